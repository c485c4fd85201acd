// The graph executor: graph::compile binds a graph's symbolic dims, infers every shape, plans the
// activations in one arena (graph/memory.hpp) and builds one step per node for a device (host_device
// or an emulated card: the same code path as the operators); executable::run takes inputs by name
// and returns outputs by name. Kernels: detail/exec_kernels.hpp (CNN ops: detail/exec_cnn.hpp).
//
//   auto exe = graph::compile(g, dev, {.symbols = {{"batch", 8}}});
//   graph::tensor_map out = exe.run({{"x", graph::host_tensor::of<float>({8, 16}, x)}});
//
// Dtypes: values keep their graph dtypes (f32 activations; i64/i32 shape and index operands; u8
// bools). compile_options::compute = bf16 rounds GEMM, attention and convolution inputs (MatMul,
// Gemm, FusedMatMul, Attention, Conv, FusedConv) to bf16 and accumulates in f32 (constant operands —
// weights, filters — are converted once, at compile); every other op and every stored activation stays f32.
// Conv filters that are constants are packed for ops::conv2d once, at compile. Graph inputs are copied into device memory for a run; constants are read in
// place; graph outputs are written to device buffers of their own and copied out.
// An executable is not reentrant: one run at a time (its arena is shared by the runs).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <tessel/detail/checked.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/graph/detail/exec_kernels.hpp>
#include <tessel/graph/ir.hpp>
#include <tessel/graph/memory.hpp>
#include <tessel/graph/shape_inference.hpp>

