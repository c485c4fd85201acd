// A persistent pool of threads that runs the blocks of tile programs. An executor of `threads`
// participants keeps threads - 1 pool workers; the thread that calls run() is the last
// participant: it claims blocks of its own launch beside the workers instead of waiting for them
// (so a 2-core machine runs 2 threads, not 2 workers and a spinning caller, and a launch starts
// without waiting for a sleeping worker to wake). Several devices and threads can share one
// executor (the emulator runs 128 cards on one host pool). Each pool worker owns a scratch arena
// that lives as long as the executor; a calling thread uses one arena of its own (thread-local),
// so packed panels need no allocation per launch. Idle workers spin briefly (so back-to-back
// launches cost microseconds) and then block.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
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
  // `threads` participants (>= 1): threads - 1 pool workers and the calling thread; `spin` is how
  // long an idle worker polls before sleeping.
  explicit executor(unsigned threads, std::chrono::microseconds spin = std::chrono::microseconds(200),
                    std::size_t scratch_bytes = std::size_t{4} << 20)
      : spin_(spin), scratch_initial_(scratch_bytes), participants_(threads) {
    if (threads == 0) throw device_error(errc::invalid_argument, "executor needs at least one thread");
    if (threads > 4096)
      throw device_error(errc::invalid_argument, "executor thread count " + std::to_string(threads) + " is unreasonable (max 4096)");
    const unsigned pool = threads - 1;
    arenas_.reserve(pool);
    for (unsigned i = 0; i < pool; ++i) arenas_.push_back(std::make_unique<scratch_arena>(scratch_bytes));
    threads_.reserve(pool);
    try {
      for (unsigned i = 0; i < pool; ++i) threads_.emplace_back([this, i] { worker_loop(i); });
    } catch (...) {
      shutdown();
      throw;
    }
  }
  executor(const executor&) = delete;
  executor& operator=(const executor&) = delete;
  ~executor() { shutdown(); }

  // Participants of a launch: the pool workers and the calling thread. Blocks see worker ids
  // 0 .. size() - 1; the calling thread is size() - 1 (ids are distinct among the blocks of one
  // launch running at once; concurrent launches from different threads share the last id).
  unsigned size() const { return participants_; }
  // Bytes of scratch a block can use without growing its worker's arena: the initial size until
  // the arena first allocates (arenas allocate lazily), then what it holds.
  std::size_t scratch_bytes() const {
    const std::size_t held = arenas_.empty() ? 0 : arenas_[0]->capacity();
    return held > scratch_initial_ ? held : scratch_initial_;
  }

  // Runs `program(ctx)` for every block of `g` and returns when all finished; the calling thread
  // runs blocks too. The first exception a block throws is rethrown here (remaining blocks are
  // skipped). Safe to call from several threads at once; a call from inside a block of this
  // executor (on a worker or on a calling thread) runs the blocks inline on that thread, above the
  // enclosing block's scratch. A single block, or an executor without pool workers, runs on the
  // calling thread alone (run_here): handing it to a worker would only add the worker's wake-up.
  template <class P>
  void run(const grid& g, const P& program) {
    const std::size_t n = g.size();
    if (n == 0) return;
    thread_state& t = here();
    if (t.exec == this) {  // nested launch: run inline, never wait on ourselves
      scratch_arena& a = *t.arena;
      const auto saved = a.mark();
      for (std::size_t b = 0; b < n; ++b) {
        block_ctx ctx(g, b, t.worker, size(), a);
        program(ctx);
        a.rewind(saved);
      }
      return;
    }
    if (n == 1 || threads_.empty()) return run_here(g, program);
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
    {
      caller_scope scope(*this);
      claim_blocks(j, scope.worker(), [&]() -> scratch_arena& { return scope.fresh(); });
    }
    // wait for the workers' blocks: spin briefly, then block. `j` lives on this stack, so we
    // return only when no worker can still touch it: all blocks done, `j` unlisted (under mu_,
    // where workers join it), and every worker that joined it has left.
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

  // Runs every block of `g` on the calling thread, in order, as participant size() - 1 with the
  // thread's own scratch arena (rewound per block; above the enclosing block's scratch when called
  // from inside a block). The same blocks run the same arithmetic as in run(), so the bits do not
  // change. An exception leaves at once (later blocks do not run).
  template <class P>
  void run_here(const grid& g, const P& program) {
    const std::size_t n = g.size();
    if (n == 0) return;
    caller_scope scope(*this);
    for (std::size_t b = 0; b < n; ++b) {
      block_ctx ctx(g, b, scope.worker(), size(), scope.fresh());
      program(ctx);
    }
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

  // Which executor's block this thread is running (if any), as which participant, on which arena.
  struct thread_state {
    const executor* exec = nullptr;
    unsigned worker = 0;
    scratch_arena* arena = nullptr;
  };
  static thread_state& here() {
    static thread_local thread_state s;
    return s;
  }
  // The arena a thread uses when it runs blocks of its own launches, and how deeply such launches
  // nest on the thread (a launch into another executor from inside a block takes its scratch above
  // the enclosing block's; only an outermost launch resets the arena).
  struct caller_arena {
    scratch_arena arena;
    unsigned depth = 0;
  };
  static caller_arena& own_arena() {
    static thread_local caller_arena s;
    return s;
  }
  // The calling thread's participation in one launch: marks the thread as this executor's last
  // participant (so nested launches run inline) and hands out its arena, fresh for each block.
  class caller_scope {
   public:
    explicit caller_scope(const executor& ex) : own_(own_arena()), saved_(here()), outer_(own_.depth == 0), mark_(own_.arena.mark()) {
      ++own_.depth;
      here() = thread_state{&ex, ex.size() - 1, &own_.arena};
    }
    caller_scope(const caller_scope&) = delete;
    caller_scope& operator=(const caller_scope&) = delete;
    ~caller_scope() {  // (an outermost launch's scratch is reset by the next one; reset may allocate)
      here() = saved_;
      --own_.depth;
      if (!outer_) own_.arena.rewind(mark_);
    }
    unsigned worker() const { return here().worker; }
    scratch_arena& fresh() {
      if (outer_)
        own_.arena.reset();
      else
        own_.arena.rewind(mark_);
      return own_.arena;
    }

   private:
    caller_arena& own_;
    thread_state saved_;
    bool outer_;
    scratch_arena::mark_t mark_;
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

  // Takes the front job with blocks left, or nullptr.
  job* front_job() {
    std::lock_guard lk(mu_);
    while (!jobs_.empty()) {
      job* j = jobs_.front();
      if (j->next.load(std::memory_order_relaxed) < j->nblocks) {
        j->active.fetch_add(1, std::memory_order_acq_rel);
        return j;
      }
      jobs_.pop_front();  // fully claimed; its owner waits on `done`
    }
    return nullptr;
  }

  // Claims and runs blocks of `j` until none is left; `arena()` gives the scratch for each block.
  // A failed block records the first exception and the remaining blocks are skipped.
  template <class Arena>
  void claim_blocks(job& j, unsigned w, Arena arena) {
    for (;;) {
      const std::size_t b = j.next.fetch_add(1, std::memory_order_relaxed);
      if (b >= j.nblocks) break;
      if (!j.failed.load(std::memory_order_relaxed)) {
        try {
          block_ctx ctx(j.dims, b, w, size(), arena());
          j.invoke(j.program, ctx);
        } catch (...) {
          std::lock_guard lk(j.err_mu);
          if (!j.error) j.error = std::current_exception();
          j.failed.store(true, std::memory_order_relaxed);
        }
      }
      if (j.done.fetch_add(1, std::memory_order_acq_rel) + 1 == j.nblocks) {
        completions_.fetch_add(1, std::memory_order_seq_cst);
        completions_.notify_all();
      }
    }
  }

  void work_on(job* j, unsigned w) {
    scratch_arena& a = *arenas_[w];
    claim_blocks(*j, w, [&]() -> scratch_arena& {
      a.reset();
      return a;
    });
    j->active.fetch_sub(1, std::memory_order_acq_rel);  // last touch of `j`: its owner may free it now
    completions_.fetch_add(1, std::memory_order_seq_cst);
    completions_.notify_all();
  }

  void worker_loop(unsigned w) {
    here() = thread_state{this, w, arenas_[w].get()};
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
  unsigned participants_;
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
