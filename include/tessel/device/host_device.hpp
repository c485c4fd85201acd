// The host CPU as a device: tile programs run on an executor (a persistent worker pool, owned or
// shared), memory comes from a caching pool of 64-byte / 2 MiB-huge-page aligned blocks.
// Launches are synchronous (the queue is in order and drained by launch itself), so events are
// always complete; exceptions thrown by a program are rethrown by launch.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <tessel/device/errors.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/executor.hpp>
#include <tessel/device/profiler.hpp>

namespace tessel {
inline namespace v0 {

// A caching allocator: freed blocks are kept by size class and handed out again, so repeated
// allocate/free of activations or workspaces never re-faults pages. Thread-safe.
class caching_pool {
 public:
  explicit caching_pool(bool caching = true) : caching_(caching) {}
  caching_pool(const caching_pool&) = delete;
  caching_pool& operator=(const caching_pool&) = delete;
  ~caching_pool() {
    for (auto& [p, size] : live_) detail::os_free(p);
    for (auto& [size, ps] : cache_)
      for (void* p : ps) detail::os_free(p);
  }

  void* allocate(std::size_t bytes) {
    const std::size_t cls = size_class(bytes);
    std::lock_guard lk(mu_);
    stats_.allocations++;
    stats_.requested_total += bytes;
    void* p = nullptr;
    if (auto it = cache_.find(cls); it != cache_.end() && !it->second.empty()) {
      p = it->second.back();
      it->second.pop_back();
      stats_.pool_hits++;
    } else {
      std::size_t got = 0;
      p = detail::os_allocate(cls, 64, got);
      stats_.reserved += cls;
      stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
    }
    live_.emplace(p, cls);
    stats_.in_use += cls;
    stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.in_use);
    return p;
  }

  void deallocate(void* p) {
    if (!p) return;
    std::lock_guard lk(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) throw device_error(errc::invalid_argument, "deallocate of a pointer this device did not allocate (or freed twice)");
    const std::size_t cls = it->second;
    live_.erase(it);
    stats_.in_use -= cls;
    if (caching_) {
      cache_[cls].push_back(p);
    } else {
      detail::os_free(p);
      stats_.reserved -= cls;
    }
  }

  // Size of the live block at `p` (0 if unknown).
  std::size_t block_size(const void* p) const {
    std::lock_guard lk(mu_);
    auto it = live_.find(const_cast<void*>(p));
    return it == live_.end() ? 0 : it->second;
  }

  // Returns cached blocks to the OS.
  void trim() {
    std::lock_guard lk(mu_);
    for (auto& [size, ps] : cache_) {
      for (void* p : ps) detail::os_free(p);
      stats_.reserved -= size * ps.size();
    }
    cache_.clear();
  }

  memory_stats stats() const {
    std::lock_guard lk(mu_);
    return stats_;
  }

  // Size classes: 2 MiB multiples for large blocks, else powers of two with 4 steps per octave
  // (at most 25% slack), minimum 64 bytes.
  static std::size_t size_class(std::size_t bytes) {
    if (bytes >= detail::huge_page_threshold) return detail::round_up_checked(bytes, detail::huge_page_size);
    if (bytes <= 64) return 64;
    std::size_t p2 = std::size_t{1} << (63 - __builtin_clzll(bytes - 1));  // largest power of two < bytes
    std::size_t step = p2 / 4;
    return detail::round_up_checked(bytes, step < 64 ? 64 : step);
  }

 private:
  bool caching_;
  mutable std::mutex mu_;
  std::unordered_map<void*, std::size_t> live_;
  std::map<std::size_t, std::vector<void*>> cache_;
  memory_stats stats_;
};

class host_device {
 public:
  // Always-complete event (launches are synchronous on the host).
  struct event {
    void wait() const noexcept {}
    bool ready() const noexcept { return true; }
  };

