// Internals shared by the row-wise training operators (norm, softmax, loss, activation, rope):
// typed lane loads/stores for f32 and bf16 rows, fixed-order lane reductions, argument checks and
// the split of rows into blocks. Not a public header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <tessel/arch/stream.hpp>
#include <tessel/tile/tensor.hpp>
#include <tessel/types/bf16.hpp>

namespace tessel {
inline namespace v0 {
// Bad norm/activation/softmax/loss/rope input (shapes, null data, eps, scales, labels).
struct layer_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
}  // namespace v0
}  // namespace tessel

namespace tessel::detail::rows {

namespace st = tessel::arch::stream;

template <class T>
concept row_io_type = std::is_same_v<std::remove_const_t<T>, float> || std::is_same_v<std::remove_const_t<T>, bf16>;

template <class T>
inline float load1(const T* p, std::size_t i) {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>) return p[i];
  else return st::bf16_bits_to_f32(reinterpret_cast<const std::uint16_t*>(p)[i]);
}
template <class T>
inline st::vf loadv(const T* p, std::size_t i) {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>) return st::load(p + i);
  else return st::load_bf16(reinterpret_cast<const std::uint16_t*>(p) + i);
}
template <class T>
inline void store1(T* p, std::size_t i, float x) {
  if constexpr (std::is_same_v<T, float>) p[i] = x;
  else reinterpret_cast<std::uint16_t*>(p)[i] = st::f32_to_bf16_bits(x);
}
template <class T>
inline void storev(T* p, std::size_t i, st::vf x) {
  if constexpr (std::is_same_v<T, float>) st::store(x, p + i);
  else st::store_bf16(x, reinterpret_cast<std::uint16_t*>(p) + i);
}

// Write-only outputs larger than this go around the cache with non-temporal stores (no
// read-for-ownership traffic); smaller ones stay cached for the next operator to read.
inline constexpr std::size_t nt_threshold_bytes = std::size_t{16} << 20;
template <class T>
inline bool stream_out(std::size_t rows, std::size_t cols) {
  return rows != 0 && cols != 0 && rows * cols >= nt_threshold_bytes / sizeof(T);
}
// typed_store, non-temporal for vectors when `nt` (scalar tails store normally).
template <class T, class V>
inline void typed_store_nt(T* p, std::size_t i, V x, bool nt) {
  if constexpr (std::is_same_v<V, float>) {
    store1(p, i, x);
  } else if (!nt) {
    storev(p, i, x);
  } else if constexpr (std::is_same_v<T, float>) {
    st::store_nt(x, p + i);
  } else {
    st::store_u16(st::bf16_rne_lanes(x), reinterpret_cast<std::uint16_t*>(p) + i, true);
  }
}

// Runs f(i, V) over [0, n) with V = st::vf for full vectors and float for the tail.
template <class F>
inline void for_lanes(std::size_t n, F&& f) {
  std::size_t i = 0;
  for (; i + st::width <= n; i += st::width) f(i, st::vf{});
  for (; i < n; ++i) f(i, 0.0f);
}

// Fixed-order sum of g(i, V) over [0, n): lane accumulators, pairwise lane combine, tail in order.
template <class G>
inline float sum_lanes(std::size_t n, G&& g) {
  std::size_t i = 0;
  float s = 0.0f;
  if (n >= st::width) {
    st::vf acc(0.0f);
    for (; i + st::width <= n; i += st::width) acc = acc + g(i, st::vf{});
    s = st::hsum(acc);
  }
  for (; i < n; ++i) s += g(i, 0.0f);
  return s;
}

template <class V>
inline V lanes_load(const float* p, std::size_t i) {
  if constexpr (std::is_same_v<V, float>) return p[i];
  else return st::load(p + i);
}
template <class V>
inline void lanes_store(float* p, std::size_t i, V x) {
  if constexpr (std::is_same_v<V, float>) p[i] = x;
  else st::store(x, p + i);
}
template <class T, class V>
inline V typed_load(const T* p, std::size_t i) {
  if constexpr (std::is_same_v<V, float>) return load1(p, i);
  else return loadv(p, i);
}
template <class T, class V>
inline void typed_store(T* p, std::size_t i, V x) {
  if constexpr (std::is_same_v<V, float>) store1(p, i, x);
  else storev(p, i, x);
}

// Rows per block so a block streams about `target` elements (at least one row).
inline std::size_t rows_per_block(std::size_t rows, std::size_t cols, std::size_t target = std::size_t{1} << 15) {
  std::size_t r = cols >= target ? 1 : target / (cols ? cols : 1);
  return r == 0 ? 1 : (r > rows && rows > 0 ? rows : r);
}

template <class E>
inline void require(bool ok, const std::string& msg) {
  if (!ok) throw E("tessel: " + msg);
}

inline std::string shape(std::size_t r, std::size_t c) { return tessel::detail::shape_str(r, c); }

// A (rows, cols) tensor view must be row-major with unit column stride (rows may be padded).
template <class E, class T>
inline void check_rows(const tensor<T, 2>& t, std::size_t rows, std::size_t cols, const std::string& what) {
  require<E>(t.rows() == rows && t.cols() == cols, what + " is " + shape(t.rows(), t.cols()) + ", expected " + shape(rows, cols));
  require<E>(t.empty() || t.col_stride() == 1, what + " must have unit column stride");
  require<E>(t.empty() || t.data() != nullptr, what + " is null");
}

}  // namespace tessel::detail::rows
