// The typed graph IR that importers build and passes rewrite: values (graph inputs, constants, node
// outputs) with a dtype and a shape whose dims may be unknown or symbolic ("batch"), nodes with an
// ONNX op type and attributes, and the graph that owns both. Nodes refer to values by name, so an
// importer may add them in any order; verify() then says what is wrong, naming the node or value.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <queue>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <tessel/detail/checked.hpp>
#include <tessel/graph/errors.hpp>
#include <tessel/types/dtype.hpp>

namespace tessel {
inline namespace v0 {
namespace graph {

// ---- dims and shapes ------------------------------------------------------------------------------

// One dim: a size >= 0, or unknown (-1), optionally named by a symbol that equal unknown dims share
// ("batch"). `dim(8)`, `dim("batch")` and `dim()` (anonymous unknown) read well in shape lists.
struct dim {
  std::int64_t size = -1;
  std::string symbol;

  dim() = default;
  template <std::integral I>
  requires(!std::same_as<I, bool>) dim(I n) : size(static_cast<std::int64_t>(n)) {}  // NOLINT: implicit, for {2, "batch", 8}
  dim(const char* sym) : symbol(sym) {}                                              // NOLINT
  dim(std::string sym) : symbol(std::move(sym)) {}                                   // NOLINT

  bool known() const { return size >= 0; }
  bool symbolic() const { return !known() && !symbol.empty(); }
  std::string to_string() const { return known() ? std::to_string(size) : symbol.empty() ? std::string("?") : symbol; }
  friend bool operator==(const dim&, const dim&) = default;
};

// A shape: a list of dims, or an unknown rank (what an op without a shape rule produces).
struct tensor_shape {
  std::vector<dim> dims;
  bool rank_known = true;

  tensor_shape() = default;  // a scalar
  tensor_shape(std::initializer_list<dim> d) : dims(d) {}
  explicit tensor_shape(std::vector<dim> d) : dims(std::move(d)) {}
  static tensor_shape unknown_rank() {
    tensor_shape s;
    s.rank_known = false;
    return s;
  }

  std::size_t rank() const { return dims.size(); }
  bool fully_known() const {
    return rank_known && std::all_of(dims.begin(), dims.end(), [](const dim& d) { return d.known(); });
  }
  // The element count when every dim is known; overflow_error (errc::overflow) when it would wrap.
  std::optional<std::size_t> numel() const {
    if (!fully_known()) return std::nullopt;
    std::size_t n = 1;
    for (const dim& d : dims) n = tessel::detail::mul_checked(n, static_cast<std::size_t>(d.size), "graph: element count");
    return n;
  }
  // "[2,batch,?]", "[]" for a scalar, "[*]" for an unknown rank.
  std::string to_string() const {
    if (!rank_known) return "[*]";
    std::string s = "[";
    for (std::size_t i = 0; i < dims.size(); ++i) s += std::string(i ? "," : "") + dims[i].to_string();
    return s + "]";
  }
  friend bool operator==(const tensor_shape&, const tensor_shape&) = default;
};

// A value's type: an element type (unknown after an op without a shape rule) and a shape.
struct tensor_type {
  std::optional<dtype> type;
  tensor_shape shape = tensor_shape::unknown_rank();
  std::string to_string() const { return std::string(type ? dtype_name(*type) : "?") + shape.to_string(); }
  friend bool operator==(const tensor_type&, const tensor_type&) = default;
};

// ONNX's TensorProto element codes. ONNX's BOOL maps to u8 (one byte per value, 0 or 1): tessel has
// no bool dtype. INT4/UINT4 are left out: ONNX counts their elements in values, i4x2 in pairs.
inline std::optional<dtype> dtype_from_onnx(std::int64_t code) {
  switch (code) {
    case 1: return dtype::f32;
    case 2: return dtype::u8;
    case 3: return dtype::i8;
    case 4: return dtype::u16;
    case 5: return dtype::i16;
    case 6: return dtype::i32;
    case 7: return dtype::i64;
    case 9: return dtype::u8;
    case 10: return dtype::fp16;
    case 11: return dtype::f64;
    case 12: return dtype::u32;
    case 13: return dtype::u64;
    case 16: return dtype::bf16;
    case 17: return dtype::e4m3;
    case 19: return dtype::e5m2;
    default: return std::nullopt;
  }
}

// The dtype ONNX's bool values take in this IR (Equal's output, Where's condition, Dropout's mask).
inline constexpr dtype bool_dtype = dtype::u8;

// ---- ids ----------------------------------------------------------------------------------------------

// Indices into the graph's value and node tables; `none` marks an absent optional input or output.
enum class value_id : std::uint32_t { none = 0xffffffffu };
enum class node_id : std::uint32_t { none = 0xffffffffu };
constexpr std::size_t index_of(value_id v) { return static_cast<std::size_t>(v); }
constexpr std::size_t index_of(node_id n) { return static_cast<std::size_t>(n); }

// One read of a value: node `node` takes it as input number `slot`.
struct use {
  node_id node = node_id::none;
  std::size_t slot = 0;
  friend bool operator==(const use&, const use&) = default;
};

// ---- attributes ---------------------------------------------------------------------------------------

using ints = std::vector<std::int64_t>;
using floats = std::vector<double>;
using strings = std::vector<std::string>;
// ONNX's attribute kinds that a shape rule reads (tensors and graphs are the importer's business:
// a tensor-valued Constant becomes a graph constant).
using attribute = std::variant<std::int64_t, double, std::string, ints, floats, strings>;
using attribute_map = std::map<std::string, attribute, std::less<>>;

inline std::string_view attribute_kind(const attribute& a) {
  constexpr std::string_view names[] = {"an int", "a float", "a string", "a list of ints", "a list of floats", "a list of strings"};
  return names[a.index()];
}

namespace detail {
template <class T>
inline constexpr std::string_view attribute_kind_of = "";
template <>
inline constexpr std::string_view attribute_kind_of<std::int64_t> = "an int";
template <>
inline constexpr std::string_view attribute_kind_of<double> = "a float";
template <>
inline constexpr std::string_view attribute_kind_of<std::string> = "a string";
template <>
inline constexpr std::string_view attribute_kind_of<ints> = "a list of ints";
template <>
inline constexpr std::string_view attribute_kind_of<floats> = "a list of floats";
template <>
inline constexpr std::string_view attribute_kind_of<strings> = "a list of strings";

inline std::string format_double(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

inline std::string attribute_to_string(const attribute& a) {
  auto list = [](const auto& v, auto fmt) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) s += std::string(i ? "," : "") + fmt(v[i]);
    return s + "]";
  };
  auto fmt_int = [](std::int64_t x) { return std::to_string(x); };
  auto fmt_str = [](const std::string& x) { return std::string("\"") + x + "\""; };
  switch (a.index()) {
    case 0: return fmt_int(std::get<0>(a));
    case 1: return format_double(std::get<1>(a));
    case 2: return fmt_str(std::get<2>(a));
    case 3: return list(std::get<3>(a), fmt_int);
    case 4: return list(std::get<4>(a), format_double);
    default: return list(std::get<5>(a), fmt_str);
  }
}
}  // namespace detail

// ---- values and nodes -----------------------------------------------------------------------------

enum class value_role : std::uint8_t {
  undefined,    // read or marked as output, but nothing defines it (yet): verify() rejects it
  input,        // a graph input
  constant,     // an initializer: its bytes are held in `data`
  node_output,  // produced by node `producer`
};

struct value {
  std::string name;
  std::optional<dtype> type;
  tensor_shape shape = tensor_shape::unknown_rank();
  value_role role = value_role::undefined;
  node_id producer = node_id::none;  // node_output only
  std::size_t producer_slot = 0;
  std::vector<use> consumers;                          // in the order the reads were added
  std::shared_ptr<const std::vector<std::byte>> data;  // constant only: numel * dtype_size bytes, row-major
  bool is_output = false;
  bool declared = false;  // the type was given (input, constant, set_value_type): inference checks against it
  bool removed = false;   // produced by a removed node; its name is free again

  tensor_type type_info() const { return {type, shape}; }
  std::string label() const { return std::string("value '") + name + "'"; }
};

struct node {
  std::string name;
  std::string op;                         // ONNX spelling: "MatMul", "Add", ...
  std::string domain;                     // "" (or "ai.onnx") for ONNX's own ops
  std::vector<value_id> inputs, outputs;  // value_id::none: an absent optional input or output
  attribute_map attributes;
  bool removed = false;

  // "MatMul 'fc1'": how every error names a node.
  std::string label() const { return op + " '" + name + "'"; }
  bool has_attribute(std::string_view key) const { return attributes.find(key) != attributes.end(); }

  // Typed getters: without a default the attribute is required; either way one of another kind is a
  // graph_error naming the node and the attribute.
  std::int64_t get_int(std::string_view key) const { return required<std::int64_t>(key); }
  std::int64_t get_int(std::string_view key, std::int64_t def) const { return optional_or<std::int64_t>(key, def); }
  double get_float(std::string_view key) const { return required<double>(key); }
  double get_float(std::string_view key, double def) const { return optional_or<double>(key, def); }
  std::string get_string(std::string_view key) const { return required<std::string>(key); }
  std::string get_string(std::string_view key, std::string def) const { return optional_or<std::string>(key, std::move(def)); }
  ints get_ints(std::string_view key) const { return required<ints>(key); }
  ints get_ints(std::string_view key, ints def) const { return optional_or<ints>(key, std::move(def)); }
  floats get_floats(std::string_view key) const { return required<floats>(key); }
  floats get_floats(std::string_view key, floats def) const { return optional_or<floats>(key, std::move(def)); }
  strings get_strings(std::string_view key) const { return required<strings>(key); }
  strings get_strings(std::string_view key, strings def) const { return optional_or<strings>(key, std::move(def)); }

 private:
  template <class T>
  const T* find_as(std::string_view key) const {
    auto it = attributes.find(key);
    if (it == attributes.end()) return nullptr;
    if (const T* p = std::get_if<T>(&it->second)) return p;
    throw graph_error(label() + ": attribute '" + std::string(key) + "' is " + std::string(attribute_kind(it->second)) + ", expected " +
                      std::string(detail::attribute_kind_of<T>));
  }
  template <class T>
  T required(std::string_view key) const {
    if (const T* p = find_as<T>(key)) return *p;
    throw graph_error(label() + ": attribute '" + std::string(key) + "' (" + std::string(detail::attribute_kind_of<T>) + ") is required");
  }
  template <class T>
  T optional_or(std::string_view key, T def) const {
    if (const T* p = find_as<T>(key)) return *p;
    return def;
  }
};

struct infer_options {
  // false: an op without a shape rule is a graph_error (errc::unsupported) naming it; true: its
  // outputs get an unknown dtype and rank, and inference goes on.
  bool allow_unknown_ops = false;
};

// ---- the graph ----------------------------------------------------------------------------------------

class graph {
 public:
  graph() = default;
  explicit graph(std::string name) : name_(std::move(name)) {}
  const std::string& name() const { return name_; }

  // -- building. Names are unique among live values and among live nodes; a name read before it is
  // defined refers to a placeholder that a later add_input / add_constant / add_node defines.

  value_id add_input(std::string name, dtype t, tensor_shape shape) {
    check_shape(name, shape, false);
    const value_id v = define(name, "graph input");
    value& x = values_[index_of(v)];
    x.role = value_role::input;
    x.type = t;
    x.shape = std::move(shape);
    x.declared = true;
    inputs_.push_back(v);
    return v;
  }

  // A constant (ONNX initializer) of `t` with all-known `dims`; `bytes` must hold exactly
  // numel * dtype_size(t) bytes (i4x2 counts pairs), row-major.
  value_id add_constant(std::string name, dtype t, std::vector<std::int64_t> dims, std::shared_ptr<const std::vector<std::byte>> bytes) {
    tensor_shape shape;
    for (std::int64_t d : dims) shape.dims.emplace_back(d);
    check_shape(name, shape, true);
    const std::size_t need = bytes_of(name, t, shape);
    if (!bytes) throw graph_error(std::string("constant '") + name + "': no bytes (a null pointer)");
    if (bytes->size() != need)
      throw graph_error(std::string("constant '") + name + "': holds " + std::to_string(bytes->size()) + " bytes, " + std::string(dtype_name(t)) +
                        shape.to_string() + " needs " + std::to_string(need));
    const value_id v = define(name, "constant");
    value& x = values_[index_of(v)];
    x.role = value_role::constant;
    x.type = t;
    x.shape = std::move(shape);
    x.data = std::move(bytes);
    x.declared = true;
    constants_.push_back(v);
    return v;
  }

  // The same from typed values (copied).
  template <dtype_element T>
  value_id add_constant(std::string name, std::vector<std::int64_t> dims, const std::vector<T>& values) {
    auto bytes = std::make_shared<std::vector<std::byte>>(tessel::detail::mul_checked(values.size(), sizeof(T), "graph: constant bytes"));
    if (!values.empty()) std::memcpy(bytes->data(), values.data(), bytes->size());
    return add_constant(std::move(name), dtype_of<T>, std::move(dims), std::move(bytes));
  }

  // A 1-D i64 constant: the shape of a Reshape, the axes of an Unsqueeze, ...
  value_id add_constant_ints(std::string name, const ints& values) {
    return add_constant<std::int64_t>(std::move(name), {static_cast<std::int64_t>(values.size())}, values);
  }

  // A node reading `inputs` and defining `outputs` (by name; "" is an absent optional one). An empty
  // `name` gets "<op>_<n>". Rejects a duplicate node name and an output that something else defines.
  node_id add_node(std::string op, std::string name, const std::vector<std::string>& inputs, const std::vector<std::string>& outputs,
                   attribute_map attributes = {}, std::string domain = {}) {
    if (op.empty()) throw graph_error(std::string("node '") + name + "': empty op type");
    if (name.empty()) {
      for (std::size_t k = nodes_.size();; ++k) {
        name = op + "_" + std::to_string(k);
        if (!node_by_name_.count(name)) break;
      }
    }
    const std::string label = op + " '" + name + "'";
    if (auto it = node_by_name_.find(name); it != node_by_name_.end())
      throw graph_error(std::string("duplicate node name: ") + label + " and " + nodes_[index_of(it->second)].label());
    // Validate every output before changing anything (a failed add leaves the graph as it was).
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].empty()) continue;
      for (std::size_t j = 0; j < i; ++j)
        if (outputs[j] == outputs[i]) throw graph_error(label + ": output '" + outputs[i] + "' is listed twice");
      if (auto v = find_value(outputs[i]); v && values_[index_of(*v)].role != value_role::undefined)
        throw graph_error(label + ": output '" + outputs[i] + "' is already " + definition_of(*v) + " (a value has one producer)");
    }
    check_room(nodes_.size(), "nodes");
    check_room(values_.size() + inputs.size() + outputs.size(), "values");

