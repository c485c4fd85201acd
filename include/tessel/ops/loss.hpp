// Cross-entropy from logits fused with its backward, as a row-streaming tile program: per row an
// online log-sum-exp over cache-sized column blocks (one exp per logit, kept in the worker's
// scratch), the loss with label smoothing and an ignore index, then the gradient
// softmax − target = exp(z − bm)·exp(bm − lse) − target written directly: the probabilities are
// never written to memory, only the gradient is. The gradient may overwrite
// the logits (in place). Labels are all checked before the launch; the mean loss sums the row
// losses in row order, so it never depends on the worker count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <tessel/ops/detail/norm_rows.hpp>
#include <tessel/tile/block_ctx.hpp>
#include <tessel/tile/tensor.hpp>

namespace tessel {
inline namespace v0 {

struct cross_entropy_options {
  std::int64_t ignore_index = -100;  // rows with this label add no loss and get a zero gradient
  float label_smoothing = 0.0f;      // target = (1 - eps)·onehot + eps/V
  // Gradient multiplier; NaN (the default) means 1/(number of rows not ignored): the mean loss.
  float grad_scale = std::numeric_limits<float>::quiet_NaN();
};

struct cross_entropy_result {
  double loss = 0.0;        // mean over the rows not ignored (0 if none)
  std::size_t counted = 0;  // rows not ignored
};

}  // namespace v0

namespace detail::loss {

namespace st = tessel::arch::stream;
using namespace tessel::detail::rows;

inline constexpr std::size_t col_block = 4096;  // 16 KiB of f32: the block max and its exps stay in L1

template <class In, class G>
struct ce_program {
  tensor<const In, 2> z;
  tensor<G, 2> g;  // may be empty: loss only
  const std::int64_t* labels;
  float* row_loss;
  std::int64_t ignore;
  float eps, scale;
  std::size_t rpb, rows, n;
  bool nt;
  void operator()(block_ctx& ctx) const {
    if (g.data() != nullptr)
      pipelined_rows(ctx);
    else
      plain_rows(ctx);
  }

