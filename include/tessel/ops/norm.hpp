// LayerNorm and RMSNorm as row-streaming tile programs, forward and backward with the parameter
// gradients. The forward fuses an optional residual add before (h = x + residual, written out for
// the next block) and a cast after: to f32, bf16, or e4m3 with a scale and the tensor's amax (the
// FP8 recipe's delayed-scaling statistic). Each row is read from memory once; its later passes run
// from a cached f32 copy in the worker's scratch. Row sums use a fixed lane order, and parameter
// gradients are summed over a fixed split of the rows in a fixed order, so results never depend on
// the number of workers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <tessel/ops/detail/norm_rows.hpp>
#include <tessel/tile/block_ctx.hpp>
#include <tessel/tile/tensor.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/convert.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel {
inline namespace v0 {

struct norm_options {
  float eps = 1e-5f;
  float out_scale = 1.0f;    // e4m3 output: y_q = e4m3(y * out_scale), saturating
  float* amax = nullptr;     // if set: max |y| over the tensor (before out_scale)
  bool accumulate = false;   // backward: add into dweight/dbias instead of overwriting
};

}  // namespace v0

namespace detail::norm {

namespace st = tessel::arch::stream;
using namespace tessel::detail::rows;

template <class V>
inline V round_bf16(V x) {
  if constexpr (std::is_same_v<V, float>) return st::bf16_bits_to_f32(st::f32_to_bf16_bits(x));
  else return st::from_bits(st::bf16_rne_lanes(x) << 16);
}

template <class In, class Out>
struct fwd_program {
  tensor<const In, 2> x, res;
  tensor<In, 2> h_out;
  const float* w;
  const float* b;  // null for RMSNorm
  tensor<Out, 2> y;
  float* mean;
  float* rstd;
  float eps, out_scale;
  bool rms, has_res, has_h_out;
  float* amax_blocks;
  std::size_t rpb, rows, n;
  bool nt;

  void operator()(block_ctx& ctx) const {
    if (has_res) rms ? rows_<true, true>(ctx) : rows_<true, false>(ctx);
    else rms ? rows_<false, true>(ctx) : rows_<false, false>(ctx);
  }

