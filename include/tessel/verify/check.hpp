// tessel::verify: check an operator's output against a reference, the way a kernel author needs it.
//   - fills chosen to make a check discriminate: small integers whose sums are exact in every
//     dtype, normal and uniform values, and adversarial ones (subnormals, ±max, ±0, NaN, ±Inf);
//   - a tolerance from the dtype and the reduction length (DESIGN.md's policy:
//     |got − want| ≤ γ_K·magnitude + u_out·|want| + abs, γ_K = K·u/(1 − K·u)), or one given;
//   - a report: the worst element (index, got, want, absolute and relative error, ULPs of the
//     output type), how many elements are over the bound, the first few of them, and "mistrusted"
//     when the check cannot discriminate (a reference that is mostly zero, or constant);
//   - shape sweeps (0, 1, primes, the edges of the kernel's tiles, a large prime) and bitwise
//     comparisons for the determinism checks (determinism.hpp).
// The reference is fp64 (a lambda or a library op run in a wider type); NaN in the reference must
// be NaN in the output, an infinity must be the same infinity.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <tessel/error.hpp>
#include <tessel/types.hpp>

namespace tessel {
inline namespace v0 {
namespace verify {

struct verify_error : error_of<verify_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "verify";
};

// ---- numbers -------------------------------------------------------------------------------

// The element types a check reads: IEEE float/double, tessel's narrow floats, and integers.
template <class T>
concept checkable =
    std::is_arithmetic_v<T> || std::is_same_v<T, bf16> || std::is_same_v<T, fp16> || std::is_same_v<T, e4m3> || std::is_same_v<T, e5m2>;

template <checkable T>
constexpr double to_double(T x) noexcept {
  if constexpr (std::is_arithmetic_v<T>)
    return static_cast<double>(x);
  else
    return static_cast<double>(x);
}

// Unit roundoff u = 2^-digits of a floating type (0 for integers: they are exact).
template <checkable T>
constexpr double unit_roundoff() noexcept {
  if constexpr (std::is_integral_v<T>)
    return 0.0;
  else {
    double u = 1.0;
    for (int i = 0; i < std::numeric_limits<T>::digits; ++i) u *= 0.5;
    return u;
  }
}

inline double unit_roundoff(dtype d) {
  switch (d) {
    case dtype::f64: return unit_roundoff<double>();
    case dtype::f32: return unit_roundoff<float>();
    case dtype::bf16: return unit_roundoff<bf16>();
    case dtype::fp16: return unit_roundoff<fp16>();
    case dtype::e4m3: return unit_roundoff<e4m3>();
    case dtype::e5m2: return unit_roundoff<e5m2>();
    default: return 0.0;
  }
}

// γ_K = K·u / (1 − K·u): the relative error bound of a K-term sum in unit roundoff u. Infinite when
// K·u ≥ 1 (no bound at that length).
inline double gamma(std::size_t k, double u) noexcept {
  const double ku = static_cast<double>(k) * u;
  return ku >= 1.0 ? std::numeric_limits<double>::infinity() : ku / (1.0 - ku);
}

// The spacing of T's values at x (its ULP there); subnormal spacing below the smallest normal.
template <checkable T>
double ulp(double x) noexcept {
  if constexpr (std::is_integral_v<T>)
    return 1.0;
  else {
    const double ax = std::fabs(x);
    const double min_normal = to_double(std::numeric_limits<T>::min());
    const int digits = std::numeric_limits<T>::digits;
    if (!std::isfinite(ax)) return std::numeric_limits<double>::infinity();
    int e = 0;
    std::frexp(std::max(ax, min_normal), &e);  // max(|x|, min) in [2^(e-1), 2^e)
    return std::ldexp(1.0, e - digits);
  }
}

// ---- fills ---------------------------------------------------------------------------------

enum class fill {
  small_int,    // integers in [-range, range]: products and sums stay exact, so results compare bitwise
  uniform,      // uniform in [lo, hi)
  normal,       // N(0, stddev²)
  adversarial,  // mostly uniform, with ±0, subnormals, the smallest normal, ±max, NaN and ±Inf mixed in
};

inline const char* to_string(fill f) {
  switch (f) {
    case fill::small_int: return "small_int";
    case fill::uniform: return "uniform";
    case fill::normal: return "normal";
    case fill::adversarial: return "adversarial";
  }
  return "?";
}

struct fill_options {
  int range = 3;           // small_int: [-range, range]
  double lo = -1, hi = 1;  // uniform
  double stddev = 1;       // normal
  bool specials = true;    // adversarial: include NaN and Inf (off: only finite extremes)
};

// A seeded generator whose stream is the same with every standard library (splitmix64), so a
// failing seed reproduces anywhere.
class rng {
 public:
  explicit rng(std::uint64_t seed) : s_(seed) {}
  std::uint64_t next() noexcept {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double uniform(double lo, double hi) noexcept { return lo + (hi - lo) * uniform(); }
  std::int64_t integer(std::int64_t lo, std::int64_t hi) noexcept {  // [lo, hi]
    const auto span = static_cast<std::uint64_t>(hi - lo) + 1;
    return lo + static_cast<std::int64_t>(next() % span);
  }
  double normal() noexcept {  // Box–Muller
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  std::uint64_t s_;
};

template <checkable T>
T from_double(double x) noexcept {
  if constexpr (std::is_integral_v<T>)
    return static_cast<T>(x);
  else
    return static_cast<T>(x);
}

// Fills `v` with values of kind `f` from `seed`; the same seed gives the same values everywhere.
template <checkable T>
void fill_values(std::span<T> v, fill f, std::uint64_t seed, const fill_options& o = {}) {
  if (o.range < 0) throw verify_error("fill: range " + std::to_string(o.range) + " is negative");
  if (!(o.lo < o.hi) || !std::isfinite(o.lo) || !std::isfinite(o.hi))
    throw verify_error("fill: uniform bounds [" + std::to_string(o.lo) + ", " + std::to_string(o.hi) + ") are empty or not finite");
  if (!(o.stddev > 0) || !std::isfinite(o.stddev)) throw verify_error("fill: stddev " + std::to_string(o.stddev) + " is not positive and finite");
  rng g(seed);
  for (auto& x : v) {
    switch (f) {
      case fill::small_int: x = from_double<T>(static_cast<double>(g.integer(-o.range, o.range))); break;
      case fill::uniform: x = from_double<T>(g.uniform(o.lo, o.hi)); break;
      case fill::normal: x = from_double<T>(o.stddev * g.normal()); break;
      case fill::adversarial: {
        if constexpr (std::is_integral_v<T>) {
          const auto pick = g.next() % 8;
          x = pick == 0 ? std::numeric_limits<T>::max() : pick == 1 ? std::numeric_limits<T>::lowest() : from_double<T>(g.integer(-3, 3));
        } else {
          const double mx = to_double(std::numeric_limits<T>::max()), mn = to_double(std::numeric_limits<T>::min());
          const double sub = to_double(std::numeric_limits<T>::denorm_min());
          const double sign = (g.next() & 1) ? -1.0 : 1.0;
          const auto pick = g.next() % 16;
          double d = g.uniform(o.lo, o.hi);
          if (pick == 0)
            d = sign * 0.0;
          else if (pick == 1)
            d = sign * sub * static_cast<double>(1 + g.next() % 3);  // subnormals
          else if (pick == 2)
            d = sign * mn;
          else if (pick == 3)
            d = sign * mx;
          else if (pick == 4 && o.specials)
            d = std::numeric_limits<double>::quiet_NaN();
          else if (pick == 5 && o.specials)
            d = sign * std::numeric_limits<double>::infinity();
          x = from_double<T>(d);
        }
        break;
      }
    }
  }
}

template <checkable T>
std::vector<T> filled(std::size_t n, fill f, std::uint64_t seed, const fill_options& o = {}) {
  std::vector<T> v(n);
  fill_values(std::span<T>(v), f, seed, o);
  return v;
}

// ---- shapes --------------------------------------------------------------------------------

// The sizes a sweep should try along one dimension: 0, 1, small primes, each tile edge and its
// neighbours (edge − 1, edge + 1, 2·edge + 1), and `large` (a prime is best). Sorted, unique,
// without 0 when `with_zero` is false.
inline std::vector<std::size_t> sizes(std::initializer_list<std::size_t> tile_edges, std::size_t large = 257, bool with_zero = true) {
  std::vector<std::size_t> s = {1, 2, 3, 5, 7, 13, 31};
  if (with_zero) s.push_back(0);
  for (std::size_t e : tile_edges) {
    if (e == 0) continue;
    s.push_back(e - 1);
    s.push_back(e);
    s.push_back(e + 1);
    s.push_back(2 * e + 1);
  }
  if (large) s.push_back(large);
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  if (!with_zero && !s.empty() && s.front() == 0) s.erase(s.begin());
  return s;
}

// ---- tolerance -----------------------------------------------------------------------------

// bound_i = abs + rel·|want_i| + mag·magnitude_i. magnitude_i is what the error of a reduction
// scales with (Σ|a_k·b_k| for a dot product); without a magnitude the `mag` term uses |want_i|.
struct tolerance {
  double abs = 0;
  double rel = 0;
  double mag = 0;

  static tolerance exact() { return {}; }
  static tolerance relative(double rel, double abs = 0) { return {abs, rel, 0}; }
  // DESIGN.md's GEMM policy: K-term sums accumulated in `acc`, rounded once to `out`.
  static tolerance reduction(std::size_t k, dtype acc, dtype out) { return {0, unit_roundoff(out), gamma(k, unit_roundoff(acc))}; }
  // `ulps` units of the output type's roundoff (elementwise maps; u = half an ULP at 1).
  static tolerance ulps_of(dtype out, double ulps) { return {0, 2 * ulps * unit_roundoff(out), 0}; }
};

struct check_options {
  // "mistrusted": the reference is zero in more than this fraction of (at least `mistrust_min`)
  // elements, or takes a single value; such a check passes without discriminating.
  double mistrust_zero_fraction = 0.8;
  std::size_t mistrust_min = 16;
  bool detect_mistrust = true;  // off when zeros are the whole point (a K = 0 product into a NaN-poisoned output)
  std::size_t keep = 8;         // how many failing elements (in index order) the report lists
};

struct mismatch {
  std::size_t index = 0;
  double got = 0, want = 0;
  double abs_err = 0, rel_err = 0, ulps = 0, bound = 0;
};

struct report {
  std::string name;
  std::size_t count = 0;          // elements compared
  std::size_t over = 0;           // elements over the bound (or a NaN/Inf mismatch)
  std::optional<mismatch> worst;  // largest error relative to its bound (largest absolute error if none is over)
  std::vector<mismatch> first;    // the first `keep` elements over the bound
  double max_abs_err = 0, max_rel_err = 0, max_ulps = 0;
  bool mistrusted = false;
  std::string mistrust_reason;

  bool passed() const noexcept { return over == 0; }
  bool trusted() const noexcept { return !mistrusted; }
  // One line: name, verdict, count over bound, the worst element; "mistrusted: why" when so.
  std::string to_string() const {
    char buf[512];
    std::string s = name + ": " + (passed() ? "ok" : "FAIL");
    if (mistrusted) s += " (mistrusted: " + mistrust_reason + ")";
    std::snprintf(buf, sizeof buf, ", %zu of %zu over the bound", over, count);
    s += buf;
    if (worst) {
      std::snprintf(buf, sizeof buf, "; worst [%zu] got %.9g want %.9g abs %.3g rel %.3g ulps %.3g bound %.3g", worst->index, worst->got, worst->want,
                    worst->abs_err, worst->rel_err, worst->ulps, worst->bound);
      s += buf;
    }
    return s;
  }
};

namespace detail {
inline bool same_special(double got, double want) {
  if (std::isnan(want)) return std::isnan(got);
  return got == want;  // ±Inf must be the same infinity
}
}  // namespace detail

// Compares `got` (the operator's output, type T) with the fp64 reference `want`, element by element.
template <checkable T>
report compare(std::string name, std::span<const T> got, std::span<const double> want, const tolerance& tol, std::span<const double> magnitude = {},
               const check_options& o = {}) {
  if (got.size() != want.size())
    throw verify_error(name + ": output has " + std::to_string(got.size()) + " elements, the reference " + std::to_string(want.size()));
  if (!magnitude.empty() && magnitude.size() != want.size())
    throw verify_error(name + ": magnitude has " + std::to_string(magnitude.size()) + " elements, the reference " + std::to_string(want.size()));
  if (!(tol.abs >= 0) || !(tol.rel >= 0) || !(tol.mag >= 0)) throw verify_error(name + ": a tolerance term is negative or NaN");
  report r;
  r.name = std::move(name);
  r.count = got.size();
  double worst_ratio = -1;
  std::size_t zeros = 0;
  bool constant = true;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = to_double(got[i]), w = want[i];
    if (w == 0) ++zeros;
    if (i > 0 && !(w == want[0] || (std::isnan(w) && std::isnan(want[0])))) constant = false;
    mismatch m;
    m.index = i;
    m.got = g;
    m.want = w;
    bool bad;
    double ratio;
    if (!std::isfinite(w) || !std::isfinite(g)) {
      bad = !detail::same_special(g, w);
      m.abs_err = bad ? std::numeric_limits<double>::infinity() : 0.0;
      m.rel_err = m.abs_err;
      m.ulps = m.abs_err;
      ratio = bad ? std::numeric_limits<double>::infinity() : 0.0;
    } else {
      const double mg = magnitude.empty() ? std::fabs(w) : magnitude[i];
      m.bound = tol.abs + tol.rel * std::fabs(w) + tol.mag * mg;
      m.abs_err = std::fabs(g - w);
      m.rel_err = w != 0 ? m.abs_err / std::fabs(w) : (m.abs_err == 0 ? 0.0 : std::numeric_limits<double>::infinity());
      m.ulps = m.abs_err / ulp<T>(w);
      bad = m.abs_err > m.bound;
      ratio = m.bound > 0 ? m.abs_err / m.bound : (m.abs_err > 0 ? std::numeric_limits<double>::infinity() : 0.0);
      r.max_abs_err = std::max(r.max_abs_err, m.abs_err);
      r.max_rel_err = std::max(r.max_rel_err, m.rel_err);
      r.max_ulps = std::max(r.max_ulps, m.ulps);
    }
    if (bad) {
      ++r.over;
      if (r.first.size() < o.keep) r.first.push_back(m);
    }
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      r.worst = m;
    }
  }
  if (o.detect_mistrust && r.count >= o.mistrust_min) {
    if (static_cast<double>(zeros) > o.mistrust_zero_fraction * static_cast<double>(r.count)) {
      r.mistrusted = true;
      r.mistrust_reason = std::to_string(zeros) + " of " + std::to_string(r.count) + " reference values are zero";
    } else if (constant) {
      r.mistrusted = true;
      r.mistrust_reason = "every reference value is the same";
    }
  }
  return r;
}

template <checkable T>
report compare(std::string name, const std::vector<T>& got, const std::vector<double>& want, const tolerance& tol,
               const std::vector<double>& magnitude = {}, const check_options& o = {}) {
  return compare(std::move(name), std::span<const T>(got), std::span<const double>(want), tol, std::span<const double>(magnitude), o);
}

// Bitwise equality of two outputs (determinism: thread counts, devices, repeated runs). The
// report's worst element is the first that differs.
template <checkable T>
report compare_bits(std::string name, std::span<const T> a, std::span<const T> b) {
  if (a.size() != b.size())
    throw verify_error(name + ": the runs produced " + std::to_string(a.size()) + " and " + std::to_string(b.size()) + " elements");
  report r;
  r.name = std::move(name);
  r.count = a.size();
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) == 0) continue;
    mismatch m;
    m.index = i;
    m.got = to_double(a[i]);
    m.want = to_double(b[i]);
    m.abs_err = std::fabs(m.got - m.want);
    m.rel_err = m.want != 0 ? m.abs_err / std::fabs(m.want) : m.abs_err;
    m.ulps = std::isfinite(m.want) ? m.abs_err / ulp<T>(m.want) : 0.0;
    if (!r.worst) r.worst = m;
    if (r.first.size() < check_options{}.keep) r.first.push_back(m);
    ++r.over;
    r.max_abs_err = std::max(r.max_abs_err, m.abs_err);
  }
  return r;
}

