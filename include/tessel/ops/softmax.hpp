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
  float scale = 1.0f;             // applied to x before the mask
  tensor<const float, 2> mask{};  // additive (rows, n) mask, e.g. 0 / -inf; empty = none
  bool causal = false;            // column j of row i is masked when j > i + causal_offset
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
    if (causal)
      causal_rows(ctx);
    else
      pipelined_rows(ctx);
  }

  // Full rows, as a three-stage pipeline over the block's rows: one loop over the columns writes
  // row r's output (non-temporally), exponentiates row r + 1 from cache, and reads row r + 2 from
  // memory (scale, mask, running max). Reads, writes and the exp arithmetic all overlap, and each
  // row is read once. Per row the operations and their order are those of the plain passes.
  void pipelined_rows(block_ctx& ctx) const {
    const std::size_t r0 = ctx.block_linear() * rpb, r1 = std::min(rows, r0 + rpb), cnt = r1 - r0;
    float* bufs[3];
    for (auto& b : bufs) b = ctx.scratch().template allocate_array<float>(n);
    float row_max[3] = {neg_inf, neg_inf, neg_inf}, row_inv[3] = {0.0f, 0.0f, 0.0f};
    const bool has_mask = mask.data() != nullptr;
    for (std::size_t t = 0; t < cnt + 2; ++t) {
      const bool do_head = t < cnt, do_mid = t >= 1 && t - 1 < cnt, do_out = t >= 2;
      // head: row t; mid: row t - 1; out: row t - 2 (ring slots t % 3)
      const std::size_t sh = t % 3, sm = (t + 2) % 3, so = (t + 1) % 3;
      const In* xr = do_head ? &x(r0 + t, 0) : nullptr;
      const float* mr = do_head && has_mask ? &mask(r0 + t, 0) : nullptr;
      // the row after the head row is requested into L2 a whole row ahead: the loads the core
      // keeps in flight by itself do not cover the memory latency
      const In* px = t + 1 < cnt ? &x(r0 + t + 1, 0) : nullptr;
      const float* pm = t + 1 < cnt && has_mask ? &mask(r0 + t + 1, 0) : nullptr;
      float* bh = bufs[sh];
      float* bm = bufs[sm];
      const float* bo = bufs[so];
      const float m = do_mid ? row_max[sm] : neg_inf;
      const bool mid = do_mid && m != neg_inf;  // an all-masked row has no exponentials
      const bool out_zero = do_out && row_max[so] == neg_inf;
      const float inv = row_inv[so];
      Out* yr = do_out ? &y(r0 + t - 2, 0) : nullptr;
      const auto step = [&](std::size_t i, auto v0, auto& mx, auto& sum) {
        using V = decltype(v0);
        if (do_out) typed_store_nt<Out, V>(yr, i, out_zero ? V(0.0f) : lanes_load<V>(bo, i) * V(inv), nt);
        if (mid) {
          const V e = st::exp_fast(lanes_load<V>(bm, i) - V(m));
          lanes_store<V>(bm, i, e);
          sum = sum + e;
        }
        if (do_head) {
          if constexpr (!std::is_same_v<V, float>) {
            if (px && i % (64 / sizeof(In)) == 0) st::prefetch_l2(px + i);
            if (pm) st::prefetch_l2(pm + i);
          }
          V z = typed_load<In, V>(xr, i) * V(scale);
          if (mr) z = z + lanes_load<V>(mr, i);
          lanes_store<V>(bh, i, z);
          mx = st::max(mx, z);
        }
      };
      std::size_t i = 0;
      float ms = neg_inf, s = 0.0f;
      if (n >= st::width) {
        st::vf mv(neg_inf), sv(0.0f);
        for (; i + st::width <= n; i += st::width) step(i, st::vf{}, mv, sv);
        ms = st::hmax(mv);
        s = st::hsum(sv);
      }
      float mt = neg_inf;
      for (; i < n; ++i) step(i, 0.0f, mt, s);
      if (do_head) row_max[sh] = std::max(mt, ms);
      if (do_mid) row_inv[sm] = 1.0f / s;  // one division per row; y = e·(1/s) is within 1.5 ulp of e/s
    }
    if (nt) st::nt_fence();
  }

  // Causal rows (visible lengths differ row to row): one row at a time, three passes.
  void causal_rows(block_ctx& ctx) const {
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
        if constexpr (std::is_same_v<V, float>)
          ms = st::max(ms, z);
        else
          mv = st::max(mv, z);
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
  const std::size_t rpb = rows_per_block(rows, n, o.causal ? std::size_t{1} << 15 : pipelined_block);
  dev.launch(grid{(rows + rpb - 1) / rpb},
             detail::softmax::fwd_program<In, Out>{x, y, o.mask, o.scale, o.causal, o.causal_offset, rpb, rows, n,
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
  dev.launch(grid{(rows + rpb - 1) / rpb},
             detail::softmax::bwd_program<Dy, Y, Dx>{dy, y, dx, scale, rpb, rows, n,
                                                     detail::rows::stream_out<Dx>(rows, n) && (const void*)dx.data() != (const void*)dy.data() &&
                                                         (const void*)dx.data() != (const void*)y.data()});
}

}  // namespace v0
}  // namespace tessel
