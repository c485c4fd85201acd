// Atoms of the direct GEMM path: tiny products computed from f32 operands where they lie, with no
// packed panels (packing and its setup cost more than a product of a few thousand multiply-adds).
// `direct_rows`: c(i, j) = sum_k A(i,k)·B(k,j) over B's rows (vectorized along N, A broadcast);
// `direct_dot`: the same sum as a dot product of A's row and Bᵀ's row (vectorized along K), for a
// transposed B. Each has a scalar reference with the same arithmetic order, which tests compare.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include <tessel/arch/gemm_atoms.hpp>  // run_rows_of
#include <tessel/arch/target.hpp>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tessel::arch {

// c(i, j) = sum over k of A(i,k)·B(k,j) for i < rows (the atom's MR), j < n (at most its nc): one
// fused multiply-add per k, in k order, from zero (the order of the packed f32 atoms, so a
// one-chunk product has their bits). A(i,k) at a[i*a_rs + k*a_cs] (any strides: a transposed A is
// read where it lies), B(k,j) at b[k*ldb + j]. The result is written to c (rows ldc apart).
struct direct_rows_args {
  const float* a = nullptr;
  std::size_t a_rs = 0, a_cs = 0;
  const float* b = nullptr;
  std::size_t ldb = 0;
  std::size_t k = 0;
  int n = 0;
  float* c = nullptr;
  std::size_t ldc = 0;
  std::size_t prefetch_rows = 0;  // > 0: B's row k + prefetch_rows is requested at step k (a long ldb defeats the hardware's)
};

// Arguments of a dot atom: c(i, j) = A(i,:)·Bt(j,:) for i < rows, j < n, with A's row i at
// a + i*lda and Bᵀ's row j (column j of B) at b + j*ldb, both contiguous over k; E is the
// operands' element (f32, or bf16 bit patterns).
template <class E>
struct dot_args {
  const E* a = nullptr;
  std::size_t lda = 0;
  const E* b = nullptr;
  std::size_t ldb = 0;
  std::size_t k = 0;
  int n = 0;
  float* c = nullptr;
  std::size_t ldc = 0;
};

// The f32 dot. Order (fixed, whatever the vector width): 16 partial sums, lane l taking k = l,
// l+16, l+32, ... by fused multiply-adds from zero, then added as a halving tree (l + 8, then
// l + 4, l + 2, l + 1).
using direct_dot_args = dot_args<float>;

// The bf16 dot, operands read in place. Order: vdpbf16ps's. 16 partial sums, lane l taking the
// K-pairs q = l, l+16, ... (elements 2q and 2q+1; an odd K's last pair has a zero second element):
// per pair, the exact product of elements 2q+1 then the exact product of elements 2q are added,
// each add rounded to nearest even with subnormal inputs and results flushed to zero; then the
// same halving tree.
using direct_dot_bf16_args = dot_args<std::uint16_t>;

// Runs a dot atom over C (M, N) at c (rows ldc apart) in strips of Atom::nr columns and Atom::mr
// rows; A's rows start at a (p.lda apart), Bᵀ's at b (p.ldb apart); p.k is K. Each element is one
// dot in the atom's fixed order: how C is cut into strips never changes the bits.
template <class Atom, class E>
inline void run_dots(dot_args<E> p, const E* a, const E* b, std::size_t M, std::size_t N, float* c, std::size_t ldc) {
  p.ldc = ldc;
  for (std::size_t j = 0; j < N; j += Atom::nr) {
    p.n = static_cast<int>(std::min<std::size_t>(Atom::nr, N - j));
    p.b = b + j * p.ldb;
    for (std::size_t i = 0; i < M; i += Atom::mr) {
      p.a = a + i * p.lda;
      p.c = c + i * ldc + j;
      run_rows_of<Atom>(static_cast<int>(std::min<std::size_t>(Atom::mr, M - i)), p);
    }
  }
}

namespace detail {
// The dot atoms stream Bᵀ's rows once for a product of a few rows (a decode step's projections):
// NR rows side by side, one row apart, which the hardware prefetcher fetches late. Each k step
// also asks for the same line of the next NR rows, `ahead` bytes on (an address past B's end is
// only a hint, formed as an integer). bf16 1 x 1408 x 512 from DRAM, 1 thread: 10 -> 29 GB/s
// (a plain read of the same bytes 22); the small Llama's decode 1 thread: batch 1 1.9x, batch 4 3x.
inline void prefetch_ahead(const void* p, std::uintptr_t ahead) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(p) + ahead), 0, 3);
}
inline float halving_sum16(const float (&s)[16]) {
  float r8[8], r4[4];
  for (int l = 0; l < 8; ++l) r8[l] = s[l] + s[l + 8];
  for (int l = 0; l < 4; ++l) r4[l] = r8[l] + r8[l + 4];
  return (r4[0] + r4[2]) + (r4[1] + r4[3]);
}
}  // namespace detail

