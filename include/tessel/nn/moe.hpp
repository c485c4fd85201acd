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
#include <tessel/device/device_buffer.hpp>
#include <tessel/nn/errors.hpp>
#include <tessel/nn/layers.hpp>
#include <tessel/nn/parameters.hpp>
#include <tessel/ops/activation.hpp>

namespace tessel {
inline namespace v0 {
namespace nn {

template <device Dev, compute_type T>
class sparse_moe {
 public:
  sparse_moe() = default;
  // router: (E, d); experts[j] = {w1 (I, d), w3 (I, d), w2 (d, I)}, Hugging Face's nn.Linear layout.
  sparse_moe(parameter<Dev>* router, std::vector<std::array<parameter<Dev>*, 3>> experts, std::size_t hidden, std::size_t inter, std::size_t top_k)
      : d_(hidden), I_(inter), E_(experts.size()), k_(top_k) {
    if (E_ == 0 || k_ == 0 || k_ > E_)
      throw nn_error(errc::invalid_argument, "sparse_moe: top-" + std::to_string(k_) + " of " + std::to_string(E_) + " experts");
    router_ = linear<Dev, T>(router, nullptr, d_, E_);
    for (auto& e : experts) {
      w1_.emplace_back(e[0], nullptr, d_, I_);
      w3_.emplace_back(e[1], nullptr, d_, I_);
      w2_.emplace_back(e[2], nullptr, I_, d_);
    }
  }
  std::size_t experts() const { return E_; }
  std::size_t top_k() const { return k_; }

  // y (n, d) f32 = the block applied to x (n, d). Keeps routing and per-expert activations.
  void forward(Dev& dev, cview<T> x, mview<float> y, bool train) {
    const std::size_t n = x.rows();
    if (x.cols() != d_ || y.rows() != n || y.cols() != d_ || x.col_stride() != 1 || y.col_stride() != 1) throw nn_error(errc::invalid_argument, "sparse_moe: shapes do not match the block");
    reserve(dev, n);
    n_ = n;
    router_.forward(dev, x, rows_view<float>(logits_, n, E_), train);
    route(n);
    // gather: expert j's rows are [off_[j], off_[j+1]) of the concatenated buffers, tokens in order
    for (std::size_t r = 0; r < n * k_; ++r) {
      const std::size_t t = r / k_;
      const T* src = x.data() + t * x.row_stride();
      std::copy(src, src + d_, xe_.data() + slot_[r] * d_);
    }
    for (std::size_t j = 0; j < E_; ++j) {
      const std::size_t o = off_[j], c = off_[j + 1] - o;
      if (c == 0) continue;
      const cview<T> xj(xe_.data() + o * d_, c, d_, d_);
      w1_[j].forward(dev, xj, mview<T>(ge_.data() + o * I_, c, I_, I_), train);
      w3_[j].forward(dev, xj, mview<T>(ue_.data() + o * I_, c, I_, I_), train);
      swiglu_forward(dev, std::span<const T>(ge_.data() + o * I_, c * I_), std::span<const T>(ue_.data() + o * I_, c * I_),
                     std::span<T>(he_.data() + o * I_, c * I_));
      w2_[j].forward(dev, cview<T>(he_.data() + o * I_, c, I_, I_), mview<float>(oe_.data() + o * d_, c, d_, d_), train);
    }
    // combine in top-k rank order
    for (std::size_t t = 0; t < n; ++t) {
      float* out = y.data() + t * y.row_stride();
      std::fill(out, out + d_, 0.0f);
      for (std::size_t r = 0; r < k_; ++r) {
        const float w = weight_[t * k_ + r];
        const float* src = oe_.data() + slot_[t * k_ + r] * d_;
        for (std::size_t i = 0; i < d_; ++i) out[i] += w * src[i];
      }
    }
  }

  // Per expert: how many rows chose it (in their top k) and the sum of its probabilities, of the
  // last forward (HF's f_e · N and P_e · N before the division by the rows of all layers).
  const std::vector<std::size_t>& expert_counts() const { return count_; }
  const std::vector<double>& prob_sums() const { return psum_; }
  // The last forward's router logits (n, E) f32.
  std::span<const float> router_logits() const { return {logits_.data(), n_ * E_}; }

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
    for (std::size_t t = 0; t < n; ++t) {
      const float* g = dy.data() + t * dy.row_stride();
      for (std::size_t r = 0; r < k_; ++r) {
        const std::size_t s = slot_[t * k_ + r];
        const float w = weight_[t * k_ + r];
        const float* o = oe_.data() + s * d_;
        T* de = dye_.data() + s * d_;
        double acc = 0.0;
        for (std::size_t i = 0; i < d_; ++i) {
          acc += double(g[i]) * o[i];
          de[i] = T(w * g[i]);
        }
        dw[t * k_ + r] = acc;
      }
    }
    for (std::size_t j = 0; j < E_; ++j) {
      const std::size_t o = off_[j], c = off_[j + 1] - o;
      if (c == 0) continue;
      w2_[j].backward(dev, cview<T>(dye_.data() + o * d_, c, d_, d_), mview<T>(dhe_.data() + o * I_, c, I_, I_), false);
      swiglu_backward(dev, std::span<const T>(dhe_.data() + o * I_, c * I_), std::span<const T>(ge_.data() + o * I_, c * I_),
                      std::span<const T>(ue_.data() + o * I_, c * I_), std::span<T>(dge_.data() + o * I_, c * I_),
                      std::span<T>(due_.data() + o * I_, c * I_));
      const mview<float> dxj(dxe_.data() + o * d_, c, d_, d_);
      w1_[j].backward(dev, cview<T>(dge_.data() + o * I_, c, I_, I_), dxj, false);
      w3_[j].backward(dev, cview<T>(due_.data() + o * I_, c, I_, I_), dxj, true);
    }
    // scatter-add in rank order
    for (std::size_t t = 0; t < n; ++t) {
      float* out = dx.data() + t * dx.row_stride();
      std::fill(out, out + d_, 0.0f);
      for (std::size_t r = 0; r < k_; ++r) {
        const float* src = dxe_.data() + slot_[t * k_ + r] * d_;
        for (std::size_t i = 0; i < d_; ++i) out[i] += src[i];
      }
    }
    // router: through the renormalisation (w_r = p_r / Z over the top k) and the softmax
    std::vector<double> p(E_), dp(E_);
    for (std::size_t t = 0; t < n; ++t) {
      softmax_row(t, p.data());
      for (std::size_t e = 0; e < E_; ++e) dp[e] = dprob.empty() ? 0.0 : dprob[e];
      double z = 0.0, sw = 0.0;
      for (std::size_t r = 0; r < k_; ++r) z += p[expert_[t * k_ + r]];
      for (std::size_t r = 0; r < k_; ++r) sw += dw[t * k_ + r] * (p[expert_[t * k_ + r]] / z);
      for (std::size_t r = 0; r < k_; ++r) dp[expert_[t * k_ + r]] += (dw[t * k_ + r] - sw) / z;
      double pdp = 0.0;
      for (std::size_t e = 0; e < E_; ++e) pdp += p[e] * dp[e];
      for (std::size_t e = 0; e < E_; ++e) dlogits_.data()[t * E_ + e] = T(float(p[e] * (dp[e] - pdp)));
    }
    router_.backward(dev, cview<T>(dlogits_.data(), n, E_, E_), dx, true);
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
    ensure(ge_, nk * I_);
    ensure(ue_, nk * I_);
    ensure(he_, nk * I_);
    ensure(oe_, nk * d_);
    ensure(dye_, nk * d_);
    ensure(dhe_, nk * I_);
    ensure(dge_, nk * I_);
    ensure(due_, nk * I_);
    ensure(dxe_, nk * d_);
  }

  // softmax of row t's router logits, in double
  void softmax_row(std::size_t t, double* p) const {
    const float* l = logits_.data() + t * E_;
    double mx = l[0];
    for (std::size_t e = 1; e < E_; ++e) mx = std::max(mx, double(l[e]));
    double s = 0.0;
    for (std::size_t e = 0; e < E_; ++e) s += (p[e] = std::exp(double(l[e]) - mx));
    for (std::size_t e = 0; e < E_; ++e) p[e] /= s;
  }

  // top-k per row (descending probability, ties to the lower index), renormalised weights, each
  // expert's rows in token order, and the aux-loss statistics.
  void route(std::size_t n) {
    expert_.assign(n * k_, 0);
    weight_.assign(n * k_, 0.0f);
    slot_.assign(n * k_, 0);
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
    off_.assign(E_ + 1, 0);
    for (std::size_t e = 0; e < E_; ++e) off_[e + 1] = off_[e] + count_[e];
    std::vector<std::size_t> fill(off_.begin(), off_.end() - 1);
    for (std::size_t r = 0; r < n * k_; ++r) slot_[r] = fill[expert_[r]]++;
  }

  std::size_t d_ = 0, I_ = 0, E_ = 0, k_ = 0, n_ = 0;
  linear<Dev, T> router_;
  std::vector<linear<Dev, T>> w1_, w3_, w2_;
  // routing of the last forward: per (token, rank) its expert, weight and row in the expert buffers
  std::vector<std::size_t> expert_, slot_, off_, count_;
  std::vector<float> weight_;
  std::vector<double> psum_;
  device_buffer<float, Dev> logits_, oe_, dxe_;
  device_buffer<T, Dev> dlogits_, xe_, ge_, ue_, he_, dye_, dhe_, dge_, due_;
};

}  // namespace nn
}  // namespace v0
}  // namespace tessel
