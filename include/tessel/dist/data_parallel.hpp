// Data parallelism over a dp group: one model replica per dp rank, each on its own device, each
// with its share of the batch. The model is an nn::decoder_lm, a dist::tp_decoder_lm whose tp group
// is another axis of the same world, or a dist::pipeline of such stages (dp × pp × tp: the dp peers
// of a rank hold the same shards; process_groups builds every group). Ranks with different numbers of counted tokens (targets
// that are not ignore_index) are weighted by their counts, so the averaged gradient is the gradient
// of the mean loss over the whole batch.
//
// ZeRO stage 0 (plain DP): after the local forward and backward the gradients are averaged over the
// dp group in buckets (consecutive parameters in registration order, packed into one buffer up to
// bucket_bytes), every bucket reduced in dp-rank order, so every replica sees the same bits whatever
// the thread timing, runs the same AdamW step (the model's own), and stays bitwise identical.
//
// ZeRO stage 1 (optimizer state sharded, Rajbhandari et al. 2020; Megatron's distributed
// optimizer): the parameters, taken in registration order as one flat vector of P elements, are cut
// into dp contiguous shards of ceil(P / dp) elements (the last ones shorter or empty). The gradients
// are reduce-scattered (each rank receives the average of its shard only), each rank runs AdamW on
// its shard with the moments for its shard only (8·P/dp bytes instead of 8·P), and the updated
// parameters are all-gathered. Every element is reduced in the same rank order as the all-reduce
// and updated by the same per-element arithmetic, so stage 1 gives the same bits as stage 0
// (tested) when the gradient norm is not clipped; with clipping the norm is summed shard by shard
// in double where stage 0 sums f32 chunks, so the norms differ by f32 accumulation error (measured
// 1e-8 relative) and the clipping coefficients may differ in their last bit.
// Expert parallelism (a tp_decoder_lm whose MoE experts are split over its ep group): the experts'
// weights are held by the dp / ep replicas of data_parallel_options::expert_dp (process_groups::
// edp()) only, and each one's gradient already sums its ep group's tokens (the dispatch brought
// them), so it is summed over expert_dp and divided by dp; everything else is averaged over dp.
// Every rank's loss gradient is scaled by the whole batch's counted tokens (passed to the model as
// its grad_scale) instead of being reweighted after backward, since an expert's gradient mixes the
// ranks' tokens. ZeRO-1 over experts and expert parallelism in a pipeline are not built yet.
//
// Compressed gradients (data_parallel_options::compression, stage 0): each bucket's all-reduce is
// all_reduce_compressed with that bucket's own error-feedback residuals, so what a quantization
// drops in one step is sent in the next; wire_bytes() counts what this rank sent.
//
// The f32 values (which the norms and biases read) and the gradients stay whole on every rank; the
// bytes per parameter on a card are therefore 4 (f32 value) + 4 (f32 gradient) + 2 (bf16 copy, bf16
// models) + 8/dp (moments), which memory() reports from the buffers actually held.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <tessel/collectives/communicator.hpp>
#include <tessel/collectives/compression.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/detail/checked.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/dist/grad_check.hpp>
#include <tessel/dist/pipeline.hpp>
#include <tessel/dist/tp_decoder.hpp>
#include <tessel/nn/decoder.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

struct data_parallel_options {
  std::size_t bucket_bytes = std::size_t{4} << 20;  // f32 bytes per rank per collective (gradient buckets, shard chunks)
  int zero_stage = 0;                               // 0: plain DP; 1: optimizer state sharded over dp (2 and 3 are not built yet)
  communicator* expert_dp = nullptr;                // expert parallelism: the replicas holding this rank's experts (process_groups::edp())
  // Compressed gradient buckets (ZeRO stage 0): every bucket's all-reduce carries BF16, FP8 or INT4
  // with per-chunk scales (all_reduce_compressed), with each bucket's quantization residual fed
  // into the next step's (error feedback) unless error_feedback is false.
  compression_options compression = {.format = wire_format::none};
  bool error_feedback = true;
};

