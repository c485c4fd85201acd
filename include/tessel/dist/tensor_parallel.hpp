// Tensor-parallel layers (Megatron-LM's): they wrap nn's linear over parameter shards registered in
// nn's registry with their shard info, so a full Hugging Face checkpoint is sliced on load.
//   column_parallel_linear  W (out, in) split by rows: rank r holds rows [r·out/tp, (r+1)·out/tp).
//                           forward: y_r = x W_rᵀ (+ b_r), no communication; backward: dW_r, db_r
//                           local, dx = Σ_r dy_r W_r all-reduced over tp.
//   row_parallel_linear     W (out, in) split by columns: rank r holds columns of its input slice.
//                           forward: y = Σ_r x_r W_rᵀ all-reduced over tp, then + b; backward: local.
//   tp_swiglu_mlp           gate and up column-parallel, down row-parallel: one all-reduce forward
//                           (down's output) and one backward (dx).
//   tp_attention            q, k, v column-parallel by heads, o row-parallel (grouped-query heads,
//                           kv heads split over tp or, when fewer than tp, replicated).
// Reductions are f32 sums in tp-rank order (the communicator's fixed order): every tp rank gets the
// same bits, whatever the thread timing. Against one device, the only difference is where the
// K-dimension sum is split: each output is a sum of the same products, grouped differently.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <tessel/collectives/communicator.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/nn/layers.hpp>
#include <tessel/nn/parameters.hpp>
#include <tessel/ops/activation.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/rope.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

using nn::compute_type;
using nn::cview;
using nn::mview;

namespace detail {
inline std::size_t shard_of(std::size_t n, const communicator& tp, const std::string& what) {
  const std::size_t t = std::size_t(tp.size());
  if (n % t != 0)
    throw dist_error(errc::config,
                     "tp = " + std::to_string(t) + " does not divide the " + std::to_string(n) + " " + what + " of a tensor-parallel layer");
  return n / t;
}
// A contiguous row-major f32 (rows, cols) view's elements.
inline std::span<float> contiguous(mview<float> v, const char* what) {
  if (v.rows() > 1 && (v.col_stride() != 1 || v.row_stride() != v.cols()))
    throw dist_error(errc::invalid_argument, std::string(what) + ": the all-reduced tensor must be contiguous row-major");
  return {v.data(), v.rows() * v.cols()};
}
// b holds at least n elements (grown, contents dropped, when it is smaller): the layers' scratch
template <class E, class Dev>
void ensure(Dev& dev, device_buffer<E, Dev>& b, std::size_t n) {
  if (b.size() < n) b = device_buffer<E, Dev>(dev, n);
}
// The transient f32 buffers of a layer's reduction (its partial sums; a reduce-scatter's result),
// held only during one call: a model gives all its layers one (share_workspace), so under sequence
// parallelism the full-size partials exist once, not once per layer.
template <class Dev>
struct tp_workspace {
  device_buffer<float, Dev> partial, sum;
};
// A layer's workspace: its own, or the one it was given.
template <class Dev>
class workspace_ref {
 public:
  tp_workspace<Dev>& get() { return shared_ ? *shared_ : own_; }
  void share(tp_workspace<Dev>& w) { shared_ = &w; }

