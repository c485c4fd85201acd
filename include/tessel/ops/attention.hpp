// Fused scaled-dot-product attention (FlashAttention-2) as tile programs on any device:
//   O = softmax(scale·Q·Kᵀ + mask)·V, plus the per-row log-sum-exp for the backward pass.
// Layouts [batch, seq, heads, dim] (bshd) and [batch, heads, seq, dim] (bhsd); varlen batches
// packed as [total_tokens, heads, dim] with cumulative offsets; head dims any multiple of 16 up to
// 256; GQA/MQA (heads_q a multiple of heads_kv); causal masks aligned top-left or bottom-right;
// sliding windows; f32, bf16 (FP32 softmax and accumulation) and e4m3 inputs with scales.
// Decode (few query rows, long or paged KV cache) splits the KV length and merges exactly.
// Backward (f32, bf16, and e4m3 inputs dequantised to f32) recomputes tiles and never accumulates
// in a data-dependent order.
// A row with no visible key is "fully masked": its output is 0 and its log-sum-exp is −inf.
// Results never depend on the thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// first: it includes the intrinsic headers with GCC 12's spurious -Wuninitialized silenced
#include <tessel/ops/errors.hpp>
#include <tessel/ops/quant.hpp>
#include <tessel/arch/softmax_atoms.hpp>
#include <tessel/device/device.hpp>
#include <tessel/ops/detail/attention_common.hpp>
#include <tessel/ops/detail/attention_bwd.hpp>
#include <tessel/ops/detail/attention_decode.hpp>
#include <tessel/ops/detail/attention_fwd.hpp>
#include <tessel/tile/block_ctx.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel {
inline namespace v0 {

enum class attention_layout : std::uint8_t { bshd, bhsd };
enum class mask_align : std::uint8_t { top_left, bottom_right };

// Shape of a dense (padded) batch.
struct attention_shape {
  std::size_t batch = 1, seq_q = 0, seq_kv = 0, heads_q = 1, heads_kv = 1, head_dim = 0;
  attention_layout layout = attention_layout::bshd;
};

// Shape of a varlen batch: sequence b has tokens [cu_q[b], cu_q[b+1]) of Q/O and
// [cu_kv[b], cu_kv[b+1]) of K/V, all stored [total_tokens, heads, head_dim]. Empty sequences are fine.
struct attention_varlen_shape {
  std::span<const std::int32_t> cu_q, cu_kv;  // batch + 1 non-decreasing offsets each
  std::size_t heads_q = 1, heads_kv = 1, head_dim = 0;
};

struct attention_options {
  float scale = 0.0f;                                    // softmax scale; 0 means 1/sqrt(head_dim)
  bool causal = false;                                   // key j visible to row i only if j <= i + offset
  mask_align align = mask_align::top_left;               // offset = 0 (top-left) or seq_kv - seq_q (bottom-right)
  std::ptrdiff_t window_left = -1;                       // sliding window: j >= i + offset - window_left (-1: unbounded)
  std::ptrdiff_t window_right = -1;                      //                 j <= i + offset + window_right (-1: unbounded)
  float q_scale = 1.0f, k_scale = 1.0f, v_scale = 1.0f;  // dequantisation scales (e4m3 inputs)
};

template <class T>
concept attention_input = std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, e4m3>;
template <class T>
concept attention_output = std::is_same_v<T, float> || std::is_same_v<T, bf16>;

}  // namespace v0

