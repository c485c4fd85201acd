// Vector kernels for the bulk float <-> narrow-float conversions (tessel/types/convert.hpp).
// Highway static dispatch; the rounding is the integer algorithm of types/detail/codec.hpp done
// lane-wise (never the target's own demote instructions, whose NaN/subnormal handling differs),
// so every lane equals the scalar conversion bit for bit. Tails go through the scalar codec.
#pragma once

#include <cstddef>
#include <cstdint>

// Static dispatch only: without this, Highway 1.0.3 stops with "best baseline should be included
// in dynamic targets" under -march=native on AVX-512 machines (AVX3_DL is not an attainable target).
#ifndef HWY_COMPILE_ONLY_STATIC
#define HWY_COMPILE_ONLY_STATIC 1
#endif
#include <hwy/highway.h>

#include <tessel/types/detail/codec.hpp>

namespace tessel::arch {
namespace hn = hwy::HWY_NAMESPACE;

namespace detail {
using tessel::detail::source_traits;

// Lane-wise detail::encode<Fmt, Ov, float>: float bits in, format codes (in u32 lanes) out.
template <class Fmt, overflow Ov, class D, class V>
HWY_INLINE V encode_lanes(D du, V u) {
  constexpr std::uint32_t shift = 23 - Fmt::man_bits;
  constexpr std::uint32_t emin = std::uint32_t(127 - Fmt::bias + 1);
  constexpr std::uint32_t rebias = std::uint32_t(127 - Fmt::bias) << 23;
  V a = hn::And(u, hn::Set(du, 0x7FFFFFFFu));
  if constexpr (Ov == overflow::saturate) {
    // Clamping |x| to max before rounding is saturation (anything above max rounds to max or
    // beyond); NaN lanes must pass through unchanged.
    constexpr float max_f = tessel::detail::decode_bits<Fmt, float>(static_cast<typename Fmt::storage>(Fmt::max_code));
    if constexpr (Fmt::exp_bits == 8) {
      // bf16 keeps float subnormals, so no FP min here (DAZ would zero them): rotate the NaN
      // range [0x7F800001, 0x7FFFFFFF] to the bottom of u32, clamp, rotate back.
      constexpr std::uint32_t rot = 0x7F800001u;
      const V r = hn::Sub(a, hn::Set(du, rot));
      a = hn::Add(hn::Min(r, hn::Set(du, std::bit_cast<std::uint32_t>(max_f) - rot)), hn::Set(du, rot));
    } else {
      // x86 min returns its second operand when either is NaN, so NaN lanes pass through. (Under
      // DAZ a subnormal float becomes 0 here, which is what these formats round it to anyway.)
      const hn::Rebind<float, D> df;
      a = hn::BitCast(du, hn::Min(hn::Set(df, max_f), hn::BitCast(df, a)));
    }
  }
  const V one = hn::Set(du, 1u);
  V code;
  if constexpr (Fmt::exp_bits == 8) {  // bf16: same exponent range as float, one rounding shift
    code = hn::ShiftRight<shift>(hn::Add(hn::Add(a, hn::Set(du, (1u << (shift - 1)) - 1)), hn::And(hn::ShiftRight<shift>(a), one)));
  } else {
    // Fast path, exact for every lane whose biased exponent e is >= emin (target normal) or
    // <= emin - man - 2 (|x| <= half the smallest subnormal: rounds to 0): clamping a at rebias
    // sends the latter to code 0.
    const V e = hn::ShiftRight<23>(a);
    const V x = hn::Sub(hn::Max(a, hn::Set(du, rebias)), hn::Set(du, rebias));
    code = hn::ShiftRight<shift>(hn::Add(hn::Add(x, hn::Set(du, (1u << (shift - 1)) - 1)), hn::And(hn::ShiftRight<shift>(x), one)));
    // Lanes in [2^(emin-man-1), 2^emin) round onto the subnormal grid: take the slow path for the
    // whole vector when any lane is there (rare in scaled data).
    constexpr std::uint32_t lo = emin - Fmt::man_bits - 1;
    const auto is_sub = hn::Lt(hn::Sub(e, hn::Set(du, lo)), hn::Set(du, emin - lo));
    if (HWY_UNLIKELY(!hn::AllFalse(du, is_sub))) {
      // One variable-shift rounding of the full significand: m >> (shift + emin - e).
      const V m = hn::Or(hn::And(a, hn::Set(du, 0x7FFFFFu)), hn::Set(du, 0x800000u));
      const V s_m1 = hn::Sub(hn::Set(du, shift + emin - 1), e);
      const V s = hn::Add(s_m1, one);
      const V odd = hn::And(hn::Shr(m, s), one);
      const V sub = hn::Shr(hn::Add(hn::Add(m, hn::Shl(one, s_m1)), hn::Sub(odd, one)), s);
      code = hn::IfThenElse(is_sub, sub, code);
    }
  }
  // (Saturated lanes are already <= max; this catches propagate overflow and E4M3 NaN.)
  code = hn::Min(code, hn::Set(du, Fmt::overflow_code));
  if constexpr (Fmt::ieee) {
    const auto is_nan = hn::Gt(a, hn::Set(du, 0x7F800000u));
    const V payload = hn::And(hn::ShiftRight<shift>(a), hn::Set(du, Fmt::man_mask));
    const V quiet = hn::Set(du, 1u << (Fmt::man_bits - 1));
    const V nan = hn::Or(hn::Set(du, Fmt::inf_code), hn::IfThenElse(hn::Eq(payload, hn::Zero(du)), quiet, payload));
    code = hn::IfThenElse(is_nan, nan, code);
  }  // (E4M3: NaN inputs already became the NaN code through the limit.)
  const V sign = hn::And(hn::ShiftRight<31 - Fmt::exp_bits - Fmt::man_bits>(u), hn::Set(du, Fmt::sign_bit));
  return hn::Or(code, sign);
}

// Lane-wise detail::decode<Fmt, float>: codes (u32 lanes) in, float bits out.
template <class Fmt, class D, class V>
HWY_INLINE V decode_lanes(D du, V h) {
  constexpr std::uint32_t shift = 23 - Fmt::man_bits;
  const V sign = hn::ShiftLeft<31 - Fmt::exp_bits - Fmt::man_bits>(hn::And(h, hn::Set(du, Fmt::sign_bit)));
  const V em = hn::And(h, hn::Set(du, Fmt::abs_mask));
  if constexpr (Fmt::exp_bits == 8) {
    return hn::Or(sign, hn::ShiftLeft<shift>(em));
  } else {
    const hn::Rebind<float, D> df;
    const hn::Rebind<std::int32_t, D> di;
    V f = hn::Add(hn::ShiftLeft<shift>(em), hn::Set(du, std::uint32_t(127 - Fmt::bias) << 23));
    const V ex = hn::ShiftRight<Fmt::man_bits>(em);
    // Subnormal: mantissa * 2^(1-bias-man), exact in float and a normal float.
    const auto sub = hn::Mul(hn::ConvertTo(df, hn::BitCast(di, em)), hn::Set(df, tessel::detail::pow2<float>(1 - Fmt::bias - Fmt::man_bits)));
    f = hn::IfThenElse(hn::Eq(ex, hn::Zero(du)), hn::BitCast(du, sub), f);
    if constexpr (Fmt::ieee) {
      const V special = hn::Or(hn::Set(du, 0x7F800000u), hn::ShiftLeft<shift>(hn::And(em, hn::Set(du, Fmt::man_mask))));
      f = hn::IfThenElse(hn::Eq(ex, hn::Set(du, Fmt::exp_max)), special, f);
    } else {
      f = hn::IfThenElse(hn::Eq(em, hn::Set(du, Fmt::abs_mask)), hn::Set(du, 0x7FC00000u), f);
    }
    return hn::Or(f, sign);
  }
}

template <class Storage>
using narrow_tag = hn::Rebind<Storage, hn::ScalableTag<std::uint32_t>>;

// Store the low 8/16 bits of each u32 lane (values already fit).
template <class Storage, class V>
HWY_INLINE void store_codes(V code, Storage* dst) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  // One vpmovdb/vpmovdw: Highway 1.0.3's DemoteTo takes ~5 shuffle ops here, and this store is
  // on the critical path of a memory-bound loop. (Lanes hold codes < 2^16, so truncation is exact;
  // the maskz form because GCC 12 warns inside the unmasked intrinsic.)
  if constexpr (sizeof(Storage) == 1)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_maskz_cvtepi32_epi8(0xFFFF, code.raw));
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_maskz_cvtepi32_epi16(0xFFFF, code.raw));
#else
  const hn::ScalableTag<std::int32_t> di;
  hn::StoreU(hn::DemoteTo(narrow_tag<Storage>(), hn::BitCast(di, code)), narrow_tag<Storage>(), dst);
