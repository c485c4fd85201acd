// Internals of the graph executor: a range-parallel launch on any device, numpy broadcasting index
// plans, element loads/stores through double for the ops that mix dtypes (Cast, Pow's exponent), and
// the dtype dispatch the kernels use. Users never include this.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <tessel/detail/checked.hpp>
#include <tessel/device/device.hpp>
#include <tessel/graph/ir.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp16.hpp>

namespace tessel {
inline namespace v0 {
namespace graph {
namespace detail::exec {

using shape_t = std::vector<std::size_t>;

inline std::size_t numel_of(const shape_t& s) {
  std::size_t n = 1;
  for (std::size_t d : s) n = tessel::detail::mul_checked(n, d, "graph executor: element count");
  return n;
}

// Runs f(begin, end) over [0, n) in blocks of `grain` on the device's workers. Each element is
// computed by one block alone, so results do not depend on the worker count.
template <class F>
struct range_program {
  const F* f;
  std::size_t n, grain;
  void operator()(block_ctx& ctx) const {
    const std::size_t b = ctx.block_linear() * grain;
    (*f)(b, std::min(n, b + grain));
  }
};

template <class Dev, class F>
void parallel_for(Dev& dev, std::size_t n, std::size_t grain, const F& f) {
  if (n == 0) return;
  grain = std::max<std::size_t>(grain, 1);
  dev.launch(grid{(n + grain - 1) / grain}, range_program<F>{&f, n, grain});
}

// Numpy broadcasting of several inputs to `out`: per input, the element stride of each output axis
// (0 where the input has size 1 or lacks the axis).
struct bcast {
  shape_t out;
  std::vector<shape_t> strides;  // [input][axis]

  bcast(shape_t o, const std::vector<shape_t>& ins) : out(std::move(o)) {
    const std::size_t r = out.size();
    for (const shape_t& s : ins) {
      shape_t st(r, 0);
      std::size_t acc = 1;
      for (std::size_t k = 0; k < s.size(); ++k) {
        const std::size_t ax = s.size() - 1 - k;  // input axis
        const std::size_t oa = r - 1 - k;         // output axis
        st[oa] = s[ax] == 1 ? 0 : acc;
        acc *= s[ax];
      }
      strides.push_back(std::move(st));
    }
  }

  // The output index of flat element `begin` (idx, per axis) and each input's offset there (off).
  void seek(std::size_t begin, std::vector<std::size_t>& idx, std::vector<std::size_t>& off) const {
    std::size_t rem = begin;
    for (std::size_t a = out.size(); a-- > 0;) {
      idx[a] = out[a] ? rem % out[a] : 0;
      rem = out[a] ? rem / out[a] : 0;
    }
    for (std::size_t j = 0; j < strides.size(); ++j)
      for (std::size_t a = 0; a < out.size(); ++a) off[j] += idx[a] * strides[j][a];
  }

  // f(i, offs): output element i reads input j at offs[j]; called for i in [begin, end) in order.
  template <class F>
  void for_range(std::size_t begin, std::size_t end, F&& f) const {
    const std::size_t r = out.size(), k = strides.size();
    std::vector<std::size_t> idx(r, 0), off(k, 0);
    seek(begin, idx, off);
    for (std::size_t i = begin; i < end; ++i) {
      f(i, off.data());
      for (std::size_t a = r; a-- > 0;) {  // odometer step
        for (std::size_t j = 0; j < k; ++j) off[j] += strides[j][a];
        if (++idx[a] < out[a]) break;
        for (std::size_t j = 0; j < k; ++j) off[j] -= strides[j][a] * out[a];
        idx[a] = 0;
      }
    }
  }

  // f(i, offs, len): output elements [i, i + len) read input j at offs[j] + t * inner(j), t < len; a
  // run ends at the end of the innermost axis or at `end`. The kernels' loops run along these runs.
  template <class F>
  void for_runs(std::size_t begin, std::size_t end, F&& f) const {
    const std::size_t r = out.size(), k = strides.size();
    std::vector<std::size_t> idx(r, 0), off(k, 0);
    if (r == 0) {
      if (begin < end) f(begin, off.data(), end - begin);
      return;
    }
    seek(begin, idx, off);
    const std::size_t last = out[r - 1];
    for (std::size_t i = begin; i < end;) {
      const std::size_t len = std::min(last - idx[r - 1], end - i);
      f(i, off.data(), len);
      i += len;
      idx[r - 1] += len;
      for (std::size_t j = 0; j < k; ++j) off[j] += len * strides[j][r - 1];
      if (idx[r - 1] < last) continue;  // only at `end`
      for (std::size_t j = 0; j < k; ++j) off[j] -= last * strides[j][r - 1];
      idx[r - 1] = 0;
      for (std::size_t a = r - 1; a-- > 0;) {  // odometer step of the outer axes
        for (std::size_t j = 0; j < k; ++j) off[j] += strides[j][a];
        if (++idx[a] < out[a]) break;
        for (std::size_t j = 0; j < k; ++j) off[j] -= strides[j][a] * out[a];
        idx[a] = 0;
      }
    }
  }
  // Input j's stride along the innermost axis (a run's step).
  std::size_t inner(std::size_t j) const { return out.empty() ? 0 : strides[j].back(); }
};

// Row-major strides of a shape.
inline shape_t strides_of(const shape_t& s) {
  shape_t st(s.size(), 1);
  for (std::size_t a = s.size(); a-- > 1;) st[a - 1] = st[a] * s[a];
  return st;
}

inline double load_double(dtype t, const std::byte* p, std::size_t i) {
  auto ld = [&]<class T>(T) {
    T x;
    std::memcpy(&x, p + i * sizeof(T), sizeof(T));
    return x;
  };
  switch (t) {
    case dtype::f32: return ld(float{});
    case dtype::f64: return ld(double{});
    case dtype::i64: return static_cast<double>(ld(std::int64_t{}));
    case dtype::i32: return ld(std::int32_t{});
    case dtype::i16: return ld(std::int16_t{});
    case dtype::i8: return ld(std::int8_t{});
    case dtype::u8: return ld(std::uint8_t{});
    case dtype::u16: return ld(std::uint16_t{});
    case dtype::u32: return ld(std::uint32_t{});
    case dtype::u64: return static_cast<double>(ld(std::uint64_t{}));
    case dtype::bf16: return static_cast<double>(static_cast<float>(ld(bf16{})));
    case dtype::fp16: return static_cast<double>(static_cast<float>(ld(fp16{})));
    default: break;
  }
  throw graph_error(errc::unsupported, std::string("graph executor: cannot read ") + std::string(dtype_name(t)) + " elements");
}

// Float to integer truncates toward zero (ONNX Cast); out-of-range values saturate.
template <class I>
I to_int(double x) {
  if (x != x) return 0;
  x = x < 0 ? -std::floor(-x) : std::floor(x);
  constexpr double lo = static_cast<double>(std::numeric_limits<I>::min()), hi = static_cast<double>(std::numeric_limits<I>::max());
  if (x <= lo) return std::numeric_limits<I>::min();
  if (x >= hi) return std::numeric_limits<I>::max();
  return static_cast<I>(x);
}

inline void store_double(dtype t, std::byte* p, std::size_t i, double x) {
  auto st = [&]<class T>(T v) { std::memcpy(p + i * sizeof(T), &v, sizeof(T)); };
  switch (t) {
    case dtype::f32: return st(static_cast<float>(x));
    case dtype::f64: return st(x);
    case dtype::i64: return st(to_int<std::int64_t>(x));
    case dtype::i32: return st(to_int<std::int32_t>(x));
    case dtype::i16: return st(to_int<std::int16_t>(x));
    case dtype::i8: return st(to_int<std::int8_t>(x));
    case dtype::u8: return st(to_int<std::uint8_t>(x));
    case dtype::u16: return st(to_int<std::uint16_t>(x));
    case dtype::u32: return st(to_int<std::uint32_t>(x));
    case dtype::u64: return st(to_int<std::uint64_t>(x));
    case dtype::bf16: return st(bf16(static_cast<float>(x)));  // via float: double rounding is at most 1 ulp apart
    case dtype::fp16: return st(fp16(static_cast<float>(x)));
    default: break;
  }
  throw graph_error(errc::unsupported, std::string("graph executor: cannot write ") + std::string(dtype_name(t)) + " elements");
}

inline bool castable(dtype t) {
  switch (t) {
    case dtype::f32:
    case dtype::f64:
    case dtype::i64:
    case dtype::i32:
    case dtype::i16:
    case dtype::i8:
    case dtype::u8:
    case dtype::u16:
    case dtype::u32:
    case dtype::u64:
    case dtype::bf16:
    case dtype::fp16: return true;
    default: return false;
  }
}

// Calls f(T{}) for the arithmetic dtypes the elementwise kernels take; others are unsupported.
template <class F>
void dispatch_arith(dtype t, const node& n, F&& f) {
  switch (t) {
    case dtype::f32: f(float{}); return;
    case dtype::f64: f(double{}); return;
    case dtype::i64: f(std::int64_t{}); return;
    case dtype::i32: f(std::int32_t{}); return;
    default: break;
  }
  throw graph_error(errc::unsupported,
                    n.label() + ": dtype " + std::string(dtype_name(t)) + " is not supported by the executor (f32, f64, i64, i32)");
}

template <class F>
void dispatch_float(dtype t, const node& n, F&& f) {
  switch (t) {
    case dtype::f32: f(float{}); return;
    case dtype::f64: f(double{}); return;
    default: break;
  }
  throw graph_error(errc::unsupported, n.label() + ": dtype " + std::string(dtype_name(t)) + " is not supported by the executor (f32, f64)");
}

// Copies elements of `size` bytes (1, 2, 4, 8 or any) from src[soff] to dst[doff].
inline void copy_elem(std::byte* dst, std::size_t doff, const std::byte* src, std::size_t soff, std::size_t size) {
  std::memcpy(dst + doff * size, src + soff * size, size);
}

}  // namespace detail::exec
}  // namespace graph
}  // namespace v0
}  // namespace tessel
