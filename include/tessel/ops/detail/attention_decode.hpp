// Flash-decoding: a few query rows against a long (optionally paged) KV cache read in place.
// The KV length is cut into fixed chunks of dec_chunk keys at multiples of dec_chunk, from the
// first one a query row can see (the split depends only on the shape, never on the thread count; the kv-head tiles may follow the workers, which changes no bit). One block per (chunk, tile of kv heads and query rows, sequence) streams its
// chunk once: groups of dec_group tokens, and for each group every kv head of the tile in turn,
// all query rows of the head's GQA group at once (scores, online softmax, P·V fused per group),
// while the rows of the next group are pulled in as one dense stream; with bf16 and 4 query rows
// per kv head (GQA-4 decode) a full group is instead walked in token order with its lines
// requested ahead, so that the core's reads run under its math. The block leaves its rows'
// max m, sum l and unnormalised output; a merge pass combines the chunks of each row in chunk
// order: exact and deterministic. Users never include this.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <tessel/arch/decode_atoms.hpp>
#include <tessel/ops/detail/attention_common.hpp>
#include <tessel/tile/block_ctx.hpp>

namespace tessel::detail::attn {

inline constexpr std::size_t dec_chunk = 512;             // keys per split (multiple of dec_group)
inline constexpr std::size_t dec_group = 32;              // keys per online-softmax step (multiple of 16)
inline constexpr std::size_t dec_tok_group = 128;         // keys per step on the token-order path (64: 5%, 32: 11% slower)
inline constexpr std::size_t dec_row_tile = 64;           // query rows per block; more rows make more blocks
inline constexpr std::size_t dec_acc_budget = 64 * 1024;  // bytes of f32 accumulators per block

// A launch with fewer blocks than the device has workers (one sequence whose context fits one
// chunk: a decode step at batch 1) cuts its kv heads into more tiles, up to one per worker, so
// that every worker reads the cache. A kv head's rows are computed alone whichever tile holds it,
// so the tiles never change a bit (tests/ops/attention.cpp); no more than the workers, since a
// tile reads only its heads' part of each token row (4 tiles of 1 head on one thread: 19 -> 37 us
// per layer of the small Llama).

// How the rows and kv heads of one (chunk, sequence) are cut into blocks.
struct decode_plan {
  std::size_t rows = 0;      // R = (heads_q / heads_kv) * seq_q query rows per kv head
  std::size_t row_tile = 0;  // rows per block
  std::size_t row_tiles = 0;
  std::size_t heads_per_blk = 0;  // kv heads per block (all of them when the accumulators fit)
  std::size_t head_tiles = 0;
  std::size_t nsplit = 0;  // chunks of the longest visible stretch of keys
  static decode_plan make(std::size_t R, std::size_t hkv, std::size_t d, std::size_t max_kv, std::size_t batch = 1, std::size_t workers = 1) {
    decode_plan p;
    p.rows = R;
    p.row_tile = std::min(R, dec_row_tile);
    p.row_tiles = ceil_div(R, p.row_tile);
    p.nsplit = std::max<std::size_t>(1, ceil_div(max_kv, dec_chunk));
    p.heads_per_blk = std::clamp<std::size_t>(dec_acc_budget / (p.row_tile * d * sizeof(float)), 1, hkv);
    // fewer blocks than workers otherwise: fewer kv heads per block
    const std::size_t others = p.nsplit * p.row_tiles * std::max<std::size_t>(batch, 1);
    if (others * ceil_div(hkv, p.heads_per_blk) < workers)
      p.heads_per_blk = std::min(p.heads_per_blk, ceil_div(hkv, std::min(hkv, ceil_div(workers, others))));
    p.head_tiles = ceil_div(hkv, p.heads_per_blk);
    return p;
  }
};

// Partial result of one chunk: for each of R rows, [m, l, o(D)] (m in log2 units; a row that saw
// no key has m = -inf and its o is not written).
template <class T>
struct decode_split_program {
  const T* q;
  const T* kc;
  const T* vc;
  const seq_geom* seqs;
  geom g;
  mask_rule mask;
  float scale_log2;
  decode_plan plan;
  float* part;  // [(b*hkv + hk)*nsplit + s][R][D + 2]

  static constexpr bool has_fast = arch::decode::has_bf16_decode && std::is_same_v<T, bf16>;

