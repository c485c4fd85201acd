// Expert parallelism: a sparse mixture-of-experts block (nn::sparse_moe's Mixtral block) whose E
// experts are spread over the ep ranks of a communicator, rank r holding experts
// [r·E/ep, (r+1)·E/ep). Every ep rank has its own tokens (ep ranks are data-parallel ranks for
// everything but the experts) and the router whole.
//
// Forward: the router and the routing run locally (nn::moe_routing, the same code as one device);
// each token's row goes once to every rank holding one of its top-k experts (moe_dispatch_rows,
// DeepEP's dispatch); each rank runs its experts on the rows it received (nn::expert_bank), grouped
// by expert in (source rank, token) order; every expert row comes back to its (token, k) slot
// unsummed (moe_return_rows) and the home rank combines them in top-k order. Backward mirrors it:
// the slots' gradients go to the experts (moe_send_rows), the experts' input gradients come back
// per slot and are added in top-k order. Two exchanges forward, two backward, plus the routing
// metadata.
//
// Against one device (nn::sparse_moe) on the concatenation of the ep ranks' tokens in rank order:
// each expert sees the same rows in the same order, and each token adds the same rows in the same
// order, so the output, the input gradient and every expert's weight gradient are the same bits
// (tested). The router's weight gradient is a sum over tokens, taken per rank here: the ranks'
// gradients summed (by data parallelism's all-reduce) agree to the reordering of that sum.
//
// ep_moe_options::fp8_dispatch sends the forward's rows as DeepEP's FP8 (E4M3, one f32 scale per
// 128 channels, rounded through BF16 first): a quarter of f32's bytes, at E4M3's precision (3
// mantissa bits); the expert GEMMs read the dequantized rows and the backward stays exact.
// ep_moe_options::fp8_experts (or set_experts_fp8) runs the local experts' GEMMs in FP8
// (nn::expert_bank::set_fp8: DeepSeek-V3's block-scaled recipe, forward and backward); an
// expert's scales are taken over its own rows, which are those of one device, so ep_moe stays
// the bits of nn::sparse_moe with its experts in FP8 (tested). The router keeps the compute type.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <tessel/collectives/communicator.hpp>
#include <tessel/collectives/moe.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/detail/checked.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/dist/tensor_parallel.hpp>
#include <tessel/nn/layers.hpp>
#include <tessel/nn/moe.hpp>
#include <tessel/nn/parameters.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

struct ep_moe_options {
  bool fp8_dispatch = false;  // forward rows as E4M3 + per-128-channel scales (hidden % 128 == 0)
  bool fp8_experts = false;   // the local experts' GEMMs in FP8 (set_experts_fp8)
};

// The experts rank `rank` of `ep` holds: [first, first + count).
inline std::pair<std::size_t, std::size_t> local_experts(std::size_t experts, int ep, int rank) {
  if (ep <= 0 || rank < 0 || rank >= ep)
    throw dist_error(errc::invalid_argument, "expert parallelism: rank " + std::to_string(rank) + " of ep = " + std::to_string(ep));
  const auto e = static_cast<std::size_t>(ep);
  if (experts == 0 || experts % e != 0)
    throw dist_error(errc::config, "ep = " + std::to_string(ep) + " does not divide the " + std::to_string(experts) + " experts");
  const std::size_t per = experts / e;
  return {static_cast<std::size_t>(rank) * per, per};
}