namespace detail::attn {

inline void check(bool ok, const std::string& msg) {
  if (!ok) throw attention_error(msg);
}
inline std::size_t mul3(std::size_t a, std::size_t b, std::size_t c, const char* what) {
  return detail::mul_checked(mul_checked(a, b, what), c, what);
}
// One buffer as the checks see it: data, element count, name for the message.
struct named_buffer {
  const void* data;
  std::size_t size;
  const char* name;
  template <class T>
  named_buffer(std::span<T> s, const char* n) : data(s.data()), size(s.size()), name(n) {}
};
inline void check_named(const named_buffer& b, std::size_t need) {
  if (b.size < need)
    throw attention_error(errc::out_of_range, std::string(b.name) + " has " + std::to_string(b.size) + " elements, needs " + std::to_string(need));
  if (need > 0 && b.data == nullptr) throw attention_error(std::string(b.name) + " is null");
}
template <class T>
inline void check_buffer(std::span<T> s, std::size_t need, const char* name) {
  check_named({s, name}, need);
}
inline void check_heads(std::size_t hq, std::size_t hkv, std::size_t d) {
  check(d > 0 && d % 16 == 0 && d <= 256, "head_dim " + std::to_string(d) + " must be a positive multiple of 16 up to 256");
  check(hq > 0 && hkv > 0, "head counts must be positive (heads_q=" + std::to_string(hq) + ", heads_kv=" + std::to_string(hkv) + ")");
  check(hq % hkv == 0, "heads_q=" + std::to_string(hq) + " is not a multiple of heads_kv=" + std::to_string(hkv));
}
inline mask_rule make_mask(const attention_options& o) {
  check(o.window_left >= -1 && o.window_right >= -1, "window sizes must be >= -1 (-1 = unbounded)");
  check(std::isfinite(o.scale) && o.scale >= 0.0f, "scale must be finite and >= 0 (0 = 1/sqrt(head_dim))");
  check(std::isfinite(o.q_scale) && std::isfinite(o.k_scale) && std::isfinite(o.v_scale), "q/k/v scales must be finite");
  mask_rule m;
  m.causal = o.causal;
  m.bottom_right = o.align == mask_align::bottom_right;
  m.wl = o.window_left;
  m.wr = o.window_right;
  return m;
}
// Element counts of one call's tensors: q-like (q, o, dout, dq), kv-like (k, v, dk, dv), lse.
struct io_counts {
  std::size_t q = 0, kv = 0, lse = 0;
};
// The checks every entry point makes of its buffers and options, in one order: each q-like buffer
// holds n.q elements, each kv-like one n.kv, lse n.lse (an optional lse may also be empty), none
// is null where it must hold data, and the mask options are valid.
inline void check_io(const io_counts& n, std::initializer_list<named_buffer> q_like, std::initializer_list<named_buffer> kv_like, named_buffer lse,
                     bool lse_optional, const attention_options& opt) {
  for (const auto& b : q_like) check_named(b, n.q);
  for (const auto& b : kv_like) check_named(b, n.kv);
  if (!(lse_optional && lse.size == 0)) check_named(lse, n.lse);
  (void)make_mask(opt);
}
// Counts of a dense batch (checks the head shape and the size arithmetic).
inline io_counts dense_counts(const attention_shape& s) {
  check_heads(s.heads_q, s.heads_kv, s.head_dim);
  io_counts n;
  n.q = mul3(detail::mul_checked(s.batch, s.seq_q, "attention shape"), s.heads_q, s.head_dim, "attention shape");
  n.kv = mul3(detail::mul_checked(s.batch, s.seq_kv, "attention shape"), s.heads_kv, s.head_dim, "attention shape");
  n.lse = mul3(s.batch, s.seq_q, s.heads_q, "attention shape");  // the first products of n.q: no new overflow
  return n;
}
// The checks of both dense backward entry points, whatever their element types; returns the counts.
template <class Q, class KV, class O, class G>
io_counts check_dense_backward(const attention_shape& s, std::span<const Q> q, std::span<const KV> k, std::span<const KV> v, std::span<const O> o,
                               std::span<const O> dout, std::span<const float> lse, std::span<G> dq, std::span<G> dk, std::span<G> dv,
                               const attention_options& opt) {
  const io_counts n = dense_counts(s);
  check_io(n, {{q, "q"}, {o, "o"}, {dout, "dout"}, {dq, "dq"}}, {{k, "k"}, {v, "v"}, {dk, "dk"}, {dv, "dv"}}, {lse, "lse"}, false, opt);
  return n;
}
inline float softmax_scale(const attention_options& o, std::size_t d) {
  const float s = o.scale == 0.0f ? 1.0f / std::sqrt(static_cast<float>(d)) : o.scale;
  return s;
}

// Numbers the packed blocks of every sequence (Q blocks of bq rows, K/V blocks of bkv rows);
// returns the totals.
inline void assign_blocks(std::vector<seq_geom>& seqs, std::size_t bq, std::size_t bkv, std::size_t& q_blocks, std::size_t& kv_blocks) {
  q_blocks = kv_blocks = 0;
  for (auto& s : seqs) {
    s.q_blk0 = q_blocks;
    s.kv_blk0 = kv_blocks;
    q_blocks = detail::add_checked(q_blocks, ceil_div(s.sq, bq), "attention blocks");
    kv_blocks = detail::add_checked(kv_blocks, ceil_div(s.skv, bkv), "attention blocks");
  }
}

// Dense batch -> per-sequence geometry.
inline void dense_geom(const attention_shape& s, geom& g, std::vector<seq_geom>& seqs) {
  const std::size_t H = s.heads_q, HK = s.heads_kv, D = s.head_dim;
  g.hq = H;
  g.hkv = HK;
  g.d = D;
  g.group = H / HK;
  const bool bshd = s.layout == attention_layout::bshd;
  g.q_tok = g.o_tok = bshd ? H * D : D;
  g.q_head = g.o_head = bshd ? D : s.seq_q * D;
  g.k_tok = g.v_tok = bshd ? HK * D : D;
  g.k_head = g.v_head = bshd ? D : s.seq_kv * D;
  g.lse_head = s.seq_q;
  seqs.resize(s.batch);
  for (std::size_t b = 0; b < s.batch; ++b) {
    seq_geom& q = seqs[b];
    q.q_base = q.o_base = b * s.seq_q * H * D;
    q.k_base = q.v_base = b * s.seq_kv * HK * D;
    q.lse_base = b * H * s.seq_q;
    q.sq = s.seq_q;
    q.skv = s.seq_kv;
  }
}

// Runs the two forward passes over prepared geometry.
template <class T, class O, class Dev>
void run_forward(Dev& dev, const geom& g, std::vector<seq_geom>& seqs, std::size_t max_sq, std::size_t max_skv, const T* q, const T* k, const T* v,
                 O* o, float* lse, const attention_options& opt) {
  using sf = stage_for<T>;
  std::size_t total_q_blocks = 0, total_kv_blocks = 0;
  assign_blocks(seqs, fwd_bq, fwd_bkv, total_q_blocks, total_kv_blocks);
  using E = typename sf::elem;
  const mask_rule mask = make_mask(opt);
  if (seqs.empty() || max_sq == 0) return;
  const std::size_t D = g.d, Dp = round_up(D, sf::NR);
  const std::size_t per_blk = detail::add_checked(detail::mul_checked(fwd_bkv, D, "attention workspace"),
                                                  detail::mul_checked(fwd_bkv, Dp, "attention workspace"), "attention workspace");
  const std::size_t ws_elems = mul3(total_kv_blocks, g.hkv, per_blk, "attention workspace");
  E* ws = ws_elems ? static_cast<E*>(dev.allocate(detail::mul_checked(ws_elems, sizeof(E), "attention workspace"))) : nullptr;
  E* kp = ws;
  E* vp = ws ? ws + total_kv_blocks * g.hkv * fwd_bkv * D : nullptr;
  struct guard {
    Dev& d;
    void* p;
    ~guard() {
      if (p) d.deallocate(p);
    }
  } gd{dev, ws};
  if (max_skv > 0)
    dev.launch(grid{ceil_div(max_skv, fwd_bkv), g.hkv, seqs.size()}, pack_kv_program<T, E, sf::NR, sf::KP>{k, v, seqs.data(), g, fwd_bkv, kp, vp});
  const float sc = softmax_scale(opt, D) * opt.q_scale * opt.k_scale * log2e;
  const std::size_t nqb = ceil_div(max_sq, fwd_bq);
  dev.launch(grid{nqb, g.hq, seqs.size()}, flash_fwd_program<T, O, typename sf::atom>{q, o, lse, kp, vp, seqs.data(), g, mask, sc, opt.v_scale, nqb});
}

}  // namespace detail::attn

