// The global gradient check of a sharded optimizer step: whether any gradient anywhere is
// non-finite, and the global L2 norm with PyTorch's clip_grad_norm_ coefficient, taken over every
// rank's part of the gradients with one all-reduce, so every rank skips or clips alike.
// tp_decoder_lm::adamw (tp shards, replicated weights counted once) and data_parallel's ZeRO-1
// step (dp shards of the flat gradient) both use it.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>

#include <tessel/collectives/communicator.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

class grad_check {
 public:
  explicit grad_check(float max_grad_norm) : max_norm_(max_grad_norm) {}
  bool wants_norm() const { return max_norm_ > 0.0f; }

  // Gradients this rank holds: every one is checked for finiteness; those `counted` (not a copy
  // another rank counts) add their squares to the norm.
  void add(std::span<const float> g, bool counted = true) {
    const bool sq = counted && wants_norm();
    for (const float x : g) {
      if (!std::isfinite(x))
        acc_[1] = 1.0;
      else if (sq)
        acc_[0] += double(x) * double(x);
    }
  }

  // Sums every rank's part over `group` (all of them must call it).
  void reduce(communicator& group) { group.all_reduce(std::span<double>(acc_, 2), reduce_op::sum); }
  // Adds another check's sums (e.g. the expert weights', reduced over the expert-parallel group
  // first) into this one, before this one's reduce.
  void merge(const grad_check& o) {
    acc_[0] += o.acc_[0];
    acc_[1] += o.acc_[1];
  }
  bool found_inf() const { return acc_[1] > 0.0; }
  // The global norm of the gradients divided by the loss scale they carry (-1 when not asked for:
  // max_grad_norm <= 0).
  double norm(float loss_scale = 1.0f) const { return wants_norm() ? std::sqrt(acc_[0]) / double(loss_scale) : -1.0; }
  // What the step divides the gradients by (step_options::loss_scale): the loss scale times 1 / the
  // clip coefficient max_norm / (norm + 1e-6) of the unscaled gradients when that is below 1.
  float clip_divisor(float loss_scale = 1.0f) const {
    if (!wants_norm()) return loss_scale;
    const double coef = double(max_norm_) / (norm(loss_scale) + 1e-6);
    return coef < 1.0 ? float(double(loss_scale) / coef) : loss_scale;
  }

 private:
  float max_norm_;
  double acc_[2] = {0.0, 0.0};  // Σ g² over what this rank counts, non-finite gradients seen
};

}  // namespace dist
}  // namespace v0
}  // namespace tessel
