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
//   Row-exact forms: moe_dispatch_rows moves rows of any element type (f32, BF16, FP16) unchanged;
//   moe_return_rows brings each expert row back to its (token, k) slot unsummed and moe_send_rows
//   is its reverse, so a model's expert-parallel layer combines on the home rank in one device's
//   order (dist/expert_parallel.hpp).
//   Timing-only forms (moe_timing_only) run the same exchanges with real routing metadata and
//   payload-free token rows, for simulated transports (the 128-card bandwidth figure).
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
#include <type_traits>
#include <vector>

#include <tessel/collectives/errors.hpp>
#include <tessel/collectives/communicator.hpp>
#include <tessel/detail/checked.hpp>
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
  // and per destination rank the top-k slots (token * top_k + k) it serves, in (token, k) order
  std::vector<std::vector<std::size_t>> sent_slots;
  // receive side: distinct received tokens (by source rank, then token order) and, per row, which
  std::vector<int> recv_src_rank;
  std::vector<std::int64_t> recv_src_token;
  std::vector<std::size_t> recv_per_rank;  // distinct tokens received from each rank
  std::vector<std::size_t> row_token;      // row -> index into the distinct received tokens
  std::vector<int> row_k;                  // row -> top-k slot on its home rank
  std::vector<int> row_expert;             // row -> local expert
  std::vector<float> row_weight;           // row -> top-k weight
  std::vector<std::size_t> tokens_per_expert;
  std::size_t payload_bytes = 0;  // bytes per dispatched token (data + scales)
  bool timing_only = false;       // made by a moe_timing_only dispatch: no payloads
  std::size_t rows() const { return row_token.size(); }
};

template <class X>
struct moe_dispatch_result {
  std::vector<X> x;           // (rows, hidden), grouped by local expert
  std::vector<float> scales;  // (rows, hidden/128) for FP8 dispatch, empty otherwise
  moe_handle handle;
  const std::vector<std::size_t>& tokens_per_expert() const { return handle.tokens_per_expert; }
  const std::vector<float>& weights() const { return handle.row_weight; }
};

