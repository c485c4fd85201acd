// The AVX-512 matrix-multiply atoms (part of arch/gemm_atoms.hpp): f32 FMA atoms, the
// AVX512-BF16 pair atoms (plain, block-scaled, rows, in-place pairs) and the bf16 -> f32 rows atom.
// Each is compiled only when its instructions are enabled.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <tessel/arch/target.hpp>
#include <tessel/arch/gemm_atoms/reference.hpp>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tessel::arch {

#if defined(__AVX512F__)
namespace detail {
template <int MR, int NV>
inline void finish_avx512(const ukernel_args& p, __m512 (&t)[MR][NV]) {
  const bool scaled = p.row_scale || p.col_scale;
  __m512 cs[NV];
  for (int v = 0; v < NV; ++v) cs[v] = p.col_scale ? _mm512_loadu_ps(p.col_scale + 16 * v) : _mm512_set1_ps(1.0f);
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    float* c = p.c + static_cast<std::size_t>(i) * p.ldc;
    const __m512 rs = _mm512_set1_ps(p.row_scale ? p.row_scale[i] : 1.0f);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      if (scaled) {
        const __m512 s = _mm512_mul_ps(rs, cs[v]);
        t[i][v] = p.accumulate ? _mm512_fmadd_ps(t[i][v], s, _mm512_loadu_ps(c + 16 * v)) : _mm512_mul_ps(t[i][v], s);
      } else if (p.accumulate) {
        t[i][v] = _mm512_add_ps(_mm512_loadu_ps(c + 16 * v), t[i][v]);
      }
      if (p.out)
        _mm512_stream_ps(p.out + static_cast<std::size_t>(i) * p.ldo + 16 * v, t[i][v]);
      else
        _mm512_storeu_ps(c + 16 * v, t[i][v]);
    }
  }
}
}  // namespace detail

// (MR, 16*NV) f32 tile with AVX-512 FMA: A broadcast per row, B rows as NV zmm vectors.
template <int MR, int NV>
struct avx512_fma_f32 {
  static constexpr int mr = MR, nr = 16 * NV, k_pack = 1;
  template <int R>
  using with_rows = avx512_fma_f32<R, NV>;
  using a_type = float;
  using b_type = float;
  static void run(const ukernel_args& p) {
    if (p.a_rs)
      run_impl<true>(p);
    else
      run_impl<false>(p);
  }
  template <bool Direct>
  static void run_impl(const ukernel_args& p) {
    const float* a = static_cast<const float*>(p.a);
    const float* b = static_cast<const float*>(p.b);
    const std::size_t rs = Direct ? p.a_rs : 1, ks = Direct ? 1 : MR;
    __m512 t[MR][NV];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) t[i][v] = _mm512_setzero_ps();
    if (p.accumulate)  // the tile of C is read after the K loop: fetch it now, behind the FMAs (+10%)
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char*>(p.c + i * p.ldc + 16 * v), _MM_HINT_T0);
    std::size_t k = p.k;
#pragma GCC unroll 4
    for (; k > 0; --k) {
      __m512 bv[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(b + 16 * v);
      _mm_prefetch(reinterpret_cast<const char*>(b + 16 * NV * 8), _MM_HINT_T0);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const __m512 av = _mm512_set1_ps(a[i * rs]);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) t[i][v] = _mm512_fmadd_ps(av, bv[v], t[i][v]);
      }
      a += ks;
      b += 16 * NV;
    }
    detail::finish_avx512<MR, NV>(p, t);
  }
};
using avx512_fma_6x32_f32 = avx512_fma_f32<6, 2>;
using avx512_fma_8x32_f32 = avx512_fma_f32<8, 2>;
using avx512_fma_6x64_f32 = avx512_fma_f32<6, 4>;
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// (MR, 16*NV) f32 tile from bf16 K-pairs with vdpbf16ps: 32 multiply-adds per instruction per row.
template <int MR, int NV>
struct avx512bf16_dot_bf16bf16f32 {
  static constexpr int mr = MR, nr = 16 * NV, k_pack = 2;
  template <int R>
  using with_rows = avx512bf16_dot_bf16bf16f32<R, NV>;
  using a_type = std::uint16_t;
  using b_type = std::uint16_t;
  static void run(const ukernel_args& p) {
    if (p.a_rs)
      run_impl<true>(p);
    else
      run_impl<false>(p);
  }
  template <bool Direct>
  static void run_impl(const ukernel_args& p) {
    const auto* a = static_cast<const std::uint16_t*>(p.a);
    const auto* b = static_cast<const std::uint16_t*>(p.b);
    const std::size_t rs = Direct ? p.a_rs : 2, ks = Direct ? 2 : 2 * MR;
    __m512 t[MR][NV];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) t[i][v] = _mm512_setzero_ps();
    if (p.accumulate)  // the tile of C is read after the K loop: fetch it now, behind the FMAs
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char*>(p.c + i * p.ldc + 16 * v), _MM_HINT_T0);
    std::size_t k = p.k;
