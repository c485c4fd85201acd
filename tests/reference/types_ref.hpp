// Independent reference for tessel's narrow float types, written differently from the library:
// decode by the textbook formula in double (std::ldexp), encode by searching a sorted table of all
// finite non-negative code values and picking the nearer neighbour (ties to the even code), with
// each type's overflow rule stated explicitly.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace tessel_ref {

// Per-type description, written out by hand from the OCP FP8 / IEEE 754 / bfloat16 specifications.
struct format_spec {
  int exp_bits, man_bits, bias;
  bool fn;  // E4M3FN: no Inf; only S.1111.111 is NaN
  unsigned total_bits() const { return 1u + unsigned(exp_bits + man_bits); }
};
inline constexpr format_spec bf16_spec{8, 7, 127, false};
inline constexpr format_spec fp16_spec{5, 10, 15, false};
inline constexpr format_spec e5m2_spec{5, 2, 15, false};
inline constexpr format_spec e4m3_spec{4, 3, 7, true};

inline bool ref_is_nan(const format_spec& f, std::uint32_t code) {
  const std::uint32_t e = (code >> f.man_bits) & ((1u << f.exp_bits) - 1), m = code & ((1u << f.man_bits) - 1);
  if (f.fn) return e == (1u << f.exp_bits) - 1 && m == (1u << f.man_bits) - 1;
  return e == (1u << f.exp_bits) - 1 && m != 0;
}
inline bool ref_is_inf(const format_spec& f, std::uint32_t code) {
  const std::uint32_t e = (code >> f.man_bits) & ((1u << f.exp_bits) - 1), m = code & ((1u << f.man_bits) - 1);
  return !f.fn && e == (1u << f.exp_bits) - 1 && m == 0;
}

// (-1)^s * 2^(e-bias) * (1 + m/2^M), or 2^(1-bias) * (m/2^M) for e == 0.
inline double ref_decode(const format_spec& f, std::uint32_t code) {
  const bool neg = (code >> (f.total_bits() - 1)) & 1;
  if (ref_is_nan(f, code)) return std::numeric_limits<double>::quiet_NaN();
  if (ref_is_inf(f, code)) return neg ? -HUGE_VAL : HUGE_VAL;
  const int e = int((code >> f.man_bits) & ((1u << f.exp_bits) - 1));
  const double m = double(code & ((1u << f.man_bits) - 1)) / double(1u << f.man_bits);
  const double v = e == 0 ? std::ldexp(m, 1 - f.bias) : std::ldexp(1.0 + m, e - f.bias);
  return neg ? -v : v;
}

// All finite non-negative codes sorted by value, and the rounding-by-search encoder.
struct encoder {
  format_spec f;
  std::vector<double> values;        // ascending
  std::vector<std::uint32_t> codes;  // codes[i] has value values[i]
  double max_finite, overflow_mid;   // overflow_mid: halfway between max and the next (unbounded) step

  explicit encoder(format_spec spec) : f(spec) {
    const std::uint32_t n = 1u << (f.total_bits() - 1);
    std::vector<std::pair<double, std::uint32_t>> t;
    for (std::uint32_t c = 0; c < n; ++c) {
      const double v = ref_decode(f, c);
      if (std::isfinite(v)) t.emplace_back(v, c);
    }
    std::sort(t.begin(), t.end());
    for (auto& [v, c] : t) {
      values.push_back(v);
      codes.push_back(c);
    }
    max_finite = values.back();
    const double ulp_max = values.back() - values[values.size() - 2];  // same binade
    overflow_mid = max_finite + ulp_max / 2;
  }

  std::uint32_t nan_code(bool neg) const {
    const std::uint32_t sign = neg ? 1u << (f.total_bits() - 1) : 0u;
    return sign | (((1u << f.exp_bits) - 1) << f.man_bits) | (f.fn ? (1u << f.man_bits) - 1 : 1u << (f.man_bits - 1));
  }
  std::uint32_t overflow_code(bool neg, bool saturate) const {
    const std::uint32_t sign = neg ? 1u << (f.total_bits() - 1) : 0u;
    if (saturate) return sign | codes.back();
    if (f.fn) return nan_code(neg);
    return sign | (((1u << f.exp_bits) - 1) << f.man_bits);  // Inf
  }

  // Index of the code nearest to v >= 0 (v <= max_finite), ties to the even code; `hint` is the
  // index of the largest value <= v if the caller already knows it (monotone sweeps).
  std::size_t nearest(double v, std::size_t lo) const {
    const std::size_t hi = lo + 1 < values.size() ? lo + 1 : lo;
    const double dl = v - values[lo], dh = values[hi] - v;
    if (dl < dh) return lo;
    if (dh < dl) return hi;
    return (codes[lo] & 1u) == 0 ? lo : hi;
  }
  std::size_t floor_index(double v) const {  // largest i with values[i] <= v
    return std::size_t(std::upper_bound(values.begin(), values.end(), v) - values.begin()) - 1;
  }

  // Non-NaN magnitude (v >= 0, may be +Inf) -> code without sign. Returns the code; the caller
  // applies the sign. For NaN inputs use nan_code.
  std::uint32_t encode_magnitude(double v, bool saturate, std::size_t floor_hint) const {
    if (v > max_finite) {
      // Beyond max: round as if the exponent range were unbounded; a tie goes to the even of
      // {max, next}: max when max's code is even (E4M3 0x7E), otherwise the overflow value.
      const bool stays = v < overflow_mid || (v == overflow_mid && (codes.back() & 1u) == 0);
      if (stays) return codes.back();
      return overflow_code(false, saturate);
    }
    return codes[nearest(v, floor_hint)];
  }

  std::uint32_t encode(double x, bool saturate) const {
    const bool neg = std::signbit(x);
    if (std::isnan(x)) return nan_code(neg);
    const double v = std::fabs(x);
    const std::uint32_t sign = neg ? 1u << (f.total_bits() - 1) : 0u;
    return sign | encode_magnitude(v, saturate, v > max_finite ? values.size() - 1 : floor_index(v));
  }
};

}  // namespace tessel_ref
