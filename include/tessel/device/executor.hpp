// A persistent pool of worker threads that runs the blocks of tile programs. Several devices can
// share one executor (the emulator runs 128 cards on one host pool); each worker owns a scratch
// arena that lives as long as the executor, so packed panels need no allocation per launch.
// Idle workers spin briefly (so back-to-back launches cost microseconds) and then block.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <tessel/device/errors.hpp>
#include <tessel/tile/block_ctx.hpp>

namespace tessel {
inline namespace v0 {

class executor {
 public:
  // `threads` workers (>= 1); `spin` is how long an idle worker polls before sleeping.
  explicit executor(unsigned threads, std::chrono::microseconds spin = std::chrono::microseconds(200),
                    std::size_t scratch_bytes = std::size_t{4} << 20)
      : spin_(spin), scratch_initial_(scratch_bytes) {
    if (threads == 0) throw device_error(errc::invalid_argument, "executor needs at least one thread");
    if (threads > 4096)
      throw device_error(errc::invalid_argument, "executor thread count " + std::to_string(threads) + " is unreasonable (max 4096)");
    arenas_.reserve(threads);
    for (unsigned i = 0; i < threads; ++i) arenas_.push_back(std::make_unique<scratch_arena>(scratch_bytes));
    threads_.reserve(threads);
    try {
      for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this, i] { worker_loop(i); });
    } catch (...) {
      shutdown();
      throw;
    }
  }
  executor(const executor&) = delete;
  executor& operator=(const executor&) = delete;
  ~executor() { shutdown(); }

  unsigned size() const { return static_cast<unsigned>(arenas_.size()); }
  // Bytes of scratch a block can use without growing its worker's arena: the initial size until
  // the arena first allocates (arenas allocate lazily), then what it holds.
  std::size_t scratch_bytes() const {
    const std::size_t held = arenas_.empty() ? 0 : arenas_[0]->capacity();
    return held > scratch_initial_ ? held : scratch_initial_;
  }

