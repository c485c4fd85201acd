// Micro-kernels of attention decode (a few query rows against a long KV cache read in place):
// scores of R query rows against 16 keys given by row pointers (vdpbf16ps over D, then a 16-way
// transpose-reduction), and O(R, D) += P(R, keys) · V(keys, D) with V rows interleaved into
// K-pairs on the fly. bf16 with AVX512-BF16; portable f32 versions for every other case.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <tessel/arch/target.hpp>
// first: it includes the intrinsic headers with GCC 12's spurious -Wuninitialized silenced
#include <tessel/arch/softmax_atoms.hpp>
#include <tessel/arch/gemm_atoms.hpp>
#include <tessel/arch/unpack.hpp>

namespace tessel::arch::decode {

// Reads one byte of every cache line of [a, a + bytes) and [b, b + bytes), alternating, in address
// order: a dense demand stream that the hardware prefetchers pick up (software prefetches of the
// same lines are not followed as well on these cores). Returns a value to pass to keep().
inline unsigned touch_lines2(const void* a, const void* b, std::size_t bytes) {
  const unsigned char* x = static_cast<const unsigned char*>(a);
  const unsigned char* y = static_cast<const unsigned char*>(b);
  unsigned s = 0;
  for (std::size_t o = 0; o < bytes; o += 64) s += static_cast<unsigned>(x[o]) + y[o];
  return s;
}
// Keeps the loads behind x from being optimised away.
inline void keep(unsigned x) {
#if defined(__GNUC__) || defined(__clang__)
  asm volatile("" : : "r"(x));
#else
  static volatile unsigned sink;
  sink = x;
#endif
}

// ---- portable: f32 rows ------------------------------------------------------------------------
// out[r*ld + j] = sum_d q[r*D + d] * k_j[d] for j < n keys (k_j already f32).
inline void qk_f32(const float* q, std::size_t R, std::size_t D, const float* const* krow, std::size_t n, float* out, std::size_t ld) {
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t j = 0; j < n; ++j) out[r * ld + j] = softmax::dot_row(q + r * D, krow[j], D);
}
// o[r*ldo + d] += sum_j p[r*ldp + j] * v_j[d].
inline void pv_f32(const float* p, std::size_t ldp, std::size_t R, const float* const* vrow, std::size_t n, std::size_t D, float* o,
                   std::size_t ldo) {
  using vf = xsimd::batch<float>;
  for (std::size_t r = 0; r < R; ++r) {
    float* orow = o + r * ldo;
    for (std::size_t j = 0; j < n; ++j) {
      const float pj = p[r * ldp + j];
      if (pj == 0.0f) continue;
      const vf pv(pj);
      std::size_t d = 0;
      for (; d + vf::size <= D; d += vf::size)
        stream::fma(pv, vf::load_unaligned(vrow[j] + d), vf::load_unaligned(orow + d)).store_unaligned(orow + d);
      for (; d < D; ++d) orow[d] = std::fma(pj, vrow[j][d], orow[d]);
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
inline constexpr bool has_bf16_decode = true;

// 16 vectors -> one vector of their horizontal sums (lane i = sum of a[i]).
inline __m512 reduce16(__m512 (&a)[16]) {
  __m512 x[4];
  for (int g = 0; g < 4; ++g) {
    __m512 s[2];
    for (int p = 0; p < 2; ++p) {
      const __m512 a0 = a[4 * g + 2 * p], a1 = a[4 * g + 2 * p + 1];
      s[p] = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    }
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(s[0]), _mm512_castps_pd(s[1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(s[0]), _mm512_castps_pd(s[1]));
    x[g] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
}

// out[r*ld + j] (j < 16) = sum_d q(r, d) k_j(d), bf16 codes, D a multiple of 32. Rows go in
// pairs against 8 keys at a time: each K vector loaded feeds two rows, and one transpose-reduction
// yields 8 scores of each row.
inline void qk16_bf16(const std::uint16_t* q, std::size_t R, std::size_t D, const std::uint16_t* const* krow, float* out, std::size_t ld) {
  std::size_t r = 0;
  for (; r + 2 <= R; r += 2) {
    const std::uint16_t* q0 = q + r * D;
    const std::uint16_t* q1 = q0 + D;
    for (int h = 0; h < 16; h += 8) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      for (std::size_t d = 0; d < D; d += 32) {
        const __m512i a = _mm512_loadu_si512(q0 + d), b = _mm512_loadu_si512(q1 + d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m512i kv = _mm512_loadu_si512(krow[h + j] + d);
          acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)a, (__m512bh)kv);
          acc[8 + j] = _mm512_dpbf16_ps(acc[8 + j], (__m512bh)b, (__m512bh)kv);
        }
      }
      const __m512 s = reduce16(acc);  // lanes 0-7: row r, keys h..h+7; lanes 8-15: row r+1
      _mm256_storeu_ps(out + r * ld + h, _mm512_castps512_ps256(s));
      _mm256_storeu_ps(out + (r + 1) * ld + h, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    }
  }
  for (; r < R; ++r) {
    const std::uint16_t* qr = q + r * D;
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (std::size_t d = 0; d < D; d += 32) {
      const __m512i qv = _mm512_loadu_si512(qr + d);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)qv, (__m512bh)_mm512_loadu_si512(krow[j] + d));
    }
    _mm512_storeu_ps(out + r * ld, reduce16(acc));
  }
}

// o(r, d) += sum_j p(r, j) v_j(d) over n (even) keys; p rows are bf16 codes with keys adjacent
// (pairs), V rows bf16 codes; D a multiple of 32. The pairs of two V rows are formed with in-lane
// unpacks (one cycle, unlike a cross-lane permute), so o keeps each 32-column chunk in "pv order":
// 128-bit groups [c0-3, c8-11, c16-19, c24-27, c4-7, c12-15, c20-23, c28-31]; from_pv_order
// restores the natural order. R rows and C chunks per pass at compile time: the 2·R·C
// accumulators stay in registers and are independent enough to hide the vdpbf16ps latency.
template <int R, int C>
inline void pv_bf16_pass(const std::uint16_t* p, std::size_t ldp, const std::uint16_t* const* vrow, std::size_t n, std::size_t d, float* o,
                         std::size_t ldo) {
  __m512 acc[R][C][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      acc[r][c][0] = _mm512_loadu_ps(o + r * ldo + d + 32 * c);
      acc[r][c][1] = _mm512_loadu_ps(o + r * ldo + d + 32 * c + 16);
    }
  for (std::size_t j = 0; j < n; j += 2) {
    __m512i vlo[C], vhi[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(vrow[j] + d + 32 * c), b = _mm512_loadu_si512(vrow[j + 1] + d + 32 * c);
      vlo[c] = _mm512_unpacklo_epi16(a, b);
      vhi[c] = _mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      std::uint32_t pair;
      std::memcpy(&pair, p + r * ldp + j, 4);
      const __m512i pp = _mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        acc[r][c][0] = _mm512_dpbf16_ps(acc[r][c][0], (__m512bh)pp, (__m512bh)vlo[c]);
        acc[r][c][1] = _mm512_dpbf16_ps(acc[r][c][1], (__m512bh)pp, (__m512bh)vhi[c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(o + r * ldo + d + 32 * c, acc[r][c][0]);
      _mm512_storeu_ps(o + r * ldo + d + 32 * c + 16, acc[r][c][1]);
    }
}
template <int R>
inline void pv_bf16_rows(const std::uint16_t* p, std::size_t ldp, const std::uint16_t* const* vrow, std::size_t n, std::size_t D, float* o,
                         std::size_t ldo) {
  constexpr int C = R <= 2 ? 4 : R <= 4 ? 2 : 1;
  std::size_t d = 0;
  for (; d + 32 * C <= D; d += 32 * C) pv_bf16_pass<R, C>(p, ldp, vrow, n, d, o, ldo);
  for (; d < D; d += 32) pv_bf16_pass<R, 1>(p, ldp, vrow, n, d, o, ldo);
}

// Same for R <= 8 rows given at run time.
inline void pv_bf16(const std::uint16_t* p, std::size_t ldp, std::size_t R, const std::uint16_t* const* vrow, std::size_t n, std::size_t D, float* o,
                    std::size_t ldo) {
  switch (R) {
    case 1: return pv_bf16_rows<1>(p, ldp, vrow, n, D, o, ldo);
    case 2: return pv_bf16_rows<2>(p, ldp, vrow, n, D, o, ldo);
    case 3: return pv_bf16_rows<3>(p, ldp, vrow, n, D, o, ldo);
    case 4: return pv_bf16_rows<4>(p, ldp, vrow, n, D, o, ldo);
    case 5: return pv_bf16_rows<5>(p, ldp, vrow, n, D, o, ldo);
    case 6: return pv_bf16_rows<6>(p, ldp, vrow, n, D, o, ldo);
    case 7: return pv_bf16_rows<7>(p, ldp, vrow, n, D, o, ldo);
    default: return pv_bf16_rows<8>(p, ldp, vrow, n, D, o, ldo);
  }
}

// ---- token order (4 query rows per kv head) ----------------------------------------------------
// A core here overlaps its memory reads with its math only when it walks the cache in address
// order and the line for a few tokens ahead is already requested (measured: head-order walks,
// 2 KiB apart, and dense bursts followed by math run reads and math one after the other). So these
// atoms take 4 consecutive token rows at once, every kv head in turn, line by line, and prefetch
// the same lines of 4 rows further along the walk (pf: row bases, kv head 0).

// Scores of 4 token rows against nh kv heads x 4 query rows: out[u*ld + h*4 + r] = q(h, r) . k_u(h),
// q rows (h*4 + r) of D bf16 codes (D a multiple of 32), k_u(h) at krow[u] + h*k_head. Each Q
// vector loaded feeds the 4 tokens; one transpose-reduction per head gives its 16 scores.
inline void qk_tok4_bf16(const std::uint16_t* q, std::size_t nh, std::size_t D, const std::uint16_t* const* krow, std::size_t k_head,
                         const std::uint16_t* const* pf, float* out, std::size_t ld) {
  for (std::size_t h = 0; h < nh; ++h) {
    const std::uint16_t* qh = q + h * 4 * D;
    const std::size_t off = h * k_head;
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
    for (std::size_t d = 0; d < D; d += 32) {
      __m512i x[4];
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        _mm_prefetch(reinterpret_cast<const char*>(pf[u] + off + d), _MM_HINT_T0);
        x[u] = _mm512_loadu_si512(krow[u] + off + d);
      }
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m512i qv = _mm512_loadu_si512(qh + r * D + d);
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) a[u * 4 + r] = _mm512_dpbf16_ps(a[u * 4 + r], (__m512bh)qv, (__m512bh)x[u]);
      }
    }
    const __m512 s = reduce16(a);  // lane u*4 + r
    _mm_storeu_ps(out + h * 4, _mm512_castps512_ps128(s));
    _mm_storeu_ps(out + ld + h * 4, _mm512_extractf32x4_ps(s, 1));
    _mm_storeu_ps(out + 2 * ld + h * 4, _mm512_extractf32x4_ps(s, 2));
    _mm_storeu_ps(out + 3 * ld + h * 4, _mm512_extractf32x4_ps(s, 3));
  }
}

// The same scores for nh a multiple of 4, with each token row read whole, in address order (kv
// head after kv head, line after line) before the next: one sequential stream, which the
// hardware prefetchers follow, where qk_tok4_bf16 reads 4 rows side by side. Each Q vector then
// feeds one token instead of 4 (math from L2 2.2 -> 2.6 ms on the bench shape), yet a core's reads
// hide better under its math (1-thread kernel 3.9-4.3 -> 3.8-4.0 ms). 4 kv heads per reduction.
inline void qk_tok4_seq_bf16(const std::uint16_t* q, std::size_t nh, std::size_t D, const std::uint16_t* const* krow, std::size_t k_head,
                             const std::uint16_t* const* pf, float* out, std::size_t ld) {
  for (int u = 0; u < 4; ++u)
    for (std::size_t h = 0; h < nh; h += 4) {
      __m512 a[16];
      for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int hh = 0; hh < 4; ++hh)
        for (std::size_t d = 0; d < D; d += 32) {
          const std::size_t off = (h + hh) * k_head + d;
          _mm_prefetch(reinterpret_cast<const char*>(pf[u] + off), _MM_HINT_T0);
          const __m512i x = _mm512_loadu_si512(krow[u] + off);
          const std::uint16_t* qh = q + (h + hh) * 4 * D + d;
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r) a[hh * 4 + r] = _mm512_dpbf16_ps(a[hh * 4 + r], (__m512bh)_mm512_loadu_si512(qh + r * D), (__m512bh)x);
        }
      _mm512_storeu_ps(out + u * ld + h * 4, reduce16(a));  // lane hh*4 + r
    }
}