template <device Dev, nn::compute_type T>
class ep_moe {
 public:
  ep_moe() = default;
  // router: (E, d), whole; local: this rank's E/ep experts in order, each {w1 (I, d), w3 (I, d),
  // w2 (d, I)} (Hugging Face's layout); ep: the expert-parallel group.
  ep_moe(nn::parameter<Dev>* router, std::vector<std::array<nn::parameter<Dev>*, 3>> local, std::size_t hidden, std::size_t inter,
         std::size_t experts, std::size_t top_k, communicator& ep, ep_moe_options o = {})
      : d_(hidden), E_(experts), k_(top_k), ep_(&ep), opt_(o), routing_(experts, top_k) {
    const auto [first, count] = local_experts(experts, ep.size(), ep.rank());
    (void)first;
    if (local.size() != count)
      throw dist_error(errc::config, "ep_moe: rank " + std::to_string(ep.rank()) + " is given " + std::to_string(local.size()) +
                                         " experts, but ep = " + std::to_string(ep.size()) + " over " + std::to_string(experts) + " experts is " +
                                         std::to_string(count) + " per rank");
    if (o.fp8_dispatch && (hidden == 0 || hidden % 128 != 0))
      throw dist_error(errc::config, "ep_moe: FP8 dispatch needs the hidden size to be a multiple of 128, not " + std::to_string(hidden));
    router_ = nn::linear<Dev, T>(router, nullptr, d_, E_);
    bank_ = nn::expert_bank<Dev, T>(std::move(local), hidden, inter);
    bank_.set_fp8(o.fp8_experts);
  }
  std::size_t experts() const { return E_; }
  // FP8 mode of this rank's experts (nn::sparse_moe::set_experts_fp8); the router keeps the compute type.
  void set_experts_fp8(bool on) {
    bank_.set_fp8(on);
    opt_.fp8_experts = on;
  }
  bool experts_fp8() const { return bank_.fp8(); }
  // This rank's experts (e.g. for their FP8 amax).
  const nn::expert_bank<Dev, T>& bank() const { return bank_; }
  std::size_t top_k() const { return k_; }
  communicator& ep() const { return *ep_; }

  // y (n, d) f32 = the block applied to this rank's tokens x (n, d). Collective over ep.
  void forward(Dev& dev, nn::cview<T> x, nn::mview<float> y, bool train) {
    const std::size_t n = x.rows();
    if (x.cols() != d_ || y.rows() != n || y.cols() != d_ || x.col_stride() != 1 || y.col_stride() != 1)
      throw dist_error(errc::invalid_argument, "ep_moe: shapes do not match the block");
    n_ = n;
    tessel::dist::detail::ensure(dev, logits_, tessel::detail::mul_checked(n, E_, "ep_moe: logits"));
    router_.forward(dev, x, nn::rows_view<float>(logits_, n, E_), train);
    routing_.route(logits_.data(), n);
    const auto& expert = routing_.slot_expert();
    idx_.resize(n * k_);
    for (std::size_t i = 0; i < idx_.size(); ++i) idx_[i] = static_cast<std::int64_t>(expert[i]);
    const std::span<const float> w(routing_.slot_weight());
    std::vector<T> rows(n * d_);
    for (std::size_t t = 0; t < n; ++t) std::copy(x.data() + t * x.row_stride(), x.data() + t * x.row_stride() + d_, rows.data() + t * d_);
    const int E = static_cast<int>(E_);
    if (opt_.fp8_dispatch) {
      std::vector<bf16> b(rows.size());
      for (std::size_t i = 0; i < b.size(); ++i) b[i] = bf16(static_cast<float>(rows[i]));
      std::vector<e4m3> q(b.size());
      std::vector<float> sc(b.size() / 128);
      moe_quantize_fp8(b, d_, q, sc);
      auto r = moe_dispatch_fp8(*ep_, q, sc, d_, idx_, w, k_, E);
      handle_ = std::move(r.handle);
      xe_.resize(r.x.size());
      for (std::size_t i = 0; i < xe_.size(); ++i) xe_[i] = T(static_cast<float>(r.x[i]) * r.scales[i / 128]);
    } else {
      auto r = moe_dispatch_rows<T>(*ep_, rows, d_, idx_, w, k_, E);
      handle_ = std::move(r.handle);
      xe_ = std::move(r.x);
    }
    const auto& per = handle_.tokens_per_expert;
    off_.assign(per.size() + 1, 0);
    for (std::size_t j = 0; j < per.size(); ++j) off_[j + 1] = off_[j] + per[j];
    oe_.resize(handle_.rows() * d_);
    bank_.forward(dev, xe_.data(), off_, oe_.data(), train);
    slots_ = moe_return_rows<float>(*ep_, oe_, handle_);
    const auto& wt = routing_.slot_weight();
    for (std::size_t t = 0; t < n; ++t) {  // combine in top-k rank order, as on one device
      float* out = y.data() + t * y.row_stride();
      std::fill(out, out + d_, 0.0f);
      for (std::size_t r = 0; r < k_; ++r) {
        const float wr = wt[t * k_ + r];
        const float* src = slots_.data() + (t * k_ + r) * d_;
        for (std::size_t i = 0; i < d_; ++i) out[i] += wr * src[i];
      }
    }
  }

