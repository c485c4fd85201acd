// Flash-decoding: a few query rows against a long (optionally paged) KV cache read in place.
// The KV length is cut into fixed chunks (the split depends only on the shape, never on the
// thread count); one block per (chunk, kv head, sequence) computes, for all q heads of its GQA
// group at once, the chunk's row max m, sum l and unnormalised output; a merge pass combines
// the chunks of each row in chunk order: exact and deterministic. Users never include this.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <tessel/arch/decode_atoms.hpp>
#include <tessel/ops/detail/attention_common.hpp>
#include <tessel/tile/block_ctx.hpp>

namespace tessel::detail::attn {

inline constexpr std::size_t dec_chunk = 512;  // keys per split (multiple of 16)

// Partial result of one chunk: for each of R rows, [m, l, o(D)] (m in log2 units).
template <class T>
struct decode_split_program {
  const T* q;
  const T* kc;
  const T* vc;
  const seq_geom* seqs;
  geom g;
  mask_rule mask;
  float scale_log2;
  std::size_t rows;        // R = group * sq
  std::size_t nsplit;
  float* part;             // [(b*hkv + hk)*nsplit + s][R][D + 2]

  const T* krow(const seq_geom& s, std::size_t hk, std::size_t j) const { return kc + token_offset(s, j) + hk * g.k_head; }
  const T* vrow(const seq_geom& s, std::size_t hk, std::size_t j) const { return vc + token_offset(s, j) + hk * g.v_head; }
  std::size_t token_offset(const seq_geom& s, std::size_t j) const {
    if (g.page) return static_cast<std::size_t>(s.pages[j / g.page]) * g.page_stride + (j % g.page) * g.k_tok;
    return s.k_base + j * g.k_tok;
  }

  void operator()(block_ctx& ctx) const {
    const auto [sp, hk, b] = ctx.block_index3();
    const seq_geom& s = seqs[b];
    const std::size_t R = rows, D = g.d, W = D + 2;
    float* out = part + ((b * g.hkv + hk) * nsplit + sp) * R * W;
    for (std::size_t r = 0; r < R; ++r) {
      out[r * W] = -std::numeric_limits<float>::infinity();
      out[r * W + 1] = 0.0f;
      std::fill_n(out + r * W + 2, D, 0.0f);
    }
    const std::size_t j0 = sp * dec_chunk;
    if (j0 >= s.skv || s.sq == 0) return;
    const std::size_t n = std::min(dec_chunk, s.skv - j0);
    std::size_t lo[64], hi[64];
    std::size_t clo = n, chi = 0;  // union of visible keys in this chunk, chunk-relative
    for (std::size_t r = 0; r < R; ++r) {
      std::size_t l = 0, h = 0;
      mask.range(r % s.sq, s.sq, s.skv, l, h);
      l = std::max(l, j0);
      h = std::min(h, j0 + n);
      lo[r] = l < h ? l - j0 : 0;
      hi[r] = l < h ? h - j0 : 0;
      if (lo[r] < hi[r]) { clo = std::min(clo, lo[r]); chi = std::max(chi, hi[r]); }
    }
    if (clo >= chi) return;
    // keys [a, e) of the chunk, rounded to 16 for the atoms (extra keys are masked)
    const std::size_t a = clo / 16 * 16, e = std::min(n, round_up(chi, 16));
    auto& sc = ctx.scratch();
    const std::size_t ncols = round_up(e - a, 16);
    float* sbuf = sc.allocate_array<float>(R * ncols);  // (R, keys) scores
    float* acc = sc.allocate_array<float>(R * D);       // (R, D)
    std::fill_n(acc, R * D, 0.0f);
    const std::size_t h0 = hk * g.group;
    auto qrow = [&](std::size_t r) { return q + s.q_base + (h0 + r / s.sq) * g.q_head + (r % s.sq) * g.q_tok; };
    float m[64], l[64];
    constexpr bool fast = arch::decode::has_bf16_decode && std::is_same_v<T, bf16>;
    if constexpr (fast) {
      if (D % 32 == 0) {
        std::uint16_t* qs = sc.allocate_array<std::uint16_t>(R * D);
        for (std::size_t r = 0; r < R; ++r) std::memcpy(qs + r * D, qrow(r), D * 2);
        const std::uint16_t* kp[16];
        for (std::size_t j = a; j < e; j += 16) {
          for (std::size_t t = 0; t < 16; ++t)
            kp[t] = reinterpret_cast<const std::uint16_t*>(krow(s, hk, j0 + std::min(j + t, e - 1)));
          arch::decode::qk16_bf16(qs, R, D, kp, sbuf + (j - a), ncols);
        }
        std::uint16_t* pb = sc.allocate_array<std::uint16_t>(R * ncols);
        softmax_rows(sbuf, ncols, a, e, lo, hi, m, l, pb);
        const std::uint16_t* vp[dec_chunk + 2];
        const std::size_t nk = round_up(e - a, 2);
        for (std::size_t j = 0; j < nk; ++j) vp[j] = reinterpret_cast<const std::uint16_t*>(vrow(s, hk, j0 + std::min(a + j, e - 1)));
        for (std::size_t r0 = 0; r0 < R; r0 += 8)
          arch::decode::pv_bf16(pb + r0 * ncols, ncols, std::min<std::size_t>(8, R - r0), vp, nk, D, acc + r0 * D, D);
        finish(out, acc, m, l);
        return;
      }
    }
    // portable path: rows in f32
    float* qs = sc.allocate_array<float>(R * D);
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t d = 0; d < D; ++d) qs[r * D + d] = arch::to_f32(qrow(r)[d]);
    float* kv = sc.allocate_array<float>(16 * D);
    const float* rp[16];
    for (std::size_t j = a; j < e; j += 16) {
      const std::size_t cnt = std::min<std::size_t>(16, e - j);
      for (std::size_t t = 0; t < cnt; ++t) {
        const T* src = krow(s, hk, j0 + j + t);
        for (std::size_t d = 0; d < D; ++d) kv[t * D + d] = arch::to_f32(src[d]);
        rp[t] = kv + t * D;
      }
      arch::decode::qk_f32(qs, R, D, rp, cnt, sbuf + (j - a), ncols);
    }
    softmax_rows(sbuf, ncols, a, e, lo, hi, m, l, sbuf);
    for (std::size_t j = a; j < e; j += 16) {
      const std::size_t cnt = std::min<std::size_t>(16, e - j);
      for (std::size_t t = 0; t < cnt; ++t) {
        const T* src = vrow(s, hk, j0 + j + t);
        for (std::size_t d = 0; d < D; ++d) kv[t * D + d] = arch::to_f32(src[d]);
        rp[t] = kv + t * D;
      }
      arch::decode::pv_f32(sbuf + (j - a), ncols, R, rp, cnt, D, acc, D);
    }
    finish(out, acc, m, l);
  }

