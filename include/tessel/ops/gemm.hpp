// GEMM as a tile program: C = alpha·op(A)·op(B) + beta·C, then an optional epilogue chain, for
// f32, bf16 (→ f32 or bf16), fp16 and FP8 (e4m3/e5m2, mixed) inputs with per-tensor or
// DeepSeek-V3 block scales (1x128 for A along K, 128x128 for B), accumulated in FP32.
// Row-major convention: A is (M,K), B is (K,N), C is (M,N) after op(); transposes are strides.
// Every element of C is computed by one block in a fixed K order, so results never depend on the
// thread count or on which worker runs which block.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <queue>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <tessel/arch/target.hpp>  // first: parses the intrinsic headers under a GCC 12 false-positive guard
#include <tessel/ops/errors.hpp>
#include <tessel/ops/gemm_tune.hpp>
#include <tessel/arch/copy.hpp>
#include <tessel/arch/direct_atoms.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/device/profiler.hpp>
#include <tessel/tile.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp16.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel {
inline namespace v0 {

enum class transpose : std::uint8_t { none, yes };

// Scales for FP8 (or any) inputs. Per-tensor: C = alpha·(scale_a·A)(scale_b·B). Block scales
// (DeepSeek-V3): a_block[m * ceil(K/128) + kb] scales A(m, 128kb..128kb+127) and
// b_block[kb * ceil(N/128) + nb] scales B(128kb.., 128nb..) of op(B), both as (M,K)/(K,N) logically.
struct gemm_scales {
  float a = 1.0f, b = 1.0f;
  const float* a_block = nullptr;
  const float* b_block = nullptr;
  static constexpr std::size_t block = 128;
};

template <class T>
concept gemm_input =
    std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, fp16> || std::is_same_v<T, e4m3> || std::is_same_v<T, e5m2>;
template <class T>
concept gemm_output =
    std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, fp16> || std::is_same_v<T, e4m3> || std::is_same_v<T, e5m2>;

}  // namespace v0

namespace detail {

// Narrow: the f32 atom of tile programs (best_f32_atom, 32 columns with AVX-512) instead of the
// GEMM's 64-column one, for operands whose columns come in groups of 32 or fewer (conv2d's output
// channels per group; see conv_narrow): a 6x64 atom on 32 columns computes half zeros.
template <class TA, class TB, bool Skinny = false, bool Narrow = false>
struct gemm_config {
  static_assert(mma_traits<TA>::pair == mma_traits<TB>::pair,
                "tessel::gemm: A and B must both be 16/8-bit floats (bf16/e4m3/e5m2) or both f32/fp16 on this target");
  using traits = mma_traits<TA>;
  using stage = typename traits::stage_type;
  using atom = std::conditional_t<traits::pair, typename traits::atom, std::conditional_t<Narrow, arch::best_f32_atom, arch::best_f32_gemm_atom>>;
  static constexpr std::size_t MR = atom::mr, NR = atom::nr, KP = atom::k_pack;
  using a_layout = layout::panel<MR, KP>;      // (MC,KC) A as MR-row panels
  using b_layout = layout::col_panel<NR, KP>;  // (KC,NB) B as NR-column panels
  // K chunk: a 128 KiB B micro-panel that streams from L2, which the atoms sustain at full rate:
  // 2048 deep for bf16 pairs (32 columns), 512 for f32 with the AVX-512 6x64 atom (1024 with the
  // 32 columns of the AVX2 atom). Each atom call's C tile round trip and call overhead are spread
  // over K/KC fewer calls: measured side by side, bf16 512 -> 1024 -> 2048 +1.8% then +1.0%, f32
  // 8x32 512 -> 1024 +1.6%, but f32 6x64 1024 -> 512 +1.3% (a 256 KiB panel did not keep up);
  // one step deeper (bf16 4096: an (MC,KC) A tile of 768 KiB no longer shares the 1 MiB L2) lost
  // 1-2%. Deeper chunks change rounding (one add into C per chunk); the gamma_K,
  // integer-bitwise and thread-count tests decide. FP8 block-scaled chunks stay 512 (KC_scaled: 4 scale blocks).
  // Skinny (small M) GEMMs are bound by reading B once: wide, short B tiles read B's rows
  // contiguously (few pages, long bursts) instead of tall column strips; 72 (not 64) rows keep
  // the staged panels from sitting 4 KiB apart, where their stores alias the source loads.
  // The narrow atom (conv's second f32 atom) takes the wide one's chunks: chunk sums that start
  // from zero and add into C make the chunking part of the bits, and one chunking lets conv pick
  // either atom, in either orientation, for the same result.
  static constexpr std::size_t KC = Skinny ? 72 : (traits::pair ? 2048 : (Narrow ? gemm_config<TA, TB>::KC : (NR >= 64 ? 512 : 1024)));
  static constexpr std::size_t KC_scaled = Skinny ? 72 : 512;  // block-scaled (FP8) chunks
  static constexpr std::size_t NB = Skinny ? 1024 : 256;       // columns per block ((KC,NB) B tile in L3, its (KC,NR) micro-panels streamed from L2)
  // rows per mma step: the (MC,KC) A tile (f32 144 KiB, bf16 288 KiB), the B micro-panel
  // (128 KiB) and the (MC,NB) accumulators (72 KiB) share the 1 MiB L2 with room to spare; measured
  // against 96 with the deeper chunks: +0.8-2.8% f32, +0.4-0.8% bf16 (48 was no better than 72)
  static constexpr std::size_t MC = gemm_mc;
  static constexpr std::size_t MB_max = 1024;  // rows per block: packed B is reused by this many rows
  static_assert(2 * MB_max == gemm_max_block_rows, "gemm_config: a plan's largest block is the resident program's");
  static constexpr std::size_t skinny_max_m = 32;
  static_assert(NB % NR == 0 && MC % MR == 0, "gemm_config: tile sizes must be multiples of the atom");
};

// Requests the cache lines of a row-major tile (rows x bytes_per_row at base, rows row_stride
// bytes apart) into L2 a few at a time, in row order: the next tile's fetch spread over the
// current tile's compute. Only addresses inside the tile are touched.
struct tile_prefetcher {
  const char* base = nullptr;
  std::size_t row_stride = 0, row_lines = 0, lines = 0, next = 0;
  void start(const void* p, std::size_t rows, std::size_t bytes_per_row, std::size_t stride_bytes) {
    base = static_cast<const char*>(p);
    row_stride = stride_bytes;
    row_lines = ceil_div(bytes_per_row, 64);
    lines = rows * row_lines;
    next = 0;
  }
  void issue(std::size_t n) {
    for (; n > 0 && next < lines; --n, ++next) __builtin_prefetch(base + (next / row_lines) * row_stride + (next % row_lines) * 64, 0, 2);
  }
};

inline std::string gemm_shape(std::size_t M, std::size_t N, std::size_t K) {
  return "(M,N,K)=(" + std::to_string(M) + "," + std::to_string(N) + "," + std::to_string(K) + ")";
}

template <class TA, class TB, class TC, class Chain, bool Scaled, bool Skinny = false>
struct gemm_program {
  using cfg = gemm_config<TA, TB, Skinny>;
  using S = typename cfg::stage;
  using atom = typename cfg::atom;
  static constexpr std::size_t MR = cfg::MR, NR = cfg::NR, KP = cfg::KP, NB = cfg::NB, MC = cfg::MC;
  // Block scales with the pair atom: a chunk spans SB scale blocks and the block-scaled atom
  // applies each block's scales to its tile in registers/L1, so the (MB,NB) accumulator is swept
  // once per chunk as for bf16 (one sweep per 128-deep block cost ~25% at 1 MiB per block).
  // Other atoms run one scale block per chunk with their row/column scales.
  static constexpr bool scaled_pair = Scaled && KP == 2;
  static constexpr std::size_t SB = scaled_pair ? cfg::KC_scaled / gemm_scales::block : 1;
  static constexpr std::size_t KC = Scaled ? gemm_scales::block * SB : cfg::KC;
  static_assert(!scaled_pair || cfg::KC_scaled % gemm_scales::block == 0, "gemm_program: K chunk must hold whole scale blocks");
  static_assert(!scaled_pair || (arch::best_bf16_scaled_atom::mr == MR && arch::best_bf16_scaled_atom::nr == NR),
                "gemm_program: the block-scaled atom must have the pair atom's tile");

  std::size_t M, N, K, batch;
  tensor<const TA, 2> A;              // (M,K) view of batch 0
  tensor<const TB, 2> B;              // (K,N)
  tensor<TC, 2> C;                    // (M,N)
  std::size_t sa, sb, sc;             // batch strides (elements)
  const TA* const* a_ptrs = nullptr;  // pointer-array batching (overrides strides)
  const TB* const* b_ptrs = nullptr;
  TC* const* c_ptrs = nullptr;
  float alpha, beta;
  gemm_scales scales;
  std::size_t MB;
  Chain ep;
  // Split K (unscaled, one matrix): block z computes the partial product over K rows
  // [z*k_split, min(K, (z+1)*k_split)) into C + z*sc; gemm_splitk_reduce adds them in z order.
  std::size_t k_split = 0;
  // A transposed A packed once for every block column (gemm_pack_a_program): the (MC,KC) panel
  // tile of row slab s and K chunk c at a_packed + (s * a_chunks + c) * MC * KC.
  const S* a_packed = nullptr;
  std::size_t a_chunks = 0;
  // Streams C like a large result whatever this product's own size (a grouped launch whose
  // products together write more than stream_min_bytes). Changes how C is stored, not its bits.
  bool stream_large = false;

  // For the profiler's trace: the product's shape.
  std::string shape() const { return detail::gemm_shape(M, N, K) + (batch > 1 ? std::string(" x batch ") + std::to_string(batch) : std::string()); }

  kernel_cost cost(const grid&) const {
    kernel_cost c;
    c.flops = 2.0 * double(M) * double(N) * double(K) * double(batch);
    c.bytes = (double(M) * K * sizeof(TA) + double(K) * N * sizeof(TB) + double(M) * N * sizeof(TC) * (beta != 0 ? 2 : 1)) * double(batch);
    c.precision = std::is_same_v<TA, float>
                      ? math_precision::f32
                      : (std::is_same_v<TA, bf16> ? math_precision::bf16 : (std::is_same_v<TA, fp16> ? math_precision::fp16 : math_precision::fp8));
    return c;
  }

