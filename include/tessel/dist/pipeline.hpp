// Pipeline parallelism: a model's layers cut into stages over a pp group (tp_decoder_lm built with
// tp_decoder_options::pp), a batch cut into micro-batches, and the 1F1B schedule (Narayanan et al.
// 2021, PipeDream-Flush; Megatron-LM's non-interleaved schedule): stage s runs p − 1 − s forwards,
// then alternates one forward and one backward, then drains the backwards, so at most p − s
// micro-batches are in flight on stage s (p on the first stage).
//
// Activations are recomputed: a stage keeps only each in-flight micro-batch's input stream
// (rows × hidden f32; the first stage keeps nothing, it re-embeds the ids), and runs the forward
// again just before that micro-batch's backward. That costs one more forward per micro-batch (the
// last stage runs its forward only once, in the backward slot) and keeps the layers' single
// activation buffers; storing each micro-batch's activations instead is future work.
//
// Streams cross stages as f32 over point-to-point messages on the pp group: forward activations
// with tag 1, gradients with tag 2; a stage's "send this, receive that" pairs are one
// communicator::send_recv, so neighbours never wait on each other's sends.
//
// Micro-batch i's loss gradient is of its row losses' sum divided by the whole batch's counted
// rows (not by its own), so the accumulated gradient is the whole batch's mean's, every tensor's
// the head's included; one micro-batch keeps the mean's own 1/counted (decoder_lm's bits).
//
// Against one stage: every micro-batch runs the same operations on the same rows whatever the
// stage boundaries (the boundary's residual add is the f32 add the next norm would have fused), and
// each parameter's gradient accumulates the micro-batches in order; so the loss and every gradient
// are the same bits for every pp (tested). Against one device on the whole batch, micro-batching
// splits the token sums of the weight gradients (a rounding difference, as gradient accumulation).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <tessel/collectives/communicator.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/dist/tp_decoder.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

struct pipeline_options {
  std::size_t micro_batches = 1;  // the batch is cut into this many equal micro-batches (it must divide the batch)
};

// A stage's streams as the schedule moves them: what it receives into (slot) and what it sends
// (view). A timing-only run passes null data with the stream's element count.
struct stream_slot {
  float* data = nullptr;
  std::size_t count = 0;
};
struct stream_view {
  const float* data = nullptr;
  std::size_t count = 0;
};

// What one stage does in the 1F1B schedule: run micro-batch i's forward or backward, and name the
// buffers the schedule receives into and sends from (f32 streams).
struct one_f_one_b_hooks {
  std::function<void(std::size_t)> forward, backward;
  std::function<stream_slot(std::size_t)> input;  // micro-batch i's input (count 0 on the first stage)
  std::function<stream_view()> output;            // the last forward's output (count 0 on the last stage)
  std::function<stream_slot()> output_grad;       // the gradient of this stage's output (count 0 on the last stage)
  std::function<stream_view()> input_grad;        // the last backward's input gradient (count 0 on the first stage)
};