inline namespace v0 {

// Forward attention over a dense batch. q, o: (batch, seq_q, heads_q, head_dim) in `layout`
// order; k, v: (batch, seq_kv, heads_kv, head_dim); lse (optional, may be empty):
// (batch, heads_q, seq_q) natural-log log-sum-exp of the scaled logits (−inf for fully masked rows).
template <class Dev, attention_input T, attention_output O>
void attention_forward(Dev& dev, const attention_shape& s, std::span<const T> q, std::span<const T> k, std::span<const T> v, std::span<O> o,
                       std::span<float> lse = {}, const attention_options& opt = {}) {
  using namespace detail::attn;
  check_io(dense_counts(s), {{q, "q"}, {o, "o"}}, {{k, "k"}, {v, "v"}}, {lse, "lse"}, true, opt);
  geom g;
  std::vector<seq_geom> seqs;
  dense_geom(s, g, seqs);
  run_forward<T, O>(dev, g, seqs, s.seq_q, s.seq_kv, q.data(), k.data(), v.data(), o.data(), lse.empty() ? nullptr : lse.data(), opt);
}

}  // namespace v0

namespace detail::attn {
// Validates cumulative offsets: batch+1 entries, cu[0] >= 0, non-decreasing, last <= tokens.
inline std::size_t check_offsets(std::span<const std::int32_t> cu, const char* name) {
  check(!cu.empty(), std::string(name) + " must have batch + 1 entries (got 0)");
  check(cu[0] >= 0, std::string(name) + "[0] = " + std::to_string(cu[0]) + " is negative");
  for (std::size_t i = 1; i < cu.size(); ++i)
    check(cu[i] >= cu[i - 1], std::string(name) + " is not non-decreasing at index " + std::to_string(i) + " (" + std::to_string(cu[i - 1]) + " > " +
                                  std::to_string(cu[i]) + ")");
  return static_cast<std::size_t>(cu.back());
}
// Counts of a varlen batch (checks the head shape, the offsets and the size arithmetic).
inline io_counts varlen_counts(const attention_varlen_shape& s) {
  check_heads(s.heads_q, s.heads_kv, s.head_dim);
  check(s.cu_q.size() == s.cu_kv.size(),
        "cu_q and cu_kv must have the same length (batch + 1): " + std::to_string(s.cu_q.size()) + " vs " + std::to_string(s.cu_kv.size()));
  const std::size_t tq = check_offsets(s.cu_q, "cu_q"), tkv = check_offsets(s.cu_kv, "cu_kv");
  io_counts n;
  n.q = mul3(tq, s.heads_q, s.head_dim, "attention shape");
  n.kv = mul3(tkv, s.heads_kv, s.head_dim, "attention shape");
  n.lse = detail::mul_checked(tq, s.heads_q, "attention shape");
  return n;
}
inline void varlen_geom(const attention_varlen_shape& s, geom& g, std::vector<seq_geom>& seqs, std::size_t& max_sq, std::size_t& max_skv) {
  const std::size_t H = s.heads_q, HK = s.heads_kv, D = s.head_dim;
  g.hq = H;
  g.hkv = HK;
  g.d = D;
  g.group = H / HK;
  g.q_tok = g.o_tok = H * D;
  g.q_head = g.o_head = D;
  g.k_tok = g.v_tok = HK * D;
  g.k_head = g.v_head = D;
  g.lse_head = static_cast<std::size_t>(s.cu_q.back());
  const std::size_t B = s.cu_q.size() - 1;
  seqs.resize(B);
  max_sq = max_skv = 0;
  for (std::size_t b = 0; b < B; ++b) {
    seq_geom& q = seqs[b];
    const std::size_t q0 = static_cast<std::size_t>(s.cu_q[b]), k0 = static_cast<std::size_t>(s.cu_kv[b]);
    q.sq = static_cast<std::size_t>(s.cu_q[b + 1]) - q0;
    q.skv = static_cast<std::size_t>(s.cu_kv[b + 1]) - k0;
    q.q_base = q.o_base = q0 * H * D;
    q.k_base = q.v_base = k0 * HK * D;
    q.lse_base = q0;
    max_sq = std::max(max_sq, q.sq);
    max_skv = std::max(max_skv, q.skv);
  }
}
}  // namespace detail::attn

