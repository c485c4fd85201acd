// Row kernels of the online (streaming) softmax that fused attention runs between its two matrix
// products: scaled row maximum, exp2 of shifted logits with the row sum, rescaling of an
// accumulator row, and f32 -> bf16 (RNE) packing of probabilities. xsimd vectors, scalar tails.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

// GCC 12 warns (-Wuninitialized, not only -Wmaybe-uninitialized) inside its AVX-512 headers when
// _mm512_max_ps / roundscale / cvtt inline into our code; what counts is the pragma state when the
// intrinsic headers are first parsed, so include them here first with both silenced.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#include <tessel/arch/stream.hpp>
#include <tessel/arch/target.hpp>

namespace tessel::arch::softmax {

using vf = xsimd::batch<float>;
inline constexpr std::size_t W = vf::size;
inline constexpr float neg_inf = -std::numeric_limits<float>::infinity();

// f32 -> bf16 bits: round to nearest even with tessel::bf16's NaN rule (arch::stream's scalar
// conversion, so the scalar tails below give the same bits as the vector bodies).
inline std::uint16_t f32_to_bf16_bits(float f) { return stream::f32_to_bf16_bits(f); }

// exp2 for x <= 0 (and -inf -> 0), accurate to 3 ulp (2.6 measured over [-126, 0]): 2^x = 2^round(x) * p(f), |f| <= 0.5,
// a degree-6 polynomial. Faster than a general exp because no overflow branch is needed. A positive
// x gives 1: callers pass score·c − max as one fma, which is exact, so the max element itself can
// come out above 0 by the rounding of max (half an ulp of it: past 2^25 in log2 units for scores
// of 1e9 and more, whose exp2 overflowed and turned the softmax into NaN).
// (Every multiply-add here is stream::fma: xsimd 8's AVX-512 fma/fms are the generic a*b+c, which
// GCC fuses and Clang does not, so the vector bodies rounded unlike their scalar std::fma twins.)
template <class B>
inline B exp2_nonpos(const B& x) {
  using I = xsimd::as_integer_t<B>;
  const B xc = xsimd::max(xsimd::min(B(0.0f), x), B(-127.0f));  // below: flushed to 0 below (and -inf, NaN -> 0)
  const B r = xsimd::nearbyint(xc);
  const B f = xc - r;  // [-0.5, 0.5]
  // minimax-like Taylor terms of 2^f
  B p = B(1.5403530393381606e-4f);
  p = stream::fma(p, f, B(1.3333558146428443e-3f));
  p = stream::fma(p, f, B(9.6181291076284772e-3f));
  p = stream::fma(p, f, B(5.5504108664821580e-2f));
  p = stream::fma(p, f, B(2.4022650695910071e-1f));
  p = stream::fma(p, f, B(6.9314718055994531e-1f));
  p = stream::fma(p, f, B(1.0f));
  const I e = (xsimd::to_int(r) + I(127)) << 23;
  const B scale = xsimd::bitwise_cast<B>(e);
  return xsimd::select(x < B(-126.0f), B(0.0f), p * scale);
}
// Scalar twin of the vector version (same polynomial, so scalar and vector results agree; no libm
// call on the per-row rescaling path). exp2_nonpos(0) == 1 exactly.
inline float exp2_nonpos(float x) {
  if (!(x >= -126.0f)) return 0.0f;
  x = std::min(x, 0.0f);
  const float r = std::nearbyint(x);
  const float f = x - r;
  float p = 1.5403530393381606e-4f;
  p = std::fma(p, f, 1.3333558146428443e-3f);
  p = std::fma(p, f, 9.6181291076284772e-3f);
  p = std::fma(p, f, 5.5504108664821580e-2f);
  p = std::fma(p, f, 2.4022650695910071e-1f);
  p = std::fma(p, f, 6.9314718055994531e-1f);
  p = std::fma(p, f, 1.0f);
  const std::uint32_t e = static_cast<std::uint32_t>(static_cast<std::int32_t>(r) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}

// W floats in a register -> W bf16 codes: the bits of f32_to_bf16_bits for every lane (RNE,
// subnormals kept, NaN quiet). arch::stream's conversion, which takes vcvtneps2bf16 only for
// vectors without subnormal or NaN lanes (the instruction reads subnormals as zero), so a value's
// code does not depend on whether it sits in a vector body or a scalar tail, nor on the target.
inline void store_bf16(const vf& x, std::uint16_t* out) { stream::store_bf16(x, out); }

// W floats -> W bf16 codes (as above).
inline void store_bf16(const float* x, std::uint16_t* out) { stream::store_bf16(vf::load_unaligned(x), out); }

// Largest lane of v.
inline float hmax(const vf& v) {
#if defined(__AVX512F__)
  if constexpr (W == 16) return _mm512_reduce_max_ps(v);
#endif
  alignas(64) float t[W];
  v.store_aligned(t);
  float m = t[0];
  for (std::size_t i = 1; i < W; ++i) m = t[i] > m ? t[i] : m;
  return m;
}

// One online-softmax step of a row over 32 scores, all visible: m (running max of s*c, log2
// units) and l (running sum) are updated, p gets exp2(s*c - m_new) as bf16 codes (RNE), and the
// factor alpha = exp2(m_old - m_new) that the row's accumulator must be scaled by is returned.
inline float online_step32_bf16(const float* s, float c, float& m, float& l, std::uint16_t* p) {
  constexpr std::size_t N = 32 / W;
  vf x[N];
  vf mx = vf::load_unaligned(s);
  x[0] = mx;
  for (std::size_t i = 1; i < N; ++i) {
    x[i] = vf::load_unaligned(s + i * W);
    mx = xsimd::max(mx, x[i]);
  }
  const float t = hmax(mx), tc = t * c, mn = std::max(m, tc);
  const float alpha = exp2_nonpos(m - mn);
  const vf cv(c), tv(t), shv(tc - mn);  // exponents (s - t)·c - (mn - t·c): see online_row
  vf sum(0.0f);
  for (std::size_t i = 0; i < N; ++i) {
    const vf v = exp2_nonpos(stream::fma(x[i] - tv, cv, shv));
    sum += v;
    store_bf16(v, p + i * W);
  }
  l = l * alpha + xsimd::hadd(sum);
  m = mn;
  return alpha;
}

// max_j s[j] * scale over [0, n) (scale > 0, so max(s)*scale); -inf for n == 0.
inline float row_max(const float* s, std::size_t n) {
  std::size_t j = 0;
  float m = neg_inf;
  if (n >= W) {
    vf mv = vf::load_unaligned(s);
    for (j = W; j + W <= n; j += W) mv = xsimd::max(mv, vf::load_unaligned(s + j));
    alignas(64) float t[W];
    mv.store_aligned(t);
    for (std::size_t i = 0; i < W; ++i) m = t[i] > m ? t[i] : m;
  }
  for (; j < n; ++j) m = s[j] > m ? s[j] : m;
  return m;
}

// p[j] = exp2((s[j] - t)*c - m) for j < n (m finite; one fma after the subtraction, and with the
// default t = 0 exactly exp2(s[j]*c - m)), returns sum_j p[j] (f32, in fixed lane order).
// OutBits = uint16_t writes bf16 bits (RNE); float writes f32. The sum is over the f32 values.
template <class Out>
inline float exp2_row(const float* s, std::size_t n, float c, float m, Out* p, float t = 0.0f) {
  const vf cv(c), mv(m), tv(t);
  vf acc(0.0f);
  std::size_t j = 0;
  for (; j + W <= n; j += W) {
    const vf e = exp2_nonpos(stream::fma(vf::load_unaligned(s + j) - tv, cv, -mv));
    acc += e;
    if constexpr (std::is_same_v<Out, float>)
      e.store_unaligned(p + j);
    else
      store_bf16(e, p + j);
  }
  float sum = xsimd::hadd(acc);
  for (; j < n; ++j) {
    const float e = exp2_nonpos(std::fma(s[j] - t, c, -m));
    sum += e;
    if constexpr (std::is_same_v<Out, float>)
      p[j] = e;
    else
      p[j] = f32_to_bf16_bits(e);
  }
  return sum;
}

// exp2_nonpos with AVX-512's vscalefps: the same polynomial and the same bits as exp2_nonpos for
// every x <= 0 (x < -126, -inf and NaN give 0), in 11 instructions instead of 16: 2^r is applied by
// scalef rather than built from exponent bits, and the lanes below -126 are zeroed by a mask. A
// positive x is not clamped here (online_row's exponents never are; the callers whose exponents
// can be clamp them, nonpos()).
inline vf exp2_nonpos_scalef(const vf& x) {
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    const __m512 v = x;
    const __mmask16 keep = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    const __m512 r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(v, r);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, p, r);
  }
#endif
  return exp2_nonpos(x);
}

