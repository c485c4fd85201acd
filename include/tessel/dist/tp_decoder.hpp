// A Llama-style decoder trained with tensor parallelism (Megatron-LM's layout): Llama, Mistral and
// Qwen2 configs (pre-norm RMSNorm, rotary positions, grouped-query attention, SwiGLU; dense MLPs).
// Each tp rank holds
//   the embedding and the LM head by vocabulary rows (vocab_parallel_embedding / _lm_head: the
//   logits are never gathered; V need not be divisible by tp),
//   in every block tp_attention (heads split; kv heads split or replicated) and tp_swiglu_mlp
//   (intermediate features split),
//   the norms' weights whole: their inputs are the same bits on every rank (each block's output is
//   all-reduced), so their gradients are too, with no communication.
// The residual stream is f32, replicated, as in nn::decoder_lm. Per block: 2 all-reduces forward
// (o_proj, down_proj) and 2 backward (dx of q/k/v, of gate/up), plus 1 for replicated kv heads'
// weight gradients; the embedding and the loss add 1 and 2 (3 with the gradient).
//
// Against nn::decoder_lm on one device: with tp = 1 every operation is the same one on the same
// shapes, so the loss, the gradients and the AdamW step are the same bits (tested); with tp > 1 the
// sums over the split dimensions are grouped by rank, the only difference (each layer's bound is
// tested in tensor_parallel.cpp and vocab_parallel.cpp).
//
// Sequence parallelism (tp_decoder_options::sequence_parallel, Megatron-LM's): the residual stream
// between the layers is split by tokens, each rank holding N/tp of the N = batch·seq rows (tp must
// divide N). The norms run on those rows only and their outputs are all-gathered (in the compute
// type) as the layers' inputs; each layer's output sum is a reduce-scatter onto the rows instead
// of an all-reduce. Backward mirrors it: the stream's gradient rows are all-gathered, the layers'
// dx reduce-scattered. The same bytes cross the wire as without it (an all-reduce is a
// reduce-scatter and an all-gather), but the f32 stream, the norms and the residual adds cost 1/tp
// per rank. Every element is the same f32 sum in rank order, so the loss and every gradient are
// the same bits as without it, but for the norms' weights: their gradients are sums over rows,
// taken per rank and then all-reduced (grouped differently: equal to rounding).
//
// Mixture-of-experts configs (Mixtral): each block's MLP is a dist::ep_moe whose experts are split
// over tp_decoder_options::ep (the expert-parallel group: dp replicas, each with its own tokens;
// process_groups::ep()), all on this rank without it. The MoE block is not split over tp: each tp
// rank runs it on all the rows (its router and experts are replicated over tp and counted once in
// the norm). Not built yet: MoE with sequence parallelism, and the aux loss over pp > 1 stages.
//
// Parameters are named as in Hugging Face checkpoints and load sliced from a whole-model file
// (load()), so a one-device checkpoint trains on any tp. init() draws each rank's shards from the
// same seed per name, which is a valid initialisation but not the one-device one: to match a
// one-device run, save that model and load it.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include <tessel/collectives/communicator.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/collectives/transport/threads.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/dist/expert_parallel.hpp>
#include <tessel/dist/grad_check.hpp>
#include <tessel/dist/tensor_parallel.hpp>
#include <tessel/dist/vocab_parallel.hpp>
#include <tessel/io/model_config.hpp>
#include <tessel/nn/decoder.hpp>
#include <tessel/nn/layers.hpp>
#include <tessel/nn/parameters.hpp>
#include <tessel/ops/optim.hpp>
#include <tessel/types/convert.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

struct tp_decoder_options {
  bool sequence_parallel = false;  // split the residual stream by tokens over tp (see above)
  // Pipeline parallelism: this rank is stage pp->rank() of pp->size() and holds only its layers
  // (the first stage the embedding too, the last the final norm and the LM head); dist::pipeline
  // runs the schedule. nullptr: one stage, the whole model.
  communicator* pp = nullptr;
  // Layers per stage, in stage order (they must add up to num_hidden_layers, none 0); empty: as
  // even as possible, the first stages taking one more.
  std::vector<std::size_t> stage_layers = {};
  // Mixture-of-experts models: the expert-parallel group (nullptr: every expert on this rank) and
  // the MoE blocks' options (FP8 dispatch, FP8 experts).
  communicator* ep = nullptr;
  ep_moe_options moe = {};
};

// The layers [first, second) of stage `stage` of `stages` for `layers` layers (see stage_layers).
inline std::pair<std::size_t, std::size_t> stage_range(std::size_t layers, std::size_t stages, std::size_t stage,
                                                       const std::vector<std::size_t>& per_stage = {}) {
  if (stages == 0 || stage >= stages) throw dist_error(errc::invalid_argument, "stage " + std::to_string(stage) + " of " + std::to_string(stages));
  if (per_stage.empty()) {
    if (stages > layers)
      throw dist_error(errc::config, "pp = " + std::to_string(stages) + " stages for " + std::to_string(layers) + " layers: every stage needs one");
    const std::size_t q = layers / stages, e = layers % stages;
    const std::size_t first = stage * q + std::min(stage, e);
    return {first, first + q + (stage < e ? 1 : 0)};
  }
  if (per_stage.size() != stages)
    throw dist_error(errc::config, std::to_string(per_stage.size()) + " stage sizes for pp = " + std::to_string(stages) + " stages");
  std::size_t total = 0, first = 0;
  for (std::size_t i = 0; i < stages; ++i) {
    if (per_stage[i] == 0) throw dist_error(errc::config, "stage " + std::to_string(i) + " is given 0 layers: every stage needs one");
    if (i == stage) first = total;
    total += per_stage[i];
  }
  if (total != layers)
    throw dist_error(errc::config, "the stage sizes add up to " + std::to_string(total) + " layers, the model has " + std::to_string(layers));
  return {first, first + per_stage[stage]};
}

