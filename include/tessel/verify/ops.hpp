// The library's operators, each with a verify entry: an independent fp64 reference (plain loops,
// written here), a sweep of shapes (0, 1, primes, tile edges), fills that discriminate, the
// tolerance its dtype and reduction length give, gradcheck of its backward where it has one, and a
// bitwise determinism check (1 thread against N). `tessel-verify --all` runs them all, so a user who
// changes an atom checks every operator with one command.
//
// Tolerances (u = 2^-24, the f32 unit roundoff; γ_K = K·u/(1 − K·u)):
//   gemm           γ_K·Σ|a·b| + u_out·|c|                       (DESIGN.md; FP8: K + block-scale products)
//   gemm epilogue  1.13·γ_{K+1}·Σ|a·b| + (u_bf16 + 64u)·|y| + 64u   (gelu' ≤ 1.13, erf, the bf16 cast)
//   convert        exact (one RNE rounding of the f32 product; NaN/Inf/overflow as the scalar types)
//   softmax        γ_{n+16}·|y|                                  (a sum of n exps, a division)
//   rmsnorm        γ_{n+16}·|y|; layernorm γ_{n+16}·(|x|+|μ|)·rstd·|w| (cancellation in x − μ)
//   activations    64·u·|y| + 64·u·|x|·u-scale near zero          (exp/erf approximations)
//   cross-entropy  γ_{n+16} on the loss and on each gradient, relative to the row's scale
//   rope           16·u·(|x_i·cos| + |x_j·sin|)
//   attention      γ_{s+d+16}·Σ_j p_j·|v_j|                     (row sums of s keys, d-long dots)
//                  + u_bf16·Σ_j p_j·|v_j| for bf16/e4m3 inputs      (P rounded to bf16 for the P·V atom)
//   embedding      forward exact; backward γ_T·Σ|dout| over the T tokens of a row
//   optimizers     16·u·(|p| + |update|), one step from the kernel's own state (no drift)
//   backward       gradcheck: fp64 central differences, rtol 1e-3, atol 1e-6 (random directions)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/emulator/card.hpp>
#include <tessel/ops/activation.hpp>
#include <tessel/ops/attention.hpp>
#include <tessel/ops/conv.hpp>
#include <tessel/ops/embedding.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/loss.hpp>
#include <tessel/ops/norm.hpp>
#include <tessel/ops/optim.hpp>
#include <tessel/ops/quant.hpp>
#include <tessel/ops/rope.hpp>
#include <tessel/ops/softmax.hpp>
#include <tessel/verify/check.hpp>
#include <tessel/verify/determinism.hpp>
#include <tessel/verify/gradcheck.hpp>