  // Unscaled products: the block packs B's (K,NB) column strip once, in KS-deep pieces kept in
  // L3, then runs each MC-row slab of C through all K chunks of a piece while the slab's
  // accumulators (MC x NB floats) stay in L2; the (MB,NB) accumulator is swept once per piece,
  // not once per KC chunk. Chunks are added into the accumulators in K order, as in the
  // chunk-major loop, so the bits are the same.
  static constexpr std::size_t KS_max = 4096;  // K depth of one packed piece
  void run_resident(block_ctx& ctx, const tensor<const TA, 2>& Az, const tensor<const TB, 2>& Bz, const tensor<TC, 2>& Cz, std::size_t m0,
                    std::size_t rows, std::size_t n0, std::size_t cols) const {
    using b_stage = staged<S, KC, NB, typename cfg::b_layout>;
    const std::size_t nk = ceil_div(K, KC), chunks = std::min(nk, KS_max / KC);
    S* strip = ctx.scratch().allocate_array<S>(chunks * b_stage::elements);  // chunks x (KC,NB)
    const std::size_t rows_pad = ceil_div(rows, MC) * MC;
    float* acc = ctx.scratch().allocate_array<float>((nk > chunks ? rows_pad : MC) * NB);  // (MB,NB) or one (MC,NB) slab
    staged<S, MC, KC, layout::row> a{ctx};                                                 // (MC,KC) converted A
    staged<S, MC, KC, typename cfg::a_layout> ap{ctx};                                     // (MC,KC) transposed A as MR-row panels (K pairs for bf16)
    // a column-major (transposed) A packs fastest into the atom's panels: MR consecutive rows per
    // K step (f32), or the K pair (k, k+1) of MR rows from two contiguous runs (bf16, FP8); into the
    // row layout a bf16 A was gathered element by element, a column stride apart, per slab
    const bool panel_a = Az.row_stride() == 1 && Az.col_stride() != 1 && K > 1;
    const bool direct_a = std::is_same_v<TA, S> && Az.col_stride() == 1;
    const auto chain = epilogue::alpha_beta(alpha * scales.a * scales.b, beta) | ep;
    const std::size_t jps = ceil_div(cols, NR);
    const bool stream_c = stream_output(Cz);
    // ... and when nothing is left to apply (alpha 1, no epilogue), the atoms stream each finished
    // full-width tile straight into C during the last chunk, so the stores spread over the slab's
    // compute instead of following it (bf16 2048^3: +1.2% 1 thread, +0.9% 2 threads, side by side)
    const bool atoms_out = stream_c && Chain::empty && alpha * scales.a * scales.b == 1.0f && Cz.row_stride() % 16 == 0 &&
                           reinterpret_cast<std::uintptr_t>(Cz.data()) % 64 == 0;
    for (std::size_t kq = 0; kq < nk; kq += chunks) {
      const std::size_t kn = std::min(chunks, nk - kq);
      for (std::size_t k = 0; k < kn; ++k) {
        b_stage bk(strip + k * b_stage::elements);
        // only the K rows and panels the atoms read: a shallow or narrow product does not zero a whole (KC,NB) tile
        const std::size_t kv = std::min(KC, K - (kq + k) * KC);
        load(Bz.template tile_at<KC, NB>((kq + k) * KC, n0), bk, tile_extent{kv, cols});
      }
      const bool last_piece = kq + kn == nk;
      for (std::size_t mc = 0; mc < rows; mc += MC) {
        const std::size_t r = std::min(MC, rows - mc);
        float* accm = acc + (nk > chunks ? mc * NB : 0);
        for (std::size_t k = 0; k < kn; ++k) {
          const std::size_t k0 = (kq + k) * KC, kv = std::min(KC, K - k0);
          const bool direct = direct_a && kv % KP == 0;
          const S* apd = ap.data();
          if (a_packed)
            apd = a_packed + ((m0 + mc) / MC * a_chunks + kq + k) * MC * KC;
          else if (!direct) {  // the rows and K columns (whole pairs) the atoms read
            if (panel_a)
              load(Az.template tile_at<MC, KC>(m0 + mc, k0), ap, tile_extent{r, kv});
            else
              load(Az.template tile_at<MC, KC>(m0 + mc, k0), a, tile_extent{r, ceil_div(kv, KP) * KP});
          }
          const S* bkp = strip + k * b_stage::elements;
          arch::ukernel_args p;
          p.k = ceil_div(kv, KP);  // a staged A is zero beyond kv
          p.ldc = NB;
          p.accumulate = kq + k > 0;
          const bool out_now = atoms_out && last_piece && k + 1 == kn;
          p.ldo = Cz.row_stride();
          for (std::size_t jp = 0; jp < jps; ++jp) {
            p.b = bkp + jp * NR * layout::col_panel<NR, KP>::padded_rows(KC);
            const bool out_panel = out_now && (jp + 1) * NR <= cols;
            for (std::size_t ip = 0; ip * MR < r; ++ip) {
              const std::size_t pr = std::min(MR, r - ip * MR);
              p.c = accm + ip * MR * NB + jp * NR;
              // a panel-A atom always computes MR rows: a partial panel stays in the accumulators
              // (streaming it out wrote MR - pr rows past its rows, past the end of C on the last slab)
              const bool out_rows = out_panel && !(panel_a && !direct && pr < MR);
              if constexpr (std::is_same_v<TC, float>) p.out = out_rows ? Cz.data() + (m0 + mc + ip * MR) * Cz.row_stride() + n0 + jp * NR : nullptr;
              if (direct) {
                p.a = Az.data() + (m0 + mc + ip * MR) * Az.row_stride() + k0;
                p.a_rs = Az.row_stride();
                arch::run_rows<atom>(static_cast<int>(pr), p);
              } else if (panel_a) {
                p.a = apd + ip * MR * KC;
                atom::run(p);
              } else {
                p.a = a.data() + ip * MR * KC;
                p.a_rs = KC;
                arch::run_rows<atom>(static_cast<int>(pr), p);
              }
            }
          }
        }
        if (last_piece) {
          TC* c = Cz.data() + (m0 + mc) * Cz.row_stride() + n0 * Cz.col_stride();
          if constexpr (std::is_same_v<TC, float>) {
            if (atoms_out) {  // the atoms wrote the full-width panels; the narrower last one is left
              const std::size_t done = cols / NR * NR;
              const bool last_direct = direct_a && (K - (nk - 1) * KC) % KP == 0;
              const std::size_t rf = panel_a && !last_direct ? r / MR * MR : r;  // rows the atoms wrote
              if (rf < r && done > 0)
                store_streaming(accm + rf * NB, r - rf, done, c + rf * Cz.row_stride(), Cz.row_stride(), m0 + mc + rf, n0, chain);
              if (done < cols)
                store_streaming(accm + done, r, cols - done, c + done, Cz.row_stride(), m0 + mc, n0 + done, chain);
              else
                arch::store_fence();
              continue;
            }
            if (stream_c) {
              store_streaming(accm, r, cols, c, Cz.row_stride(), m0 + mc, n0, chain);
              continue;
            }
          }
          detail::store_rows<TC>(accm, NB, r, cols, c, Cz.row_stride(), Cz.col_stride(), m0 + mc, n0, chain);
        }
      }
    }
  }

  // A large f32 C that the epilogue does not read (beta = 0) is written with streaming stores:
  // no write-allocate read of each line, and the stores drain while the next slab computes. A
  // plain store of a (MC,NB) slab waited on those reads: 6.7% of bf16 2048^3 on 1 thread (K is
  // one chunk, so a slab stores after every 2048-deep pass), 3.5% of f32. Small results stay
  // cached for the caller (they may fit in L3).
  static constexpr std::size_t stream_min_bytes = std::size_t{8} << 20;
  bool stream_output(const tensor<TC, 2>& Cz) const {
    return std::is_same_v<TC, float> && beta == 0.0f && Cz.col_stride() == 1 &&
           (stream_large || double(M) * double(N) * double(batch) * sizeof(TC) >= double(stream_min_bytes));
  }
  // store_rows' arithmetic (the chain on each row of the (r,cols) slab, in place) with the rows
  // then streamed out; the fence orders them before the launch publishes the block as done.
  template <class Ch>
  static void store_streaming(float* acc, std::size_t r, std::size_t cols, TC* c, std::size_t ldc, std::size_t row0, std::size_t col0,
                              const Ch& chain) {
    static_assert(NB <= 256, "store_streaming: store_rows applies the chain to rows of at most 256 columns");
    static_assert(std::is_same_v<TC, float>, "store_streaming: f32 results only (no conversion on the way)");
    for (std::size_t i = 0; i < r; ++i) {
      float* v = acc + i * NB;
      TC* d = c + i * ldc;
      if constexpr (!Ch::empty) {
        epilogue::row_info ri;
        ri.row = row0 + i;
        ri.col0 = col0;
        ri.old = d;
        ri.old_stride = 1;
        ri.old_at = &detail::read_as_f32<TC>;
        ri.old_f32 = d;
        chain.apply(v, cols, ri);
      }
      arch::copy_streaming(d, v, cols * sizeof(TC));
    }
    arch::store_fence();
  }

  void operator()(block_ctx& ctx) const {
    const auto idx = ctx.block_index3();
    if (k_split == 0) return run_block(ctx, idx[0], idx[1], idx[2]);
    // this split as a GEMM of its own over K rows [k0, k0 + kz): same blocking, its own chunks
    const std::size_t z = idx[2], k0 = z * k_split, kz = std::min(k_split, K - k0);
    gemm_program part = *this;
    part.K = kz;
    part.k_split = 0;
    part.A = tensor<const TA, 2>::strided(A.data() + k0 * A.col_stride(), M, kz, A.row_stride(), A.col_stride());
    part.B = tensor<const TB, 2>::strided(B.data() + k0 * B.row_stride(), kz, N, B.row_stride(), B.col_stride());
    part.C = tensor<TC, 2>::strided(C.data() + z * sc, M, N, C.row_stride(), C.col_stride());
    part.batch = 1;
    part.run_block(ctx, idx[0], idx[1], 0);
  }