 private:
  tp_workspace<Dev> own_;
  tp_workspace<Dev>* shared_ = nullptr;
};

// Sums each rank's partial (rows, cols), contiguous, over tp into out (out += when `accumulate`).
// out's rows say which rows the caller keeps:
//   all of them     an all-reduce (out may be the partial itself);
//   rows / tp       this rank's rows [r·rows/tp, (r+1)·rows/tp): a reduce-scatter (sequence
//                   parallelism: the stream between layers is split by tokens).
// Either way every element is the same f32 sum in tp-rank order, so both give the same bits.
// `scratch` holds the reduce-scatter's result when it must be added.
template <class Dev>
void sum_partials(Dev& dev, communicator& tp, mview<float> partial, mview<float> out, bool accumulate, device_buffer<float, Dev>& scratch,
                  const char* who) {
  const std::size_t rows = partial.rows(), cols = partial.cols(), t = std::size_t(tp.size());
  const std::span<float> p = contiguous(partial, who);
  if (out.cols() != cols || (out.rows() != rows && out.rows() * t != rows))
    throw dist_error(errc::invalid_argument, std::string(who) + ": the output is (" + std::to_string(out.rows()) + ", " + std::to_string(out.cols()) +
                                                 "); it must be all " + std::to_string(rows) + " rows or this rank's " + std::to_string(rows / t) +
                                                 " (sequence parallelism: tp = " + std::to_string(t) + " must divide the rows) of " +
                                                 std::to_string(cols) + " columns");
  const bool scatter = out.rows() != rows;
  if (!scatter) {
    tp.all_reduce(p, reduce_op::sum);
    if (out.data() == partial.data() && !accumulate) return;
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < cols; ++c) out(r, c) = accumulate ? out(r, c) + partial(r, c) : partial(r, c);
    return;
  }
  const std::size_t local = rows / t;
  if (!accumulate && (local <= 1 || (out.col_stride() == 1 && out.row_stride() == cols))) {
    tp.reduce_scatter(std::span<const float>(p), std::span<float>(out.data(), local * cols), reduce_op::sum);
    return;
  }
  ensure(dev, scratch, local * cols);
  tp.reduce_scatter(std::span<const float>(p), std::span<float>(scratch.data(), local * cols), reduce_op::sum);
  for (std::size_t r = 0; r < local; ++r)
    for (std::size_t c = 0; c < cols; ++c) {
      const float v = scratch.data()[r * cols + c];
      out(r, c) = accumulate ? out(r, c) + v : v;
    }
}
template <class T>
void add_bias_rows(mview<T> y, std::span<const float> b) {
  for (std::size_t r = 0; r < y.rows(); ++r)
    for (std::size_t c = 0; c < y.cols(); ++c) y(r, c) = T(float(y(r, c)) + b[c]);
}
}  // namespace detail

// y (N, out/tp) = x (N, in) · W_rᵀ + b_r; registered as "<name>.weight" (and ".bias") shards of
// HF's (out, in) and (out).
template <device Dev, compute_type T>
class column_parallel_linear {
 public:
  column_parallel_linear() = default;
  column_parallel_linear(nn::parameters<Dev>& reg, const std::string& name, std::size_t in, std::size_t out, bool bias, communicator& tp)
      : column_parallel_linear(reg, name, in, out, bias, tp, even_rows(out, tp)) {}
  // Rows [rows.offset, rows.offset + rows.length) of W on this rank, which other ranks may hold too
  // (grouped-query attention with fewer kv heads than tp ranks replicates a kv head's rows).
  struct row_range {
    std::size_t offset, length;
  };
  column_parallel_linear(nn::parameters<Dev>& reg, const std::string& name, std::size_t in, std::size_t out, bool bias, communicator& tp,
                         row_range rows)
      : tp_(&tp), in_(in), out_(out) {
    constexpr bool b16 = std::is_same_v<T, bf16>;
    nn::parameter<Dev>* w = &reg.add_shard(name + ".weight", {out, in}, 0, rows.offset, rows.length, b16);
    nn::parameter<Dev>* b = bias ? &reg.add_shard(name + ".bias", {out}, 0, rows.offset, rows.length, b16) : nullptr;
    lin_ = nn::linear<Dev, T>(w, b, in, rows.length);
  }
  std::size_t in_features() const { return in_; }
  std::size_t out_features() const { return out_; }  // the full layer's
  std::size_t local_out_features() const { return lin_.out_features(); }
  nn::linear<Dev, T>& local() { return lin_; }
  const nn::linear<Dev, T>& local() const { return lin_; }

