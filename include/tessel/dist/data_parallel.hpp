// Plain data parallelism (ZeRO stage 0): one nn::decoder_lm replica per dp rank, each on its own
// device, each with its share of the batch. After the local forward and backward the gradients are
// averaged over the dp group in buckets (consecutive parameters in registration order, packed into
// one buffer up to bucket_bytes), every bucket reduced in dp-rank order, so every replica sees the
// same bits whatever the thread timing, runs the same AdamW step, and stays bitwise identical.
// Ranks with different numbers of counted tokens (targets that are not ignore_index) are weighted
// by their counts, so the averaged gradient is the gradient of the mean loss over the whole batch.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <tessel/collectives/communicator.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/nn/decoder.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

struct data_parallel_options {
  std::size_t bucket_bytes = std::size_t{4} << 20;  // f32 gradient bytes per all-reduce
};

template <device Dev, nn::compute_type T = float>
class data_parallel {
 public:
  data_parallel(nn::decoder_lm<Dev, T>& model, communicator& dp, data_parallel_options o = {}) : m_(&model), dp_(&dp), o_(o) {
    if (o_.bucket_bytes < sizeof(float)) throw dist_error(errc::invalid_argument, "data_parallel: bucket_bytes must hold one f32");
  }

  nn::decoder_lm<Dev, T>& model() { return *m_; }

  // Every replica's parameters <- rank `root`'s (so replicas start identical whatever each did).
  void broadcast_parameters(int root = 0) {
    for (auto& p : m_->params()) dp_->broadcast(p.value.span(), root);
    m_->params().refresh_bf16();
  }

  // Zeroes the gradients, runs this rank's forward and backward on its (batch, seq) share, and
  // averages the gradients over dp. Returns the mean loss over every rank's counted tokens.
  double forward_backward(std::span<const std::int64_t> ids, std::span<const std::int64_t> targets, std::size_t batch, std::size_t seq,
                          std::int64_t ignore_index = -100) {
    m_->params().zero_grad();
    const double local = m_->forward_backward(ids, targets, batch, seq, ignore_index);
    // Counted tokens per rank: each rank's gradient is of its own mean; weight it by its share.
    double cnt = double(std::count_if(targets.begin(), targets.end(), [&](std::int64_t t) { return t != ignore_index; }));
    std::vector<double> counts(std::size_t(dp_->size()));
    dp_->all_gather(std::span<const double>(&cnt, 1), std::span<double>(counts));
    double total = 0.0;
    for (double c : counts) total += c;
    const float w = total > 0.0 ? float(cnt * double(dp_->size()) / total) : 0.0f;
    bool equal = true;
    for (double c : counts) equal = equal && c == counts[0];
    if (!equal)
      for (auto& p : m_->params())
        for (float& g : p.grad.span()) g *= w;
    all_reduce_gradients();
    double sum = local * cnt;
    double global = 0.0;
    dp_->all_reduce(std::span<const double>(&sum, 1), std::span<double>(&global, 1), reduce_op::sum);
    return total > 0.0 ? global / total : 0.0;
  }

  // forward_backward, then one AdamW step (the same on every replica).
  double step(std::span<const std::int64_t> ids, std::span<const std::int64_t> targets, std::size_t batch, std::size_t seq, const nn::adamw_config& h,
              std::uint64_t step_no, std::int64_t ignore_index = -100) {
    const double loss = forward_backward(ids, targets, batch, seq, ignore_index);
    m_->adamw(h, step_no);
    return loss;
  }

  // The gradients averaged over dp, bucket by bucket in registration order.
  void all_reduce_gradients() {
    const std::size_t cap = o_.bucket_bytes / sizeof(float);
    std::vector<nn::parameter<Dev>*> members;
    std::size_t fill = 0;
    auto flush = [&] {
      if (members.empty()) return;
      if (members.size() == 1) {
        dp_->all_reduce(members[0]->grad.span(), reduce_op::avg);
      } else {
        if (bucket_.size() < fill) bucket_ = std::vector<float>(fill);
        std::size_t at = 0;
        for (auto* p : members) at = std::copy_n(p->grad.data(), p->numel, bucket_.begin() + std::ptrdiff_t(at)) - bucket_.begin();
        dp_->all_reduce(std::span<float>(bucket_.data(), fill), reduce_op::avg);
        at = 0;
        for (auto* p : members) {
          std::copy_n(bucket_.begin() + std::ptrdiff_t(at), p->numel, p->grad.data());
          at += p->numel;
        }
      }
      members.clear();
      fill = 0;
    };
    for (auto& p : m_->params()) {
      if (fill > 0 && fill + p.numel > cap) flush();
      members.push_back(&p);
      fill += p.numel;
    }
    flush();
  }

 private:
  nn::decoder_lm<Dev, T>* m_;
  communicator* dp_;
  data_parallel_options o_;
  std::vector<float> bucket_;  // host staging of a bucket (device memory is host-addressable here)
};

}  // namespace dist
}  // namespace v0
}  // namespace tessel
