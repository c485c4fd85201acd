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

inline constexpr std::size_t dec_chunk = 256;  // keys per split (multiple of 32)

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

  template <class P>
  static void prefetch_row(const P* p, std::size_t bytes, int) {
    const char* c = reinterpret_cast<const char*>(p);
    for (std::size_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
  }

  void operator()(block_ctx& ctx) const {
    const auto idx = ctx.block_index3();
    const std::size_t sp = idx[0], b = idx[1];
    const seq_geom& s = seqs[b];
    const std::size_t R = rows, D = g.d, W = D + 2, HK = g.hkv;
    auto out_of = [&](std::size_t hk) { return part + ((b * HK + hk) * nsplit + sp) * R * W; };
    for (std::size_t hk = 0; hk < HK; ++hk) {
      float* out = out_of(hk);
      for (std::size_t r = 0; r < R; ++r) {
        out[r * W] = -std::numeric_limits<float>::infinity();
        out[r * W + 1] = 0.0f;
        std::fill_n(out + r * W + 2, D, 0.0f);
      }
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
    float* sbuf = sc.allocate_array<float>(HK * R * ncols);  // (HK, R, keys) scores
    float* acc = sc.allocate_array<float>(HK * R * D);       // (HK, R, D)
    float* m = sc.allocate_array<float>(HK * R);
    float* l = sc.allocate_array<float>(HK * R);
    std::fill_n(acc, HK * R * D, 0.0f);
    auto qrow = [&](std::size_t hk, std::size_t r) { return q + s.q_base + (hk * g.group + r / s.sq) * g.q_head + (r % s.sq) * g.q_tok; };
    // All kv heads of a token are adjacent in the cache, so one block walks the chunk's tokens in
    // memory order for every head: the reads stream instead of striding by the token size.
    constexpr bool fast = arch::decode::has_bf16_decode && std::is_same_v<T, bf16>;
    if constexpr (fast) {
      if (D % 32 == 0) {
        std::uint16_t* qs = sc.allocate_array<std::uint16_t>(HK * R * D);
        for (std::size_t hk = 0; hk < HK; ++hk)
          for (std::size_t r = 0; r < R; ++r) std::memcpy(qs + (hk * R + r) * D, qrow(hk, r), D * 2);
        const std::uint16_t* kp[16];
        // Software prefetch of whole token rows (every head) a group ahead: a block reads each
        // token's heads in turn, an order the hardware prefetchers do not follow.
        const std::size_t row_bytes = HK * D * 2;
        auto prefetch_tokens = [&](auto rowfn, std::size_t from, std::size_t to) {
          for (std::size_t t = from; t < std::min(to, e); ++t) prefetch_row(rowfn(s, 0, j0 + t), row_bytes, 0);
        };
        auto krow_fn = [this](const seq_geom& sg, std::size_t h, std::size_t j) { return krow(sg, h, j); };
        auto vrow_fn = [this](const seq_geom& sg, std::size_t h, std::size_t j) { return vrow(sg, h, j); };
        prefetch_tokens(krow_fn, a, a + 32);
        for (std::size_t j = a; j < e; j += 16) {
          prefetch_tokens(krow_fn, j + 32, j + 48);
          for (std::size_t hk = 0; hk < HK; ++hk) {
            for (std::size_t t = 0; t < 16; ++t) kp[t] = reinterpret_cast<const std::uint16_t*>(krow(s, hk, j0 + std::min(j + t, e - 1)));
            arch::decode::qk16_bf16(qs + hk * R * D, R, D, kp, sbuf + hk * R * ncols + (j - a), ncols);
          }
        }
        std::uint16_t* pb = sc.allocate_array<std::uint16_t>(HK * R * ncols);
        for (std::size_t hk = 0; hk < HK; ++hk) softmax_rows(sbuf + hk * R * ncols, ncols, a, e, lo, hi, m + hk * R, l + hk * R, pb + hk * R * ncols);
        const std::size_t nk = round_up(e - a, 2);
        constexpr std::size_t sub = 32;
        const std::uint16_t* vp[sub];
        prefetch_tokens(vrow_fn, a, a + sub);
        for (std::size_t j = 0; j < nk; j += sub) {
          const std::size_t cnt = std::min(sub, nk - j);
          prefetch_tokens(vrow_fn, a + j + sub, a + j + 2 * sub);
          for (std::size_t hk = 0; hk < HK; ++hk) {
            for (std::size_t t = 0; t < cnt; ++t) vp[t] = reinterpret_cast<const std::uint16_t*>(vrow(s, hk, j0 + std::min(a + j + t, e - 1)));
            for (std::size_t r0 = 0; r0 < R; r0 += 8)
              arch::decode::pv_bf16(pb + (hk * R + r0) * ncols + j, ncols, std::min<std::size_t>(8, R - r0), vp, cnt, D, acc + (hk * R + r0) * D, D);
          }
        }
        for (std::size_t hk = 0; hk < HK; ++hk) finish(out_of(hk), acc + hk * R * D, m + hk * R, l + hk * R);
        return;
      }
    }
    // portable path: rows in f32
    float* qs = sc.allocate_array<float>(R * D);
    float* kv = sc.allocate_array<float>(16 * D);
    const float* rp[16];
    for (std::size_t hk = 0; hk < HK; ++hk) {
      float* sb = sbuf + hk * R * ncols;
      float* ac = acc + hk * R * D;
      for (std::size_t r = 0; r < R; ++r)
        for (std::size_t d = 0; d < D; ++d) qs[r * D + d] = arch::to_f32(qrow(hk, r)[d]);
      for (std::size_t j = a; j < e; j += 16) {
        const std::size_t cnt = std::min<std::size_t>(16, e - j);
        for (std::size_t t = 0; t < cnt; ++t) {
          const T* src = krow(s, hk, j0 + j + t);
          for (std::size_t d = 0; d < D; ++d) kv[t * D + d] = arch::to_f32(src[d]);
          rp[t] = kv + t * D;
        }
        arch::decode::qk_f32(qs, R, D, rp, cnt, sb + (j - a), ncols);
      }
      softmax_rows(sb, ncols, a, e, lo, hi, m + hk * R, l + hk * R, sb);
      for (std::size_t j = a; j < e; j += 16) {
        const std::size_t cnt = std::min<std::size_t>(16, e - j);
        for (std::size_t t = 0; t < cnt; ++t) {
          const T* src = vrow(s, hk, j0 + j + t);
          for (std::size_t d = 0; d < D; ++d) kv[t * D + d] = arch::to_f32(src[d]);
          rp[t] = kv + t * D;
        }
        arch::decode::pv_f32(sb + (j - a), ncols, R, rp, cnt, D, ac, D);
      }
      finish(out_of(hk), ac, m + hk * R, l + hk * R);
    }
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
