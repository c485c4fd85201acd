// 04: FP8 GEMM with DeepSeek-V3 block scales. Quantize activations per 1x128 block and weights per
// 128x128 block to e4m3 (saturating), multiply with FP32 accumulation scaled per K block, and
// compare with the f32 GEMM of the unquantized data. Run: ./04_fp8_block_scaled_gemm
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <tessel/device.hpp>
#include <tessel/ops/gemm.hpp>

using namespace tessel;

int main() {
  const std::size_t M = 256, N = 512, K = 1024, blk = gemm_scales::block;
  const std::size_t kb = K / blk, nb = N / blk;
  std::mt19937 g(1);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> A(M * K), B(K * N), C(M * N), Cq(M * N);
  for (auto& x : A) x = d(g);
  for (auto& x : B) x = d(g) * 0.05f;
  // per-block scales: amax / 448 (e4m3's largest finite value)
  std::vector<float> sa(M * kb), sb(kb * nb);
  std::vector<e4m3> Aq(M * K), Bq(K * N);
  for (std::size_t i = 0; i < M; ++i)
    for (std::size_t b = 0; b < kb; ++b) {
      float amax = 0;
      for (std::size_t k = 0; k < blk; ++k) amax = std::max(amax, std::fabs(A[i * K + b * blk + k]));
      const float s = amax > 0 ? amax / 448.0f : 1.0f;
      sa[i * kb + b] = s;
      for (std::size_t k = 0; k < blk; ++k) Aq[i * K + b * blk + k] = e4m3(std::clamp(A[i * K + b * blk + k] / s, -448.0f, 448.0f));
    }
  for (std::size_t bk = 0; bk < kb; ++bk)
    for (std::size_t bn = 0; bn < nb; ++bn) {
      float amax = 0;
      for (std::size_t k = 0; k < blk; ++k)
        for (std::size_t n = 0; n < blk; ++n) amax = std::max(amax, std::fabs(B[(bk * blk + k) * N + bn * blk + n]));
      const float s = amax > 0 ? amax / 448.0f : 1.0f;
      sb[bk * nb + bn] = s;
      for (std::size_t k = 0; k < blk; ++k)
        for (std::size_t n = 0; n < blk; ++n) {
          const std::size_t i = (bk * blk + k) * N + bn * blk + n;
          Bq[i] = e4m3(std::clamp(B[i] / s, -448.0f, 448.0f));
        }
    }
  host_device dev;
  gemm(dev, transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N);
  gemm_scales s;
  s.a_block = sa.data();
  s.b_block = sb.data();
  gemm(dev, transpose::none, transpose::none, M, N, K, 1.0f, Aq.data(), K, Bq.data(), N, 0.0f, Cq.data(), N, epilogue::chain<>{}, s);
  double num = 0, den = 0;
  for (std::size_t i = 0; i < C.size(); ++i) {
    num += (Cq[i] - C[i]) * (Cq[i] - C[i]);
    den += C[i] * C[i];
  }
  std::printf("FP8 (e4m3, 1x128 / 128x128 block scales) vs f32: relative RMS error %.4f\n", std::sqrt(num / den));
  return std::sqrt(num / den) < 0.1 ? 0 : 1;
}
