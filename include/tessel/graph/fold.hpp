// The cleanup passes every other pass relies on: constant folding (a small exact evaluator for shape
// arithmetic on integers and elementwise maths on small float constants, so that an exporter's
// Shape -> Gather -> Unsqueeze -> Concat -> Reshape chain becomes one constant shape), common
// subexpression elimination (identical constants and identical nodes become one) and dead-code removal.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <tessel/detail/checked.hpp>
#include <tessel/graph/errors.hpp>
#include <tessel/graph/ir.hpp>
#include <tessel/graph/shape_inference.hpp>

namespace tessel {
inline namespace v0 {
namespace graph {

struct fold_options {
  // A folded constant larger than this stays a node (ConstantOfShape and Expand can make large ones).
  std::size_t max_constant_bytes = std::size_t(1) << 24;
  // Sizes for symbolic dims ("batch" -> 2): Shape of such a value folds, specializing the graph to them.
  std::map<std::string, std::int64_t, std::less<>> bindings;
};

namespace detail {

// A constant on the host, exact: integer dtypes (and bool, u8) as int64, f32 and f64 as double (an f32
// result is rounded to float when stored, so float arithmetic folds to the float result).
struct folded_tensor {
  dtype type = dtype::f32;
  std::vector<std::int64_t> dims;
  std::vector<double> f;
  std::vector<std::int64_t> i;

  bool floating() const { return type == dtype::f32 || type == dtype::f64; }
  std::size_t numel() const { return floating() ? f.size() : i.size(); }
  double get(std::size_t k) const { return floating() ? f[k] : static_cast<double>(i[k]); }
};

inline bool foldable_dtype(dtype t) {
  switch (t) {
    case dtype::f32:
    case dtype::f64:
    case dtype::i64:
    case dtype::i32:
    case dtype::i16:
    case dtype::i8:
    case dtype::u32:
    case dtype::u16:
    case dtype::u8: return true;
    default: return false;
  }
}

// Thrown inside the evaluator: the node stays (an op or a case the evaluator does not take, a result
// over the size cap, an integer result that would overflow).
struct not_foldable {};

inline std::size_t numel_of(const std::vector<std::int64_t>& dims) {
  std::size_t n = 1;
  for (std::int64_t d : dims) {
    if (d < 0) throw not_foldable{};
    n = tessel::detail::mul_checked(n, static_cast<std::size_t>(d), "graph: folded constant");
  }
  return n;
}

template <class T>
inline void read_elems(const std::vector<std::byte>& b, std::size_t n, folded_tensor& t) {
  for (std::size_t k = 0; k < n; ++k) {
    T x;
    std::memcpy(&x, b.data() + k * sizeof(T), sizeof(T));
    if constexpr (std::is_floating_point_v<T>)
      t.f[k] = static_cast<double>(x);
    else
      t.i[k] = static_cast<std::int64_t>(x);
  }
}

// The constant's values, or nullopt for a dtype the evaluator does not take.
inline std::optional<folded_tensor> read_constant(const value& x) {
  if (x.role != value_role::constant || !x.data || !x.type || !foldable_dtype(*x.type) || !x.shape.fully_known()) return std::nullopt;
  folded_tensor t;
  t.type = *x.type;
  for (const dim& d : x.shape.dims) t.dims.push_back(d.size);
  const std::size_t n = *x.shape.numel();
  if (x.data->size() != n * dtype_size(t.type)) return std::nullopt;
  (t.floating() ? t.f.resize(n) : t.i.resize(n));
  switch (t.type) {
    case dtype::f32: read_elems<float>(*x.data, n, t); break;
    case dtype::f64: read_elems<double>(*x.data, n, t); break;
    case dtype::i64: read_elems<std::int64_t>(*x.data, n, t); break;
    case dtype::i32: read_elems<std::int32_t>(*x.data, n, t); break;
    case dtype::i16: read_elems<std::int16_t>(*x.data, n, t); break;
    case dtype::i8: read_elems<std::int8_t>(*x.data, n, t); break;
    case dtype::u32: read_elems<std::uint32_t>(*x.data, n, t); break;
    case dtype::u16: read_elems<std::uint16_t>(*x.data, n, t); break;
    default: read_elems<std::uint8_t>(*x.data, n, t); break;
  }
  return t;
}

template <class T>
inline void write_elems(const folded_tensor& t, std::vector<std::byte>& b) {
  for (std::size_t k = 0; k < t.numel(); ++k) {
    T x;
    if constexpr (std::is_floating_point_v<T>)
      x = static_cast<T>(t.f[k]);
    else
      x = static_cast<T>(t.i[k]);
    std::memcpy(b.data() + k * sizeof(T), &x, sizeof(T));
  }
}

inline std::shared_ptr<const std::vector<std::byte>> to_bytes(const folded_tensor& t) {
  auto b = std::make_shared<std::vector<std::byte>>(tessel::detail::mul_checked(t.numel(), dtype_size(t.type), "graph: folded bytes"));
  switch (t.type) {
    case dtype::f32: write_elems<float>(t, *b); break;
    case dtype::f64: write_elems<double>(t, *b); break;
    case dtype::i64: write_elems<std::int64_t>(t, *b); break;
    case dtype::i32: write_elems<std::int32_t>(t, *b); break;
    case dtype::i16: write_elems<std::int16_t>(t, *b); break;
    case dtype::i8: write_elems<std::int8_t>(t, *b); break;
    case dtype::u32: write_elems<std::uint32_t>(t, *b); break;
    case dtype::u16: write_elems<std::uint16_t>(t, *b); break;
    default: write_elems<std::uint8_t>(t, *b); break;
  }
  return b;
}

// Whether integer x fits dtype t (the evaluator does not wrap).
inline bool fits(dtype t, std::int64_t x) {
  auto in = [x](auto lo, auto hi) { return x >= static_cast<std::int64_t>(lo) && x <= static_cast<std::int64_t>(hi); };
  switch (t) {
    case dtype::i32: return in(std::numeric_limits<std::int32_t>::min(), std::numeric_limits<std::int32_t>::max());
    case dtype::i16: return in(std::numeric_limits<std::int16_t>::min(), std::numeric_limits<std::int16_t>::max());
    case dtype::i8: return in(std::numeric_limits<std::int8_t>::min(), std::numeric_limits<std::int8_t>::max());
    case dtype::u32: return in(0, std::numeric_limits<std::uint32_t>::max());
    case dtype::u16: return in(0, std::numeric_limits<std::uint16_t>::max());
    case dtype::u8: return in(0, 255);
    default: return true;
  }
}

// The evaluator's state for one node: its inputs, the cap, and typed failures that name the node.
struct evaluator {
  const node& n;
  const std::vector<std::optional<folded_tensor>>& in;
  std::size_t max_bytes;

  [[noreturn]] void fail(const std::string& msg, errc code = errc::invalid_argument) const { throw graph_error(code, n.label() + ": " + msg); }
  const folded_tensor& arg(std::size_t k) const {
    if (k >= in.size() || !in[k]) throw not_foldable{};
    return *in[k];
  }
  bool has(std::size_t k) const { return k < in.size() && in[k].has_value(); }

  // An empty result of `t` and `dims`, within the cap.
  folded_tensor make(dtype t, std::vector<std::int64_t> dims) const {
    folded_tensor r;
    r.type = t;
    r.dims = std::move(dims);
    const std::size_t n_el = numel_of(r.dims);
    if (tessel::detail::mul_checked(n_el, dtype_size(t), "graph: folded bytes") > max_bytes) throw not_foldable{};
    (r.floating() ? r.f.resize(n_el) : r.i.resize(n_el));
    return r;
  }
  // Rounds an f32 result to float; checks integer results fit their dtype.
  void finish(folded_tensor& r) const {
    if (r.type == dtype::f32)
      for (double& x : r.f) x = static_cast<double>(static_cast<float>(x));
    if (!r.floating())
      for (std::int64_t x : r.i)
        if (!fits(r.type, x)) throw not_foldable{};
  }

  std::vector<std::int64_t> ints_of(const folded_tensor& t) const {
    if (t.floating()) fail("expected an integer tensor");
    return t.i;
  }
  std::size_t axis(std::int64_t a, std::size_t rank) const {
    const auto r = static_cast<std::int64_t>(rank);
    if (a < -r || a >= r) fail(std::string("axis ") + std::to_string(a) + " is out of range for rank " + std::to_string(rank), errc::out_of_range);
    return static_cast<std::size_t>(a < 0 ? a + r : a);
  }
  std::vector<std::int64_t> axes_of(std::size_t slot) const {
    if (n.has_attribute("axes")) return n.get_ints("axes");
    if (has(slot)) return ints_of(arg(slot));
    if (slot < n.inputs.size() && n.inputs[slot] != value_id::none) throw not_foldable{};
    return {};
  }

  static std::vector<std::size_t> strides(const std::vector<std::int64_t>& dims) {
    std::vector<std::size_t> s(dims.size(), 1);
    for (std::size_t k = dims.size(); k-- > 1;) s[k - 1] = s[k] * static_cast<std::size_t>(dims[k]);
    return s;
  }

  std::vector<std::int64_t> broadcast_dims(const std::vector<std::vector<std::int64_t>>& all) const {
    std::size_t r = 0;
    for (const auto& d : all) r = std::max(r, d.size());
    std::vector<std::int64_t> o(r, 1);
    for (const auto& d : all)
      for (std::size_t k = 0; k < d.size(); ++k) {
        std::int64_t& od = o[r - d.size() + k];
        if (d[k] == od || d[k] == 1) continue;
        if (od != 1) fail("shapes do not broadcast");
        od = d[k];
      }
    return o;
  }
  // For each element of `out`, the flat index of the element of `from` it reads under broadcasting.
  static std::vector<std::size_t> broadcast_map(const std::vector<std::int64_t>& out, const std::vector<std::int64_t>& from) {
    const std::size_t r = out.size();
    std::vector<std::size_t> fs(r, 0);
    const auto src = strides(from);
    for (std::size_t k = 0; k < from.size(); ++k)
      if (from[k] != 1) fs[r - from.size() + k] = src[k];
    const std::size_t total = numel_of(out);
    std::vector<std::size_t> m(total);
    std::vector<std::int64_t> idx(r, 0);
    std::size_t off = 0;
    for (std::size_t e = 0; e < total; ++e) {
      m[e] = off;
      for (std::size_t k = r; k-- > 0;) {
        if (++idx[k] < out[k]) {
          off += fs[k];
          break;
        }
        off -= fs[k] * static_cast<std::size_t>(out[k] - 1);
        idx[k] = 0;
      }
    }
    return m;
  }

  // Elementwise over broadcast inputs; `fn(values...)` per element, doubles in, a double out.
  template <class F>
  folded_tensor map_binary(dtype out_t, const folded_tensor& a, const folded_tensor& b, F fn) const {
    folded_tensor r = make(out_t, broadcast_dims({a.dims, b.dims}));
    const auto ma = broadcast_map(r.dims, a.dims), mb = broadcast_map(r.dims, b.dims);
    for (std::size_t e = 0; e < ma.size(); ++e) {
      if (r.floating())
        r.f[e] = fn(a, ma[e], b, mb[e]);
      else
        r.i[e] = static_cast<std::int64_t>(fn(a, ma[e], b, mb[e]));
    }
    return r;
  }

  folded_tensor arith() const {
    const folded_tensor& a = arg(0);
    const folded_tensor& b = arg(1);
    if (a.type != b.type) fail("input dtypes differ");
    const std::string& op = n.op;
    if (a.floating()) {
      folded_tensor r = map_binary(a.type, a, b, [&](const folded_tensor& x, std::size_t i, const folded_tensor& y, std::size_t j) {
        const double p = x.f[i], q = y.f[j];
        return op == "Add" ? p + q : op == "Sub" ? p - q : op == "Mul" ? p * q : p / q;
      });
      finish(r);
      return r;
    }
    folded_tensor r = make(a.type, broadcast_dims({a.dims, b.dims}));
    const auto ma = broadcast_map(r.dims, a.dims), mb = broadcast_map(r.dims, b.dims);
    for (std::size_t e = 0; e < ma.size(); ++e) {
      const std::int64_t p = a.i[ma[e]], q = b.i[mb[e]];
      std::int64_t v = 0;
      bool overflow = false;
      if (op == "Add")
        overflow = __builtin_add_overflow(p, q, &v);
      else if (op == "Sub")
        overflow = __builtin_sub_overflow(p, q, &v);
      else if (op == "Mul")
        overflow = __builtin_mul_overflow(p, q, &v);
      else {
        if (q == 0 || (q == -1 && p == std::numeric_limits<std::int64_t>::min())) throw not_foldable{};
        v = p / q;  // ONNX's integer Div truncates
      }
      if (overflow) throw not_foldable{};
      r.i[e] = v;
    }
    finish(r);
    return r;
  }

  folded_tensor compare() const {
    const folded_tensor& a = arg(0);
    const folded_tensor& b = arg(1);
    if (a.type != b.type) fail("input dtypes differ");
    const std::string& op = n.op;
    return map_binary(bool_dtype, a, b, [&](const folded_tensor& x, std::size_t i, const folded_tensor& y, std::size_t j) {
      // Integers compare exactly (not through double).
      const bool lt = x.floating() ? x.f[i] < y.f[j] : x.i[i] < y.i[j];
      const bool gt = x.floating() ? x.f[i] > y.f[j] : x.i[i] > y.i[j];
      const bool eq = x.floating() ? x.f[i] == y.f[j] : x.i[i] == y.i[j];
      return op == "Equal" ? (eq ? 1.0 : 0.0) : op == "Less" ? (lt ? 1.0 : 0.0) : (gt ? 1.0 : 0.0);
    });
  }

  folded_tensor unary() const {
    const folded_tensor& a = arg(0);
    const std::string& op = n.op;
    folded_tensor r = make(a.type, a.dims);
    if (!a.floating()) {
      for (std::size_t e = 0; e < a.i.size(); ++e) {
        const std::int64_t x = a.i[e];
        if (x == std::numeric_limits<std::int64_t>::min() && op != "Relu") throw not_foldable{};
        if (op == "Neg")
          r.i[e] = -x;
        else if (op == "Abs")
          r.i[e] = x < 0 ? -x : x;
        else if (op == "Relu")
          r.i[e] = std::max<std::int64_t>(x, 0);
        else if (op == "Identity")
          r.i[e] = x;
        else
          throw not_foldable{};
      }
      finish(r);
      return r;
    }
    for (std::size_t e = 0; e < a.f.size(); ++e) {
      const double x = a.f[e];
      double y = 0;
      if (op == "Neg")
        y = -x;
      else if (op == "Abs")
        y = std::fabs(x);
      else if (op == "Relu")
        y = x > 0 ? x : 0.0;
      else if (op == "Identity")
        y = x;
      else if (op == "Sqrt")
        y = std::sqrt(x);
      else if (op == "Reciprocal")
        y = 1.0 / x;
      else if (op == "Exp")
        y = std::exp(x);
      else if (op == "Log")
        y = std::log(x);
      else if (op == "Erf")
        y = std::erf(x);
      else if (op == "Tanh")
        y = std::tanh(x);
      else if (op == "Sigmoid")
        y = 1.0 / (1.0 + std::exp(-x));
      else if (op == "Floor")
        y = std::floor(x);
      else if (op == "Ceil")
        y = std::ceil(x);
      else if (op == "Sin")
        y = std::sin(x);
      else if (op == "Cos")
        y = std::cos(x);
      else
        throw not_foldable{};
      r.f[e] = y;
    }
    finish(r);
    return r;
  }

  folded_tensor pow() const {
    const folded_tensor& a = arg(0);
    const folded_tensor& b = arg(1);
    if (!a.floating()) throw not_foldable{};
    folded_tensor r = map_binary(
        a.type, a, b, [](const folded_tensor& x, std::size_t i, const folded_tensor& y, std::size_t j) { return std::pow(x.f[i], y.get(j)); });
    finish(r);
    return r;
  }

  dtype cast_target() const {
    const auto it = n.attributes.find("to");
    if (it == n.attributes.end()) fail("attribute 'to' is required");
    if (std::holds_alternative<std::string>(it->second)) {
      for (dtype d : all_dtypes)
        if (dtype_name(d) == std::get<std::string>(it->second)) return d;
      fail(std::string("attribute 'to' names no dtype: '") + std::get<std::string>(it->second) + "'");
    }
    const auto d = dtype_from_onnx(n.get_int("to"));
    if (!d) throw not_foldable{};
    return *d;
  }

  folded_tensor cast() const {
    const folded_tensor& a = arg(0);
    const dtype to = cast_target();
    if (!foldable_dtype(to)) throw not_foldable{};
    const auto it = n.attributes.find("to");
    const bool to_bool = it != n.attributes.end() && std::holds_alternative<std::int64_t>(it->second) && std::get<std::int64_t>(it->second) == 9;
    folded_tensor r = make(to, a.dims);
    for (std::size_t e = 0; e < a.numel(); ++e) {
      if (r.floating()) {
        r.f[e] = a.get(e);
      } else if (to_bool) {
        r.i[e] = a.get(e) != 0.0 ? 1 : 0;
      } else if (a.floating()) {
        const double x = std::trunc(a.f[e]);
        if (!(x >= -9.2e18 && x <= 9.2e18)) throw not_foldable{};  // NaN and out of range: implementation-defined in ONNX
        r.i[e] = static_cast<std::int64_t>(x);
      } else {
        r.i[e] = a.i[e];
      }
    }
    finish(r);
    return r;
  }

  folded_tensor where() const {
    const folded_tensor& c = arg(0);
    const folded_tensor& x = arg(1);
    const folded_tensor& y = arg(2);
    if (c.floating() || x.type != y.type) fail("condition must be bool and the branches of one dtype");
    folded_tensor r = make(x.type, broadcast_dims({c.dims, x.dims, y.dims}));
    const auto mc = broadcast_map(r.dims, c.dims), mx = broadcast_map(r.dims, x.dims), my = broadcast_map(r.dims, y.dims);
    for (std::size_t e = 0; e < mc.size(); ++e) {
      const bool pick = c.i[mc[e]] != 0;
      if (r.floating())
        r.f[e] = pick ? x.f[mx[e]] : y.f[my[e]];
      else
        r.i[e] = pick ? x.i[mx[e]] : y.i[my[e]];
    }
    return r;
  }

  // Copies elements by a list of source indices.
  folded_tensor gather_flat(const folded_tensor& a, std::vector<std::int64_t> dims, const std::vector<std::size_t>& src) const {
    folded_tensor r = make(a.type, std::move(dims));
    for (std::size_t e = 0; e < src.size(); ++e) {
      if (r.floating())
        r.f[e] = a.f[src[e]];
      else
        r.i[e] = a.i[src[e]];
    }
    return r;
  }

  folded_tensor gather() const {
    const folded_tensor& a = arg(0);
    const auto idx = ints_of(arg(1));
    if (a.dims.empty()) fail("Gather needs rank >= 1");
    const std::size_t ax = axis(n.get_int("axis", 0), a.dims.size());
    const std::int64_t d = a.dims[ax];
    std::size_t outer = 1, inner = 1;
    for (std::size_t k = 0; k < ax; ++k) outer *= static_cast<std::size_t>(a.dims[k]);
    for (std::size_t k = ax + 1; k < a.dims.size(); ++k) inner *= static_cast<std::size_t>(a.dims[k]);
    std::vector<std::int64_t> dims(a.dims.begin(), a.dims.begin() + static_cast<std::ptrdiff_t>(ax));
    dims.insert(dims.end(), arg(1).dims.begin(), arg(1).dims.end());
    dims.insert(dims.end(), a.dims.begin() + static_cast<std::ptrdiff_t>(ax) + 1, a.dims.end());
    std::vector<std::size_t> src;
    for (std::size_t o = 0; o < outer; ++o)
      for (std::int64_t j : idx) {
        if (j < -d || j >= d)
          fail(std::string("index ") + std::to_string(j) + " is out of range for axis size " + std::to_string(d), errc::out_of_range);
        const auto jj = static_cast<std::size_t>(j < 0 ? j + d : j);
        for (std::size_t k = 0; k < inner; ++k) src.push_back((o * static_cast<std::size_t>(d) + jj) * inner + k);
      }
    return gather_flat(a, std::move(dims), src);
  }

  folded_tensor concat() const {
    const folded_tensor& a0 = arg(0);
    if (a0.dims.empty()) fail("Concat needs rank >= 1");
    const std::size_t ax = axis(n.get_int("axis"), a0.dims.size());
    std::vector<std::int64_t> dims = a0.dims;
    dims[ax] = 0;
    for (std::size_t k = 0; k < n.inputs.size(); ++k) {
      const folded_tensor& a = arg(k);
      if (a.type != a0.type || a.dims.size() != dims.size()) fail("inputs differ in dtype or rank");
      for (std::size_t j = 0; j < dims.size(); ++j)
        if (j != ax && a.dims[j] != a0.dims[j]) fail("inputs differ off the concat axis");
      dims[ax] += a.dims[ax];
    }
    folded_tensor r = make(a0.type, dims);
    std::size_t outer = 1;
    for (std::size_t k = 0; k < ax; ++k) outer *= static_cast<std::size_t>(dims[k]);
    std::size_t at = 0;
    for (std::size_t o = 0; o < outer; ++o)
      for (std::size_t k = 0; k < n.inputs.size(); ++k) {
        const folded_tensor& a = arg(k);
        const std::size_t chunk = a.numel() / std::max<std::size_t>(outer, 1);
        for (std::size_t e = 0; e < chunk; ++e, ++at) {
          if (r.floating())
            r.f[at] = a.f[o * chunk + e];
          else
            r.i[at] = a.i[o * chunk + e];
        }
      }
    return r;
  }

  folded_tensor with_dims(const folded_tensor& a, std::vector<std::int64_t> dims) const {
    if (numel_of(dims) != a.numel()) fail("element counts differ");
    folded_tensor r = a;
    r.dims = std::move(dims);
    return r;
  }

  folded_tensor unsqueeze() const {
    const folded_tensor& a = arg(0);
    const auto ax = axes_of(1);
    const std::size_t r = a.dims.size() + ax.size();
    std::vector<char> at(r, 0);
    for (std::int64_t x : ax) {
      const std::size_t k = axis(x, r);
      if (at[k]) fail("repeated axis");
      at[k] = 1;
    }
    std::vector<std::int64_t> dims;
    std::size_t next = 0;
    for (std::size_t k = 0; k < r; ++k) dims.push_back(at[k] ? 1 : a.dims[next++]);
    return with_dims(a, dims);
  }

  folded_tensor squeeze() const {
    const folded_tensor& a = arg(0);
    const auto ax = axes_of(1);
    std::vector<char> drop(a.dims.size(), 0);
    if (ax.empty())
      for (std::size_t k = 0; k < a.dims.size(); ++k) drop[k] = a.dims[k] == 1;
    for (std::int64_t x : ax) {
      const std::size_t k = axis(x, a.dims.size());
      if (a.dims[k] != 1) fail(std::string("cannot squeeze axis ") + std::to_string(k) + " of size " + std::to_string(a.dims[k]));
      drop[k] = 1;
    }
    std::vector<std::int64_t> dims;
    for (std::size_t k = 0; k < a.dims.size(); ++k)
      if (!drop[k]) dims.push_back(a.dims[k]);
    return with_dims(a, dims);
  }

  folded_tensor reshape() const {
    const folded_tensor& a = arg(0);
    std::vector<std::int64_t> t = ints_of(arg(1));
    const bool allow_zero = n.get_int("allowzero", 0) != 0;
    std::optional<std::size_t> infer;
    std::size_t known = 1;
    for (std::size_t k = 0; k < t.size(); ++k) {
      if (t[k] == 0 && !allow_zero) {
        if (k >= a.dims.size()) fail("0 copies a dim the input does not have");
        t[k] = a.dims[k];
      }
      if (t[k] == -1) {
        if (infer) fail("more than one -1");
        infer = k;
        continue;
      }
      if (t[k] < 0) fail("negative size");
      known = tessel::detail::mul_checked(known, static_cast<std::size_t>(t[k]), "graph: reshape");
    }
    if (infer) {
      if (known == 0 || a.numel() % known != 0) fail("-1 cannot be inferred");
      t[*infer] = static_cast<std::int64_t>(a.numel() / known);
    }
    return with_dims(a, t);
  }

  folded_tensor expand() const {
    const folded_tensor& a = arg(0);
    const auto shape = ints_of(arg(1));
    folded_tensor r = make(a.type, broadcast_dims({a.dims, shape}));
    return gather_flat(a, r.dims, broadcast_map(r.dims, a.dims));
  }

  folded_tensor transpose() const {
    const folded_tensor& a = arg(0);
    const std::size_t r = a.dims.size();
    ints perm(r);
    for (std::size_t k = 0; k < r; ++k) perm[k] = static_cast<std::int64_t>(r - 1 - k);
    perm = n.get_ints("perm", perm);
    if (perm.size() != r) fail("perm has the wrong length");
    std::vector<char> seen(r, 0);
    for (std::int64_t p : perm) {
      if (p < 0 || p >= static_cast<std::int64_t>(r) || seen[static_cast<std::size_t>(p)]) fail("perm is not a permutation");
      seen[static_cast<std::size_t>(p)] = 1;
    }
    std::vector<std::int64_t> dims(r);
    for (std::size_t k = 0; k < r; ++k) dims[k] = a.dims[static_cast<std::size_t>(perm[k])];
    const auto in_strides = strides(a.dims);
    std::vector<std::int64_t> from_strides(r);
    for (std::size_t k = 0; k < r; ++k) from_strides[k] = static_cast<std::int64_t>(in_strides[static_cast<std::size_t>(perm[k])]);
    // broadcast_map with the permuted strides: walk the output, step the source.
    const std::size_t total = numel_of(dims);
    std::vector<std::size_t> src(total);
    std::vector<std::int64_t> idx(r, 0);
    std::size_t off = 0;
    for (std::size_t e = 0; e < total; ++e) {
      src[e] = off;
      for (std::size_t k = r; k-- > 0;) {
        if (++idx[k] < dims[k]) {
          off += static_cast<std::size_t>(from_strides[k]);
          break;
        }
        off -= static_cast<std::size_t>(from_strides[k]) * static_cast<std::size_t>(dims[k] - 1);
        idx[k] = 0;
      }
    }
    return gather_flat(a, dims, src);
  }

  folded_tensor slice() const {
    const folded_tensor& a = arg(0);
    const std::size_t r = a.dims.size();
    std::vector<std::int64_t> starts, ends, axes, steps;
    if (n.inputs.size() > 1) {
      starts = ints_of(arg(1));
      ends = ints_of(arg(2));
      if (n.inputs.size() > 3 && n.inputs[3] != value_id::none) axes = ints_of(arg(3));
      if (n.inputs.size() > 4 && n.inputs[4] != value_id::none) steps = ints_of(arg(4));
    } else {
      starts = n.get_ints("starts");
      ends = n.get_ints("ends");
      axes = n.get_ints("axes", {});
    }
    if (axes.empty())
      for (std::size_t k = 0; k < starts.size(); ++k) axes.push_back(static_cast<std::int64_t>(k));
    if (steps.empty()) steps.assign(starts.size(), 1);
    if (ends.size() != starts.size() || axes.size() != starts.size() || steps.size() != starts.size())
      fail("starts, ends, axes and steps differ in length");
    std::vector<std::int64_t> first(r, 0), step(r, 1), dims = a.dims;
    for (std::size_t k = 0; k < axes.size(); ++k) {
      const std::size_t ax = axis(axes[k], r);
      const std::int64_t d = a.dims[ax], sp = steps[k];
      if (sp == 0) fail("step 0");
      std::int64_t st = starts[k];
      if (st < 0) st += d;
      st = sp > 0 ? std::clamp<std::int64_t>(st, 0, d) : std::clamp<std::int64_t>(st, 0, d - 1);
      first[ax] = st;
      step[ax] = sp;
      dims[ax] = slice_len(d, starts[k], ends[k], sp);
    }
    const auto s = strides(a.dims);
    const std::size_t total = numel_of(dims);
    std::vector<std::size_t> src(total);
    std::vector<std::int64_t> idx(r, 0);
    for (std::size_t e = 0; e < total; ++e) {
      std::size_t off = 0;
      for (std::size_t k = 0; k < r; ++k) off += static_cast<std::size_t>(first[k] + idx[k] * step[k]) * s[k];
      src[e] = off;
      for (std::size_t k = r; k-- > 0;) {
        if (++idx[k] < dims[k]) break;
        idx[k] = 0;
      }
    }
    return gather_flat(a, dims, src);
  }

  folded_tensor range() const {
    const folded_tensor& s = arg(0);
    const folded_tensor& l = arg(1);
    const folded_tensor& d = arg(2);
    if (s.numel() != 1 || l.numel() != 1 || d.numel() != 1 || s.type != l.type || s.type != d.type)
      fail("start, limit and delta must be scalars of one dtype");
    if (s.floating()) {
      if (d.f[0] == 0) fail("delta 0");
      const double count = std::max(std::ceil((l.f[0] - s.f[0]) / d.f[0]), 0.0);
      if (!(count < 1e12)) throw not_foldable{};
      folded_tensor r = make(s.type, {static_cast<std::int64_t>(count)});
      for (std::size_t k = 0; k < r.f.size(); ++k) r.f[k] = s.f[0] + static_cast<double>(k) * d.f[0];
      finish(r);
      return r;
    }
    const std::int64_t st = s.i[0], li = l.i[0], de = d.i[0];
    if (de == 0) fail("delta 0");
    const long double span = static_cast<long double>(li) - static_cast<long double>(st);
    const long double q = span / static_cast<long double>(de);
    const std::int64_t count = q <= 0 ? 0 : static_cast<std::int64_t>(std::ceil(q));
    folded_tensor r = make(s.type, {count});
    for (std::int64_t k = 0; k < count; ++k) r.i[static_cast<std::size_t>(k)] = st + k * de;
    finish(r);
    return r;
  }

  folded_tensor constant_of_shape() const {
    const auto shape = ints_of(arg(0));
    dtype t = dtype::f32;
    double fv = 0;
    std::int64_t iv = 0;
    if (auto it = n.attributes.find("value"); it != n.attributes.end()) {
      if (const auto* p = std::get_if<double>(&it->second))
        fv = *p;
      else if (const auto* q = std::get_if<std::int64_t>(&it->second))
        t = dtype::i64, iv = *q;
      else
        throw not_foldable{};
    }
    folded_tensor r = make(t, shape);
    std::fill(r.f.begin(), r.f.end(), fv);
    std::fill(r.i.begin(), r.i.end(), iv);
    finish(r);
    return r;
  }

  folded_tensor constant_node() const {
    if (n.attributes.size() != 1) throw not_foldable{};
    const auto& [key, a] = *n.attributes.begin();
    folded_tensor r;
    if (key == "value_int")
      r.type = dtype::i64, r.i = {std::get<std::int64_t>(a)};
    else if (key == "value_ints")
      r.type = dtype::i64, r.i = std::get<ints>(a), r.dims = {static_cast<std::int64_t>(r.i.size())};
    else if (key == "value_float")
      r.type = dtype::f32, r.f = {std::get<double>(a)};
    else if (key == "value_floats")
      r.type = dtype::f32, r.f = std::get<floats>(a), r.dims = {static_cast<std::int64_t>(r.f.size())};
    else
      throw not_foldable{};
    finish(r);
    return r;
  }

  folded_tensor run() const {
    const std::string& op = n.op;
    if (n.outputs.size() != 1) throw not_foldable{};
    try {
      if (op == "Constant") return constant_node();
      if (op == "Add" || op == "Sub" || op == "Mul" || op == "Div") return arith();
      if (op == "Equal" || op == "Less" || op == "Greater") return compare();
      if (op == "Pow") return pow();
      if (op == "Cast") return cast();
      if (op == "Where") return where();
      if (op == "Gather") return gather();
      if (op == "Concat") return concat();
      if (op == "Unsqueeze") return unsqueeze();
      if (op == "Squeeze") return squeeze();
      if (op == "Reshape") return reshape();
      if (op == "Expand") return expand();
      if (op == "Transpose") return transpose();
      if (op == "Slice") return slice();
      if (op == "Range") return range();
      if (op == "ConstantOfShape") return constant_of_shape();
      return unary();
    } catch (const std::bad_variant_access&) { throw not_foldable{}; } catch (const overflow_error& e) {
      fail(e.what(), errc::overflow);
    }
  }
};

inline std::string fresh_value_name(const graph& g, const std::string& base) {
  if (!g.find_value(base)) return base;
  for (std::size_t k = 1;; ++k) {
    std::string s = base + "_" + std::to_string(k);
    if (!g.find_value(s)) return s;
  }
}

inline std::string fresh_node_name(const graph& g, const std::string& base) {
  if (!g.find_node(base)) return base;
  for (std::size_t k = 1;; ++k) {
    std::string s = base + "_" + std::to_string(k);
    if (!g.find_node(s)) return s;
  }
}

// An attribute as an exact key: doubles to 17 digits (the printer's %g would make 1e-5 and
// 1.000001e-5 equal), strings with their length.
inline std::string attribute_key(const attribute& a) {
  auto num = [](double x) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", x);
    return std::string(buf);
  };
  auto str = [](const std::string& x) { return std::to_string(x.size()) + ":" + x; };
  std::string s = std::to_string(a.index()) + "|";
  switch (a.index()) {
    case 0: return s + std::to_string(std::get<0>(a));
    case 1: return s + num(std::get<1>(a));
    case 2: return s + str(std::get<2>(a));
    case 3:
      for (std::int64_t x : std::get<3>(a)) s += std::to_string(x) + ",";
      return s;
    case 4:
      for (double x : std::get<4>(a)) s += num(x) + ",";
      return s;
    default:
      for (const std::string& x : std::get<5>(a)) s += str(x) + ",";
      return s;
  }
}

inline bool onnx_op(const node& n) { return n.domain.empty() || n.domain == "ai.onnx"; }

// A dim's size, from the shape or from a binding of its symbol; -1 when neither knows it.
inline std::int64_t bound_size(const dim& d, const fold_options& opt) {
  if (d.known()) return d.size;
  if (auto it = opt.bindings.find(d.symbol); !d.symbol.empty() && it != opt.bindings.end()) return it->second;
  return -1;
}

// Shape(x) {start, end} as constant dims, when every selected dim is known (or bound).
inline std::optional<folded_tensor> fold_shape(const graph& g, const node& n, const fold_options& opt) {
  if (n.inputs.size() != 1 || n.inputs[0] == value_id::none) return std::nullopt;
  const tensor_shape& s = g.get(n.inputs[0]).shape;
  if (!s.rank_known) return std::nullopt;
  const auto r = static_cast<std::int64_t>(s.rank());
  auto clampi = [r](std::int64_t x) { return std::clamp<std::int64_t>(x < 0 ? x + r : x, 0, r); };
  const std::int64_t b = clampi(n.get_int("start", 0)), e = clampi(n.get_int("end", r));
  folded_tensor t;
  t.type = dtype::i64;
  for (std::int64_t k = b; k < e; ++k) {
    const std::int64_t d = bound_size(s.dims[static_cast<std::size_t>(k)], opt);
    if (d < 0) return std::nullopt;
    t.i.push_back(d);
  }
  t.dims = {static_cast<std::int64_t>(t.i.size())};
  return t;
}

// Gather(Shape(x), constant indices) when the gathered dims are known even though others are not
// (the exporter reads the sequence length of a [batch, seq, d] input this way).
inline std::optional<folded_tensor> fold_gather_of_shape(const graph& g, const node& n, const fold_options& opt) {
  if (n.inputs.size() != 2 || n.inputs[0] == value_id::none || n.inputs[1] == value_id::none) return std::nullopt;
  const value& data = g.get(n.inputs[0]);
  if (data.role != value_role::node_output) return std::nullopt;
  const node& sh = g.get(data.producer);
  if (sh.op != "Shape" || !onnx_op(sh) || sh.inputs.size() != 1 || sh.has_attribute("start") || sh.has_attribute("end")) return std::nullopt;
  const tensor_shape& s = g.get(sh.inputs[0]).shape;
  const auto idx = read_constant(g.get(n.inputs[1]));
  if (!s.rank_known || !idx || idx->floating() || n.get_int("axis", 0) != 0) return std::nullopt;
  folded_tensor t;
  t.type = dtype::i64;
  t.dims = idx->dims;
  const auto r = static_cast<std::int64_t>(s.rank());
  for (std::int64_t j : idx->i) {
    if (j < -r || j >= r) return std::nullopt;  // shape inference reports it
    const std::int64_t d = bound_size(s.dims[static_cast<std::size_t>(j < 0 ? j + r : j)], opt);
    if (d < 0) return std::nullopt;
    t.i.push_back(d);
  }
  return t;
}

// Reshape(x, Concat(..., Unsqueeze(Gather(Shape(x), k)) at position k, ..., constants)): each dim read
// from x's own shape at its own position is a 0 ("copy this dim", allowzero 0), so the shape becomes a
// constant even when those dims are symbolic. Returns the constant's values, or nullopt.
inline std::optional<ints> reshape_copy_dims(const graph& g, const node& rs) {
  if (rs.op != "Reshape" || !onnx_op(rs) || rs.inputs.size() != 2 || rs.get_int("allowzero", 0) != 0) return std::nullopt;
  const value& sv = g.get(rs.inputs[1]);
  if (sv.role != value_role::node_output) return std::nullopt;
  const node& cat = g.get(sv.producer);
  if (cat.op != "Concat" || !onnx_op(cat) || cat.get_int("axis", 0) != 0) return std::nullopt;
  auto producer = [&](value_id v, std::string_view op) -> const node* {
    if (v == value_id::none) return nullptr;
    const value& x = g.get(v);
    if (x.role != value_role::node_output) return nullptr;
    const node& p = g.get(x.producer);
    return p.op == op && onnx_op(p) ? &p : nullptr;
  };
  ints shape;
  for (value_id piece : cat.inputs) {
    if (piece == value_id::none) return std::nullopt;
    if (auto c = read_constant(g.get(piece)); c && !c->floating() && c->dims.size() == 1) {
      shape.insert(shape.end(), c->i.begin(), c->i.end());
      continue;
    }
    // Unsqueeze(Gather(Shape(x), scalar k), [0]) or Gather(Shape(x), [k]).
    const node* ga = producer(piece, "Gather");
    std::size_t want_rank = 1;
    if (const node* un = producer(piece, "Unsqueeze")) {
      std::optional<ints> ax = un->has_attribute("axes") ? std::optional<ints>(un->get_ints("axes"))
                               : un->inputs.size() > 1   ? g.constant_ints(un->inputs[1])
                                                         : std::nullopt;
      if (!ax || *ax != ints{0}) return std::nullopt;
      ga = producer(un->inputs[0], "Gather");
      want_rank = 0;
    }
    if (!ga || ga->inputs.size() != 2 || ga->get_int("axis", 0) != 0) return std::nullopt;
    const node* sh = producer(ga->inputs[0], "Shape");
    const auto idx = read_constant(g.get(ga->inputs[1]));
    if (!sh || sh->inputs.size() != 1 || sh->inputs[0] != rs.inputs[0] || sh->has_attribute("start") || sh->has_attribute("end")) return std::nullopt;
    if (!idx || idx->floating() || idx->dims.size() != want_rank || idx->i.size() != 1) return std::nullopt;
    const tensor_shape& xs = g.get(rs.inputs[0]).shape;
    if (!xs.rank_known) return std::nullopt;
    const auto r = static_cast<std::int64_t>(xs.rank());
    std::int64_t k = idx->i[0];
    if (k < -r || k >= r) return std::nullopt;
    if (k < 0) k += r;
    if (k != static_cast<std::int64_t>(shape.size())) return std::nullopt;  // a dim moved elsewhere: not a copy
    shape.push_back(0);
  }
  return shape;
}

// Replaces value `old` by a new constant holding `t`, which then takes `old`'s name.
inline value_id install_constant(graph& g, value_id old, const folded_tensor& t) {
  const std::string name = g.get(old).name;
  const value_id c = g.add_constant(fresh_value_name(g, name + "_folded"), t.type, t.dims, to_bytes(t));
  g.replace_all_uses(old, c);
  return c;
}

}  // namespace detail

// Evaluates every ONNX node whose inputs are all constants (and Shape of a value whose dims are known
// or bound, and Gather of such a Shape), replacing its output by a constant that keeps the output's
// name; then gives a Reshape whose computed shape only copies its input's dims in place a constant
// shape with 0s (so a symbolic batch no longer blocks it). Returns how many nodes were folded plus
// reshapes simplified; the nodes and constants left unread stay until remove_dead_code.
namespace detail {
inline std::size_t fold_sweep(graph& g, const fold_options& opt) {
  std::size_t folded = 0;
  for (node_id id : g.topological_order()) {
    if (!g.contains(id)) continue;
    const node& n = g.get(id);
    if (!detail::onnx_op(n) || n.outputs.size() != 1 || n.outputs[0] == value_id::none) continue;
    std::optional<detail::folded_tensor> result;
    if (n.op == "Shape") {
      result = detail::fold_shape(g, n, opt);
    } else {
      std::vector<std::optional<detail::folded_tensor>> in;
      bool all = true;
      for (value_id v : n.inputs) {
        if (v == value_id::none) {
          in.emplace_back();
          continue;
        }
        in.push_back(detail::read_constant(g.get(v)));
        all = all && in.back().has_value();
      }
      if (all && (!n.inputs.empty() || n.op == "Constant")) {
        try {
          result = detail::evaluator{n, in, opt.max_constant_bytes}.run();
        } catch (const detail::not_foldable&) { result.reset(); }
      } else if (n.op == "Gather") {
        result = detail::fold_gather_of_shape(g, n, opt);
      }
    }
    if (!result) continue;
    if (tessel::detail::mul_checked(result->numel(), dtype_size(result->type), "graph: folded bytes") > opt.max_constant_bytes) continue;
    const value_id out = n.outputs[0];
    const std::string name = g.get(out).name;
    const value_id c = detail::install_constant(g, out, *result);
    g.remove_node(id);
    g.rename_value(c, name);
    ++folded;
  }
  // Reshapes whose computed shape only copies the input's own dims take a constant shape with 0s.
  for (node_id id : g.node_ids()) {
    const node& n = g.get(id);
    if (n.op != "Reshape" || n.inputs.size() != 2 || n.inputs[1] == value_id::none || g.get(n.inputs[1]).role == value_role::constant) continue;
    const auto shape = detail::reshape_copy_dims(g, n);
    if (!shape) continue;
    const std::string base = g.get(n.inputs[1]).name + "_const";
    const value_id c = g.add_constant_ints(detail::fresh_value_name(g, base), *shape);
    g.set_input(id, 1, c);
    ++folded;
  }
  return folded;
}
}  // namespace detail

// One sweep folds what the shapes known at its start allow; a fold makes shapes further down known
// (a constant Reshape shape gives its output dims, which the next Shape reads), so sweeps repeat,
// with shapes inferred (ops without a rule left unknown) before each, until one folds nothing.
inline std::size_t fold_constants(graph& g, const fold_options& opt = {}) {
  std::size_t total = 0;
  for (;;) {
    g.infer_shapes({.allow_unknown_ops = true});
    const std::size_t n = detail::fold_sweep(g, opt);
    total += n;
    if (n == 0) return total;
  }
}

// Common subexpression elimination: small constants (up to `max_constant_bytes`: the exporter's
// repeated scalars, axes and shape pieces) with the same dtype, dims and bytes become one, then nodes
// with the same op, domain, attributes and inputs (after that merge) become one. Weights are not
// compared by content: two equal weights are rare, and hashing every weight costs a pass over the
// model. Returns how many constants and nodes went. A graph output is never merged away (it keeps its
// name).
inline std::size_t eliminate_common_subexpressions(graph& g, std::size_t max_constant_bytes = 64) {
  std::size_t merged = 0;
  std::map<std::string, value_id> seen_const;
  for (value_id c : std::vector<value_id>(g.constants())) {
    if (!g.contains(c)) continue;
    const value& x = g.get(c);
    if (x.is_output || !x.data || x.data->size() > max_constant_bytes) continue;
    std::string key = std::string(dtype_name(*x.type)) + x.shape.to_string();
    key.append(reinterpret_cast<const char*>(x.data->data()), x.data->size());
    auto [it, fresh] = seen_const.emplace(std::move(key), c);
    if (fresh) continue;
    g.replace_all_uses(c, it->second);
    ++merged;
  }
  g.remove_unused_constants();

  std::map<std::string, node_id> seen_node;
  for (node_id id : g.topological_order()) {
    const node& n = g.get(id);
    if (n.outputs.empty() || n.op.rfind("Random", 0) == 0 || n.op == "Multinomial" || n.op == "Bernoulli") continue;
    std::string key = n.domain + "::" + n.op + "(";
    for (value_id v : n.inputs) key += v == value_id::none ? std::string("_,") : std::to_string(index_of(v)) + ",";
    key += ")->" + std::to_string(n.outputs.size()) + "{";
    for (const auto& [k, a] : n.attributes) key += k + "=" + detail::attribute_key(a) + ";";
    auto [it, fresh] = seen_node.emplace(std::move(key), id);
    if (fresh) continue;
    const node& first = g.get(it->second);
    bool ok = true;
    for (std::size_t k = 0; k < n.outputs.size(); ++k) {
      const bool a = n.outputs[k] != value_id::none, b = first.outputs[k] != value_id::none;
      if (a && (!b || g.get(n.outputs[k]).is_output)) ok = false;  // a graph output keeps its name
    }
    if (!ok) continue;
    const std::vector<value_id> outs = n.outputs, keep = first.outputs;
    for (std::size_t k = 0; k < outs.size(); ++k)
      if (outs[k] != value_id::none) g.replace_all_uses(outs[k], keep[k]);
    g.remove_node(id);
    ++merged;
  }
  return merged;
}

// Removes the nodes no graph output depends on and the constants nothing reads; returns how many nodes.
inline std::size_t remove_dead_code(graph& g) {
  const std::size_t n = g.remove_dead_nodes();
  g.remove_unused_constants();
  return n;
}

}  // namespace graph
}  // namespace v0
}  // namespace tessel
