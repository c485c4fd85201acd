// Reduction operators and the arithmetic rules every algorithm shares: 8/16-bit floats are reduced
// in FP32 and rounded once, integers wrap (two's complement), min/max propagate NaN, and every
// element is reduced in rank order 0, 1, ..., n-1 (the canonical order that makes results bitwise
// identical across algorithms, chunkings and transports).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#include <tessel/collectives/errors.hpp>
#include <tessel/types/dtype.hpp>

namespace tessel {
inline namespace v0 {

enum class reduce_op : std::uint8_t { sum, prod, min, max, avg };

constexpr std::string_view reduce_op_name(reduce_op op) {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::prod: return "prod";
    case reduce_op::min: return "min";
    case reduce_op::max: return "max";
    case reduce_op::avg: return "avg";
  }
  throw comm_error(errc::invalid_argument, "invalid reduce_op value " + std::to_string(static_cast<int>(op)));
}

inline reduce_op reduce_op_from_name(std::string_view s) {
  for (auto op : {reduce_op::sum, reduce_op::prod, reduce_op::min, reduce_op::max, reduce_op::avg})
    if (reduce_op_name(op) == s) return op;
  throw comm_error(errc::invalid_argument, "unknown reduce_op '" + std::string(s) + "'");
}

// The type a dtype is reduced in: FP32 for bf16/fp16/e4m3/e5m2, itself otherwise.
constexpr dtype accumulator_dtype(dtype d) {
  switch (d) {
    case dtype::bf16:
    case dtype::fp16:
    case dtype::e4m3:
    case dtype::e5m2: return dtype::f32;
    default: return d;
  }
}

// Reductions are defined on every dtype except the packed i4x2.
constexpr bool reducible(dtype d) { return d != dtype::i4x2; }

}  // namespace v0
namespace detail {

// Timing-only runs (the emulator without payloads) execute every algorithm's message schedule but
// no arithmetic and no copies: set per thread by the communicator while it runs such a collective.
inline thread_local bool coll_dry_run = false;

// memmove that a timing-only run skips.
inline void copy_bytes(void* dst, const void* src, std::size_t n) {
  if (n && !coll_dry_run && dst != src) std::memmove(dst, src, n);
}

template <class T>
using acc_t = std::conditional_t<(std::is_class_v<T>), float, T>;

// Wrapping integer arithmetic without signed-overflow UB (and without int promotion traps).
template <class A>
using wrap_t = std::conditional_t<(sizeof(A) < 4), std::uint32_t, std::make_unsigned_t<A>>;

template <reduce_op Op, class A>
constexpr A apply_op(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using W = wrap_t<A>;
    if constexpr (Op == reduce_op::sum || Op == reduce_op::avg)
      return static_cast<A>(static_cast<W>(static_cast<W>(a) + static_cast<W>(b)));
    else if constexpr (Op == reduce_op::prod)
      return static_cast<A>(static_cast<W>(static_cast<W>(a) * static_cast<W>(b)));
    else if constexpr (Op == reduce_op::min)
      return b < a ? b : a;
    else
      return a < b ? b : a;
  } else {
    if constexpr (Op == reduce_op::sum || Op == reduce_op::avg)
      return a + b;
    else if constexpr (Op == reduce_op::prod)
      return a * b;
    else if constexpr (Op == reduce_op::min)
      return (a != a) ? a : (b != b) ? b : (b < a ? b : a);  // NaN propagates; ties keep the earlier rank
    else
      return (a != a) ? a : (b != b) ? b : (a < b ? b : a);
  }
}

template <class T>
inline acc_t<T> coll_widen(T x) {
  if constexpr (std::is_class_v<T>)
    return static_cast<float>(x);
  else
    return x;
}

// Final step: avg divides the (wrapped, for integers) sum by n, then one rounding to T.
template <reduce_op Op, class T>
inline T coll_narrow(acc_t<T> a, int n) {
  if constexpr (Op == reduce_op::avg) {
    if constexpr (std::is_integral_v<T> && std::is_signed_v<T>)
      a = static_cast<T>(static_cast<std::int64_t>(a) / static_cast<std::int64_t>(n));
    else if constexpr (std::is_integral_v<T>)
      a = static_cast<T>(static_cast<std::uint64_t>(a) / static_cast<std::uint64_t>(n));
    else
      a = a / static_cast<acc_t<T>>(n);
  }
  if constexpr (std::is_class_v<T>)
    return T(a);
  else
    return a;
}

// Loads element i of a buffer that holds either T or acc_t<T>.
template <class T, bool IsAcc>
inline acc_t<T> load_elem(const std::byte* p, std::size_t i) {
  if constexpr (IsAcc || !std::is_class_v<T>) {
    acc_t<T> v;
    std::memcpy(&v, p + i * sizeof(acc_t<T>), sizeof v);
    return v;
  } else {
    T v;
    std::memcpy(&v, p + i * sizeof(T), sizeof v);
    return coll_widen(v);
  }
}

