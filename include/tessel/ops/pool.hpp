// 2-D pooling over NCHW or NHWC images as tile programs: max and average pooling (ONNX MaxPool /
// AveragePool geometry: kernel, stride, asymmetric padding, dilation, ceil_mode, count_include_pad),
// global average and global max pooling, each forward and backward, f32 or bf16 with f32 arithmetic.
// Every output sums (or compares) its window's taps in the order (kernel row, kernel column), and
// every input gradient adds its contributions in output-pixel order, so the bits depend neither on
// the layout, nor on the thread count, nor on the device. Bad geometry throws conv_error (the
// convolution-and-pooling family of ops/errors.hpp).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include <tessel/ops/conv.hpp>
#include <tessel/ops/errors.hpp>

namespace tessel {
inline namespace v0 {

// Geometry of a pooling (ONNX MaxPool/AveragePool attributes). ceil_mode rounds the output extent
// up, but a window must start inside the input or its leading padding (as PyTorch and the ONNX
// reference do). count_include_pad (average only): the divisor counts the taps inside the padded
// input [−pad_begin, extent + pad_end) instead of those inside the input; taps a ceil_mode window
// has beyond the padding never count.
struct pool2d_params {
  std::size_t kernel_h = 1, kernel_w = 1;
  std::size_t stride_h = 1, stride_w = 1;
  std::size_t pad_top = 0, pad_left = 0, pad_bottom = 0, pad_right = 0;
  std::size_t dilation_h = 1, dilation_w = 1;
  bool ceil_mode = false;
  bool count_include_pad = false;
  conv_layout layout = conv_layout::nchw;
};

enum class pool_kind : std::uint8_t { max, average };

}  // namespace v0

namespace detail {

// One spatial axis of a pooling: window o starts at o·stride − pad_begin; its taps r (coordinate
// start + r·dilation) in [lo, hi) lie inside the input, the first `padded` inside the padded input.
struct pool_axis {
  std::size_t in = 0, out = 0, k = 1, st = 1, pa = 0, pb = 0, dil = 1;
  struct taps {
    std::size_t lo, hi, padded;
  };
  taps window(std::size_t o) const {
    const std::ptrdiff_t start = static_cast<std::ptrdiff_t>(o * st) - static_cast<std::ptrdiff_t>(pa), d = static_cast<std::ptrdiff_t>(dil);
    const auto below = [&](std::ptrdiff_t end) {  // taps with coordinate < end
      if (end <= start) return std::size_t{0};
      return std::min(k, static_cast<std::size_t>((end - start + d - 1) / d));
    };
    const std::size_t lo = start >= 0 ? 0 : std::min(k, static_cast<std::size_t>((-start + d - 1) / d));
    const std::size_t hi = std::max(lo, below(static_cast<std::ptrdiff_t>(in)));
    return {lo, hi, below(static_cast<std::ptrdiff_t>(in + pb))};
  }
  std::size_t coord(std::size_t o, std::size_t r) const { return o * st + r * dil - pa; }  // for taps in [lo, hi)
};

struct pool_geom {
  std::size_t n, c;
  pool_axis y, x;
  conv_layout layout;
  bool include_pad;
  image_dims in() const { return {n, c, y.in, x.in}; }
  image_dims out() const { return {n, c, y.out, x.out}; }
  std::size_t taps() const { return y.k * x.k; }
};

inline pool_axis pool_axis_of(const char* axis, std::size_t in, std::size_t k, std::size_t st, std::size_t pa, std::size_t pb, std::size_t dil,
                              bool ceil_mode) {
  conv_check(k >= 1, [&] { return std::string("pool: empty kernel ") + axis; });
  conv_check(st >= 1, [&] { return std::string("pool: stride ") + axis + " must be at least 1"; });
  conv_check(dil >= 1, [&] { return std::string("pool: dilation ") + axis + " must be at least 1"; });
  const std::size_t padded = add_checked(add_checked(in, pa, "pool padded extent"), pb, "pool padded extent");
  const std::size_t span = add_checked(mul_checked(k - 1, dil, "pool kernel extent"), 1, "pool kernel extent");
  conv_check(padded >= span, [&] {
    return std::string("pool: kernel ") + axis + " extent " + std::to_string(span) + " (kernel " + std::to_string(k) + ", dilation " +
           std::to_string(dil) + ") exceeds the padded input " + axis + " " + std::to_string(padded);
  });
  pool_axis a{in, 0, k, st, pa, pb, dil};
  a.out = (padded - span + (ceil_mode ? st - 1 : 0)) / st + 1;
  if (ceil_mode && (a.out - 1) * st >= in + pa) --a.out;  // the last window would start in the trailing padding
  for (std::size_t o = 0; o < a.out; ++o) {
    const auto t = a.window(o);
    conv_check(t.lo < t.hi, [&] {
      return std::string("pool: window ") + std::to_string(o) + " along the " + axis + " has no tap inside the input of " + axis + " " +
             std::to_string(in) + " (padding " + std::to_string(pa) + "/" + std::to_string(pb) + ", kernel " + std::to_string(k) + ", dilation " +
             std::to_string(dil) + ")";
    });
  }
  return a;
}

inline pool_geom pool_geometry(const image_dims& x, const pool2d_params& p) {
  conv_check(p.layout == conv_layout::nchw || p.layout == conv_layout::nhwc, [] { return std::string("pool: unknown layout"); });
  conv_check(x.c >= 1, [&] { return "pool: no channels in input " + dims_str(x); });
  (void)x.size();
  pool_geom g{};
  g.n = x.n, g.c = x.c, g.layout = p.layout, g.include_pad = p.count_include_pad;
  g.y = pool_axis_of("height", x.h, p.kernel_h, p.stride_h, p.pad_top, p.pad_bottom, p.dilation_h, p.ceil_mode);
  g.x = pool_axis_of("width", x.w, p.kernel_w, p.stride_w, p.pad_left, p.pad_right, p.dilation_w, p.ceil_mode);
  (void)g.out().size();
  (void)mul_checked(g.out().size(), g.taps(), "pool work");
  return g;
}

template <class T>
inline T pool_from_f32(float v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return T(v);
}

// The max of a window keeps its first tap on ties; a NaN tap wins over numbers (the first NaN).
inline bool pool_better(float v, float best) { return v > best || (v != v && best == best); }
// pool_better(v, best) ? v : best without a branch (a window's taps in random order mispredict).
inline float pool_max_step(float v, float best) {
  const std::uint32_t take = 0u - static_cast<std::uint32_t>((v > best) | ((v != v) & (best == best)));
  return std::bit_cast<float>((std::bit_cast<std::uint32_t>(v) & take) | (std::bit_cast<std::uint32_t>(best) & ~take));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// pool_taps (below) over kernel rows rows[0, nr) of T at horizontal stride SX (1 or 2), an average
// divided by div: tap (r, s) of output i is rows[r][i·SX + s·dx], loaded straight into vectors
// (stride 2: f32 as two vectors' even words through one vpermt2ps; bf16 as dwords whose low word
// is the even element, shifted into place), four vectors at a time (a tap's compare and blend wait
// on the previous tap's, so one vector alone ran at the chain's latency). A masked load reads no
// word past the last tap's, so the rows are read in place.
template <pool_kind Kind, std::size_t SX, class T>
inline void pool_taps_direct(const T* const* rows, std::size_t nr, std::size_t kx, std::size_t dx, std::size_t n, float div, float* out) {
  constexpr bool max = Kind == pool_kind::max;
  constexpr std::size_t V = 4;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  for (std::size_t i = 0; i < n; i += 16 * V) {
    __mmask16 m[V], ma[V], mb[V];
    __mmask32 mw[V];
    __m512 a[V];
    for (std::size_t v = 0; v < V; ++v) {
      const std::size_t j = i + 16 * v, cnt = j < n ? std::min<std::size_t>(16, n - j) : 0, need = cnt ? SX * (cnt - 1) + 1 : 0;
      m[v] = static_cast<__mmask16>((1u << cnt) - 1u);
      ma[v] = static_cast<__mmask16>((1u << std::min<std::size_t>(need, 16)) - 1u);
      mb[v] = static_cast<__mmask16>(need > 16 ? (1u << (need - 16)) - 1u : 0u);
      mw[v] = static_cast<__mmask32>((std::uint64_t{1} << need) - 1u);
      a[v] = _mm512_setzero_ps();
    }
    const auto load = [&](const T* q, std::size_t v) {
      if constexpr (std::is_same_v<T, float>) {
        if constexpr (SX == 1)
          return _mm512_maskz_loadu_ps(m[v], q);
        else
          return _mm512_permutex2var_ps(_mm512_maskz_loadu_ps(ma[v], q), even, _mm512_maskz_loadu_ps(mb[v], q + 16));
      } else if constexpr (SX == 1) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m[v], q)), 16));
      } else {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_maskz_loadu_epi16(mw[v], q), 16));
      }
    };
    bool first = max;
    for (std::size_t r = 0; r < nr; ++r)
      for (std::size_t s = 0; s < kx; ++s) {
        const T* q = rows[r] + SX * i + s * dx;
        for (std::size_t v = 0; v < V; ++v) {
          const __m512 x = load(q + SX * 16 * v, v);
          if (first)
            a[v] = x;
          else if constexpr (max)
            a[v] = _mm512_mask_mov_ps(a[v], _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(a[v], a[v], _CMP_ORD_Q), x, a[v], _CMP_NLE_UQ), x);
          else
            a[v] = _mm512_add_ps(a[v], x);
        }
        first = false;
      }
    for (std::size_t v = 0; v < V; ++v) _mm512_mask_storeu_ps(out + i + 16 * v, m[v], max ? a[v] : _mm512_div_ps(a[v], _mm512_set1_ps(div)));
  }
}
#endif

