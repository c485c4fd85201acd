// Tensor-parallel layers (Megatron-LM's): they wrap nn's linear over parameter shards registered in
// nn's registry with their shard info, so a full Hugging Face checkpoint is sliced on load.
//   column_parallel_linear  W (out, in) split by rows: rank r holds rows [r·out/tp, (r+1)·out/tp).
//                           forward: y_r = x W_rᵀ (+ b_r), no communication; backward: dW_r, db_r
//                           local, dx = Σ_r dy_r W_r all-reduced over tp.
//   row_parallel_linear     W (out, in) split by columns: rank r holds columns of its input slice.
//                           forward: y = Σ_r x_r W_rᵀ all-reduced over tp, then + b; backward: local.
//   tp_swiglu_mlp           gate and up column-parallel, down row-parallel: one all-reduce forward
//                           (down's output) and one backward (dx).
// Reductions are f32 sums in tp-rank order (the communicator's fixed order): every tp rank gets the
// same bits, whatever the thread timing. Against one device, the only difference is where the
// K-dimension sum is split: each output is a sum of the same products, grouped differently.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include <tessel/collectives/communicator.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/nn/layers.hpp>
#include <tessel/nn/parameters.hpp>
#include <tessel/ops/activation.hpp>
#include <tessel/ops/gemm.hpp>

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
    throw dist_error(errc::config, "tp = " + std::to_string(t) + " does not divide the " + std::to_string(n) + " " + what + " of a tensor-parallel layer");
  return n / t;
}
// A contiguous row-major f32 (rows, cols) view's elements.
inline std::span<float> contiguous(mview<float> v, const char* what) {
  if (v.rows() > 1 && (v.col_stride() != 1 || v.row_stride() != v.cols()))
    throw dist_error(errc::invalid_argument, std::string(what) + ": the all-reduced tensor must be contiguous row-major");
  return {v.data(), v.rows() * v.cols()};
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
      : tp_(&tp), in_(in), out_(out) {
    const std::size_t local = detail::shard_of(out, tp, "output features"), off = local * std::size_t(tp.rank());
    constexpr bool b16 = std::is_same_v<T, bf16>;
    nn::parameter<Dev>* w = &reg.add_shard(name + ".weight", {out, in}, 0, off, local, b16);
    nn::parameter<Dev>* b = bias ? &reg.add_shard(name + ".bias", {out}, 0, off, local, b16) : nullptr;
    lin_ = nn::linear<Dev, T>(w, b, in, local);
  }
  std::size_t in_features() const { return in_; }
  std::size_t out_features() const { return out_; }  // the full layer's
  std::size_t local_out_features() const { return lin_.out_features(); }
  nn::linear<Dev, T>& local() { return lin_; }

  template <class Y>
  void forward(Dev& dev, cview<T> x, mview<Y> y, bool save) {
    lin_.forward(dev, x, y, save);
  }
  // dx (N, in) = Σ over tp of dy_r W_r (dx += when `accumulate`); dW_r, db_r accumulate. With
  // reduce = false dx gets this rank's partial only (a caller that sums several layers' partials
  // before one all-reduce, as the MLP does).
  void backward(Dev& dev, cview<T> dy, mview<float> dx, bool accumulate, bool reduce = true) {
    if (!reduce || !dx.data()) {
      lin_.backward(dev, dy, dx, accumulate);
      return;
    }
    if (!accumulate) {
      lin_.backward(dev, dy, dx, false);
      tp_->all_reduce(detail::contiguous(dx, "column_parallel_linear"), reduce_op::sum);
      return;
    }
    if (scratch_.size() < dx.rows() * dx.cols()) scratch_ = device_buffer<float, Dev>(dev, dx.rows() * dx.cols());
    const mview<float> s = nn::rows_view<float>(scratch_, dx.rows(), dx.cols());
    lin_.backward(dev, dy, s, false);
    tp_->all_reduce(detail::contiguous(s, "column_parallel_linear"), reduce_op::sum);
    for (std::size_t r = 0; r < dx.rows(); ++r)
      for (std::size_t c = 0; c < dx.cols(); ++c) dx(r, c) += s(r, c);
  }

 private:
  communicator* tp_ = nullptr;
  std::size_t in_ = 0, out_ = 0;
  nn::linear<Dev, T> lin_;
  device_buffer<float, Dev> scratch_;
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

  // y must be contiguous; it holds the same bits on every tp rank.
  void forward(Dev& dev, cview<T> x, mview<float> y, bool save) {
    lin_.forward(dev, x, y, save);
    tp_->all_reduce(detail::contiguous(y, "row_parallel_linear"), reduce_op::sum);
    if (b_) detail::add_bias_rows(y, b_->value.cspan());
  }
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

  // y (N, hidden) f32 = the MLP of x (N, hidden), the same bits on every tp rank.
  void forward(Dev& dev, cview<T> x, mview<float> y, bool save) {
    const std::size_t n = x.rows();
    ensure(dev, g_, n * i_);
    ensure(dev, u_, n * i_);
    ensure(dev, h_, n * i_);
    gate_.forward(dev, x, nn::rows_view<T>(g_, n, i_), save);
    up_.forward(dev, x, nn::rows_view<T>(u_, n, i_), save);
    swiglu_forward(dev, std::span<const T>(g_.data(), n * i_), std::span<const T>(u_.data(), n * i_), std::span<T>(h_.data(), n * i_));
    down_.forward(dev, nn::crows_view<T>(h_, n, i_), y, save);
  }
  // dx (N, hidden) f32 = the gradient of x (dx += when `accumulate`), summed over tp in one
  // all-reduce; every weight's gradient accumulates locally.
  void backward(Dev& dev, cview<T> dy, mview<float> dx, bool accumulate) {
    const std::size_t n = dy.rows();
    ensure(dev, dh_, n * i_);
    ensure(dev, dg_, n * i_);
    ensure(dev, du_, n * i_);
    down_.backward(dev, dy, nn::rows_view<T>(dh_, n, i_), false);
    swiglu_backward(dev, std::span<const T>(dh_.data(), n * i_), std::span<const T>(g_.data(), n * i_), std::span<const T>(u_.data(), n * i_),
                    std::span<T>(dg_.data(), n * i_), std::span<T>(du_.data(), n * i_));
    mview<float> target = dx;
    if (accumulate) {
      ensure(dev, dx_, n * d_);
      target = nn::rows_view<float>(dx_, n, d_);
    }
    gate_.backward(dev, nn::crows_view<T>(dg_, n, i_), target, false, false);
    up_.backward(dev, nn::crows_view<T>(du_, n, i_), target, true, false);
    tp_->all_reduce(detail::contiguous(target, "tp_swiglu_mlp"), reduce_op::sum);
    if (accumulate)
      for (std::size_t r = 0; r < n; ++r)
        for (std::size_t c = 0; c < d_; ++c) dx(r, c) += target(r, c);
  }

  // silu(gate)·up of the last forward: this rank's (N, I/tp) slice.
  std::span<const T> hidden(std::size_t rows) const { return {h_.data(), rows * i_}; }
  column_parallel_linear<Dev, T>& gate() { return gate_; }
  column_parallel_linear<Dev, T>& up() { return up_; }
  row_parallel_linear<Dev, T>& down() { return down_; }

 private:
  template <class E>
  static void ensure(Dev& dev, device_buffer<E, Dev>& b, std::size_t n) {
    if (b.size() < n) b = device_buffer<E, Dev>(dev, n);
  }
  column_parallel_linear<Dev, T> gate_, up_;
  row_parallel_linear<Dev, T> down_;
  communicator* tp_ = nullptr;
  std::size_t d_ = 0, i_ = 0;
  device_buffer<T, Dev> g_, u_, h_, dh_, dg_, du_;
  device_buffer<float, Dev> dx_;
};

}  // namespace dist
}  // namespace v0
}  // namespace tessel
