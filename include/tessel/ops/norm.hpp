// LayerNorm and RMSNorm as row-streaming tile programs, forward and backward with the parameter
// gradients. The forward fuses an optional residual add before (h = x + residual, written out for
// the next block) and a cast after: to f32, bf16, or e4m3 with a scale and the tensor's amax (the
// FP8 recipe's delayed-scaling statistic). Each row is read from memory once; its later passes run
// from a cached f32 copy in the worker's scratch. Row sums use a fixed lane order, and parameter
// gradients are summed over a fixed split of the rows in a fixed order, so results never depend on
// the number of workers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <tessel/ops/detail/norm_rows.hpp>
#include <tessel/tile/block_ctx.hpp>
#include <tessel/tile/tensor.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/convert.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel {
inline namespace v0 {

struct norm_options {
  float eps = 1e-5f;
  float out_scale = 1.0f;   // e4m3 output: y_q = e4m3(y * out_scale), saturating
  float* amax = nullptr;    // if set: max |y| over the tensor (before out_scale)
  bool accumulate = false;  // backward: add into dweight/dbias instead of overwriting
};

}  // namespace v0

namespace detail::norm {

namespace st = tessel::arch::stream;
using namespace tessel::detail::rows;

template <class V>
inline V round_bf16(V x) {
  if constexpr (std::is_same_v<V, float>)
    return st::bf16_bits_to_f32(st::f32_to_bf16_bits(x));
  else
    return st::from_bits(st::bf16_rne_lanes(x) << 16);
}

// k < g (a function, so that an empty group's loops draw no always-false-comparison warning)
constexpr bool below(std::size_t k, std::size_t g) { return k < g; }
// f(k) for k = 0 .. G − 1 as compile-time constants, so per-row accumulators stay in registers
template <std::size_t G, class F>
inline void unrolled(F&& f) {
  [&]<std::size_t... K>(std::index_sequence<K...>) { (f(std::integral_constant<std::size_t, K>{}), ...); }
  (std::make_index_sequence<G>{});
}

template <class In, class Out>
struct fwd_program {
  tensor<const In, 2> x, res;
  tensor<In, 2> h_out;
  const float* w;
  const float* b;  // null for RMSNorm
  tensor<Out, 2> y;
  float* mean;
  float* rstd;
  float eps, out_scale;
  bool rms, has_res, has_h_out;
  float* amax_blocks;
  std::size_t rpb, rows, n;
  bool nt;

  void operator()(block_ctx& ctx) const {
    if (has_res)
      rms ? rows_<true, true>(ctx) : rows_<true, false>(ctx);
    else
      rms ? rows_<false, true>(ctx) : rows_<false, false>(ctx);
  }

  // Rows travel through the pipeline in groups of `group`: one loop over the columns writes the
  // outputs of one group and reads the next group from memory (its sums), so non-temporal writes
  // and reads stream together as in one elementwise pass, and each load of weight (and bias) from
  // cache serves a whole group. x (and the residual) are read from memory once; the output pass
  // re-reads the row from cache. Every row gets exactly the operations, in the same order, it would
  // get alone: grouping changes which rows share a loop, never a row's bits.
  // Measured at 8192 columns on one core (GB/s; f32 LayerNorm with a bias, bf16 LayerNorm):
  // groups of 1: 28 / 26, 2: 28 / 40, 4: 36 / 25 (bf16 rows lose in groups of 4).
  static constexpr std::size_t group = sizeof(In) == 4 ? 4 : 2;

  struct pass_state {
    float* bufs[2 * group];  // with a residual: h of a row in flight, slot (r - r0) % (2 group)
    float* qs[group];        // e4m3 output: scaled f32 rows before the saturating conversion
    const float* wb;         // weight and bias interleaved per vector (null without a bias)
    std::size_t r0, r1;
    st::vf amv;
    float ams;
  };