  void run_block(block_ctx& ctx, std::size_t mb, std::size_t nb, std::size_t z) const {
    const TA* pa = a_ptrs ? a_ptrs[z] : A.data() + z * sa;
    const TB* pb = b_ptrs ? b_ptrs[z] : B.data() + z * sb;
    TC* pc = c_ptrs ? c_ptrs[z] : C.data() + z * sc;
    const auto Az = tensor<const TA, 2>::strided(pa, M, K, A.row_stride(), A.col_stride());
    const auto Bz = tensor<const TB, 2>::strided(pb, K, N, B.row_stride(), B.col_stride());
    const auto Cz = tensor<TC, 2>::strided(pc, M, N, C.row_stride(), C.col_stride());

    const std::size_t m0 = mb * MB, rows = std::min(MB, M - m0);
    const std::size_t n0 = nb * NB, cols = std::min(NB, N - n0);
    if constexpr (!Scaled && !Skinny) {
      if (K > 0) return run_resident(ctx, Az, Bz, Cz, m0, rows, n0, cols);
    }
    const std::size_t rows_pad = ceil_div(rows, MC) * MC;
    float* acc = ctx.scratch().allocate_array<float>(rows_pad * NB);  // (MB,NB)
    staged<S, KC, NB, typename cfg::b_layout> b{ctx};                 // (KC,NB)
    staged<S, MC, KC, layout::row> a{ctx};                            // (MC,KC) converted A, read in place
    staged<S, MC, KC, typename cfg::a_layout> ap{ctx};                // (MC,KC) transposed A as MR-row panels
    // a column-major (transposed) A packs fastest into panels (MR contiguous rows per K step)
    const bool panel_a = KP == 1 && Az.row_stride() == 1 && K > 1;
    alignas(64) float rs[SB * MC];  // rs[q*MC + i]: row scales of scale block q of the chunk
    alignas(64) float cs[SB * NB];  // cs[q*NB + j]
    const bool direct_a = std::is_same_v<TA, S> && Az.col_stride() == 1;
    const std::size_t nk = ceil_div(K, KC);
    const auto ab = epilogue::alpha_beta(alpha * scales.a * scales.b, beta);
    const auto chain = ab | ep;

    if (nk == 0) std::fill_n(acc, rows_pad * NB, 0.0f);
    // FP8 block-scaled: the next B tile and the next A tile are requested during the current
    // compute (their strips are 4 KiB-strided rows of a few lines, which the hardware
    // prefetchers do not fetch ahead of the converting loads)
    constexpr bool prefetch_tiles = scaled_pair;
    const bool pf_b = prefetch_tiles && Bz.col_stride() == 1, pf_a = prefetch_tiles && Az.col_stride() == 1;
    tile_prefetcher next_b, next_a;
    const std::size_t calls_per_mc = ceil_div(cols, NR) * (MC / MR);
    for (auto k : pipelined(nk)) {
      const std::size_t k0 = k * KC, kv = std::min(KC, K - k0);
      load(Bz.template tile_at<KC, NB>(k0, n0), b, tile_extent{kv, cols});  // only what the atoms read
      if (pf_b && k.has_next()) {
        const std::size_t k1 = k0 + KC;
        next_b.start(Bz.data() + k1 * Bz.row_stride() + n0, std::min(KC, K - k1), cols * sizeof(TB), Bz.row_stride() * sizeof(TB));
      }
      const std::size_t b_per_call = ceil_div(next_b.lines, ceil_div(rows, MC) * calls_per_mc);
      if constexpr (Scaled) {
        const std::size_t nbk = ceil_div(N, gemm_scales::block);
        for (std::size_t q = 0; q < ceil_div(kv, gemm_scales::block); ++q)
          for (std::size_t j = 0; j < NB; ++j) {
            const std::size_t col = std::min(n0 + j, N - 1);
            cs[q * NB + j] = scales.b_block[(k * SB + q) * nbk + col / gemm_scales::block];
          }
      }
      for (std::size_t mc = 0; mc < rows; mc += MC) {
        const std::size_t r = std::min(MC, rows - mc);
        float* accm = acc + mc * NB;
        if constexpr (Scaled) {
          const std::size_t kbs = ceil_div(K, gemm_scales::block);
          for (std::size_t q = 0; q < ceil_div(kv, gemm_scales::block); ++q)
            for (std::size_t i = 0; i < MC; ++i) rs[q * MC + i] = i < r ? scales.a_block[(m0 + mc + i) * kbs + k * SB + q] : 0.0f;
        }
        const bool direct = direct_a && kv % KP == 0;
        if (!direct) {
          if (panel_a)
            load(Az.template tile_at<MC, KC>(m0 + mc, k0), ap, tile_extent{r, kv});
          else
            load(Az.template tile_at<MC, KC>(m0 + mc, k0), a, tile_extent{r, ceil_div(kv, KP) * KP});
        }
        if (pf_a) {  // the A tile of the next mc step (or of the next K chunk's first)
          const std::size_t mn = mc + MC < rows ? mc + MC : 0, kn = mc + MC < rows ? k0 : k0 + KC;
          if (kn < K)
            next_a.start(Az.data() + (m0 + mn) * Az.row_stride() + kn, std::min(MC, rows - mn), std::min(KC, K - kn) * sizeof(TA),
                         Az.row_stride() * sizeof(TA));
          else
            next_a.lines = 0;
        }
        const std::size_t a_per_call = ceil_div(next_a.lines, calls_per_mc);
        const std::size_t steps = ceil_div(kv, KP);  // a staged A is zero beyond kv
        for (std::size_t jp = 0; jp < ceil_div(cols, NR); ++jp) {
          for (std::size_t ip = 0; ip < ceil_div(r, MR); ++ip) {
            const std::size_t pr = std::min(MR, r - ip * MR);
            arch::ukernel_args p;
            p.k = steps;
            p.b = b.data() + jp * NR * layout::col_panel<NR, KP>::padded_rows(KC);
            p.c = accm + ip * MR * NB + jp * NR;
            p.ldc = NB;
            p.accumulate = !k.first();
            if constexpr (Scaled) {
              p.row_scale = rs + ip * MR;
              p.col_scale = cs + jp * NR;
            }
            if (direct) {
              p.a = Az.data() + (m0 + mc + ip * MR) * Az.row_stride() + k0;
              p.a_rs = Az.row_stride();
            } else if (!panel_a) {
              p.a = a.data() + ip * MR * KC;
              p.a_rs = KC;
            }
            if constexpr (scaled_pair) {
              arch::scaled_ukernel_args sp;
              static_cast<arch::ukernel_args&>(sp) = p;
              sp.block_k = gemm_scales::block / KP;
              sp.rs_stride = MC;
              sp.cs_stride = NB;
              arch::run_rows_of<arch::best_bf16_scaled_atom>(static_cast<int>(pr), sp);
              if (pf_a) next_a.issue(a_per_call);
              if (pf_b) next_b.issue(b_per_call);
            } else if (panel_a && !direct) {
              p.a = ap.data() + ip * MR * KC;  // KP == 1: panels are MR x KC
              atom::run(p);
            } else {
              arch::run_rows<atom>(static_cast<int>(pr), p);
            }
          }
        }
        if (k.last())
          detail::store_rows<TC>(accm, NB, r, cols, Cz.data() + (m0 + mc) * Cz.row_stride() + n0 * Cz.col_stride(), Cz.row_stride(), Cz.col_stride(),
                                 m0 + mc, n0, chain);
      }
    }
    if (nk == 0)
      detail::store_rows<TC>(acc, NB, rows, cols, Cz.data() + m0 * Cz.row_stride() + n0 * Cz.col_stride(), Cz.row_stride(), Cz.col_stride(), m0, n0,
                             chain);
  }
};

// Packs a transposed A once into the (MC,KC) panel tiles gemm_program's blocks read
// (gemm_program::a_packed), so the blocks of every column of C share one packing instead of each
// repacking its rows: block (s, c) packs row slab s, K chunk c. A pure copy: the bits of C are
// those of the per-block packing.
template <class TA, class Cfg>
struct gemm_pack_a_program {
  using S = typename Cfg::stage;
  static constexpr std::size_t MC = Cfg::MC, KC = Cfg::KC;
  tensor<const TA, 2> A;  // (M,K)
  S* out;
  std::size_t chunks;
  kernel_cost cost(const grid&) const { return {0.0, double(A.rows()) * double(A.cols()) * double(sizeof(TA) + sizeof(S)), math_precision::f32}; }
  // Bytes of the packed tiles of an (M,K) A: whole (MC,KC) tiles, the last chunk padded.
  static double bytes(std::size_t M, std::size_t K) { return double(ceil_div(M, MC)) * double(ceil_div(K, KC)) * double(MC * KC * sizeof(S)); }
  void operator()(block_ctx& ctx) const {
    const auto idx = ctx.block_index3();
    pack(idx[0], idx[1]);
  }
  // The tile of row slab s, K chunk c.
  void pack(std::size_t s, std::size_t c) const {
    const std::size_t m0 = s * MC, k0 = c * KC;
    staged<S, MC, KC, typename Cfg::a_layout> t(out + (s * chunks + c) * MC * KC);
    load(A.template tile_at<MC, KC>(m0, k0), t, tile_extent{std::min(MC, A.rows() - m0), std::min(KC, A.cols() - k0)});
  }
};

// Skinny bf16 GEMM (M <= 3, row-major A and B): each block owns 128 columns of C and streams its
// strip of B once, in place. Bound by reading B, so no packing and no pair layout.
template <class TC, class Chain>
struct gemm_rows_program {
  std::size_t M, N, K, batch;
  tensor<const bf16, 2> A, B;
  tensor<TC, 2> C;
  std::size_t sa, sb, sc;
  float alpha, beta;
  Chain ep;
  kernel_cost cost(const grid&) const {
    return {2.0 * double(M) * N * K * batch, (double(M) * K + double(K) * N) * 2.0 + double(M) * N * sizeof(TC), math_precision::bf16};
  }
  void operator()(block_ctx& ctx) const {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const auto idx = ctx.block_index3();
    const std::size_t n0 = idx[0] * 128, z = idx[2];
    const int n = static_cast<int>(std::min<std::size_t>(128, N - n0));
    alignas(64) float acc[3 * 128];
    const auto* a = reinterpret_cast<const std::uint16_t*>(A.data() + z * sa);
    const auto* b = reinterpret_cast<const std::uint16_t*>(B.data() + z * sb + n0);
    const std::size_t lda = A.row_stride(), ldb = B.row_stride();
    switch (M) {
      case 1: arch::avx512_rows_bf16_f32<1>::run(a, lda, b, ldb, K, n, acc, 128); break;
      case 2: arch::avx512_rows_bf16_f32<2>::run(a, lda, b, ldb, K, n, acc, 128); break;
      default: arch::avx512_rows_bf16_f32<3>::run(a, lda, b, ldb, K, n, acc, 128); break;
    }
    TC* c = C.data() + z * sc + n0;
    detail::store_rows<TC>(acc, 128, M, static_cast<std::size_t>(n), c, C.row_stride(), 1, 0, n0, epilogue::alpha_beta(alpha, beta) | ep);
#else
    (void)ctx;
#endif
  }
};

inline constexpr std::size_t skinny_rows_max = 48;

// Skinny bf16 GEMM (M <= skinny_rows_max, row-major B): bound by reading B once, and B streams
// from memory fastest in whole rows (strips of a few hundred bytes per row run at half the
// bandwidth here). So a launch has about one block per worker, each owning W columns of C for
// all M rows (accumulators in L1/L2) and walking its strip of B in K chunks of 128-256 KiB, row
// by row, with the next chunk requested while the current one computes. M <= 2 reads B in place
// with the rows atom; more rows run the in-place pair atom (K pairs formed in registers) per
// group of <= 12 rows. Each element of C is one chain in K order fixed by KC alone (a function of
// the shape), so the result does not depend on W or on the thread count.
template <class TC, class Chain>
struct gemm_skinny_program {
  // max_w: widest block for M > 2 (2048 columns: the chunk being computed, the next one being
  // fetched and the (M,W) accumulators fit one 1 MiB L2; 4096 for 1 thread overflowed it,
  // 2.2 -> 1.5 ms). kc_w: the width KC is derived from (fixed, so KC follows the shape only).
  static constexpr std::size_t rows_per_group = 12, max_w = 2048, rows_max_w = 4096, kc_w = 4096, chunk_words = 262144;
  std::size_t M, N, K, batch;
  tensor<const bf16, 2> A, B;
  tensor<TC, 2> C;
  std::size_t sa, sb, sc;
  float alpha, beta;
  Chain ep;
  std::size_t W = 0;  // columns per block (multiple of 32)