// One online-softmax step of a row whose visible scores are s[0, n) (n >= 1): the running max m
// (of s*c, log2 units) and sum l are updated, p[0, n) gets exp2(s*c - m_new) (bf16 codes, RNE, or
// f32), and alpha = exp2(m_old - m_new), the factor the row's accumulator must be scaled by, is
// returned (exactly 1 when the max did not move, without evaluating exp2). One pass for the max and
// one for exp2 and the sum, both in registers; with AVX-512 the last partial vector is masked
// rather than run lane by lane, so only then does the sum's order differ from exp2_row's.
// The exponents s·c - m_new as one fma are exact but for m_new's own rounding, a shift common to
// the row that the normalisation cancels while it is small: half an ulp of m_new, at most 2^-14
// below online_exact_max (2^10 in log2 units: scores of about 700, past any trained model's), so the
// max key's weight still rounds to bf16's 1 and P·V and l agree. Past it the shift grows (at
// scores of 1e9 it passed exp2's range: a row of Inf and NaN, or a row flushed to 0 and taken for
// masked), so such rows take the exponents from the block's own max t: (s - t)·c + (t·c - m_new),
// with s - t never positive, and the max key gets exp2(0) = 1 when it sets m_new (l >= 1 at any
// magnitude). One subtraction more per score, which costs the forward kernel 3%: hence only there.
inline constexpr float online_exact_max = 0x1p10f;
template <class Out>
inline float online_row(const float* s, std::size_t n, float c, float& m, float& l, Out* p) {
  static_assert(std::is_same_v<Out, float> || std::is_same_v<Out, std::uint16_t>);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (W == 16) {
    const std::size_t full = n / W * W;
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1u);
    const __m512 ninf = _mm512_set1_ps(neg_inf);
    __m512 mv = ninf;
    std::size_t j = 0;
    for (; j < full; j += W) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
    if (tail) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(ninf, tail, s + full));
    const float t = _mm512_reduce_max_ps(mv), tc = t * c, mn = std::max(m, tc);
    const float alpha = mn == m ? 1.0f : exp2_nonpos(m - mn);
    const vf cv(c), tv(t), shv(tc - mn), mnv(-mn);
    vf sum(0.0f);
    auto put = [&](const vf& e, std::size_t at, __mmask16 k) {
      if constexpr (std::is_same_v<Out, float>) {
        _mm512_mask_storeu_ps(p + at, k, e);
      } else {
#if defined(__AVX512BF16__)
        _mm256_mask_storeu_epi16(p + at, k, (__m256i)_mm512_cvtneps_pbh(e));
#else
        alignas(32) std::uint16_t b[W];
        store_bf16(e, b);
        for (std::size_t i = 0; i < W; ++i)
          if (k >> i & 1u) p[at + i] = b[i];
#endif
      }
    };
    auto exps = [&]<bool FromMax>() {
      const auto x = [&](const vf& v) { return FromMax ? stream::fma(v - tv, cv, shv) : stream::fma(v, cv, mnv); };
      for (j = 0; j < full; j += W) {
        const vf e = exp2_nonpos_scalef(x(vf::load_unaligned(s + j)));
        sum += e;
        put(e, j, 0xffff);
      }
      if (tail) {  // lanes past n load -inf and give exactly 0
        const vf e = exp2_nonpos_scalef(x(vf(_mm512_mask_loadu_ps(ninf, tail, s + full))));
        sum += e;
        put(e, full, tail);
      }
    };
    if (std::fabs(mn) < online_exact_max)
      exps.template operator()<false>();
    else
      exps.template operator()<true>();
    l = l * alpha + xsimd::hadd(sum);
    m = mn;
    return alpha;
  }
