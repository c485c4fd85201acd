// 03: a user-written fused kernel. GEMM + bias + GELU + cast to bf16 written with the public tile
// primitives (load B into VNNI pairs, mma reading A in place, store through an epilogue chain) in
// fused_gemm_bias_gelu.hpp, checked and timed against the library GEMM with the same epilogue
// (bench/gemm.cpp times both side by side). Run: ./03_fused_gemm_bias_gelu [M N K]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include <tessel/device.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/tile.hpp>

#include "example_args.hpp"
#include "fused_gemm_bias_gelu.hpp"  // the kernel: a tile program with the public primitives

using namespace tessel;

int main(int argc, char** argv) {
  const example_args::positional args(argc, argv, "[M N K, each 1..16384]", 3);
  if (args.count() != 0 && args.count() != 3) args.fail("give M, N and K together, or none");
  const auto M = std::size_t(args.integer(1, "M", 1, 16384, 1024));
  const auto N = std::size_t(args.integer(2, "N", 1, 16384, 2048));
  const auto K = std::size_t(args.integer(3, "K", 1, 16384, 2048));
  std::vector<bf16> A(M * K), B(K * N), C1(M * N), C2(M * N);
  std::vector<float> bias(N);
  for (std::size_t i = 0; i < A.size(); ++i) A[i] = bf16(float(int(i % 13) - 6) / 8);
  for (std::size_t i = 0; i < B.size(); ++i) B[i] = bf16(float(int(i % 11) - 5) / 8);
  for (std::size_t i = 0; i < N; ++i) bias[i] = float(i % 5) / 4;
  host_device dev;
  tensor<const bf16, 2> tA(A.data(), M, K), tB(B.data(), K, N);
  auto user = [&] { example::gemm_bias_gelu_launch(dev, tA, tB, tensor<bf16, 2>(C1.data(), M, N), bias); };
  auto library = [&] {
    gemm(dev, tA, tB, tensor<bf16, 2>(C2.data(), M, N), 1.0f, 0.0f, epilogue::bias(bias) | epilogue::gelu | epilogue::cast<bf16>);
  };
  auto best = [](auto f) {
    double b = 1e30;
    for (int r = 0; r < 5; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      f();
      b = std::min(b, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return b;
  };
  const double tu = best(user), tl = best(library);
  std::size_t diff = 0;
  for (std::size_t i = 0; i < C1.size(); ++i) diff += std::fabs(float(C1[i]) - float(C2[i])) > 1e-2f * (1 + std::fabs(float(C2[i])));
  const double gf = 2.0 * M * N * K / 1e9;
  std::printf("M=%zu N=%zu K=%zu on %u workers\n", M, N, K, dev.capabilities().workers);
  std::printf("user tile program : %8.2f ms  %6.1f GFLOP/s\n", tu * 1e3, gf / tu);
  std::printf("library gemm      : %8.2f ms  %6.1f GFLOP/s  (user/library time %.2f)\n", tl * 1e3, gf / tl, tu / tl);
  std::printf("elements differing beyond bf16 rounding: %zu\n", diff);
  return diff == 0 ? 0 : 1;
}