// Bytes a rank holds for training, by kind (device buffers actually allocated).
struct memory_use {
  std::size_t parameters = 0;       // f32 values and bf16 copies
  std::size_t gradients = 0;        // f32 gradients
  std::size_t optimizer_state = 0;  // AdamW moments
  std::size_t total() const { return parameters + gradients + optimizer_state; }
};

// What data_parallel needs to know of a model beyond params(), forward_backward() and adamw(): the
// groups its parameters are split over besides dp (none for one-device models), and whether a
// parameter counts in the global gradient norm on this rank (a replicated copy counts once).
template <class Model>
struct model_split {
  static std::vector<communicator*> groups(Model&) { return {}; }
  static bool counted(const Model&, const void*) { return true; }
  static int ep(const Model&) { return 1; }                        // ranks its experts are split over
  static bool expert(const Model&, const void*) { return false; }  // one of this rank's experts
};
template <device Dev, nn::compute_type T>
struct model_split<tp_decoder_lm<Dev, T>> {
  static std::vector<communicator*> groups(tp_decoder_lm<Dev, T>& m) {
    std::vector<communicator*> g{&m.tp()};
    if (m.pp()) g.push_back(m.pp());
    return g;
  }
  static bool counted(const tp_decoder_lm<Dev, T>& m, const nn::parameter<Dev>* p) { return m.counted_in_norm(*p); }
  static int ep(const tp_decoder_lm<Dev, T>& m) { return m.ep() ? m.ep()->size() : 1; }
  static bool expert(const tp_decoder_lm<Dev, T>& m, const nn::parameter<Dev>* p) { return m.is_expert(*p); }
};
template <class Stage>
struct model_split<pipeline<Stage>> {
  static std::vector<communicator*> groups(pipeline<Stage>& m) { return model_split<Stage>::groups(m.model()); }
  static bool counted(pipeline<Stage>& m, const void* p) {
    return model_split<Stage>::counted(m.model(), static_cast<const nn::parameter<typename Stage::device_type>*>(p));
  }
  static int ep(pipeline<Stage>& m) { return model_split<Stage>::ep(m.model()); }
  static bool expert(pipeline<Stage>&, const void*) { return false; }
};

template <class Model>
class data_parallel {
  using Dev = typename Model::device_type;
  using T = typename Model::compute_t;

 public:
  data_parallel(Model& model, communicator& dp, data_parallel_options o = {}) : m_(&model), dp_(&dp), o_(o) {
    if (o_.bucket_bytes < sizeof(float)) throw dist_error(errc::invalid_argument, "data_parallel: bucket_bytes must hold one f32");
    if (o_.zero_stage < 0 || o_.zero_stage > 3)
      throw dist_error(errc::config, "data_parallel: ZeRO stage " + std::to_string(o_.zero_stage) + " is not one of 0, 1, 2, 3");
    if (o_.zero_stage > 1)
      throw dist_error(errc::unsupported, "data_parallel: ZeRO stage " + std::to_string(o_.zero_stage) + " is not built yet (stages 0 and 1 are)");
    if (o_.compression.format != wire_format::none && o_.zero_stage != 0)
      throw dist_error(errc::unsupported,
                       "data_parallel: compressed gradients with ZeRO stage " + std::to_string(o_.zero_stage) + " are not built yet (stage 0 is)");
    if (model_split<Model>::ep(*m_) > 1) {
      const int ep = model_split<Model>::ep(*m_);
      if constexpr (requires { m_->model(); })
        throw dist_error(errc::unsupported, "data_parallel: expert parallelism (ep = " + std::to_string(ep) + ") inside a pipeline is not built yet");
      if (o_.zero_stage != 0)
        throw dist_error(errc::unsupported, "data_parallel: ZeRO stage " + std::to_string(o_.zero_stage) +
                                                " with expert parallelism (ep = " + std::to_string(ep) + ") is not built yet (plain DP is)");
      if (!o_.expert_dp)
        throw dist_error(errc::config,
                         "data_parallel: the model's experts are split over ep = " + std::to_string(ep) +
                             " ranks: data_parallel_options::expert_dp must be the replicas holding the same experts (process_groups::edp())");
      if (o_.expert_dp->size() * ep != dp_->size())
        throw dist_error(errc::config, "data_parallel: expert_dp of " + std::to_string(o_.expert_dp->size()) +
                                           " ranks times ep = " + std::to_string(ep) + " is not dp = " + std::to_string(dp_->size()));
      experts_ = true;
    }
    std::size_t at = 0;
    for (auto& p : m_->params()) {
      members_.push_back(&p);
      starts_.push_back(at);
      at = tessel::detail::add_checked(at, p.numel, "data_parallel: parameter count");
    }
    total_ = at;
    const std::size_t n = std::size_t(dp_->size());
    shard_ = total_ / n + (total_ % n != 0);
    lo_ = std::min(total_, shard_ * std::size_t(dp_->rank()));
    hi_ = std::min(total_, lo_ + shard_);
  }