  // With a gradient: a pipeline over the block's rows, column block by column block. One loop
  // writes row r's gradient for column block b, reads block b of row r + 1 (its max and sum), and
  // takes the exponentials of block b − 1 of row r + 1 (from cache) into the scratch row e, where
  // row r's gradient has already consumed them. Gradient writes, logit reads and the exp
  // arithmetic all overlap, and each logit is read from memory once. Per row the arithmetic and
  // its order are those of plain_rows (the tests compare the losses bit for bit).
  void pipelined_rows(block_ctx& ctx) const {
    constexpr float ninf = -std::numeric_limits<float>::infinity();
    constexpr std::size_t W = st::width;
    const std::size_t r0 = ctx.block_linear() * rpb, r1 = std::min(rows, r0 + rpb), cnt = r1 - r0;
    const std::size_t nblk = (n + col_block - 1) / col_block;
    float* e = ctx.scratch().template allocate_array<float>(n);
    float* bmax = ctx.scratch().template allocate_array<float>(nblk);
    const float smooth = eps / float(n);
    float out_lse = 0.0f;  // log-sum-exp of the row being written
    for (std::size_t t = 0; t <= cnt; ++t) {
      const bool head = t < cnt && labels[r0 + t] != ignore;  // row r0 + t is read
      const bool out = t >= 1;                                // row r0 + t - 1 is written
      const bool out_zero = out && labels[r0 + t - 1] == ignore;
      const In* zr = t < cnt ? &z(r0 + t, 0) : nullptr;
      G* gr = out ? &g(r0 + t - 1, 0) : nullptr;
      const std::size_t oy = out && !out_zero ? std::size_t(labels[r0 + t - 1]) : 0;
      float py = 0.0f;
      float M = ninf, S = 0.0f, sum_z = 0.0f, prev_bm = ninf;
      for (std::size_t b = 0; b <= nblk; ++b) {
        const std::size_t c0 = b * col_block;
        const std::size_t len = b < nblk ? std::min(col_block, n - c0) : 0;
        // stage lengths: gradient and reads over block b, exponentials over block b - 1
        const std::size_t lo = out ? len : 0, lh = head ? len : 0;
        const std::size_t le = head && b >= 1 && prev_bm != ninf ? col_block : 0;  // every block but the last is full
        G* gb = out ? gr + c0 : nullptr;
        const float* eb = e + c0;
        const In* zb = head ? zr + c0 : nullptr;
        const In* const zp = head && b >= 1 ? zr + c0 - col_block : nullptr;
        float* const ep = b >= 1 ? e + c0 - col_block : nullptr;
        const float bmp = prev_bm;
        // the next column block of the row being read is requested into L1 meanwhile
        const In* pf = head && c0 + col_block < n ? zb + col_block : nullptr;
        const std::size_t pf_len = pf ? std::min(col_block, n - c0 - col_block) : 0;
        // softmax = exp(z - bm) · exp(bm - lse)
        float f = 0.0f;
        if (lo != 0 && !out_zero) {
          f = bmax[b] == ninf ? 0.0f : st::exp_fast(bmax[b] - out_lse);
          if (oy >= c0 && oy < c0 + len) py = e[oy] * f;
        }
        const bool dense = lo != 0 && !out_zero && f != 0.0f;
        const float flat = out_zero ? 0.0f : -scale * smooth;
        const auto grad = [&](std::size_t i, auto v0) {
          using V = decltype(v0);
          if (dense)
            typed_store_nt<G, V>(gb, i, V(scale) * st::fma(lanes_load<V>(eb, i), V(f), V(-smooth)), nt);
          else
            typed_store_nt<G, V>(gb, i, V(flat), nt);
        };
        const auto expo = [&](std::size_t i, auto v0) {
          using V = decltype(v0);
          const V x = st::exp_fast(typed_load<In, V>(zp, i) - V(bmp));
          lanes_store<V>(ep, i, x);
          return x;
        };
        st::vf mv(ninf), zacc(0.0f), eacc(0.0f);
        const std::size_t L = std::max(lo, std::max(lh, le));
        std::size_t i = 0;
        for (; i + W <= L; i += W) {
          if (i + W <= lo) grad(i, st::vf{});
          if (i + W <= lh) {
            if (pf && i < pf_len && i % (64 / sizeof(In)) == 0) st::prefetch(pf + i);
            const st::vf x = typed_load<In, st::vf>(zb, i);
            mv = st::max(mv, x);
            zacc = zacc + x;
          }
          if (i + W <= le) eacc = eacc + expo(i, st::vf{});
        }
        for (std::size_t j = lo / W * W; j < lo; ++j) grad(j, 0.0f);
        if (le != 0) {  // block b - 1 done: the online log-sum-exp update, in block order
          float bs = le >= W ? st::hsum(eacc) : 0.0f;
          for (std::size_t j = le / W * W; j < le; ++j) bs += expo(j, 0.0f);
          if (bmp > M) {
            S = st::fma(S, st::exp_fast(M - bmp), bs);
            M = bmp;
          } else {
            S = st::fma(bs, st::exp_fast(bmp - M), S);
          }
        }
        if (lh != 0) {
          float bz = lh >= W ? st::hsum(zacc) : 0.0f, ms = ninf;
          for (std::size_t j = lh / W * W; j < lh; ++j) {
            const float x = load1(zb, j);
            ms = st::max(ms, x);
            bz += x;
          }
          sum_z += bz;
          const float bm = std::max(ms, st::hmax(mv));
          bmax[b] = bm;
          prev_bm = bm;
          // the last block is short: its exponentials are taken here, not in a next round
          if (b + 1 == nblk && bm != ninf && len != col_block) {
            float* el = e + c0;
            const float bs = sum_lanes(len, [&](std::size_t k, auto v0) {
              using V = decltype(v0);
              const V x = st::exp_fast(typed_load<In, V>(zb, k) - V(bm));
              lanes_store<V>(el, k, x);
              return x;
            });
            if (bm > M) {
              S = st::fma(S, st::exp_fast(M - bm), bs);
              M = bm;
            } else {
              S = st::fma(bs, st::exp_fast(bm - M), S);
            }
            prev_bm = ninf;  // nothing left for the round after
          }
        }
      }
      if (out) {
        const std::size_t ro = r0 + t - 1;
        if (nt) st::nt_fence();  // the label's entry is patched with an ordinary store
        if (!out_zero)
          store1(gr, oy, scale * ((py - smooth) - (1.0f - eps)));
        else
          row_loss[ro] = 0.0f;
      }
      if (head) {
        const std::size_t rh = r0 + t;
        out_lse = M + std::log(S);
        const float zy = load1(zr, std::size_t(labels[rh]));
        row_loss[rh] = (1.0f - eps) * (out_lse - zy) + eps * (out_lse - sum_z / float(n));
      }
    }
  }