namespace tessel {
inline namespace v0 {
namespace verify {

struct run_options {
  unsigned threads = 2;    // the device's threads; determinism compares 1 thread against this
  std::uint64_t seed = 1;  // fills
  bool quick = false;      // fewer shapes
  bool card = true;        // determinism also runs on an emulated card (its bits must be the host's)
};

struct entry {
  std::string name;  // "<op>/<dtype>..." as in the benchmarks
  std::string what;
  std::function<void(suite&, const run_options&)> run;
};

namespace detail {

inline std::vector<std::size_t> pick(const std::vector<std::size_t>& all, bool quick) {
  if (!quick || all.size() <= 4) return all;
  return {all.front(), all[all.size() / 3], all[2 * all.size() / 3], all.back()};
}
inline std::string dims(std::initializer_list<std::size_t> d) {
  std::string s;
  for (std::size_t x : d) {
    if (!s.empty()) s += 'x';
    s += std::to_string(x);
  }
  return s;
}
template <class T>
std::vector<double> widen(const std::vector<T>& v) {
  std::vector<double> d(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) d[i] = to_double(v[i]);
  return d;
}
inline constexpr double u32 = 0x1p-24;

// Outputs start as NaN, so an element the kernel never writes cannot pass (and zeros discriminate).
template <checkable T>
std::vector<T> poisoned(std::size_t n) {
  return std::vector<T>(n, from_double<T>(std::numeric_limits<double>::quiet_NaN()));
}

// The same computation on 1 thread, on `threads` threads and (o.card) on an emulated card: the
// outputs must agree bitwise. `run(device)` is generic over the device.
template <checkable T, class F>
void determinism(suite& s, const std::string& name, const F& run, const run_options& o) {
  std::vector<named_run<T>> runs;
  runs.push_back({"1 thread", [&run] {
                    host_device d(1);
                    return run(d);
                  }});
  runs.push_back({std::to_string(o.threads) + " threads", [&run, &o] {
                    host_device d(o.threads);
                    return run(d);
                  }});
  if (o.card)
    runs.push_back({"emulated card", [&run, &o] {
                      executor ex(o.threads);
                      emu::card_spec spec;
                      spec.memory_bytes = std::size_t{1} << 30;
                      emu::card c(0, spec, ex, false, nullptr);
                      return run(c);
                    }});
  for (auto& r : same_bits<T>(name, runs).reports) s.add(std::move(r));
}

// ---- gemm ----
template <class TA, class TC>
void gemm_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  const auto ms = pick(sizes({16, 48}, 97), o.quick), ks = pick(sizes({32}, 301), o.quick);
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (std::size_t m : ms)
        for (std::size_t k : ks) {
          const std::size_t n = (m * 7 + k) % 61 + 1;
          const auto a = filled<TA>(m * k, fill::uniform, o.seed + m * 131 + k), b = filled<TA>(k * n, fill::uniform, o.seed + k * 17 + n);
          auto at = [&](std::size_t i, std::size_t p) { return to_double(ta ? a[p * m + i] : a[i * k + p]); };
          auto bt = [&](std::size_t p, std::size_t j) { return to_double(tb ? b[j * k + p] : b[p * n + j]); };
          std::vector<double> want(m * n), mag(m * n);
          for (std::size_t i = 0; i < m; ++i)
            for (std::size_t j = 0; j < n; ++j)
              for (std::size_t p = 0; p < k; ++p) {
                const double t = at(i, p) * bt(p, j);
                want[i * n + j] += t;
                mag[i * n + j] += std::fabs(t);
              }
          auto run = [&](auto& d) {
            auto c = poisoned<TC>(m * n);
            // BLAS leading dimensions: at least 1, even for an empty operand
            gemm(d, ta ? transpose::yes : transpose::none, tb ? transpose::yes : transpose::none, m, n, k, 1.0f, a.data(),
                 std::max<std::size_t>(1, ta ? m : k), b.data(), std::max<std::size_t>(1, tb ? k : n), 0.0f, c.data(), n);
            return c;
          };
          const std::string name = std::string("gemm ") + (ta ? "T" : "N") + (tb ? "T" : "N") + " " + dims({m, n, k});
          check_options co;
          co.detect_mistrust = k != 0;  // K = 0: all zeros is the answer, written over NaN
          s.add(compare(name, std::span<const TC>(run(dev)), std::span<const double>(want),
                        tolerance::reduction(k, dtype::f32, tessel::detail::dtype_of_v<TC>), std::span<const double>(mag), co));
          if (m == ms.back() && k == ks.back()) determinism<TC>(s, name, run, o);
        }
}

// A gradcheck's verdict as a suite entry (its line carries the worst derivative).
inline report as_report(const gradcheck_report& g) {
  report r;
  r.name = g.to_string();
  r.count = g.count;
  r.over = g.over;
  r.mistrusted = g.mistrusted;
  if (r.mistrusted) r.mistrust_reason = "every derivative is zero";
  return r;
}

// ---- rows: softmax and norms ----
inline std::vector<double> softmax64(std::span<const double> x, std::size_t rows, std::size_t n) {
  std::vector<double> y(x.size());
  for (std::size_t r = 0; r < rows; ++r) {
    double m = -INFINITY, sum = 0;
    for (std::size_t c = 0; c < n; ++c) m = std::max(m, x[r * n + c]);
    for (std::size_t c = 0; c < n; ++c) sum += std::exp(x[r * n + c] - m);
    for (std::size_t c = 0; c < n; ++c) y[r * n + c] = std::exp(x[r * n + c] - m) / sum;
  }
  return y;
}

inline void softmax_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  const std::size_t rows = 5;
  for (std::size_t n : pick(sizes({16, 64}, 1031), o.quick)) {
    const auto x = filled<float>(rows * n, fill::normal, o.seed + n, {3, -1, 1, 3.0, true});
    auto run = [&](auto& d) {
      auto y = poisoned<float>(x.size());
      softmax_forward(d, tensor<const float, 2>(x.data(), rows, n), tensor<float, 2>(y.data(), rows, n));
      return y;
    };
    const std::string name = "softmax " + dims({rows, n});
    s.add(compare(name, run(dev), softmax64(widen(x), rows, n), tolerance::relative(gamma(n + 16, u32))));
    determinism<float>(s, name, run, o);
  }
  // backward: gradcheck of softmax_backward against the fp64 forward
  const std::size_t n = 37;
  const auto x = filled<double>(rows * n, fill::normal, o.seed + 99);
  gradcheck_options go;
  go.mode = grad_mode::random_directions;
  auto r = gradcheck(
      "softmax_backward " + dims({rows, n}), [&](std::span<const double> xx) { return softmax64(xx, rows, n); },
      [&](std::span<const double> xx, std::span<const double> dy) {
        const auto y64 = softmax64(xx, rows, n);
        std::vector<float> y(y64.begin(), y64.end()), g(dy.begin(), dy.end()), dx(xx.size());
        softmax_backward(dev, tensor<const float, 2>(g.data(), rows, n), tensor<const float, 2>(y.data(), rows, n),
                         tensor<float, 2>(dx.data(), rows, n));
        return std::vector<double>(dx.begin(), dx.end());
      },
      x, go);
  s.add(as_report(r));
}

inline std::vector<double> norm64(bool rms, std::span<const double> x, std::size_t rows, std::size_t n, std::span<const float> w,
                                  std::span<const float> b, double eps, std::vector<double>* mag = nullptr) {
  std::vector<double> y(x.size());
  if (mag) mag->assign(x.size(), 0.0);
  for (std::size_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    if (!rms) {
      for (std::size_t c = 0; c < n; ++c) mean += x[r * n + c];
      mean /= double(n);
    }
    for (std::size_t c = 0; c < n; ++c) var += (x[r * n + c] - mean) * (x[r * n + c] - mean);
    const double rs = 1.0 / std::sqrt(var / double(n) + eps);
    for (std::size_t c = 0; c < n; ++c) {
      y[r * n + c] = (x[r * n + c] - mean) * rs * w[c] + (b.empty() ? 0.0 : double(b[c]));
      if (mag) (*mag)[r * n + c] = (std::fabs(x[r * n + c]) + std::fabs(mean)) * rs * std::fabs(w[c]) + (b.empty() ? 0.0 : std::fabs(b[c]));
    }
  }
  return y;
}

inline void norm_entry(suite& s, const run_options& o, bool rms) {
  host_device dev(o.threads);
  const std::size_t rows = 6;
  const char* op = rms ? "rmsnorm" : "layernorm";
  const float eps = 1e-5f;
  // rows of length 0 have no mean or RMS: the library rejects them with a typed error
  for (std::size_t n : pick(sizes({16, 64}, 1031, false), o.quick)) {
    const auto x = filled<float>(rows * n, fill::normal, o.seed + n, {3, -1, 1, 2.0, true});
    const auto w = filled<float>(n, fill::uniform, o.seed + 7, {3, 0.5, 1.5, 1, true}), b = filled<float>(n, fill::uniform, o.seed + 8);
    norm_options no;
    no.eps = eps;
    auto run = [&](auto& d) {
      auto y = poisoned<float>(x.size());
      std::vector<float> mean(rows), rstd(rows);
      if (rms)
        rmsnorm_forward(d, tensor<const float, 2>(x.data(), rows, n), std::span<const float>(w), tensor<float, 2>(y.data(), rows, n), rstd, no);
      else
        layernorm_forward(d, tensor<const float, 2>(x.data(), rows, n), std::span<const float>(w), std::span<const float>(b),
                          tensor<float, 2>(y.data(), rows, n), mean, rstd, no);
      return y;
    };
    std::vector<double> mag;
    const auto want = norm64(rms, widen(x), rows, n, w, rms ? std::span<const float>{} : std::span<const float>(b), eps, &mag);
    const std::string name = std::string(op) + " " + dims({rows, n});
    tolerance t;
    t.mag = gamma(n + 16, u32);
    s.add(compare(name, run(dev), want, t, mag));
    determinism<float>(s, name, run, o);
  }
  const std::size_t n = 24, m = 3;
  const auto w = filled<float>(n, fill::uniform, o.seed + 5, {3, 0.5, 1.5, 1, true}), b = filled<float>(n, fill::uniform, o.seed + 6);
  const std::span<const float> bs = rms ? std::span<const float>{} : std::span<const float>(b);
  gradcheck_options go;
  go.mode = grad_mode::random_directions;
  s.add(as_report(gradcheck(
      std::string(op) + "_backward " + dims({m, n}), [&](std::span<const double> xx) { return norm64(rms, xx, m, n, w, bs, eps); },
      [&](std::span<const double> xx, std::span<const double> dy) {
        std::vector<float> xf(xx.begin(), xx.end()), g(dy.begin(), dy.end()), y(xx.size()), mean(m), rstd(m), dx(xx.size()), dw(n), db(n);
        norm_options no;
        no.eps = eps;
        const tensor<const float, 2> xt(xf.data(), m, n);
        if (rms) {
          rmsnorm_forward(dev, xt, std::span<const float>(w), tensor<float, 2>(y.data(), m, n), rstd, no);
          rmsnorm_backward(dev, tensor<const float, 2>(g.data(), m, n), xt, std::span<const float>(w), rstd, tensor<float, 2>(dx.data(), m, n), dw,
                           no);
        } else {
          layernorm_forward(dev, xt, std::span<const float>(w), bs, tensor<float, 2>(y.data(), m, n), mean, rstd, no);
          layernorm_backward(dev, tensor<const float, 2>(g.data(), m, n), xt, std::span<const float>(w), mean, rstd,
                             tensor<float, 2>(dx.data(), m, n), dw, db, no);
        }
        return std::vector<double>(dx.begin(), dx.end());
      },
      filled<double>(m * n, fill::normal, o.seed + 3), go)));
}

// ---- elementwise activations ----
enum class act { gelu_tanh, gelu_erf, silu };
inline double act64(act a, double x) {
  switch (a) {
    case act::gelu_tanh: return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    case act::gelu_erf: return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    case act::silu: return x / (1.0 + std::exp(-x));
  }
  return 0;
}

inline void activation_entry(suite& s, const run_options& o, act a) {
  host_device dev(o.threads);
  const char* op = a == act::gelu_tanh ? "gelu_tanh" : a == act::gelu_erf ? "gelu_erf" : "silu";
  auto fwd = [a](auto& d, std::span<const float> x, std::span<float> y) {
    if (a == act::silu)
      silu_forward(d, x, y);
    else
      gelu_forward(d, x, y, a == act::gelu_tanh ? gelu_approx::tanh : gelu_approx::erf);
  };
  for (std::size_t n : pick(sizes({8, 16, 64}, 100003), o.quick)) {
    const auto x = filled<float>(n, fill::normal, o.seed + n, {3, -1, 1, 3.0, true});
    auto run = [&](auto& d) {
      auto y = poisoned<float>(n);
      fwd(d, x, y);
      return y;
    };
    std::vector<double> want(n), mag(n);
    for (std::size_t i = 0; i < n; ++i) {
      want[i] = act64(a, x[i]);
      mag[i] = std::fabs(x[i]);
    }
    tolerance t;
    t.rel = 64 * u32;
    t.mag = 64 * u32;
    const std::string name = std::string(op) + " " + std::to_string(n);
    s.add(compare(name, run(dev), want, t, mag));
    determinism<float>(s, name, run, o);
  }
  const std::size_t n = 41;
  gradcheck_options go;
  go.mode = grad_mode::random_directions;
  s.add(as_report(gradcheck(
      std::string(op) + "_backward " + std::to_string(n),
      [a](std::span<const double> x) {
        std::vector<double> y(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) y[i] = act64(a, x[i]);
        return y;
      },
      [&](std::span<const double> x, std::span<const double> dy) {
        std::vector<float> xf(x.begin(), x.end()), g(dy.begin(), dy.end()), dx(x.size());
        if (a == act::silu)
          silu_backward(dev, std::span<const float>(g), std::span<const float>(xf), std::span<float>(dx));
        else
          gelu_backward(dev, std::span<const float>(g), std::span<const float>(xf), std::span<float>(dx),
                        a == act::gelu_tanh ? gelu_approx::tanh : gelu_approx::erf);
        return std::vector<double>(dx.begin(), dx.end());
      },
      filled<double>(n, fill::normal, o.seed + 4), go)));
}

inline void swiglu_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  for (std::size_t n : pick(sizes({8, 16, 64}, 100003), o.quick)) {
    const auto a = filled<float>(n, fill::normal, o.seed + n, {3, -1, 1, 3.0, true}), b = filled<float>(n, fill::normal, o.seed + 2 * n);
    auto run = [&](auto& d) {
      auto y = poisoned<float>(n);
      swiglu_forward(d, std::span<const float>(a), std::span<const float>(b), std::span<float>(y));
      return y;
    };
    std::vector<double> want(n), mag(n);
    for (std::size_t i = 0; i < n; ++i) {
      want[i] = act64(act::silu, a[i]) * b[i];
      mag[i] = std::fabs(a[i] * b[i]);
    }
    tolerance t;
    t.rel = 64 * u32;
    t.mag = 64 * u32;
    const std::string name = "swiglu " + std::to_string(n);
    s.add(compare(name, run(dev), want, t, mag));
    determinism<float>(s, name, run, o);
  }
  const std::size_t n = 23;  // x = [a; b]
  gradcheck_options go;
  go.mode = grad_mode::random_directions;
  s.add(as_report(gradcheck(
      "swiglu_backward " + std::to_string(n),
      [&](std::span<const double> x) {
        std::vector<double> y(n);
        for (std::size_t i = 0; i < n; ++i) y[i] = act64(act::silu, x[i]) * x[n + i];
        return y;
      },
      [&](std::span<const double> x, std::span<const double> dy) {
        std::vector<float> af(x.begin(), x.begin() + n), bf(x.begin() + n, x.end()), g(dy.begin(), dy.end()), da(n), db(n);
        swiglu_backward(dev, std::span<const float>(g), std::span<const float>(af), std::span<const float>(bf), std::span<float>(da),
                        std::span<float>(db));
        std::vector<double> dx(da.begin(), da.end());
        dx.insert(dx.end(), db.begin(), db.end());
        return dx;
      },
      filled<double>(2 * n, fill::normal, o.seed + 5), go)));
}

// ---- cross-entropy ----
inline void cross_entropy_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  const std::size_t rows = 7;
  for (std::size_t n : pick(sizes({16, 64}, 32003, false), o.quick)) {
    const auto x = filled<float>(rows * n, fill::normal, o.seed + n, {3, -1, 1, 2.0, true});
    std::vector<std::int64_t> labels(rows);
    rng g(o.seed + n);
    for (auto& l : labels) l = g.integer(0, static_cast<std::int64_t>(n) - 1);
    labels[rows / 2] = -100;  // ignored
    const auto p = softmax64(widen(x), rows, n);
    std::vector<double> want_grad(rows * n);
    double want_loss = 0;
    std::size_t counted = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      if (labels[r] < 0) continue;
      ++counted;
      want_loss -= std::log(p[r * n + std::size_t(labels[r])]);
    }
    want_loss /= double(counted);
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < n; ++c)
        want_grad[r * n + c] = labels[r] < 0 ? 0.0 : (p[r * n + c] - (std::int64_t(c) == labels[r] ? 1.0 : 0.0)) / double(counted);
    double loss = 0;
    auto run = [&](auto& d) {
      auto dl = poisoned<float>(x.size());
      loss = cross_entropy(d, tensor<const float, 2>(x.data(), rows, n), std::span<const std::int64_t>(labels), tensor<float, 2>(dl.data(), rows, n))
                 .loss;
      return dl;
    };
    const std::string name = "cross_entropy " + dims({rows, n});
    tolerance t;
    t.abs = gamma(n + 16, u32) / double(counted);
    t.rel = gamma(n + 16, u32);
    s.add(compare(name + " dlogits", run(dev), want_grad, t));
    s.add(compare(name + " loss", std::vector<double>{loss}, std::vector<double>{want_loss}, tolerance::relative(gamma(n + 16, u32))));
    determinism<float>(s, name, run, o);
  }
}

