// The executor's CNN kernels. Conv and FusedConv run on ops::conv2d (exec_kernels.hpp's
// build_conv; the filter, a graph constant, prepacked once at compile time), pooling on
// ops/pool.hpp and inference batch norm on ops/batchnorm.hpp. What stays here is the geometry those
// builders share and the two fallbacks for ONNX semantics that ops/ does not take:
//   pool_nchw        MaxPool / AveragePool when ops::max_pool2d/avg_pool2d refuse the geometry (a
//                    window with no tap inside the input: pads as large as the kernel) or give
//                    another output extent than ONNX's shape rule.
//   batch_norm_nchw  BatchNormalization with epsilon <= 0 (ONNX allows it; ops::batchnorm wants > 0).
//   global_avg_nchw  GlobalAveragePool: the plane summed in fp64 (ops::global_avg_pool2d sums in f32,
//                    up to (H·W − 1)·u·Σ|x| off: 2 ulps of the mean fail on a 5x4 plane of signed values).
// Both take f32 NCHW data (1-D spatial inputs run as H = 1) and launch on the executor's device.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include <tessel/device/device_buffer.hpp>
#include <tessel/graph/detail/exec_support.hpp>

namespace tessel {
inline namespace v0 {
namespace graph {
namespace detail::exec {

// A 2-D window geometry (1-D inputs have h = kh = 1, stride/dilation 1, no padding along H).
struct window2d {
  std::size_t n = 0, c = 0, h = 0, w = 0;  // input
  std::size_t oh = 0, ow = 0;              // output
  std::size_t kh = 1, kw = 1, sh = 1, sw = 1, dh = 1, dw = 1;
  std::ptrdiff_t ph = 0, pw = 0;          // padding before (top, left)
  std::ptrdiff_t ph_end = 0, pw_end = 0;  // padding after (bottom, right)
};

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
              if (max)
                acc = (v > acc || v != v) ? v : acc;
              else
                acc += v;
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

// GlobalAveragePool: one mean per (n, c) plane of `hw` pixels, summed in fp64.
template <class Dev>
void global_avg_nchw(Dev& dev, std::size_t planes, std::size_t hw, const float* x, float* y) {
  parallel_for(dev, planes, 16, [&](std::size_t lo, std::size_t hi) {
    for (std::size_t p = lo; p < hi; ++p) {
      const float* xp = x + p * hw;
      double acc = 0.0;
      for (std::size_t i = 0; i < hw; ++i) acc += xp[i];
      y[p] = static_cast<float>(hw ? acc / static_cast<double>(hw) : 0.0);
    }
  });
}

// y = (x - mean[c]) / sqrt(var[c] + eps) * scale[c] + b[c] over (n, c, hw).
template <class Dev>
void batch_norm_nchw(Dev& dev, std::size_t n, std::size_t c, std::size_t hw, double eps, const float* x, const float* scale, const float* b,
                     const float* mean, const float* var, float* y) {
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
