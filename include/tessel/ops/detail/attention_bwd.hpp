// FlashAttention-2 backward as tile programs, deterministic by construction:
//  1. pack pass: Q and dO blocks (T- and N-form panels) with delta_i = rowsum(dO_i ∘ O_i), and
//     K/V blocks (K in both forms, V in T-form);
//  2. dK/dV pass: one block per (K/V block, kv head, sequence) owns its rows of dK and dV and loops
//     over the q heads of its group and the Q blocks in a fixed order, recomputing P from the LSE;
//  3. dQ pass: one block per (Q block, head, sequence) owns its rows of dQ and loops over K/V blocks.
// No output element is ever accumulated by two blocks, so 1 or N threads give the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <tessel/ops/detail/attention_common.hpp>
#include <tessel/ops/detail/attention_pack.hpp>
#include <tessel/tile/block_ctx.hpp>

namespace tessel::detail::attn {

inline constexpr std::size_t bwd_bq = 96;   // Q rows per block
inline constexpr std::size_t bwd_bkv = 96;  // K/V rows per block

// Workspaces of the backward pass (stage elements E), indexed by packed block.
template <class E>
struct bwd_ws {
  E* qt;
  E* qn;
  E* dot;
  E* don;        // per (q blk, h): BQ*D, BQ*Dp, BQ*D, BQ*Dp
  float* delta;  // per (q blk, h): BQ
  E* kt;
  E* kn;
  E* vt;  // per (kv blk, hk): BKV*D, BKV*Dp, BKV*D
};

template <class E, class T>
inline void stage_rows(const T* src, std::size_t tok, std::size_t n, std::size_t rows_pad, std::size_t D, E* dst) {
  for (std::size_t i = 0; i < rows_pad; ++i) {
    E* out = dst + i * D;
    if (i < n) {
      const T* s = src + i * tok;
      if constexpr ((std::is_same_v<T, float> && std::is_same_v<E, float>) || (std::is_same_v<T, bf16> && std::is_same_v<E, std::uint16_t>))
        std::memcpy(out, s, D * sizeof(E));
      else
        for (std::size_t d = 0; d < D; ++d) out[d] = to_stage<E>(s[d]);
    } else {
      std::fill_n(out, D, E{});
    }
  }
}

template <class T, class E, std::size_t NR, std::size_t KP>
struct pack_q_program {
  const T* q;
  const T* o;
  const T* dout;
  const seq_geom* seqs;
  geom g;
  bwd_ws<E> ws;
  void operator()(block_ctx& ctx) const {
    const auto [qb, h, b] = ctx.block_index3();
    const seq_geom& s = seqs[b];
    const std::size_t i0 = qb * bwd_bq;
    if (i0 >= s.sq) return;
    const std::size_t n = std::min(bwd_bq, s.sq - i0), D = g.d, Dp = round_up(D, NR);
    const std::size_t blk = (s.q_blk0 + qb) * g.hq + h;
    const T* q0 = q + s.q_base + h * g.q_head + i0 * g.q_tok;
    const T* o0 = o + s.o_base + h * g.o_head + i0 * g.o_tok;
    const T* d0 = dout + s.o_base + h * g.o_head + i0 * g.o_tok;
    const std::size_t qt = g.q_tok, ot = g.o_tok;
    pack_t<E, NR, KP, T>([&](std::size_t j) { return q0 + j * qt; }, n, bwd_bq, D, ws.qt + blk * bwd_bq * D);
    pack_n<E, NR, KP, T>([&](std::size_t j) { return q0 + j * qt; }, n, bwd_bq, D, ws.qn + blk * bwd_bq * Dp);
    pack_t<E, NR, KP, T>([&](std::size_t j) { return d0 + j * ot; }, n, bwd_bq, D, ws.dot + blk * bwd_bq * D);
    pack_n<E, NR, KP, T>([&](std::size_t j) { return d0 + j * ot; }, n, bwd_bq, D, ws.don + blk * bwd_bq * Dp);
    float* delta = ws.delta + blk * bwd_bq;
    // delta_i = dO_i · O_i in 8 interleaved FMA chains (element d into chain d mod 8) added
    // pairwise: one chain was latency-bound at 4 cycles per element, most of this program's time
    for (std::size_t i = 0; i < bwd_bq; ++i) {
      float acc[8] = {};
      if (i < n) {
        const T* dr = d0 + i * ot;
        const T* orow = o0 + i * ot;
        std::size_t d = 0;
        for (; d + 8 <= D; d += 8)
          for (std::size_t l = 0; l < 8; ++l) acc[l] = std::fma(arch::to_f32(dr[d + l]), arch::to_f32(orow[d + l]), acc[l]);
        for (std::size_t l = 0; d < D; ++d, ++l) acc[l] = std::fma(arch::to_f32(dr[d]), arch::to_f32(orow[d]), acc[l]);
      }
      delta[i] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
  }
};

template <class T, class E, std::size_t NR, std::size_t KP>
struct pack_kv_bwd_program {
  const T* k;
  const T* v;
  const seq_geom* seqs;
  geom g;
  bwd_ws<E> ws;
  void operator()(block_ctx& ctx) const {
    const auto [kb, hk, b] = ctx.block_index3();
    const seq_geom& s = seqs[b];
    const std::size_t j0 = kb * bwd_bkv;
    if (j0 >= s.skv) return;
    const std::size_t n = std::min(bwd_bkv, s.skv - j0), D = g.d, Dp = round_up(D, NR);
    const std::size_t blk = (s.kv_blk0 + kb) * g.hkv + hk;
    const T* k0 = k + s.k_base + hk * g.k_head + j0 * g.k_tok;
    const T* v0 = v + s.v_base + hk * g.v_head + j0 * g.v_tok;
    const std::size_t kt = g.k_tok, vt = g.v_tok;
    pack_t<E, NR, KP, T>([&](std::size_t j) { return k0 + j * kt; }, n, bwd_bkv, D, ws.kt + blk * bwd_bkv * D);
    pack_n<E, NR, KP, T>([&](std::size_t j) { return k0 + j * kt; }, n, bwd_bkv, D, ws.kn + blk * bwd_bkv * Dp);
    pack_t<E, NR, KP, T>([&](std::size_t j) { return v0 + j * vt; }, n, bwd_bkv, D, ws.vt + blk * bwd_bkv * D);
  }
};

// dK, dV rows of one K/V block.
template <class T, class Atom>
struct flash_bwd_dkdv_program {
  using E = typename Atom::a_type;
  static constexpr std::size_t MR = Atom::mr, NR = Atom::nr, KP = Atom::k_pack;
  static constexpr std::size_t BQ = bwd_bq, BK = bwd_bkv;
  // padded tiles (rows rounded up to MR, columns to NR) must fit the blocks' workspace
  static_assert(BQ % MR == 0 && BQ % NR == 0 && BK % MR == 0 && BK % NR == 0,
                "flash attention backward: block sizes must be multiples of the atom's MR and NR");
  const T* k;
  const T* v;
  const float* lse;
  T* dk;
  T* dv;
  const seq_geom* seqs;
  geom g;
  bwd_ws<E> ws;
  mask_rule mask;
  float scale;  // softmax scale
  std::size_t nkb;