template <device Dev, nn::compute_type T = float>
class tp_decoder_lm {
  static constexpr bool bf16_compute = std::is_same_v<T, bf16>;

 public:
  using device_type = Dev;
  using compute_t = T;

  // A model with zero parameters shaped by `cfg`, this rank's shards of it (load() or init() fills them).
  tp_decoder_lm(Dev& dev, io::model_config cfg, communicator& tp, tp_decoder_options o = {})
      : dev_(&dev), cfg_(std::move(cfg)), tp_(&tp), opt_(o), params_(dev) {
    build();
  }
  tp_decoder_lm(tp_decoder_lm&&) = delete;  // modules hold pointers into the registry

  const io::model_config& config() const { return cfg_; }
  nn::parameters<Dev>& params() { return params_; }
  communicator& tp() const { return *tp_; }
  const tp_decoder_options& options() const { return opt_; }
  // Pipeline stage: this rank's layers [first, second); whether it holds the embedding (first
  // stage) and the head (last stage).
  std::pair<std::size_t, std::size_t> layers() const { return {layer0_, layer0_ + blocks_.size()}; }
  bool first_stage() const { return !opt_.pp || opt_.pp->rank() == 0; }
  bool last_stage() const { return !opt_.pp || opt_.pp->rank() == opt_.pp->size() - 1; }
  communicator* pp() const { return opt_.pp; }
  // Mixture-of-experts models: the expert-parallel group (a group of one without tp_decoder_options::ep;
  // nullptr for dense models),
  // whether p is one of this rank's experts (held by no other rank of the ep group), and the
  // load-balancing loss of the last forward over this stage's layers (HF's, without its coefficient).
  communicator* ep() const { return opt_.ep ? opt_.ep : solo_.get(); }
  bool is_expert(const nn::parameter<Dev>& p) const { return experts_.count(&p) != 0; }
  double last_aux_loss() const { return aux_; }

  // FP8 mode (nn::linear::set_fp8, DeepSeek-V3's block-scaled recipe) for every projection of this
  // rank's blocks: attention's q, k, v and o shards, the dense MLP's gate, up and down shards, and a
  // mixture of experts' local experts (ep_moe::set_experts_fp8); the embedding, the head and the
  // router keep the compute type, as in nn::decoder_lm::set_fp8_linears. Each shard quantises its
  // own operands in 128-blocks: on tp = 1 that is one device's FP8 model bit for bit; on more
  // ranks a shard that does not start on a multiple of 128 (features of q, k, v, gate, up; the
  // reduction of o and down) has blocks and scales of its own, so the results agree with one
  // device's FP8 model to FP8's rounding, not bitwise.
  void set_fp8_linears(bool on) {
    for_each_projection([&](nn::linear<Dev, T>& l) { l.set_fp8(on); });
    if (cfg_.is_moe())
      for (block& b : blocks_) b.moe.set_experts_fp8(on);
  }
  // The FP8 projections' amax over this rank's layers (nn::decoder_lm::fp8_amax_max): of the last
  // step and since set_fp8_linears(true).
  nn::fp8_amax fp8_amax_max() const {
    nn::fp8_amax m;
    const auto add = [&](const nn::linear<Dev, T>& l) {
      if (l.fp8()) m.include(l.amax());
    };
    for_each_projection(add);
    if (cfg_.is_moe())
      for (const block& b : blocks_) b.moe.bank().for_each_linear(add);
    return m;
  }
  // fp16 mode for this rank's shards of attention's q, k, v, o and the dense MLP's projections, with
  // the policy that moves a projection back to the compute type (nn::decoder_lm::set_fp16_linears,
  // nn::fp16_policy). Each step the shards of a projection share their overflow record over the
  // tp group (the amax of each operand, the largest over the ranks), so every rank moves the same
  // projections at the same step, and rank 0 of the group logs it. Train with a loss scaler.
  void set_fp16_linears(bool on, nn::fp16_policy policy = {}) {
    std::size_t n = 0;
    for_each_projection([&](const nn::linear<Dev, T>&) { ++n; });
    nn::fp16_strikes strikes = on ? nn::fp16_strikes(std::move(policy), n) : nn::fp16_strikes();
    if (on && !ws16_) ws16_ = std::make_shared<nn::fp16_workspace<Dev>>();
    for_each_projection([&](nn::linear<Dev, T>& l) { l.set_precision(on ? nn::linear_precision::fp16 : nn::linear_precision::compute, ws16_); });
    strikes16_ = std::move(strikes);
  }
  // How many of this rank's projections run in fp16 now (the same on every rank of the group).
  std::size_t fp16_linears() const {
    std::size_t n = 0;
    for_each_projection([&](const nn::linear<Dev, T>& l) { n += l.precision() == nn::linear_precision::fp16; });
    return n;
  }
  // Dynamic loss scaling, as nn::decoder_lm::set_loss_scaler: forward_backward (and the last
  // stage's stage_backward) multiply the loss's gradient by the scale, adamw() divides it out of the
  // step and the clipping norm, skips a step whose gradients are not finite on any rank, and feeds
  // the outcome to the scaler. Set the same scaler on every rank (all tp ranks and pipeline stages):
  // they see the same outcomes, so their scales stay equal. nullopt: no scaling.
  void set_loss_scaler(std::optional<loss_scaler> s) { scaler_ = std::move(s); }
  const std::optional<loss_scaler>& scaler() const noexcept { return scaler_; }
  float loss_scale() const noexcept { return scaler_ ? scaler_->scale() : 1.0f; }

