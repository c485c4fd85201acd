// Vocabulary-parallel embedding and LM head with cross-entropy (Megatron-LM's
// VocabParallelEmbedding and vocab_parallel_cross_entropy): the (V, hidden) tables are split by
// rows over tp, so no rank holds the whole vocabulary and the (N, V) logits are never gathered.
//
// Shard rule (V need not be divisible by tp): with q = V / tp and e = V % tp, rank r holds rows
// [r·q + min(r, e), … + q + (r < e)): the first e ranks hold one row more. Every rank must hold at
// least one row (V >= tp), else the constructors raise a dist_error naming V and tp.
//
//   vocab_parallel_embedding  forward: each rank writes the rows it owns and −0.0 for ids it does
//                             not own, then one all-reduce (sum) → the full (N, hidden) output on
//                             every rank. A sum of one value and −0.0s is that value exactly (−0.0,
//                             not +0.0, is the additive identity of IEEE addition: +0.0 would turn a
//                             −0.0 table entry into +0.0), so the output is bitwise the one-device
//                             lookup. Backward: dout is the same on every rank; each rank adds it into
//                             its own rows, in token order (as ops' embedding_backward), no
//                             communication.
//   vocab_parallel_lm_head    loss(x, labels) = mean over non-ignored rows of log Σ_v e^{z_v} − z_y,
//                             z = x Wᵀ, from local logits z_r = x W_rᵀ (N, V_r):
//                               M   = max over tp of the local row maxima       all-reduce (max), N floats
//                               S   = Σ over tp of Σ_local e^{z − M};           one all-reduce (sum)
//                               z_y = the label's logit from its owner (−0.0      of 2N floats
//                                     from the others)
//                               row loss = (M + log S) − z_y
//                             gradient: dz_r = (softmax − onehot)/count on this rank's columns,
//                             dW_r += dz_rᵀ x locally, dx = Σ_r dz_r W_r: one all-reduce (sum).
//                             The per-row arithmetic is ops' cross_entropy's (same exp_fast, same
//                             softmax = e^{z−M}·e^{M−lse}): against one device only the grouping of
//                             S's sum (and of dx's K = V sum) differs while V fits one of its 4096-
//                             column blocks (beyond, it rescales per block: one more rounding).
//                             No label smoothing (ops' cross_entropy has it; not carried over yet).
// With tp = 1 the loss is ops' cross_entropy itself (nn::decoder_lm's head, bit for bit).
// Every sum is in tp-rank order (the communicator's fixed order), so every rank gets the same bits.
// x and labels must be the same on every tp rank (the replicated input of a tensor-parallel layer).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

#include <tessel/arch/stream.hpp>
#include <tessel/collectives/communicator.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/dist/tensor_parallel.hpp>
#include <tessel/nn/layers.hpp>
#include <tessel/nn/parameters.hpp>
#include <tessel/ops/loss.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

// The rows [offset, offset + length) of a V-row table that a tp rank holds (the rule above).
struct vocab_range {
  std::size_t offset = 0, length = 0;
  bool contains(std::int64_t id) const { return id >= 0 && std::uint64_t(id) >= offset && std::uint64_t(id) - offset < length; }
};

inline vocab_range vocab_rows(std::size_t vocab, std::size_t tp_size, std::size_t rank) {
  if (tp_size == 0 || rank >= tp_size)
    throw dist_error(errc::invalid_argument, "vocab_rows: rank " + std::to_string(rank) + " of tp = " + std::to_string(tp_size));
  if (vocab < tp_size)
    throw dist_error(errc::config, "vocabulary-parallel layer: V = " + std::to_string(vocab) + " rows over tp = " + std::to_string(tp_size) +
                                       " leaves " + std::to_string(tp_size - vocab) + " rank(s) with no rows (every rank needs one: V >= tp)");
  const std::size_t q = vocab / tp_size, e = vocab % tp_size;
  return {rank * q + std::min(rank, e), q + (rank < e ? 1 : 0)};
}

namespace detail {
inline vocab_range vocab_rows_of(std::size_t vocab, const communicator& tp) {
  return vocab_rows(vocab, std::size_t(tp.size()), std::size_t(tp.rank()));
}
}  // namespace detail