// ---- rope ----
inline std::vector<double> rope64(std::span<const double> x, std::size_t tokens, std::size_t heads, std::size_t hd, std::span<const std::int64_t> pos,
                                  double theta, double sign, std::vector<double>* mag = nullptr) {
  std::vector<double> y(x.size());
  if (mag) mag->assign(x.size(), 0.0);
  const std::size_t half = hd / 2;
  for (std::size_t t = 0; t < tokens; ++t)
    for (std::size_t h = 0; h < heads; ++h)
      for (std::size_t j = 0; j < half; ++j) {
        const double ang = double(pos[t]) * std::pow(theta, -2.0 * double(j) / double(hd));
        const double c = std::cos(ang), sn = sign * std::sin(ang);
        const std::size_t i0 = t * heads * hd + h * hd + j, i1 = i0 + half;
        y[i0] = x[i0] * c - x[i1] * sn;
        y[i1] = x[i1] * c + x[i0] * sn;
        if (mag) {
          (*mag)[i0] = std::fabs(x[i0] * c) + std::fabs(x[i1] * sn);
          (*mag)[i1] = std::fabs(x[i1] * c) + std::fabs(x[i0] * sn);
        }
      }
  return y;
}

inline void rope_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  const std::size_t heads = 3;
  for (std::size_t hd : {std::size_t{2}, std::size_t{64}, std::size_t{128}})
    for (std::size_t tokens : pick(sizes({16}, 67), o.quick)) {
      const auto x = filled<float>(tokens * heads * hd, fill::normal, o.seed + tokens + hd);
      std::vector<std::int64_t> pos(tokens);
      for (std::size_t t = 0; t < tokens; ++t) pos[t] = std::int64_t(t * 37 % 4099);
      auto run = [&](auto& d) {
        std::vector<float> y = x;
        rope_forward(d, tensor<float, 2>(y.data(), tokens, heads * hd), hd, std::span<const std::int64_t>(pos));
        return y;
      };
      std::vector<double> mag;
      const auto want = rope64(widen(x), tokens, heads, hd, pos, 10000.0, 1.0, &mag);
      tolerance t;
      t.mag = 16 * u32;
      const std::string name = "rope " + dims({tokens, heads, hd});
      s.add(compare(name, run(dev), want, t, mag));
      determinism<float>(s, name, run, o);
    }
  const std::size_t tokens = 5, hd = 8, hh = 2;
  std::vector<std::int64_t> pos = {0, 3, 17, 100, 4095};
  gradcheck_options go;
  go.mode = grad_mode::random_directions;
  s.add(as_report(gradcheck(
      "rope_backward " + dims({tokens, hh, hd}), [&](std::span<const double> x) { return rope64(x, tokens, hh, hd, pos, 10000.0, 1.0); },
      [&](std::span<const double>, std::span<const double> dy) {
        std::vector<float> g(dy.begin(), dy.end());
        rope_backward(dev, tensor<float, 2>(g.data(), tokens, hh * hd), hd, std::span<const std::int64_t>(pos));
        return std::vector<double>(g.begin(), g.end());
      },
      filled<double>(tokens * hh * hd, fill::normal, o.seed + 6), go)));
}