  // K rows per chunk. The pair atom rounds once per chunk (c + chunk sum), so for M > 2 the chunk
  // depends on the shape only, never on the worker count; the rows atom (M <= 2) carries its
  // accumulators across chunks exactly, so its chunk follows the block width (~128 KiB of B).
  std::size_t kc() const {
    if (M <= 2) return std::clamp<std::size_t>(65536 / W / 16 * 16, 16, 256);
    const std::size_t w = std::min(kc_w, ceil_div(N, 32) * 32);
    return std::clamp<std::size_t>(chunk_words / w / 16 * 16, 16, 256);
  }
  static std::size_t block_cols(std::size_t M, std::size_t N, unsigned workers) {
    const std::size_t nblk = std::max<std::size_t>(std::max(1u, workers), ceil_div(N, M <= 2 ? rows_max_w : max_w));
    return ceil_div(ceil_div(N, nblk), 32) * 32;
  }
  kernel_cost cost(const grid&) const {
    return {2.0 * double(M) * N * K * batch, (double(M) * K + double(K) * N) * 2.0 + double(M) * N * sizeof(TC), math_precision::bf16};
  }
  void operator()(block_ctx& ctx) const {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const auto idx = ctx.block_index3();
    const std::size_t n0 = idx[0] * W, z = idx[2];
    const std::size_t n = std::min(W, N - n0);
    const std::size_t KC = kc();
    const std::size_t ldc = W + 16;                             // rows of acc not a multiple of 4 KiB apart (L1 sets)
    float* acc = ctx.scratch().allocate_array<float>(M * ldc);  // (M,W)
    // (with K = 0, A and B may be null: no offsets are applied to them then)
    const auto* b = K ? reinterpret_cast<const std::uint16_t*>(B.data() + z * sb + n0) : nullptr;
    const auto* a = K ? reinterpret_cast<const std::uint16_t*>(A.data() + z * sa) : nullptr;
    const std::size_t ldb = B.row_stride();
    // A's K-pairs must be adjacent for the rows atom's broadcasts (a transposed A is staged per
    // chunk); the pair atom gets A staged per chunk as K-pair panels per row group
    const std::size_t lds = KC + 32;
    std::uint16_t* as = ctx.scratch().allocate_array<std::uint16_t>(M * lds);  // (M,KC)
    auto chunk_a = [&](std::size_t k0, std::size_t kv) -> std::pair<const std::uint16_t*, std::size_t> {
      if (A.col_stride() == 1) return {a + k0, A.row_stride()};
      for (std::size_t i = 0; i < M; ++i)
        for (std::size_t kk = 0; kk < kv; ++kk) as[i * lds + kk] = a[i * A.row_stride() + (k0 + kk) * A.col_stride()];
      return {as, lds};
    };
    // requests the next chunk (rows k0+KC..) row by row, `lines` cache lines at a time
    const std::size_t row_lines = ceil_div(n * 2, 64);
    std::size_t pf_row = 0, pf_line = 0, pf_end = 0;
    auto prefetch_next = [&](std::size_t lines) {
      for (; lines > 0 && pf_row < pf_end; --lines) {
        __builtin_prefetch(b + pf_row * ldb + pf_line * 32);
        if (++pf_line == row_lines) pf_line = 0, ++pf_row;
      }
    };
    for (std::size_t k = 0; k < std::min(K, std::size_t{4}); ++k)
      for (std::size_t l = 0; l < row_lines; ++l) __builtin_prefetch(b + k * ldb + l * 32);
    if (K == 0) std::fill_n(acc, M * ldc, 0.0f);
    constexpr std::size_t SW = 128;  // columns per rows-atom call
    const std::size_t groups = ceil_div(M, rows_per_group), R = ceil_div(M, groups);
    // lines of the next chunk per K-pair step of an atom call: (KC * n/32 lines) / (groups * n/32 calls * KC/2 steps)
    const std::size_t pf_step = groups == 1 ? 2 : 1;
    std::uint16_t* cb = M <= 2 ? nullptr : ctx.scratch().allocate_array<std::uint16_t>(32 * KC + 64);  // (KC,32) panel copy
    for (std::size_t k0 = 0; k0 < K; k0 += KC) {
      const std::size_t kv = std::min(KC, K - k0);
      pf_row = std::min(K, k0 + KC), pf_line = 0, pf_end = std::min(K, k0 + 2 * KC);
      const std::size_t calls = M <= 2 ? ceil_div(n, SW) : ceil_div(n, 32) * groups;
      const std::size_t per_call = ceil_div((pf_end - pf_row) * row_lines, calls);
      if (M <= 2) {
        const auto [ak, lda] = chunk_a(k0, kv);
        for (std::size_t s0 = 0; s0 < n; s0 += SW) {
          arch::rows_args p;
          p.a = ak;
          p.lda = lda;
          p.b = b + k0 * ldb + s0;
          p.ldb = ldb;
          p.k = kv;
          p.n = static_cast<int>(std::min(SW, n - s0));
          p.c = acc + s0;
          p.ldc = ldc;
          p.accumulate = k0 > 0;
          arch::run_rows_of<arch::avx512bf16_rows_dot_bf16bf16f32<2, 4>>(static_cast<int>(M), p);
          prefetch_next(per_call);
        }
      } else {
        // A of this chunk as K-pair panels per group (pair q, row i at 2*(q*rows + i)): the atom
        // broadcasts from fixed offsets instead of computing M row addresses. Then every group of
        // <= 12 rows runs on each 32-column panel of the chunk (fetched into L2 row by row during
        // the previous chunk) with the in-place pair atom, which pairs rows k, k+1 in registers
        // exactly as packing did (same bits). The first group reads B where it lies and leaves a
        // copy of the panel in a contiguous (KC,32) buffer that the other groups read from L1: a
        // panel's KC lines of B, 2*ldb bytes apart, share one L1 set when ldb is a multiple of
        // 2 KiB, so a second walk of them came from L2 again. M=16, N=K=4096, side by side with
        // the packing version in one process: 2 threads 1.0 -> 0.78-0.80 ms, 1 thread 2.2 ->
        // 1.5 ms (with max_w). Prefetches of the next chunk are spread one or two per K step
        // inside the atoms (no prefetch: +28%; more prefetches per step, or of the current chunk
        // a few steps ahead, were slower).
        const std::size_t kp = ceil_div(kv, 2);
        for (std::size_t r0 = 0; r0 < M; r0 += R) {
          const std::size_t rows = std::min(R, M - r0);
          std::uint16_t* dst = as + r0 * lds;
          const std::size_t rs = A.row_stride(), cs = A.col_stride();
          if (cs == 1 && kv % 2 == 0) {  // whole pairs: one 32-bit copy each
            for (std::size_t i = 0; i < rows; ++i) {
              const std::uint16_t* src = a + (r0 + i) * rs + k0;
              for (std::size_t q = 0; q < kp; ++q) std::memcpy(dst + 2 * (q * rows + i), src + 2 * q, 4);
            }
            continue;
          }
          for (std::size_t i = 0; i < rows; ++i) {
            const std::uint16_t* src = a + (r0 + i) * rs + k0 * cs;
            for (std::size_t q = 0; q < kp; ++q) {
              dst[2 * (q * rows + i)] = src[2 * q * cs];
              dst[2 * (q * rows + i) + 1] = 2 * q + 1 < kv ? src[(2 * q + 1) * cs] : std::uint16_t{0};
            }
          }
        }
        for (std::size_t u = 0; u * 32 < n; ++u) {
          for (std::size_t r0 = 0; r0 < M; r0 += R) {
            arch::inplace_pairs_args p;
            p.a = as + r0 * lds;
            p.b = r0 == 0 ? b + k0 * ldb + 32 * u : cb;
            p.ldb = r0 == 0 ? ldb : 32;
            p.copy_out = r0 == 0 && groups > 1 ? cb : nullptr;
            p.k = kv;
            p.n = static_cast<int>(std::min<std::size_t>(32, n - 32 * u));
            p.c = acc + r0 * ldc + 32 * u;
            p.ldc = ldc;
            p.accumulate = k0 > 0;
            if (pf_row < pf_end) {
              const std::size_t take = std::min({per_call, pf_step * kp, row_lines - pf_line});
              p.prefetch = reinterpret_cast<const char*>(b + pf_row * ldb + pf_line * 32);
              p.prefetch_lines = take;
              if ((pf_line += take) == row_lines) pf_line = 0, ++pf_row;
            }
            const int rows = static_cast<int>(std::min(R, M - r0));
            if (pf_step == 1)
              arch::run_rows_of<arch::avx512bf16_dot_inplace_bf16bf16f32<12, 1>>(rows, p);
            else
              arch::run_rows_of<arch::avx512bf16_dot_inplace_bf16bf16f32<12, 2>>(rows, p);
            prefetch_next(per_call - p.prefetch_lines);
          }
        }
      }
    }
    if (M > 2 && K > 0)
      for (std::size_t i = 0; i < M; ++i) arch::unscramble_pairs32(acc + i * ldc, ceil_div(n, 32));
    TC* c = C.data() + z * sc + n0;
    detail::store_rows<TC>(acc, ldc, M, n, c, C.row_stride(), 1, 0, n0, epilogue::alpha_beta(alpha, beta) | ep);
#else
    (void)ctx;
#endif
  }
};

// Split K: C = alpha·(P_0 + P_1 + ... + P_{s-1}) + beta·C, then the chain, the partials added in
// split order (the same bits whatever the worker count); blocks own rows of C.
template <class TC, class Chain>
struct gemm_splitk_reduce {
  static constexpr std::size_t rows_per_block = 8;
  float* P;  // splits x (M,N), row-major, summed into P_0 in place
  std::size_t M, N, splits;
  tensor<TC, 2> C;
  float alpha, beta;
  Chain ep;
  kernel_cost cost(const grid&) const {
    return {double(M) * N * double(splits), double(M) * N * (double(splits) * 4 + sizeof(TC) * (beta != 0 ? 2 : 1)), math_precision::f32};
  }
  void operator()(block_ctx& ctx) const {
    const std::size_t m0 = ctx.block_index3()[0] * rows_per_block, rows = std::min(rows_per_block, M - m0);
    const std::size_t ps = M * N;
    for (std::size_t i = m0; i < m0 + rows; ++i) {
      float* v = P + i * N;
      for (std::size_t s = 1; s < splits; ++s) {
        const float* p = P + s * ps + i * N;
        for (std::size_t j = 0; j < N; ++j) v[j] += p[j];
      }
    }
    detail::store_rows<TC>(P + m0 * N, N, rows, N, C.data() + m0 * C.row_stride(), C.row_stride(), C.col_stride(), m0, 0,
                           epilogue::alpha_beta(alpha, beta) | ep);
  }
};

// A narrow product computed as its transpose (see gemm_launch): C = alpha·Wᵀ + beta·C, then the
// chain, W the (N,M) accumulators; blocks own rows of C, each gathered from W's columns.
template <class TC, class Chain>
struct gemm_transposed_store {
  static constexpr std::size_t rows_per_block = 64;
  const float* W;
  std::size_t M, N;
  tensor<TC, 2> C;
  float alpha, beta;
  Chain ep;
  kernel_cost cost(const grid&) const { return {double(M) * N, double(M) * N * (4 + sizeof(TC) * (beta != 0 ? 2 : 1)), math_precision::f32}; }
  void operator()(block_ctx& ctx) const {
    const std::size_t m0 = ctx.block_index3()[0] * rows_per_block, rows = std::min(rows_per_block, M - m0);
    float* t = ctx.scratch().allocate_array<float>(rows * N);
    for (std::size_t j = 0; j < N; ++j)
      for (std::size_t i = 0; i < rows; ++i) t[i * N + j] = W[j * M + m0 + i];
    detail::store_rows<TC>(t, N, rows, N, C.data() + m0 * C.row_stride(), C.row_stride(), C.col_stride(), m0, 0,
                           epilogue::alpha_beta(alpha, beta) | ep);
  }
};

// K rows per split, or 0 for no split: a function of the shape only (never of the worker count),
// so a shape's bits are the same on any device. Splits when C has few (MC,NB) tiles to share out
// and K is deep enough for two splits of at least 1024 (and whole K chunks); at most 8 splits.
template <class TA, class TB>
std::size_t gemm_k_split(std::size_t M, std::size_t N, std::size_t K) {
  using cfg = gemm_config<TA, TB>;
  constexpr std::size_t few_tiles = 8, min_split = 1024, max_splits = 8;
  if (ceil_div(M, cfg::MC) * ceil_div(N, cfg::NB) >= few_tiles) return 0;
  const std::size_t s = ceil_div(std::max(ceil_div(K, max_splits), min_split), cfg::KC) * cfg::KC;
  return K >= 2 * s ? s : 0;
}

// Whether a narrow product runs as its transpose, Cᵀ = op(B)ᵀ·op(A)ᵀ (C's rows at least 4 times
// its columns). The f32 GEMM atom is 64 columns wide, so 8 columns of C computed 56 zeros
// (4096x8x4096 f32 NN: 13.6 GFLOP/s on 1 thread, 18.7 swapped), and a transposed A in a single
// column block is gathered inside the block, while swapped it is the row-major B operand (TN
// 4096x8x4096: 5.3 -> 25; 4096x64x4096: 42 -> 75; 1024x128x1024: 62 -> 93). With a row-major A the
// swap packs the large operand from a transposed source, which pays only below 32 columns of f32
// (N=30: 51 -> 73, N=32: 54 -> 49, N=64: 108 -> 68) and never for bf16, whose pair atom is 32
// columns wide (NN 4096x16x4096: 94 -> 68; TN: 22 -> 76, TN 4096x64x4096: 69 -> 140). Swapping the operands' roles keeps every element's
// chain (fma(a, b, c) = fma(b, a, c), the same K chunks added into the accumulators in the same
// order), so the bits are the same; only products on the plain packed path (not skinny, no split K
// either way) qualify. A function of the shape and layout; a plan may say otherwise.
template <class TA, class TB>
bool gemm_swappable(std::size_t M, std::size_t N, std::size_t K) {
  return M > gemm_config<TA, TB>::skinny_max_m && gemm_k_split<TA, TB>(M, N, K) == 0 && gemm_k_split<TB, TA>(N, M, K) == 0;
}
template <class TA, class TB>
bool gemm_swap_narrow(std::size_t M, std::size_t N, std::size_t K, bool a_transposed) {
  return (a_transposed ? N <= 128 : (!gemm_config<TA, TB>::traits::pair && N < 32)) && M >= 4 * N && gemm_swappable<TA, TB>(M, N, K);
}

// Row blocks of an M-row product before any split for the workers: blocks of up to 2·MB_max rows
// when a block holds one (MC,NB) slab of accumulators (the resident program), MB_max otherwise
// (scaled and skinny programs hold the whole (MB,NB) block).
template <class Cfg>
std::size_t gemm_row_blocks(std::size_t M, bool resident) {
  return ceil_div(M, resident ? 2 * Cfg::MB_max : Cfg::MB_max);
}
// Rows per block for `mblocks` blocks: whole MC slabs.
template <class Cfg>
std::size_t gemm_block_rows(std::size_t M, std::size_t mblocks) {
  return ceil_div(ceil_div(M, mblocks), Cfg::MC) * Cfg::MC;
}

// Row blocks shared out over `workers`: from `base` blocks, 2, 3 and 4 times as many are tried
// (blocks of at least MC rows), each block's work taken as its rows times its columns, both
// rounded up to the atom's tile (the last row and column blocks are short, but a 4-column block
// still runs NR-wide atoms), and the blocks handed out in launch order (rows fastest) to the
// first free worker, as the executor does. The count whose last worker finishes earliest, relative
// to a perfect share, wins; more blocks must win by 2% (each one packs its B strip again).
// (Counting blocks alone missed ragged blocks: 384^3 f32 on 2 workers made one 384x256 and one
// 384x128 block, 0.75 of a perfect share; 4 blocks reach 0.96.) Never changes an element's arithmetic.
template <class Cfg>
std::size_t gemm_balanced_row_blocks(std::size_t M, std::size_t N, std::size_t layers, unsigned workers, std::size_t base) {
  const std::size_t w = std::max(1u, workers), cblocks = ceil_div(N, Cfg::NB);
  // (16 or more blocks per worker share well however ragged the last ones are)
  if (w == 1 || M == 0 || N == 0 || layers == 0 || base * cblocks * layers >= 16 * w) return base;
  auto share = [&](std::size_t mbk) {
    const std::size_t MB = gemm_block_rows<Cfg>(M, mbk), rblocks = ceil_div(M, MB);
    std::priority_queue<double, std::vector<double>, std::greater<>> free_at;  // each worker's finish time, earliest on top
    for (std::size_t k = 0; k < w; ++k) free_at.push(0.0);
    double total = 0, last = 0;
    for (std::size_t z = 0; z < layers; ++z)
      for (std::size_t j = 0; j < cblocks; ++j)
        for (std::size_t i = 0; i < rblocks; ++i) {
          const double rows = double(ceil_div(std::min(MB, M - i * MB), Cfg::MR) * Cfg::MR);
          const double work = rows * double(ceil_div(std::min(Cfg::NB, N - j * Cfg::NB), Cfg::NR) * Cfg::NR);
          const double done = free_at.top() + work;
          free_at.pop();
          free_at.push(done);
          total += work;
          last = std::max(last, done);
        }
    return total / (double(w) * last);
  };
  std::size_t best = base;
  double best_share = share(base);
  for (std::size_t f = 2; f <= 4; ++f) {
    const std::size_t mbk = f * base;
    if (ceil_div(M, mbk) < Cfg::MC) break;
    if (const double s = share(mbk); s > best_share * 1.02) best = mbk, best_share = s;
  }
  return best;
}

// Whether a transposed A is packed once for all of C's column blocks (gemm_pack_a_program) rather
// than by each block: when C has more column blocks than there are workers to share them and the
// packed tiles take at most twice A's size plus 4 MiB. Per-block packing makes each worker pack A's
// rows (column blocks / workers) times, cache-hot and overlapped with its products; packing once
// packs them once but adds a launch that writes and rereads the whole panel. With no more column
// blocks than workers, per-block packing costs a worker no more packing and wins (2 workers, TN
// f32 with N = 512 = 2 column blocks: 2048x512x512 239 -> 319 GFLOP/s, 512x512x2048 275 -> 375,
// 1408x512x2048 284 -> 367, 8192x512x1024 331 -> 353 on Zen 5); one worker packs once from 2
// column blocks as before. `workers`: the device's (1 where products share them: gemm_grouped).
// A pure copy either way: the bits never depend on it.
template <class TA, class TB>
bool gemm_pack_a_once(const tensor<const TA, 2>& A, std::size_t N, unsigned workers) {
  using cfg = gemm_config<TA, TB>;
  const std::size_t M = A.rows(), K = A.cols();
  return A.row_stride() == 1 && A.col_stride() != 1 && K > 1 && ceil_div(N, cfg::NB) > std::max(1u, workers) &&
         gemm_pack_a_program<TA, cfg>::bytes(M, K) <= 2.0 * double(M) * double(K) * sizeof(TA) + double(4 << 20);
}

// A workspace from the device's caching pool, returned when the scope ends, after the device has
// finished every launch that reads it (also when a launch throws). Null: nothing to return.
template <class Dev>
struct device_workspace {
  Dev& d;
  void* p;
  device_workspace(Dev& dev, void* ptr) : d(dev), p(ptr) {}
  device_workspace(const device_workspace&) = delete;
  device_workspace& operator=(const device_workspace&) = delete;
  ~device_workspace() {
    if (!p) return;
    d.synchronize();
    d.deallocate(p);
  }
};

// Runs one launch of the GEMM. On the host, a launch that one thread would run anyway (a
// 1-thread device, a single block: executor::run) or too small to share runs on the calling
// thread alone (host_device::launch_here): sharing it with a pool worker costs a wake-up and the
// wait for the worker's last block (tens of us, far more on a loaded machine), more than a 64^3
// product. The same blocks run the same arithmetic, so the bits do not change. A plan may ask for
// the calling thread at any size.
// A product of a few rows that streams B once (skinny dots and rows: a decode step's x·Wᵀ) is
// bound by reading B, at one core's read bandwidth when it is not shared; since the calling thread
// computes beside the pool (executor::run), sharing one costs a notify and at most one block's
// tail, so those are shared from 1 MFLOP (B of 0.5M elements). Measured on decode, 2 threads,
// batch 1 (bench_model BM_decode, the threshold for every product set to 4, 1 and 0.3 MFLOP, two
// alternated rounds): the small Llama 1096, 1376 -> 1787, 1665 (0.3: 2047, 1591) tokens/s, the
// 160M one 160, 131 -> 199, 177 (0.3: 179, 166); batch 4 unchanged within noise. This rule as it
// stands (skinny products only), against 4 MFLOP for all: the 160M one 132, 131 -> 148, 154.
inline constexpr double gemm_share_min_flops = 4e6;
inline constexpr double gemm_share_min_flops_streaming = 1e6;

// The products gemm_fused gathers on this thread (see there): each one launch's grid, its program
// behind a type-erased block body, and its cost, in the order they were issued.
struct gemm_gathered {
  grid g;
  std::size_t first = 0;  // its first block in the gathered launch
  kernel_cost cost;
  std::function<void(block_ctx&)> body;
  std::function<std::string()> shape;
};
struct gemm_gather {
  const void* dev = nullptr;  // the device whose launches are gathered
  std::vector<gemm_gathered> items;
  std::size_t blocks = 0;
  double flops = 0.0;
};
inline thread_local gemm_gather* gemm_gather_here = nullptr;

// The gathered products as one launch: block b runs the block b - first of the product holding
// it, with that product's grid, so each computes what its own launch would have.
struct gemm_gathered_program {
  std::shared_ptr<const std::vector<gemm_gathered>> items;
  std::string shape() const {
    std::string s = "gathered x " + std::to_string(items->size());
    for (const gemm_gathered& x : *items)
      if (x.shape) s += "; " + x.shape();
    return s;
  }
  kernel_cost cost(const grid&) const {
    kernel_cost c;
    for (const gemm_gathered& x : *items) {
      c.flops += x.cost.flops;
      c.bytes += x.cost.bytes;
      c.precision = x.cost.precision;
    }
    return c;
  }
  void operator()(block_ctx& ctx) const {
    const std::size_t b = ctx.block_linear();
    const auto it = std::upper_bound(items->begin(), items->end(), b, [](std::size_t v, const gemm_gathered& x) { return v < x.first; }) - 1;
    block_ctx sub(it->g, b - it->first, ctx.worker_id(), ctx.num_workers(), ctx.scratch());
    it->body(sub);
  }
};

// `streaming`: a product of a few rows that streams its B once (above); gemm_fused gathers those
// of its device on its thread instead of launching them.
template <class Dev, class P>
void gemm_run(Dev& dev, const grid& g, const P& prog, double flops, bool calling_thread = false, bool streaming = false) {
  if (gemm_gather* gs = gemm_gather_here; streaming && gs && gs->dev == static_cast<const void*>(&dev) && g.size() > 0) {
    gemm_gathered x;
    x.g = g;
    x.first = gs->blocks;
    if constexpr (costed_program<P>) x.cost = static_cast<kernel_cost>(prog.cost(g));
    x.body = [prog](block_ctx& ctx) { prog(ctx); };
    if constexpr (profiler::detail::has_shape_function<P>) x.shape = [prog] { return std::string(prog.shape()); };
    gs->items.push_back(std::move(x));
    gs->blocks = add_checked(gs->blocks, g.size(), "gemm_fused blocks");
    gs->flops += flops;
    return;
  }
  if constexpr (std::is_same_v<Dev, host_device>) {
    if (flops < (streaming ? gemm_share_min_flops_streaming : gemm_share_min_flops) || calling_thread) return dev.launch_here(g, prog);
  }
  dev.launch(g, prog);
}

// Tiny products: below direct_max_macs multiply-adds (M·N·K per matrix) a product costs less
// than packing its operands into (KC,NB) tiles and setting up their blocks, so it is computed from
// the operands where they lie with the direct atoms: a B with unit column stride is read by rows
// (A broadcast, any strides), a transposed B against a row-major A by dot products (when K fills
// vectors), and any other B is first copied into a row-major f32 buffer. Operands that are not f32
// are widened (exactly) into f32 buffers in their stored order. Each block computes whole matrices
// of a batch; the launch of a small total runs on the calling thread (gemm_run). The path and its
// arithmetic depend on the shape and strides only, so the bits never depend on the thread count.
// The thresholds are measured by bench_gemm's gemm_direct cases (direct against packed in one
// loop, 1 thread, 3 runs): f32 direct was 1.2-4x the packed path's speed from 4^3 to 96^3 (every
// transpose; the f32 atoms' peak is the same, the direct path only skips packing), and 2^20 keeps
// every direct product under the 4 MFLOP below which a launch runs on the calling thread anyway.
// bf16 direct (widened to f32) lost to the pair atoms from 40^3 on (NN 0.95, 96^3 0.7) and, for M
// <= 8 with a row-major B, to the skinny rows path (0.2-0.7), which keeps those.
struct gemm_tuning {
  double direct_max_macs = 1 << 20;        // f32 and fp16 inputs (f32 atoms)
  double direct_max_macs_pair = 1 << 15;   // bf16 and FP8 inputs (pair atoms)
  std::size_t direct_max_k = 16;           // any size this shallow
  std::size_t direct_dot_min_k = 32;       // a transposed B is read by dot products from this depth
  std::size_t direct_dot_max_m = 16;       // a transposed B: dot products in place up to this many rows
  std::size_t direct_dot_copy_max_m = 16;  // a transposed A this short (whole matrix) is copied into rows for dot products
  std::size_t direct_narrow_max_n = 4;     // C this narrow (matrix-vector-like) takes the direct path at any size
  // ... and this narrow for f32 with a row-major A: dot products of A's rows beat the packed path's
  // 32-column atom on 5-8 columns (NN f32 1 thread: 4096x8x4096 19 -> 36 GFLOP/s, 2048x6x1024 27 -> 64,
  // 1000x7x300 35 -> 70, 8192x5x512 24 -> 45; a transposed A keeps its swapped path, 2-5x faster there)
  std::size_t direct_narrow_max_n_f32_rows = 8;
  std::size_t direct_gemv_max_m = 2;  // f32: B read in place (by rows, or Bᵀ rows by dots) up to this many rows
  // C this narrow from a column-major A (direct path, A of 16 rows or more) is computed as Cᵀ = Bᵀ·Aᵀ,
  // vectorized along M: TN f32 1 thread 210x5x220 32 -> 73 GFLOP/s, 300x12x200 84 -> 100; from 14
  // columns on, C's rows fill most of a vector and the transposed store costs more (500x15x100: 98 -> 94)
  std::size_t direct_col_major_max_n = 12;
  // f32 with a row-major B: A's rows against B read in place by rows (C's columns shared out) up
  // to this many rows, where packing B costs more than the product saves (NN 1 thread: 8x1000x2048
  // 62 -> 107 GFLOP/s, 12x3000x1000 65 -> 105); see gemm_direct_rows_few
  std::size_t direct_rows_max_m = 16;
  // bf16 with a row-major B of at most this many elements (128 KiB, L2-resident while every row
  // group reads it) and at least 64 columns (the pair-rows atom's width): the direct path at any
  // size and depth, A's pairs broadcast against B's rows paired in registers, with no packing of A
  // (1 thread: NN 3136x64x64 153 -> 202 GFLOP/s, 2000x1024x64 145 -> 192, 256x256x128 182 -> 206,
  // TN 2000x1024x32 102 -> 156; a larger B loses: 256x4096x64 147 -> 100, 2000x1024x128 170 -> 163)
  std::size_t direct_pair_rows_max_kn = std::size_t{1} << 16;
  std::size_t direct_pair_rows_min_n = 64;
};
inline gemm_tuning& gemm_tune() {
  static gemm_tuning t;
  return t;
}

// Whether an f32 product of M rows (more than direct_gemv_max_m) reads a row-major B (ldb elements
// apart) in place by rows: up to direct_rows_max_m rows when B's rows are not a multiple of 4 KiB
// apart. Rows that are share a few cache sets and evict each other before the next pass over B's
// column strip (16x4096x1024: 43 GFLOP/s in place, 67 packed; 6x2048x2048: 41 and 47).
inline bool gemm_direct_rows_few(std::size_t M, std::size_t ldb) { return M <= gemm_tune().direct_rows_max_m && (ldb * sizeof(float)) % 4096 != 0; }

template <class TA, class TB, class TC, class Chain>
struct gemm_direct_program {
  std::size_t M, N, K, batch;
  tensor<const TA, 2> A;  // (M,K) view of batch 0
  tensor<const TB, 2> B;  // (K,N)
  tensor<TC, 2> C;        // (M,N)
  std::size_t sa, sb, sc;
  const TA* const* a_ptrs;
  const TB* const* b_ptrs;
  TC* const* c_ptrs;
  Chain chain;            // alpha, beta and the epilogue
  std::size_t per_block;  // matrices per block
  std::size_t dot_min_k;
  bool plain;                       // f32 C, alpha 1, beta 0, no epilogue: the atoms write C
  std::size_t rows_per_block = 0;   // one matrix (batch 1) split by rows of C, or 0: whole matrices
  std::size_t cols_per_block = 0;   // one matrix (batch 1) split by columns of C (when rows_per_block is 0)
  std::size_t dot_copy_max_m = 0;   // a transposed A of at most this many rows (whole matrix) is copied into rows for dots
  std::size_t col_major_max_n = 0;  // C at most this narrow (whole matrix) from a column-major A: computed as Cᵀ = Bᵀ·Aᵀ