// out[i] = the max (first NaN, else the first of the largest) or the sum (from 0, in order) of
// tp[0][i], ..., tp[nt-1][i] for i < n: the taps of a row of whole windows, in vectors, each
// window's value kept in a register across its taps (AVX-512: pool_taps_direct, one tap per row).
// A tap is taken when it is not <= the max so far (unordered: NaN taps win) and that max is not
// already NaN: xsimd 8's float `!=` is the ordered compare, so NaN is tested with isnan there.
template <pool_kind Kind>
inline void pool_taps(const float* const* tp, std::size_t nt, std::size_t n, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  pool_taps_direct<Kind, 1>(tp, nt, 1, 0, n, 1.0f, out);  // each tap a row of its own (x / 1 is x)
#else
  constexpr bool max = Kind == pool_kind::max;
  std::size_t i = 0;
  using B = xsimd::batch<float>;
  for (; i < n / B::size * B::size; i += B::size) {
    B a = max ? B::load_unaligned(tp[0] + i) : B(0.0f);
    for (std::size_t t = max ? 1 : 0; t < nt; ++t) {
      const B x = B::load_unaligned(tp[t] + i);
      if constexpr (max)
        a = xsimd::select((x > a) || (xsimd::isnan(x) && !xsimd::isnan(a)), x, a);
      else
        a = a + x;
    }
    a.store_unaligned(out + i);
  }
  for (; i < n; ++i) {
    float a = max ? tp[0][i] : 0.0f;
    for (std::size_t t = max ? 1 : 0; t < nt; ++t) a = max ? (pool_better(tp[t][i], a) ? tp[t][i] : a) : a + tp[t][i];
    out[i] = a;
  }
#endif
}