// The 1F1B schedule of stage s of p over mb micro-batches on the pp group: p − 1 − s warm-up
// forwards, then one forward and one backward alternately, then the remaining backwards. Streams
// cross stages over point-to-point messages (forward activations tag 1, gradients tag 2), and a
// stage's "send this, receive that" pairs with one neighbour are one send_recv, so neighbours never
// wait on each other's sends. dist::pipeline runs it with the model's stages; the timing-only step
// (dist/timing_step.hpp) runs it with kernels charged to an emulated card's clock.
inline void one_f_one_b(communicator* pp, int p, int s, std::size_t mb, const one_f_one_b_hooks& h) {
  const int prev = s > 0 ? s - 1 : -1, next = s + 1 < p ? s + 1 : -1;
  constexpr int tag_fwd = 1, tag_bwd = 2;
  auto send_to = [&](int peer, stream_view v, int tag) {
    if (peer >= 0) pp->send(v.data, v.count, dtype::f32, peer, tag);
  };
  auto recv_from = [&](int peer, stream_slot v, int tag) {
    if (peer >= 0) pp->recv(v.data, v.count, dtype::f32, peer, tag);
  };
  auto swap_with = [&](int peer, stream_view out, int send_tag, stream_slot in, int recv_tag) {
    if (peer >= 0) pp->send_recv(out.data, out.count, peer, send_tag, in.data, in.count, peer, recv_tag, dtype::f32);
  };
  const std::size_t warmup = std::min<std::size_t>(std::size_t(p - s - 1), mb), steady = mb - warmup;
  std::size_t fi = 0, bi = 0;
  for (std::size_t k = 0; k < warmup; ++k, ++fi) {
    recv_from(prev, h.input(fi), tag_fwd);
    h.forward(fi);
    send_to(next, h.output(), tag_fwd);
  }
  if (steady > 0) recv_from(prev, h.input(fi), tag_fwd);
  for (std::size_t k = 0; k < steady; ++k) {
    h.forward(fi++);
    // send this forward's output, receive the gradient of the oldest micro-batch in flight
    swap_with(next, h.output(), tag_fwd, h.output_grad(), tag_bwd);
    h.backward(bi++);
    if (k + 1 == steady)
      send_to(prev, h.input_grad(), tag_bwd);
    else
      swap_with(prev, h.input_grad(), tag_bwd, h.input(fi), tag_fwd);
  }
  for (std::size_t k = 0; k < warmup; ++k) {
    recv_from(next, h.output_grad(), tag_bwd);
    h.backward(bi++);
    send_to(prev, h.input_grad(), tag_bwd);
  }
}

template <class Model>
class pipeline {
 public:
  using device_type = typename Model::device_type;
  using compute_t = typename Model::compute_t;

  // `model` is this rank's stage (its options().pp is the pipeline group).
  explicit pipeline(Model& model, pipeline_options o = {}) : m_(&model), o_(o) {
    if (o_.micro_batches == 0) throw dist_error(errc::invalid_argument, "pipeline: micro_batches must be at least 1");
  }
  Model& model() { return *m_; }
  nn::parameters<device_type>& params() { return m_->params(); }
  int stages() const { return m_->pp() ? m_->pp()->size() : 1; }
  int stage() const { return m_->pp() ? m_->pp()->rank() : 0; }
  // The most micro-batch inputs this stage held at once in the last forward_backward (1F1B:
  // min(p − stage, micro_batches) on stages after the first; 0 on the first).
  std::size_t peak_in_flight() const { return peak_; }