  Model& model() { return *m_; }
  communicator& dp() const { return *dp_; }
  const data_parallel_options& options() const { return o_; }
  int zero_stage() const { return o_.zero_stage; }
  // Whether p is one of the experts split over ep (data_parallel_options::expert_dp holds its replicas).
  bool expert(const nn::parameter<Dev>& p) const { return experts_ && model_split<Model>::expert(*m_, &p); }
  // ZeRO-1: this rank's AdamW moments, over owned_range() (allocated, zero, on first use), and
  // f(parameter, offset in it, count, offset in the shard) for each piece of that range.
  std::pair<std::span<float>, std::span<float>> shard_moments() {
    if (m_shard_.size() != hi_ - lo_) {
      m_shard_ = device_buffer<float, Dev>::zeros(m_->params().device(), hi_ - lo_);
      v_shard_ = device_buffer<float, Dev>::zeros(m_->params().device(), hi_ - lo_);
    }
    return {m_shard_.span(), v_shard_.span()};
  }
  // Gradient bytes this rank has sent since construction (both phases of each all-reduce; an
  // uncompressed bucket counts as a ring's 2·(n−1)/n·4 bytes per element).
  std::size_t wire_bytes() const { return wire_bytes_; }
  bool has_shard_moments() const { return !m_shard_.empty() || hi_ == lo_; }
  template <class F>
  void for_owned(F&& f) {
    for_range(lo_, hi_, f);
  }
  // The flat range [first, second) of the parameters (registration order) whose optimizer state
  // this rank holds: everything at stage 0.
  std::pair<std::size_t, std::size_t> owned_range() const { return o_.zero_stage == 0 ? std::pair{std::size_t(0), total_} : std::pair{lo_, hi_}; }

  // What this rank holds: the model's parameters and gradients, and the moments (the model's at
  // stage 0, this rank's shard at stage 1).
  memory_use memory() const {
    memory_use u;
    for (const auto* p : members_) {
      u.parameters += p->value.size() * sizeof(float) + p->value_bf16.size() * sizeof(bf16);
      u.gradients += p->grad.size() * sizeof(float);
      u.optimizer_state += (p->m.size() + p->v.size()) * sizeof(float);
    }
    u.optimizer_state += (m_shard_.size() + v_shard_.size()) * sizeof(float);
    return u;
  }

  // Every replica's parameters <- rank `root`'s (so replicas start identical whatever each did).
  void broadcast_parameters(int root = 0) {
    for (auto& p : m_->params()) dp_->broadcast(p.value.span(), root);
    m_->params().refresh_bf16();
  }