inline namespace v0 {

// Forward attention over a varlen batch: q, o hold cu_q.back() tokens, k, v hold cu_kv.back()
// tokens, each [tokens, heads, head_dim]; lse (optional): [heads_q, cu_q.back()].
template <class Dev, attention_input T, attention_output O>
void attention_forward_varlen(Dev& dev, const attention_varlen_shape& s, std::span<const T> q, std::span<const T> k, std::span<const T> v,
                              std::span<O> o, std::span<float> lse = {}, const attention_options& opt = {}) {
  using namespace detail::attn;
  check_io(varlen_counts(s), {{q, "q"}, {o, "o"}}, {{k, "k"}, {v, "v"}}, {lse, "lse"}, true, opt);
  geom g;
  std::vector<seq_geom> seqs;
  std::size_t max_sq = 0, max_skv = 0;
  varlen_geom(s, g, seqs, max_sq, max_skv);
  run_forward<T, O>(dev, g, seqs, max_sq, max_skv, q.data(), k.data(), v.data(), o.data(), lse.empty() ? nullptr : lse.data(), opt);
}

}  // namespace v0

namespace detail::attn {
template <class T, class Dev>
void run_backward(Dev& dev, const geom& g, std::vector<seq_geom>& seqs, std::size_t max_sq, std::size_t max_skv, const T* q, const T* k, const T* v,
                  const T* o, const T* dout, const float* lse, T* dq, T* dk, T* dv, const attention_options& opt) {
  using sf = stage_for<T>;
  using E = typename sf::elem;
  const mask_rule mask = make_mask(opt);
  std::size_t nqb_tot = 0, nkb_tot = 0;
  assign_blocks(seqs, bwd_bq, bwd_bkv, nqb_tot, nkb_tot);
  const std::size_t D = g.d, Dp = round_up(D, sf::NR);
  const std::size_t qe = mul3(nqb_tot, g.hq, bwd_bq, "attention workspace"), ke = mul3(nkb_tot, g.hkv, bwd_bkv, "attention workspace");
  const std::size_t elems = detail::add_checked(detail::mul_checked(qe, 2 * (D + Dp), "attention workspace"),
                                                detail::mul_checked(ke, 2 * D + Dp, "attention workspace"), "attention workspace");
  const std::size_t bytes = detail::add_checked(detail::mul_checked(elems, sizeof(E), "attention workspace"),
                                                detail::mul_checked(qe, sizeof(float), "attention workspace") + 64, "attention workspace");
  void* mem = bytes ? dev.allocate(bytes) : nullptr;
  struct guard {
    Dev& d;
    void* p;
    ~guard() {
      if (p) d.deallocate(p);
    }
  } gd{dev, mem};
  bwd_ws<E> ws{};
  E* p = static_cast<E*>(mem);
  ws.qt = p;
  p += qe * D;
  ws.qn = p;
  p += qe * Dp;
  ws.dot = p;
  p += qe * D;
  ws.don = p;
  p += qe * Dp;
  ws.kt = p;
  p += ke * D;
  ws.kn = p;
  p += ke * Dp;
  ws.vt = p;
  p += ke * D;
  ws.delta = reinterpret_cast<float*>((reinterpret_cast<std::uintptr_t>(p) + 63) & ~std::uintptr_t{63});
  const float scale = softmax_scale(opt, D);
  const std::size_t nqb = ceil_div(max_sq, bwd_bq), nkb = ceil_div(max_skv, bwd_bkv);
  if (nqb) dev.launch(grid{nqb, g.hq, seqs.size()}, pack_q_program<T, E, sf::NR, sf::KP>{q, o, dout, seqs.data(), g, ws});
  if (nkb) dev.launch(grid{nkb, g.hkv, seqs.size()}, pack_kv_bwd_program<T, E, sf::NR, sf::KP>{k, v, seqs.data(), g, ws});
  if (nkb)
    dev.launch(grid{nkb, g.hkv, seqs.size()}, flash_bwd_dkdv_program<T, typename sf::atom>{k, v, lse, dk, dv, seqs.data(), g, ws, mask, scale, nkb});
  if (nqb)
    dev.launch(grid{nqb, g.hq, seqs.size()}, flash_bwd_dq_program<T, typename sf::atom>{q, dout, lse, dq, seqs.data(), g, ws, mask, scale, nqb});
}
}  // namespace detail::attn