template <class F>
decltype(auto) visit_op(reduce_op op, F&& f) {
  switch (op) {
    case reduce_op::sum: return f(std::integral_constant<reduce_op, reduce_op::sum>{});
    case reduce_op::prod: return f(std::integral_constant<reduce_op, reduce_op::prod>{});
    case reduce_op::min: return f(std::integral_constant<reduce_op, reduce_op::min>{});
    case reduce_op::max: return f(std::integral_constant<reduce_op, reduce_op::max>{});
    case reduce_op::avg: return f(std::integral_constant<reduce_op, reduce_op::avg>{});
  }
  throw comm_error(errc::invalid_argument, "invalid reduce_op value " + std::to_string(static_cast<int>(op)));
}

// The one runtime element-type dispatch of the collectives: f(std::type_identity<T>) for the
// dtypes whose type Allowed<T> accepts, std::invalid_argument "<dtype> <why>" for the others.
// Reductions use it (every type but packed int4) and so does wire compression (bf16/e4m3/e5m2).
template <template <class> class Allowed, class Fallback, class F>
decltype(auto) visit_dtype_if(dtype d, const char* why, F&& f) {
  return visit_dtype(d, [&]<class T>(std::type_identity<T> t) -> decltype(auto) {
    if constexpr (Allowed<T>::value) {
      return f(t);
    } else {
      throw comm_error(errc::invalid_argument, std::string(dtype_name(d)) + " " + why);
      return f(std::type_identity<Fallback>{});  // never reached; gives every branch one return type
    }
  });
}
template <class T>
struct is_reducible_element : std::bool_constant<!std::is_same_v<T, tessel::int4x2>> {};

template <class F>
decltype(auto) visit_reducible(dtype d, F&& f) {
  return visit_dtype_if<is_reducible_element, float>(d, "cannot be reduced element-wise", static_cast<F&&>(f));
}

// dst[i] = op(a[i], b[i]) in the accumulator type. a holds T (a_acc == false) or acc_t<T>; b holds T.
// dst holds acc_t<T>; dst may alias a (element-wise) or b when T is its own accumulator.
inline void fold_kernel(reduce_op op, dtype d, const std::byte* a, bool a_acc, const std::byte* b, std::byte* dst, std::size_t n) {
  if (coll_dry_run) return;
  visit_reducible(d, [&]<class T>(std::type_identity<T>) {
    visit_op(op, [&]<reduce_op Op>(std::integral_constant<reduce_op, Op>) {
      using A = acc_t<T>;
      if constexpr (std::is_same_v<A, T>) {
        // same type everywhere: a plain element-wise loop the compiler vectorizes
        const T* pa = reinterpret_cast<const T*>(a);
        const T* pb = reinterpret_cast<const T*>(b);
        T* pd = reinterpret_cast<T*>(dst);
        for (std::size_t i = 0; i < n; ++i) pd[i] = apply_op<Op, A>(pa[i], pb[i]);
      } else {
        A* pd = reinterpret_cast<A*>(dst);
        if (a_acc) {
          for (std::size_t i = 0; i < n; ++i) pd[i] = apply_op<Op, A>(load_elem<T, true>(a, i), load_elem<T, false>(b, i));
        } else {
          for (std::size_t i = 0; i < n; ++i) pd[i] = apply_op<Op, A>(load_elem<T, false>(a, i), load_elem<T, false>(b, i));
        }
      }
    });
  });
}

// dst (acc_t<T>) = src (T) converted.
inline void to_acc_kernel(dtype d, const std::byte* src, std::byte* dst, std::size_t n) {
  if (coll_dry_run) return;
  visit_reducible(d, [&]<class T>(std::type_identity<T>) {
    using A = acc_t<T>;
    if constexpr (std::is_same_v<A, T>) {
      if (n && src != dst) std::memmove(dst, src, n * sizeof(T));
    } else {
      A* pd = reinterpret_cast<A*>(dst);
      for (std::size_t i = 0; i < n; ++i) pd[i] = load_elem<T, false>(src, i);
    }
  });
}

// dst (T) = finalize(src (acc_t<T>)) with n ranks; dst may alias src when T is its own accumulator.
inline void finalize_kernel(reduce_op op, dtype d, int nranks, const std::byte* src, std::byte* dst, std::size_t n) {
  if (coll_dry_run) return;
  visit_reducible(d, [&]<class T>(std::type_identity<T>) {
    visit_op(op, [&]<reduce_op Op>(std::integral_constant<reduce_op, Op>) {
      using A = acc_t<T>;
      if constexpr (std::is_same_v<A, T> && Op != reduce_op::avg) {
        if (n && src != dst) std::memmove(dst, src, n * sizeof(T));
      } else {
        for (std::size_t i = 0; i < n; ++i) {
          const T v = coll_narrow<Op, T>(load_elem<T, true>(src, i), nranks);
          std::memcpy(dst + i * sizeof(T), &v, sizeof(T));
        }
      }
    });
  });
}

}  // namespace detail
inline namespace v0 {}  // namespace v0
}  // namespace tessel
