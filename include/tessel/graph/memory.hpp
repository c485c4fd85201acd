// The activation memory plan of a graph: liveness over the topological order gives every
// intermediate value (a node output that is not a graph output) of known size a tensor_life, and the
// one liveness planner (device/memory_plan.hpp) places them in one arena. An elementwise op, or one
// that only relabels its input's bytes (Reshape, Flatten, Squeeze, Unsqueeze, Identity), writes in
// place over an input that dies at it when the sizes allow.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <tessel/detail/checked.hpp>
#include <tessel/device/memory_plan.hpp>
#include <tessel/graph/ir.hpp>

namespace tessel {
inline namespace v0 {
namespace graph {

// Sizes for symbolic dims ("batch" -> 8) when planning; an unbound symbol leaves its value unplanned.
using symbol_bindings = std::map<std::string, std::int64_t, std::less<>>;

struct activation_plan {
  memory_plan plan;                  // offsets, arena, lower bound, one-buffer-per-tensor total
  std::vector<value_id> values;      // plan tensor i is values[i] (in order of definition)
  std::vector<tensor_life> tensors;  // what the planner got: op indices count in `order`
  std::vector<node_id> order;        // the topological order of the lifetimes
  std::size_t unknown_size = 0;      // intermediates left out: a dtype or a dim not known

  std::optional<std::size_t> offset_of(value_id v) const {
    for (std::size_t i = 0; i < values.size(); ++i)
      if (values[i] == v) return plan.offset[i];
    return std::nullopt;
  }

  // "activations: 14 tensors (5 in place, 0 of unknown size): peak 24.00 KiB planned vs 56.00 KiB
  // one buffer per tensor vs lower bound 24.00 KiB"
  std::string report() const {
    return std::string("activations: ") + std::to_string(values.size()) + " tensors (" + std::to_string(plan.in_place) + " in place, " +
           std::to_string(unknown_size) + " of unknown size): peak " + tessel::detail::plan_format_bytes(plan.arena_bytes) + " planned vs " +
           tessel::detail::plan_format_bytes(plan.unplanned_bytes) + " one buffer per tensor vs lower bound " +
           tessel::detail::plan_format_bytes(plan.lower_bound_bytes);
  }
};

namespace detail {

// Which inputs an op may overwrite with its first output, element for element.
inline std::vector<std::size_t> in_place_inputs(const node& n) {
  if (!n.domain.empty() && n.domain != "ai.onnx") return {};
  static constexpr std::string_view unary[] = {"Relu", "Gelu", "Erf", "Tanh", "Sigmoid", "Exp", "Log", "Sqrt", "Neg", "Abs", "Reciprocal", "Identity",
                                               "Dropout", "Cast", "Ceil", "Floor", "Sin", "Cos",
                                               // bytes relabelled, not changed
                                               "Reshape", "Flatten", "Squeeze", "Unsqueeze"};
  static constexpr std::string_view binary[] = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean"};
  for (std::string_view op : unary)
    if (op == n.op) return {0};
  for (std::string_view op : binary)
    if (op == n.op) {
      std::vector<std::size_t> all(n.inputs.size());
      for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
      return all;
    }
  return {};
}

// Element count with symbols bound; nullopt when a dim stays unknown. Overflow names the value.
inline std::optional<std::size_t> bound_numel(const value& x, const symbol_bindings& symbols) {
  if (!x.type || !x.shape.rank_known) return std::nullopt;
  try {
    std::size_t n = 1;
    for (const dim& d : x.shape.dims) {
      std::int64_t s = d.size;
      if (!d.known()) {
        auto it = d.symbol.empty() ? symbols.end() : symbols.find(d.symbol);
        if (it == symbols.end()) return std::nullopt;
        if (it->second < 0) throw graph_error(x.label() + ": symbol '" + d.symbol + "' is bound to " + std::to_string(it->second));
        s = it->second;
      }
      n = tessel::detail::mul_checked(n, static_cast<std::size_t>(s), "graph: element count");
    }
    (void)tessel::detail::mul_checked(n, dtype_size(*x.type), "graph: bytes");  // the caller multiplies
    return n;
  } catch (const overflow_error& e) { throw graph_error(errc::overflow, x.label() + ": " + x.type_info().to_string() + ": size " + e.what()); }
}

}  // namespace detail

// Plans every intermediate value of known size (with `symbols` bound) over g's topological order.
// Graph inputs, constants and graph outputs stay outside the arena (the caller owns them).
inline activation_plan plan_activations(const graph& g, const plan_options& opt = {}, const symbol_bindings& symbols = {}) {
  activation_plan r;
  r.order = g.topological_order();
  constexpr std::size_t none = static_cast<std::size_t>(-1);
  std::vector<std::size_t> at;  // node index -> position in the order
  for (std::size_t i = 0; i < r.order.size(); ++i) {
    const std::size_t k = index_of(r.order[i]);
    if (at.size() <= k) at.resize(k + 1, none);
    at[k] = i;
  }
  std::map<value_id, std::size_t> planned;  // value -> its tensor index
  std::vector<std::size_t> elems;           // per tensor
  std::vector<char> taken;                  // per tensor: already given away in place
  for (std::size_t i = 0; i < r.order.size(); ++i) {
    const node& n = g.get(r.order[i]);
    for (std::size_t slot = 0; slot < n.outputs.size(); ++slot) {
      const value_id v = n.outputs[slot];
      if (v == value_id::none) continue;
      const value& x = g.get(v);
      if (x.is_output) continue;
      const auto numel = detail::bound_numel(x, symbols);
      if (!numel) {
        ++r.unknown_size;
        continue;
      }
      tensor_life t;
      t.bytes = *numel * dtype_size(*x.type);  // checked in bound_numel
      t.first = t.last = i;
      for (const use& u : x.consumers) t.last = std::max(t.last, at[index_of(u.node)]);
      t.name = x.name;
      if (slot == 0)
        for (std::size_t s : detail::in_place_inputs(n)) {
          if (s >= n.inputs.size() || n.inputs[s] == value_id::none) continue;
          auto it = planned.find(n.inputs[s]);
          if (it == planned.end()) continue;
          const std::size_t k = it->second;
          const value& y = g.get(n.inputs[s]);
          // Element for element: same count and element size (a broadcast input is smaller), and the
          // input dies here.
          if (taken[k] || r.tensors[k].last != i || elems[k] != *numel || dtype_size(*y.type) != dtype_size(*x.type)) continue;
          t.reuse_input = k;
          taken[k] = 1;
          break;
        }
      planned.emplace(v, r.tensors.size());
      r.values.push_back(v);
      r.tensors.push_back(std::move(t));
      elems.push_back(*numel);
      taken.push_back(0);
    }
  }
  r.plan = plan_memory(r.tensors, opt);
  return r;
}

}  // namespace graph
}  // namespace v0
}  // namespace tessel