// ---- attention ----
// fp64 attention over bshd tensors; `mag` (if given) gets Σ_j p_j·|v_j| / Σ_j p_j per output.
inline std::vector<double> attention64(const attention_shape& sh, bool causal, std::span<const double> q, std::span<const double> k,
                                       std::span<const double> v, std::vector<double>* mag = nullptr) {
  const std::size_t d = sh.head_dim, sq = sh.seq_q, skv = sh.seq_kv, group = sh.heads_q / sh.heads_kv;
  std::vector<double> out(q.size()), p(skv);
  if (mag) mag->assign(q.size(), 0.0);
  const double scale = 1.0 / std::sqrt(double(d));
  for (std::size_t bb = 0; bb < sh.batch; ++bb)
    for (std::size_t h = 0; h < sh.heads_q; ++h) {
      const std::size_t hk = h / group;
      for (std::size_t i = 0; i < sq; ++i) {
        double m = -INFINITY, sum = 0;
        for (std::size_t j = 0; j < skv; ++j) {
          double dot = 0;
          for (std::size_t e = 0; e < d; ++e) dot += q[((bb * sq + i) * sh.heads_q + h) * d + e] * k[((bb * skv + j) * sh.heads_kv + hk) * d + e];
          p[j] = (causal && j > i) ? -INFINITY : dot * scale;
          m = std::max(m, p[j]);
        }
        for (std::size_t j = 0; j < skv; ++j) sum += (p[j] = std::exp(p[j] - m));
        for (std::size_t e = 0; e < d; ++e) {
          double acc = 0, mg = 0;
          for (std::size_t j = 0; j < skv; ++j) {
            const double vv = v[((bb * skv + j) * sh.heads_kv + hk) * d + e];
            acc += p[j] * vv;
            mg += p[j] * std::fabs(vv);
          }
          out[((bb * sq + i) * sh.heads_q + h) * d + e] = acc / sum;
          if (mag) (*mag)[((bb * sq + i) * sh.heads_q + h) * d + e] = mg / sum;
        }
      }
    }
  return out;
}

inline void attention_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  for (bool causal : {false, true})
    for (std::size_t hq_over_kv : {std::size_t{1}, std::size_t{4}})
      for (std::size_t sq : pick(sizes({64}, 131), o.quick)) {
        attention_shape sh;
        sh.batch = 2;
        sh.seq_q = sq;
        sh.seq_kv = sq + (causal ? 0 : 7);
        sh.heads_kv = 2;
        sh.heads_q = 2 * hq_over_kv;
        sh.head_dim = 64;
        attention_options ao;
        ao.causal = causal;
        const std::size_t d = sh.head_dim;
        const auto q = filled<float>(sh.batch * sq * sh.heads_q * d, fill::normal, o.seed + sq);
        const auto k = filled<float>(sh.batch * sh.seq_kv * sh.heads_kv * d, fill::normal, o.seed + sq + 1);
        const auto v = filled<float>(sh.batch * sh.seq_kv * sh.heads_kv * d, fill::normal, o.seed + sq + 2);
        auto run = [&](auto& dv) {
          auto out = poisoned<float>(q.size());
          attention_forward(dv, sh, std::span<const float>(q), std::span<const float>(k), std::span<const float>(v), std::span<float>(out), {}, ao);
          return out;
        };
        std::vector<double> mag;
        const auto want = attention64(sh, causal, widen(q), widen(k), widen(v), &mag);
        tolerance t;
        t.mag = gamma(sh.seq_kv + d + 16, u32);
        const std::string name =
            std::string("attention ") + (causal ? "causal " : "") + "hq" + std::to_string(sh.heads_q) + " hkv2 " + dims({sh.batch, sq, sh.seq_kv, d});
        s.add(compare(name, run(dev), want, t, mag));
        determinism<float>(s, name, run, o);
      }
  // backward: dq, dk, dv together, gradchecked against the fp64 forward (x = [q; k; v])
  for (bool causal : {false, true}) {
    attention_shape sh;
    sh.batch = 1;
    sh.seq_q = 5;
    sh.seq_kv = causal ? 5 : 9;
    sh.heads_q = 4;
    sh.heads_kv = 2;
    sh.head_dim = 16;
    const std::size_t nq = sh.seq_q * sh.heads_q * sh.head_dim, nk = sh.seq_kv * sh.heads_kv * sh.head_dim;
    attention_options ao;
    ao.causal = causal;
    gradcheck_options go;
    go.mode = grad_mode::random_directions;
    s.add(as_report(gradcheck(
        std::string("attention_backward ") + (causal ? "causal " : "") + "hq4 hkv2 " + dims({sh.batch, sh.seq_q, sh.seq_kv, sh.head_dim}),
        [&](std::span<const double> x) { return attention64(sh, causal, x.subspan(0, nq), x.subspan(nq, nk), x.subspan(nq + nk, nk)); },
        [&](std::span<const double> x, std::span<const double> dy) {
          std::vector<float> xf(x.begin(), x.end()), g(dy.begin(), dy.end()), out(nq), lse(sh.heads_q * sh.seq_q), dx(x.size());
          const std::span<const float> q(xf.data(), nq), k(xf.data() + nq, nk), v(xf.data() + nq + nk, nk);
          attention_forward(dev, sh, q, k, v, std::span<float>(out), std::span<float>(lse), ao);
          attention_backward(dev, sh, q, k, v, std::span<const float>(out), std::span<const float>(g), std::span<const float>(lse),
                             std::span<float>(dx.data(), nq), std::span<float>(dx.data() + nq, nk), std::span<float>(dx.data() + nq + nk, nk), ao);
          return std::vector<double>(dx.begin(), dx.end());
        },
        filled<double>(nq + 2 * nk, fill::normal, o.seed + 12), go)));
  }
}

// One output row of attention in fp64: q (d) against the keys `keys` (pointers to d-long k and v
// rows); a row without keys is "fully masked" (zeros). Returns Σ_j p_j·|v_j| / Σ p in `mag`.
inline void attention_row64(const double* q, const std::vector<const double*>& ks, const std::vector<const double*>& vs, std::size_t d, double scale,
                            double* out, double* mag) {
  if (ks.empty()) {
    for (std::size_t e = 0; e < d; ++e) out[e] = mag[e] = 0;
    return;
  }
  std::vector<double> p(ks.size());
  double m = -INFINITY, sum = 0;
  for (std::size_t j = 0; j < ks.size(); ++j) {
    double dot = 0;
    for (std::size_t e = 0; e < d; ++e) dot += q[e] * ks[j][e];
    p[j] = dot * scale;
    m = std::max(m, p[j]);
  }
  for (auto& x : p) sum += (x = std::exp(x - m));
  for (std::size_t e = 0; e < d; ++e) {
    double acc = 0, mg = 0;
    for (std::size_t j = 0; j < ks.size(); ++j) {
      acc += p[j] * vs[j][e];
      mg += p[j] * std::fabs(vs[j][e]);
    }
    out[e] = acc / sum;
    mag[e] = mg / sum;
  }
}