  // One loop over the columns: the output pass of rows ro .. ro + GO − 1 (mean mu, 1/σ rs) and the
  // first pass of rows ri .. ri + GI − 1 (h, with its residual add, summed as moments shifted by
  // c for LayerNorm or as squares for RMSNorm, into m).
  template <bool Res, bool Rms, std::size_t GO, std::size_t GI>
  void fused(pass_state& ps, std::size_t ro, const float* mu, const float* rs, std::size_t ri, const float* c, moments* m) const {
    constexpr std::size_t W = st::width, L = 64 / sizeof(In), NO = GO ? GO : 1, NI = GI ? GI : 1;
    constexpr bool fp8 = std::is_same_v<Out, e4m3>;
    const In* xi[NI] = {};
    const In* rri[NI] = {};
    In* hi[NI] = {};
    float* bi[NI] = {};
    const In* pxi[NI] = {};
    const In* pri[NI] = {};
    float ci[NI] = {};
    for (std::size_t k = 0; below(k, GI); ++k) {
      const std::size_t q = ri + k;
      xi[k] = &x(q, 0);
      ci[k] = c[k];
      // the same row of the next group is requested into L2 a whole group ahead: the few loads
      // the core keeps in flight by itself do not cover the memory latency
      const bool ahead = q + GI < ps.r1;
      pxi[k] = ahead ? &x(q + GI, 0) : nullptr;
      if constexpr (Res) {
        rri[k] = &res(q, 0);
        pri[k] = ahead ? &res(q + GI, 0) : nullptr;
        hi[k] = has_h_out ? &h_out(q, 0) : nullptr;
        bi[k] = ps.bufs[(q - ps.r0) % (2 * group)];
      }
    }
    const In* xo[NO] = {};
    const float* bo[NO] = {};
    Out* yo[NO] = {};
    float* qo[NO] = {};
    float muo[NO] = {}, rso[NO] = {};
    for (std::size_t k = 0; below(k, GO); ++k) {
      const std::size_t p = ro + k;
      xo[k] = &x(p, 0);
      if constexpr (Res) bo[k] = ps.bufs[(p - ps.r0) % (2 * group)];
      if constexpr (fp8)
        qo[k] = ps.qs[k];
      else
        yo[k] = &y(p, 0);
      muo[k] = mu[k];
      rso[k] = rs[k];
    }
    const float* wp = w;
    const float* bp = b;
    const float* wb = ps.wb;
    const bool want_amax = amax_blocks != nullptr, use_nt = nt;
    const float osc = out_scale;
    // U vectors from column i on: U = 2 for bf16 outputs, so that each (non-temporal) store
    // writes a whole 64-byte line
    const auto body = [&](std::size_t i, auto v0, auto uc, auto& a1, auto& a2, auto& am) {
      using V = decltype(v0);
      constexpr std::size_t U = uc;
      constexpr std::size_t S = std::is_same_v<V, float> ? 1 : W;  // columns per V
      if constexpr (GO > 0) {
        V wv[U], bv[U];
        unrolled<U>([&](auto u) {
          const std::size_t j = i + u * S;
          bv[u] = V(0.0f);
          if constexpr (std::is_same_v<V, float>) {
            wv[u] = wp[j];
            if (bp) bv[u] = bp[j];
          } else if (wb) {
            wv[u] = lanes_load<V>(wb, 2 * j);
            bv[u] = lanes_load<V>(wb, 2 * j + W);
          } else {
            wv[u] = lanes_load<V>(wp, j);
            if (bp) bv[u] = lanes_load<V>(bp, j);
          }
        });
        unrolled<GO>([&](auto kc) {
          constexpr std::size_t k = kc;
          V yv[U];
          unrolled<U>([&](auto u) {
            const std::size_t j = i + u * S;
            V hv;
            if constexpr (Res)
              hv = lanes_load<V>(bo[k], j);
            else
              hv = typed_load<In, V>(xo[k], j);
            const V xh = (hv - V(muo[k])) * V(rso[k]);
            yv[u] = bp ? st::fma(xh, wv[u], bv[u]) : xh * wv[u];
            if (want_amax) am = st::max(am, st::abs(yv[u]));
            if constexpr (fp8) lanes_store<V>(qo[k], j, yv[u] * V(osc));
          });
          if constexpr (fp8) {
            (void)osc;
          } else if constexpr (U == 2 && std::is_same_v<Out, bf16>) {
            st::store_bf16x2(yv[0], yv[1], reinterpret_cast<std::uint16_t*>(yo[k]) + i, use_nt);
          } else {
            unrolled<U>([&](auto u) { typed_store_nt<Out, V>(yo[k], i + u * S, yv[u], use_nt); });
          }
        });
      }
      unrolled<GI>([&](auto kc) {
        constexpr std::size_t k = kc;
        unrolled<U>([&](auto u) {
          const std::size_t j = i + u * S;
          if constexpr (!std::is_same_v<V, float>) {
            if (pxi[k] && j % L == 0) st::prefetch_l2(pxi[k] + j);
            if (Res && pri[k] && j % L == 0) st::prefetch_l2(pri[k] + j);
          }
          V h = typed_load<In, V>(xi[k], j);
          if constexpr (Res) {
            h = h + typed_load<In, V>(rri[k], j);
            if constexpr (std::is_same_v<In, bf16>) h = round_bf16(h);  // normalise what is saved
            if (hi[k]) typed_store<In, V>(hi[k], j, h);
            lanes_store<V>(bi[k], j, h);
          }
          if constexpr (Rms) {
            a2[k] = st::fma(h, h, a2[k]);
          } else {
            const V d = h - V(ci[k]);
            a1[k] = a1[k] + d;
            a2[k] = st::fma(d, d, a2[k]);
          }
        });
      });
    };
    using one = std::integral_constant<std::size_t, 1>;
    using two = std::integral_constant<std::size_t, 2>;
    const std::size_t nn = n;
    std::size_t i = 0;
    float s1[NI] = {}, s2[NI] = {};
    if (nn >= W) {
      st::vf a1[NI], a2[NI];
      unrolled<NI>([&](auto k) { a1[k] = st::vf(0.0f), a2[k] = st::vf(0.0f); });
      st::vf am = ps.amv;
      if constexpr (std::is_same_v<Out, bf16>)
        for (; i + 2 * W <= nn; i += 2 * W) body(i, st::vf{}, two{}, a1, a2, am);
      for (; i + W <= nn; i += W) body(i, st::vf{}, one{}, a1, a2, am);
      ps.amv = am;
      unrolled<GI>([&](auto k) { s1[k] = st::hsum(a1[k]), s2[k] = st::hsum(a2[k]); });
    }
    float am = ps.ams;
    for (; i < nn; ++i) body(i, 0.0f, one{}, s1, s2, am);
    ps.ams = am;
    for (std::size_t k = 0; below(k, GI); ++k) m[k] = {s1[k], s2[k]};
    if constexpr (fp8)
      for (std::size_t k = 0; below(k, GO); ++k) convert(std::span<const float>(qo[k], n), std::span<e4m3>(&y(ro + k, 0), n), overflow::saturate);
  }

