// What instruction sets this translation unit was compiled for, as constexpr flags, plus the
// portable vector type (xsimd batch for the best compiled arch) that tiles use as registers.
#pragma once

// GCC 12 reports -Wmaybe-uninitialized inside its own AVX-512 intrinsic headers (the
// `__Y = __Y` idiom of _mm512_undefined_*) when xsimd's math inlines them; the state of this
// pragma when those headers are first parsed is what counts, so they are included here, first.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <xsimd/xsimd.hpp>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace tessel::arch {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
inline constexpr bool has_avx512 = true;
#else
inline constexpr bool has_avx512 = false;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
inline constexpr bool has_avx512_bf16 = true;
#else
inline constexpr bool has_avx512_bf16 = false;
#endif
#if defined(__AVX2__) && defined(__FMA__)
inline constexpr bool has_avx2_fma = true;
#else
inline constexpr bool has_avx2_fma = false;
#endif
#if defined(__F16C__)
inline constexpr bool has_f16c = true;
#else
inline constexpr bool has_f16c = false;
#endif

// Register type of float tiles: the widest batch xsimd enables for this compilation.
using vec_f32 = xsimd::batch<float>;
inline constexpr std::size_t vec_f32_width = vec_f32::size;

// Name of the best target, for benchmark labels and capability reports.
constexpr const char* target_name() {
  if constexpr (has_avx512_bf16) return "avx512_bf16";
  else if constexpr (has_avx512) return "avx512";
  else if constexpr (has_avx2_fma) return "avx2_fma";
  else return "scalar";
}

}  // namespace tessel::arch