namespace moe_detail {
inline void check_routing(const communicator& c, std::size_t tokens, std::size_t hidden, std::size_t top_k, std::span<const std::int64_t> idx,
                          std::span<const float> w, int num_experts) {
  if (num_experts <= 0 || num_experts % c.size() != 0)
    throw comm_error(errc::invalid_argument, "moe: num_experts " + std::to_string(num_experts) + " must be a positive multiple of the rank count " +
                                                 std::to_string(c.size()));
  if (hidden == 0) throw comm_error(errc::invalid_argument, "moe: hidden must be positive");
  if (tokens > 0 && top_k == 0) throw comm_error(errc::invalid_argument, "moe: top_k must be positive");
  if (tokens && top_k > std::numeric_limits<std::size_t>::max() / tokens) throw comm_error(errc::overflow, "moe: tokens * top_k overflows");
  if (idx.size() != tokens * top_k || w.size() != tokens * top_k)
    throw comm_error(errc::invalid_argument, "moe: topk_idx and topk_weights must hold tokens * top_k entries");
  for (std::int64_t e : idx)
    if (e < -1 || e >= num_experts)
      throw comm_error(errc::out_of_range,
                       "moe: expert index " + std::to_string(e) + " outside [0, " + std::to_string(num_experts) + ") (use -1 for no expert)");
}

// An all_to_allv of bytes: sc[q] bytes from `send` (packed in rank order) to rank q; rc[q] bytes
// from rank q into `recv` (packed in rank order). timing: payload-free (no buffers; see
// communicator::all_to_allv_timing), the same messages otherwise.
inline void exchange_bytes(communicator& c, const std::byte* send, const std::vector<std::size_t>& sc, std::byte* recv,
                           const std::vector<std::size_t>& rc, bool timing) {
  if (timing) return c.all_to_allv_timing(sc, rc, dtype::u8);
  const std::size_t n = sc.size();
  std::vector<std::size_t> sd(n), rd(n);
  for (std::size_t q = 1; q < n; ++q) sd[q] = sd[q - 1] + sc[q - 1], rd[q] = rd[q - 1] + rc[q - 1];
  c.all_to_allv(send, sc, sd, recv, rc, rd, dtype::u8);
}
inline std::vector<std::size_t> prefix(const std::vector<std::size_t>& v) {
  std::vector<std::size_t> p(v.size() + 1, 0);
  for (std::size_t i = 0; i < v.size(); ++i) p[i + 1] = tessel::detail::add_checked(p[i], v[i], "moe: counts");
  return p;
}
inline void check_not_dry(communicator& c) {
  if (c.transport_handle().timing_only())
    throw comm_error(errc::unsupported,
                     "moe: the transport is timing-only (no bytes move), so the routing cannot be exchanged; use a cluster that "
                     "moves payloads and the moe_timing_only forms for payload-free timing");
}

// Shared body of every dispatch. Three exchanges, the same in both modes: (1) per destination the
// record count and the record shape, (2) the routing metadata (token id, top-k indices and
// weights), (3) the payload rows (data_bytes of `data` [+ extra_bytes of `extra`] per token).
// timing: (3) is payload-free (data/extra unused, result rows empty) but timed in full.
template <class X>
moe_dispatch_result<X> dispatch(communicator& c, const std::byte* data, std::size_t data_bytes, const std::byte* extra, std::size_t extra_bytes,
                                bool timing, std::size_t tokens, std::size_t hidden, std::size_t top_k, std::span<const std::int64_t> idx,
                                std::span<const float> w, int num_experts) {
  check_routing(c, tokens, hidden, top_k, idx, w, num_experts);
  check_not_dry(c);
  const int n = c.size(), epr = num_experts / n;
  const auto un = static_cast<std::size_t>(n);
  const std::size_t payload_bytes = data_bytes + extra_bytes;
  moe_dispatch_result<X> res;
  moe_handle& h = res.handle;
  h.num_tokens = tokens, h.hidden = hidden, h.top_k = top_k, h.num_experts = num_experts, h.ranks = n;
  h.timing_only = timing, h.payload_bytes = payload_bytes;
  h.sent_tokens.assign(un, {});
  h.sent_slots.assign(un, {});
  std::vector<char> seen(un);
  for (std::size_t t = 0; t < tokens; ++t) {
    std::fill(seen.begin(), seen.end(), 0);
    for (std::size_t k = 0; k < top_k; ++k) {
      const std::int64_t e = idx[t * top_k + k];
      if (e < 0) continue;
      const auto q = static_cast<std::size_t>(e / epr);
      h.sent_slots[q].push_back(t * top_k + k);
      if (seen[q]) continue;  // once per destination rank
      seen[q] = 1;
      h.sent_tokens[q].push_back(static_cast<std::int64_t>(t));
    }
  }
  // (1) counts, with the record shape so that peers that disagree are caught
  std::vector<std::uint64_t> hs(3 * un), hr(3 * un);
  for (std::size_t q = 0; q < un; ++q) hs[3 * q] = h.sent_tokens[q].size(), hs[3 * q + 1] = payload_bytes, hs[3 * q + 2] = top_k;
  c.all_to_all(hs.data(), hr.data(), 3, dtype::u64);
  std::vector<std::size_t> rcount(un);
  for (std::size_t q = 0; q < un; ++q) {
    if (hr[3 * q + 1] != payload_bytes || hr[3 * q + 2] != top_k)
      throw comm_error(errc::invalid_argument, "moe: peers disagree on hidden, the payload format or top_k");
    rcount[q] = static_cast<std::size_t>(hr[3 * q]);
  }
  // (2) metadata records: token id, top_k expert indices, top_k weights
  const std::size_t meta = sizeof(std::int64_t) + top_k * (sizeof(std::int64_t) + sizeof(float));
  std::vector<std::size_t> msc(un), mrc(un), psc(un), prc(un);
  for (std::size_t q = 0; q < un; ++q) {
    msc[q] = h.sent_tokens[q].size() * meta;
    mrc[q] = tessel::detail::mul_checked(rcount[q], meta, "moe: received records");
    psc[q] = h.sent_tokens[q].size() * payload_bytes;
    prc[q] = tessel::detail::mul_checked(rcount[q], payload_bytes, "moe: received payload");
  }
  const auto msd = prefix(msc), mrd = prefix(mrc);
  std::vector<std::byte> ms(msd[un]), mr(mrd[un]);
  for (std::size_t q = 0; q < un; ++q)
    for (std::size_t i = 0; i < h.sent_tokens[q].size(); ++i) {
      const std::int64_t tok = h.sent_tokens[q][i];
      const auto t = static_cast<std::size_t>(tok);
      std::byte* p = ms.data() + msd[q] + i * meta;
      std::memcpy(p, &tok, 8);
      std::memcpy(p + 8, idx.data() + t * top_k, top_k * 8);
      std::memcpy(p + 8 + top_k * 8, w.data() + t * top_k, top_k * 4);
    }
  exchange_bytes(c, ms.data(), msc, mr.data(), mrc, false);
  // (3) payload rows
  std::vector<std::byte> pr;
  {
    std::vector<std::byte> ps;
    if (!timing) {
      const auto psd = prefix(psc);
      ps.resize(psd[un]);
      for (std::size_t q = 0; q < un; ++q)
        for (std::size_t i = 0; i < h.sent_tokens[q].size(); ++i) {
          const auto t = static_cast<std::size_t>(h.sent_tokens[q][i]);
          std::byte* p = ps.data() + psd[q] + i * payload_bytes;
          std::memcpy(p, data + t * data_bytes, data_bytes);
          if (extra_bytes) std::memcpy(p + data_bytes, extra + t * extra_bytes, extra_bytes);
        }
      pr.resize(prefix(prc)[un]);
    }
    exchange_bytes(c, ps.data(), psc, pr.data(), prc, timing);
  }
  // distinct received tokens
  h.recv_per_rank = rcount;
  std::size_t U = 0;
  for (std::size_t q = 0; q < un; ++q) U += rcount[q];
  h.recv_src_rank.reserve(U);
  h.recv_src_token.reserve(U);
  for (std::size_t q = 0; q < un; ++q)
    for (std::size_t i = 0; i < rcount[q]; ++i) {
      std::int64_t tok;
      std::memcpy(&tok, mr.data() + mrd[q] + i * meta, 8);
      h.recv_src_rank.push_back(static_cast<int>(q));
      h.recv_src_token.push_back(tok);
    }
  // rows grouped by local expert, then by received token, then by k
  h.tokens_per_expert.assign(static_cast<std::size_t>(epr), 0);
  const std::int64_t first = static_cast<std::int64_t>(c.rank()) * epr;
  for (int e = 0; e < epr; ++e)
    for (std::size_t u = 0; u < U; ++u) {
      const std::byte* rec = mr.data() + u * meta;  // records are packed in rank order
      for (std::size_t k = 0; k < top_k; ++k) {
        std::int64_t g;
        std::memcpy(&g, rec + 8 + k * 8, 8);
        if (g != first + e) continue;
        float wt;
        std::memcpy(&wt, rec + 8 + top_k * 8 + k * 4, 4);
        h.row_token.push_back(u);
        h.row_k.push_back(static_cast<int>(k));
        h.row_expert.push_back(e);
        h.row_weight.push_back(wt);
        ++h.tokens_per_expert[static_cast<std::size_t>(e)];
      }
    }
  if (timing) return res;
  const std::size_t rows = h.rows();
  res.x.resize(rows * hidden);
  res.scales.resize(rows * extra_bytes / sizeof(float));
  for (std::size_t i = 0; i < rows; ++i) {
    const std::byte* p = pr.data() + h.row_token[i] * payload_bytes;  // payload rows are packed like the records
    std::memcpy(res.x.data() + i * hidden, p, data_bytes);
    if (extra_bytes) std::memcpy(res.scales.data() + i * extra_bytes / sizeof(float), p + data_bytes, extra_bytes);
  }
  return res;
}

// Byte counts of the reverse exchange (expert ranks -> home ranks), `row` bytes per token.
inline void reverse_counts(const moe_handle& h, std::size_t row, std::vector<std::size_t>& sc, std::vector<std::size_t>& rc) {
  const auto un = static_cast<std::size_t>(h.ranks);
  sc.assign(un, 0), rc.assign(un, 0);
  for (std::size_t q = 0; q < un; ++q) {
    sc[q] = tessel::detail::mul_checked(h.recv_per_rank[q], row, "moe: combine");
    rc[q] = tessel::detail::mul_checked(h.sent_tokens[q].size(), row, "moe: combine");
  }
}
inline void check_handle(communicator& c, const moe_handle& h) {
  if (h.ranks != c.size()) throw comm_error(errc::invalid_argument, "moe: handle belongs to another communicator size");
  if (h.sent_tokens.size() != static_cast<std::size_t>(h.ranks) || h.sent_slots.size() != static_cast<std::size_t>(h.ranks) ||
      h.recv_per_rank.size() != static_cast<std::size_t>(h.ranks))
    throw comm_error(errc::invalid_argument, "moe: handle was not filled by a dispatch");
  check_not_dry(c);
}

// Expert side of a combine: per received token, sum_w * y over its rows (FP32, row order), as BF16;
// home side: add the partials in rank order (FP32), round once. One exchange (the counts are in
// the handle). In timing-only mode y must be empty and the result is empty.
inline std::vector<bf16> combine_rows(communicator& c, std::span<const bf16> y, const moe_handle& h, bool use_weights) {
  check_handle(c, h);
  const std::size_t H = h.hidden, U = h.recv_src_token.size(), un = static_cast<std::size_t>(h.ranks);
  std::vector<std::size_t> sc, rc;
  reverse_counts(h, H * sizeof(bf16), sc, rc);
  if (h.timing_only) {
    if (!y.empty()) throw comm_error(errc::invalid_argument, "moe: a timing-only handle takes no payload (pass an empty span)");
    exchange_bytes(c, nullptr, sc, nullptr, rc, true);
    return {};
  }
  if (y.size() != h.rows() * H) throw comm_error(errc::invalid_argument, "moe: combine input must hold rows * hidden elements");
  std::vector<float> part(U * H, 0.0f);
  for (std::size_t i = 0; i < h.rows(); ++i) {
    const float wt = use_weights ? h.row_weight[i] : 1.0f;
    float* d = part.data() + h.row_token[i] * H;
    const bf16* src = y.data() + i * H;
    for (std::size_t j = 0; j < H; ++j) d[j] += wt * static_cast<float>(src[j]);
  }
  // distinct received tokens are in rank order, so the partials are already packed for sending
  std::vector<bf16> sb(U * H);
  for (std::size_t i = 0; i < sb.size(); ++i) sb[i] = bf16(part[i]);
  std::vector<bf16> rb(prefix(rc)[un] / sizeof(bf16));
  exchange_bytes(c, reinterpret_cast<const std::byte*>(sb.data()), sc, reinterpret_cast<std::byte*>(rb.data()), rc, false);
  std::vector<float> acc(h.num_tokens * H, 0.0f);
  std::vector<char> any(h.num_tokens, 0);
  const bf16* in = rb.data();
  for (std::size_t q = 0; q < un; ++q)
    for (std::int64_t tok : h.sent_tokens[q]) {
      const auto t = static_cast<std::size_t>(tok);
      float* d = acc.data() + t * H;
      const bool first = !any[t];
      any[t] = 1;
      for (std::size_t j = 0; j < H; ++j) d[j] = first ? static_cast<float>(in[j]) : d[j] + static_cast<float>(in[j]);
      in += H;
    }
  std::vector<bf16> res(h.num_tokens * H);
  for (std::size_t i = 0; i < res.size(); ++i) res[i] = bf16(acc[i]);
  return res;
}
}  // namespace moe_detail