  // Rows [a, e) (a multiple of G of them) through the pipeline in groups of G.
  template <bool Res, bool Rms, std::size_t G>
  void pipeline(pass_state& ps, std::size_t a, std::size_t e) const {
    if (a >= e) return;
    const float inv_n = 1.0f / float(n);
    // the shift of row r: its first h (LayerNorm; RMSNorm sums plain squares)
    const auto shift = [&](std::size_t r) {
      if constexpr (Rms)
        return (void)r, 0.0f;
      else if constexpr (Res) {
        float h = load1(&x(r, 0), 0) + load1(&res(r, 0), 0);
        if constexpr (std::is_same_v<In, bf16>) h = round_bf16(h);
        return h;
      } else {
        return load1(&x(r, 0), 0);
      }
    };
    float c[G], mu[G], rs[G];
    moments m[G];
    for (std::size_t k = 0; k < G; ++k) c[k] = shift(a + k);
    fused<Res, Rms, 0, G>(ps, 0, nullptr, nullptr, a, c, m);
    for (std::size_t r = a; r < e; r += G) {
      for (std::size_t k = 0; k < G; ++k) {
        const std::size_t q = r + k;
        if constexpr (Rms) {
          mu[k] = 0.0f;
          rs[k] = 1.0f / std::sqrt(m[k].s2 * inv_n + eps);
        } else {
          // mean and variance from moments shifted by the row's first value. When that shift is
          // far from the mean (|mean − c| > 4σ), cancellation could cost accuracy, and the exact
          // two-pass variance is taken from the cached row instead.
          const float d = m[k].s1 * inv_n;
          mu[k] = c[k] + d;
          float var = m[k].s2 * inv_n - d * d;
          if (!(d * d <= 16.0f * var)) {  // also NaN/Inf rows
            const In* xr = &x(q, 0);
            const float* bf = Res ? ps.bufs[(q - ps.r0) % (2 * group)] : nullptr;
            const float mq = mu[k];
            var = sum_lanes<true>(n,
                                  [&](std::size_t i, auto v0) {
                                    using V = decltype(v0);
                                    if constexpr (Res)
                                      return lanes_load<V>(bf, i) - V(mq);
                                    else
                                      return (void)bf, typed_load<In, V>(xr, i) - V(mq);
                                  }) *
                  inv_n;
          }
          rs[k] = 1.0f / std::sqrt(var + eps);
          if (mean) mean[q] = mu[k];
        }
        if (rstd) rstd[q] = rs[k];
      }
      if (r + G < e) {
        for (std::size_t k = 0; k < G; ++k) c[k] = shift(r + G + k);
        fused<Res, Rms, G, G>(ps, r, mu, rs, r + G, c, m);
      } else {
        fused<Res, Rms, G, 0>(ps, r, mu, rs, 0, nullptr, nullptr);
      }
    }
  }

