// Widening element decoders used when tiles are loaded: narrow float codes to f32 (exact) and
// FP8 codes to bf16 bits (exact: every e4m3/e5m2 value is a bf16 value), through 256-entry
// tables built at compile time from the number layer's own decoders.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

template <class F8>
inline constexpr std::array<float, 256> f8_to_f32_table = detail::make_f8_table<F8>();
template <class F8>
inline constexpr std::array<std::uint16_t, 256> f8_to_bf16_table = detail::make_f8_bf16_table<F8>();

// Any supported element to f32.
template <class T>
inline float to_f32(T x) {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else if constexpr (std::is_same_v<T, bf16>) {
    const std::uint32_t u = static_cast<std::uint32_t>(x.bits()) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else if constexpr (std::is_same_v<T, e4m3> || std::is_same_v<T, e5m2>)
    return f8_to_f32_table<T>[x.bits()];
  else
    return static_cast<float>(x);
}

// Element to bf16 bits: exact for bf16 and FP8; RNE for wider types.
template <class T>
inline std::uint16_t to_bf16_bits(T x) {
  if constexpr (std::is_same_v<T, bf16>)
    return x.bits();
  else if constexpr (std::is_same_v<T, e4m3> || std::is_same_v<T, e5m2>)
    return f8_to_bf16_table<T>[x.bits()];
  else
    return bf16(static_cast<float>(x)).bits();
}

#if defined(__AVX512BW__)
namespace detail {
// The 128 magnitude codes of an FP8 format as bf16 bits, in four 32-word vectors for vpermi2w.
template <class F8>
struct f8_bf16_vec_table {
  alignas(64) std::uint16_t t[128];
  f8_bf16_vec_table() {
    for (unsigned i = 0; i < 128; ++i) t[i] = f8_to_bf16_table<F8>[i];
  }
};
// 32 FP8 codes (zero-extended to words) -> 32 bf16 codes, exact.
template <class F8>
inline __m512i f8x32_to_bf16(__m512i w) {
  static const f8_bf16_vec_table<F8> tab;
  const __m512i t0 = _mm512_load_si512(tab.t), t1 = _mm512_load_si512(tab.t + 32), t2 = _mm512_load_si512(tab.t + 64),
                t3 = _mm512_load_si512(tab.t + 96);
  const __m512i lo = _mm512_permutex2var_epi16(t0, w, t1);  // index bits 0..5 (bit 5 picks t1)
  const __m512i hi = _mm512_permutex2var_epi16(t2, w, t3);
  const __mmask32 upper = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40));
  const __m512i mag = _mm512_mask_blend_epi16(upper, lo, hi);
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8);
  return _mm512_or_si512(mag, sign);
}
}  // namespace detail
#endif

// Widens a run of n elements: S -> D for the stage types (D = float or bf16), exactly when the
// value fits (bf16/FP8 -> bf16, anything -> float); vectorized for the common pairs. The vector
// loops end at n rounded down to their width, so the scalar tail provably starts at or below n:
// written as `j + 8 <= n`, GCC 12 kept a path with j past a small known n (a caller that bounds n
// by its tile) and raised -Werror=aggressive-loop-optimizations on the tail ("iteration 2^63-1").
template <class S, class D>
inline void widen(const S* src, D* dst, std::size_t n) {
  std::size_t j = 0;
  if constexpr (std::is_same_v<S, D>) {
    std::memcpy(dst, src, n * sizeof(D));
    return;
  }
#if defined(__AVX512BW__)
  if constexpr ((std::is_same_v<S, e4m3> || std::is_same_v<S, e5m2>)&&std::is_same_v<D, bf16>) {
    for (; j < n / 32 * 32; j += 32) {
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j)));
      _mm512_storeu_si512(dst + j, detail::f8x32_to_bf16<S>(w));
    }
  }
  if constexpr ((std::is_same_v<S, e4m3> || std::is_same_v<S, e5m2>)&&std::is_same_v<D, float>) {
    for (; j < n / 32 * 32; j += 32) {
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j)));
      const __m512i b = detail::f8x32_to_bf16<S>(w);
      _mm512_storeu_si512(dst + j, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(b)), 16));
      _mm512_storeu_si512(dst + j + 16, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1)), 16));
    }
  }
  if constexpr (std::is_same_v<S, bf16> && std::is_same_v<D, float>) {
    for (; j < n / 16 * 16; j += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j));
      _mm512_storeu_si512(dst + j, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
#endif
#if defined(__F16C__) && defined(__AVX__)
  if constexpr (std::is_same_v<S, fp16> && std::is_same_v<D, float>) {
    for (; j < n / 8 * 8; j += 8) _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
  }
#endif
  for (; j < n; ++j) {
    if constexpr (std::is_same_v<D, float>)
      dst[j] = to_f32(src[j]);
    else
      dst[j] = bf16::from_bits(to_bf16_bits(src[j]));
  }
}

