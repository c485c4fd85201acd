// The model layer's modules: linear, norm and self-attention core, each with forward and backward,
// written on ops/ only (DESIGN.md, "Modules"). Activations are row-major (tokens, features) views.
// T is the compute type (float or bf16): what GEMMs and attention read. The residual stream and
// every gradient that flows along it stay f32, as under PyTorch's autocast; a module saves in its
// forward what its backward needs (views of buffers its owner keeps alive until then).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <tessel/device/device.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/nn/errors.hpp>
#include <tessel/nn/parameters.hpp>
#include <tessel/ops/attention.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/gemm_grouped.hpp>
#include <tessel/ops/norm.hpp>
#include <tessel/ops/quant.hpp>
#include <tessel/tile/epilogue.hpp>
#include <tessel/tile/tensor.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp16.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel {
inline namespace v0 {
namespace nn {

template <class T>
concept compute_type = std::is_same_v<T, float> || std::is_same_v<T, bf16>;

template <class T>
using cview = tensor<const T, 2>;
template <class T>
using mview = tensor<T, 2>;

// A row-major (rows, cols) view of a buffer (its first rows*cols elements).
template <class T, class Buf>
mview<T> rows_view(Buf&& b, std::size_t rows, std::size_t cols) {  // Buf&&: a buffer or a view handed by value
  return mview<T>(b.data(), rows, cols, cols);
}
template <class T, class Buf>
cview<T> crows_view(const Buf& b, std::size_t rows, std::size_t cols) {
  return cview<T>(b.data(), rows, cols, cols);
}

// The weight of a parameter as a compute-type pointer: the master for f32, its bf16 copy for bf16.
template <compute_type T, device Dev>
const T* compute_data(const parameter<Dev>& p) {
  if constexpr (std::is_same_v<T, float>)
    return p.value.data();
  else
    return p.value_bf16.data();
}

// The largest |x| a linear layer in FP8 mode saw in its last step, per GEMM operand, and the
// largest over all steps since it was switched on (amax history, as FP8 training recipes log it).
struct fp8_amax {
  float x = 0, w = 0, dy = 0;              // last forward/backward
  float x_max = 0, w_max = 0, dy_max = 0;  // since fp8 mode was set
  // Each field the larger of this one's and a's (a model's amax over its layers).
  void include(const fp8_amax& a) {
    x = std::max(x, a.x), w = std::max(w, a.w), dy = std::max(dy, a.dy);
    x_max = std::max(x_max, a.x_max), w_max = std::max(w_max, a.w_max), dy_max = std::max(dy_max, a.dy_max);
  }
};

// What a linear layer's three GEMMs read: the model's compute type, fp16 copies of the operands
// (fp16 mode), or e4m3 with block scales (FP8 mode). Every mode accumulates in f32 and keeps the
// layer's outputs, gradients and f32 masters as they are.
enum class linear_precision : std::uint8_t { compute, fp16, fp8 };

// The largest |x|, |W| and |dy| a linear layer in fp16 mode converted since its record was last
// cleared (NaN: a NaN). A finite value at or past fp16's overflow threshold became Inf in its
// operand: the layer's forward() (x or W) or backward() (dy, which carries the loss scale)
// overflowed, and the products of that pass are not finite. An operand that arrived holding Inf
// or NaN (an amax that is not finite) overflowed elsewhere first, and does not count here.
struct fp16_overflow {
  float x = 0, w = 0, dy = 0;
  static bool overflows(float amax) noexcept { return std::isfinite(amax) && !std::isfinite(float(fp16(amax))); }
  bool forward() const noexcept { return overflows(x) || overflows(w); }
  bool backward() const noexcept { return overflows(dy); }
};

// The fp16 copies of a layer's operands in fp16 mode (x or dy, the other GEMM side, and the
// weight). Layers that run one at a time (a model's) share one; each buffer grows to the largest
// operand it has held.
template <device Dev>
struct fp16_workspace {
  device_buffer<fp16, Dev> a, b, w;
};

// y (N, out) = x (N, in) · Wᵀ + b, with W (out, in) stored either as Hugging Face's Linear does,
// (out, in) row-major, or as GPT-2's Conv1D does, (in, out) row-major, possibly as a column slice
// [col0, col0 + out) of a wider (in, total) matrix (GPT-2's fused q|k|v).
//
// FP8 mode (set_fp8): DeepSeek-V3's block-scaled recipe for all three GEMMs. Each operand is
// quantised to e4m3 in the layout its GEMM reads, the A side in 1x128 blocks along the reduction
// (x for y, dy for dx, dyᵀ along tokens for dW), the B side in 128x128 tiles (W from its f32
// master, read as Wᵀ for y and as W for dx; x for dW); the GEMMs accumulate in FP32 and apply the
// block scales per 128-deep step. Outputs, gradients and masters stay as in the layer's compute
// type. The one departure from DeepSeek-V3: the B side of the weight gradient takes 128x128 tiles
// (our GEMM's B scales) where DeepSeek-V3 scales along tokens in 128x1 blocks; that is x for
// Hugging Face's layout (dW = dyᵀ x) and dy for GPT-2's Conv1D (dWᵀ = xᵀ dy).
//
// fp16 mode (set_precision): the three GEMMs read fp16 copies of x, W (from its f32 master) and
// dy, converted when the GEMM runs (backward converts the saved x again rather than keeping a
// copy), with f32 accumulation, as fp16 mixed precision does. The conversions record each
// operand's amax (fp16_overflow): fp16 tops out at 65504, so a training loop scales the loss (and
// with it dy) to keep small gradients from flushing to zero and watches for overflow. Grouped
// products (experts) have no fp16 form.
template <device Dev, compute_type T>
class linear {
 public:
  linear() = default;
  linear(parameter<Dev>* w, parameter<Dev>* b, std::size_t in, std::size_t out, bool stored_in_out = false, std::size_t col0 = 0)
      : w_(w), b_(b), in_(in), out_(out), in_out_(stored_in_out), col0_(col0) {
    if (!w) throw nn_error(errc::invalid_argument, "linear: null weight");
    const std::size_t total = in_out_ ? w->shape.at(1) : out;
    if (w->shape.size() != 2 || (in_out_ ? w->shape[0] != in || col0 + out > total : w->shape[0] != out || w->shape[1] != in))
      throw nn_error(errc::invalid_argument, "linear: weight '" + w->name + "' of shape " + w->shape_string() + " cannot be a (" +
                                                 std::to_string(out) + ", " + std::to_string(in) + ") map");
    if (b && (b->numel < col0 + out)) throw nn_error(errc::invalid_argument, "linear: bias '" + b->name + "' is too short");
  }
  std::size_t in_features() const { return in_; }
  std::size_t out_features() const { return out_; }
  parameter<Dev>* weight() const { return w_; }
  parameter<Dev>* bias() const { return b_; }

  // The precision of the layer's GEMMs (above). Switching FP8 on resets its amax history; fp16
  // mode converts into `ws` (shared with other layers) or, without one, a workspace of its own,
  // and starts with a clear overflow record.
  void set_precision(linear_precision p, std::shared_ptr<fp16_workspace<Dev>> ws = nullptr) {
    if (p == linear_precision::fp8 && prec_ != p) amax_ = {};
    if (p == linear_precision::fp16) {
      ws16_ = ws ? std::move(ws) : (ws16_ ? ws16_ : std::make_shared<fp16_workspace<Dev>>());
      if (prec_ != p) over16_ = {};
    }
    prec_ = p;
  }
  linear_precision precision() const noexcept { return prec_; }
  // FP8 mode on or off (on: set_precision(fp8); off: back to the compute type).
  void set_fp8(bool on) { set_precision(on ? linear_precision::fp8 : linear_precision::compute); }
  bool fp8() const { return prec_ == linear_precision::fp8; }
  const fp8_amax& amax() const { return amax_; }
  // fp16 mode's overflow record since the last clear_overflow() (its owner clears it once per
  // optimizer step, so a step's forward, recomputation and backward passes all count).
  const fp16_overflow& overflow() const noexcept { return over16_; }
  void clear_overflow() noexcept { over16_ = {}; }
  // The record replaced by one shared with the layer's peers (its shards on other tensor-parallel
  // ranks, its copies on other replicas): the largest amax of each operand over them.
  void set_overflow(const fp16_overflow& o) noexcept { over16_ = o; }

  // Backward's x from now on: the saved input's values at another place (a recomputed copy of it).
  void rebind_input(cview<T> x) {
    if (x.rows() != x_.rows() || x.cols() != x_.cols())
      throw nn_error(errc::invalid_argument, "linear: rebind_input to " + std::to_string(x.rows()) + " x " + std::to_string(x.cols()) +
                                                 " rows and columns, the saved input has " + std::to_string(x_.rows()) + " x " +
                                                 std::to_string(x_.cols()));
    x_ = x;
  }

  // y = x Wᵀ + b (Y: T or f32). Saves x for backward when `save`.
  template <class Y>
  void forward(Dev& dev, cview<T> x, mview<Y> y, bool save) {
    if (save) x_ = x;
    if (prec_ == linear_precision::fp16) {
      const auto xh = to_fp16(dev, ws16_->a, x, over16_.x);
      const auto W = weight_view<const fp16>(weight_fp16(dev));
      if (b_)
        gemm(dev, xh, W.transposed(), y, 1.0f, 0.0f, epilogue::bias(std::span<const float>(b_->value.data() + col0_, out_)));
      else
        gemm(dev, xh, W.transposed(), y);
      return;
    }
    if (fp8()) {
      const std::span<const float> bias = b_ ? std::span<const float>(b_->value.data() + col0_, out_) : std::span<const float>{};
      fp8_gemm(dev, x, weight_view<const float>(w_->value.data()).transposed(), y, 0.0f, bias, amax_.x, amax_.w);
      amax_.x_max = std::max(amax_.x_max, amax_.x);
      amax_.w_max = std::max(amax_.w_max, amax_.w);
      return;
    }
    const auto W = weight_view<const T>(compute_data<T>(*w_));
    if (b_)
      gemm(dev, x, W.transposed(), y, 1.0f, 0.0f, epilogue::bias(std::span<const float>(b_->value.data() + col0_, out_)));
    else
      gemm(dev, x, W.transposed(), y);
  }
  // The same products as problems for one grouped launch (gemm_grouped) with other layers' (a bank
  // of experts): y = x Wᵀ (saving x when `save`), dx = dy W (+ dx when `accumulate_dx`) and
  // dW += dyᵀ x for the saved x. A layer with a bias has no such form (its bias is an epilogue of
  // its own). In FP8 mode the *_fp8 forms below give the block-scaled e4m3 problems instead.
  template <class Y>
  gemm_problem<T, T, Y> forward_problem(cview<T> x, mview<Y> y, bool save) {
    check_compute_grouped();
    if (b_) throw nn_error(errc::unsupported, "linear: a layer with a bias cannot run as a grouped product");
    if (save) x_ = x;
    return gemm_problem_of(x, weight_view<const T>(compute_data<T>(*w_)).transposed(), y);
  }
  template <class DX>
  gemm_problem<T, T, DX> input_grad_problem(cview<T> dy, mview<DX> dx, bool accumulate_dx) const {
    check_compute_grouped();
    return gemm_problem_of(dy, weight_view<const T>(compute_data<T>(*w_)), dx, 1.0f, accumulate_dx ? 1.0f : 0.0f);
  }
  gemm_problem<T, T, float> weight_grad_problem(cview<T> dy) const {
    check_compute_grouped();
    if (x_.rows() != dy.rows()) throw nn_error(errc::invalid_argument, "linear: backward without a matching forward");
    const auto g = weight_grad_operands(x_, dy);
    return gemm_problem_of(g.a, g.b, g.c, 1.0f, 1.0f);
  }
  // FP8 mode's grouped problems: the operands are quantised now (the recipe of forward/backward,
  // the same bits), into buffers of the layer kept per product kind, so that a layer's three
  // problems may be pending at once; each stays valid until the layer's next problem of its kind.
  template <class Y>
  gemm_problem<e4m3, e4m3, Y> forward_problem_fp8(Dev& dev, cview<T> x, mview<Y> y, bool save) {
    check_fp8_grouped();
    if (save) x_ = x;
    const auto p = fp8_problem(dev, fp8q_[0], x, weight_view<const float>(w_->value.data()).transposed(), y, 0.0f, amax_.x, amax_.w);
    amax_.x_max = std::max(amax_.x_max, amax_.x);
    amax_.w_max = std::max(amax_.w_max, amax_.w);
    return p;
  }
  template <class DX>
  gemm_problem<e4m3, e4m3, DX> input_grad_problem_fp8(Dev& dev, cview<T> dy, mview<DX> dx, bool accumulate_dx) {
    check_fp8_grouped();
    float unused = 0;
    const auto p = fp8_problem(dev, fp8q_[1], dy, weight_view<const float>(w_->value.data()), dx, accumulate_dx ? 1.0f : 0.0f, amax_.dy, unused);
    amax_.dy_max = std::max(amax_.dy_max, amax_.dy);
    return p;
  }
  gemm_problem<e4m3, e4m3, float> weight_grad_problem_fp8(Dev& dev, cview<T> dy) {
    check_fp8_grouped();
    if (x_.rows() != dy.rows()) throw nn_error(errc::invalid_argument, "linear: backward without a matching forward");
    const auto g = weight_grad_operands(x_, dy);
    float amax_a = 0, amax_b = 0;
    return fp8_problem(dev, fp8q_[2], g.a, g.b, g.c, 1.0f, amax_a, amax_b);
  }

  // dx = dy W (accumulate: dx += dy W; DX: T or f32), dW += dyᵀ x, db += column sums of dy.
  // `dx` may be empty (the first layer's input needs no gradient).
  template <class DX>
  void backward(Dev& dev, cview<T> dy, mview<DX> dx, bool accumulate_dx) {
    if (x_.rows() != dy.rows()) throw nn_error(errc::invalid_argument, "linear: backward without a matching forward");
    if (prec_ == linear_precision::fp16) {
      const auto dyh = to_fp16(dev, ws16_->b, dy, over16_.dy);
      if (dx.data()) gemm(dev, dyh, weight_view<const fp16>(weight_fp16(dev)), dx, 1.0f, accumulate_dx ? 1.0f : 0.0f);
      float unused = 0;  // x's amax counted in forward
      const auto g = weight_grad_operands(to_fp16(dev, ws16_->a, x_, unused), dyh);
      gemm(dev, g.a, g.b, g.c, 1.0f, 1.0f);
    } else if (fp8()) {
      float unused = 0;
      if (dx.data()) fp8_gemm(dev, dy, weight_view<const float>(w_->value.data()), dx, accumulate_dx ? 1.0f : 0.0f, {}, amax_.dy, unused);
      const auto g = weight_grad_operands(x_, dy);
      float amax_a = 0, amax_b = 0;
      fp8_gemm(dev, g.a, g.b, g.c, 1.0f, {}, amax_a, amax_b);
      if (!dx.data()) amax_.dy = in_out_ ? amax_b : amax_a;  // dy is b (x^T dy) or a (dy^T x)
      amax_.dy_max = std::max(amax_.dy_max, amax_.dy);
    } else {
      const auto W = weight_view<const T>(compute_data<T>(*w_));
      if (dx.data()) gemm(dev, dy, W, dx, 1.0f, accumulate_dx ? 1.0f : 0.0f);
      const auto g = weight_grad_operands(x_, dy);
      gemm(dev, g.a, g.b, g.c, 1.0f, 1.0f);
    }
    if (b_) {
      if (ones_.size() < dy.rows()) ones_ = device_buffer<T, Dev>(dev, dy.rows(), T(1.0f));
      mview<float> db = mview<float>::strided(b_->grad.data() + col0_, out_, 1, 1, 1);
      gemm(dev, dy.transposed(), cview<T>(ones_.data(), dy.rows(), 1, 1), db, 1.0f, 1.0f);
    }
  }

 private:
  void check_compute_grouped() const {
    if (fp8()) throw nn_error(errc::unsupported, "linear: a layer in FP8 mode cannot run as a grouped product (use the _fp8 forms)");
    if (prec_ == linear_precision::fp16) throw nn_error(errc::unsupported, "linear: a layer in fp16 mode has no grouped product");
  }
  void check_fp8_grouped() const {
    if (!fp8()) throw nn_error(errc::unsupported, "linear: FP8 grouped products of a layer not in FP8 mode");
    if (b_) throw nn_error(errc::unsupported, "linear: a layer with a bias cannot run as a grouped product");
  }
  static void take_amax(float& into, float m) noexcept {  // the larger, NaN if either is
    into = std::isnan(into) || std::isnan(m) ? std::numeric_limits<float>::quiet_NaN() : std::max(into, m);
  }
  // fp16 mode: src (rows with unit column stride) into `buf` as a packed (rows, cols) fp16
  // matrix; amax takes the largest |src| seen (NaN stays NaN).
  cview<fp16> to_fp16(Dev& dev, device_buffer<fp16, Dev>& buf, cview<T> src, float& amax) {
    const std::size_t R = src.rows(), C = src.cols();
    const std::size_t n = tessel::detail::mul_checked(R, C, "linear: fp16 operand");
    if (C > 1 && src.col_stride() != 1) throw nn_error(errc::unsupported, "linear: fp16 mode needs operands with unit column stride");
    if (buf.size() < n) buf = device_buffer<fp16, Dev>(dev, n);
    float m = 0.0f;
    if (R <= 1 || src.row_stride() == C) {
      convert(dev, std::span<const T>(src.data(), n), std::span<fp16>(buf.data(), n), 1.0f, &m);
    } else {
      for (std::size_t r = 0; r < R; ++r) {
        float mr = 0.0f;
        convert(dev, std::span<const T>(src.data() + r * src.row_stride(), C), std::span<fp16>(buf.data() + r * C, C), 1.0f, &mr);
        take_amax(m, mr);
      }
    }
    take_amax(amax, m);
    return cview<fp16>(buf.data(), R, C, C);
  }
  // fp16 mode: the whole weight parameter (its f32 master) in fp16, W's amax recorded.
  const fp16* weight_fp16(Dev& dev) {
    const std::size_t n = w_->numel;
    if (ws16_->w.size() < n) ws16_->w = device_buffer<fp16, Dev>(dev, n);
    float m = 0.0f;
    convert(dev, w_->value.cspan(), std::span<fp16>(ws16_->w.data(), n), 1.0f, &m);
    take_amax(over16_.w, m);
    return ws16_->w.data();
  }
  // An e4m3 copy of a GEMM operand and its block scales (reused across steps; grows as needed).
  struct fp8_operand {
    device_buffer<e4m3, Dev> v;
    device_buffer<float, Dev> s;
    template <class S>
    cview<e4m3> quantize(Dev& dev, tensor<const S, 2> src, std::size_t block_rows, float& amax) {
      const std::size_t R = src.rows(), C = src.cols();
      const std::size_t n = tessel::detail::mul_checked(R, C, "linear: fp8 operand"), ns = ceil_div(R, block_rows) * ceil_div(C, std::size_t{128});
      if (v.size() < n) v = device_buffer<e4m3, Dev>(dev, n);
      if (s.size() < ns) s = device_buffer<float, Dev>(dev, ns);
      quantize_e4m3(dev, src, mview<e4m3>(v.data(), R, C, C), std::span<float>(s.data(), ns), {.block_rows = block_rows, .amax = &amax});
      return cview<e4m3>(v.data(), R, C, C);
    }
  };
  struct fp8_pair {
    fp8_operand a, b;
  };
  // The problem c = a·b + beta·c with a quantised in 1x128 blocks along K and b in 128x128 tiles
  // into `q`; the operands' amax go to amax_a, amax_b.
  template <class SA, class SB, class Y>
  gemm_problem<e4m3, e4m3, Y> fp8_problem(Dev& dev, fp8_pair& q, tensor<const SA, 2> a, tensor<const SB, 2> b, mview<Y> c, float beta, float& amax_a,
                                          float& amax_b) {
    auto p = gemm_problem_of(q.a.quantize(dev, a, 1, amax_a), q.b.quantize(dev, b, gemm_scales::block, amax_b), c, 1.0f, beta);
    p.scales.a_block = q.a.s.data();
    p.scales.b_block = q.b.s.data();
    return p;
  }
  // The same, run now (+ bias per column, if any).
  template <class SA, class SB, class Y>
  void fp8_gemm(Dev& dev, tensor<const SA, 2> a, tensor<const SB, 2> b, mview<Y> c, float beta, std::span<const float> bias, float& amax_a,
                float& amax_b) {
    const auto p = fp8_problem(dev, fp8q_[0], a, b, c, beta, amax_a, amax_b);
    const cview<e4m3> qa(p.A, p.M, p.K, p.lda), qb(p.B, p.K, p.N, p.ldb);
    if (!bias.empty())
      gemm(dev, qa, qb, c, 1.0f, beta, epilogue::bias(bias), p.scales);
    else
      gemm(dev, qa, qb, c, 1.0f, beta, epilogue::chain<>{}, p.scales);
  }

  // dW += a·b into c: dyᵀ·x into the (out, in) gradient, or, for a weight stored (in, total),
  // xᵀ·dy into its columns [col0, col0 + out).
  template <class E>
  struct grad_operands {
    cview<E> a, b;
    mview<float> c;
  };
  template <class E>
  grad_operands<E> weight_grad_operands(cview<E> x, cview<E> dy) const {
    if (in_out_) return {x.transposed(), dy, mview<float>::strided(w_->grad.data() + col0_, in_, out_, w_->shape[1], 1)};
    return {dy.transposed(), x, mview<float>::strided(w_->grad.data(), out_, in_, in_, 1)};
  }
  template <class E>
  tensor<E, 2> weight_view(E* base) const {
    if (in_out_) return tensor<E, 2>::strided(base + col0_, out_, in_, 1, w_->shape[1]);  // (out, in) view of (in, total)
    return tensor<E, 2>::strided(base, out_, in_, in_, 1);
  }
  parameter<Dev>* w_ = nullptr;
  parameter<Dev>* b_ = nullptr;
  std::size_t in_ = 0, out_ = 0;
  bool in_out_ = false;
  std::size_t col0_ = 0;
  cview<T> x_;
  device_buffer<T, Dev> ones_;
  linear_precision prec_ = linear_precision::compute;
  fp8_amax amax_;
  std::shared_ptr<fp16_workspace<Dev>> ws16_;
  fp16_overflow over16_;
  fp8_pair fp8q_[3];  // per product kind: forward, input gradient, weight gradient (fp8_gemm: the first)
};

// RMSNorm or LayerNorm over the f32 residual stream, writing the compute type. With a residual,
// the stream is advanced first (h = x + residual, written to residual_out) and h is normalised.
template <device Dev, compute_type T>
class norm {
 public:
  norm() = default;
  norm(parameter<Dev>* w, parameter<Dev>* b, bool rms, float eps) : w_(w), b_(b), rms_(rms), eps_(eps) {
    if (!w || w->shape.size() != 1) throw nn_error(errc::invalid_argument, "norm: weight must be a vector");
    if (b && b->shape != w->shape) throw nn_error(errc::invalid_argument, "norm: bias and weight differ in shape");
  }
  std::size_t features() const { return w_->numel; }

  void forward(Dev& dev, cview<float> x, cview<float> residual, mview<float> residual_out, mview<T> y, bool save) {
    const std::size_t rows = x.rows();
    if (rstd_.size() < rows) {
      rstd_ = device_buffer<float, Dev>(dev, rows);
      if (!rms_) mean_ = device_buffer<float, Dev>(dev, rows);
    }
    const std::span<float> rstd(rstd_.data(), rows);
    const norm_options o{.eps = eps_};
    if (rms_)
      rmsnorm_forward(dev, x, w_->value.cspan(), y, rstd, o, residual, residual_out);
    else
      layernorm_forward(dev, x, w_->value.cspan(), b_ ? b_->value.cspan() : std::span<const float>{}, y, std::span<float>(mean_.data(), rows), rstd,
                        o, residual, residual_out);
    if (save) h_ = residual.data() ? cview<float>(residual_out) : x;
  }
  // dx = d(loss)/d(h) from dy (the gradient of y) plus `dres` (the gradient arriving on the stream
  // after this point; may be empty); dweight and dbias accumulate.
  void backward(Dev& dev, cview<float> dy, cview<float> dres, mview<float> dx) {
    const std::size_t rows = h_.rows();
    if (dy.rows() != rows) throw nn_error(errc::invalid_argument, "norm: backward without a matching forward");
    const norm_options o{.eps = eps_, .accumulate = true};
    const std::span<const float> rstd(rstd_.data(), rows);
    if (rms_)
      rmsnorm_backward(dev, dy, h_, w_->value.cspan(), rstd, dx, w_->grad.span(), o, dres);
    else
      layernorm_backward(dev, dy, h_, w_->value.cspan(), std::span<const float>(mean_.data(), rows), rstd, dx, w_->grad.span(),
                         b_ ? b_->grad.span() : std::span<float>{}, o, dres);
  }

 private:
  parameter<Dev>* w_ = nullptr;
  parameter<Dev>* b_ = nullptr;
  bool rms_ = true;
  float eps_ = 1e-6f;
  cview<float> h_;
  device_buffer<float, Dev> rstd_, mean_;
};

// Causal self-attention over a dense batch (batch, seq) of q (tokens, heads_q·d) and k, v
// (tokens, heads_kv·d) in token order, with grouped-query heads and an optional sliding window
// (a query attends to the `window` most recent keys, itself included).
template <device Dev, compute_type T>
class self_attention {
 public:
  self_attention() = default;
  self_attention(std::size_t heads_q, std::size_t heads_kv, std::size_t head_dim, std::optional<std::size_t> window)
      : hq_(heads_q), hkv_(heads_kv), d_(head_dim), window_(window) {}

  attention_options options() const {
    attention_options o;
    o.causal = true;
    if (window_) o.window_left = static_cast<std::ptrdiff_t>(*window_) - 1;
    return o;
  }
  attention_shape shape(std::size_t batch, std::size_t seq) const {
    return attention_shape{.batch = batch, .seq_q = seq, .seq_kv = seq, .heads_q = hq_, .heads_kv = hkv_, .head_dim = d_};
  }
  // o = softmax(q kᵀ / sqrt(d) + mask) v; lse (batch·heads_q·seq) is kept for backward.
  void forward(Dev& dev, std::size_t batch, std::size_t seq, std::span<const T> q, std::span<const T> k, std::span<const T> v, std::span<T> o,
               std::span<float> lse) {
    attention_forward(dev, shape(batch, seq), q, k, v, o, lse, options());
  }
  void backward(Dev& dev, std::size_t batch, std::size_t seq, std::span<const T> q, std::span<const T> k, std::span<const T> v, std::span<const T> o,
                std::span<const T> dout, std::span<const float> lse, std::span<T> dq, std::span<T> dk, std::span<T> dv) {
    attention_backward(dev, shape(batch, seq), q, k, v, o, dout, lse, dq, dk, dv, options());
  }

 private:
  std::size_t hq_ = 1, hkv_ = 1, d_ = 0;
  std::optional<std::size_t> window_;
};

}  // namespace nn
}  // namespace v0
}  // namespace tessel