// Rows of output per block: about 4 blocks per worker over all images and channel blocks.
inline std::size_t pool_rows_per_block(std::size_t out_rows, std::size_t other_blocks, unsigned workers) {
  const std::size_t want = std::max<std::size_t>(1, ceil_div(4 * std::size_t(std::max(1u, workers)), std::max<std::size_t>(other_blocks, 1)));
  return std::max<std::size_t>(1, ceil_div(out_rows, want));
}

// Forward: block (image, channel block of CB, output-row block of RB).
template <class T, pool_kind Kind>
struct pool_fwd_program {
  static constexpr std::size_t CB = 64;
  const T* x;
  T* y;
  pool_geom g;
  std::size_t rb;

  kernel_cost cost(const grid&) const {
    return {double(g.out().size()) * double(g.taps()), double(g.in().size() + g.out().size()) * sizeof(T), math_precision::f32};
  }

  void operator()(block_ctx& ctx) const {
    const auto idx = ctx.block_index3();
    const std::size_t img = idx[0], c0 = idx[1] * CB, cn = std::min(CB, g.c - c0), oy0 = idx[2] * rb, oy1 = std::min(g.y.out, oy0 + rb);
    const std::size_t H = g.y.in, W = g.x.in, OW = g.x.out;
    if (g.layout == conv_layout::nchw) {
      // Plane by plane, a row of outputs at a time (each output's taps in the same order as the
      // NHWC path): an output pixel's channels lie a plane apart, and the channel-inner order
      // read a page per element on U-Net's 128x128 planes. The row's windows are computed once
      // per block (window() per output was most of the pool's time); the interior [ia, ib) of
      // whole windows runs tap by tap across the row in vectors (each output still seeing its
      // taps in order), the edges [0, ia) and [ib, OW) output by output. With AVX-512, strides
      // 1 and 2 load every tap's run of the row straight into vectors (pool_taps_direct);
      // elsewhere a stride-2 kernel row is first split into its even and odd words
      // (arch::copy_stride2), so that every tap reads a contiguous run: tap s of output ox is
      // word ox + ⌊s·dx/2⌋ of phase s·dx mod 2. (ResNet's 3x3 stride-2 max pool had gathered
      // element by element, at 2 GFLOP/s.) The next output row's new kernel rows are prefetched.
      auto* wx = ctx.scratch().template allocate_array<pool_axis::taps>(OW);
      float* acc = ctx.scratch().template allocate_array<float>(OW);
      for (std::size_t ox = 0; ox < OW; ++ox) wx[ox] = g.x.window(ox);
      const std::size_t sx = g.x.st, dx = g.x.dil, kx = g.x.k;
      const auto whole = [&](std::size_t ox) { return wx[ox].lo == 0 && wx[ox].hi == kx; };
      std::size_t ia = 0, ib;
      while (ia < OW && !whole(ia)) ++ia;
      for (ib = ia; ib < OW && whole(ib);) ++ib;
      const std::size_t L = ib - ia, ky = g.y.k;
      // Phases of a kernel row's interior inputs: sx == 1 one (the row), sx == 2 two (even and
      // odd words), larger strides one gathered run per tap. len[q]: the words phase q needs.
      const std::size_t nph = sx == 1 ? 1 : sx == 2 ? 2 : 0;
      std::size_t len[2] = {0, 0};
      for (std::size_t s = 0; s < kx && nph; ++s) len[(s * dx) % sx] = std::max(len[(s * dx) % sx], L + (s * dx) / sx);
      const std::size_t span = std::max(len[0], len[1]), per_row = nph ? 2 * span : kx * L;
      float* ph = ctx.scratch().template allocate_array<float>(ky * per_row);
      T* raw = ctx.scratch().template allocate_array<T>(span);
      const float** tp = ctx.scratch().template allocate_array<const float*>(ky * kx);
      [[maybe_unused]] const T** rows = ctx.scratch().template allocate_array<const T*>(ky);
      // tp[s] = the row of tap s of kernel row `row` (the interior's first window's) in f32, in buf
      const auto row_taps = [&](const T* row, float* buf, const float** tps) {
        if (nph == 0) {
          for (std::size_t s = 0; s < kx; ++s) {
            const T* q = row + s * dx;
            float* d = buf + s * L;
            for (std::size_t j = 0; j < L; ++j) d[j] = arch::to_f32(q[j * sx]);
            tps[s] = d;
          }
          return;
        }
        const float* base[2] = {nullptr, nullptr};
        for (std::size_t q = 0; q < nph; ++q) {
          if (len[q] == 0) continue;
          float* dst = buf + q * span;
          if constexpr (std::is_same_v<T, float>) {
            if (sx == 1)
              dst = const_cast<float*>(row);  // read in place, never written
            else
              arch::copy_stride2(row + q, dst, len[q]);
          } else if (sx == 1) {
            arch::widen(row, dst, len[q]);
          } else {
            arch::copy_stride2(row + q, raw, len[q]);
            arch::widen(static_cast<const T*>(raw), dst, len[q]);
          }
          base[q] = dst;
        }
        for (std::size_t s = 0; s < kx; ++s) tps[s] = base[(s * dx) % sx] + (s * dx) / sx;
      };
      auto* wy = ctx.scratch().template allocate_array<pool_axis::taps>(oy1 - oy0);
      for (std::size_t oy = oy0; oy < oy1; ++oy) wy[oy - oy0] = g.y.window(oy);
      for (std::size_t ch = c0; ch < c0 + cn; ++ch) {
        const T* p = x + (img * g.c + ch) * H * W;
        for (std::size_t oy = oy0; oy < oy1; ++oy) {
          const auto ty = wy[oy - oy0];
          T* o = y + ((img * g.c + ch) * g.y.out + oy) * OW;
          // row ty.lo less the left pad (unsigned: it may wrap below 0, the tap's index does not)
          const std::size_t r0 = g.y.coord(oy, ty.lo) * W - g.x.pa, ry = g.y.dil * W;
          const std::size_t nr = ty.hi - ty.lo;
          if (L > 0 && oy + 1 < oy1) {  // the next output row's new kernel rows, fetched ahead of their reads
            const std::size_t bytes = ((L - 1) * sx + (kx - 1) * dx + 1) * sizeof(T), last = g.y.coord(oy, ty.hi - 1);
            const auto t1 = wy[oy + 1 - oy0];
            for (std::size_t r = t1.lo; r < t1.hi; ++r) {
              const std::size_t iy = g.y.coord(oy + 1, r);
              if (iy <= last && g.y.dil == 1) continue;  // read by this row (dilated rows interleave: all fetched)
              const char* q = reinterpret_cast<const char*>(p + (iy * W + ia * sx - g.x.pa));
              for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(q + b);
            }
          }
          const float div_whole = float(g.include_pad ? ty.padded * kx : nr * kx);
          bool stored = false;  // the interior went straight to o
          if (L > 0) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
            if (sx <= 2) {
              for (std::size_t r = 0; r < nr; ++r) rows[r] = p + (r0 + r * ry + ia * sx);
              float* out = acc + ia;
              if constexpr (std::is_same_v<T, float>) out = o + ia;
              if (sx == 1)
                pool_taps_direct<Kind, 1>(rows, nr, kx, dx, L, div_whole, out);
              else
                pool_taps_direct<Kind, 2>(rows, nr, kx, dx, L, div_whole, out);
              if constexpr (!std::is_same_v<T, float>)
                for (std::size_t ox = ia; ox < ib; ++ox) o[ox] = pool_from_f32<T>(acc[ox]);
              stored = true;
            } else
#endif
            {
              for (std::size_t r = 0; r < nr; ++r) row_taps(p + (r0 + r * ry + ia * sx), ph + r * per_row, tp + r * kx);
              pool_taps<Kind>(tp, nr * kx, L, acc + ia);
            }
          }
          if (!stored)
            for (std::size_t ox = ia; ox < ib; ++ox) o[ox] = pool_from_f32<T>(Kind == pool_kind::max ? acc[ox] : acc[ox] / div_whole);
          const auto edge = [&](std::size_t ox) {
            const auto tx = wx[ox];
            const float div = float(g.include_pad ? ty.padded * tx.padded : nr * (tx.hi - tx.lo));
            const std::size_t q = r0 + ox * sx;
            float a = Kind == pool_kind::max ? arch::to_f32(p[q + tx.lo * dx]) : 0.0f;
            for (std::size_t r = 0; r < nr; ++r)
              for (std::size_t s = tx.lo; s < tx.hi; ++s) {
                const float v = arch::to_f32(p[q + r * ry + s * dx]);
                if constexpr (Kind == pool_kind::max)
                  a = pool_max_step(v, a);
                else
                  a += v;
              }
            o[ox] = pool_from_f32<T>(Kind == pool_kind::max ? a : a / div);
          };
          for (std::size_t ox = 0; ox < ia; ++ox) edge(ox);
          for (std::size_t ox = ib; ox < OW; ++ox) edge(ox);
        }
      }
      return;
    }
    for (std::size_t oy = oy0; oy < oy1; ++oy) {
      const auto ty = g.y.window(oy);
      for (std::size_t ox = 0; ox < OW; ++ox) {
        const auto tx = g.x.window(ox);
        const float div = float(g.include_pad ? ty.padded * tx.padded : (ty.hi - ty.lo) * (tx.hi - tx.lo));
        float acc[CB];
        const T* first = x + ((img * H + g.y.coord(oy, ty.lo)) * W + g.x.coord(ox, tx.lo)) * g.c + c0;
        for (std::size_t j = 0; j < cn; ++j) acc[j] = Kind == pool_kind::max ? arch::to_f32(first[j]) : 0.0f;
        for (std::size_t r = ty.lo; r < ty.hi; ++r)
          for (std::size_t s = tx.lo; s < tx.hi; ++s) {
            const T* p = x + ((img * H + g.y.coord(oy, r)) * W + g.x.coord(ox, s)) * g.c + c0;
            for (std::size_t j = 0; j < cn; ++j) {
              const float v = arch::to_f32(p[j]);
              if constexpr (Kind == pool_kind::max)
                acc[j] = pool_better(v, acc[j]) ? v : acc[j];
              else
                acc[j] += v;
            }
          }
        T* o = y + ((img * g.y.out + oy) * OW + ox) * g.c + c0;
        for (std::size_t j = 0; j < cn; ++j) o[j] = pool_from_f32<T>(Kind == pool_kind::max ? acc[j] : acc[j] / div);
      }
    }
  }
};