// The token embedding (V, hidden), registered as a row shard of `name` (HF: "model.embed_tokens.weight").
template <device Dev>
class vocab_parallel_embedding {
 public:
  vocab_parallel_embedding() = default;
  // with_bf16: keep a bf16 copy too (a bf16 LM head tied to this table reads it).
  vocab_parallel_embedding(nn::parameters<Dev>& reg, const std::string& name, std::size_t vocab, std::size_t hidden, communicator& tp,
                           bool with_bf16 = false)
      : tp_(&tp), vocab_(vocab), hidden_(hidden), rows_(detail::vocab_rows_of(vocab, tp)) {
    if (hidden == 0) throw dist_error(errc::invalid_argument, "vocab_parallel_embedding: hidden size 0");
    w_ = &reg.add_shard(name, {vocab, hidden}, 0, rows_.offset, rows_.length, with_bf16);
    w_->sparse_row = hidden;
  }
  std::size_t vocab() const { return vocab_; }  // the full table's
  std::size_t hidden() const { return hidden_; }
  vocab_range rows() const { return rows_; }
  nn::parameter<Dev>* weight() const { return w_; }
  communicator& tp() const { return *tp_; }

  // out (N, hidden) f32, contiguous = table[ids], the same bits on every tp rank and as one device;
  // or this rank's N/tp rows of it (sequence parallelism: a reduce-scatter instead of an
  // all-reduce). An id outside [0, V) is a dist_error(out_of_range) naming it (raised on every
  // rank, before any communication, since ids are the same on every rank).
  void forward(Dev& dev, std::span<const std::int64_t> ids, mview<float> out) {
    const bool local = out.rows() != ids.size() && out.rows() * std::size_t(tp_->size()) == ids.size();
    check(ids, local ? ids.size() : out.rows(), out.cols(), "forward: out");
    auto& ws = ws_.get();
    mview<float> full = out;
    if (local) {
      dist::detail::ensure(dev, ws.partial, ids.size() * hidden_);
      full = nn::rows_view<float>(ws.partial, ids.size(), hidden_);
    }
    const float* w = w_->value.data();
    for (std::size_t t = 0; t < ids.size(); ++t) {
      const bool own = rows_.contains(ids[t]);
      const float* src = own ? w + (std::size_t(ids[t]) - rows_.offset) * hidden_ : nullptr;
      for (std::size_t c = 0; c < hidden_; ++c) full(t, c) = own ? src[c] : -0.0f;
    }
    dist::detail::sum_partials(dev, *tp_, full, out, false, ws.sum, "vocab_parallel_embedding");
  }
  void share_workspace(dist::detail::tp_workspace<Dev>& w) { ws_.share(w); }
  // dW_r (own rows) += dout rows of the tokens this rank owns, in token order. No communication.
  void backward(Dev&, std::span<const std::int64_t> ids, cview<float> dout) {
    check(ids, dout.rows(), dout.cols(), "backward: dout");
    float* g = w_->grad.data();
    for (std::size_t t = 0; t < ids.size(); ++t) {
      if (!rows_.contains(ids[t])) continue;
      float* dst = g + (std::size_t(ids[t]) - rows_.offset) * hidden_;
      for (std::size_t c = 0; c < hidden_; ++c) dst[c] += dout(t, c);
    }
  }

 private:
  void check(std::span<const std::int64_t> ids, std::size_t rows, std::size_t cols, const char* what) const {
    if (rows != ids.size() || cols != hidden_)
      throw dist_error(errc::invalid_argument, std::string("vocab_parallel_embedding: ") + what + " is (" + std::to_string(rows) + ", " +
                                                   std::to_string(cols) + "), needs (" + std::to_string(ids.size()) +
                                                   " ids, hidden = " + std::to_string(hidden_) + ")");
    for (std::size_t t = 0; t < ids.size(); ++t)
      if (ids[t] < 0 || std::uint64_t(ids[t]) >= vocab_)
        throw dist_error(errc::out_of_range, "vocab_parallel_embedding: id " + std::to_string(ids[t]) + " of token " + std::to_string(t) +
                                                 " is outside [0, V = " + std::to_string(vocab_) + ")");
  }
  communicator* tp_ = nullptr;
  std::size_t vocab_ = 0, hidden_ = 0;
  vocab_range rows_;
  nn::parameter<Dev>* w_ = nullptr;
  dist::detail::workspace_ref<Dev> ws_;
};

