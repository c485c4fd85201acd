// A decoder-only language model built from a Hugging Face config (io::model_config): Llama, Mistral
// and Qwen2 (pre-norm RMSNorm, rotary, grouped-query attention, SwiGLU), Mixtral (the same with
// a sparse mixture of SwiGLU experts, nn/moe.hpp, and HF's load-balancing loss) and GPT-2 (LayerNorm,
// learned positions, fused q|k|v, GELU MLP, Conv1D weights), with a forward pass, the loss and a
// backward pass for every parameter, and an AdamW step over the registry. Parameters carry Hugging
// Face's names, so checkpoints load and save by name.
//
// Precision: T = float computes in f32; T = bf16 computes GEMMs and attention in bf16 with f32
// accumulation, keeps the residual stream, the norms, the logits, the loss and every parameter
// gradient in f32, and updates f32 masters (the bf16 copies are refreshed by the step). The
// blocks' projections may instead run their GEMMs in FP8 (set_fp8_linears) or fp16
// (set_fp16_linears: with a loss scaler, and a policy that moves a projection whose fp16 operands
// keep overflowing back to the compute type, logged).
//
// Activations: a training step's tensors (the saved activations, the forward's temporaries, the
// head's logits chunk, backward's gradients of activations and recomputed copies) live in one
// arena placed by the one liveness planner (device/memory_plan.hpp): each tensor holds its bytes
// only over the phases of the step that write or read it, so a tensor dead before another is born
// lends it its bytes. The plan is made per (batch, seq, recompute mode, head chunk, training or
// not) before the step runs; backward reads the forward's saved tensors (a module-level tape: the
// layers in reverse order).
//
// Incremental decoding (nn/kv_cache.hpp): prefill runs prompts of different lengths as one varlen
// batch through the flash kernel and writes every layer's post-RoPE K and V into a paged cache;
// decode_step runs one new token per sequence against the cache with the split-KV decode kernel.
// When every layer has a sliding window (Mistral), both give the pages of tokens outside the widest
// window back to the cache, so a sequence holds about window / page_size + 1 pages at any length.
// Both reuse the modules of forward(), so they invalidate a pending backward (as forward() does).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <numbers>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <tessel/device/device.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/device/memory_plan.hpp>
#include <tessel/io/model_config.hpp>
#include <tessel/io/safetensors.hpp>
#include <tessel/nn/errors.hpp>
#include <tessel/nn/kv_cache.hpp>
#include <tessel/nn/layers.hpp>
#include <tessel/nn/moe.hpp>
#include <tessel/nn/parameters.hpp>
#include <tessel/ops/activation.hpp>
#include <tessel/ops/embedding.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/loss.hpp>
#include <tessel/ops/optim.hpp>
#include <tessel/ops/quant.hpp>
#include <tessel/ops/rope.hpp>