  // For the profiler's trace: the product's shape.
  std::string shape() const { return detail::gemm_shape(M, N, K) + (batch > 1 ? std::string(" x batch ") + std::to_string(batch) : std::string()); }

  kernel_cost cost(const grid&) const {
    kernel_cost c;
    c.flops = 2.0 * double(M) * double(N) * double(K) * double(batch);
    c.bytes = (double(M) * K * sizeof(TA) + double(K) * N * sizeof(TB) + double(M) * N * sizeof(TC) * 2) * double(batch);
    c.precision = std::is_same_v<TA, float>
                      ? math_precision::f32
                      : (std::is_same_v<TA, bf16> ? math_precision::bf16 : (std::is_same_v<TA, fp16> ? math_precision::fp16 : math_precision::fp8));
    return c;
  }

  // p + off, where an empty operand (K = 0 leaves A and B with no elements) may be null
  template <class T>
  static T* at(T* p, std::size_t off) {
    return p ? p + off : p;
  }

  void operator()(block_ctx& ctx) const {
    const std::size_t b = ctx.block_index3()[0];
    if (rows_per_block > 0) {  // one matrix, its rows shared out
      const std::size_t i0 = b * rows_per_block, rows = std::min(rows_per_block, M - i0);
      const TA* pa = a_ptrs ? a_ptrs[0] : A.data();
      TC* pc = c_ptrs ? c_ptrs[0] : C.data();
      return one(ctx.scratch(), at(pa, i0 * A.row_stride()), b_ptrs ? b_ptrs[0] : B.data(), at(pc, i0 * C.row_stride()), rows, i0, N, 0);
    }
    if (cols_per_block > 0) {  // one matrix, its columns shared out
      const std::size_t j0 = b * cols_per_block, cols = std::min(cols_per_block, N - j0);
      const TB* pb = b_ptrs ? b_ptrs[0] : B.data();
      TC* pc = c_ptrs ? c_ptrs[0] : C.data();
      return one(ctx.scratch(), a_ptrs ? a_ptrs[0] : A.data(), at(pb, j0 * B.col_stride()), at(pc, j0 * C.col_stride()), M, 0, cols, j0);
    }
    const std::size_t z0 = b * per_block;
    for (std::size_t z = z0; z < std::min(batch, z0 + per_block); ++z) {
      const auto m = ctx.scratch().mark();
      one(ctx.scratch(), a_ptrs ? a_ptrs[z] : at(A.data(), z * sa), b_ptrs ? b_ptrs[z] : at(B.data(), z * sb),
          c_ptrs ? c_ptrs[z] : at(C.data(), z * sc), M, 0, N, 0);
      ctx.scratch().rewind(m);
    }
  }