// ---- scalar references ------------------------------------------------------------------------
template <int MR, int NC>
struct scalar_direct_rows_f32 {
  static constexpr int mr = MR, nc = NC;
  template <int R>
  using with_rows = scalar_direct_rows_f32<R, NC>;
  template <int W>
  using with_cols = scalar_direct_rows_f32<MR, W>;
  static void run(const direct_rows_args& p) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < p.n && j < NC; ++j) {
        float t = 0.0f;
        for (std::size_t k = 0; k < p.k; ++k) t = std::fma(p.a[i * p.a_rs + k * p.a_cs], p.b[k * p.ldb + j], t);
        p.c[static_cast<std::size_t>(i) * p.ldc + j] = t;
      }
  }
};

template <int MR, int NR>
struct scalar_direct_dot_f32 {
  static constexpr int mr = MR, nr = NR;
  template <int R>
  using with_rows = scalar_direct_dot_f32<R, NR>;
  static void run(const direct_dot_args& p) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < p.n && j < NR; ++j) {
        float s[16] = {};
        for (std::size_t k = 0; k < p.k; ++k) s[k % 16] = std::fma(p.a[i * p.lda + k], p.b[j * p.ldb + k], s[k % 16]);
        p.c[static_cast<std::size_t>(i) * p.ldc + j] = detail::halving_sum16(s);
      }
  }
};

template <int MR, int NR>
struct scalar_direct_dot_bf16 {
  static constexpr int mr = MR, nr = NR;
  template <int R>
  using with_rows = scalar_direct_dot_bf16<R, NR>;
  static void run(const direct_dot_bf16_args& p) {
    using detail::bf16_bits_to_f32;
    using detail::flush_subnormal;
    const std::size_t pairs = (p.k + 1) / 2, padded = (pairs + 15) / 16 * 16;  // whole 32-element steps
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < p.n && j < NR; ++j) {
        float s[16] = {};
        auto at = [&](const std::uint16_t* row, std::size_t k) { return k < p.k ? flush_subnormal(bf16_bits_to_f32(row[k])) : 0.0f; };
        const std::uint16_t* ar = p.a + i * p.lda;
        const std::uint16_t* br = p.b + j * p.ldb;
        for (std::size_t q = 0; q < padded; ++q) {
          float& t = s[q % 16];
          t = flush_subnormal(t + at(ar, 2 * q + 1) * at(br, 2 * q + 1));
          t = flush_subnormal(t + at(ar, 2 * q) * at(br, 2 * q));
        }
        p.c[static_cast<std::size_t>(i) * p.ldc + j] = detail::halving_sum16(s);
      }
  }
};

// ---- AVX-512 ----------------------------------------------------------------------------------
#if defined(__AVX512F__)
// (MR, <= 16*NV): A broadcast per row and k, B's row k as NV masked vectors.
template <int MR, int NV>
struct avx512_direct_rows_f32 {
  static constexpr int mr = MR, nc = 16 * NV;
  template <int R>
  using with_rows = avx512_direct_rows_f32<R, NV>;
  template <int W>
  using with_cols = avx512_direct_rows_f32<MR, (W + 15) / 16>;  // at least W columns
  static void run(const direct_rows_args& p) {
    __mmask16 mk[NV];
    for (int v = 0; v < NV; ++v) {
      const int left = p.n - 16 * v;
      mk[v] = left >= 16 ? __mmask16(0xFFFF) : (left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1));
    }
    __m512 t[MR][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) t[i][v] = _mm512_setzero_ps();
    const float* b = p.b;
    const float* a = p.a;
    const std::size_t pf = p.prefetch_rows * p.ldb;
    for (std::size_t k = 0; k < p.k; ++k) {
      __m512 bv[NV];
      if (pf)
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char*>(b + pf + 16 * v), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) bv[v] = _mm512_maskz_loadu_ps(mk[v], b + 16 * v);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512 av = _mm512_set1_ps(a[i * p.a_rs]);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) t[i][v] = _mm512_fmadd_ps(av, bv[v], t[i][v]);
      }
      a += p.a_cs;
      b += p.ldb;
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) _mm512_mask_storeu_ps(p.c + static_cast<std::size_t>(i) * p.ldc + 16 * v, mk[v], t[i][v]);
  }
};

