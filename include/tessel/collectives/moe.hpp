// MoE dispatch and combine with DeepEP's semantics, over any communicator.
//   dispatch: each token goes once to every rank that holds one of its top-k experts (experts are
//   split evenly: rank r holds experts [r*E/n, (r+1)*E/n)); the receiver gets the rows grouped by
//   local expert (a token appears once per local expert it chose), per-expert counts and a handle.
//   FP8 dispatch carries E4M3 data with one FP32 scale per 128 channels (amax/448).
//   combine: each expert rank sums w * y over the rows of a token in FP32 (rows in expert order),
//   sends that partial back in BF16, and the home rank adds the partials in rank order in FP32 and
//   rounds once to BF16. Tokens without experts come back as zeros.
//   Backward: dispatch_backward (a combine with unit weights) and combine_backward (a dispatch of
//   the output gradient, scaled by each row's weight).
// topk_idx = -1 means "no expert" for that slot; any other index outside [0, E) is out_of_range.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <tessel/collectives/communicator.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel {
inline namespace v0 {

// Routing recorded by dispatch, used by combine and the backward passes.
struct moe_handle {
  std::size_t num_tokens = 0, hidden = 0, top_k = 0;
  int num_experts = 0, ranks = 0;
  // send side: tokens sent to each rank, in order (a token appears once per destination rank)
  std::vector<std::vector<std::int64_t>> sent_tokens;
  // receive side: distinct received tokens (by source rank, then token order) and, per row, which
  std::vector<int> recv_src_rank;
  std::vector<std::int64_t> recv_src_token;
  std::vector<std::size_t> recv_per_rank;  // distinct tokens received from each rank
  std::vector<std::size_t> row_token;      // row -> index into the distinct received tokens
  std::vector<int> row_k;                  // row -> top-k slot on its home rank
  std::vector<int> row_expert;             // row -> local expert
  std::vector<float> row_weight;           // row -> top-k weight
  std::vector<std::size_t> tokens_per_expert;
  std::size_t rows() const { return row_token.size(); }
};

template <class X>
struct moe_dispatch_result {
  std::vector<X> x;          // (rows, hidden), grouped by local expert
  std::vector<float> scales;  // (rows, hidden/128) for FP8 dispatch, empty otherwise
  moe_handle handle;
  const std::vector<std::size_t>& tokens_per_expert() const { return handle.tokens_per_expert; }
  const std::vector<float>& weights() const { return handle.row_weight; }
};

namespace moe_detail {
inline void check_routing(const communicator& c, std::size_t tokens, std::size_t hidden, std::size_t top_k,
                          std::span<const std::int64_t> idx, std::span<const float> w, int num_experts) {
  if (num_experts <= 0 || num_experts % c.size() != 0)
    throw std::invalid_argument("tessel::moe: num_experts " + std::to_string(num_experts) + " must be a positive multiple of the rank count " +
                                std::to_string(c.size()));
  if (hidden == 0) throw std::invalid_argument("tessel::moe: hidden must be positive");
  if (tokens > 0 && top_k == 0) throw std::invalid_argument("tessel::moe: top_k must be positive");
  if (tokens && top_k > std::numeric_limits<std::size_t>::max() / tokens) throw std::overflow_error("tessel::moe: tokens * top_k overflows");
  if (idx.size() != tokens * top_k || w.size() != tokens * top_k)
    throw std::length_error("tessel::moe: topk_idx and topk_weights must hold tokens * top_k entries");
  for (std::int64_t e : idx)
    if (e < -1 || e >= num_experts)
      throw std::out_of_range("tessel::moe: expert index " + std::to_string(e) + " outside [0, " + std::to_string(num_experts) +
                              ") (use -1 for no expert)");
}

// Exchanges per-rank byte buffers (all_to_allv of bytes); returns what each rank sent us.
inline std::vector<std::vector<std::byte>> moe_exchange(communicator& c, const std::vector<std::vector<std::byte>>& out) {
  const auto n = static_cast<std::size_t>(c.size());
  std::vector<std::uint64_t> sc(n), rc(n);
  for (std::size_t q = 0; q < n; ++q) sc[q] = out[q].size();
  c.all_to_all(sc.data(), rc.data(), 1, dtype::u64);
  std::vector<std::size_t> scount(n), sdisp(n), rcount(n), rdisp(n);
  std::size_t st = 0, rt = 0;
  for (std::size_t q = 0; q < n; ++q) {
    scount[q] = sc[q], sdisp[q] = st, st += sc[q];
    rcount[q] = rc[q], rdisp[q] = rt, rt += rc[q];
  }
  std::vector<std::byte> sb(st), rb(rt);
  for (std::size_t q = 0; q < n; ++q)
    if (sc[q]) std::memcpy(sb.data() + sdisp[q], out[q].data(), sc[q]);
  c.all_to_allv(sb.data(), scount, sdisp, rb.data(), rcount, rdisp, dtype::u8);
  std::vector<std::vector<std::byte>> in(n);
  for (std::size_t q = 0; q < n; ++q) in[q].assign(rb.begin() + static_cast<std::ptrdiff_t>(rdisp[q]), rb.begin() + static_cast<std::ptrdiff_t>(rdisp[q] + rc[q]));
  return in;
}

// Shared body of both dispatches: payload_bytes per token (data [+ scales]).
template <class X>
moe_dispatch_result<X> dispatch(communicator& c, const std::byte* payload, std::size_t payload_bytes, std::size_t data_bytes,
                                std::size_t tokens, std::size_t hidden, std::size_t top_k,
                                std::span<const std::int64_t> idx, std::span<const float> w, int num_experts) {
  check_routing(c, tokens, hidden, top_k, idx, w, num_experts);
  const int n = c.size(), epr = num_experts / n;
  moe_dispatch_result<X> res;
  moe_handle& h = res.handle;
  h.num_tokens = tokens, h.hidden = hidden, h.top_k = top_k, h.num_experts = num_experts, h.ranks = n;
  h.sent_tokens.assign(static_cast<std::size_t>(n), {});
  const std::size_t rec = sizeof(std::int64_t) + payload_bytes + top_k * (sizeof(std::int64_t) + sizeof(float));
  std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(n));
  std::vector<char> seen(static_cast<std::size_t>(n));
  for (std::size_t t = 0; t < tokens; ++t) {
    std::fill(seen.begin(), seen.end(), 0);
    for (std::size_t k = 0; k < top_k; ++k) {
      const std::int64_t e = idx[t * top_k + k];
      if (e < 0) continue;
      const auto q = static_cast<std::size_t>(e / epr);
      if (seen[q]) continue;  // once per destination rank
      seen[q] = 1;
      h.sent_tokens[q].push_back(static_cast<std::int64_t>(t));
      auto& b = out[q];
      const std::size_t at = b.size();
      b.resize(at + rec);
      const auto tok = static_cast<std::int64_t>(t);
      std::memcpy(b.data() + at, &tok, sizeof tok);
      std::memcpy(b.data() + at + 8, payload + t * payload_bytes, payload_bytes);
      std::memcpy(b.data() + at + 8 + payload_bytes, idx.data() + t * top_k, top_k * 8);
      std::memcpy(b.data() + at + 8 + payload_bytes + top_k * 8, w.data() + t * top_k, top_k * 4);
    }
  }
  const auto in = moe_exchange(c, out);
  // distinct received tokens
  std::vector<const std::byte*> recs;
  h.recv_per_rank.assign(static_cast<std::size_t>(n), 0);
  for (int q = 0; q < n; ++q) {
    const auto& b = in[static_cast<std::size_t>(q)];
    if (b.size() % rec) throw std::length_error("tessel::moe: peers disagree on hidden or top_k");
    for (std::size_t at = 0; at < b.size(); at += rec) {
      std::int64_t tok;
      std::memcpy(&tok, b.data() + at, 8);
      recs.push_back(b.data() + at);
      h.recv_src_rank.push_back(q);
      h.recv_src_token.push_back(tok);
      ++h.recv_per_rank[static_cast<std::size_t>(q)];
    }
  }
  // rows grouped by local expert, then by received token, then by k
  h.tokens_per_expert.assign(static_cast<std::size_t>(epr), 0);
  const std::int64_t first = static_cast<std::int64_t>(c.rank()) * epr;
  for (int e = 0; e < epr; ++e)
    for (std::size_t u = 0; u < recs.size(); ++u)
      for (std::size_t k = 0; k < top_k; ++k) {
        std::int64_t g;
        std::memcpy(&g, recs[u] + 8 + payload_bytes + k * 8, 8);
        if (g != first + e) continue;
        float wt;
        std::memcpy(&wt, recs[u] + 8 + payload_bytes + top_k * 8 + k * 4, 4);
        h.row_token.push_back(u);
        h.row_k.push_back(static_cast<int>(k));
        h.row_expert.push_back(e);
        h.row_weight.push_back(wt);
        ++h.tokens_per_expert[static_cast<std::size_t>(e)];
      }
  const std::size_t rows = h.rows();
  res.x.resize(rows * hidden);
  const std::size_t sb = payload_bytes - data_bytes;
  res.scales.resize(rows * sb / sizeof(float));
  for (std::size_t i = 0; i < rows; ++i) {
    const std::byte* p = recs[h.row_token[i]] + 8;
    std::memcpy(res.x.data() + i * hidden, p, data_bytes);
    if (sb) std::memcpy(res.scales.data() + i * sb / sizeof(float), p + data_bytes, sb);
  }
  return res;
}

// Expert side of a combine: per received token, sum_w * y over its rows (FP32, row order), as BF16;
// home side: add the partials in rank order (FP32), round once.
inline std::vector<bf16> combine_rows(communicator& c, std::span<const bf16> y, const moe_handle& h, bool use_weights) {
  if (h.ranks != c.size()) throw std::invalid_argument("tessel::moe: handle belongs to another communicator size");
  if (y.size() != h.rows() * h.hidden) throw std::length_error("tessel::moe: combine input must hold rows * hidden elements");
  const std::size_t H = h.hidden, U = h.recv_src_token.size();
  std::vector<float> part(U * H, 0.0f);
  for (std::size_t i = 0; i < h.rows(); ++i) {
    const float wt = use_weights ? h.row_weight[i] : 1.0f;
    float* d = part.data() + h.row_token[i] * H;
    for (std::size_t j = 0; j < H; ++j) d[j] += wt * static_cast<float>(y[i * H + j]);
  }
  std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(h.ranks));
  std::size_t u = 0;
  for (int q = 0; q < h.ranks; ++q) {
    auto& b = out[static_cast<std::size_t>(q)];
    b.resize(h.recv_per_rank[static_cast<std::size_t>(q)] * H * sizeof(bf16));
    for (std::size_t t = 0; t < h.recv_per_rank[static_cast<std::size_t>(q)]; ++t, ++u)
      for (std::size_t j = 0; j < H; ++j) {
        const bf16 v(part[u * H + j]);
        std::memcpy(b.data() + (t * H + j) * sizeof(bf16), &v, sizeof(bf16));
      }
  }
  const auto in = moe_exchange(c, out);
  std::vector<float> acc(h.num_tokens * H, 0.0f);
  std::vector<char> any(h.num_tokens, 0);
  for (int q = 0; q < h.ranks; ++q) {
    const auto& toks = h.sent_tokens[static_cast<std::size_t>(q)];
    const auto& b = in[static_cast<std::size_t>(q)];
    if (b.size() != toks.size() * H * sizeof(bf16)) throw std::length_error("tessel::moe: combine reply of the wrong size");
    for (std::size_t t = 0; t < toks.size(); ++t) {
      float* d = acc.data() + static_cast<std::size_t>(toks[t]) * H;
      const bool first = !any[static_cast<std::size_t>(toks[t])];
      any[static_cast<std::size_t>(toks[t])] = 1;
      for (std::size_t j = 0; j < H; ++j) {
        bf16 v;
        std::memcpy(&v, b.data() + (t * H + j) * sizeof(bf16), sizeof(bf16));
        d[j] = first ? static_cast<float>(v) : d[j] + static_cast<float>(v);
      }
    }
  }
  std::vector<bf16> res(h.num_tokens * H);
  for (std::size_t i = 0; i < res.size(); ++i) res[i] = bf16(acc[i]);
  return res;
}
}  // namespace moe_detail

