// The user-written fused kernel of example 03 (GEMM + bias + GELU + cast to bf16, written with
// the public tile primitives), shared by the example and bench/gemm.cpp, which times it against
// the library GEMM with the same epilogue.
#pragma once

#include <algorithm>
#include <span>
#include <type_traits>

#include <tessel/device.hpp>
#include <tessel/tile.hpp>

namespace example {
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
    using S = tr::stage_type;  // bf16 pairs, or f32 without a pair atom
    using b_tile = staged<S, Cfg::BK, Cfg::BN, tr::b_layout>;
    auto [bm, bn] = ctx.block_index();
    const std::size_t nk = ceil_div(A.cols(), Cfg::BK);
    S* strip = ctx.scratch().allocate_array<S>(nk * b_tile::elements);  // B(:, strip bn) as nk packed tiles
    for (std::size_t k = 0; k < nk; ++k) {
      b_tile b(strip + k * b_tile::elements);
      load(B.tile<Cfg::BK, Cfg::BN>(k, bn), b);
    }
    staged<float, Cfg::BM, Cfg::BN> acc{ctx};                             // (BM,BN) accumulators of one slab
    staged<S, Cfg::BM, Cfg::BK> a{ctx};                                   // used only without a pair atom
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

// Launches the kernel: row blocks of at most 2048 rows, more of them only when there are fewer
// column strips than workers.
template <class Device>
void gemm_bias_gelu_launch(Device& dev, tensor<const bf16, 2> A, tensor<const bf16, 2> B, tensor<bf16, 2> C, std::span<const float> bias) {
  const std::size_t slabs = ceil_div(A.rows(), cfg::BM), strips = ceil_div(B.cols(), cfg::BN), workers = dev.capabilities().workers;
  std::size_t row_blocks = ceil_div(A.rows(), 2048);
  while (row_blocks * strips < workers && row_blocks < slabs) ++row_blocks;
  const std::size_t per_block = ceil_div(slabs, row_blocks);
  dev.launch(grid{ceil_div(slabs, per_block), strips}, gemm_bias_gelu<cfg>{A, B, C, bias, per_block});
}

}  // namespace example
