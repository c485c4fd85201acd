// The graph executor's kernels: one builder per op kind that reads the node's attributes and its
// values' bound shapes once, at compile time, and returns the step that runs it. Steps call tessel's
// operators where one exists (GEMM with epilogue chains, attention, layer/RMS norm, softmax, GELU)
// and otherwise simple loops over ranges on the device's workers (each output element computed by
// one worker, in a fixed order: results do not depend on the worker count).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <tessel/device/device_buffer.hpp>
#include <tessel/graph/detail/exec_cnn.hpp>
#include <tessel/graph/detail/exec_support.hpp>
#include <tessel/graph/ir.hpp>
#include <tessel/graph/shape_inference.hpp>
#include <tessel/ops/activation.hpp>
#include <tessel/ops/attention.hpp>
#include <tessel/ops/batchnorm.hpp>
#include <tessel/ops/conv.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/norm.hpp>
#include <tessel/ops/pool.hpp>
#include <tessel/ops/softmax.hpp>

namespace tessel {
inline namespace v0 {
namespace graph {
namespace detail::exec {

// What a step sees when it runs: the device and every value's bytes (by value index).
template <class Dev>
struct run_state {
  Dev& dev;
  const std::vector<std::byte*>& ptr;
  std::byte* at(value_id v) const { return ptr[index_of(v)]; }
  template <class T>
  T* as(value_id v) const {
    return reinterpret_cast<T*>(ptr[index_of(v)]);
  }
};

template <class Dev>
using step_fn = std::function<void(const run_state<Dev>&)>;

// What a builder sees: the node, and every value's dtype and bound shape.
struct build_ctx {
  const graph& g;
  const node& n;
  const std::vector<shape_t>& shapes;  // per value index
  dtype compute;                       // f32, or bf16 for GEMM/attention inputs

  [[noreturn]] void fail(const std::string& msg, errc code = errc::unsupported) const { throw graph_error(code, n.label() + ": " + msg); }
  bool has(std::size_t i) const { return i < n.inputs.size() && n.inputs[i] != value_id::none; }
  bool has_out(std::size_t i) const { return i < n.outputs.size() && n.outputs[i] != value_id::none; }
  value_id in(std::size_t i) const {
    if (!has(i)) fail("input " + std::to_string(i) + " is required", errc::invalid_argument);
    return n.inputs[i];
  }
  value_id out(std::size_t i = 0) const { return n.outputs.at(i); }
  const shape_t& shape(value_id v) const { return shapes[index_of(v)]; }
  dtype type(value_id v) const { return *g.get(v).type; }
  const shape_t& in_shape(std::size_t i) const { return shape(in(i)); }
  dtype in_type(std::size_t i) const { return type(in(i)); }
  void need_f32(std::size_t i) const {
    if (in_type(i) != dtype::f32)
      fail(std::string("input '") + g.get(in(i)).name + "' is " + std::string(dtype_name(in_type(i))) + "; the executor runs this op on f32");
  }
  // The f32 values of input i when it is a graph constant (weights), else null.
  const float* const_f32(std::size_t i) const {
    if (!has(i)) return nullptr;
    const value& v = g.get(in(i));
    if (v.role != value_role::constant || !v.data || !v.type || *v.type != dtype::f32) return nullptr;
    return reinterpret_cast<const float*>(v.data->data());
  }
  // A constant integer operand (Slice's starts, Reduce's axes, ...).
  ints const_operand(std::size_t i, std::string_view what) const {
    auto v = g.constant_ints(in(i));
    if (!v) fail(std::string(what) + " '" + g.get(in(i)).name + "' is computed at run time; the executor needs it constant");
    return *v;
  }
  std::size_t axis(std::int64_t a, std::size_t rank) const {
    const auto r = static_cast<std::int64_t>(rank);
    if (a < -r || a >= r) fail("axis " + std::to_string(a) + " out of range for rank " + std::to_string(rank), errc::out_of_range);
    return static_cast<std::size_t>(a < 0 ? a + r : a);
  }
};

inline std::size_t prod(const shape_t& s, std::size_t b, std::size_t e) {
  std::size_t p = 1;
  for (std::size_t i = b; i < e; ++i) p = tessel::detail::mul_checked(p, s[i], "graph executor: element count");
  return p;
}

// ---- activations (FusedMatMul/FusedConv's `activation`; the same functions as the epilogues) --------

enum class act_kind : std::uint8_t { none, relu, gelu, gelu_tanh, sigmoid, tanh, silu };

inline act_kind parse_act(const build_ctx& c) {
  const std::string a = c.n.get_string("activation", "");
  if (a.empty()) return act_kind::none;
  if (a == "Relu") return act_kind::relu;
  if (a == "Gelu") return act_kind::gelu;
  if (a == "GeluTanh") return act_kind::gelu_tanh;
  if (a == "Sigmoid") return act_kind::sigmoid;
  if (a == "Tanh") return act_kind::tanh;
  if (a == "Silu") return act_kind::silu;
  c.fail("activation '" + a + "' is not one of '', Relu, Gelu, GeluTanh, Sigmoid, Tanh, Silu");
}

inline float sigmoid1(float x) { return 1.0f / (1.0f + std::exp(-x)); }

inline void apply_act(float* v, std::size_t n, act_kind a) {
  switch (a) {
    case act_kind::none: return;
    case act_kind::relu: arch::math::relu_inplace(v, n); return;
    case act_kind::gelu: arch::math::gelu_erf_inplace(v, n); return;
    case act_kind::gelu_tanh: arch::math::gelu_tanh_inplace(v, n); return;
    case act_kind::silu: arch::math::silu_inplace(v, n); return;
    case act_kind::sigmoid:
      for (std::size_t j = 0; j < n; ++j) v[j] = sigmoid1(v[j]);
      return;
    case act_kind::tanh:
      for (std::size_t j = 0; j < n; ++j) v[j] = std::tanh(v[j]);
      return;
  }
}

// The tail of every GEMM-shaped node (MatMul, FusedMatMul, Gemm, Attention by parts, Conv,
// FusedConv) as one epilogue op: v += bias[col]; v += residual(row, col); v = act(v), each part
// optional. One op type for all of them means the executor instantiates each GEMM and convolution
// program once per dtype, not once per combination of parts (a third of the code it generated).
// The residual is a row-major (rows, ld) matrix, or, for a convolution, an NCHW image of the
// output's dims (row = pixel n·H·W + q, column = output channel).
struct graph_tail : epilogue::op_base {
  const float* bias = nullptr;  // one value per column, or null
  const float* res = nullptr;   // the residual, or null
  std::size_t ld = 0;           // matrix residual: its row stride
  std::size_t plane = 0;        // NCHW residual: H·W of the output; 0: the residual is a matrix
  std::size_t channels = 0;     // NCHW residual: the output's channels
  act_kind act = act_kind::none;
  void apply(float* v, std::size_t n, const epilogue::row_info& ri) const {
    if (bias)
      for (std::size_t j = 0; j < n; ++j) v[j] += bias[ri.col0 + j];
    if (res && plane) {
      const std::size_t img = ri.row / plane, q = ri.row % plane;
      const float* r = res + (img * channels + ri.col0) * plane + q;
      for (std::size_t j = 0; j < n; ++j) v[j] += r[j * plane];
    } else if (res) {
      const float* r = res + ri.row * ld + ri.col0;
      for (std::size_t j = 0; j < n; ++j) v[j] += r[j];
    }
    apply_act(v, n, act);
  }
};
using tail_chain = epilogue::chain<graph_tail>;
inline tail_chain tail_of(const graph_tail& t = {}) { return tail_chain{std::tuple<graph_tail>(t)}; }

// The same tail as a pass over y (any shape), bias and residual broadcast one way to y's shape.
template <class Dev>
void tail_pass(Dev& dev, float* y, const shape_t& ys, const float* bias, const shape_t& bs, const float* res, const shape_t& rs, act_kind act) {
  const bcast b(ys, {bias ? bs : shape_t{}, res ? rs : shape_t{}});
  auto body = [&](std::size_t lo, std::size_t hi) {
    b.for_range(lo, hi, [&](std::size_t i, const std::size_t* off) {
      float v = y[i];
      if (bias) v += bias[off[0]];
      if (res) v += res[off[1]];
      y[i] = v;
    });
    apply_act(y + lo, hi - lo, act);
  };
  parallel_for(dev, numel_of(ys), 4096, body);
}

// ---- GEMM --------------------------------------------------------------------------------------------

template <class Dev>
device_buffer<bf16, Dev> to_bf16(Dev& dev, const float* x, std::size_t n) {
  device_buffer<bf16, Dev> b(dev, n);
  bf16* p = b.data();
  parallel_for(dev, n, 1 << 14, [&](std::size_t lo, std::size_t hi) {
    for (std::size_t i = lo; i < hi; ++i) p[i] = bf16(x[i]);
  });
  return b;
}

// A constant f32 operand converted to bf16 once, at compile time, when the compute dtype is bf16
// (weights are graph constants: a run then converts only its activations). Shared by the step's copies.
template <class Dev>
std::shared_ptr<const device_buffer<bf16, Dev>> const_bf16(const build_ctx& c, Dev& dev, std::size_t i, std::size_t n) {
  const float* p = c.compute == dtype::bf16 ? c.const_f32(i) : nullptr;
  if (!p || n == 0) return nullptr;
  return std::make_shared<const device_buffer<bf16, Dev>>(to_bf16(dev, p, n));
}

// C[b] (M,N) = alpha·A[b]·B[b] for b < batch, C contiguous; A[b] at A + a_off[b] (ld K), B[b] at
// B + b_off[b] (ld N). bf16 compute: A and B rounded to bf16 first, accumulated in f32. K == 0 gives
// zeros without the epilogue (callers run their tail as a pass then). a16p / b16p, when given, are
// A and B already in bf16 (constant weights converted at compile time).
template <class Dev>
void matmul_run(Dev& dev, dtype compute, std::size_t M, std::size_t N, std::size_t K, float alpha, const float* A, std::size_t a_numel,
                const std::vector<std::size_t>& a_off, const float* B, std::size_t b_numel, const std::vector<std::size_t>& b_off, float* C,
                const tail_chain& ep, const bf16* a16p = nullptr, const bf16* b16p = nullptr) {
  const std::size_t batch = a_off.size();
  if (K == 0) {
    std::fill_n(C, batch * M * N, 0.0f);
    return;
  }
  auto go = [&]<class T>(const T* a, const T* b) {
    if (batch == 1) {
      gemm(dev, transpose::none, transpose::none, M, N, K, alpha, a + a_off[0], K, b + b_off[0], N, 0.0f, C, N, ep);
      return;
    }
    std::vector<const T*> ap(batch), bp(batch);
    std::vector<float*> cp(batch);
    for (std::size_t i = 0; i < batch; ++i) {
      ap[i] = a + a_off[i];
      bp[i] = b + b_off[i];
      cp[i] = C + i * M * N;
    }
    gemm_batched(dev, transpose::none, transpose::none, M, N, K, alpha, ap.data(), K, bp.data(), N, 0.0f, cp.data(), N, batch, ep);
  };
  if (compute == dtype::bf16) {  // a16p / b16p: operands converted once at compile time (constants)
    std::optional<device_buffer<bf16, Dev>> a16, b16;
    if (!a16p) a16p = a16.emplace(to_bf16(dev, A, a_numel)).data();
    if (!b16p) b16p = b16.emplace(to_bf16(dev, B, b_numel)).data();
    go(a16p, b16p);
  } else {
    go(A, B);
  }
}

// MatMul's geometry with numpy broadcasting: M, N, K, and per output matrix the offsets of its A and B.
struct matmul_geom {
  std::size_t M = 0, N = 0, K = 0;
  std::vector<std::size_t> a_off, b_off;
};

inline matmul_geom matmul_geometry(const shape_t& as, const shape_t& bs) {
  shape_t a = as, b = bs;
  if (a.size() == 1) a.insert(a.begin(), 1);
  if (b.size() == 1) b.push_back(1);
  matmul_geom g;
  g.M = a[a.size() - 2];
  g.K = a.back();
  g.N = b.back();
  const shape_t ab(a.begin(), a.end() - 2), bb(b.begin(), b.end() - 2);
  const std::size_t bprod = prod(bb, 0, bb.size());
  if (bprod == 1) {  // B is one matrix: A's batch folds into M (one GEMM over all rows)
    g.M = tessel::detail::mul_checked(g.M, prod(ab, 0, ab.size()), "graph executor: rows");
    g.a_off = {0};
    g.b_off = {0};
    return g;
  }
  shape_t ob(std::max(ab.size(), bb.size()));
  for (std::size_t k = 0; k < ob.size(); ++k) {
    const std::size_t da = k < ab.size() ? ab[ab.size() - 1 - k] : 1, db = k < bb.size() ? bb[bb.size() - 1 - k] : 1;
    ob[ob.size() - 1 - k] = da == 1 ? db : da;
  }
  const bcast bc(ob, {ab, bb});
  const std::size_t count = numel_of(ob);
  g.a_off.resize(count);
  g.b_off.resize(count);
  bc.for_range(0, count, [&](std::size_t i, const std::size_t* off) {
    g.a_off[i] = off[0] * g.M * g.K;
    g.b_off[i] = off[1] * g.K * g.N;
  });
  return g;
}

// ---- attention -----------------------------------------------------------------------------------------

// Attention by parts (an additive mask, or head dims the fused operator does not take): scores by
// a batched GEMM, the mask (and the causal rule) added by softmax, then P·V by a batched GEMM.
template <class Dev>
void attention_by_parts(Dev& dev, dtype compute, std::size_t B, std::size_t Hq, std::size_t Hkv, std::size_t Sq, std::size_t Sk, std::size_t D,
                        std::size_t Dv, float scale, bool causal, const float* q, const float* k, const float* v, const float* mask,
                        const shape_t& mask_shape, float* o) {
  const std::size_t mats = B * Hq, rows = mats * Sq, group = Hq / Hkv;
  device_buffer<float, Dev> s(dev, std::max<std::size_t>(rows * Sk, 1)), p(dev, std::max<std::size_t>(rows * Sk, 1));
  auto kv_of = [&](std::size_t m) { return (m / Hq) * Hkv + (m % Hq) / group; };
  auto run = [&]<class T>(const T* qq, const T* kk, const T* vv, const T* pp) {
    std::vector<const T*> ap(mats), bp(mats);
    std::vector<float*> cp(mats);
    for (std::size_t m = 0; m < mats; ++m) {
      ap[m] = qq + m * Sq * D;
      bp[m] = kk + kv_of(m) * Sk * D;
      cp[m] = s.data() + m * Sq * Sk;
    }
    if (!pp) {
      gemm_batched(dev, transpose::none, transpose::yes, Sq, Sk, D, 1.0f, ap.data(), D, bp.data(), D, 0.0f, cp.data(), Sk, mats, tail_of());
      return;
    }
    for (std::size_t m = 0; m < mats; ++m) {
      ap[m] = pp + m * Sq * Sk;
      bp[m] = vv + kv_of(m) * Sk * Dv;
      cp[m] = o + m * Sq * Dv;
    }
    gemm_batched(dev, transpose::none, transpose::none, Sq, Dv, Sk, 1.0f, ap.data(), Sk, bp.data(), Dv, 0.0f, cp.data(), Dv, mats, tail_of());
  };
  if (D == 0) std::fill_n(s.data(), rows * Sk, 0.0f);
  // the additive mask, broadcast to (B, Hq, Sq, Sk), with the causal rule folded in (bottom-right)
  device_buffer<float, Dev> mk(dev, (mask || causal) ? std::max<std::size_t>(rows * Sk, 1) : 0);
  if (mask || causal) {
    const bcast bc({B, Hq, Sq, Sk}, {mask ? mask_shape : shape_t{}});
    float* mp = mk.data();
    const std::size_t step = bc.inner(0);
    parallel_for(dev, rows * Sk, 4096, [&](std::size_t lo, std::size_t hi) {
      bc.for_runs(lo, hi, [&](std::size_t i, const std::size_t* off, std::size_t len) {  // a run lies in one row
        float* row = mp + i;
        if (mask)
          for (std::size_t t = 0; t < len; ++t) row[t] = mask[off[0] + t * step];
        else
          std::fill_n(row, len, 0.0f);
        if (!causal) return;
        // column c is masked when c + Sq > qi + Sk (bottom-right): from c = qi + Sk + 1 - Sq on, or all of them
        const std::size_t qi = i / Sk % Sq, kj = i % Sk, lim = qi + Sk + 1, first = lim > Sq ? lim - Sq : 0;
        for (std::size_t t = first > kj ? first - kj : 0; t < len; ++t) row[t] = -std::numeric_limits<float>::infinity();
      });
    });
  }
  softmax_options so;
  so.scale = scale;
  if (mask || causal) so.mask = tensor<const float, 2>(mk.data(), rows, Sk);
  if (compute == dtype::bf16) {
    const auto q16 = to_bf16(dev, q, B * Hq * Sq * D), k16 = to_bf16(dev, k, B * Hkv * Sk * D), v16 = to_bf16(dev, v, B * Hkv * Sk * Dv);
    if (D > 0) run(q16.data(), k16.data(), v16.data(), static_cast<const bf16*>(nullptr));
    if (rows && Sk) softmax_forward(dev, tensor<const float, 2>(s.data(), rows, Sk), tensor<float, 2>(p.data(), rows, Sk), so);
    const auto p16 = to_bf16(dev, p.data(), rows * Sk);
    if (Sk == 0)
      std::fill_n(o, rows * Dv, 0.0f);
    else
      run(q16.data(), k16.data(), v16.data(), p16.data());
  } else {
    if (D > 0) run(q, k, v, static_cast<const float*>(nullptr));
    if (rows && Sk) softmax_forward(dev, tensor<const float, 2>(s.data(), rows, Sk), tensor<float, 2>(p.data(), rows, Sk), so);
    if (Sk == 0)
      std::fill_n(o, rows * Dv, 0.0f);
    else
      run(q, k, v, static_cast<const float*>(p.data()));
  }
}

// ---- elementwise -----------------------------------------------------------------------------------------

template <class Dev>
step_fn<Dev> build_unary(const build_ctx& c) {
  const std::string& op = c.n.op;
  const value_id x = c.in(0), y = c.out();
  const std::size_t n = numel_of(c.shape(x));
  const dtype t = c.type(x);
  step_fn<Dev> fn;
  auto make = [&]<class T>(T, auto f) {
    fn = [x, y, n, f](const run_state<Dev>& s) {
      const T* xp = s.template as<T>(x);
      T* yp = s.template as<T>(y);
      parallel_for(s.dev, n, 8192, [&](std::size_t lo, std::size_t hi) {
        for (std::size_t i = lo; i < hi; ++i) yp[i] = f(xp[i]);
      });
    };
  };
  if (op == "Abs" || op == "Neg" || op == "Relu") {
    dispatch_arith(t, c.n, [&]<class T>(T z) {
      if (op == "Abs")
        make(z, [](T v) { return v < T(0) ? T(-v) : v; });
      else if (op == "Neg")
        make(z, [](T v) { return T(-v); });
      else
        make(z, [](T v) { return v > T(0) ? v : (v != v ? v : T(0)); });
    });
    return fn;
  }
  dispatch_float(t, c.n, [&]<class T>(T z) {
    if (op == "Ceil")
      make(z, [](T v) { return std::ceil(v); });
    else if (op == "Floor")
      make(z, [](T v) { return std::floor(v); });
    else if (op == "Sqrt")
      make(z, [](T v) { return std::sqrt(v); });
    else if (op == "Exp")
      make(z, [](T v) { return std::exp(v); });
    else if (op == "Log")
      make(z, [](T v) { return std::log(v); });
    else if (op == "Sin")
      make(z, [](T v) { return std::sin(v); });
    else if (op == "Cos")
      make(z, [](T v) { return std::cos(v); });
    else if (op == "Tanh")
      make(z, [](T v) { return std::tanh(v); });
    else if (op == "Erf")
      make(z, [](T v) { return std::erf(v); });
    else if (op == "Reciprocal")
      make(z, [](T v) { return T(1) / v; });
    else if (op == "Sigmoid")
      make(z, [](T v) { return T(1) / (T(1) + std::exp(-v)); });
    else
      c.fail("no kernel");
  });
  return fn;
}

// Add Sub Mul Div Max Min Sum Mean Equal Less Greater Pow Where: numpy broadcasting of every input.
template <class Dev>
step_fn<Dev> build_broadcast(const build_ctx& c) {
  const std::string op = c.n.op;
  const value_id y = c.out();
  std::vector<value_id> ins;
  std::vector<shape_t> shapes;
  for (std::size_t i = 0; i < c.n.inputs.size(); ++i) {
    ins.push_back(c.in(i));
    shapes.push_back(c.in_shape(i));
  }
  const bcast bc(c.shape(y), shapes);
  const std::size_t n = numel_of(c.shape(y));
  step_fn<Dev> fn;
  if (op == "Where") {
    const std::size_t es = dtype_size(c.type(y));
    fn = [=](const run_state<Dev>& s) {
      const std::uint8_t* cond = s.template as<std::uint8_t>(ins[0]);
      const std::byte *a = s.at(ins[1]), *b = s.at(ins[2]);
      std::byte* out = s.at(y);
      parallel_for(s.dev, n, 4096, [&](std::size_t lo, std::size_t hi) {
        bc.for_range(lo, hi, [&](std::size_t i, const std::size_t* off) {
          if (cond[off[0]])
            copy_elem(out, i, a, off[1], es);
          else
            copy_elem(out, i, b, off[2], es);
        });
      });
    };
    return fn;
  }
  if (op == "Pow") {
    const dtype te = c.in_type(1);
    if (!castable(te)) c.fail("exponent dtype " + std::string(dtype_name(te)) + " is not supported");
    dispatch_float(c.in_type(0), c.n, [&]<class T>(T) {
      fn = [=](const run_state<Dev>& s) {
        const T* a = s.template as<T>(ins[0]);
        const std::byte* e = s.at(ins[1]);
        T* out = s.template as<T>(y);
        parallel_for(s.dev, n, 4096, [&](std::size_t lo, std::size_t hi) {
          bc.for_range(lo, hi, [&](std::size_t i, const std::size_t* off) {
            out[i] = static_cast<T>(std::pow(static_cast<double>(a[off[0]]), load_double(te, e, off[1])));
          });
        });
      };
    });
    return fn;
  }
  const bool compare = op == "Equal" || op == "Less" || op == "Greater";
  dispatch_arith(c.in_type(0), c.n, [&]<class T>(T) {
    const bool is_int = std::is_integral_v<T>;
    if (op == "Mean" && is_int) c.fail("Mean of integers is not supported");
    if (compare) {
      fn = [=](const run_state<Dev>& s) {
        const T* a = s.template as<T>(ins[0]);
        const T* b = s.template as<T>(ins[1]);
        std::uint8_t* out = s.template as<std::uint8_t>(y);
        parallel_for(s.dev, n, 4096, [&](std::size_t lo, std::size_t hi) {
          bc.for_range(lo, hi, [&](std::size_t i, const std::size_t* off) {
            const T u = a[off[0]], v = b[off[1]];
            out[i] = op[0] == 'E' ? u == v : op[0] == 'L' ? u < v : u > v;
          });
        });
      };
      return;
    }
    int kind = 0;  // 0 add, 1 sub, 2 mul, 3 div, 4 max, 5 min, 6 mean
    if (op == "Add" || op == "Sum")
      kind = 0;
    else if (op == "Sub")
      kind = 1;
    else if (op == "Mul")
      kind = 2;
    else if (op == "Div")
      kind = 3;
    else if (op == "Max")
      kind = 4;
    else if (op == "Min")
      kind = 5;
    else if (op == "Mean")
      kind = 6;
    else
      c.fail("no kernel");
    const std::size_t k = ins.size();
    const std::string label = c.n.label();
    const std::size_t s0 = k == 2 ? bc.inner(0) : 2, s1 = k == 2 ? bc.inner(1) : 2;
    fn = [=](const run_state<Dev>& s) {
      std::vector<const T*> p(k);
      for (std::size_t j = 0; j < k; ++j) p[j] = s.template as<T>(ins[j]);
      if constexpr (std::is_integral_v<T>)
        if (kind == 3)
          for (std::size_t i = 0, m = numel_of(shapes[1]); i < m; ++i)
            if (p[1][i] == T(0)) throw graph_error(errc::invalid_argument, label + ": integer division by zero");
      T* out = s.template as<T>(y);
      if (k == 2 && s0 <= 1 && s1 <= 1 && kind <= 3) {
        // Two operands each contiguous or broadcast along the innermost axis: loops the compiler
        // vectorizes, one per operation and stride pattern (the same operation per element).
        parallel_for(s.dev, n, 4096, [&](std::size_t lo, std::size_t hi) {
          bc.for_runs(lo, hi, [&](std::size_t i, const std::size_t* off, std::size_t len) {
            const T* a = p[0] + off[0];
            const T* b = p[1] + off[1];
            T* o = out + i;
            auto loop = [&](auto f) {
              if (s0 == 1 && s1 == 1)
                for (std::size_t t = 0; t < len; ++t) o[t] = f(a[t], b[t]);
              else if (s0 == 1)
                for (std::size_t t = 0; t < len; ++t) o[t] = f(a[t], b[0]);
              else if (s1 == 1)
                for (std::size_t t = 0; t < len; ++t) o[t] = f(a[0], b[t]);
              else
                for (std::size_t t = 0; t < len; ++t) o[t] = f(a[0], b[0]);
            };
            switch (kind) {
              case 0: loop([](T u, T v) { return T(u + v); }); break;
              case 1: loop([](T u, T v) { return T(u - v); }); break;
              case 2: loop([](T u, T v) { return T(u * v); }); break;
              default: loop([](T u, T v) { return T(u / v); }); break;
            }
          });
        });
        return;
      }
      parallel_for(s.dev, n, 4096, [&](std::size_t lo, std::size_t hi) {
        bc.for_range(lo, hi, [&](std::size_t i, const std::size_t* off) {
          T acc = p[0][off[0]];
          for (std::size_t j = 1; j < k; ++j) {
            const T v = p[j][off[j]];
            switch (kind) {
              case 0:
              case 6: acc = T(acc + v); break;
              case 1: acc = T(acc - v); break;
              case 2: acc = T(acc * v); break;
              case 3: acc = T(acc / v); break;
              case 4: acc = (v > acc || v != v) ? v : acc; break;
              default: acc = (v < acc || v != v) ? v : acc; break;
            }
          }
          if (kind == 6) acc = T(acc / T(k));
          out[i] = acc;
        });
      });
    };
  });
  return fn;
}

template <class Dev>
step_fn<Dev> build_cast(const build_ctx& c) {
  const value_id x = c.in(0), y = c.out();
  const dtype from = c.type(x), to = c.type(y);
  if (!castable(from) || !castable(to))
    c.fail("cast from " + std::string(dtype_name(from)) + " to " + std::string(dtype_name(to)) + " is not supported");
  const std::size_t n = numel_of(c.shape(x));
  return [=](const run_state<Dev>& s) {
    const std::byte* xp = s.at(x);
    std::byte* yp = s.at(y);
    parallel_for(s.dev, n, 8192, [&](std::size_t lo, std::size_t hi) {
      for (std::size_t i = lo; i < hi; ++i) store_double(to, yp, i, load_double(from, xp, i));
    });
  };
}

// ---- data movement ------------------------------------------------------------------------------------

// Reshape Flatten Squeeze Unsqueeze Identity Dropout: the same bytes (nothing to do when the plan
// put the output over its input).
template <class Dev>
step_fn<Dev> build_copy(const build_ctx& c) {
  const value_id x = c.in(0), y = c.out();
  const std::size_t bytes = numel_of(c.shape(x)) * dtype_size(c.type(x));
  const value_id mask = c.n.op == "Dropout" && c.has_out(1) ? c.n.outputs[1] : value_id::none;
  const std::size_t mask_n = mask == value_id::none ? 0 : numel_of(c.shape(mask));
  return [=](const run_state<Dev>& s) {
    if (s.at(x) != s.at(y) && bytes) s.dev.copy(s.at(x), s.at(y), bytes);
    if (mask != value_id::none) std::fill_n(s.template as<std::uint8_t>(mask), mask_n, std::uint8_t{1});  // inference: all kept
  };
}

// out[i] = in[base + Σ idx[a] * strides[a]] over out's shape: Transpose, Expand, Slice.
template <class Dev>
step_fn<Dev> build_gather_strided(value_id x, value_id y, shape_t out, shape_t strides, std::size_t base, std::size_t es) {
  bcast bc(out, {shape_t{}});
  bc.strides[0] = std::move(strides);
  const std::size_t n = numel_of(out);
  const std::size_t step = bc.inner(0);
  return [=](const run_state<Dev>& s) {
    const std::byte* xp = s.at(x);
    std::byte* yp = s.at(y);
    parallel_for(s.dev, n, 4096, [&](std::size_t lo, std::size_t hi) {
      bc.for_runs(lo, hi, [&](std::size_t i, const std::size_t* off, std::size_t len) {
        const std::size_t from = base + off[0];
        if (step == 1) return static_cast<void>(std::memcpy(yp + i * es, xp + from * es, len * es));
        auto run = [&]<class W>(W) {  // whole elements as one word each (offsets wrap mod 2^64 for negative steps)
          for (std::size_t t = 0; t < len; ++t) std::memcpy(yp + (i + t) * sizeof(W), xp + (from + t * step) * sizeof(W), sizeof(W));
        };
        switch (es) {
          case 1: run(std::uint8_t{}); break;
          case 2: run(std::uint16_t{}); break;
          case 4: run(std::uint32_t{}); break;
          case 8: run(std::uint64_t{}); break;
          default:
            for (std::size_t t = 0; t < len; ++t) copy_elem(yp, i + t, xp, from + t * step, es);
        }
      });
    });
  };
}

template <class Dev>
step_fn<Dev> build_transpose(const build_ctx& c) {
  const shape_t& in = c.in_shape(0);
  const std::size_t r = in.size();
  ints perm(r);
  for (std::size_t i = 0; i < r; ++i) perm[i] = static_cast<std::int64_t>(r - 1 - i);
  perm = c.n.get_ints("perm", perm);
  const shape_t st = strides_of(in);
  shape_t ps(r);
  for (std::size_t a = 0; a < r; ++a) ps[a] = st[static_cast<std::size_t>(perm[a])];
  return build_gather_strided<Dev>(c.in(0), c.out(), c.shape(c.out()), ps, 0, dtype_size(c.in_type(0)));
}

template <class Dev>
step_fn<Dev> build_expand(const build_ctx& c) {
  const bcast b(c.shape(c.out()), {c.in_shape(0)});
  return build_gather_strided<Dev>(c.in(0), c.out(), c.shape(c.out()), b.strides[0], 0, dtype_size(c.in_type(0)));
}

template <class Dev>
step_fn<Dev> build_slice(const build_ctx& c) {
  const shape_t& in = c.in_shape(0);
  const std::size_t r = in.size();
  ints starts, ends, axes, steps;
  if (c.n.inputs.size() > 1) {
    starts = c.const_operand(1, "starts");
    ends = c.const_operand(2, "ends");
    if (c.has(3)) axes = c.const_operand(3, "axes");
    if (c.has(4)) steps = c.const_operand(4, "steps");
  } else {
    starts = c.n.get_ints("starts");
    ends = c.n.get_ints("ends");
    axes = c.n.get_ints("axes", {});
  }
  if (axes.empty())
    for (std::size_t i = 0; i < starts.size(); ++i) axes.push_back(static_cast<std::int64_t>(i));
  if (steps.empty()) steps.assign(starts.size(), 1);
  const shape_t st = strides_of(in);
  shape_t ss = st;
  std::size_t base = 0;
  for (std::size_t i = 0; i < axes.size(); ++i) {
    const std::size_t a = c.axis(axes[i], r);
    const auto d = static_cast<std::int64_t>(in[a]);
    std::int64_t s0 = starts.at(i), sp = steps.at(i);
    if (s0 < 0) s0 += d;
    s0 = sp > 0 ? std::clamp<std::int64_t>(s0, 0, d) : std::clamp<std::int64_t>(s0, 0, d - 1);
    if (c.shape(c.out())[a] > 0) base += static_cast<std::size_t>(s0) * st[a];
    ss[a] = static_cast<std::size_t>(sp) * st[a];  // a negative step wraps: offsets are taken mod 2^64
  }
  return build_gather_strided<Dev>(c.in(0), c.out(), c.shape(c.out()), ss, base, dtype_size(c.in_type(0)));
}

// Concat's and Split's copies: `outer` rows of `row` bytes, each the parts' rows (value, bytes per
// row) side by side. The parallel work is pieces of at most 256 KiB of a row, not whole rows: an
// NCHW concat over channels at batch 1 is one row (U-Net's skips: a serial copy of 3-4 MiB).
// f(o, at, v, b, lo, n) copies bytes [lo, lo + n) of part v's row o (b bytes, at `at` in the row).
template <class Dev, class F>
void for_row_pieces(Dev& dev, std::size_t outer, std::size_t row, const std::vector<std::pair<value_id, std::size_t>>& parts, const F& f) {
  constexpr std::size_t piece = std::size_t{256} << 10;
  const std::size_t per = std::max<std::size_t>(1, (row + piece - 1) / piece);
  parallel_for(dev, tessel::detail::mul_checked(outer, per, "graph executor: copy pieces"), per == 1 ? 64 : 1, [&](std::size_t w0, std::size_t w1) {
    for (std::size_t w = w0; w < w1; ++w) {
      const std::size_t o = w / per, lo = w % per * piece, hi = std::min(row, lo + piece);
      std::size_t at = 0;
      for (const auto& [v, b] : parts) {
        const std::size_t s0 = std::max(lo, at), s1 = std::min(hi, at + b);
        if (s0 < s1) f(o, at, v, b, s0 - at, s1 - s0);
        at += b;
      }
    }
  });
}

template <class Dev>
step_fn<Dev> build_concat(const build_ctx& c) {
  const shape_t& out = c.shape(c.out());
  const std::size_t ax = c.axis(c.n.get_int("axis"), out.size());
  const std::size_t outer = prod(out, 0, ax), es = dtype_size(c.type(c.out()));
  const std::size_t row = prod(out, ax, out.size()) * es;  // bytes of one outer row of the output
  std::vector<std::pair<value_id, std::size_t>> parts;     // input, bytes per outer row
  for (std::size_t i = 0; i < c.n.inputs.size(); ++i) parts.emplace_back(c.in(i), prod(c.in_shape(i), ax, out.size()) * es);
  const value_id y = c.out();
  return [=](const run_state<Dev>& s) {
    std::byte* yp = s.at(y);
    for_row_pieces(s.dev, outer, row, parts, [&](std::size_t o, std::size_t at, value_id v, std::size_t b, std::size_t lo, std::size_t n) {
      std::memcpy(yp + o * row + at + lo, s.at(v) + o * b + lo, n);
    });
  };
}

template <class Dev>
step_fn<Dev> build_split(const build_ctx& c) {
  const shape_t& in = c.in_shape(0);
  const std::size_t ax = c.axis(c.n.get_int("axis", 0), in.size());
  const std::size_t outer = prod(in, 0, ax), es = dtype_size(c.in_type(0));
  const std::size_t row = prod(in, ax, in.size()) * es;
  std::vector<std::pair<value_id, std::size_t>> parts;
  for (std::size_t i = 0; i < c.n.outputs.size(); ++i) {
    const value_id v = c.n.outputs[i];
    if (v == value_id::none) c.fail("absent output " + std::to_string(i) + ": Split needs every output");
    parts.emplace_back(v, prod(c.shape(v), ax, in.size()) * es);
  }
  const value_id x = c.in(0);
  return [=](const run_state<Dev>& s) {
    const std::byte* xp = s.at(x);
    for_row_pieces(s.dev, outer, row, parts, [&](std::size_t o, std::size_t at, value_id v, std::size_t b, std::size_t lo, std::size_t n) {
      std::memcpy(s.at(v) + o * b + lo, xp + o * row + at + lo, n);
    });
  };
}

template <class Dev>
step_fn<Dev> build_gather(const build_ctx& c) {
  const shape_t& in = c.in_shape(0);
  const std::size_t ax = c.axis(c.n.get_int("axis", 0), in.size());
  const std::size_t outer = prod(in, 0, ax), inner = prod(in, ax + 1, in.size()) * dtype_size(c.in_type(0));
  const std::size_t dim = in[ax], ni = numel_of(c.in_shape(1));
  const dtype it = c.in_type(1);
  if (it != dtype::i64 && it != dtype::i32) c.fail("indices must be i64 or i32");
  const value_id x = c.in(0), idx = c.in(1), y = c.out();
  const std::string label = c.n.label();
  return [=](const run_state<Dev>& s) {
    std::vector<std::size_t> at(ni);
    for (std::size_t j = 0; j < ni; ++j) {
      std::int64_t k = it == dtype::i64 ? s.template as<std::int64_t>(idx)[j] : s.template as<std::int32_t>(idx)[j];
      if (k < -static_cast<std::int64_t>(dim) || k >= static_cast<std::int64_t>(dim))
        throw graph_error(errc::out_of_range, label + ": index " + std::to_string(k) + " is out of range for an axis of " + std::to_string(dim));
      at[j] = static_cast<std::size_t>(k < 0 ? k + static_cast<std::int64_t>(dim) : k);
    }
    const std::byte* xp = s.at(x);
    std::byte* yp = s.at(y);
    parallel_for(s.dev, outer * ni, 64, [&](std::size_t lo, std::size_t hi) {
      for (std::size_t r = lo; r < hi; ++r) {
        const std::size_t o = r / ni, j = r % ni;
        if (inner) std::memcpy(yp + r * inner, xp + (o * dim + at[j]) * inner, inner);
      }
    });
  };
}

template <class Dev>
step_fn<Dev> build_shape(const build_ctx& c) {
  const shape_t& in = c.in_shape(0);
  const auto r = static_cast<std::int64_t>(in.size());
  auto clampi = [r](std::int64_t x) { return std::clamp<std::int64_t>(x < 0 ? x + r : x, 0, r); };
  const std::int64_t b = clampi(c.n.get_int("start", 0)), e = clampi(c.n.get_int("end", r));
  std::vector<std::int64_t> v;
  for (std::int64_t i = b; i < e; ++i) v.push_back(static_cast<std::int64_t>(in[static_cast<std::size_t>(i)]));
  const value_id y = c.out();
  return [=](const run_state<Dev>& s) { std::copy(v.begin(), v.end(), s.template as<std::int64_t>(y)); };
}

template <class Dev>
step_fn<Dev> build_constant(const build_ctx& c) {
  const std::string& key = c.n.attributes.begin()->first;
  std::vector<std::byte> bytes;
  auto put = [&]<class T>(const std::vector<T>& v) {
    bytes.resize(v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(bytes.data(), v.data(), bytes.size());
  };
  if (key == "value_int")
    put(std::vector<std::int64_t>{c.n.get_int(key)});
  else if (key == "value_ints")
    put(c.n.get_ints(key));
  else if (key == "value_float")
    put(std::vector<float>{static_cast<float>(c.n.get_float(key))});
  else if (key == "value_floats") {
    std::vector<float> f;
    for (double d : c.n.get_floats(key)) f.push_back(static_cast<float>(d));
    put(f);
  } else
    c.fail("attribute '" + key + "' is not taken");
  const value_id y = c.out();
  return [=](const run_state<Dev>& s) {
    if (!bytes.empty()) std::memcpy(s.at(y), bytes.data(), bytes.size());
  };
}

// ---- reductions, softmax --------------------------------------------------------------------------

template <class Dev>
step_fn<Dev> build_reduce(const build_ctx& c) {
  const shape_t& in = c.in_shape(0);
  const std::size_t r = in.size();
  ints a;
  if (c.n.has_attribute("axes"))
    a = c.n.get_ints("axes");
  else if (c.has(1))
    a = c.const_operand(1, "axes");
  std::vector<char> red(r, 0);
  if (a.empty()) {  // every axis, unless noop_with_empty_axes
    if (c.n.get_int("noop_with_empty_axes", 0) == 0) std::fill(red.begin(), red.end(), char{1});
  } else {
    for (std::int64_t x : a) red[c.axis(x, r)] = 1;
  }
  const shape_t st = strides_of(in);
  // offsets of the reduced box, and of each output element's corner
  std::vector<std::size_t> box{0};
  shape_t kept_dims, kept_strides;
  for (std::size_t ax = 0; ax < r; ++ax) {
    if (red[ax]) {
      std::vector<std::size_t> nb;
      for (std::size_t b : box)
        for (std::size_t i = 0; i < in[ax]; ++i) nb.push_back(b + i * st[ax]);
      box = std::move(nb);
    } else {
      kept_dims.push_back(in[ax]);
      kept_strides.push_back(st[ax]);
    }
  }
  bcast corner(kept_dims, {shape_t{}});
  corner.strides[0] = kept_strides;
  const std::size_t n_out = numel_of(kept_dims);
  const std::string op = c.n.op;
  const value_id x = c.in(0), y = c.out();
  step_fn<Dev> fn;
  dispatch_arith(c.in_type(0), c.n, [&]<class T>(T) {
    fn = [=](const run_state<Dev>& s) {
      const T* xp = s.template as<T>(x);
      T* yp = s.template as<T>(y);
      parallel_for(s.dev, n_out, 64, [&](std::size_t lo, std::size_t hi) {
        corner.for_range(lo, hi, [&](std::size_t i, const std::size_t* off) {
          using A = std::conditional_t<std::is_floating_point_v<T>, double, T>;
          A acc{};
          if (op == "ReduceProd") acc = A(1);
          if (op == "ReduceMax") acc = box.empty() ? A(0) : A(xp[off[0] + box[0]]);
          if (op == "ReduceMin") acc = box.empty() ? A(0) : A(xp[off[0] + box[0]]);
          if (op == "ReduceMax" && std::is_floating_point_v<T> && box.empty()) acc = -std::numeric_limits<A>::infinity();
          if (op == "ReduceMin" && std::is_floating_point_v<T> && box.empty()) acc = std::numeric_limits<A>::infinity();
          for (std::size_t b : box) {
            const A v = A(xp[off[0] + b]);
            if (op == "ReduceSum" || op == "ReduceMean")
              acc = A(acc + v);
            else if (op == "ReduceProd")
              acc = A(acc * v);
            else if (op == "ReduceMax")
              acc = (v > acc || v != v) ? v : acc;
            else
              acc = (v < acc || v != v) ? v : acc;
          }
          if (op == "ReduceMean") acc = box.empty() ? A(0) : A(acc / A(box.size()));
          yp[i] = static_cast<T>(acc);
        });
      });
    };
  });
  return fn;
}

template <class Dev>
step_fn<Dev> build_softmax(const build_ctx& c) {
  c.need_f32(0);
  const shape_t& in = c.in_shape(0);
  const std::size_t ax = c.axis(c.n.get_int("axis", -1), in.size());
  const std::size_t outer = prod(in, 0, ax), len = in[ax], inner = prod(in, ax + 1, in.size());
  const bool log = c.n.op == "LogSoftmax";
  const value_id x = c.in(0), y = c.out();
  if (!log && inner == 1)  // the last axis: tessel's softmax operator
    return [=](const run_state<Dev>& s) {
      if (outer && len)
        softmax_forward(s.dev, tensor<const float, 2>(s.template as<float>(x), outer, len), tensor<float, 2>(s.template as<float>(y), outer, len));
    };
  return [=](const run_state<Dev>& s) {
    const float* xp = s.template as<float>(x);
    float* yp = s.template as<float>(y);
    parallel_for(s.dev, outer * inner, 16, [&](std::size_t lo, std::size_t hi) {
      for (std::size_t r = lo; r < hi; ++r) {
        const std::size_t base = (r / inner) * len * inner + r % inner;
        float m = -std::numeric_limits<float>::infinity();
        for (std::size_t k = 0; k < len; ++k) m = std::max(m, xp[base + k * inner]);
        double sum = 0;
        for (std::size_t k = 0; k < len; ++k) sum += std::exp(static_cast<double>(xp[base + k * inner]) - m);
        const double ls = std::log(sum);
        for (std::size_t k = 0; k < len; ++k) {
          const double z = static_cast<double>(xp[base + k * inner]) - m;
          yp[base + k * inner] = static_cast<float>(log ? z - ls : std::exp(z) / sum);
        }
      }
    });
  };
}

// ---- norms ----------------------------------------------------------------------------------------------

// A norm's scale or bias expanded to the `n` values of one normalized row (it broadcasts one way).
inline std::vector<float> expand_param(const float* p, const shape_t& ps, const shape_t& normalized) {
  const std::size_t n = numel_of(normalized);
  std::vector<float> v(n);
  const bcast b(normalized, {ps});
  b.for_range(0, n, [&](std::size_t i, const std::size_t* off) { v[i] = p[off[0]]; });
  return v;
}

// LayerNormalization RMSNormalization SkipLayerNormalization SkipRMSNormalization.
template <class Dev>
step_fn<Dev> build_norm(const build_ctx& c) {
  const std::string& op = c.n.op;
  const bool skip = op.rfind("Skip", 0) == 0;
  const bool rms = op.find("RMS") != std::string::npos;
  const std::size_t scale_in = skip ? 2 : 1;
  const std::size_t bias_in = rms ? 99 : scale_in + 1;
  for (std::size_t i = 0; i < c.n.inputs.size(); ++i)
    if (c.has(i)) c.need_f32(i);
  const shape_t& xs = c.in_shape(0);
  const std::size_t ax = c.axis(c.n.get_int("axis", -1), xs.size());
  const shape_t normalized(xs.begin() + static_cast<std::ptrdiff_t>(ax), xs.end());
  const std::size_t rows = prod(xs, 0, ax), n = prod(xs, ax, xs.size());
  norm_options o;
  o.eps = static_cast<float>(c.n.get_float("epsilon", 1e-5));
  const value_id x = c.in(0), y = c.out(), scale = c.in(scale_in);
  const value_id bias = c.has(bias_in) ? c.in(bias_in) : value_id::none;
  const value_id skv = skip ? c.in(1) : value_id::none;
  const shape_t scale_s = c.shape(scale), bias_s = bias == value_id::none ? shape_t{} : c.shape(bias);
  const shape_t skip_s = skip ? c.shape(skv) : shape_t{};
  const bool skip_full = skip && numel_of(skip_s) == rows * n;
  // LayerNormalization's optional outputs 1 and 2 are the mean and the inverse std dev (f32)
  const value_id mean_out = !skip && !rms && c.has_out(1) ? c.n.outputs[1] : value_id::none;
  const value_id rstd_out = !skip && !rms && c.has_out(2) ? c.n.outputs[2] : value_id::none;
  const value_id sum_out = skip && c.has_out(1) ? c.n.outputs[1] : value_id::none;
  return [=](const run_state<Dev>& s) {
    if (rows == 0) return;
    const std::vector<float> w = expand_param(s.template as<float>(scale), scale_s, normalized);
    const std::vector<float> b = bias == value_id::none ? std::vector<float>{} : expand_param(s.template as<float>(bias), bias_s, normalized);
    tensor<const float, 2> res{};
    device_buffer<float, Dev> skip_full_buf;
    if (skip) {
      if (skip_full) {
        res = tensor<const float, 2>(s.template as<float>(skv), rows, n);
      } else {  // a broadcast skip: materialize it
        skip_full_buf = device_buffer<float, Dev>(s.dev, rows * n);
        const bcast bc(xs, {skip_s});
        const float* sp = s.template as<float>(skv);
        float* dp = skip_full_buf.data();
        bc.for_range(0, rows * n, [&](std::size_t i, const std::size_t* off) { dp[i] = sp[off[0]]; });
        res = tensor<const float, 2>(dp, rows, n);
      }
    }
    const tensor<const float, 2> xt(s.template as<float>(x), rows, n);
    const tensor<float, 2> yt(s.template as<float>(y), rows, n);
    const tensor<float, 2> ht = sum_out == value_id::none ? tensor<float, 2>{} : tensor<float, 2>(s.template as<float>(sum_out), rows, n);
    const std::span<float> mean = mean_out == value_id::none ? std::span<float>{} : std::span<float>(s.template as<float>(mean_out), rows);
    const std::span<float> rstd = rstd_out == value_id::none ? std::span<float>{} : std::span<float>(s.template as<float>(rstd_out), rows);
    if (rms)
      rmsnorm_forward(s.dev, xt, std::span<const float>(w), yt, std::span<float>{}, o, res, ht);
    else
      layernorm_forward(s.dev, xt, std::span<const float>(w), std::span<const float>(b), yt, mean, rstd, o, res, ht);
  };
}

// ---- GEMM family ----------------------------------------------------------------------------------------

// Whether `bs` is a per-column bias of an (., N) product: N values along the last axis.
inline bool per_column(const shape_t& bs, std::size_t N) { return numel_of(bs) == N && (bs.empty() ? N == 1 : bs.back() == N); }

// MatMul, and FusedMatMul: Y = act(alpha·(A @ B) + bias + residual). When B is one matrix (A's
// batch folds into the rows), the bias is per column and the residual has Y's shape, the tail runs
// as one epilogue op of the GEMM; otherwise the GEMM writes the product and one pass adds the tail.
template <class Dev>
step_fn<Dev> build_matmul(const build_ctx& c, Dev& dev) {
  const bool fused = c.n.op == "FusedMatMul";
  for (std::size_t i = 0; i < c.n.inputs.size(); ++i)
    if (c.has(i)) c.need_f32(i);
  const matmul_geom geom = matmul_geometry(c.in_shape(0), c.in_shape(1));
  const float alpha = fused ? static_cast<float>(c.n.get_float("alpha", 1.0)) : 1.0f;
  const act_kind act = fused ? parse_act(c) : act_kind::none;
  const value_id a = c.in(0), b = c.in(1), y = c.out();
  const value_id bias = fused && c.has(2) ? c.in(2) : value_id::none;
  const value_id res = fused && c.has(3) ? c.in(3) : value_id::none;
  const shape_t ys = c.shape(y);
  const shape_t bs = bias == value_id::none ? shape_t{} : c.shape(bias), rs = res == value_id::none ? shape_t{} : c.shape(res);
  const std::size_t an = numel_of(c.in_shape(0)), bn = numel_of(c.in_shape(1));
  const dtype compute = c.compute;
  const bool in_epilogue = geom.a_off.size() == 1 && geom.K > 0 && (bias == value_id::none || per_column(bs, geom.N)) &&
                           (res == value_id::none || numel_of(rs) == numel_of(ys));
  const bool tail = bias != value_id::none || res != value_id::none || act != act_kind::none;
  const auto a16c = const_bf16(c, dev, 0, an), b16c = const_bf16(c, dev, 1, bn);
  return [=](const run_state<Dev>& s) {
    const bf16* a16p = a16c ? a16c->data() : nullptr;
    const bf16* b16p = b16c ? b16c->data() : nullptr;
    const float* ap = s.template as<float>(a);
    const float* bp = s.template as<float>(b);
    float* yp = s.template as<float>(y);
    const float* biasp = bias == value_id::none ? nullptr : s.template as<float>(bias);
    const float* resp = res == value_id::none ? nullptr : s.template as<float>(res);
    if (tail && in_epilogue) {
      graph_tail ft;
      ft.bias = biasp;
      ft.res = resp;
      ft.ld = geom.N;
      ft.act = act;
      matmul_run(s.dev, compute, geom.M, geom.N, geom.K, alpha, ap, an, geom.a_off, bp, bn, geom.b_off, yp, tail_of(ft), a16p, b16p);
      return;
    }
    matmul_run(s.dev, compute, geom.M, geom.N, geom.K, alpha, ap, an, geom.a_off, bp, bn, geom.b_off, yp, tail_of(), a16p, b16p);
    if (tail) tail_pass(s.dev, yp, ys, biasp, bs, resp, rs, act);
  };
}

// Gemm: Y = alpha·op(A)·op(B) + beta·C, C broadcast one way to (M, N).
template <class Dev>
step_fn<Dev> build_gemm(const build_ctx& c, Dev& dev) {
  for (std::size_t i = 0; i < c.n.inputs.size(); ++i)
    if (c.has(i)) c.need_f32(i);
  const bool ta = c.n.get_int("transA", 0) != 0, tb = c.n.get_int("transB", 0) != 0;
  const float alpha = static_cast<float>(c.n.get_float("alpha", 1.0)), beta = static_cast<float>(c.n.get_float("beta", 1.0));
  const shape_t& as = c.in_shape(0);
  const shape_t& bs = c.in_shape(1);
  const std::size_t M = ta ? as[1] : as[0], K = ta ? as[0] : as[1], N = tb ? bs[0] : bs[1];
  const value_id a = c.in(0), b = c.in(1), y = c.out();
  const value_id cv = c.has(2) && beta != 0.0f ? c.in(2) : value_id::none;
  const shape_t cs = cv == value_id::none ? shape_t{} : c.shape(cv);
  const std::size_t an = numel_of(as), bn = numel_of(bs);
  const dtype compute = c.compute;
  const auto a16c = const_bf16(c, dev, 0, an), b16c = const_bf16(c, dev, 1, bn);
  return [=](const run_state<Dev>& s) {
    float* yp = s.template as<float>(y);
    if (cv != value_id::none) {  // Y = C (broadcast), then the GEMM adds alpha·AB to beta·Y
      const float* cp = s.template as<float>(cv);
      const bcast bc({M, N}, {cs});
      parallel_for(s.dev, M * N, 4096,
                   [&](std::size_t lo, std::size_t hi) { bc.for_range(lo, hi, [&](std::size_t i, const std::size_t* off) { yp[i] = cp[off[0]]; }); });
    }
    const float bt = cv == value_id::none ? 0.0f : beta;
    if (K == 0) {
      for (std::size_t i = 0; i < M * N; ++i) yp[i] = bt == 0.0f ? 0.0f : bt * yp[i];
      return;
    }
    const transpose tA = ta ? transpose::yes : transpose::none, tB = tb ? transpose::yes : transpose::none;
    const std::size_t lda = ta ? M : K, ldb = tb ? K : N;
    if (compute == dtype::bf16) {
      std::optional<device_buffer<bf16, Dev>> a16, b16;  // non-constant operands: converted per run
      const bf16* a16p = a16c ? a16c->data() : a16.emplace(to_bf16(s.dev, s.template as<float>(a), an)).data();
      const bf16* b16p = b16c ? b16c->data() : b16.emplace(to_bf16(s.dev, s.template as<float>(b), bn)).data();
      gemm(s.dev, tA, tB, M, N, K, alpha, a16p, lda, b16p, ldb, bt, yp, N, tail_of());
    } else {
      gemm(s.dev, tA, tB, M, N, K, alpha, static_cast<const float*>(s.template as<float>(a)), lda, static_cast<const float*>(s.template as<float>(b)),
           ldb, bt, yp, N, tail_of());
    }
  };
}

// Attention: tessel's fused attention when it takes the shape (no additive mask, head dim a multiple
// of 16 up to 256, Dv = D), by parts otherwise.
template <class Dev>
step_fn<Dev> build_attention(const build_ctx& c) {
  for (std::size_t i = 0; i < c.n.inputs.size(); ++i)
    if (c.has(i)) c.need_f32(i);
  const shape_t& qs = c.in_shape(0);
  const shape_t& ks = c.in_shape(1);
  const shape_t& vs = c.in_shape(2);
  const std::size_t B = qs[0], Hq = qs[1], Sq = qs[2], D = qs[3], Hkv = ks[1], Sk = ks[2], Dv = vs[3];
  if (Hkv == 0 || Hq % Hkv != 0) c.fail("query heads are not a multiple of key/value heads", errc::invalid_argument);
  const float scale = static_cast<float>(c.n.get_float("scale", D ? 1.0 / std::sqrt(static_cast<double>(D)) : 1.0));
  const bool causal = c.n.get_int("causal", 0) != 0;
  const value_id q = c.in(0), k = c.in(1), v = c.in(2), y = c.out();
  const value_id mask = c.has(3) ? c.in(3) : value_id::none;
  const shape_t ms = mask == value_id::none ? shape_t{} : c.shape(mask);
  const bool fused = mask == value_id::none && D > 0 && D % 16 == 0 && D <= 256 && Dv == D && scale != 0.0f && Sq > 0 && Sk > 0;
  const dtype compute = c.compute;
  return [=](const run_state<Dev>& s) {
    const float* qp = s.template as<float>(q);
    const float* kp = s.template as<float>(k);
    const float* vp = s.template as<float>(v);
    float* op = s.template as<float>(y);
    if (!fused) {
      attention_by_parts(s.dev, compute, B, Hq, Hkv, Sq, Sk, D, Dv, scale, causal, qp, kp, vp,
                         mask == value_id::none ? nullptr : s.template as<float>(mask), ms, op);
      return;
    }
    attention_shape sh;
    sh.batch = B;
    sh.seq_q = Sq;
    sh.seq_kv = Sk;
    sh.heads_q = Hq;
    sh.heads_kv = Hkv;
    sh.head_dim = D;
    sh.layout = attention_layout::bhsd;
    attention_options o;
    o.scale = scale;
    o.causal = causal;
    o.align = mask_align::bottom_right;
    const std::size_t nq = B * Hq * Sq * D, nk = B * Hkv * Sk * D;
    if (compute == dtype::bf16) {
      const auto q16 = to_bf16(s.dev, qp, nq), k16 = to_bf16(s.dev, kp, nk), v16 = to_bf16(s.dev, vp, nk);
      attention_forward(s.dev, sh, std::span<const bf16>(q16.data(), nq), std::span<const bf16>(k16.data(), nk),
                        std::span<const bf16>(v16.data(), nk), std::span<float>(op, nq), std::span<float>{}, o);
    } else {
      attention_forward(s.dev, sh, std::span<const float>(qp, nq), std::span<const float>(kp, nk), std::span<const float>(vp, nk),
                        std::span<float>(op, nq), std::span<float>{}, o);
    }
  };
}

template <class Dev>
step_fn<Dev> build_gelu(const build_ctx& c) {
  c.need_f32(0);
  const gelu_approx ap = c.n.get_string("approximate", "none") == "tanh" ? gelu_approx::tanh : gelu_approx::erf;
  const value_id x = c.in(0), y = c.out();
  const std::size_t n = numel_of(c.in_shape(0));
  return [=](const run_state<Dev>& s) {
    gelu_forward(s.dev, std::span<const float>(s.template as<float>(x), n), std::span<float>(s.template as<float>(y), n), ap);
  };
}

// RotaryEmbedding (tessel's contract in shape_inference.hpp): y = x·cos + rotate(x)·sin, cos and sin
// broadcast to x; rotate pairs i with i + D/2 along the last axis (or 2i with 2i + 1 when interleaved).
template <class Dev>
step_fn<Dev> build_rotary(const build_ctx& c) {
  for (std::size_t i : {0, 1, 2}) c.need_f32(i);
  const value_id x = c.in(0), cv = c.in(1), sv = c.in(2), y = c.out();
  const shape_t& ys = c.shape(y);
  if (ys.empty() || ys.back() % 2 != 0) c.fail("the last axis of the input must be even", errc::invalid_argument);
  const bool interleaved = c.n.get_int("interleaved", 0) != 0;
  const bcast bc(ys, {c.in_shape(1), c.in_shape(2)});
  const std::size_t n = numel_of(ys), d = ys.back(), half = d / 2;
  return [=](const run_state<Dev>& s) {
    const float* xp = s.template as<float>(x);
    const float* cp = s.template as<float>(cv);
    const float* sp = s.template as<float>(sv);
    float* yp = s.template as<float>(y);
    // along runs of the last axis (cos and sin step by 0 or 1 there): one position per element,
    // no odometer step, and the split halves as two plain loops the compiler vectorizes
    const std::size_t ic = bc.inner(0), is = bc.inner(1);
    parallel_for(s.dev, n, 4096, [&](std::size_t lo, std::size_t hi) {
      bc.for_runs(lo, hi, [&](std::size_t i0, const std::size_t* off, std::size_t len) {
        const std::size_t j0 = i0 % d;
        const float* x = xp + i0;
        const float* cr = cp + off[0];
        const float* sr = sp + off[1];
        float* yr = yp + i0;
        if (interleaved) {
          for (std::size_t t = 0; t < len; ++t) {
            const auto u = static_cast<std::ptrdiff_t>(t);  // the partner is in the same row
            const float rot = (j0 + t) % 2 == 0 ? -x[u + 1] : x[u - 1];
            yr[t] = x[t] * cr[t * ic] + rot * sr[t * is];
          }
          return;
        }
        const std::size_t split = j0 < half ? std::min(len, half - j0) : 0;  // [0, split) in the first half
        const auto h = static_cast<std::ptrdiff_t>(half);                    // x[t - h] for t >= split lies in the same row
        if (ic == 1 && is == 1) {
          for (std::size_t t = 0; t < split; ++t) yr[t] = x[t] * cr[t] + (-x[t + half]) * sr[t];
          for (std::size_t t = split; t < len; ++t) yr[t] = x[t] * cr[t] + x[static_cast<std::ptrdiff_t>(t) - h] * sr[t];
        } else {
          for (std::size_t t = 0; t < split; ++t) yr[t] = x[t] * cr[t * ic] + (-x[t + half]) * sr[t * is];
          for (std::size_t t = split; t < len; ++t) yr[t] = x[t] * cr[t * ic] + x[static_cast<std::ptrdiff_t>(t) - h] * sr[t * is];
        }
      });
    });
  };
}

// ---- CNN ops (ops::conv2d, ops/pool.hpp, ops/batchnorm.hpp; fallbacks in exec_cnn.hpp) --------------

// The 2-D window of a Conv or pool node over input shape `xs` (1-D spatial runs as H = 1).
inline window2d window_of(const build_ctx& c, const shape_t& xs, const shape_t& ys, const shape_t& kernel) {
  const std::size_t ns = xs.size() - 2;
  if (ns != 1 && ns != 2) c.fail("only 1-D and 2-D windows are supported (input rank " + std::to_string(xs.size()) + ")");
  const ints strides = c.n.get_ints("strides", ints(ns, 1)), dil = c.n.get_ints("dilations", ints(ns, 1));
  ints pads = c.n.get_ints("pads", ints(2 * ns, 0));
  const std::string auto_pad = c.n.get_string("auto_pad", "NOTSET");
  if (auto_pad == "VALID") pads.assign(2 * ns, 0);
  if (auto_pad == "SAME_UPPER" || auto_pad == "SAME_LOWER")
    for (std::size_t i = 0; i < ns; ++i) {
      const auto in = static_cast<std::int64_t>(xs[2 + i]), out = static_cast<std::int64_t>(ys[2 + i]);
      const std::int64_t total = std::max<std::int64_t>(0, (out - 1) * strides[i] + (static_cast<std::int64_t>(kernel[i]) - 1) * dil[i] + 1 - in);
      const std::int64_t small = total / 2, large = total - small;
      pads[i] = auto_pad == "SAME_UPPER" ? small : large;
      pads[ns + i] = total - pads[i];
    }
  window2d g;
  g.n = xs[0];
  g.c = xs[1];
  const std::size_t o = ns == 2 ? 0 : 1;  // 1-D: the only axis is W
  auto u = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  g.h = ns == 2 ? xs[2] : 1;
  g.w = xs[xs.size() - 1];
  g.oh = ns == 2 ? ys[2] : 1;
  g.ow = ys[ys.size() - 1];
  if (ns == 2) {
    g.kh = kernel[0];
    g.sh = u(strides[0]);
    g.dh = u(dil[0]);
    g.ph = static_cast<std::ptrdiff_t>(pads[0]);
    g.ph_end = static_cast<std::ptrdiff_t>(pads[2]);
  }
  g.kw = kernel[1 - o];
  g.sw = u(strides[1 - o]);
  g.dw = u(dil[1 - o]);
  g.pw = static_cast<std::ptrdiff_t>(pads[1 - o]);
  g.pw_end = static_cast<std::ptrdiff_t>(pads[ns + 1 - o]);
  return g;
}

inline void check_pads(const build_ctx& c, const window2d& g) {
  if (g.ph < 0 || g.pw < 0 || g.ph_end < 0 || g.pw_end < 0) c.fail("negative pads are not supported", errc::invalid_argument);
}

// Conv and FusedConv (Y = act(Conv(X, W, B) + Z)) on ops::conv2d, NCHW. A constant filter is packed
// into the implicit GEMM's panels once, here (conv2d_packed_filter); a filter computed at run time
// takes the plain call. The bias, FusedConv's residual Z (when it has Y's shape) and its activation
// all run in conv2d's epilogue (graph_tail); a Z that broadcasts takes one pass after.
template <class Dev>
step_fn<Dev> build_conv(const build_ctx& c, Dev& dev) {
  for (std::size_t i = 0; i < c.n.inputs.size(); ++i)
    if (c.has(i)) c.need_f32(i);
  const shape_t& xs = c.in_shape(0);
  const shape_t& ws = c.in_shape(1);
  const shape_t ys = c.shape(c.out());
  if (ws.size() != xs.size() || xs.size() < 3)
    c.fail("filter rank " + std::to_string(ws.size()) + " for input rank " + std::to_string(xs.size()), errc::invalid_argument);
  const shape_t kernel(ws.begin() + 2, ws.end());
  const window2d g = window_of(c, xs, ys, kernel);
  check_pads(c, g);
  const std::int64_t group_attr = c.n.get_int("group", 1);
  const std::size_t m = ws[0];
  if (group_attr < 1 || g.c % static_cast<std::size_t>(group_attr) != 0 || m % static_cast<std::size_t>(group_attr) != 0 ||
      ws[1] * static_cast<std::size_t>(group_attr) != g.c)
    c.fail("group " + std::to_string(group_attr) + " does not fit " + std::to_string(g.c) + " input channels, filter " + std::to_string(m) + "x" +
               std::to_string(ws[1]),
           errc::invalid_argument);
  const bool fused = c.n.op == "FusedConv";
  const act_kind act = fused ? parse_act(c) : act_kind::none;
  const value_id x = c.in(0), w = c.in(1), y = c.out();
  const value_id b = c.has(2) ? c.in(2) : value_id::none;
  const value_id z = fused && c.has(3) ? c.in(3) : value_id::none;
  if (b != value_id::none && numel_of(c.shape(b)) != m)
    c.fail("bias has " + std::to_string(numel_of(c.shape(b))) + " values for " + std::to_string(m) + " output channels", errc::invalid_argument);
  const shape_t zs = z == value_id::none ? shape_t{} : c.shape(z);
  const bool z_in_chain = z != value_id::none && zs == ys;
  conv2d_params p;
  p.stride_h = g.sh, p.stride_w = g.sw, p.dilation_h = g.dh, p.dilation_w = g.dw;
  p.pad_top = static_cast<std::size_t>(g.ph), p.pad_left = static_cast<std::size_t>(g.pw);
  p.pad_bottom = static_cast<std::size_t>(g.ph_end), p.pad_right = static_cast<std::size_t>(g.pw_end);
  p.groups = static_cast<std::size_t>(group_attr);
  p.layout = conv_layout::nchw;
  const image_dims xd{g.n, g.c, g.h, g.w}, yd{g.n, m, g.oh, g.ow};
  const filter_dims fd{m, ws[1], g.kh, g.kw};
  // the output extent ops::conv2d will compute must be the one shape inference gave Y
  auto extent = [](std::size_t in, std::size_t pa, std::size_t pb, std::size_t k, std::size_t d, std::size_t st) -> std::size_t {
    const std::size_t padded = in + pa + pb, span = (k - 1) * d + 1;
    return padded < span ? 0 : (padded - span) / st + 1;
  };
  if (extent(g.h, p.pad_top, p.pad_bottom, g.kh, g.dh, g.sh) != g.oh || extent(g.w, p.pad_left, p.pad_right, g.kw, g.dw, g.sw) != g.ow)
    c.fail("output " + std::to_string(g.oh) + "x" + std::to_string(g.ow) + " does not follow from the window", errc::invalid_argument);
  // bf16 compute: the filter rounded to bf16 and packed at compile time, the image rounded per run;
  // products accumulate in f32 and Y (with its epilogue) stays f32, as MatMul's
  const bool low = c.compute == dtype::bf16;
  std::shared_ptr<const conv2d_packed_filter<float, Dev>> packed;
  std::shared_ptr<const conv2d_packed_filter<bf16, Dev>> packed16;
  if (const float* wc = c.const_f32(1); wc && numel_of(ws) > 0) {
    if (low) {
      const auto w16 = to_bf16(dev, wc, numel_of(ws));
      packed16 = std::make_shared<const conv2d_packed_filter<bf16, Dev>>(dev, tessel::filter<const bf16>{w16.data(), fd}, p.groups);
    } else {
      packed = std::make_shared<const conv2d_packed_filter<float, Dev>>(dev, tessel::filter<const float>{wc, fd}, p.groups);
    }
  }
  return [=](const run_state<Dev>& s) {
    float* yp = s.template as<float>(y);
    const tessel::image<const float> xi{s.template as<float>(x), xd};
    const tessel::image<float> yi{yp, yd};
    graph_tail t;  // conv2d gets no bias of its own: the tail adds it, before Z, as conv2d would
    t.bias = b == value_id::none ? nullptr : s.template as<float>(b);
    if (z_in_chain) {
      t.res = s.template as<float>(z);
      t.plane = yd.h * yd.w;
      t.channels = yd.c;
    }
    t.act = z == value_id::none || z_in_chain ? act : act_kind::none;
    const tail_chain chain = tail_of(t);
    const std::span<const float> no_bias;
    if (low) {
      const auto x16 = to_bf16(s.dev, xi.data, xd.size());
      const tessel::image<const bf16> xb{x16.data(), xd};
      if (packed16) {
        conv2d(s.dev, xb, *packed16, no_bias, yi, p, chain);
      } else {
        const auto w16 = to_bf16(s.dev, s.template as<float>(w), fd.size());
        conv2d(s.dev, xb, tessel::filter<const bf16>{w16.data(), fd}, no_bias, yi, p, chain);
      }
    } else if (packed) {
      conv2d(s.dev, xi, *packed, no_bias, yi, p, chain);
    } else {
      conv2d(s.dev, xi, tessel::filter<const float>{s.template as<float>(w), fd}, no_bias, yi, p, chain);
    }
    if (z != value_id::none && !z_in_chain)  // a Z that broadcasts to Y: one pass adds it, then the activation
      tail_pass(s.dev, yp, ys, nullptr, shape_t{}, s.template as<float>(z), zs, act);
  };
}

// MaxPool / AveragePool on ops::max_pool2d / avg_pool2d (ceil_mode, count_include_pad, pads,
// dilations: ONNX's semantics), unless ops refuses the geometry (a window with no tap inside the
// input) or computes another output extent: then the fallback loop pool_nchw. GlobalMaxPool on
// ops::global_max_pool2d, GlobalAveragePool on the fp64 loop global_avg_nchw (any spatial rank as one plane).
template <class Dev>
step_fn<Dev> build_pool(const build_ctx& c) {
  c.need_f32(0);
  const std::string& op = c.n.op;
  const value_id x = c.in(0), y = c.out();
  const shape_t& xs = c.in_shape(0);
  if (xs.size() < 3) c.fail("input rank " + std::to_string(xs.size()) + " has no spatial axis", errc::invalid_argument);
  if (op == "GlobalAveragePool" || op == "GlobalMaxPool") {
    const image_dims xd{xs[0], xs[1], 1, prod(xs, 2, xs.size())}, yd{xs[0], xs[1], 1, 1};
    if (xd.c == 0 || xd.n == 0) return [](const run_state<Dev>&) {};
    if (op == "GlobalAveragePool")  // fp64 sums (see exec_cnn.hpp)
      return [=](const run_state<Dev>& s) { global_avg_nchw(s.dev, xd.n * xd.c, xd.w, s.template as<float>(x), s.template as<float>(y)); };
    return [=](const run_state<Dev>& s) {
      global_max_pool2d(s.dev, tessel::image<const float>{s.template as<float>(x), xd}, tessel::image<float>{s.template as<float>(y), yd},
                        conv_layout::nchw);
    };
  }
  if (c.has_out(1)) c.fail("MaxPool's indices output is not supported");
  const ints k = c.n.get_ints("kernel_shape");
  for (std::int64_t v : k)
    if (v < 1) c.fail("kernel_shape " + ints_to_string(k) + " holds a size below 1", errc::invalid_argument);
  if (k.size() + 2 != xs.size()) c.fail("kernel_shape " + ints_to_string(k) + " for input rank " + std::to_string(xs.size()), errc::invalid_argument);
  const window2d g = window_of(c, xs, c.shape(y), shape_t(k.begin(), k.end()));
  check_pads(c, g);
  const bool max = op == "MaxPool", include_pad = c.n.get_int("count_include_pad", 0) != 0;
  pool2d_params p;
  p.kernel_h = g.kh, p.kernel_w = g.kw, p.stride_h = g.sh, p.stride_w = g.sw, p.dilation_h = g.dh, p.dilation_w = g.dw;
  p.pad_top = static_cast<std::size_t>(g.ph), p.pad_left = static_cast<std::size_t>(g.pw);
  p.pad_bottom = static_cast<std::size_t>(g.ph_end), p.pad_right = static_cast<std::size_t>(g.pw_end);
  p.ceil_mode = c.n.get_int("ceil_mode", 0) != 0;
  p.count_include_pad = include_pad;
  p.layout = conv_layout::nchw;
  const image_dims xd{g.n, g.c, g.h, g.w}, yd{g.n, g.c, g.oh, g.ow};
  bool on_ops = false;
  try {
    on_ops = xd.c > 0 && pool2d_output(xd, p) == yd;
  } catch (const conv_error&) {
    on_ops = false;  // a window ops does not take (no tap inside the input): the fallback's semantics
  }
  if (!on_ops) return [=](const run_state<Dev>& s) { pool_nchw(s.dev, g, max, include_pad, s.template as<float>(x), s.template as<float>(y)); };
  return [=](const run_state<Dev>& s) {
    const tessel::image<const float> xi{s.template as<float>(x), xd};
    const tessel::image<float> yi{s.template as<float>(y), yd};
    if (max)
      max_pool2d(s.dev, xi, yi, p);
    else
      avg_pool2d(s.dev, xi, yi, p);
  };
}

// BatchNormalization (inference) on ops::batchnorm_forward_inference, the spatial axes as one plane;
// epsilon <= 0 (which ops refuses) takes the fallback loop batch_norm_nchw.
template <class Dev>
step_fn<Dev> build_batch_norm(const build_ctx& c) {
  for (std::size_t i = 0; i < 5; ++i) c.need_f32(i);
  if (c.n.get_int("training_mode", 0) != 0) c.fail("training_mode = 1 is not supported (inference only)");
  const shape_t& xs = c.in_shape(0);
  if (xs.size() < 2) c.fail("input rank " + std::to_string(xs.size()) + " has no channel axis", errc::invalid_argument);
  const std::size_t n = xs[0], ch = xs[1], hw = prod(xs, 2, xs.size());
  for (std::size_t i = 1; i < 5; ++i)
    if (numel_of(c.in_shape(i)) != ch)
      c.fail("input " + std::to_string(i) + " has " + std::to_string(numel_of(c.in_shape(i))) + " values for " + std::to_string(ch) + " channels",
             errc::invalid_argument);
  const double eps = c.n.get_float("epsilon", 1e-5);
  const value_id x = c.in(0), sc = c.in(1), b = c.in(2), mean = c.in(3), var = c.in(4), y = c.out();
  const float eps_f = static_cast<float>(eps);
  if (!(std::isfinite(eps_f) && eps_f > 0.0f))
    return [=](const run_state<Dev>& s) {
      batch_norm_nchw(s.dev, n, ch, hw, eps, s.template as<float>(x), s.template as<float>(sc), s.template as<float>(b), s.template as<float>(mean),
                      s.template as<float>(var), s.template as<float>(y));
    };
  batchnorm_params p;
  p.eps = eps_f;
  p.layout = conv_layout::nchw;
  const image_dims d{n, ch, 1, hw};
  return [=](const run_state<Dev>& s) {
    auto span = [&](value_id v) { return std::span<const float>(s.template as<float>(v), ch); };
    batchnorm_forward_inference(s.dev, tessel::image<const float>{s.template as<float>(x), d}, span(sc), span(b), span(mean), span(var),
                                tessel::image<float>{s.template as<float>(y), d}, p);
  };
}

// ---- Resize (opset 13 to 17) ------------------------------------------------------------------------------

// Where output coordinate `o` of an axis reads the input (ONNX coordinate_transformation_mode).
enum class resize_coord : std::uint8_t { half_pixel, pytorch_half_pixel, align_corners, asymmetric };
enum class resize_nearest : std::uint8_t { round_prefer_floor, round_prefer_ceil, floor, ceil };

inline double resize_source(resize_coord m, std::size_t o, double scale, std::size_t in, std::size_t out) {
  const double x = static_cast<double>(o);
  switch (m) {
    case resize_coord::half_pixel: return (x + 0.5) / scale - 0.5;
    case resize_coord::pytorch_half_pixel: return out > 1 ? (x + 0.5) / scale - 0.5 : 0.0;
    case resize_coord::align_corners: return out == 1 ? 0.0 : x * static_cast<double>(in - 1) / static_cast<double>(out - 1);
    case resize_coord::asymmetric: return x / scale;
  }
  return x;
}

inline std::size_t resize_nearest_index(resize_nearest m, double x, std::size_t in) {
  double r = 0;
  switch (m) {
    case resize_nearest::round_prefer_floor: r = (x - std::floor(x) == 0.5) ? std::floor(x) : std::round(x); break;
    case resize_nearest::round_prefer_ceil: r = (x - std::floor(x) == 0.5) ? std::ceil(x) : std::round(x); break;
    case resize_nearest::floor: r = std::floor(x); break;
    case resize_nearest::ceil: r = std::ceil(x); break;
  }
  if (!(r > 0)) return 0;  // also NaN
  return std::min(static_cast<std::size_t>(r), in - 1);
}

// Resize: mode nearest (any axes, any dtype: the element is copied) or linear (f32, bilinear on the
// last two axes — the others must keep their size at scale 1); scales or sizes constant. The
// per-axis source indices (and linear weights) are computed here, once; a row of the output (all
// axes but the last) then reads one (nearest) or two (linear) input rows. Cubic, tf_crop_and_resize,
// half_pixel_symmetric, antialias and axes are graph_error(unsupported) naming the node.
template <class Dev>
step_fn<Dev> build_resize(const build_ctx& c) {
  const std::string mode = c.n.get_string("mode", "nearest");
  if (mode != "nearest" && mode != "linear") c.fail("mode '" + mode + "' is not supported (nearest, linear)");
  const std::string ctm = c.n.get_string("coordinate_transformation_mode", "half_pixel");
  resize_coord coord;
  if (ctm == "half_pixel")
    coord = resize_coord::half_pixel;
  else if (ctm == "pytorch_half_pixel")
    coord = resize_coord::pytorch_half_pixel;
  else if (ctm == "align_corners")
    coord = resize_coord::align_corners;
  else if (ctm == "asymmetric")
    coord = resize_coord::asymmetric;
  else
    c.fail("coordinate_transformation_mode '" + ctm + "' is not supported (half_pixel, pytorch_half_pixel, align_corners, asymmetric)");
  const std::string nm = c.n.get_string("nearest_mode", "round_prefer_floor");
  resize_nearest near;
  if (nm == "round_prefer_floor")
    near = resize_nearest::round_prefer_floor;
  else if (nm == "round_prefer_ceil")
    near = resize_nearest::round_prefer_ceil;
  else if (nm == "floor")
    near = resize_nearest::floor;
  else if (nm == "ceil")
    near = resize_nearest::ceil;
  else
    c.fail("nearest_mode '" + nm + "' is not supported (round_prefer_floor, round_prefer_ceil, floor, ceil)");
  if (c.n.get_int("antialias", 0) != 0) c.fail("antialias = 1 is not supported");
  if (c.n.has_attribute("axes")) c.fail("attribute 'axes' is not supported");
  if (c.n.get_string("keep_aspect_ratio_policy", "stretch") != "stretch") c.fail("keep_aspect_ratio_policy other than stretch is not supported");
  const shape_t& xs = c.in_shape(0);
  const value_id x = c.in(0), y = c.out();
  const shape_t ys = c.shape(y);
  const std::size_t r = xs.size();
  if (r == 0 || ys.size() != r) c.fail("input and output ranks differ or are 0", errc::invalid_argument);
  // the scale of each axis: the scales input when given (non-empty), else out / in
  std::vector<double> scale(r);
  const bool has_scales = c.has(2) && numel_of(c.in_shape(2)) > 0;
  if (has_scales) {
    const float* sp = c.const_f32(2);
    if (!sp) c.fail("scales must be a constant f32 tensor");
    if (numel_of(c.in_shape(2)) != r)
      c.fail("scales has " + std::to_string(numel_of(c.in_shape(2))) + " values for rank " + std::to_string(r), errc::invalid_argument);
    for (std::size_t a = 0; a < r; ++a) {
      scale[a] = static_cast<double>(sp[a]);
      if (!(scale[a] > 0.0) || !std::isfinite(scale[a]))
        c.fail("scale " + std::to_string(scale[a]) + " at axis " + std::to_string(a) + " is not positive and finite", errc::invalid_argument);
    }
  } else {
    for (std::size_t a = 0; a < r; ++a) scale[a] = xs[a] ? static_cast<double>(ys[a]) / static_cast<double>(xs[a]) : 1.0;
  }
  const std::size_t ny = numel_of(ys);
  for (std::size_t a = 0; a < r; ++a)
    if (xs[a] == 0 && ys[a] != 0) c.fail("axis " + std::to_string(a) + " resizes an empty axis to " + std::to_string(ys[a]), errc::invalid_argument);
  if (ny == 0) return [](const run_state<Dev>&) {};
  const shape_t xst = strides_of(xs);
  const std::size_t W = ys[r - 1], rows = ny / W;
  if (mode == "nearest") {
    std::vector<std::vector<std::size_t>> src(r);  // [axis][output index] -> input element offset along the axis
    for (std::size_t a = 0; a < r; ++a)
      for (std::size_t o = 0; o < ys[a]; ++o)
        src[a].push_back(resize_nearest_index(near, resize_source(coord, o, scale[a], xs[a], ys[a]), xs[a]) * xst[a]);
    const std::size_t es = dtype_size(c.in_type(0));
    return [=](const run_state<Dev>& s) {
      const std::byte* xp = s.at(x);
      std::byte* yp = s.at(y);
      parallel_for(s.dev, rows, 16, [&](std::size_t lo, std::size_t hi) {
        for (std::size_t row = lo; row < hi; ++row) {
          std::size_t off = 0, rem = row;
          for (std::size_t a = r - 1; a-- > 0;) {
            off += src[a][rem % ys[a]];
            rem /= ys[a];
          }
          const std::size_t* sx = src[r - 1].data();
          // typed copies for the common widths (a memcpy call of es bytes per element was most of
          // U-Net's upsampling)
          auto typed = [&](auto size) {
            constexpr std::size_t E = decltype(size)::value;
            std::byte* d = yp + row * W * E;
            const std::byte* q = xp + off * E;
            for (std::size_t o = 0; o < W; ++o) std::memcpy(d + o * E, q + sx[o] * E, E);  // a fixed-size copy: one move
          };
          if (es == 4)
            typed(std::integral_constant<std::size_t, 4>{});
          else if (es == 2)
            typed(std::integral_constant<std::size_t, 2>{});
          else if (es == 8)
            typed(std::integral_constant<std::size_t, 8>{});
          else if (es == 1)
            typed(std::integral_constant<std::size_t, 1>{});
          else
            for (std::size_t o = 0; o < W; ++o) copy_elem(yp, row * W + o, xp, off + sx[o], es);
        }
      });
    };
  }
  c.need_f32(0);
  // linear: bilinear on the last two axes (linear on the last one for rank 1); others unchanged
  const std::size_t lin0 = r >= 2 ? r - 2 : 0;
  for (std::size_t a = 0; a < lin0; ++a)
    if (xs[a] != ys[a] || scale[a] != 1.0) c.fail("linear resize of axis " + std::to_string(a) + " is not supported (only the last two axes)");
  struct tap {
    std::size_t i0, i1;
    float w;  // weight of i1
  };
  auto taps = [&](std::size_t a) {
    std::vector<tap> t;
    for (std::size_t o = 0; o < ys[a]; ++o) {
      const double xin = std::clamp(resize_source(coord, o, scale[a], xs[a], ys[a]), 0.0, static_cast<double>(xs[a] - 1));
      const auto i0 = static_cast<std::size_t>(std::floor(xin));
      t.push_back({i0, std::min(i0 + 1, xs[a] - 1), static_cast<float>(xin - static_cast<double>(i0))});
    }
    return t;
  };
  const std::vector<tap> tx = taps(r - 1), ty = r >= 2 ? taps(r - 2) : std::vector<tap>{{0, 0, 0.0f}};
  const std::size_t H = r >= 2 ? ys[r - 2] : 1, IW = xs[r - 1], IH = r >= 2 ? xs[r - 2] : 1;
  return [=](const run_state<Dev>& s) {
    const float* xp = s.template as<float>(x);
    float* yp = s.template as<float>(y);
    parallel_for(s.dev, rows, 8, [&](std::size_t lo, std::size_t hi) {
      for (std::size_t row = lo; row < hi; ++row) {
        const std::size_t plane = row / H, oy = row % H;
        const float* r0 = xp + (plane * IH + ty[oy].i0) * IW;
        const float* r1 = xp + (plane * IH + ty[oy].i1) * IW;
        const float wy = ty[oy].w;
        float* out = yp + row * W;
        for (std::size_t o = 0; o < W; ++o) {
          const tap& t = tx[o];
          const float top = r0[t.i0] + t.w * (r0[t.i1] - r0[t.i0]);
          const float bot = r1[t.i0] + t.w * (r1[t.i1] - r1[t.i0]);
          out[o] = top + wy * (bot - top);
        }
      }
    });
  };
}

// ---- dispatch ------------------------------------------------------------------------------------------

template <class Dev>
step_fn<Dev> build_step(const build_ctx& c, Dev& dev) {
  const std::string& op = c.n.op;
  if (c.n.domain == fused_domain) {
    if (op == "FusedMatMul") return build_matmul<Dev>(c, dev);
    if (op == "Attention") return build_attention<Dev>(c);
    if (op == "RotaryEmbedding") return build_rotary<Dev>(c);
    if (op == "RMSNormalization" || op == "SkipLayerNormalization" || op == "SkipRMSNormalization") return build_norm<Dev>(c);
    if (op == "FusedConv") return build_conv<Dev>(c, dev);
    c.fail("no kernel for tessel::" + op);
  }
  if (!c.n.domain.empty() && c.n.domain != "ai.onnx") c.fail("no kernel for domain '" + c.n.domain + "'");
  static constexpr std::string_view unary[] = {"Abs", "Ceil",       "Cos",  "Erf",     "Exp", "Floor", "Log",
                                               "Neg", "Reciprocal", "Relu", "Sigmoid", "Sin", "Sqrt",  "Tanh"};
  static constexpr std::string_view bcast_ops[] = {"Add",  "Sub",   "Mul",  "Div",     "Max", "Min",  "Sum",
                                                   "Mean", "Equal", "Less", "Greater", "Pow", "Where"};
  static constexpr std::string_view copies[] = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"};
  auto in = [&](const auto& list) { return std::find(std::begin(list), std::end(list), std::string_view(op)) != std::end(list); };
  if (in(unary)) return build_unary<Dev>(c);
  if (in(bcast_ops)) return build_broadcast<Dev>(c);
  if (in(copies)) return build_copy<Dev>(c);
  if (op == "Cast") return build_cast<Dev>(c);
  if (op == "Gelu") return build_gelu<Dev>(c);
  if (op == "Transpose") return build_transpose<Dev>(c);
  if (op == "Expand") return build_expand<Dev>(c);
  if (op == "Slice") return build_slice<Dev>(c);
  if (op == "Concat") return build_concat<Dev>(c);
  if (op == "Split") return build_split<Dev>(c);
  if (op == "Gather") return build_gather<Dev>(c);
  if (op == "Shape") return build_shape<Dev>(c);
  if (op == "Constant") return build_constant<Dev>(c);
  if (op.rfind("Reduce", 0) == 0) return build_reduce<Dev>(c);
  if (op == "Softmax" || op == "LogSoftmax") return build_softmax<Dev>(c);
  if (op == "LayerNormalization") return build_norm<Dev>(c);
  if (op == "MatMul") return build_matmul<Dev>(c, dev);
  if (op == "Gemm") return build_gemm<Dev>(c, dev);
  if (op == "Conv") return build_conv<Dev>(c, dev);
  if (op == "Resize") return build_resize<Dev>(c);
  if (op == "MaxPool" || op == "AveragePool" || op == "GlobalAveragePool" || op == "GlobalMaxPool") return build_pool<Dev>(c);
  if (op == "BatchNormalization") return build_batch_norm<Dev>(c);
  c.fail("no kernel for op '" + op + "'");
}

}  // namespace detail::exec
}  // namespace graph
}  // namespace v0
}  // namespace tessel