// (MR, <= NR) dot products, 16 k per step (the last step masked).
template <int MR, int NR>
struct avx512_direct_dot_f32 {
  static constexpr int mr = MR, nr = NR;
  template <int R>
  using with_rows = avx512_direct_dot_f32<R, NR>;
  static void run(const direct_dot_args& p) {
    const float* b[NR];
    for (int j = 0; j < NR; ++j) b[j] = p.b + static_cast<std::size_t>(j < p.n ? j : 0) * p.ldb;  // spare columns repeat column 0
    __m512 s[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) s[i][j] = _mm512_setzero_ps();
    // One loop, the last step masked (a masked lane adds 0*0 to its partial sum: the same bits as
    // no step for it). (A step lambda called from a main loop and a tail kept the accumulators in
    // memory under GCC 12: a store per FMA, 40 GFLOP/s of the core's 118.)
    const std::uintptr_t ahead = static_cast<std::uintptr_t>(NR) * p.ldb * sizeof(float);  // (detail::prefetch_ahead)
    for (std::size_t k = 0; k < p.k; k += 16) {
      const __mmask16 m = k + 16 <= p.k ? __mmask16(0xFFFF) : __mmask16((1u << (p.k - k)) - 1);
      __m512 bv[NR];
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) detail::prefetch_ahead(b[j] + k, ahead);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) bv[j] = _mm512_maskz_loadu_ps(m, b[j] + k);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512 av = _mm512_maskz_loadu_ps(m, p.a + i * p.lda + k);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) s[i][j] = _mm512_fmadd_ps(av, bv[j], s[i][j]);
      }
    }
    // (constant bounds, every sum formed and only the real columns stored: indexing s with the
    // run-time column count kept it in memory)
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        const __m256 r8 = _mm256_add_ps(_mm512_castps512_ps256(s[i][j]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s[i][j]), 1)));
        const __m128 r4 = _mm_add_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps(r8, 1));
        const __m128 r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));      // (r4[0]+r4[2], r4[1]+r4[3])
        const __m128 r1 = _mm_add_ss(r2, _mm_shuffle_ps(r2, r2, 1));  // r2[0] + r2[1]
        if (j < p.n) p.c[static_cast<std::size_t>(i) * p.ldc + j] = _mm_cvtss_f32(r1);
      }
  }
};
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// (MR, NR) dots of bf16 rows by vdpbf16ps, 32 elements (16 K-pairs) per step; a skinny product
// with a transposed B (a layer's input gradient for a few tokens) streams Bᵀ once, in place.
// U > 1: each row's next U lines are read one after the other before the next row's (a burst of
// U·64 bytes per row), the rest of K one line per row as with U = 1; each sum still takes its
// steps in k order, so the bits are U = 1's. A GEMV streaming Bᵀ from memory, bf16, 1 thread, the
// atoms side by side in one process (two rounds; GB/s, U = 1 -> 8): 1 x 2816 x 1024 30.1, 26.6 ->
// 35.0, 29.6; x 1024 x 2816 33.8, 33.0 -> 35.6, 34.6; 1408 x 512 30.1, 29.3 -> 32.9, 31.3;
// 512 x 1408 28.2, 33.0 -> 34.2, 33.4; 8192 x 512 29.6, 24.1 -> 33.2, 24.8; 32000 x 1024 29.4,
// 28.2 -> 33.9, 33.7 (a plain AVX-512 read: 35). U = 2 and 4 were between; 4 or 16 rows slower.
// From cache (B of 0.5 MB) U = 8 and 1 are the same.
template <int MR, int NR, int U = 1>
struct avx512bf16_direct_dot_bf16 {
  static constexpr int mr = MR, nr = NR;
  template <int R>
  using with_rows = avx512bf16_direct_dot_bf16<R, NR, U>;
  static void run(const direct_dot_bf16_args& p) {
    const std::uint16_t* b[NR];
    for (int j = 0; j < NR; ++j) b[j] = p.b + static_cast<std::size_t>(j < p.n ? j : 0) * p.ldb;  // spare columns repeat column 0
    __m512 s[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) s[i][j] = _mm512_setzero_ps();
    // one loop, the last step masked: masked elements are zeros, so pairs past K add +0, as the
    // reference's padded pairs do (the accumulators stay in registers: see the f32 dot atom)
    const std::uintptr_t ahead = static_cast<std::uintptr_t>(NR) * p.ldb * sizeof(std::uint16_t);  // (detail::prefetch_ahead)
    std::size_t k = 0;
    if constexpr (U > 1) {
      for (; k + 32 * U <= p.k; k += 32 * U) {
        __m512bh av[MR][U];
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
          for (int u = 0; u < U; ++u) av[i][u] = (__m512bh)_mm512_loadu_si512(p.a + i * p.lda + k + 32 * u);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
#pragma GCC unroll 8
          for (int u = 0; u < U; ++u) detail::prefetch_ahead(b[j] + k + 32 * u, ahead);
#pragma GCC unroll 8
          for (int u = 0; u < U; ++u) {
            const __m512bh bv = (__m512bh)_mm512_loadu_si512(b[j] + k + 32 * u);
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) s[i][j] = _mm512_dpbf16_ps(s[i][j], av[i][u], bv);
          }
        }
      }
    }
    for (; k < p.k; k += 32) {
      const __mmask32 m = k + 32 <= p.k ? ~__mmask32(0) : __mmask32((1u << (p.k - k)) - 1);
      __m512bh bv[NR];
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) detail::prefetch_ahead(b[j] + k, ahead);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) bv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, b[j] + k);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(m, p.a + i * p.lda + k);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) s[i][j] = _mm512_dpbf16_ps(s[i][j], av, bv[j]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        const __m256 r8 = _mm256_add_ps(_mm512_castps512_ps256(s[i][j]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s[i][j]), 1)));
        const __m128 r4 = _mm_add_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps(r8, 1));
        const __m128 r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
        const __m128 r1 = _mm_add_ss(r2, _mm_shuffle_ps(r2, r2, 1));
        if (j < p.n) p.c[static_cast<std::size_t>(i) * p.ldc + j] = _mm_cvtss_f32(r1);
      }
  }
};
inline constexpr bool has_direct_dot_bf16_atom = true;
using best_direct_dot_bf16_atom = avx512bf16_direct_dot_bf16<4, 4>;
using best_direct_dot_bf16_atom_few_rows = avx512bf16_direct_dot_bf16<1, 8, 8>;
#else
inline constexpr bool has_direct_dot_bf16_atom = false;
using best_direct_dot_bf16_atom = scalar_direct_dot_bf16<4, 4>;  // (unused: the bf16 dot path needs the instruction)
using best_direct_dot_bf16_atom_few_rows = best_direct_dot_bf16_atom;
#endif