#endif
}
template <class Storage>
HWY_INLINE auto load_codes(const Storage* src) {
  const hn::ScalableTag<std::uint32_t> du;
  return hn::PromoteTo(du, hn::LoadU(narrow_tag<Storage>(), src));
}

}  // namespace detail

// Scalar tails are written with pointers: GCC 12 misreads the index form after inlining with a
// constant n (a false -Waggressive-loop-optimizations error).

// dst[i] = encode<Fmt, Ov>(src[i]).
template <class Fmt, overflow Ov>
void encode_f32(const float* src, typename Fmt::storage* dst, std::size_t n) {
  const hn::ScalableTag<std::uint32_t> du;
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(du);
  std::size_t i = 0;
  for (; i + N <= n; i += N) detail::store_codes(detail::encode_lanes<Fmt, Ov>(du, hn::BitCast(du, hn::LoadU(df, src + i))), dst + i);
  for (const float* p = src + i; p != src + n; ++p) dst[p - src] = tessel::detail::encode<Fmt, Ov>(*p);
}

// dst[i] = encode<Fmt, Ov>(src[i] / scale).
template <class Fmt, overflow Ov>
HWY_INLINE void quantize_f32(const float* src, typename Fmt::storage* dst, std::size_t n, float scale) {
  const hn::ScalableTag<std::uint32_t> du;
  const hn::ScalableTag<float> df;
  const auto vs = hn::Set(df, scale);
  const std::size_t N = hn::Lanes(du);
  std::size_t i = 0;
  for (; i + N <= n; i += N) detail::store_codes(detail::encode_lanes<Fmt, Ov>(du, hn::BitCast(du, hn::Div(hn::LoadU(df, src + i), vs))), dst + i);
  for (const float* p = src + i; p != src + n; ++p) dst[p - src] = tessel::detail::encode<Fmt, Ov>(*p / scale);
}

