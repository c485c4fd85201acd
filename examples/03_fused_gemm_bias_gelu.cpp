// 03: a user-written fused kernel. GEMM + bias + GELU + cast to bf16 written with the public tile
// primitives (load B into VNNI pairs, mma reading A in place, store through an epilogue chain),
// timed against the library GEMM with the same epilogue. Run: ./03_fused_gemm_bias_gelu [M N K]
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

using namespace tessel;

// C(M,N) = gelu(A(M,K) · B(K,N) + bias(N)), bf16 in, f32 accumulate, bf16 out.
// A block owns a BN-wide column strip of C over slabs_per_block slabs of BM rows. It packs its
// (K,BN) strip of B once, BK deep at a time, then runs each slab of A through all of K against
// that strip: B is packed once per block, not once per slab, and a slab's accumulators stay in
// cache until the epilogue stores them. This is the blocking of the library's GEMM.
template <class Cfg>
struct gemm_bias_gelu {
  tensor<const bf16, 2> A, B;
  tensor<bf16, 2> C;
  std::span<const float> bias;
  std::size_t slabs_per_block;
  void operator()(block_ctx& ctx) const {
    using tr = mma_traits<bf16>;
    using S = tr::stage_type;                                            // bf16 pairs, or f32 without a pair atom
    using b_tile = staged<S, Cfg::BK, Cfg::BN, tr::b_layout>;
    auto [bm, bn] = ctx.block_index();
    const std::size_t nk = ceil_div(A.cols(), Cfg::BK);
    S* strip = ctx.scratch().allocate_array<S>(nk * b_tile::elements);  // B(:, strip bn) as nk packed tiles
    for (std::size_t k = 0; k < nk; ++k) {
      b_tile b(strip + k * b_tile::elements);
      load(B.tile<Cfg::BK, Cfg::BN>(k, bn), b);
    }
    staged<float, Cfg::BM, Cfg::BN> acc{ctx};                            // (BM,BN) accumulators of one slab
    staged<S, Cfg::BM, Cfg::BK> a{ctx};                                  // used only without a pair atom
    const std::size_t cols = std::min(Cfg::BN, C.cols() - bn * Cfg::BN);  // the last strip may be narrower
    const std::size_t first = bm * slabs_per_block, last = std::min(first + slabs_per_block, ceil_div(A.rows(), Cfg::BM));
    for (std::size_t s = first; s < last; ++s) {
      for (std::size_t k = 0; k < nk; ++k) {
        const b_tile b(strip + k * b_tile::elements);
        if constexpr (std::is_same_v<S, bf16>) {
          mma(A.tile<Cfg::BM, Cfg::BK>(s, k), b, acc, {.accumulate = k > 0, .n = cols});  // A read in place
        } else {  // no bf16 pair atom (AVX2 build): A is widened to f32 rows, then read in place
          load(A.tile<Cfg::BM, Cfg::BK>(s, k), a);
          mma(tensor<const S, 2>(a.data(), Cfg::BM, Cfg::BK).tile<Cfg::BM, Cfg::BK>(0, 0), b, acc, {.accumulate = k > 0, .n = cols});
        }
      }
      store(acc, C.tile<Cfg::BM, Cfg::BN>(s, bn), epilogue::bias(bias) | epilogue::gelu | epilogue::cast<bf16>);
    }
  }
};
// BK: K chunks of 4 KiB per A row, 2048 bf16 pairs or 1024 widened f32 (fewer accumulator round
// trips); BM: 72 rows (A slab, B micro-panel and accumulators share the 1 MiB L2); BN: 256 columns
// (the packed B strip stays in L3). The library's GEMM uses the same sizes.
struct cfg {
  static constexpr std::size_t BM = 72, BN = 256, BK = std::is_same_v<mma_traits<bf16>::stage_type, bf16> ? 2048 : 1024;
};

int main(int argc, char** argv) {
  const std::size_t M = argc > 3 ? std::strtoul(argv[1], nullptr, 10) : 1024;
  const std::size_t N = argc > 3 ? std::strtoul(argv[2], nullptr, 10) : 2048;
  const std::size_t K = argc > 3 ? std::strtoul(argv[3], nullptr, 10) : 2048;
  std::vector<bf16> A(M * K), B(K * N), C1(M * N), C2(M * N);
  std::vector<float> bias(N);
  for (std::size_t i = 0; i < A.size(); ++i) A[i] = bf16(float(int(i % 13) - 6) / 8);
  for (std::size_t i = 0; i < B.size(); ++i) B[i] = bf16(float(int(i % 11) - 5) / 8);
  for (std::size_t i = 0; i < N; ++i) bias[i] = float(i % 5) / 4;
  host_device dev;
  tensor<const bf16, 2> tA(A.data(), M, K), tB(B.data(), K, N);
  // Row blocks of at most 2048 rows; more of them only when there are fewer column strips than workers.
  const std::size_t slabs = ceil_div(M, cfg::BM), strips = ceil_div(N, cfg::BN), workers = dev.capabilities().workers;
  std::size_t row_blocks = ceil_div(M, 2048);
  while (row_blocks * strips < workers && row_blocks < slabs) ++row_blocks;
  const std::size_t per_block = ceil_div(slabs, row_blocks);
  auto user = [&] {
    dev.launch(grid{ceil_div(slabs, per_block), strips}, gemm_bias_gelu<cfg>{tA, tB, tensor<bf16, 2>(C1.data(), M, N), bias, per_block});
  };
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