// ---- AVX2 -------------------------------------------------------------------------------------
#if defined(__AVX2__) && defined(__FMA__)
namespace detail {
// lanes [0, n) of 8 set (n clamped to [0, 8])
inline __m256i lane_mask8(long n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 0 ? 0 : (n > 8 ? 8 : n))), idx);
}
}  // namespace detail

template <int MR, int NV>
struct avx2_direct_rows_f32 {
  static constexpr int mr = MR, nc = 8 * NV;
  template <int R>
  using with_rows = avx2_direct_rows_f32<R, NV>;
  template <int W>
  using with_cols = avx2_direct_rows_f32<MR, (W + 7) / 8>;  // at least W columns
  static void run(const direct_rows_args& p) {
    __m256i mk[NV];
    for (int v = 0; v < NV; ++v) mk[v] = detail::lane_mask8(p.n - 8 * v);
    __m256 t[MR][NV];
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) t[i][v] = _mm256_setzero_ps();
    const float* b = p.b;
    const float* a = p.a;
    for (std::size_t k = 0; k < p.k; ++k) {
      __m256 bv[NV];
      for (int v = 0; v < NV; ++v) bv[v] = _mm256_maskload_ps(b + 8 * v, mk[v]);
      for (int i = 0; i < MR; ++i) {
        const __m256 av = _mm256_set1_ps(a[i * p.a_rs]);
        for (int v = 0; v < NV; ++v) t[i][v] = _mm256_fmadd_ps(av, bv[v], t[i][v]);
      }
      a += p.a_cs;
      b += p.ldb;
    }
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) _mm256_maskstore_ps(p.c + static_cast<std::size_t>(i) * p.ldc + 8 * v, mk[v], t[i][v]);
  }
};

