// Elementwise activations as streaming tile programs, forward and backward: GELU (tanh and erf
// forms), SiLU, SwiGLU (silu(a)·b, the gated unit of LLaMA-style MLPs), ReLU, and the elementwise
// sum a + b (a residual join, or two gradients of one tensor accumulated). Spans of f32 or bf16,
// cut into fixed chunks (one block each) so that results never depend on the worker count.
// The logistic pieces use arch::stream::exp_fast (<= 2 ulp); GELU-tanh is written as
// x / (1 + exp(-2u)), exact in form and free of the cancellation of 1 + tanh(u) for negative x.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <tessel/detail/type_name.hpp>
#include <tessel/ops/detail/norm_rows.hpp>
#include <tessel/tile/block_ctx.hpp>
#include <tessel/tile/ranges.hpp>

namespace tessel {
inline namespace v0 {

enum class gelu_approx : std::uint8_t { tanh, erf };

}  // namespace v0

namespace detail::act {

namespace st = tessel::arch::stream;
using namespace tessel::detail::rows;

inline constexpr float k_tanh = 0.7978845608028654f;  // sqrt(2/pi)
inline constexpr float c_tanh = 0.044715f;
inline constexpr float inv_sqrt2 = 0.7071067811865476f;
inline constexpr float inv_sqrt_2pi = 0.3989422804014327f;

template <class V>
inline V erf_(V x) {
  if constexpr (std::is_same_v<V, float>)
    return std::erf(x);
  else
    return xsimd::erf(x);
}
template <class V>
inline V sigmoid(V x) {
  return V(1.0f) / (V(1.0f) + st::exp_fast(-x));
}

template <class V>
inline V gelu_tanh(V x) {
  const V u = V(k_tanh) * st::fma(V(c_tanh) * x, x * x, x);
  return x / (V(1.0f) + st::exp_fast(V(-2.0f) * u));
}
template <class V>
inline V gelu_tanh_grad(V x) {
  const V x2 = x * x;
  const V u = V(k_tanh) * st::fma(V(c_tanh) * x, x2, x);
  const V s = V(1.0f) / (V(1.0f) + st::exp_fast(V(-2.0f) * u));  // (1 + tanh u) / 2
  const V du = V(k_tanh) * st::fma(V(3.0f * c_tanh), x2, V(1.0f));
  return st::fma(V(2.0f) * x * s * (V(1.0f) - s), du, s);
}
template <class V>
inline V gelu_erf(V x) {
  return V(0.5f) * x * (V(1.0f) + erf_(x * V(inv_sqrt2)));
}
template <class V>
inline V gelu_erf_grad(V x) {
  const V cdf = V(0.5f) * (V(1.0f) + erf_(x * V(inv_sqrt2)));
  const V pdf = V(inv_sqrt_2pi) * st::exp_fast(V(-0.5f) * x * x);
  return st::fma(x, pdf, cdf);
}
template <class V>
inline V silu(V x) {
  return x / (V(1.0f) + st::exp_fast(-x));
}
// ReLU as max(0, x): vmaxps returns its second operand for a NaN lane, so NaN propagates.
template <class V>
inline V relu(V x) {
  return st::max(V(0.0f), x);
}
// dy where x > 0, else exactly 0 (also for an infinite dy, which a product with a 0/1 mask would
// turn into NaN).
inline float relu_grad(float dy, float x) { return x > 0.0f ? dy : 0.0f; }
inline st::vf relu_grad(st::vf dy, st::vf x) { return xsimd::select(x > st::vf(0.0f), dy, st::vf(0.0f)); }

template <class V>
inline V silu_grad(V x) {
  const V s = sigmoid(x);
  return s * st::fma(x, V(1.0f) - s, V(1.0f));
}

// One chunked elementwise pass: f(i, V, nt) for i in the block's chunk; `nt` asks for
// non-temporal stores of write-only outputs (large tensors only).
template <class F>
struct map_program {
  // named in profiles after the operator whose lambda it runs ("gelu_forward")
  static const std::string& name() {
    static const std::string n = ::tessel::detail::enclosing_function_name<F>();
    return n;
  }
  const chunk_range* chunks;
  F f;
  bool nt;
  void operator()(block_ctx& ctx) const {
    const chunk_range& c = chunks[ctx.block_linear()];
    std::size_t i = c.begin;
    for (; i + st::width <= c.end; i += st::width) f(i, st::vf{}, nt);
    for (; i < c.end; ++i) f(i, 0.0f, false);
    if (nt) st::nt_fence();
  }
};

template <class Out, class Dev, class F>
void launch_map(Dev& dev, std::size_t n, bool outputs_alias_inputs, F f) {
  if (n == 0) return;
  const std::vector<chunk_range> chunks = make_chunks({n});
  dev.launch(grid{chunks.size()}, map_program<F>{chunks.data(), f, !outputs_alias_inputs && stream_out<Out>(n, 1)});
}

inline void check_same(std::size_t a, std::size_t b, const char* who, const char* what) {
  require<layer_error>(a == b, std::string(who) + ": " + what + " has " + std::to_string(b) + " elements, expected " + std::to_string(a));
}
template <class T>
inline void check_ptr(std::span<T> s, const char* who, const char* what) {
  require<layer_error>(s.empty() || s.data() != nullptr, std::string(who) + ": " + what + " is null");
}

}  // namespace detail::act

inline namespace v0 {

// y = gelu(x).
template <class Dev, class In, class Out>
void gelu_forward(Dev& dev, std::span<const In> x, std::span<Out> y, gelu_approx a = gelu_approx::tanh) {
  using namespace detail::act;
  static_assert(row_io_type<In> && row_io_type<Out>, "tessel::gelu_forward: f32 or bf16 spans");
  check_same(x.size(), y.size(), "gelu_forward", "y");
  check_ptr(x, "gelu_forward", "x");
  check_ptr(y, "gelu_forward", "y");
  const In* xp = x.data();
  Out* yp = y.data();
  if (a == gelu_approx::tanh)
    launch_map<Out>(dev, x.size(), (const void*)yp == (const void*)xp, [=](std::size_t i, auto v0, bool nt) {
      using V = decltype(v0);
      typed_store_nt<Out, V>(yp, i, gelu_tanh(typed_load<In, V>(xp, i)), nt);
    });
  else
    launch_map<Out>(dev, x.size(), (const void*)yp == (const void*)xp, [=](std::size_t i, auto v0, bool nt) {
      using V = decltype(v0);
      typed_store_nt<Out, V>(yp, i, gelu_erf(typed_load<In, V>(xp, i)), nt);
    });
}

// dx = dy · gelu'(x).
template <class Dev, class Dy, class In, class Dx>
void gelu_backward(Dev& dev, std::span<const Dy> dy, std::span<const In> x, std::span<Dx> dx, gelu_approx a = gelu_approx::tanh) {
  using namespace detail::act;
  static_assert(row_io_type<Dy> && row_io_type<In> && row_io_type<Dx>, "tessel::gelu_backward: f32 or bf16 spans");
  check_same(x.size(), dy.size(), "gelu_backward", "dy");
  check_same(x.size(), dx.size(), "gelu_backward", "dx");
  check_ptr(x, "gelu_backward", "x");
  const Dy* gp = dy.data();
  const In* xp = x.data();
  Dx* dp = dx.data();
  if (a == gelu_approx::tanh)
    launch_map<Dx>(dev, x.size(), (const void*)dp == (const void*)xp || (const void*)dp == (const void*)gp, [=](std::size_t i, auto v0, bool nt) {
      using V = decltype(v0);
      typed_store_nt<Dx, V>(dp, i, typed_load<Dy, V>(gp, i) * gelu_tanh_grad(typed_load<In, V>(xp, i)), nt);
    });
  else
    launch_map<Dx>(dev, x.size(), (const void*)dp == (const void*)xp || (const void*)dp == (const void*)gp, [=](std::size_t i, auto v0, bool nt) {
      using V = decltype(v0);
      typed_store_nt<Dx, V>(dp, i, typed_load<Dy, V>(gp, i) * gelu_erf_grad(typed_load<In, V>(xp, i)), nt);
    });
}

// y = x · sigmoid(x).
template <class Dev, class In, class Out>
void silu_forward(Dev& dev, std::span<const In> x, std::span<Out> y) {
  using namespace detail::act;
  static_assert(row_io_type<In> && row_io_type<Out>, "tessel::silu_forward: f32 or bf16 spans");
  check_same(x.size(), y.size(), "silu_forward", "y");
  check_ptr(x, "silu_forward", "x");
  const In* xp = x.data();
  Out* yp = y.data();
  launch_map<Out>(dev, x.size(), (const void*)yp == (const void*)xp, [=](std::size_t i, auto v0, bool nt) {
    using V = decltype(v0);
    typed_store_nt<Out, V>(yp, i, silu(typed_load<In, V>(xp, i)), nt);
  });
}

template <class Dev, class Dy, class In, class Dx>
void silu_backward(Dev& dev, std::span<const Dy> dy, std::span<const In> x, std::span<Dx> dx) {
  using namespace detail::act;
  static_assert(row_io_type<Dy> && row_io_type<In> && row_io_type<Dx>, "tessel::silu_backward: f32 or bf16 spans");
  check_same(x.size(), dy.size(), "silu_backward", "dy");
  check_same(x.size(), dx.size(), "silu_backward", "dx");
  check_ptr(x, "silu_backward", "x");
  const Dy* gp = dy.data();
  const In* xp = x.data();
  Dx* dp = dx.data();
  launch_map<Dx>(dev, x.size(), (const void*)dp == (const void*)xp || (const void*)dp == (const void*)gp, [=](std::size_t i, auto v0, bool nt) {
    using V = decltype(v0);
    typed_store_nt<Dx, V>(dp, i, typed_load<Dy, V>(gp, i) * silu_grad(typed_load<In, V>(xp, i)), nt);
  });
}

// y = silu(a) · b (gate a, up-projection b).
template <class Dev, class In, class Out>
void swiglu_forward(Dev& dev, std::span<const In> a, std::span<const In> b, std::span<Out> y) {
  using namespace detail::act;
  static_assert(row_io_type<In> && row_io_type<Out>, "tessel::swiglu_forward: f32 or bf16 spans");
  check_same(a.size(), b.size(), "swiglu_forward", "b");
  check_same(a.size(), y.size(), "swiglu_forward", "y");
  check_ptr(a, "swiglu_forward", "a");
  check_ptr(b, "swiglu_forward", "b");
  const In* ap = a.data();
  const In* bp = b.data();
  Out* yp = y.data();
  launch_map<Out>(dev, a.size(), (const void*)yp == (const void*)ap || (const void*)yp == (const void*)bp, [=](std::size_t i, auto v0, bool nt) {
    using V = decltype(v0);
    typed_store_nt<Out, V>(yp, i, silu(typed_load<In, V>(ap, i)) * typed_load<In, V>(bp, i), nt);
  });
}

// da = dy · b · silu'(a), db = dy · silu(a).
template <class Dev, class Dy, class In, class Dx>
void swiglu_backward(Dev& dev, std::span<const Dy> dy, std::span<const In> a, std::span<const In> b, std::span<Dx> da, std::span<Dx> db) {
  using namespace detail::act;
  static_assert(row_io_type<Dy> && row_io_type<In> && row_io_type<Dx>, "tessel::swiglu_backward: f32 or bf16 spans");
  const std::size_t n = a.size();
  check_same(n, b.size(), "swiglu_backward", "b");
  check_same(n, dy.size(), "swiglu_backward", "dy");
  check_same(n, da.size(), "swiglu_backward", "da");
  check_same(n, db.size(), "swiglu_backward", "db");
  check_ptr(a, "swiglu_backward", "a");
  const Dy* gp = dy.data();
  const In* ap = a.data();
  const In* bp = b.data();
  Dx* dap = da.data();
  Dx* dbp = db.data();
  launch_map<Dx>(dev, n,
                 (const void*)dap == (const void*)ap || (const void*)dap == (const void*)bp || (const void*)dap == (const void*)gp ||
                     (const void*)dbp == (const void*)ap || (const void*)dbp == (const void*)bp || (const void*)dbp == (const void*)gp,
                 [=](std::size_t i, auto v0, bool nt) {
                   using V = decltype(v0);
                   const V g = typed_load<Dy, V>(gp, i), x = typed_load<In, V>(ap, i), u = typed_load<In, V>(bp, i);
                   const V s = sigmoid(x);
                   typed_store_nt<Dx, V>(dap, i, g * u * (s * st::fma(x, V(1.0f) - s, V(1.0f))), nt);
                   typed_store_nt<Dx, V>(dbp, i, g * (x * s), nt);
                 });
}

// y = max(0, x). y may be x's own storage.
template <class Dev, class In, class Out>
void relu_forward(Dev& dev, std::span<const In> x, std::span<Out> y) {
  using namespace detail::act;
  static_assert(row_io_type<In> && row_io_type<Out>, "tessel::relu_forward: f32 or bf16 spans");
  check_same(x.size(), y.size(), "relu_forward", "y");
  check_ptr(x, "relu_forward", "x");
  check_ptr(y, "relu_forward", "y");
  const In* xp = x.data();
  Out* yp = y.data();
  launch_map<Out>(dev, x.size(), (const void*)yp == (const void*)xp, [=](std::size_t i, auto v0, bool nt) {
    using V = decltype(v0);
    typed_store_nt<Out, V>(yp, i, relu(typed_load<In, V>(xp, i)), nt);
  });
}

// dx = dy where x > 0, else 0. `x` may be the forward's input or its output y = relu(x) (both are
// positive at the same elements), so a network need keep only one of them. dx may alias dy.
template <class Dev, class Dy, class In, class Dx>
void relu_backward(Dev& dev, std::span<const Dy> dy, std::span<const In> x, std::span<Dx> dx) {
  using namespace detail::act;
  static_assert(row_io_type<Dy> && row_io_type<In> && row_io_type<Dx>, "tessel::relu_backward: f32 or bf16 spans");
  check_same(x.size(), dy.size(), "relu_backward", "dy");
  check_same(x.size(), dx.size(), "relu_backward", "dx");
  check_ptr(x, "relu_backward", "x");
  check_ptr(dy, "relu_backward", "dy");
  check_ptr(dx, "relu_backward", "dx");
  const Dy* gp = dy.data();
  const In* xp = x.data();
  Dx* dp = dx.data();
  launch_map<Dx>(dev, x.size(), (const void*)dp == (const void*)xp || (const void*)dp == (const void*)gp, [=](std::size_t i, auto v0, bool nt) {
    using V = decltype(v0);
    typed_store_nt<Dx, V>(dp, i, relu_grad(typed_load<Dy, V>(gp, i), typed_load<In, V>(xp, i)), nt);
  });
}

// y = a + b elementwise (a residual join; or the two gradients of a tensor read by two branches).
// y may alias a or b.
template <class Dev, class In, class Out>
void add_forward(Dev& dev, std::span<const In> a, std::span<const In> b, std::span<Out> y) {
  using namespace detail::act;
  static_assert(row_io_type<In> && row_io_type<Out>, "tessel::add_forward: f32 or bf16 spans");
  check_same(a.size(), b.size(), "add_forward", "b");
  check_same(a.size(), y.size(), "add_forward", "y");
  check_ptr(a, "add_forward", "a");
  check_ptr(b, "add_forward", "b");
  check_ptr(y, "add_forward", "y");
  const In* ap = a.data();
  const In* bp = b.data();
  Out* yp = y.data();
  launch_map<Out>(dev, a.size(), (const void*)yp == (const void*)ap || (const void*)yp == (const void*)bp, [=](std::size_t i, auto v0, bool nt) {
    using V = decltype(v0);
    typed_store_nt<Out, V>(yp, i, typed_load<In, V>(ap, i) + typed_load<In, V>(bp, i), nt);
  });
}

}  // namespace v0
}  // namespace tessel