  template <class Y>
  void forward(Dev& dev, cview<T> x, mview<Y> y, bool save) {
    lin_.forward(dev, x, y, save);
  }
  // dx = Σ over tp of dy_r W_r (dx += when `accumulate`); dW_r, db_r accumulate. dx is (N, in), or
  // this rank's N/tp rows of it (sequence parallelism: a reduce-scatter, detail::sum_partials).
  // With reduce = false dx (N, in) gets this rank's partial only (a caller that sums several
  // layers' partials before one reduction, as the MLP does).
  void backward(Dev& dev, cview<T> dy, mview<float> dx, bool accumulate, bool reduce = true) {
    if (!reduce || !dx.data()) {
      lin_.backward(dev, dy, dx, accumulate);
      return;
    }
    auto& ws = ws_.get();
    if (!accumulate && dx.rows() == dy.rows()) {  // the partial in place, then summed
      lin_.backward(dev, dy, dx, false);
      detail::sum_partials(dev, *tp_, dx, dx, false, ws.sum, "column_parallel_linear");
      return;
    }
    detail::ensure(dev, ws.partial, dy.rows() * in_);
    const mview<float> s = nn::rows_view<float>(ws.partial, dy.rows(), in_);
    lin_.backward(dev, dy, s, false);
    detail::sum_partials(dev, *tp_, s, dx, accumulate, ws.sum, "column_parallel_linear");
  }
  void share_workspace(detail::tp_workspace<Dev>& w) { ws_.share(w); }

 private:
  static row_range even_rows(std::size_t out, const communicator& tp) {
    const std::size_t local = detail::shard_of(out, tp, "output features");
    return {local * std::size_t(tp.rank()), local};
  }
  communicator* tp_ = nullptr;
  std::size_t in_ = 0, out_ = 0;
  nn::linear<Dev, T> lin_;
  detail::workspace_ref<Dev> ws_;
};

// y (N, out) = Σ over tp of x_r (N, in/tp) · W_rᵀ, then + b (b whole on every rank); registered as
// a "<name>.weight" shard of HF's (out, in) along dim 1 and a whole "<name>.bias".
template <device Dev, compute_type T>
class row_parallel_linear {
 public:
  row_parallel_linear() = default;
  row_parallel_linear(nn::parameters<Dev>& reg, const std::string& name, std::size_t in, std::size_t out, bool bias, communicator& tp)
      : tp_(&tp), in_(in), out_(out) {
    const std::size_t local = detail::shard_of(in, tp, "input features"), off = local * std::size_t(tp.rank());
    constexpr bool b16 = std::is_same_v<T, bf16>;
    nn::parameter<Dev>* w = &reg.add_shard(name + ".weight", {out, in}, 1, off, local, b16);
    b_ = bias ? &reg.add(name + ".bias", {out}, b16) : nullptr;
    lin_ = nn::linear<Dev, T>(w, nullptr, local, out);  // the bias is added once, after the sum
  }
  std::size_t in_features() const { return in_; }  // the full layer's
  std::size_t local_in_features() const { return lin_.in_features(); }
  std::size_t out_features() const { return out_; }
  nn::linear<Dev, T>& local() { return lin_; }
  const nn::linear<Dev, T>& local() const { return lin_; }

  // y is (N, out), contiguous, or this rank's N/tp rows of it (sequence parallelism: the sum is a
  // reduce-scatter); either way the same bits as the other ranks hold for those rows.
  void forward(Dev& dev, cview<T> x, mview<float> y, bool save) {
    auto& ws = ws_.get();
    if (y.rows() == x.rows()) {
      lin_.forward(dev, x, y, save);
      detail::sum_partials(dev, *tp_, y, y, false, ws.sum, "row_parallel_linear");
    } else {
      detail::ensure(dev, ws.partial, x.rows() * out_);
      const mview<float> p = nn::rows_view<float>(ws.partial, x.rows(), out_);
      lin_.forward(dev, x, p, save);
      detail::sum_partials(dev, *tp_, p, y, false, ws.sum, "row_parallel_linear");
    }
    if (b_) detail::add_bias_rows(y, b_->value.cspan());
  }
  void share_workspace(detail::tp_workspace<Dev>& w) { ws_.share(w); }
  // dx_r (N, in/tp) = dy W_r (dx += when `accumulate`), dW_r += dyᵀ x_r, db += Σ rows of dy: all local.
  template <class DX>
  void backward(Dev& dev, cview<T> dy, mview<DX> dx, bool accumulate) {
    lin_.backward(dev, dy, dx, accumulate);
    if (b_) {
      if (ones_.size() < dy.rows()) ones_ = device_buffer<T, Dev>(dev, dy.rows(), T(1.0f));
      mview<float> db = mview<float>::strided(b_->grad.data(), out_, 1, 1, 1);
      gemm(dev, dy.transposed(), cview<T>(ones_.data(), dy.rows(), 1, 1), db, 1.0f, 1.0f);  // as nn::linear does
    }
  }