// dst[0, n) = src[0, n) for 4-byte words, inline: whole vectors, then one masked vector for the
// tail (a masked lane neither reads nor faults), where a call to memcpy of a short, variable
// length cost as much as the copy (the convolution gathers copy runs of 1 to 64 pixels).
template <class S>
inline void copy_words(const S* src, S* dst, std::size_t n) {
  static_assert(sizeof(S) == 4 && std::is_trivially_copyable_v<S>, "copy_words: 4-byte elements");
  [[maybe_unused]] std::size_t j = 0;  // (unused by the plain build's memcpy)
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) _mm512_storeu_si512(dst + j, _mm512_loadu_si512(src + j));
  if (j < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1u);
    _mm512_mask_storeu_epi32(dst + j, m, _mm512_maskz_loadu_epi32(m, src + j));
  }
#elif defined(__AVX2__)
  for (; j + 8 <= n; j += 8) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j)));
  if (j < n) {
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_epi32(reinterpret_cast<int*>(dst + j), m, _mm256_maskload_epi32(reinterpret_cast<const int*>(src + j), m));
  }
#else
  std::memcpy(dst, src, n * sizeof(S));
#endif
}

// dst[j] = src[2j] for j < n, 4- or 2-byte words, inline (a convolution's stride-2 row runs):
// two vectors' even words at a time; the last word read is src[2(n-1)] (masked loads past it).
template <class S>
inline void copy_stride2(const S* src, S* dst, std::size_t n) {
  static_assert((sizeof(S) == 4 || sizeof(S) == 2) && std::is_trivially_copyable_v<S>, "copy_stride2: 4- or 2-byte elements");
  std::size_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (sizeof(S) == 4) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    for (; j < n; j += 16) {
      const std::size_t t = std::min<std::size_t>(16, n - j), need = 2 * t - 1;  // words of src read
      const __mmask16 ma = static_cast<__mmask16>((1u << std::min<std::size_t>(need, 16)) - 1u);
      const __mmask16 mb = static_cast<__mmask16>(need > 16 ? (1u << (need - 16)) - 1u : 0u);
      const __m512i a = _mm512_maskz_loadu_epi32(ma, src + 2 * j), b = _mm512_maskz_loadu_epi32(mb, src + 2 * j + 16);
      _mm512_mask_storeu_epi32(dst + j, static_cast<__mmask16>((1u << t) - 1u), _mm512_permutex2var_epi32(a, even, b));
    }
  } else {
    alignas(64) static constexpr std::uint16_t ev[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                         32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
    const __m512i even = _mm512_load_si512(ev);
    for (; j < n; j += 32) {
      const std::size_t t = std::min<std::size_t>(32, n - j), need = 2 * t - 1;
      const __mmask32 ma = static_cast<__mmask32>((std::uint64_t{1} << std::min<std::size_t>(need, 32)) - 1u);
      const __mmask32 mb = static_cast<__mmask32>(need > 32 ? (std::uint64_t{1} << (need - 32)) - 1u : 0u);
      const __m512i a = _mm512_maskz_loadu_epi16(ma, src + 2 * j), b = _mm512_maskz_loadu_epi16(mb, src + 2 * j + 32);
      _mm512_mask_storeu_epi16(dst + j, static_cast<__mmask32>((std::uint64_t{1} << t) - 1u), _mm512_permutex2var_epi16(a, even, b));
    }
  }
#endif
  for (; j < n; ++j) dst[j] = src[2 * j];
}

