// The device concept: memory (allocate/free/copy/capacity), an in-order queue with events,
// `launch(grid, program)` of tile programs, and a capability query. host_device (thread pool)
// and the emulator's cards both model it, so the same program runs on either.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>

#include <tessel/tile/block_ctx.hpp>

namespace tessel {
namespace detail {
struct empty_program {
  void operator()(block_ctx&) const noexcept {}
};
}  // namespace detail

inline namespace v0 {

// Precision of a kernel's math, used by cost models to pick the matching peak rate.
enum class math_precision : std::uint8_t { none, f64, f32, bf16, fp16, fp8, i8 };

// What a launch costs, as a program declares it. A cost model charges
// max(flops / peak(precision), bytes / memory bandwidth) + launch overhead.
struct kernel_cost {
  double flops = 0;  // floating-point operations (an FMA counts 2)
  double bytes = 0;  // bytes moved to/from device memory
  math_precision precision = math_precision::f32;
};

// A program that can state its own cost for a grid (optional; devices without a clock ignore it).
template <class P>
concept costed_program = tile_program<P> && requires(const P& p, const grid& g) {
  { p.cost(g) } -> std::convertible_to<kernel_cost>;
};

// What a device can do.
struct device_caps {
  std::string name;
  unsigned workers = 1;                // blocks that run concurrently
  std::size_t memory_capacity = 0;     // bytes (0 = unknown / host memory)
  std::size_t scratch_per_worker = 0;  // bytes of scratch a block may use without growth
  bool avx2 = false, avx512 = false, avx512_bf16 = false;
  double peak_flops_f32 = 0;    // 0 = unknown
  double memory_bandwidth = 0;  // bytes/s, 0 = unknown
};

// Memory usage counters of a device allocator.
struct memory_stats {
  std::size_t in_use = 0;  // bytes handed to users now
  std::size_t peak_in_use = 0;
  std::size_t reserved = 0;  // bytes held from the OS/arena (in use + cached)
  std::size_t peak_reserved = 0;
  std::size_t requested_total = 0;  // sum of all allocation sizes: what fresh allocation would touch
  std::size_t allocations = 0;
  std::size_t pool_hits = 0;  // allocations served from the cache
};

// The device concept. Memory operations take and return raw bytes; copies are source first.
// `launch` enqueues `program` on the device's in-order queue; errors thrown by a program are
// rethrown by `launch` or by the next `synchronize` (host_device: by `launch` itself).
// `record()` returns an event marking the current end of the queue; `event.wait()` blocks until
// everything before it finished and `event.ready()` polls.
template <class D>
concept device = requires(D& d, const D& cd, std::size_t n, void* p, const void* q, const grid& g) {
  { d.allocate(n) } -> std::same_as<void*>;
  d.deallocate(p);
  d.copy(q, p, n);
  d.launch(g, detail::empty_program{});
  d.synchronize();
  { d.record() } -> std::same_as<typename D::event>;
  requires requires(typename D::event & e) {
    e.wait();
    { e.ready() } -> std::convertible_to<bool>;
  };
  { cd.capabilities() } -> std::convertible_to<device_caps>;
  { cd.memory() } -> std::convertible_to<memory_stats>;
};

}  // namespace v0
}  // namespace tessel