    const node_id id = static_cast<node_id>(nodes_.size());
    node n;
    n.name = std::move(name);
    n.op = std::move(op);
    n.domain = std::move(domain);
    n.attributes = std::move(attributes);
    for (std::size_t slot = 0; slot < inputs.size(); ++slot) {
      if (inputs[slot].empty()) {
        n.inputs.push_back(value_id::none);
        continue;
      }
      const value_id v = intern(inputs[slot]);
      values_[index_of(v)].consumers.push_back({id, slot});
      n.inputs.push_back(v);
    }
    for (std::size_t slot = 0; slot < outputs.size(); ++slot) {
      if (outputs[slot].empty()) {
        n.outputs.push_back(value_id::none);
        continue;
      }
      const value_id v = intern(outputs[slot]);
      value& x = values_[index_of(v)];
      x.role = value_role::node_output;
      x.producer = id;
      x.producer_slot = slot;
      n.outputs.push_back(v);
    }
    node_by_name_.emplace(n.name, id);
    nodes_.push_back(std::move(n));
    return id;
  }

  // Marks a value (perhaps not defined yet) as a graph output, in call order.
  value_id mark_output(std::string_view name) {
    check_room(values_.size() + 1, "values");
    const value_id v = intern(name);
    value& x = values_[index_of(v)];
    if (x.is_output) throw graph_error(x.label() + ": already a graph output");
    x.is_output = true;
    outputs_.push_back(v);
    return v;
  }

  // Declares a value's type (an importer's value_info): inference then checks its result against it.
  void set_value_type(value_id v, std::optional<dtype> t, tensor_shape shape) {
    value& x = live_value(v);
    if (x.role == value_role::constant) throw graph_error(x.label() + ": a constant's type is fixed by its bytes");
    check_shape(x.name, shape, false);
    x.type = t;
    x.shape = std::move(shape);
    x.declared = true;
  }

  // -- lookups

  const value& get(value_id v) const { return const_cast<graph&>(*this).live_value(v); }
  const node& get(node_id n) const { return const_cast<graph&>(*this).live_node(n); }
  std::optional<value_id> find_value(std::string_view name) const {
    auto it = value_by_name_.find(name);
    return it == value_by_name_.end() ? std::nullopt : std::optional<value_id>(it->second);
  }
  std::optional<node_id> find_node(std::string_view name) const {
    auto it = node_by_name_.find(name);
    return it == node_by_name_.end() ? std::nullopt : std::optional<node_id>(it->second);
  }
  value_id value_named(std::string_view name) const {
    if (auto v = find_value(name)) return *v;
    throw graph_error(errc::out_of_range, std::string("value '") + std::string(name) + "': no such value");
  }
  node_id node_named(std::string_view name) const {
    if (auto n = find_node(name)) return *n;
    throw graph_error(errc::out_of_range, std::string("node '") + std::string(name) + "': no such node");
  }
  const std::vector<value_id>& inputs() const { return inputs_; }
  const std::vector<value_id>& constants() const { return constants_; }
  const std::vector<value_id>& outputs() const { return outputs_; }
  // Live nodes in the order they were added.
  std::vector<node_id> node_ids() const {
    std::vector<node_id> r;
    for (std::size_t i = 0; i < nodes_.size(); ++i)
      if (!nodes_[i].removed) r.push_back(static_cast<node_id>(i));
    return r;
  }
  std::size_t node_count() const { return node_by_name_.size(); }
  std::size_t value_count() const { return value_by_name_.size(); }
  // How many live nodes run each op, by op name.
  std::map<std::string, std::size_t, std::less<>> count_by_op() const {
    std::map<std::string, std::size_t, std::less<>> c;
    for (const node& n : nodes_)
      if (!n.removed) ++c[n.op];
    return c;
  }

  // numel * dtype_size when the dtype and every dim are known (i4x2 counts pairs); a graph_error with
  // errc::overflow naming the value when that would wrap.
  std::optional<std::size_t> byte_size(value_id v) const {
    const value& x = get(v);
    if (!x.type || !x.shape.fully_known()) return std::nullopt;
    return bytes_of(x.name, *x.type, x.shape);
  }

  // The values of an integer constant (i64, i32) or of a Constant node's value_int / value_ints: what
  // Reshape's shape, Unsqueeze's axes and Slice's starts read. nullopt when not known here.
  std::optional<ints> constant_ints(value_id v) const {
    const value& x = get(v);
    if (x.role == value_role::constant && x.data && x.type && x.shape.fully_known()) {
      const auto n = x.shape.numel();
      if (*x.type == dtype::i64 && x.data->size() == *n * 8) return read_ints<std::int64_t>(*x.data, *n);
      if (*x.type == dtype::i32 && x.data->size() == *n * 4) return read_ints<std::int32_t>(*x.data, *n);
      return std::nullopt;
    }
    if (x.role == value_role::node_output) {
      const node& p = nodes_[index_of(x.producer)];
      if (p.op == "Constant" && (p.domain.empty() || p.domain == "ai.onnx")) {
        auto it = p.attributes.find("value_ints");
        if (it != p.attributes.end() && std::holds_alternative<ints>(it->second)) return std::get<ints>(it->second);
        it = p.attributes.find("value_int");
        if (it != p.attributes.end() && std::holds_alternative<std::int64_t>(it->second)) return ints{std::get<std::int64_t>(it->second)};
      }
    }
    return std::nullopt;
  }

  // -- analysis

  // Kahn's algorithm; among the ready nodes the earliest added runs first, so the order depends only
  // on the graph. A cycle is a graph_error that lists one, node by node.
  std::vector<node_id> topological_order() const {
    const std::size_t n = nodes_.size();
    std::vector<std::size_t> waiting(n, 0);  // inputs whose producer has not run yet
    std::size_t live = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (nodes_[i].removed) continue;
      ++live;
      for (value_id v : nodes_[i].inputs)
        if (v != value_id::none && values_[index_of(v)].role == value_role::node_output) ++waiting[i];
    }
    std::priority_queue<std::size_t, std::vector<std::size_t>, std::greater<>> ready;
    for (std::size_t i = 0; i < n; ++i)
      if (!nodes_[i].removed && waiting[i] == 0) ready.push(i);
    std::vector<node_id> order;
    order.reserve(live);
    while (!ready.empty()) {
      const std::size_t i = ready.top();
      ready.pop();
      order.push_back(static_cast<node_id>(i));
      for (value_id v : nodes_[i].outputs) {
        if (v == value_id::none) continue;
        for (const use& u : values_[index_of(v)].consumers)
          if (--waiting[index_of(u.node)] == 0) ready.push(index_of(u.node));
      }
    }
    if (order.size() != live) throw_cycle(waiting);
    return order;
  }

  // Every rule of the IR, the first broken one as a graph_error: names unique, every read value
  // defined (by exactly one node, graph input or constant), every graph output defined, constants
  // holding exactly their bytes, no cycle.
  void verify() const {
    if (outputs_.empty()) throw graph_error(std::string("graph '") + name_ + "': no graph outputs");
    std::map<std::string_view, std::size_t> seen;
    for (std::size_t i = 0; i < values_.size(); ++i) {
      const value& x = values_[i];
      if (x.removed) continue;
      if (x.name.empty()) throw graph_error(std::string("value #") + std::to_string(i) + ": empty name");
      if (!seen.emplace(x.name, i).second) throw graph_error(x.label() + ": duplicate value name");
      if (x.role == value_role::constant) {
        const std::size_t need = bytes_of(x.name, *x.type, x.shape);
        const std::size_t have = x.data ? x.data->size() : 0;
        if (have != need)
          throw graph_error(std::string("constant '") + x.name + "': holds " + std::to_string(have) + " bytes, " + x.type_info().to_string() +
                            " needs " + std::to_string(need));
      }
      if (x.role == value_role::node_output) {
        const node& p = nodes_[index_of(x.producer)];
        if (p.removed || x.producer_slot >= p.outputs.size() || p.outputs[x.producer_slot] != static_cast<value_id>(i))
          throw graph_error(x.label() + ": its producer " + p.label() + " does not list it as an output");
      }
    }
    seen.clear();
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      const node& n = nodes_[i];
      if (n.removed) continue;
      if (!seen.emplace(n.name, i).second) throw graph_error(n.label() + ": duplicate node name");
      for (std::size_t slot = 0; slot < n.inputs.size(); ++slot) {
        const value_id v = n.inputs[slot];
        if (v == value_id::none) continue;
        const value& x = values_[index_of(v)];
        if (x.removed) throw graph_error(n.label() + ": input " + std::to_string(slot) + " reads removed " + x.label());
        if (x.role == value_role::undefined)
          throw graph_error(n.label() + ": input '" + x.name + "' is not defined by any node, graph input or constant");
      }
      for (value_id v : n.outputs)
        if (v != value_id::none && values_[index_of(v)].producer != static_cast<node_id>(i))
          throw graph_error(n.label() + ": output '" + values_[index_of(v)].name + "' has another producer");
    }
    for (value_id v : outputs_) {
      const value& x = values_[index_of(v)];
      if (x.removed || x.role == value_role::undefined)
        throw graph_error(std::string("graph output '") + x.name + "' is not defined by any node, graph input or constant");
    }
    (void)topological_order();
  }

  // Shape and dtype inference over the topological order (rules: shape_inference.hpp). Values with a
  // declared type are checked against the result; others take it.
  void infer_shapes(const infer_options& opt = {});

  // One line per node in topological order (insertion order if there is a cycle):
  //   graph mlp(%x: f32[batch,16])
  //     const %w1: f32[16,32]
  //     %h: f32[batch,32] = MatMul(%x, %w1)  # fc1
  //     %y: f32[batch,4] = Gemm(%h, %w2, %b2) {transB=1}  # fc2
  //   return %y
  std::string to_string() const {
    auto ref = [&](value_id v) { return v == value_id::none ? std::string("_") : std::string("%") + values_[index_of(v)].name; };
    auto typed = [&](value_id v) { return v == value_id::none ? std::string("_") : ref(v) + ": " + values_[index_of(v)].type_info().to_string(); };
    std::string s = std::string("graph ") + (name_.empty() ? std::string("main") : name_) + "(";
    for (std::size_t i = 0; i < inputs_.size(); ++i) s += std::string(i ? ", " : "") + typed(inputs_[i]);
    s += ")\n";
    for (value_id c : constants_)
      if (!values_[index_of(c)].removed) s += std::string("  const ") + typed(c) + "\n";
    std::vector<node_id> order;
    try {
      order = topological_order();
    } catch (const graph_error&) { order = node_ids(); }
    for (node_id id : order) {
      const node& n = nodes_[index_of(id)];
      s += "  ";
      for (std::size_t i = 0; i < n.outputs.size(); ++i) s += std::string(i ? ", " : "") + typed(n.outputs[i]);
      s += n.outputs.empty() ? "" : " = ";
      s += (n.domain.empty() ? std::string() : n.domain + "::") + n.op + "(";
      for (std::size_t i = 0; i < n.inputs.size(); ++i) s += std::string(i ? ", " : "") + ref(n.inputs[i]);
      s += ")";
      if (!n.attributes.empty()) {
        s += " {";
        bool first = true;
        for (const auto& [k, a] : n.attributes) {
          s += std::string(first ? "" : ", ") + k + "=" + detail::attribute_to_string(a);
          first = false;
        }
        s += "}";
      }
      s += std::string("  # ") + n.name + "\n";
    }
    s += "return";
    for (std::size_t i = 0; i < outputs_.size(); ++i) s += std::string(i ? ", " : " ") + ref(outputs_[i]);
    return s + "\n";
  }

  // -- rewiring (what fusion passes use)

  // Makes input `slot` of node `n` read `v` (value_id::none: absent).
  void set_input(node_id n, std::size_t slot, value_id v) {
    node& x = live_node(n);
    if (slot >= x.inputs.size())
      throw graph_error(errc::out_of_range,
                        x.label() + ": input slot " + std::to_string(slot) + " out of range (" + std::to_string(x.inputs.size()) + " inputs)");
    if (v != value_id::none) (void)live_value(v);
    drop_use(x.inputs[slot], {n, slot});
    x.inputs[slot] = v;
    if (v != value_id::none) values_[index_of(v)].consumers.push_back({n, slot});
  }

  // Every read of `from` (except by node `except`) reads `to` instead, and if `from` is a graph
  // output, `to` takes its place. Returns how many reads moved.
  std::size_t replace_all_uses(value_id from, value_id to, node_id except = node_id::none) {
    value& f = live_value(from);
    value& t = live_value(to);
    if (from == to) return 0;
    if (f.is_output && t.is_output) throw graph_error(f.label() + ": cannot replace a graph output by " + t.label() + ", already a graph output");
    std::vector<use> keep, moved;
    for (const use& u : f.consumers) (u.node == except ? keep : moved).push_back(u);
    for (const use& u : moved) {
      nodes_[index_of(u.node)].inputs[u.slot] = to;
      t.consumers.push_back(u);
    }
    f.consumers = std::move(keep);
    if (f.is_output) {
      std::replace(outputs_.begin(), outputs_.end(), from, to);
      f.is_output = false;
      t.is_output = true;
    }
    return moved.size();
  }

  // Removes one node whose outputs nobody reads and none of which is a graph output.
  void remove_node(node_id n) {
    const node& x = live_node(n);
    for (value_id v : x.outputs) {
      if (v == value_id::none) continue;
      const value& y = values_[index_of(v)];
      if (!y.consumers.empty())
        throw graph_error(std::string("cannot remove ") + x.label() + ": its output '" + y.name + "' is read by " +
                          nodes_[index_of(y.consumers.front().node)].label());
      if (y.is_output) throw graph_error(std::string("cannot remove ") + x.label() + ": its output '" + y.name + "' is a graph output");
    }
    erase_node(n);
  }

  // Removes every node none of whose outputs leads to a graph output; returns how many.
  std::size_t remove_dead_nodes() {
    std::vector<char> alive(nodes_.size(), 0);
    std::vector<value_id> todo(outputs_.begin(), outputs_.end());
    while (!todo.empty()) {
      const value& x = values_[index_of(todo.back())];
      todo.pop_back();
      if (x.role != value_role::node_output || alive[index_of(x.producer)]) continue;
      alive[index_of(x.producer)] = 1;
      for (value_id v : nodes_[index_of(x.producer)].inputs)
        if (v != value_id::none) todo.push_back(v);
    }
    std::size_t removed = 0;
    for (std::size_t i = 0; i < nodes_.size(); ++i)
      if (!nodes_[i].removed && !alive[i]) {
        erase_node(static_cast<node_id>(i));
        ++removed;
      }
    return removed;
  }

  // Removes every constant that no node reads and that is not a graph output (what folding leaves
  // behind); returns how many.
  std::size_t remove_unused_constants() {
    std::size_t removed = 0;
    std::vector<value_id> keep;
    for (value_id c : constants_) {
      value& x = values_[index_of(c)];
      if (x.removed) continue;
      if (!x.consumers.empty() || x.is_output) {
        keep.push_back(c);
        continue;
      }
      x.removed = true;
      x.data.reset();
      value_by_name_.erase(x.name);
      ++removed;
    }
    constants_ = std::move(keep);
    return removed;
  }

  // Whether an id names a live (not removed) node or value: what a pass checks before revisiting one.
  bool contains(node_id n) const { return index_of(n) < nodes_.size() && !nodes_[index_of(n)].removed; }
  bool contains(value_id v) const { return index_of(v) < values_.size() && !values_[index_of(v)].removed; }

  void rename_value(value_id v, std::string name) {
    value& x = live_value(v);
    if (name == x.name) return;
    if (name.empty()) throw graph_error(x.label() + ": cannot take an empty name");
    if (auto other = find_value(name)) throw graph_error(x.label() + ": cannot take the name of " + values_[index_of(*other)].label());
    value_by_name_.erase(x.name);
    x.name = std::move(name);
    value_by_name_.emplace(x.name, v);
  }

 private:
  std::string name_;
  std::vector<value> values_;
  std::vector<node> nodes_;
  std::map<std::string, value_id, std::less<>> value_by_name_;
  std::map<std::string, node_id, std::less<>> node_by_name_;
  std::vector<value_id> inputs_, constants_, outputs_;

  static void check_room(std::size_t count, const char* what) {
    if (count >= 0xffffffffu) throw graph_error(errc::capacity, std::string("graph: too many ") + what + " (ids are 32-bit)");
  }

  value& live_value(value_id v) {
    if (index_of(v) >= values_.size())
      throw graph_error(errc::out_of_range,
                        std::string("value id ") + std::to_string(index_of(v)) + " out of range (" + std::to_string(values_.size()) + " values)");
    value& x = values_[index_of(v)];
    if (x.removed) throw graph_error(errc::out_of_range, x.label() + ": removed");
    return x;
  }
  node& live_node(node_id n) {
    if (index_of(n) >= nodes_.size())
      throw graph_error(errc::out_of_range,
                        std::string("node id ") + std::to_string(index_of(n)) + " out of range (" + std::to_string(nodes_.size()) + " nodes)");
    node& x = nodes_[index_of(n)];
    if (x.removed) throw graph_error(errc::out_of_range, x.label() + ": removed");
    return x;
  }

  // The live value called `name`, or a new undefined placeholder.
  value_id intern(std::string_view name) {
    if (auto v = find_value(name)) return *v;
    const value_id v = static_cast<value_id>(values_.size());
    value x;
    x.name = std::string(name);
    values_.push_back(std::move(x));
    value_by_name_.emplace(std::string(name), v);
    return v;
  }

  // Turns `name` into a defined value (a fresh one or a placeholder read before); a second definition
  // is an error naming the first.
  value_id define(const std::string& name, const char* what) {
    if (name.empty()) throw graph_error(std::string("a ") + what + " needs a name");
    if (auto v = find_value(name)) {
      if (values_[index_of(*v)].role != value_role::undefined)
        throw graph_error(std::string(what) + " '" + name + "': the name is already " + definition_of(*v));
      return *v;
    }
    check_room(values_.size() + 1, "values");
    return intern(name);
  }

  std::string definition_of(value_id v) const {
    const value& x = values_[index_of(v)];
    switch (x.role) {
      case value_role::input: return "a graph input";
      case value_role::constant: return "a constant";
      case value_role::node_output: return std::string("the output of ") + nodes_[index_of(x.producer)].label();
      case value_role::undefined: break;
    }
    return "undefined";
  }

  static void check_shape(const std::string& name, const tensor_shape& s, bool constant) {
    if (!s.rank_known) {
      if (constant) throw graph_error(std::string("value '") + name + "': a constant needs a known rank");
      return;
    }
    for (std::size_t i = 0; i < s.dims.size(); ++i) {
      const dim& d = s.dims[i];
      const std::string where = std::string("value '") + name + "': dim " + std::to_string(i);
      if (d.size < -1) throw graph_error(where + " is " + std::to_string(d.size) + " (a size >= 0, or -1: unknown)");
      if (d.known() && !d.symbol.empty()) throw graph_error(where + " has both a size and a symbol ('" + d.symbol + "')");
      if (constant && !d.known()) throw graph_error(where + ": a constant's dims must be known");
    }
  }

  static std::size_t bytes_of(const std::string& name, dtype t, const tensor_shape& s) {
    try {
      return tessel::detail::mul_checked(*s.numel(), dtype_size(t), "graph: bytes");
    } catch (const overflow_error& e) {
      throw graph_error(errc::overflow, std::string("value '") + name + "': " + std::string(dtype_name(t)) + s.to_string() + ": size " + e.what());
    }
  }

  template <class T>
  static ints read_ints(const std::vector<std::byte>& b, std::size_t n) {
    ints r(n);
    for (std::size_t i = 0; i < n; ++i) {
      T x;
      std::memcpy(&x, b.data() + i * sizeof(T), sizeof(T));
      r[i] = static_cast<std::int64_t>(x);
    }
    return r;
  }

  void drop_use(value_id v, use u) {
    if (v == value_id::none) return;
    auto& c = values_[index_of(v)].consumers;
    if (auto it = std::find(c.begin(), c.end(), u); it != c.end()) c.erase(it);  // gone when v's producer went first
  }

  void erase_node(node_id n) {
    node& x = nodes_[index_of(n)];
    for (std::size_t slot = 0; slot < x.inputs.size(); ++slot) drop_use(x.inputs[slot], {n, slot});
    for (value_id v : x.outputs) {
      if (v == value_id::none) continue;
      value& y = values_[index_of(v)];
      y.removed = true;
      y.consumers.clear();
      value_by_name_.erase(y.name);
    }
    node_by_name_.erase(x.name);
    x.removed = true;
  }

  // Every node left by Kahn's algorithm waits for a producer that is also left, so walking from one
  // to such a producer must come back to a node already walked: that loop is a cycle.
  [[noreturn]] void throw_cycle(const std::vector<std::size_t>& waiting) const {
    std::size_t start = 0;
    while (nodes_[start].removed || waiting[start] == 0) ++start;
    std::vector<std::size_t> path, pos(nodes_.size(), static_cast<std::size_t>(-1));
    std::size_t at = start;
    while (pos[at] == static_cast<std::size_t>(-1)) {
      pos[at] = path.size();
      path.push_back(at);
      for (value_id v : nodes_[at].inputs) {
        if (v == value_id::none) continue;
        const value& x = values_[index_of(v)];
        if (x.role == value_role::node_output && waiting[index_of(x.producer)] > 0) {
          at = index_of(x.producer);
          break;
        }
      }
    }
    // path[pos[at]..] walks against the data flow: reverse it, and start at the earliest added node.
    std::vector<std::size_t> cycle(path.rbegin(), path.rend() - static_cast<std::ptrdiff_t>(pos[at]));
    std::rotate(cycle.begin(), std::min_element(cycle.begin(), cycle.end()), cycle.end());
    std::string s = std::string("graph has a cycle: ");
    for (std::size_t k : cycle) s += nodes_[k].label() + " -> ";
    throw graph_error(s + nodes_[cycle.front()].label());
  }
};

}  // namespace graph
}  // namespace v0
}  // namespace tessel

#include <tessel/graph/shape_inference.hpp>  // graph::infer_shapes
