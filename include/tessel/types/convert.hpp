// Bulk conversions between float and tessel's narrow types over spans: convert (value or
// saturating semantics), per-tensor quantize/dequantize, and block-scaled quantize/dequantize.
// Vectorized with Highway (arch/convert.hpp, which this numbers-layer header includes as its one
// use of the instructions layer); results are bit-identical to the scalar conversions.
#pragma once

#include <cstddef>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <tessel/types/errors.hpp>
#include <tessel/arch/convert.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp16.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel {
inline namespace v0 {
// A narrow float type that the bulk API converts to and from float.
template <class T>
concept narrow_float = std::is_same_v<T, bf16> || std::is_same_v<T, fp16> || std::is_same_v<T, e4m3> || std::is_same_v<T, e5m2>;

// Largest finite value of a narrow type, as float (448 for e4m3, 57344 for e5m2, ...).
template <narrow_float T>
inline constexpr float max_finite = static_cast<float>(T::from_bits(T::format::max_code));

}  // namespace v0

namespace detail {
inline void check_sizes(const char* fn, const char* a, std::size_t na, const char* b, std::size_t nb) {
  if (na != nb)
    throw type_error(errc::invalid_argument,
                     std::string(fn) + ": " + a + " has " + std::to_string(na) + " elements but " + b + " has " + std::to_string(nb));
}
inline void check_block(const char* fn, std::size_t n, std::size_t block) {
  if (block == 0) throw type_error(errc::invalid_argument, std::string(fn) + ": block size is 0");
  if (n % block != 0)
    throw type_error(errc::invalid_argument,
                     std::string(fn) + ": block size " + std::to_string(block) + " does not divide the length " + std::to_string(n));
}
inline void check_scale(const char* fn, float scale) {
  if (!(scale > 0.0f) || scale == std::numeric_limits<float>::infinity())
    throw type_error(errc::invalid_argument, std::string(fn) + ": scale " + std::to_string(scale) + " is not a positive finite number");
}
template <class T>
auto* raw(T* p) noexcept {
  if constexpr (narrow_float<std::remove_const_t<T>>)
    return reinterpret_cast<
        std::conditional_t<std::is_const_v<T>, const typename std::remove_const_t<T>::storage_type, typename std::remove_const_t<T>::storage_type>*>(
        p);
  else
    return p;
}
}  // namespace detail