// BF16 dispatch. x: (tokens, hidden); topk_idx/topk_weights: (tokens, top_k).
inline moe_dispatch_result<bf16> moe_dispatch(communicator& c, std::span<const bf16> x, std::size_t hidden,
                                              std::span<const std::int64_t> topk_idx, std::span<const float> topk_weights,
                                              std::size_t top_k, int num_experts) {
  if (hidden == 0 || x.size() % hidden) throw std::length_error("tessel::moe_dispatch: x must hold tokens * hidden elements");
  const std::size_t tokens = x.size() / hidden;
  return moe_detail::dispatch<bf16>(c, reinterpret_cast<const std::byte*>(x.data()), hidden * sizeof(bf16), hidden * sizeof(bf16),
                                    tokens, hidden, top_k, topk_idx, topk_weights, num_experts);
}

// FP8 dispatch: x (tokens, hidden) E4M3 with scales (tokens, hidden/128), hidden a multiple of 128.
inline moe_dispatch_result<e4m3> moe_dispatch_fp8(communicator& c, std::span<const e4m3> x, std::span<const float> scales,
                                                  std::size_t hidden, std::span<const std::int64_t> topk_idx,
                                                  std::span<const float> topk_weights, std::size_t top_k, int num_experts) {
  if (hidden == 0 || hidden % 128) throw std::invalid_argument("tessel::moe_dispatch_fp8: hidden must be a positive multiple of 128");
  if (x.size() % hidden) throw std::length_error("tessel::moe_dispatch_fp8: x must hold tokens * hidden elements");
  const std::size_t tokens = x.size() / hidden, sg = hidden / 128;
  if (scales.size() != tokens * sg) throw std::length_error("tessel::moe_dispatch_fp8: scales must hold tokens * hidden/128 entries");
  std::vector<std::byte> payload(tokens * (hidden + sg * 4));
  for (std::size_t t = 0; t < tokens; ++t) {
    std::memcpy(payload.data() + t * (hidden + sg * 4), x.data() + t * hidden, hidden);
    std::memcpy(payload.data() + t * (hidden + sg * 4) + hidden, scales.data() + t * sg, sg * 4);
  }
  return moe_detail::dispatch<e4m3>(c, payload.data(), hidden + sg * 4, hidden, tokens, hidden, top_k, topk_idx, topk_weights,
                                    num_experts);
}