// Backward: block (image, channel block of CB) owns its input-gradient planes whole. It adds, in
// output-pixel order, dy/divisor to every tap of an average window, or dy to the argmax of a max
// window (found as the forward finds it), into an f32 buffer in scratch, then writes dx once.
template <class T, class TX, pool_kind Kind>
struct pool_bwd_program {
  static constexpr std::size_t CB = 16;
  const T* x;  // max only
  const T* dy;
  TX* dx;
  pool_geom g;

  kernel_cost cost(const grid&) const {
    const double xs = Kind == pool_kind::max ? double(g.in().size()) * sizeof(T) : 0.0;
    return {double(g.out().size()) * double(g.taps()), xs + double(g.out().size()) * sizeof(T) + double(g.in().size()) * sizeof(TX),
            math_precision::f32};
  }

  // The argmax (r, s) of window (oy, ox) of channel j, `at(iy, ix)` giving the input value.
  template <class At>
  static void argmax(const pool_axis::taps& ty, const pool_axis::taps& tx, const pool_axis& ay, const pool_axis& ax, std::size_t oy, std::size_t ox,
                     const At& at, std::size_t& by, std::size_t& bx) {
    by = ay.coord(oy, ty.lo), bx = ax.coord(ox, tx.lo);
    float best = at(by, bx);
    for (std::size_t r = ty.lo; r < ty.hi; ++r)
      for (std::size_t s = tx.lo; s < tx.hi; ++s) {
        const std::size_t iy = ay.coord(oy, r), ix = ax.coord(ox, s);
        const float v = at(iy, ix);
        if (pool_better(v, best)) best = v, by = iy, bx = ix;
      }
  }