  template <bool Res, bool Rms>
  void rows_(block_ctx& ctx) const {
    const std::size_t blk = ctx.block_linear();
    const std::size_t r0 = blk * rpb, r1 = std::min(rows, r0 + rpb);
    pass_state ps{};
    ps.r0 = r0;
    ps.r1 = r1;
    ps.amv = st::vf(0.0f);
    ps.ams = 0.0f;
    if constexpr (Res)
      for (auto& p : ps.bufs) p = ctx.scratch().template allocate_array<float>(n);
    if constexpr (std::is_same_v<Out, e4m3>)
      for (auto& p : ps.qs) p = ctx.scratch().template allocate_array<float>(n);
    // With a bias, weight and bias are interleaved vector by vector in scratch (once per block):
    // the output pass then reads one cached stream for both instead of two.
    constexpr std::size_t W = st::width;
    if (b && n >= W) {
      float* wb = ctx.scratch().template allocate_array<float>(2 * (n / W) * W);
      for (std::size_t k = 0; k + W <= n; k += W) {
        std::copy(w + k, w + k + W, wb + 2 * k);
        std::copy(b + k, b + k + W, wb + 2 * k + W);
      }
      ps.wb = wb;
    }
    // whole groups first, then the rows left over one at a time
    const std::size_t main = r0 + (r1 - r0) / group * group;
    pipeline<Res, Rms, group>(ps, r0, main);
    pipeline<Res, Rms, 1>(ps, main, r1);
    if (amax_blocks) amax_blocks[blk] = std::max(ps.ams, st::hmax(ps.amv));
    if (nt) st::nt_fence();
  }
};

template <class Dy, class In, class Dx>
struct bwd_program {
  tensor<const Dy, 2> dy;
  tensor<const In, 2> h;
  tensor<const float, 2> dres;
  tensor<Dx, 2> dx;
  const float* w;
  const float* mean;  // null for RMSNorm
  const float* rstd;
  float* partials;  // per block: dw (n) then db (n)
  bool want_db;
  std::size_t rpb, rows, n;
  bool nt;

  void operator()(block_ctx& ctx) const {
    if (mean)
      rows_<true>(ctx);
    else
      rows_<false>(ctx);
  }