// The LM head W (V, hidden) split by rows, fused with the mean cross-entropy (no label smoothing).
template <device Dev, compute_type T>
class vocab_parallel_lm_head {
 public:
  vocab_parallel_lm_head() = default;
  // Its own weight: a row shard of `name` (HF: "lm_head.weight"; bf16 models keep a bf16 copy).
  vocab_parallel_lm_head(nn::parameters<Dev>& reg, const std::string& name, std::size_t vocab, std::size_t hidden, communicator& tp)
      : tp_(&tp), vocab_(vocab), hidden_(hidden), rows_(detail::vocab_rows_of(vocab, tp)) {
    if (hidden == 0) throw dist_error(errc::invalid_argument, "vocab_parallel_lm_head: hidden size 0");
    nn::parameter<Dev>* w = &reg.add_shard(name, {vocab, hidden}, 0, rows_.offset, rows_.length, std::is_same_v<T, bf16>);
    lin_ = nn::linear<Dev, T>(w, nullptr, hidden, rows_.length);
  }
  // Tied to the embedding (tie_word_embeddings): the same shard, so both gradients add into its
  // grad. A bf16 head needs the embedding built with_bf16.
  explicit vocab_parallel_lm_head(vocab_parallel_embedding<Dev>& tied)
      : tp_(&tied.tp()), vocab_(tied.vocab()), hidden_(tied.hidden()), rows_(tied.rows()) {
    if (std::is_same_v<T, bf16> && tied.weight()->value_bf16.empty())
      throw dist_error(errc::config, "vocab_parallel_lm_head: a bf16 head tied to '" + tied.weight()->name + "' needs the embedding built with_bf16");
    lin_ = nn::linear<Dev, T>(tied.weight(), nullptr, hidden_, rows_.length);
  }
  std::size_t vocab() const { return vocab_; }
  std::size_t hidden() const { return hidden_; }
  vocab_range rows() const { return rows_; }
  nn::parameter<Dev>* weight() const { return lin_.weight(); }
  nn::linear<Dev, T>& local() { return lin_; }
  void share_workspace(dist::detail::tp_workspace<Dev>& w) { ws_.share(w); }

  // The mean cross-entropy of x W ᵀ (x (N, hidden)) against labels (N; ignore_index rows count for
  // nothing), the same on every tp rank; counted = the rows not ignored. With a non-empty dx
  // (N, hidden, contiguous f32; or this rank's N/tp rows of it, sequence parallelism) the gradient
  // runs too: dx = d loss / dx (overwritten), and this rank's dW accumulates into the weight's
  // grad. An empty dx: the loss only (evaluation). grad_scale multiplies the gradient of the summed
  // row losses (NaN, the default: 1 / counted, the mean's; a pipeline's micro-batch passes
  // 1 / the whole batch's count).
  // A label outside [0, V) (other than ignore_index) is a dist_error(out_of_range) naming it.
  cross_entropy_result loss(Dev& dev, cview<T> x, std::span<const std::int64_t> labels, mview<float> dx, std::int64_t ignore_index = -100,
                            float grad_scale = std::numeric_limits<float>::quiet_NaN()) {
    const std::size_t n = x.rows(), len = rows_.length;
    const bool grad = dx.data() != nullptr;
    const bool local_dx = grad && dx.rows() != n && dx.rows() * std::size_t(tp_->size()) == n;
    if (x.cols() != hidden_ || labels.size() != n || (grad && ((dx.rows() != n && !local_dx) || dx.cols() != hidden_)))
      throw dist_error(errc::invalid_argument, "vocab_parallel_lm_head: x (" + std::to_string(n) + ", " + std::to_string(x.cols()) + "), " +
                                                   std::to_string(labels.size()) + " labels and dx (" + std::to_string(dx.rows()) + ", " +
                                                   std::to_string(dx.cols()) + ") for hidden = " + std::to_string(hidden_));
    cross_entropy_result res;
    for (std::size_t i = 0; i < n; ++i) {
      const std::int64_t l = labels[i];
      if (l == ignore_index) continue;
      if (l < 0 || std::uint64_t(l) >= vocab_)
        throw dist_error(errc::out_of_range, "vocab_parallel_lm_head: label " + std::to_string(l) + " of row " + std::to_string(i) +
                                                 " is outside [0, V = " + std::to_string(vocab_) + ")");
      ++res.counted;
    }
    if (tp_->size() == 1) return whole_vocab_loss(dev, x, labels, dx, ignore_index, grad_scale);
    constexpr float ninf = -std::numeric_limits<float>::infinity();
    detail::ensure(dev, z_, n * len);
    detail::ensure(dev, st_, 3 * n);
    const mview<float> z = nn::rows_view<float>(z_, n, len);  // (N, V_r) logits, then e^{z − M}
    float* mx = st_.data();                                   // (N) row maxima
    float* se = st_.data() + n;                               // (2N) [S | z_y]
    lin_.forward(dev, x, z, grad);
    for (std::size_t i = 0; i < n; ++i) {
      float m = ninf;
      if (labels[i] != ignore_index)
        for (std::size_t j = 0; j < len; ++j) m = std::max(m, z(i, j));
      mx[i] = m;
    }
    tp_->all_reduce(std::span<float>(mx, n), reduce_op::max);
    for (std::size_t i = 0; i < n; ++i) {
      float s = 0.0f, zy = -0.0f;  // −0.0: the owner's z_y comes through the sum unchanged
      if (labels[i] != ignore_index) {
        if (rows_.contains(labels[i])) zy = z(i, std::size_t(labels[i]) - rows_.offset);
        for (std::size_t j = 0; j < len; ++j) {
          const float e = arch::stream::exp_fast(z(i, j) - mx[i]);
          z(i, j) = e;
          s += e;
        }
      }
      se[i] = s;
      se[n + i] = zy;
    }
    tp_->all_reduce(std::span<float>(se, 2 * n), reduce_op::sum);
    // Row losses in row order, as cross_entropy does (ignored rows add nothing).
    double sum = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      if (labels[i] == ignore_index) continue;
      const float lse = mx[i] + std::log(se[i]);
      sum += double(lse - se[n + i]);
      mx[i] = arch::stream::exp_fast(mx[i] - lse);  // e^{M − lse}: softmax = e^{z − M}·e^{M − lse}
    }
    res.loss = res.counted ? sum / double(res.counted) : 0.0;
    if (!grad) return res;