  // Zeroes the gradients, runs this rank's forward and backward on its (batch, seq) share, and
  // averages the gradients over dp (stage 1: only this rank's shard of them holds the average; the
  // rest keep this rank's own gradients). Returns the mean loss over every rank's counted tokens.
  double forward_backward(std::span<const std::int64_t> ids, std::span<const std::int64_t> targets, std::size_t batch, std::size_t seq,
                          std::int64_t ignore_index = -100) {
    m_->params().zero_grad();
    // Counted tokens per rank: each rank's gradient is of its own mean; weight it by its share.
    double cnt = double(std::count_if(targets.begin(), targets.end(), [&](std::int64_t t) { return t != ignore_index; }));
    std::vector<double> counts(std::size_t(dp_->size()));
    dp_->all_gather(std::span<const double>(&cnt, 1), std::span<double>(counts));
    double total = 0.0;
    for (double c : counts) total += c;
    const float w = total > 0.0 ? float(cnt * double(dp_->size()) / total) : 0.0f;
    bool equal = true;
    for (double c : counts) equal = equal && c == counts[0];
    double local = 0.0;
    if constexpr (requires { m_->forward_backward(ids, targets, batch, seq, ignore_index, 1.0f); }) {
      // experts mix the ranks' tokens: scale the loss gradient itself (dp / total per row: the mean
      // over the whole batch, times dp for the average below)
      if (experts_)
        local = m_->forward_backward(ids, targets, batch, seq, ignore_index, total > 0.0 ? float(double(dp_->size()) / total) : 0.0f);
      else
        local = m_->forward_backward(ids, targets, batch, seq, ignore_index);
    } else {
      local = m_->forward_backward(ids, targets, batch, seq, ignore_index);
    }
    if (!equal && !experts_)
      for (auto& p : m_->params())
        for (float& g : p.grad.span()) g *= w;
    if (o_.zero_stage == 0)
      all_reduce_gradients();
    else
      reduce_scatter_gradients();
    double sum = local * cnt;
    double global = 0.0;
    dp_->all_reduce(std::span<const double>(&sum, 1), std::span<double>(&global, 1), reduce_op::sum);
    return total > 0.0 ? global / total : 0.0;
  }

  // forward_backward, then one AdamW step (the same on every replica).
  double step(std::span<const std::int64_t> ids, std::span<const std::int64_t> targets, std::size_t batch, std::size_t seq, const nn::adamw_config& h,
              std::uint64_t step_no, std::int64_t ignore_index = -100) {
    const double loss = forward_backward(ids, targets, batch, seq, ignore_index);
    adamw(h, step_no);
    return loss;
  }

  // One AdamW step after forward_backward, the same on every replica: stage 0 the model's own;
  // stage 1 this rank's shard (the finiteness check and the clipping norm taken over every shard,
  // one all-reduce), then the parameters all-gathered.
  step_result adamw(const nn::adamw_config& h, std::uint64_t step_no) {
    // fp16 projections: every replica strikes on the step's overflow anywhere (the largest amax
    // over dp), so all move the same projections at the same step and stay one model; dp rank 0 logs
    m_->share_fp16_overflow([&](std::span<float> amax) { dp_->all_reduce(amax, reduce_op::max); }, dp_->rank() == 0);
    if (o_.zero_stage == 0) return m_->adamw(h, step_no);
    if (h.lazy_rows)
      throw dist_error(errc::unsupported, "data_parallel: lazy rows (adamw_config::lazy_rows) with ZeRO-1: a shard's rows are not whole");
    // over every dp shard, and with a tensor-parallel model over its tp group too (the dp-averaged
    // gradients are the same on a tp rank's dp peers, so dp shards times tp shards are all of them)
    grad_check gc(h.max_grad_norm);
    for_range(lo_, hi_, [&](nn::parameter<Dev>& p, std::size_t off, std::size_t cnt, std::size_t) {
      gc.add(p.grad.cspan().subspan(off, cnt), model_split<Model>::counted(*m_, &p));
    });
    gc.reduce(*dp_);
    for (communicator* g : model_split<Model>::groups(*m_)) gc.reduce(*g);
    step_result res;
    if (gc.found_inf()) {
      res.found_inf = res.skipped = true;
      m_->note_step(res);
      return res;
    }
    const float ls = m_->loss_scale();  // the model's loss scaler (set_loss_scaler), 1 without one
    Dev& dev = m_->params().device();
    shard_moments();
    std::vector<optim_tensor<float, float>> ts;
    for_range(lo_, hi_, [&](nn::parameter<Dev>& p, std::size_t off, std::size_t cnt, std::size_t at) {
      ts.push_back(nn::optim_part(p, off, cnt, m_shard_.span().subspan(at, cnt), v_shard_.span().subspan(at, cnt)));
    });
    step_options so;
    so.storage = std::is_same_v<T, bf16> ? param_storage::bf16_master : param_storage::f32;
    so.check_finite = false;              // checked above, over every shard
    so.loss_scale = gc.clip_divisor(ls);  // the loss scale, and PyTorch's clip_grad_norm_, as the step's gradient divisor
    if (!ts.empty()) res = adamw_step(dev, std::span<const optim_tensor<float, float>>(ts), h.hyper, step_no, so);
    res.grad_norm = gc.norm(ls);
    all_gather_parameters();
    m_->note_step(res);
    return res;
  }

