// 11_bf16_params: why bf16 parameters need a master copy, stochastic rounding, or remainders.
//
// 1 Mi parameters start at 1.0 and take 1000 SGD steps of lr·g = 1e-4 each (f32 result: 0.9).
//  - bf16 parameters, round to nearest: every update is below half a bf16 ulp, so nothing moves.
//  - bf16 parameters, stochastic rounding: each step rounds down with probability update/ulp, so
//    the mean follows the f32 trajectory (unbiased), with no extra memory.
//  - bf16 + 16-bit remainders: bf16 and remainder together are the f32 master bit for bit, in
//    half the memory of an f32 master copy.
//
//   ./11_bf16_params
#include <bit>
#include <cmath>
#include <cstdio>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/optim.hpp>

using namespace tessel;

int main() {
  host_device dev;
  const std::size_t n = std::size_t(1) << 20;
  const int steps = 1000;
  std::vector<float> grad(n, 1.0f), f32(n, 1.0f);
  std::vector<bf16> nearest(n, bf16(1.0f)), stochastic(n, bf16(1.0f)), hi(n, bf16(1.0f));
  std::vector<std::uint16_t> lo(n, 0);
  sgd_params h;
  h.lr = 1e-4f;

  auto step = [&](optim_tensor<float, float> t, const step_options& o, int s) {
    t.grad = grad;
    sgd_step(dev, std::span<const optim_tensor<float, float>>(&t, 1), h, std::uint64_t(s), o);
  };
  for (int s = 1; s <= steps; ++s) {
    optim_tensor<float, float> t;
    t.param = f32;
    step(t, {}, s);

    step_options o;
    o.storage = param_storage::bf16;
    t = {};
    t.param_bf16 = nearest;
    step(t, o, s);

    o.round = rounding::stochastic;
    o.seed = 2024;
    t.param_bf16 = stochastic;
    step(t, o, s);

    step_options r;
    r.storage = param_storage::bf16_remainder;
    t = {};
    t.param_bf16 = hi;
    t.remainder = lo;
    step(t, r, s);
  }
  auto mean = [&](auto const& v) {
    double m = 0;
    for (auto x : v) m += double(float(x));
    return m / double(v.size());
  };
  std::size_t exact = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t joined = ((std::uint32_t(hi[i].bits()) << 16) | lo[i]) - (std::uint32_t(lo[i] & 0x8000u) << 1);
    exact += joined == std::bit_cast<std::uint32_t>(f32[i]);
  }
  std::printf("after %d steps of -1e-4 (f32 reference %.6f):\n", steps, mean(f32));
  std::printf("  bf16, round to nearest : mean %.6f  (stuck: each update is below half an ulp)\n", mean(nearest));
  std::printf("  bf16, stochastic       : mean %.6f  (unbiased, 2 bytes per parameter)\n", mean(stochastic));
  std::printf("  bf16 + remainder       : bf16 part %.6f; (bf16, remainder) == f32 run bit for bit for %zu of %zu (4 bytes per parameter)\n",
              mean(hi), exact, n);
  const bool ok = exact == n && mean(nearest) == 1.0 && std::abs(mean(stochastic) - mean(f32)) < 1e-3;
  return ok ? 0 : 1;
}