#pragma GCC unroll 4
    for (; k > 0; --k) {
      __m512i bv[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_si512(b + 32 * v);
      _mm_prefetch(reinterpret_cast<const char*>(b + 32 * NV * 8), _MM_HINT_T0);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        std::uint32_t pair;
        std::memcpy(&pair, a + i * rs, 4);  // one K-pair of row i
        const __m512i av = _mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) t[i][v] = _mm512_dpbf16_ps(t[i][v], (__m512bh)av, (__m512bh)bv[v]);
      }
      a += ks;
      b += 32 * NV;
    }
    detail::finish_avx512<MR, NV>(p, t);
  }
};
using avx512bf16_dot_6x32_bf16bf16f32 = avx512bf16_dot_bf16bf16f32<6, 2>;

// Block-scaled form of the pair atom (scaled_ukernel_args): the scale blocks of one call run
// back to back on the same (MR, 16*NV) tile of C, which stays in L1 between them, so a packed
// panel may span several 128-deep scale blocks and C leaves the core once per panel, not once
// per scale block. Same arithmetic as scalar_dot2_scaled_bf16.
template <int MR, int NV>
struct avx512bf16_dot_scaled_bf16bf16f32 {
  static constexpr int mr = MR, nr = 16 * NV, k_pack = 2;
  template <int R>
  using with_rows = avx512bf16_dot_scaled_bf16bf16f32<R, NV>;
  using a_type = std::uint16_t;
  using b_type = std::uint16_t;
  static void run(const scaled_ukernel_args& p) {
    if (p.a_rs)
      run_impl<true>(p);
    else
      run_impl<false>(p);
  }
  template <bool Direct>
  static void run_impl(const scaled_ukernel_args& p) {
    const auto* a = static_cast<const std::uint16_t*>(p.a);
    const auto* b = static_cast<const std::uint16_t*>(p.b);
    const std::size_t rs = Direct ? p.a_rs : 2, ks = Direct ? 2 : 2 * MR;
    const std::size_t bk = p.block_k ? p.block_k : 1;
    if (p.accumulate)
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char*>(p.c + i * p.ldc + 16 * v), _MM_HINT_T0);
    for (std::size_t q = 0, k0 = 0; k0 < p.k; ++q, k0 += bk) {
      __m512 t[MR][NV];
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) t[i][v] = _mm512_setzero_ps();
      std::size_t k = p.k - k0 < bk ? p.k - k0 : bk;
#pragma GCC unroll 4
      for (; k > 0; --k) {
        __m512i bv[NV];
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_si512(b + 32 * v);
        _mm_prefetch(reinterpret_cast<const char*>(b + 32 * NV * 8), _MM_HINT_T0);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          std::uint32_t pair;
          std::memcpy(&pair, a + i * rs, 4);
          const __m512i av = _mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) t[i][v] = _mm512_dpbf16_ps(t[i][v], (__m512bh)av, (__m512bh)bv[v]);
        }
        a += ks;
        b += 32 * NV;
      }
      const float* rsq = p.row_scale + q * p.rs_stride;
      const float* csq = p.col_scale + q * p.cs_stride;
      __m512 cs[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) cs[v] = _mm512_loadu_ps(csq + 16 * v);
      const bool first = q == 0 && !p.accumulate;
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        float* c = p.c + static_cast<std::size_t>(i) * p.ldc;
        const __m512 r = _mm512_set1_ps(rsq[i]);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
          const __m512 s = _mm512_mul_ps(r, cs[v]);
          _mm512_storeu_ps(c + 16 * v, first ? _mm512_mul_ps(t[i][v], s) : _mm512_fmadd_ps(t[i][v], s, _mm512_loadu_ps(c + 16 * v)));
        }
      }
    }
  }
};
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Skinny (GEMV-like) atom: c(MR, n) (+)= a(MR, k) · b(k, n) for n <= 32*NP, with A and B read in
// place from row-major bf16. Each pair of B rows (k, k+1) is interleaved into K-pairs in
// registers (vpunpck{l,h}wd: lane-local, so the accumulators hold columns in a lane-scrambled
// order that is undone once, when c is written) and fed to vdpbf16ps with A's pair broadcast.
// Skinny GEMMs are bound by reading B once; packing B would only add a write and a re-read.
template <int MR, int NP>
struct avx512bf16_rows_dot_bf16bf16f32 {
  static constexpr int mr = MR, nc = 32 * NP;
  template <int R>
  using with_rows = avx512bf16_rows_dot_bf16bf16f32<R, NP>;
  static void run(const rows_args& p) {
    // scrambled (lo, hi) accumulator lanes <-> natural columns, for vpermt2ps
    alignas(64) static constexpr std::int32_t to_nat0[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
    alignas(64) static constexpr std::int32_t to_nat1[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    alignas(64) static constexpr std::int32_t to_lo[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    alignas(64) static constexpr std::int32_t to_hi[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    __mmask32 mk[NP];
    __mmask16 ms[2 * NP];
#pragma GCC unroll 16
    for (int u = 0; u < NP; ++u) {
      const int left = p.n - 32 * u;
      mk[u] = left >= 32 ? __mmask32(0xFFFFFFFFu) : (left <= 0 ? __mmask32(0) : __mmask32((1u << left) - 1));
#pragma GCC unroll 16
      for (int h = 0; h < 2; ++h) {
        const int l = left - 16 * h;
        ms[2 * u + h] = l >= 16 ? __mmask16(0xFFFF) : (l <= 0 ? __mmask16(0) : __mmask16((1u << l) - 1));
      }
    }
    __m512 t[MR][2 * NP];
    if (p.accumulate) {
      const __m512i il = _mm512_load_si512(to_lo), ih = _mm512_load_si512(to_hi);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
        for (int u = 0; u < NP; ++u) {
          const float* c = p.c + static_cast<std::size_t>(i) * p.ldc + 32 * u;
          const __m512 n0 = _mm512_maskz_loadu_ps(ms[2 * u], c), n1 = _mm512_maskz_loadu_ps(ms[2 * u + 1], c + 16);
          t[i][2 * u] = _mm512_permutex2var_ps(n0, il, n1);
          t[i][2 * u + 1] = _mm512_permutex2var_ps(n0, ih, n1);
        }
    } else {
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
        for (int v = 0; v < 2 * NP; ++v) t[i][v] = _mm512_setzero_ps();
    }
    const std::uint16_t* b = p.b;
    const std::uint16_t* a = p.a;
    const std::size_t ldb = p.ldb, lda = p.lda, kp = p.k / 2;
    const char* pf = reinterpret_cast<const char*>(p.prefetch);
    const std::size_t pf_pairs = p.prefetch ? p.prefetch_k / 2 : 0;
    for (std::size_t q = 0; q < kp; ++q) {
      if (q < pf_pairs) {
#pragma GCC unroll 4
        for (int u = 0; u < NP; ++u) {
          _mm_prefetch(pf + 64 * u, _MM_HINT_T0);
          _mm_prefetch(pf + 2 * ldb + 64 * u, _MM_HINT_T0);
        }
        pf += 4 * ldb;
      }
      __m512i lo[NP], hi[NP];
#pragma GCC unroll 4
      for (int u = 0; u < NP; ++u) {
        const __m512i x = _mm512_maskz_loadu_epi16(mk[u], b + 32 * u), y = _mm512_maskz_loadu_epi16(mk[u], b + ldb + 32 * u);
        lo[u] = _mm512_unpacklo_epi16(x, y);
        hi[u] = _mm512_unpackhi_epi16(x, y);
      }
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        std::uint32_t pair;
        std::memcpy(&pair, a + i * lda + 2 * q, 4);
        const __m512i av = _mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
        for (int u = 0; u < NP; ++u) {
          t[i][2 * u] = _mm512_dpbf16_ps(t[i][2 * u], (__m512bh)av, (__m512bh)lo[u]);
          t[i][2 * u + 1] = _mm512_dpbf16_ps(t[i][2 * u + 1], (__m512bh)av, (__m512bh)hi[u]);
        }
      }
      b += 2 * ldb;
    }
    if (p.k & 1) {  // half pair: (k-1, zero)
      const __m512i z = _mm512_setzero_si512();
      __m512i lo[NP], hi[NP];
#pragma GCC unroll 16
      for (int u = 0; u < NP; ++u) {
        const __m512i x = _mm512_maskz_loadu_epi16(mk[u], b + 32 * u);
        lo[u] = _mm512_unpacklo_epi16(x, z);
        hi[u] = _mm512_unpackhi_epi16(x, z);
      }
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const __m512i av = _mm512_set1_epi32(static_cast<int>(a[i * lda + p.k - 1]));
#pragma GCC unroll 16
        for (int u = 0; u < NP; ++u) {
          t[i][2 * u] = _mm512_dpbf16_ps(t[i][2 * u], (__m512bh)av, (__m512bh)lo[u]);
          t[i][2 * u + 1] = _mm512_dpbf16_ps(t[i][2 * u + 1], (__m512bh)av, (__m512bh)hi[u]);
        }
      }
    }
    const __m512i i0 = _mm512_load_si512(to_nat0), i1 = _mm512_load_si512(to_nat1);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
      for (int u = 0; u < NP; ++u) {
        float* c = p.c + static_cast<std::size_t>(i) * p.ldc + 32 * u;
        _mm512_mask_storeu_ps(c, ms[2 * u], _mm512_permutex2var_ps(t[i][2 * u], i0, t[i][2 * u + 1]));
        _mm512_mask_storeu_ps(c + 16, ms[2 * u + 1], _mm512_permutex2var_ps(t[i][2 * u], i1, t[i][2 * u + 1]));
      }
  }
};
// Packs k rows x n columns of row-major bf16 B (row r at b + r*ldb) into K-pair panels of 32
// columns for avx512bf16_dot_bf16bf16f32<MR, 2>: panel u at out + u*panel_stride holds pair q at
// + 64q. Pairs are formed with the lane-local vpunpck{l,h}wd (1 uop each; a full 32-lane word
// permute costs as much as the math for M = 16), so within each 32-column unit the atom's output
// columns come out in the order `scrambled_col`; unscramble_pairs32 restores it once per result.
// An odd k and columns beyond n are zero-filled. Rows are read whole and in order (long bursts).
inline void pack_pairs_bf16(const std::uint16_t* b, std::size_t ldb, std::size_t k, std::size_t n, std::uint16_t* out, std::size_t panel_stride) {
  const std::size_t full = n / 32, rest = n % 32;
  const __mmask32 m = rest ? __mmask32((1u << rest) - 1) : __mmask32(0);
  for (std::size_t r = 0; r < k; r += 2) {
    const std::uint16_t* r0 = b + r * ldb;
    const std::uint16_t* r1 = r0 + ldb;
    std::uint16_t* o = out + 32 * r;  // pair r/2: 64 words
    if (r + 1 < k) {
      for (std::size_t u = 0; u < full; ++u, o += panel_stride) {
        const __m512i x = _mm512_loadu_si512(r0 + 32 * u), y = _mm512_loadu_si512(r1 + 32 * u);
        _mm512_storeu_si512(o, _mm512_unpacklo_epi16(x, y));
        _mm512_storeu_si512(o + 32, _mm512_unpackhi_epi16(x, y));
      }
      if (rest) {
        const __m512i x = _mm512_maskz_loadu_epi16(m, r0 + 32 * full), y = _mm512_maskz_loadu_epi16(m, r1 + 32 * full);
        _mm512_storeu_si512(o, _mm512_unpacklo_epi16(x, y));
        _mm512_storeu_si512(o + 32, _mm512_unpackhi_epi16(x, y));
      }
    } else {
      const __m512i y = _mm512_setzero_si512();
      for (std::size_t u = 0; u < full + (rest ? 1 : 0); ++u, o += panel_stride) {
        const __m512i x = u < full ? _mm512_loadu_si512(r0 + 32 * u) : _mm512_maskz_loadu_epi16(m, r0 + 32 * u);
        _mm512_storeu_si512(o, _mm512_unpacklo_epi16(x, y));
        _mm512_storeu_si512(o + 32, _mm512_unpackhi_epi16(x, y));
      }
    }
  }
}

// Arguments of the in-place pair atom: c(MR, 32) (+)= a · b(k rows, <= 32 columns).
//  a: A's K-pairs packed as for the pair atom (pair q of row i at a + 2*(q*MR + i)); b: row r of B
//  at b + r*ldb, columns >= n not read. `prefetch` (may be null): `prefetch_lines` consecutive
//  cache lines the atom requests, PF per K-pair step, while it computes (the caller's next chunk).
//  `copy_out` (may be null): the k rows it reads are also stored there, row r at copy_out + 32*r
//  (zero beyond n), for later calls to read as b with ldb = 32 from L1 (B's own rows may share
//  one L1 set).
struct inplace_pairs_args {
  const std::uint16_t* a = nullptr;
  const std::uint16_t* b = nullptr;
  std::size_t ldb = 0;
  std::size_t k = 0;  // rows of B (an odd k ends with a half pair)
  int n = 32;
  float* c = nullptr;
  std::size_t ldc = 0;
  bool accumulate = false;
  const char* prefetch = nullptr;
  std::size_t prefetch_lines = 0;
  std::uint16_t* copy_out = nullptr;
};

// avx512bf16_dot_bf16bf16f32<MR, 2> on B read in place: each pair of B rows (k, k+1) is paired in
// registers exactly as pack_pairs_bf16 pairs it (same scrambled column order, same zero half pair
// for an odd k), so the result has the same bits as packing then running the pair atom, without
// the packing pass (a store and a reload of every element of B). Lines the caller names are
// requested PF per step, spread through the math instead of in a loop between calls.
template <int MR, int PF>
struct avx512bf16_dot_inplace_bf16bf16f32 {
  static constexpr int mr = MR, nr = 32;
  template <int R>
  using with_rows = avx512bf16_dot_inplace_bf16bf16f32<R, PF>;
  static void run(const inplace_pairs_args& p) {
    const auto* a = p.a;
    const auto* b = p.b;
    const std::size_t ldb = p.ldb;
    const __mmask32 m = p.n >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (p.n > 0 ? p.n : 0)) - 1);
    __m512 t[MR][2];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) t[i][0] = t[i][1] = _mm512_setzero_ps();
    if (p.accumulate)
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < 2; ++v) _mm_prefetch(reinterpret_cast<const char*>(p.c + i * p.ldc + 16 * v), _MM_HINT_T0);
    // branch-free walk of the lines to request (a data-dependent branch in this loop made GCC
    // -O3 spill the accumulators); with none left it re-requests the last one, or its own B line
    const char* pf = p.prefetch && p.prefetch_lines ? p.prefetch : reinterpret_cast<const char*>(b);
    std::size_t pf_left = p.prefetch ? p.prefetch_lines : 0;
    const std::size_t kp = p.k / 2;
    std::uint16_t* const co = p.copy_out;
    for (std::size_t q = 0; q < kp; ++q) {
#pragma GCC unroll 4
      for (int j = 0; j < PF; ++j) {
        _mm_prefetch(pf, _MM_HINT_T0);
        pf_left -= pf_left != 0;
        pf += pf_left != 0 ? 64 : 0;
      }
      const __m512i x = _mm512_maskz_loadu_epi16(m, b), y = _mm512_maskz_loadu_epi16(m, b + ldb);
      if (co) _mm512_storeu_si512(co + 64 * q, x), _mm512_storeu_si512(co + 64 * q + 32, y);
      const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        std::uint32_t pair;
        std::memcpy(&pair, a + 2 * i, 4);
        const __m512i av = _mm512_set1_epi32(static_cast<int>(pair));
        t[i][0] = _mm512_dpbf16_ps(t[i][0], (__m512bh)av, (__m512bh)lo);
        t[i][1] = _mm512_dpbf16_ps(t[i][1], (__m512bh)av, (__m512bh)hi);
      }
      a += 2 * MR;
      b += 2 * ldb;
    }
    if (p.k & 1) {
      const __m512i x = _mm512_maskz_loadu_epi16(m, b), z = _mm512_setzero_si512();
      if (co) _mm512_storeu_si512(co + 64 * kp, x);
      const __m512i lo = _mm512_unpacklo_epi16(x, z), hi = _mm512_unpackhi_epi16(x, z);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        std::uint32_t pair;
        std::memcpy(&pair, a + 2 * i, 4);
        const __m512i av = _mm512_set1_epi32(static_cast<int>(pair));
        t[i][0] = _mm512_dpbf16_ps(t[i][0], (__m512bh)av, (__m512bh)lo);
        t[i][1] = _mm512_dpbf16_ps(t[i][1], (__m512bh)av, (__m512bh)hi);
      }
    }
    for (; pf_left > 0; --pf_left) _mm_prefetch(pf, _MM_HINT_T0), pf += 64;  // lines beyond PF per step
      // written out here, not through finish_avx512: GCC -O3 does not inline that call, and an
      // accumulator array passed by reference is then stored to the stack on every K step
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      float* c = p.c + static_cast<std::size_t>(i) * p.ldc;
      if (p.accumulate) {
        t[i][0] = _mm512_add_ps(_mm512_loadu_ps(c), t[i][0]);
        t[i][1] = _mm512_add_ps(_mm512_loadu_ps(c + 16), t[i][1]);
      }
      _mm512_storeu_ps(c, t[i][0]);
      _mm512_storeu_ps(c + 16, t[i][1]);
    }
  }
};

