// The executor's CNN kernels, each behind ONE function, so that the lead can switch each to
// tessel's operator (ops::conv2d and its pooling/batch-norm siblings, being written on the conv
// branch) in one place:
//   conv_nchw        Conv and FusedConv: im2col per image and group + tessel's GEMM (bias as a row
//                    epilogue). THE SEAM for ops::conv2d.
//   pool_nchw        MaxPool / AveragePool (1-D or 2-D windows, pads, strides, dilations, count_include_pad).
//   global_pool_nchw GlobalAveragePool / GlobalMaxPool.
//   batch_norm_nchw  BatchNormalization in inference mode.
// All take f32 NCHW data (1-D spatial inputs run as H = 1) and launch on the executor's device.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include <tessel/device/device_buffer.hpp>
#include <tessel/graph/detail/exec_support.hpp>
#include <tessel/ops/gemm.hpp>

namespace tessel {
inline namespace v0 {
namespace graph {
namespace detail::exec {

// A 2-D window geometry (1-D inputs have h = kh = 1, stride/dilation 1, no padding along H).
struct window2d {
  std::size_t n = 0, c = 0, h = 0, w = 0;    // input
  std::size_t oh = 0, ow = 0;                // output
  std::size_t kh = 1, kw = 1, sh = 1, sw = 1, dh = 1, dw = 1;
  std::ptrdiff_t ph = 0, pw = 0;             // padding before (top, left)
  std::ptrdiff_t ph_end = 0, pw_end = 0;     // padding after (bottom, right)
};

// Conv over NCHW: y[n, m, oh, ow] = sum_{c in group, kh, kw} x[n, c, ...] * w[m, c, kh, kw] + b[m].
// x (n, c, h, w), w (m, c / group, kh, kw), y (n, m, oh, ow); bias: m values or null.
template <class Dev>
void conv_nchw(Dev& dev, const window2d& g, std::size_t m, std::size_t group, const float* x, const float* w, const float* bias,
               float* y) {
  const std::size_t cg = g.c / group, mg = m / group;
  const std::size_t kk = tessel::detail::mul_checked(cg, g.kh * g.kw, "conv: im2col rows");
  const std::size_t ohw = tessel::detail::mul_checked(g.oh, g.ow, "conv: output pixels");
  device_buffer<float, Dev> col(dev, std::max<std::size_t>(tessel::detail::mul_checked(kk, ohw, "conv: im2col size"), 1));
  float* cp = col.data();
  for (std::size_t img = 0; img < g.n; ++img)
    for (std::size_t gi = 0; gi < group; ++gi) {
      const float* xg = x + (img * g.c + gi * cg) * g.h * g.w;
      // im2col: row (c, i, j) of `col` holds the input pixel each output pixel's window reads there
      auto fill = [&](std::size_t b, std::size_t e) {
        for (std::size_t r = b; r < e; ++r) {
          const std::size_t ci = r / (g.kh * g.kw), i = r / g.kw % g.kh, j = r % g.kw;
          float* dst = cp + r * ohw;
          for (std::size_t oy = 0; oy < g.oh; ++oy) {
            const std::ptrdiff_t iy = static_cast<std::ptrdiff_t>(oy * g.sh + i * g.dh) - g.ph;
            for (std::size_t ox = 0; ox < g.ow; ++ox) {
              const std::ptrdiff_t ix = static_cast<std::ptrdiff_t>(ox * g.sw + j * g.dw) - g.pw;
              const bool in = iy >= 0 && ix >= 0 && iy < static_cast<std::ptrdiff_t>(g.h) && ix < static_cast<std::ptrdiff_t>(g.w);
              dst[oy * g.ow + ox] = in ? xg[(ci * g.h + static_cast<std::size_t>(iy)) * g.w + static_cast<std::size_t>(ix)] : 0.0f;
            }
          }
        }
      };
      parallel_for(dev, kk, 4, fill);
      float* yg = y + (img * m + gi * mg) * ohw;
      const float* wg = w + gi * mg * kk;
      if (kk == 0) {
        for (std::size_t r = 0; r < mg; ++r)
          for (std::size_t p = 0; p < ohw; ++p) yg[r * ohw + p] = bias ? bias[gi * mg + r] : 0.0f;
        continue;
      }
      if (bias)
        gemm(dev, transpose::none, transpose::none, mg, ohw, kk, 1.0f, wg, kk, static_cast<const float*>(cp), ohw, 0.0f, yg, ohw,
             epilogue::bias_row(std::span<const float>(bias + gi * mg, mg)));
      else
        gemm(dev, transpose::none, transpose::none, mg, ohw, kk, 1.0f, wg, kk, static_cast<const float*>(cp), ohw, 0.0f, yg, ohw);
    }
}

// MaxPool (max = true) or AveragePool over NCHW windows clipped to the input.
template <class Dev>
void pool_nchw(Dev& dev, const window2d& g, bool max, bool count_include_pad, const float* x, float* y) {
  const std::size_t planes = g.n * g.c;
  auto body = [&](std::size_t b, std::size_t e) {
    for (std::size_t p = b; p < e; ++p) {
      const float* xp = x + p * g.h * g.w;
      float* yp = y + p * g.oh * g.ow;
      for (std::size_t oy = 0; oy < g.oh; ++oy)
        for (std::size_t ox = 0; ox < g.ow; ++ox) {
          double acc = max ? -std::numeric_limits<double>::infinity() : 0.0;
          std::size_t count = 0, padded = 0;
          for (std::size_t i = 0; i < g.kh; ++i)
            for (std::size_t j = 0; j < g.kw; ++j) {
              const std::ptrdiff_t iy = static_cast<std::ptrdiff_t>(oy * g.sh + i * g.dh) - g.ph;
              const std::ptrdiff_t ix = static_cast<std::ptrdiff_t>(ox * g.sw + j * g.dw) - g.pw;
              // count_include_pad counts the explicit padding, not a window's overhang past it (ceil_mode)
              const bool in_pad_h = iy < static_cast<std::ptrdiff_t>(g.h) + g.ph_end, in_pad_w = ix < static_cast<std::ptrdiff_t>(g.w) + g.pw_end;
              if (iy < 0 || ix < 0 || iy >= static_cast<std::ptrdiff_t>(g.h) || ix >= static_cast<std::ptrdiff_t>(g.w)) {
                if (in_pad_h && in_pad_w) ++padded;
                continue;
              }
              const double v = xp[static_cast<std::size_t>(iy) * g.w + static_cast<std::size_t>(ix)];
              if (max) acc = (v > acc || v != v) ? v : acc;
              else acc += v;
              ++count;
            }
          if (!max) {
            const std::size_t d = count_include_pad ? count + padded : count;
            acc = d ? acc / static_cast<double>(d) : 0.0;
          }
          yp[oy * g.ow + ox] = static_cast<float>(acc);
        }
    }
  };
  parallel_for(dev, planes, 1, body);
}

// GlobalAveragePool / GlobalMaxPool: one value per (n, c) plane of `hw` pixels.
template <class Dev>
void global_pool_nchw(Dev& dev, std::size_t planes, std::size_t hw, bool max, const float* x, float* y) {
  auto body = [&](std::size_t b, std::size_t e) {
    for (std::size_t p = b; p < e; ++p) {
      const float* xp = x + p * hw;
      double acc = max ? -std::numeric_limits<double>::infinity() : 0.0;
      for (std::size_t i = 0; i < hw; ++i) {
        const double v = xp[i];
        if (max) acc = (v > acc || v != v) ? v : acc;
        else acc += v;
      }
      y[p] = static_cast<float>(max ? acc : (hw ? acc / static_cast<double>(hw) : 0.0));
    }
  };
  parallel_for(dev, planes, 16, body);
}

// y = (x - mean[c]) / sqrt(var[c] + eps) * scale[c] + b[c] over (n, c, hw).
template <class Dev>
void batch_norm_nchw(Dev& dev, std::size_t n, std::size_t c, std::size_t hw, double eps, const float* x, const float* scale,
                     const float* b, const float* mean, const float* var, float* y) {
  auto body = [&](std::size_t lo, std::size_t hi) {
    for (std::size_t p = lo; p < hi; ++p) {
      const std::size_t ch = p % c;
      const float a = static_cast<float>(static_cast<double>(scale[ch]) / std::sqrt(static_cast<double>(var[ch]) + eps));
      const float s = b[ch] - mean[ch] * a;
      const float* xp = x + p * hw;
      float* yp = y + p * hw;
      for (std::size_t i = 0; i < hw; ++i) yp[i] = xp[i] * a + s;
    }
  };
  parallel_for(dev, n * c, 4, body);
}

}  // namespace detail::exec
}  // namespace graph
}  // namespace v0
}  // namespace tessel
