// Matrix-multiply atoms: register-blocked micro-kernels computing an (MR,NR) f32 tile from packed
// panels. Named for target, shape and types (CuTe style); each has a scalar reference with the
// same arithmetic order, which tests compare it with. `best_*` aliases pick the fastest atom this
// compilation can run; an atom whose instructions are not enabled fails to compile with a message.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <tessel/arch/target.hpp>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tessel::arch {

// Arguments of one micro-kernel call.
//  f32 atoms (k_pack = 1):   a = [k][MR] floats,          b = [k][NR] floats
//  pair atoms (k_pack = 2):  a = [k/2][MR][2] bf16 bits,  b = [k/2][NR][2] bf16 bits; `k` counts pairs
// Result t = A·B accumulated over k in order; with scales t(i,j) is multiplied by
// row_scale[i] * col_scale[j] (null = 1); then c = t (accumulate = false) or c = c + t.
struct ukernel_args {
  std::size_t k = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  float* c = nullptr;
  std::size_t ldc = 0;
  bool accumulate = false;
  const float* row_scale = nullptr;
  const float* col_scale = nullptr;
  // 0: A is a packed panel. Otherwise A is read in place, row i at a + i*a_rs elements
  // (row-major f32, or row-major bf16 whose K-pairs are adjacent): no packing for row-major A.
  std::size_t a_rs = 0;
};

namespace detail {
template <int MR, int NR>
inline void finish_scalar(const ukernel_args& p, const float (&t)[MR][NR]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float* c = p.c + static_cast<std::size_t>(i) * p.ldc + j;
      if (p.row_scale || p.col_scale) {
        const float s = (p.row_scale ? p.row_scale[i] : 1.0f) * (p.col_scale ? p.col_scale[j] : 1.0f);
        *c = p.accumulate ? std::fma(t[i][j], s, *c) : t[i][j] * s;
      } else {
        *c = p.accumulate ? *c + t[i][j] : t[i][j];
      }
    }
}
inline float bf16_bits_to_f32(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Flush a subnormal to (signed) zero, as vdpbf16ps does with its inputs and outputs.
inline float flush_subnormal(float x) {
  return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x;
}
}  // namespace detail

// ---- scalar references ------------------------------------------------------------------------

// c (MR,NR) from f32 panels with one fused multiply-add per k, in k order.
template <int MR, int NR>
struct scalar_fma_f32 {
  static constexpr int mr = MR, nr = NR, k_pack = 1;
  template <int R> using with_rows = scalar_fma_f32<R, NR>;
  using a_type = float;
  using b_type = float;
  static void run(const ukernel_args& p) {
    const float* a = static_cast<const float*>(p.a);
    const float* b = static_cast<const float*>(p.b);
    const std::size_t rs = p.a_rs ? p.a_rs : 1, ks = p.a_rs ? 1 : MR;
    float t[MR][NR] = {};
    for (std::size_t k = 0; k < p.k; ++k)
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) t[i][j] = std::fma(a[k * ks + i * rs], b[k * NR + j], t[i][j]);
    detail::finish_scalar<MR, NR>(p, t);
  }
};

// c (MR,NR) from bf16 K-pair panels with the semantics of vdpbf16ps: per pair,
// t += a1*b1 then t += a0*b0 (products exact, each sum rounded), subnormals flushed.
template <int MR, int NR>
struct scalar_dot2_bf16 {
  static constexpr int mr = MR, nr = NR, k_pack = 2;
  template <int R> using with_rows = scalar_dot2_bf16<R, NR>;
  using a_type = std::uint16_t;
  using b_type = std::uint16_t;
  static void run(const ukernel_args& p) {
    const auto* a = static_cast<const std::uint16_t*>(p.a);
    const auto* b = static_cast<const std::uint16_t*>(p.b);
    const std::size_t rs = p.a_rs ? p.a_rs : 2, ks = p.a_rs ? 2 : 2 * MR;
    float t[MR][NR] = {};
    using detail::bf16_bits_to_f32;
    using detail::flush_subnormal;
    for (std::size_t k = 0; k < p.k; ++k)
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) {
          const float a0 = flush_subnormal(bf16_bits_to_f32(a[k * ks + i * rs]));
          const float a1 = flush_subnormal(bf16_bits_to_f32(a[k * ks + i * rs + 1]));
          const float b0 = flush_subnormal(bf16_bits_to_f32(b[(k * NR + j) * 2]));
          const float b1 = flush_subnormal(bf16_bits_to_f32(b[(k * NR + j) * 2 + 1]));
          float acc = flush_subnormal(t[i][j]);
          acc = flush_subnormal(acc + a1 * b1);
          acc = flush_subnormal(acc + a0 * b0);
          t[i][j] = acc;
        }
    detail::finish_scalar<MR, NR>(p, t);
  }
};

// ---- AVX-512 --------------------------------------------------------------------------------
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
      _mm512_storeu_ps(c + 16 * v, t[i][v]);
    }
  }
}
}  // namespace detail