#endif
  const float t = row_max(s, n), tc = t * c, mn = std::max(m, tc);
  const float alpha = mn == m ? 1.0f : exp2_nonpos(m - mn);
  const bool from_max = !(std::fabs(mn) < online_exact_max);
  l = l * alpha + exp2_row(s, n, c, from_max ? mn - tc : mn, p, from_max ? t : 0.0f);
  m = mn;
  return alpha;
}

// Converts n floats to bf16 codes (RNE).
inline void to_bf16_row(const float* x, std::size_t n, std::uint16_t* out) {
  std::size_t j = 0;
  for (; j + W <= n; j += W) store_bf16(x + j, out + j);
  for (; j < n; ++j) out[j] = f32_to_bf16_bits(x[j]);
}

// o[j] *= a for j < n.
inline void scale_row(float* o, std::size_t n, float a) {
  const vf av(a);
  std::size_t j = 0;
  for (; j + W <= n; j += W) (vf::load_unaligned(o + j) * av).store_unaligned(o + j);
  for (; j < n; ++j) o[j] *= a;
}

// sum_j x[j]*y[j] in f32 (fixed lane order).
inline float dot_row(const float* x, const float* y, std::size_t n) {
  vf acc(0.0f);
  std::size_t j = 0;
  for (; j + W <= n; j += W) acc = stream::fma(vf::load_unaligned(x + j), vf::load_unaligned(y + j), acc);
  float s = xsimd::hadd(acc);
  for (; j < n; ++j) s = std::fma(x[j], y[j], s);
  return s;
}