  // The mean cross-entropy over the whole batch (every counted token weighted alike, as one device
  // computes it), the same on every stage, with its gradient accumulated into each stage's
  // parameters. ids and targets (batch × seq) must be the same on every stage.
  double forward_backward(std::span<const std::int64_t> ids, std::span<const std::int64_t> targets, std::size_t batch, std::size_t seq,
                          std::int64_t ignore_index = -100) {
    const std::size_t mb = o_.micro_batches;
    if (batch == 0 || seq == 0) throw dist_error(errc::invalid_argument, "pipeline: an empty batch");
    if (batch % mb != 0)
      throw dist_error(errc::invalid_argument,
                       "pipeline: " + std::to_string(mb) + " micro-batches do not divide the batch of " + std::to_string(batch));
    if (seq > SIZE_MAX / batch || ids.size() != batch * seq || targets.size() != ids.size())
      throw dist_error(errc::invalid_argument, "pipeline: " + std::to_string(ids.size()) + " ids and " + std::to_string(targets.size()) +
                                                   " targets for batch " + std::to_string(batch) + " x seq " + std::to_string(seq));
    const std::size_t b = batch / mb, tok = b * seq;
    const std::size_t elems = m_->stage_rows(b, seq) * m_->config().hidden_size;
    // each micro-batch's gradient is its mean's times its share of the counted tokens
    std::vector<double> counted(mb, 0.0);
    double total = 0.0;
    for (std::size_t i = 0; i < mb; ++i) {
      counted[i] = double(std::count_if(targets.begin() + std::ptrdiff_t(i * tok), targets.begin() + std::ptrdiff_t((i + 1) * tok),
                                        [&](std::int64_t t) { return t != ignore_index; }));
      total += counted[i];
    }
    auto ids_of = [&](std::size_t i) { return ids.subspan(i * tok, tok); };
    auto targets_of = [&](std::size_t i) { return targets.subspan(i * tok, tok); };

    communicator* pp = m_->pp();
    const int p = stages(), s = stage();
    const int prev = s > 0 ? s - 1 : -1, next = s + 1 < p ? s + 1 : -1;
    inputs_.assign(mb, {});
    dout_.resize(next >= 0 ? elems : 0);
    peak_ = 0;
    double loss_sum = 0.0;  // the last stage's Σ counted·loss
    auto held = [&] {
      std::size_t h = 0;
      for (const auto& v : inputs_) h += !v.empty();
      peak_ = std::max(peak_, h);
    };
    auto fwd = [&](std::size_t i) {
      if (next < 0) return;  // the last stage runs its forward in the backward slot
      m_->stage_forward(ids_of(i), b, seq, inputs_[i], false);
    };
    auto bwd = [&](std::size_t i) {
      m_->stage_forward(ids_of(i), b, seq, inputs_[i], true);  // recomputed
      // d(Σ rows' losses / total): micro-batch i's rows scaled by 1/total, not 1/counted_i
      const float scale = mb == 1 ? std::numeric_limits<float>::quiet_NaN() : total > 0.0 ? float(1.0 / total) : 0.0f;
      const double l = m_->stage_backward(targets_of(i), ignore_index, dout_, scale);
      if (next < 0) loss_sum += l * counted[i];
      inputs_[i] = {};
    };
    auto input_buf = [&](std::size_t i) -> std::span<float> {
      if (prev < 0) return {};
      inputs_[i].resize(elems);
      return inputs_[i];
    };
    auto out = [&] { return next >= 0 ? m_->stage_output() : std::span<const float>{}; };
    auto in_grad = [&] { return prev >= 0 ? m_->stage_input_grad() : std::span<const float>{}; };

    one_f_one_b(pp, p, s, mb,
                one_f_one_b_hooks{
                    .forward =
                        [&](std::size_t i) {
                          held();
                          fwd(i);
                        },
                    .backward = bwd,
                    .input =
                        [&](std::size_t i) {
                          auto v = input_buf(i);
                          return stream_slot{v.data(), v.size()};
                        },
                    .output =
                        [&] {
                          auto v = out();
                          return stream_view{v.data(), v.size()};
                        },
                    .output_grad =
                        [&] {
                          return stream_slot{dout_.data(), next >= 0 ? dout_.size() : 0};
                        },
                    .input_grad =
                        [&] {
                          auto v = in_grad();
                          return stream_view{v.data(), v.size()};
                        },
                });
    // the loss lives on the last stage: to every stage
    double loss = next < 0 && total > 0.0 ? loss_sum / total : 0.0;
    if (pp && p > 1) pp->broadcast(std::span<double>(&loss, 1), p - 1);
    return loss;
  }

  step_result adamw(const nn::adamw_config& h, std::uint64_t step) { return m_->adamw(h, step); }
  // The stage model's loss scale and end of step (tp_decoder_lm::set_loss_scaler), for an optimizer
  // that steps the stage's parameters itself (data_parallel's ZeRO-1).
  float loss_scale() const { return m_->loss_scale(); }
  void note_step(const step_result& r) { m_->note_step(r); }
  // The stage's fp16 overflow records shared over its replicas (tp_decoder_lm::share_fp16_overflow).
  template <class Reduce>
  void share_fp16_overflow(Reduce&& reduce, bool tell) {
    m_->share_fp16_overflow(std::forward<Reduce>(reduce), tell);
  }

 private:
  Model* m_;
  pipeline_options o_;
  std::vector<std::vector<float>> inputs_;  // the in-flight micro-batches' input streams
  std::vector<float> dout_;                 // the next stage's gradient of this stage's output
  std::size_t peak_ = 0;
};

}  // namespace dist
}  // namespace v0
}  // namespace tessel
