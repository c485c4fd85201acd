// Batch normalization over the channels of NCHW or NHWC images: the training forward (batch mean
// and biased variance per channel over N, H, W; running statistics updated with the unbiased
// variance, as PyTorch), the inference form from running statistics, and the backward (dx, dγ,
// dβ). Per-channel sums are fp64 over the pixels in (n, h, w) order, one block per channel block,
// so the statistics — and every output — have the same bits in both layouts and on any number of
// workers. Elementwise passes are f32 with explicit FMAs. Bad input throws layer_error.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <tessel/detail/checked.hpp>
#include <tessel/ops/conv.hpp>
#include <tessel/ops/errors.hpp>

namespace tessel {
inline namespace v0 {

struct batchnorm_params {
  float eps = 1e-5f;
  float momentum = 0.1f;  // running = (1 − momentum)·running + momentum·batch statistic
  conv_layout layout = conv_layout::nchw;
};

}  // namespace v0

namespace detail {

template <class Message>
void bn_check(bool ok, const Message& message) {
  if (!ok) [[unlikely]]
    throw layer_error("batchnorm: " + message());
}

// Per-channel fp64 sums over the pixels in (n, h, w) order. Block b owns channels [b·CB, b·CB + CB)
// (CB = 1 for NCHW, whose channels are planes; 16 for NHWC, whose pixels are channel runs).
// Forward (dy null): s1 = Σ x, then s2 = Σ (x − s1/M)². Backward: s1 = Σ dy, s2 = Σ dy·(x − mean_c).
template <class T>
struct bn_sums_program {
  const T* x;
  const T* dy;        // backward only
  const float* mean;  // backward only
  double* s1;
  double* s2;
  image_dims d;
  conv_layout layout;
  std::size_t cb;

  // two reads of the image: x twice (forward's two passes) or x and dy once (backward)
  kernel_cost cost(const grid&) const { return {3.0 * double(d.size()), 2.0 * double(d.size()) * sizeof(T), math_precision::f32}; }

  template <class F>
  void each(std::size_t c0, std::size_t cn, const F& f) const {  // f(j, element index) in pixel order
    const std::size_t plane = d.h * d.w;
    for (std::size_t img = 0; img < d.n; ++img) {
      if (layout == conv_layout::nchw) {
        for (std::size_t j = 0; j < cn; ++j) {
          const std::size_t base = (img * d.c + c0 + j) * plane;
          for (std::size_t q = 0; q < plane; ++q) f(j, base + q);
        }
      } else {
        for (std::size_t q = 0; q < plane; ++q) {
          const std::size_t base = (img * plane + q) * d.c + c0;
          for (std::size_t j = 0; j < cn; ++j) f(j, base + j);
        }
      }
    }
  }

  void operator()(block_ctx& ctx) const {
    const std::size_t c0 = ctx.block_linear() * cb, cn = std::min(cb, d.c - c0);
    double a[16] = {}, b[16] = {}, m[16] = {};
    if (!dy) {
      each(c0, cn, [&](std::size_t j, std::size_t i) { a[j] += double(arch::to_f32(x[i])); });
      const double count = double(d.n * d.h * d.w);
      for (std::size_t j = 0; j < cn; ++j) m[j] = a[j] / count;
      each(c0, cn, [&](std::size_t j, std::size_t i) {
        const double v = double(arch::to_f32(x[i])) - m[j];
        b[j] += v * v;
      });
    } else {
      for (std::size_t j = 0; j < cn; ++j) m[j] = double(mean[c0 + j]);
      each(c0, cn, [&](std::size_t j, std::size_t i) {
        const double g = double(arch::to_f32(dy[i]));
        a[j] += g;
        b[j] += g * (double(arch::to_f32(x[i])) - m[j]);
      });
    }
    for (std::size_t j = 0; j < cn; ++j) s1[c0 + j] = a[j], s2[c0 + j] = b[j];
  }
};

// Elementwise over the image with per-channel coefficients k (4 floats a channel: k0..k3):
// forward  y  = fma(x − k0, k1, k2)                       (k0 mean, k1 γ·rstd, k2 β)
// backward dx = k1 · fma(−(x − k0), k3, dy − k2)          (k1 γ·rstd, k2 dβ/M, k3 rstd·dγ/M)
// Block b owns rows [b·rpb, b·rpb + rpb): a row is a plane (NCHW, channel row % C) or a pixel
// (NHWC, channels 0..C−1).
template <class T, class TO, bool Backward>
struct bn_apply_program {
  const T* x;
  const T* dy;  // backward only
  TO* out;
  const float* k;
  image_dims d;
  conv_layout layout;
  std::size_t rpb;