  void operator()(block_ctx& ctx) const {
    const auto idx = ctx.block_index3();
    const std::size_t img = idx[0], c0 = idx[1] * CB, cn = std::min(CB, g.c - c0);
    const std::size_t H = g.y.in, W = g.x.in, OH = g.y.out, OW = g.x.out, plane = H * W;
    const bool nchw = g.layout == conv_layout::nchw;
    // (plane, cn) accumulators: channel j of pixel q at q·cn + j in both layouts
    float* acc = ctx.scratch().template allocate_array<float>(plane * cn);
    std::fill_n(acc, plane * cn, 0.0f);
    for (std::size_t oy = 0; oy < OH; ++oy) {
      const auto ty = g.y.window(oy);
      for (std::size_t ox = 0; ox < OW; ++ox) {
        const auto tx = g.x.window(ox);
        for (std::size_t j = 0; j < cn; ++j) {
          const std::size_t ch = c0 + j;
          const float gv = arch::to_f32(nchw ? dy[((img * g.c + ch) * OH + oy) * OW + ox] : dy[((img * OH + oy) * OW + ox) * g.c + ch]);
          if constexpr (Kind == pool_kind::max) {
            std::size_t by, bx;
            if (nchw) {
              const T* p = x + (img * g.c + ch) * plane;
              argmax(
                  ty, tx, g.y, g.x, oy, ox, [&](std::size_t iy, std::size_t ix) { return arch::to_f32(p[iy * W + ix]); }, by, bx);
            } else {
              const T* p = x + img * plane * g.c + ch;
              argmax(
                  ty, tx, g.y, g.x, oy, ox, [&](std::size_t iy, std::size_t ix) { return arch::to_f32(p[(iy * W + ix) * g.c]); }, by, bx);
            }
            acc[(by * W + bx) * cn + j] += gv;
          } else {
            const float div = float(g.include_pad ? ty.padded * tx.padded : (ty.hi - ty.lo) * (tx.hi - tx.lo));
            const float v = gv / div;
            for (std::size_t r = ty.lo; r < ty.hi; ++r)
              for (std::size_t s = tx.lo; s < tx.hi; ++s) acc[(g.y.coord(oy, r) * W + g.x.coord(ox, s)) * cn + j] += v;
          }
        }
      }
    }
    for (std::size_t q = 0; q < plane; ++q)
      for (std::size_t j = 0; j < cn; ++j) {
        const std::size_t o = nchw ? (img * g.c + c0 + j) * plane + q : (img * plane + q) * g.c + c0 + j;
        dx[o] = pool_from_f32<TX>(acc[q * cn + j]);
      }
  }
};