  // Element offset of token j's row (kv head 0) in the cache.
  std::size_t token_offset(const seq_geom& s, std::size_t j) const {
    if (g.page) {
      std::size_t p = j / g.page;
      if (g.ring && p >= g.ring) p %= g.ring;
      return static_cast<std::size_t>(s.pages[p]) * g.page_stride + (j % g.page) * g.k_tok;
    }
    return s.k_base + j * g.k_tok;
  }

  void operator()(block_ctx& ctx) const {
    if constexpr (has_fast) {
      if (g.d % 32 == 0) {
        // blocks with 4 query rows per kv head take the token-order path, in longer steps
        const std::size_t rt = ctx.block_index3()[1] % plan.row_tiles;
        if (std::min(plan.row_tile, plan.rows - rt * plan.row_tile) == 4) return run<true, dec_tok_group>(ctx);
        return run<true, dec_group>(ctx);
      }
    }
    run<false, dec_group>(ctx);
  }

  // fast_bf16: bf16 codes straight into the vdpbf16ps atoms; else rows converted to f32. G keys
  // per online-softmax step.
  template <bool fast_bf16, std::size_t G>
  void run(block_ctx& ctx) const {
    static_assert(dec_chunk % G == 0 && G % 16 == 0);
    const auto idx = ctx.block_index3();
    const std::size_t sp = idx[0], b = idx[2];
    const std::size_t ht = idx[1] / plan.row_tiles, rt = idx[1] % plan.row_tiles;
    const seq_geom& s = seqs[b];
    const std::size_t R = plan.rows, D = g.d, W = D + 2;
    const std::size_t h0 = ht * plan.heads_per_blk, h1 = std::min(g.hkv, h0 + plan.heads_per_blk), nh = h1 - h0;
    const std::size_t r0 = rt * plan.row_tile, nr = std::min(plan.row_tile, R - r0);
    auto out_row = [&](std::size_t hk, std::size_t r) { return part + ((b * g.hkv + hk) * plan.nsplit + sp) * R * W + (r0 + r) * W; };
    auto write_empty = [&] {
      for (std::size_t hk = h0; hk < h1; ++hk)
        for (std::size_t r = 0; r < nr; ++r) {
          float* o = out_row(hk, r);
          o[0] = -std::numeric_limits<float>::infinity();
          o[1] = 0.0f;
        }
    };
    const std::size_t j0 = s.kv_lo + sp * dec_chunk;
    if (j0 >= s.skv || s.sq == 0) return write_empty();
    const std::size_t n = std::min(dec_chunk, s.skv - j0);
    // visible keys of each row, chunk-relative [lo, hi), and their union [clo, chi)
    std::size_t lo[dec_row_tile], hi[dec_row_tile];
    std::size_t clo = n, chi = 0;
    for (std::size_t r = 0; r < nr; ++r) {
      std::size_t l = 0, h = 0;
      mask.range((r0 + r) % s.sq, s.sq, s.skv, l, h);
      l = std::max(l, j0);
      h = std::min(h, j0 + n);
      lo[r] = l < h ? l - j0 : 0;
      hi[r] = l < h ? h - j0 : 0;
      if (lo[r] < hi[r]) {
        clo = std::min(clo, lo[r]);
        chi = std::max(chi, hi[r]);
      }
    }
    if (clo >= chi) return write_empty();
    using E = std::conditional_t<fast_bf16, std::uint16_t, float>;  // stage type of Q and P
    auto& sc = ctx.scratch();
    E* qs = sc.allocate_array<E>(nh * nr * D);           // (nh, nr, D) query rows
    float* acc = sc.allocate_array<float>(nh * nr * D);  // (nh, nr, D) unnormalised output
    float* m = sc.allocate_array<float>(nh * nr);
    float* l = sc.allocate_array<float>(nh * nr);
    float* sbuf = sc.allocate_array<float>(nr * G);                      // (nr, G) scores of one step
    E* pbuf = sc.allocate_array<E>(nr * G);                              // (nr, G) probabilities of one step
    float* kvf = fast_bf16 ? nullptr : sc.allocate_array<float>(G * D);  // (G, D) rows in f32
    // Token order (bf16, 4 query rows per kv head, the GQA-4 decode): full groups are walked in
    // address order, 4 token rows at a time (K rows, then V rows), with the lines 4 rows further
    // along requested ahead, so the core's reads run under its math; a dense burst followed by
    // head-order math (the general path below) runs the two one after the other. Q·Kᵀ reads each
    // token row whole before the next when the tile has a multiple of 4 kv heads (a single
    // sequential stream hides better under the math than 4 rows side by side, even at more Q
    // loads per line); P·V takes 4 rows side by side (pairs need 2; 8 rows lose the overlap, its
    // 1-thread kernel 3.8 -> 4.4-5.0 ms). Scores (G, rows)
    // and the probability pairs of one P·V step (PV/2, rows), rows = kv head * 4 + query row
    // padded to 16. PF: rows requested ahead along the walk (K rows, V rows, the next group's K
    // rows); 3 and 6 measured slower, 5 the same. PV: V rows per P·V step (8 spills the pair
    // registers).
    constexpr std::size_t PF = 4, PV = 4;
    bool tok = false;
    if constexpr (fast_bf16 && G == dec_tok_group) tok = nr == 4;
    const std::size_t ldr = round_up(nh * 4, std::size_t{16});
    float* st = tok ? sc.allocate_array<float>(G * ldr) : nullptr;
    std::uint32_t* pp = tok ? sc.allocate_array<std::uint32_t>(PV / 2 * ldr) : nullptr;
    float* alph = tok ? sc.allocate_array<float>(ldr) : nullptr;
    float* tsh = tok ? sc.allocate_array<float>(2 * ldr) : nullptr;  // online_tok_max's tmax and sh
    float* lsum = tok ? sc.allocate_array<float>(ldr) : nullptr;
    std::fill_n(acc, nh * nr * D, 0.0f);
    std::fill_n(m, nh * nr, -std::numeric_limits<float>::infinity());
    std::fill_n(l, nh * nr, 0.0f);
    for (std::size_t hh = 0; hh < nh; ++hh)
      for (std::size_t r = 0; r < nr; ++r) {
        const std::size_t rr = r0 + r;
        const T* src = q + s.q_base + ((h0 + hh) * g.group + rr / s.sq) * g.q_head + (rr % s.sq) * g.q_tok;
        E* dst = qs + (hh * nr + r) * D;
        if constexpr (fast_bf16)
          std::memcpy(dst, src, D * 2);
        else
          for (std::size_t d = 0; d < D; ++d) dst[d] = arch::to_f32(src[d]);
      }
    // Token rows (kv head 0) of the current and the next group. Keys of a group outside the
    // visible [clo, chi) are masked; their row pointers repeat a visible key's, so that a paged
    // cache may have given back the pages of keys no row can see (a sliding window's past).
    const T* kt[2][G];
    const T* vt[2][G];
    auto rows_of = [&](std::size_t gs, const T** kr, const T** vr) {
      const std::size_t cnt = std::min(G, chi - gs);
      for (std::size_t t = 0; t < G; ++t) {
        const std::size_t off = token_offset(s, j0 + std::max(gs + std::min(t, cnt - 1), clo));
        kr[t] = kc + off;
        vr[t] = vc + off;
      }
    };
    const std::size_t row_bytes = D * sizeof(T);
    const std::size_t ga = clo / G * G;
    // The rows of a group (every head of the tile), K and V line by line in address order: read
    // as one dense burst, this is a stream the hardware prefetchers follow at full speed, where
    // scattered per-head reads or software prefetches stall on the few L1 miss buffers (measured
    // 18-22 vs 14 GB/s per core on a 32k cache).
    auto touch_group = [&](const T* const* kr, const T* const* vr) {
      unsigned sink = 0;
      for (std::size_t t = 0; t < G; ++t) sink += arch::decode::touch_lines2(kr[t] + h0 * g.k_head, vr[t] + h0 * g.v_head, nh * row_bytes);
      arch::decode::keep(sink);
    };
    rows_of(ga, kt[0], vt[0]);
    if (!tok) touch_group(kt[0], vt[0]);
    const float c = scale_log2;
    int cur = 0;
    for (std::size_t gs = ga; gs < chi; gs += G, cur ^= 1) {
      const std::size_t cnt = std::min(G, chi - gs), nk2 = round_up(cnt, 2);
      const bool has_next = gs + G < chi;
      if (has_next) rows_of(gs + G, kt[cur ^ 1], vt[cur ^ 1]);
      if (has_next && !tok) touch_group(kt[cur ^ 1], vt[cur ^ 1]);  // the next group, while this one computes
      if constexpr (fast_bf16) {
        bool full = tok && cnt == G;
        for (std::size_t r = 0; r < nr && full; ++r) full = lo[r] <= gs && hi[r] >= gs + G;
        if (full) {
          using U16 = std::uint16_t;
          const std::size_t kh0 = h0 * g.k_head, vh0 = h0 * g.v_head;
          auto walk = [&](std::size_t p) -> const U16* {
            const T* r = p < G ? kt[cur][p] + kh0 : p < 2 * G ? vt[cur][p - G] + vh0 : has_next ? kt[cur ^ 1][p - 2 * G] + kh0 : vt[cur][G - 1] + vh0;
            return reinterpret_cast<const U16*>(r);
          };
          const U16 *rows[4], *pf[4];
          for (std::size_t t = 0; t < G; t += 4) {
            for (std::size_t u = 0; u < 4; ++u) {
              rows[u] = reinterpret_cast<const U16*>(kt[cur][t + u] + kh0);
              pf[u] = walk(t + u + PF);
            }
            if (nh % 4 == 0)
              arch::decode::qk_tok4_seq_bf16(qs, nh, D, rows, g.k_head, pf, st + t * ldr, ldr);
            else
              arch::decode::qk_tok4_bf16(qs, nh, D, rows, g.k_head, pf, st + t * ldr, ldr);
          }
          arch::decode::online_tok_max(st, ldr, G, nh * 4, c, m, alph, tsh, tsh + ldr);
          for (std::size_t row = 0; row < nh * 4; ++row) {
            if (alph[row] != 1.0f) arch::softmax::scale_row(acc + row * D, D, alph[row]);
            lsum[row] = 0.0f;
          }
          const U16 *vrows[PV], *vpf[PV];
          for (std::size_t t = 0; t < G; t += PV) {
            for (std::size_t u = 0; u < PV; ++u) {
              vrows[u] = reinterpret_cast<const U16*>(vt[cur][t + u] + vh0);
              vpf[u] = walk(G + t + u + PF);
            }
            arch::decode::online_tok_exp(st + t * ldr, ldr, PV, nh * 4, c, tsh, tsh + ldr, pp, lsum);
            arch::decode::pv_tok_bf16<PV>(pp, ldr, nh, D, vrows, g.v_head, vpf, acc);
          }
          for (std::size_t row = 0; row < nh * 4; ++row) l[row] = l[row] * alph[row] + lsum[row];
          continue;
        }
      }
      for (std::size_t hh = 0; hh < nh; ++hh) {
        const std::size_t hk = h0 + hh;
        const T* krow[G];
        const T* vrow[G];
        for (std::size_t t = 0; t < G; ++t) {
          krow[t] = kt[cur][t] + hk * g.k_head;
          vrow[t] = vt[cur][t] + hk * g.v_head;
        }
        const E* qh = qs + hh * nr * D;
        float* ah = acc + hh * nr * D;
        // S = Q · Kᵀ  (nr, cnt rounded to 16)
        if constexpr (fast_bf16) {
          for (std::size_t t = 0; t < cnt; t += 16)
            arch::decode::qk16_bf16(qh, nr, D, reinterpret_cast<const std::uint16_t* const*>(krow + t), sbuf + t, G);
        } else {
          const float* fr[G];
          for (std::size_t t = 0; t < cnt; ++t) {
            if constexpr (std::is_same_v<T, float>)
              fr[t] = krow[t];
            else {
              for (std::size_t d = 0; d < D; ++d) kvf[t * D + d] = arch::to_f32(krow[t][d]);
              fr[t] = kvf + t * D;
            }
          }
          arch::decode::qk_f32(qh, nr, D, fr, cnt, sbuf, G);
        }
        // online softmax of the step, row by row
        for (std::size_t r = 0; r < nr; ++r) {
          const float* srow = sbuf + r * G;
          E* prow = pbuf + r * G;
          const std::size_t x = std::max(lo[r], gs), y = std::min(hi[r], gs + cnt);
          if (x >= y) {
            std::fill_n(prow, nk2, E{});
            continue;
          }
          if constexpr (fast_bf16 && G == 32) {
            if (x == gs && y == gs + G) {  // every key of the step visible: the common case
              const float alpha = arch::softmax::online_step32_bf16(srow, c, m[hh * nr + r], l[hh * nr + r], prow);
              if (alpha != 1.0f) arch::softmax::scale_row(ah + r * D, D, alpha);
              continue;
            }
          }
          const std::size_t a = x - gs, e = y - gs;
          float& mr = m[hh * nr + r];
          const float t = arch::softmax::row_max(srow + a, e - a), mx = t * c;
          const float mn = std::max(mr, mx);
          const float alpha = arch::softmax::exp2_nonpos(mr - mn);
          std::fill_n(prow, a, E{});
          const float sum = arch::softmax::exp2_row(srow + a, e - a, c, mn - mx, prow + a, t);  // from the step's max (online_row)
          std::fill(prow + e, prow + nk2, E{});
          float& lr = l[hh * nr + r];
          lr = lr * alpha + sum;
          if (alpha != 1.0f) arch::softmax::scale_row(ah + r * D, D, alpha);
          mr = mn;
        }
        // O += P · V  (nr, D)
        if constexpr (fast_bf16) {
          for (std::size_t rr = 0; rr < nr; rr += 8)
            arch::decode::pv_bf16(pbuf + rr * G, G, std::min<std::size_t>(8, nr - rr), reinterpret_cast<const std::uint16_t* const*>(vrow), nk2, D,
                                  ah + rr * D, D);
        } else {
          const float* fr[G];
          for (std::size_t t = 0; t < cnt; ++t) {
            if constexpr (std::is_same_v<T, float>)
              fr[t] = vrow[t];
            else {
              for (std::size_t d = 0; d < D; ++d) kvf[t * D + d] = arch::to_f32(vrow[t][d]);
              fr[t] = kvf + t * D;
            }
          }
          arch::decode::pv_f32(pbuf, G, nr, fr, cnt, D, ah, D);
        }
      }
    }
    for (std::size_t hh = 0; hh < nh; ++hh)
      for (std::size_t r = 0; r < nr; ++r) {
        float* o = out_row(h0 + hh, r);
        o[0] = m[hh * nr + r];
        o[1] = l[hh * nr + r];
        if (l[hh * nr + r] == 0.0f)
          o[0] = -std::numeric_limits<float>::infinity();
        else if constexpr (fast_bf16)
          arch::decode::from_pv_order(acc + (hh * nr + r) * D, o + 2, D);
        else
          std::memcpy(o + 2, acc + (hh * nr + r) * D, D * sizeof(float));
      }
  }
};

// Merges the chunks of each (sequence, kv head): rows in chunk order.
template <class O>
struct decode_merge_program {
  const float* part;
  O* o;
  float* lse;
  const seq_geom* seqs;
  geom g;
  std::size_t rows, nsplit;
  float out_scale;
  void operator()(block_ctx& ctx) const {
    const auto [hk, b, unused] = ctx.block_index3();
    (void)unused;
    const seq_geom& s = seqs[b];
    const std::size_t R = rows, D = g.d, W = D + 2;
    if (s.sq == 0) return;
    const float* base = part + (b * g.hkv + hk) * nsplit * R * W;
    const std::size_t used = std::max<std::size_t>(1, ceil_div(s.skv - s.kv_lo, dec_chunk));  // chunks of this sequence
    float* acc = ctx.scratch().allocate_array<float>(D);
    for (std::size_t r = 0; r < R; ++r) {
      float M = -std::numeric_limits<float>::infinity();
      for (std::size_t sp = 0; sp < used; ++sp) M = std::max(M, base[(sp * R + r) * W]);
      const std::size_t h = hk * g.group + r / s.sq, i = r % s.sq;
      O* dst = o + s.o_base + h * g.o_head + i * g.o_tok;
      float* lp = lse ? lse + s.lse_base + h * g.lse_head + i : nullptr;
      if (M == -std::numeric_limits<float>::infinity()) {
        for (std::size_t d = 0; d < D; ++d) dst[d] = from_f32<O>(0.0f);
        if (lp) *lp = -std::numeric_limits<float>::infinity();
        continue;
      }
      float L = 0.0f;
      std::fill_n(acc, D, 0.0f);
      for (std::size_t sp = 0; sp < used; ++sp) {
        const float* pr = base + (sp * R + r) * W;
        if (pr[0] == -std::numeric_limits<float>::infinity()) continue;
        const float w = arch::softmax::exp2_nonpos(pr[0] - M);
        L = std::fma(pr[1], w, L);
        for (std::size_t d = 0; d < D; ++d) acc[d] = std::fma(pr[2 + d], w, acc[d]);
      }
      const float inv = out_scale / L;
      for (std::size_t d = 0; d < D; ++d) dst[d] = from_f32<O>(acc[d] * inv);
      if (lp) *lp = (M + std::log2(L)) * ln2;
    }
  }
};

}  // namespace tessel::detail::attn