// Dispatch of rows of any trivially copyable element type (a model's f32, BF16 or FP16
// activations), moved unchanged. x: (tokens, hidden); topk_idx/topk_weights: (tokens, top_k).
template <class X>
requires std::is_trivially_copyable_v<X> moe_dispatch_result<X> moe_dispatch_rows(communicator& c, std::span<const X> x, std::size_t hidden,
                                                                                  std::span<const std::int64_t> topk_idx,
                                                                                  std::span<const float> topk_weights, std::size_t top_k,
                                                                                  int num_experts) {
  if (hidden == 0 || x.size() % hidden) throw comm_error(errc::invalid_argument, "moe_dispatch: x must hold tokens * hidden elements");
  const std::size_t row = tessel::detail::mul_checked(hidden, sizeof(X), "moe_dispatch: hidden");
  return moe_detail::dispatch<X>(c, reinterpret_cast<const std::byte*>(x.data()), row, nullptr, 0, false, x.size() / hidden, hidden, top_k, topk_idx,
                                 topk_weights, num_experts);
}

// BF16 dispatch (DeepEP's): moe_dispatch_rows of BF16 rows.
inline moe_dispatch_result<bf16> moe_dispatch(communicator& c, std::span<const bf16> x, std::size_t hidden, std::span<const std::int64_t> topk_idx,
                                              std::span<const float> topk_weights, std::size_t top_k, int num_experts) {
  return moe_dispatch_rows<bf16>(c, x, hidden, topk_idx, topk_weights, top_k, num_experts);
}