// 16 partial sums as two 8-lane halves (lanes 0-7 and 8-15), so the bits equal the AVX-512 atom's.
template <int MR, int NR>
struct avx2_direct_dot_f32 {
  static constexpr int mr = MR, nr = NR;
  template <int R>
  using with_rows = avx2_direct_dot_f32<R, NR>;
  static void run(const direct_dot_args& p) {
    const float* b[NR];
    for (int j = 0; j < NR; ++j) b[j] = p.b + static_cast<std::size_t>(j < p.n ? j : 0) * p.ldb;
    __m256 s[MR][NR][2];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) s[i][j][0] = s[i][j][1] = _mm256_setzero_ps();
    // one loop, the last step masked (the accumulators stay in registers: see the AVX-512 atom)
    const __m256i all = _mm256_set1_epi32(-1);
    const std::uintptr_t ahead = static_cast<std::uintptr_t>(NR) * p.ldb * sizeof(float);  // (detail::prefetch_ahead)
    for (std::size_t k = 0; k < p.k; k += 16) {
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) detail::prefetch_ahead(b[j] + k, ahead);
      const bool full = k + 16 <= p.k;
      const __m256i m0 = full ? all : detail::lane_mask8(static_cast<long>(p.k - k));
      const __m256i m1 = full ? all : detail::lane_mask8(static_cast<long>(p.k - k) - 8);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i m = h ? m1 : m0;
        __m256 bv[NR];
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) bv[j] = _mm256_maskload_ps(b[j] + k + 8 * h, m);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const __m256 av = _mm256_maskload_ps(p.a + i * p.lda + k + 8 * h, m);
#pragma GCC unroll 8
          for (int j = 0; j < NR; ++j) s[i][j][h] = _mm256_fmadd_ps(av, bv[j], s[i][j][h]);
        }
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        const __m256 r8 = _mm256_add_ps(s[i][j][0], s[i][j][1]);
        const __m128 r4 = _mm_add_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps(r8, 1));
        const __m128 r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
        const __m128 r1 = _mm_add_ss(r2, _mm_shuffle_ps(r2, r2, 1));
        if (j < p.n) p.c[static_cast<std::size_t>(i) * p.ldc + j] = _mm_cvtss_f32(r1);
      }
  }
};
#endif

// ---- best direct atoms for this compilation ---------------------------------------------------
#if defined(__AVX512F__)
using best_direct_rows_atom = avx512_direct_rows_f32<4, 4>;  // 4 x 64: 16 accumulators
// up to 8 rows in one pass (each element of B loaded once): 8 x 32, 16 accumulators
using best_direct_rows_atom_few_rows = avx512_direct_rows_f32<8, 2>;
// one or two rows (a GEMV-like product): 128 columns, so 8 chains per row are in flight
using best_direct_rows_atom_gemv = avx512_direct_rows_f32<2, 8>;
using best_direct_dot_atom = avx512_direct_dot_f32<4, 4>;
// one or two rows: 8 columns, so 8 or 16 sums are in flight (4 chains of one row waited on the FMA
// latency: 1x13x2449 NT 43-46 -> 50-53 GFLOP/s, 1 thread)
using best_direct_dot_atom_few_rows = avx512_direct_dot_f32<2, 8>;
// one column (a matrix-vector product, N = 1): 8 rows, so no spare column repeats the work
using best_direct_dot_atom_one_col = avx512_direct_dot_f32<8, 1>;
#elif defined(__AVX2__) && defined(__FMA__)
using best_direct_rows_atom = avx2_direct_rows_f32<4, 2>;  // 4 x 16: 8 accumulators
using best_direct_rows_atom_few_rows = best_direct_rows_atom;
using best_direct_rows_atom_gemv = best_direct_rows_atom;
using best_direct_dot_atom = avx2_direct_dot_f32<2, 3>;  // 12 accumulator pairs
using best_direct_dot_atom_few_rows = best_direct_dot_atom;
using best_direct_dot_atom_one_col = avx2_direct_dot_f32<4, 1>;
#else
using best_direct_rows_atom = scalar_direct_rows_f32<4, 16>;
using best_direct_rows_atom_few_rows = best_direct_rows_atom;
using best_direct_rows_atom_gemv = best_direct_rows_atom;
using best_direct_dot_atom = scalar_direct_dot_f32<2, 4>;
using best_direct_dot_atom_few_rows = best_direct_dot_atom;
using best_direct_dot_atom_one_col = scalar_direct_dot_f32<4, 1>;
#endif

}  // namespace tessel::arch