 private:
  communicator* tp_ = nullptr;
  std::size_t in_ = 0, out_ = 0;
  nn::linear<Dev, T> lin_;
  nn::parameter<Dev>* b_ = nullptr;
  device_buffer<T, Dev> ones_;
  detail::workspace_ref<Dev> ws_;
};

// Llama's MLP, down(silu(gate(x)) · up(x)), over tp: each rank holds I/tp of the intermediate
// features. Parameters "<prefix>.gate_proj", "<prefix>.up_proj", "<prefix>.down_proj" (+ .weight).
template <device Dev, compute_type T>
class tp_swiglu_mlp {
 public:
  tp_swiglu_mlp() = default;
  tp_swiglu_mlp(nn::parameters<Dev>& reg, const std::string& prefix, std::size_t hidden, std::size_t intermediate, bool bias, communicator& tp)
      : gate_(reg, prefix + ".gate_proj", hidden, intermediate, bias, tp),
        up_(reg, prefix + ".up_proj", hidden, intermediate, bias, tp),
        down_(reg, prefix + ".down_proj", intermediate, hidden, bias, tp),
        tp_(&tp),
        d_(hidden),
        i_(intermediate / std::size_t(tp.size())) {}

  // y (N, hidden) f32 = the MLP of x (N, hidden), the same bits on every tp rank; or this rank's
  // N/tp rows of it (sequence parallelism).
  void forward(Dev& dev, cview<T> x, mview<float> y, bool save) {
    const std::size_t n = x.rows();
    detail::ensure(dev, g_, n * i_);
    detail::ensure(dev, u_, n * i_);
    detail::ensure(dev, h_, n * i_);
    gate_.forward(dev, x, nn::rows_view<T>(g_, n, i_), save);
    up_.forward(dev, x, nn::rows_view<T>(u_, n, i_), save);
    swiglu_forward(dev, std::span<const T>(g_.data(), n * i_), std::span<const T>(u_.data(), n * i_), std::span<T>(h_.data(), n * i_));
    down_.forward(dev, nn::crows_view<T>(h_, n, i_), y, save);
  }
  // dx (N, hidden) f32 = the gradient of x (dx += when `accumulate`), summed over tp in one
  // all-reduce, or this rank's N/tp rows of it in one reduce-scatter; every weight's gradient
  // accumulates locally.
  void backward(Dev& dev, cview<T> dy, mview<float> dx, bool accumulate) {
    const std::size_t n = dy.rows();
    detail::ensure(dev, dh_, n * i_);
    detail::ensure(dev, dg_, n * i_);
    detail::ensure(dev, du_, n * i_);
    down_.backward(dev, dy, nn::rows_view<T>(dh_, n, i_), false);
    swiglu_backward(dev, std::span<const T>(dh_.data(), n * i_), std::span<const T>(g_.data(), n * i_), std::span<const T>(u_.data(), n * i_),
                    std::span<T>(dg_.data(), n * i_), std::span<T>(du_.data(), n * i_));
    auto& ws = ws_.get();
    mview<float> target = dx;
    if (accumulate || dx.rows() != n) {
      detail::ensure(dev, ws.partial, n * d_);
      target = nn::rows_view<float>(ws.partial, n, d_);
    }
    gate_.backward(dev, nn::crows_view<T>(dg_, n, i_), target, false, false);
    up_.backward(dev, nn::crows_view<T>(du_, n, i_), target, true, false);
    detail::sum_partials(dev, *tp_, target, dx, accumulate, ws.sum, "tp_swiglu_mlp");
  }
  // Use w for the transient reduction buffers (this layer's and its linears').
  void share_workspace(detail::tp_workspace<Dev>& w) {
    ws_.share(w);
    gate_.share_workspace(w);
    up_.share_workspace(w);
    down_.share_workspace(w);
  }

