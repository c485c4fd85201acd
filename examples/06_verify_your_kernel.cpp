// 06: verify your kernel. The user-written GEMM + bias + GELU + bf16 kernel of example 03
// (fused_gemm_bias_gelu.hpp) checked the way tessel checks its own operators (tessel/verify.hpp):
//   1. shapes swept around its tiles (BM = 72 rows, BN = 256 columns) and K edges;
//   2. an fp64 reference and DESIGN.md's tolerance (γ_K of the f32 sums carried through GELU, one
//      bf16 rounding), outputs poisoned with NaN first, the worst element reported;
//   3. the same bits on 1 and 2 threads and on an emulated card.
// Exit status 0 when every check passes. Run: ./06_verify_your_kernel
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include <tessel/device.hpp>
#include <tessel/emulator/card.hpp>
#include <tessel/verify.hpp>

#include "fused_gemm_bias_gelu.hpp"

using namespace tessel;

int main() {
  verify::suite checks;
  for (std::size_t m : {1, 71, 72, 73, 145})
    for (std::size_t n : {1, 255, 256, 257})
      for (std::size_t k : {1, 100, 2049}) {
        // 1. inputs that discriminate: uniform reals (sums are inexact, so the bound matters)
        const auto a = verify::filled<bf16>(m * k, verify::fill::uniform, m * 7919 + k);
        const auto b = verify::filled<bf16>(k * n, verify::fill::uniform, n * 104729 + k);
        const auto bias = verify::filled<float>(n, verify::fill::uniform, n);
        // 2. the fp64 reference: gelu_tanh(a·b + bias), and Σ|a·b| for the bound
        std::vector<double> want(m * n), mag(m * n);
        for (std::size_t i = 0; i < m; ++i)
          for (std::size_t j = 0; j < n; ++j) {
            double acc = bias[j], sum_abs = std::fabs(bias[j]);
            for (std::size_t p = 0; p < k; ++p) {
              const double t = double(a[i * k + p]) * double(b[p * n + j]);
              acc += t;
              sum_abs += std::fabs(t);
            }
            want[i * n + j] = 0.5 * acc * (1.0 + std::tanh(0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)));
            mag[i * n + j] = sum_abs;
          }
        auto run = [&](auto& dev) {
          std::vector<bf16> c(m * n, bf16(std::numeric_limits<float>::quiet_NaN()));  // unwritten elements fail
          example::gemm_bias_gelu_launch(dev, tensor<const bf16, 2>(a.data(), m, k), tensor<const bf16, 2>(b.data(), k, n),
                                         tensor<bf16, 2>(c.data(), m, n), bias);
          return c;
        };
        verify::tolerance tol;
        tol.mag = 1.13 * verify::gamma(k + 1, verify::unit_roundoff<float>());          // gelu' <= 1.13 carries the sum's error
        tol.rel = verify::unit_roundoff<bf16>() + 64 * verify::unit_roundoff<float>();  // one bf16 rounding, the tanh
        tol.abs = 64 * verify::unit_roundoff<float>();
        const std::string shape = std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k);
        host_device dev(2);
        checks.add(verify::compare("gemm_bias_gelu " + shape, run(dev), want, tol, mag));
        // 3. determinism on the largest K: 1 thread, 2 threads, an emulated card
        if (k == 2049) {
          executor ex(2);
          emu::card_spec spec;
          spec.memory_bytes = std::size_t{1} << 30;
          emu::card card(0, spec, ex, false, nullptr);
          const auto same = verify::same_bits<bf16>("gemm_bias_gelu " + shape, {{"1 thread",
                                                                                 [&] {
                                                                                   host_device d(1);
                                                                                   return run(d);
                                                                                 }},
                                                                                {"2 threads",
                                                                                 [&] {
                                                                                   host_device d(2);
                                                                                   return run(d);
                                                                                 }},
                                                                                {"emulated card", [&] { return run(card); }}});
          for (const auto& r : same.reports) checks.add(r);
        }
      }
  // every failing check prints its worst element: index, got, want, errors, ULPs, bound
  std::printf("%s\n", checks.summary().c_str());
  double worst = 0;
  for (const auto& r : checks.reports)
    if (r.worst && r.worst->bound > 0) worst = std::max(worst, r.worst->abs_err / r.worst->bound);
  std::printf("largest error / bound over the sweep: %.3f\n", worst);
  return checks.passed() ? 0 : 1;
}