// (MR, 16*NV) f32 tile with AVX-512 FMA: A broadcast per row, B rows as NV zmm vectors.
template <int MR, int NV>
struct avx512_fma_f32 {
  static constexpr int mr = MR, nr = 16 * NV, k_pack = 1;
  template <int R> using with_rows = avx512_fma_f32<R, NV>;
  using a_type = float;
  using b_type = float;
  static void run(const ukernel_args& p) {
    if (p.a_rs) run_impl<true>(p);
    else run_impl<false>(p);
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
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// (MR, 16*NV) f32 tile from bf16 K-pairs with vdpbf16ps: 32 multiply-adds per instruction per row.
template <int MR, int NV>
struct avx512bf16_dot_bf16bf16f32 {
  static constexpr int mr = MR, nr = 16 * NV, k_pack = 2;
  template <int R> using with_rows = avx512bf16_dot_bf16bf16f32<R, NV>;
  using a_type = std::uint16_t;
  using b_type = std::uint16_t;
  static void run(const ukernel_args& p) {
    if (p.a_rs) run_impl<true>(p);
    else run_impl<false>(p);
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
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// Skinny product c(M, n) = a(M, K) · b(K, n), n <= 128, for M <= 3 rows of bf16 activations and
// bf16 rows of B read in place (no packing: a GEMV-like product is bound by reading B once).
// One f32 FMA per k in k order per element (bf16 products are exact in f32).
template <int M>
struct avx512_rows_bf16_f32 {
  static_assert(M >= 1 && M <= 3, "avx512_rows_bf16_f32: 1 to 3 rows");
  static constexpr int max_cols = 128;
  static void run(const std::uint16_t* a, std::size_t lda, const std::uint16_t* b, std::size_t ldb, std::size_t K, int n, float* c,
                  std::size_t ldc) {
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

// ---- AVX2 -------------------------------------------------------------------------------------
#if defined(__AVX2__) && defined(__FMA__)
// (MR, 8*NV) f32 tile with AVX2 FMA.
template <int MR, int NV>
struct avx2_fma_f32 {
  static constexpr int mr = MR, nr = 8 * NV, k_pack = 1;
  template <int R> using with_rows = avx2_fma_f32<R, NV>;
  using a_type = float;
  using b_type = float;
  static void run(const ukernel_args& p) {
    const float* a = static_cast<const float*>(p.a);
    const float* b = static_cast<const float*>(p.b);
    const std::size_t rs = p.a_rs ? p.a_rs : 1, ks = p.a_rs ? 1 : MR;
    __m256 t[MR][NV];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) t[i][v] = _mm256_setzero_ps();
    std::size_t k = p.k;
#pragma GCC unroll 4
    for (; k > 0; --k) {
      __m256 bv[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(b + 8 * v);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const __m256 av = _mm256_broadcast_ss(a + i * rs);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) t[i][v] = _mm256_fmadd_ps(av, bv[v], t[i][v]);
      }
      a += ks;
      b += 8 * NV;
    }
    const bool scaled = p.row_scale || p.col_scale;
    for (int i = 0; i < MR; ++i) {
      float* c = p.c + static_cast<std::size_t>(i) * p.ldc;
      const __m256 rs = _mm256_set1_ps(p.row_scale ? p.row_scale[i] : 1.0f);
      for (int v = 0; v < NV; ++v) {
        __m256 r = t[i][v];
        if (scaled) {
          const __m256 s = _mm256_mul_ps(rs, p.col_scale ? _mm256_loadu_ps(p.col_scale + 8 * v) : _mm256_set1_ps(1.0f));
          r = p.accumulate ? _mm256_fmadd_ps(r, s, _mm256_loadu_ps(c + 8 * v)) : _mm256_mul_ps(r, s);
        } else if (p.accumulate) {
          r = _mm256_add_ps(_mm256_loadu_ps(c + 8 * v), r);
        }
        _mm256_storeu_ps(c + 8 * v, r);
      }
    }
  }
};
using avx2_fma_6x16_f32 = avx2_fma_f32<6, 2>;
#endif

// ---- best atoms for this compilation ----------------------------------------------------------
#if defined(__AVX512F__)
using best_f32_atom = avx512_fma_f32<8, 2>;
#elif defined(__AVX2__) && defined(__FMA__)
using best_f32_atom = avx2_fma_6x16_f32;
#else
using best_f32_atom = scalar_fma_f32<4, 8>;
#endif

// Atom for bf16 x bf16 -> f32. Without avx512_bf16 there is no pair atom: bf16 operands are widened
// to f32 while packing and `best_f32_atom` runs (has_pair_atom tells callers which).
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
using best_bf16_atom = avx512bf16_dot_bf16bf16f32<12, 2>;
inline constexpr bool has_pair_atom = true;
#else
using best_bf16_atom = best_f32_atom;
inline constexpr bool has_pair_atom = false;
#endif

// Runs Atom::with_rows<rows> (1 <= rows <= Atom::mr): the same atom for a partial row panel,
// so edge rows cost what they compute (M = 1 runs a 1-row kernel, not a padded MR-row one).
template <class Atom, int R = Atom::mr>
inline void run_rows(int rows, const ukernel_args& p) {
  if constexpr (R >= 1) {
    if (rows == R) return Atom::template with_rows<R>::run(p);
    return run_rows<Atom, R - 1>(rows, p);
  }
}

// Scalar reference matching an atom's arithmetic.
template <class Atom>
using reference_atom_for = std::conditional_t<Atom::k_pack == 2, scalar_dot2_bf16<Atom::mr, Atom::nr>, scalar_fma_f32<Atom::mr, Atom::nr>>;

}  // namespace tessel::arch
