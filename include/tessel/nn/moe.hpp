// Hugging Face Mixtral's sparse mixture-of-experts block (`block_sparse_moe`) with forward and
// backward: a router (linear hidden -> E, f32 logits), softmax over the experts, the top k with
// their probabilities renormalised to sum 1, and SwiGLU experts w2(silu(w1 x) * w3 x) each run on
// only the tokens routed to it (gather -> GEMMs -> weighted combine), no token dropping.
//
// Determinism: routing (softmax in double, top-k with ties to the lower expert index), the gather
// (each expert's tokens in token order) and the combine (each token adds its experts' outputs in
// top-k rank order) do not depend on the thread count; the GEMMs are deterministic.
// The load-balancing loss of HF (load_balancing_loss_func) spans all layers, so the block only
// reports its per-expert statistics (counts, probability sums) and takes d aux / d p back.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <tessel/device/device.hpp>
#include <tessel/detail/checked.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/nn/errors.hpp>
#include <tessel/nn/layers.hpp>
#include <tessel/nn/parameters.hpp>
#include <tessel/ops/activation.hpp>

namespace tessel {
inline namespace v0 {
namespace nn {

// The routing of a sparse MoE block, from its router logits: softmax in double, the top k per row
// (descending probability, ties to the lower expert index) with their probabilities renormalised,
// the per-expert statistics of the aux loss, and the gradient back to the logits. Shared by
// sparse_moe (one device) and dist::ep_moe (experts over ranks), so both route the same bits.
class moe_routing {
 public:
  moe_routing() = default;
  moe_routing(std::size_t experts, std::size_t top_k) : E_(experts), k_(top_k) {
    if (E_ == 0 || k_ == 0 || k_ > E_)
      throw nn_error(errc::invalid_argument, "sparse_moe: top-" + std::to_string(k_) + " of " + std::to_string(E_) + " experts");
  }
  std::size_t experts() const { return E_; }
  std::size_t top_k() const { return k_; }
  std::size_t rows() const { return n_; }

  // Routes n rows of logits (n, E) f32, kept by reference until the next route (backward reads them).
  void route(const float* logits, std::size_t n) {
    logits_ = logits, n_ = n;
    expert_.assign(n * k_, 0);
    weight_.assign(n * k_, 0.0f);
    count_.assign(E_, 0);
    psum_.assign(E_, 0.0);
    std::vector<double> p(E_);
    std::vector<char> taken(E_);
    for (std::size_t t = 0; t < n; ++t) {
      softmax_row(t, p.data());
      for (std::size_t e = 0; e < E_; ++e) psum_[e] += p[e];
      std::fill(taken.begin(), taken.end(), 0);
      double z = 0.0;
      for (std::size_t r = 0; r < k_; ++r) {
        std::size_t best = E_;
        for (std::size_t e = 0; e < E_; ++e)
          if (!taken[e] && (best == E_ || p[e] > p[best])) best = e;
        taken[best] = 1;
        expert_[t * k_ + r] = best;
        z += p[best];
        ++count_[best];
      }
      for (std::size_t r = 0; r < k_; ++r) weight_[t * k_ + r] = float(p[expert_[t * k_ + r]] / z);
    }
  }
  // Per (row, rank) slot t * k + r: its expert and renormalised weight.
  const std::vector<std::size_t>& slot_expert() const { return expert_; }
  const std::vector<float>& slot_weight() const { return weight_; }
  // Per expert: how many rows chose it and the sum of its probabilities (HF's f_e · N, P_e · N).
  const std::vector<std::size_t>& expert_counts() const { return count_; }
  const std::vector<double>& prob_sums() const { return psum_; }

  // Gradient of the logits (n, E), written in the compute type, from the gradient of every slot's
  // weight (dw, n·k, before renormalisation's backward) and `dprob` (E or empty) added to every
  // row's probabilities: through the renormalisation w_r = p_r / Z over the top k and the softmax.
  template <class T>
  void backward(std::span<const double> dw, std::span<const double> dprob, T* dlogits) const {
    std::vector<double> p(E_), dp(E_);
    for (std::size_t t = 0; t < n_; ++t) {
      softmax_row(t, p.data());
      for (std::size_t e = 0; e < E_; ++e) dp[e] = dprob.empty() ? 0.0 : dprob[e];
      double z = 0.0, sw = 0.0;
      for (std::size_t r = 0; r < k_; ++r) z += p[expert_[t * k_ + r]];
      for (std::size_t r = 0; r < k_; ++r) sw += dw[t * k_ + r] * (p[expert_[t * k_ + r]] / z);
      for (std::size_t r = 0; r < k_; ++r) dp[expert_[t * k_ + r]] += (dw[t * k_ + r] - sw) / z;
      double pdp = 0.0;
      for (std::size_t e = 0; e < E_; ++e) pdp += p[e] * dp[e];
      for (std::size_t e = 0; e < E_; ++e) dlogits[t * E_ + e] = T(float(p[e] * (dp[e] - pdp)));
    }
  }

 private:
  void softmax_row(std::size_t t, double* p) const {
    const float* l = logits_ + t * E_;
    double mx = l[0];
    for (std::size_t e = 1; e < E_; ++e) mx = std::max(mx, double(l[e]));
    double s = 0.0;
    for (std::size_t e = 0; e < E_; ++e) s += (p[e] = std::exp(double(l[e]) - mx));
    for (std::size_t e = 0; e < E_; ++e) p[e] /= s;
  }

  std::size_t E_ = 0, k_ = 0, n_ = 0;
  const float* logits_ = nullptr;
  std::vector<std::size_t> expert_, count_;
  std::vector<float> weight_;
  std::vector<double> psum_;
};

// Hugging Face's load_balancing_loss_func over N routed rows (every MoE layer's rows together):
// aux = E · Σ_e f_e · P_e with f_e = counts[e] / N and P_e = prob_sums[e] / N (counts and sums over
// the layers), and dprob[e] = coef · E · f_e / N, the gradient of coef · aux with respect to every
// row's probability of e (the top-k selection carries none). Returns aux.
inline double load_balancing_loss(std::span<const double> counts, std::span<const double> prob_sums, double rows, double coef,
                                  std::vector<double>& dprob) {
  const std::size_t E = counts.size();
  double aux = 0.0;
  dprob.assign(E, 0.0);
  for (std::size_t e = 0; e < E; ++e) {
    aux += double(E) * (counts[e] / rows) * (prob_sums[e] / rows);
    if (coef > 0.0) dprob[e] = coef * double(E) * (counts[e] / rows) / rows;
  }
  return aux;
}

// A bank of SwiGLU experts w2(silu(w1 x) * w3 x) run on rows grouped by expert: expert j's rows
// are [off[j], off[j+1]) of the (rows, d) input. Keeps its intermediates for backward; the input
// rows must stay alive until then (the linears keep views of them).
template <device Dev, compute_type T>
class expert_bank {
 public:
  expert_bank() = default;
  // experts[j] = {w1 (I, d), w3 (I, d), w2 (d, I)}, Hugging Face's nn.Linear layout.
  expert_bank(std::vector<std::array<parameter<Dev>*, 3>> experts, std::size_t hidden, std::size_t inter) : d_(hidden), I_(inter) {
    for (auto& e : experts) {
      w1_.emplace_back(e[0], nullptr, d_, I_);
      w3_.emplace_back(e[1], nullptr, d_, I_);
      w2_.emplace_back(e[2], nullptr, I_, d_);
    }
  }
  std::size_t experts() const { return w1_.size(); }
  // FP8 mode for every expert projection (linear::set_fp8: DeepSeek-V3's block-scaled recipe, whose
  // experts run in FP8): the grouped launches take e4m3 operands with their block scales.
  void set_fp8(bool on) {
    for (auto* v : {&w1_, &w3_, &w2_})
      for (auto& l : *v) l.set_fp8(on);
    fp8_ = on;
  }
  bool fp8() const { return fp8_; }
  // Every expert projection (w1, w3, w2 of each expert), e.g. for their amax.
  template <class F>
  void for_each_linear(F&& f) const {
    for (const auto* v : {&w1_, &w3_, &w2_})
      for (const auto& l : *v) f(l);
  }

  // oe (rows, d) f32 = each expert applied to its rows of xe (rows, d); off has experts()+1 entries.
  // The experts' products run as grouped launches (gemm_grouped): every expert's gate and up
  // projections in one, their down projections in another. An expert's bits do not depend on the
  // other experts or on how many a rank holds.
  void forward(Dev& dev, const T* xe, std::span<const std::size_t> off, float* oe, bool train) {
    if (off.size() != experts() + 1) throw nn_error(errc::invalid_argument, "sparse_moe: one row offset per expert and one past the end");
    off_.assign(off.begin(), off.end());
    for (std::size_t j = 0; j < experts(); ++j)
      if (off_[j + 1] < off_[j]) throw nn_error(errc::invalid_argument, "sparse_moe: row offsets must not decrease");
    reserve(dev, off_.back());
    if (fp8_)
      run_forward<true>(dev, xe, oe, train);
    else
      run_forward<false>(dev, xe, oe, train);
  }
  // dxe (rows, d) f32 = d loss / d xe from dye (rows, d) in the compute type, the rows of the last
  // forward; the experts' weight gradients accumulate.
  void backward(Dev& dev, const T* dye, float* dxe) {
    if (fp8_)
      run_backward<true>(dev, dye, dxe);
    else
      run_backward<false>(dev, dye, dxe);
  }

 private:
  // The problems of the compute type, or (F8) of e4m3 operands quantised as they are made: those of
  // gate and up go into one group and the down projections into another; backward makes each
  // problem once its operands exist (the gate and up gradients after the SwiGLU backward).
  template <bool F8, class Y>
  using problem = gemm_problem<std::conditional_t<F8, e4m3, T>, std::conditional_t<F8, e4m3, T>, Y>;
  template <bool F8, class Y>
  problem<F8, Y> forward_problem(Dev& dev, linear<Dev, T>& l, cview<T> x, mview<Y> y, bool save) {
    if constexpr (F8)
      return l.forward_problem_fp8(dev, x, y, save);
    else
      return l.forward_problem(x, y, save);
  }
  template <bool F8, class Y>
  problem<F8, Y> input_grad_problem(Dev& dev, linear<Dev, T>& l, cview<T> dy, mview<Y> dx, bool accumulate) {
    if constexpr (F8)
      return l.input_grad_problem_fp8(dev, dy, dx, accumulate);
    else
      return l.input_grad_problem(dy, dx, accumulate);
  }
  template <bool F8>
  problem<F8, float> weight_grad_problem(Dev& dev, linear<Dev, T>& l, cview<T> dy) {
    if constexpr (F8)
      return l.weight_grad_problem_fp8(dev, dy);
    else
      return l.weight_grad_problem(dy);
  }
  template <bool F8>
  void run_forward(Dev& dev, const T* xe, float* oe, bool train) {
    std::vector<problem<F8, T>> up;
    std::vector<problem<F8, float>> down;
    for (std::size_t j = 0; j < experts(); ++j) {
      const std::size_t o = off_[j], c = off_[j + 1] - o;
      if (c == 0) continue;
      const cview<T> xj(xe + o * d_, c, d_, d_);
      up.push_back(forward_problem<F8>(dev, w1_[j], xj, mview<T>(ge_.data() + o * I_, c, I_, I_), train));
      up.push_back(forward_problem<F8>(dev, w3_[j], xj, mview<T>(ue_.data() + o * I_, c, I_, I_), train));
    }
    if (up.empty()) return;
    const std::size_t n = off_.back() * I_;
    gemm_grouped(dev, up);
    swiglu_forward(dev, std::span<const T>(ge_.data(), n), std::span<const T>(ue_.data(), n), std::span<T>(he_.data(), n));
    for (std::size_t j = 0; j < experts(); ++j) {
      const std::size_t o = off_[j], c = off_[j + 1] - o;
      if (c == 0) continue;
      down.push_back(forward_problem<F8>(dev, w2_[j], cview<T>(he_.data() + o * I_, c, I_, I_), mview<float>(oe + o * d_, c, d_, d_), train));
    }
    gemm_grouped(dev, down);
  }
  template <bool F8>
  void run_backward(Dev& dev, const T* dye, float* dxe) {
    std::vector<problem<F8, T>> dh;
    std::vector<problem<F8, float>> dx1, dx3, dw;
    for (std::size_t j = 0; j < experts(); ++j) {
      const std::size_t o = off_[j], c = off_[j + 1] - o;
      if (c == 0) continue;
      const cview<T> dyj(dye + o * d_, c, d_, d_);
      dh.push_back(input_grad_problem<F8>(dev, w2_[j], dyj, mview<T>(dhe_.data() + o * I_, c, I_, I_), false));
      dw.push_back(weight_grad_problem<F8>(dev, w2_[j], dyj));
    }
    if (dh.empty()) return;
    const std::size_t n = off_.back() * I_;
    gemm_grouped(dev, dh);
    swiglu_backward(dev, std::span<const T>(dhe_.data(), n), std::span<const T>(ge_.data(), n), std::span<const T>(ue_.data(), n),
                    std::span<T>(dge_.data(), n), std::span<T>(due_.data(), n));
    for (std::size_t j = 0; j < experts(); ++j) {
      const std::size_t o = off_[j], c = off_[j + 1] - o;
      if (c == 0) continue;
      const cview<T> dgj(dge_.data() + o * I_, c, I_, I_), duj(due_.data() + o * I_, c, I_, I_);
      const mview<float> dxj(dxe + o * d_, c, d_, d_);
      dx1.push_back(input_grad_problem<F8>(dev, w1_[j], dgj, dxj, false));
      dx3.push_back(input_grad_problem<F8>(dev, w3_[j], duj, dxj, true));  // after dx1: adds into the same rows
      dw.push_back(weight_grad_problem<F8>(dev, w1_[j], dgj));
      dw.push_back(weight_grad_problem<F8>(dev, w3_[j], duj));
    }
    gemm_grouped(dev, dx1);
    gemm_grouped(dev, dx3);
    gemm_grouped(dev, dw);
  }

  void reserve(Dev& dev, std::size_t rows) {
    const std::size_t m = tessel::detail::mul_checked(rows, I_, "sparse_moe: expert rows");
    for (auto* b : {&ge_, &ue_, &he_, &dhe_, &dge_, &due_})
      if (b->size() < m) *b = device_buffer<T, Dev>(dev, m);
  }
  std::size_t d_ = 0, I_ = 0;
  std::vector<linear<Dev, T>> w1_, w3_, w2_;
  bool fp8_ = false;
  std::vector<std::size_t> off_;
  device_buffer<T, Dev> ge_, ue_, he_, dhe_, dge_, due_;
};

template <device Dev, compute_type T>
class sparse_moe {
 public:
  sparse_moe() = default;
  // router: (E, d); experts[j] = {w1 (I, d), w3 (I, d), w2 (d, I)}, Hugging Face's nn.Linear layout.
  sparse_moe(parameter<Dev>* router, std::vector<std::array<parameter<Dev>*, 3>> experts, std::size_t hidden, std::size_t inter, std::size_t top_k)
      : d_(hidden), E_(experts.size()), k_(top_k), routing_(E_, k_), bank_(std::move(experts), hidden, inter) {
    router_ = linear<Dev, T>(router, nullptr, d_, E_);
  }
  std::size_t experts() const { return E_; }
  std::size_t top_k() const { return k_; }

  // y (n, d) f32 = the block applied to x (n, d). Keeps routing and per-expert activations.
  void forward(Dev& dev, cview<T> x, mview<float> y, bool train) {
    const std::size_t n = x.rows();
    if (x.cols() != d_ || y.rows() != n || y.cols() != d_ || x.col_stride() != 1 || y.col_stride() != 1)
      throw nn_error(errc::invalid_argument, "sparse_moe: shapes do not match the block");
    reserve(dev, n);
    n_ = n;
    router_.forward(dev, x, rows_view<float>(logits_, n, E_), train);
    routing_.route(logits_.data(), n);
    const auto& expert = routing_.slot_expert();
    const auto& weight = routing_.slot_weight();
    // each expert's rows in token order: expert j's rows are [off_[j], off_[j+1])
    off_.assign(E_ + 1, 0);
    for (std::size_t e = 0; e < E_; ++e) off_[e + 1] = off_[e] + routing_.expert_counts()[e];
    std::vector<std::size_t> fill(off_.begin(), off_.end() - 1);
    slot_.resize(n * k_);
    for (std::size_t r = 0; r < n * k_; ++r) slot_[r] = fill[expert[r]]++;
    for (std::size_t r = 0; r < n * k_; ++r) {
      const T* src = x.data() + (r / k_) * x.row_stride();
      std::copy(src, src + d_, xe_.data() + slot_[r] * d_);
    }
    bank_.forward(dev, xe_.data(), off_, oe_.data(), train);
    // combine in top-k rank order
    for (std::size_t t = 0; t < n; ++t) {
      float* out = y.data() + t * y.row_stride();
      std::fill(out, out + d_, 0.0f);
      for (std::size_t r = 0; r < k_; ++r) {
        const float w = weight[t * k_ + r];
        const float* src = oe_.data() + slot_[t * k_ + r] * d_;
        for (std::size_t i = 0; i < d_; ++i) out[i] += w * src[i];
      }
    }
  }

  // Per expert: how many rows chose it (in their top k) and the sum of its probabilities, of the
  // last forward (HF's f_e · N and P_e · N before the division by the rows of all layers).
  const std::vector<std::size_t>& expert_counts() const { return routing_.expert_counts(); }
  const std::vector<double>& prob_sums() const { return routing_.prob_sums(); }
  // The last forward's router logits (n, E) f32.
  std::span<const float> router_logits() const { return {logits_.data(), n_ * E_}; }
  // The experts' FP8 mode (expert_bank::set_fp8); the router keeps the compute type.
  void set_experts_fp8(bool on) { bank_.set_fp8(on); }
  const expert_bank<Dev, T>& bank() const { return bank_; }

  // dx (n, d) f32 = d loss / d x (written, not accumulated) from dy (n, d) f32; the parameters'
  // gradients accumulate. `dprob` (E, may be empty) is a gradient added to every row's softmax
  // probabilities (the aux loss's coef · E · f_e / N).
  void backward(Dev& dev, cview<float> dy, mview<float> dx, std::span<const double> dprob) {
    const std::size_t n = n_;
    if (dy.rows() != n || dx.rows() != n) throw nn_error(errc::invalid_argument, "sparse_moe: backward without a matching forward");
    if (dy.cols() != d_ || dx.cols() != d_ || dy.col_stride() != 1 || dx.col_stride() != 1)
      throw nn_error(errc::invalid_argument, "sparse_moe: gradients must be row-major (tokens, hidden)");
    if (!dprob.empty() && dprob.size() != E_) throw nn_error(errc::invalid_argument, "sparse_moe: one probability gradient per expert");
    std::vector<double> dw(n * k_);
    // gradient of each (token, rank) expert output: w · dy, and of the weight: <dy, expert output>
    const auto& weight = routing_.slot_weight();
    for (std::size_t t = 0; t < n; ++t) {
      const float* g = dy.data() + t * dy.row_stride();
      for (std::size_t r = 0; r < k_; ++r) {
        const std::size_t s = slot_[t * k_ + r];
        dw[t * k_ + r] = slot_gradient(g, weight[t * k_ + r], oe_.data() + s * d_, dye_.data() + s * d_, d_);
      }
    }
    bank_.backward(dev, dye_.data(), dxe_.data());
    // scatter-add in rank order
    for (std::size_t t = 0; t < n; ++t) {
      float* out = dx.data() + t * dx.row_stride();
      std::fill(out, out + d_, 0.0f);
      for (std::size_t r = 0; r < k_; ++r) {
        const float* src = dxe_.data() + slot_[t * k_ + r] * d_;
        for (std::size_t i = 0; i < d_; ++i) out[i] += src[i];
      }
    }
    routing_.backward(std::span<const double>(dw), dprob, dlogits_.data());
    router_.backward(dev, cview<T>(dlogits_.data(), n, E_, E_), dx, true);
  }

  // One slot's backward through the weighted combine: de = w · g in the compute type, and the
  // gradient of its weight <g, o> (double). Shared with dist::ep_moe.
  static double slot_gradient(const float* g, float w, const float* o, T* de, std::size_t d) {
    double acc = 0.0;
    for (std::size_t i = 0; i < d; ++i) {
      acc += double(g[i]) * o[i];
      de[i] = T(w * g[i]);
    }
    return acc;
  }

 private:
  void reserve(Dev& dev, std::size_t n) {
    auto ensure = [&](auto& b, std::size_t m) {
      using B = std::decay_t<decltype(b)>;
      if (b.size() < m) b = B(dev, m);
    };
    const std::size_t nk = n * k_;
    ensure(logits_, n * E_);
    ensure(dlogits_, n * E_);
    ensure(xe_, nk * d_);
    ensure(oe_, nk * d_);
    ensure(dye_, nk * d_);
    ensure(dxe_, nk * d_);
  }

  std::size_t d_ = 0, E_ = 0, k_ = 0, n_ = 0;
  linear<Dev, T> router_;
  moe_routing routing_;
  expert_bank<Dev, T> bank_;
  // per (token, rank) slot its row in the expert buffers, and each expert's first row
  std::vector<std::size_t> slot_, off_;
  device_buffer<float, Dev> logits_, oe_, dxe_;
  device_buffer<T, Dev> dlogits_, xe_, dye_;
};

}  // namespace nn
}  // namespace v0
}  // namespace tessel
