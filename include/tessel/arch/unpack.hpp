// Widening element decoders used when tiles are loaded: narrow float codes to f32 (exact) and
// FP8 codes to bf16 bits (exact: every e4m3/e5m2 value is a bf16 value), through 256-entry
// tables built at compile time from the number layer's own decoders.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <tessel/arch/target.hpp>
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

// out[2j] = r0[j], out[2j+1] = r1[j] for j < n: two rows of 16-bit codes into K-pairs (VNNI).
inline void interleave_u16(const std::uint16_t* r0, const std::uint16_t* r1, std::uint16_t* out, std::size_t n) {
  std::size_t j = 0;
#if defined(__AVX512BW__)
  alignas(64) static constexpr std::uint16_t lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr std::uint16_t hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i ilo = _mm512_load_si512(lo), ihi = _mm512_load_si512(hi);
  for (; j + 32 <= n; j += 32) {
    // fetch ahead: B is streamed from memory once and the loads alone do not keep enough misses in flight
    _mm_prefetch(reinterpret_cast<const char*>(r0 + j + 512), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(r1 + j + 512), _MM_HINT_T0);
    const __m512i a = _mm512_loadu_si512(r0 + j), b = _mm512_loadu_si512(r1 + j);
    _mm512_storeu_si512(out + 2 * j, _mm512_permutex2var_epi16(a, ilo, b));
    _mm512_storeu_si512(out + 2 * j + 32, _mm512_permutex2var_epi16(a, ihi, b));
  }
#endif
  for (; j < n; ++j) {
    out[2 * j] = r0[j];
    out[2 * j + 1] = r1[j];
  }
}

}  // namespace tessel::arch