template <class T>
void pool_check_out(const char* what, const image_dims& got, const image_dims& want, const image_dims& x) {
  conv_check(got == want, [&] {
    return std::string("pool: ") + what + " " + dims_str(got) + " does not match input " + dims_str(x) + ", whose pooling gives " + dims_str(want);
  });
}

template <pool_kind Kind, class Dev, class T>
void pool_forward(Dev& dev, image<const T> x, image<T> y, const pool2d_params& p) {
  const auto g = pool_geometry(x.dims, p);
  pool_check_out<T>("output", y.dims, g.out(), x.dims);
  conv_check_buffer("x", x.data, x.dims.size());
  conv_check_buffer("y", y.data, y.dims.size());
  if (g.out().size() == 0) return;
  using P = pool_fwd_program<T, Kind>;
  const std::size_t cb = ceil_div(g.c, P::CB);
  const std::size_t rb = pool_rows_per_block(g.y.out, g.n * cb, dev.capabilities().workers);
  const P prog{x.data, y.data, g, rb};
  gemm_run(dev, grid{g.n, cb, ceil_div(g.y.out, rb)}, prog, prog.cost(grid{1}).flops);
}

template <pool_kind Kind, class Dev, class T, class TX>
void pool_backward(Dev& dev, const T* x, image<const T> dy, image<TX> dx, const pool2d_params& p) {
  const auto g = pool_geometry(dx.dims, p);
  pool_check_out<T>("output gradient", dy.dims, g.out(), dx.dims);
  if constexpr (Kind == pool_kind::max) conv_check_buffer("x", x, dx.dims.size());
  conv_check_buffer("dy", dy.data, dy.dims.size());
  conv_check_buffer("dx", dx.data, dx.dims.size());
  if (g.in().size() == 0) return;
  using P = pool_bwd_program<T, TX, Kind>;
  const P prog{x, dy.data, dx.data, g};
  gemm_run(dev, grid{g.n, ceil_div(g.c, P::CB)}, prog, prog.cost(grid{1}).flops);
}

