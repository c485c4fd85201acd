// Reference for collectives tests (nccl-tests style): per-(seed, rank, index) data that any rank can
// regenerate, and a plain scalar reduction in the canonical order (rank 0..n-1, 8/16-bit floats in
// FP32 rounded once, wrapping integers) written independently of the library's kernels.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <tessel/collectives/reduce_op.hpp>
#include <tessel/types.hpp>

namespace tessel_ref {

inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Element i of rank r's input for a test with this seed and op, as a value of T.
template <class T>
T gen(std::uint64_t seed, int rank, std::size_t i, tessel::reduce_op op) {
  const std::uint64_t h = mix(seed ^ mix(static_cast<std::uint64_t>(rank) * 0x100000001b3ull ^ mix(i)));
  if constexpr (std::is_integral_v<T>) {
    if (op == tessel::reduce_op::prod) return static_cast<T>(static_cast<std::int64_t>(h % 5) - 2);
    return static_cast<T>(h);
  } else {
    const double u = static_cast<double>(h >> 11) * 0x1.0p-53;  // [0,1)
    double v;
    if (op == tessel::reduce_op::prod)
      v = 0.5 + 1.5 * u;  // stays finite over 8 ranks in every format
    else
      v = (u - 0.5) * 16.0;
    return T(v);
  }
}

template <class T>
using acc_of = std::conditional_t<std::is_class_v<T>, float, T>;

template <class A>
A ref_op(tessel::reduce_op op, A a, A b) {
  using tessel::reduce_op;
  if constexpr (std::is_integral_v<A>) {
    using U = std::conditional_t<(sizeof(A) < 4), std::uint32_t, std::make_unsigned_t<A>>;
    switch (op) {
      case reduce_op::sum:
      case reduce_op::avg: return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
      case reduce_op::prod: return static_cast<A>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
      case reduce_op::min: return b < a ? b : a;
      case reduce_op::max: return a < b ? b : a;
    }
  } else {
    switch (op) {
      case reduce_op::sum:
      case reduce_op::avg: return a + b;
      case reduce_op::prod: return a * b;
      case reduce_op::min: return std::isnan(a) ? a : std::isnan(b) ? b : (b < a ? b : a);
      case reduce_op::max: return std::isnan(a) ? a : std::isnan(b) ? b : (a < b ? b : a);
    }
  }
  return a;
}

template <class T>
acc_of<T> ref_widen(T x) {
  if constexpr (std::is_class_v<T>)
    return static_cast<float>(x);
  else
    return x;
}

// Canonical reduction of element i over n ranks.
template <class T>
T reduce_elem(std::uint64_t seed, int n, std::size_t i, tessel::reduce_op op) {
  using A = acc_of<T>;
  A acc = ref_widen(gen<T>(seed, 0, i, op));
  for (int r = 1; r < n; ++r) acc = ref_op<A>(op, acc, ref_widen(gen<T>(seed, r, i, op)));
  if (op == tessel::reduce_op::avg) {
    if constexpr (std::is_integral_v<A>) {
      if constexpr (std::is_signed_v<A>)
        acc = static_cast<A>(static_cast<std::int64_t>(acc) / n);
      else
        acc = static_cast<A>(static_cast<std::uint64_t>(acc) / static_cast<std::uint64_t>(n));
    } else {
      acc = acc / static_cast<A>(n);
    }
  }
  if constexpr (std::is_class_v<T>)
    return T(acc);
  else
    return acc;
}

template <class T>
std::vector<T> gen_vec(std::uint64_t seed, int rank, std::size_t count, tessel::reduce_op op, std::size_t first = 0) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = gen<T>(seed, rank, first + i, op);
  return v;
}

template <class T>
std::vector<T> reduce_vec(std::uint64_t seed, int n, std::size_t count, tessel::reduce_op op) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = reduce_elem<T>(seed, n, i, op);
  return v;
}

// Number of elements whose bits differ (the #wrong column of tessel-perf uses the same rule).
template <class T>
std::size_t count_wrong(const T* got, const T* want, std::size_t n) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += std::memcmp(got + i, want + i, sizeof(T)) != 0;
  return bad;
}

}  // namespace tessel_ref
