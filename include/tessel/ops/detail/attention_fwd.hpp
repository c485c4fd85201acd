// FlashAttention-2 forward as tile programs: a packing pass puts each K/V token block into the
// atom's B panels once (K as Kᵀ panels, V as VNNI pairs), then one block per (Q row block, head,
// sequence) streams the K/V blocks its mask allows with a running row max and sum, so no S×S
// buffer ever exists. Every output row is computed by one block in a fixed K/V order: results do
// not depend on the thread count. Users never include this.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <type_traits>

#include <tessel/ops/detail/attention_common.hpp>
#include <tessel/ops/detail/attention_pack.hpp>
#include <tessel/tile/block_ctx.hpp>
#include <tessel/types/convert.hpp>

namespace tessel::detail::attn {

// Tile sizes of the forward pass.
inline constexpr std::size_t fwd_bq = 96;  // Q rows per block (multiple of every atom's MR)
inline constexpr std::size_t fwd_bkv =
    256;  // K/V tokens per block (multiple of every atom's NR; 256 halves the acc round trips and row steps per flop of 128)

// Pass 1: pack block kb of K (T-form) and V (N-form) of kv head hk of sequence b.
template <class T, class E, std::size_t NR, std::size_t KP>
struct pack_kv_program {
  const T* k;
  const T* v;
  const seq_geom* seqs;
  geom g;
  std::size_t NB;  // tokens per block
  E* kp;           // [(blk)*hkv + hk] * NB*D
  E* vp;           // [(blk)*hkv + hk] * NB*Dp
  void operator()(block_ctx& ctx) const {
    const auto [kb, hk, b] = ctx.block_index3();
    const seq_geom& s = seqs[b];
    const std::size_t j0 = kb * NB;
    if (j0 >= s.skv) return;
    const std::size_t n = std::min(NB, s.skv - j0);
    const std::size_t D = g.d, Dp = round_up(D, NR);
    const std::size_t blk = (s.kv_blk0 + kb) * g.hkv + hk;
    const T* kb0 = k + s.k_base + hk * g.k_head + j0 * g.k_tok;
    const T* vb0 = v + s.v_base + hk * g.v_head + j0 * g.v_tok;
    const std::size_t kt = g.k_tok, vt = g.v_tok;
    pack_t<E, NR, KP, T>([&](std::size_t j) { return kb0 + j * kt; }, n, NB, D, kp + blk * NB * D);
    pack_n<E, NR, KP, T>([&](std::size_t j) { return vb0 + j * vt; }, n, NB, D, vp + blk * NB * Dp);
  }
};

// Pass 2: one (BQ rows, head h, sequence b) block of O and its log-sum-exp.
template <class T, class O, class Atom>
struct flash_fwd_program {
  using E = typename Atom::a_type;
  static constexpr std::size_t MR = Atom::mr, NR = Atom::nr, KP = Atom::k_pack;
  static constexpr std::size_t BQ = fwd_bq, BKV = fwd_bkv;
  static_assert(BQ % MR == 0 && BKV % NR == 0, "flash attention forward: block sizes must be multiples of the atom's MR and NR");
  const T* q;
  O* o;
  float* lse;  // may be null
  const E* kp;
  const E* vp;
  const seq_geom* seqs;
  geom g;
  mask_rule mask;
  float scale_log2;  // softmax scale * q_scale * k_scale * log2(e)
  float out_scale;   // v_scale
  std::size_t nqb;   // Q blocks of the longest sequence (grid x)