  // An f32 operand: element (r, c) at p[r*rs + c*cs].
  struct f32_view {
    const float* p;
    std::size_t rs, cs;
  };
  // f32 view of an operand (rows, cols) with X's strides at p: in place when it is f32, else
  // widened into scratch in the order it is stored
  template <class T>
  static f32_view as_f32(scratch_arena& arena, const T* p, const tensor<const T, 2>& X, std::size_t rows, std::size_t cols) {
    if constexpr (std::is_same_v<T, float>) {
      return {p, X.row_stride(), X.col_stride()};
    } else {
      float* buf = arena.allocate_array<float>(rows * cols);
      if (X.row_stride() == 1 && X.col_stride() != 1) {  // column-major
        for (std::size_t c = 0; c < cols; ++c) arch::widen(p + c * X.col_stride(), buf + c * rows, rows);
        return {buf, 1, rows};
      }
      for (std::size_t r = 0; r < rows; ++r) {
        if (X.col_stride() == 1)
          arch::widen(p + r * X.row_stride(), buf + r * cols, cols);
        else
          for (std::size_t c = 0; c < cols; ++c) buf[r * cols + c] = arch::to_f32(p[r * X.row_stride() + c * X.col_stride()]);
      }
      return {buf, cols, 1};
    }
  }

  // Both bf16, A row-major (or a transposed A of at most dot_copy_max_m rows, copied into rows) and
  // B stored as Bᵀ rows: dot products on the bf16 elements in place (vdpbf16ps), no widened copies.
  // A function of the strides, the whole matrix's M and K, never of the split.
  bool bf16_dots() const {
    if constexpr (std::is_same_v<TA, bf16> && std::is_same_v<TB, bf16> && arch::has_direct_dot_bf16_atom)
      return (A.col_stride() == 1 || this->M <= dot_copy_max_m) && B.row_stride() == 1 && K >= dot_min_k;
    else
      return false;
  }

  // Both bf16 and C at least a vector wide (when not read by dots): K-pairs of B's rows by
  // vdpbf16ps with A's pair broadcast (the rows atom), instead of widening both operands to f32 for
  // FMAs (half the multiply-add rate); a transposed B is copied into rows first (K x N, 1/M of the
  // product's work). A function of the strides and the whole matrix's shape, never of the split.
  bool bf16_pair_rows() const {
    if constexpr (std::is_same_v<TA, bf16> && std::is_same_v<TB, bf16> && arch::has_rows_dot_atom)
      return !bf16_dots() && this->N >= 16;
    else
      return false;
  }

