// Shape and dtype rules for the ONNX operators tessel's reference models use, and graph::infer_shapes
// that runs them in topological order. Rules are checked: a contradiction is a graph_error naming the
// node ("MatMul 'fc1': inner dims 64 and 48 differ ([2,64] x [48,8])"). Unknown dims propagate;
// a symbolic dim ("batch") keeps its symbol through elementwise ops, broadcasting, MatMul, Reshape's
// 0 and -1, and the ops that copy dims. Semantics follow the ONNX operator specs (opset 13 to 20
// where they differ: axes as an attribute or as an input, Split's num_outputs, Shape's start/end).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <tessel/graph/ir.hpp>

namespace tessel {
inline namespace v0 {
namespace graph {
namespace detail {

// Thrown inside a rule when an input's rank (or a non-constant shape operand) leaves the outputs'
// shapes unknown; the dtypes the rule set before it stand.
struct shape_unknown {};

inline std::string ints_to_string(const ints& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += std::string(i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

// Checked dim arithmetic: sizes are int64 in the IR, the checks are the library's size_t ones.
inline std::int64_t to_dim(std::size_t x, const char* what) {
  if (x > static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()))
    throw overflow_error("size", std::string(what) + " overflows int64: " + std::to_string(x));
  return static_cast<std::int64_t>(x);
}
inline std::int64_t dim_mul(std::int64_t a, std::int64_t b, const char* what) {
  return to_dim(tessel::detail::mul_checked(static_cast<std::size_t>(a), static_cast<std::size_t>(b), what), what);
}
inline std::int64_t dim_add(std::int64_t a, std::int64_t b, const char* what) {
  return to_dim(tessel::detail::add_checked(static_cast<std::size_t>(a), static_cast<std::size_t>(b), what), what);
}

// The product of dims as one dim: known when all are; the symbol when exactly one symbolic dim meets
// known ones whose product is 1; 0 when any known dim is 0; otherwise unknown.
inline dim dim_product(const std::vector<dim>& dims, std::size_t begin, std::size_t end) {
  std::int64_t known = 1;
  std::size_t unknown = 0;
  const dim* sym = nullptr;
  bool zero = false;
  for (std::size_t i = begin; i < end; ++i) {
    if (dims[i].known()) {
      zero = zero || dims[i].size == 0;
      known = dim_mul(known, dims[i].size, "graph: dim product");
    } else {
      ++unknown;
      sym = &dims[i];
    }
  }
  if (zero) return dim(0);
  if (unknown == 0) return dim(known);
  if (unknown == 1 && known == 1) return *sym;
  return dim();
}

struct infer_ctx {
  const graph& g;
  const node& n;
  std::vector<tensor_type>& out;  // one per output slot, preset to unknown

  [[noreturn]] void fail(const std::string& msg, errc code = errc::invalid_argument) const { throw graph_error(code, n.label() + ": " + msg); }
  std::size_t inputs() const { return n.inputs.size(); }
  std::size_t outputs() const { return n.outputs.size(); }
  bool has(std::size_t i) const { return i < n.inputs.size() && n.inputs[i] != value_id::none; }
  bool has_output(std::size_t i) const { return i < n.outputs.size() && n.outputs[i] != value_id::none; }
  const value& in(std::size_t i) const {
    if (!has(i)) fail(std::string("input ") + std::to_string(i) + " is required");
    return g.get(n.inputs[i]);
  }
  std::string quoted(std::size_t i) const { return std::string("'") + in(i).name + "'"; }
  std::optional<dtype> type(std::size_t i) const { return in(i).type; }
  // Input i's shape; its rank must be known for the rule to go on.
  const tensor_shape& ranked(std::size_t i) const {
    const tensor_shape& s = in(i).shape;
    if (!s.rank_known) throw shape_unknown{};
    return s;
  }
  std::optional<ints> const_ints(std::size_t i) const { return has(i) ? g.constant_ints(n.inputs[i]) : std::nullopt; }

  void arity(std::size_t min_in, std::size_t max_in, std::size_t min_out, std::size_t max_out) const {
    if (n.inputs.size() < min_in || n.inputs.size() > max_in)
      fail(std::string("takes ") + range(min_in, max_in) + " inputs, not " + std::to_string(n.inputs.size()));
    if (n.outputs.size() < min_out || n.outputs.size() > max_out)
      fail(std::string("has ") + range(min_out, max_out) + " outputs, not " + std::to_string(n.outputs.size()));
  }
  static std::string range(std::size_t lo, std::size_t hi) {
    if (lo == hi) return std::to_string(lo);
    if (hi == static_cast<std::size_t>(-1)) return std::string("at least ") + std::to_string(lo);
    return std::to_string(lo) + " to " + std::to_string(hi);
  }

  // An axis in [-rank, rank) (or [-rank, rank] with `inclusive`), as an index.
  std::size_t axis(std::int64_t a, std::size_t rank, std::string_view what, bool inclusive = false) const {
    const auto r = static_cast<std::int64_t>(rank);
    const std::int64_t hi = inclusive ? r : r - 1;
    if (a < -r || a > hi) fail(std::string(what) + " " + std::to_string(a) + " is out of range for rank " + std::to_string(rank), errc::out_of_range);
    return static_cast<std::size_t>(a < 0 ? a + r : a);
  }
  // Normalized, distinct axes.
  std::vector<std::size_t> axes(const ints& a, std::size_t rank, std::string_view what) const {
    std::vector<std::size_t> r;
    for (std::int64_t x : a) {
      const std::size_t k = axis(x, rank, what);
      if (std::find(r.begin(), r.end(), k) != r.end()) fail(std::string(what) + " " + ints_to_string(a) + " repeat axis " + std::to_string(k));
      r.push_back(k);
    }
    return r;
  }

  // The common dtype of the given inputs (unknown ones skipped); differing known ones are an error.
  std::optional<dtype> same_type(std::initializer_list<std::size_t> idx) const { return same_type(std::vector<std::size_t>(idx)); }
  std::optional<dtype> same_type(const std::vector<std::size_t>& idx) const {
    std::optional<dtype> t;
    std::size_t from = 0;
    for (std::size_t i : idx) {
      if (!has(i)) continue;
      const auto u = type(i);
      if (!u) continue;
      if (t && *t != *u)
        fail(std::string("input dtypes differ: ") + std::string(dtype_name(*t)) + " (" + quoted(from) + ") and " + std::string(dtype_name(*u)) +
             " (" + quoted(i) + ")");
      if (!t) from = i;
      t = u;
    }
    return t;
  }
  void set_type(std::size_t slot, std::optional<dtype> t) {
    if (slot < out.size()) out[slot].type = t;
  }
  void set_shape(std::size_t slot, tensor_shape s) {
    if (slot < out.size()) out[slot].shape = std::move(s);
  }
  void set(std::size_t slot, std::optional<dtype> t, tensor_shape s) {
    set_type(slot, t);
    set_shape(slot, std::move(s));
  }
};

// ---- dim algebra --------------------------------------------------------------------------------------

// Numpy broadcasting of two dims: equal, or one of them 1. An unknown dim against a known one other
// than 1 becomes that one (it must be 1 or equal); equal symbols stay; anything else is unknown.
inline std::optional<dim> broadcast_dim(const dim& a, const dim& b) {
  if (a.known() && b.known()) {
    if (a.size == b.size || b.size == 1) return a;
    if (a.size == 1) return b;
    return std::nullopt;
  }
  if (a.known()) return a.size == 1 ? b : a;
  if (b.known()) return b.size == 1 ? a : b;
  return a.symbol == b.symbol ? a : dim();
}

inline tensor_shape broadcast(const infer_ctx& c, const tensor_shape& a, const tensor_shape& b, std::string_view what = "shapes") {
  const std::size_t r = std::max(a.rank(), b.rank());
  tensor_shape s;
  s.dims.resize(r);
  for (std::size_t k = 0; k < r; ++k) {
    const dim da = k < a.rank() ? a.dims[a.rank() - 1 - k] : dim(1);
    const dim db = k < b.rank() ? b.dims[b.rank() - 1 - k] : dim(1);
    auto d = broadcast_dim(da, db);
    if (!d)
      c.fail(std::string(what) + " " + a.to_string() + " and " + b.to_string() + " do not broadcast: dims " + std::to_string(da.size) + " and " +
             std::to_string(db.size) + " at axis -" + std::to_string(k + 1));
    s.dims[r - 1 - k] = *d;
  }
  return s;
}

// Two dims that must be equal: the more informative one, or nullopt when known sizes differ.
inline std::optional<dim> merge_dim(const dim& a, const dim& b) {
  if (a.known() && b.known()) return a.size == b.size ? std::optional<dim>(a) : std::nullopt;
  if (a.known()) return a;
  if (b.known()) return b;
  return a.symbol.empty() ? b : a;
}

// A spatial attribute list of `count` values (default `def` each), each at least `min`.
inline ints spatial_attr(const infer_ctx& c, std::string_view key, std::size_t count, std::int64_t def, std::int64_t min) {
  ints v = c.n.get_ints(key, ints(count, def));
  if (v.size() != count)
    c.fail(std::string("attribute '") + std::string(key) + "' " + ints_to_string(v) + " has " + std::to_string(v.size()) + " values, expected " +
           std::to_string(count));
  for (std::int64_t x : v)
    if (x < min) c.fail(std::string("attribute '") + std::string(key) + "' " + ints_to_string(v) + " has a value below " + std::to_string(min));
  return v;
}

// The output size of a sliding window (Conv and the pools) over one spatial axis.
inline dim window_dim(const infer_ctx& c, const dim& in, std::int64_t k, std::int64_t stride, std::int64_t dil, std::int64_t pad_begin,
                      std::int64_t pad_end, const std::string& auto_pad, bool ceil_mode, std::size_t axis) {
  if (auto_pad != "NOTSET" && auto_pad != "VALID" && auto_pad != "SAME_UPPER" && auto_pad != "SAME_LOWER")
    c.fail(std::string("auto_pad '") + auto_pad + "' is not NOTSET, VALID, SAME_UPPER or SAME_LOWER");
  if (!in.known()) return dim();
  if (auto_pad == "SAME_UPPER" || auto_pad == "SAME_LOWER") return dim(in.size == 0 ? 0 : (in.size - 1) / stride + 1);
  if (auto_pad == "VALID") pad_begin = pad_end = 0;
  const std::int64_t span = dim_add(dim_mul(dil, k - 1, "graph: window span"), 1, "graph: window span");
  const std::int64_t padded = dim_add(dim_add(in.size, pad_begin, "graph: padded size"), pad_end, "graph: padded size");
  if (padded < span)
    c.fail(std::string("spatial axis ") + std::to_string(axis) + ": the window spans " + std::to_string(span) + " but the padded input has " +
           std::to_string(padded));
  const std::int64_t q = padded - span;
  std::int64_t o = q / stride + (ceil_mode && q % stride != 0 ? 1 : 0) + 1;
  if (ceil_mode) {  // a window may not start in the end padding: (o - 1) * stride < in + pad_begin
    const std::int64_t x = dim_add(in.size, pad_begin, "graph: padded size");
    if (o - 1 >= x / stride + (x % stride != 0 ? 1 : 0)) --o;
  }
  return dim(o);
}

// ---- the rules ----------------------------------------------------------------------------------------

using rule_fn = void (*)(infer_ctx&);

inline void rule_unary(infer_ctx& c) {
  c.arity(1, 1, 1, 1);
  c.set_type(0, c.type(0));  // before ranked(): an unknown rank keeps the dtype
  c.set_shape(0, c.ranked(0));
}

inline void rule_gelu(infer_ctx& c) {
  const std::string a = c.n.get_string("approximate", "none");
  if (a != "none" && a != "tanh") c.fail(std::string("attribute 'approximate' is '") + a + "', expected 'none' or 'tanh'");
  rule_unary(c);
}

inline void rule_softmax(infer_ctx& c) {
  c.arity(1, 1, 1, 1);
  c.set_type(0, c.type(0));
  const tensor_shape& s = c.ranked(0);
  (void)c.axis(c.n.get_int("axis", -1), s.rank(), "axis");
  c.set_shape(0, s);
}

inline void rule_cast(infer_ctx& c) {
  c.arity(1, 1, 1, 1);
  const auto it = c.n.attributes.find("to");
  if (it == c.n.attributes.end()) c.fail("attribute 'to' is required");
  dtype to{};
  if (std::holds_alternative<std::string>(it->second)) {  // tessel's own spelling: "bf16"
    const std::string& s = std::get<std::string>(it->second);
    bool found = false;
    for (dtype d : all_dtypes)
      if (dtype_name(d) == s) {
        to = d;
        found = true;
      }
    if (!found) c.fail(std::string("attribute 'to' names no dtype: '") + s + "'");
  } else {
    const std::int64_t code = c.n.get_int("to");
    auto d = dtype_from_onnx(code);
    if (!d) c.fail(std::string("attribute 'to' is ONNX element type ") + std::to_string(code) + ", which tessel has no dtype for", errc::unsupported);
    to = *d;
  }
  c.set_type(0, to);
  c.set_shape(0, c.ranked(0));
}

inline void rule_dropout(infer_ctx& c) {
  c.arity(1, 3, 1, 2);
  c.set_type(0, c.type(0));
  c.set_type(1, bool_dtype);
  const tensor_shape& s = c.ranked(0);
  c.set_shape(0, s);
  c.set_shape(1, s);
}

inline std::vector<std::size_t> all_inputs(const infer_ctx& c) {
  std::vector<std::size_t> v(c.inputs());
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = i;
  return v;
}

inline tensor_shape broadcast_all(const infer_ctx& c, const std::vector<std::size_t>& idx) {
  tensor_shape s = c.ranked(idx.front());
  for (std::size_t k = 1; k < idx.size(); ++k) s = broadcast(c, s, c.ranked(idx[k]));
  return s;
}

inline void rule_binary(infer_ctx& c) {  // Add Sub Mul Div
  c.arity(2, 2, 1, 1);
  c.set_type(0, c.same_type({0, 1}));
  c.set_shape(0, broadcast_all(c, {0, 1}));
}

inline void rule_pow(infer_ctx& c) {  // the exponent may have another type
  c.arity(2, 2, 1, 1);
  c.set_type(0, c.type(0));
  c.set_shape(0, broadcast_all(c, {0, 1}));
}

inline void rule_compare(infer_ctx& c) {  // Equal Less Greater
  c.arity(2, 2, 1, 1);
  (void)c.same_type({0, 1});
  c.set_type(0, bool_dtype);
  c.set_shape(0, broadcast_all(c, {0, 1}));
}

inline void rule_variadic(infer_ctx& c) {  // Max Min Sum Mean
  c.arity(1, static_cast<std::size_t>(-1), 1, 1);
  const auto idx = all_inputs(c);
  c.set_type(0, c.same_type(idx));
  c.set_shape(0, broadcast_all(c, idx));
}

inline void rule_where(infer_ctx& c) {
  c.arity(3, 3, 1, 1);
  if (auto t = c.type(0); t && *t != bool_dtype)
    c.fail(std::string("condition ") + c.quoted(0) + " is " + std::string(dtype_name(*t)) + ", expected bool (" +
           std::string(dtype_name(bool_dtype)) + ")");
  c.set_type(0, c.same_type({1, 2}));
  c.set_shape(0, broadcast_all(c, {0, 1, 2}));
}

// MatMul's output shape from inputs 0 and 1 (FusedMatMul shares it).
inline void matmul_shape(infer_ctx& c) {
  const tensor_shape& a = c.ranked(0);
  const tensor_shape& b = c.ranked(1);
  for (std::size_t i : {0, 1})
    if (c.in(i).shape.rank() == 0) c.fail(std::string("input ") + c.quoted(i) + " is a scalar; MatMul needs rank >= 1");
  std::vector<dim> da = a.dims, db = b.dims;
  if (da.size() == 1) da.insert(da.begin(), dim(1));
  if (db.size() == 1) db.push_back(dim(1));
  const dim& ka = da.back();
  const dim& kb = db[db.size() - 2];
  if (!merge_dim(ka, kb))
    c.fail(std::string("inner dims ") + ka.to_string() + " and " + kb.to_string() + " differ (" + a.to_string() + " x " + b.to_string() + ")");
  const tensor_shape batch =
      broadcast(c, tensor_shape(std::vector<dim>(da.begin(), da.end() - 2)), tensor_shape(std::vector<dim>(db.begin(), db.end() - 2)), "batch dims");
  tensor_shape s = batch;
  if (a.rank() > 1) s.dims.push_back(da[da.size() - 2]);
  if (b.rank() > 1) s.dims.push_back(db.back());
  c.set_shape(0, s);
}

inline void rule_matmul(infer_ctx& c) {
  c.arity(2, 2, 1, 1);
  c.set_type(0, c.same_type({0, 1}));
  matmul_shape(c);
}

inline void rule_gemm(infer_ctx& c) {
  c.arity(2, 3, 1, 1);
  c.set_type(0, c.same_type({0, 1, 2}));
  (void)c.n.get_float("alpha", 1.0);
  (void)c.n.get_float("beta", 1.0);
  const tensor_shape& a = c.ranked(0);
  const tensor_shape& b = c.ranked(1);
  for (std::size_t i : {0, 1})
    if (c.in(i).shape.rank() != 2) c.fail(std::string("input ") + c.quoted(i) + " has shape " + c.in(i).shape.to_string() + "; Gemm needs rank 2");
  const bool ta = c.n.get_int("transA", 0) != 0, tb = c.n.get_int("transB", 0) != 0;
  const dim m = a.dims[ta ? 1 : 0], ka = a.dims[ta ? 0 : 1];
  const dim kb = b.dims[tb ? 1 : 0], n = b.dims[tb ? 0 : 1];
  if (!merge_dim(ka, kb))
    c.fail(std::string("inner dims ") + ka.to_string() + " and " + kb.to_string() + " differ (" + a.to_string() + std::string(ta ? "^T" : "") +
           " x " + b.to_string() + std::string(tb ? "^T" : "") + ")");
  const tensor_shape y{m, n};
  if (c.has(2)) {  // C broadcasts one way, to (M, N)
    const tensor_shape& cs = c.ranked(2);
    bool ok = cs.rank() <= 2;
    for (std::size_t k = 0; ok && k < cs.rank(); ++k) {
      const dim& cd = cs.dims[cs.rank() - 1 - k];
      const dim& yd = y.dims[1 - k];
      ok = !(cd.known() && cd.size != 1 && yd.known() && cd.size != yd.size);
    }
    if (!ok) c.fail(std::string("C ") + cs.to_string() + " does not broadcast to " + y.to_string());
  }
  c.set_shape(0, y);
}

inline void rule_transpose(infer_ctx& c) {
  c.arity(1, 1, 1, 1);
  c.set_type(0, c.type(0));
  const tensor_shape& s = c.ranked(0);
  const std::size_t r = s.rank();
  ints perm(r);
  for (std::size_t i = 0; i < r; ++i) perm[i] = static_cast<std::int64_t>(r - 1 - i);
  perm = c.n.get_ints("perm", perm);
  std::vector<char> seen(r, 0);
  bool ok = perm.size() == r;
  for (std::size_t i = 0; ok && i < r; ++i) {
    ok = perm[i] >= 0 && perm[i] < static_cast<std::int64_t>(r) && !seen[static_cast<std::size_t>(perm[i])];
    if (ok) seen[static_cast<std::size_t>(perm[i])] = 1;
  }
  if (!ok)
    c.fail(std::string("perm ") + ints_to_string(perm) + " is not a permutation of 0.." + std::to_string(r == 0 ? 0 : r - 1) + " (input " +
           s.to_string() + ")");
  tensor_shape o;
  for (std::int64_t p : perm) o.dims.push_back(s.dims[static_cast<std::size_t>(p)]);
  c.set_shape(0, o);
}

// Element counts as known product x multiset of symbols; `opaque` when an anonymous unknown dim is in.
struct elem_count {
  std::int64_t known = 1;
  std::vector<std::string> symbols;
  bool opaque = false;
  void add(const dim& d) {
    if (d.known())
      known = dim_mul(known, d.size, "graph: element count");
    else if (d.symbol.empty())
      opaque = true;
    else
      symbols.push_back(d.symbol);
  }
};

inline void rule_reshape(infer_ctx& c) {
  c.arity(2, 2, 1, 1);
  c.set_type(0, c.type(0));
  if (auto t = c.type(1); t && *t != dtype::i64)
    c.fail(std::string("shape ") + c.quoted(1) + " is " + std::string(dtype_name(*t)) + ", expected i64");
  const tensor_shape& in = c.ranked(0);
  const auto target = c.const_ints(1);
  if (!target) {  // a computed shape: the rank is its length, when known
    const tensor_shape& ss = c.ranked(1);
    if (ss.rank() != 1 || !ss.dims[0].known()) throw shape_unknown{};
    c.set_shape(0, tensor_shape(std::vector<dim>(static_cast<std::size_t>(ss.dims[0].size))));
    return;
  }
  const bool allow_zero = c.n.get_int("allowzero", 0) != 0;
  const std::string what = std::string("cannot reshape ") + in.to_string() + " to " + ints_to_string(*target);
  tensor_shape o;
  std::optional<std::size_t> infer_at;
  for (std::size_t i = 0; i < target->size(); ++i) {
    const std::int64_t s = (*target)[i];
    if (s == -1) {
      if (infer_at) c.fail(what + ": more than one -1");
      infer_at = i;
      o.dims.emplace_back();
    } else if (s == 0 && !allow_zero) {
      if (i >= in.rank()) c.fail(what + ": 0 at index " + std::to_string(i) + " copies a dim the input does not have");
      o.dims.push_back(in.dims[i]);
    } else if (s < 0) {
      c.fail(what + ": negative size " + std::to_string(s));
    } else {
      o.dims.emplace_back(s);
    }
  }
  if (allow_zero && infer_at && std::find(target->begin(), target->end(), 0) != target->end())
    c.fail(what + ": with allowzero, a 0 next to -1 leaves -1 undetermined");
  elem_count from, to;
  for (const dim& d : in.dims) from.add(d);
  for (std::size_t i = 0; i < o.rank(); ++i)
    if (i != infer_at) to.add(o.dims[i]);
  if (!from.opaque && !to.opaque) {
    for (auto it = to.symbols.begin(); it != to.symbols.end();) {  // symbols on both sides cancel
      auto f = std::find(from.symbols.begin(), from.symbols.end(), *it);
      if (f == from.symbols.end()) {
        ++it;
        continue;
      }
      from.symbols.erase(f);
      it = to.symbols.erase(it);
    }
    if (to.symbols.empty() && from.symbols.empty()) {
      if (infer_at) {
        if (to.known == 0) c.fail(what + ": -1 is ambiguous next to a 0-sized dim");
        if (from.known % to.known != 0)
          c.fail(what + ": " + std::to_string(from.known) + " elements do not divide into blocks of " + std::to_string(to.known));
        o.dims[*infer_at] = dim(from.known / to.known);
      } else if (from.known != to.known) {
        c.fail(what + ": " + std::to_string(from.known) + " elements vs " + std::to_string(to.known));
      }
    } else if (infer_at && to.symbols.empty() && from.symbols.size() == 1 && from.known == to.known) {
      o.dims[*infer_at] = dim(from.symbols.front());  // -1 is the one symbol left
    }
  }
  c.set_shape(0, o);
}

inline void rule_flatten(infer_ctx& c) {
  c.arity(1, 1, 1, 1);
  c.set_type(0, c.type(0));
  const tensor_shape& s = c.ranked(0);
  const std::size_t a = c.axis(c.n.get_int("axis", 1), s.rank(), "axis", true);
  c.set_shape(0, tensor_shape{dim_product(s.dims, 0, a), dim_product(s.dims, a, s.rank())});
}

// Axes from the attribute (older opsets) or from input `slot` (opset 13+); nullopt when the input
// is there but not a constant. `present` says whether any was given.
inline std::optional<ints> axes_operand(const infer_ctx& c, std::size_t slot, bool& present) {
  present = true;
  if (c.n.has_attribute("axes")) return c.n.get_ints("axes");
  if (c.has(slot)) {
    if (auto t = c.type(slot); t && *t != dtype::i64)
      c.fail(std::string("axes ") + c.quoted(slot) + " is " + std::string(dtype_name(*t)) + ", expected i64");
    return c.const_ints(slot);
  }
  present = false;
  return ints{};
}

inline void rule_squeeze(infer_ctx& c) {
  c.arity(1, 2, 1, 1);
  c.set_type(0, c.type(0));
  const tensor_shape& s = c.ranked(0);
  bool present = false;
  const auto a = axes_operand(c, 1, present);
  if (!a) throw shape_unknown{};
  tensor_shape o;
  if (!present) {  // every dim of size 1: needs every dim known
    if (!s.fully_known()) throw shape_unknown{};
    for (const dim& d : s.dims)
      if (d.size != 1) o.dims.push_back(d);
  } else {
    const auto ax = c.axes(*a, s.rank(), "axes");
    for (std::size_t k : ax)
      if (s.dims[k].known() && s.dims[k].size != 1)
        c.fail(std::string("cannot squeeze axis ") + std::to_string(k) + " of size " + std::to_string(s.dims[k].size) + " (input " + s.to_string() +
               ")");
    for (std::size_t i = 0; i < s.rank(); ++i)
      if (std::find(ax.begin(), ax.end(), i) == ax.end()) o.dims.push_back(s.dims[i]);
  }
  c.set_shape(0, o);
}

inline void rule_unsqueeze(infer_ctx& c) {
  c.arity(1, 2, 1, 1);
  c.set_type(0, c.type(0));
  const tensor_shape& s = c.ranked(0);
  bool present = false;
  const auto a = axes_operand(c, 1, present);
  if (!present) c.fail("axes are required (an attribute, or input 1 from opset 13)");
  if (!a) throw shape_unknown{};
  const std::size_t r = s.rank() + a->size();
  const auto ax = c.axes(*a, r, "axes");
  tensor_shape o;
  std::size_t next = 0;
  for (std::size_t i = 0; i < r; ++i) o.dims.push_back(std::find(ax.begin(), ax.end(), i) != ax.end() ? dim(1) : s.dims[next++]);
  c.set_shape(0, o);
}

inline void rule_concat(infer_ctx& c) {
  c.arity(1, static_cast<std::size_t>(-1), 1, 1);
  const auto idx = all_inputs(c);
  c.set_type(0, c.same_type(idx));
  const std::int64_t axis_attr = c.n.get_int("axis");
  tensor_shape o = c.ranked(0);
  const std::size_t ax = c.axis(axis_attr, o.rank(), "axis");
  for (std::size_t i = 1; i < idx.size(); ++i) {
    const tensor_shape& s = c.ranked(i);
    if (s.rank() != o.rank())
      c.fail(std::string("input ") + c.quoted(i) + " has rank " + std::to_string(s.rank()) + ", input " + c.quoted(0) + " rank " +
             std::to_string(o.rank()));
    for (std::size_t k = 0; k < o.rank(); ++k) {
      if (k == ax) {
        o.dims[k] = o.dims[k].known() && s.dims[k].known() ? dim(dim_add(o.dims[k].size, s.dims[k].size, "graph: concat dim")) : dim();
        continue;
      }
      auto m = merge_dim(o.dims[k], s.dims[k]);
      if (!m)
        c.fail(std::string("dim ") + std::to_string(k) + " differs: " + o.dims[k].to_string() + " before input " + c.quoted(i) + ", " +
               s.dims[k].to_string() + " in it");
      o.dims[k] = *m;
    }
  }
  c.set_shape(0, o);
}

inline void rule_split(infer_ctx& c) {
  c.arity(1, 2, 1, static_cast<std::size_t>(-1));
  const std::size_t n = c.outputs();
  for (std::size_t k = 0; k < n; ++k) c.set_type(k, c.type(0));
  const tensor_shape& s = c.ranked(0);
  const std::size_t ax = c.axis(c.n.get_int("axis", 0), s.rank(), "axis");
  const dim d = s.dims[ax];
  std::vector<dim> sizes(n);
  std::optional<ints> split;
  if (c.n.has_attribute("split"))
    split = c.n.get_ints("split");
  else if (c.has(1))
    split = c.const_ints(1);
  if (split) {
    if (split->size() != n)
      c.fail(std::string("split ") + ints_to_string(*split) + " has " + std::to_string(split->size()) + " sizes for " + std::to_string(n) +
             " outputs");
    std::int64_t sum = 0;
    for (std::size_t k = 0; k < n; ++k) {
      if ((*split)[k] < 0) c.fail(std::string("split ") + ints_to_string(*split) + " has a negative size");
      sum = dim_add(sum, (*split)[k], "graph: split sizes");
      sizes[k] = dim((*split)[k]);
    }
    if (d.known() && sum != d.size)
      c.fail(std::string("split ") + ints_to_string(*split) + " sums to " + std::to_string(sum) + ", but axis " + std::to_string(ax) + " has " +
             std::to_string(d.size));
  } else if (!c.has(1) && d.known()) {
    const std::int64_t parts = static_cast<std::int64_t>(n);
    if (c.n.has_attribute("num_outputs")) {  // opset 18: the last part may be smaller
      if (c.n.get_int("num_outputs") != parts)
        c.fail(std::string("num_outputs ") + std::to_string(c.n.get_int("num_outputs")) + " but " + std::to_string(n) + " outputs");
      const std::int64_t chunk = (d.size + parts - 1) / parts;
      if (chunk * (parts - 1) > d.size)
        c.fail(std::string("axis ") + std::to_string(ax) + " of size " + std::to_string(d.size) + " cannot give " + std::to_string(n) +
               " non-empty parts");
      for (std::size_t k = 0; k < n; ++k) sizes[k] = dim(k + 1 < n ? chunk : d.size - chunk * (parts - 1));
    } else {
      if (d.size % parts != 0)
        c.fail(std::string("axis ") + std::to_string(ax) + " of size " + std::to_string(d.size) + " does not split evenly into " + std::to_string(n) +
               " outputs");
      for (std::size_t k = 0; k < n; ++k) sizes[k] = dim(d.size / parts);
    }
  }
  for (std::size_t k = 0; k < n; ++k) {
    tensor_shape o = s;
    o.dims[ax] = sizes[k];
    c.set_shape(k, o);
  }
}

// Slice's length along one axis of known size d (the ONNX clamping rules).
inline std::int64_t slice_len(std::int64_t d, std::int64_t start, std::int64_t end, std::int64_t step) {
  if (start < 0) start += d;
  if (end < 0) end += d;
  if (step > 0) {
    start = std::clamp<std::int64_t>(start, 0, d);
    end = std::clamp<std::int64_t>(end, 0, d);
    return end > start ? 1 + (end - start - 1) / step : 0;
  }
  start = std::clamp<std::int64_t>(start, 0, d - 1);
  end = std::clamp<std::int64_t>(end, -1, d - 1);
  if (start <= end) return 0;
  const auto abs_step = static_cast<std::uint64_t>(-(step + 1)) + 1;  // no overflow at INT64_MIN
  return static_cast<std::int64_t>(1 + static_cast<std::uint64_t>(start - end - 1) / abs_step);
}

inline void rule_slice(infer_ctx& c) {
  c.arity(1, 5, 1, 1);
  c.set_type(0, c.type(0));
  const tensor_shape& s = c.ranked(0);
  const std::size_t r = s.rank();
  std::optional<ints> starts, ends, axes, steps;
  if (c.inputs() > 1) {  // opset 10+: operands are inputs
    if (!c.has(1) || !c.has(2)) c.fail("starts and ends (inputs 1 and 2) are required");
    starts = c.const_ints(1);
    ends = c.const_ints(2);
    axes = c.has(3) ? c.const_ints(3) : std::nullopt;
    steps = c.has(4) ? c.const_ints(4) : std::nullopt;
    if (!c.has(3) || !c.has(4)) {
      const std::size_t m = starts ? starts->size() : ends ? ends->size() : 0;
      if (!c.has(3) && (starts || ends)) {
        axes = ints(m);
        for (std::size_t i = 0; i < m; ++i) (*axes)[i] = static_cast<std::int64_t>(i);
      }
      if (!c.has(4)) steps = ints(m, 1);
    }
  } else {  // opset 1: attributes
    starts = c.n.get_ints("starts");
    ends = c.n.get_ints("ends");
    axes = c.n.get_ints("axes", {});
    if (axes->empty()) {
      axes->resize(starts->size());
      for (std::size_t i = 0; i < axes->size(); ++i) (*axes)[i] = static_cast<std::int64_t>(i);
    }
    steps = ints(starts->size(), 1);
  }
  tensor_shape o = s;
  if (!axes) {  // any axis may change
    for (dim& d : o.dims) d = dim();
    c.set_shape(0, o);
    return;
  }
  const auto ax = c.axes(*axes, r, "axes");
  if (!starts || !ends || !steps) {
    for (std::size_t k : ax) o.dims[k] = dim();
    c.set_shape(0, o);
    return;
  }
  if (starts->size() != ax.size() || ends->size() != ax.size() || steps->size() != ax.size())
    c.fail(std::string("starts ") + ints_to_string(*starts) + ", ends " + ints_to_string(*ends) + ", axes " + ints_to_string(*axes) + " and steps " +
           ints_to_string(*steps) + " differ in length");
  for (std::size_t i = 0; i < ax.size(); ++i) {
    const std::int64_t st = (*starts)[i], en = (*ends)[i], sp = (*steps)[i];
    if (sp == 0) c.fail(std::string("step 0 on axis ") + std::to_string(ax[i]));
    const dim& d = s.dims[ax[i]];
    if (d.known()) o.dims[ax[i]] = dim(slice_len(d.size, st, en, sp));
    // An unknown dim is kept only by the whole-axis slice (0 to "the end": INT32_MAX or more).
    else
      o.dims[ax[i]] = st == 0 && sp == 1 && en >= std::numeric_limits<std::int32_t>::max() ? d : dim();
  }
  c.set_shape(0, o);
}

inline void rule_gather(infer_ctx& c) {
  c.arity(2, 2, 1, 1);
  c.set_type(0, c.type(0));
  if (auto t = c.type(1); t && *t != dtype::i64 && *t != dtype::i32)
    c.fail(std::string("indices ") + c.quoted(1) + " are " + std::string(dtype_name(*t)) + ", expected i64 or i32");
  const tensor_shape& s = c.ranked(0);
  const tensor_shape& idx = c.ranked(1);
  if (s.rank() == 0) c.fail(std::string("data ") + c.quoted(0) + " is a scalar; Gather needs rank >= 1");
  const std::size_t ax = c.axis(c.n.get_int("axis", 0), s.rank(), "axis");
  if (auto v = c.const_ints(1); v && s.dims[ax].known())
    for (std::int64_t i : *v)
      if (i < -s.dims[ax].size || i >= s.dims[ax].size)
        c.fail(std::string("index ") + std::to_string(i) + " is out of range for axis " + std::to_string(ax) + " of size " +
                   std::to_string(s.dims[ax].size),
               errc::out_of_range);
  tensor_shape o;
  o.dims.assign(s.dims.begin(), s.dims.begin() + static_cast<std::ptrdiff_t>(ax));
  o.dims.insert(o.dims.end(), idx.dims.begin(), idx.dims.end());
  o.dims.insert(o.dims.end(), s.dims.begin() + static_cast<std::ptrdiff_t>(ax) + 1, s.dims.end());
  c.set_shape(0, o);
}

inline void rule_reduce(infer_ctx& c) {  // ReduceMean ReduceSum ReduceMax ReduceMin ReduceProd
  c.arity(1, 2, 1, 1);
  c.set_type(0, c.type(0));
  const tensor_shape& s = c.ranked(0);
  const bool keep = c.n.get_int("keepdims", 1) != 0;
  bool present = false;
  const auto a = axes_operand(c, 1, present);
  if (!a) {  // computed axes: with keepdims the rank stays
    if (!keep) throw shape_unknown{};
    c.set_shape(0, tensor_shape(std::vector<dim>(s.rank())));
    return;
  }
  std::vector<std::size_t> ax;
  if (a->empty()) {
    if (c.n.get_int("noop_with_empty_axes", 0) != 0) {
      c.set_shape(0, s);
      return;
    }
    for (std::size_t i = 0; i < s.rank(); ++i) ax.push_back(i);
  } else {
    ax = c.axes(*a, s.rank(), "axes");
  }
  tensor_shape o;
  for (std::size_t i = 0; i < s.rank(); ++i) {
    if (std::find(ax.begin(), ax.end(), i) == ax.end())
      o.dims.push_back(s.dims[i]);
    else if (keep)
      o.dims.emplace_back(1);
  }
  c.set_shape(0, o);
}

inline void rule_shape(infer_ctx& c) {
  c.arity(1, 1, 1, 1);
  c.set_type(0, dtype::i64);
  const tensor_shape& s = c.in(0).shape;
  if (!s.rank_known) {
    c.set_shape(0, tensor_shape{dim()});
    return;
  }
  const auto r = static_cast<std::int64_t>(s.rank());
  auto clampi = [r](std::int64_t x) { return std::clamp<std::int64_t>(x < 0 ? x + r : x, 0, r); };
  const std::int64_t b = clampi(c.n.get_int("start", 0)), e = clampi(c.n.get_int("end", r));
  c.set_shape(0, tensor_shape{dim(std::max<std::int64_t>(e - b, 0))});
}

inline void rule_constant(infer_ctx& c) {
  c.arity(0, 0, 1, 1);
  if (c.n.attributes.size() != 1) c.fail(std::string("needs exactly one value attribute, has ") + std::to_string(c.n.attributes.size()));
  const std::string& key = c.n.attributes.begin()->first;
  if (key == "value_int") {
    (void)c.n.get_int(key);
    c.set(0, dtype::i64, tensor_shape{});
  } else if (key == "value_ints") {
    c.set(0, dtype::i64, tensor_shape{dim(c.n.get_ints(key).size())});
  } else if (key == "value_float") {
    (void)c.n.get_float(key);
    c.set(0, dtype::f32, tensor_shape{});
  } else if (key == "value_floats") {
    c.set(0, dtype::f32, tensor_shape{dim(c.n.get_floats(key).size())});
  } else {
    c.fail(std::string("attribute '") + key + "' is not taken here (a tensor value is a graph constant: add_constant)", errc::unsupported);
  }
}

inline void rule_expand(infer_ctx& c) {
  c.arity(2, 2, 1, 1);
  c.set_type(0, c.type(0));
  const tensor_shape& s = c.ranked(0);
  const auto target = c.const_ints(1);
  if (!target) {
    const tensor_shape& ss = c.ranked(1);
    if (ss.rank() != 1 || !ss.dims[0].known()) throw shape_unknown{};
    c.set_shape(0, tensor_shape(std::vector<dim>(std::max(s.rank(), static_cast<std::size_t>(ss.dims[0].size)))));
    return;
  }
  tensor_shape t;
  for (std::int64_t x : *target) {
    if (x < 0) c.fail(std::string("shape ") + ints_to_string(*target) + " has a negative size");
    t.dims.emplace_back(x);
  }
  c.set_shape(0, broadcast(c, s, t));
}

// N, C and the spatial dims; rank >= 3.
inline const tensor_shape& image_input(const infer_ctx& c, std::size_t i) {
  const tensor_shape& s = c.ranked(i);
  if (s.rank() < 3)
    c.fail(std::string("input ") + c.quoted(i) + " has shape " + s.to_string() + "; " + c.n.op + " needs N, C and at least one spatial dim");
  return s;
}

// Conv's output shape from inputs 0 to 2 and its attributes (FusedConv shares it).
inline void conv_shape(infer_ctx& c) {
  const tensor_shape& x = image_input(c, 0);
  const tensor_shape& w = c.ranked(1);
  const std::size_t ns = x.rank() - 2;
  if (w.rank() != x.rank())
    c.fail(std::string("weight ") + c.quoted(1) + " has shape " + w.to_string() + ", rank " + std::to_string(x.rank()) + " expected");
  const std::int64_t group = c.n.get_int("group", 1);
  if (group < 1) c.fail(std::string("group ") + std::to_string(group) + " is not positive");
  const dim& ch = x.dims[1];
  const dim& ch_per_group = w.dims[1];
  const dim& m = w.dims[0];
  if (ch.known() && ch_per_group.known() && ch.size != dim_mul(ch_per_group.size, group, "graph: channels"))
    c.fail(std::string("input ") + c.quoted(0) + " has " + std::to_string(ch.size) + " channels, weight " + c.quoted(1) + " takes " +
           std::to_string(ch_per_group.size) + " per group x group " + std::to_string(group));
  if (m.known() && m.size % group != 0)
    c.fail(std::string("weight ") + c.quoted(1) + " has " + std::to_string(m.size) + " output channels, not a multiple of group " +
           std::to_string(group));
  if (c.has(2)) {
    const tensor_shape& b = c.ranked(2);
    if (b.rank() != 1 || !merge_dim(b.dims[0], m))
      c.fail(std::string("bias ") + c.quoted(2) + " has shape " + b.to_string() + ", expected [" + m.to_string() + "]");
  }
  ints kernel(ns);
  for (std::size_t i = 0; i < ns; ++i) kernel[i] = w.dims[2 + i].known() ? w.dims[2 + i].size : -1;
  if (c.n.has_attribute("kernel_shape")) {
    const ints k = spatial_attr(c, "kernel_shape", ns, 1, 1);
    for (std::size_t i = 0; i < ns; ++i) {
      if (kernel[i] >= 0 && kernel[i] != k[i])
        c.fail(std::string("kernel_shape ") + ints_to_string(k) + " differs from weight " + c.quoted(1) + " " + w.to_string());
      kernel[i] = k[i];
    }
  }
  const ints strides = spatial_attr(c, "strides", ns, 1, 1);
  const ints dil = spatial_attr(c, "dilations", ns, 1, 1);
  const ints pads = spatial_attr(c, "pads", 2 * ns, 0, 0);
  const std::string auto_pad = c.n.get_string("auto_pad", "NOTSET");
  tensor_shape o{x.dims[0], m};
  for (std::size_t i = 0; i < ns; ++i)
    o.dims.push_back(kernel[i] < 0 ? dim() : window_dim(c, x.dims[2 + i], kernel[i], strides[i], dil[i], pads[i], pads[ns + i], auto_pad, false, i));
  c.set_shape(0, o);
}

inline void rule_conv(infer_ctx& c) {
  c.arity(2, 3, 1, 1);
  c.set_type(0, c.same_type({0, 1, 2}));
  conv_shape(c);
}

inline void rule_pool(infer_ctx& c) {  // MaxPool AveragePool
  const bool max = c.n.op == "MaxPool";
  c.arity(1, 1, 1, max ? 2 : 1);
  c.set_type(0, c.type(0));
  c.set_type(1, dtype::i64);
  const tensor_shape& x = image_input(c, 0);
  const std::size_t ns = x.rank() - 2;
  if (!c.n.has_attribute("kernel_shape")) c.fail("attribute 'kernel_shape' is required");
  const ints k = spatial_attr(c, "kernel_shape", ns, 1, 1);
  const ints strides = spatial_attr(c, "strides", ns, 1, 1);
  const ints dil = spatial_attr(c, "dilations", ns, 1, 1);
  const ints pads = spatial_attr(c, "pads", 2 * ns, 0, 0);
  const std::string auto_pad = c.n.get_string("auto_pad", "NOTSET");
  const bool ceil_mode = c.n.get_int("ceil_mode", 0) != 0;
  tensor_shape o{x.dims[0], x.dims[1]};
  for (std::size_t i = 0; i < ns; ++i)
    o.dims.push_back(window_dim(c, x.dims[2 + i], k[i], strides[i], dil[i], pads[i], pads[ns + i], auto_pad, ceil_mode, i));
  c.set_shape(0, o);
  c.set_shape(1, o);
}

inline void rule_global_pool(infer_ctx& c) {  // GlobalAveragePool GlobalMaxPool
  c.arity(1, 1, 1, 1);
  c.set_type(0, c.type(0));
  const tensor_shape& x = image_input(c, 0);
  tensor_shape o{x.dims[0], x.dims[1]};
  o.dims.resize(x.rank(), dim(1));
  c.set_shape(0, o);
}

inline void rule_batch_norm(infer_ctx& c) {
  c.arity(5, 5, 1, 3);
  if (c.n.get_int("training_mode", 0) != 0) c.fail("training_mode 1 is not supported (inference only)", errc::unsupported);
  for (std::size_t k = 1; k < c.outputs(); ++k)
    if (c.has_output(k)) c.fail(std::string("output ") + std::to_string(k) + " (running statistics) exists only in training mode", errc::unsupported);
  (void)c.n.get_float("epsilon", 1e-5);
  c.set_type(0, c.type(0));
  const tensor_shape& x = c.ranked(0);
  if (x.rank() < 2) c.fail(std::string("input ") + c.quoted(0) + " has shape " + x.to_string() + "; BatchNormalization needs N and C");
  for (std::size_t i = 1; i < 5; ++i) {
    const tensor_shape& p = c.ranked(i);
    if (p.rank() != 1 || !merge_dim(p.dims[0], x.dims[1]))
      c.fail(std::string("input ") + c.quoted(i) + " has shape " + p.to_string() + ", expected [" + x.dims[1].to_string() + "] (the channels)");
  }
  c.set_shape(0, x);
}

inline void rule_layer_norm(infer_ctx& c) {
  c.arity(2, 3, 1, 3);
  (void)c.n.get_float("epsilon", 1e-5);
  c.set_type(0, c.same_type({0, 1, 2}));
  const std::int64_t stash = c.n.get_int("stash_type", 1);
  const auto stash_t = dtype_from_onnx(stash);
  if (!stash_t) c.fail(std::string("stash_type ") + std::to_string(stash) + " is no ONNX element type tessel has", errc::unsupported);
  c.set_type(1, stash_t);
  c.set_type(2, stash_t);
  const tensor_shape& x = c.ranked(0);
  const std::size_t ax = c.axis(c.n.get_int("axis", -1), x.rank(), "axis");
  const tensor_shape normalized(std::vector<dim>(x.dims.begin() + static_cast<std::ptrdiff_t>(ax), x.dims.end()));
  for (std::size_t i : {1, 2}) {  // Scale and B broadcast one way, to the normalized shape
    if (!c.has(i)) continue;
    const tensor_shape& p = c.ranked(i);
    bool ok = p.rank() <= normalized.rank();
    for (std::size_t k = 0; ok && k < p.rank(); ++k) {
      const dim& pd = p.dims[p.rank() - 1 - k];
      const dim& nd = normalized.dims[normalized.rank() - 1 - k];
      ok = !(pd.known() && nd.known() && pd.size != 1 && pd.size != nd.size);
    }
    if (!ok)
      c.fail(std::string(i == 1 ? "scale " : "bias ") + c.quoted(i) + " " + p.to_string() + " does not broadcast to the normalized shape " +
             normalized.to_string());
  }
  c.set_shape(0, x);
  tensor_shape stats(std::vector<dim>(x.dims.begin(), x.dims.begin() + static_cast<std::ptrdiff_t>(ax)));
  stats.dims.resize(x.rank(), dim(1));
  c.set_shape(1, stats);
  c.set_shape(2, stats);
}

// ---- tessel's fused ops (domain "tessel") ---------------------------------------------------------------
// What the fusion passes (graph/passes) rewrite ONNX patterns into and the executor runs as one tessel
// operator each. `activation` is "" (none), "Relu", "Gelu" (exact erf), "GeluTanh", "Sigmoid", "Tanh" or
// "Silu". Semantics (the executor's contract; A @ B is MatMul's, with its broadcasting):
//   FusedMatMul(A, B, bias?, residual?) {alpha = 1, activation}: Y = act(alpha·(A @ B) + bias + residual);
//       bias and residual broadcast one way to the product's shape (bias is usually [N]).
//   FusedConv(X, W, B?, Z?) {Conv's attributes, activation}: Y = act(Conv(X, W, B) + Z); Z has Y's shape
//       (a BatchNormalization after the Conv is folded into W and B).
//   RMSNormalization(X, scale) {axis = -1, epsilon = 1e-5}: Y = X / sqrt(mean(X² over axes >= axis) + eps) · scale.
//   SkipLayerNormalization(X, skip, scale, bias?) {axis = -1, epsilon = 1e-5}: S = X + skip (skip broadcasts
//       one way to X), Y = LayerNormalization(S, scale, bias); optional output 1 is S.
//   SkipRMSNormalization(X, skip, scale) {axis = -1, epsilon = 1e-5}: the same with RMSNormalization.
//   Attention(Q, K, V, mask?) {scale = 1/sqrt(D), causal = 0}: Q [B, Hq, Sq, D], K [B, Hkv, Sk, D],
//       V [B, Hkv, Sk, Dv], Hq a multiple of Hkv (query head h reads kv head h / (Hq / Hkv));
//       mask is added to the scores and broadcasts one way to [B, Hq, Sq, Sk]; causal keeps key j for
//       query i when j <= i + Sk - Sq (aligned bottom-right: a decode step sees the whole cache).
//       Y = softmax(scale·Q·Kᵀ + mask) · V, [B, Hq, Sq, Dv].
//   RotaryEmbedding(X, cos, sin) {interleaved = 0}: Y = X·cos + rotate(X)·sin; cos and sin broadcast one way
//       to X, whose last axis D is even. rotate pairs element i < D/2 of the last axis with i + D/2:
//       rotate(X) = [-X[D/2:], X[:D/2]] (GPT-NeoX / Llama); with interleaved = 1 it pairs 2i with 2i+1:
//       rotate(X)[2i] = -X[2i+1], rotate(X)[2i+1] = X[2i] (GPT-J).
inline constexpr std::string_view fused_domain = "tessel";

inline void check_activation(const infer_ctx& c) {
  const std::string a = c.n.get_string("activation", "");
  static constexpr std::string_view known[] = {"", "Relu", "Gelu", "GeluTanh", "Sigmoid", "Tanh", "Silu"};
  if (std::find(std::begin(known), std::end(known), a) == std::end(known))
    c.fail(std::string("activation '") + a + "' is not one of '', Relu, Gelu, GeluTanh, Sigmoid, Tanh, Silu", errc::unsupported);
}

// `p` broadcasts one way to `to` (numpy rules, `to` unchanged).
inline void check_broadcasts_to(const infer_ctx& c, std::size_t i, const tensor_shape& to, std::string_view what) {
  const tensor_shape& p = c.ranked(i);
  bool ok = p.rank() <= to.rank();
  for (std::size_t k = 0; ok && k < p.rank(); ++k) {
    const dim& pd = p.dims[p.rank() - 1 - k];
    const dim& td = to.dims[to.rank() - 1 - k];
    ok = !(pd.known() && td.known() && pd.size != 1 && pd.size != td.size);
  }
  if (!ok) c.fail(std::string(what) + " " + c.quoted(i) + " " + p.to_string() + " does not broadcast to " + to.to_string());
}

inline void rule_fused_matmul(infer_ctx& c) {
  c.arity(2, 4, 1, 1);
  check_activation(c);
  (void)c.n.get_float("alpha", 1.0);
  const std::optional<dtype> t = c.same_type({0, 1, 2, 3});
  c.set_type(0, t);
  matmul_shape(c);
  if (!c.out[0].shape.rank_known) return;
  const tensor_shape y = c.out[0].shape;
  if (c.has(2)) check_broadcasts_to(c, 2, y, "bias");
  if (c.has(3)) check_broadcasts_to(c, 3, y, "residual");
}

inline void rule_fused_conv(infer_ctx& c) {
  c.arity(2, 4, 1, 1);
  check_activation(c);
  c.set_type(0, c.same_type({0, 1, 2, 3}));
  conv_shape(c);
  if (c.has(3)) {
    const tensor_shape& z = c.ranked(3);
    const tensor_shape& y = c.out[0].shape;
    bool ok = y.rank_known && z.rank() == y.rank();
    for (std::size_t k = 0; ok && k < z.rank(); ++k) ok = merge_dim(z.dims[k], y.dims[k]).has_value();
    if (!ok) c.fail(std::string("residual ") + c.quoted(3) + " " + z.to_string() + " is not the output's shape " + y.to_string());
  }
}

inline void rule_norm_common(infer_ctx& c, std::size_t x_in, std::size_t first_param, std::size_t last_param) {
  (void)c.n.get_float("epsilon", 1e-5);
  const tensor_shape& x = c.ranked(x_in);
  const std::size_t ax = c.axis(c.n.get_int("axis", -1), x.rank(), "axis");
  const tensor_shape normalized(std::vector<dim>(x.dims.begin() + static_cast<std::ptrdiff_t>(ax), x.dims.end()));
  for (std::size_t i = first_param; i <= last_param; ++i)
    if (c.has(i)) check_broadcasts_to(c, i, normalized, i == first_param ? "scale" : "bias");
}

inline void rule_rms_norm(infer_ctx& c) {
  c.arity(2, 2, 1, 1);
  c.set_type(0, c.same_type({0, 1}));
  rule_norm_common(c, 0, 1, 1);
  c.set_shape(0, c.ranked(0));
}

inline void rule_skip_norm(infer_ctx& c) {
  const bool layer = c.n.op == "SkipLayerNormalization";
  c.arity(3, layer ? 4 : 3, 1, 2);
  const std::optional<dtype> t = c.same_type({0, 1, 2, 3});
  c.set_type(0, t);
  c.set_type(1, t);
  const tensor_shape& x = c.ranked(0);
  check_broadcasts_to(c, 1, x, "skip");
  rule_norm_common(c, 0, 2, layer ? 3 : 2);
  c.set_shape(0, x);
  c.set_shape(1, x);
}

inline void rule_attention(infer_ctx& c) {
  c.arity(3, 4, 1, 1);
  (void)c.n.get_int("causal", 0);
  c.set_type(0, c.same_type({0, 1, 2}));
  const tensor_shape& q = c.ranked(0);
  const tensor_shape& k = c.ranked(1);
  const tensor_shape& v = c.ranked(2);
  for (std::size_t i : {0, 1, 2})
    if (c.in(i).shape.rank() != 4)
      c.fail(std::string("input ") + c.quoted(i) + " has shape " + c.in(i).shape.to_string() + "; Attention takes [batch, heads, seq, head dim]");
  auto same = [&](const dim& a, const dim& b, std::string_view what) {
    auto m = merge_dim(a, b);
    if (!m) c.fail(std::string(what) + " differ: " + q.to_string() + ", " + k.to_string() + ", " + v.to_string());
    return *m;
  };
  const dim b = same(same(q.dims[0], k.dims[0], "batch sizes"), v.dims[0], "batch sizes");
  const dim hkv = same(k.dims[1], v.dims[1], "key and value heads");
  (void)same(k.dims[2], v.dims[2], "key and value lengths");
  (void)same(q.dims[3], k.dims[3], "query and key head dims");
  if (q.dims[1].known() && hkv.known() && (hkv.size == 0 || q.dims[1].size % hkv.size != 0))
    c.fail(std::string("query heads ") + q.dims[1].to_string() + " are not a multiple of key/value heads " + hkv.to_string());
  const tensor_shape y{b, q.dims[1], q.dims[2], v.dims[3]};
  if (c.has(3)) check_broadcasts_to(c, 3, tensor_shape{b, q.dims[1], q.dims[2], k.dims[2]}, "mask");
  c.set_shape(0, y);
}

inline void rule_rotary(infer_ctx& c) {
  c.arity(3, 3, 1, 1);
  const std::int64_t inter = c.n.get_int("interleaved", 0);
  if (inter != 0 && inter != 1) c.fail(std::string("attribute 'interleaved' is ") + std::to_string(inter) + ", expected 0 or 1");
  c.set_type(0, c.same_type({0, 1, 2}));
  const tensor_shape& x = c.ranked(0);
  if (x.rank() == 0) c.fail("input " + c.quoted(0) + " is a scalar; RotaryEmbedding rotates pairs along the last axis");
  const dim& d = x.dims.back();
  if (d.known() && d.size % 2 != 0) c.fail("input " + c.quoted(0) + " " + x.to_string() + " has an odd last axis; rotation needs pairs");
  check_broadcasts_to(c, 1, x, "cos");
  check_broadcasts_to(c, 2, x, "sin");
  c.set_shape(0, x);
}

// The values of a constant f32 input (Resize's scales), nullopt when they are not known here.
inline std::optional<std::vector<float>> const_f32(const infer_ctx& c, std::size_t i) {
  if (!c.has(i)) return std::nullopt;
  const value& x = c.in(i);
  if (x.role != value_role::constant || !x.data || x.type != dtype::f32 || !x.shape.fully_known()) return std::nullopt;
  std::vector<float> v(x.data->size() / sizeof(float));
  if (!v.empty()) std::memcpy(v.data(), x.data->data(), v.size() * sizeof(float));
  return v;
}

inline void rule_resize(infer_ctx& c) {  // opset 13 to 17: X, roi, scales, sizes
  c.arity(1, 4, 1, 1);
  const std::string mode = c.n.get_string("mode", "nearest");
  if (mode != "nearest" && mode != "linear" && mode != "cubic")
    c.fail(std::string("attribute 'mode' is '") + mode + "', expected nearest, linear or cubic");
  c.set_type(0, c.type(0));
  const tensor_shape& x = c.ranked(0);
  // An empty scales tensor stands for "absent" (exporters write one when they give sizes).
  auto scales = const_f32(c, 2);
  const bool has_scales = c.has(2) && !(c.in(2).shape.fully_known() && c.in(2).shape.numel() == 0u);
  if (has_scales == c.has(3)) c.fail("takes exactly one of 'scales' (input 2) and 'sizes' (input 3)");
  tensor_shape y;
  if (c.has(3)) {
    const auto sizes = c.const_ints(3);
    if (!sizes) {  // computed sizes: the rank stays
      c.set_shape(0, tensor_shape(std::vector<dim>(x.rank())));
      return;
    }
    if (sizes->size() != x.rank())
      c.fail(std::string("sizes ") + ints_to_string(*sizes) + " has " + std::to_string(sizes->size()) + " values for rank " +
             std::to_string(x.rank()));
    for (std::int64_t d : *sizes) {
      if (d < 0) c.fail(std::string("sizes ") + ints_to_string(*sizes) + " holds a negative size");
      y.dims.emplace_back(d);
    }
  } else {
    if (!scales) {
      c.set_shape(0, tensor_shape(std::vector<dim>(x.rank())));
      return;
    }
    if (scales->size() != x.rank())
      c.fail(std::string("scales has ") + std::to_string(scales->size()) + " values for rank " + std::to_string(x.rank()));
    for (std::size_t k = 0; k < x.rank(); ++k) {
      const float f = (*scales)[k];
      if (!(f > 0.0f) || !(f < 1e9f))
        c.fail(std::string("scale ") + std::to_string(f) + " at axis " + std::to_string(k) + " is not a positive finite number");
      const dim& d = x.dims[k];
      if (f == 1.0f)
        y.dims.push_back(d);
      else if (!d.known())
        y.dims.emplace_back();
      else {
        const double o = std::floor(static_cast<double>(d.size) * static_cast<double>(f));
        if (o > 9.0e18) c.fail(std::string("axis ") + std::to_string(k) + ": the resized size overflows", errc::overflow);
        y.dims.emplace_back(static_cast<std::int64_t>(o));
      }
    }
  }
  c.set_shape(0, y);
}

inline void rule_logical(infer_ctx& c) {  // And Or Xor: bool inputs
  c.arity(2, 2, 1, 1);
  for (std::size_t i : {0, 1})
    if (auto t = c.type(i); t && *t != bool_dtype)
      c.fail(std::string("input ") + c.quoted(i) + " is " + std::string(dtype_name(*t)) + ", expected bool (" + std::string(dtype_name(bool_dtype)) +
             ")");
  c.set_type(0, bool_dtype);
  c.set_shape(0, broadcast_all(c, {0, 1}));
}

inline void rule_not(infer_ctx& c) {
  c.arity(1, 1, 1, 1);
  if (auto t = c.type(0); t && *t != bool_dtype)
    c.fail(std::string("input ") + c.quoted(0) + " is " + std::string(dtype_name(*t)) + ", expected bool (" + std::string(dtype_name(bool_dtype)) +
           ")");
  c.set_type(0, bool_dtype);
  c.set_shape(0, c.ranked(0));
}

inline void rule_trilu(infer_ctx& c) {  // input 1: the diagonal offset k, a scalar
  c.arity(1, 2, 1, 1);
  (void)c.n.get_int("upper", 1);
  c.set_type(0, c.type(0));
  if (c.has(1) && c.in(1).shape.rank_known && c.in(1).shape.rank() != 0 && !(c.in(1).shape.rank() == 1 && c.in(1).shape.dims[0] == dim(1)))
    c.fail(std::string("k ") + c.quoted(1) + " has shape " + c.in(1).shape.to_string() + ", expected a scalar");
  const tensor_shape& s = c.ranked(0);
  if (s.rank() < 2) c.fail(std::string("input ") + c.quoted(0) + " has shape " + s.to_string() + "; Trilu needs rank >= 2");
  c.set_shape(0, s);
}

inline void rule_tile(infer_ctx& c) {
  c.arity(2, 2, 1, 1);
  c.set_type(0, c.type(0));
  const tensor_shape& s = c.ranked(0);
  const auto reps = c.const_ints(1);
  if (!reps) {  // computed repeats: the rank stays
    c.set_shape(0, tensor_shape(std::vector<dim>(s.rank())));
    return;
  }
  if (reps->size() != s.rank())
    c.fail(std::string("repeats ") + ints_to_string(*reps) + " has " + std::to_string(reps->size()) + " values for rank " + std::to_string(s.rank()));
  tensor_shape y;
  for (std::size_t k = 0; k < s.rank(); ++k) {
    const std::int64_t r = (*reps)[k];
    if (r < 0) c.fail(std::string("repeats ") + ints_to_string(*reps) + " holds a negative count");
    const dim& d = s.dims[k];
    if (r == 1)
      y.dims.push_back(d);
    else if (r == 0)
      y.dims.emplace_back(0);
    else if (d.known())
      y.dims.emplace_back(dim_mul(d.size, r, "graph: tiled size"));
    else
      y.dims.emplace_back();
  }
  c.set_shape(0, y);
}

struct rule_entry {
  std::string_view op;
  rule_fn fn;
};

inline constexpr rule_entry shape_rules[] = {
    {"Abs", rule_unary},
    {"Add", rule_binary},
    {"And", rule_logical},
    {"Not", rule_not},
    {"Or", rule_logical},
    {"Xor", rule_logical},
    {"Resize", rule_resize},
    {"Tile", rule_tile},
    {"Trilu", rule_trilu},
    {"AveragePool", rule_pool},
    {"BatchNormalization", rule_batch_norm},
    {"Cast", rule_cast},
    {"Ceil", rule_unary},
    {"Concat", rule_concat},
    {"Constant", rule_constant},
    {"Conv", rule_conv},
    {"Cos", rule_unary},
    {"Div", rule_binary},
    {"Dropout", rule_dropout},
    {"Equal", rule_compare},
    {"Erf", rule_unary},
    {"Exp", rule_unary},
    {"Expand", rule_expand},
    {"Flatten", rule_flatten},
    {"Floor", rule_unary},
    {"Gather", rule_gather},
    {"Gelu", rule_gelu},
    {"Gemm", rule_gemm},
    {"GlobalAveragePool", rule_global_pool},
    {"GlobalMaxPool", rule_global_pool},
    {"Greater", rule_compare},
    {"Identity", rule_unary},
    {"LayerNormalization", rule_layer_norm},
    {"Less", rule_compare},
    {"Log", rule_unary},
    {"LogSoftmax", rule_softmax},
    {"MatMul", rule_matmul},
    {"Max", rule_variadic},
    {"MaxPool", rule_pool},
    {"Mean", rule_variadic},
    {"Min", rule_variadic},
    {"Mul", rule_binary},
    {"Neg", rule_unary},
    {"Pow", rule_pow},
    {"Reciprocal", rule_unary},
    {"ReduceMax", rule_reduce},
    {"ReduceMean", rule_reduce},
    {"ReduceMin", rule_reduce},
    {"ReduceProd", rule_reduce},
    {"ReduceSum", rule_reduce},
    {"Relu", rule_unary},
    {"Reshape", rule_reshape},
    {"Shape", rule_shape},
    {"Sigmoid", rule_unary},
    {"Sin", rule_unary},
    {"Slice", rule_slice},
    {"Softmax", rule_softmax},
    {"Split", rule_split},
    {"Sqrt", rule_unary},
    {"Squeeze", rule_squeeze},
    {"Sub", rule_binary},
    {"Sum", rule_variadic},
    {"Tanh", rule_unary},
    {"Transpose", rule_transpose},
    {"Unsqueeze", rule_unsqueeze},
    {"Where", rule_where},
};

inline constexpr rule_entry fused_shape_rules[] = {
    {"Attention", rule_attention},
    {"FusedConv", rule_fused_conv},
    {"FusedMatMul", rule_fused_matmul},
    {"RMSNormalization", rule_rms_norm},
    {"RotaryEmbedding", rule_rotary},
    {"SkipLayerNormalization", rule_skip_norm},
    {"SkipRMSNormalization", rule_skip_norm},
};

inline rule_fn find_shape_rule(const node& n) {
  if (n.domain == fused_domain) {
    for (const rule_entry& e : fused_shape_rules)
      if (e.op == n.op) return e.fn;
    return nullptr;
  }
  if (!n.domain.empty() && n.domain != "ai.onnx") return nullptr;
  for (const rule_entry& e : shape_rules)
    if (e.op == n.op) return e.fn;
  return nullptr;
}

// The inferred type against a declared one: known facts must agree; the result keeps the most known.
inline tensor_type merge_declared(const node& n, const value& x, const tensor_type& inferred) {
  auto mismatch = [&]() {
    throw graph_error(n.label() + ": output '" + x.name + "' is declared " + x.type_info().to_string() + " but infers " + inferred.to_string());
  };
  tensor_type r;
  if (x.type && inferred.type && *x.type != *inferred.type) mismatch();
  r.type = inferred.type ? inferred.type : x.type;
  if (!inferred.shape.rank_known) {
    r.shape = x.shape;
  } else if (!x.shape.rank_known) {
    r.shape = inferred.shape;
  } else {
    if (x.shape.rank() != inferred.shape.rank()) mismatch();
    r.shape = inferred.shape;
    for (std::size_t i = 0; i < r.shape.rank(); ++i) {
      const dim& d = x.shape.dims[i];
      const dim& e = inferred.shape.dims[i];
      if (!merge_dim(d, e)) mismatch();
      r.shape.dims[i] = e.known() ? e : d.known() || !d.symbol.empty() ? d : e;
    }
  }
  return r;
}

}  // namespace detail

// Whether ONNX op `op` has a shape rule here.
inline bool has_shape_rule(std::string_view op) {
  for (const detail::rule_entry& e : detail::shape_rules)
    if (e.op == op) return true;
  return false;
}

inline void graph::infer_shapes(const infer_options& opt) {
  for (node_id id : topological_order()) {
    const node& n = nodes_[index_of(id)];
    for (value_id v : n.inputs)
      if (v != value_id::none && values_[index_of(v)].role == value_role::undefined)
        throw graph_error(n.label() + ": input '" + values_[index_of(v)].name + "' is not defined by any node, graph input or constant");
    std::vector<tensor_type> out(n.outputs.size());
    if (const detail::rule_fn rule = detail::find_shape_rule(n)) {
      detail::infer_ctx c{*this, n, out};
      try {
        rule(c);
      } catch (const detail::shape_unknown&) {
        for (tensor_type& t : out) t.shape = tensor_shape::unknown_rank();
      } catch (const overflow_error& e) { throw graph_error(errc::overflow, n.label() + ": " + e.what()); }
    } else if (!opt.allow_unknown_ops) {
      throw graph_error(errc::unsupported, n.label() + ": unknown op '" + (n.domain.empty() ? "" : n.domain + "::") + n.op +
                                               "' (no shape rule; infer_options::allow_unknown_ops leaves its outputs unknown)");
    }
    for (std::size_t slot = 0; slot < n.outputs.size(); ++slot) {
      if (n.outputs[slot] == value_id::none) continue;
      value& x = values_[index_of(n.outputs[slot])];
      const tensor_type t = x.declared ? detail::merge_declared(n, x, out[slot]) : out[slot];
      x.type = t.type;
      x.shape = t.shape;
    }
  }
}

}  // namespace graph
}  // namespace v0
}  // namespace tessel