HWY_INLINE float amax_finite_f32(const float* src, std::size_t n);

// Block-scaled: for each of the n / block blocks, scales[b] = scale_of(largest finite |x| of the
// block), then the block is quantized with it. (Sizes are checked by the caller.)
template <class Fmt, overflow Ov, class ScaleOf>
void quantize_blocks_f32(const float* src, typename Fmt::storage* dst, float* scales, std::size_t n, std::size_t block, ScaleOf scale_of) {
  // Groups of blocks small enough to stay in L1/L2: first all their scales (independent
  // reductions pipeline well), then the quantization, so no block waits on its own reduction.
  constexpr std::size_t group_floats = 4096;
  const std::size_t group = block >= group_floats ? 1 : group_floats / block;
  const std::size_t nb = n / block;
  for (std::size_t g = 0; g < nb; g += group) {
    const std::size_t ge = g + group < nb ? g + group : nb;
    for (std::size_t b = g; b < ge; ++b) scales[b] = scale_of(amax_finite_f32(src + b * block, block));
    for (std::size_t b = g; b < ge; ++b) quantize_f32<Fmt, Ov>(src + b * block, dst + b * block, block, scales[b]);
  }
}

// dst[i] = decode<Fmt>(src[i]).
template <class Fmt>
void decode_f32(const typename Fmt::storage* src, float* dst, std::size_t n) {
  const hn::ScalableTag<std::uint32_t> du;
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(du);
  std::size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::BitCast(df, detail::decode_lanes<Fmt>(du, detail::load_codes(src + i))), df, dst + i);
  for (auto* p = src + i; p != src + n; ++p) dst[p - src] = tessel::detail::decode<Fmt, float>(*p);
}

// dst[i] = decode<Fmt>(src[i]) * scale.
template <class Fmt>
HWY_INLINE void dequantize_f32(const typename Fmt::storage* src, float* dst, std::size_t n, float scale) {
  const hn::ScalableTag<std::uint32_t> du;
  const hn::ScalableTag<float> df;
  const auto vs = hn::Set(df, scale);
  const std::size_t N = hn::Lanes(du);
  std::size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::BitCast(df, detail::decode_lanes<Fmt>(du, detail::load_codes(src + i))), vs), df, dst + i);
  for (auto* p = src + i; p != src + n; ++p) dst[p - src] = tessel::detail::decode<Fmt, float>(*p) * scale;
}

// dst[i] = decode<Fmt>(src[i]) * scales[i / block].
template <class Fmt>
void dequantize_blocks_f32(const typename Fmt::storage* src, const float* scales, float* dst, std::size_t n, std::size_t block) {
  for (std::size_t b = 0, o = 0; o < n; ++b, o += block) dequantize_f32<Fmt>(src + o, dst + o, block, scales[b]);
}

// Largest |x| over the finite values of src (0 when there are none). Compares magnitudes as
// integers (non-negative floats order like their bits), so it is exact and NaN-proof.
HWY_INLINE float amax_finite_f32(const float* src, std::size_t n) {
  const hn::ScalableTag<std::uint32_t> du;
  const std::size_t N = hn::Lanes(du);
  auto m = hn::Zero(du);
  const auto abs_mask = hn::Set(du, 0x7FFFFFFFu);
  const auto inf = hn::Set(du, 0x7F800000u);
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto a = hn::And(hn::LoadU(du, reinterpret_cast<const std::uint32_t*>(src) + i), abs_mask);
    m = hn::Max(m, hn::IfThenElseZero(hn::Lt(a, inf), a));
  }
  std::uint32_t best = hn::GetLane(hn::MaxOfLanes(du, m));
  for (const float* p = src + i; p != src + n; ++p) {
    const std::uint32_t a = std::bit_cast<std::uint32_t>(*p) & 0x7FFFFFFFu;
    if (a < 0x7F800000u && a > best) best = a;
  }
  return std::bit_cast<float>(best);
}

}  // namespace tessel::arch
