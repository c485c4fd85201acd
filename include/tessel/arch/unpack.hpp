// Widening element decoders used when tiles are loaded: narrow float codes to f32 (exact) and
// FP8 codes to bf16 bits (exact: every e4m3/e5m2 value is a bf16 value), through 256-entry
// tables built at compile time from the number layer's own decoders.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>

#include <tessel/types/bf16.hpp>
#include <tessel/types/fp16.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel::arch {

namespace detail {
template <class F8>
constexpr std::array<float, 256> make_f8_table() {
  std::array<float, 256> t{};
  for (unsigned i = 0; i < 256; ++i) t[i] = static_cast<float>(F8::from_bits(static_cast<std::uint8_t>(i)));
  return t;
}
template <class F8>
constexpr std::array<std::uint16_t, 256> make_f8_bf16_table() {
  std::array<std::uint16_t, 256> t{};
  for (unsigned i = 0; i < 256; ++i) t[i] = bf16(static_cast<float>(F8::from_bits(static_cast<std::uint8_t>(i)))).bits();
  return t;
}
}  // namespace detail

template <class F8> inline constexpr std::array<float, 256> f8_to_f32_table = detail::make_f8_table<F8>();
template <class F8> inline constexpr std::array<std::uint16_t, 256> f8_to_bf16_table = detail::make_f8_bf16_table<F8>();

// Any supported element to f32.
template <class T>
inline float to_f32(T x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else if constexpr (std::is_same_v<T, bf16>) {
    const std::uint32_t u = static_cast<std::uint32_t>(x.bits()) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else if constexpr (std::is_same_v<T, e4m3> || std::is_same_v<T, e5m2>) return f8_to_f32_table<T>[x.bits()];
  else return static_cast<float>(x);
}

// Element to bf16 bits: exact for bf16 and FP8; RNE for wider types.
template <class T>
inline std::uint16_t to_bf16_bits(T x) {
  if constexpr (std::is_same_v<T, bf16>) return x.bits();
  else if constexpr (std::is_same_v<T, e4m3> || std::is_same_v<T, e5m2>) return f8_to_bf16_table<T>[x.bits()];
  else return bf16(static_cast<float>(x)).bits();
}

}  // namespace tessel::arch