template <checkable T>
report compare_bits(std::string name, const std::vector<T>& a, const std::vector<T>& b) {
  return compare_bits(std::move(name), std::span<const T>(a), std::span<const T>(b));
}

// A set of reports (one per shape, fill, op): what failed, what could not discriminate.
struct suite {
  std::vector<report> reports;

  void add(report r) { reports.push_back(std::move(r)); }
  std::size_t failed() const {
    return static_cast<std::size_t>(std::count_if(reports.begin(), reports.end(), [](const report& r) { return !r.passed(); }));
  }
  std::size_t mistrusted() const {
    return static_cast<std::size_t>(std::count_if(reports.begin(), reports.end(), [](const report& r) { return r.mistrusted; }));
  }
  bool passed() const { return failed() == 0; }
  // The failing reports' lines (all of them when `all`), then a count line.
  std::string summary(bool all = false) const {
    std::string s;
    for (const auto& r : reports)
      if (all || !r.passed()) s += r.to_string() + "\n";
    s += std::to_string(reports.size() - failed()) + " of " + std::to_string(reports.size()) + " checks passed";
    if (mistrusted()) s += ", " + std::to_string(mistrusted()) + " mistrusted";
    return s;
  }
};

}  // namespace verify
}  // namespace v0
}  // namespace tessel