  // Runs `program(ctx)` for every block of `g` and returns when all finished. The first
  // exception a block throws is rethrown here (remaining blocks are skipped). Safe to call from
  // several threads at once; a call from inside a worker runs the blocks inline on that worker.
  template <class P>
  void run(const grid& g, const P& program) {
    const std::size_t n = g.size();
    if (n == 0) return;
    if (current_executor() == this) {  // nested launch: run inline, never wait on ourselves
      const unsigned w = current_worker();
      scratch_arena& a = *arenas_[w];
      auto saved = a.mark();
      for (std::size_t b = 0; b < n; ++b) {
        block_ctx ctx(g, b, w, size(), a);
        program(ctx);
        a.rewind(saved);
      }
      return;
    }
    job j;
    j.dims = g;
    j.nblocks = n;
    j.program = &program;
    j.invoke = [](const void* p, block_ctx& ctx) { (*static_cast<const P*>(p))(ctx); };
    {
      std::lock_guard lk(mu_);
      jobs_.push_back(&j);
    }
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) epoch_.notify_all();
    // wait: spin briefly, then block. `j` lives on this stack, so we return only when no worker
    // can still touch it: all blocks done, `j` unlisted (under mu_, where workers join it), and
    // every worker that joined it has left.
    wait_until([&] { return j.done.load(std::memory_order_acquire) == n; });
    {
      std::lock_guard lk(mu_);
      for (auto it = jobs_.begin(); it != jobs_.end(); ++it)
        if (*it == &j) {
          jobs_.erase(it);
          break;
        }
    }
    wait_until([&] { return j.active.load(std::memory_order_acquire) == 0; });
    if (j.error) std::rethrow_exception(j.error);
  }

 private:
  struct job {
    grid dims;
    std::size_t nblocks = 0;
    const void* program = nullptr;
    void (*invoke)(const void*, block_ctx&) = nullptr;
    std::atomic<std::size_t> next{0};
    std::atomic<std::size_t> done{0};
    std::atomic<unsigned> active{0};  // workers that may still touch this job
    std::atomic<bool> failed{false};
    std::mutex err_mu;
    std::exception_ptr error;
  };

  template <class Cond>
  void wait_until(Cond cond) {
    const auto t0 = std::chrono::steady_clock::now();
    unsigned iter = 0;
    while (!cond()) {
      if ((++iter & 63) == 0 && std::chrono::steady_clock::now() - t0 > spin_) {
        for (;;) {
          std::uint64_t c = completions_.load(std::memory_order_seq_cst);
          if (cond()) return;
          completions_.wait(c, std::memory_order_seq_cst);
        }
      }
      cpu_relax();
      if ((iter & 1023) == 0) std::this_thread::yield();
    }
  }

  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  static const executor*& current_executor() {
    static thread_local const executor* e = nullptr;
    return e;
  }
  static unsigned& current_worker() {
    static thread_local unsigned w = 0;
    return w;
  }

  // Takes the front job with blocks left, or nullptr.
  job* front_job() {
    std::lock_guard lk(mu_);
    while (!jobs_.empty()) {
      job* j = jobs_.front();
      if (j->next.load(std::memory_order_relaxed) < j->nblocks) {
        j->active.fetch_add(1, std::memory_order_acq_rel);
        return j;
      }
      jobs_.pop_front();  // fully claimed; its owner waits on `finished`
    }
    return nullptr;
  }

  void work_on(job* j, unsigned w) {
    scratch_arena& a = *arenas_[w];
    for (;;) {
      std::size_t b = j->next.fetch_add(1, std::memory_order_relaxed);
      if (b >= j->nblocks) break;
      if (!j->failed.load(std::memory_order_relaxed)) {
        try {
          a.reset();
          block_ctx ctx(j->dims, b, w, size(), a);
          j->invoke(j->program, ctx);
        } catch (...) {
          std::lock_guard lk(j->err_mu);
          if (!j->error) j->error = std::current_exception();
          j->failed.store(true, std::memory_order_relaxed);
        }
      }
      if (j->done.fetch_add(1, std::memory_order_acq_rel) + 1 == j->nblocks) {
        completions_.fetch_add(1, std::memory_order_seq_cst);
        completions_.notify_all();
      }
    }
    j->active.fetch_sub(1, std::memory_order_acq_rel);  // last touch of `j`: its owner may free it now
    completions_.fetch_add(1, std::memory_order_seq_cst);
    completions_.notify_all();
  }

  void worker_loop(unsigned w) {
    current_executor() = this;
    current_worker() = w;
    for (;;) {
      std::uint64_t seen = epoch_.load(std::memory_order_seq_cst);
      if (stop_.load(std::memory_order_acquire)) return;
      if (job* j = front_job()) {
        work_on(j, w);
        continue;
      }
      // spin for new work
      const auto t0 = std::chrono::steady_clock::now();
      bool got = false;
      unsigned spins = 0;
      while (std::chrono::steady_clock::now() - t0 < spin_) {
        for (int k = 0; k < 32; ++k) cpu_relax();
        if ((++spins & 15) == 0) std::this_thread::yield();  // let others run if the machine is oversubscribed
        if (epoch_.load(std::memory_order_seq_cst) != seen || stop_.load(std::memory_order_relaxed)) {
          got = true;
          break;
        }
      }
      if (got) continue;
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (epoch_.load(std::memory_order_seq_cst) == seen && !stop_.load(std::memory_order_seq_cst)) epoch_.wait(seen, std::memory_order_seq_cst);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  void shutdown() {
    stop_.store(true, std::memory_order_seq_cst);
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    epoch_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
    threads_.clear();
  }

  std::chrono::microseconds spin_;
  std::size_t scratch_initial_;
  std::vector<std::unique_ptr<scratch_arena>> arenas_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::deque<job*> jobs_;
  std::atomic<std::uint64_t> epoch_{0};
  std::atomic<std::uint64_t> completions_{0};
  std::atomic<unsigned> sleepers_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace v0
}  // namespace tessel