  // An f32 (rows, BQ) tile as the atom's A operand: itself for f32 atoms, else bf16 codes in `buf`.
  static const E* stage_tile(const float* x, std::size_t rows, std::size_t cols, E* buf) {
    if constexpr (std::is_same_v<E, float>) {
      (void)rows;
      (void)cols;
      (void)buf;
      return x;
    } else {
      for (std::size_t r = 0; r < rows; ++r) arch::softmax::to_bf16_row(x + r * BQ, cols, buf + r * BQ);
      return buf;
    }
  }

  void operator()(block_ctx& ctx) const {
    const auto idx = ctx.block_index3();
    const std::size_t kb = idx[0], hk = idx[1], b = idx[2];
    const seq_geom& s = seqs[b];
    const std::size_t j0 = kb * BK;
    if (j0 >= s.skv) return;
    const std::size_t nk = std::min(BK, s.skv - j0), nk_pad = round_up(nk, MR);
    const std::size_t D = g.d, Dp = round_up(D, NR);
    auto& sc = ctx.scratch();
    E* ks = sc.allocate_array<E>(BK * D);            // (BK,D) K rows
    E* vs = sc.allocate_array<E>(BK * D);            // (BK,D) V rows
    float* st = sc.allocate_array<float>(BK * BQ);   // (BK,BQ) Sᵀ then Pᵀ
    float* dpt = sc.allocate_array<float>(BK * BQ);  // (BK,BQ) dPᵀ then dSᵀ
    E* pe = sc.allocate_array<E>(BK * BQ);           // (BK,BQ) Pᵀ / dSᵀ in stage type
    float* dka = sc.allocate_array<float>(BK * Dp);  // (BK,Dp)
    float* dva = sc.allocate_array<float>(BK * Dp);  // (BK,Dp)
    stage_rows<E>(k + s.k_base + hk * g.k_head + j0 * g.k_tok, g.k_tok, nk, nk_pad, D, ks);
    stage_rows<E>(v + s.v_base + hk * g.v_head + j0 * g.v_tok, g.v_tok, nk, nk_pad, D, vs);
    std::fill_n(dka, nk_pad * Dp, 0.0f);
    std::fill_n(dva, nk_pad * Dp, 0.0f);
    const float c = scale * log2e;
    std::size_t lo[BQ], hi[BQ];
    float mrow[BQ], drow[BQ];
    const std::size_t nqb = ceil_div(s.sq, BQ);
    for (std::size_t hh = 0; hh < g.group; ++hh) {
      const std::size_t h = hk * g.group + hh;
      for (std::size_t qb = 0; qb < nqb; ++qb) {
        const std::size_t i0 = qb * BQ, nq = std::min(BQ, s.sq - i0);
        bool any = false;
        for (std::size_t i = 0; i < nq; ++i) {
          mask.range(i0 + i, s.sq, s.skv, lo[i], hi[i]);
          if (lo[i] < hi[i] && lo[i] < j0 + nk && hi[i] > j0) any = true;
        }
        if (!any) continue;
        const std::size_t blk = (s.q_blk0 + qb) * g.hq + h;
        const float* lrow = lse + s.lse_base + h * g.lse_head + i0;
        const float* dl = ws.delta + blk * BQ;
        for (std::size_t i = 0; i < nq; ++i) {
          mrow[i] = lrow[i] == -std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::infinity() : lrow[i] * log2e;
          drow[i] = dl[i];
        }
        const std::size_t ncol = round_up(nq, NR), kdep = round_up(nq, KP);
        // Sᵀ = K · Qᵀ  (nk_pad, ncol)
        mma_direct<Atom>(ks, D, nk_pad, ws.qt + blk * BQ * D, D, ncol, D, st, BQ, false);
        // dPᵀ = V · dOᵀ
        mma_direct<Atom>(vs, D, nk_pad, ws.dot + blk * BQ * D, D, ncol, D, dpt, BQ, false);
        // is every (row i, key j) pair of this tile visible? then no per-element mask is needed
        bool full = nq == BQ && nk == BK;
        for (std::size_t i = 0; full && i < nq; ++i) full = lo[i] <= j0 && hi[i] >= j0 + nk;
        for (std::size_t i = nq; i < kdep; ++i) {
          mrow[i] = std::numeric_limits<float>::infinity();  // padding columns: P = 0
          drow[i] = 0.0f;
        }
        for (std::size_t j = 0; j < nk_pad; ++j) {
          float* sr = st + j * BQ;
          float* dr = dpt + j * BQ;
          if (j >= nk) {
            std::fill_n(sr, kdep, 0.0f);
            std::fill_n(dr, kdep, 0.0f);
            continue;
          }
          arch::softmax::exp2_cols(sr, mrow, kdep, c, sr);  // Pᵀ(j, i) = exp(S·scale - lse_i)
          if (!full) {
            const std::size_t jj = j0 + j;
            for (std::size_t i = 0; i < nq; ++i)
              if (jj < lo[i] || jj >= hi[i]) sr[i] = 0.0f;
          }
          arch::softmax::softmax_grad_cols(sr, dr, drow, kdep);  // dSᵀ = Pᵀ ∘ (dPᵀ - delta)
        }
        // dV += Pᵀ · dO
        const E* pa = stage_tile(st, nk_pad, kdep, pe);
        mma_direct<Atom>(pa, BQ, nk_pad, ws.don + blk * BQ * Dp, BQ, Dp, kdep, dva, Dp, true);
        // dK += dSᵀ · Q
        const E* da = stage_tile(dpt, nk_pad, kdep, pe);
        mma_direct<Atom>(da, BQ, nk_pad, ws.qn + blk * BQ * Dp, BQ, Dp, kdep, dka, Dp, true);
      }
    }
    T* dk0 = dk + s.k_base + hk * g.k_head + j0 * g.k_tok;
    T* dv0 = dv + s.v_base + hk * g.v_head + j0 * g.v_tok;
    for (std::size_t j = 0; j < nk; ++j)
      for (std::size_t d = 0; d < D; ++d) {
        dk0[j * g.k_tok + d] = from_f32<T>(dka[j * Dp + d] * scale);
        dv0[j * g.v_tok + d] = from_f32<T>(dva[j * Dp + d]);
      }
  }
};

// dQ rows of one Q block.
template <class T, class Atom>
struct flash_bwd_dq_program {
  using E = typename Atom::a_type;
  static constexpr std::size_t MR = Atom::mr, NR = Atom::nr, KP = Atom::k_pack;
  static constexpr std::size_t BQ = bwd_bq, BK = bwd_bkv;
  // padded tiles (rows rounded up to MR, columns to NR) must fit the blocks' workspace
  static_assert(BQ % MR == 0 && BQ % NR == 0 && BK % MR == 0 && BK % NR == 0,
                "flash attention backward: block sizes must be multiples of the atom's MR and NR");
  const T* q;
  const T* dout;
  const float* lse;
  T* dq;
  const seq_geom* seqs;
  geom g;
  bwd_ws<E> ws;
  mask_rule mask;
  float scale;
  std::size_t nqb;

