// Row softmax as a streaming tile program: y = softmax(scale·x + mask) per row, forward and
// backward, with an optional additive mask tensor and/or a causal mask. Each row is read once; the
// exponentials are computed once into the worker's scratch and normalised from there. A row with
// every entry masked gives zeros (not NaN). Results do not depend on the number of workers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include <tessel/ops/detail/norm_rows.hpp>
#include <tessel/tile/block_ctx.hpp>
#include <tessel/tile/tensor.hpp>

namespace tessel {
inline namespace v0 {

struct softmax_options {
  float scale = 1.0f;                 // applied to x before the mask
  tensor<const float, 2> mask{};      // additive (rows, n) mask, e.g. 0 / -inf; empty = none
  bool causal = false;                // column j of row i is masked when j > i + causal_offset
  std::int64_t causal_offset = 0;
};

}  // namespace v0

namespace detail::softmax {

namespace st = tessel::arch::stream;
using namespace tessel::detail::rows;

inline constexpr float neg_inf = -std::numeric_limits<float>::infinity();

template <class In, class Out>
struct fwd_program {
  tensor<const In, 2> x;
  tensor<Out, 2> y;
  tensor<const float, 2> mask;
  float scale;
  bool causal;
  std::int64_t offset;
  std::size_t rpb, rows, n;
  bool nt;
  void operator()(block_ctx& ctx) const {
    const std::size_t r0 = ctx.block_linear() * rpb, r1 = std::min(rows, r0 + rpb);
    float* buf = ctx.scratch().template allocate_array<float>(n);
    for (std::size_t r = r0; r < r1; ++r) {
      std::size_t len = n;  // columns that are not causally masked
      if (causal) {
        const std::int64_t last = std::int64_t(r) + offset;  // last visible column
        len = last < 0 ? 0 : std::min<std::size_t>(n, std::size_t(last) + 1);
      }
      const In* xr = &x(r, 0);
      const float* mr = mask.data() ? &mask(r, 0) : nullptr;
      st::vf mv(neg_inf);
      float ms = neg_inf;
      for_lanes(len, [&](std::size_t i, auto v0) {
        using V = decltype(v0);
        V z = typed_load<In, V>(xr, i) * V(scale);
        if (mr) z = z + lanes_load<V>(mr, i);
        lanes_store<V>(buf, i, z);
        if constexpr (std::is_same_v<V, float>) ms = st::max(ms, z);
        else mv = st::max(mv, z);
      });
      const float m = std::max(ms, st::hmax(mv));
      Out* yr = &y(r, 0);
      if (m == neg_inf) {  // nothing visible: zeros
        for_lanes(n, [&](std::size_t i, auto v0) { typed_store<Out, decltype(v0)>(yr, i, decltype(v0)(0.0f)); });
        continue;
      }
      // While the exponentials are computed from cache, the next row streams in.
      const In* next = r + 1 < r1 ? &x(r + 1, 0) : nullptr;
      const float s = sum_lanes(len, [&](std::size_t i, auto v0) {
        using V = decltype(v0);
        if constexpr (!std::is_same_v<V, float>)
          if (next) st::prefetch(next + i);
        const V e = st::exp_fast(lanes_load<V>(buf, i) - V(m));
        lanes_store<V>(buf, i, e);
        return e;
      });
      const float inv = 1.0f / s;  // one division per row; y = e·(1/s) is within 1.5 ulp of e/s
      for_lanes(len, [&](std::size_t i, auto v0) {
        using V = decltype(v0);
        typed_store_nt<Out, V>(yr, i, lanes_load<V>(buf, i) * V(inv), nt);
      });
      for (std::size_t i = len; i < n; ++i) store1(yr, i, 0.0f);
    }
    if (nt) st::nt_fence();
  }
};

template <class Dy, class Y, class Dx>
struct bwd_program {
  tensor<const Dy, 2> dy;
  tensor<const Y, 2> y;
  tensor<Dx, 2> dx;
  float scale;
  std::size_t rpb, rows, n;
  bool nt;
  void operator()(block_ctx& ctx) const {
    const std::size_t r0 = ctx.block_linear() * rpb, r1 = std::min(rows, r0 + rpb);
    for (std::size_t r = r0; r < r1; ++r) {
      const Dy* dr = &dy(r, 0);
      const Y* yr = &y(r, 0);
      Dx* xr = &dx(r, 0);
      const float dot = sum_lanes(n, [&](std::size_t i, auto v0) {
        using V = decltype(v0);
        return typed_load<Dy, V>(dr, i) * typed_load<Y, V>(yr, i);
      });
      for_lanes(n, [&](std::size_t i, auto v0) {
        using V = decltype(v0);
        typed_store_nt<Dx, V>(xr, i, V(scale) * (typed_load<Y, V>(yr, i) * (typed_load<Dy, V>(dr, i) - V(dot))), nt);
      });
    }
    if (nt) st::nt_fence();
  }
};

}  // namespace detail::softmax

inline namespace v0 {

// y (rows, n) = softmax over each row of scale·x + mask (+ causal mask). In: f32/bf16; Out: f32/bf16.
template <class Dev, class In, class Out>
void softmax_forward(Dev& dev, tensor<const In, 2> x, tensor<Out, 2> y, const softmax_options& o = {}) {
  using namespace detail::rows;
  static_assert(row_io_type<In> && row_io_type<Out>, "tessel::softmax_forward: f32 or bf16 tensors");
  const std::size_t rows = x.rows(), n = x.cols();
  check_rows<layer_error>(x, rows, n, "softmax_forward: x");
  check_rows<layer_error>(y, rows, n, "softmax_forward: y");
  if (o.mask.data()) check_rows<layer_error>(o.mask, rows, n, "softmax_forward: mask");
  require<layer_error>(std::isfinite(o.scale), "softmax_forward: scale must be finite");
  if (rows == 0 || n == 0) return;
  const std::size_t rpb = rows_per_block(rows, n);
  dev.launch(grid{(rows + rpb - 1) / rpb}, detail::softmax::fwd_program<In, Out>{x, y, o.mask, o.scale, o.causal, o.causal_offset, rpb, rows, n,
                                                                                 detail::rows::stream_out<Out>(rows, n) && (const void*)y.data() != (const void*)x.data()});
}

// dx = scale · y ⊙ (dy − Σ_j dy_j y_j) per row: the gradient with respect to x of softmax_forward.
template <class Dev, class Dy, class Y, class Dx>
void softmax_backward(Dev& dev, tensor<const Dy, 2> dy, tensor<const Y, 2> y, tensor<Dx, 2> dx, float scale = 1.0f) {
  using namespace detail::rows;
  static_assert(row_io_type<Dy> && row_io_type<Y> && row_io_type<Dx>, "tessel::softmax_backward: f32 or bf16 tensors");
  const std::size_t rows = y.rows(), n = y.cols();
  check_rows<layer_error>(dy, rows, n, "softmax_backward: dy");
  check_rows<layer_error>(y, rows, n, "softmax_backward: y");
  check_rows<layer_error>(dx, rows, n, "softmax_backward: dx");
  require<layer_error>(std::isfinite(scale), "softmax_backward: scale must be finite");
  if (rows == 0 || n == 0) return;
  const std::size_t rpb = rows_per_block(rows, n);
  dev.launch(grid{(rows + rpb - 1) / rpb}, detail::softmax::bwd_program<Dy, Y, Dx>{
                                                   dy, y, dx, scale, rpb, rows, n,
                                                   detail::rows::stream_out<Dx>(rows, n) && (const void*)dx.data() != (const void*)dy.data() &&
                                                       (const void*)dx.data() != (const void*)y.data()});
}

}  // namespace v0
}  // namespace tessel