    const float scale = !std::isnan(grad_scale) ? grad_scale : res.counted ? 1.0f / float(res.counted) : 0.0f;
    detail::ensure(dev, dz_, n * len);
    const mview<T> dz = nn::rows_view<T>(dz_, n, len);  // (N, V_r)
    for (std::size_t i = 0; i < n; ++i) {
      const bool counted = labels[i] != ignore_index;
      for (std::size_t j = 0; j < len; ++j) dz(i, j) = T(counted ? scale * (z(i, j) * mx[i]) : 0.0f);
      if (counted && rows_.contains(labels[i])) {
        const std::size_t y = std::size_t(labels[i]) - rows_.offset;
        dz(i, y) = T(scale * (z(i, y) * mx[i] - 1.0f));
      }
    }
    auto& ws = ws_.get();
    mview<float> part = dx;  // dx = Σ_r dz_r W_r; dW_r += dz_rᵀ x
    if (local_dx) {
      dist::detail::ensure(dev, ws.partial, n * hidden_);
      part = nn::rows_view<float>(ws.partial, n, hidden_);
    }
    lin_.backward(dev, nn::crows_view<T>(dz_, n, len), part, false);
    dist::detail::sum_partials(dev, *tp_, part, dx, false, ws.sum, "vocab_parallel_lm_head");
    return res;
  }

 private:
  // One rank holds the whole vocabulary: the loss is ops' fused cross_entropy over the logits (with
  // dlogits in the compute type), exactly nn::decoder_lm's head, so a tp = 1 model is its bits.
  cross_entropy_result whole_vocab_loss(Dev& dev, cview<T> x, std::span<const std::int64_t> labels, mview<float> dx, std::int64_t ignore_index,
                                        float grad_scale) {
    const std::size_t n = x.rows();
    const bool grad = dx.data() != nullptr;
    detail::ensure(dev, z_, n * vocab_);
    const mview<float> z = nn::rows_view<float>(z_, n, vocab_);
    lin_.forward(dev, x, z, grad);
    cross_entropy_options co;
    co.ignore_index = ignore_index;
    co.grad_scale = grad_scale;
    if (!grad) return cross_entropy(dev, nn::cview<float>(z), labels, mview<float>{}, {}, co);
    detail::ensure(dev, dz_, n * vocab_);
    const auto r = cross_entropy(dev, nn::cview<float>(z), labels, nn::rows_view<T>(dz_, n, vocab_), {}, co);
    lin_.backward(dev, nn::crows_view<T>(dz_, n, vocab_), dx, false);
    return r;
  }

  communicator* tp_ = nullptr;
  std::size_t vocab_ = 0, hidden_ = 0;
  vocab_range rows_;
  nn::linear<Dev, T> lin_;
  device_buffer<float, Dev> z_, st_;
  device_buffer<T, Dev> dz_;
  dist::detail::workspace_ref<Dev> ws_;
};

}  // namespace dist
}  // namespace v0
}  // namespace tessel