namespace tessel {
inline namespace v0 {
namespace graph {

// A tensor in host memory: dtype, shape, row-major bytes.
struct host_tensor {
  dtype type = dtype::f32;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;

  std::size_t numel() const {
    std::size_t n = 1;
    for (std::int64_t d : shape) n = tessel::detail::mul_checked(n, static_cast<std::size_t>(d), "host_tensor: element count");
    return n;
  }
  template <dtype_element T>
  static host_tensor of(std::vector<std::int64_t> shape, const std::vector<T>& values) {
    host_tensor t;
    t.type = dtype_of<T>;
    t.shape = std::move(shape);
    if (t.numel() != values.size())
      throw graph_error(std::string("host_tensor: ") + std::to_string(values.size()) + " values for " + std::to_string(t.numel()) + " elements");
    t.data.resize(values.size() * sizeof(T));
    if (!values.empty()) std::memcpy(t.data.data(), values.data(), t.data.size());
    return t;
  }
  // The values as T (T must be the tensor's dtype).
  template <dtype_element T>
  std::vector<T> values() const {
    if (dtype_of<T> != type)
      throw graph_error(std::string("host_tensor: holds ") + std::string(dtype_name(type)) + ", read as " + std::string(dtype_name(dtype_of<T>)));
    std::vector<T> v(data.size() / sizeof(T));
    if (!v.empty()) std::memcpy(v.data(), data.data(), data.size());
    return v;
  }
};

using tensor_map = std::map<std::string, host_tensor, std::less<>>;

struct compile_options {
  symbol_bindings symbols;     // sizes of the symbolic dims ("batch" -> 8)
  dtype compute = dtype::f32;  // f32, or bf16 for GEMM/attention inputs (f32 accumulation)
  bool plan_memory = true;     // false: one device buffer per intermediate (for comparison)
  bool poison_freed = false;   // before each step, fill arena bytes no live value holds with NaN (0xff)
  plan_options plan{};         // the planner's alignment and in-place switch
};

template <device Dev>
class executable;

template <device Dev>
executable<Dev> compile(const graph& g, Dev& dev, const compile_options& opt = {});

template <device Dev>
class executable {
 public:
  // Runs the graph: `inputs` must name every graph input exactly once, with its dtype and bound shape.
  tensor_map run(const tensor_map& inputs) {
    check_inputs(inputs);
    std::vector<std::byte*> ptr(values_, nullptr);
    // graph inputs: copied into device memory; constants: in place
    std::vector<device_buffer<std::byte, Dev>> in_bufs;
    for (value_id v : g_.inputs()) {
      const host_tensor& t = inputs.find(g_.get(v).name)->second;
      in_bufs.emplace_back(*dev_, std::max<std::size_t>(t.data.size(), 1));
      if (!t.data.empty()) dev_->copy(t.data.data(), in_bufs.back().data(), t.data.size());
      ptr[index_of(v)] = in_bufs.back().data();
    }
    for (value_id v : g_.constants())
      if (!g_.get(v).removed) ptr[index_of(v)] = const_cast<std::byte*>(g_.get(v).data->data());
    for (std::size_t i = 0; i < outputs_.size(); ++i) ptr[index_of(outputs_[i])] = out_bufs_[i].data();
    for (std::size_t i = 0; i < act_.values.size(); ++i)
      ptr[index_of(act_.values[i])] = opt_.plan_memory ? arena_.data() + act_.plan.offset[i] : own_bufs_[i].data();
    // a graph output that is an input or a constant is copied into its buffer
    for (std::size_t i = 0; i < outputs_.size(); ++i) {
      const value& x = g_.get(outputs_[i]);
      if (x.role == value_role::node_output) continue;
      const std::byte* src = x.role == value_role::constant ? x.data->data() : ptr[index_of(outputs_[i])];
      if (x.role == value_role::input) src = in_bufs[input_slot(outputs_[i])].data();
      if (out_bytes_[i]) dev_->copy(src, out_bufs_[i].data(), out_bytes_[i]);
      ptr[index_of(outputs_[i])] = out_bufs_[i].data();
    }
    const detail::exec::run_state<Dev> st{*dev_, ptr};
    for (std::size_t k = 0; k < steps_.size(); ++k) {
      if (opt_.poison_freed && opt_.plan_memory) poison_before(k);
      try {
        steps_[k](st);
      } catch (const graph_error&) { throw; } catch (const error& x) {  // an operator's own error: say which node ran it
        throw graph_error(x.code(), labels_[k] + ": " + x.what());
      }
    }
    dev_->synchronize();
    tensor_map out;
    for (std::size_t i = 0; i < outputs_.size(); ++i) {
      const value& x = g_.get(outputs_[i]);
      host_tensor t;
      t.type = *x.type;
      for (std::size_t d : shapes_[index_of(outputs_[i])]) t.shape.push_back(static_cast<std::int64_t>(d));
      t.data.resize(out_bytes_[i]);
      if (out_bytes_[i]) dev_->copy(out_bufs_[i].data(), t.data.data(), out_bytes_[i]);
      out.emplace(x.name, std::move(t));
    }
    return out;
  }

  // The activation plan (offsets by value, arena size, what one buffer per tensor would take).
  const activation_plan& activations() const { return act_; }
  // Bytes of the arena this executable holds (0 when compiled with plan_memory = false).
  std::size_t arena_bytes() const { return arena_.size(); }
  // The arena offset of a value, if it has one (a map, not the plan's linear search).
  std::optional<std::size_t> offset_of(value_id v) const {
    auto it = offset_.find(v);
    return it == offset_.end() ? std::nullopt : std::optional<std::size_t>(it->second);
  }
  // The graph as compiled: symbols bound, every shape inferred.
  const graph& bound_graph() const { return g_; }
  // A value's bound shape.
  std::vector<std::size_t> shape_of(std::string_view name) const { return shapes_[index_of(g_.value_named(name))]; }

 private:
  friend executable compile<Dev>(const graph&, Dev&, const compile_options&);
  executable(Dev& dev, const compile_options& opt) : dev_(&dev), opt_(opt) {}

  Dev* dev_;
  compile_options opt_;
  graph g_;
  std::size_t values_ = 0;                     // value table size (ids index it)
  std::vector<detail::exec::shape_t> shapes_;  // per value index
  activation_plan act_;
  std::map<value_id, std::size_t> offset_;
  device_buffer<std::byte, Dev> arena_;
  std::vector<device_buffer<std::byte, Dev>> own_bufs_;  // plan_memory = false: one per planned value
  std::vector<value_id> outputs_;
  std::vector<std::size_t> out_bytes_;
  std::vector<device_buffer<std::byte, Dev>> out_bufs_;
  std::vector<detail::exec::step_fn<Dev>> steps_;  // in act_.order
  std::vector<std::string> labels_;                // the node of each step

  std::size_t input_slot(value_id v) const {
    const auto& in = g_.inputs();
    return static_cast<std::size_t>(std::find(in.begin(), in.end(), v) - in.begin());
  }

  void check_inputs(const tensor_map& inputs) const {
    for (const auto& [name, t] : inputs) {
      auto v = g_.find_value(name);
      if (!v || g_.get(*v).role != value_role::input)
        throw graph_error(errc::invalid_argument, std::string("input '") + name + "': the graph has no such input");
    }
    for (value_id v : g_.inputs()) {
      const value& x = g_.get(v);
      auto it = inputs.find(x.name);
      if (it == inputs.end()) throw graph_error(errc::invalid_argument, std::string("input '") + x.name + "' is missing");
      const host_tensor& t = it->second;
      const auto& want = shapes_[index_of(v)];
      bool same = t.shape.size() == want.size();
      for (std::size_t i = 0; same && i < want.size(); ++i) same = t.shape[i] >= 0 && static_cast<std::size_t>(t.shape[i]) == want[i];
      std::string ws = "[";
      for (std::size_t i = 0; i < want.size(); ++i) ws += std::string(i ? "," : "") + std::to_string(want[i]);
      ws += "]";
      if (t.type != *x.type)
        throw graph_error(errc::invalid_argument, std::string("input '") + x.name + "' is " + std::string(dtype_name(t.type)) + ", the graph takes " +
                                                      std::string(dtype_name(*x.type)) + ws);
      if (!same) {
        std::string ts = "[";
        for (std::size_t i = 0; i < t.shape.size(); ++i) ts += std::string(i ? "," : "") + std::to_string(t.shape[i]);
        throw graph_error(errc::invalid_argument,
                          std::string("input '") + x.name + "' has shape " + ts + "], the graph takes " + ws + " (symbols as bound at compile)");
      }
      const std::size_t need = tessel::detail::mul_checked(t.numel(), dtype_size(t.type), "graph: input bytes");
      if (t.data.size() != need)
        throw graph_error(errc::invalid_argument, std::string("input '") + x.name + "' holds " + std::to_string(t.data.size()) +
                                                      " bytes, its shape needs " + std::to_string(need));
    }
  }

  // Fills with NaN the arena bytes no value live across step k holds (poison_free_bytes).
  void poison_before(std::size_t k) { poison_free_bytes(std::span<std::byte>(arena_.data(), arena_.size()), act_.tensors, act_.plan, k); }
};

template <device Dev>
executable<Dev> compile(const graph& source, Dev& dev, const compile_options& opt) {
  if (opt.compute != dtype::f32 && opt.compute != dtype::bf16)
    throw graph_error(errc::unsupported, std::string("compile: compute dtype ") + std::string(dtype_name(opt.compute)) + " (f32 or bf16)");
  executable<Dev> e(dev, opt);
  graph& g = e.g_;
  g = source;
  g.verify();
  // bind the inputs' symbols, then infer every shape with them
  for (value_id v : g.inputs()) {
    const value& x = g.get(v);
    if (!x.shape.rank_known) throw graph_error(errc::invalid_argument, std::string("input '") + x.name + "' has an unknown rank");
    tensor_shape s;
    for (const dim& d : x.shape.dims) {
      if (d.known()) {
        s.dims.emplace_back(d.size);
        continue;
      }
      auto it = d.symbol.empty() ? opt.symbols.end() : opt.symbols.find(d.symbol);
      if (it == opt.symbols.end())
        throw graph_error(errc::invalid_argument,
                          std::string("input '") + x.name + "' " + x.shape.to_string() + ": " +
                              (d.symbol.empty() ? std::string("an anonymous unknown dim") : "symbol '" + d.symbol + "' is not bound"));
      if (it->second < 0)
        throw graph_error(errc::invalid_argument,
                          std::string("input '") + x.name + "': symbol '" + d.symbol + "' is bound to " + std::to_string(it->second));
      s.dims.emplace_back(it->second);
    }
    g.set_value_type(v, x.type, std::move(s));
  }
  g.infer_shapes();
  // every value's bound shape
  std::size_t count = 0;
  for (node_id n : g.node_ids())
    for (value_id v : g.get(n).outputs)
      if (v != value_id::none) count = std::max(count, index_of(v) + 1);
  for (value_id v : g.inputs()) count = std::max(count, index_of(v) + 1);
  for (value_id v : g.constants()) count = std::max(count, index_of(v) + 1);
  for (value_id v : g.outputs()) count = std::max(count, index_of(v) + 1);
  e.values_ = count;
  e.shapes_.assign(count, {});
  auto bind = [&](value_id v) {
    const value& x = g.get(v);
    if (!x.type || !x.shape.fully_known())
      throw graph_error(errc::unsupported,
                        x.label() + ": " + x.type_info().to_string() +
                            " is not known after binding the symbols (a shape computed at run time); the executor needs static shapes");
    detail::exec::shape_t s;
    for (const dim& d : x.shape.dims) s.push_back(static_cast<std::size_t>(d.size));
    e.shapes_[index_of(v)] = std::move(s);
  };
  for (value_id v : g.inputs()) bind(v);
  for (value_id v : g.constants())
    if (!g.get(v).removed) bind(v);
  for (node_id n : g.node_ids())
    for (value_id v : g.get(n).outputs)
      if (v != value_id::none) bind(v);
  // the activation plan, its offsets by value, the arena (or one buffer per value)
  e.act_ = plan_activations(g, opt.plan, {});
  if (e.act_.unknown_size)
    throw graph_error(errc::unsupported, std::string("compile: ") + std::to_string(e.act_.unknown_size) + " intermediates of unknown size");
  for (std::size_t i = 0; i < e.act_.values.size(); ++i) e.offset_.emplace(e.act_.values[i], e.act_.plan.offset[i]);
  if (opt.plan_memory) {
    e.arena_ = device_buffer<std::byte, Dev>(dev, e.act_.plan.arena_bytes);
  } else {
    for (const tensor_life& t : e.act_.tensors) e.own_bufs_.emplace_back(dev, std::max<std::size_t>(t.bytes, 1));
  }
  for (value_id v : g.outputs()) {
    e.outputs_.push_back(v);
    const std::size_t bytes =
        tessel::detail::mul_checked(detail::exec::numel_of(e.shapes_[index_of(v)]), dtype_size(*g.get(v).type), "graph: output bytes");
    e.out_bytes_.push_back(bytes);
    e.out_bufs_.emplace_back(dev, std::max<std::size_t>(bytes, 1));
  }
  // one step per node, in the plan's order
  for (node_id id : e.act_.order) {
    const node& n = g.get(id);
    const detail::exec::build_ctx c{g, n, e.shapes_, opt.compute};
    try {
      e.steps_.push_back(detail::exec::build_step<Dev>(c, dev));
      e.labels_.push_back(n.label());
    } catch (const graph_error&) { throw; } catch (const error& x) {
      throw graph_error(errc::invalid_argument, n.label() + ": " + x.what());
    }
  }
  return e;
}

}  // namespace graph
}  // namespace v0
}  // namespace tessel