// FP8 dispatch: x (tokens, hidden) E4M3 with scales (tokens, hidden/128), hidden a multiple of 128.
inline moe_dispatch_result<e4m3> moe_dispatch_fp8(communicator& c, std::span<const e4m3> x, std::span<const float> scales, std::size_t hidden,
                                                  std::span<const std::int64_t> topk_idx, std::span<const float> topk_weights, std::size_t top_k,
                                                  int num_experts) {
  if (hidden == 0 || hidden % 128) throw comm_error(errc::invalid_argument, "moe_dispatch_fp8: hidden must be a positive multiple of 128");
  if (x.size() % hidden) throw comm_error(errc::invalid_argument, "moe_dispatch_fp8: x must hold tokens * hidden elements");
  const std::size_t tokens = x.size() / hidden, sg = hidden / 128;
  if (scales.size() != tokens * sg) throw comm_error(errc::invalid_argument, "moe_dispatch_fp8: scales must hold tokens * hidden/128 entries");
  return moe_detail::dispatch<e4m3>(c, reinterpret_cast<const std::byte*>(x.data()), hidden, reinterpret_cast<const std::byte*>(scales.data()),
                                    sg * sizeof(float), false, tokens, hidden, top_k, topk_idx, topk_weights, num_experts);
}

// Timing-only forms (simulated transports): the same dispatch, with the routing metadata exchanged
// for real, but the token payloads only timed (every byte of them crosses the modelled fabric; no
// payload is allocated or copied). The result has the full handle and per-expert counts and empty
// x/scales; combine and the backward passes of a timing-only handle take and return empty spans.
// This is how 128-card dispatches (4096 tokens x 7168 channels each) are measured in host memory.
struct moe_timing_only_t {
  explicit constexpr moe_timing_only_t() = default;
};
inline constexpr moe_timing_only_t moe_timing_only{};