// Varlen batches (an empty query sequence among them), decode against a paged KV cache, and E4M3
// inputs with dequantisation scales.
inline void attention_variants_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  const std::size_t hq = 4, hkv = 2, d = 32, group = hq / hkv;
  const double scale = 1.0 / std::sqrt(double(d));
  // -- varlen: token-packed sequences
  for (bool causal : {false, true}) {
    const std::vector<std::int32_t> cu_q = {0, 3, 3, 20, 21}, cu_kv = {0, 5, 9, 40, 41};
    const std::size_t tq = std::size_t(cu_q.back()), tk = std::size_t(cu_kv.back());
    const auto q = filled<float>(tq * hq * d, fill::normal, o.seed + 31), k = filled<float>(tk * hkv * d, fill::normal, o.seed + 32),
               v = filled<float>(tk * hkv * d, fill::normal, o.seed + 33);
    const auto qd = widen(q), kd = widen(k), vd = widen(v);
    std::vector<double> want(q.size()), mag(q.size());
    for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
      const std::size_t q0 = std::size_t(cu_q[b]), nq = std::size_t(cu_q[b + 1]) - q0, k0 = std::size_t(cu_kv[b]),
                        nk = std::size_t(cu_kv[b + 1]) - k0;
      for (std::size_t i = 0; i < nq; ++i)
        for (std::size_t h = 0; h < hq; ++h) {
          std::vector<const double*> ks, vs;
          for (std::size_t j = 0; j < nk && (!causal || j <= i); ++j) {
            ks.push_back(kd.data() + ((k0 + j) * hkv + h / group) * d);
            vs.push_back(vd.data() + ((k0 + j) * hkv + h / group) * d);
          }
          const std::size_t at = ((q0 + i) * hq + h) * d;
          attention_row64(qd.data() + at, ks, vs, d, scale, want.data() + at, mag.data() + at);
        }
    }
    attention_varlen_shape sh;
    sh.cu_q = cu_q;
    sh.cu_kv = cu_kv;
    sh.heads_q = hq;
    sh.heads_kv = hkv;
    sh.head_dim = d;
    attention_options ao;
    ao.causal = causal;
    auto run = [&](auto& dv) {
      auto out = poisoned<float>(q.size());
      attention_forward_varlen(dv, sh, std::span<const float>(q), std::span<const float>(k), std::span<const float>(v), std::span<float>(out), {},
                               ao);
      return out;
    };
    tolerance t;
    t.mag = gamma(40 + d + 16, u32);
    const std::string name = std::string("attention varlen ") + (causal ? "causal " : "") + "4 sequences (one empty)";
    s.add(compare(name, run(dev), want, t, mag));
    determinism<float>(s, name, run, o);
  }
  // -- decode: seq_q new rows per sequence, bottom-right causal, against a paged cache in shuffled pages
  for (std::size_t seq_q : {std::size_t{1}, std::size_t{4}}) {
    const std::size_t batch = 3, page = 16, per_seq = 5, pages = batch * per_seq;
    const std::vector<std::int32_t> lens = {int(seq_q), 37, 80};
    std::vector<std::int32_t> table(batch * per_seq);
    for (std::size_t i = 0; i < table.size(); ++i) table[i] = std::int32_t((i * 7 + 3) % pages);  // a permutation of the pages
    const auto q = filled<float>(batch * seq_q * hq * d, fill::normal, o.seed + 41),
               k = filled<float>(pages * page * hkv * d, fill::normal, o.seed + 42),
               v = filled<float>(pages * page * hkv * d, fill::normal, o.seed + 43);
    const auto qd = widen(q), kd = widen(k), vd = widen(v);
    std::vector<double> want(q.size()), mag(q.size());
    for (std::size_t b = 0; b < batch; ++b)
      for (std::size_t i = 0; i < seq_q; ++i)
        for (std::size_t h = 0; h < hq; ++h) {
          std::vector<const double*> ks, vs;
          const std::size_t len = std::size_t(lens[b]), last = i + len - seq_q;  // bottom-right: row i sees keys <= i + len - seq_q
          for (std::size_t j = 0; j < len && j <= last; ++j) {
            const std::size_t tok = std::size_t(table[b * per_seq + j / page]) * page + j % page;
            ks.push_back(kd.data() + (tok * hkv + h / group) * d);
            vs.push_back(vd.data() + (tok * hkv + h / group) * d);
          }
          const std::size_t at = ((b * seq_q + i) * hq + h) * d;
          attention_row64(qd.data() + at, ks, vs, d, scale, want.data() + at, mag.data() + at);
        }
    attention_decode_shape sh;
    sh.batch = batch;
    sh.seq_q = seq_q;
    sh.heads_q = hq;
    sh.heads_kv = hkv;
    sh.head_dim = d;
    sh.page_size = page;
    sh.num_pages = pages;
    sh.pages_per_seq = per_seq;
    attention_options ao;
    ao.causal = true;
    ao.align = mask_align::bottom_right;
    auto run = [&](auto& dv) {
      auto out = poisoned<float>(q.size());
      attention_decode(dv, sh, std::span<const float>(q), std::span<const float>(k), std::span<const float>(v), std::span<const std::int32_t>(lens),
                       std::span<const std::int32_t>(table), std::span<float>(out), {}, ao);
      return out;
    };
    tolerance t;
    t.mag = gamma(80 + d + 16, u32);
    const std::string name = "attention decode paged seq_q " + std::to_string(seq_q) + " lens 1-80";
    s.add(compare(name, run(dev), want, t, mag));
    determinism<float>(s, name, run, o);
  }
  // -- E4M3 q, k, v with per-tensor dequantisation scales
  {
    attention_shape sh;
    sh.batch = 2;
    sh.seq_q = 33;
    sh.seq_kv = 70;
    sh.heads_q = hq;
    sh.heads_kv = hkv;
    sh.head_dim = 64;
    fill_options fo;
    fo.lo = -16;
    fo.hi = 16;
    const auto q = filled<e4m3>(sh.batch * sh.seq_q * hq * sh.head_dim, fill::uniform, o.seed + 51, fo);
    const auto k = filled<e4m3>(sh.batch * sh.seq_kv * hkv * sh.head_dim, fill::uniform, o.seed + 52, fo);
    const auto v = filled<e4m3>(sh.batch * sh.seq_kv * hkv * sh.head_dim, fill::uniform, o.seed + 53, fo);
    attention_options ao;
    ao.q_scale = 1.0f / 16;
    ao.k_scale = 1.0f / 32;
    ao.v_scale = 1.0f / 8;
    auto scaled = [](const std::vector<e4m3>& x, float sc) {
      std::vector<double> r(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) r[i] = to_double(x[i]) * double(sc);
      return r;
    };
    std::vector<double> mag;
    const auto want = attention64(sh, false, scaled(q, ao.q_scale), scaled(k, ao.k_scale), scaled(v, ao.v_scale), &mag);
    auto run = [&](auto& dv) {
      auto out = poisoned<float>(q.size());
      attention_forward(dv, sh, std::span<const e4m3>(q), std::span<const e4m3>(k), std::span<const e4m3>(v), std::span<float>(out), {}, ao);
      return out;
    };
    // e4m3 (and bf16) inputs run on the bf16 pair atom: P is rounded to bf16 before P·V
    tolerance t;
    t.mag = unit_roundoff<bf16>() + gamma(sh.seq_kv + sh.head_dim + 16, u32);
    const std::string name = "attention e4m3 scaled " + dims({sh.batch, sh.seq_q, sh.seq_kv, sh.head_dim});
    s.add(compare(name, run(dev), want, t, mag));
    determinism<float>(s, name, run, o);
  }
}

// ---- embedding ----
inline void embedding_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  for (std::size_t width : pick(sizes({16, 256}, 1031), o.quick)) {
    const std::size_t vocab = 50, tokens = 97;
    const auto table = filled<float>(vocab * width, fill::normal, o.seed + width);
    const auto dout = filled<float>(tokens * width, fill::normal, o.seed + width + 1);
    std::vector<std::int64_t> ids(tokens);
    rng g(o.seed + width);
    for (auto& id : ids) id = g.integer(0, 9);  // repeated ids: the scatter-add sums several rows
    std::vector<double> want_fwd(tokens * width), want_bwd(vocab * width), mag(vocab * width);
    for (std::size_t t = 0; t < tokens; ++t)
      for (std::size_t c = 0; c < width; ++c) {
        want_fwd[t * width + c] = table[std::size_t(ids[t]) * width + c];
        want_bwd[std::size_t(ids[t]) * width + c] += dout[t * width + c];
        mag[std::size_t(ids[t]) * width + c] += std::fabs(dout[t * width + c]);
      }
    auto fwd = [&](auto& d) {
      auto out = poisoned<float>(tokens * width);
      embedding_forward(d, std::span<const std::int64_t>(ids), tensor<const float, 2>(table.data(), vocab, width),
                        tensor<float, 2>(out.data(), tokens, width));
      return out;
    };
    auto bwd = [&](auto& d) {
      std::vector<float> dt(vocab * width, 0.0f);
      embedding_backward(d, std::span<const std::int64_t>(ids), tensor<const float, 2>(dout.data(), tokens, width),
                         tensor<float, 2>(dt.data(), vocab, width));
      return dt;
    };
    const std::string name = "embedding " + dims({tokens, vocab, width});
    s.add(compare(name + " forward", fwd(dev), want_fwd, tolerance::exact()));
    tolerance t;
    t.mag = gamma(tokens, u32);
    auto check_options_for_sparse = check_options{};
    check_options_for_sparse.mistrust_zero_fraction = 0.9;  // 10 of 50 rows are used: 80% zeros by design
    s.add(compare(name + " backward", std::span<const float>(bwd(dev)), std::span<const double>(want_bwd), t, std::span<const double>(mag),
                  check_options_for_sparse));
    determinism<float>(s, name + " backward", bwd, o);
  }
}