inline namespace v0 {

// Backward attention over a dense batch (f32 or bf16): from q, k, v, the forward output o, its
// gradient dout and the forward log-sum-exp, computes dq (like q), dk and dv (like k, v). With
// GQA, dk/dv sum the gradients of every q head of the group (in head order). Deterministic.
template <class Dev, attention_output T>
void attention_backward(Dev& dev, const attention_shape& s, std::span<const T> q, std::span<const T> k, std::span<const T> v, std::span<const T> o,
                        std::span<const T> dout, std::span<const float> lse, std::span<T> dq, std::span<T> dk, std::span<T> dv,
                        const attention_options& opt = {}) {
  using namespace detail::attn;
  check_dense_backward(s, q, k, v, o, dout, lse, dq, dk, dv, opt);
  geom g;
  std::vector<seq_geom> seqs;
  dense_geom(s, g, seqs);
  run_backward<T>(dev, g, seqs, s.seq_q, s.seq_kv, q.data(), k.data(), v.data(), o.data(), dout.data(), lse.data(), dq.data(), dk.data(), dv.data(),
                  opt);
}

// Backward attention over a varlen batch (layouts as attention_forward_varlen).
template <class Dev, attention_output T>
void attention_backward_varlen(Dev& dev, const attention_varlen_shape& s, std::span<const T> q, std::span<const T> k, std::span<const T> v,
                               std::span<const T> o, std::span<const T> dout, std::span<const float> lse, std::span<T> dq, std::span<T> dk,
                               std::span<T> dv, const attention_options& opt = {}) {
  using namespace detail::attn;
  check_io(varlen_counts(s), {{q, "q"}, {o, "o"}, {dout, "dout"}, {dq, "dq"}}, {{k, "k"}, {v, "v"}, {dk, "dk"}, {dv, "dv"}}, {lse, "lse"}, false,
           opt);
  geom g;
  std::vector<seq_geom> seqs;
  std::size_t max_sq = 0, max_skv = 0;
  varlen_geom(s, g, seqs, max_sq, max_skv);
  run_backward<T>(dev, g, seqs, max_sq, max_skv, q.data(), k.data(), v.data(), o.data(), dout.data(), lse.data(), dq.data(), dk.data(), dv.data(),
                  opt);
}

}  // namespace v0