// o(h*4 + r, :) += the P·V terms of N (4 or 8) token rows: pp[i*ldp + h*4 + r] holds the bf16 pair
// of tokens 2i (low) and 2i+1 (high); v_u(h) at vrow[u] + h*v_head. o rows of D floats in pv
// order (see pv_bf16); each accumulator gets the pairs in token order, as pv_bf16 adds them.
template <int N>
inline void pv_tok_bf16(const std::uint32_t* pp, std::size_t ldp, std::size_t nh, std::size_t D, const std::uint16_t* const* vrow, std::size_t v_head,
                        const std::uint16_t* const* pf, float* o) {
  static_assert(N == 4 || N == 8);
  for (std::size_t h = 0; h < nh; ++h) {
    const std::size_t off = h * v_head;
    __m512i a[N / 2][4];
#pragma GCC unroll 4
    for (int i = 0; i < N / 2; ++i)
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) a[i][r] = _mm512_set1_epi32(static_cast<int>(pp[i * ldp + h * 4 + r]));
    for (std::size_t d = 0; d < D; d += 32) {
      __m512i lo[N / 2], hi[N / 2];
#pragma GCC unroll 4
      for (int i = 0; i < N / 2; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(pf[2 * i] + off + d), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(pf[2 * i + 1] + off + d), _MM_HINT_T0);
        const __m512i x0 = _mm512_loadu_si512(vrow[2 * i] + off + d), x1 = _mm512_loadu_si512(vrow[2 * i + 1] + off + d);
        lo[i] = _mm512_unpacklo_epi16(x0, x1);
        hi[i] = _mm512_unpackhi_epi16(x0, x1);
      }
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        float* od = o + (h * 4 + r) * D + d;
        __m512 l = _mm512_loadu_ps(od), u = _mm512_loadu_ps(od + 16);
#pragma GCC unroll 4
        for (int i = 0; i < N / 2; ++i) {
          l = _mm512_dpbf16_ps(l, (__m512bh)a[i][r], (__m512bh)lo[i]);
          u = _mm512_dpbf16_ps(u, (__m512bh)a[i][r], (__m512bh)hi[i]);
        }
        _mm512_storeu_ps(od, l);
        _mm512_storeu_ps(od + 16, u);
      }
    }
  }
}