// ---- optimizers: one step against fp64 from the kernel's own state, three steps in a row ----
enum class optimizer { adamw, sgd_nesterov, lion };

inline void optimizer_entry(suite& s, const run_options& o, optimizer which) {
  host_device dev(o.threads);
  const char* op = which == optimizer::adamw ? "adamw" : which == optimizer::sgd_nesterov ? "sgd" : "lion";
  for (std::size_t n : pick(sizes({16, 64}, 100003, false), o.quick)) {
    auto p = filled<float>(n, fill::normal, o.seed + n);
    std::vector<float> m(n, 0.0f), v(n, 0.0f);
    for (std::uint64_t step = 1; step <= 3; ++step) {
      const auto g = filled<float>(n, fill::normal, o.seed + n + 100 * step);
      std::vector<double> want(n), mag(n);
      const std::vector<float> p0 = p, m0 = m, v0 = v;
      for (std::size_t i = 0; i < n; ++i) {
        const double pi = p0[i], gi = g[i], mi = m0[i], vi = v0[i];
        if (which == optimizer::adamw) {
          const adamw_params h;
          const double m1 = h.beta1 * mi + (1 - double(h.beta1)) * gi, v1 = h.beta2 * vi + (1 - double(h.beta2)) * gi * gi;
          const double bc1 = 1 - std::pow(double(h.beta1), double(step)), bc2 = 1 - std::pow(double(h.beta2), double(step));
          const double upd = double(h.lr) / bc1 * m1 / (std::sqrt(v1) / std::sqrt(bc2) + h.eps);
          want[i] = pi * (1 - double(h.lr) * h.weight_decay) - upd;
          mag[i] = std::fabs(pi) + std::fabs(upd);
        } else if (which == optimizer::sgd_nesterov) {
          const double lr = 0.01, mom = 0.9;
          const double b = step == 1 ? gi : mom * mi + gi;
          const double upd = lr * (gi + mom * b);
          want[i] = pi - upd;
          mag[i] = std::fabs(pi) + lr * (std::fabs(gi) + mom * std::fabs(b));
        } else {
          const lion_params h;
          const double c = h.beta1 * mi + (1 - double(h.beta1)) * gi;
          const double sg = c > 0 ? 1.0 : c < 0 ? -1.0 : 0.0;
          want[i] = pi * (1 - double(h.lr) * h.weight_decay) - double(h.lr) * sg;
          mag[i] = std::fabs(pi) + double(h.lr);
        }
      }
      optim_tensor<float, float> t;
      t.param = p;
      t.grad = g;
      t.m = m;
      if (which == optimizer::adamw) t.v = v;
      const std::span<const optim_tensor<float, float>> ts(&t, 1);
      if (which == optimizer::adamw)
        adamw_step(dev, ts, adamw_params{}, step);
      else if (which == optimizer::sgd_nesterov) {
        sgd_params h;
        h.lr = 0.01f;
        h.momentum = 0.9f;
        h.nesterov = true;
        sgd_step(dev, ts, h, step);
      } else
        lion_step(dev, ts, lion_params{}, step);
      tolerance tol;
      tol.mag = 16 * u32;
      s.add(compare(std::string(op) + " " + std::to_string(n) + " step " + std::to_string(step), p, want, tol, mag));
    }
  }
}

// ---- gemm variants: FP8 block-scaled, a fused epilogue, strided batches ----
inline void gemm_fp8_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  for (std::size_t m : pick(sizes({16}, 97), o.quick))
    for (std::size_t k : {std::size_t{1}, std::size_t{127}, std::size_t{128}, std::size_t{300}}) {
      const std::size_t n = 130, kb = ceil_div(k, 128), nb = ceil_div(n, 128);
      fill_options fo;
      fo.lo = -8;
      fo.hi = 8;
      const auto a = filled<e4m3>(m * k, fill::uniform, o.seed + m + k, fo), b = filled<e4m3>(k * n, fill::uniform, o.seed + 3 * k, fo);
      fill_options so;
      so.lo = 0.01;
      so.hi = 0.1;
      const auto sa = filled<float>(m * kb, fill::uniform, o.seed + 5, so), sb = filled<float>(kb * nb, fill::uniform, o.seed + 6, so);
      std::vector<double> want(m * n), mag(m * n);
      for (std::size_t i = 0; i < m; ++i)
        for (std::size_t j = 0; j < n; ++j)
          for (std::size_t p = 0; p < k; ++p) {
            const double t = to_double(a[i * k + p]) * to_double(b[p * n + j]) * sa[i * kb + p / 128] * sb[(p / 128) * nb + j / 128];
            want[i * n + j] += t;
            mag[i * n + j] += std::fabs(t);
          }
      auto run = [&](auto& d) {
        auto c = poisoned<float>(m * n);
        gemm_scales sc;
        sc.a_block = sa.data();
        sc.b_block = sb.data();
        gemm(d, transpose::none, transpose::none, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n, epilogue::chain<>{}, sc);
        return c;
      };
      const std::string name = "gemm e4m3 block-scaled " + dims({m, n, k});
      s.add(compare(name, run(dev), want, tolerance::reduction(k + 2 * kb + 2, dtype::f32, dtype::f32), mag));
      if (m == 97) determinism<float>(s, name, run, o);
    }
}

inline void gemm_epilogue_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  for (std::size_t m : pick(sizes({16, 48}, 97), o.quick)) {
    const std::size_t n = 67, k = 129;
    const auto a = filled<bf16>(m * k, fill::uniform, o.seed + m), b = filled<bf16>(k * n, fill::uniform, o.seed + m + 1);
    const auto bias = filled<float>(n, fill::uniform, o.seed + 2);
    std::vector<double> want(m * n), mag(m * n);
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        double acc = bias[j], mg = std::fabs(bias[j]);
        for (std::size_t p = 0; p < k; ++p) {
          const double t = to_double(a[i * k + p]) * to_double(b[p * n + j]);
          acc += t;
          mg += std::fabs(t);
        }
        want[i * n + j] = 0.5 * acc * (1.0 + std::erf(acc / std::sqrt(2.0)));
        mag[i * n + j] = mg;
      }
    auto run = [&](auto& d) {
      auto c = poisoned<bf16>(m * n);
      gemm(d, transpose::none, transpose::none, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n,
           epilogue::bias(std::span<const float>(bias)) | epilogue::gelu_erf | epilogue::cast<bf16>);
      return c;
    };
    // gelu' ≤ 1.13 carries the sum's γ_K error; then the erf and one bf16 rounding
    tolerance t;
    t.mag = 1.13 * gamma(k + 1, u32);
    t.rel = unit_roundoff<bf16>() + 64 * u32;
    t.abs = 64 * u32;
    const std::string name = "gemm bf16 + bias + gelu_erf -> bf16 " + dims({m, n, k});
    s.add(compare(name, run(dev), want, t, mag));
    determinism<bf16>(s, name, run, o);
  }
}