  // Rows go in groups of `group`: one pass reads a group's dy and h and sums each row's two
  // coefficients c1 = Σ dy·w and c2 = Σ dy·w·x̂ together; then one pass writes the group's dx
  // from cache, adds its rows into the block's dweight/dbias partial sums (one load and store of
  // those per group, rows in row order) and requests the next group's dy and h into L2, so that
  // memory reads overlap the writes and the next reading pass runs from L2. (Fusing the two
  // passes into one loop, as the forward does, measured slower here: f32 LayerNorm 31 -> 26
  // GB/s, RMSNorm 35 -> 26 on one core, reading two streams while writing one; requesting the
  // next group from the reading pass instead of the writing pass: LayerNorm 0.75 -> 0.85 of triad.)
  // A row's operations and their order do not depend on the grouping.
  static constexpr std::size_t group = 2;
  struct coeffs {
    float c1, c2;
  };

  template <bool Ln, std::size_t GO, std::size_t GI>
  void fused(std::size_t ro, const coeffs* co, std::size_t ri, coeffs* cn, std::size_t r1, float* pw, float* pb) const {
    constexpr std::size_t W = st::width, NO = GO ? GO : 1, NI = GI ? GI : 1;
    constexpr std::size_t Ld = 64 / sizeof(Dy), Lh = 64 / sizeof(In);
    const Dy* dyi[NI] = {};
    const In* hi[NI] = {};
    float mui[NI] = {}, rsi[NI] = {};
    for (std::size_t k = 0; below(k, GI); ++k) {
      const std::size_t q = ri + k;
      dyi[k] = &dy(q, 0);
      hi[k] = &h(q, 0);
      mui[k] = Ln ? mean[q] : 0.0f;
      rsi[k] = rstd[q];
    }
    const Dy* dyo[NO] = {};
    const In* ho[NO] = {};
    const float* dro[NO] = {};
    Dx* dxo[NO] = {};
    const Dy* pno[NO] = {};
    const In* pnh[NO] = {};
    float muo[NO] = {}, rso[NO] = {}, c1o[NO] = {}, c2o[NO] = {};
    for (std::size_t k = 0; below(k, GO); ++k) {
      const std::size_t p = ro + k;
      dyo[k] = &dy(p, 0);
      ho[k] = &h(p, 0);
      dro[k] = dres.data() == nullptr ? nullptr : &dres(p, 0);
      dxo[k] = &dx(p, 0);
      if (p + GO < r1) pno[k] = &dy(p + GO, 0), pnh[k] = &h(p + GO, 0);
      muo[k] = Ln ? mean[p] : 0.0f;
      rso[k] = rstd[p];
      c1o[k] = co[k].c1;
      c2o[k] = co[k].c2;
    }
    const float* wp = w;
    const bool db = want_db, use_nt = nt;
    const auto body = [&](std::size_t i, auto v0, auto& a1, auto& a2) {
      using V = decltype(v0);
      const V wv = lanes_load<V>(wp, i);
      if constexpr (GO > 0) {
        // the next group's dy and h are requested into L2 while this group's dx streams out,
        // so memory reads and writes overlap and the next reading pass runs from L2
        if constexpr (!std::is_same_v<V, float>)
          unrolled<GO>([&](auto kc) {
            constexpr std::size_t k = kc;
            if (pno[k] && i % Ld == 0) st::prefetch_l2(pno[k] + i);
            if (pnh[k] && i % Lh == 0) st::prefetch_l2(pnh[k] + i);
          });
        V pwv = lanes_load<V>(pw, i), pbv(0.0f);
        if (db) pbv = lanes_load<V>(pb, i);
        unrolled<GO>([&](auto kc) {
          constexpr std::size_t k = kc;
          const V d = typed_load<Dy, V>(dyo[k], i);
          const V xh = (typed_load<In, V>(ho[k], i) - V(muo[k])) * V(rso[k]);
          const V g = d * wv;
          V o = V(rso[k]) * st::fma(xh, V(-c2o[k]), g - V(c1o[k]));
          if (dro[k]) o = o + lanes_load<V>(dro[k], i);
          typed_store_nt<Dx, V>(dxo[k], i, o, use_nt);
          pwv = st::fma(d, xh, pwv);
          if (db) pbv = pbv + d;
        });
        lanes_store<V>(pw, i, pwv);
        if (db) lanes_store<V>(pb, i, pbv);
      }
      unrolled<GI>([&](auto kc) {
        constexpr std::size_t k = kc;
        if constexpr (!std::is_same_v<V, float>) {}
        const V d = typed_load<Dy, V>(dyi[k], i);
        const V xh = (typed_load<In, V>(hi[k], i) - V(mui[k])) * V(rsi[k]);
        const V g = d * wv;
        if constexpr (Ln) a1[k] = a1[k] + g;
        a2[k] = st::fma(g, xh, a2[k]);
      });
    };
    const std::size_t nn = n;
    std::size_t i = 0;
    float s1[NI] = {}, s2[NI] = {};
    if (nn >= W) {
      st::vf a1[NI], a2[NI];
      unrolled<NI>([&](auto k) { a1[k] = st::vf(0.0f), a2[k] = st::vf(0.0f); });
      for (; i + W <= nn; i += W) body(i, st::vf{}, a1, a2);
      unrolled<GI>([&](auto k) { s1[k] = st::hsum(a1[k]), s2[k] = st::hsum(a2[k]); });
    }
    for (; i < nn; ++i) body(i, 0.0f, s1, s2);
    const float inv_n = 1.0f / float(nn);
    for (std::size_t k = 0; below(k, GI); ++k) cn[k] = {s1[k] * inv_n, s2[k] * inv_n};
  }