  // Scores (R, ncols) for chunk keys [a, e) -> probabilities (stage type P) with row max/sum.
  template <class P>
  void softmax_rows(float* sbuf, std::size_t ncols, std::size_t a, std::size_t e, const std::size_t* lo, const std::size_t* hi, float* m, float* l,
                    P* pbuf) const {
    const std::size_t width = e - a;
    for (std::size_t r = 0; r < rows; ++r) {
      float* srow = sbuf + r * ncols;
      P* prow = pbuf + r * ncols;
      const std::size_t x = lo[r] < hi[r] ? lo[r] - a : 0, y = lo[r] < hi[r] ? hi[r] - a : 0;
      if (x >= y) {
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.0f;
        std::fill_n(prow, ncols, P{});
        continue;
      }
      m[r] = arch::softmax::row_max(srow + x, y - x) * scale_log2;
      l[r] = arch::softmax::exp2_row(srow + x, y - x, scale_log2, m[r], prow + x);
      std::fill_n(prow, x, P{});
      std::fill(prow + y, prow + ncols, P{});
      (void)width;
    }
  }
  void finish(float* out, const float* acc, const float* m, const float* l) const {
    const std::size_t W = g.d + 2;
    for (std::size_t r = 0; r < rows; ++r) {
      out[r * W] = m[r];
      out[r * W + 1] = l[r];
      std::copy_n(acc + r * g.d, g.d, out + r * W + 2);
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
    float* acc = ctx.scratch().allocate_array<float>(D);
    for (std::size_t r = 0; r < R; ++r) {
      float M = -std::numeric_limits<float>::infinity();
      for (std::size_t sp = 0; sp < nsplit; ++sp) M = std::max(M, base[(sp * R + r) * W]);
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
      for (std::size_t sp = 0; sp < nsplit; ++sp) {
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