  // The gradients averaged over dp, bucket by bucket in registration order (experts' over expert_dp).
  void all_reduce_gradients() {
    reduce_buckets(*dp_, false);
    if (experts_) reduce_buckets(*o_.expert_dp, true);
  }

 private:
  // Buckets of the non-expert (experts = false) or the expert parameters, averaged over dp: the
  // former all-reduced to their average over g = dp, the latter summed over g = expert_dp and
  // divided by dp.
  void reduce_buckets(communicator& g, bool experts) {
    const bool sum = experts;
    const float scale = 1.0f / float(dp_->size());
    std::size_t bucket_no = 0;
    auto reduce = [&](std::span<float> v) {
      const std::size_t k = bucket_no++;
      const reduce_op op = sum ? reduce_op::sum : reduce_op::avg;
      if (g.size() > 1) {
        if (o_.compression.format != wire_format::none) {
          auto& efs = experts ? ef_experts_ : ef_dense_;
          if (efs.size() <= k) efs.resize(k + 1);
          wire_bytes_ += all_reduce_compressed(g, v, v, op, o_.compression, o_.error_feedback ? &efs[k] : nullptr).bytes_sent;
        } else {
          g.all_reduce(v, op);
          wire_bytes_ += 2 * v.size() * sizeof(float) * std::size_t(g.size() - 1) / std::size_t(g.size());
        }
      }
      if (sum)
        for (float& x : v) x *= scale;
    };
    const std::size_t cap = o_.bucket_bytes / sizeof(float);
    std::vector<nn::parameter<Dev>*> members;
    std::size_t fill = 0;
    auto flush = [&] {
      if (members.empty()) return;
      if (members.size() == 1) {
        reduce(members[0]->grad.span());
      } else {
        if (bucket_.size() < fill) bucket_ = std::vector<float>(fill);
        std::size_t at = 0;
        for (auto* p : members) at = std::copy_n(p->grad.data(), p->numel, bucket_.begin() + std::ptrdiff_t(at)) - bucket_.begin();
        reduce(std::span<float>(bucket_.data(), fill));
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
      if ((experts_ && model_split<Model>::expert(*m_, &p)) != experts) continue;
      if (fill > 0 && fill + p.numel > cap) flush();
      members.push_back(&p);
      fill += p.numel;
    }
    flush();
  }

  // Calls f(parameter, offset in it, count, offset from a) for each piece of the flat range [a, b).
  template <class F>
  void for_range(std::size_t a, std::size_t b, F&& f) {
    if (a >= b) return;
    std::size_t i = std::size_t(std::upper_bound(starts_.begin(), starts_.end(), a) - starts_.begin()) - 1;
    for (std::size_t at = a; at < b; ++i) {
      nn::parameter<Dev>& p = *members_[i];
      const std::size_t off = at - starts_[i], cnt = std::min(b - at, p.numel - off);
      if (cnt > 0) f(p, off, cnt, at - a);
      at += cnt;
    }
  }
  std::size_t chunk_elems() const { return std::max<std::size_t>(1, o_.bucket_bytes / sizeof(float)); }
  float* staging(std::size_t n) {
    if (bucket_.size() < n) bucket_ = std::vector<float>(n);
    return bucket_.data();
  }

  // Stage 1: rank q receives the average of flat gradient shard q, chunk by chunk (the same rank
  // order per element as all_reduce_gradients).
  void reduce_scatter_gradients() {
    const std::size_t n = std::size_t(dp_->size()), cap = std::max<std::size_t>(1, chunk_elems() / n);
    for (std::size_t c0 = 0; c0 < shard_; c0 += cap) {
      const std::size_t c = std::min(cap, shard_ - c0);
      float* buf = staging(n * c + c);
      std::fill_n(buf, n * c, 0.0f);  // past the end of the parameters: padding
      for (std::size_t q = 0; q < n; ++q) {
        const std::size_t a = std::min(total_, q * shard_ + c0);
        for_range(a, std::min(total_, a + c), [&](nn::parameter<Dev>& p, std::size_t off, std::size_t cnt, std::size_t at) {
          std::copy_n(p.grad.data() + off, cnt, buf + q * c + at);
        });
      }
      float* out = buf + n * c;
      dp_->reduce_scatter(std::span<const float>(buf, n * c), std::span<float>(out, c), reduce_op::avg);
      const std::size_t a = std::min(hi_, lo_ + c0);
      for_range(a, std::min(hi_, a + c),
                [&](nn::parameter<Dev>& p, std::size_t off, std::size_t cnt, std::size_t at) { std::copy_n(out + at, cnt, p.grad.data() + off); });
    }
  }

  // Stage 1: every rank's updated shard of the f32 values to every rank, then the bf16 copies.
  void all_gather_parameters() {
    const std::size_t n = std::size_t(dp_->size()), cap = std::max<std::size_t>(1, chunk_elems() / n);
    for (std::size_t c0 = 0; c0 < shard_; c0 += cap) {
      const std::size_t c = std::min(cap, shard_ - c0);
      float* buf = staging(c + n * c);
      std::fill_n(buf, c, 0.0f);
      const std::size_t a = std::min(hi_, lo_ + c0);
      for_range(a, std::min(hi_, a + c),
                [&](nn::parameter<Dev>& p, std::size_t off, std::size_t cnt, std::size_t at) { std::copy_n(p.value.data() + off, cnt, buf + at); });
      float* out = buf + c;
      dp_->all_gather(std::span<const float>(buf, c), std::span<float>(out, n * c));
      for (std::size_t q = 0; q < n; ++q) {
        const std::size_t b = std::min(total_, q * shard_ + c0);
        for_range(b, std::min(total_, b + c), [&](nn::parameter<Dev>& p, std::size_t off, std::size_t cnt, std::size_t at) {
          std::copy_n(out + q * c + at, cnt, p.value.data() + off);
        });
      }
    }
    m_->params().refresh_bf16();
  }

  Model* m_;
  communicator* dp_;
  data_parallel_options o_;
  bool experts_ = false;                               // the model's experts are split over ep > 1 ranks
  std::vector<error_feedback> ef_dense_, ef_experts_;  // compressed buckets' residuals, by bucket
  std::size_t wire_bytes_ = 0;
  std::vector<float> bucket_;                            // host staging of a bucket (device memory is host-addressable here)
  std::vector<nn::parameter<Dev>*> members_;             // the registry in order
  std::vector<std::size_t> starts_;                      // each one's first flat index
  std::size_t total_ = 0, shard_ = 0, lo_ = 0, hi_ = 0;  // P, ceil(P / dp), this rank's shard [lo, hi)
  device_buffer<float, Dev> m_shard_, v_shard_;          // stage 1: this shard's AdamW moments
};

}  // namespace dist
}  // namespace v0
}  // namespace tessel