// Quantizes BF16 activations for FP8 dispatch: scale = amax/448 per 128 channels, saturating.
inline void moe_quantize_fp8(std::span<const bf16> x, std::size_t hidden, std::span<e4m3> q, std::span<float> scales) {
  if (hidden == 0 || hidden % 128) throw std::invalid_argument("tessel::moe_quantize_fp8: hidden must be a positive multiple of 128");
  if (x.size() % hidden || q.size() != x.size() || scales.size() != x.size() / 128)
    throw std::length_error("tessel::moe_quantize_fp8: sizes do not match (tokens * hidden, tokens * hidden/128)");
  for (std::size_t g = 0; g < scales.size(); ++g) {
    float amax = 0;
    for (std::size_t j = 0; j < 128; ++j) amax = std::max(amax, std::fabs(static_cast<float>(x[g * 128 + j])));
    const float s = amax > 0 ? amax / 448.0f : 1.0f;
    scales[g] = s;
    for (std::size_t j = 0; j < 128; ++j)
      q[g * 128 + j] = e4m3(std::clamp(static_cast<float>(x[g * 128 + j]) / s, -448.0f, 448.0f));
  }
}

// combine: y (rows, hidden) in the handle's row order -> (tokens, hidden) on the home ranks.
inline std::vector<bf16> moe_combine(communicator& c, std::span<const bf16> y, const moe_handle& h) {
  return moe_detail::combine_rows(c, y, h, true);
}