// The online-softmax step of n rows over G visible tokens, split so that its exp2 work can run
// inside the P·V walk (a phase of pure math would stall the core's read stream). Scores are
// s[t*ld + row], ld a multiple of 16; rows run 16 to a vector, tokens down the columns, so no
// horizontal reductions are needed.
// First: m (running max of s*c, log2 units) moves to the step's new max, and alpha[row] =
// exp2(m_old - m_new) is the factor the row's accumulator and sum must be scaled by (exactly 1
// when the max did not move). tmax[row] gets the step's raw max score t and sh[row] = t·c - m_new
// (<= 0, 0 when the step set the max): the exponents are (s - t)·c + sh, as softmax::online_row's.
inline void online_tok_max(const float* s, std::size_t ld, std::size_t G, std::size_t n, float c, float* m, float* alpha, float* tmax, float* sh) {
  const __m512 cv = _mm512_set1_ps(c);
  for (std::size_t j = 0; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1u);
    __m512 mx = _mm512_maskz_loadu_ps(k, s + j);
    for (std::size_t t = 1; t < G; ++t) mx = _mm512_max_ps(mx, _mm512_maskz_loadu_ps(k, s + t * ld + j));
    const __m512 mo = _mm512_maskz_loadu_ps(k, m + j);
    const __m512 tc = _mm512_mul_ps(mx, cv);  // read twice: not fused into the subtraction below
    const __m512 mn = _mm512_max_ps(mo, tc);
    _mm512_mask_storeu_ps(alpha + j, k, softmax::exp2_nonpos_scalef(softmax::vf(_mm512_sub_ps(mo, mn))));
    _mm512_mask_storeu_ps(m + j, k, mn);
    _mm512_mask_storeu_ps(tmax + j, k, mx);
    _mm512_mask_storeu_ps(sh + j, k, _mm512_sub_ps(tc, mn));
  }
}
// Then, for nt (even) tokens from s: p = exp2((s - tmax)*c + sh) is added to sum[row] in token
// order (f32), and pp[(t/2)*ld + row] gets the bf16 (RNE) pair of tokens t, t+1 that pv_tok_bf16
// takes.
inline void online_tok_exp(const float* s, std::size_t ld, std::size_t nt, std::size_t n, float c, const float* tmax, const float* sh,
                           std::uint32_t* pp, float* sum) {
  const __m512i pair_idx =
      _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512 cv = _mm512_set1_ps(c);
  for (std::size_t j = 0; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1u);
    const __m512 tv = _mm512_maskz_loadu_ps(k, tmax + j), shv = _mm512_maskz_loadu_ps(k, sh + j);
    __m512 acc = _mm512_maskz_loadu_ps(k, sum + j);
    for (std::size_t t = 0; t < nt; t += 2) {
      const __m512 x0 = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t * ld + j), tv), cv, shv);
      const __m512 x1 = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + (t + 1) * ld + j), tv), cv, shv);
      const __m512 p0 = softmax::exp2_nonpos_scalef(softmax::vf(x0));
      const __m512 p1 = softmax::exp2_nonpos_scalef(softmax::vf(x1));
      acc = _mm512_add_ps(_mm512_add_ps(acc, p0), p1);
      const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // words 0-15 token t, 16-31 token t+1
      _mm512_storeu_si512(pp + (t / 2) * ld + j, _mm512_permutexvar_epi16(pair_idx, w));
    }
    _mm512_mask_storeu_ps(sum + j, k, acc);
  }
}

