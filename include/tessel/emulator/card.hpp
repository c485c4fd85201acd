// One card of the emulated cluster: a tessel device (models the `device` concept) with its own
// memory arena (capacity enforced; host memory taken only for what is allocated), a simulated
// clock per stream, and a roofline cost model. Programs really run on a (shared) host executor;
// the clock advances by max(flops / peak, bytes / HBM bandwidth) + launch overhead.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <tessel/device/device.hpp>
#include <tessel/device/executor.hpp>
#include <tessel/device/profiler.hpp>
#include <tessel/emulator/config.hpp>
#include <tessel/emulator/errors.hpp>
#include <tessel/emulator/trace.hpp>

namespace tessel {
inline namespace v0 {
namespace emu {

// Peak FLOP rate of a card for a precision (f64 modelled at half the f32 rate).
inline double peak_of(const card_spec& spec, math_precision p) {
  switch (p) {
    case math_precision::bf16:
    case math_precision::fp16: return spec.peak_bf16;
    case math_precision::fp8:
    case math_precision::i8: return spec.peak_fp8;
    case math_precision::f64: return spec.peak_fp32 / 2;
    default: return spec.peak_fp32;
  }
}

// The roofline time a card charges for one launch: max(flops / peak, bytes / HBM) + launch overhead.
// The card's clock and the planner (dist/planner.hpp) both use it.
inline double roofline_time(const card_spec& spec, const kernel_cost& c) {
  return std::max(c.flops / peak_of(spec, c.precision), c.bytes / spec.hbm_bandwidth) + spec.launch_overhead;
}

// Accumulated work of a card, for utilization counters.
struct card_counters {
  std::uint64_t launches = 0;
  double flops = 0, bytes = 0;  // declared by programs
  double math_time = 0;         // sum of flops / peak(precision): seconds at full FLOP rate
  double hbm_time = 0;          // sum of bytes / HBM bandwidth: seconds at full HBM rate
  double busy = 0;              // seconds the compute engine was busy (incl. launch overhead)
};

class card {
 public:
  // Simulated-time event: waiting makes the card's default stream catch up with it.
  struct event {
    card* owner = nullptr;
    double t = 0;
    void wait() const {
      if (owner) owner->advance_to(t);
    }
    bool ready() const { return true; }  // launches are synchronous in host time
    double time() const { return t; }
  };

  // An in-order queue with its own simulated clock; all streams of a card share its compute
  // engine (kernels from two streams do not overlap each other, but do overlap transfers).
  class stream {
   public:
    template <tile_program P>
    void launch(const grid& g, const P& program) {
      c_->launch_on(index_, g, program, cost_of(program, g));
    }
    template <tile_program P>
    void launch(const grid& g, const P& program, const kernel_cost& cost) {
      c_->launch_on(index_, g, program, cost);
    }
    event record() { return {c_, c_->stream_clock(index_)}; }
    void wait(const event& e) { c_->advance_stream(index_, e.t); }
    double clock() const { return c_->stream_clock(index_); }
    std::size_t index() const { return index_; }

   private:
    friend class card;
    stream(card* c, std::size_t i) : c_(c), index_(i) {}
    card* c_;
    std::size_t index_;
  };

  card(std::size_t id, const card_spec& spec, executor& exec, bool timing_only, trace_recorder* trace)
      : id_(id), spec_(spec), exec_(&exec), timing_only_(timing_only), trace_(trace), clocks_(1, 0.0) {}
  card(const card&) = delete;
  card& operator=(const card&) = delete;
  ~card() { release_all(); }

  std::size_t id() const { return id_; }
  const card_spec& spec() const { return spec_; }
  bool alive() const { return alive_.load(std::memory_order_acquire); }
  // Dead now: reported dead by the fabric, or its clock inside a scheduled outage (the cards'
  // clocks run ahead of the fabric simulation).
  bool down() const {
    const double t = clock();
    std::lock_guard lk(mu_);
    bool d = !alive();
    for (auto [a, b] : down_) d = d || (t >= a && t < b);
    return d;
  }
  // Increments on every hot swap: pointers from an older incarnation are gone.
  std::uint64_t incarnation() const { return incarnation_.load(std::memory_order_acquire); }

  // ---- memory ----
  void* allocate(std::size_t bytes) {
    ensure_alive("allocate");
    std::lock_guard lk(mu_);
    if (bytes == 0) bytes = 1;
    const std::size_t avail = spec_.memory_bytes - used_;
    if (bytes > avail) throw capacity_error(id_, bytes, avail);
    void* p;
    if (timing_only_) {
      // No host memory: hand out distinct, never-dereferenced addresses in a private range.
      fake_next_ = (fake_next_ + 255) / 256 * 256;
      p = reinterpret_cast<void*>(fake_base() + fake_next_);
      fake_next_ += bytes;
    } else {
      p = host_allocate(bytes);
    }
    allocs_.emplace(reinterpret_cast<std::uintptr_t>(p), bytes);
    requested_total_ += bytes;
    used_ += bytes;
    peak_ = std::max(peak_, used_);
    allocations_++;
    return p;
  }
  void deallocate(void* p) {
    if (!p) return;
    std::lock_guard lk(mu_);
    auto it = allocs_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == allocs_.end())
      throw invalid_card_error("card " + std::to_string(id_) + ": deallocate of a pointer it does not own (freed twice, or lost in a hot swap)");
    used_ -= it->second;
    const std::size_t size = it->second;
    allocs_.erase(it);
    if (!timing_only_) host_free(p, size);
  }
  template <class T>
  T* allocate_n(std::size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw emulator_error(errc::overflow, "allocation of " + std::to_string(n) + " elements overflows");
    return static_cast<T*>(allocate(n * sizeof(T)));
  }
  // Whether [p, p + bytes) lies inside one live allocation of this card.
  bool owns(const void* p, std::size_t bytes) const {
    std::lock_guard lk(mu_);
    return owns_locked(p, bytes);
  }
  std::size_t capacity() const { return spec_.memory_bytes; }
  std::size_t used() const {
    std::lock_guard lk(mu_);
    return used_;
  }

  // Copy on the card (or between host and card): bytes move for real; the clock advances by
  // read + write at HBM bandwidth.
  void copy(const void* src, void* dst, std::size_t bytes) {
    ensure_alive("copy");
    if (bytes == 0) return;
    if (!src || !dst) throw emulator_error(errc::invalid_argument, "copy of " + std::to_string(bytes) + " bytes with a null pointer");
    if (!timing_only_) std::memmove(dst, src, bytes);
    const double t = 2.0 * static_cast<double>(bytes) / spec_.hbm_bandwidth;
    std::lock_guard lk(mu_);
    double start = std::max(clocks_[0], compute_free_);
    clocks_[0] = compute_free_ = start + t;
    counters_.bytes += 2.0 * static_cast<double>(bytes);
    counters_.hbm_time += t;
    counters_.busy += t;
  }

  memory_stats memory() const {
    std::lock_guard lk(mu_);
    memory_stats s;
    s.reserved = reserved_;
    s.peak_reserved = peak_reserved_;
    s.pool_hits = pool_hits_;
    s.requested_total = requested_total_;
    s.in_use = used_;
    s.peak_in_use = peak_;
    s.allocations = allocations_;
    return s;
  }

  // ---- execution ----
  template <tile_program P>
  void launch(const grid& g, const P& program) {
    launch_on(0, g, program, cost_of(program, g));
  }
  // Launch with an explicit cost (for programs that do not declare one).
  template <tile_program P>
  void launch(const grid& g, const P& program, const kernel_cost& cost) {
    launch_on(0, g, program, cost);
  }
  void synchronize() {}
  event record() { return {this, clock()}; }

  stream make_stream() {
    std::lock_guard lk(mu_);
    clocks_.push_back(clocks_[0]);
    return stream(this, clocks_.size() - 1);
  }
  stream default_stream() { return stream(this, 0); }

  // Simulated time of the default stream, in seconds.
  double clock() const {
    std::lock_guard lk(mu_);
    return clocks_[0];
  }
  void advance_to(double t) { advance_stream(0, t); }
  // Charges `seconds` of compute without running anything (e.g. a modelled kernel).
  void charge(const kernel_cost& cost, const std::string& name = "kernel") { launch_on(0, grid{0}, ::tessel::detail::empty_program{}, cost, name); }

  // Roofline time of one launch.
  double kernel_time(const kernel_cost& c) const { return roofline_time(spec_, c); }
  double peak_of(math_precision p) const { return emu::peak_of(spec_, p); }

  card_counters counters() const {
    std::lock_guard lk(mu_);
    return counters_;
  }

  device_caps capabilities() const {
    device_caps c;
    c.name = "ubl128 card " + std::to_string(id_);
    c.workers = exec_->size();
    c.memory_capacity = spec_.memory_bytes;
    c.scratch_per_worker = exec_->scratch_bytes();
    c.peak_flops_f32 = spec_.peak_fp32;
    c.memory_bandwidth = spec_.hbm_bandwidth;
    return c;
  }

  // ---- used by the cluster ----
  void set_alive(bool a) { alive_.store(a, std::memory_order_release); }
  // A scheduled outage [from, to): work whose start falls inside it fails, whatever the fabric
  // simulation has reached (cards' clocks run ahead of the fabric).
  void add_outage(double from, double to) {
    std::lock_guard lk(mu_);
    down_.emplace_back(from, to);
  }
  // Hot swap: the replacement card has empty memory and the old pointers are gone.
  void wipe(double t) {
    std::lock_guard lk(mu_);
    release_all_locked();
    used_ = 0;
    incarnation_.fetch_add(1, std::memory_order_acq_rel);
    for (double& c : clocks_) c = std::max(c, t);
    compute_free_ = std::max(compute_free_, t);
  }

 private:
  template <class P>
  static kernel_cost cost_of(const P& program, const grid& g) {
    if constexpr (costed_program<P>)
      return static_cast<kernel_cost>(program.cost(g));
    else
      return kernel_cost{};
  }

  // Host memory behind card allocations. Large blocks are mapped with MAP_POPULATE: the kernel
  // faults them in bulk (~20 GB/s here, against ~1 GB/s for first-touch 4 KiB faults). Freed
  // blocks are cached by exact size and handed out again (a hot swap drops the cache too).
  static constexpr std::size_t map_threshold = std::size_t{64} << 10;
  static std::size_t host_size(std::size_t bytes) { return bytes >= map_threshold ? (bytes + 4095) / 4096 * 4096 : (bytes + 63) / 64 * 64; }
  void* host_allocate(std::size_t bytes) {
    const std::size_t sz = host_size(bytes);
    if (auto it = cache_.find(sz); it != cache_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      pool_hits_++;
      return p;
    }
    void* p = nullptr;
#if defined(__linux__)
    if (sz >= map_threshold) {
      p = ::mmap(nullptr, sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
    } else
#endif
    {
      p = std::aligned_alloc(64, sz);
      if (!p) throw std::bad_alloc();
    }
    reserved_ += sz;
    peak_reserved_ = std::max(peak_reserved_, reserved_);
    return p;
  }
  void host_free(void* p, std::size_t bytes) { cache_[host_size(bytes)].push_back(p); }
  void host_release(void* p, std::size_t sz) {
#if defined(__linux__)
    if (sz >= map_threshold) {
      ::munmap(p, sz);
      reserved_ -= sz;
      return;
    }
#endif
    std::free(p);
    reserved_ -= sz;
  }
  void release_all_locked() {
    if (!timing_only_) {
      for (auto& [a, size] : allocs_) host_release(reinterpret_cast<void*>(a), host_size(size));
      for (auto& [sz, ps] : cache_)
        for (void* p : ps) host_release(p, sz);
    }
    allocs_.clear();
    cache_.clear();
  }
  void release_all() {
    std::lock_guard lk(mu_);
    release_all_locked();
  }

  std::uintptr_t fake_base() const { return (static_cast<std::uintptr_t>(id_) + 1) << 40; }

  bool owns_locked(const void* p, std::size_t bytes) const {
    auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = allocs_.upper_bound(a);
    if (it == allocs_.begin()) return false;
    --it;
    return a >= it->first && bytes <= it->second && a - it->first <= it->second - bytes;
  }

  void ensure_alive(const char* what) const {
    if (down()) throw card_failed_error(id_, clock(), std::string(what) + " on a failed card");
  }

  double stream_clock(std::size_t s) const {
    std::lock_guard lk(mu_);
    return clocks_.at(s);
  }
  void advance_stream(std::size_t s, double t) {
    std::lock_guard lk(mu_);
    clocks_.at(s) = std::max(clocks_.at(s), t);
  }

  template <class P>
  void launch_on(std::size_t s, const grid& g, const P& program, const kernel_cost& cost, const std::string& name = "kernel") {
    ensure_alive("launch");
    if (!timing_only_ && !g.empty()) {
      if (profiler::detail::level.load(std::memory_order_relaxed) != 0) [[unlikely]]
        profiler::detail::profiled_launch(
            g, program, "card", id_, exec_->size(), [&] { exec_->run(g, program); }, &cost);
      else
        exec_->run(g, program);
    }
    const double t = kernel_time(cost);
    double start, end;
    {
      std::lock_guard lk(mu_);
      start = std::max(clocks_.at(s), compute_free_);
      end = start + t;
      clocks_[s] = compute_free_ = end;
      counters_.launches++;
      counters_.flops += cost.flops;
      counters_.bytes += cost.bytes;
      counters_.math_time += cost.flops / peak_of(cost.precision);
      counters_.hbm_time += cost.bytes / spec_.hbm_bandwidth;
      counters_.busy += t;
    }
    if (trace_) trace_->record({id_, track::compute, name, start, t, static_cast<std::uint64_t>(cost.bytes), cost.flops});
  }

  std::size_t id_;
  card_spec spec_;
  executor* exec_;
  bool timing_only_;
  trace_recorder* trace_;
  mutable std::mutex mu_;
  std::map<std::uintptr_t, std::size_t> allocs_;
  std::map<std::size_t, std::vector<void*>> cache_;
  std::size_t used_ = 0, peak_ = 0, allocations_ = 0;
  std::size_t reserved_ = 0, peak_reserved_ = 0, pool_hits_ = 0, requested_total_ = 0;
  std::uintptr_t fake_next_ = 0;
  std::vector<double> clocks_;
  std::vector<std::pair<double, double>> down_;
  double compute_free_ = 0;
  card_counters counters_;
  std::atomic<bool> alive_{true};
  std::atomic<std::uint64_t> incarnation_{0};
};

static_assert(device<card>);

}  // namespace emu
}  // namespace v0
}  // namespace tessel