  template <bool Ln, std::size_t G>
  void pipeline(std::size_t a, std::size_t e, std::size_t r1, float* pw, float* pb) const {
    if (a >= e) return;
    coeffs c[G], cur[G];
    fused<Ln, 0, G>(0, nullptr, a, c, r1, pw, pb);
    for (std::size_t r = a; r < e; r += G) {
      std::copy(c, c + G, cur);
      fused<Ln, G, 0>(r, cur, 0, nullptr, r1, pw, pb);
      if (r + G < e) fused<Ln, 0, G>(0, nullptr, r + G, c, r1, pw, pb);
    }
  }

  template <bool Ln>
  void rows_(block_ctx& ctx) const {
    const std::size_t blk = ctx.block_linear();
    const std::size_t r0 = blk * rpb, r1 = std::min(rows, r0 + rpb);
    float* pw = partials + blk * 2 * n;
    float* pb = pw + n;
    std::fill(pw, pw + 2 * n, 0.0f);
    const std::size_t main = r0 + (r1 - r0) / group * group;
    pipeline<Ln, group>(r0, main, r1, pw, pb);
    pipeline<Ln, 1>(main, r1, r1, pw, pb);
    if (nt) st::nt_fence();
  }
};

// dw[j] = sum over blocks in block order (then added to dw[j] when accumulating).
struct reduce_program {
  const float* partials;
  float* dw;
  float* db;
  std::size_t blocks, n, cols_per_block;
  bool accumulate;
  void operator()(block_ctx& ctx) const {
    const std::size_t c0 = ctx.block_linear() * cols_per_block, c1 = std::min(n, c0 + cols_per_block);
    for (std::size_t j = c0; j < c1; ++j) {
      float sw = 0.0f, sb = 0.0f;
      for (std::size_t k = 0; k < blocks; ++k) {
        sw += partials[k * 2 * n + j];
        if (db) sb += partials[k * 2 * n + n + j];
      }
      dw[j] = accumulate ? dw[j] + sw : sw;  // accumulate adds this pass's exact result once
      if (db) db[j] = accumulate ? db[j] + sb : sb;
    }
  }
};

template <class T>
concept norm_out = std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, e4m3>;

template <class Dev, class In, class Out>
void forward(Dev& dev, bool rms, tensor<const In, 2> x, std::span<const float> w, std::span<const float> b, tensor<Out, 2> y, std::span<float> mean,
             std::span<float> rstd, const norm_options& o, tensor<const In, 2> res, tensor<In, 2> h_out) {
  static_assert(row_io_type<In>, "tessel norm: input must be f32 or bf16");
  static_assert(norm_out<Out>, "tessel norm: output must be f32, bf16 or e4m3");
  const char* who = rms ? "rmsnorm_forward" : "layernorm_forward";
  const std::size_t rows = x.rows(), n = x.cols();
  const std::string W = who;
  check_rows<layer_error>(x, rows, n, W + ": x");
  check_rows<layer_error>(y, rows, n, W + ": y");
  require<layer_error>(n > 0 || rows == 0, W + ": rows must not be empty");
  require<layer_error>(w.size() == n, W + ": weight has " + std::to_string(w.size()) + " elements, rows have " + std::to_string(n));
  if (!rms)
    require<layer_error>(b.empty() || b.size() == n, W + ": bias has " + std::to_string(b.size()) + " elements, rows have " + std::to_string(n));
  require<layer_error>(mean.empty() || rms || mean.size() == rows, W + ": mean must have one element per row");
  require<layer_error>(rstd.empty() || rstd.size() == rows, W + ": rstd must have one element per row");
  require<layer_error>(std::isfinite(o.eps) && o.eps > 0.0f, W + ": eps must be positive and finite");
  require<layer_error>(std::isfinite(o.out_scale) && o.out_scale > 0.0f, W + ": out_scale must be positive and finite");
  const bool has_res = res.data() != nullptr;
  if (has_res) check_rows<layer_error>(res, rows, n, W + ": residual");
  const bool has_h = h_out.data() != nullptr;
  if (has_h) {
    require<layer_error>(has_res, W + ": residual_out needs a residual");
    check_rows<layer_error>(h_out, rows, n, W + ": residual_out");
  }
  if (rows == 0) {
    if (o.amax) *o.amax = 0.0f;
    return;
  }
  const std::size_t rpb = rows_per_block(rows, n, pipelined_block);
  const std::size_t blocks = (rows + rpb - 1) / rpb;
  std::vector<float> am(o.amax ? blocks : 0, 0.0f);
  fwd_program<In, Out> p{x,
                         res,
                         h_out,
                         w.data(),
                         (rms || b.empty()) ? nullptr : b.data(),
                         y,
                         (rms || mean.empty()) ? nullptr : mean.data(),
                         rstd.empty() ? nullptr : rstd.data(),
                         o.eps,
                         o.out_scale,
                         rms,
                         has_res,
                         has_h,
                         o.amax ? am.data() : nullptr,
                         rpb,
                         rows,
                         n,
                         stream_out<Out>(rows, n)};
  dev.launch(grid{blocks}, p);
  if (o.amax) {
    float m = 0.0f;
    for (float v : am) m = std::max(m, v);
    *o.amax = m;
  }
}

template <class Dev, class Dy, class In, class Dx>
void backward(Dev& dev, bool rms, tensor<const Dy, 2> dy, tensor<const In, 2> h, std::span<const float> w, std::span<const float> mean,
              std::span<const float> rstd, tensor<Dx, 2> dx, std::span<float> dw, std::span<float> db, const norm_options& o,
              tensor<const float, 2> dres) {
  static_assert(row_io_type<Dy> && row_io_type<In> && row_io_type<Dx>, "tessel norm backward: tensors must be f32 or bf16");
  const std::string W = rms ? "rmsnorm_backward" : "layernorm_backward";
  const std::size_t rows = h.rows(), n = h.cols();
  check_rows<layer_error>(h, rows, n, W + ": saved input");
  check_rows<layer_error>(dy, rows, n, W + ": dy");
  check_rows<layer_error>(dx, rows, n, W + ": dx");
  if (dres.data() != nullptr) check_rows<layer_error>(dres, rows, n, W + ": dresidual");
  require<layer_error>(w.size() == n, W + ": weight has " + std::to_string(w.size()) + " elements, rows have " + std::to_string(n));
  require<layer_error>(dw.size() == n, W + ": dweight has " + std::to_string(dw.size()) + " elements, rows have " + std::to_string(n));
  if (!rms) require<layer_error>(db.empty() || db.size() == n, W + ": dbias must be empty or have one element per column");
  if (!rms) require<layer_error>(mean.size() == rows, W + ": mean must have one element per row");
  require<layer_error>(rstd.size() == rows, W + ": rstd must have one element per row");
  if (rows == 0 || n == 0) {
    if (!o.accumulate) {
      std::fill(dw.begin(), dw.end(), 0.0f);
      std::fill(db.begin(), db.end(), 0.0f);
    }
    return;
  }
  // A fixed split (depends on the shape only) so the parameter-gradient sums are reproducible.
  const std::size_t blocks = std::min<std::size_t>(rows, 32);
  const std::size_t rpb = (rows + blocks - 1) / blocks;
  const std::size_t nb = (rows + rpb - 1) / rpb;
  std::vector<float> partials(nb * 2 * n);
  const bool want_db = !rms && !db.empty();
  dev.launch(grid{nb}, bwd_program<Dy, In, Dx>{dy, h, dres, dx, w.data(), rms ? nullptr : mean.data(), rstd.data(), partials.data(), want_db, rpb,
                                               rows, n, stream_out<Dx>(rows, n) && (const void*)dx.data() != (const void*)dy.data()});
  const std::size_t cpb = 4096;
  dev.launch(grid{(n + cpb - 1) / cpb}, reduce_program{partials.data(), dw.data(), want_db ? db.data() : nullptr, nb, n, cpb, o.accumulate});
}

}  // namespace detail::norm