// Restores natural column order in `units` 32-float units of a result row written by the pair
// atom from pack_pairs_bf16 panels (position p holds column scrambled_col(p)).
inline void unscramble_pairs32(float* row, std::size_t units) {
  alignas(64) static constexpr std::int32_t to_nat0[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static constexpr std::int32_t to_nat1[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i i0 = _mm512_load_si512(to_nat0), i1 = _mm512_load_si512(to_nat1);
  for (std::size_t u = 0; u < units; ++u, row += 32) {
    const __m512 lo = _mm512_loadu_ps(row), hi = _mm512_loadu_ps(row + 16);
    _mm512_storeu_ps(row, _mm512_permutex2var_ps(lo, i0, hi));
    _mm512_storeu_ps(row + 16, _mm512_permutex2var_ps(lo, i1, hi));
  }
}
inline constexpr bool has_rows_dot_atom = true;
#else
inline constexpr bool has_rows_dot_atom = false;
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// Skinny product c(M, n) = a(M, K) · b(K, n), n <= 128, for M <= 3 rows of bf16 activations and
// bf16 rows of B read in place (no packing: a GEMV-like product is bound by reading B once).
// One f32 FMA per k in k order per element (bf16 products are exact in f32).
template <int M>
struct avx512_rows_bf16_f32 {
  static_assert(M >= 1 && M <= 3, "avx512_rows_bf16_f32: 1 to 3 rows");
  static constexpr int max_cols = 128;
  static void run(const std::uint16_t* a, std::size_t lda, const std::uint16_t* b, std::size_t ldb, std::size_t K, int n, float* c, std::size_t ldc) {
    __m512 t[M][8];
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < 8; ++v) t[i][v] = _mm512_setzero_ps();
    __mmask16 mk[8];
    for (int v = 0; v < 8; ++v) {
      const int left = n - 16 * v;
      mk[v] = left >= 16 ? __mmask16(0xFFFF) : (left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1));
    }
    for (std::size_t k = 0; k < K; ++k) {
      const std::uint16_t* row = b + k * ldb;
      const std::uint16_t* ahead = b + (k + 16 < K ? k + 16 : k) * ldb;
      for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(ahead + 32 * l), _MM_HINT_T0);
      __m512 av[M];
      for (int i = 0; i < M; ++i) av[i] = _mm512_set1_ps(detail::bf16_bits_to_f32(a[i * lda + k]));
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {
        const __m256i h = _mm256_maskz_loadu_epi16(mk[v], row + 16 * v);
        const __m512 bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        for (int i = 0; i < M; ++i) t[i][v] = _mm512_fmadd_ps(av[i], bv, t[i][v]);
      }
    }
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < 8; ++v) _mm512_mask_storeu_ps(c + i * ldc + 16 * v, mk[v], t[i][v]);
  }
};
inline constexpr bool has_rows_bf16_atom = true;
#else
inline constexpr bool has_rows_bf16_atom = false;
#endif

}  // namespace tessel::arch