  // Whether p counts in the global gradient norm on this rank: a weight other ranks hold the same
  // copy of (the norms, replicated kv heads, row-parallel biases) counts on the first of them only.
  bool counted_in_norm(const nn::parameter<Dev>& p) const { return !replicated_.count(&p) || tp_->rank() == 0; }

  // This rank's shards of a whole-model safetensors file (or a sharded index's directory).
  void load(const std::filesystem::path& path, const nn::load_options& o = {}) {
    nn::load_options lo = o;
    if (cfg_.tie_word_embeddings) lo.ignore_names.push_back("lm_head.weight");
    lo.ignore_names.insert(lo.ignore_names.end(), others_experts_.begin(), others_experts_.end());
    params_.load(path, lo);
  }
  void init(std::uint64_t seed, double std = 0.02) { params_.init_normal(seed, std); }

  // Mean cross-entropy of targets (see nn::decoder_lm::forward_backward), the same on every tp
  // rank, and its gradient accumulated into this rank's parameters. ids and targets must be the
  // same on every rank. grad_scale: the gradient is of the row losses' sum times it (NaN: 1 / the
  // counted rows, the mean's; data_parallel passes the whole batch's).
  double forward_backward(std::span<const std::int64_t> ids, std::span<const std::int64_t> targets, std::size_t batch, std::size_t seq,
                          std::int64_t ignore_index = -100, float grad_scale = std::numeric_limits<float>::quiet_NaN()) {
    check_targets(ids, targets, "forward_backward");
    whole_model("forward_backward");
    run_forward(ids, batch, seq, true);
    const std::size_t n = n_, d = cfg_.hidden_size;
    ensure(dy_, rows_ * d);
    if (sp()) stash_norm_grads();
    grad_scale = scaled(grad_scale, targets, ignore_index);
    scale_aux();
    const auto r = head_.loss(*dev_, nn::crows_view<T>(yf_, n, d), targets, nn::rows_view<float>(dy_, rows_, d), ignore_index, grad_scale);
    run_backward();
    if (sp()) sum_norm_grads();
    return r.loss;
  }
  // Mean loss without gradients (evaluation).
  double loss(std::span<const std::int64_t> ids, std::span<const std::int64_t> targets, std::size_t batch, std::size_t seq,
              std::int64_t ignore_index = -100) {
    check_targets(ids, targets, "loss");
    whole_model("loss");
    run_forward(ids, batch, seq, false);
    return head_.loss(*dev_, nn::crows_view<T>(yf_, n_, cfg_.hidden_size), targets, nn::mview<float>{}, ignore_index).loss;
  }

  // ---- one pipeline stage (dist::pipeline drives these; ids and targets are the micro-batch's,
  // the same on every rank of the replica)
  // The rows of the stream a stage takes and gives for (batch, seq): batch·seq, or this rank's
  // share of them under sequence parallelism.
  std::size_t stage_rows(std::size_t batch, std::size_t seq) const {
    const std::size_t n = batch * seq;
    return sp() ? n / std::size_t(tp_->size()) : n;
  }
  // The forward of this stage's layers: the first stage from the token ids, later ones from `in`
  // (stage_rows × hidden f32: the previous stage's output). A stage before the last leaves its
  // output stream in stage_output().
  void stage_forward(std::span<const std::int64_t> ids, std::size_t batch, std::size_t seq, std::span<const float> in, bool train) {
    run_forward(ids, batch, seq, train, in);
    if (last_stage()) return;
    const std::size_t m = rows_ * cfg_.hidden_size;
    ensure(out_, m);
    const float* a = blocks_.back().s_mid.data();
    const float* b = tmp_.data();
    for (std::size_t i = 0; i < m; ++i) out_.data()[i] = a[i] + b[i];  // the residual add the next stage's first norm would fuse
  }
  std::span<const float> stage_output() const { return {out_.data(), rows_ * cfg_.hidden_size}; }
  // The backward of the last stage_forward (run with train = true): the last stage from the loss of
  // `targets` (returns the micro-batch's mean loss; the gradient is of the row losses' sum times
  // grad_scale, NaN: 1 / the counted rows, the mean's), the others from `dout` (the next stage's
  // stage_input_grad). Gradients accumulate into the parameters.
  double stage_backward(std::span<const std::int64_t> targets, std::int64_t ignore_index, std::span<const float> dout,
                        float grad_scale = std::numeric_limits<float>::quiet_NaN()) {
    const std::size_t d = cfg_.hidden_size, m = rows_ * d;
    ensure(dy_, m);
    ensure(dS_, m);
    if (sp()) stash_norm_grads();
    scale_aux();
    double loss = 0.0;
    if (last_stage()) {
      if (targets.size() != n_)
        throw dist_error(errc::invalid_argument,
                         "tp_decoder_lm::stage_backward: " + std::to_string(targets.size()) + " targets for " + std::to_string(n_) + " tokens");
      loss = head_
                 .loss(*dev_, nn::crows_view<T>(yf_, n_, d), targets, nn::rows_view<float>(dy_, rows_, d), ignore_index,
                       scaled(grad_scale, targets, ignore_index))
                 .loss;
    } else {
      if (dout.size() != m)
        throw dist_error(errc::invalid_argument, "tp_decoder_lm::stage_backward: the output gradient holds " + std::to_string(dout.size()) +
                                                     " values, needs " + std::to_string(m));
      std::copy(dout.begin(), dout.end(), dS_.data());
    }
    run_backward(!last_stage());
    if (sp()) sum_norm_grads();
    return loss;
  }
  // d loss / d (this stage's input stream) after stage_backward, for the previous stage.
  std::span<const float> stage_input_grad() const { return {dS_.data(), rows_ * cfg_.hidden_size}; }