inline namespace v0 {

// y = (x - mean) / sqrt(var + eps) * weight + bias per row of x (rows, n); with a residual,
// the normalised row is h = x + residual, and h is written to residual_out when given. mean and
// rstd (one per row, may be empty) are what the backward pass needs. Out: f32, bf16 or e4m3.
template <class Dev, class In, class Out>
void layernorm_forward(Dev& dev, tensor<const In, 2> x, std::span<const float> weight, std::span<const float> bias, tensor<Out, 2> y,
                       std::span<float> mean, std::span<float> rstd, const norm_options& o = {}, tensor<const In, 2> residual = {},
                       tensor<In, 2> residual_out = {}) {
  detail::norm::forward(dev, false, x, weight, bias, y, mean, rstd, o, residual, residual_out);
}

// y = x / sqrt(mean(x^2) + eps) * weight, with the same residual and output options.
template <class Dev, class In, class Out>
void rmsnorm_forward(Dev& dev, tensor<const In, 2> x, std::span<const float> weight, tensor<Out, 2> y, std::span<float> rstd,
                     const norm_options& o = {}, tensor<const In, 2> residual = {}, tensor<In, 2> residual_out = {}) {
  detail::norm::forward(dev, true, x, weight, std::span<const float>{}, y, std::span<float>{}, rstd, o, residual, residual_out);
}

// Backward from the saved normalised input h (x, or x + residual): dx, dweight and dbias (may be
// empty). dresidual, if given, is the gradient arriving on the residual stream and is added to dx
// (the fused residual add's backward).
template <class Dev, class Dy, class In, class Dx>
void layernorm_backward(Dev& dev, tensor<const Dy, 2> dy, tensor<const In, 2> h, std::span<const float> weight, std::span<const float> mean,
                        std::span<const float> rstd, tensor<Dx, 2> dx, std::span<float> dweight, std::span<float> dbias, const norm_options& o = {},
                        tensor<const float, 2> dresidual = {}) {
  detail::norm::backward(dev, false, dy, h, weight, mean, rstd, dx, dweight, dbias, o, dresidual);
}

template <class Dev, class Dy, class In, class Dx>
void rmsnorm_backward(Dev& dev, tensor<const Dy, 2> dy, tensor<const In, 2> h, std::span<const float> weight, std::span<const float> rstd,
                      tensor<Dx, 2> dx, std::span<float> dweight, const norm_options& o = {}, tensor<const float, 2> dresidual = {}) {
  detail::norm::backward(dev, true, dy, h, weight, std::span<const float>{}, rstd, dx, dweight, std::span<float>{}, o, dresidual);
}

}  // namespace v0
}  // namespace tessel
