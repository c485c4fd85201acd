// An fp64 reference interpreter for the executor's tests: every op the executor runs, written the
// plainest way (nested loops over multi-indices in double), sharing no code with the executor. It
// reads the graph's constants and attributes and takes its shapes from the inputs it is given.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <tessel/graph.hpp>

namespace tessel_test_graph {

namespace tg = tessel::graph;
using tessel::dtype;

struct rt {  // a reference tensor: dtype, shape, values in double
  dtype t = dtype::f32;
  std::vector<std::size_t> s;
  std::vector<double> v;
};

inline std::size_t count(const std::vector<std::size_t>& s) {
  std::size_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

inline rt from_host(const tg::host_tensor& h) {
  rt r;
  r.t = h.type;
  for (auto d : h.shape) r.s.push_back(static_cast<std::size_t>(d));
  const std::size_t n = count(r.s);
  r.v.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    switch (h.type) {
      case dtype::f32: {
        float x;
        std::memcpy(&x, h.data.data() + 4 * i, 4);
        r.v[i] = x;
        break;
      }
      case dtype::f64: {
        double x;
        std::memcpy(&x, h.data.data() + 8 * i, 8);
        r.v[i] = x;
        break;
      }
      case dtype::i64: {
        std::int64_t x;
        std::memcpy(&x, h.data.data() + 8 * i, 8);
        r.v[i] = static_cast<double>(x);
        break;
      }
      case dtype::i32: {
        std::int32_t x;
        std::memcpy(&x, h.data.data() + 4 * i, 4);
        r.v[i] = x;
        break;
      }
      case dtype::u8: r.v[i] = static_cast<double>(static_cast<std::uint8_t>(h.data[i])); break;
      default: throw std::runtime_error("reference: dtype");
    }
  }
  return r;
}

inline rt from_value(const tg::value& x) {
  tg::host_tensor h;
  h.type = *x.type;
  for (const auto& d : x.shape.dims) h.shape.push_back(d.size);
  h.data = *x.data;
  return from_host(h);
}

// multi-index helpers
inline std::vector<std::size_t> unravel(std::size_t i, const std::vector<std::size_t>& s) {
  std::vector<std::size_t> idx(s.size());
  for (std::size_t a = s.size(); a-- > 0;) {
    idx[a] = i % s[a];
    i /= s[a];
  }
  return idx;
}
inline std::size_t ravel(const std::vector<std::size_t>& idx, const std::vector<std::size_t>& s) {
  std::size_t i = 0;
  for (std::size_t a = 0; a < s.size(); ++a) i = i * s[a] + idx[a];
  return i;
}
// the element of `x` that output index `idx` (of rank >= x's) reads under numpy broadcasting
inline double bat(const rt& x, const std::vector<std::size_t>& idx) {
  std::vector<std::size_t> j(x.s.size());
  for (std::size_t k = 0; k < x.s.size(); ++k) {
    const std::size_t a = idx.size() - x.s.size() + k;
    j[k] = x.s[k] == 1 ? 0 : idx[a];
  }
  return x.v[ravel(j, x.s)];
}
inline std::vector<std::size_t> bshape(const std::vector<rt>& xs) {
  std::size_t r = 0;
  for (const rt& x : xs) r = std::max(r, x.s.size());
  std::vector<std::size_t> s(r, 1);
  for (const rt& x : xs)
    for (std::size_t k = 0; k < x.s.size(); ++k) {
      std::size_t& d = s[r - x.s.size() + k];
      if (x.s[k] != 1) d = x.s[k];
    }
  for (const rt& x : xs)  // a zero-sized dim wins
    for (std::size_t k = 0; k < x.s.size(); ++k)
      if (x.s[k] == 0) s[r - x.s.size() + k] = 0;
  return s;
}

inline std::size_t nax(std::int64_t a, std::size_t r) { return static_cast<std::size_t>(a < 0 ? a + static_cast<std::int64_t>(r) : a); }

inline double act_ref(const std::string& a, double x) {
  if (a.empty()) return x;
  if (a == "Relu") return x > 0 ? x : 0;
  if (a == "Gelu") return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
  if (a == "GeluTanh") return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
  if (a == "Sigmoid") return 1 / (1 + std::exp(-x));
  if (a == "Tanh") return std::tanh(x);
  if (a == "Silu") return x / (1 + std::exp(-x));
  throw std::runtime_error("reference: activation " + a);
}

inline rt matmul_ref(const rt& A, const rt& B) {
  rt a = A, b = B;
  if (a.s.size() == 1) a.s.insert(a.s.begin(), 1);
  if (b.s.size() == 1) b.s.push_back(1);
  const std::size_t M = a.s[a.s.size() - 2], K = a.s.back(), N = b.s.back();
  rt ab{a.t, std::vector<std::size_t>(a.s.begin(), a.s.end() - 2), {}}, bb{b.t, std::vector<std::size_t>(b.s.begin(), b.s.end() - 2), {}};
  const auto batch = bshape({ab, bb});
  rt y;
  y.t = A.t;
  y.s = batch;
  if (A.s.size() > 1) y.s.push_back(M);
  if (B.s.size() > 1) y.s.push_back(N);
  y.v.assign(count(batch) * M * N, 0.0);
  for (std::size_t bi = 0; bi < count(batch); ++bi) {
    const auto idx = unravel(bi, batch);
    auto off = [&](const rt& x, const std::vector<std::size_t>& xs) {
      std::vector<std::size_t> j(xs.size());
      for (std::size_t k = 0; k < xs.size(); ++k) j[k] = xs[k] == 1 ? 0 : idx[idx.size() - xs.size() + k];
      (void)x;
      return ravel(j, xs);
    };
    const std::size_t ao = off(a, ab.s) * M * K, bo = off(b, bb.s) * K * N;
    for (std::size_t i = 0; i < M; ++i)
      for (std::size_t j = 0; j < N; ++j) {
        double acc = 0;
        for (std::size_t k = 0; k < K; ++k) acc += a.v[ao + i * K + k] * b.v[bo + k * N + j];
        y.v[bi * M * N + i * N + j] = acc;
      }
  }
  return y;
}

inline rt norm_ref(const rt& x, const rt* scale, const rt* bias, std::int64_t axis_attr, double eps, bool rms, rt* mean_out = nullptr,
                   rt* rstd_out = nullptr) {
  const std::size_t ax = nax(axis_attr, x.s.size());
  std::size_t rows = 1, n = 1;
  for (std::size_t a = 0; a < x.s.size(); ++a) (a < ax ? rows : n) *= x.s[a];
  const std::vector<std::size_t> ns(x.s.begin() + static_cast<std::ptrdiff_t>(ax), x.s.end());
  rt y = x;
  if (mean_out) {
    mean_out->t = dtype::f32;
    mean_out->s = x.s;
    for (std::size_t a = ax; a < x.s.size(); ++a) mean_out->s[a] = 1;
    mean_out->v.assign(rows, 0);
    *rstd_out = *mean_out;
  }
  for (std::size_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (std::size_t j = 0; j < n; ++j) mean += x.v[r * n + j];
    mean /= static_cast<double>(n);
    for (std::size_t j = 0; j < n; ++j) {
      const double d = x.v[r * n + j] - (rms ? 0 : mean);
      var += d * d;
    }
    var /= static_cast<double>(n);
    const double rstd = 1 / std::sqrt(var + eps);
    if (mean_out) {
      mean_out->v[r] = mean;
      rstd_out->v[r] = rstd;
    }
    for (std::size_t j = 0; j < n; ++j) {
      const auto idx = unravel(j, ns);
      double v = (x.v[r * n + j] - (rms ? 0 : mean)) * rstd * bat(*scale, idx);
      if (bias) v += bat(*bias, idx);
      y.v[r * n + j] = v;
    }
  }
  return y;
}

// The ONNX Conv / pool window geometry (2-D; 1-D runs as H = 1), pads resolved.
struct win {
  std::size_t ns = 2;
  std::vector<std::int64_t> k, st, dl, pads;
};
inline win window_ref(const tg::node& n, const std::vector<std::size_t>& xs, const std::vector<std::size_t>& ys, std::vector<std::int64_t> k) {
  win w;
  w.ns = xs.size() - 2;
  w.k = std::move(k);
  w.st = n.get_ints("strides", tg::ints(w.ns, 1));
  w.dl = n.get_ints("dilations", tg::ints(w.ns, 1));
  w.pads = n.get_ints("pads", tg::ints(2 * w.ns, 0));
  const std::string ap = n.get_string("auto_pad", "NOTSET");
  if (ap == "VALID") w.pads.assign(2 * w.ns, 0);
  if (ap.rfind("SAME", 0) == 0)
    for (std::size_t i = 0; i < w.ns; ++i) {
      const std::int64_t tot = std::max<std::int64_t>(
          0, (static_cast<std::int64_t>(ys[2 + i]) - 1) * w.st[i] + (w.k[i] - 1) * w.dl[i] + 1 - static_cast<std::int64_t>(xs[2 + i]));
      w.pads[i] = ap == "SAME_UPPER" ? tot / 2 : tot - tot / 2;
      w.pads[w.ns + i] = tot - w.pads[i];
    }
  return w;
}

// Evaluates the whole graph in fp64; returns every value by name.
inline std::map<std::string, rt> reference(const tg::graph& g, const std::map<std::string, rt>& inputs) {
  std::map<std::string, rt> env = inputs;
  for (tg::value_id c : g.constants()) env[g.get(c).name] = from_value(g.get(c));
  for (tg::node_id id : g.topological_order()) {
    const tg::node& n = g.get(id);
    std::vector<rt> in;
    std::vector<bool> present;
    for (tg::value_id v : n.inputs) {
      present.push_back(v != tg::value_id::none);
      in.push_back(v == tg::value_id::none ? rt{} : env.at(g.get(v).name));
    }
    const std::string& op = n.op;
    std::vector<rt> out(n.outputs.size());
    rt& y = out[0];
    auto elementwise = [&](dtype t, const std::function<double(const std::vector<double>&)>& f) {
      y.t = t;
      y.s = bshape(in);
      y.v.resize(count(y.s));
      for (std::size_t i = 0; i < y.v.size(); ++i) {
        const auto idx = unravel(i, y.s);
        std::vector<double> a;
        for (const rt& x : in) a.push_back(bat(x, idx));
        y.v[i] = f(a);
      }
    };
    auto round_to = [&](rt& r) {  // integer dtypes hold integers
      if (r.t == dtype::i64 || r.t == dtype::i32)
        for (double& v : r.v) v = std::trunc(v);
    };
    const bool isint = !in.empty() && (in[0].t == dtype::i64 || in[0].t == dtype::i32);
    if (op == "Abs")
      elementwise(in[0].t, [](auto a) { return std::fabs(a[0]); });
    else if (op == "Neg")
      elementwise(in[0].t, [](auto a) { return -a[0]; });
    else if (op == "Relu")
      elementwise(in[0].t, [](auto a) { return a[0] > 0 ? a[0] : 0.0; });
    else if (op == "Ceil")
      elementwise(in[0].t, [](auto a) { return std::ceil(a[0]); });
    else if (op == "Floor")
      elementwise(in[0].t, [](auto a) { return std::floor(a[0]); });
    else if (op == "Sqrt")
      elementwise(in[0].t, [](auto a) { return std::sqrt(a[0]); });
    else if (op == "Exp")
      elementwise(in[0].t, [](auto a) { return std::exp(a[0]); });
    else if (op == "Log")
      elementwise(in[0].t, [](auto a) { return std::log(a[0]); });
    else if (op == "Sin")
      elementwise(in[0].t, [](auto a) { return std::sin(a[0]); });
    else if (op == "Cos")
      elementwise(in[0].t, [](auto a) { return std::cos(a[0]); });
    else if (op == "Tanh")
      elementwise(in[0].t, [](auto a) { return std::tanh(a[0]); });
    else if (op == "Erf")
      elementwise(in[0].t, [](auto a) { return std::erf(a[0]); });
    else if (op == "Reciprocal")
      elementwise(in[0].t, [](auto a) { return 1 / a[0]; });
    else if (op == "Sigmoid")
      elementwise(in[0].t, [](auto a) { return 1 / (1 + std::exp(-a[0])); });
    else if (op == "Gelu") {
      const std::string ap = n.get_string("approximate", "none");
      elementwise(in[0].t, [&](auto a) { return act_ref(ap == "tanh" ? "GeluTanh" : "Gelu", a[0]); });
    } else if (op == "Identity" || op == "Dropout") {
      y = in[0];
      if (out.size() > 1) out[1] = rt{dtype::u8, in[0].s, std::vector<double>(in[0].v.size(), 1.0)};
    } else if (op == "Add" || op == "Sum")
      elementwise(in[0].t, [](auto a) {
        double s = 0;
        for (double x : a) s += x;
        return s;
      });
    else if (op == "Sub")
      elementwise(in[0].t, [](auto a) { return a[0] - a[1]; });
    else if (op == "Mul")
      elementwise(in[0].t, [](auto a) { return a[0] * a[1]; });
    else if (op == "Div")
      elementwise(in[0].t, [&](auto a) { return isint ? std::trunc(a[0] / a[1]) : a[0] / a[1]; });
    else if (op == "Max")
      elementwise(in[0].t, [](auto a) { return *std::max_element(a.begin(), a.end()); });
    else if (op == "Min")
      elementwise(in[0].t, [](auto a) { return *std::min_element(a.begin(), a.end()); });
    else if (op == "Mean")
      elementwise(in[0].t, [](auto a) {
        double s = 0;
        for (double x : a) s += x;
        return s / double(a.size());
      });
    else if (op == "Pow")
      elementwise(in[0].t, [](auto a) { return std::pow(a[0], a[1]); });
    else if (op == "Equal")
      elementwise(dtype::u8, [](auto a) { return a[0] == a[1] ? 1.0 : 0.0; });
    else if (op == "Less")
      elementwise(dtype::u8, [](auto a) { return a[0] < a[1] ? 1.0 : 0.0; });
    else if (op == "Greater")
      elementwise(dtype::u8, [](auto a) { return a[0] > a[1] ? 1.0 : 0.0; });
    else if (op == "Where")
      elementwise(in[1].t, [](auto a) { return a[0] != 0 ? a[1] : a[2]; });
    else if (op == "Cast") {
      y = in[0];
      y.t = *g.get(n.outputs[0]).type;
      if (y.t == dtype::bf16 || y.t == dtype::fp16) throw std::runtime_error("reference: cast to 16-bit floats");
      if (y.t == dtype::f32)
        for (double& v : y.v) v = static_cast<float>(v);
      round_to(y);
    } else if (op == "Reshape" || op == "Flatten" || op == "Squeeze" || op == "Unsqueeze") {
      y = in[0];
      y.s.clear();
      for (const auto& d : g.get(n.outputs[0]).shape.dims)
        y.s.push_back(d.known() ? static_cast<std::size_t>(d.size) : in[0].s[0]);  // a symbolic dim is the batch
      // recompute: the element count fixes the one symbolic dim
      std::size_t known = 1, at = 0;
      bool sym = false;
      for (std::size_t a = 0; a < y.s.size(); ++a) {
        if (g.get(n.outputs[0]).shape.dims[a].known())
          known *= y.s[a];
        else {
          sym = true;
          at = a;
        }
      }
      if (sym) y.s[at] = known ? in[0].v.size() / known : 0;
    } else if (op == "Transpose") {
      const std::size_t r = in[0].s.size();
      tg::ints perm(r);
      for (std::size_t i = 0; i < r; ++i) perm[i] = static_cast<std::int64_t>(r - 1 - i);
      perm = n.get_ints("perm", perm);
      y.t = in[0].t;
      for (auto p : perm) y.s.push_back(in[0].s[static_cast<std::size_t>(p)]);
      y.v.resize(in[0].v.size());
      for (std::size_t i = 0; i < y.v.size(); ++i) {
        const auto idx = unravel(i, y.s);
        std::vector<std::size_t> j(r);
        for (std::size_t a = 0; a < r; ++a) j[static_cast<std::size_t>(perm[a])] = idx[a];
        y.v[i] = in[0].v[ravel(j, in[0].s)];
      }
    } else if (op == "Concat") {
      const std::size_t ax = nax(n.get_int("axis"), in[0].s.size());
      y.t = in[0].t;
      y.s = in[0].s;
      y.s[ax] = 0;
      for (const rt& x : in) y.s[ax] += x.s[ax];
      y.v.resize(count(y.s));
      for (std::size_t i = 0; i < y.v.size(); ++i) {
        auto idx = unravel(i, y.s);
        std::size_t k = 0;
        while (idx[ax] >= in[k].s[ax]) idx[ax] -= in[k++].s[ax];
        y.v[i] = in[k].v[ravel(idx, in[k].s)];
      }
    } else if (op == "Split") {
      const std::size_t ax = nax(n.get_int("axis", 0), in[0].s.size());
      std::size_t at = 0;
      for (std::size_t o = 0; o < out.size(); ++o) {
        const auto& dims = g.get(n.outputs[o]).shape.dims;
        rt& z = out[o];
        z.t = in[0].t;
        z.s = in[0].s;
        z.s[ax] = static_cast<std::size_t>(dims[ax].size);
        z.v.resize(count(z.s));
        for (std::size_t i = 0; i < z.v.size(); ++i) {
          auto idx = unravel(i, z.s);
          idx[ax] += at;
          z.v[i] = in[0].v[ravel(idx, in[0].s)];
        }
        at += z.s[ax];
      }
    } else if (op == "Slice") {
      const auto starts = *g.constant_ints(n.inputs[1]), ends = *g.constant_ints(n.inputs[2]);
      tg::ints axes, steps;
      if (present.size() > 3 && present[3])
        axes = *g.constant_ints(n.inputs[3]);
      else
        for (std::size_t i = 0; i < starts.size(); ++i) axes.push_back(static_cast<std::int64_t>(i));
      if (present.size() > 4 && present[4])
        steps = *g.constant_ints(n.inputs[4]);
      else
        steps.assign(starts.size(), 1);
      const std::size_t r = in[0].s.size();
      std::vector<std::vector<std::size_t>> pick(r);
      for (std::size_t a = 0; a < r; ++a)
        for (std::size_t i = 0; i < in[0].s[a]; ++i) pick[a].push_back(i);
      for (std::size_t i = 0; i < axes.size(); ++i) {
        const std::size_t a = nax(axes[i], r);
        const auto d = static_cast<std::int64_t>(in[0].s[a]);
        std::int64_t b = starts[i], e = ends[i], st = steps[i];
        if (b < 0) b += d;
        if (e < 0) e += d;
        pick[a].clear();
        if (st > 0) {
          b = std::clamp<std::int64_t>(b, 0, d);
          e = std::clamp<std::int64_t>(e, 0, d);
          for (std::int64_t k = b; k < e; k += st) pick[a].push_back(static_cast<std::size_t>(k));
        } else {
          b = std::clamp<std::int64_t>(b, 0, d - 1);
          e = std::clamp<std::int64_t>(e, -1, d - 1);
          for (std::int64_t k = b; k > e; k += st) pick[a].push_back(static_cast<std::size_t>(k));
        }
      }
      y.t = in[0].t;
      for (auto& p : pick) y.s.push_back(p.size());
      y.v.resize(count(y.s));
      for (std::size_t i = 0; i < y.v.size(); ++i) {
        auto idx = unravel(i, y.s);
        for (std::size_t a = 0; a < r; ++a) idx[a] = pick[a][idx[a]];
        y.v[i] = in[0].v[ravel(idx, in[0].s)];
      }
    } else if (op == "Gather") {
      const std::size_t ax = nax(n.get_int("axis", 0), in[0].s.size());
      y.t = in[0].t;
      y.s.assign(in[0].s.begin(), in[0].s.begin() + static_cast<std::ptrdiff_t>(ax));
      y.s.insert(y.s.end(), in[1].s.begin(), in[1].s.end());
      y.s.insert(y.s.end(), in[0].s.begin() + static_cast<std::ptrdiff_t>(ax) + 1, in[0].s.end());
      y.v.resize(count(y.s));
      const std::size_t ir = in[1].s.size();
      for (std::size_t i = 0; i < y.v.size(); ++i) {
        const auto idx = unravel(i, y.s);
        std::vector<std::size_t> j(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(ax));
        std::vector<std::size_t> ii(idx.begin() + static_cast<std::ptrdiff_t>(ax), idx.begin() + static_cast<std::ptrdiff_t>(ax + ir));
        double k = in[1].v[ravel(ii, in[1].s)];
        if (k < 0) k += static_cast<double>(in[0].s[ax]);
        j.push_back(static_cast<std::size_t>(k));
        j.insert(j.end(), idx.begin() + static_cast<std::ptrdiff_t>(ax + ir), idx.end());
        y.v[i] = in[0].v[ravel(j, in[0].s)];
      }
    } else if (op == "Expand") {
      rt t{in[0].t, {}, {}};
      for (double d : in[1].v) t.s.push_back(static_cast<std::size_t>(d));
      t.v.assign(count(t.s), 0);
      in = {in[0], t};
      elementwise(in[0].t, [](auto a) { return a[0] + a[1]; });
    } else if (op == "Shape") {
      y.t = dtype::i64;
      for (auto d : in[0].s) y.v.push_back(static_cast<double>(d));
      y.s = {y.v.size()};
    } else if (op == "Constant") {
      if (n.has_attribute("value_ints")) {
        y.t = dtype::i64;
        for (auto v : n.get_ints("value_ints")) y.v.push_back(static_cast<double>(v));
        y.s = {y.v.size()};
      } else if (n.has_attribute("value_floats")) {
        y.t = dtype::f32;
        for (auto v : n.get_floats("value_floats")) y.v.push_back(static_cast<float>(v));
        y.s = {y.v.size()};
      } else if (n.has_attribute("value_int")) {
        y = rt{dtype::i64, {}, {static_cast<double>(n.get_int("value_int"))}};
      } else {
        y = rt{dtype::f32, {}, {static_cast<float>(n.get_float("value_float"))}};
      }
    } else if (op.rfind("Reduce", 0) == 0) {
      const std::size_t r = in[0].s.size();
      tg::ints axes = n.get_ints("axes", {});
      if (axes.empty() && present.size() > 1 && present[1]) axes = *g.constant_ints(n.inputs[1]);
      std::vector<bool> red(r, axes.empty() && n.get_int("noop_with_empty_axes", 0) == 0);
      for (auto a : axes) red[nax(a, r)] = true;
      const bool keep = n.get_int("keepdims", 1) != 0;
      std::vector<std::size_t> ks;  // keepdims shape
      for (std::size_t a = 0; a < r; ++a) ks.push_back(red[a] ? 1 : in[0].s[a]);
      std::vector<std::vector<double>> bins(count(ks));
      for (std::size_t i = 0; i < in[0].v.size(); ++i) {
        auto idx = unravel(i, in[0].s);
        for (std::size_t a = 0; a < r; ++a)
          if (red[a]) idx[a] = 0;
        bins[ravel(idx, ks)].push_back(in[0].v[i]);
      }
      y.t = in[0].t;
      for (std::size_t a = 0; a < r; ++a)
        if (!red[a] || keep) y.s.push_back(ks[a]);
      for (auto& b : bins) {
        double acc = op == "ReduceProd" ? 1 : 0;
        if (op == "ReduceMax") acc = -INFINITY;
        if (op == "ReduceMin") acc = INFINITY;
        for (double v : b) {
          if (op == "ReduceSum" || op == "ReduceMean")
            acc += v;
          else if (op == "ReduceProd")
            acc *= v;
          else if (op == "ReduceMax")
            acc = std::max(acc, v);
          else
            acc = std::min(acc, v);
        }
        if (op == "ReduceMean") acc /= double(b.size());
        y.v.push_back(acc);
      }
    } else if (op == "Softmax" || op == "LogSoftmax") {
      const std::size_t ax = nax(n.get_int("axis", -1), in[0].s.size());
      y = in[0];
      for (std::size_t i = 0; i < y.v.size(); ++i) {
        auto idx = unravel(i, y.s);
        double m = -INFINITY, sum = 0;
        for (std::size_t k = 0; k < y.s[ax]; ++k) {
          idx[ax] = k;
          m = std::max(m, in[0].v[ravel(idx, y.s)]);
        }
        for (std::size_t k = 0; k < y.s[ax]; ++k) {
          idx[ax] = k;
          sum += std::exp(in[0].v[ravel(idx, y.s)] - m);
        }
        y.v[i] = op == "Softmax" ? std::exp(in[0].v[i] - m) / sum : in[0].v[i] - m - std::log(sum);
      }
    } else if (op == "MatMul" || op == "FusedMatMul") {
      y = matmul_ref(in[0], in[1]);
      if (op == "FusedMatMul") {
        const double alpha = n.get_float("alpha", 1.0);
        const std::string act = n.get_string("activation", "");
        for (std::size_t i = 0; i < y.v.size(); ++i) {
          const auto idx = unravel(i, y.s);
          double v = alpha * y.v[i];
          if (present.size() > 2 && present[2]) v += bat(in[2], idx);
          if (present.size() > 3 && present[3]) v += bat(in[3], idx);
          y.v[i] = act_ref(act, v);
        }
      }
    } else if (op == "Gemm") {
      auto tr = [](const rt& x) {
        rt t{x.t, {x.s[1], x.s[0]}, std::vector<double>(x.v.size())};
        for (std::size_t i = 0; i < x.s[0]; ++i)
          for (std::size_t j = 0; j < x.s[1]; ++j) t.v[j * x.s[0] + i] = x.v[i * x.s[1] + j];
        return t;
      };
      const rt a = n.get_int("transA", 0) ? tr(in[0]) : in[0], b = n.get_int("transB", 0) ? tr(in[1]) : in[1];
      y = matmul_ref(a, b);
      const double alpha = n.get_float("alpha", 1.0), beta = n.get_float("beta", 1.0);
      for (std::size_t i = 0; i < y.v.size(); ++i)
        y.v[i] = alpha * y.v[i] + (present.size() > 2 && present[2] ? beta * bat(in[2], unravel(i, y.s)) : 0.0);
    } else if (op == "LayerNormalization") {
      const bool stats = out.size() > 1;
      rt mean, rstd;
      y = norm_ref(in[0], &in[1], present.size() > 2 && present[2] ? &in[2] : nullptr, n.get_int("axis", -1), n.get_float("epsilon", 1e-5), false,
                   stats ? &mean : nullptr, stats ? &rstd : nullptr);
      if (out.size() > 1) out[1] = mean;
      if (out.size() > 2) out[2] = rstd;
    } else if (op == "RMSNormalization") {
      y = norm_ref(in[0], &in[1], nullptr, n.get_int("axis", -1), n.get_float("epsilon", 1e-5), true);
    } else if (op == "SkipLayerNormalization" || op == "SkipRMSNormalization") {
      rt sum = in[0];
      for (std::size_t i = 0; i < sum.v.size(); ++i) sum.v[i] += bat(in[1], unravel(i, sum.s));
      const bool rms = op == "SkipRMSNormalization";
      y = norm_ref(sum, &in[2], !rms && present.size() > 3 && present[3] ? &in[3] : nullptr, n.get_int("axis", -1), n.get_float("epsilon", 1e-5),
                   rms);
      if (out.size() > 1) out[1] = sum;
    } else if (op == "RotaryEmbedding") {  // written from the contract: pairs along the last axis
      const rt& x = in[0];
      const std::size_t d = x.s.back();
      const bool inter = n.get_int("interleaved", 0) != 0;
      y = rt{x.t, x.s, std::vector<double>(x.v.size())};
      for (std::size_t i = 0; i < x.v.size(); ++i) {
        const std::size_t j = i % d, row = i - j;
        const std::size_t partner = inter ? (j ^ 1u) : (j + d / 2) % d;
        const bool first = inter ? j % 2 == 0 : j < d / 2;
        const double rot = (first ? -1.0 : 1.0) * x.v[row + partner];
        const auto idx = unravel(i, x.s);
        y.v[i] = x.v[i] * bat(in[1], idx) + rot * bat(in[2], idx);
      }
    } else if (op == "Attention") {
      const rt &q = in[0], &k = in[1], &v = in[2];
      const std::size_t B = q.s[0], Hq = q.s[1], Sq = q.s[2], D = q.s[3], Hkv = k.s[1], Sk = k.s[2], Dv = v.s[3];
      const double scale = n.get_float("scale", 1 / std::sqrt(double(D)));
      const bool causal = n.get_int("causal", 0) != 0;
      y = rt{q.t, {B, Hq, Sq, Dv}, std::vector<double>(B * Hq * Sq * Dv)};
      for (std::size_t b = 0; b < B; ++b)
        for (std::size_t h = 0; h < Hq; ++h) {
          const std::size_t hk = h / (Hq / Hkv);
          for (std::size_t i = 0; i < Sq; ++i) {
            std::vector<double> sc(Sk);
            double m = -INFINITY;
            for (std::size_t j = 0; j < Sk; ++j) {
              double d = 0;
              for (std::size_t e = 0; e < D; ++e) d += q.v[((b * Hq + h) * Sq + i) * D + e] * k.v[((b * Hkv + hk) * Sk + j) * D + e];
              d *= scale;
              if (present.size() > 3 && present[3]) d += bat(in[3], {b, h, i, j});
              if (causal && j + Sq > i + Sk) d = -INFINITY;
              sc[j] = d;
              m = std::max(m, d);
            }
            double sum = 0;
            for (double& s : sc) sum += (s = std::exp(s - m));
            for (std::size_t e = 0; e < Dv; ++e) {
              double acc = 0;
              for (std::size_t j = 0; j < Sk; ++j) acc += sc[j] / sum * v.v[((b * Hkv + hk) * Sk + j) * Dv + e];
              y.v[((b * Hq + h) * Sq + i) * Dv + e] = acc;
            }
          }
        }
    } else if (op == "Conv" || op == "FusedConv") {
      const rt &x = in[0], &w = in[1];
      std::vector<std::size_t> ys;
      for (const auto& d : g.get(n.outputs[0]).shape.dims) ys.push_back(d.known() ? static_cast<std::size_t>(d.size) : x.s[0]);
      const win wn = window_ref(n, x.s, ys, std::vector<std::int64_t>(w.s.begin() + 2, w.s.end()));
      const auto group = static_cast<std::size_t>(n.get_int("group", 1));
      const bool two = wn.ns == 2;
      const std::size_t H = two ? x.s[2] : 1, W = x.s.back(), OH = two ? ys[2] : 1, OW = ys.back(), KH = two ? w.s[2] : 1, KW = w.s.back();
      const std::size_t M = w.s[0], CG = w.s[1], MG = M / group;
      y = rt{x.t, ys, std::vector<double>(count(ys))};
      for (std::size_t b = 0; b < x.s[0]; ++b)
        for (std::size_t m = 0; m < M; ++m)
          for (std::size_t oy = 0; oy < OH; ++oy)
            for (std::size_t ox = 0; ox < OW; ++ox) {
              double acc = present.size() > 2 && present[2] ? in[2].v[m] : 0;
              for (std::size_t c = 0; c < CG; ++c)
                for (std::size_t i = 0; i < KH; ++i)
                  for (std::size_t j = 0; j < KW; ++j) {
                    const std::int64_t iy = two ? static_cast<std::int64_t>(oy) * wn.st[0] + static_cast<std::int64_t>(i) * wn.dl[0] - wn.pads[0] : 0;
                    const std::size_t a = two ? 1 : 0;
                    const std::int64_t ix = static_cast<std::int64_t>(ox) * wn.st[a] + static_cast<std::int64_t>(j) * wn.dl[a] - wn.pads[a];
                    if (iy < 0 || ix < 0 || iy >= static_cast<std::int64_t>(H) || ix >= static_cast<std::int64_t>(W)) continue;
                    const std::size_t ci = (m / MG) * CG + c;
                    acc += x.v[((b * x.s[1] + ci) * H + static_cast<std::size_t>(iy)) * W + static_cast<std::size_t>(ix)] *
                           w.v[((m * CG + c) * KH + i) * KW + j];
                  }
              const std::size_t at = ((b * M + m) * OH + oy) * OW + ox;
              if (op == "FusedConv") {
                if (present.size() > 3 && present[3]) acc += in[3].v[at];
                acc = act_ref(n.get_string("activation", ""), acc);
              }
              y.v[at] = acc;
            }
    } else if (op == "MaxPool" || op == "AveragePool") {
      const rt& x = in[0];
      std::vector<std::size_t> ys;
      for (const auto& d : g.get(n.outputs[0]).shape.dims) ys.push_back(d.known() ? static_cast<std::size_t>(d.size) : x.s[0]);
      const win wn = window_ref(n, x.s, ys, n.get_ints("kernel_shape"));
      const bool two = wn.ns == 2, incl = n.get_int("count_include_pad", 0) != 0;
      const std::size_t H = two ? x.s[2] : 1, W = x.s.back(), OH = two ? ys[2] : 1, OW = ys.back();
      const std::size_t KH = two ? static_cast<std::size_t>(wn.k[0]) : 1, KW = static_cast<std::size_t>(wn.k.back());
      const std::size_t a = two ? 1 : 0;
      const std::int64_t ph0 = two ? wn.pads[0] : 0, ph1 = two ? wn.pads[2] : 0, pw0 = wn.pads[a], pw1 = wn.pads[wn.ns + a];
      y = rt{x.t, ys, std::vector<double>(count(ys))};
      for (std::size_t p = 0; p < x.s[0] * x.s[1]; ++p)
        for (std::size_t oy = 0; oy < OH; ++oy)
          for (std::size_t ox = 0; ox < OW; ++ox) {
            double acc = op == "MaxPool" ? -INFINITY : 0;
            std::size_t cnt = 0;
            for (std::size_t i = 0; i < KH; ++i)
              for (std::size_t j = 0; j < KW; ++j) {
                const std::int64_t iy = two ? static_cast<std::int64_t>(oy) * wn.st[0] + static_cast<std::int64_t>(i) * wn.dl[0] - ph0 : 0;
                const std::int64_t ix = static_cast<std::int64_t>(ox) * wn.st[a] + static_cast<std::int64_t>(j) * wn.dl[a] - pw0;
                const bool inside = iy >= 0 && ix >= 0 && iy < static_cast<std::int64_t>(H) && ix < static_cast<std::int64_t>(W);
                const bool in_pads = iy < static_cast<std::int64_t>(H) + ph1 && ix < static_cast<std::int64_t>(W) + pw1;
                if (inside) {
                  const double v = x.v[(p * H + static_cast<std::size_t>(iy)) * W + static_cast<std::size_t>(ix)];
                  acc = op == "MaxPool" ? std::max(acc, v) : acc + v;
                  ++cnt;
                } else if (incl && in_pads) {
                  ++cnt;
                }
              }
            y.v[(p * OH + oy) * OW + ox] = op == "MaxPool" ? acc : acc / double(cnt);
          }
    } else if (op == "GlobalAveragePool" || op == "GlobalMaxPool") {
      const rt& x = in[0];
      std::size_t hw = 1;
      for (std::size_t a = 2; a < x.s.size(); ++a) hw *= x.s[a];
      y.t = x.t;
      y.s = x.s;
      for (std::size_t a = 2; a < y.s.size(); ++a) y.s[a] = 1;
      for (std::size_t p = 0; p < x.s[0] * x.s[1]; ++p) {
        double acc = op == "GlobalMaxPool" ? -INFINITY : 0;
        for (std::size_t i = 0; i < hw; ++i) acc = op == "GlobalMaxPool" ? std::max(acc, x.v[p * hw + i]) : acc + x.v[p * hw + i];
        y.v.push_back(op == "GlobalMaxPool" ? acc : acc / double(hw));
      }
    } else if (op == "BatchNormalization") {
      const rt& x = in[0];
      const double eps = n.get_float("epsilon", 1e-5);
      std::size_t hw = 1;
      for (std::size_t a = 2; a < x.s.size(); ++a) hw *= x.s[a];
      y = x;
      for (std::size_t i = 0; i < y.v.size(); ++i) {
        const std::size_t c = i / hw % x.s[1];
        y.v[i] = (x.v[i] - in[3].v[c]) / std::sqrt(in[4].v[c] + eps) * in[1].v[c] + in[2].v[c];
      }
    } else {
      throw std::runtime_error("reference: no op " + op);
    }
    for (std::size_t o = 0; o < out.size(); ++o) {
      if (n.outputs[o] == tg::value_id::none) continue;
      round_to(out[o]);
      env[g.get(n.outputs[o]).name] = out[o];
    }
  }
  return env;
}

// ---- random data ----------------------------------------------------------------------------------------

inline std::vector<float> randu(std::size_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

inline rt to_rt(const std::vector<std::size_t>& s, const std::vector<float>& v) {
  rt r{dtype::f32, s, {}};
  for (float x : v) r.v.push_back(x);
  return r;
}

inline tg::host_tensor to_host(const rt& r) {
  tg::host_tensor h;
  h.type = r.t;
  for (auto d : r.s) h.shape.push_back(static_cast<std::int64_t>(d));
  const std::size_t es = tessel::dtype_size(r.t);
  h.data.resize(r.v.size() * es);
  for (std::size_t i = 0; i < r.v.size(); ++i) {
    switch (r.t) {
      case dtype::f32: {
        const float x = static_cast<float>(r.v[i]);
        std::memcpy(h.data.data() + 4 * i, &x, 4);
        break;
      }
      case dtype::i64: {
        const auto x = static_cast<std::int64_t>(r.v[i]);
        std::memcpy(h.data.data() + 8 * i, &x, 8);
        break;
      }
      case dtype::i32: {
        const auto x = static_cast<std::int32_t>(r.v[i]);
        std::memcpy(h.data.data() + 4 * i, &x, 4);
        break;
      }
      case dtype::u8: h.data[i] = static_cast<std::byte>(r.v[i] != 0); break;
      default: throw std::runtime_error("to_host: dtype");
    }
  }
  return h;
}

}  // namespace tessel_test_graph