// out[2j] = r0[j], out[2j+1] = r1[j] for j < n: two rows of 16-bit codes into K-pairs (VNNI).
// `prefetch`: the rows are streamed from memory (fetch ahead of the loads).
inline void interleave_u16(const std::uint16_t* r0, const std::uint16_t* r1, std::uint16_t* out, std::size_t n,
                           [[maybe_unused]] bool prefetch = true) {
  std::size_t j = 0;
#if defined(__AVX512BW__)
  alignas(64) static constexpr std::uint16_t lo[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr std::uint16_t hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i ilo = _mm512_load_si512(lo), ihi = _mm512_load_si512(hi);
  for (; j + 32 <= n; j += 32) {
    // fetch ahead: B is streamed from memory once and the loads alone do not keep enough misses in flight
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(r0 + j + 512), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(r1 + j + 512), _MM_HINT_T0);
    }
    const __m512i a = _mm512_loadu_si512(r0 + j), b = _mm512_loadu_si512(r1 + j);
    _mm512_storeu_si512(out + 2 * j, _mm512_permutex2var_epi16(a, ilo, b));
    _mm512_storeu_si512(out + 2 * j + 32, _mm512_permutex2var_epi16(a, ihi, b));
  }
  if (j < n) {  // the tail in masked vectors (the convolution gathers pair runs of 1 to 32 pixels)
    const std::size_t t = n - j;
    const __mmask32 m = static_cast<__mmask32>((std::uint64_t{1} << t) - 1u);
    const __m512i a = _mm512_maskz_loadu_epi16(m, r0 + j), b = _mm512_maskz_loadu_epi16(m, r1 + j);
    const __mmask32 m0 = static_cast<__mmask32>((std::uint64_t{1} << std::min<std::size_t>(2 * t, 32)) - 1u);
    _mm512_mask_storeu_epi16(out + 2 * j, m0, _mm512_permutex2var_epi16(a, ilo, b));
    if (t > 16) {
      const __mmask32 m1 = static_cast<__mmask32>((std::uint64_t{1} << (2 * t - 32)) - 1u);
      _mm512_mask_storeu_epi16(out + 2 * j + 32, m1, _mm512_permutex2var_epi16(a, ihi, b));
    }
    return;
  }
#endif
  for (; j < n; ++j) {
    out[2 * j] = r0[j];
    out[2 * j + 1] = r1[j];
  }
}

// A 16 x 16 block of 32-bit words transposed: word c of source row r (16 words at src + r*src_ld
// bytes) goes to word r of destination row c (at dst + c*dst_ld bytes); any alignment. Packing a
// column-major GEMM operand into panels is this, 16 columns by 16 K units at a time (f32 values,
// or bf16 K-pairs): the element-by-element copy cost one store per element.
inline void transpose16_b32(const void* src, std::size_t src_ld, void* dst, std::size_t dst_ld) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
#if defined(__AVX512F__)
  __m512i r[16], t[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(s + static_cast<std::size_t>(i) * src_ld);
    // 32-bit, then 64-bit interleaves within 128-bit lanes, then 128-bit lane shuffles in two rounds
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4g + q] lane L (128-bit) holds rows 4g..4g+3 of column 4L + q (q: 0 1 2 3 after the order above)
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);      // lanes 0,2 of r[i], lanes 0,2 of r[i+4]
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);  // lanes 1,3
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    // column i (lane 0 of the first round), 8 + i (lane 2), 4 + i (lane 1), 12 + i (lane 3)
    _mm512_storeu_si512(d + static_cast<std::size_t>(i) * dst_ld, _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88));
    _mm512_storeu_si512(d + static_cast<std::size_t>(8 + i) * dst_ld, _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD));
    _mm512_storeu_si512(d + static_cast<std::size_t>(4 + i) * dst_ld, _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88));
    _mm512_storeu_si512(d + static_cast<std::size_t>(12 + i) * dst_ld, _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD));
  }
#else
  for (std::size_t r = 0; r < 16; ++r)
    for (std::size_t c = 0; c < 16; ++c) std::memcpy(d + c * dst_ld + r * 4, s + r * src_ld + c * 4, 4);
#endif
}

}  // namespace tessel::arch