inline void gemm_batched_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  for (std::size_t batch : {std::size_t{1}, std::size_t{3}, std::size_t{8}})
    for (std::size_t m : pick(sizes({16}, 67), o.quick)) {
      const std::size_t n = 19, k = 45;
      const auto a = filled<float>(batch * m * k, fill::normal, o.seed + batch * m), b = filled<float>(batch * k * n, fill::normal, o.seed + batch);
      std::vector<double> want(batch * m * n), mag(batch * m * n);
      for (std::size_t q = 0; q < batch; ++q)
        for (std::size_t i = 0; i < m; ++i)
          for (std::size_t j = 0; j < n; ++j)
            for (std::size_t p = 0; p < k; ++p) {
              // B transposed: stored (n, k)
              const double t = double(a[q * m * k + i * k + p]) * double(b[q * k * n + j * k + p]);
              want[q * m * n + i * n + j] += t;
              mag[q * m * n + i * n + j] += std::fabs(t);
            }
      auto run = [&](auto& d) {
        auto c = poisoned<float>(batch * m * n);
        gemm_strided_batched(d, transpose::none, transpose::yes, m, n, k, 1.0f, a.data(), k, m * k, b.data(), k, k * n, 0.0f, c.data(), n, m * n,
                             batch);
        return c;
      };
      const std::string name = "gemm strided batched NT " + dims({batch, m, n, k});
      s.add(compare(name, run(dev), want, tolerance::reduction(k, dtype::f32, dtype::f32), mag));
      if (m == 67) determinism<float>(s, name, run, o);
    }
}

// ---- bulk conversion: the device's convert against the scalar conversions, bit for bit ----
template <class To>
void convert_entry_of(suite& s, const run_options& o, const char* to_name) {
  host_device dev(o.threads);
  for (std::size_t n : pick(sizes({16, 64}, 100003), o.quick))
    for (float scale : {1.0f, 0.37f}) {
      const auto x = filled<float>(n, fill::adversarial, o.seed + n);
      auto run = [&](auto& d) {
        auto y = poisoned<To>(n);
        convert(d, std::span<const float>(x), std::span<To>(y), scale);
        return y;
      };
      std::vector<double> want(n);
      for (std::size_t i = 0; i < n; ++i) want[i] = to_double(To(x[i] * scale));  // f32 product, one RNE conversion
      const std::string name = std::string("convert f32 -> ") + to_name + " x" + (scale == 1.0f ? "1" : "0.37") + " " + std::to_string(n);
      s.add(compare(name, run(dev), want, tolerance::exact()));
      if (n == 100003) determinism<To>(s, name, run, o);
    }
}

inline void convert_entry(suite& s, const run_options& o) {
  convert_entry_of<bf16>(s, o, "bf16");
  convert_entry_of<fp16>(s, o, "fp16");
  convert_entry_of<e4m3>(s, o, "e4m3");
  convert_entry_of<e5m2>(s, o, "e5m2");
}

// ---- conv2d (implicit GEMM) ----
struct conv_case {
  image_dims x;
  filter_dims f;
  conv2d_params p;
};
inline std::vector<conv_case> conv_cases(conv_layout l) {
  auto geo = [l](std::size_t s, std::size_t pt, std::size_t pl, std::size_t pb, std::size_t pr, std::size_t d, std::size_t g) {
    conv2d_params p;
    p.stride_h = p.stride_w = s;
    p.pad_top = pt, p.pad_left = pl, p.pad_bottom = pb, p.pad_right = pr;
    p.dilation_h = p.dilation_w = d;
    p.groups = g;
    p.layout = l;
    return p;
  };
  return {{{1, 3, 9, 9}, {5, 3, 3, 3}, geo(1, 1, 1, 1, 1, 1, 1)},   {{2, 6, 11, 10}, {9, 2, 3, 3}, geo(2, 1, 0, 2, 1, 1, 3)},
          {{1, 5, 12, 12}, {7, 5, 3, 3}, geo(1, 2, 2, 2, 2, 2, 1)}, {{2, 13, 6, 5}, {17, 13, 1, 1}, geo(1, 0, 0, 0, 0, 1, 1)},
          {{1, 3, 19, 19}, {8, 3, 7, 7}, geo(2, 3, 3, 3, 3, 1, 1)}, {{1, 70, 5, 5}, {67, 70, 3, 3}, geo(1, 1, 1, 1, 1, 1, 1)}};
}
inline std::size_t conv_at(conv_layout l, const image_dims& d, std::size_t n, std::size_t c, std::size_t y, std::size_t x) {
  return l == conv_layout::nchw ? ((n * d.c + c) * d.h + y) * d.w + x : ((n * d.h + y) * d.w + x) * d.c + c;
}
// fp64 conv: for each output and (input, weight) pair of its sum, f(out index, x index, w index).
template <class F>
void conv_taps(const conv_case& cc, const image_dims& y, const F& f) {
  const auto& p = cc.p;
  const std::size_t kg = cc.f.out / p.groups;
  for (std::size_t n = 0; n < y.n; ++n)
    for (std::size_t o = 0; o < y.c; ++o)
      for (std::size_t oy = 0; oy < y.h; ++oy)
        for (std::size_t ox = 0; ox < y.w; ++ox)
          for (std::size_t c = 0; c < cc.f.in; ++c)
            for (std::size_t r = 0; r < cc.f.kh; ++r)
              for (std::size_t q = 0; q < cc.f.kw; ++q) {
                const long iy = long(oy * p.stride_h + r * p.dilation_h) - long(p.pad_top),
                           ix = long(ox * p.stride_w + q * p.dilation_w) - long(p.pad_left);
                if (iy < 0 || ix < 0 || iy >= long(cc.x.h) || ix >= long(cc.x.w)) continue;
                f(conv_at(p.layout, y, n, o, oy, ox), conv_at(p.layout, cc.x, n, o / kg * cc.f.in + c, std::size_t(iy), std::size_t(ix)),
                  ((o * cc.f.in + c) * cc.f.kh + r) * cc.f.kw + q);
              }
}
inline std::string conv_name(const conv_case& cc) {
  return std::string(cc.p.layout == conv_layout::nchw ? "nchw " : "nhwc ") + dims({cc.x.n, cc.x.c, cc.x.h, cc.x.w}) + " * " +
         dims({cc.f.out, cc.f.in, cc.f.kh, cc.f.kw}) + " s" + std::to_string(cc.p.stride_h) + " d" + std::to_string(cc.p.dilation_h) + " g" +
         std::to_string(cc.p.groups);
}

template <class T, class TY>
void conv_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc}) {
    const auto cases = conv_cases(l);
    for (std::size_t i = 0; i < cases.size(); ++i) {
      if (o.quick && i % 2 == 1) continue;
      const auto& cc = cases[i];
      const auto yd = tessel::detail::conv_geometry(cc.x, cc.f, cc.p).out();
      const auto x = filled<T>(cc.x.size(), fill::uniform, o.seed + i), w = filled<T>(cc.f.size(), fill::uniform, o.seed + 100 + i);
      const auto bias = filled<float>(cc.f.out, fill::uniform, o.seed + 200 + i);
      std::vector<double> want(yd.size()), mag(yd.size());
      conv_taps(cc, yd, [&](std::size_t yi, std::size_t xi, std::size_t wi) {
        const double t = to_double(x[xi]) * to_double(w[wi]);
        want[yi] += t;
        mag[yi] += std::fabs(t);
      });
      const std::size_t plane = yd.h * yd.w;
      for (std::size_t yi = 0; yi < want.size(); ++yi) {
        const std::size_t c = l == conv_layout::nchw ? yi / plane % yd.c : yi % yd.c;
        want[yi] += bias[c];
        mag[yi] += std::fabs(bias[c]);
      }
      auto run = [&](auto& d) {
        auto y = poisoned<TY>(yd.size());
        conv2d(d, image<const T>{x.data(), cc.x}, filter<const T>{w.data(), cc.f}, std::span<const float>(bias), image<TY>{y.data(), yd}, cc.p);
        return y;
      };
      const std::string name = "conv2d " + conv_name(cc);
      s.add(compare(name, std::span<const TY>(run(dev)), std::span<const double>(want),
                    tolerance::reduction(cc.f.in * cc.f.kh * cc.f.kw + 1, dtype::f32, tessel::detail::dtype_of_v<TY>), std::span<const double>(mag)));
      if (i == 1) determinism<TY>(s, name, run, o);
    }
  }
}

