// 05: devices. One executor (worker pool) shared by two host devices, each with its own caching
// memory pool; exceptions thrown in a program come back from launch; the pool's reuse shows in
// its counters; a program can state its cost (what the emulator's cards charge).
#include <chrono>
#include <cstdio>
#include <stdexcept>

#include <tessel/device.hpp>

using namespace tessel;

struct fill {
  float* out;
  std::size_t n;
  void operator()(block_ctx& ctx) const {
    const std::size_t per = ceil_div(n, ctx.dims().x), lo = ctx.block_linear() * per;
    for (std::size_t i = lo; i < n && i < lo + per; ++i) out[i] = float(i);
  }
  kernel_cost cost(const grid&) const { return {0.0, double(n) * sizeof(float), math_precision::f32}; }
};
static_assert(costed_program<fill>);

int main() {
  executor pool(2);
  host_device a(pool), b(pool);
  const std::size_t n = std::size_t(16) << 20;
  for (int step = 0; step < 8; ++step) {  // a training-loop-like pattern: same sizes every step
    float* x = a.allocate_n<float>(n);
    a.launch(grid{64}, fill{x, n});
    a.deallocate(x);
  }
  const auto m = a.memory();
  std::printf("8 x 64 MiB allocations: %zu MiB requested, %zu MiB peak reserved, %zu pool hits\n", m.requested_total >> 20, m.peak_reserved >> 20,
              m.pool_hits);
  try {
    b.launch(grid{4}, [](block_ctx& ctx) {
      if (ctx.block_linear() == 2) throw std::runtime_error("block 2 says no");
    });
  } catch (const std::exception& e) { std::printf("exception from a block: %s\n", e.what()); }
  const int reps = 20000;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) b.launch(grid{2}, [](block_ctx&) {});
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps;
  std::printf("empty launch on 2 workers: %.2f us\n", us);
}