  // silu(gate)·up of the last forward: this rank's (N, I/tp) slice.
  std::span<const T> hidden(std::size_t rows) const { return {h_.data(), rows * i_}; }
  column_parallel_linear<Dev, T>& gate() { return gate_; }
  column_parallel_linear<Dev, T>& up() { return up_; }
  row_parallel_linear<Dev, T>& down() { return down_; }
  const column_parallel_linear<Dev, T>& gate() const { return gate_; }
  const column_parallel_linear<Dev, T>& up() const { return up_; }
  const row_parallel_linear<Dev, T>& down() const { return down_; }

 private:
  column_parallel_linear<Dev, T> gate_, up_;
  row_parallel_linear<Dev, T> down_;
  communicator* tp_ = nullptr;
  std::size_t d_ = 0, i_ = 0;
  device_buffer<T, Dev> g_, u_, h_, dh_, dg_, du_;
  detail::workspace_ref<Dev> ws_;
};

// Llama's self-attention over tp (Megatron's parallel attention): q_proj, k_proj and v_proj are
// column-parallel by heads, o_proj row-parallel; rotary positions and the causal (optionally
// sliding-window) attention run on this rank's heads only. Rank r runs the query heads
// [r·hq/tp, (r+1)·hq/tp) and the kv heads they read:
//   heads_kv % tp == 0  each rank holds heads_kv/tp kv heads (a plain split of k_proj and v_proj);
//   tp % heads_kv == 0  (fewer kv heads than ranks) kv head r·heads_kv/tp is replicated on the
//                       tp/heads_kv ranks whose query heads read it. Each of them holds part of its
//                       gradient (its own query heads' part); backward adds the parts in rank order
//                       so the replicas keep the same weights.
// Other (heads_q, heads_kv, tp) are dist_errors naming the numbers, raised by the constructor.
// Communication: one all-reduce forward (o_proj), one backward (dx over q, k and v together), and
// with replicated kv heads one more for their weight gradients.
template <device Dev, compute_type T>
class tp_attention {
 public:
  struct config {  // the full layer's sizes
    std::size_t hidden = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
    bool qkv_bias = false, o_bias = false;
    std::optional<std::size_t> window;  // sliding window: keys a query sees, itself included
    std::optional<rope_options> rope;   // rotary positions (none: the caller adds positions)
  };

  tp_attention() = default;
  // Parameters "<prefix>.q_proj", ".k_proj", ".v_proj", ".o_proj" (+ .weight, .bias), HF's names.
  tp_attention(nn::parameters<Dev>& reg, const std::string& prefix, const config& c, communicator& tp) : tp_(&tp), c_(checked(c, tp)) {
    const std::size_t t = std::size_t(tp.size()), r = std::size_t(tp.rank()), d = c_.head_dim;
    hq_ = c_.heads_q / t;
    if (c_.heads_kv % t == 0) {
      hkv_ = c_.heads_kv / t;
      replicas_ = 1;
      kv_slot_ = r;
    } else {
      hkv_ = 1;
      replicas_ = t / c_.heads_kv;
      kv_slot_ = r / replicas_;
    }
    using col = column_parallel_linear<Dev, T>;
    const typename col::row_range kv_rows{kv_slot_ * hkv_ * d, hkv_ * d};
    q_ = col(reg, prefix + ".q_proj", c_.hidden, c_.heads_q * d, c_.qkv_bias, tp);
    k_ = col(reg, prefix + ".k_proj", c_.hidden, c_.heads_kv * d, c_.qkv_bias, tp, kv_rows);
    v_ = col(reg, prefix + ".v_proj", c_.hidden, c_.heads_kv * d, c_.qkv_bias, tp, kv_rows);
    o_ = row_parallel_linear<Dev, T>(reg, prefix + ".o_proj", c_.heads_q * d, c_.hidden, c_.o_bias, tp);
    attn_ = nn::self_attention<Dev, T>(hq_, hkv_, d, c_.window);
    if (c_.rope) {  // the caller's frequencies are copied, and tabled: rope() points at both on use
      inv_freq_.assign(c_.rope->inv_freq.begin(), c_.rope->inv_freq.end());
      c_.rope->inv_freq = {};
      c_.rope->table = nullptr;
      table_ = std::make_shared<rope_table>(d, rope());
    }
  }