// Backward of dispatch: the gradient of each row flows back to its token (a combine without weights).
inline std::vector<bf16> moe_dispatch_backward(communicator& c, std::span<const bf16> grad_rows, const moe_handle& h) {
  return moe_detail::combine_rows(c, grad_rows, h, false);
}

// Backward of combine: grad_y[row] = weight(row) * grad_out[token of row] (a dispatch of grad_out).
inline std::vector<bf16> moe_combine_backward(communicator& c, std::span<const bf16> grad_out, const moe_handle& h) {
  if (h.ranks != c.size()) throw std::invalid_argument("tessel::moe: handle belongs to another communicator size");
  const std::size_t H = h.hidden;
  if (grad_out.size() != h.num_tokens * H) throw std::length_error("tessel::moe_combine_backward: grad_out must hold tokens * hidden elements");
  std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(h.ranks));
  for (int q = 0; q < h.ranks; ++q) {
    const auto& toks = h.sent_tokens[static_cast<std::size_t>(q)];
    auto& b = out[static_cast<std::size_t>(q)];
    b.resize(toks.size() * H * sizeof(bf16));
    for (std::size_t t = 0; t < toks.size(); ++t)
      std::memcpy(b.data() + t * H * sizeof(bf16), grad_out.data() + static_cast<std::size_t>(toks[t]) * H, H * sizeof(bf16));
  }
  const auto in = moe_detail::moe_exchange(c, out);
  std::vector<const std::byte*> recs;
  for (int q = 0; q < h.ranks; ++q) {
    const auto& b = in[static_cast<std::size_t>(q)];
    if (b.size() != h.recv_per_rank[static_cast<std::size_t>(q)] * H * sizeof(bf16))
      throw std::length_error("tessel::moe_combine_backward: reply of the wrong size");
    for (std::size_t t = 0; t < h.recv_per_rank[static_cast<std::size_t>(q)]; ++t) recs.push_back(b.data() + t * H * sizeof(bf16));
  }
  std::vector<bf16> g(h.rows() * H);
  for (std::size_t i = 0; i < h.rows(); ++i)
    for (std::size_t j = 0; j < H; ++j) {
      bf16 v;
      std::memcpy(&v, recs[h.row_token[i]] + j * sizeof(bf16), sizeof(bf16));
      g[i * H + j] = bf16(h.row_weight[i] * static_cast<float>(v));
    }
  return g;
}

}  // namespace v0
}  // namespace tessel