// ds[j] = p[j] * (dp[j] - delta) * c for j < n (softmax backward, in place into dp).
inline void softmax_grad_row(const float* p, float* dp, std::size_t n, float delta, float c) {
  const vf dv(delta), cv(c);
  std::size_t j = 0;
  for (; j + W <= n; j += W) (vf::load_unaligned(p + j) * (vf::load_unaligned(dp + j) - dv) * cv).store_unaligned(dp + j);
  for (; j < n; ++j) dp[j] = p[j] * (dp[j] - delta) * c;
}

// min(x, 0) per lane, NaN kept (vminps returns its second operand when either is NaN).
inline vf nonpos(const vf& x) { return xsimd::min(vf(0.0f), x); }

// p[j] = exp2(s[j]*c - m) in place (m finite, or -inf giving zeros), f32 (the bits of exp2_nonpos).
inline void exp2_inplace(float* s, std::size_t n, float c, float m) {
  if (m == neg_inf) {
    for (std::size_t j = 0; j < n; ++j) s[j] = 0.0f;
    return;
  }
  const vf cv(c), mv(m);
  std::size_t j = 0;
  for (; j + W <= n; j += W) exp2_nonpos_scalef(nonpos(stream::fma(vf::load_unaligned(s + j), cv, -mv))).store_unaligned(s + j);
  for (; j < n; ++j) s[j] = exp2_nonpos(std::fma(s[j], c, -m));
}

// p[j] = exp2(s[j]*c - m[j]) with a per-column shift m (m[j] = +inf gives 0), f32.
inline void exp2_cols(const float* s, const float* m, std::size_t n, float c, float* p) {
  const vf cv(c);
  std::size_t j = 0;
  for (; j + W <= n; j += W)
    exp2_nonpos_scalef(nonpos(stream::fma(vf::load_unaligned(s + j), cv, -vf::load_unaligned(m + j)))).store_unaligned(p + j);
  for (; j < n; ++j) p[j] = exp2_nonpos(std::fma(s[j], c, -m[j]));
}

// dp[j] = p[j] * (dp[j] - delta[j]) with a per-column delta (softmax backward of a transposed tile).
inline void softmax_grad_cols(const float* p, float* dp, const float* delta, std::size_t n) {
  std::size_t j = 0;
  for (; j + W <= n; j += W) (vf::load_unaligned(p + j) * (vf::load_unaligned(dp + j) - vf::load_unaligned(delta + j))).store_unaligned(dp + j);
  for (; j < n; ++j) dp[j] = p[j] * (dp[j] - delta[j]);
}

}  // namespace tessel::arch::softmax