  std::size_t local_heads_q() const { return hq_; }
  std::size_t local_heads_kv() const { return hkv_; }
  // how many ranks hold this rank's kv heads (1 unless heads_kv < tp)
  std::size_t kv_replicas() const { return replicas_; }

  // y (batch·seq, hidden) f32 = attention of x (batch·seq, hidden) in token order, the same bits on
  // every tp rank, or this rank's batch·seq/tp rows of it (sequence parallelism); positions
  // (batch·seq) are the rotary positions (ignored without rope).
  void forward(Dev& dev, std::size_t batch, std::size_t seq, cview<T> x, std::span<const std::int64_t> positions, mview<float> y, bool save) {
    const std::size_t n = checked_mul(batch, seq), d = c_.head_dim, qd = hq_ * d, kvd = hkv_ * d;
    if (x.rows() != n || x.cols() != c_.hidden || !rows_ok(y.rows(), n) || y.cols() != c_.hidden)
      throw dist_error(errc::invalid_argument, "tp_attention: x must be (batch·seq = " + std::to_string(n) +
                                                   ", hidden = " + std::to_string(c_.hidden) + ") and y that or its rows / tp, got x (" +
                                                   std::to_string(x.rows()) + ", " + std::to_string(x.cols()) + ") and y (" +
                                                   std::to_string(y.rows()) + ", " + std::to_string(y.cols()) + ")");
    if (c_.rope && positions.size() != n)
      throw dist_error(errc::invalid_argument,
                       "tp_attention: " + std::to_string(positions.size()) + " positions for " + std::to_string(n) + " tokens");
    detail::ensure(dev, qb_, n * qd);
    detail::ensure(dev, kb_, n * kvd);
    detail::ensure(dev, vb_, n * kvd);
    detail::ensure(dev, ob_, n * qd);
    detail::ensure(dev, lse_, batch * hq_ * seq);
    q_.forward(dev, x, nn::rows_view<T>(qb_, n, qd), save);
    k_.forward(dev, x, nn::rows_view<T>(kb_, n, kvd), save);
    v_.forward(dev, x, nn::rows_view<T>(vb_, n, kvd), save);
    if (c_.rope) {
      table_->cover(positions);
      rope_forward(dev, nn::rows_view<T>(qb_, n, qd), d, positions, rope());
      rope_forward(dev, nn::rows_view<T>(kb_, n, kvd), d, positions, rope());
      positions_.assign(positions.begin(), positions.end());
    }
    attn_.forward(dev, batch, seq, std::span<const T>(qb_.data(), n * qd), std::span<const T>(kb_.data(), n * kvd),
                  std::span<const T>(vb_.data(), n * kvd), std::span<T>(ob_.data(), n * qd), std::span<float>(lse_.data(), batch * hq_ * seq));
    o_.forward(dev, nn::crows_view<T>(ob_, n, qd), y, save);
    batch_ = batch;
    seq_ = seq;
  }