namespace tessel {
inline namespace v0 {
namespace nn {

// Rotary frequencies of a config, with its rope_scaling applied (none, linear, llama3).
inline std::vector<double> rope_frequencies(const io::model_config& c) {
  const std::size_t half = c.head_dim / 2;
  std::vector<double> f(half);
  for (std::size_t j = 0; j < half; ++j) f[j] = std::pow(c.rope_theta, -2.0 * double(j) / double(c.head_dim));
  const auto& s = c.rope_scaling;
  switch (s.type) {
    case io::rope_scaling_type::none: break;
    case io::rope_scaling_type::linear:
      for (double& x : f) x /= s.factor;
      break;
    case io::rope_scaling_type::llama3: {
      // Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
      const double old_len = double(s.original_max_position_embeddings);
      const double low_wl = old_len / s.low_freq_factor, high_wl = old_len / s.high_freq_factor;
      for (double& x : f) {
        const double wl = 2.0 * std::numbers::pi / x;
        if (wl < high_wl) continue;
        if (wl > low_wl) {
          x /= s.factor;
          continue;
        }
        const double smooth = (old_len / wl - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        x = (1.0 - smooth) * x / s.factor + smooth * x;
      }
      break;
    }
    case io::rope_scaling_type::dynamic:
      throw nn_error(errc::unsupported, "rope_scaling 'dynamic' (NTK scaling by sequence length) is not supported");
  }
  return f;
}

struct adamw_config {
  adamw_params hyper{};
  float max_grad_norm = 0.0f;  // > 0: clip the global gradient norm first
  // Lazy rows (torch.optim.SparseAdam's, TF's LazyAdam): in a parameter with sparse_row > 0 (the
  // token embedding) a row whose gradient is all zero is left as it is, value and moments (no
  // weight decay, no moment decay), so a step changes only the rows its tokens used. Off: every
  // row steps, as torch.optim.AdamW.
  bool lazy_rows = false;
};

// fp16 projections with dynamic switching (decoder_lm::set_fp16_linears). After every optimizer
// step each fp16 projection either struck or did not; `patience` strikes in a row move it to the
// model's compute type (bf16 for bf16 models, f32 for f32 ones) for good, and `log` is told. A
// strike: the forward overflowed (x or W past fp16's range, which no loss scale changes), or the
// backward did (dy, which carries the loss scale) while the scale was already at most min_scale
// (the scaler has backed off as far as it usefully can). A backward overflow at a larger scale is
// the scaler's business: it skips the step and halves the scale.
struct fp16_policy {
  std::uint32_t patience = 3;
  float min_scale = 1.0f;
  std::function<void(const std::string&)> log;  // one line per switch (unset: std::clog)
};

// fp16_policy's bookkeeping for a model's projections (decoder_lm, dist::tp_decoder_lm): one
// strike count per projection, in the model's fixed order of them.
class fp16_strikes {
 public:
  fp16_strikes() = default;
  fp16_strikes(fp16_policy p, std::size_t projections) : policy_(std::move(p)), strikes_(projections, 0) {
    if (policy_.patience == 0) throw nn_error(errc::invalid_argument, "set_fp16_linears: patience must be at least 1");
  }
  bool active() const noexcept { return !strikes_.empty(); }
  // The step's overflow records of the projections that `for_each(f)` visits (f(linear&), the
  // model's fixed order of them), 3 floats each (the amax of x, w, dy), handed to `reduce`
  // (void(std::span<float>)), which replaces them in place by the largest over a group of peers
  // (a tensor-parallel model's shards, data parallelism's replicas), then written back: peers that
  // share their records strike and move the same projections at the same step. Nothing (and no
  // call to `reduce`) when fp16 projections are off.
  template <class ForEach, class Reduce>
  void share(ForEach&& for_each, Reduce&& reduce) const {
    if (!active()) return;
    std::vector<float> amax;
    amax.reserve(3 * strikes_.size());
    for_each([&](const auto& l) {
      const fp16_overflow& o = l.overflow();
      amax.insert(amax.end(), {o.x, o.w, o.dy});
    });
    reduce(std::span<float>(amax));
    std::size_t i = 0;
    for_each([&](auto& l) {
      l.set_overflow(fp16_overflow{amax[i], amax[i + 1], amax[i + 2]});
      i += 3;
    });
  }
  // Whether note() tells the policy's log (peers that decide alike let one of them tell).
  void tell(bool on) noexcept { tell_ = on; }
  // The step of projection i, in fp16 mode, whose passes saw `o` at loss scale `scale`: a strike or
  // a clean step; at `patience` strikes in a row it leaves fp16 for the compute type, told to the
  // policy's log when `log` (a tensor-parallel model's ranks decide alike and one of them tells).
  template <class Dev, class T>
  void note(linear<Dev, T>& l, std::size_t i, const fp16_overflow& o, float scale, bool log = true) {
    std::uint32_t& strikes = strikes_.at(i);
    strikes = o.forward() || (o.backward() && scale <= policy_.min_scale) ? strikes + 1 : 0;
    if (strikes < policy_.patience) return;
    l.set_precision(linear_precision::compute);
    if (!log || !tell_) return;
    const std::string line = "tessel::nn: " + l.weight()->name + " leaves fp16 for " + (std::is_same_v<T, bf16> ? "bf16" : "f32") + " after " +
                             std::to_string(strikes) + " steps in a row that overflowed (amax x " + std::to_string(o.x) + ", w " +
                             std::to_string(o.w) + ", dy " + std::to_string(o.dy) + ", loss scale " + std::to_string(scale) + ")";
    if (policy_.log)
      policy_.log(line);
    else
      std::clog << line << std::endl;
  }

 private:
  fp16_policy policy_;
  std::vector<std::uint32_t> strikes_;
  bool tell_ = true;
};

// One AdamW step over every parameter of a registry, in its order (the moments are created, zero,
// on first use): parameters with a bf16 copy update their f32 master and refresh the copy. The
// models' adamw() calls this; so does dist's tensor-parallel model, with its own global clipping.
// The optimizer's view of elements [off, off + cnt) of a parameter: its f32 value (or f32 master
// and bf16 copy), its gradient, and the moments `m`, `v` of those elements (the parameter's own,
// or a ZeRO shard's).
template <device Dev>
optim_tensor<float, float> optim_part(parameter<Dev>& p, std::size_t off, std::size_t cnt, std::span<float> m, std::span<float> v) {
  optim_tensor<float, float> t;
  if (!p.value_bf16.empty()) {
    t.param_bf16 = p.value_bf16.span().subspan(off, cnt);
    t.master = p.value.span().subspan(off, cnt);
  } else {
    t.param = p.value.span().subspan(off, cnt);
  }
  t.grad = p.grad.cspan().subspan(off, cnt);
  t.m = m, t.v = v;
  return t;
}

// lazy_rows: adamw_config::lazy_rows (each run of touched rows of a sparse_row parameter is a
// tensor of its own).
template <device Dev>
step_result adamw_update(Dev& dev, parameters<Dev>& params, const adamw_params& hyper, std::uint64_t step, const step_options& so,
                         bool lazy_rows = false) {
  std::vector<optim_tensor<float, float>> ts;
  ts.reserve(params.size());
  for (auto& p : params) {
    if (p.m.empty()) {
      p.m = device_buffer<float, Dev>::zeros(dev, p.numel);
      p.v = device_buffer<float, Dev>::zeros(dev, p.numel);
    }
    auto part = [&](std::size_t off, std::size_t cnt) {
      ts.push_back(optim_part(p, off, cnt, p.m.span().subspan(off, cnt), p.v.span().subspan(off, cnt)));
    };
    const std::size_t r = p.sparse_row;
    if (!lazy_rows || r == 0 || p.numel % r != 0) {
      part(0, p.numel);
      continue;
    }
    const float* g = p.grad.data();
    auto touched = [&](std::size_t row) { return std::any_of(g + row * r, g + (row + 1) * r, [](float x) { return x != 0.0f; }); };
    for (std::size_t row = 0, rows = p.numel / r; row < rows;) {
      if (!touched(row)) {
        ++row;
        continue;
      }
      std::size_t end = row + 1;
      while (end < rows && touched(end)) ++end;
      part(row * r, (end - row) * r);
      row = end;
    }
  }
  if (ts.empty()) return {};
  return adamw_step(dev, std::span<const optim_tensor<float, float>>(ts), hyper, step, so);
}

// What a training step recomputes in backward instead of keeping (decoder_lm::set_recompute).
enum class recompute : std::uint8_t { none, attention, blocks };

template <device Dev, compute_type T = float>
class decoder_lm {
  static constexpr bool bf16_compute = std::is_same_v<T, bf16>;

 public:
  using device_type = Dev;
  using compute_t = T;
  // A model with zero parameters shaped by `cfg` (load() or init() fills them).
  decoder_lm(Dev& dev, io::model_config cfg) : dev_(&dev), cfg_(std::move(cfg)), params_(dev) { build(); }
  decoder_lm(decoder_lm&&) = delete;  // modules hold pointers into the registry and each other

  // Config and weights from a Hugging Face model directory (config.json + model.safetensors or a
  // sharded index).
  static std::unique_ptr<decoder_lm> from_pretrained(Dev& dev, const std::filesystem::path& dir, const load_options& o = {}) {
    auto m = std::make_unique<decoder_lm>(dev, io::load_model_config(dir / "config.json"));
    m->load(dir, o);
    return m;
  }

  const io::model_config& config() const { return cfg_; }
  parameters<Dev>& params() { return params_; }
  const parameters<Dev>& params() const { return params_; }
  Dev& device() const { return *dev_; }

  void load(const std::filesystem::path& path, const load_options& o = {}) {
    load_options lo = o;
    if (cfg_.tie_word_embeddings) lo.ignore_names.push_back("lm_head.weight");
    params_.load(path, lo);
  }
  void init(std::uint64_t seed, double std = 0.02) { params_.init_normal(seed, std); }

  // Logits (batch·seq, vocab), f32, of `ids` (batch·seq token ids, row-major (batch, seq)). The
  // returned span stays valid until the next call.
  std::span<const float> forward(std::span<const std::int64_t> ids, std::size_t batch, std::size_t seq) {
    run_forward(ids, batch, seq, false);
    return {logits_.data(), n_ * cfg_.vocab_size};
  }

  // Mean cross-entropy of targets (batch·seq ids; targets[t] is the token expected after position
  // t, ignore_index rows count for nothing) and, accumulated into every parameter's grad, its
  // gradient. Returns the loss. Call params().zero_grad() between steps. Mixture-of-experts models:
  // the gradient also holds router_aux_loss_coef · d aux (when the config's coefficient is > 0), the
  // returned loss is the cross-entropy alone (the aux loss is last_aux_loss()).
  double forward_backward(std::span<const std::int64_t> ids, std::span<const std::int64_t> targets, std::size_t batch, std::size_t seq,
                          std::int64_t ignore_index = -100) {
    if (targets.size() != ids.size())
      throw nn_error(errc::invalid_argument,
                     "forward_backward: " + std::to_string(targets.size()) + " targets for " + std::to_string(ids.size()) + " tokens");
    const std::size_t V = cfg_.vocab_size;
    std::size_t counted = 0;  // the mean's denominator over every row, before any chunk runs
    for (std::size_t r = 0; r < targets.size(); ++r) {
      const std::int64_t t = targets[r];
      if (t == ignore_index) continue;
      if (t < 0 || std::uint64_t(t) >= V)
        throw nn_error(errc::out_of_range, "forward_backward: target " + std::to_string(t) + " of row " + std::to_string(r) + " is outside [0, " +
                                               std::to_string(V) + ")");
      ++counted;
    }
    run_forward(ids, batch, seq, true, false);
    // The LM head and the cross-entropy, head_chunk_rows rows at a time: logits, their gradient
    // and the head's backward for those rows (dW accumulates), so the (rows, vocab) logits never
    // exist whole. The loss is the mean over every row (the same row order and scale as one pass).
    const std::size_t n = n_, d = cfg_.hidden_size, R = head_rows(n);
    row_loss_.resize(n);
    cross_entropy_options co;
    co.ignore_index = ignore_index;
    co.grad_scale = counted ? loss_scale() / float(counted) : 0.0f;  // the mean over all rows, times the loss scale
    if (moe() && loss_scale() != 1.0f)
      for (double& g : aux_dprob_) g *= double(loss_scale());
    phase(ph_head());
    const slot<T> yf = tbuf(act::yf, 0);
    const slot<float> logits = fbuf(act::logits, 0), dy = fbuf(act::dy_head, 0);
    const slot<T> dlogits = tbuf(act::dlogits, 0);
    for (std::size_t r0 = 0; r0 < n; r0 += R) {
      const std::size_t rows = std::min(R, n - r0);
      head_.forward(*dev_, cview<T>(yf.data() + r0 * d, rows, d, d), mview<float>(logits.data(), rows, V, V), true);
      cross_entropy(*dev_, cview<float>(logits.data(), rows, V, V), targets.subspan(r0, rows), mview<T>(dlogits.data(), rows, V, V),
                    std::span<float>(row_loss_.data() + r0, rows), co);
      head_.backward(*dev_, cview<T>(dlogits.data(), rows, V, V), mview<float>(dy.data() + r0 * d, rows, d, d), false);
    }
    run_backward();
    double sum = 0.0;
    for (float l : row_loss_) sum += double(l);
    return counted ? sum / double(counted) : 0.0;
  }

  // Rows of the LM head and cross-entropy per pass in forward_backward (0: all at once). Chunks
  // bound the logits and their gradient to rows x vocab; the head weight's gradient then sums
  // over the chunks, and the head's GEMMs, with fewer rows, may round differently (within f32
  // bounds; the result does not depend on the thread count). Default 1024 (bench_model: 512 rows
  // cost the small Llama 12% of its step, 1024 about 2%).
  void set_head_chunk_rows(std::size_t rows) {
    if (rows != head_chunk_) release_arena();
    head_chunk_ = rows;
  }
  std::size_t head_chunk_rows() const noexcept { return head_chunk_; }

  // Mixture-of-experts models: the load-balancing loss of the last forward (HF's
  // load_balancing_loss_func, without its coefficient; 0 for dense models), and layer l's router
  // logits (batch·seq, experts).
  double last_aux_loss() const { return aux_; }
  std::span<const float> router_logits(std::size_t layer) const {
    if (!moe() || layer >= blocks_.size()) throw nn_error(errc::invalid_argument, "router_logits: no MoE layer " + std::to_string(layer));
    return blocks_[layer].moe.router_logits();
  }

  // A paged KV cache shaped for this model: `max_sequences` live sequences of up to `max_length`
  // tokens (0: the config's max_position_embeddings), sharing `num_pages` pages of `page_size` tokens.
  kv_cache<Dev, T> make_cache(std::size_t max_sequences, std::size_t num_pages, std::size_t page_size = 16, std::size_t max_length = 0) const {
    kv_cache_shape s;
    s.layers = cfg_.num_hidden_layers;
    s.heads_kv = cfg_.num_key_value_heads;
    s.head_dim = cfg_.head_dim;
    s.page_size = page_size;
    s.num_pages = num_pages;
    s.max_sequences = max_sequences;
    s.max_length = max_length ? max_length : cfg_.max_position_embeddings;
    return kv_cache<Dev, T>(*dev_, s);
  }
  // The tokens of a sequence its next query may read: the widest layer's sliding window when every
  // layer has one (prefill and decode_step give the older tokens' pages back to the cache), else
  // the maximum of std::size_t (every token stays).
  std::size_t kv_keep() const noexcept { return kv_keep_; }
  // The longest sequence `cache` can decode with this model: its max_length; when every layer has
  // a sliding window (kv_keep()) whose pages fit the cache's block-table ring (kv_cache::holds_window),
  // 2^31 - 1 (a sequence holds only its window's pages however long it grows); for learned
  // positions (GPT-2), at most max_position_embeddings.
  std::size_t max_length(const kv_cache<Dev, T>& cache) const {
    std::size_t n = cache.shape().max_length;
    if (kv_keep_ < n && cache.holds_window(kv_keep_)) n = std::size_t(std::numeric_limits<std::int32_t>::max());
    return pos_ ? std::min(n, cfg_.max_position_embeddings) : n;
  }

  // Runs the prompts of empty sequences seqs[i] of `cache` (distinct; prompt i is the next
  // lengths[i] > 0 ids of `tokens`) as one batch, writes every layer's K and V rows of them into
  // the cache, and returns the logits (batch, vocab) f32 of each prompt's last token (valid until
  // the next call). Positions count from 0. Nothing is written when an argument is wrong.
  std::span<const float> prefill(kv_cache<Dev, T>& cache, std::span<const std::size_t> seqs, std::span<const std::int64_t> tokens,
                                 std::span<const std::size_t> lengths) {
    check_cache(cache);
    const std::size_t B = seqs.size();
    if (B == 0 || lengths.size() != B)
      throw nn_error(errc::invalid_argument,
                     "prefill: " + std::to_string(B) + " sequences with " + std::to_string(lengths.size()) + " prompt lengths");
    cache.check_distinct(seqs, "prefill");
    std::size_t n = 0;
    for (std::size_t i = 0; i < B; ++i) {
      if (lengths[i] == 0) throw nn_error(errc::invalid_argument, "prefill: the prompt of sequence " + std::to_string(seqs[i]) + " is empty");
      if (cache.length(seqs[i]) != 0)
        throw nn_error(errc::invalid_argument, "prefill: sequence " + std::to_string(seqs[i]) + " already holds " +
                                                   std::to_string(cache.length(seqs[i])) +
                                                   " tokens (prefill starts a sequence; continue it with decode_step)");
      if (lengths[i] > max_length(cache))
        throw nn_error(errc::out_of_range, "prefill: a prompt of " + std::to_string(lengths[i]) + " tokens exceeds the " +
                                               std::to_string(max_length(cache)) + " positions this model and cache hold");
      n = detail::add_checked(n, lengths[i], "prefill tokens");
    }
    if (tokens.size() != n)
      throw nn_error(errc::invalid_argument,
                     "prefill: " + std::to_string(tokens.size()) + " token ids for prompts of " + std::to_string(n) + " in total");
    if (n > std::size_t(std::numeric_limits<std::int32_t>::max()))
      throw nn_error(errc::overflow, "prefill: " + std::to_string(n) + " tokens in one batch");
    check_ids(tokens);
    cache.reserve(seqs, lengths, kv_keep_);  // all pages or none; none for tokens outside every window
    cu_.assign(B + 1, 0);
    positions_inf_.resize(n);
    for (std::size_t i = 0; i < B; ++i) {
      cu_[i + 1] = cu_[i] + std::int32_t(lengths[i]);
      for (std::size_t t = 0; t < lengths[i]; ++t) positions_inf_[std::size_t(cu_[i]) + t] = std::int64_t(t);
    }
    last_rows_.resize(B);
    for (std::size_t i = 0; i < B; ++i) last_rows_[i] = std::size_t(cu_[i + 1]) - 1;
    const std::size_t kvd = cfg_.num_key_value_heads * cfg_.head_dim;
    const attention_varlen_shape vs{cu_, cu_, cfg_.num_attention_heads, cfg_.num_key_value_heads, cfg_.head_dim};
    run_inference(tokens, [&](std::size_t l, std::size_t rows, const T* q, const T* k, const T* v, T* o) {
      attention_forward_varlen(*dev_, vs, std::span<const T>(q, rows * cfg_.num_attention_heads * cfg_.head_dim), std::span<const T>(k, rows * kvd),
                               std::span<const T>(v, rows * kvd), std::span<T>(o, rows * cfg_.num_attention_heads * cfg_.head_dim),
                               std::span<float>{}, blocks_[l].attn.options());
      for (std::size_t i = 0; i < B; ++i) {
        const std::size_t f = cache.first_token(seqs[i]), at = std::size_t(cu_[i]) + f;
        cache.write(l, seqs[i], f, k + at * kvd, v + at * kvd, lengths[i] - f, kvd);
      }
    });
    for (std::size_t i = 0; i < B; ++i) cache.commit(seqs[i], lengths[i]);
    return {inf_.logits.data(), B * cfg_.vocab_size};
  }
  std::span<const float> prefill(kv_cache<Dev, T>& cache, std::size_t seq, std::span<const std::int64_t> prompt) {
    const std::size_t len = prompt.size();
    return prefill(cache, std::span<const std::size_t>(&seq, 1), prompt, std::span<const std::size_t>(&len, 1));
  }

  // One new token per sequence: tokens[i] is appended to seqs[i] (distinct, each already holding
  // at least one token; the batch may mix lengths) at position length(seqs[i]); its K and V rows
  // go into the cache, and its attention reads the cache (with the model's sliding window, if
  // any). Returns the logits (batch, vocab) f32 of the new tokens (valid until the next call).
  std::span<const float> decode_step(kv_cache<Dev, T>& cache, std::span<const std::size_t> seqs, std::span<const std::int64_t> tokens) {
    if (seqs.empty() || tokens.size() != seqs.size())
      throw nn_error(errc::invalid_argument,
                     "decode_step: " + std::to_string(seqs.size()) + " sequences with " + std::to_string(tokens.size()) + " tokens");
    ones_.assign(seqs.size(), 1);
    return append(cache, seqs, tokens, ones_, "decode_step");
  }
  // Several new tokens per sequence, in one pass: counts[i] >= 1 tokens, the next counts[i] ids of
  // `tokens`, are appended to seqs[i] (distinct, each already holding at least one token) — a
  // conversation's next turn after its cached history, or a run of draft tokens to verify. Their K
  // and V rows go into the cache; each attends to the cache and to the new tokens before it (with
  // the model's sliding window, if any). Returns the logits (batch, vocab) f32 of each sequence's
  // last new token (valid until the next call). Nothing is written when an argument is wrong. A
  // windowed sequence past the cache's max_length (see max_length(cache)) holds the window plus the
  // run: a run too long for its block table's ring is an out_of_range error of kv_cache::reserve.
  std::span<const float> extend(kv_cache<Dev, T>& cache, std::span<const std::size_t> seqs, std::span<const std::int64_t> tokens,
                                std::span<const std::size_t> counts) {
    if (seqs.empty() || counts.size() != seqs.size())
      throw nn_error(errc::invalid_argument,
                     "extend: " + std::to_string(seqs.size()) + " sequences with " + std::to_string(counts.size()) + " counts");
    return append(cache, seqs, tokens, counts, "extend");
  }
  std::span<const float> extend(kv_cache<Dev, T>& cache, std::size_t seq, std::span<const std::int64_t> tokens) {
    const std::size_t n = tokens.size();
    return extend(cache, std::span<const std::size_t>(&seq, 1), tokens, std::span<const std::size_t>(&n, 1));
  }

  // Mean loss without gradients (evaluation).
  double loss(std::span<const std::int64_t> ids, std::span<const std::int64_t> targets, std::size_t batch, std::size_t seq,
              std::int64_t ignore_index = -100) {
    if (targets.size() != ids.size())
      throw nn_error(errc::invalid_argument, "loss: " + std::to_string(targets.size()) + " targets for " + std::to_string(ids.size()) + " tokens");
    run_forward(ids, batch, seq, false);
    cross_entropy_options co;
    co.ignore_index = ignore_index;
    return cross_entropy(*dev_, crows_view<float>(logits_, n_, cfg_.vocab_size), targets, mview<float>{}, {}, co).loss;
  }

  // FP8 mode (linear::set_fp8, DeepSeek-V3's block-scaled recipe) for every projection of the
  // blocks: attention's q, k, v, o, the dense MLP's, and a mixture of experts' expert projections
  // (their grouped products take e4m3 operands with block scales). The embedding, the LM head and
  // the router keep the compute type, as in DeepSeek-V3's recipe (which keeps the embedding, head,
  // gating and norms in higher precision).
  void set_fp8_linears(bool on) {
    for_each_projection([&](linear<Dev, T>& l) { l.set_fp8(on); });
    if (moe())
      for (block& b : blocks_) b.moe.set_experts_fp8(on);
  }
  // fp16 mode (linear::set_precision) for attention's q, k, v, o and the dense MLP's projections,
  // sharing one workspace; off: back to the compute type. A mixture of experts' experts keep the
  // compute type (grouped products have no fp16 form), as do the embedding, the head and the
  // router. `policy` decides when a projection leaves fp16 (fp16_policy); its strike counts start
  // at zero. Train with a loss scaler (set_loss_scaler): fp16's smallest subnormal is 6e-8.
  void set_fp16_linears(bool on, fp16_policy policy = {}) {
    std::size_t n = 0;
    for_each_projection([&](const linear<Dev, T>&) { ++n; });
    fp16_strikes strikes = on ? fp16_strikes(std::move(policy), n) : fp16_strikes();
    if (on && !ws16_) ws16_ = std::make_shared<fp16_workspace<Dev>>();
    for_each_projection([&](linear<Dev, T>& l) { l.set_precision(on ? linear_precision::fp16 : linear_precision::compute, ws16_); });
    strikes16_ = std::move(strikes);
  }
  // How many projections run in fp16 now (set_fp16_linears less those the policy moved).
  std::size_t fp16_linears() const {
    std::size_t n = 0;
    for_each_projection([&](const linear<Dev, T>& l) { n += l.precision() == linear_precision::fp16; });
    return n;
  }
  // Dynamic loss scaling (ops' loss_scaler): forward_backward multiplies the loss's gradient by
  // the scale (every parameter gradient carries it), adamw() divides it out, skips a step whose
  // gradients are not finite, and feeds the outcome to the scaler. nullopt: no scaling.
  void set_loss_scaler(std::optional<loss_scaler> s) { scaler_ = std::move(s); }
  const std::optional<loss_scaler>& scaler() const noexcept { return scaler_; }
  float loss_scale() const noexcept { return scaler_ ? scaler_->scale() : 1.0f; }
  // The FP8 projections' amax over every layer, per operand: of the last step (x, w, dy) and since
  // set_fp8_linears(true) (x_max, w_max, dy_max).
  fp8_amax fp8_amax_max() const {
    fp8_amax m;
    const auto add = [&](const linear<Dev, T>& l) {
      if (l.fp8()) m.include(l.amax());
    };
    for_each_projection(add);
    if (moe())
      for (const block& b : blocks_) b.moe.bank().for_each_linear(add);
    return m;
  }

  // Activation recomputation for training steps (forward_backward): none keeps every block's
  // activations; attention keeps q, k, v and recomputes the attention core (its output and
  // log-sum-exp rows) in backward; blocks keeps each block's input stream alone and reruns the
  // block's forward in backward. Gradients are the same bits in every mode (the kernels are
  // deterministic); recomputed activations are planned like any other tensor (they live from the
  // block's recomputation to their last read). MoE experts keep their own buffers.
  // Set it between steps (not between a forward and its backward); the next step plans anew.
  void set_recompute(recompute r) {
    if (r == recompute_) return;
    recompute_ = r;
    release_arena();
  }
  recompute recompute_mode() const noexcept { return recompute_; }

  // Bytes of the activation arena the last training step planned (forward_backward): its saved
  // activations, the forward's temporaries, the head's logits chunk and their gradient, and
  // backward's gradients of activations, each over the phases it lives. 0 before the first step.
  std::size_t activation_bytes() const noexcept { return train_.plan.arena_bytes; }
  // What the same tensors take with one buffer per tensor (every occurrence of every tensor of the
  // step its own allocation: the baseline the planned arena is measured against).
  std::size_t activation_bytes_per_tensor() const noexcept { return train_.plan.unplanned_bytes; }
  // The last training step's plan (offsets, arena, its lower bound: the most bytes live in a phase).
  const memory_plan& activation_plan() const noexcept { return train_.plan; }

  // Checks of the activation arena. planned = false gives every tensor its own bytes (no reuse: the
  // reference layout); poison = true fills the arena's bytes no live tensor covers with NaN at the
  // start of every phase of a step (a tensor read outside its planned lifetime reads NaN). Both
  // leave the results' bits unchanged when the plan is right; poison costs a fill per phase.
  void set_activation_checks(bool planned, bool poison) {
    if (planned != planned_) release_arena();
    planned_ = planned;
    poison_ = poison;
  }

  // One AdamW step over every parameter (step counts from 1), as torch.optim.AdamW; bf16 models
  // update the f32 masters and refresh their bf16 copies in the same pass.
  // With a loss scaler the gradients are unscaled first and a step with a non-finite gradient
  // is skipped (step_result::skipped); then note_step() runs.
  step_result adamw(const adamw_config& h, std::uint64_t step) {
    step_options so;
    so.storage = bf16_compute ? param_storage::bf16_master : param_storage::f32;
    so.max_grad_norm = h.max_grad_norm;
    so.loss_scale = loss_scale();
    const step_result r = adamw_update(*dev_, params_, h.hyper, step, so, h.lazy_rows);
    note_step(r);
    return r;
  }
  // The end of an optimizer step (adamw() calls it; call it after an optimizer of your own, before
  // the next step's forward): the loss scaler takes the step's outcome, and every fp16 projection's
  // overflow record of the step (all its forward and backward passes since the last call) counts a
  // strike or clears its count (fp16_policy); records are cleared.
  void note_step(const step_result& r) {
    const float scale = loss_scale();
    if (scaler_) scaler_->update(r);
    if (!strikes16_.active()) return;  // fp16 projections are off
    std::size_t i = 0;
    for_each_projection([&](linear<Dev, T>& l) {
      const std::size_t k = i++;
      if (l.precision() != linear_precision::fp16) return;
      const fp16_overflow o = l.overflow();
      l.clear_overflow();
      strikes16_.note(l, k, o, scale);
    });
  }
  // Data parallelism's part of the fp16 policy (dist::data_parallel calls it before each optimizer
  // step, on every replica): the step's overflow records of the fp16 projections go through
  // `reduce` (void(std::span<float>): in place, the largest over the replicas; fp16_strikes::share),
  // so every replica strikes and moves the same projections at the same step, and only a replica
  // with `tell` logs it. Nothing without fp16 projections.
  template <class Reduce>
  void share_fp16_overflow(Reduce&& reduce, bool tell) {
    strikes16_.share([&](auto&& f) { for_each_projection(f); }, reduce);
    strikes16_.tell(tell);
  }

 private:
  struct block {
    norm<Dev, T> ln1, ln2;
    linear<Dev, T> q, k, v, o, up, gate, down;  // gate unused without a gated MLP
    self_attention<Dev, T> attn;
    sparse_moe<Dev, T> moe;  // Mixtral: instead of gate, up, down
  };

  // f(linear&) for each projection of the blocks with a weight (q, k, v, o, up, gate, down), in
  // that order per block: the fixed order strikes16_ follows.
  template <class F>
  void for_each_projection(F&& f) {
    for (block& b : blocks_)
      for (linear<Dev, T>* l : {&b.q, &b.k, &b.v, &b.o, &b.up, &b.gate, &b.down})
        if (l->weight()) f(*l);
  }
  template <class F>
  void for_each_projection(F&& f) const {
    for (const block& b : blocks_)
      for (const linear<Dev, T>* l : {&b.q, &b.k, &b.v, &b.o, &b.up, &b.gate, &b.down})
        if (l->weight()) f(*l);
  }
  bool gpt2() const { return cfg_.naming == io::param_naming::gpt2; }
  bool gated() const { return !gpt2(); }
  bool moe() const { return cfg_.is_moe(); }

  // bf16 models give every parameter a bf16 copy (only the GEMM weights read theirs) so one fused
  // optimizer launch with one storage mode updates the whole registry.
  parameter<Dev>* add(const std::string& name, std::vector<std::size_t> shape, bool /*matrix*/) {
    return &params_.add(name, std::move(shape), bf16_compute);
  }

  void build() {
    const auto& c = cfg_;
    if (c.hidden_size == 0 || c.num_hidden_layers == 0 || c.vocab_size == 0 || c.num_attention_heads == 0 || c.head_dim == 0)
      throw nn_error(errc::invalid_argument, "decoder_lm: the config has a zero dimension");
    if (c.num_attention_heads % c.num_key_value_heads != 0)
      throw nn_error(errc::invalid_argument, "decoder_lm: heads (" + std::to_string(c.num_attention_heads) + ") not a multiple of kv heads (" +
                                                 std::to_string(c.num_key_value_heads) + ")");
    if (gated() && c.act != io::activation::silu)
      throw nn_error(errc::unsupported, "decoder_lm: gated MLPs use silu (SwiGLU); got '" + c.hidden_act + "'");
    if (!gated() && c.act != io::activation::gelu_tanh && c.act != io::activation::gelu)
      throw nn_error(errc::unsupported, "decoder_lm: GPT-2 MLPs use gelu; got '" + c.hidden_act + "'");
    if (c.positions == io::position_kind::rotary) {
      rope_freq_ = rope_frequencies(c);
      rope_tab_ = rope_table(c.head_dim, rope_at({}));
    }
    const std::size_t d = c.hidden_size, I = c.intermediate_size, qd = c.num_attention_heads * c.head_dim, kvd = c.num_key_value_heads * c.head_dim;
    const bool ln = c.norm == io::norm_kind::layer_norm;
    const float eps = float(c.norm_eps);
    auto norm_params = [&](const std::string& n) {
      parameter<Dev>* w = add(n + ".weight", {d}, false);
      parameter<Dev>* b = ln ? add(n + ".bias", {d}, false) : nullptr;
      return norm<Dev, T>(w, b, !ln, eps);
    };
    blocks_.resize(c.num_hidden_layers);
    if (gpt2()) {
      if (qd != d || kvd != d) throw nn_error(errc::unsupported, "decoder_lm: GPT-2 needs heads * head_dim == hidden size");
      embed_ = add("transformer.wte.weight", {c.vocab_size, d}, true);
      embed_->sparse_row = d;
      pos_ = add("transformer.wpe.weight", {c.max_position_embeddings, d}, false);
      for (std::size_t l = 0; l < c.num_hidden_layers; ++l) {
        block& b = blocks_[l];
        const std::string p = "transformer.h." + std::to_string(l) + ".";
        b.ln1 = norm_params(p + "ln_1");
        parameter<Dev>* wa = add(p + "attn.c_attn.weight", {d, 3 * d}, true);
        parameter<Dev>* ba = add(p + "attn.c_attn.bias", {3 * d}, false);
        b.q = linear<Dev, T>(wa, ba, d, d, true, 0);
        b.k = linear<Dev, T>(wa, ba, d, d, true, d);
        b.v = linear<Dev, T>(wa, ba, d, d, true, 2 * d);
        b.o = linear<Dev, T>(add(p + "attn.c_proj.weight", {d, d}, true), add(p + "attn.c_proj.bias", {d}, false), d, d, true);
        b.ln2 = norm_params(p + "ln_2");
        b.up = linear<Dev, T>(add(p + "mlp.c_fc.weight", {d, I}, true), add(p + "mlp.c_fc.bias", {I}, false), d, I, true);
        b.down = linear<Dev, T>(add(p + "mlp.c_proj.weight", {I, d}, true), add(p + "mlp.c_proj.bias", {d}, false), I, d, true);
      }
      final_norm_ = norm_params("transformer.ln_f");
      head_ = linear<Dev, T>(embed_, nullptr, d, c.vocab_size);  // GPT-2 always ties
    } else {
      embed_ = add("model.embed_tokens.weight", {c.vocab_size, d}, true);
      embed_->sparse_row = d;
      for (std::size_t l = 0; l < c.num_hidden_layers; ++l) {
        block& b = blocks_[l];
        const std::string p = "model.layers." + std::to_string(l) + ".";
        b.ln1 = norm_params(p + "input_layernorm");
        auto proj = [&](const std::string& n, std::size_t in, std::size_t out, bool bias) {
          parameter<Dev>* w = add(p + n + ".weight", {out, in}, true);
          parameter<Dev>* bb = bias ? add(p + n + ".bias", {out}, false) : nullptr;
          return linear<Dev, T>(w, bb, in, out);
        };
        b.q = proj("self_attn.q_proj", d, qd, c.qkv_bias);
        b.k = proj("self_attn.k_proj", d, kvd, c.qkv_bias);
        b.v = proj("self_attn.v_proj", d, kvd, c.qkv_bias);
        b.o = proj("self_attn.o_proj", qd, d, c.o_bias);
        b.ln2 = norm_params(p + "post_attention_layernorm");
        if (c.is_moe()) {
          const std::string m = p + "block_sparse_moe.";
          parameter<Dev>* router = add(m + "gate.weight", {c.num_local_experts, d}, true);
          std::vector<std::array<parameter<Dev>*, 3>> ex;
          for (std::size_t j = 0; j < c.num_local_experts; ++j) {
            const std::string e = m + "experts." + std::to_string(j) + ".";
            ex.push_back({add(e + "w1.weight", {I, d}, true), add(e + "w3.weight", {I, d}, true), add(e + "w2.weight", {d, I}, true)});
          }
          b.moe = sparse_moe<Dev, T>(router, std::move(ex), d, I, c.num_experts_per_tok);
        } else {
          b.gate = proj("mlp.gate_proj", d, I, c.mlp_bias);
          b.up = proj("mlp.up_proj", d, I, c.mlp_bias);
          b.down = proj("mlp.down_proj", I, d, c.mlp_bias);
        }
      }
      final_norm_ = norm_params("model.norm");
      parameter<Dev>* head = c.tie_word_embeddings ? embed_ : add("lm_head.weight", {c.vocab_size, d}, true);
      head_ = linear<Dev, T>(head, nullptr, d, c.vocab_size);
    }
    bool all_windowed = c.num_hidden_layers > 0;
    std::size_t widest = 0;
    for (std::size_t l = 0; l < c.num_hidden_layers; ++l) {
      std::optional<std::size_t> window = c.sliding_window;
      if (window && c.family == io::model_family::qwen2 && l < c.max_window_layers) window.reset();
      blocks_[l].attn = self_attention<Dev, T>(c.num_attention_heads, c.num_key_value_heads, c.head_dim, window);
      if (window && *window > 0)
        widest = std::max(widest, *window);
      else
        all_windowed = false;
    }
    // a token leaves the KV cache once it is outside every layer's window
    kv_keep_ = all_windowed ? widest : std::numeric_limits<std::size_t>::max();
  }

  template <class E>
  void ensure(device_buffer<E, Dev>& b, std::size_t n) {
    if (b.size() < n) b = device_buffer<E, Dev>(*dev_, n);
  }

  void check_batch(std::span<const std::int64_t> ids, std::size_t batch, std::size_t seq) {
    const std::size_t n = detail::mul_checked(batch, seq, "tokens");
    if (ids.size() != n)
      throw nn_error(errc::invalid_argument,
                     std::to_string(ids.size()) + " token ids for batch " + std::to_string(batch) + " x seq " + std::to_string(seq));
    if (n == 0) throw nn_error(errc::invalid_argument, "an empty batch");
    if (cfg_.positions == io::position_kind::learned && seq > cfg_.max_position_embeddings)
      throw nn_error(errc::invalid_argument, "sequence of " + std::to_string(seq) + " tokens is longer than the " +
                                                 std::to_string(cfg_.max_position_embeddings) + " learned positions");
    check_ids(ids);
  }

  void check_ids(std::span<const std::int64_t> ids) const {
    for (std::size_t t = 0; t < ids.size(); ++t)
      if (ids[t] < 0 || std::uint64_t(ids[t]) >= cfg_.vocab_size)
        throw nn_error(errc::invalid_argument, "token id " + std::to_string(ids[t]) + " at position " + std::to_string(t) +
                                                   " is outside the vocabulary [0, " + std::to_string(cfg_.vocab_size) + ")");
  }

  void check_cache(const kv_cache<Dev, T>& c) const {
    const auto& s = c.shape();
    if (&c.device() != dev_ || s.layers != cfg_.num_hidden_layers || s.heads_kv != cfg_.num_key_value_heads || s.head_dim != cfg_.head_dim)
      throw nn_error(errc::invalid_argument, "kv_cache of " + std::to_string(s.layers) + " layers x " + std::to_string(s.heads_kv) + " kv heads x " +
                                                 std::to_string(s.head_dim) + " (or on another device) does not fit this model (" +
                                                 std::to_string(cfg_.num_hidden_layers) + " x " + std::to_string(cfg_.num_key_value_heads) + " x " +
                                                 std::to_string(cfg_.head_dim) + ")");
  }

  // decode_step and extend: counts[i] tokens appended to seqs[i], attention through attention_decode
  // (one launch when every sequence takes the same count, else one per sequence).
  std::span<const float> append(kv_cache<Dev, T>& cache, std::span<const std::size_t> seqs, std::span<const std::int64_t> tokens,
                                std::span<const std::size_t> counts, const char* what) {
    check_cache(cache);
    const std::size_t B = seqs.size();
    cache.check_distinct(seqs, what);
    std::size_t n = 0;
    for (std::size_t i = 0; i < B; ++i) {
      if (counts[i] == 0) throw nn_error(errc::invalid_argument, std::string(what) + ": no tokens for sequence " + std::to_string(seqs[i]));
      n = detail::add_checked(n, counts[i], "extend tokens");
    }
    if (tokens.size() != n)
      throw nn_error(errc::invalid_argument,
                     std::string(what) + ": " + std::to_string(tokens.size()) + " token ids for runs of " + std::to_string(n) + " in total");
    if (n > std::size_t(std::numeric_limits<std::int32_t>::max()))
      throw nn_error(errc::overflow, std::string(what) + ": " + std::to_string(n) + " tokens in one batch");
    positions_inf_.resize(n);
    seqlens_.resize(B);
    cu_.assign(B + 1, 0);
    bool same = true;
    std::size_t most = 0;
    for (std::size_t i = 0; i < B; ++i) {
      most = std::max(most, counts[i]);
      const std::size_t len = cache.length(seqs[i]);
      if (len == 0)
        throw nn_error(errc::invalid_argument, std::string(what) + ": sequence " + std::to_string(seqs[i]) + " is empty (start it with prefill)");
      if (counts[i] > max_length(cache) || len > max_length(cache) - counts[i])
        throw nn_error(errc::out_of_range, std::string(what) + ": sequence " + std::to_string(seqs[i]) + " holds " + std::to_string(len) +
                                               " tokens, position " + std::to_string(len + counts[i] - 1) + " exceeds the " +
                                               std::to_string(max_length(cache)) + " positions this model and cache hold");
      cu_[i + 1] = cu_[i] + std::int32_t(counts[i]);
      for (std::size_t t = 0; t < counts[i]; ++t) positions_inf_[std::size_t(cu_[i]) + t] = std::int64_t(len + t);
      seqlens_[i] = std::int32_t(len + counts[i]);
      same = same && counts[i] == counts[0];
    }
    check_ids(tokens);
    // all pages or none; gives back the pages that left every layer's window (the first new token's
    // window reaches most - 1 tokens further back than the last one's)
    const std::size_t keep = kv_keep_ == std::numeric_limits<std::size_t>::max() ? kv_keep_ : kv_keep_ + (most - 1);
    cache.reserve(seqs, counts, keep);
    cache.gather_tables(seqs, tables_);
    last_rows_.resize(B);
    for (std::size_t i = 0; i < B; ++i) last_rows_[i] = std::size_t(cu_[i + 1]) - 1;
    const std::size_t kvd = cfg_.num_key_value_heads * cfg_.head_dim, qd = cfg_.num_attention_heads * cfg_.head_dim;
    const std::size_t pps = cache.pages_per_seq();
    run_inference(tokens, [&](std::size_t l, std::size_t rows, const T* q, const T* k, const T* v, T* o) {
      for (std::size_t i = 0; i < B; ++i) {
        const std::size_t r0 = std::size_t(cu_[i]);
        cache.write(l, seqs[i], std::size_t(positions_inf_[r0]), k + r0 * kvd, v + r0 * kvd, counts[i], kvd);
      }
      attention_options ao = blocks_[l].attn.options();
      ao.align = mask_align::bottom_right;  // the new tokens are the last of their sequence
      if (same) {
        attention_decode(*dev_, cache.decode_shape(B, cfg_.num_attention_heads, counts[0]), std::span<const T>(q, rows * qd), cache.k(l), cache.v(l),
                         std::span<const std::int32_t>(seqlens_), std::span<const std::int32_t>(tables_), std::span<T>(o, rows * qd),
                         std::span<float>{}, ao);
        return;
      }
      for (std::size_t i = 0; i < B; ++i) {
        const std::size_t r0 = std::size_t(cu_[i]);
        attention_decode(*dev_, cache.decode_shape(1, cfg_.num_attention_heads, counts[i]), std::span<const T>(q + r0 * qd, counts[i] * qd),
                         cache.k(l), cache.v(l), std::span<const std::int32_t>(seqlens_).subspan(i, 1),
                         std::span<const std::int32_t>(tables_).subspan(i * pps, pps), std::span<T>(o + r0 * qd, counts[i] * qd), std::span<float>{},
                         ao);
      }
    });
    for (std::size_t i = 0; i < B; ++i) cache.commit(seqs[i], counts[i]);
    return {inf_.logits.data(), B * cfg_.vocab_size};
  }

  // The layer stack of forward() without saving anything, on n = ids.size() tokens at
  // positions_inf_; attend(layer, n, q, k, v, o) is the attention core (after RoPE). Leaves the
  // logits (rows last_rows_, vocab) in inf_.logits: only those rows go through the final norm and
  // the head.
  template <class Attend>
  void run_inference(std::span<const std::int64_t> ids, Attend&& attend) {
    const auto& c = cfg_;
    const std::size_t n = ids.size(), d = c.hidden_size, I = c.intermediate_size, B = last_rows_.size();
    const std::size_t qd = c.num_attention_heads * c.head_dim, kvd = c.num_key_value_heads * c.head_dim;
    Dev& dev = *dev_;
    infer_buffers& f = inf_;
    ensure(f.sa, n * d);
    ensure(f.sb, n * d);
    ensure(f.tmp, n * d);
    ensure(f.y, n * d);
    ensure(f.q, n * qd);
    ensure(f.k, n * kvd);
    ensure(f.v, n * kvd);
    ensure(f.o, n * qd);
    if (!moe()) {
      ensure(f.g, n * I);
      ensure(f.u, n * I);
      ensure(f.h, n * I);
    }
    ensure(f.last_x, B * d);
    ensure(f.last_r, B * d);
    ensure(f.last_s, B * d);
    ensure(f.last_y, B * d);
    ensure(f.logits, B * c.vocab_size);
    embedding_forward(dev, ids, crows_view<float>(embed_->value, c.vocab_size, d), rows_view<float>(f.sa, n, d));
    if (pos_)
      embedding_forward(dev, std::span<const std::int64_t>(positions_inf_), crows_view<float>(pos_->value, c.max_position_embeddings, d),
                        rows_view<float>(f.sa, n, d), true);
    const rope_options ro = rope_at(positions_inf_);
    // the stream: sa entering a block, sb after its attention (as s_in and s_mid of forward())
    for (std::size_t l = 0; l < blocks_.size(); ++l) {
      block& b = blocks_[l];
      if (l == 0)
        b.ln1.forward(dev, crows_view<float>(f.sa, n, d), cview<float>{}, mview<float>{}, rows_view<T>(f.y, n, d), false);
      else
        b.ln1.forward(dev, crows_view<float>(f.tmp, n, d), crows_view<float>(f.sb, n, d), rows_view<float>(f.sa, n, d), rows_view<T>(f.y, n, d),
                      false);
      const cview<T> y1 = crows_view<T>(f.y, n, d);
      // a decode step's three GEMVs as one launch (gemm_fused: the same bits)
      gemm_fused(dev, [&] {
        b.q.forward(dev, y1, rows_view<T>(f.q, n, qd), false);
        b.k.forward(dev, y1, rows_view<T>(f.k, n, kvd), false);
        b.v.forward(dev, y1, rows_view<T>(f.v, n, kvd), false);
      });
      if (!rope_freq_.empty()) {
        rope_forward(dev, rows_view<T>(f.q, n, qd), c.head_dim, std::span<const std::int64_t>(positions_inf_), ro);
        rope_forward(dev, rows_view<T>(f.k, n, kvd), c.head_dim, std::span<const std::int64_t>(positions_inf_), ro);
      }
      attend(l, n, f.q.data(), f.k.data(), f.v.data(), f.o.data());
      b.o.forward(dev, crows_view<T>(f.o, n, qd), rows_view<float>(f.tmp, n, d), false);
      b.ln2.forward(dev, crows_view<float>(f.tmp, n, d), crows_view<float>(f.sa, n, d), rows_view<float>(f.sb, n, d), rows_view<T>(f.y, n, d), false);
      mlp_forward(b, crows_view<T>(f.y, n, d), f.g.data(), f.u.data(), f.h.data(), rows_view<float>(f.tmp, n, d), false);
    }
    // the final norm and the head on the rows whose logits are wanted
    for (std::size_t i = 0; i < B; ++i) {
      const std::size_t r = last_rows_[i];
      std::copy(f.tmp.data() + r * d, f.tmp.data() + (r + 1) * d, f.last_x.data() + i * d);
      std::copy(f.sb.data() + r * d, f.sb.data() + (r + 1) * d, f.last_r.data() + i * d);
    }
    final_norm_.forward(dev, crows_view<float>(f.last_x, B, d), crows_view<float>(f.last_r, B, d), rows_view<float>(f.last_s, B, d),
                        rows_view<T>(f.last_y, B, d), false);
    head_.forward(dev, crows_view<T>(f.last_y, B, d), rows_view<float>(f.logits, B, c.vocab_size), false);
  }

  // ---- The activation arena (device/memory_plan.hpp) ----
  // The tensors of a step: s_in and s_mid, the f32 stream entering block l and after its attention;
  // y1 and y2, the normed inputs of attention and the MLP; q, k, v, o and lse, attention's (after
  // RoPE); tmp_o and tmp_mlp, the f32 outputs of the o projection and of the MLP; g, u and h, the
  // dense MLP's gate, up and activation; s_final and yf, the final norm's stream and output;
  // logits and dlogits, one chunk of the head; dy_head, the head's input gradient; dS, d loss / d
  // s_in of block l (index L: of the final norm's input); the rest, block l's backward gradients
  // (gT_*: a bf16 model's compute-type copy of an f32 gradient).
  // clang-format off
  enum class act : std::uint8_t {
    s_in, s_mid, y1, q, k, v, o, lse, tmp_o, y2, g, u, h, tmp_mlp,  // a block's forward: recomputed() relies on this order
    s_final, yf, logits, dlogits, dy_head, dS,
    gT_mlp, dT_mlp, dg, du, dy_mlp, dS2, gT_attn, dT_attn, dq, dk, dv, dy_attn,
    count
  };
  // clang-format on

  template <class E>
  struct slot {
    E* p = nullptr;
    std::size_t n = 0;
    E* data() const noexcept { return p; }
    std::size_t size() const noexcept { return n; }
  };
  // The phases of a training step, in order: the embedding (0); block l's forward, 1 + 6l + f_*;
  // the final norm; the head (every chunk, forward and backward); the final norm's backward; block
  // l's backward (the last block first), b_*; the embedding's backward. A forward without
  // training runs the first three.
  enum : std::size_t { f_ln1, f_qkv, f_attn, f_o, f_ln2, f_mlp, f_count };
  enum : std::size_t { b_rc, b_mlp, b_ln2, b_attn, b_ln1, b_count };
  std::size_t ph_f(std::size_t l, std::size_t p) const { return 1 + f_count * l + p; }
  std::size_t ph_final() const { return 1 + f_count * blocks_.size(); }
  std::size_t ph_head() const { return ph_final() + 1; }
  std::size_t ph_final_back() const { return ph_final() + 2; }
  std::size_t ph_b(std::size_t l, std::size_t p) const { return ph_final() + 3 + b_count * (blocks_.size() - 1 - l) + p; }
  std::size_t ph_embed_back() const { return ph_final() + 3 + b_count * blocks_.size(); }

  // Whether backward reads a copy of kind k recomputed in the block's b_rc phase.
  bool recomputed(act k) const {
    switch (recompute_) {
      case recompute::none: return false;
      case recompute::attention: return k == act::o || k == act::lse;
      case recompute::blocks: return k <= act::tmp_mlp && k != act::s_in;
    }
    return false;
  }

  std::size_t head_rows(std::size_t n) const { return head_chunk_ && head_chunk_ < n ? head_chunk_ : n; }

  struct step_key {
    std::size_t batch = 0, seq = 0, head = 0;
    recompute mode = recompute::none;
    bool planned = true;
    bool operator==(const step_key&) const = default;
  };
  struct step_plan {
    std::vector<tensor_life> lives;  // per tensor: bytes and phases [first, last]
    memory_plan plan;
    std::vector<std::int32_t> ids;   // (pass, kind, layer) -> the plan's tensor, or -1
    std::vector<std::size_t> elems;  // per tensor
    step_key key;                    // batch 0: not planned
  };
  std::size_t slot_index(act k, std::size_t l, bool pass1) const {
    return ((pass1 ? std::size_t(act::count) : 0) + std::size_t(k)) * (blocks_.size() + 1) + l;
  }

  // The plan of a step on (batch, seq) tokens (training or not) under the current recompute mode
  // and head chunk, made when one of them changed; the arena grows to hold it.
  void plan_step(std::size_t batch, std::size_t seq, bool train) {
    step_plan& sp = train ? train_ : infer_;
    cur_ = &sp;
    const std::size_t n = detail::mul_checked(batch, seq, "tokens");
    const step_key key{batch, seq, train ? head_rows(n) : 0, recompute_, planned_};
    if (sp.key == key) return;
    const auto& c = cfg_;
    const std::size_t L = blocks_.size(), d = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
    const std::size_t qd = c.num_attention_heads * c.head_dim, kvd = c.num_key_value_heads * c.head_dim;
    sp = step_plan{};
    sp.ids.assign(2 * std::size_t(act::count) * (L + 1), -1);
    const auto put = [&](act k, std::size_t l, bool pass1, std::size_t rows, std::size_t cols, std::size_t esize, std::size_t first,
                         std::size_t last) {
      const std::size_t e = detail::mul_checked(rows, cols, "activation elements");
      const std::size_t id = sp.lives.size();
      sp.lives.push_back({detail::mul_checked(e, esize, "activation bytes"), first, last});
      if (id > std::size_t(std::numeric_limits<std::int32_t>::max())) throw nn_error(errc::overflow, "decoder_lm: too many activations");
      sp.ids[slot_index(k, l, pass1)] = std::int32_t(id);
      sp.elems.push_back(e);
    };
    constexpr std::size_t sF = sizeof(float), sT = sizeof(T);
    const bool dense = !moe(), gate = dense && gated();
    for (std::size_t l = 0; l < L; ++l) {
      const std::size_t next = l + 1 < L ? ph_f(l + 1, f_ln1) : ph_final();  // where the stream is read next
      // A forward tensor lives to its last forward read `fp`, or to its read in backward phase bp
      // when training keeps it; a recomputed copy lives from b_rc to that read.
      const auto fwd = [&](act k, std::size_t rows, std::size_t cols, std::size_t esize, std::size_t first, std::size_t fp, std::size_t bp) {
        put(k, l, false, rows, cols, esize, first, train && !recomputed(k) && bp != b_rc ? ph_b(l, bp) : fp);
        if (train && recomputed(k)) put(k, l, true, rows, cols, esize, ph_b(l, b_rc), ph_b(l, bp));
      };
      put(act::s_in, l, false, n, d, sF, l == 0 ? 0 : ph_f(l, f_ln1), train ? ph_b(l, b_ln1) : ph_f(l, f_ln2));
      fwd(act::y1, n, d, sT, ph_f(l, f_ln1), ph_f(l, f_qkv), b_attn);
      fwd(act::q, n, qd, sT, ph_f(l, f_qkv), ph_f(l, f_attn), b_attn);
      fwd(act::k, n, kvd, sT, ph_f(l, f_qkv), ph_f(l, f_attn), b_attn);
      fwd(act::v, n, kvd, sT, ph_f(l, f_qkv), ph_f(l, f_attn), b_attn);
      fwd(act::o, n, qd, sT, ph_f(l, f_attn), ph_f(l, f_o), b_attn);
      fwd(act::lse, batch * c.num_attention_heads, seq, sF, ph_f(l, f_attn), ph_f(l, f_o), b_attn);
      fwd(act::tmp_o, n, d, sF, ph_f(l, f_o), ph_f(l, f_ln2), b_rc);
      fwd(act::s_mid, n, d, sF, ph_f(l, f_ln2), next, b_ln2);
      fwd(act::y2, n, d, sT, ph_f(l, f_ln2), ph_f(l, f_mlp), b_mlp);
      if (gate) fwd(act::g, n, I, sT, ph_f(l, f_mlp), ph_f(l, f_mlp), b_mlp);
      if (dense) {
        fwd(act::u, n, I, sT, ph_f(l, f_mlp), ph_f(l, f_mlp), b_mlp);
        fwd(act::h, n, I, sT, ph_f(l, f_mlp), ph_f(l, f_mlp), b_mlp);
      }
      fwd(act::tmp_mlp, n, d, sF, ph_f(l, f_mlp), next, b_rc);
      if (!train) continue;
      const auto bwd = [&](act k, std::size_t rows, std::size_t cols, std::size_t esize, std::size_t first, std::size_t last) {
        put(k, l, false, rows, cols, esize, ph_b(l, first), ph_b(l, last));
      };
      put(act::dS, l, false, n, d, sF, ph_b(l, b_ln1), l ? ph_b(l - 1, b_ln2) : ph_embed_back());
      if (dense) {
        if (bf16_compute) bwd(act::gT_mlp, n, d, sT, b_mlp, b_mlp);
        bwd(act::dT_mlp, n, I, sT, b_mlp, b_mlp);
        if (gate) bwd(act::dg, n, I, sT, b_mlp, b_mlp);
        bwd(act::du, n, I, sT, b_mlp, b_mlp);
      }
      bwd(act::dy_mlp, n, d, sF, b_mlp, b_ln2);
      bwd(act::dS2, n, d, sF, b_ln2, b_ln1);
      if (bf16_compute) bwd(act::gT_attn, n, d, sT, b_attn, b_attn);
      bwd(act::dT_attn, n, qd, sT, b_attn, b_attn);
      bwd(act::dq, n, qd, sT, b_attn, b_attn);
      bwd(act::dk, n, kvd, sT, b_attn, b_attn);
      bwd(act::dv, n, kvd, sT, b_attn, b_attn);
      bwd(act::dy_attn, n, d, sF, b_attn, b_ln1);
    }
    put(act::s_final, 0, false, n, d, sF, ph_final(), train ? ph_final_back() : ph_final());
    put(act::yf, 0, false, n, d, sT, ph_final(), ph_head());
    if (train) {
      const std::size_t R = head_rows(n);
      put(act::logits, 0, false, R, V, sF, ph_head(), ph_head());
      put(act::dlogits, 0, false, R, V, sT, ph_head(), ph_head());
      put(act::dy_head, 0, false, n, d, sF, ph_head(), ph_final_back());
      put(act::dS, L, false, n, d, sF, ph_final_back(), ph_b(L - 1, b_ln2));
    }
    sp.plan = plan_memory(sp.lives);
    if (!planned_) {                                           // the reference layout: each tensor its own aligned bytes, in order
      constexpr std::size_t align = plan_options{}.alignment;  // plan_memory's, which sized unplanned_bytes
      std::size_t at = 0;
      for (std::size_t i = 0; i < sp.lives.size(); ++i) {
        sp.plan.offset[i] = at;
        at += (sp.lives[i].bytes + align - 1) / align * align;  // within unplanned_bytes, checked by plan_memory
      }
      sp.plan.arena_bytes = at;
    }
    sp.key = key;
    if (arena_.size() < sp.plan.arena_bytes) {
      arena_ = {};  // free the old arena before the new one is taken
      arena_ = device_buffer<std::byte, Dev>(*dev_, sp.plan.arena_bytes);
    }
  }
  // Frees the arena and forgets the plans (the next step plans and allocates anew).
  void release_arena() {
    arena_ = {};
    train_.key = {};
    infer_.key = {};
  }

  // Kind k of layer l (pass1: its recomputed copy) in the current step's plan.
  template <class E>
  slot<E> buf(act k, std::size_t l, bool pass1) {
    const std::int32_t id = cur_ ? cur_->ids[slot_index(k, l, pass1)] : -1;
    if (id < 0)
      throw nn_error(errc::invalid_argument,
                     "decoder_lm: activation " + std::to_string(int(k)) + " of layer " + std::to_string(l) + " is not in this step's plan");
    return {reinterpret_cast<E*>(arena_.data() + cur_->plan.offset[std::size_t(id)]), cur_->elems[std::size_t(id)]};
  }
  slot<float> fbuf(act k, std::size_t l, bool pass1 = false) { return buf<float>(k, l, pass1); }
  slot<T> tbuf(act k, std::size_t l, bool pass1 = false) { return buf<T>(k, l, pass1); }

  // The start of phase p: with poisoning on, every byte of the arena but those of the tensors made
  // before p and read in p or later becomes NaN (poison_free_bytes, as graph's executor does).
  void phase(std::size_t p) {
    if (poison_ && cur_) poison_free_bytes(std::span<std::byte>(arena_.data(), arena_.size()), cur_->lives, cur_->plan, p);
  }

  // The blocks and the final norm, then (with `head`) the LM head's logits of every row.
  void run_forward(std::span<const std::int64_t> ids, std::size_t batch, std::size_t seq, bool train, bool head = true) {
    check_batch(ids, batch, seq);
    plan_step(batch, seq, train);
    batch_ = batch;
    seq_ = seq;
    n_ = batch * seq;
    ids_.assign(ids.begin(), ids.end());
    const auto& c = cfg_;
    const std::size_t n = n_, d = c.hidden_size, L = blocks_.size();
    positions_.resize(n);
    for (std::size_t t = 0; t < n; ++t) positions_[t] = std::int64_t(t % seq);
    Dev& dev = *dev_;
    phase(0);
    const slot<float> s0 = fbuf(act::s_in, 0);
    embedding_forward(dev, std::span<const std::int64_t>(ids_), crows_view<float>(embed_->value, c.vocab_size, d), rows_view<float>(s0, n, d));
    if (pos_)
      embedding_forward(dev, std::span<const std::int64_t>(positions_), crows_view<float>(pos_->value, c.max_position_embeddings, d),
                        rows_view<float>(s0, n, d), true);
    for (std::size_t l = 0; l < L; ++l) block_forward(l, train, false);
    if (moe()) aux_from_routing();
    phase(ph_final());
    final_norm_.forward(dev, crows_view<float>(fbuf(act::tmp_mlp, L - 1), n, d), crows_view<float>(fbuf(act::s_mid, L - 1), n, d),
                        rows_view<float>(fbuf(act::s_final, 0), n, d), rows_view<T>(tbuf(act::yf, 0), n, d), train);
    if (!head) return;
    phase(ph_head());
    ensure(logits_, n * c.vocab_size);
    head_.forward(dev, crows_view<T>(tbuf(act::yf, 0), n, d), rows_view<float>(logits_, n, c.vocab_size), train);
  }

  // Block l's forward: its input stream s_in (layer 0: the embeddings; later: the previous block's
  // s_mid + MLP output, which ln1 adds and writes to s_in) to its MLP output tmp_mlp (added to s_mid
  // by the next norm). `recomputing` (backward's b_rc phase): s_in holds the stream already, and
  // the recomputed kinds are rebuilt into their copies, the same bits as the first pass.
  void block_forward(std::size_t l, bool train, bool recomputing) {
    const auto& c = cfg_;
    const std::size_t n = n_, d = c.hidden_size;
    const std::size_t qd = c.num_attention_heads * c.head_dim, kvd = c.num_key_value_heads * c.head_dim;
    Dev& dev = *dev_;
    block& b = blocks_[l];
    const auto F = [&](act k) { return fbuf(k, l, recomputing && recomputed(k)); };
    const auto X = [&](act k) { return tbuf(k, l, recomputing && recomputed(k)); };
    const auto at = [&](std::size_t p) {
      if (!recomputing) phase(ph_f(l, p));
    };
    at(f_ln1);
    const slot<T> y1s = X(act::y1);
    if (l == 0 || recomputing)
      b.ln1.forward(dev, crows_view<float>(F(act::s_in), n, d), cview<float>{}, mview<float>{}, rows_view<T>(y1s, n, d), train);
    else
      b.ln1.forward(dev, crows_view<float>(fbuf(act::tmp_mlp, l - 1), n, d), crows_view<float>(fbuf(act::s_mid, l - 1), n, d),
                    rows_view<float>(F(act::s_in), n, d), rows_view<T>(y1s, n, d), train);
    at(f_qkv);
    const cview<T> y1 = crows_view<T>(y1s, n, d);
    const slot<T> qs = X(act::q), ks = X(act::k);
    b.q.forward(dev, y1, rows_view<T>(qs, n, qd), train);
    b.k.forward(dev, y1, rows_view<T>(ks, n, kvd), train);
    b.v.forward(dev, y1, rows_view<T>(X(act::v), n, kvd), train);
    if (!rope_freq_.empty()) {
      const rope_options ro = rope_at(positions_);
      rope_forward(dev, rows_view<T>(qs, n, qd), c.head_dim, std::span<const std::int64_t>(positions_), ro);
      rope_forward(dev, rows_view<T>(ks, n, kvd), c.head_dim, std::span<const std::int64_t>(positions_), ro);
    }
    at(f_attn);
    attention_forward_of(l, recomputing);
    at(f_o);
    const slot<float> to = F(act::tmp_o);
    b.o.forward(dev, crows_view<T>(X(act::o), n, qd), rows_view<float>(to, n, d), train);
    at(f_ln2);
    const slot<T> y2 = X(act::y2);
    b.ln2.forward(dev, crows_view<float>(to, n, d), crows_view<float>(F(act::s_in), n, d), rows_view<float>(F(act::s_mid), n, d),
                  rows_view<T>(y2, n, d), train);
    at(f_mlp);
    T* g = moe() || !gated() ? nullptr : X(act::g).data();
    T* u = moe() ? nullptr : X(act::u).data();
    T* h = moe() ? nullptr : X(act::h).data();
    mlp_forward(b, crows_view<T>(y2, n, d), g, u, h, rows_view<float>(F(act::tmp_mlp), n, d), train);
  }
  // Block b's MLP from y2 into out: the dense one (gate and up into g and u, the activation into
  // h, down) or the expert bank (MoE, which keeps its own buffers).
  void mlp_forward(block& b, cview<T> y2, T* g, T* u, T* h, mview<float> out, bool train) {
    Dev& dev = *dev_;
    if (moe()) {
      b.moe.forward(dev, y2, out, train);
      return;
    }
    const std::size_t n = y2.rows(), I = cfg_.intermediate_size, nI = n * I;
    if (gated()) {
      gemm_fused(dev, [&] {  // one launch when they are GEMVs (decode)
        b.gate.forward(dev, y2, mview<T>(g, n, I, I), train);
        b.up.forward(dev, y2, mview<T>(u, n, I, I), train);
      });
      swiglu_forward(dev, std::span<const T>(g, nI), std::span<const T>(u, nI), std::span<T>(h, nI));
    } else {
      b.up.forward(dev, y2, mview<T>(u, n, I, I), train);
      gelu_forward(dev, std::span<const T>(u, nI), std::span<T>(h, nI), gelu_kind());
    }
    b.down.forward(dev, cview<T>(h, n, I, I), out, train);
  }
  // Block l's attention core: its q, k, v to o and the log-sum-exp rows backward reads.
  void attention_forward_of(std::size_t l, bool recomputing) {
    const std::size_t n = n_, qd = cfg_.num_attention_heads * cfg_.head_dim, kvd = cfg_.num_key_value_heads * cfg_.head_dim;
    const auto X = [&](act k) { return tbuf(k, l, recomputing && recomputed(k)); };
    blocks_[l].attn.forward(
        *dev_, batch_, seq_, std::span<const T>(X(act::q).data(), n * qd), std::span<const T>(X(act::k).data(), n * kvd),
        std::span<const T>(X(act::v).data(), n * kvd), std::span<T>(X(act::o).data(), n * qd),
        std::span<float>(fbuf(act::lse, l, recomputing && recomputed(act::lse)).data(), batch_ * cfg_.num_attention_heads * seq_));
  }

  // RoPE options for these positions: the model's frequencies, and its table grown to hold them
  // (the same bits as computing them, without a sin and a cos per token, frequency and call)
  rope_options rope_at(std::span<const std::int64_t> positions) {
    rope_tab_.cover(positions);
    rope_options ro;
    ro.theta = cfg_.rope_theta;
    ro.inv_freq = rope_freq_;
    ro.table = rope_tab_.head_dim() ? &rope_tab_ : nullptr;
    return ro;
  }
  // HF's load_balancing_loss_func over the rows of every layer: aux = E · Σ_e f_e · P_e, and its
  // gradient with respect to each row's probabilities, coef · E · f_e / N (top-k carries none).
  void aux_from_routing() {
    const std::size_t E = cfg_.num_local_experts;
    const double N = double(n_ * blocks_.size());
    std::vector<double> cnt(E, 0.0), ps(E, 0.0);
    for (const block& b : blocks_)
      for (std::size_t e = 0; e < E; ++e) {
        cnt[e] += double(b.moe.expert_counts()[e]);
        ps[e] += b.moe.prob_sums()[e];
      }
    aux_ = load_balancing_loss(cnt, ps, N, cfg_.router_aux_loss_coef, aux_dprob_);
  }

  gelu_approx gelu_kind() const { return cfg_.act == io::activation::gelu ? gelu_approx::erf : gelu_approx::tanh; }

  // The compute-type view of an f32 gradient: for bf16 models its conversion into kind `k` of layer
  // l, for f32 the same memory.
  cview<T> as_compute(slot<float> g, std::size_t rows, std::size_t cols, [[maybe_unused]] act k, [[maybe_unused]] std::size_t l) {
    if constexpr (bf16_compute) {
      const slot<T> t = tbuf(k, l);
      convert(*dev_, std::span<const float>(g.data(), rows * cols), std::span<bf16>(t.data(), rows * cols));
      return crows_view<T>(t, rows, cols);
    } else {
      return crows_view<float>(g, rows, cols);
    }
  }

  void run_backward() {
    const auto& c = cfg_;
    const std::size_t n = n_, d = c.hidden_size, I = c.intermediate_size, L = blocks_.size();
    const std::size_t qd = c.num_attention_heads * c.head_dim, kvd = c.num_key_value_heads * c.head_dim;
    Dev& dev = *dev_;
    // final norm (dy_head holds the head's input gradient): dS[L] = d loss / d s_final
    phase(ph_final_back());
    final_norm_.backward(dev, crows_view<float>(fbuf(act::dy_head, 0), n, d), cview<float>{}, rows_view<float>(fbuf(act::dS, L), n, d));
    const rope_options ro = rope_at(positions_);
    for (std::size_t li = L; li-- > 0;) {
      block& b = blocks_[li];
      const auto S = [&](act k) { return tbuf(k, li, recomputed(k)); };  // what backward reads of the forward
      // Recomputation: the block's activations (or its attention output) again, from what was kept.
      phase(ph_b(li, b_rc));
      if (recompute_ == recompute::blocks)
        block_forward(li, true, true);
      else if (recompute_ == recompute::attention) {
        attention_forward_of(li, true);
        b.o.rebind_input(crows_view<T>(S(act::o), n, qd));  // the o projection's dW reads the copy
      }
      // MLP: its output was added to s_mid, so it receives dS.
      phase(ph_b(li, b_mlp));
      const slot<float> dS = fbuf(act::dS, li + 1), dym = fbuf(act::dy_mlp, li);
      if (moe()) {
        b.moe.backward(dev, crows_view<float>(dS, n, d), rows_view<float>(dym, n, d), std::span<const double>(aux_dprob_));
      } else {
        const cview<T> dm = as_compute(dS, n, d, act::gT_mlp, li);
        const slot<T> dT = tbuf(act::dT_mlp, li), du = tbuf(act::du, li);
        b.down.backward(dev, dm, rows_view<T>(dT, n, I), false);
        if (gated()) {
          const slot<T> dg = tbuf(act::dg, li);
          swiglu_backward(dev, std::span<const T>(dT.data(), n * I), std::span<const T>(S(act::g).data(), n * I),
                          std::span<const T>(S(act::u).data(), n * I), std::span<T>(dg.data(), n * I), std::span<T>(du.data(), n * I));
          b.gate.backward(dev, crows_view<T>(dg, n, I), rows_view<float>(dym, n, d), false);
          b.up.backward(dev, crows_view<T>(du, n, I), rows_view<float>(dym, n, d), true);
        } else {
          gelu_backward(dev, std::span<const T>(dT.data(), n * I), std::span<const T>(S(act::u).data(), n * I), std::span<T>(du.data(), n * I),
                        gelu_kind());
          b.up.backward(dev, crows_view<T>(du, n, I), rows_view<float>(dym, n, d), false);
        }
      }
      // ln2: dS2 = d loss / d s_mid (from y2 and from the stream after the block)
      phase(ph_b(li, b_ln2));
      const slot<float> dS2 = fbuf(act::dS2, li);
      b.ln2.backward(dev, crows_view<float>(dym, n, d), crows_view<float>(dS, n, d), rows_view<float>(dS2, n, d));
      // attention: its output was added to s_in, so it receives dS2.
      phase(ph_b(li, b_attn));
      const cview<T> da = as_compute(dS2, n, d, act::gT_attn, li);
      const slot<T> dT = tbuf(act::dT_attn, li), dq = tbuf(act::dq, li), dk = tbuf(act::dk, li), dv = tbuf(act::dv, li);
      const slot<float> dya = fbuf(act::dy_attn, li);
      b.o.backward(dev, da, rows_view<T>(dT, n, qd), false);
      b.attn.backward(dev, batch_, seq_, std::span<const T>(S(act::q).data(), n * qd), std::span<const T>(S(act::k).data(), n * kvd),
                      std::span<const T>(S(act::v).data(), n * kvd), std::span<const T>(S(act::o).data(), n * qd),
                      std::span<const T>(dT.data(), n * qd),
                      std::span<const float>(fbuf(act::lse, li, recomputed(act::lse)).data(), batch_ * c.num_attention_heads * seq_),
                      std::span<T>(dq.data(), n * qd), std::span<T>(dk.data(), n * kvd), std::span<T>(dv.data(), n * kvd));
      if (!rope_freq_.empty()) {
        rope_backward(dev, rows_view<T>(dq, n, qd), c.head_dim, std::span<const std::int64_t>(positions_), ro);
        rope_backward(dev, rows_view<T>(dk, n, kvd), c.head_dim, std::span<const std::int64_t>(positions_), ro);
      }
      b.q.backward(dev, crows_view<T>(dq, n, qd), rows_view<float>(dya, n, d), false);
      b.k.backward(dev, crows_view<T>(dk, n, kvd), rows_view<float>(dya, n, d), true);
      b.v.backward(dev, crows_view<T>(dv, n, kvd), rows_view<float>(dya, n, d), true);
      // ln1: dS[li] = d loss / d s_in
      phase(ph_b(li, b_ln1));
      b.ln1.backward(dev, crows_view<float>(dya, n, d), crows_view<float>(dS2, n, d), rows_view<float>(fbuf(act::dS, li), n, d));
    }
    phase(ph_embed_back());
    const slot<float> dS0 = fbuf(act::dS, 0);
    embedding_backward(dev, std::span<const std::int64_t>(ids_), crows_view<float>(dS0, n, d), rows_view<float>(embed_->grad, c.vocab_size, d));
    if (pos_)
      embedding_backward(dev, std::span<const std::int64_t>(positions_), crows_view<float>(dS0, n, d),
                         rows_view<float>(pos_->grad, c.max_position_embeddings, d));
  }

  Dev* dev_;
  io::model_config cfg_;
  parameters<Dev> params_;
  parameter<Dev>* embed_ = nullptr;
  parameter<Dev>* pos_ = nullptr;
  std::vector<block> blocks_;
  recompute recompute_ = recompute::none;
  std::size_t kv_keep_ = std::numeric_limits<std::size_t>::max();  // kv_keep()
  std::size_t head_chunk_ = 1024;
  std::vector<float> row_loss_;
  norm<Dev, T> final_norm_;
  linear<Dev, T> head_;
  std::vector<double> rope_freq_;
  rope_table rope_tab_;  // cos/sin of rope_freq_ at the positions seen so far (rope_at)
  // fp16 projections (set_fp16_linears) and loss scaling
  std::shared_ptr<fp16_workspace<Dev>> ws16_;
  fp16_strikes strikes16_;  // per projection, for_each_projection's order
  std::optional<loss_scaler> scaler_;
  // activations of the last forward
  std::size_t batch_ = 0, seq_ = 0, n_ = 0;
  std::vector<std::int64_t> ids_, positions_;
  double aux_ = 0.0;                  // MoE: the last forward's load-balancing loss
  std::vector<double> aux_dprob_;     // and coef · its gradient per expert probability
  device_buffer<float, Dev> logits_;  // forward()'s and loss()'s logits (the step's output, outside the arena)
  // the activation arena and the plans of the last training step and the last forward without one
  device_buffer<std::byte, Dev> arena_;
  step_plan train_, infer_;
  const step_plan* cur_ = nullptr;
  bool planned_ = true, poison_ = false;
  // inference (prefill, decode_step): one set of buffers for every layer
  struct infer_buffers {
    device_buffer<float, Dev> sa, sb, tmp, last_x, last_r, last_s, logits;
    device_buffer<T, Dev> y, q, k, v, o, g, u, h, last_y;
  } inf_;
  std::vector<std::int64_t> positions_inf_;
  std::vector<std::int32_t> cu_, seqlens_, tables_;
  std::vector<std::size_t> last_rows_, ones_;
};

}  // namespace nn
}  // namespace v0
}  // namespace tessel