inline namespace v0 {

// float -> narrow. propagate: value semantics (e4m3 overflow -> NaN, others -> +-Inf);
// saturate: finite overflow and +-Inf -> +-max; NaN stays NaN. RNE, subnormals kept.
template <narrow_float To>
void convert(std::span<const float> src, std::span<To> dst, overflow ov = overflow::propagate) {
  detail::check_sizes("convert", "source", src.size(), "destination", dst.size());
  if (ov == overflow::saturate)
    arch::encode_f32<typename To::format, overflow::saturate>(src.data(), detail::raw(dst.data()), src.size());
  else
    arch::encode_f32<typename To::format, overflow::propagate>(src.data(), detail::raw(dst.data()), src.size());
}

// narrow -> float (exact). The overflow argument is accepted for symmetry and has no effect.
template <narrow_float From>
void convert(std::span<const From> src, std::span<float> dst, overflow = overflow::propagate) {
  detail::check_sizes("convert", "source", src.size(), "destination", dst.size());
  arch::decode_f32<typename From::format>(detail::raw(src.data()), dst.data(), src.size());
}

// Convenience overloads for non-const source spans (span<T> does not deduce span<const T>).
template <narrow_float To>
void convert(std::span<float> src, std::span<To> dst, overflow ov = overflow::propagate) {
  convert(std::span<const float>(src), dst, ov);
}
template <narrow_float From>
void convert(std::span<From> src, std::span<float> dst, overflow ov = overflow::propagate) {
  convert(std::span<const From>(src), dst, ov);
}

// Any other pair of float types (double <-> narrow, narrow <-> narrow, float <-> double): scalar,
// one rounding each (narrow -> narrow goes through float, which holds every narrow value exactly).
template <class T>
concept bulk_float = narrow_float<T> || std::is_same_v<T, float> || std::is_same_v<T, double>;

template <bulk_float From, bulk_float To>
requires(!(std::is_same_v<From, float> && narrow_float<To>)&&!(narrow_float<From> &&
                                                               std::is_same_v<To, float>)) void convert(std::span<const From> src, std::span<To> dst,
                                                                                                        overflow ov = overflow::propagate) {
  detail::check_sizes("convert", "source", src.size(), "destination", dst.size());
  for (std::size_t i = 0; i < src.size(); ++i) {
    if constexpr (narrow_float<To>) {
      using Mid = std::conditional_t<std::is_same_v<From, double>, double, float>;
      const Mid x = static_cast<Mid>(src[i]);
      dst[i] = To::from_bits(ov == overflow::saturate ? detail::encode<typename To::format, overflow::saturate>(x)
                                                      : detail::encode<typename To::format, overflow::propagate>(x));
    } else {
      dst[i] = static_cast<To>(src[i]);
    }
  }
}

// Per-tensor scaled quantization: dst[i] = To(src[i] / scale) (float division, then one RNE to To).
// scale must be positive and finite (std::invalid_argument otherwise).
template <narrow_float To>
void quantize(std::span<const float> src, std::span<To> dst, float scale, overflow ov = overflow::saturate) {
  detail::check_sizes("quantize", "source", src.size(), "destination", dst.size());
  detail::check_scale("quantize", scale);
  if (ov == overflow::saturate)
    arch::quantize_f32<typename To::format, overflow::saturate>(src.data(), detail::raw(dst.data()), src.size(), scale);
  else
    arch::quantize_f32<typename To::format, overflow::propagate>(src.data(), detail::raw(dst.data()), src.size(), scale);
}

// dst[i] = float(src[i]) * scale.
template <narrow_float From>
void dequantize(std::span<const From> src, std::span<float> dst, float scale) {
  detail::check_sizes("dequantize", "source", src.size(), "destination", dst.size());
  arch::dequantize_f32<typename From::format>(detail::raw(src.data()), dst.data(), src.size(), scale);
}

inline constexpr std::size_t default_quant_block = 128;

// The scale block-scaled quantization uses for a block whose largest finite magnitude is amax:
// amax / max_finite<To>, so amax maps to max. A block with no finite non-zero value (all zeros,
// or only NaN/Inf) gets scale 1, and the scale is never below the smallest normal float, so that
// dividing by it never overflows a finite value of the block past max.
template <narrow_float To>
float block_scale(float amax) noexcept {
  if (!(amax > 0.0f)) return 1.0f;
  const float s = amax / max_finite<To>;
  return s < std::numeric_limits<float>::min() ? std::numeric_limits<float>::min() : s;
}

// Block-scaled quantization: one scale per `block` contiguous values (block_scale of the block's
// largest finite |x|; NaN and +-Inf do not set the scale and then follow `ov`), written to
// `scales` (size src.size() / block). dst[i] = To(src[i] / scales[i / block]).
template <narrow_float To>
void quantize_blocks(std::span<const float> src, std::span<To> dst, std::span<float> scales, std::size_t block = default_quant_block,
                     overflow ov = overflow::saturate) {
  detail::check_sizes("quantize_blocks", "source", src.size(), "destination", dst.size());
  detail::check_block("quantize_blocks", src.size(), block);
  detail::check_sizes("quantize_blocks", "scales", scales.size(), "source / block", src.size() / block);
  const auto scale_of = [](float amax) { return block_scale<To>(amax); };
  if (ov == overflow::saturate)
    arch::quantize_blocks_f32<typename To::format, overflow::saturate>(src.data(), detail::raw(dst.data()), scales.data(), src.size(), block,
                                                                       scale_of);
  else
    arch::quantize_blocks_f32<typename To::format, overflow::propagate>(src.data(), detail::raw(dst.data()), scales.data(), src.size(), block,
                                                                        scale_of);
}

// Same, returning the scales.
template <narrow_float To>
std::vector<float> quantize_blocks(std::span<const float> src, std::span<To> dst, std::size_t block = default_quant_block,
                                   overflow ov = overflow::saturate) {
  detail::check_block("quantize_blocks", src.size(), block);
  std::vector<float> scales(src.size() / block);
  quantize_blocks(src, dst, std::span<float>(scales), block, ov);
  return scales;
}

// Inverse of quantize_blocks: dst[i] = float(src[i]) * scales[i / block].
template <narrow_float From>
void dequantize_blocks(std::span<const From> src, std::span<const float> scales, std::span<float> dst, std::size_t block = default_quant_block) {
  detail::check_sizes("dequantize_blocks", "source", src.size(), "destination", dst.size());
  detail::check_block("dequantize_blocks", src.size(), block);
  detail::check_sizes("dequantize_blocks", "scales", scales.size(), "source / block", src.size() / block);
  arch::dequantize_blocks_f32<typename From::format>(detail::raw(src.data()), scales.data(), dst.data(), src.size(), block);
}

}  // namespace v0
}  // namespace tessel