  // dx (batch·seq, hidden) f32 = the gradient of x for dy (dx += when `accumulate`), summed over tp
  // in one all-reduce (or this rank's rows of it in one reduce-scatter, sequence parallelism); the
  // weights' gradients accumulate (replicated kv heads' parts summed).
  void backward(Dev& dev, cview<T> dy, mview<float> dx, bool accumulate) {
    const std::size_t n = batch_ * seq_, d = c_.head_dim, qd = hq_ * d, kvd = hkv_ * d;
    if (n == 0 || dy.rows() != n || dy.cols() != c_.hidden || !rows_ok(dx.rows(), n) || dx.cols() != c_.hidden)
      throw dist_error(errc::invalid_argument,
                       "tp_attention: backward needs dy and dx of the last forward's (" + std::to_string(n) + ", " + std::to_string(c_.hidden) + ")");
    detail::ensure(dev, do_, n * qd);
    detail::ensure(dev, dq_, n * qd);
    detail::ensure(dev, dk_, n * kvd);
    detail::ensure(dev, dv_, n * kvd);
    o_.backward(dev, dy, nn::rows_view<T>(do_, n, qd), false);
    attn_.backward(dev, batch_, seq_, std::span<const T>(qb_.data(), n * qd), std::span<const T>(kb_.data(), n * kvd),
                   std::span<const T>(vb_.data(), n * kvd), std::span<const T>(ob_.data(), n * qd), std::span<const T>(do_.data(), n * qd),
                   std::span<const float>(lse_.data(), batch_ * hq_ * seq_), std::span<T>(dq_.data(), n * qd), std::span<T>(dk_.data(), n * kvd),
                   std::span<T>(dv_.data(), n * kvd));
    if (c_.rope) {
      rope_backward(dev, nn::rows_view<T>(dq_, n, qd), d, std::span<const std::int64_t>(positions_), rope());
      rope_backward(dev, nn::rows_view<T>(dk_, n, kvd), d, std::span<const std::int64_t>(positions_), rope());
    }
    if (replicas_ > 1) stash_kv_grads(dev);
    auto& ws = ws_.get();
    mview<float> target = dx;
    if (accumulate || dx.rows() != n) {
      detail::ensure(dev, ws.partial, n * c_.hidden);
      target = nn::rows_view<float>(ws.partial, n, c_.hidden);
    }
    q_.backward(dev, nn::crows_view<T>(dq_, n, qd), target, false, false);
    k_.backward(dev, nn::crows_view<T>(dk_, n, kvd), target, true, false);
    v_.backward(dev, nn::crows_view<T>(dv_, n, kvd), target, true, false);
    detail::sum_partials(dev, *tp_, target, dx, accumulate, ws.sum, "tp_attention");
    if (replicas_ > 1) sum_kv_replicas();
  }

  // Use w for the transient reduction buffers (this layer's and its linears').
  void share_workspace(detail::tp_workspace<Dev>& w) {
    ws_.share(w);
    for (auto* l : {&q_, &k_, &v_}) l->share_workspace(w);
    o_.share_workspace(w);
  }

  // Read and grow other's rotary table from now on (a layer of the same model: the same head_dim
  // and frequencies, or dist_error), so a model's layers keep one table, not one each. The same
  // bits either way.
  void share_rope_table(const tp_attention& other) {
    const bool same = table_ && other.table_ && table_->head_dim() == other.table_->head_dim() &&
                      std::ranges::equal(table_->frequencies(), other.table_->frequencies());
    if (!table_ && !other.table_) return;
    if (!same)
      throw dist_error(errc::invalid_argument, "tp_attention: share_rope_table with a layer of other rotary frequencies or head_dim (or no rope)");
    table_ = other.table_;
  }
  // The rotary table this layer reads (null without rope).
  const rope_table* rope_cache() const { return table_.get(); }

  // This rank's attention output of the last forward (batch·seq, local_heads_q·head_dim), before o_proj.
  std::span<const T> attention_output() const { return {ob_.data(), batch_ * seq_ * hq_ * c_.head_dim}; }
  column_parallel_linear<Dev, T>& q() { return q_; }
  column_parallel_linear<Dev, T>& k() { return k_; }
  column_parallel_linear<Dev, T>& v() { return v_; }
  row_parallel_linear<Dev, T>& o() { return o_; }
  const column_parallel_linear<Dev, T>& q() const { return q_; }
  const column_parallel_linear<Dev, T>& k() const { return k_; }
  const column_parallel_linear<Dev, T>& v() const { return v_; }
  const row_parallel_linear<Dev, T>& o() const { return o_; }

