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
#include <cpuid.h>
#include <immintrin.h>
#endif
#include <xsimd/xsimd.hpp>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include <fstream>
#include <string>

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
  if constexpr (has_avx512_bf16)
    return "avx512_bf16";
  else if constexpr (has_avx512)
    return "avx512";
  else if constexpr (has_avx2_fma)
    return "avx2_fma";
  else
    return "scalar";
}

// The processor's model name (the CPUID brand string on x86, else /proc/cpuinfo's "model name"),
// trimmed; "unknown" when neither says. Tuning caches are keyed on it: a blocking measured on one
// model is not trusted on another.
inline const std::string& cpu_model() {
  static const std::string name = [] {
    std::string s;
#if defined(__x86_64__) || defined(__i386__)
    if (static_cast<unsigned>(__get_cpuid_max(0x80000000u, nullptr)) >= 0x80000004u) {
      unsigned r[12] = {};
      for (unsigned i = 0; i < 3; ++i) __get_cpuid(0x80000002u + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
      const char* c = reinterpret_cast<const char*>(r);
      for (std::size_t i = 0; i < sizeof(r) && c[i] != '\0'; ++i) s += c[i];
    }
#endif
    if (s.find_first_not_of(' ') == std::string::npos) {
      s.clear();
      std::ifstream f("/proc/cpuinfo");
      for (std::string line; s.empty() && std::getline(f, line);)
        if (line.rfind("model name", 0) == 0)
          if (const auto colon = line.find(':'); colon != std::string::npos) s = line.substr(colon + 1);
    }
    const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
    s = b == std::string::npos ? std::string("unknown") : s.substr(b, e - b + 1);
    return s;
  }();
  return name;
}

}  // namespace tessel::arch