  // A device with its own pool of `threads` workers (default: hardware concurrency).
  explicit host_device(unsigned threads = default_threads(), bool caching = true)
      : owned_(std::make_shared<executor>(threads)), exec_(owned_.get()), pool_(caching) {}
  // A device running on a shared executor (which must outlive it).
  explicit host_device(executor& shared, bool caching = true) : exec_(&shared), pool_(caching) {}

  host_device(const host_device&) = delete;
  host_device& operator=(const host_device&) = delete;

  static unsigned default_threads() {
    unsigned n = std::thread::hardware_concurrency();
    return n == 0 ? 1 : n;
  }

  // ---- memory ----
  void* allocate(std::size_t bytes) { return pool_.allocate(bytes); }
  void deallocate(void* p) { pool_.deallocate(p); }
  template <class T>
  T* allocate_n(std::size_t n) {
    if (n > SIZE_MAX / sizeof(T))
      throw device_error(errc::overflow, "allocation of " + std::to_string(n) + " elements of " + std::to_string(sizeof(T)) + " bytes overflows");
    return static_cast<T*>(allocate(n * sizeof(T)));
  }
  // Copies `bytes` from `src` to `dst` (source first). Null with nonzero size is an error.
  void copy(const void* src, void* dst, std::size_t bytes) {
    if (bytes == 0) return;
    if (!src || !dst) throw device_error(errc::invalid_argument, "copy of " + std::to_string(bytes) + " bytes with a null pointer");
    std::memmove(dst, src, bytes);
  }
  void trim() { pool_.trim(); }
  memory_stats memory() const { return pool_.stats(); }

  // ---- execution ----
  // The executor runs a launch on its pool workers and the calling thread together; a launch that
  // one thread would run anyway (a 1-thread device, a single block) runs on the calling thread
  // alone, as launch_here does: handing it to a worker costs a wake-up once the worker has slept
  // (its spin ends 200 us after its last block; the futex wake measured ~50 us here), which a
  // model's decode step paid for every small kernel between its one-row GEMMs: a 2816-element
  // SwiGLU took 52 us after a long GEMM, 3.6 us back to back. With the profiler off this is
  // exec_->run plus one relaxed load and a branch.
  template <tile_program P>
  void launch(const grid& g, const P& program) {
    if (profiler::detail::level.load(std::memory_order_relaxed) != 0) [[unlikely]] {
      const unsigned workers = g.size() <= 1 ? 1 : exec_->size();
      return profiler::detail::profiled_launch(g, program, "host", id_, workers, [&] { exec_->run(g, program); });
    }
    exec_->run(g, program);
  }
  // Runs every block of the launch on the calling thread, in order, with a scratch arena of the
  // thread's own (nested launches take their scratch above the enclosing block's): executor::
  // run_here. The same blocks run the same arithmetic as on the workers, so the bits do not
  // change; the profiler records it as a launch on this device with one worker.
  template <tile_program P>
  void launch_here(const grid& g, const P& program) {
    if (profiler::detail::level.load(std::memory_order_relaxed) != 0) [[unlikely]]
      return profiler::detail::profiled_launch(g, program, "host", id_, 1, [&] { exec_->run_here(g, program); });
    exec_->run_here(g, program);
  }
  void synchronize() {}
  event record() { return {}; }

  device_caps capabilities() const {
    device_caps c;
    c.name = "host";
    c.workers = exec_->size();
    c.scratch_per_worker = exec_->scratch_bytes();
#if defined(__AVX2__)
    c.avx2 = true;
#endif
#if defined(__AVX512F__)
    c.avx512 = true;
#endif
#if defined(__AVX512BF16__)
    c.avx512_bf16 = true;
#endif
    return c;
  }
  executor& exec() { return *exec_; }
  // This device's number in profiles ("host_device <index>"), in construction order.
  std::size_t index() const { return id_; }

 private:
  std::shared_ptr<executor> owned_;
  executor* exec_;
  caching_pool pool_;
  std::size_t id_ = profiler::detail::next_host_device.fetch_add(1, std::memory_order_relaxed);
};

static_assert(device<host_device>);

}  // namespace v0
}  // namespace tessel
