// Pattern fusions: subgraphs that exporters spell op by op become one node the executor runs as one
// operator (ONNX's LayerNormalization and Gelu, tessel's fused ops; their contract is the comment at
// the end of shape_inference.hpp). A pattern fuses only when every interior value has exactly the one
// reader the pattern expects and is no graph output, its constants have the values and shapes the
// contract needs, and the fused node passes its shape rule with the type of the value it replaces;
// the replaced value keeps its name. Each pass returns how many patterns it fused. The passes read
// inferred shapes (which dims match, which axis is last): run infer_shapes first, as optimize does.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <tessel/graph/errors.hpp>
#include <tessel/graph/fold.hpp>
#include <tessel/graph/ir.hpp>
#include <tessel/graph/shape_inference.hpp>

namespace tessel {
inline namespace v0 {
namespace graph {
namespace detail {

// Questions a pattern asks about the graph around a node.
struct matcher {
  const graph& g;

  // The live producer of `v` when it runs `op` in `domain` ("" is ONNX's).
  std::optional<node_id> producer(value_id v, std::string_view op, std::string_view domain = {}) const {
    if (v == value_id::none || !g.contains(v)) return std::nullopt;
    const value& x = g.get(v);
    if (x.role != value_role::node_output) return std::nullopt;
    const node& n = g.get(x.producer);
    const bool dom = domain.empty() ? onnx_op(n) : n.domain == domain;
    if (n.op != op || !dom) return std::nullopt;
    return x.producer;
  }
  // Read by exactly one node input and no graph output.
  bool single_use(value_id v) const {
    const value& x = g.get(v);
    return !x.is_output && x.consumers.size() == 1;
  }
  // The one reader of `v` when it runs `op` (ONNX's).
  std::optional<node_id> sole_consumer(value_id v, std::string_view op) const {
    if (!single_use(v)) return std::nullopt;
    const node_id c = g.get(v).consumers.front().node;
    const node& n = g.get(c);
    if (n.op != op || !onnx_op(n)) return std::nullopt;
    return c;
  }
  // The other operand of a two-input node, given one of them.
  static value_id other(const node& n, value_id v) {
    if (n.inputs.size() != 2) return value_id::none;
    return n.inputs[0] == v ? n.inputs[1] : n.inputs[1] == v ? n.inputs[0] : value_id::none;
  }
  // A constant with one element, as a double.
  std::optional<double> scalar(value_id v) const {
    if (v == value_id::none) return std::nullopt;
    const auto t = read_constant(g.get(v));
    if (!t || t->numel() != 1) return std::nullopt;
    return t->get(0);
  }
  bool scalar_near(value_id v, double target, double rel = 1e-4) const {
    const auto s = scalar(v);
    return s && std::fabs(*s - target) <= rel * std::fabs(target);
  }
  // The constant operand of a two-input node and the other one, whichever order they come in.
  std::optional<std::pair<value_id, double>> with_scalar(const node& n, double target, double rel = 1e-4) const {
    if (n.inputs.size() != 2) return std::nullopt;
    for (std::size_t k : {1, 0})
      if (scalar_near(n.inputs[k], target, rel)) return std::pair<value_id, double>{n.inputs[1 - k], *scalar(n.inputs[k])};
    return std::nullopt;
  }
  const tensor_shape& shape(value_id v) const { return g.get(v).shape; }
  // A rank-1 value whose length is `d` (or unknown where d is).
  bool vector_of(value_id v, const dim& d) const {
    const tensor_shape& s = shape(v);
    return s.rank_known && s.rank() == 1 && merge_dim(s.dims[0], d).has_value() && !(d.known() && !s.dims[0].known());
  }
  // ReduceMean's axes (attribute or constant input), nullopt when not known or "all axes".
  std::optional<ints> reduce_axes(const node& n) const {
    if (n.get_int("keepdims", 1) != 1) return std::nullopt;
    if (n.has_attribute("axes")) return n.get_ints("axes");
    if (n.inputs.size() > 1 && n.inputs[1] != value_id::none) return g.constant_ints(n.inputs[1]);
    return std::nullopt;
  }
  // The axes are exactly the last axis of a value of rank `rank`.
  static bool last_axis(const std::optional<ints>& a, std::size_t rank) {
    return a && a->size() == 1 && rank > 0 && ((*a)[0] == -1 || (*a)[0] == static_cast<std::int64_t>(rank) - 1);
  }
};

// Two shapes that are the same as far as is known: equal ranks and dims that merge (equal symbols).
inline bool same_shape(const tensor_shape& a, const tensor_shape& b) {
  if (!a.rank_known || !b.rank_known || a.rank() != b.rank()) return false;
  for (std::size_t k = 0; k < a.rank(); ++k) {
    const dim& x = a.dims[k];
    const dim& y = b.dims[k];
    if (x.known() != y.known()) return false;
    if (x.known() ? x.size != y.size : (x.symbol.empty() || x.symbol != y.symbol)) return false;
  }
  return true;
}

// `p` broadcasts one way to `to` without changing it (each dim 1 or the same as to's).
inline bool broadcasts_to(const tensor_shape& p, const tensor_shape& to) {
  if (!p.rank_known || !to.rank_known || p.rank() > to.rank()) return false;
  for (std::size_t k = 0; k < p.rank(); ++k) {
    const dim& x = p.dims[p.rank() - 1 - k];
    const dim& y = to.dims[to.rank() - 1 - k];
    if (x.known() && x.size == 1) continue;
    if (x.known() != y.known()) return false;
    if (x.known() ? x.size != y.size : (x.symbol.empty() || x.symbol != y.symbol)) return false;
  }
  return true;
}

// The other operand `p` of an Add whose result has the shape `to` of its first operand: in a valid
// graph it then broadcasts one way to `to`, so only its rank and its known dims (1 or to's) are
// checked, and an unknown dim passes (a symbolic "batch" against a bound 2).
inline bool addend_fits(const tensor_shape& p, const tensor_shape& to, const tensor_shape& sum, bool same_rank) {
  if (!same_shape(sum, to) || !p.rank_known || p.rank() > to.rank() || (same_rank && p.rank() != to.rank())) return false;
  for (std::size_t k = 0; k < p.rank(); ++k) {
    const dim& x = p.dims[p.rank() - 1 - k];
    const dim& y = to.dims[to.rank() - 1 - k];
    if (x.known() && x.size != 1 && !(y.known() && y.size == x.size)) return false;
  }
  return true;
}

// Adding a fused node and swapping it in for the subgraph it replaces.
struct rewriter {
  graph& g;

  // Adds the node with outputs standing for `replaces` (value_id::none: an absent output) and checks
  // it with its shape rule against their types; nullopt (and the node gone again) when it fails.
  std::optional<node_id> add(std::string op, std::string domain, const std::string& name_base, const std::vector<value_id>& inputs,
                             const std::vector<value_id>& replaces, attribute_map attrs) {
    std::vector<std::string> in, out;
    for (value_id v : inputs) in.push_back(v == value_id::none ? std::string() : g.get(v).name);
    for (value_id v : replaces) out.push_back(v == value_id::none ? std::string() : fresh_value_name(g, g.get(v).name + "_fused"));
    const node_id id = g.add_node(std::move(op), fresh_node_name(g, name_base), in, out, std::move(attrs), std::move(domain));
    if (!check(id, replaces)) {
      g.remove_node(id);
      return std::nullopt;
    }
    return id;
  }

  bool check(node_id id, const std::vector<value_id>& replaces) const {
    const node& n = g.get(id);
    const rule_fn rule = find_shape_rule(n);
    if (!rule) return false;
    std::vector<tensor_type> out(n.outputs.size());
    infer_ctx c{g, n, out};
    try {
      rule(c);
    } catch (const shape_unknown&) {
      for (tensor_type& t : out) t.shape = tensor_shape::unknown_rank();
    } catch (const error&) { return false; }
    for (std::size_t k = 0; k < replaces.size(); ++k) {
      if (replaces[k] == value_id::none) continue;
      const tensor_type old = g.get(replaces[k]).type_info();
      if (old.type && out[k].type && *old.type != *out[k].type) return false;
      if (old.shape.rank_known && out[k].shape.rank_known) {
        if (old.shape.rank() != out[k].shape.rank()) return false;
        for (std::size_t d = 0; d < old.shape.rank(); ++d)
          if (!merge_dim(old.shape.dims[d], out[k].shape.dims[d])) return false;
      }
    }
    return true;
  }

  // Readers of each replaced value read the fused node's output instead, which takes the old name;
  // the interior nodes left without readers go.
  void commit(node_id fused, const std::vector<value_id>& replaces, const std::vector<node_id>& interior) {
    std::vector<std::string> names;
    const std::vector<value_id> outs = g.get(fused).outputs;
    for (std::size_t k = 0; k < replaces.size(); ++k) {
      names.push_back(replaces[k] == value_id::none ? std::string() : g.get(replaces[k]).name);
      if (replaces[k] != value_id::none) g.replace_all_uses(replaces[k], outs[k]);
    }
    erase_unused(interior);
    for (std::size_t k = 0; k < replaces.size(); ++k)
      if (replaces[k] != value_id::none && !g.find_value(names[k])) g.rename_value(outs[k], names[k]);
  }

  void erase_unused(const std::vector<node_id>& nodes) {
    for (bool progress = true; progress;) {
      progress = false;
      for (node_id id : nodes) {
        if (!g.contains(id)) continue;
        bool unused = true;
        for (value_id v : g.get(id).outputs)
          if (v != value_id::none && (g.get(v).is_output || !g.get(v).consumers.empty())) unused = false;
        if (!unused) continue;
        g.remove_node(id);
        progress = true;
      }
    }
  }
};

// Live nodes running `op` (in `domain`, "" for ONNX's), in topological order: a pass's anchors.
inline std::vector<node_id> anchors(const graph& g, std::string_view op, std::string_view domain = {}) {
  std::vector<node_id> r;
  for (node_id id : g.topological_order()) {
    const node& n = g.get(id);
    if (n.op == op && (domain.empty() ? onnx_op(n) : n.domain == domain)) r.push_back(id);
  }
  return r;
}

// x·t·0.5 in the three ways exporters associate it: (x·t)·0.5, x·(t·0.5), (x·0.5)·t. Returns the
// product's value and its Mul nodes; `t` must be read only by the first Mul.
inline std::optional<std::pair<value_id, std::vector<node_id>>> match_half_product(const matcher& m, value_id x, value_id t) {
  const auto m1 = m.sole_consumer(t, "Mul");
  if (!m1) return std::nullopt;
  const node& n1 = m.g.get(*m1);
  const value_id o = matcher::other(n1, t);
  const value_id p1 = n1.outputs[0];
  if (o == value_id::none) return std::nullopt;
  if (o == x || m.scalar_near(o, 0.5)) {
    const auto m2 = m.sole_consumer(p1, "Mul");
    if (!m2) return std::nullopt;
    const node& n2 = m.g.get(*m2);
    const value_id o2 = matcher::other(n2, p1);
    const bool ok = o == x ? m.scalar_near(o2, 0.5) : o2 == x;
    if (!ok) return std::nullopt;
    return std::pair{n2.outputs[0], std::vector<node_id>{*m1, *m2}};
  }
  if (const auto mh = m.producer(o, "Mul"); mh && m.single_use(o)) {
    const auto half = m.with_scalar(m.g.get(*mh), 0.5);
    if (half && half->first == x) return std::pair{p1, std::vector<node_id>{*mh, *m1}};
  }
  return std::nullopt;
}

}  // namespace detail

// ReduceMean, Sub, Pow 2 (or Mul(d, d)), ReduceMean, Add eps, Sqrt, Div, Mul γ (, Add β) over the last
// axis, γ and β rank 1 -> LayerNormalization.
inline std::size_t fuse_layer_norm(graph& g) {
  std::size_t fused = 0;
  for (node_id a : detail::anchors(g, "ReduceMean")) {
    if (!g.contains(a)) continue;
    const detail::matcher m{g};
    const node& m1 = g.get(a);
    const value_id x = m1.inputs.empty() ? value_id::none : m1.inputs[0];
    if (x == value_id::none || !m.shape(x).rank_known) continue;
    const tensor_shape xs = m.shape(x);
    const auto ax = m.reduce_axes(m1);
    if (!detail::matcher::last_axis(ax, xs.rank())) continue;
    const value_id mean = m1.outputs[0];
    const auto sub = m.sole_consumer(mean, "Sub");
    if (!sub || g.get(*sub).inputs[0] != x || g.get(*sub).inputs[1] != mean) continue;
    const value_id d = g.get(*sub).outputs[0];
    const value& dv = g.get(d);
    if (dv.is_output) continue;
    std::optional<node_id> sq, div;
    std::size_t sq_reads = 0;
    for (const use& u : dv.consumers) {
      const node& c = g.get(u.node);
      if (!detail::onnx_op(c)) continue;
      if (c.op == "Pow" && c.inputs[0] == d && m.scalar_near(c.inputs[1], 2.0, 0)) sq = u.node, sq_reads = 1;
      if (c.op == "Mul" && c.inputs[0] == d && c.inputs[1] == d) sq = u.node, sq_reads = 2;
      if (c.op == "Div" && c.inputs[0] == d) div = u.node;
    }
    if (!sq || !div || dv.consumers.size() != sq_reads + 1) continue;
    const auto m2 = m.sole_consumer(g.get(*sq).outputs[0], "ReduceMean");
    if (!m2 || m.reduce_axes(g.get(*m2)) != ax) continue;
    const auto add_eps = m.sole_consumer(g.get(*m2).outputs[0], "Add");
    if (!add_eps) continue;
    const auto eps = m.scalar(detail::matcher::other(g.get(*add_eps), g.get(*m2).outputs[0]));
    if (!eps) continue;
    const auto sqrt = m.sole_consumer(g.get(*add_eps).outputs[0], "Sqrt");
    if (!sqrt) continue;
    const value_id sd = g.get(*sqrt).outputs[0];
    if (!m.single_use(sd) || g.get(sd).consumers.front().node != *div || g.get(*div).inputs[1] != sd) continue;
    const auto mul = m.sole_consumer(g.get(*div).outputs[0], "Mul");
    if (!mul) continue;
    const value_id gamma = detail::matcher::other(g.get(*mul), g.get(*div).outputs[0]);
    const dim last = xs.dims.back();
    if (gamma == value_id::none || !m.vector_of(gamma, last)) continue;
    value_id result = g.get(*mul).outputs[0], beta = value_id::none;
    std::vector<node_id> interior{a, *sub, *sq, *m2, *add_eps, *sqrt, *div, *mul};
    if (const auto add_b = m.sole_consumer(result, "Add")) {
      const value_id b = detail::matcher::other(g.get(*add_b), result);
      if (b != value_id::none && m.vector_of(b, last)) {
        beta = b;
        result = g.get(*add_b).outputs[0];
        interior.push_back(*add_b);
      }
    }
    detail::rewriter rw{g};
    std::vector<value_id> in{x, gamma};
    if (beta != value_id::none) in.push_back(beta);
    const auto f = rw.add("LayerNormalization", "", g.get(a).name + "_layernorm", in, {result}, {{"axis", std::int64_t{-1}}, {"epsilon", *eps}});
    if (!f) continue;
    rw.commit(*f, {result}, interior);
    ++fused;
  }
  return fused;
}

// Pow 2 (or Mul(x, x)), ReduceMean over the last axis, Add eps, Sqrt, Reciprocal then Mul (or Div x
// by it, or Div 1 by it then Mul), Mul γ of rank 1 -> tessel's RMSNormalization.
inline std::size_t fuse_rms_norm(graph& g) {
  std::size_t fused = 0;
  for (node_id a : detail::anchors(g, "ReduceMean")) {
    if (!g.contains(a)) continue;
    const detail::matcher m{g};
    const node& rm = g.get(a);
    const value_id sq = rm.inputs.empty() ? value_id::none : rm.inputs[0];
    if (sq == value_id::none || !m.single_use(sq)) continue;
    value_id x = value_id::none;
    std::optional<node_id> sq_node;
    if (auto p = m.producer(sq, "Pow"); p && m.scalar_near(g.get(*p).inputs[1], 2.0, 0)) x = g.get(*p).inputs[0], sq_node = p;
    if (auto p = m.producer(sq, "Mul"); p && g.get(*p).inputs[0] == g.get(*p).inputs[1]) x = g.get(*p).inputs[0], sq_node = p;
    if (!sq_node || !m.shape(x).rank_known || !detail::matcher::last_axis(m.reduce_axes(rm), m.shape(x).rank())) continue;
    const auto add_eps = m.sole_consumer(rm.outputs[0], "Add");
    if (!add_eps) continue;
    const auto eps = m.scalar(detail::matcher::other(g.get(*add_eps), rm.outputs[0]));
    const auto sqrt = eps ? m.sole_consumer(g.get(*add_eps).outputs[0], "Sqrt") : std::nullopt;
    if (!sqrt) continue;
    const value_id r = g.get(*sqrt).outputs[0];
    std::vector<node_id> interior{*sq_node, a, *add_eps, *sqrt};
    value_id normed = value_id::none;
    if (!m.single_use(r)) continue;
    const node& rc = g.get(g.get(r).consumers.front().node);
    const node_id rc_id = g.get(r).consumers.front().node;
    value_id inv = value_id::none;
    if (rc.op == "Reciprocal" && detail::onnx_op(rc)) inv = rc.outputs[0];
    if (rc.op == "Div" && detail::onnx_op(rc) && rc.inputs[1] == r) {
      if (rc.inputs[0] == x)
        normed = rc.outputs[0];
      else if (m.scalar_near(rc.inputs[0], 1.0, 0))
        inv = rc.outputs[0];
    }
    interior.push_back(rc_id);
    if (inv != value_id::none) {
      const auto mul = m.sole_consumer(inv, "Mul");
      if (!mul || detail::matcher::other(g.get(*mul), inv) != x) continue;
      normed = g.get(*mul).outputs[0];
      interior.push_back(*mul);
    }
    if (normed == value_id::none) continue;
    const auto mul_g = m.sole_consumer(normed, "Mul");
    if (!mul_g) continue;
    const value_id gamma = detail::matcher::other(g.get(*mul_g), normed);
    if (gamma == value_id::none || !m.vector_of(gamma, m.shape(x).dims.back())) continue;
    interior.push_back(*mul_g);
    const value_id result = g.get(*mul_g).outputs[0];
    detail::rewriter rw{g};
    const auto f = rw.add("RMSNormalization", std::string(detail::fused_domain), g.get(a).name + "_rmsnorm", {x, gamma}, {result},
                          {{"axis", std::int64_t{-1}}, {"epsilon", *eps}});
    if (!f) continue;
    rw.commit(*f, {result}, interior);
    ++fused;
  }
  return fused;
}

// x·0.5·(1 + erf(x/√2)) (Div by √2 or Mul by 1/√2; the product in any association) -> Gelu.
inline std::size_t fuse_gelu_erf(graph& g) {
  std::size_t fused = 0;
  for (node_id a : detail::anchors(g, "Erf")) {
    if (!g.contains(a)) continue;
    const detail::matcher m{g};
    const value_id u = g.get(a).inputs[0];
    if (!m.single_use(u)) continue;
    value_id x = value_id::none;
    std::optional<node_id> scale_node;
    if (auto p = m.producer(u, "Div"); p && m.scalar_near(g.get(*p).inputs[1], std::sqrt(2.0))) x = g.get(*p).inputs[0], scale_node = p;
    if (auto p = m.producer(u, "Mul")) {
      if (auto s = m.with_scalar(g.get(*p), std::sqrt(0.5))) x = s->first, scale_node = p;
    }
    if (!scale_node) continue;
    const auto add1 = m.sole_consumer(g.get(a).outputs[0], "Add");
    if (!add1 || !m.with_scalar(g.get(*add1), 1.0, 0)) continue;
    const auto prod = detail::match_half_product(m, x, g.get(*add1).outputs[0]);
    if (!prod) continue;
    std::vector<node_id> interior{*scale_node, a, *add1};
    interior.insert(interior.end(), prod->second.begin(), prod->second.end());
    detail::rewriter rw{g};
    const auto f = rw.add("Gelu", "", g.get(a).name + "_gelu", {x}, {prod->first}, {});
    if (!f) continue;
    rw.commit(*f, {prod->first}, interior);
    ++fused;
  }
  return fused;
}

// 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) (x³ as Pow 3 or Mul(x, Mul(x, x))) -> Gelu {approximate tanh}.
inline std::size_t fuse_gelu_tanh(graph& g) {
  std::size_t fused = 0;
  for (node_id a : detail::anchors(g, "Tanh")) {
    if (!g.contains(a)) continue;
    const detail::matcher m{g};
    const value_id in = g.get(a).inputs[0];
    const auto mc = m.producer(in, "Mul");
    if (!mc || !m.single_use(in)) continue;
    const auto c = m.with_scalar(g.get(*mc), std::sqrt(2.0 / 3.14159265358979323846));
    if (!c || !m.single_use(c->first)) continue;
    const auto add = m.producer(c->first, "Add");
    if (!add) continue;
    // One operand of the Add is 0.044715·x³, the other x.
    value_id x = value_id::none;
    std::vector<node_id> interior{*add, *mc, a};
    for (std::size_t k : {0, 1}) {
      const value_id kv = g.get(*add).inputs[k];
      const auto mk = m.producer(kv, "Mul");
      if (!mk || !m.single_use(kv)) continue;
      const auto coef = m.with_scalar(g.get(*mk), 0.044715);
      if (!coef || !m.single_use(coef->first)) continue;
      const value_id cand = g.get(*add).inputs[1 - k];
      const value_id cube = coef->first;
      if (auto p = m.producer(cube, "Pow"); p && g.get(*p).inputs[0] == cand && m.scalar_near(g.get(*p).inputs[1], 3.0, 0)) {
        x = cand;
        interior.insert(interior.end(), {*mk, *p});
      } else if (auto q = m.producer(cube, "Mul")) {
        const value_id sq = detail::matcher::other(g.get(*q), cand);
        const auto r = m.producer(sq, "Mul");
        if (sq != value_id::none && r && m.single_use(sq) && g.get(*r).inputs[0] == cand && g.get(*r).inputs[1] == cand) {
          x = cand;
          interior.insert(interior.end(), {*mk, *q, *r});
        }
      }
      if (x != value_id::none) break;
    }
    if (x == value_id::none) continue;
    const auto add1 = m.sole_consumer(g.get(a).outputs[0], "Add");
    if (!add1 || !m.with_scalar(g.get(*add1), 1.0, 0)) continue;
    const auto prod = detail::match_half_product(m, x, g.get(*add1).outputs[0]);
    if (!prod) continue;
    interior.push_back(*add1);
    interior.insert(interior.end(), prod->second.begin(), prod->second.end());
    detail::rewriter rw{g};
    const auto f = rw.add("Gelu", "", g.get(a).name + "_gelu", {x}, {prod->first}, {{"approximate", std::string("tanh")}});
    if (!f) continue;
    rw.commit(*f, {prod->first}, interior);
    ++fused;
  }
  return fused;
}

namespace detail {

// After a product: Add bias (a constant that broadcasts one way to it), Add residual (a value of its
// rank that keeps its shape; with `exact_residual`, of its exact shape), an activation (Relu, Sigmoid, Tanh, Gelu, Gelu tanh, x·sigmoid(x)). Which of them follow.
struct epilogue_match {
  value_id bias = value_id::none, residual = value_id::none, result = value_id::none;
  std::string activation;
  std::vector<node_id> nodes;
  bool any() const { return bias != value_id::none || residual != value_id::none || !activation.empty(); }
};

// `weight`: MatMul's B; when it is [K, N], a bias [N] (or [1]) fits the product whatever A's shape.
inline epilogue_match match_epilogue(const matcher& m, value_id product, bool want_bias, bool want_residual, bool only_relu = false,
                                     bool exact_residual = false, value_id weight = value_id::none) {
  epilogue_match e;
  e.result = product;
  const tensor_shape ps = m.shape(product);
  auto vector_fits = [&](value_id o) {
    if (weight == value_id::none) return false;
    const tensor_shape& w = m.shape(weight);
    const tensor_shape& b = m.shape(o);
    return w.rank_known && w.rank() == 2 && w.dims[1].known() && b.rank_known && b.rank() == 1 && b.dims[0].known() &&
           (b.dims[0].size == w.dims[1].size || b.dims[0].size == 1);
  };
  if (want_bias)
    if (const auto add = m.sole_consumer(e.result, "Add")) {
      const value_id o = matcher::other(m.g.get(*add), e.result);
      if (o != value_id::none && m.g.get(o).role == value_role::constant && ((ps.rank_known && broadcasts_to(m.shape(o), ps)) || vector_fits(o))) {
        e.bias = o;
        e.result = m.g.get(*add).outputs[0];
        e.nodes.push_back(*add);
      }
    }
  if (want_residual && ps.rank_known)
    if (const auto add = m.sole_consumer(e.result, "Add")) {
      const value_id o = matcher::other(m.g.get(*add), e.result);
      const tensor_shape& sum = m.shape(m.g.get(*add).outputs[0]);
      const bool fits = exact_residual ? same_shape(m.shape(o), ps) && same_shape(sum, ps) : addend_fits(m.shape(o), ps, sum, true);
      if (o != value_id::none && o != e.result && fits) {
        e.residual = o;
        e.result = m.g.get(*add).outputs[0];
        e.nodes.push_back(*add);
      }
    }
  const value& r = m.g.get(e.result);
  if (r.is_output || r.consumers.empty()) return e;
  const node_id c = r.consumers.front().node;
  const node& cn = m.g.get(c);
  if (!onnx_op(cn)) return e;
  if (r.consumers.size() == 1) {
    std::string act;
    if (cn.op == "Relu")
      act = "Relu";
    else if (!only_relu && (cn.op == "Sigmoid" || cn.op == "Tanh"))
      act = cn.op;
    else if (!only_relu && cn.op == "Gelu") {
      const std::string ap = cn.get_string("approximate", "none");
      act = ap == "tanh" ? "GeluTanh" : ap == "none" ? "Gelu" : "";
    }
    if (!act.empty()) {
      e.activation = act;
      e.result = cn.outputs[0];
      e.nodes.push_back(c);
    }
  } else if (!only_relu && r.consumers.size() == 2) {  // x·sigmoid(x)
    std::optional<node_id> sig, mul;
    for (const use& u : r.consumers) {
      const node& k = m.g.get(u.node);
      if (k.op == "Sigmoid" && onnx_op(k)) sig = u.node;
      if (k.op == "Mul" && onnx_op(k)) mul = u.node;
    }
    if (sig && mul && m.single_use(m.g.get(*sig).outputs[0]) && matcher::other(m.g.get(*mul), e.result) == m.g.get(*sig).outputs[0]) {
      e.activation = "Silu";
      e.result = m.g.get(*mul).outputs[0];
      e.nodes.insert(e.nodes.end(), {*sig, *mul});
    }
  }
  return e;
}

// Transposes a 2-D constant (Gemm's transB folded into the weight).
inline std::optional<value_id> transposed_constant(graph& g, value_id w) {
  auto t = read_constant(g.get(w));
  if (!t || t->dims.size() != 2) return std::nullopt;
  folded_tensor r = *t;
  const auto rows = static_cast<std::size_t>(t->dims[0]), cols = static_cast<std::size_t>(t->dims[1]);
  r.dims = {t->dims[1], t->dims[0]};
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < cols; ++j) {
      if (r.floating())
        r.f[j * rows + i] = t->f[i * cols + j];
      else
        r.i[j * rows + i] = t->i[i * cols + j];
    }
  return g.add_constant(fresh_value_name(g, g.get(w).name + "_t"), r.type, r.dims, to_bytes(r));
}

}  // namespace detail

// MatMul (or Gemm without transA, beta 1, transB only of a constant) followed by any of Add bias,
// Add residual, activation -> tessel's FusedMatMul. A product with nothing to absorb stays.
inline std::size_t fuse_matmul(graph& g) {
  std::size_t fused = 0;
  std::vector<node_id> todo = detail::anchors(g, "MatMul");
  for (node_id id : detail::anchors(g, "Gemm")) todo.push_back(id);
  for (node_id a : todo) {
    if (!g.contains(a)) continue;
    const detail::matcher m{g};
    const node n = g.get(a);  // a copy: adding nodes moves the table
    const bool gemm = n.op == "Gemm";
    value_id A = n.inputs[0], B = n.inputs[1], C = value_id::none;
    double alpha = 1.0;
    if (gemm) {
      if (n.get_int("transA", 0) != 0) continue;
      alpha = n.get_float("alpha", 1.0);
      C = n.inputs.size() > 2 ? n.inputs[2] : value_id::none;
      if (C != value_id::none && n.get_float("beta", 1.0) != 1.0) continue;
      if (n.get_int("transB", 0) != 0 && (g.get(B).role != value_role::constant || !detail::read_constant(g.get(B)))) continue;
    }
    const value_id product = n.outputs[0];
    const detail::epilogue_match e = detail::match_epilogue(m, product, C == value_id::none, true, false, false, gemm ? value_id::none : B);
    if (!e.any()) continue;
    if (gemm && n.get_int("transB", 0) != 0) {
      const auto t = detail::transposed_constant(g, B);
      if (!t) continue;
      B = *t;
    }
    const value_id bias = C != value_id::none ? C : e.bias;
    std::vector<value_id> in{A, B, bias, e.residual};
    while (in.back() == value_id::none) in.pop_back();
    attribute_map attrs;
    if (!e.activation.empty()) attrs["activation"] = e.activation;
    if (alpha != 1.0) attrs["alpha"] = alpha;
    std::vector<node_id> interior{a};
    interior.insert(interior.end(), e.nodes.begin(), e.nodes.end());
    detail::rewriter rw{g};
    const auto f = rw.add("FusedMatMul", std::string(detail::fused_domain), n.name + "_fused", in, {e.result}, std::move(attrs));
    if (!f) {
      g.remove_unused_constants();
      continue;
    }
    rw.commit(*f, {e.result}, interior);
    ++fused;
  }
  return fused;
}

// Add then LayerNormalization -> SkipLayerNormalization; Add then tessel's RMSNormalization ->
// SkipRMSNormalization. The sum becomes output 1 when something else reads it (or it is a graph output).
inline std::size_t fuse_skip_norm(graph& g, std::size_t* rms_count = nullptr) {
  std::size_t fused = 0;
  std::vector<node_id> todo = detail::anchors(g, "LayerNormalization");
  for (node_id id : detail::anchors(g, "RMSNormalization", detail::fused_domain)) todo.push_back(id);
  for (node_id a : todo) {
    if (!g.contains(a)) continue;
    const detail::matcher m{g};
    const node n = g.get(a);
    const bool layer = n.op == "LayerNormalization";
    if (layer && n.get_int("stash_type", 1) != 1) continue;
    bool stats_used = false;
    for (std::size_t k = 1; k < n.outputs.size(); ++k)
      if (n.outputs[k] != value_id::none && (g.get(n.outputs[k]).is_output || !g.get(n.outputs[k]).consumers.empty())) stats_used = true;
    if (stats_used) continue;
    const value_id s = n.inputs[0];
    const auto add = m.producer(s, "Add");
    if (!add) continue;
    const node& an = g.get(*add);
    const tensor_shape ss = m.shape(s);
    value_id x = value_id::none, skip = value_id::none;
    for (std::size_t k : {0, 1})
      if (x == value_id::none && detail::addend_fits(m.shape(an.inputs[1 - k]), m.shape(an.inputs[k]), ss, false))
        x = an.inputs[k], skip = an.inputs[1 - k];
    if (x == value_id::none) continue;
    const bool keep_sum = g.get(s).is_output || g.get(s).consumers.size() > 1;
    std::vector<value_id> in{x, skip};
    for (std::size_t k = 1; k < n.inputs.size(); ++k) in.push_back(n.inputs[k]);
    while (in.back() == value_id::none) in.pop_back();
    attribute_map attrs{{"axis", n.get_int("axis", -1)}, {"epsilon", n.get_float("epsilon", 1e-5)}};
    std::vector<value_id> replaces{n.outputs[0]};
    if (keep_sum) replaces.push_back(s);
    detail::rewriter rw{g};
    const auto f = rw.add(layer ? "SkipLayerNormalization" : "SkipRMSNormalization", std::string(detail::fused_domain), n.name + "_skip", in,
                          replaces, std::move(attrs));
    if (!f) continue;
    rw.commit(*f, replaces, {a, *add});
    ++fused;
    if (!layer && rms_count) ++*rms_count;
  }
  return fused;
}

namespace detail {

// A Slice of the last axis with constant starts, ends and axes (steps absent or 1): its data and the
// range it keeps, clamped to the axis's known length.
struct last_axis_range {
  value_id data = value_id::none;
  std::int64_t begin = 0, end = 0;
};

inline std::optional<last_axis_range> slice_of_last_axis(const matcher& m, node_id id) {
  const node& s = m.g.get(id);
  if (s.inputs.size() < 4 || s.inputs[3] == value_id::none) return std::nullopt;
  const tensor_shape& x = m.shape(s.inputs[0]);
  if (!x.rank_known || x.rank() == 0 || !x.dims.back().known()) return std::nullopt;
  const std::int64_t rank = static_cast<std::int64_t>(x.rank()), d = x.dims.back().size;
  const auto starts = m.g.constant_ints(s.inputs[1]), ends = m.g.constant_ints(s.inputs[2]), axes = m.g.constant_ints(s.inputs[3]);
  if (!starts || !ends || !axes || starts->size() != 1 || ends->size() != 1 || axes->size() != 1) return std::nullopt;
  if ((*axes)[0] != -1 && (*axes)[0] != rank - 1) return std::nullopt;
  if (s.inputs.size() > 4 && s.inputs[4] != value_id::none) {
    const auto steps = m.g.constant_ints(s.inputs[4]);
    if (!steps || steps->size() != 1 || (*steps)[0] != 1) return std::nullopt;
  }
  auto clamp = [d](std::int64_t i) { return i < 0 ? std::max<std::int64_t>(i + d, 0) : std::min(i, d); };
  return last_axis_range{s.inputs[0], clamp((*starts)[0]), clamp((*ends)[0])};
}

}  // namespace detail

// x·cos + rotate_half(x)·sin with rotate_half(x) = Concat(-x[..., D/2:], x[..., :D/2]) along the last
// axis (Hugging Face's Llama and GPT-NeoX spelling; Mul and Add operands in either order), cos and sin
// broadcasting one way to x -> tessel's RotaryEmbedding.
inline std::size_t fuse_rotary(graph& g) {
  std::size_t fused = 0;
  for (node_id a : detail::anchors(g, "Concat")) {
    if (!g.contains(a)) continue;
    const detail::matcher m{g};
    const node& cat = g.get(a);
    if (cat.inputs.size() != 2 || !m.single_use(cat.inputs[0]) || !m.single_use(cat.inputs[1])) continue;
    const auto neg = m.producer(cat.inputs[0], "Neg");
    if (!neg) continue;
    const value_id high_v = g.get(*neg).inputs[0];
    const auto high = m.producer(high_v, "Slice");
    const auto low = m.producer(cat.inputs[1], "Slice");
    if (!high || !low || !m.single_use(high_v)) continue;
    const auto hr = detail::slice_of_last_axis(m, *high), lr = detail::slice_of_last_axis(m, *low);
    if (!hr || !lr || hr->data != lr->data) continue;
    const value_id x = hr->data;
    const tensor_shape xs = m.shape(x);
    const std::int64_t d = xs.dims.back().size, half = d / 2;
    const std::int64_t axis = cat.get_int("axis", 0);
    if (d == 0 || d % 2 != 0 || (axis != -1 && axis != static_cast<std::int64_t>(xs.rank()) - 1)) continue;
    if (lr->begin != 0 || lr->end != half || hr->begin != half || hr->end != d) continue;
    const auto mul_sin = m.sole_consumer(cat.outputs[0], "Mul");
    if (!mul_sin) continue;
    const value_id sin = detail::matcher::other(g.get(*mul_sin), cat.outputs[0]);
    const value_id rotated = g.get(*mul_sin).outputs[0];
    const auto add = m.sole_consumer(rotated, "Add");
    if (sin == value_id::none || !add) continue;
    const value_id straight = detail::matcher::other(g.get(*add), rotated);
    const auto mul_cos = m.producer(straight, "Mul");
    if (straight == value_id::none || !mul_cos || !m.single_use(straight)) continue;
    const value_id cos = detail::matcher::other(g.get(*mul_cos), x);
    const value_id result = g.get(*add).outputs[0];
    if (cos == value_id::none || cos == x || sin == x) continue;
    if (!detail::broadcasts_to(m.shape(cos), xs) || !detail::broadcasts_to(m.shape(sin), xs) || !detail::same_shape(m.shape(result), xs)) continue;
    detail::rewriter rw{g};
    const auto f = rw.add("RotaryEmbedding", std::string(detail::fused_domain), g.get(*add).name + "_rotary", {x, cos, sin}, {result},
                          {{"interleaved", std::int64_t{0}}});
    if (!f) continue;
    rw.commit(*f, {result}, {*high, *low, *neg, a, *mul_sin, *mul_cos, *add});
    ++fused;
  }
  return fused;
}

namespace detail {

// The value before a repeat of key/value heads, appending the nodes it strips to `interior`: HF's
// repeat_kv, Reshape(Expand(Unsqueeze(base, axes [2]), [B, Hkv, n, S, D]), [B, Hkv·n, S, D]) with
// single-use intermediates; or index_select, Gather(base, [0, .., 0, 1, .., 1, ..], axis 1) where
// head h reads base head h / n. Either way Attention's GQA contract reads base the same way.
inline value_id strip_repeat_kv(const matcher& m, value_id v, std::vector<node_id>& interior) {
  if (const auto ga = m.producer(v, "Gather")) {
    const node& gn = m.g.get(*ga);
    const value_id base = gn.inputs[0];
    const tensor_shape& b = m.shape(base);
    const tensor_shape& o = m.shape(v);
    if (!b.rank_known || b.rank() != 4 || !o.rank_known || o.rank() != 4 || !b.dims[1].known() || !o.dims[1].known()) return v;
    const std::int64_t axis = gn.get_int("axis", 0);
    const tensor_shape& is = m.shape(gn.inputs[1]);
    const auto idx = m.g.constant_ints(gn.inputs[1]);
    const std::int64_t hkv = b.dims[1].size, hq = o.dims[1].size;
    if ((axis != 1 && axis != -3) || !idx || !is.rank_known || is.rank() != 1 || hkv <= 0 || hq % hkv != 0) return v;
    if (static_cast<std::int64_t>(idx->size()) != hq) return v;
    for (std::int64_t h = 0; h < hq; ++h)
      if ((*idx)[static_cast<std::size_t>(h)] != h / (hq / hkv)) return v;
    interior.push_back(*ga);
    return base;
  }
  const auto rs = m.producer(v, "Reshape");
  if (!rs) return v;
  const value_id ev = m.g.get(*rs).inputs[0];
  const auto ex = m.producer(ev, "Expand");
  if (!ex || !m.single_use(ev)) return v;
  const value_id uv = m.g.get(*ex).inputs[0];
  const auto un = m.producer(uv, "Unsqueeze");
  if (!un || !m.single_use(uv)) return v;
  const node& u = m.g.get(*un);
  std::optional<ints> ax = u.has_attribute("axes") ? std::optional<ints>(u.get_ints("axes"))
                           : u.inputs.size() > 1   ? m.g.constant_ints(u.inputs[1])
                                                   : std::nullopt;
  const value_id base = u.inputs[0];
  const tensor_shape& b = m.shape(base);
  const tensor_shape& e = m.shape(ev);
  const tensor_shape& o = m.shape(v);
  if (!ax || *ax != ints{2} || !b.rank_known || !e.rank_known || !o.rank_known || b.rank() != 4 || e.rank() != 5 || o.rank() != 4) return v;
  auto eq = [](const dim& p, const dim& q) { return p.known() ? q.known() && p.size == q.size : !p.symbol.empty() && p.symbol == q.symbol; };
  if (!eq(b.dims[0], e.dims[0]) || !eq(b.dims[1], e.dims[1]) || !eq(b.dims[2], e.dims[3]) || !eq(b.dims[3], e.dims[4])) return v;
  if (!eq(b.dims[0], o.dims[0]) || !eq(b.dims[2], o.dims[2]) || !eq(b.dims[3], o.dims[3])) return v;
  if (!b.dims[1].known() || !e.dims[2].known() || !o.dims[1].known() || o.dims[1].size != b.dims[1].size * e.dims[2].size) return v;
  interior.insert(interior.end(), {*rs, *ex, *un});
  return base;
}

inline bool very_negative(double x) { return x <= -1e4; }

// A constant [..1.., Sq, Sk] that keeps element (i, j) exactly when j <= i + Sk - Sq; `keep_value`
// says of an element 1 (kept), 0 (masked) or -1 (neither: not a mask this pattern takes).
template <class Pred>
inline bool causal_constant(const matcher& m, value_id v, const dim& sq, const dim& sk, Pred keep_value) {
  const auto t = read_constant(m.g.get(v));
  if (!t || t->dims.size() < 2 || !sq.known() || !sk.known()) return false;
  const std::size_t r = t->dims.size();
  for (std::size_t k = 0; k + 2 < r; ++k)
    if (t->dims[k] != 1) return false;
  if (t->dims[r - 2] != sq.size || t->dims[r - 1] != sk.size) return false;
  const std::int64_t shift = sk.size - sq.size;
  for (std::int64_t i = 0; i < sq.size; ++i)
    for (std::int64_t j = 0; j < sk.size; ++j)
      if (keep_value(t->get(static_cast<std::size_t>(i * sk.size + j))) != (j <= i + shift ? 1 : 0)) return false;
  return true;
}

// A constant of zeros (either sign) added to `scores` without broadcasting them to a larger shape
// (`sum`'s): no mask at all. Softmax cannot tell the sum from the scores (s + 0 differs from s only
// in the sign of a zero, and exp(-0) = exp(+0)), so dropping it keeps the bits; an exporter's
// "no mask" (a traced `+ 0.0`) then takes the fused attention instead of the masked one by parts.
inline bool zero_constant(const matcher& m, value_id v, value_id scores, value_id sum) {
  const auto t = read_constant(m.g.get(v));
  if (!t) return false;
  const tensor_shape a = m.shape(scores), b = m.shape(sum);
  if (!a.rank_known || !b.rank_known || a.rank() != b.rank()) return false;
  for (std::size_t i = 0; i < a.rank(); ++i)
    if (!a.dims[i].known() || !b.dims[i].known() || a.dims[i].size != b.dims[i].size) return false;
  for (std::size_t i = 0; i < t->numel(); ++i)
    if (t->get(i) != 0.0) return false;
  return true;
}

}  // namespace detail

// MatMul(Q, Kᵀ), Mul or Div by a scalar, Add mask or Where with a causal mask, Softmax over the last
// axis, MatMul(P, V) -> tessel's Attention. Kᵀ's Transpose and repeat_kv of K and V are absorbed; a
// constant causal mask becomes causal = 1.
inline std::size_t fuse_attention(graph& g) {
  std::size_t fused = 0;
  for (node_id a : detail::anchors(g, "Softmax")) {
    if (!g.contains(a)) continue;
    const detail::matcher m{g};
    const node& sm = g.get(a);
    const value_id logits = sm.inputs[0];
    const tensor_shape ls = m.shape(logits);
    if (!ls.rank_known || ls.rank() != 4) continue;
    const std::int64_t sax = sm.get_int("axis", -1);
    if (sax != -1 && sax != 3) continue;
    const auto pv = m.sole_consumer(sm.outputs[0], "MatMul");
    if (!pv || g.get(*pv).inputs[0] != sm.outputs[0]) continue;
    std::vector<node_id> interior{a, *pv};
    value_id cur = logits, mask = value_id::none;
    std::int64_t causal = 0;
    const dim sq = ls.dims[2], sk = ls.dims[3];
    if (!m.single_use(cur)) continue;
    if (const auto add = m.producer(cur, "Add")) {
      const node& an = g.get(*add);
      // The scores operand: a MatMul's output, or a Mul or Div of one (the mask may be computed too).
      auto scores_like = [&](value_id s) {
        if (m.producer(s, "MatMul")) return true;
        for (const char* op : {"Mul", "Div"})
          if (const auto p = m.producer(s, op))
            for (value_id in : g.get(*p).inputs)
              if (m.producer(in, "MatMul")) return true;
        return false;
      };
      std::optional<std::size_t> scores_at;
      for (std::size_t k : {0, 1})
        if (!scores_at && scores_like(an.inputs[k])) scores_at = k;
      if (!scores_at) continue;
      const value_id mv = an.inputs[1 - *scores_at];
      if (detail::causal_constant(m, mv, sq, sk, [](double x) { return x == 0.0 ? 1 : detail::very_negative(x) ? 0 : -1; }))
        causal = 1;
      else if (!detail::zero_constant(m, mv, an.inputs[*scores_at], logits))
        mask = mv;
      cur = an.inputs[*scores_at];
      interior.push_back(*add);
    } else if (const auto wh = m.producer(cur, "Where")) {
      const node& wn = g.get(*wh);
      bool ok = false;
      for (std::size_t k : {1, 2}) {
        const value_id other = wn.inputs[k == 1 ? 2 : 1];
        const auto neg = m.scalar(other);
        if (ok || !neg || !detail::very_negative(*neg)) continue;
        // Where(keep, scores, -inf) or Where(drop, -inf, scores).
        const bool keep_when_true = k == 1;
        if (detail::causal_constant(m, wn.inputs[0], sq, sk, [&](double c) { return (c != 0.0) == keep_when_true ? 1 : 0; })) {
          ok = true;
          cur = wn.inputs[k];
        }
      }
      if (!ok) continue;
      causal = 1;
      interior.push_back(*wh);
    }
    if (!m.single_use(cur)) continue;
    double scale = 1.0;
    if (const auto mul = m.producer(cur, "Mul")) {
      const node& mn = g.get(*mul);
      std::optional<std::pair<value_id, double>> s;
      for (std::size_t k : {1, 0})
        if (!s)
          if (auto v = m.scalar(mn.inputs[k])) s = std::pair<value_id, double>{mn.inputs[1 - k], *v};
      if (!s) continue;
      scale = s->second;
      cur = s->first;
      interior.push_back(*mul);
    } else if (const auto div = m.producer(cur, "Div")) {
      const auto v = m.scalar(g.get(*div).inputs[1]);
      if (!v || *v == 0.0) continue;
      scale = 1.0 / *v;
      cur = g.get(*div).inputs[0];
      interior.push_back(*div);
    }
    const auto qk = m.producer(cur, "MatMul");
    if (!qk || !m.single_use(cur)) continue;
    interior.push_back(*qk);
    value_id q = g.get(*qk).inputs[0];
    const value_id kt = g.get(*qk).inputs[1];
    value_id v = g.get(*pv).inputs[1];
    // A scale applied to Q before the product (q · s or q / s, s a constant scalar) joins `scale`.
    if (m.single_use(q)) {
      if (const auto mq = m.producer(q, "Mul")) {
        const node& mn = g.get(*mq);
        for (std::size_t k : {1, 0})
          if (const auto sv = m.scalar(mn.inputs[k]); sv && mn.inputs[1 - k] != value_id::none) {
            scale *= *sv;
            q = mn.inputs[1 - k];
            interior.push_back(*mq);
            break;
          }
      } else if (const auto dq = m.producer(q, "Div")) {
        if (const auto sv = m.scalar(g.get(*dq).inputs[1]); sv && *sv != 0.0) {
          scale /= *sv;
          q = g.get(*dq).inputs[0];
          interior.push_back(*dq);
        }
      }
    }
    if (!m.shape(q).rank_known || m.shape(q).rank() != 4 || !m.shape(kt).rank_known || m.shape(kt).rank() != 4) continue;
    // K = Transpose(kt, [0,1,3,2]); a Transpose producing kt composes with it.
    value_id k = value_id::none;
    ints k_perm{0, 1, 3, 2};
    value_id k_src = kt;
    if (const auto tr = m.producer(kt, "Transpose"); tr && m.single_use(kt)) {
      const ints p = g.get(*tr).get_ints("perm", ints{3, 2, 1, 0});
      if (p.size() != 4) continue;
      ints r(4);
      for (std::size_t i = 0; i < 4; ++i) r[i] = p[static_cast<std::size_t>(k_perm[i])];
      k_perm = r;
      k_src = g.get(*tr).inputs[0];
      interior.push_back(*tr);
    }
    std::vector<node_id> created;
    if (k_perm == ints{0, 1, 2, 3}) {
      k = detail::strip_repeat_kv(m, k_src, interior);
    } else {
      const std::string kname = detail::fresh_value_name(g, g.get(k_src).name + "_bhsd");
      const std::string knode = detail::fresh_node_name(g, g.get(*qk).name + "_k_transpose");
      created.push_back(g.add_node("Transpose", knode, {g.get(k_src).name}, {kname}, {{"perm", k_perm}}));
      k = g.value_named(kname);
    }
    v = detail::strip_repeat_kv(m, v, interior);
    std::vector<value_id> in{q, k, v};
    if (mask != value_id::none) in.push_back(mask);
    const value_id result = g.get(*pv).outputs[0];
    detail::rewriter rw{g};
    attribute_map attrs{{"scale", scale}};
    if (causal) attrs["causal"] = causal;
    const auto f = rw.add("Attention", std::string(detail::fused_domain), g.get(*qk).name + "_attention", in, {result}, std::move(attrs));
    if (!f) {
      for (node_id c : created) g.remove_node(c);
      continue;
    }
    rw.commit(*f, {result}, interior);
    ++fused;
  }
  return fused;
}

// Conv followed by any of BatchNormalization (constant statistics: folded into W and B in double),
// Add residual (a value of the output's shape), Relu -> tessel's FusedConv.
inline std::size_t fuse_conv(graph& g) {
  std::size_t fused = 0;
  for (node_id a : detail::anchors(g, "Conv")) {
    if (!g.contains(a)) continue;
    const detail::matcher m{g};
    const node n = g.get(a);
    const value_id y = n.outputs[0];
    value_id W = n.inputs[1], B = n.inputs.size() > 2 ? n.inputs[2] : value_id::none;
    std::vector<node_id> interior{a};
    value_id cur = y;
    std::optional<node_id> bn;
    if (const auto b = m.sole_consumer(y, "BatchNormalization")) {
      const node& bnn = g.get(*b);
      bool ok = bnn.inputs.size() == 5 && bnn.inputs[0] == y && bnn.get_int("training_mode", 0) == 0;
      for (std::size_t k = 1; ok && k < bnn.outputs.size(); ++k) ok = bnn.outputs[k] == value_id::none;
      if (ok) bn = b;
    }
    std::optional<detail::folded_tensor> w, bias, sc, sh, mean, var;
    if (bn) {
      const node& bnn = g.get(*bn);
      w = detail::read_constant(g.get(W));
      if (B != value_id::none) bias = detail::read_constant(g.get(B));
      sc = detail::read_constant(g.get(bnn.inputs[1]));
      sh = detail::read_constant(g.get(bnn.inputs[2]));
      mean = detail::read_constant(g.get(bnn.inputs[3]));
      var = detail::read_constant(g.get(bnn.inputs[4]));
      const bool consts = w && w->floating() && !w->dims.empty() && sc && sh && mean && var && (B == value_id::none || bias);
      bool ok = consts;
      if (ok)
        for (const auto* p : {&*sc, &*sh, &*mean, &*var}) ok = ok && p->floating() && p->dims.size() == 1 && p->dims[0] == w->dims[0];
      if (ok && bias) ok = bias->floating() && bias->dims.size() == 1 && bias->dims[0] == w->dims[0];
      if (!ok) bn.reset();
    }
    if (bn) {
      cur = g.get(*bn).outputs[0];
      interior.push_back(*bn);
    }
    const detail::epilogue_match e = detail::match_epilogue(m, cur, false, true, true, true);
    if (!bn && !e.any()) continue;
    interior.insert(interior.end(), e.nodes.begin(), e.nodes.end());
    if (bn) {
      const double eps = g.get(*bn).get_float("epsilon", 1e-5);
      const std::size_t ch = static_cast<std::size_t>(w->dims[0]);
      const std::size_t per = w->numel() / std::max<std::size_t>(ch, 1);
      detail::folded_tensor w2 = *w, b2;
      b2.type = w->type;
      b2.dims = {static_cast<std::int64_t>(ch)};
      b2.f.resize(ch);
      for (std::size_t c = 0; c < ch; ++c) {
        const double s = sc->f[c] / std::sqrt(var->f[c] + eps);
        for (std::size_t k = 0; k < per; ++k) w2.f[c * per + k] = w->f[c * per + k] * s;
        b2.f[c] = ((bias ? bias->f[c] : 0.0) - mean->f[c]) * s + sh->f[c];
      }
      // Rounded once, to the weight's dtype (to_bytes converts from the double results).
      W = g.add_constant(detail::fresh_value_name(g, g.get(W).name + "_bn"), w2.type, w2.dims, detail::to_bytes(w2));
      B = g.add_constant(detail::fresh_value_name(g, n.name + "_bn_bias"), b2.type, b2.dims, detail::to_bytes(b2));
    }
    std::vector<value_id> in{n.inputs[0], W, B, e.residual};
    while (in.back() == value_id::none) in.pop_back();
    attribute_map attrs = n.attributes;
    if (!e.activation.empty()) attrs["activation"] = e.activation;
    detail::rewriter rw{g};
    const auto f = rw.add("FusedConv", std::string(detail::fused_domain), n.name + "_fused", in, {e.result}, std::move(attrs));
    if (!f) {
      g.remove_unused_constants();
      continue;
    }
    rw.commit(*f, {e.result}, interior);
    ++fused;
  }
  return fused;
}

}  // namespace graph
}  // namespace v0
}  // namespace tessel