  // Memory traffic: x (and the residual) are read from memory once, in the row's first pass (its
  // sum); the variance and the output pass re-read the row from cache. The output pass of row r
  // runs in the same loop as the first pass of row r + 1, so the non-temporal writes of one row
  // and the reads of the next stream together (as in one elementwise pass) instead of in turns.
  template <bool Res, bool Rms>
  void rows_(block_ctx& ctx) const {
    const std::size_t blk = ctx.block_linear();
    const std::size_t r0 = blk * rpb, r1 = std::min(rows, r0 + rpb);
    // with a residual, h = x + residual is formed once per row into scratch (two rows alternate:
    // one is being written out while the next is formed); without one, x itself is re-read
    float* bufs[2] = {Res ? ctx.scratch().template allocate_array<float>(n) : nullptr,
                      Res ? ctx.scratch().template allocate_array<float>(n) : nullptr};
    constexpr bool fp8 = std::is_same_v<Out, e4m3>;
    float* q = fp8 ? ctx.scratch().template allocate_array<float>(n) : nullptr;
    st::vf amv(0.0f);
    float ams = 0.0f;
    const float inv_n = 1.0f / float(n);
    // first pass over row r: h, with the residual add (summed, or summed as squares for RMSNorm)
    const auto head = [&](std::size_t r) {
      const In* xr = &x(r, 0);
      // the row after is requested into L2 a whole row ahead: the few loads the core keeps in
      // flight by itself do not cover the memory latency
      const bool ahead = r + 1 < r1;
      const In* px = ahead ? &x(r + 1, 0) : nullptr;
      const In* pr = Res && ahead ? &res(r + 1, 0) : nullptr;
      const In* rr = Res ? &res(r, 0) : nullptr;
      In* hr = Res && has_h_out ? &h_out(r, 0) : nullptr;
      float* bf = bufs[(r - r0) & 1];
      return [=](std::size_t i, auto v0) {
        using V = decltype(v0);
        if constexpr (!std::is_same_v<V, float>) {
          if (px && i % (64 / sizeof(In)) == 0) st::prefetch_l2(px + i);
          if (Res && pr && i % (64 / sizeof(In)) == 0) st::prefetch_l2(pr + i);
        }
        V h = typed_load<In, V>(xr, i);
        if constexpr (Res) {
          h = h + typed_load<In, V>(rr, i);
          if constexpr (std::is_same_v<In, bf16>) h = round_bf16(h);  // normalise what is saved
          if (hr) typed_store<In, V>(hr, i, h);
          lanes_store<V>(bf, i, h);
        } else {
          (void)rr, (void)hr, (void)bf;
        }
        return h;
      };
    };
    // h of row r at lane i, from cache
    const auto cached = [&](std::size_t r) {
      const In* xr = &x(r, 0);
      const float* bf = bufs[(r - r0) & 1];
      return [=](std::size_t i, auto v0) {
        using V = decltype(v0);
        if constexpr (Res) return lanes_load<V>(bf, i);
        else return (void)bf, typed_load<In, V>(xr, i);
      };
    };
    const float* wp = w;
    const float* bp = b;
    // With a bias, weight and bias are interleaved vector by vector in scratch (once per block):
    // the output pass then reads one cached stream for both instead of two, which leaves more of
    // the core's outstanding-miss slots to the memory stream of the next row.
    constexpr std::size_t W = st::width;
    float* wb = nullptr;
    if (bp && n >= W) {
      wb = ctx.scratch().template allocate_array<float>(2 * (n / W) * W);
      for (std::size_t k = 0; k + W <= n; k += W) {
        std::copy(wp + k, wp + k + W, wb + 2 * k);
        std::copy(bp + k, bp + k + W, wb + 2 * k + W);
      }
    }
    const bool want_amax = amax_blocks != nullptr, use_nt = nt;
    const float osc = out_scale;
    // output pass of row r
    const auto out = [&](std::size_t r, float mu, float rs) {
      const auto hv = cached(r);
      Out* yr = &y(r, 0);
      return [=, &amv, &ams](std::size_t i, auto v0) {
        using V = decltype(v0);
        const V xh = (hv(i, v0) - V(mu)) * V(rs);
        V yv;
        if constexpr (std::is_same_v<V, float>) yv = bp ? st::fma(xh, wp[i], bp[i]) : xh * wp[i];
        else if (wb) yv = st::fma(xh, lanes_load<V>(wb, 2 * i), lanes_load<V>(wb, 2 * i + W));
        else yv = bp ? st::fma(xh, lanes_load<V>(wp, i), lanes_load<V>(bp, i)) : xh * lanes_load<V>(wp, i);
        if (want_amax) {
          if constexpr (std::is_same_v<V, float>) ams = st::max(ams, st::abs(yv));
          else amv = st::max(amv, st::abs(yv));
        }
        if constexpr (fp8) lanes_store<V>(q, i, yv * V(osc));
        else (void)osc, typed_store_nt<Out, V>(yr, i, yv, use_nt);
      };
    };
    if constexpr (Rms) {
      float s = sum_lanes<true>(n, head(r0));
      for (std::size_t r = r0; r < r1; ++r) {
        const float rs = 1.0f / std::sqrt(s * inv_n + eps);
        if (rstd) rstd[r] = rs;
        if (r + 1 < r1) s = for_lanes_sum<true>(n, out(r, 0.0f, rs), head(r + 1));
        else for_lanes(n, out(r, 0.0f, rs));
        if constexpr (fp8) convert(std::span<const float>(q, n), std::span<e4m3>(&y(r, 0), n), overflow::saturate);
      }
    } else {
      // LayerNorm takes the mean and variance from moments shifted by the row's first value, in
      // the same pass that reads the row (no pass over the row while memory idles). When that
      // shift is far from the mean (|mean − c| > 4σ), cancellation could cost accuracy, and the
      // exact two-pass variance is taken from the cached row instead.
      const auto nop = [](std::size_t, auto) {};
      const auto shift = [&](std::size_t r) { return float(head(r)(0, 0.0f)); };
      float c = shift(r0);
      moments m = for_lanes_moments(n, c, nop, head(r0));
      for (std::size_t r = r0; r < r1; ++r) {
        const float d = m.s1 * inv_n;
        const float mu = c + d;
        float var = m.s2 * inv_n - d * d;
        if (!(d * d <= 16.0f * var)) {  // also NaN/Inf rows
          const auto hv = cached(r);
          var = sum_lanes<true>(n, [&](std::size_t i, auto v0) {
            using V = decltype(v0);
            return hv(i, v0) - V(mu);
          }) * inv_n;
        }
        const float rs = 1.0f / std::sqrt(var + eps);
        if (mean) mean[r] = mu;
        if (rstd) rstd[r] = rs;
        if (r + 1 < r1) {
          c = shift(r + 1);
          m = for_lanes_moments(n, c, out(r, mu, rs), head(r + 1));
        } else {
          for_lanes(n, out(r, mu, rs));
        }
        if constexpr (fp8) convert(std::span<const float>(q, n), std::span<e4m3>(&y(r, 0), n), overflow::saturate);
      }
    }
    if (amax_blocks) amax_blocks[blk] = std::max(ams, st::hmax(amv));
    if (nt) st::nt_fence();
  }
};

template <class Dy, class In, class Dx>
struct bwd_program {
  tensor<const Dy, 2> dy;
  tensor<const In, 2> h;
  tensor<const float, 2> dres;
  tensor<Dx, 2> dx;
  const float* w;
  const float* mean;  // null for RMSNorm
  const float* rstd;
  float* partials;  // per block: dw (n) then db (n)
  bool want_db;
  std::size_t rpb, rows, n;
  bool nt;