  // One AdamW step over this rank's parameters, as nn::decoder_lm::adamw. The finiteness check and
  // the global gradient norm (max_grad_norm > 0) are taken over the whole model: every rank's
  // shards (and every pipeline stage's), the replicated weights counted once; so every rank skips
  // or clips alike. grad_norm in the result is that global norm (-1 when not computed).
  step_result adamw(const nn::adamw_config& h, std::uint64_t step) {
    grad_check gc(h.max_grad_norm), ge(h.max_grad_norm);
    const bool split = ep() && ep()->size() > 1;  // each ep rank holds other experts: their sums first
    for (auto& p : params_) (split && is_expert(p) ? ge : gc).add(p.grad.cspan(), counted_in_norm(p));
    if (split) {
      ge.reduce(*ep());
      gc.merge(ge);
    }
    gc.reduce(*tp_);
    if (opt_.pp) gc.reduce(*opt_.pp);
    step_result res;
    if (gc.found_inf()) {
      res.found_inf = res.skipped = true;
      note_step(res);
      return res;
    }
    const float ls = loss_scale();
    step_options so;
    so.storage = bf16_compute ? param_storage::bf16_master : param_storage::f32;
    so.check_finite = false;              // checked above, over every rank
    so.loss_scale = gc.clip_divisor(ls);  // the loss scale, and PyTorch's clip_grad_norm_, as the step's gradient divisor
    res = nn::adamw_update(*dev_, params_, h.hyper, step, so, h.lazy_rows);
    res.grad_norm = gc.norm(ls);
    note_step(res);
    return res;
  }
  // The end of an optimizer step (adamw() calls it; so does data_parallel's ZeRO-1 step), on every
  // rank: the loss scaler takes the outcome; the fp16 projections' overflow records of the step,
  // the largest over the tp group, count a strike or clear it (nn::fp16_policy); records cleared.
  void note_step(const step_result& r) {
    const float scale = loss_scale();
    if (scaler_) scaler_->update(r);
    if (!strikes16_.active()) return;
    strikes16_.share([&](auto&& f) { for_each_projection(f); }, [&](std::span<float> amax) { tp_->all_reduce(amax, reduce_op::max); });
    std::size_t i = 0;
    for_each_projection([&](nn::linear<Dev, T>& l) {
      const std::size_t k = i++;
      if (l.precision() != nn::linear_precision::fp16) return;
      const nn::fp16_overflow o = l.overflow();
      l.clear_overflow();
      strikes16_.note(l, k, o, scale, tp_->rank() == 0);
    });
  }
  // Data parallelism's part of the fp16 policy, as nn::decoder_lm::share_fp16_overflow (over the
  // replicas; note_step then shares over the tp group, so a record is the largest over both).
  template <class Reduce>
  void share_fp16_overflow(Reduce&& reduce, bool tell) {
    strikes16_.share([&](auto&& f) { for_each_projection(f); }, reduce);
    strikes16_.tell(tell);
  }

 private:
  // f(linear) for each projection of the blocks (q, k, v, o; the dense MLP's gate, up, down).
  template <class F>
  void for_each_projection(F&& f) {
    for (block& b : blocks_) {
      for (nn::linear<Dev, T>* l : {&b.attn.q().local(), &b.attn.k().local(), &b.attn.v().local(), &b.attn.o().local()}) f(*l);
      if (!cfg_.is_moe())
        for (nn::linear<Dev, T>* l : {&b.mlp.gate().local(), &b.mlp.up().local(), &b.mlp.down().local()}) f(*l);
    }
  }
  template <class F>
  void for_each_projection(F&& f) const {
    for (const block& b : blocks_) {
      for (const nn::linear<Dev, T>* l : {&b.attn.q().local(), &b.attn.k().local(), &b.attn.v().local(), &b.attn.o().local()}) f(*l);
      if (!cfg_.is_moe())
        for (const nn::linear<Dev, T>* l : {&b.mlp.gate().local(), &b.mlp.up().local(), &b.mlp.down().local()}) f(*l);
    }
  }
  struct block {
    nn::norm<Dev, T> ln1, ln2;
    tp_attention<Dev, T> attn;
    tp_swiglu_mlp<Dev, T> mlp;
    ep_moe<Dev, T> moe;                     // mixture-of-experts models: instead of mlp
    device_buffer<float, Dev> s_in, s_mid;  // the residual stream entering the block and after attention
    device_buffer<T, Dev> y1, y2;           // the norms' outputs (the layers' inputs)
  };

