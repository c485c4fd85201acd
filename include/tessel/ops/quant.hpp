// Bulk dtype conversion as a streaming tile program: dst[i] = To(float(src[i]) * scale), rounded to
// nearest even (the numeric policy), for any pair of tessel's element types. The model layer uses it
// where an f32 stream meets a bf16 GEMM operand; the e4m3 attention backward uses it to dequantise.
// Unscaled float <-> narrow conversions run the numbers layer's vectorised bulk convert on each
// chunk; every other case converts element by element (the same bits either way).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include <tessel/arch/unpack.hpp>
#include <tessel/ops/errors.hpp>
#include <tessel/tile/block_ctx.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp16.hpp>
#include <tessel/types/convert.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel {
namespace detail::quant {

template <class To>
inline To from_f32(float x) {
  if constexpr (std::is_same_v<To, float>)
    return x;
  else
    return To(x);
}

template <class From, class To>
struct convert_program {
  const From* src;
  To* dst;
  std::size_t n;
  float scale;
  static constexpr std::size_t chunk = std::size_t{1} << 16;
  void operator()(block_ctx& ctx) const {
    const std::size_t i0 = ctx.block_linear() * chunk, i1 = std::min(n, i0 + chunk);
    if (scale == 1.0f) {
      // The numbers layer's bulk conversions (Highway; bit-identical to the scalar ones) per chunk.
      if constexpr (std::is_same_v<From, float> && narrow_float<To>) {
        tessel::convert(std::span<const float>(src + i0, i1 - i0), std::span<To>(dst + i0, i1 - i0));
        return;
      } else if constexpr (narrow_float<From> && std::is_same_v<To, float>) {
        tessel::convert(std::span<const From>(src + i0, i1 - i0), std::span<float>(dst + i0, i1 - i0));
        return;
      }
    }
    for (std::size_t i = i0; i < i1; ++i) dst[i] = from_f32<To>(arch::to_f32(src[i]) * scale);
  }
};

template <class To, class From, class Dev>
void convert_on(Dev& dev, const From* src, To* dst, std::size_t n, float scale) {
  if (n) dev.launch(grid{ceil_div(n, convert_program<From, To>::chunk)}, convert_program<From, To>{src, dst, n, scale});
}

}  // namespace detail::quant

inline namespace v0 {

// dst = To(src * scale) elementwise on `dev`. src and dst must have the same length and must not
// overlap unless they are the same storage of the same type.
template <class Dev, class From, class To>
void convert(Dev& dev, std::span<const From> src, std::span<To> dst, float scale = 1.0f) {
  if (src.size() != dst.size())
    throw layer_error(errc::invalid_argument,
                      "convert: source has " + std::to_string(src.size()) + " elements, destination " + std::to_string(dst.size()));
  if (!src.empty() && (!src.data() || !dst.data())) throw layer_error(errc::invalid_argument, "convert: null buffer");
  if constexpr (std::is_same_v<std::remove_const_t<From>, To>) {
    if (static_cast<const void*>(src.data()) == static_cast<const void*>(dst.data()) && scale == 1.0f) return;
  }
  detail::quant::convert_on<To>(dev, src.data(), dst.data(), src.size(), scale);
}

}  // namespace v0
}  // namespace tessel