  kernel_cost cost(const grid&) const {
    return {(Backward ? 5.0 : 3.0) * double(d.size()), double(d.size()) * ((Backward ? 2.0 : 1.0) * sizeof(T) + sizeof(TO)), math_precision::f32};
  }

  static TO one(float xv, float dyv, const float* kc) {
    float v;
    if constexpr (Backward)
      v = kc[1] * std::fma(-(xv - kc[0]), kc[3], dyv - kc[2]);
    else
      v = std::fma(xv - kc[0], kc[1], kc[2]);
    (void)dyv;
    if constexpr (std::is_same_v<TO, float>)
      return v;
    else
      return TO(v);
  }

  void operator()(block_ctx& ctx) const {
    const bool nchw = layout == conv_layout::nchw;
    const std::size_t plane = d.h * d.w, rows = nchw ? d.n * d.c : d.n * plane, len = nchw ? plane : d.c;
    const std::size_t r0 = ctx.block_linear() * rpb, r1 = std::min(rows, r0 + rpb);
    for (std::size_t r = r0; r < r1; ++r) {
      const std::size_t base = r * len;
      for (std::size_t i = 0; i < len; ++i) {
        const float* kc = k + 4 * (nchw ? r % d.c : i);
        const float dyv = Backward ? arch::to_f32(dy[base + i]) : 0.0f;
        out[base + i] = one(arch::to_f32(x[base + i]), dyv, kc);
      }
    }
  }
};

template <class Dev, class T>
void bn_sums(Dev& dev, const T* x, const T* dy, const float* mean, const image_dims& d, conv_layout layout, std::vector<double>& s1,
             std::vector<double>& s2) {
  s1.assign(d.c, 0.0);
  s2.assign(d.c, 0.0);
  const std::size_t cb = layout == conv_layout::nchw ? 1 : 16;
  const bn_sums_program<T> prog{x, dy, mean, s1.data(), s2.data(), d, layout, cb};
  gemm_run(dev, grid{ceil_div(d.c, cb)}, prog, 3.0 * double(d.size()));
}

template <bool Backward, class Dev, class T, class TO>
void bn_apply(Dev& dev, const T* x, const T* dy, TO* out, const std::vector<float>& k, const image_dims& d, conv_layout layout) {
  const bool nchw = layout == conv_layout::nchw;
  const std::size_t rows = nchw ? d.n * d.c : d.n * d.h * d.w, len = std::max<std::size_t>(1, nchw ? d.h * d.w : d.c);
  const std::size_t workers = std::max(1u, dev.capabilities().workers);
  // about 4 blocks a worker, none under 16 Ki elements
  const std::size_t rpb = std::max<std::size_t>({1, ceil_div(rows, 4 * workers), ceil_div(std::size_t{16384}, len)});
  const bn_apply_program<T, TO, Backward> prog{x, dy, out, k.data(), d, layout, rpb};
  gemm_run(dev, grid{ceil_div(rows, rpb)}, prog, 4.0 * double(d.size()));
}

inline void bn_check_channels(const char* what, std::size_t got, std::size_t c, bool may_be_empty) {
  bn_check((may_be_empty && got == 0) || got == c, [&] {
    return std::string(what) + " has " + std::to_string(got) + " values for " + std::to_string(c) + " channels" + (may_be_empty ? " (or none)" : "");
  });
}

template <class T>
void bn_check_image(const char* what, const T* p, const image_dims& got, const image_dims& want) {
  bn_check(got == want, [&] { return std::string(what) + " " + dims_str(got) + " does not match the input " + dims_str(want); });
  bn_check(p != nullptr || got.size() == 0, [&] { return std::string("null ") + what; });
}

inline void bn_check_params(const batchnorm_params& p) {
  bn_check(p.layout == conv_layout::nchw || p.layout == conv_layout::nhwc, [] { return std::string("unknown layout"); });
  bn_check(std::isfinite(p.eps) && p.eps > 0.0f, [&] { return "eps must be positive and finite, got " + std::to_string(p.eps); });
  bn_check(std::isfinite(p.momentum) && p.momentum >= 0.0f && p.momentum <= 1.0f,
           [&] { return "momentum must be in [0, 1], got " + std::to_string(p.momentum); });
}

}  // namespace detail

inline namespace v0 {

// Training forward: per channel c, mean_c and the biased variance σ²_c over the N·H·W pixels;
// y = (x − mean_c)·γ_c/√(σ²_c + eps) + β_c. save_mean and save_rstd (C values each) receive mean_c
// and 1/√(σ²_c + eps) for the backward. Running statistics (both C values, or both empty to skip)
// become (1 − momentum)·running + momentum·(mean_c, σ²_c·M/(M − 1)). gamma/beta empty mean 1/0.
template <class Dev, conv_element T>
void batchnorm_forward_training(Dev& dev, image<const T> x, std::span<const float> gamma, std::span<const float> beta, image<T> y,
                                std::span<float> running_mean, std::span<float> running_var, std::span<float> save_mean, std::span<float> save_rstd,
                                const batchnorm_params& p) {
  detail::bn_check_params(p);
  const std::size_t C = x.dims.c, M = detail::mul_checked(detail::mul_checked(x.dims.n, x.dims.h, "batchnorm pixels"), x.dims.w, "batchnorm pixels");
  (void)x.dims.size();
  detail::bn_check_image("x", x.data, x.dims, x.dims);
  detail::bn_check_image("y", y.data, y.dims, x.dims);
  detail::bn_check_channels("gamma", gamma.size(), C, true);
  detail::bn_check_channels("beta", beta.size(), C, true);
  detail::bn_check(running_mean.size() == running_var.size(),
                   [] { return std::string("running_mean and running_var must both be given or both empty"); });
  detail::bn_check_channels("running_mean", running_mean.size(), C, true);
  detail::bn_check_channels("save_mean", save_mean.size(), C, false);
  detail::bn_check_channels("save_rstd", save_rstd.size(), C, false);
  detail::bn_check(M > 1,
                   [&] { return "training needs more than one value per channel, input " + detail::dims_str(x.dims) + " has " + std::to_string(M); });
  std::vector<double> s1, s2;
  detail::bn_sums(dev, x.data, static_cast<const T*>(nullptr), nullptr, x.dims, p.layout, s1, s2);
  std::vector<float> k(4 * C);
  const double m = double(p.momentum);
  for (std::size_t c = 0; c < C; ++c) {
    const double mean = s1[c] / double(M), var = s2[c] / double(M);
    const float rstd = static_cast<float>(1.0 / std::sqrt(var + double(p.eps)));
    save_mean[c] = static_cast<float>(mean);
    save_rstd[c] = rstd;
    if (!running_mean.empty()) {
      running_mean[c] = static_cast<float>((1.0 - m) * double(running_mean[c]) + m * mean);
      running_var[c] = static_cast<float>((1.0 - m) * double(running_var[c]) + m * var * double(M) / double(M - 1));
    }
    k[4 * c] = save_mean[c];
    k[4 * c + 1] = (gamma.empty() ? 1.0f : gamma[c]) * rstd;
    k[4 * c + 2] = beta.empty() ? 0.0f : beta[c];
  }
  detail::bn_apply<false>(dev, x.data, static_cast<const T*>(nullptr), y.data, k, x.dims, p.layout);
}

// Inference: y = (x − running_mean_c)·γ_c/√(running_var_c + eps) + β_c (p.momentum unused).
template <class Dev, conv_element T>
void batchnorm_forward_inference(Dev& dev, image<const T> x, std::span<const float> gamma, std::span<const float> beta,
                                 std::span<const float> running_mean, std::span<const float> running_var, image<T> y, const batchnorm_params& p) {
  detail::bn_check_params(p);
  const std::size_t C = x.dims.c;
  (void)x.dims.size();
  detail::bn_check_image("x", x.data, x.dims, x.dims);
  detail::bn_check_image("y", y.data, y.dims, x.dims);
  detail::bn_check_channels("gamma", gamma.size(), C, true);
  detail::bn_check_channels("beta", beta.size(), C, true);
  detail::bn_check_channels("running_mean", running_mean.size(), C, false);
  detail::bn_check_channels("running_var", running_var.size(), C, false);
  std::vector<float> k(4 * C);
  for (std::size_t c = 0; c < C; ++c) {
    detail::bn_check(running_var[c] + p.eps > 0.0f, [&] { return "running_var + eps of channel " + std::to_string(c) + " is not positive"; });
    const float rstd = static_cast<float>(1.0 / std::sqrt(double(running_var[c]) + double(p.eps)));
    k[4 * c] = running_mean[c];
    k[4 * c + 1] = (gamma.empty() ? 1.0f : gamma[c]) * rstd;
    k[4 * c + 2] = beta.empty() ? 0.0f : beta[c];
  }
  if (x.dims.size() == 0) return;
  detail::bn_apply<false>(dev, x.data, static_cast<const T*>(nullptr), y.data, k, x.dims, p.layout);
}

// Backward of the training forward, from its save_mean/save_rstd: with x̂ = (x − mean)·rstd,
// dβ_c = Σ dy, dγ_c = Σ dy·x̂, dx = γ_c·rstd_c·(dy − dβ_c/M − x̂·dγ_c/M). dgamma/dbeta may be
// empty (not wanted); gamma empty means 1. dx is overwritten.
template <class Dev, conv_element T, conv_element TX>
void batchnorm_backward(Dev& dev, image<const T> x, image<const T> dy, std::span<const float> gamma, std::span<const float> save_mean,
                        std::span<const float> save_rstd, image<TX> dx, std::span<float> dgamma, std::span<float> dbeta, conv_layout layout) {
  detail::bn_check(layout == conv_layout::nchw || layout == conv_layout::nhwc, [] { return std::string("unknown layout"); });
  const std::size_t C = x.dims.c, M = detail::mul_checked(detail::mul_checked(x.dims.n, x.dims.h, "batchnorm pixels"), x.dims.w, "batchnorm pixels");
  (void)x.dims.size();
  detail::bn_check_image("x", x.data, x.dims, x.dims);
  detail::bn_check_image("dy", dy.data, dy.dims, x.dims);
  detail::bn_check_image("dx", dx.data, dx.dims, x.dims);
  detail::bn_check_channels("gamma", gamma.size(), C, true);
  detail::bn_check_channels("save_mean", save_mean.size(), C, false);
  detail::bn_check_channels("save_rstd", save_rstd.size(), C, false);
  detail::bn_check_channels("dgamma", dgamma.size(), C, true);
  detail::bn_check_channels("dbeta", dbeta.size(), C, true);
  if (M == 0) {
    std::fill(dgamma.begin(), dgamma.end(), 0.0f);
    std::fill(dbeta.begin(), dbeta.end(), 0.0f);
    return;
  }
  std::vector<double> s1, s2;
  detail::bn_sums(dev, x.data, dy.data, save_mean.data(), x.dims, layout, s1, s2);
  std::vector<float> k(4 * C);
  for (std::size_t c = 0; c < C; ++c) {
    const double rstd = double(save_rstd[c]), dg = s2[c] * rstd;
    if (!dgamma.empty()) dgamma[c] = static_cast<float>(dg);
    if (!dbeta.empty()) dbeta[c] = static_cast<float>(s1[c]);
    k[4 * c] = save_mean[c];
    k[4 * c + 1] = static_cast<float>((gamma.empty() ? 1.0 : double(gamma[c])) * rstd);
    k[4 * c + 2] = static_cast<float>(s1[c] / double(M));
    k[4 * c + 3] = static_cast<float>(rstd * dg / double(M));
  }
  detail::bn_apply<true>(dev, x.data, dy.data, dx.data, k, x.dims, layout);
}

}  // namespace v0
}  // namespace tessel