inline pool2d_params global_pool_params(const image_dims& x, conv_layout layout) {
  pool2d_params p;
  p.kernel_h = x.h, p.kernel_w = x.w, p.layout = layout;
  return p;
}

}  // namespace detail

inline namespace v0 {

// The output dimensions of a pooling of x (N, C, OH, OW); throws conv_error for bad geometry.
inline image_dims pool2d_output(const image_dims& x, const pool2d_params& p) { return detail::pool_geometry(x, p).out(); }

// What a pooling does: one operation per output and tap, the bytes of x and y once each.
template <conv_element T>
kernel_cost pool2d_cost(pool_kind, const image_dims& x, const pool2d_params& p) {
  const auto g = detail::pool_geometry(x, p);
  return {double(g.out().size()) * double(g.taps()), double(g.in().size() + g.out().size()) * sizeof(T), math_precision::f32};
}

// y = max over each window of x (y is pool2d_output(x.dims, p), in p.layout).
template <class Dev, conv_element T>
void max_pool2d(Dev& dev, image<const T> x, image<T> y, const pool2d_params& p) {
  detail::pool_forward<pool_kind::max>(dev, x, y, p);
}

// y = the mean of each window's taps inside the input (or inside the padded input with
// p.count_include_pad).
template <class Dev, conv_element T>
void avg_pool2d(Dev& dev, image<const T> x, image<T> y, const pool2d_params& p) {
  detail::pool_forward<pool_kind::average>(dev, x, y, p);
}

// dx = the gradient of max_pool2d: each output's dy goes to its window's argmax (the first tap in
// (kernel row, kernel column) order on ties), recomputed from x. dx is overwritten.
template <class Dev, conv_element T, conv_element TX>
void max_pool2d_backward(Dev& dev, image<const T> x, image<const T> dy, image<TX> dx, const pool2d_params& p) {
  detail::conv_check(x.dims == dx.dims,
                     [&] { return "pool: input " + detail::dims_str(x.dims) + " and its gradient " + detail::dims_str(dx.dims) + " differ"; });
  detail::pool_backward<pool_kind::max>(dev, x.data, dy, dx, p);
}

// dx = the gradient of avg_pool2d: each output's dy / divisor to every tap it averaged.
template <class Dev, conv_element T, conv_element TX>
void avg_pool2d_backward(Dev& dev, image<const T> dy, image<TX> dx, const pool2d_params& p) {
  detail::pool_backward<pool_kind::average>(dev, static_cast<const T*>(nullptr), dy, dx, p);
}

// Global pooling: y is (N, C, 1, 1), the mean (or max) of each channel's H·W plane.
template <class Dev, conv_element T>
void global_avg_pool2d(Dev& dev, image<const T> x, image<T> y, conv_layout layout) {
  detail::pool_forward<pool_kind::average>(dev, x, y, detail::global_pool_params(x.dims, layout));
}
template <class Dev, conv_element T>
void global_max_pool2d(Dev& dev, image<const T> x, image<T> y, conv_layout layout) {
  detail::pool_forward<pool_kind::max>(dev, x, y, detail::global_pool_params(x.dims, layout));
}
template <class Dev, conv_element T, conv_element TX>
void global_avg_pool2d_backward(Dev& dev, image<const T> dy, image<TX> dx, conv_layout layout) {
  detail::pool_backward<pool_kind::average>(dev, static_cast<const T*>(nullptr), dy, dx, detail::global_pool_params(dx.dims, layout));
}
template <class Dev, conv_element T, conv_element TX>
void global_max_pool2d_backward(Dev& dev, image<const T> x, image<const T> dy, image<TX> dx, conv_layout layout) {
  detail::conv_check(x.dims == dx.dims,
                     [&] { return "pool: input " + detail::dims_str(x.dims) + " and its gradient " + detail::dims_str(dx.dims) + " differ"; });
  detail::pool_backward<pool_kind::max>(dev, x.data, dy, dx, detail::global_pool_params(dx.dims, layout));
}

}  // namespace v0
}  // namespace tessel