inline void conv_backward_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc}) {
    const auto cc = conv_cases(l)[1];
    const auto yd = tessel::detail::conv_geometry(cc.x, cc.f, cc.p).out();
    const auto x = filled<double>(cc.x.size(), fill::normal, o.seed + 7), w = filled<double>(cc.f.size(), fill::normal, o.seed + 8);
    const std::vector<float> xf(x.begin(), x.end()), wf(w.begin(), w.end());
    auto forward = [&](std::span<const double> xs, std::span<const double> ws) {
      std::vector<double> y(yd.size());
      conv_taps(cc, yd, [&](std::size_t yi, std::size_t xi, std::size_t wi) { y[yi] += xs[xi] * ws[wi]; });
      return y;
    };
    gradcheck_options go;
    go.mode = grad_mode::random_directions;
    go.seed = o.seed;
    const std::string name = conv_name(cc);
    s.add(as_report(gradcheck(
        "conv2d_backward_data " + name, [&](std::span<const double> xs) { return forward(xs, w); },
        [&](std::span<const double>, std::span<const double> dy) {
          std::vector<float> dyf(dy.begin(), dy.end()), gx(cc.x.size());
          conv2d_backward_data(dev, image<const float>{dyf.data(), yd}, filter<const float>{wf.data(), cc.f}, image<float>{gx.data(), cc.x}, cc.p);
          return std::vector<double>(gx.begin(), gx.end());
        },
        x, go)));
    s.add(as_report(gradcheck(
        "conv2d_backward_weight " + name, [&](std::span<const double> ws) { return forward(x, ws); },
        [&](std::span<const double>, std::span<const double> dy) {
          std::vector<float> dyf(dy.begin(), dy.end()), gw(cc.f.size());
          conv2d_backward_weight(dev, image<const float>{xf.data(), cc.x}, image<const float>{dyf.data(), yd}, filter<float>{gw.data(), cc.f}, cc.p);
          return std::vector<double>(gw.begin(), gw.end());
        },
        w, go)));
  }
}

// ---- cross-entropy backward as a gradcheck of the mean loss ----
inline void cross_entropy_grad_entry(suite& s, const run_options& o) {
  host_device dev(o.threads);
  const std::size_t rows = 4, n = 29;
  const std::vector<std::int64_t> labels = {3, 0, 28, 11};
  gradcheck_options go;
  go.mode = grad_mode::full;
  s.add(as_report(gradcheck(
      "cross_entropy_backward " + dims({rows, n}),
      [&](std::span<const double> x) {
        const auto p = softmax64(x, rows, n);
        double l = 0;
        for (std::size_t r = 0; r < rows; ++r) l -= std::log(p[r * n + std::size_t(labels[r])]);
        return std::vector<double>{l / double(rows)};
      },
      [&](std::span<const double> x, std::span<const double> dy) {
        std::vector<float> xf(x.begin(), x.end()), dl(x.size());
        cross_entropy(dev, tensor<const float, 2>(xf.data(), rows, n), std::span<const std::int64_t>(labels), tensor<float, 2>(dl.data(), rows, n));
        std::vector<double> g(x.size());
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = double(dl[i]) * dy[0];
        return g;
      },
      filled<double>(rows * n, fill::normal, o.seed + 21), go)));
}

}  // namespace detail

// Every library operator's entry, in a stable order.
inline const std::vector<entry>& library() {
  static const std::vector<entry> all = {
      {"gemm/f32", "f32 GEMM, 4 transposes, M/K swept over tile edges; 1 vs N threads", detail::gemm_entry<float, float>},
      {"gemm/bf16", "bf16 GEMM into f32, 4 transposes, M/K swept", detail::gemm_entry<bf16, float>},
      {"gemm/bf16_out", "bf16 GEMM into bf16 (one rounding of the f32 sum)", detail::gemm_entry<bf16, bf16>},
      {"gemm/e4m3_block", "FP8 E4M3 GEMM with 1x128 / 128x128 block scales (DeepSeek-V3 recipe)", detail::gemm_fp8_entry},
      {"gemm/epilogue", "bf16 GEMM with a fused bias + exact GELU + bf16 cast epilogue", detail::gemm_epilogue_entry},
      {"gemm/batched", "strided-batched f32 GEMM (NT), batch 1, 3, 8", detail::gemm_batched_entry},
      {"conv2d/f32", "f32 conv2d (implicit GEMM) + bias, NCHW and NHWC: padding, stride 2, dilation 2, groups, 1x1, 7x7 stem",
       detail::conv_entry<float, float>},
      {"conv2d/bf16", "bf16 conv2d into bf16 (one rounding of the f32 sum), NCHW and NHWC", detail::conv_entry<bf16, bf16>},
      {"conv2d/backward", "conv2d data and weight gradients (groups 3, stride 2, asymmetric padding) by gradcheck, both layouts",
       detail::conv_backward_entry},
      {"convert", "bulk f32 -> bf16/fp16/e4m3/e5m2 with and without a scale, adversarial values, bit for bit", detail::convert_entry},
      {"softmax", "softmax forward over row lengths 1..1031; backward gradcheck", detail::softmax_entry},
      {"rmsnorm", "RMSNorm forward; backward (dx) gradcheck", [](suite& s, const run_options& o) { detail::norm_entry(s, o, true); }},
      {"layernorm", "LayerNorm forward; backward (dx) gradcheck", [](suite& s, const run_options& o) { detail::norm_entry(s, o, false); }},
      {"gelu_tanh", "tanh-approximated GELU forward and backward",
       [](suite& s, const run_options& o) { detail::activation_entry(s, o, detail::act::gelu_tanh); }},
      {"gelu_erf", "exact (erf) GELU forward and backward",
       [](suite& s, const run_options& o) { detail::activation_entry(s, o, detail::act::gelu_erf); }},
      {"silu", "SiLU forward and backward", [](suite& s, const run_options& o) { detail::activation_entry(s, o, detail::act::silu); }},
      {"swiglu", "SwiGLU forward and backward (both inputs)", detail::swiglu_entry},
      {"cross_entropy", "cross-entropy loss and dlogits (an ignored row, vocab up to 32003), and a gradcheck of the mean loss",
       [](suite& s, const run_options& o) {
         detail::cross_entropy_entry(s, o);
         detail::cross_entropy_grad_entry(s, o);
       }},
      {"rope", "rotary embedding forward (head_dim 2, 64, 128); backward gradcheck", detail::rope_entry},
      {"attention", "flash attention forward, causal and not, GQA 1 and 4; backward (dq, dk, dv) gradcheck", detail::attention_entry},
      {"attention/variants", "varlen batches (an empty sequence), decode against a paged KV cache, E4M3 inputs with scales",
       detail::attention_variants_entry},
      {"embedding", "embedding gather (exact) and its deterministic scatter-add backward", detail::embedding_entry},
      {"adamw", "fused AdamW, three steps, each against fp64 from the kernel's state",
       [](suite& s, const run_options& o) { detail::optimizer_entry(s, o, detail::optimizer::adamw); }},
      {"sgd", "fused SGD with Nesterov momentum, three steps",
       [](suite& s, const run_options& o) { detail::optimizer_entry(s, o, detail::optimizer::sgd_nesterov); }},
      {"lion", "fused Lion, three steps", [](suite& s, const run_options& o) { detail::optimizer_entry(s, o, detail::optimizer::lion); }},
  };
  return all;
}

// Runs one entry; an exception from the operator becomes a failing report naming it.
inline suite run(const entry& e, const run_options& o = {}) {
  if (o.threads == 0) throw verify_error("run_options: threads must be at least 1");
  suite s;
  try {
    e.run(s, o);
  } catch (const std::exception& ex) {
    report r;
    r.name = e.name + ": threw " + ex.what();
    r.over = 1;
    s.add(r);
  }
  for (auto& r : s.reports) r.name = e.name + ": " + r.name;
  return s;
}

}  // namespace verify
}  // namespace v0
}  // namespace tessel