  void operator()(block_ctx& ctx) const {
    const auto idx = ctx.block_index3();
    const std::size_t qb = nqb - 1 - idx[0], h = idx[1], b = idx[2];
    const seq_geom& s = seqs[b];
    const std::size_t i0 = qb * BQ;
    if (i0 >= s.sq) return;
    const std::size_t nq = std::min(BQ, s.sq - i0), nq_pad = round_up(nq, MR);
    const std::size_t D = g.d, Dp = round_up(D, NR), hk = h / g.group;
    auto& sc = ctx.scratch();
    E* qs = sc.allocate_array<E>(BQ * D);
    E* ds = sc.allocate_array<E>(BQ * D);
    float* sb = sc.allocate_array<float>(BQ * BK);  // (BQ,BK) S then P
    float* dp = sc.allocate_array<float>(BQ * BK);  // (BQ,BK) dP then dS
    E* pe = sc.allocate_array<E>(BQ * BK);
    float* acc = sc.allocate_array<float>(BQ * Dp);
    stage_rows<E>(q + s.q_base + h * g.q_head + i0 * g.q_tok, g.q_tok, nq, nq_pad, D, qs);
    stage_rows<E>(dout + s.o_base + h * g.o_head + i0 * g.o_tok, g.o_tok, nq, nq_pad, D, ds);
    std::fill_n(acc, nq_pad * Dp, 0.0f);
    const float c = scale * log2e;
    std::size_t lo[BQ], hi[BQ];
    float mrow[BQ];
    const float* delta = ws.delta + ((s.q_blk0 + qb) * g.hq + h) * BQ;
    std::size_t jlo = s.skv, jhi = 0;
    for (std::size_t i = 0; i < nq; ++i) {
      mask.range(i0 + i, s.sq, s.skv, lo[i], hi[i]);
      mrow[i] = lse[s.lse_base + h * g.lse_head + i0 + i] * log2e;
      if (lo[i] < hi[i] && mrow[i] != -std::numeric_limits<float>::infinity()) {
        jlo = std::min(jlo, lo[i]);
        jhi = std::max(jhi, hi[i]);
      }
    }
    for (std::size_t kb = jlo < jhi ? jlo / BK : 0; jlo < jhi && kb < (jhi + BK - 1) / BK; ++kb) {
      const std::size_t j0 = kb * BK, nk = std::min({BK, s.skv - j0, jhi - j0});
      const std::size_t ncol = round_up(nk, NR), kdep = round_up(nk, KP);
      const std::size_t blk = (s.kv_blk0 + kb) * g.hkv + hk;
      mma_direct<Atom>(qs, D, nq_pad, ws.kt + blk * BK * D, D, ncol, D, sb, BK, false);
      mma_direct<Atom>(ds, D, nq_pad, ws.vt + blk * BK * D, D, ncol, D, dp, BK, false);
      for (std::size_t i = 0; i < nq_pad; ++i) {
        float* sr = sb + i * BK;
        float* dr = dp + i * BK;
        E* pr = pe + i * BK;
        const bool row_ok = i < nq && mrow[i] != -std::numeric_limits<float>::infinity();
        const std::size_t a = row_ok ? std::min(std::max(lo[i], j0) - j0, nk) : 0;
        const std::size_t e = row_ok ? (hi[i] > j0 ? std::min(hi[i] - j0, nk) : 0) : 0;
        std::fill_n(pr, kdep, E{});
        if (a >= e) continue;
        arch::softmax::exp2_inplace(sr + a, e - a, c, mrow[i]);
        arch::softmax::softmax_grad_row(sr + a, dr + a, e - a, delta[i], 1.0f);
        if constexpr (std::is_same_v<E, float>)
          std::copy(dr + a, dr + e, pr + a);
        else
          arch::softmax::to_bf16_row(dr + a, e - a, pr + a);
      }
      // dQ += dS · K
      mma_direct<Atom>(pe, BK, nq_pad, ws.kn + blk * BK * Dp, BK, Dp, kdep, acc, Dp, true);
    }
    T* dq0 = dq + s.q_base + h * g.q_head + i0 * g.q_tok;
    for (std::size_t i = 0; i < nq; ++i)
      for (std::size_t d = 0; d < D; ++d) dq0[i * g.q_tok + d] = from_f32<T>(acc[i * Dp + d] * scale);
  }
};

}  // namespace tessel::detail::attn
