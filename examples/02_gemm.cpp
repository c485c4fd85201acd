// 02: the library GEMM. C = alpha·op(A)·op(B) + beta·C for f32 and bf16 inputs, with transposes,
// tensor views and an epilogue. Run: ./02_gemm
#include <chrono>
#include <cstdio>
#include <vector>

#include <tessel/device.hpp>
#include <tessel/ops/gemm.hpp>

using namespace tessel;

int main() {
  host_device dev;  // one worker per core
  const std::size_t M = 512, N = 768, K = 1024;
  std::vector<float> A(M * K, 0.5f), B(N * K, 0.25f), C(M * N, 1.0f);
  // BLAS style, row-major: B is stored (N,K) and used transposed
  gemm(dev, transpose::none, transpose::yes, M, N, K, 2.0f, A.data(), K, B.data(), K, 1.0f, C.data(), N);
  std::printf("f32: C[0] = %g (expect %g)\n", C[0], 2.0 * 0.5 * 0.25 * K + 1.0);

  // bf16 inputs, f32 accumulation, bf16 output through bias + SiLU, with tensor views
  std::vector<bf16> a(M * K, bf16(0.5f)), b(K * N, bf16(-0.25f)), c(M * N);
  std::vector<float> bias(N, 100.0f);
  auto t0 = std::chrono::steady_clock::now();
  gemm(dev, tensor<const bf16, 2>(a.data(), M, K), tensor<const bf16, 2>(b.data(), K, N), tensor<bf16, 2>(c.data(), M, N), 1.0f, 0.0f,
       epilogue::bias(bias) | epilogue::silu | epilogue::cast<bf16>);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("bf16: C[0] = %g (expect silu(%g)), %.1f GFLOP/s\n", float(c[0]), 100.0 - 0.125 * K, 2.0 * M * N * K / s / 1e9);
  try {
    gemm(dev, transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K - 1, B.data(), N, 0.0f, C.data(), N);
  } catch (const gemm_error& e) { std::printf("typed error: %s\n", e.what()); }
}