  void operator()(block_ctx& ctx) const {
    const auto idx = ctx.block_index3();
    const std::size_t qb = nqb - 1 - idx[0], h = idx[1], b = idx[2];  // long causal blocks first
    const seq_geom& s = seqs[b];
    const std::size_t i0 = qb * BQ;
    if (i0 >= s.sq) return;
    const std::size_t nq = std::min(BQ, s.sq - i0);
    const std::size_t D = g.d, Dp = round_up(D, NR), hk = h / g.group;
    const std::size_t nq_pad = round_up(nq, MR);
    auto& sc = ctx.scratch();
    E* qs = sc.allocate_array<E>(BQ * D);              // (BQ,D) Q rows in stage type
    float* sbuf = sc.allocate_array<float>(BQ * BKV);  // (BQ,BKV) logits
    E* pbuf = sc.allocate_array<E>(BQ * BKV);          // (BQ,BKV) probabilities
    float* acc = sc.allocate_array<float>(BQ * Dp);    // (BQ,Dp) unnormalised O
    float m[BQ], l[BQ];
    std::size_t lo[BQ], hi[BQ];

    const T* qrow0 = q + s.q_base + h * g.q_head + i0 * g.q_tok;
    for (std::size_t i = 0; i < nq_pad; ++i) {
      E* dst = qs + i * D;
      if (i < nq) {
        const T* src = qrow0 + i * g.q_tok;
        if constexpr (std::is_same_v<T, float> && std::is_same_v<E, float>)
          std::memcpy(dst, src, D * sizeof(float));
        else if constexpr (std::is_same_v<T, bf16> && std::is_same_v<E, std::uint16_t>)
          std::memcpy(dst, src, D * 2);
        else
          for (std::size_t d = 0; d < D; ++d) dst[d] = to_stage<E>(src[d]);
      } else {
        std::fill_n(dst, D, E{});
      }
    }
    std::size_t jlo = s.skv, jhi = 0;
    for (std::size_t i = 0; i < nq; ++i) {
      m[i] = -std::numeric_limits<float>::infinity();
      l[i] = 0.0f;
      mask.range(i0 + i, s.sq, s.skv, lo[i], hi[i]);
      if (lo[i] < hi[i]) {
        jlo = std::min(jlo, lo[i]);
        jhi = std::max(jhi, hi[i]);
      }
    }
    const float c = scale_log2;
    if (jlo < jhi) {
      const std::size_t kb_lo = jlo / BKV, kb_hi = (jhi + BKV - 1) / BKV;
      bool first = true;  // the first block's P·V writes acc (no zero fill, no rescale)
      for (std::size_t kb = kb_lo; kb < kb_hi; ++kb) {
        const std::size_t j0 = kb * BKV, nk = std::min({BKV, s.skv - j0, jhi - j0});  // keys right of every row's limit are skipped
        const std::size_t ncol = round_up(nk, NR), kdep = round_up(nk, KP);
        const std::size_t blk = (s.kv_blk0 + kb) * g.hkv + hk;
        // visible keys [a, e) of each row within this block, and per MR-row panel the columns any
        // of its rows sees: the micro-tiles right of that (masked for the whole panel) are skipped
        std::size_t ra[BQ], re[BQ], pcols[BQ / MR + 1];
        bool partial = false;
        for (std::size_t i = 0; i < nq_pad; ++i) {
          const std::size_t a = i < nq ? std::max(lo[i], j0) - j0 : 0;
          const std::size_t z = i < nq ? std::min(hi[i], j0 + nk) : 0;
          const std::size_t e = z > j0 ? z - j0 : 0;
          ra[i] = a;
          re[i] = a < e ? e : 0;
          if (i % MR == 0) pcols[i / MR] = 0;
          pcols[i / MR] = std::max(pcols[i / MR], re[i]);
          partial |= re[i] < nk;
        }
        // S = Q · Kᵀ  (nq_pad, ncol)
        if (partial)
          mma_direct_panels<Atom>(qs, D, nq_pad, kp + blk * BKV * D, D, ncol, D, sbuf, BKV, false, pcols, false);
        else
          mma_direct<Atom>(qs, D, nq_pad, kp + blk * BKV * D, D, ncol, D, sbuf, BKV, false);
        for (std::size_t i = 0; i < nq_pad; ++i) {
          float* srow = sbuf + i * BKV;
          E* prow = pbuf + i * BKV;
          const std::size_t a = ra[i], e = re[i];
          if (a >= e) {  // no key of this block is visible to row i
            std::fill_n(prow, kdep, E{});
            continue;
          }
          std::fill_n(prow, a, E{});
          const float alpha = arch::softmax::online_row(srow + a, e - a, c, m[i], l[i], prow + a);
          std::fill(prow + e, prow + kdep, E{});
          if (!first && alpha != 1.0f) arch::softmax::scale_row(acc + i * Dp, Dp, alpha);
        }
        // O += P · V  (nq_pad, Dp)
        if (partial)
          mma_direct_panels<Atom>(pbuf, BKV, nq_pad, vp + blk * BKV * Dp, BKV, Dp, kdep, acc, Dp, !first, pcols, true);
        else
          mma_direct<Atom>(pbuf, BKV, nq_pad, vp + blk * BKV * Dp, BKV, Dp, kdep, acc, Dp, !first);
        first = false;
      }
    }
    O* orow0 = o + s.o_base + h * g.o_head + i0 * g.o_tok;
    for (std::size_t i = 0; i < nq; ++i) {
      O* dst = orow0 + i * g.o_tok;
      float* src = acc + i * Dp;
      if (l[i] == 0.0f) {  // fully masked row: zeros and -inf
        for (std::size_t d = 0; d < D; ++d) dst[d] = from_f32<O>(0.0f);
        if (lse) lse[s.lse_base + h * g.lse_head + i0 + i] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float inv = out_scale / l[i];
      if constexpr (narrow_float<O>) {  // the bulk (vectorized) conversion, the same bits as O(float)
        arch::softmax::scale_row(src, D, inv);
        tessel::convert(std::span<const float>(src, D), std::span<O>(dst, D));
      } else {
        for (std::size_t d = 0; d < D; ++d) dst[d] = from_f32<O>(src[d] * inv);
      }
      if (lse) lse[s.lse_base + h * g.lse_head + i0 + i] = (m[i] + std::log2(l[i])) * ln2;
    }
  }
};

}  // namespace tessel::detail::attn