  // rows [row0, row0 + M) and columns [col0, col0 + N) of one matrix (pa, pb, pc at that row of A
  // and C and that column of B and C)
  void one(scratch_arena& arena, const TA* pa, const TB* pb, TC* pc, std::size_t M, std::size_t row0, std::size_t N, std::size_t col0) const {
    using rows_atom = arch::best_direct_rows_atom;
    using dot_atom = arch::best_direct_dot_atom;
    // (M,N) accumulators, or C itself when nothing is left to apply (f32, alpha 1, beta 0, no epilogue)
    float* acc = nullptr;
    std::size_t ldc = N;
    if constexpr (std::is_same_v<TC, float>) {
      if (plain) acc = pc, ldc = C.row_stride();
    }
    if (!acc) acc = arena.allocate_array<float>(M * N);
    if (bf16_dots()) {
      arch::direct_dot_bf16_args p;
      p.lda = A.row_stride();
      p.ldb = B.col_stride();
      p.k = K;
      const auto* a16 = reinterpret_cast<const std::uint16_t*>(pa);
      const auto* b16 = reinterpret_cast<const std::uint16_t*>(pb);
      if (A.col_stride() != 1) {  // a transposed A of a few rows, copied into rows (M x K)
        auto* buf = arena.allocate_array<std::uint16_t>(M * K);
        for (std::size_t k = 0; k < K; ++k)
          for (std::size_t i = 0; i < M; ++i) buf[i * K + k] = a16[i * A.row_stride() + k * A.col_stride()];
        a16 = buf, p.lda = K;
      }
      if (M <= 2)
        arch::run_dots<arch::best_direct_dot_bf16_atom_few_rows>(p, a16, b16, M, N, acc, ldc);
      else
        arch::run_dots<arch::best_direct_dot_bf16_atom>(p, a16, b16, M, N, acc, ldc);
      if (acc != static_cast<void*>(pc)) detail::store_rows<TC>(acc, N, M, N, pc, C.row_stride(), C.col_stride(), row0, col0, chain);
      return;
    }
    if constexpr (std::is_same_v<TA, bf16> && std::is_same_v<TB, bf16> && arch::has_rows_dot_atom) {
      if (bf16_pair_rows()) {
        // A's pairs (elements 2q, 2q+1 of a row) are broadcast from its rows: a transposed A is
        // copied into rows first (M x K, 1/N of the product's work). Each element of C is one
        // vdpbf16ps chain over K-pairs from zero, the packed pair atom's order for one K chunk.
        const auto* a16 = reinterpret_cast<const std::uint16_t*>(pa);
        std::size_t lda = A.row_stride();
        if (A.col_stride() != 1) {
          auto* buf = arena.allocate_array<std::uint16_t>(M * K);
          for (std::size_t k = 0; k < K; ++k)
            for (std::size_t i = 0; i < M; ++i) buf[i * K + k] = a16[i * A.row_stride() + k * A.col_stride()];
          a16 = buf, lda = K;
        }
        const auto* b16 = reinterpret_cast<const std::uint16_t*>(pb);
        std::size_t ldb = B.row_stride();
        if (B.col_stride() != 1) {  // a transposed B, copied into rows along its stored rows (K x N)
          auto* buf = arena.allocate_array<std::uint16_t>(K * N);
          for (std::size_t j = 0; j < N; ++j)
            for (std::size_t k = 0; k < K; ++k) buf[k * N + j] = b16[k * B.row_stride() + j * B.col_stride()];
          b16 = buf, ldb = N;
        }
        using Atom = arch::best_rows_dot_bf16_atom;
        arch::rows_args p;
        p.lda = lda;
        p.ldb = ldb;
        p.k = K;
        p.ldc = ldc;
        // column chunks whose B rows stay in L2 (128 KiB), row groups in each (see the f32 sweep below)
        const std::size_t chunk =
            std::max<std::size_t>(Atom::nc, (std::size_t{128} << 10) / (std::max<std::size_t>(K, 1) * sizeof(bf16)) / Atom::nc * Atom::nc);
        for (std::size_t j0 = 0; j0 < N; j0 += chunk)
          for (std::size_t i = 0; i < M; i += Atom::mr) {
            p.a = at(a16, i * lda);  // (null when K = 0)
            for (std::size_t j = j0; j < std::min(N, j0 + chunk); j += Atom::nc) {
              p.n = static_cast<int>(std::min<std::size_t>(Atom::nc, N - j));
              p.b = at(b16, j);
              p.c = acc + i * ldc + j;
              arch::run_rows_of<Atom>(static_cast<int>(std::min<std::size_t>(Atom::mr, M - i)), p);
            }
          }
        if (acc != static_cast<void*>(pc)) detail::store_rows<TC>(acc, N, M, N, pc, C.row_stride(), C.col_stride(), row0, col0, chain);
        return;
      }
    }
    f32_view a = as_f32(arena, pa, A, M, K);
    f32_view b = as_f32(arena, pb, B, K, N);
    // Dot products (A row-major) cost a reduction per element of C (~8 cycles); reading B by rows
    // costs a broadcast of every element of A per 16 columns of C and, for a transposed B, a copy
    // of B (~1 cycle per element). Dots win when K is several times M, or C is narrower than a
    // vector (a GEMV-like N = 1 broadcast A element by element); a B that is not stored as Bᵀ rows
    // is then copied into them.
    // (Copying a row-major B into Bᵀ rows costs more than the product it serves unless C is narrow:
    // a row-major B is read by rows from 16 columns on.)
    // A transposed A of a few rows is copied into rows first (M x K, 1/N of the product's work); "a
    // few" counts the whole matrix's rows (this->M), so every block of a split takes the same branch.
    if ((a.cs == 1 || this->M <= dot_copy_max_m) && K >= dot_min_k && (K >= 8 * M || N < 16) && (b.rs == 1 || N < 16)) {
      if (a.cs != 1) {
        float* buf = arena.allocate_array<float>(M * K);
        for (std::size_t k = 0; k < K; ++k)
          for (std::size_t i = 0; i < M; ++i) buf[i * K + k] = a.p[i * a.rs + k * a.cs];
        a = {buf, K, 1};
      }
      if (b.rs != 1) {  // Bᵀ rows, read along B's stored rows
        float* buf = arena.allocate_array<float>(N * K);
        for (std::size_t k = 0; k < K; ++k)
          for (std::size_t j = 0; j < N; ++j) buf[j * K + k] = b.p[k * b.rs + j * b.cs];
        b = {buf, 1, K};
      }
      arch::direct_dot_args p;
      p.lda = a.rs;
      p.ldb = b.cs;
      p.k = K;
      if (M <= 2 && N > 4)
        arch::run_dots<arch::best_direct_dot_atom_few_rows>(p, a.p, b.p, M, N, acc, ldc);  // (4 columns fit the 4x4 tile)
      else if (N == 1)
        arch::run_dots<arch::best_direct_dot_atom_one_col>(p, a.p, b.p, M, N, acc, ldc);
      else
        arch::run_dots<dot_atom>(p, a.p, b.p, M, N, acc, ldc);
    } else if (a.rs == 1 && a.cs != 1 && this->N <= col_major_max_n && this->M >= 16) {  // (the whole matrix's shape, not the split's)
      // a narrow C from a column-major A (Aᵀ·b-like): Cᵀ = Bᵀ·Aᵀ by the rows atom, Aᵀ's rows being
      // A's stored columns, vectorized along M instead of along C's few columns, in groups of the
      // atom's rows (fma(a, b, c) = fma(b, a, c): each element is the same chain, the same bits)
      float* t = arena.allocate_array<float>(N * M);  // Cᵀ, (N, M)
      arch::direct_rows_args p;
      p.a_rs = b.cs;
      p.a_cs = b.rs;
      p.ldb = a.cs;
      p.k = K;
      p.ldc = M;
      for (std::size_t j = 0; j < M; j += rows_atom::nc) {
        p.n = static_cast<int>(std::min<std::size_t>(rows_atom::nc, M - j));
        p.b = at(a.p, j);
        for (std::size_t r = 0; r < N; r += rows_atom::mr) {
          p.a = at(b.p, r * b.cs);
          p.c = t + r * M + j;
          arch::run_rows_narrow<rows_atom>(static_cast<int>(std::min<std::size_t>(rows_atom::mr, N - r)), p);
        }
      }
      for (std::size_t i = 0; i < M; ++i)
        for (std::size_t j = 0; j < N; ++j) acc[i * ldc + j] = t[j * M + i];
    } else {
      if (b.cs != 1) {  // B into row-major rows, read down its stored columns
        float* buf = arena.allocate_array<float>(K * N);
        for (std::size_t j = 0; j < N; ++j)
          for (std::size_t k = 0; k < K; ++k) buf[k * N + j] = b.p[k * b.rs + j * b.cs];
        b = {buf, N, 1};
      }
      arch::direct_rows_args p;
      p.a_rs = a.rs;
      p.a_cs = a.cs;
      p.ldb = b.rs;
      p.k = K;
      p.ldc = ldc;
      // B's rows 16 ahead requested at each step when it walks far down B: with a long ldb each row
      // is another page, which the hardware's prefetchers do not cross (NN 8x4096x1024 46 -> 63
      // GFLOP/s, 6x2048x2048 29 -> 42)
      p.prefetch_rows = K >= 64 ? 16 : 0;
      // (each element is one FMA chain in k order whatever the atom's width: the same bits)
      // Column chunks whose B rows (K x chunk) stay in L2 (128 KiB), and in each chunk a row group's
      // C rows written left to right: a few long store streams rather than one short burst per row
      // of the block (with columns outermost, a 32-row block wrote 32 rows 256 bytes at a time, and
      // an 8192x2048x16 product wrote C at 4.5 GB/s: 36 GFLOP/s, 63 in this order).
      auto sweep = [&]<class Atom>() {
        const std::size_t chunk =
            std::max<std::size_t>(Atom::nc, (std::size_t{128} << 10) / (std::max<std::size_t>(K, 1) * sizeof(float)) / Atom::nc * Atom::nc);
        for (std::size_t j0 = 0; j0 < N; j0 += chunk)
          for (std::size_t i = 0; i < M; i += Atom::mr) {
            p.a = at(a.p, i * a.rs);  // (null when K = 0)
            for (std::size_t j = j0; j < std::min(N, j0 + chunk); j += Atom::nc) {
              p.n = static_cast<int>(std::min<std::size_t>(Atom::nc, N - j));
              p.b = at(b.p, j);
              p.c = acc + i * ldc + j;
              arch::run_rows_narrow<Atom>(static_cast<int>(std::min<std::size_t>(Atom::mr, M - i)), p);
            }
          }
      };
      // 5-8 rows in one pass of the 8-row atom (B loaded once) rather than two of the 4-row one (the
      // whole matrix's rows: a function of the shape, not of the split)
      using few_rows_atom = arch::best_direct_rows_atom_few_rows;
      if (this->M > std::size_t(rows_atom::mr) && this->M <= std::size_t(few_rows_atom::mr))
        sweep.template operator()<few_rows_atom>();
      else if (this->M <= std::size_t(arch::best_direct_rows_atom_gemv::mr))  // 8 chains per row, not 4 (2x4096x1024 20 -> 30 GFLOP/s)
        sweep.template operator()<arch::best_direct_rows_atom_gemv>();
      else
        sweep.template operator()<rows_atom>();
    }
    if (acc != static_cast<void*>(pc)) detail::store_rows<TC>(acc, N, M, N, pc, C.row_stride(), C.col_stride(), row0, col0, chain);
  }
};

// Throws gemm_error(message()) unless ok. The message is built only on failure: formatting the
// shape into strings on every call cost ~0.5 us, more than a whole 8x8x8 product.
template <class Message>
void gemm_check(bool ok, const Message& message) {
  if (!ok) [[unlikely]]
    throw gemm_error(message());
}

// Validates one operand: (rows, cols) of op(X) stored with leading dimension ld.
template <class Shape>
void gemm_check_operand(const char* name, const void* p, transpose t, std::size_t rows, std::size_t cols, std::size_t ld, const Shape& shape) {
  const std::size_t stored_cols = t == transpose::none ? cols : rows;
  const std::size_t stored_rows = t == transpose::none ? rows : cols;
  gemm_check(ld >= std::max<std::size_t>(stored_cols, 1), [&] {
    return std::string("leading dimension of ") + name + " is " + std::to_string(ld) +
           ", needs >= " + std::to_string(std::max<std::size_t>(stored_cols, 1)) + " for a stored (" + std::to_string(stored_rows) + "," +
           std::to_string(stored_cols) + ") " + name + ", " + shape();
  });
  gemm_check(p != nullptr || rows == 0 || cols == 0, [&] { return std::string("null ") + name + " with non-zero size, " + shape(); });
  (void)detail::span_of(stored_rows, stored_cols, ld, 1);  // overflow check
}

template <class T>
tensor<const T, 2> op_view(const T* p, transpose t, std::size_t rows, std::size_t cols, std::size_t ld) {
  // op(X) is (rows, cols); stored row-major as (rows, cols) or, transposed, (cols, rows)
  return t == transpose::none ? tensor<const T, 2>::strided(p, rows, cols, ld, 1) : tensor<const T, 2>::strided(p, rows, cols, 1, ld);
}

template <class TA, class TB, class TC, class Chain, class Dev>
void gemm_launch(Dev& dev, std::size_t M, std::size_t N, std::size_t K, std::size_t batch, tensor<const TA, 2> A, tensor<const TB, 2> B,
                 tensor<TC, 2> C, std::size_t sa, std::size_t sb, std::size_t sc, const TA* const* ap, const TB* const* bp, TC* const* cp,
                 float alpha, float beta, const gemm_scales& s, const Chain& ep, const gemm_plan* plan_in = nullptr) {
  // plan_in: the transposed half of a swapped product (below): the plain packed program with the
  // outer product's plan, nothing else
  if (!plan_in) gemm_plan_consulted = false, gemm_plan_applied = {};
  // An empty product reads no scales: an empty operand's block scales may be null (an empty vector's data()).
  if (M == 0 || N == 0 || batch == 0) return;
  gemm_check(!(s.a_block == nullptr) == !(s.b_block == nullptr),
             [&] { return "block scales need both a_block and b_block, " + gemm_shape(M, N, K); });
  (void)detail::mul_checked(detail::mul_checked(M, N, "gemm size"), batch, "gemm size");
  (void)detail::mul_checked(detail::mul_checked(M, K, "gemm size"), batch, "gemm size");
  const auto chain = epilogue::detail::as_chain<Chain>::make(ep);
  using chain_t = std::remove_cvref_t<decltype(chain)>;
  const double flops = 2.0 * double(M) * double(N) * double(K) * double(batch);
  // A plan (gemm_tune.hpp) for this exact problem: the tuner's candidate, a cached plan or the
  // heuristic's choices. Only one-matrix unscaled packed products have one.
  auto plan_of = [&] {
    if (plan_in) return *plan_in;
    const gemm_tune_key key{
        dtype_of<TA>, dtype_of<TB>, dtype_of<TC>, A.col_stride() != 1, B.col_stride() != 1, M, N, K, std::max(1u, dev.capabilities().workers)};
    return gemm_plan_lookup(key);
  };
  // Row blocks: the plan's rows per block (whole MC slabs, at most the program's largest block),
  // else the heuristic's count.
  auto block_rows = [&]<class Cfg>(const gemm_plan& plan, std::size_t mblocks) {
    if (plan.block_rows > 0 && plan.block_rows % Cfg::MC == 0 && plan.block_rows <= 2 * Cfg::MB_max)
      return std::min(plan.block_rows, ceil_div(M, Cfg::MC) * Cfg::MC);
    return gemm_block_rows<Cfg>(M, mblocks);
  };
  // whether gemm_run would hand a launch to the workers (for the record of the applied plan)
  auto shares = [&](const grid& g, double f) {
    return !std::is_same_v<Dev, host_device> || (g.size() > 1 && f >= gemm_share_min_flops && dev.capabilities().workers > 1);
  };
  auto run = [&]<bool Scaled, bool Skinny>() {
    using cfg = gemm_config<TA, TB, Skinny>;
    // Unscaled blocks hold one (MC,NB) slab of accumulators, so they may be twice as tall: each
    // block packs its B strip itself, and fewer blocks per strip pack less (2 workers no longer
    // both pack every strip). Rows are split further when that shares the work more evenly
    // among the workers (gemm_balanced_row_blocks). Block shapes never change the arithmetic of an element.
    std::size_t mblocks = gemm_row_blocks<cfg>(M, !Scaled && !Skinny);
    if constexpr (!Scaled && !Skinny) mblocks = gemm_balanced_row_blocks<cfg>(M, N, batch, dev.capabilities().workers, mblocks);
    const gemm_plan plan = !Scaled && !Skinny && batch == 1 && !ap ? plan_of() : gemm_plan{};
    const std::size_t MB = block_rows.template operator()<cfg>(plan, mblocks);
    const grid g{ceil_div(M, MB), ceil_div(N, cfg::NB), batch};
    gemm_program<TA, TB, TC, chain_t, Scaled, Skinny> prog{M, N, K, batch, A, B, C, sa, sb, sc, ap, bp, cp, alpha, beta, s, MB, chain};
    if constexpr (!Scaled && !Skinny) {
      // A transposed A is packed once for all column blocks rather than by each of them (TN
      // 1024^3 on 1 thread: 4 column blocks each repacked all of A; f32 went from 0.80-0.87 of the
      // best peer to 0.97-1.04 on bench_gemm_sweep's TN weight-gradient shapes). When gemm_pack_a_once
      // says so, or a plan does (any transposed A deeper than 1: a pure copy either way).
      const std::size_t slabs = ceil_div(M, cfg::MC), chunks = ceil_div(K, cfg::KC);
      const double ws = gemm_pack_a_program<TA, cfg>::bytes(M, K);
      const bool packable = A.row_stride() == 1 && A.col_stride() != 1 && K > 1;
      const bool pack_once = plan.pack_a < 0 ? gemm_pack_a_once<TA, TB>(A, N, dev.capabilities().workers) : plan.pack_a == 1 && packable;
      gemm_plan_applied = {MB, packable ? int(pack_once) : -1, plan.calling_thread || !shares(g, flops), 0};
      if (batch == 1 && !ap && pack_once) {
        using S = typename cfg::stage;
        S* W = static_cast<S*>(dev.allocate(static_cast<std::size_t>(ws)));
        const device_workspace<Dev> guard{dev, W};  // back to the pool after both launches ran
        gemm_run(dev, grid{slabs, chunks}, gemm_pack_a_program<TA, cfg>{A, W, chunks}, double(M) * double(K), plan.calling_thread);
        prog.a_packed = W;
        prog.a_chunks = chunks;
        gemm_run(dev, g, prog, flops, plan.calling_thread);
        return;
      }
    }
    gemm_run(dev, g, prog, flops, plan.calling_thread);
  };
  // Split K: the partials go to a workspace from the device's caching pool (no page faults
  // after the first call), then one launch adds them in split order into C.
  auto run_split = [&](std::size_t ks) {
    using cfg = gemm_config<TA, TB>;
    const std::size_t splits = ceil_div(K, ks), ps = mul_checked(M, N, "gemm size");
    float* P =
        static_cast<float*>(dev.allocate(mul_checked(mul_checked(ps, splits, "gemm split-K workspace"), sizeof(float), "gemm split-K workspace")));
    const device_workspace<Dev> guard{dev, P};  // back to the pool after both launches ran
    const std::size_t mblocks = gemm_balanced_row_blocks<cfg>(M, N, splits, dev.capabilities().workers, gemm_row_blocks<cfg>(M, true));
    const gemm_plan plan = plan_of();
    const std::size_t MB = block_rows.template operator()<cfg>(plan, mblocks);
    gemm_plan_applied = {MB, -1, plan.calling_thread || !shares(grid{ceil_div(M, MB), ceil_div(N, cfg::NB), splits}, flops), 0};
    gemm_program<TA, TB, float, epilogue::chain<>, false, false> part{
        M, N, K, 1, A, B, tensor<float, 2>::strided(P, M, N, N, 1), 0, 0, ps, nullptr, nullptr, nullptr, 1.0f, 0.0f, gemm_scales{}, MB, {}};
    part.k_split = ks;
    gemm_run(dev, grid{ceil_div(M, MB), ceil_div(N, cfg::NB), splits}, part, flops, plan.calling_thread);
    using R = gemm_splitk_reduce<TC, chain_t>;
    gemm_run(dev, grid{ceil_div(M, R::rows_per_block), 1, 1}, R{P, M, N, splits, C, alpha * s.a * s.b, beta, chain}, double(ps) * double(splits),
             plan.calling_thread);
  };
  if (plan_in) {
    run.template operator()<false, false>();
    return;
  }
  constexpr bool pair_inputs = gemm_config<TA, TB>::traits::pair;
  const double macs = double(M) * double(N) * double(K);
  const double direct_max = pair_inputs ? gemm_tune().direct_max_macs_pair : gemm_tune().direct_max_macs;
  // ... and a shallow matrix of any size (K <= direct_max_k): an outer product or little more is
  // bound by writing C, which the direct atoms do once (the packed path also packs B, sweeps its
  // accumulators and copies them out); its rows are then shared out over blocks
  bool direct = !s.a_block && K > 0 && (macs <= direct_max || (batch == 1 && K <= gemm_tune().direct_max_k));
  if constexpr (std::is_same_v<TA, bf16> && std::is_same_v<TB, bf16> && arch::has_rows_dot_atom)
    if (!s.a_block && batch == 1 && K > 0 && B.col_stride() == 1 && N >= gemm_tune().direct_pair_rows_min_n &&
        double(N) * double(K) <= double(gemm_tune().direct_pair_rows_max_kn))
      direct = true;  // (read by the pair-rows atom: B row-major and C at least 16 wide)
  if constexpr (std::is_same_v<TA, bf16> && std::is_same_v<TB, bf16> && arch::has_rows_dot_atom)
    if (M <= 8 && B.col_stride() == 1 && C.col_stride() == 1 && !ap) direct = false;  // the skinny path streams B faster
  // a skinny bf16 product with a transposed B (dX = dY·W for a few tokens): vdpbf16ps dots read A's
  // rows and Bᵀ's rows in place, C's columns shared out over blocks (each element is one dot, so
  // the bits do not depend on the split)
  bool skinny_dots = false;
  if constexpr (std::is_same_v<TA, bf16> && std::is_same_v<TB, bf16> && arch::has_direct_dot_bf16_atom)
    skinny_dots = !direct && !s.a_block && batch == 1 && !ap && K >= gemm_tune().direct_dot_min_k && M <= gemm_tune().direct_dot_max_m &&
                  (A.col_stride() == 1 || M <= gemm_tune().direct_dot_copy_max_m) && B.row_stride() == 1;
  // an f32 GEMV-like product (a layer's forward or input gradient for a token or two): a row-major
  // B streamed by rows (the rows atom), a transposed one by dot products of A's rows and Bᵀ's rows,
  // C's columns shared out the same way
  if constexpr (std::is_same_v<TA, float> && std::is_same_v<TB, float>)
    skinny_dots = !direct && !s.a_block && batch == 1 && !ap && K > 0 &&
                  ((B.col_stride() == 1 && (M <= gemm_tune().direct_gemv_max_m || gemm_direct_rows_few(M, B.row_stride()))) ||
                   (M <= gemm_tune().direct_dot_max_m && B.row_stride() == 1 && K >= gemm_tune().direct_dot_min_k &&
                    (A.col_stride() == 1 || M <= gemm_tune().direct_dot_copy_max_m)));
  direct = direct || skinny_dots;
  // a narrow C (N <= 4: a matrix times a vector or a few): bound by reading A once, which the
  // direct atoms do in place (f32) or after one widening pass; its rows shared out over blocks
  const std::size_t narrow_max_n = std::is_same_v<TA, float> && std::is_same_v<TB, float> && A.col_stride() == 1
                                       ? std::max(gemm_tune().direct_narrow_max_n, gemm_tune().direct_narrow_max_n_f32_rows)
                                       : gemm_tune().direct_narrow_max_n;
  const bool narrow = !direct && !s.a_block && batch == 1 && !ap && K > 0 && N > 0 && N <= narrow_max_n;
  direct = direct || narrow;
  if (direct) {
    const auto dchain = epilogue::alpha_beta(alpha * s.a * s.b, beta) | chain;
    // matrices per block: about direct_max_macs of work each (a function of the shape only)
    // (an empty product, M or N = 0, has macs = 0: one block of all its matrices, no division)
    const std::size_t per =
        macs > 0.0 ? std::max<std::size_t>(1, static_cast<std::size_t>(std::min(direct_max / macs, double(std::max<std::size_t>(batch, 1)))))
                   : std::max<std::size_t>(batch, 1);
    // batch 1 above the threshold: blocks of about 2^20 multiply-adds of rows (a function of the
    // shape), a multiple of 24 rows (of the rows atoms' 4, 6 and 8)
    const std::size_t rows_pb =
        !skinny_dots && batch == 1 && macs > direct_max ? ceil_div(std::max<std::size_t>(1, (std::size_t{1} << 20) / (N * K)), 24) * 24 : 0;
    // skinny dots: about two blocks per worker, whole 16-column strips
    const std::size_t cols_pb =
        skinny_dots ? std::max<std::size_t>(16, ceil_div(ceil_div(N, 2 * std::max(1u, dev.capabilities().workers)), 16) * 16) : 0;
    const bool plain = chain_t::empty && alpha * s.a * s.b == 1.0f && beta == 0.0f && C.col_stride() == 1;
    gemm_direct_program<TA, TB, TC, std::remove_cvref_t<decltype(dchain)>> prog{
        M, N, K, batch, A, B, C, sa, sb, sc, ap, bp, cp, dchain, per, gemm_tune().direct_dot_min_k, plain, rows_pb, cols_pb};
    prog.dot_copy_max_m = gemm_tune().direct_dot_copy_max_m;
    prog.col_major_max_n = gemm_tune().direct_col_major_max_n;
    gemm_run(dev, grid{rows_pb ? ceil_div(M, rows_pb) : (cols_pb ? ceil_div(N, cols_pb) : ceil_div(batch, per))}, prog, flops, false, skinny_dots);
    return;
  }
  const bool skinny = M <= gemm_config<TA, TB>::skinny_max_m;
  if constexpr (std::is_same_v<TA, bf16> && std::is_same_v<TB, bf16> && arch::has_rows_dot_atom) {
    // skinny: B streamed once in place by the rows atom (any A layout; B row-major)
    if (M <= skinny_rows_max && !s.a_block && !ap && B.col_stride() == 1 && C.col_stride() == 1) {
      using P = gemm_skinny_program<TC, chain_t>;
      const std::size_t w = P::block_cols(M, N, dev.capabilities().workers);
      P prog{M, N, K, batch, A, B, C, sa, sb, sc, alpha * s.a * s.b, beta, chain, w};
      gemm_run(dev, grid{ceil_div(N, w), 1, batch}, prog, flops, false, true);
      return;
    }
  } else if constexpr (std::is_same_v<TA, bf16> && std::is_same_v<TB, bf16> && arch::has_rows_bf16_atom) {
    const bool unit = s.a == 1.0f && s.b == 1.0f;
    if (M <= 3 && !s.a_block && unit && !ap && A.col_stride() == 1 && B.col_stride() == 1 && K > 0) {
      gemm_rows_program<TC, chain_t> prog{M, N, K, batch, A, B, C, sa, sb, sc, alpha, beta, chain};
      gemm_run(dev, grid{ceil_div(N, 128), 1, batch}, prog, flops, false, true);
      return;
    }
  }
  // A narrow C as its transpose (gemm_swap_narrow): Cᵀ = op(B)ᵀ·op(A)ᵀ into a workspace by the
  // packed program with the roles swapped, then alpha, beta and the chain as C's rows are stored.
  if (!s.a_block && batch == 1 && !ap && !skinny && gemm_swappable<TA, TB>(M, N, K)) {
    const gemm_plan plan = plan_of();
    if (plan.swap < 0 ? gemm_swap_narrow<TA, TB>(M, N, K, A.col_stride() != 1) : plan.swap == 1) {
      float* W = static_cast<float*>(dev.allocate(mul_checked(mul_checked(M, N, "gemm size"), sizeof(float), "gemm workspace")));
      const device_workspace<Dev> guard{dev, W};  // back to the pool after both launches ran
      gemm_launch<TB, TA, float>(dev, N, M, K, 1, B.transposed(), A.transposed(), tensor<float, 2>::strided(W, N, M, M, 1), 0, 0, 0, nullptr, nullptr,
                                 nullptr, 1.0f, 0.0f, gemm_scales{}, epilogue::chain<>{}, &plan);
      gemm_plan_applied.swap = 1;
      using T = gemm_transposed_store<TC, chain_t>;
      gemm_run(dev, grid{ceil_div(M, T::rows_per_block)}, T{W, M, N, C, alpha * s.a * s.b, beta, chain}, double(M) * double(N), plan.calling_thread);
      return;
    }
  }
  if (s.a_block)
    run.template operator()<true, false>();
  else if (const std::size_t ks = batch == 1 && !ap ? gemm_k_split<TA, TB>(M, N, K) : 0; ks > 0 && !skinny)
    run_split(ks);
  else if (skinny)
    run.template operator()<false, true>();
  else
    run.template operator()<false, false>();
}

}  // namespace detail