 private:
  rope_options rope() const {
    rope_options r = *c_.rope;
    r.inv_freq = inv_freq_;
    r.table = table_.get();
    return r;
  }
  static config checked(const config& c, const communicator& tp) {
    const std::size_t t = std::size_t(tp.size());
    if (c.hidden == 0 || c.heads_q == 0 || c.heads_kv == 0 || c.head_dim == 0)
      throw dist_error(errc::invalid_argument, "tp_attention: hidden, heads_q, heads_kv and head_dim must be positive");
    if (c.heads_q % c.heads_kv != 0)
      throw dist_error(errc::config, "tp_attention: " + std::to_string(c.heads_q) + " query heads are not a multiple of " +
                                         std::to_string(c.heads_kv) + " kv heads");
    if (c.heads_q % t != 0)
      throw dist_error(errc::config,
                       "tp_attention: tp = " + std::to_string(t) + " does not divide the " + std::to_string(c.heads_q) + " query heads");
    if (c.heads_kv % t != 0 && t % c.heads_kv != 0)
      throw dist_error(errc::config, "tp_attention: tp = " + std::to_string(t) + " and " + std::to_string(c.heads_kv) +
                                         " kv heads: one must divide the other (kv heads are split over tp or replicated)");
    if (c.rope && !c.rope->inv_freq.empty() && c.rope->inv_freq.size() != c.head_dim / 2)
      throw dist_error(errc::invalid_argument,
                       "tp_attention: " + std::to_string(c.rope->inv_freq.size()) + " rotary frequencies for head_dim " + std::to_string(c.head_dim));
    return c;
  }
  // all n rows, or this rank's n/tp (sequence parallelism)
  bool rows_ok(std::size_t rows, std::size_t n) const { return rows == n || rows * std::size_t(tp_->size()) == n; }
  static std::size_t checked_mul(std::size_t a, std::size_t b) {
    if (a != 0 && b > SIZE_MAX / a) throw dist_error(errc::overflow, "tp_attention: batch·seq overflows");
    return a * b;
  }
  // The replicated kv parameters, in a fixed order.
  std::vector<nn::parameter<Dev>*> kv_params() {
    std::vector<nn::parameter<Dev>*> ps{k_.local().weight(), v_.local().weight()};
    if (k_.local().bias()) ps.push_back(k_.local().bias());
    if (v_.local().bias()) ps.push_back(v_.local().bias());
    return ps;
  }
  // Keep the kv gradients accumulated so far and zero them, so backward leaves this call's part.
  void stash_kv_grads(Dev& dev) {
    std::size_t per = 0;
    for (auto* p : kv_params()) per += p->numel;
    detail::ensure(dev, kv_saved_, per);
    detail::ensure(dev, kv_sum_, per * c_.heads_kv);
    std::size_t off = 0;
    for (auto* p : kv_params()) {
      std::copy_n(p->grad.data(), p->numel, kv_saved_.data() + off);
      std::fill_n(p->grad.data(), p->numel, 0.0f);
      off += p->numel;
    }
  }
  // Each kv head's gradient part from every rank that holds it, added in rank order (an all-reduce
  // of one slot per kv head; a rank's slot is its kv head's), then added to what was kept.
  void sum_kv_replicas() {
    std::size_t per = 0;
    for (auto* p : kv_params()) per += p->numel;
    float* sum = kv_sum_.data();
    std::fill_n(sum, per * c_.heads_kv, 0.0f);
    std::size_t off = kv_slot_ * per;
    for (auto* p : kv_params()) {
      std::copy_n(p->grad.data(), p->numel, sum + off);
      off += p->numel;
    }
    tp_->all_reduce(std::span<float>(sum, per * c_.heads_kv), reduce_op::sum);
    off = 0;
    for (auto* p : kv_params()) {
      float* g = p->grad.data();
      for (std::size_t i = 0; i < p->numel; ++i) g[i] = kv_saved_.data()[off + i] + sum[kv_slot_ * per + off + i];
      off += p->numel;
    }
  }

  communicator* tp_ = nullptr;
  config c_;
  std::size_t hq_ = 0, hkv_ = 0, replicas_ = 1, kv_slot_ = 0;
  column_parallel_linear<Dev, T> q_, k_, v_;
  row_parallel_linear<Dev, T> o_;
  nn::self_attention<Dev, T> attn_;
  std::vector<double> inv_freq_;
  std::shared_ptr<rope_table> table_;  // cos/sin of inv_freq_ (or theta's) at the positions seen so far (null without rope)
  device_buffer<T, Dev> qb_, kb_, vb_, ob_, dq_, dk_, dv_, do_;
  device_buffer<float, Dev> lse_, kv_saved_, kv_sum_;
  detail::workspace_ref<Dev> ws_;
  std::size_t batch_ = 0, seq_ = 0;
  std::vector<std::int64_t> positions_;
};

}  // namespace dist
}  // namespace v0
}  // namespace tessel