  // Per expert (all E): this rank's row counts and probability sums of the last forward.
  const std::vector<std::size_t>& expert_counts() const { return routing_.expert_counts(); }
  const std::vector<double>& prob_sums() const { return routing_.prob_sums(); }
  std::span<const float> router_logits() const { return {logits_.data(), n_ * E_}; }
  // Rows this rank's experts ran in the last forward, and its dispatch's payload bytes to others.
  std::size_t expert_rows() const { return handle_.rows(); }
  std::size_t dispatch_wire_bytes() const { return moe_dispatch_wire_bytes(handle_, ep_->rank()); }

  // dx (n, d) f32 (written) from dy (n, d) f32; gradients accumulate: the local experts' from every
  // rank's tokens, the router's from this rank's. dprob as nn::sparse_moe::backward. Collective.
  void backward(Dev& dev, nn::cview<float> dy, nn::mview<float> dx, std::span<const double> dprob) {
    const std::size_t n = n_;
    if (dy.rows() != n || dx.rows() != n) throw dist_error(errc::invalid_argument, "ep_moe: backward without a matching forward");
    if (dy.cols() != d_ || dx.cols() != d_ || dy.col_stride() != 1 || dx.col_stride() != 1)
      throw dist_error(errc::invalid_argument, "ep_moe: gradients must be row-major (tokens, hidden)");
    if (!dprob.empty() && dprob.size() != E_) throw dist_error(errc::invalid_argument, "ep_moe: one probability gradient per expert");
    std::vector<double> dw(n * k_);
    std::vector<T> dslots(n * k_ * d_);
    const auto& wt = routing_.slot_weight();
    for (std::size_t t = 0; t < n; ++t)
      for (std::size_t r = 0; r < k_; ++r) {
        const std::size_t s = t * k_ + r;
        dw[s] = nn::sparse_moe<Dev, T>::slot_gradient(dy.data() + t * dy.row_stride(), wt[s], slots_.data() + s * d_, dslots.data() + s * d_, d_);
      }
    const std::vector<T> dye = moe_send_rows<T>(*ep_, dslots, handle_);
    std::vector<float> dxe(handle_.rows() * d_);
    bank_.backward(dev, dye.data(), dxe.data());
    const std::vector<float> dxs = moe_return_rows<float>(*ep_, dxe, handle_);
    for (std::size_t t = 0; t < n; ++t) {  // add the experts' input gradients in top-k rank order
      float* out = dx.data() + t * dx.row_stride();
      std::fill(out, out + d_, 0.0f);
      for (std::size_t r = 0; r < k_; ++r) {
        const float* src = dxs.data() + (t * k_ + r) * d_;
        for (std::size_t i = 0; i < d_; ++i) out[i] += src[i];
      }
    }
    tessel::dist::detail::ensure(dev, dlogits_, n * E_);
    routing_.backward(std::span<const double>(dw), dprob, dlogits_.data());
    router_.backward(dev, nn::cview<T>(dlogits_.data(), n, E_, E_), dx, true);
  }

 private:
  std::size_t d_ = 0, E_ = 0, k_ = 0, n_ = 0;
  communicator* ep_ = nullptr;
  ep_moe_options opt_;
  nn::linear<Dev, T> router_;
  nn::moe_routing routing_;
  nn::expert_bank<Dev, T> bank_;
  moe_handle handle_;
  std::vector<std::int64_t> idx_;
  std::vector<std::size_t> off_;
  std::vector<T> xe_;              // the rows this rank's experts ran (the linears keep views)
  std::vector<float> oe_, slots_;  // their outputs; every slot's output back home
  device_buffer<float, Dev> logits_;
  device_buffer<T, Dev> dlogits_;
};

}  // namespace dist
}  // namespace v0
}  // namespace tessel