inline moe_dispatch_result<bf16> moe_dispatch(communicator& c, moe_timing_only_t, std::size_t tokens, std::size_t hidden,
                                              std::span<const std::int64_t> topk_idx, std::span<const float> topk_weights, std::size_t top_k,
                                              int num_experts) {
  const std::size_t row = tessel::detail::mul_checked(hidden, sizeof(bf16), "moe_dispatch: hidden");
  return moe_detail::dispatch<bf16>(c, nullptr, row, nullptr, 0, true, tokens, hidden, top_k, topk_idx, topk_weights, num_experts);
}
inline moe_dispatch_result<e4m3> moe_dispatch_fp8(communicator& c, moe_timing_only_t, std::size_t tokens, std::size_t hidden,
                                                  std::span<const std::int64_t> topk_idx, std::span<const float> topk_weights, std::size_t top_k,
                                                  int num_experts) {
  if (hidden == 0 || hidden % 128) throw comm_error(errc::invalid_argument, "moe_dispatch_fp8: hidden must be a positive multiple of 128");
  return moe_detail::dispatch<e4m3>(c, nullptr, hidden, nullptr, hidden / 128 * sizeof(float), true, tokens, hidden, top_k, topk_idx, topk_weights,
                                    num_experts);
}

// Bytes this rank's dispatch put on the wire for token payloads (to other ranks; rows to itself
// stay local), and the bytes its combine sends back (BF16 partials).
inline std::size_t moe_dispatch_wire_bytes(const moe_handle& h, int rank) {
  std::size_t b = 0;
  for (std::size_t q = 0; q < h.sent_tokens.size(); ++q)
    if (static_cast<int>(q) != rank) b += h.sent_tokens[q].size() * h.payload_bytes;
  return b;
}
inline std::size_t moe_combine_wire_bytes(const moe_handle& h, int rank) {
  std::size_t b = 0;
  for (std::size_t q = 0; q < h.recv_per_rank.size(); ++q)
    if (static_cast<int>(q) != rank) b += h.recv_per_rank[q] * h.hidden * sizeof(bf16);
  return b;
}