  void build() {
    const auto& c = cfg_;
    if (c.hidden_size == 0 || c.num_hidden_layers == 0 || c.vocab_size == 0 || c.num_attention_heads == 0 || c.head_dim == 0 ||
        c.intermediate_size == 0)
      throw dist_error(errc::invalid_argument, "tp_decoder_lm: the config has a zero dimension");
    if (c.naming == io::param_naming::gpt2 || c.norm != io::norm_kind::rms_norm || c.positions != io::position_kind::rotary ||
        c.act != io::activation::silu)
      throw dist_error(errc::unsupported, "tp_decoder_lm: Llama-style configs only (RMSNorm, rotary positions, SwiGLU or SwiGLU experts); a '" +
                                              std::string(io::model_type_name(c.family)) + "' config is not one (GPT-2 is not tensor-parallel yet)");
    if (!c.is_moe() && opt_.ep && opt_.ep->size() > 1)
      throw dist_error(errc::config, "tp_decoder_lm: ep = " + std::to_string(opt_.ep->size()) + " for a model without experts");
    if (c.is_moe() && opt_.sequence_parallel)
      throw dist_error(errc::unsupported, "tp_decoder_lm: sequence parallelism with mixture-of-experts blocks is not built yet");
    if (c.is_moe() && opt_.pp && opt_.pp->size() > 1 && c.router_aux_loss_coef > 0.0)
      throw dist_error(errc::unsupported, "tp_decoder_lm: the load-balancing loss over pp = " + std::to_string(opt_.pp->size()) +
                                              " stages (it spans every layer's routing) is not built yet; set router_aux_loss_coef to 0");
    if (c.is_moe() && !opt_.ep) solo_ = std::make_unique<communicator>(threads_world(1).transport(0));
    const std::size_t d = c.hidden_size;
    const float eps = float(c.norm_eps);
    auto norm_of = [&](const std::string& name) {
      nn::parameter<Dev>* w = &params_.add(name + ".weight", {d}, bf16_compute);
      replicated_.insert(w);
      norm_weights_.push_back(w);
      return nn::norm<Dev, T>(w, nullptr, true, eps);
    };
    const std::size_t stages = opt_.pp ? std::size_t(opt_.pp->size()) : 1, stage = opt_.pp ? std::size_t(opt_.pp->rank()) : 0;
    const auto [first, last] = stage_range(c.num_hidden_layers, stages, stage, opt_.stage_layers);
    if (stages > 1 && c.tie_word_embeddings)
      throw dist_error(errc::unsupported, "tp_decoder_lm: tied embeddings over pp = " + std::to_string(stages) +
                                              " stages (the first stage's table and the last stage's head) are not built yet");
    layer0_ = first;
    if (first_stage()) embed_ = vocab_parallel_embedding<Dev>(params_, "model.embed_tokens.weight", c.vocab_size, d, *tp_, bf16_compute);
    const std::vector<double> freq = nn::rope_frequencies(c);
    rope_options ro;
    ro.theta = c.rope_theta;
    ro.inv_freq = freq;  // tp_attention keeps its own copy
    blocks_ = std::vector<block>(last - first);
    for (std::size_t l = first; l < last; ++l) {
      block& b = blocks_[l - first];
      const std::string p = "model.layers." + std::to_string(l) + ".";
      b.ln1 = norm_of(p + "input_layernorm");
      std::optional<std::size_t> window = c.sliding_window;
      if (window && c.family == io::model_family::qwen2 && l < c.max_window_layers) window.reset();
      typename tp_attention<Dev, T>::config ac{.hidden = d,
                                               .heads_q = c.num_attention_heads,
                                               .heads_kv = c.num_key_value_heads,
                                               .head_dim = c.head_dim,
                                               .qkv_bias = c.qkv_bias,
                                               .o_bias = c.o_bias,
                                               .window = window,
                                               .rope = ro};
      b.attn = tp_attention<Dev, T>(params_, p + "self_attn", ac, *tp_);
      if (b.attn.kv_replicas() > 1) replicate_kv(b.attn);
      if (c.o_bias) replicated_.insert(&params_.at(p + "self_attn.o_proj.bias"));
      b.ln2 = norm_of(p + "post_attention_layernorm");
      if (c.is_moe()) {
        build_moe(b, p + "block_sparse_moe.");
        continue;
      }
      b.mlp = tp_swiglu_mlp<Dev, T>(params_, p + "mlp", d, c.intermediate_size, c.mlp_bias, *tp_);
      if (c.mlp_bias) replicated_.insert(&params_.at(p + "mlp.down_proj.bias"));
    }
    if (last_stage()) {
      final_norm_ = norm_of("model.norm");
      head_ = c.tie_word_embeddings ? vocab_parallel_lm_head<Dev, T>(embed_)
                                    : vocab_parallel_lm_head<Dev, T>(params_, "lm_head.weight", c.vocab_size, d, *tp_);
    }
    // one set of transient reduction buffers for every layer (they run one at a time)
    embed_.share_workspace(ws_);
    head_.share_workspace(ws_);
    for (auto& b : blocks_) {
      b.attn.share_workspace(ws_);
      b.attn.share_rope_table(blocks_.front().attn);  // one rotary table for the stage's layers
      if (!c.is_moe()) b.mlp.share_workspace(ws_);
    }
  }
  // A Mixtral block: the router whole, this rank's experts (Hugging Face's names), the others' names
  // left for load() to skip; all replicated over tp.
  void build_moe(block& b, const std::string& m) {
    const auto& c = cfg_;
    const std::size_t d = c.hidden_size, I = c.intermediate_size, E = c.num_local_experts;
    communicator& g = *ep();
    const auto [first, count] = local_experts(E, g.size(), g.rank());
    nn::parameter<Dev>* router = &params_.add(m + "gate.weight", {E, d}, bf16_compute);
    std::vector<std::array<nn::parameter<Dev>*, 3>> ex;
    for (std::size_t j = 0; j < E; ++j) {
      const std::string e = m + "experts." + std::to_string(j) + ".";
      if (j < first || j >= first + count) {
        for (const char* w : {"w1", "w3", "w2"}) others_experts_.push_back(e + w + ".weight");
        continue;
      }
      ex.push_back({&params_.add(e + "w1.weight", {I, d}, bf16_compute), &params_.add(e + "w3.weight", {I, d}, bf16_compute),
                    &params_.add(e + "w2.weight", {d, I}, bf16_compute)});
      for (auto* p : ex.back()) experts_.insert(p);
    }
    if (tp_->size() > 1) {
      replicated_.insert(router);
      for (auto& e : ex)
        for (auto* p : e) replicated_.insert(p);
    }
    b.moe = ep_moe<Dev, T>(router, std::move(ex), d, I, E, c.num_experts_per_tok, g, opt_.moe);
  }
  // kv heads held by several ranks: counted in the global norm by the first of them only
  void replicate_kv(tp_attention<Dev, T>& a) {
    if (std::size_t(tp_->rank()) % a.kv_replicas() == 0) return;
    for (auto* lin : {&a.k().local(), &a.v().local()}) {
      replicated_.insert(lin->weight());
      if (lin->bias()) replicated_.insert(lin->bias());
    }
  }

