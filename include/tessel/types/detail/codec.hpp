// Scalar bit-level codecs between IEEE binary32/binary64 and tessel's narrow float formats.
// Integer-only rounding (round to nearest, ties to even) so results never depend on the FPU's
// rounding mode or FTZ/DAZ; the vector kernels in arch/convert.hpp use the same algorithm.
#pragma once

#include <bit>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace tessel {
inline namespace v0 {

// What a narrowing conversion does with values beyond the largest finite value of the target.
// propagate: value semantics (E4M3 -> NaN, others -> +-Inf); saturate: clamp to +-max (also +-Inf
// inputs); NaN stays NaN in both modes.
enum class overflow : std::uint8_t { propagate, saturate };

}  // namespace v0

namespace detail {

// A narrow binary float format. Ieee: top exponent code means Inf/NaN (bf16, fp16, e5m2);
// otherwise "FN" (e4m3: no Inf, only S.1111.111 is NaN).
template <int ExpBits, int ManBits, bool Ieee>
struct float_format {
  static constexpr int exp_bits = ExpBits;
  static constexpr int man_bits = ManBits;
  static constexpr int total_bits = 1 + ExpBits + ManBits;
  static constexpr bool ieee = Ieee;
  static constexpr int bias = (1 << (ExpBits - 1)) - 1;
  using storage = std::conditional_t<(total_bits <= 8), std::uint8_t, std::uint16_t>;
  static constexpr std::uint32_t sign_bit = 1u << (ExpBits + ManBits);
  static constexpr std::uint32_t abs_mask = sign_bit - 1;
  static constexpr std::uint32_t man_mask = (1u << ManBits) - 1;
  static constexpr std::uint32_t exp_max = (1u << ExpBits) - 1;
  // Largest finite magnitude code, and the code that magnitude overflow produces.
  static constexpr std::uint32_t max_code = Ieee ? ((exp_max - 1) << ManBits) | man_mask : abs_mask - 1;
  static constexpr std::uint32_t inf_code = exp_max << ManBits;  // Ieee only
  static constexpr std::uint32_t nan_code = Ieee ? inf_code | (1u << (ManBits - 1)) : abs_mask;
  static constexpr std::uint32_t overflow_code = Ieee ? inf_code : abs_mask;
};

using bf16_format = float_format<8, 7, true>;
using fp16_format = float_format<5, 10, true>;
using e5m2_format = float_format<5, 2, true>;
using e4m3_format = float_format<4, 3, false>;

template <class Src>
struct source_traits;
template <>
struct source_traits<float> {
  using uint = std::uint32_t;
  static constexpr int exp_bits = 8, man_bits = 23;
};
template <>
struct source_traits<double> {
  using uint = std::uint64_t;
  static constexpr int exp_bits = 11, man_bits = 52;
};

// 2^e as Src, built from bits (e must be in Src's normal range).
template <class Src>
constexpr Src pow2(int e) noexcept {
  using S = source_traits<Src>;
  using U = typename S::uint;
  return std::bit_cast<Src>(static_cast<U>(static_cast<U>(e + (1 << (S::exp_bits - 1)) - 1) << S::man_bits));
}

// Round-to-nearest-even of x >> s for 1 <= s < bits(U), without overflow for x < 2^(bits-1).
template <class U>
constexpr U rne_shift(U x, unsigned s) noexcept {
  return (x + ((U(1) << (s - 1)) - 1) + ((x >> s) & 1)) >> s;
}

// Encode a binary32/binary64 value into format Fmt. Ov selects what magnitude overflow does.
template <class Fmt, overflow Ov, class Src>
constexpr typename Fmt::storage encode(Src x) noexcept {
  using S = source_traits<Src>;
  using U = typename S::uint;
  constexpr int sm = S::man_bits;
  constexpr int sbias = (1 << (S::exp_bits - 1)) - 1;
  constexpr int shift = sm - Fmt::man_bits;
  constexpr U src_sign = U(1) << (S::exp_bits + sm);
  constexpr U src_inf = ((U(1) << S::exp_bits) - 1) << sm;
  constexpr U src_man = (U(1) << sm) - 1;
  constexpr U emin = U(sbias - Fmt::bias + 1);  // biased source exponent of the target's min normal
  constexpr U rebias = U(sbias - Fmt::bias) << sm;
  constexpr unsigned max_shift = sizeof(U) * 8 - 1;

  const U u = std::bit_cast<U>(x);
  const U a = u & (src_sign - 1);
  const U e = a >> sm;
  U code;
  if constexpr (Fmt::exp_bits == S::exp_bits) {  // bf16 from float: same exponent range, one shift
    code = rne_shift<U>(a, shift);
  } else if (e >= emin) {
    code = rne_shift<U>(a - rebias, shift);
  } else {  // target subnormal (or zero): align the full significand to the subnormal grid
    const U m = (a & src_man) | (e != 0 ? (U(1) << sm) : U(0));
    const U e_eff = e != 0 ? e : U(1);
    const U s = U(shift) + (emin - e_eff);
    code = rne_shift<U>(m, s < max_shift ? unsigned(s) : max_shift);
  }
  constexpr U limit = Ov == overflow::saturate ? U(Fmt::max_code) : U(Fmt::overflow_code);
  code = code < limit ? code : limit;
  if (a > src_inf) {  // NaN: keep the sign; IEEE formats keep the top payload bits
    if constexpr (Fmt::ieee) {
      const U payload = (a >> shift) & Fmt::man_mask;
      code = Fmt::inf_code | (payload != 0 ? payload : U(1) << (Fmt::man_bits - 1));
    } else {
      code = Fmt::nan_code;
    }
  }
  const U sign = (u >> (S::exp_bits + sm)) << (Fmt::exp_bits + Fmt::man_bits);
  return static_cast<typename Fmt::storage>(sign | code);
}

template <class Fmt, class Src>
constexpr Src decode_bits(typename Fmt::storage h) noexcept;

// float bit patterns of all 256 codes of an 8-bit format, built at compile time.
template <class Fmt>
struct decode_table {
  static constexpr auto values = [] {
    struct table {
      std::uint32_t v[256];
    } t{};
    for (unsigned c = 0; c < 256; ++c) t.v[c] = std::bit_cast<std::uint32_t>(decode_bits<Fmt, float>(static_cast<std::uint8_t>(c)));
    return t;
  }();
};

// Decode a code of format Fmt into Src (exact: every narrow value is representable). 8-bit
// formats to float use a 1 KiB table at run time (branch-free in inner loops).
template <class Fmt, class Src>
constexpr Src decode(typename Fmt::storage h) noexcept {
  if constexpr (Fmt::total_bits == 8 && std::is_same_v<Src, float>) {
    if (!std::is_constant_evaluated()) return std::bit_cast<float>(decode_table<Fmt>::values.v[h]);
  }
  return decode_bits<Fmt, Src>(h);
}

template <class Fmt, class Src>
constexpr Src decode_bits(typename Fmt::storage h) noexcept {
  using S = source_traits<Src>;
  using U = typename S::uint;
  constexpr int sm = S::man_bits;
  constexpr int sbias = (1 << (S::exp_bits - 1)) - 1;
  constexpr int shift = sm - Fmt::man_bits;
  constexpr U src_inf = ((U(1) << S::exp_bits) - 1) << sm;
  const U sign = U(h >> (Fmt::exp_bits + Fmt::man_bits)) << (S::exp_bits + sm);
  const U em = h & Fmt::abs_mask;
  if constexpr (Fmt::exp_bits == S::exp_bits) {  // bf16 -> float: a plain widening
    return std::bit_cast<Src>(sign | (em << shift));
  } else {
    // All candidates computed, then selected: branch-free, so loops over it vectorize.
    const U ex = em >> Fmt::man_bits;
    const U normal = (em << shift) + (U(sbias - Fmt::bias) << sm);
    // Subnormal (em = mantissa < 2^man): normalize by its leading one at bit p; zero stays zero.
    const int p = std::bit_width(static_cast<std::uint32_t>(em) | 1u) - 1;
    const U sub = em == 0 ? U(0) : (U(p + 1 - Fmt::bias - Fmt::man_bits + sbias) << sm) | ((em << (sm - p)) & ((U(1) << sm) - 1));
    U f = ex == 0 ? sub : normal;
    if constexpr (Fmt::ieee)
      f = ex == Fmt::exp_max ? src_inf | ((em & Fmt::man_mask) << shift) : f;
    else
      f = em == Fmt::abs_mask ? src_inf | (U(1) << (sm - 1)) : f;
    return std::bit_cast<Src>(sign | f);
  }
}

}  // namespace detail
}  // namespace tessel