inline namespace v0 {

// Backward attention for e4m3 q, k, v with scales (dense batch): the gradients are those of the
// real inputs q·q_scale, k·k_scale, v·v_scale (what a bf16/f32 master copy receives). o, dout,
// lse are the forward's (o in O = f32 or bf16); dq, dk, dv are O. The inputs are dequantised to
// f32 (exact up to f32 rounding of the scale product) and the f32 backward runs on them.
template <class Dev, attention_output O>
void attention_backward(Dev& dev, const attention_shape& s, std::span<const e4m3> q, std::span<const e4m3> k, std::span<const e4m3> v,
                        std::span<const O> o, std::span<const O> dout, std::span<const float> lse, std::span<O> dq, std::span<O> dk, std::span<O> dv,
                        const attention_options& opt = {}) {
  using namespace detail::attn;
  const io_counts n = check_dense_backward(s, q, k, v, o, dout, lse, dq, dk, dv, opt);
  const std::size_t nq = n.q, nkv = n.kv;
  // f32 copies: q, k, v (dequantised), and o, dout, dq, dk, dv when O is not f32
  constexpr bool same = std::is_same_v<O, float>;
  const std::size_t base = detail::add_checked(nq, detail::mul_checked(2, nkv, "attention workspace"), "attention workspace");
  const std::size_t extra = same ? 0
                                 : detail::add_checked(detail::mul_checked(3, nq, "attention workspace"),
                                                       detail::mul_checked(2, nkv, "attention workspace"), "attention workspace");
  const std::size_t total = detail::add_checked(base, extra, "attention workspace");
  float* mem = total ? static_cast<float*>(dev.allocate(detail::mul_checked(total, sizeof(float), "attention workspace"))) : nullptr;
  struct guard {
    Dev& d;
    void* p;
    ~guard() {
      if (p) d.deallocate(p);
    }
  } gd{dev, mem};
  float* p = mem;
  float* q32 = p;
  p += nq;
  float* k32 = p;
  p += nkv;
  float* v32 = p;
  p += nkv;
  detail::quant::convert_on<float>(dev, q.data(), q32, nq, opt.q_scale);
  detail::quant::convert_on<float>(dev, k.data(), k32, nkv, opt.k_scale);
  detail::quant::convert_on<float>(dev, v.data(), v32, nkv, opt.v_scale);
  attention_options o1 = opt;
  o1.q_scale = o1.k_scale = o1.v_scale = 1.0f;
  if constexpr (same) {
    attention_backward<Dev, float>(dev, s, std::span<const float>(q32, nq), std::span<const float>(k32, nkv), std::span<const float>(v32, nkv), o,
                                   dout, lse, dq, dk, dv, o1);
  } else {
    float* o32 = p;
    p += nq;
    float* do32 = p;
    p += nq;
    float* dq32 = p;
    p += nq;
    float* dk32 = p;
    p += nkv;
    float* dv32 = p;
    detail::quant::convert_on<float>(dev, o.data(), o32, nq, 1.0f);
    detail::quant::convert_on<float>(dev, dout.data(), do32, nq, 1.0f);
    attention_backward<Dev, float>(dev, s, std::span<const float>(q32, nq), std::span<const float>(k32, nkv), std::span<const float>(v32, nkv),
                                   std::span<const float>(o32, nq), std::span<const float>(do32, nq), lse, std::span<float>(dq32, nq),
                                   std::span<float>(dk32, nkv), std::span<float>(dv32, nkv), o1);
    detail::quant::convert_on<O>(dev, dq32, dq.data(), nq, 1.0f);
    detail::quant::convert_on<O>(dev, dk32, dk.data(), nkv, 1.0f);
    detail::quant::convert_on<O>(dev, dv32, dv.data(), nkv, 1.0f);
  }
}

}  // namespace v0
inline namespace v0 {

// Decode: seq_q (a few) query rows per sequence against a KV cache read in place; each KV chunk
// is streamed once for all heads_q/heads_kv·seq_q rows of its kv heads (any number of rows; more
// than 64 per kv head run as several row tiles, each reading the chunk).
// q, o: [batch, seq_q, heads_q, head_dim]; lse (optional): [batch, heads_q, seq_q].
// Contiguous cache (page_size == 0): k, v are [batch, max_kv, heads_kv, head_dim].
// Paged cache: k, v are [num_pages, page_size, heads_kv, head_dim] and block_table is
// [batch, pages_per_seq]: token j of sequence b lives in page block_table[b][j / page_size]; only
// the pages of keys some query row can see are read (others, as a sliding window's past, may be -1).
// With `ring`, each row of block_table is a ring: token j lives in page
// block_table[b][(j / page_size) % pages_per_seq], so a sequence under a sliding window grows
// without bound in a fixed table, as long as the keys its query rows can see lie in at most
// pages_per_seq consecutive pages (an attention_error of errc::out_of_range names the sequence
// otherwise).
// seqlens_kv[b] is the number of cached tokens of sequence b (<= max_kv, or <= pages_per_seq·page_size
// without a ring).
// Masks as attention_forward (use causal + bottom_right for new tokens appended to the cache).
// Only the keys some query row can see are read: a sliding window's cost follows the window, not
// the sequence's length.
struct attention_decode_shape {
  std::size_t batch = 1, seq_q = 1, heads_q = 1, heads_kv = 1, head_dim = 0;
  std::size_t max_kv = 0;                                       // contiguous cache
  std::size_t page_size = 0, num_pages = 0, pages_per_seq = 0;  // paged cache
  bool ring = false;                                            // paged cache: block-table rows are rings
};

template <class Dev, attention_input T, attention_output O>
void attention_decode(Dev& dev, const attention_decode_shape& s, std::span<const T> q, std::span<const T> k, std::span<const T> v,
                      std::span<const std::int32_t> seqlens_kv, std::span<const std::int32_t> block_table, std::span<O> o, std::span<float> lse = {},
                      const attention_options& opt = {}) {
  using namespace detail::attn;
  // the cache is checked below: it is shaped by max_kv or by pages, not by seq_kv
  const io_counts n = dense_counts(attention_shape{s.batch, s.seq_q, 0, s.heads_q, s.heads_kv, s.head_dim, attention_layout::bshd});
  const std::size_t R = detail::mul_checked(s.heads_q / s.heads_kv, s.seq_q, "attention shape");
  check_io(n, {{q, "q"}, {o, "o"}}, {}, {lse, "lse"}, true, opt);
  check(seqlens_kv.size() == s.batch, "seqlens_kv has " + std::to_string(seqlens_kv.size()) + " entries, batch is " + std::to_string(s.batch));
  const bool paged = s.page_size > 0;
  const std::size_t row = detail::mul_checked(s.heads_kv, s.head_dim, "attention shape");
  std::size_t cap = 0;
  check(paged || !s.ring, "a ring block table needs a paged cache (page_size > 0)");
  if (paged) {
    check_buffer(k, mul3(s.num_pages, s.page_size, row, "attention shape"), "k_cache");
    check_buffer(v, mul3(s.num_pages, s.page_size, row, "attention shape"), "v_cache");
    check_buffer(block_table, detail::mul_checked(s.batch, s.pages_per_seq, "attention shape"), "block_table");
    cap = s.ring ? std::size_t(std::numeric_limits<std::int32_t>::max()) : detail::mul_checked(s.pages_per_seq, s.page_size, "attention shape");
  } else {
    check_buffer(k, mul3(s.batch, s.max_kv, row, "attention shape"), "k_cache");
    check_buffer(v, mul3(s.batch, s.max_kv, row, "attention shape"), "v_cache");
    cap = s.max_kv;
  }
  geom g;
  g.hq = s.heads_q;
  g.hkv = s.heads_kv;
  g.d = s.head_dim;
  g.group = s.heads_q / s.heads_kv;
  g.q_tok = g.o_tok = s.heads_q * s.head_dim;
  g.q_head = g.o_head = s.head_dim;
  g.k_tok = g.v_tok = row;
  g.k_head = g.v_head = s.head_dim;
  g.lse_head = s.seq_q;
  g.page = s.page_size;
  g.page_stride = paged ? detail::mul_checked(s.page_size, row, "attention shape") : 0;
  g.ring = s.ring ? s.pages_per_seq : 0;
  std::vector<seq_geom> seqs(s.batch);
  const mask_rule mask = make_mask(opt);
  std::size_t max_kv = 0;
  for (std::size_t b = 0; b < s.batch; ++b) {
    const std::int32_t n = seqlens_kv[b];
    check(n >= 0 && static_cast<std::size_t>(n) <= cap,
          "seqlens_kv[" + std::to_string(b) + "] = " + std::to_string(n) + " is outside [0, " + std::to_string(cap) + "]");
    seq_geom& q0 = seqs[b];
    q0.sq = s.seq_q;
    q0.skv = static_cast<std::size_t>(n);
    q0.q_base = q0.o_base = b * s.seq_q * g.q_tok;
    q0.lse_base = b * s.heads_q * s.seq_q;
    q0.k_base = q0.v_base = b * s.max_kv * row;
    // the keys some query row can see, [vlo, vhi) (a sliding window's past may be given back)
    std::size_t vlo = q0.skv, vhi = 0;
    for (std::size_t r = 0; r < s.seq_q; ++r) {
      std::size_t lo = 0, hi = 0;
      mask.range(r, s.seq_q, q0.skv, lo, hi);
      if (lo < hi) {
        vlo = std::min(vlo, lo);
        vhi = std::max(vhi, hi);
      }
    }
    if (vlo >= vhi) vlo = vhi = 0;
    q0.kv_lo = vlo / dec_chunk * dec_chunk;  // the chunks before it hold no visible key
    if (paged) {
      const std::size_t p0 = vlo / s.page_size, p1 = ceil_div(vhi, s.page_size);
      if (s.ring && p1 - p0 > s.pages_per_seq)
        throw attention_error(errc::out_of_range, "sequence " + std::to_string(b) + "'s query rows see keys [" + std::to_string(vlo) + ", " +
                                                      std::to_string(vhi) + ") in " + std::to_string(p1 - p0) + " pages, more than its ring of " +
                                                      std::to_string(s.pages_per_seq) + " block-table entries");
      q0.pages = block_table.data() + b * s.pages_per_seq;
      for (std::size_t p = p0; p < p1; ++p) {
        const std::size_t e = s.ring ? p % s.pages_per_seq : p;
        if (q0.pages[e] < 0 || static_cast<std::size_t>(q0.pages[e]) >= s.num_pages)
          throw attention_error(errc::out_of_range, "block_table[" + std::to_string(b) + "][" + std::to_string(e) +
                                                        "] = " + std::to_string(q0.pages[e]) + " is not a page index in [0, " +
                                                        std::to_string(s.num_pages) + ")");
      }
    }
    max_kv = std::max(max_kv, q0.skv - q0.kv_lo);
  }
  if (s.batch == 0 || s.seq_q == 0) return;
  const decode_plan plan = decode_plan::make(R, s.heads_kv, s.head_dim, max_kv, s.batch, dev.capabilities().workers);
  const std::size_t part_elems = mul3(mul3(s.batch, s.heads_kv, plan.nsplit, "attention workspace"), R, s.head_dim + 2, "attention workspace");
  float* part = static_cast<float*>(dev.allocate(detail::mul_checked(part_elems, sizeof(float), "attention workspace")));
  struct guard {
    Dev& d;
    void* p;
    ~guard() { d.deallocate(p); }
  } gd{dev, part};
  const float sc = softmax_scale(opt, s.head_dim) * opt.q_scale * opt.k_scale * log2e;
  dev.launch(grid{plan.nsplit, plan.head_tiles * plan.row_tiles, s.batch},
             decode_split_program<T>{q.data(), k.data(), v.data(), seqs.data(), g, mask, sc, plan, part});
  dev.launch(grid{s.heads_kv, s.batch},
             decode_merge_program<O>{part, o.data(), lse.empty() ? nullptr : lse.data(), seqs.data(), g, R, plan.nsplit, opt.v_scale});
}

}  // namespace v0
}  // namespace tessel