// Quantizes BF16 activations for FP8 dispatch: scale = amax/448 per 128 channels, saturating.
inline void moe_quantize_fp8(std::span<const bf16> x, std::size_t hidden, std::span<e4m3> q, std::span<float> scales) {
  if (hidden == 0 || hidden % 128) throw comm_error(errc::invalid_argument, "moe_quantize_fp8: hidden must be a positive multiple of 128");
  if (x.size() % hidden || q.size() != x.size() || scales.size() != x.size() / 128)
    throw comm_error(errc::invalid_argument, "moe_quantize_fp8: sizes do not match (tokens * hidden, tokens * hidden/128)");
  for (std::size_t g = 0; g < scales.size(); ++g) {
    float amax = 0;
    for (std::size_t j = 0; j < 128; ++j) amax = std::max(amax, std::fabs(static_cast<float>(x[g * 128 + j])));
    const float s = amax > 0 ? amax / 448.0f : 1.0f;
    scales[g] = s;
    for (std::size_t j = 0; j < 128; ++j) q[g * 128 + j] = e4m3(std::clamp(static_cast<float>(x[g * 128 + j]) / s, -448.0f, 448.0f));
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

// Backward of combine: grad_y[row] = weight(row) * grad_out[token of row] (a dispatch of grad_out,
// with the routing of the handle: one exchange).
inline std::vector<bf16> moe_combine_backward(communicator& c, std::span<const bf16> grad_out, const moe_handle& h) {
  moe_detail::check_handle(c, h);
  const std::size_t H = h.hidden, un = static_cast<std::size_t>(h.ranks);
  std::vector<std::size_t> rc, sc;  // the reverse of combine: home ranks send, expert ranks receive
  moe_detail::reverse_counts(h, H * sizeof(bf16), rc, sc);
  if (h.timing_only) {
    if (!grad_out.empty()) throw comm_error(errc::invalid_argument, "moe: a timing-only handle takes no payload (pass an empty span)");
    moe_detail::exchange_bytes(c, nullptr, sc, nullptr, rc, true);
    return {};
  }
  if (grad_out.size() != h.num_tokens * H)
    throw comm_error(errc::invalid_argument, "moe_combine_backward: grad_out must hold tokens * hidden elements");
  std::vector<bf16> sb(moe_detail::prefix(sc)[un] / sizeof(bf16));
  bf16* o = sb.data();
  for (std::size_t q = 0; q < un; ++q)
    for (std::int64_t tok : h.sent_tokens[q]) {
      std::memcpy(o, grad_out.data() + static_cast<std::size_t>(tok) * H, H * sizeof(bf16));
      o += H;
    }
  std::vector<bf16> rb(moe_detail::prefix(rc)[un] / sizeof(bf16));
  moe_detail::exchange_bytes(c, reinterpret_cast<const std::byte*>(sb.data()), sc, reinterpret_cast<std::byte*>(rb.data()), rc, false);
  std::vector<bf16> g(h.rows() * H);
  for (std::size_t i = 0; i < h.rows(); ++i) {
    const bf16* v = rb.data() + h.row_token[i] * H;
    for (std::size_t j = 0; j < H; ++j) g[i * H + j] = bf16(h.row_weight[i] * static_cast<float>(v[j]));
  }
  return g;
}

// Row-exact exchanges: each (token, k) slot's row travels on its own, nothing is summed on the
// way, so the home rank combines in its own order and gets what one device computes bitwise.
// They send a token once per chosen expert rather than once per expert rank (moe_combine's
// partials), which costs more bytes when a token's experts share a rank.
namespace moe_detail {
// The expert side's rows in (received token, k) order: the order in which each home rank lists
// its slots (sent_slots), since received tokens are grouped by source rank in token order.
inline std::vector<std::size_t> rows_by_slot(const moe_handle& h, std::vector<std::size_t>& per_rank) {
  std::vector<std::size_t> order(h.rows());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return h.row_token[a] != h.row_token[b] ? h.row_token[a] < h.row_token[b] : h.row_k[a] < h.row_k[b];
  });
  per_rank.assign(static_cast<std::size_t>(h.ranks), 0);
  for (std::size_t i : order) ++per_rank[static_cast<std::size_t>(h.recv_src_rank[h.row_token[i]])];
  return order;
}
// What both row-exact exchanges need: the expert side's row order and, per rank, the bytes of the
// expert side's rows for it and of the home side's slots it serves (rows of elem_bytes · hidden).
struct slot_plan {
  std::vector<std::size_t> order, expert_bytes, home_bytes;
  std::size_t row_bytes = 0;
};
inline slot_plan plan_slots(communicator& c, const moe_handle& h, std::size_t elem_bytes, bool payload) {
  check_handle(c, h);
  if (h.timing_only && payload) throw comm_error(errc::invalid_argument, "moe: a timing-only handle takes no payload (pass an empty span)");
  slot_plan p;
  p.row_bytes = tessel::detail::mul_checked(h.hidden, elem_bytes, "moe: hidden");
  std::vector<std::size_t> per_rank;
  p.order = rows_by_slot(h, per_rank);
  const auto un = static_cast<std::size_t>(h.ranks);
  p.expert_bytes.resize(un), p.home_bytes.resize(un);
  for (std::size_t q = 0; q < un; ++q) {
    p.expert_bytes[q] = tessel::detail::mul_checked(per_rank[q], p.row_bytes, "moe: slot rows");
    p.home_bytes[q] = tessel::detail::mul_checked(h.sent_slots[q].size(), p.row_bytes, "moe: slot rows");
  }
  return p;
}
}  // namespace moe_detail

