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

#include <tessel/ops/errors.hpp>
#include <tessel/arch/stream.hpp>
#include <tessel/tile/tensor.hpp>
#include <tessel/types/bf16.hpp>

namespace tessel::detail::rows {

namespace st = tessel::arch::stream;

template <class T>
concept row_io_type = std::is_same_v < std::remove_const_t<T>,
float > || std::is_same_v<std::remove_const_t<T>, bf16>;

template <class T>
inline float load1(const T* p, std::size_t i) {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>)
    return p[i];
  else
    return st::bf16_bits_to_f32(reinterpret_cast<const std::uint16_t*>(p)[i]);
}
template <class T>
inline st::vf loadv(const T* p, std::size_t i) {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>)
    return st::load(p + i);
  else
    return st::load_bf16(reinterpret_cast<const std::uint16_t*>(p) + i);
}
template <class T>
inline void store1(T* p, std::size_t i, float x) {
  if constexpr (std::is_same_v<T, float>)
    p[i] = x;
  else
    reinterpret_cast<std::uint16_t*>(p)[i] = st::f32_to_bf16_bits(x);
}
template <class T>
inline void storev(T* p, std::size_t i, st::vf x) {
  if constexpr (std::is_same_v<T, float>)
    st::store(x, p + i);
  else
    st::store_bf16(x, reinterpret_cast<std::uint16_t*>(p) + i);
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
    st::store_bf16(x, reinterpret_cast<std::uint16_t*>(p) + i, true);
  }
}

// Runs f(i, V) over [0, n) with V = st::vf for full vectors and float for the tail.
template <class F>
inline void for_lanes(std::size_t n, F&& f) {
  std::size_t i = 0;
  for (; i + st::width <= n; i += st::width) f(i, st::vf{});
  for (; i < n; ++i) f(i, 0.0f);
}

// Adds v (or v², Sq) to the accumulator with one explicit rounding pattern. Squares use an
// explicit fma: left as v * v + acc, GCC's default -ffp-contract=fast may fuse it in one inlining
// context and not in another, and two code paths meant to agree bit for bit would not.
template <bool Sq, class V>
inline V accumulate(V acc, V v) {
  if constexpr (Sq)
    return st::fma(v, v, acc);
  else
    return acc + v;
}

// Fixed-order sum of g(i, V) (or of its squares) over [0, n): lane accumulators, pairwise lane
// combine, tail in order.
template <bool Sq = false, class G>
inline float sum_lanes(std::size_t n, G&& g) {
  std::size_t i = 0;
  float s = 0.0f;
  if (n >= st::width) {
    st::vf acc(0.0f);
    for (; i + st::width <= n; i += st::width) acc = accumulate<Sq>(acc, st::vf(g(i, st::vf{})));
    s = st::hsum(acc);
  }
  for (; i < n; ++i) s = accumulate<Sq>(s, float(g(i, 0.0f)));
  return s;
}

// One loop over [0, n) that runs f(i, V) and returns sum_lanes<Sq>(n, g) in exactly its order:
// it fuses the output pass of one row with the first (memory-reading) pass of the next, so the
// row's writes and the next row's reads stream at the same time, like one elementwise pass.
template <bool Sq = false, class F, class G>
inline float for_lanes_sum(std::size_t n, F&& f, G&& g) {
  std::size_t i = 0;
  float s = 0.0f;
  if (n >= st::width) {
    st::vf acc(0.0f);
    for (; i + st::width <= n; i += st::width) {
      f(i, st::vf{});
      acc = accumulate<Sq>(acc, st::vf(g(i, st::vf{})));
    }
    s = st::hsum(acc);
  }
  for (; i < n; ++i) {
    f(i, 0.0f);
    s = accumulate<Sq>(s, float(g(i, 0.0f)));
  }
  return s;
}

// Shifted moments of g over [0, n) in one fixed-order loop that also runs f(i, V) (as
// for_lanes_sum): s1 = Σ (g − c), s2 = Σ (g − c)². With c a value of the row itself, the
// variance s2/n − (s1/n)² loses nothing to cancellation unless c lies far from the mean.
struct moments {
  float s1, s2;
};
template <class F, class G>
inline moments for_lanes_moments(std::size_t n, float c, F&& f, G&& g) {
  std::size_t i = 0;
  float s1 = 0.0f, s2 = 0.0f;
  if (n >= st::width) {
    st::vf a1(0.0f), a2(0.0f);
    const st::vf cv(c);
    for (; i + st::width <= n; i += st::width) {
      f(i, st::vf{});
      const st::vf d = st::vf(g(i, st::vf{})) - cv;
      a1 = a1 + d;
      a2 = st::fma(d, d, a2);
    }
    s1 = st::hsum(a1);
    s2 = st::hsum(a2);
  }
  for (; i < n; ++i) {
    f(i, 0.0f);
    const float d = float(g(i, 0.0f)) - c;
    s1 = s1 + d;
    s2 = st::fma(d, d, s2);
  }
  return {s1, s2};
}

template <class V>
inline V lanes_load(const float* p, std::size_t i) {
  if constexpr (std::is_same_v<V, float>)
    return p[i];
  else
    return st::load(p + i);
}
template <class V>
inline void lanes_store(float* p, std::size_t i, V x) {
  if constexpr (std::is_same_v<V, float>)
    p[i] = x;
  else
    st::store(x, p + i);
}
template <class T, class V>
inline V typed_load(const T* p, std::size_t i) {
  if constexpr (std::is_same_v<V, float>)
    return load1(p, i);
  else
    return loadv(p, i);
}
template <class T, class V>
inline void typed_store(T* p, std::size_t i, V x) {
  if constexpr (std::is_same_v<V, float>)
    store1(p, i, x);
  else
    storev(p, i, x);
}

// Rows per block so a block streams about `target` elements (at least one row). Row-streaming
// programs that overlap one row's output with the next row's input use `pipelined_block`: longer
// blocks, so the unoverlapped first and last row of each block cost little.
inline constexpr std::size_t pipelined_block = std::size_t{1} << 18;
inline std::size_t rows_per_block(std::size_t rows, std::size_t cols, std::size_t target = std::size_t{1} << 15) {
  std::size_t r = cols >= target ? 1 : target / (cols ? cols : 1);
  return r == 0 ? 1 : (r > rows && rows > 0 ? rows : r);
}

template <class E>
inline void require(bool ok, const std::string& msg) {
  if (!ok) throw E(msg);
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