  template <class E>
  void ensure(device_buffer<E, Dev>& b, std::size_t n) {
    detail::ensure(*dev_, b, n);
  }
  bool sp() const { return opt_.sequence_parallel; }
  // All N rows (all-gathered from each rank's N/tp under sequence parallelism) of a (rows_, d) tensor.
  template <class E>
  nn::cview<E> gathered(nn::cview<E> local, device_buffer<E, Dev>& full) {
    if (!sp()) return local;
    const std::size_t d = cfg_.hidden_size;
    ensure(full, n_ * d);
    tp_->all_gather(std::span<const E>(local.data(), rows_ * d), std::span<E>(full.data(), n_ * d));
    return nn::crows_view<E>(full, n_, d);
  }
  // The norms' weight gradients under sequence parallelism: each rank's backward adds its rows'
  // part; the parts are all-reduced (in rank order) and added to what the weights held before.
  void stash_norm_grads() {
    const std::size_t d = cfg_.hidden_size, total = norm_weights_.size() * d;
    ensure(norm_saved_, total);
    for (std::size_t i = 0; i < norm_weights_.size(); ++i) {
      std::copy_n(norm_weights_[i]->grad.data(), d, norm_saved_.data() + i * d);
      std::fill_n(norm_weights_[i]->grad.data(), d, 0.0f);
    }
  }
  void sum_norm_grads() {
    const std::size_t d = cfg_.hidden_size, total = norm_weights_.size() * d;
    ensure(norm_sum_, total);
    for (std::size_t i = 0; i < norm_weights_.size(); ++i) std::copy_n(norm_weights_[i]->grad.data(), d, norm_sum_.data() + i * d);
    tp_->all_reduce(std::span<float>(norm_sum_.data(), total), reduce_op::sum);
    for (std::size_t i = 0; i < norm_weights_.size(); ++i) {
      float* g = norm_weights_[i]->grad.data();
      for (std::size_t c = 0; c < d; ++c) g[c] = norm_saved_.data()[i * d + c] + norm_sum_.data()[i * d + c];
    }
  }
  // The loss gradient's multiplier with the loss scale: grad_scale (NaN: 1 / the counted rows, as
  // the head takes it) times loss_scale().
  // The MoE load-balancing gradient of the last forward times the loss scale (before its backward).
  void scale_aux() {
    if (scaler_)
      for (double& g : aux_dprob_) g *= double(loss_scale());
  }
  float scaled(float grad_scale, std::span<const std::int64_t> targets, std::int64_t ignore_index) const {
    if (!scaler_) return grad_scale;
    const float ls = loss_scale();
    if (!std::isnan(grad_scale)) return grad_scale * ls;
    const std::size_t counted = std::size_t(std::count_if(targets.begin(), targets.end(), [&](std::int64_t t) { return t != ignore_index; }));
    return counted ? ls / float(counted) : 0.0f;
  }
  void check_targets(std::span<const std::int64_t> ids, std::span<const std::int64_t> targets, const char* who) const {
    if (targets.size() != ids.size())
      throw dist_error(errc::invalid_argument, std::string("tp_decoder_lm::") + who + ": " + std::to_string(targets.size()) + " targets for " +
                                                   std::to_string(ids.size()) + " tokens");
  }