  // Loss only (no gradient): one row at a time.
  void plain_rows(block_ctx& ctx) const {
    const std::size_t r0 = ctx.block_linear() * rpb, r1 = std::min(rows, r0 + rpb);
    const bool want_grad = g.data() != nullptr;
    float* ebuf = want_grad ? ctx.scratch().template allocate_array<float>(n) : nullptr;
    float* bmax = want_grad ? ctx.scratch().template allocate_array<float>((n + col_block - 1) / col_block) : nullptr;
    for (std::size_t r = r0; r < r1; ++r) {
      const In* zr = &z(r, 0);
      G* gr = want_grad ? &g(r, 0) : nullptr;
      if (labels[r] == ignore) {
        row_loss[r] = 0.0f;
        if (gr) for_lanes(n, [&](std::size_t i, auto v0) { typed_store<G, decltype(v0)>(gr, i, decltype(v0)(0.0f)); });
        continue;
      }
      // online log-sum-exp over column blocks; with a gradient to write, each block's exp(z - bm)
      // is kept in the worker's scratch (one exp per logit in all: the gradient rescales them)
      float* e = want_grad ? ebuf : nullptr;
      float M = -std::numeric_limits<float>::infinity(), S = 0.0f, sum_z = 0.0f;
      for (std::size_t c0 = 0, b = 0; c0 < n; c0 += col_block, ++b) {
        const std::size_t len = std::min(col_block, n - c0);
        const In* zb = zr + c0;
        st::vf mv(-std::numeric_limits<float>::infinity());
        float ms = -std::numeric_limits<float>::infinity();
        const float bz = sum_lanes(len, [&](std::size_t i, auto v0) {
          using V = decltype(v0);
          const V x = typed_load<In, V>(zb, i);
          if constexpr (std::is_same_v<V, float>)
            ms = st::max(ms, x);
          else
            mv = st::max(mv, x);
          return x;
        });
        sum_z += bz;
        const float bm = std::max(ms, st::hmax(mv));
        if (e) bmax[b] = bm;
        if (bm == -std::numeric_limits<float>::infinity()) continue;
        const In* ahead = c0 + col_block < n ? zb + col_block : nullptr;  // the next block streams in meanwhile
        float* eb = e ? e + c0 : nullptr;
        const float bs = sum_lanes(len, [&](std::size_t i, auto v0) {
          using V = decltype(v0);
          if constexpr (!std::is_same_v<V, float>)
            if (ahead && c0 + col_block + i < n) st::prefetch(ahead + i);
          const V x = st::exp_fast(typed_load<In, V>(zb, i) - V(bm));
          if (eb) lanes_store<V>(eb, i, x);
          return x;
        });
        if (bm > M) {
          S = st::fma(S, st::exp_fast(M - bm), bs);
          M = bm;
        } else {
          S = st::fma(bs, st::exp_fast(bm - M), S);
        }
      }
      const float lse = M + std::log(S);
      const std::size_t y = std::size_t(labels[r]);
      const float zy = load1(zr, y);
      row_loss[r] = (1.0f - eps) * (lse - zy) + eps * (lse - sum_z / float(n));
      if (!gr) continue;
      const float smooth = eps / float(n);
      const In* next = r + 1 < r1 ? &z(r + 1, 0) : nullptr;  // streams in while this row computes
      float py = 0.0f;
      for (std::size_t c0 = 0, b = 0; c0 < n; c0 += col_block, ++b) {
        const std::size_t len = std::min(col_block, n - c0);
        // softmax = exp(z - bm) · exp(bm - lse)
        const float f = bmax[b] == -std::numeric_limits<float>::infinity() ? 0.0f : st::exp_fast(bmax[b] - lse);
        if (y >= c0 && y < c0 + len) py = e[y] * f;
        const float* eb = e + c0;
        G* gb = gr + c0;
        const In* nb = next ? next + c0 : nullptr;
        if (f == 0.0f) {
          for_lanes(len, [&](std::size_t i, auto v0) { typed_store_nt<G, decltype(v0)>(gb, i, decltype(v0)(-scale * smooth), nt); });
          continue;
        }
        for_lanes(len, [&](std::size_t i, auto v0) {
          using V = decltype(v0);
          if constexpr (!std::is_same_v<V, float>)
            if (nb) st::prefetch(nb + i);
          typed_store_nt<G, V>(gb, i, V(scale) * st::fma(lanes_load<V>(eb, i), V(f), V(-smooth)), nt);
        });
      }
      if (nt) st::nt_fence();  // the label's entry is patched with an ordinary store
      store1(gr, y, scale * ((py - smooth) - (1.0f - eps)));
    }
  }
};

}  // namespace detail::loss

inline namespace v0 {

// Cross-entropy of logits (rows, V) against integer labels. Writes the per-row loss to `row_loss`
// (may be empty) and, if `dlogits` is non-empty, d(loss)/d(logits) times grad_scale (default:
// the mean's 1/count). `dlogits` may be the logits' own storage.
template <class Dev, class In, class G>
cross_entropy_result cross_entropy(Dev& dev, tensor<const In, 2> logits, std::span<const std::int64_t> labels, tensor<G, 2> dlogits,
                                   std::span<float> row_loss = {}, const cross_entropy_options& o = {}) {
  using namespace detail::rows;
  static_assert(row_io_type<In> && row_io_type<G>, "tessel::cross_entropy: f32 or bf16 tensors");
  const std::size_t rows = logits.rows(), n = logits.cols();
  check_rows<layer_error>(logits, rows, n, "cross_entropy: logits");
  const bool grad = dlogits.data() != nullptr;
  if (grad) check_rows<layer_error>(dlogits, rows, n, "cross_entropy: dlogits");
  require<layer_error>(labels.size() == rows, "cross_entropy: " + std::to_string(labels.size()) + " labels for " + std::to_string(rows) + " rows");
  require<layer_error>(row_loss.empty() || row_loss.size() == rows, "cross_entropy: row_loss must be empty or have one element per row");
  require<layer_error>(std::isfinite(o.label_smoothing) && o.label_smoothing >= 0.0f && o.label_smoothing <= 1.0f,
                       "cross_entropy: label smoothing must be in [0, 1]");
  require<layer_error>(n > 0 || rows == 0, "cross_entropy: zero classes");
  cross_entropy_result res;
  for (std::size_t r = 0; r < rows; ++r) {
    const std::int64_t l = labels[r];
    if (l == o.ignore_index) continue;
    if (l < 0 || std::uint64_t(l) >= n)
      throw layer_error(errc::out_of_range,
                        "cross_entropy: label " + std::to_string(l) + " of row " + std::to_string(r) + " is outside [0, " + std::to_string(n) + ")");
    ++res.counted;
  }
  float scale = o.grad_scale;
  if (std::isnan(scale)) scale = res.counted ? 1.0f / float(res.counted) : 0.0f;
  require<layer_error>(std::isfinite(scale), "cross_entropy: grad_scale must be finite");
  if (rows == 0) return res;
  std::vector<float> own;
  float* rl = row_loss.data();
  if (row_loss.empty()) {
    own.resize(rows);
    rl = own.data();
  }
  const std::size_t rpb = rows_per_block(rows, n, dlogits.data() ? std::size_t{1} << 20 : std::size_t{1} << 15);
  dev.launch(grid{(rows + rpb - 1) / rpb},
             detail::loss::ce_program<In, G>{logits, dlogits, labels.data(), rl, o.ignore_index, o.label_smoothing, scale, rpb, rows, n,
                                             detail::rows::stream_out<G>(rows, n) && (const void*)dlogits.data() != (const void*)logits.data()});
  double sum = 0.0;
  for (std::size_t r = 0; r < rows; ++r) sum += double(rl[r]);
  res.loss = res.counted ? sum / double(res.counted) : 0.0;
  return res;
}

}  // namespace v0
}  // namespace tessel