// Expert rows back to their slots: y (rows, hidden) in the handle's row order -> (tokens * top_k,
// hidden) on the home ranks, row t * top_k + k holding token t's k-th expert's row (zeros for the
// slots without an expert). The backward of moe_send_rows and vice versa.
template <class Y>
requires std::is_trivially_copyable_v<Y> std::vector<Y> moe_return_rows(communicator& c, std::span<const Y> y, const moe_handle& h) {
  const auto [order, sc, home, rb] = moe_detail::plan_slots(c, h, sizeof(Y), !y.empty());
  const std::size_t H = h.hidden, un = static_cast<std::size_t>(h.ranks);
  if (h.timing_only) {
    moe_detail::exchange_bytes(c, nullptr, sc, nullptr, home, true);
    return {};
  }
  if (y.size() != h.rows() * H) throw comm_error(errc::invalid_argument, "moe_return_rows: y must hold rows * hidden elements");
  std::vector<Y> sb(h.rows() * H), recv(moe_detail::prefix(home)[un] / sizeof(Y));
  for (std::size_t i = 0; i < order.size(); ++i) std::memcpy(sb.data() + i * H, y.data() + order[i] * H, rb);
  moe_detail::exchange_bytes(c, reinterpret_cast<const std::byte*>(sb.data()), sc, reinterpret_cast<std::byte*>(recv.data()), home, false);
  std::vector<Y> out(tessel::detail::mul_checked(tessel::detail::mul_checked(h.num_tokens, h.top_k, "moe: slots"), H, "moe: slots"), Y{});
  const Y* in = recv.data();
  for (std::size_t q = 0; q < un; ++q)
    for (std::size_t s : h.sent_slots[q]) {
      std::memcpy(out.data() + s * H, in, rb);
      in += H;
    }
  return out;
}

// Slot rows to the experts: slots (tokens * top_k, hidden) on the home ranks -> (rows, hidden) in
// the handle's row order on the expert ranks (the slots without an expert are not sent).
template <class Y>
requires std::is_trivially_copyable_v<Y> std::vector<Y> moe_send_rows(communicator& c, std::span<const Y> slots, const moe_handle& h) {
  const auto [order, rc, home, rb] = moe_detail::plan_slots(c, h, sizeof(Y), !slots.empty());
  const std::size_t H = h.hidden, un = static_cast<std::size_t>(h.ranks);
  if (h.timing_only) {
    moe_detail::exchange_bytes(c, nullptr, home, nullptr, rc, true);
    return {};
  }
  if (slots.size() != h.num_tokens * h.top_k * H)
    throw comm_error(errc::invalid_argument, "moe_send_rows: slots must hold tokens * top_k * hidden elements");
  std::vector<Y> sb(moe_detail::prefix(home)[un] / sizeof(Y)), recv(h.rows() * H);
  Y* o = sb.data();
  for (std::size_t q = 0; q < un; ++q)
    for (std::size_t s : h.sent_slots[q]) {
      std::memcpy(o, slots.data() + s * H, rb);
      o += H;
    }
  moe_detail::exchange_bytes(c, reinterpret_cast<const std::byte*>(sb.data()), home, reinterpret_cast<std::byte*>(recv.data()), rc, false);
  std::vector<Y> out(h.rows() * H);
  for (std::size_t i = 0; i < order.size(); ++i) std::memcpy(out.data() + order[i] * H, recv.data() + i * H, rb);
  return out;
}

}  // namespace v0
}  // namespace tessel