inline namespace v0 {

// BLAS-style row-major GEMM: C(M,N) = alpha·op(A)·op(B) + beta·C, then `ep`.
// op(A) is (M,K): A stored (M,K) with lda >= K, or (K,M) with lda >= M when transposed.
template <class Dev, gemm_input TA, gemm_input TB, gemm_output TC, class Chain = epilogue::chain<>>
void gemm(Dev& dev, transpose ta, transpose tb, std::size_t M, std::size_t N, std::size_t K, float alpha, const TA* A, std::size_t lda, const TB* B,
          std::size_t ldb, float beta, TC* C, std::size_t ldc, const Chain& ep = {}, const gemm_scales& s = {}) {
  const auto shape = [&] { return detail::gemm_shape(M, N, K); };
  detail::gemm_check_operand("A", A, ta, M, K, lda, shape);
  detail::gemm_check_operand("B", B, tb, K, N, ldb, shape);
  detail::gemm_check_operand("C", C, transpose::none, M, N, ldc, shape);
  detail::gemm_launch<TA, TB, TC>(dev, M, N, K, 1, detail::op_view(A, ta, M, K, lda), detail::op_view(B, tb, K, N, ldb),
                                  tensor<TC, 2>::strided(C, M, N, ldc, 1), 0, 0, 0, nullptr, nullptr, nullptr, alpha, beta, s, ep);
}

// Tensor form: A is (M,K), B is (K,N), C is (M,N) (use .transposed() views for transposes).
template <class Dev, gemm_input TA, gemm_input TB, gemm_output TC, class Chain = epilogue::chain<>>
void gemm(Dev& dev, tensor<const TA, 2> A, tensor<const TB, 2> B, tensor<TC, 2> C, float alpha = 1.0f, float beta = 0.0f, const Chain& ep = {},
          const gemm_scales& s = {}) {
  const auto shape = [&] {
    return detail::gemm_shape(C.rows(), C.cols(), A.cols()) + " with A (" + std::to_string(A.rows()) + "," + std::to_string(A.cols()) + "), B (" +
           std::to_string(B.rows()) + "," + std::to_string(B.cols()) + "), C (" + std::to_string(C.rows()) + "," + std::to_string(C.cols()) + ")";
  };
  detail::gemm_check(A.rows() == C.rows() && B.cols() == C.cols() && A.cols() == B.rows(), [&] { return "mismatched shapes " + shape(); });
  detail::gemm_check(C.col_stride() == 1, [&] { return "C must be row-major (column stride 1), " + shape(); });
  detail::gemm_launch<TA, TB, TC>(dev, C.rows(), C.cols(), A.cols(), 1, A, B, C, 0, 0, 0, nullptr, nullptr, nullptr, alpha, beta, s, ep);
}

// Strided batch: batch i uses A + i*stride_a, B + i*stride_b, C + i*stride_c.
template <class Dev, gemm_input TA, gemm_input TB, gemm_output TC, class Chain = epilogue::chain<>>
void gemm_strided_batched(Dev& dev, transpose ta, transpose tb, std::size_t M, std::size_t N, std::size_t K, float alpha, const TA* A,
                          std::size_t lda, std::size_t stride_a, const TB* B, std::size_t ldb, std::size_t stride_b, float beta, TC* C,
                          std::size_t ldc, std::size_t stride_c, std::size_t batch, const Chain& ep = {}, const gemm_scales& s = {}) {
  const auto shape = [&] { return detail::gemm_shape(M, N, K) + " x batch " + std::to_string(batch); };
  detail::gemm_check_operand("A", A, ta, M, K, lda, shape);
  detail::gemm_check_operand("B", B, tb, K, N, ldb, shape);
  detail::gemm_check_operand("C", C, transpose::none, M, N, ldc, shape);

  if (batch > 1) {
    (void)detail::mul_checked(batch - 1, std::max({stride_a, stride_b, stride_c}), "batch stride");
    detail::gemm_check(stride_c >= (M ? (M - 1) * ldc + N : 0) || M == 0 || N == 0,
                       [&] { return "C batch stride " + std::to_string(stride_c) + " makes batches overlap, " + shape(); });
  }
  if (s.a_block) detail::gemm_check(batch <= 1, [&] { return "block scales are per matrix; use batch 1, " + shape(); });
  detail::gemm_launch<TA, TB, TC>(dev, M, N, K, batch, detail::op_view(A, ta, M, K, lda), detail::op_view(B, tb, K, N, ldb),
                                  tensor<TC, 2>::strided(C, M, N, ldc, 1), stride_a, stride_b, stride_c, nullptr, nullptr, nullptr, alpha, beta, s,
                                  ep);
}

// Pointer-array batch.
template <class Dev, gemm_input TA, gemm_input TB, gemm_output TC, class Chain = epilogue::chain<>>
void gemm_batched(Dev& dev, transpose ta, transpose tb, std::size_t M, std::size_t N, std::size_t K, float alpha, const TA* const* A, std::size_t lda,
                  const TB* const* B, std::size_t ldb, float beta, TC* const* C, std::size_t ldc, std::size_t batch, const Chain& ep = {}) {
  const auto shape = [&] { return detail::gemm_shape(M, N, K) + " x batch " + std::to_string(batch); };
  if (batch == 0) return;
  detail::gemm_check(A && B && C, [&] { return "null pointer array, " + shape(); });
  for (std::size_t i = 0; i < batch; ++i) {
    detail::gemm_check_operand("A", A[i], ta, M, K, lda, shape);
    detail::gemm_check_operand("B", B[i], tb, K, N, ldb, shape);
    detail::gemm_check_operand("C", C[i], transpose::none, M, N, ldc, shape);
  }
  detail::gemm_launch<TA, TB, TC>(dev, M, N, K, batch, detail::op_view(A[0], ta, M, K, lda), detail::op_view(B[0], tb, K, N, ldb),
                                  tensor<TC, 2>::strided(C[0], M, N, ldc, 1), 0, 0, 0, A, B, C, alpha, beta, gemm_scales{}, ep);
}

// Runs the GEMMs that `issue()` makes on `dev` from this thread, with as few launches as it can:
// the products of a few rows that stream their B once (skinny dots and rows: a decode step's
// x·Wᵀ of a token or a few) are gathered and run as one launch when `issue` returns, the others
// launch as they are issued. A decode step's q, k and v projections (or gate and up) are then one
// launch, shared with the pool as a whole, where alone each costs a launch and the small ones run
// on one thread. Each product runs the blocks its own launch would have run: the same bits.
// The products must be independent (none reads what another writes), and what they read and
// write must outlive this call: the gathered ones run when `issue` has returned. If `issue`
// throws, the gathered products do not run. Calls may nest (an inner call runs its own).
template <class Dev, class Issue>
void gemm_fused(Dev& dev, Issue&& issue) {
  detail::gemm_gather gather;
  gather.dev = static_cast<const void*>(&dev);
  detail::gemm_gather* const outer = detail::gemm_gather_here;
  detail::gemm_gather_here = &gather;
  try {
    std::forward<Issue>(issue)();
  } catch (...) {
    detail::gemm_gather_here = outer;
    throw;
  }
  if (gather.items.empty()) {
    detail::gemm_gather_here = outer;
    return;
  }
  const grid g{gather.blocks};
  const double flops = gather.flops;
  detail::gemm_gather_here = nullptr;  // launched here, not gathered into an enclosing call
  try {
    detail::gemm_run(dev, g, detail::gemm_gathered_program{std::make_shared<const std::vector<detail::gemm_gathered>>(std::move(gather.items))},
                     flops, false, true);
  } catch (...) {
    detail::gemm_gather_here = outer;
    throw;
  }
  detail::gemm_gather_here = outer;
}

}  // namespace v0
}  // namespace tessel
