// Epilogue chains, composed at compile time with `|` and applied by `store` to each output row
// while it is still in cache: alpha/beta, bias per column or per row, ReLU, GELU (tanh, erf), SiLU,
// residual add, scale, and a saturating cast to bf16/fp16/e4m3/e5m2 that can report the output
// amax (FP8 training recipes). An absent epilogue is an empty chain and costs nothing.
#pragma once

#include <atomic>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

#include <tessel/tile/errors.hpp>
#include <tessel/arch/math.hpp>
#include <tessel/arch/unpack.hpp>
#include <tessel/tile/tensor.hpp>

namespace tessel {
inline namespace v0 {
namespace epilogue {

// What an op sees of the row being stored: global row index, first global column, and the old
// destination values (for beta and in-place residuals).
struct row_info {
  std::size_t row = 0, col0 = 0;
  const void* old = nullptr;   // destination row before the store
  std::size_t old_stride = 1;  // elements
  float (*old_at)(const void*, std::size_t) = nullptr;
  const float* old_f32 = nullptr;  // the same row when it is contiguous f32 (else null: old_at)
  float old_value(std::size_t j) const { return old_at(old, j * old_stride); }
};

struct op_base {};

// v = alpha * v + beta * C_old (beta == 0 never reads C, so C may hold NaN/garbage).
struct alpha_beta : op_base {
  float alpha = 1.0f, beta = 0.0f;
  alpha_beta(float a, float b) : alpha(a), beta(b) {}
  void apply(float* v, std::size_t n, const row_info& ri) const {
    if (beta == 0.0f) {
      if (alpha != 1.0f)
        for (std::size_t j = 0; j < n; ++j) v[j] *= alpha;
    } else if (const float* o = ri.old_f32) {  // the same expression on a direct load: it vectorizes
      // (one call through old_at per element was 3-4 cycles: NN 2048x512x256 with beta 1 took 1.4x
      // its time with beta 0)
      for (std::size_t j = 0; j < n; ++j) v[j] = alpha * v[j] + beta * o[j];
    } else {
      for (std::size_t j = 0; j < n; ++j) v[j] = alpha * v[j] + beta * ri.old_value(j);
    }
  }
};

struct scale : op_base {
  float s = 1.0f;
  explicit scale(float x) : s(x) {}
  void apply(float* v, std::size_t n, const row_info&) const {
    for (std::size_t j = 0; j < n; ++j) v[j] *= s;
  }
};

// Per-column bias (one value per output column): v(i, j) += bias[j].
struct bias : op_base {
  std::span<const float> b;
  explicit bias(std::span<const float> x) : b(x) {}
  void apply(float* v, std::size_t n, const row_info& ri) const {
    if (ri.col0 + n > b.size())
      throw tile_error(errc::out_of_range, "epilogue::bias: " + std::to_string(b.size()) + " values for column " + std::to_string(ri.col0 + n - 1));
    const float* p = b.data() + ri.col0;
    for (std::size_t j = 0; j < n; ++j) v[j] += p[j];
  }
};
using bias_col = bias;

// Per-row bias: v(i, j) += bias[i].
struct bias_row : op_base {
  std::span<const float> b;
  explicit bias_row(std::span<const float> x) : b(x) {}
  void apply(float* v, std::size_t n, const row_info& ri) const {
    if (ri.row >= b.size())
      throw tile_error(errc::out_of_range, "epilogue::bias_row: " + std::to_string(b.size()) + " values for row " + std::to_string(ri.row));
    const float x = b[ri.row];
    for (std::size_t j = 0; j < n; ++j) v[j] += x;
  }
};

// v(i, j) += R(i, j) for a residual tensor shaped like the output.
template <class T>
struct residual : op_base {
  tensor<const T, 2> r;
  explicit residual(tensor<const T, 2> x) : r(x) {}
  void apply(float* v, std::size_t n, const row_info& ri) const {
    if (ri.row >= r.rows() || ri.col0 + n > r.cols())
      throw tile_error(errc::out_of_range, "epilogue::residual: a (" + std::to_string(r.rows()) + "," + std::to_string(r.cols()) +
                                               ") residual is smaller than the output");
    for (std::size_t j = 0; j < n; ++j) v[j] += arch::to_f32(r(ri.row, ri.col0 + j));
  }
};
template <class T>
residual(tensor<T, 2>) -> residual<std::remove_const_t<T>>;

struct relu_t : op_base {
  void apply(float* v, std::size_t n, const row_info&) const { arch::math::relu_inplace(v, n); }
};
struct gelu_tanh_t : op_base {
  void apply(float* v, std::size_t n, const row_info&) const { arch::math::gelu_tanh_inplace(v, n); }
};
struct gelu_erf_t : op_base {
  void apply(float* v, std::size_t n, const row_info&) const { arch::math::gelu_erf_inplace(v, n); }
};
struct silu_t : op_base {
  void apply(float* v, std::size_t n, const row_info&) const { arch::math::silu_inplace(v, n); }
};
inline constexpr relu_t relu{};
inline constexpr gelu_tanh_t gelu_tanh{};
inline constexpr gelu_erf_t gelu_erf{};
inline constexpr gelu_tanh_t gelu{};  // the tanh form, as GPT-style models use
inline constexpr silu_t silu{};

// Saturating cast to the destination type T; optionally records max |v| (before the cast) into
// `amax` (an atomic max, so the result does not depend on block order or thread count).
template <class T>
struct cast_t : op_base {
  using out_type = T;
  std::atomic<float>* amax = nullptr;
  void apply(float* v, std::size_t n, const row_info&) const {
    if (!amax) return;
    float m = 0.0f;
    for (std::size_t j = 0; j < n; ++j) {
      const float a = v[j] < 0 ? -v[j] : v[j];
      m = a > m ? a : m;
    }
    float cur = amax->load(std::memory_order_relaxed);
    while (m > cur && !amax->compare_exchange_weak(cur, m, std::memory_order_relaxed)) {}
  }
};
template <class T>
inline constexpr cast_t<T> cast{};
template <class T>
cast_t<T> cast_amax(std::atomic<float>& amax) {
  cast_t<T> c;
  c.amax = &amax;
  return c;
}

template <class X>
concept op = std::is_base_of_v<op_base, X>;

// An ordered list of ops; `out_type` is the cast target (void: the destination's own type).
template <class... Ops>
struct chain {
  std::tuple<Ops...> ops;
  void apply(float* v, std::size_t n, const row_info& ri) const {
    std::apply([&](const auto&... o) { (o.apply(v, n, ri), ...); }, ops);
  }
  static constexpr bool empty = sizeof...(Ops) == 0;
};

namespace detail {
template <class X>
struct as_chain {
  using type = chain<X>;
  static type make(const X& x) { return type{std::tuple<X>(x)}; }
};
template <class... O>
struct as_chain<chain<O...>> {
  using type = chain<O...>;
  static type make(const chain<O...>& c) { return c; }
};
template <class X>
struct is_cast : std::false_type {};
template <class T>
struct is_cast<cast_t<T>> : std::true_type {};
template <class... O>
struct last_cast {
  using type = void;
};
template <class A>
struct last_cast<A> {
  using type = void;
};
template <class T>
struct last_cast<cast_t<T>> {
  using type = T;
};
template <class A, class B, class... O>
struct last_cast<A, B, O...> : last_cast<B, O...> {};
template <class C>
struct cast_of {
  using type = void;
};
template <class... O>
struct cast_of<chain<O...>> {
  using type = typename last_cast<O...>::type;
};
}  // namespace detail

template <class A, class B>
requires((op<A> || requires { A::empty; }) && (op<B> || requires { B::empty; })) auto operator|(const A& a, const B& b) {
  auto ca = detail::as_chain<A>::make(a);
  auto cb = detail::as_chain<B>::make(b);
  using R = decltype(std::tuple_cat(ca.ops, cb.ops));
  return [&]<class... O>(std::type_identity<std::tuple<O...>>) { return chain<O...>{std::tuple_cat(ca.ops, cb.ops)}; }(std::type_identity<R>{});
}

// The cast target of a chain (void when it has no trailing cast).
template <class C>
using cast_type_t = typename detail::cast_of<typename detail::as_chain<C>::type>::type;

}  // namespace epilogue
}  // namespace v0
}  // namespace tessel