// dst(D) = src(D) in natural column order, src in pv order (see pv_bf16).
inline void from_pv_order(const float* src, float* dst, std::size_t D) {
  for (std::size_t d = 0; d < D; d += 32)
    for (std::size_t g = 0; g < 4; ++g) {
      std::memcpy(dst + d + 8 * g, src + d + 4 * g, 16);
      std::memcpy(dst + d + 8 * g + 4, src + d + 16 + 4 * g, 16);
    }
}
#else
inline constexpr bool has_bf16_decode = false;

// Scalar versions with the same contracts (this build has no vdpbf16ps; callers use the f32 path).
inline void qk16_bf16(const std::uint16_t* q, std::size_t R, std::size_t D, const std::uint16_t* const* krow, float* out, std::size_t ld) {
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t j = 0; j < 16; ++j) {
      float acc = 0.0f;
      for (std::size_t d = 0; d < D; ++d) acc = std::fma(detail::bf16_bits_to_f32(q[r * D + d]), detail::bf16_bits_to_f32(krow[j][d]), acc);
      out[r * ld + j] = acc;
    }
}
inline void pv_bf16(const std::uint16_t* p, std::size_t ldp, std::size_t R, const std::uint16_t* const* vrow, std::size_t n, std::size_t D, float* o,
                    std::size_t ldo) {
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t j = 0; j < n; ++j) {
      const float pj = detail::bf16_bits_to_f32(p[r * ldp + j]);
      for (std::size_t d = 0; d < D; ++d) o[r * ldo + d] = std::fma(pj, detail::bf16_bits_to_f32(vrow[j][d]), o[r * ldo + d]);
    }
}
// The scalar pv_bf16 keeps natural order.
inline void from_pv_order(const float* src, float* dst, std::size_t D) { std::memcpy(dst, src, D * sizeof(float)); }
// Token-order forms with the same contracts (scalar; pv_tok4_bf16 in natural order, as pv_bf16).
inline void qk_tok4_bf16(const std::uint16_t* q, std::size_t nh, std::size_t D, const std::uint16_t* const* krow, std::size_t k_head,
                         const std::uint16_t* const*, float* out, std::size_t ld) {
  for (std::size_t u = 0; u < 4; ++u)
    for (std::size_t h = 0; h < nh; ++h) {
      for (std::size_t r = 0; r < 4; ++r) {
        float acc = 0.0f;
        for (std::size_t d = 0; d < D; ++d)
          acc = std::fma(detail::bf16_bits_to_f32(q[(h * 4 + r) * D + d]), detail::bf16_bits_to_f32(krow[u][h * k_head + d]), acc);
        out[u * ld + h * 4 + r] = acc;
      }
    }
}
inline void qk_tok4_seq_bf16(const std::uint16_t* q, std::size_t nh, std::size_t D, const std::uint16_t* const* krow, std::size_t k_head,
                             const std::uint16_t* const* pf, float* out, std::size_t ld) {
  qk_tok4_bf16(q, nh, D, krow, k_head, pf, out, ld);
}
template <int N>
inline void pv_tok_bf16(const std::uint32_t* pp, std::size_t ldp, std::size_t nh, std::size_t D, const std::uint16_t* const* vrow, std::size_t v_head,
                        const std::uint16_t* const*, float* o) {
  for (std::size_t h = 0; h < nh; ++h)
    for (std::size_t r = 0; r < 4; ++r)
      for (std::size_t u = 0; u < std::size_t(N); ++u) {
        const std::uint32_t pr = pp[(u / 2) * ldp + h * 4 + r];
        const float pj = detail::bf16_bits_to_f32(static_cast<std::uint16_t>(u % 2 ? pr >> 16 : pr & 0xffffu));
        for (std::size_t d = 0; d < D; ++d)
          o[(h * 4 + r) * D + d] = std::fma(pj, detail::bf16_bits_to_f32(vrow[u][h * v_head + d]), o[(h * 4 + r) * D + d]);
      }
}
inline void online_tok_max(const float* s, std::size_t ld, std::size_t G, std::size_t n, float c, float* m, float* alpha, float* tmax, float* sh) {
  for (std::size_t j = 0; j < n; ++j) {
    float mx = s[j];
    for (std::size_t t = 1; t < G; ++t) mx = std::max(mx, s[t * ld + j]);
    const float tc = mx * c, mn = std::max(m[j], tc);
    alpha[j] = softmax::exp2_nonpos(m[j] - mn);
    m[j] = mn;
    tmax[j] = mx;
    sh[j] = tc - mn;
  }
}
inline void online_tok_exp(const float* s, std::size_t ld, std::size_t nt, std::size_t n, float c, const float* tmax, const float* sh,
                           std::uint32_t* pp, float* sum) {
  for (std::size_t j = 0; j < n; ++j)
    for (std::size_t t = 0; t < nt; t += 2) {
      const float p0 = softmax::exp2_nonpos(std::fma(s[t * ld + j] - tmax[j], c, sh[j]));
      const float p1 = softmax::exp2_nonpos(std::fma(s[(t + 1) * ld + j] - tmax[j], c, sh[j]));
      sum[j] = sum[j] + p0 + p1;
      pp[(t / 2) * ld + j] = std::uint32_t(softmax::f32_to_bf16_bits(p0)) | (std::uint32_t(softmax::f32_to_bf16_bits(p1)) << 16);
    }
}
#endif

}  // namespace tessel::arch::decode