  void operator()(block_ctx& ctx) const {
    const std::size_t blk = ctx.block_linear();
    const std::size_t r0 = blk * rpb, r1 = std::min(rows, r0 + rpb);
    float* pw = partials + blk * 2 * n;
    float* pb = pw + n;
    std::fill(pw, pw + 2 * n, 0.0f);
    const float inv_n = 1.0f / float(n);
    for (std::size_t r = r0; r < r1; ++r) {
      const Dy* dyr = &dy(r, 0);
      const In* hr = &h(r, 0);
      const float mu = mean ? mean[r] : 0.0f, rs = rstd[r];
      const float c1 = mean ? sum_lanes(n, [&](std::size_t i, auto v0) {
        using V = decltype(v0);
        return typed_load<Dy, V>(dyr, i) * lanes_load<V>(w, i);
      }) * inv_n : 0.0f;
      // the next row's dy and h are requested while this row's are read (two rows in flight)
      const Dy* ndy = r + 1 < rows ? &dy(r + 1, 0) : nullptr;
      const In* nh = r + 1 < rows ? &h(r + 1, 0) : nullptr;
      const float c2 = sum_lanes(n, [&](std::size_t i, auto v0) {
        using V = decltype(v0);
        if constexpr (!std::is_same_v<V, float>) {
          if (ndy && i % (64 / sizeof(Dy)) == 0) st::prefetch(ndy + i);
          if (nh && i % (64 / sizeof(In)) == 0) st::prefetch(nh + i);
        }
        const V xh = (typed_load<In, V>(hr, i) - V(mu)) * V(rs);
        return (typed_load<Dy, V>(dyr, i) * lanes_load<V>(w, i)) * xh;
      }) * inv_n;
      const float* dr = dres.data() == nullptr ? nullptr : &dres(r, 0);
      Dx* dxr = &dx(r, 0);
      for_lanes(n, [&](std::size_t i, auto v0) {
        using V = decltype(v0);
        const V d = typed_load<Dy, V>(dyr, i);
        const V xh = (typed_load<In, V>(hr, i) - V(mu)) * V(rs);
        const V g = d * lanes_load<V>(w, i);
        V out = V(rs) * ((g - V(c1)) - xh * V(c2));
        if (dr) out = out + lanes_load<V>(dr, i);
        typed_store_nt<Dx, V>(dxr, i, out, nt);
        lanes_store<V>(pw, i, st::fma(d, xh, lanes_load<V>(pw, i)));
        if (want_db) lanes_store<V>(pb, i, lanes_load<V>(pb, i) + d);
      });
    }
    if (nt) st::nt_fence();
  }
};

// dw[j] = sum over blocks in block order (then added to dw[j] when accumulating).
struct reduce_program {
  const float* partials;
  float* dw;
  float* db;
  std::size_t blocks, n, cols_per_block;
  bool accumulate;
  void operator()(block_ctx& ctx) const {
    const std::size_t c0 = ctx.block_linear() * cols_per_block, c1 = std::min(n, c0 + cols_per_block);
    for (std::size_t j = c0; j < c1; ++j) {
      float sw = 0.0f, sb = 0.0f;
      for (std::size_t k = 0; k < blocks; ++k) {
        sw += partials[k * 2 * n + j];
        if (db) sb += partials[k * 2 * n + n + j];
      }
      dw[j] = accumulate ? dw[j] + sw : sw;  // accumulate adds this pass's exact result once
      if (db) db[j] = accumulate ? db[j] + sb : sb;
    }
  }
};

template <class T>
concept norm_out = std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, e4m3>;

template <class Dev, class In, class Out>
void forward(Dev& dev, bool rms, tensor<const In, 2> x, std::span<const float> w, std::span<const float> b, tensor<Out, 2> y,
             std::span<float> mean, std::span<float> rstd, const norm_options& o, tensor<const In, 2> res, tensor<In, 2> h_out) {
  static_assert(row_io_type<In>, "tessel norm: input must be f32 or bf16");
  static_assert(norm_out<Out>, "tessel norm: output must be f32, bf16 or e4m3");
  const char* who = rms ? "rmsnorm_forward" : "layernorm_forward";
  const std::size_t rows = x.rows(), n = x.cols();
  const std::string W = who;
  check_rows<layer_error>(x, rows, n, W + ": x");
  check_rows<layer_error>(y, rows, n, W + ": y");
  require<layer_error>(n > 0 || rows == 0, W + ": rows must not be empty");
  require<layer_error>(w.size() == n, W + ": weight has " + std::to_string(w.size()) + " elements, rows have " + std::to_string(n));
  if (!rms) require<layer_error>(b.empty() || b.size() == n, W + ": bias has " + std::to_string(b.size()) + " elements, rows have " + std::to_string(n));
  require<layer_error>(mean.empty() || rms || mean.size() == rows, W + ": mean must have one element per row");
  require<layer_error>(rstd.empty() || rstd.size() == rows, W + ": rstd must have one element per row");
  require<layer_error>(std::isfinite(o.eps) && o.eps > 0.0f, W + ": eps must be positive and finite");
  require<layer_error>(std::isfinite(o.out_scale) && o.out_scale > 0.0f, W + ": out_scale must be positive and finite");
  const bool has_res = res.data() != nullptr;
  if (has_res) check_rows<layer_error>(res, rows, n, W + ": residual");
  const bool has_h = h_out.data() != nullptr;
  if (has_h) {
    require<layer_error>(has_res, W + ": residual_out needs a residual");
    check_rows<layer_error>(h_out, rows, n, W + ": residual_out");
  }
  if (rows == 0) {
    if (o.amax) *o.amax = 0.0f;
    return;
  }
  const std::size_t rpb = rows_per_block(rows, n, pipelined_block);
  const std::size_t blocks = (rows + rpb - 1) / rpb;
  std::vector<float> am(o.amax ? blocks : 0, 0.0f);
  fwd_program<In, Out> p{x, res, h_out, w.data(), (rms || b.empty()) ? nullptr : b.data(), y, (rms || mean.empty()) ? nullptr : mean.data(),
                         rstd.empty() ? nullptr : rstd.data(), o.eps, o.out_scale, rms, has_res, has_h,
                         o.amax ? am.data() : nullptr, rpb, rows, n, stream_out<Out>(rows, n)};
  dev.launch(grid{blocks}, p);
  if (o.amax) {
    float m = 0.0f;
    for (float v : am) m = std::max(m, v);
    *o.amax = m;
  }
}

template <class Dev, class Dy, class In, class Dx>
void backward(Dev& dev, bool rms, tensor<const Dy, 2> dy, tensor<const In, 2> h, std::span<const float> w, std::span<const float> mean,
              std::span<const float> rstd, tensor<Dx, 2> dx, std::span<float> dw, std::span<float> db, const norm_options& o,
              tensor<const float, 2> dres) {
  static_assert(row_io_type<Dy> && row_io_type<In> && row_io_type<Dx>, "tessel norm backward: tensors must be f32 or bf16");
  const std::string W = rms ? "rmsnorm_backward" : "layernorm_backward";
  const std::size_t rows = h.rows(), n = h.cols();
  check_rows<layer_error>(h, rows, n, W + ": saved input");
  check_rows<layer_error>(dy, rows, n, W + ": dy");
  check_rows<layer_error>(dx, rows, n, W + ": dx");
  if (dres.data() != nullptr) check_rows<layer_error>(dres, rows, n, W + ": dresidual");
  require<layer_error>(w.size() == n, W + ": weight has " + std::to_string(w.size()) + " elements, rows have " + std::to_string(n));
  require<layer_error>(dw.size() == n, W + ": dweight has " + std::to_string(dw.size()) + " elements, rows have " + std::to_string(n));
  if (!rms) require<layer_error>(db.empty() || db.size() == n, W + ": dbias must be empty or have one element per column");
  if (!rms) require<layer_error>(mean.size() == rows, W + ": mean must have one element per row");
  require<layer_error>(rstd.size() == rows, W + ": rstd must have one element per row");
  if (rows == 0 || n == 0) {
    if (!o.accumulate) {
      std::fill(dw.begin(), dw.end(), 0.0f);
      std::fill(db.begin(), db.end(), 0.0f);
    }
    return;
  }
  // A fixed split (depends on the shape only) so the parameter-gradient sums are reproducible.
  const std::size_t blocks = std::min<std::size_t>(rows, 32);
  const std::size_t rpb = (rows + blocks - 1) / blocks;
  const std::size_t nb = (rows + rpb - 1) / rpb;
  std::vector<float> partials(nb * 2 * n);
  const bool want_db = !rms && !db.empty();
  dev.launch(grid{nb}, bwd_program<Dy, In, Dx>{dy, h, dres, dx, w.data(), rms ? nullptr : mean.data(), rstd.data(), partials.data(), want_db, rpb, rows, n,
                                                    stream_out<Dx>(rows, n) && (const void*)dx.data() != (const void*)dy.data()});
  const std::size_t cpb = 4096;
  dev.launch(grid{(n + cpb - 1) / cpb}, reduce_program{partials.data(), dw.data(), want_db ? db.data() : nullptr, nb, n, cpb, o.accumulate});
}

}  // namespace detail::norm

