// Scratch memory of the collective algorithms: a process-wide cache of blocks on the OS pool of
// tile/detail/os_memory.hpp (2 MiB-aligned huge pages for large blocks), quarantined when a failed
// collective unwinds, and address-space-only stand-ins for timing-only (dry) runs.
#pragma once

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <cstddef>
#include <exception>
#include <mutex>
#include <new>
#include <tuple>
#include <utility>
#include <vector>

#include <tessel/collectives/reduce_op.hpp>
#include <tessel/tile/detail/os_memory.hpp>

namespace tessel::detail {

// Process-wide cache of scratch blocks. First-touching fresh 4 KiB pages costs far more than the
// copies themselves (DESIGN.md, Memory), so blocks are reused across collectives. Blocks come from
// the OS pool every device uses (os_allocate: 2 MiB-aligned huge pages from 1 MiB up).
class scratch_pool {
 public:
  static scratch_pool& instance() {
    static scratch_pool p;
    return p;
  }
  std::pair<std::byte*, std::size_t> get(std::size_t bytes) {
    std::size_t cls = 4096;
    while (cls < bytes) cls *= 2;
    if (cls >= huge_page_threshold) cls = std::max(cls, huge_page_size);  // what os_allocate gives
    {
      std::lock_guard lk(mu_);
      auto& v = free_[bit(cls)];
      if (!v.empty()) {
        std::byte* p = v.back();
        v.pop_back();
        cached_ -= cls;
        return {p, cls};
      }
    }
    std::size_t got = 0;  // the OS pool rounds blocks of 1 MiB and more to 2 MiB huge pages
    auto* p = static_cast<std::byte*>(os_allocate(cls, 64, got));
    return {p, cls};
  }
  void put(std::byte* p, std::size_t cls) {
    {
      std::lock_guard lk(mu_);
      if (cached_ + cls <= limit) {
        free_[bit(cls)].push_back(p);
        cached_ += cls;
        return;
      }
    }
    os_free(p);
  }
  // Kept until the process ends (still reachable, so leak checkers stay quiet); failures are rare.
  void quarantine(std::byte* p, std::size_t cls) {
    std::lock_guard lk(mu_);
    quarantined_.emplace_back(p, cls);
  }
  ~scratch_pool() {
    for (auto& q : quarantined_) os_free(q.first);
    for (auto& v : free_)
      for (auto* p : v) os_free(p);
  }
  static constexpr std::size_t limit = std::size_t{2} << 30;  // cached bytes kept for reuse

 private:
  static std::size_t bit(std::size_t cls) {
    std::size_t b = 0;
    while ((std::size_t{1} << b) < cls) ++b;
    return b;
  }
  std::mutex mu_;
  std::vector<std::byte*> free_[64];
  std::vector<std::pair<std::byte*, std::size_t>> quarantined_;
  std::size_t cached_ = 0;
};

// Timing-only runs move no bytes: their buffers may be null and their scratch holds no memory, yet
// the algorithms still compute addresses inside them. A dry_region stands in for such a buffer: an
// inaccessible (PROT_NONE), unreserved mapping of the same size, so that address arithmetic stays
// inside a mapping instead of offsetting a null pointer. It costs address space only.
class dry_region {
 public:
  dry_region() = default;
  explicit dry_region(std::size_t bytes) {
    if (!bytes) return;
    void* q = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (q == MAP_FAILED) throw std::bad_alloc();
    p_ = static_cast<std::byte*>(q);
    n_ = bytes;
  }
  dry_region(dry_region&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  dry_region& operator=(dry_region&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~dry_region() {
    if (p_) ::munmap(p_, n_);
  }
  std::byte* data() const { return p_; }

 private:
  std::byte* p_ = nullptr;
  std::size_t n_ = 0;
};

// Scratch bytes from the pool (at least 64-byte aligned, so any element type can live in them); in
// a timing-only run, a dry_region of that size.
class scratch {
 public:
  scratch() = default;
  explicit scratch(std::size_t bytes) : n_(bytes) {
    if (bytes && !coll_dry_run)
      std::tie(p_, cls_) = scratch_pool::instance().get(bytes);
    else if (bytes)
      dry_ = dry_region(bytes);
  }
  scratch(scratch&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)), cls_(std::exchange(o.cls_, 0)), dry_(std::move(o.dry_)) {}
  scratch& operator=(scratch&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(cls_, o.cls_);
    std::swap(dry_, o.dry_);
    return *this;
  }
  // A collective that fails (a dead peer, an abort) unwinds with sends still posted from its
  // scratch, and a peer may be copying out of them at that moment: the transports withdraw those
  // sends only when the collective's context is destroyed, after this scratch. So scratch released
  // during unwinding is quarantined, never handed to another collective while a reader may be in it.
  ~scratch() {
    if (!p_) return;
    if (std::uncaught_exceptions() > 0)
      scratch_pool::instance().quarantine(p_, cls_);
    else
      scratch_pool::instance().put(p_, cls_);
  }
  std::byte* data() const { return p_ ? p_ : dry_.data(); }
  std::size_t size() const { return n_; }

 private:
  std::byte* p_ = nullptr;
  std::size_t n_ = 0, cls_ = 0;
  dry_region dry_;
};

}  // namespace tessel::detail
