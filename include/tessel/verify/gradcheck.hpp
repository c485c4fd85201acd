// tessel::verify::gradcheck: a backward pass against fp64 central differences of its forward.
//   L(x) = <forward(x), dy> for a fixed random dy, so backward(x, dy) must be ∇L(x) = J(x)ᵀ·dy.
//   - full mode: every coordinate, (L(x + h·e_i) − L(x − h·e_i)) / 2h against backward's dx_i;
//   - random-direction mode: `directions` unit vectors v, (L(x + h·v) − L(x − h·v)) / 2h against
//     <dx, v> (cheap for large inputs, and it sees every coordinate at once).
// The forward is fp64 (an independent reference, or the kernel itself run in double); the
// backward is the kernel under test, wrapped to take and return doubles. An element passes when
// |analytic − numeric| ≤ atol + rtol·max(|analytic|, |numeric|).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <tessel/verify/check.hpp>

namespace tessel {
inline namespace v0 {
namespace verify {

enum class grad_mode { full, random_directions };

struct gradcheck_options {
  grad_mode mode = grad_mode::full;
  std::size_t directions = 16;  // random_directions: how many
  double step = 1e-6;           // h, relative to max(1, |x_i|) (full) or max(1, max|x|) (directions)
  double rtol = 1e-3, atol = 1e-6;
  std::uint64_t seed = 1;  // dy and the directions
  std::size_t keep = 8;
};

struct grad_mismatch {
  std::size_t index = 0;  // the coordinate (full) or the direction (random_directions)
  double analytic = 0, numeric = 0, error = 0, bound = 0;
};

struct gradcheck_report {
  std::string name;
  grad_mode mode = grad_mode::full;
  std::size_t count = 0, over = 0;
  std::optional<grad_mismatch> worst;  // largest error relative to its bound
  std::vector<grad_mismatch> first;
  bool mistrusted = false;  // every analytic and numeric value is zero: nothing was checked
  bool passed() const noexcept { return over == 0; }
  std::string to_string() const {
    char buf[320];
    std::string s = name + " gradcheck (" + (mode == grad_mode::full ? "full" : "random directions") + "): " + (passed() ? "ok" : "FAIL");
    if (mistrusted) s += " (mistrusted: every derivative is zero)";
    std::snprintf(buf, sizeof buf, ", %zu of %zu over the bound", over, count);
    s += buf;
    if (worst) {
      std::snprintf(buf, sizeof buf, "; worst [%zu] analytic %.9g numeric %.9g error %.3g bound %.3g", worst->index, worst->analytic, worst->numeric,
                    worst->error, worst->bound);
      s += buf;
    }
    return s;
  }
};

using forward_fn = std::function<std::vector<double>(std::span<const double> x)>;
using backward_fn = std::function<std::vector<double>(std::span<const double> x, std::span<const double> dy)>;

inline gradcheck_report gradcheck(std::string name, const forward_fn& forward, const backward_fn& backward, std::span<const double> x,
                                  const gradcheck_options& o = {}) {
  if (!forward || !backward) throw verify_error(name + ": gradcheck needs a forward and a backward");
  if (!(o.step > 0) || !std::isfinite(o.step))
    throw verify_error(name + ": gradcheck step " + std::to_string(o.step) + " is not positive and finite");
  if (!(o.rtol >= 0) || !(o.atol >= 0)) throw verify_error(name + ": gradcheck tolerances must be non-negative");
  if (o.mode == grad_mode::random_directions && o.directions == 0)
    throw verify_error(name + ": gradcheck with zero random directions checks nothing");
  for (std::size_t i = 0; i < x.size(); ++i)
    if (!std::isfinite(x[i])) throw verify_error(name + ": gradcheck input x[" + std::to_string(i) + "] is not finite");

  const std::vector<double> y = forward(x);
  rng g(o.seed);
  std::vector<double> dy(y.size());
  for (auto& v : dy) v = g.normal();
  const std::vector<double> dx = backward(x, dy);
  if (dx.size() != x.size())
    throw verify_error(name + ": backward returned " + std::to_string(dx.size()) + " gradients for " + std::to_string(x.size()) + " inputs");

  auto loss = [&](const std::vector<double>& xp) {
    const std::vector<double> yp = forward(xp);
    if (yp.size() != dy.size())
      throw verify_error(name + ": forward returned " + std::to_string(yp.size()) + " outputs, first " + std::to_string(dy.size()));
    double s = 0;
    for (std::size_t i = 0; i < yp.size(); ++i) s += yp[i] * dy[i];
    return s;
  };

  gradcheck_report r;
  r.name = std::move(name);
  r.mode = o.mode;
  double worst_ratio = -1;
  bool all_zero = true;
  auto record = [&](std::size_t index, double analytic, double numeric) {
    grad_mismatch m;
    m.index = index;
    m.analytic = analytic;
    m.numeric = numeric;
    m.error = std::fabs(analytic - numeric);
    m.bound = o.atol + o.rtol * std::max(std::fabs(analytic), std::fabs(numeric));
    if (analytic != 0 || numeric != 0) all_zero = false;
    const bool bad = !(m.error <= m.bound);  // NaN is bad
    ++r.count;
    if (bad) {
      ++r.over;
      if (r.first.size() < o.keep) r.first.push_back(m);
    }
    const double ratio = std::isnan(m.error) ? std::numeric_limits<double>::infinity() : (m.bound > 0 ? m.error / m.bound : m.error);
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      r.worst = m;
    }
  };

  std::vector<double> xp(x.begin(), x.end());
  if (o.mode == grad_mode::full) {
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double h = o.step * std::max(1.0, std::fabs(x[i]));
      xp[i] = x[i] + h;
      const double lp = loss(xp);
      xp[i] = x[i] - h;
      const double lm = loss(xp);
      xp[i] = x[i];
      record(i, dx[i], (lp - lm) / (2 * h));
    }
  } else {
    double xmax = 1.0;
    for (double v : x) xmax = std::max(xmax, std::fabs(v));
    const double h = o.step * xmax;
    std::vector<double> v(x.size());
    for (std::size_t d = 0; d < o.directions; ++d) {
      double norm = 0;
      for (auto& e : v) {
        e = g.normal();
        norm += e * e;
      }
      norm = std::sqrt(norm);
      double analytic = 0;
      for (std::size_t i = 0; i < v.size(); ++i) {
        v[i] /= norm > 0 ? norm : 1.0;
        analytic += dx[i] * v[i];
      }
      for (std::size_t i = 0; i < v.size(); ++i) xp[i] = x[i] + h * v[i];
      const double lp = loss(xp);
      for (std::size_t i = 0; i < v.size(); ++i) xp[i] = x[i] - h * v[i];
      const double lm = loss(xp);
      record(d, analytic, (lp - lm) / (2 * h));
    }
  }
  r.mistrusted = r.count > 0 && all_zero;
  return r;
}

inline gradcheck_report gradcheck(std::string name, const forward_fn& forward, const backward_fn& backward, const std::vector<double>& x,
                                  const gradcheck_options& o = {}) {
  return gradcheck(std::move(name), forward, backward, std::span<const double>(x), o);
}

}  // namespace verify
}  // namespace v0
}  // namespace tessel