  // The gradient arriving on the f32 stream as the compute type (the layers' dy).
  nn::cview<T> as_compute(const device_buffer<float, Dev>& g, std::size_t rows, std::size_t cols) {
    if constexpr (bf16_compute) {
      ensure(gT_, rows * cols);
      convert(*dev_, std::span<const float>(g.data(), rows * cols), std::span<bf16>(gT_.data(), rows * cols));
      return nn::crows_view<T>(gT_, rows, cols);
    } else {
      return nn::crows_view<float>(g, rows, cols);
    }
  }

  void whole_model(const char* who) const {
    if (opt_.pp && opt_.pp->size() > 1)
      throw dist_error(errc::invalid_argument, std::string("tp_decoder_lm::") + who + ": this model is one of " + std::to_string(opt_.pp->size()) +
                                                   " pipeline stages; dist::pipeline runs it");
  }
  // `in`: a later stage's input stream (rows x hidden).
  void run_forward(std::span<const std::int64_t> ids, std::size_t batch, std::size_t seq, bool train, std::span<const float> in = {}) {
    if (batch == 0 || seq == 0) throw dist_error(errc::invalid_argument, "tp_decoder_lm: an empty batch");
    if (seq > SIZE_MAX / batch) throw dist_error(errc::overflow, "tp_decoder_lm: batch·seq overflows");
    const std::size_t n = batch * seq, d = cfg_.hidden_size;
    if (ids.size() != n)
      throw dist_error(errc::invalid_argument, "tp_decoder_lm: " + std::to_string(ids.size()) + " token ids for batch " + std::to_string(batch) +
                                                   " x seq " + std::to_string(seq));
    if (sp() && n % std::size_t(tp_->size()) != 0)
      throw dist_error(errc::invalid_argument, "tp_decoder_lm: sequence parallelism splits the batch·seq = " + std::to_string(n) +
                                                   " tokens over tp = " + std::to_string(tp_->size()) + ", which must divide them");
    n_ = n;
    const std::size_t m = sp() ? n / std::size_t(tp_->size()) : n;  // the stream's rows on this rank
    if (!first_stage() && in.size() != m * d)
      throw dist_error(errc::invalid_argument, "tp_decoder_lm::stage_forward: the stage input holds " + std::to_string(in.size()) +
                                                   " values, needs " + std::to_string(m) + " rows x hidden " + std::to_string(d));
    rows_ = m;
    ids_.assign(ids.begin(), ids.end());
    positions_.resize(n);
    for (std::size_t t = 0; t < n; ++t) positions_[t] = std::int64_t(t % seq);
    for (auto& b : blocks_) {
      ensure(b.s_in, m * d);
      ensure(b.s_mid, m * d);
      ensure(b.y1, n * d);
      ensure(b.y2, n * d);
    }
    ensure(tmp_, m * d);
    ensure(s_final_, m * d);
    ensure(yf_, n * d);
    if (sp()) ensure(yl_, m * d);
    Dev& dev = *dev_;
    // a norm's output: straight into the layer's input, or this rank's rows, then all-gathered into it
    auto norm_out = [&](device_buffer<T, Dev>& full) { return nn::rows_view<T>(sp() ? yl_ : full, m, d); };
    auto gather_into = [&](device_buffer<T, Dev>& full) {
      if (sp()) tp_->all_gather(std::span<const T>(yl_.data(), m * d), std::span<T>(full.data(), n * d));
    };
    if (first_stage())
      embed_.forward(dev, std::span<const std::int64_t>(ids_), nn::rows_view<float>(blocks_[0].s_in, m, d));
    else
      std::copy(in.begin(), in.end(), blocks_[0].s_in.data());
    for (std::size_t l = 0; l < blocks_.size(); ++l) {
      block& b = blocks_[l];
      // the block's input stream is s_in (layer 0: the embeddings; later: the previous block's
      // s_mid + MLP output, added by this norm and written to s_in)
      if (l == 0)
        b.ln1.forward(dev, nn::crows_view<float>(b.s_in, m, d), nn::cview<float>{}, nn::mview<float>{}, norm_out(b.y1), train);
      else
        b.ln1.forward(dev, nn::crows_view<float>(tmp_, m, d), nn::crows_view<float>(blocks_[l - 1].s_mid, m, d), nn::rows_view<float>(b.s_in, m, d),
                      norm_out(b.y1), train);
      gather_into(b.y1);
      b.attn.forward(dev, batch, seq, nn::crows_view<T>(b.y1, n, d), std::span<const std::int64_t>(positions_), nn::rows_view<float>(tmp_, m, d),
                     train);
      b.ln2.forward(dev, nn::crows_view<float>(tmp_, m, d), nn::crows_view<float>(b.s_in, m, d), nn::rows_view<float>(b.s_mid, m, d), norm_out(b.y2),
                    train);
      gather_into(b.y2);
      if (cfg_.is_moe())
        b.moe.forward(dev, nn::crows_view<T>(b.y2, n, d), nn::rows_view<float>(tmp_, m, d), train);
      else
        b.mlp.forward(dev, nn::crows_view<T>(b.y2, n, d), nn::rows_view<float>(tmp_, m, d), train);
    }
    if (cfg_.is_moe()) aux_from_routing();
    if (!last_stage()) return;
    final_norm_.forward(dev, nn::crows_view<float>(tmp_, m, d), nn::crows_view<float>(blocks_.back().s_mid, m, d),
                        nn::rows_view<float>(s_final_, m, d), norm_out(yf_), train);
    gather_into(yf_);
  }

