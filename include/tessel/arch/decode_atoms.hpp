// Micro-kernels of attention decode (a few query rows against a long KV cache read in place):
// scores of R query rows against 16 keys given by row pointers (vdpbf16ps over D, then a 16-way
// transpose-reduction), and O(R, D) += P(R, keys) · V(keys, D) with V rows interleaved into
// K-pairs on the fly. bf16 with AVX512-BF16; portable f32 versions for every other case.
#pragma once

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

// ---- portable: f32 rows ------------------------------------------------------------------------
// out[r*ld + j] = sum_d q[r*D + d] * k_j[d] for j < n keys (k_j already f32).
inline void qk_f32(const float* q, std::size_t R, std::size_t D, const float* const* krow, std::size_t n, float* out, std::size_t ld) {
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t j = 0; j < n; ++j) out[r * ld + j] = softmax::dot_row(q + r * D, krow[j], D);
}
// o[r*ldo + d] += sum_j p[r*ldp + j] * v_j[d].
inline void pv_f32(const float* p, std::size_t ldp, std::size_t R, const float* const* vrow, std::size_t n, std::size_t D, float* o, std::size_t ldo) {
  using vf = xsimd::batch<float>;
  for (std::size_t r = 0; r < R; ++r) {
    float* orow = o + r * ldo;
    for (std::size_t j = 0; j < n; ++j) {
      const float pj = p[r * ldp + j];
      if (pj == 0.0f) continue;
      const vf pv(pj);
      std::size_t d = 0;
      for (; d + vf::size <= D; d += vf::size) xsimd::fma(pv, vf::load_unaligned(vrow[j] + d), vf::load_unaligned(orow + d)).store_unaligned(orow + d);
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

// out[r*ld + j] (j < 16) = sum_d q(r, d) k_j(d), bf16 codes, D a multiple of 32.
inline void qk16_bf16(const std::uint16_t* q, std::size_t R, std::size_t D, const std::uint16_t* const* krow, float* out, std::size_t ld) {
  for (std::size_t r = 0; r < R; ++r) {
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
// (pairs), V rows bf16 codes; D a multiple of 32. R rows at compile time, so the 2R accumulators
// stay in registers.
template <int R>
inline void pv_bf16_rows(const std::uint16_t* p, std::size_t ldp, const std::uint16_t* const* vrow, std::size_t n, std::size_t D, float* o,
                         std::size_t ldo) {
  alignas(64) static constexpr std::uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                           8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr std::uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                           24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i ilo = _mm512_load_si512(lo_idx), ihi = _mm512_load_si512(hi_idx);
  for (std::size_t d = 0; d < D; d += 32) {
    __m512 acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_loadu_ps(o + r * ldo + d);
      acc[r][1] = _mm512_loadu_ps(o + r * ldo + d + 16);
    }
    for (std::size_t j = 0; j < n; j += 2) {
      const __m512i a = _mm512_loadu_si512(vrow[j] + d), b = _mm512_loadu_si512(vrow[j + 1] + d);
      const __m512i vlo = _mm512_permutex2var_epi16(a, ilo, b), vhi = _mm512_permutex2var_epi16(a, ihi, b);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        std::uint32_t pair;
        std::memcpy(&pair, p + r * ldp + j, 4);
        const __m512i pp = _mm512_set1_epi32(static_cast<int>(pair));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)pp, (__m512bh)vlo);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)pp, (__m512bh)vhi);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(o + r * ldo + d, acc[r][0]);
      _mm512_storeu_ps(o + r * ldo + d + 16, acc[r][1]);
    }
  }
}

// Same for R <= 8 rows given at run time.
inline void pv_bf16(const std::uint16_t* p, std::size_t ldp, std::size_t R, const std::uint16_t* const* vrow, std::size_t n, std::size_t D,
                    float* o, std::size_t ldo) {
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
inline void pv_bf16(const std::uint16_t* p, std::size_t ldp, std::size_t R, const std::uint16_t* const* vrow, std::size_t n, std::size_t D,
                    float* o, std::size_t ldo) {
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t j = 0; j < n; ++j) {
      const float pj = detail::bf16_bits_to_f32(p[r * ldp + j]);
      for (std::size_t d = 0; d < D; ++d) o[r * ldo + d] = std::fma(pj, detail::bf16_bits_to_f32(vrow[j][d]), o[r * ldo + d]);
    }
}
#endif

}  // namespace tessel::arch::decode