inline namespace v0 {

// y = (x - mean) / sqrt(var + eps) * weight + bias per row of x (rows, n); with a residual,
// the normalised row is h = x + residual, and h is written to residual_out when given. mean and
// rstd (one per row, may be empty) are what the backward pass needs. Out: f32, bf16 or e4m3.
template <class Dev, class In, class Out>
void layernorm_forward(Dev& dev, tensor<const In, 2> x, std::span<const float> weight, std::span<const float> bias, tensor<Out, 2> y,
                       std::span<float> mean, std::span<float> rstd, const norm_options& o = {}, tensor<const In, 2> residual = {},
                       tensor<In, 2> residual_out = {}) {
  detail::norm::forward(dev, false, x, weight, bias, y, mean, rstd, o, residual, residual_out);
}

// y = x / sqrt(mean(x^2) + eps) * weight, with the same residual and output options.
template <class Dev, class In, class Out>
void rmsnorm_forward(Dev& dev, tensor<const In, 2> x, std::span<const float> weight, tensor<Out, 2> y, std::span<float> rstd,
                     const norm_options& o = {}, tensor<const In, 2> residual = {}, tensor<In, 2> residual_out = {}) {
  detail::norm::forward(dev, true, x, weight, std::span<const float>{}, y, std::span<float>{}, rstd, o, residual, residual_out);
}

// Backward from the saved normalised input h (x, or x + residual): dx, dweight and dbias (may be
// empty). dresidual, if given, is the gradient arriving on the residual stream and is added to dx
// (the fused residual add's backward).
template <class Dev, class Dy, class In, class Dx>
void layernorm_backward(Dev& dev, tensor<const Dy, 2> dy, tensor<const In, 2> h, std::span<const float> weight, std::span<const float> mean,
                        std::span<const float> rstd, tensor<Dx, 2> dx, std::span<float> dweight, std::span<float> dbias,
                        const norm_options& o = {}, tensor<const float, 2> dresidual = {}) {
  detail::norm::backward(dev, false, dy, h, weight, mean, rstd, dx, dweight, dbias, o, dresidual);
}

template <class Dev, class Dy, class In, class Dx>
void rmsnorm_backward(Dev& dev, tensor<const Dy, 2> dy, tensor<const In, 2> h, std::span<const float> weight, std::span<const float> rstd,
                      tensor<Dx, 2> dx, std::span<float> dweight, const norm_options& o = {}, tensor<const float, 2> dresidual = {}) {
  detail::norm::backward(dev, true, dy, h, weight, std::span<const float>{}, rstd, dx, dweight, std::span<float>{}, o, dresidual);
}

}  // namespace v0
}  // namespace tessel