  // The load-balancing loss over this stage's MoE layers and its gradient per expert probability
  // (nn::load_balancing_loss, as nn::decoder_lm).
  void aux_from_routing() {
    const std::size_t E = cfg_.num_local_experts;
    std::vector<double> cnt(E, 0.0), ps(E, 0.0);
    for (const block& b : blocks_)
      for (std::size_t e = 0; e < E; ++e) {
        cnt[e] += double(b.moe.expert_counts()[e]);
        ps[e] += b.moe.prob_sums()[e];
      }
    aux_ = nn::load_balancing_loss(cnt, ps, double(n_ * blocks_.size()), cfg_.router_aux_loss_coef, aux_dprob_);
  }

  // dy_ holds d loss / d yf (the head's dx): this rank's rows_ of it.
  // has_dS: dS_ already holds the gradient of the stream leaving the last block (a stage before the
  // last); otherwise dy_ holds the head's dx.
  void run_backward(bool has_dS = false) {
    const std::size_t m = rows_, d = cfg_.hidden_size;
    Dev& dev = *dev_;
    ensure(dS_, m * d);
    ensure(dS2_, m * d);
    if (!has_dS) final_norm_.backward(dev, nn::crows_view<float>(dy_, m, d), nn::cview<float>{}, nn::rows_view<float>(dS_, m, d));
    for (std::size_t li = blocks_.size(); li-- > 0;) {
      block& b = blocks_[li];
      // the MLP's output was added to s_mid: it receives dS
      if (cfg_.is_moe())
        b.moe.backward(dev, nn::crows_view<float>(dS_, m, d), nn::rows_view<float>(dy_, m, d), std::span<const double>(aux_dprob_));
      else
        b.mlp.backward(dev, gathered(as_compute(dS_, m, d), gfull_), nn::rows_view<float>(dy_, m, d), false);
      b.ln2.backward(dev, nn::crows_view<float>(dy_, m, d), nn::crows_view<float>(dS_, m, d), nn::rows_view<float>(dS2_, m, d));
      // the attention's output was added to s_in: it receives dS2
      b.attn.backward(dev, gathered(as_compute(dS2_, m, d), gfull_), nn::rows_view<float>(dy_, m, d), false);
      b.ln1.backward(dev, nn::crows_view<float>(dy_, m, d), nn::crows_view<float>(dS2_, m, d), nn::rows_view<float>(dS_, m, d));
    }
    if (first_stage()) embed_.backward(dev, std::span<const std::int64_t>(ids_), gathered(nn::crows_view<float>(dS_, m, d), sfull_));
  }

  Dev* dev_;
  io::model_config cfg_;
  communicator* tp_;
  tp_decoder_options opt_;
  nn::parameters<Dev> params_;
  detail::tp_workspace<Dev> ws_;                              // before the layers that point at it
  std::unordered_set<const nn::parameter<Dev>*> replicated_;  // held whole (or as the same kv rows) by more than this rank
  std::vector<nn::parameter<Dev>*> norm_weights_;
  std::unique_ptr<communicator> solo_;                     // MoE without an ep group: a group of one
  std::unordered_set<const nn::parameter<Dev>*> experts_;  // this rank's experts' weights
  std::vector<std::string> others_experts_;                // the names of the ep group's other experts
  double aux_ = 0.0;
  std::vector<double> aux_dprob_;
  std::shared_ptr<nn::fp16_workspace<Dev>> ws16_;
  nn::fp16_strikes strikes16_;  // per projection, for_each_projection's order
  std::optional<loss_scaler> scaler_;
  vocab_parallel_embedding<Dev> embed_;
  std::vector<block> blocks_;
  nn::norm<Dev, T> final_norm_;
  vocab_parallel_lm_head<Dev, T> head_;
  std::vector<std::int64_t> ids_, positions_;
  std::size_t layer0_ = 0;        // this stage's first layer
  std::size_t n_ = 0, rows_ = 0;  // tokens of the last forward; the stream's rows on this rank (n_/tp under sequence parallelism)
  device_buffer<float, Dev> tmp_, s_final_, dy_, dS_, dS2_, sfull_, norm_saved_, norm_sum_, out_;
  device_buffer<T, Dev> yf_, gT_, yl_, gfull_;
};

}  // namespace dist
}  // namespace v0
}  // namespace tessel
