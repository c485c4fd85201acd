// LayerNorm / RMSNorm (tessel/ops/norm.hpp): forward vs fp64 (relative bound 2e-6·(|y|+1)·sqrt(n)),
// fused residual/cast == unfused composition bitwise, backward vs fp64 finite differences,
// thread-count independence, bad input.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/norm.hpp>

#include "reference/train_ref.hpp"
#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_ops_norm {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;

namespace {
template <class T>
tensor<const T, 2> cview(const std::vector<T>& v, std::size_t r, std::size_t c) {
  return tensor<const T, 2>(v.data(), r, c);
}
template <class T>
tensor<T, 2> view(std::vector<T>& v, std::size_t r, std::size_t c) {
  return tensor<T, 2>(v.data(), r, c);
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
}  // namespace

TEST_CASE("norm forward matches fp64 and the fused residual/cast equals the unfused composition", "[ops][norm]") {
  host_device dev(2);
  for (bool rms : {false, true}) {
    for (std::size_t n : {1u, 5u, 16u, 100u, 1031u}) {
      const std::size_t rows = 23;
      auto x = train_ref::randn(rows * n, 1 + n, 2.0f), r = train_ref::randn(rows * n, 2 + n), w = train_ref::randn(n, 3), b = train_ref::randn(n, 4);
      for (auto& e : x) e += 3.0f;  // a mean far from zero
      std::vector<float> h(rows * n), y(rows * n), y2(rows * n), mean(rows), rstd(rows), mean2(rows), rstd2(rows), hout(rows * n);
      for (std::size_t i = 0; i < h.size(); ++i) h[i] = x[i] + r[i];
      norm_options o;
      float amax = -1.0f;
      o.amax = &amax;
      // fused: residual add inside
      if (rms)
        rmsnorm_forward(dev, cview(x, rows, n), w, view(y, rows, n), rstd, o, cview(r, rows, n), view(hout, rows, n));
      else
        layernorm_forward(dev, cview(x, rows, n), w, b, view(y, rows, n), mean, rstd, o, cview(r, rows, n), view(hout, rows, n));
      // unfused: add first, then norm
      if (rms)
        rmsnorm_forward(dev, cview(h, rows, n), w, view(y2, rows, n), rstd2);
      else
        layernorm_forward(dev, cview(h, rows, n), w, b, view(y2, rows, n), mean2, rstd2);
      CHECK(same_bits(hout, h));
      CHECK(same_bits(y, y2));
      CHECK(same_bits(rstd, rstd2));
      float am = 0.0f;
      for (float v : y) am = std::max(am, std::fabs(v));
      CHECK(amax == am);
      // vs fp64
      double worst = 0.0;
      std::vector<double> hd(n), wd(w.begin(), w.end()), bd(b.begin(), b.end()), yd(n);
      for (std::size_t i = 0; i < rows; ++i) {
        for (std::size_t j = 0; j < n; ++j) hd[j] = h[i * n + j];
        train_ref::layernorm(hd.data(), wd.data(), rms ? nullptr : bd.data(), yd.data(), n, 1e-5, rms);
        for (std::size_t j = 0; j < n; ++j) worst = std::max(worst, std::fabs(yd[j] - y[i * n + j]) / (std::fabs(yd[j]) + 1.0));
      }
      INFO("rms " << rms << " n " << n << " worst " << worst);
      CHECK(worst < 2e-6 * std::sqrt(double(n) + 1.0) * 4.0);

      // bf16 and e4m3 outputs are the single rounding of the f32 output
      std::vector<bf16> yb(rows * n);
      std::vector<e4m3> y8(rows * n);
      norm_options o8;
      o8.out_scale = 16.0f;
      if (rms) {
        rmsnorm_forward(dev, cview(h, rows, n), w, view(yb, rows, n), {});
        rmsnorm_forward(dev, cview(h, rows, n), w, view(y8, rows, n), {}, o8);
      } else {
        layernorm_forward(dev, cview(h, rows, n), w, b, view(yb, rows, n), {}, {});
        layernorm_forward(dev, cview(h, rows, n), w, b, view(y8, rows, n), {}, {}, o8);
      }
      bool ok_b = true, ok_8 = true;
      for (std::size_t i = 0; i < y.size(); ++i) {
        ok_b = ok_b && yb[i].bits() == bf16(y[i]).bits();
        std::vector<e4m3> one(1);
        const float scaled = y[i] * 16.0f;
        convert(std::span<const float>(&scaled, 1), std::span<e4m3>(one), overflow::saturate);
        ok_8 = ok_8 && y8[i].bits() == one[0].bits();
      }
      CHECK(ok_b);
      CHECK(ok_8);
    }
  }
}

TEST_CASE("norm backward agrees with fp64 finite differences, param grads are thread-count independent", "[ops][norm]") {
  for (bool rms : {false, true}) {
    const std::size_t rows = 5, n = 37;
    auto x = train_ref::randn(rows * n, 10, 1.5f), w = train_ref::randn(n, 11), b = train_ref::randn(n, 12), dy = train_ref::randn(rows * n, 13);
    auto dres = train_ref::randn(rows * n, 14);
    for (auto& e : x) e += 0.5f;
    std::vector<float> y(rows * n), mean(rows), rstd(rows), dx(rows * n), dw(n), db(n);
    host_device d1(1), d2(2);
    if (rms)
      rmsnorm_forward(d1, cview(x, rows, n), w, view(y, rows, n), rstd);
    else
      layernorm_forward(d1, cview(x, rows, n), w, b, view(y, rows, n), mean, rstd);
    if (rms)
      rmsnorm_backward(d1, cview(dy, rows, n), cview(x, rows, n), w, rstd, view(dx, rows, n), dw, {}, cview(dres, rows, n));
    else
      layernorm_backward(d1, cview(dy, rows, n), cview(x, rows, n), w, mean, rstd, view(dx, rows, n), dw, db, {}, cview(dres, rows, n));
    // L = sum(y * dy) in fp64
    auto loss = [&](const std::vector<double>& xd, const std::vector<double>& wd, const std::vector<double>& bd) {
      double L = 0.0;
      std::vector<double> yr(n);
      for (std::size_t i = 0; i < rows; ++i) {
        train_ref::layernorm(xd.data() + i * n, wd.data(), rms ? nullptr : bd.data(), yr.data(), n, 1e-5, rms);
        for (std::size_t j = 0; j < n; ++j) L += yr[j] * dy[i * n + j];
      }
      return L;
    };
    std::vector<double> xd(x.begin(), x.end()), wd(w.begin(), w.end()), bd(b.begin(), b.end());
    const double hstep = 1e-6;
    double worst_x = 0, worst_w = 0, worst_b = 0;
    for (std::size_t k = 0; k < rows * n; ++k) {
      auto xp = xd, xm = xd;
      xp[k] += hstep;
      xm[k] -= hstep;
      const double fd = (loss(xp, wd, bd) - loss(xm, wd, bd)) / (2 * hstep) + dres[k];
      worst_x = std::max(worst_x, std::fabs(fd - dx[k]) / (std::fabs(fd) + 1.0));
    }
    for (std::size_t k = 0; k < n; ++k) {
      auto wp = wd, wm = wd;
      wp[k] += hstep;
      wm[k] -= hstep;
      worst_w = std::max(worst_w, std::fabs((loss(xd, wp, bd) - loss(xd, wm, bd)) / (2 * hstep) - dw[k]));
      if (!rms) {
        auto bp = bd, bm = bd;
        bp[k] += hstep;
        bm[k] -= hstep;
        worst_b = std::max(worst_b, std::fabs((loss(xd, wd, bp) - loss(xd, wd, bm)) / (2 * hstep) - db[k]));
      }
    }
    INFO("rms " << rms << " dx " << worst_x << " dw " << worst_w << " db " << worst_b);
    CHECK(worst_x < 1e-4);
    CHECK(worst_w < 1e-4);
    CHECK(worst_b < 1e-4);

    // big enough for many blocks: 1 vs 2 workers, bitwise; accumulate adds
    const std::size_t R = 300, N = 257;
    auto X = train_ref::randn(R * N, 20), DY = train_ref::randn(R * N, 21);
    std::vector<float> Y(R * N), M(R), RS(R), DX1(R * N), DX2(R * N), DW1(N), DW2(N), DB1(N), DB2(N), W2(N, 1.0f), B2(N, 0.0f);
    if (rms)
      rmsnorm_forward(d1, cview(X, R, N), W2, view(Y, R, N), RS);
    else
      layernorm_forward(d1, cview(X, R, N), W2, B2, view(Y, R, N), M, RS);
    auto bwd = [&](host_device& d, std::vector<float>& dxo, std::vector<float>& dwo, std::vector<float>& dbo, const norm_options& o) {
      if (rms)
        rmsnorm_backward(d, cview(DY, R, N), cview(X, R, N), W2, RS, view(dxo, R, N), dwo, o);
      else
        layernorm_backward(d, cview(DY, R, N), cview(X, R, N), W2, M, RS, view(dxo, R, N), dwo, dbo, o);
    };
    bwd(d1, DX1, DW1, DB1, {});
    bwd(d2, DX2, DW2, DB2, {});
    CHECK(same_bits(DX1, DX2));
    CHECK(same_bits(DW1, DW2));
    CHECK(same_bits(DB1, DB2));
    norm_options acc;
    acc.accumulate = true;
    bwd(d2, DX2, DW2, DB2, acc);
    for (std::size_t j = 0; j < N; ++j) CHECK(DW2[j] == DW1[j] + DW1[j]);
  }
}

TEST_CASE("norm rows in a pipelined block equal rows computed alone, and the LayerNorm shift fallback stays accurate", "[ops][norm]") {
  host_device dev(2);
  for (bool rms : {false, true}) {
    for (std::size_t n : {7u, 64u, 1000u}) {
      const std::size_t rows = 12;
      auto x = train_ref::randn(rows * n, 70 + n, 1.0f), res = train_ref::randn(rows * n, 71 + n), w = train_ref::randn(n, 72),
           b = train_ref::randn(n, 73);
      for (std::size_t j = 0; j < n; ++j) x[3 * n + j] += 1.0e4f;  // a mean far from zero, first value near it
      x[5 * n] = 50.0f;                                            // an outlier first value: the exact two-pass variance
      std::vector<bf16> xb(rows * n), rb(rows * n), yb(rows * n), hb(rows * n), yb1(n), hb1(n);
      for (std::size_t i = 0; i < x.size(); ++i) xb[i] = bf16(x[i]), rb[i] = bf16(res[i]);
      std::vector<float> y(rows * n), rs(rows), mu(rows), y1(n), rs1(1), mu1(1);
      auto fwd = [&](auto xin, auto yout, std::span<float> m, std::span<float> r, auto rin, auto hout) {
        if (rms)
          rmsnorm_forward(dev, xin, w, yout, r, {}, rin, hout);
        else
          layernorm_forward(dev, xin, w, b, yout, m, r, {}, rin, hout);
      };
      fwd(cview(x, rows, n), view(y, rows, n), std::span<float>(mu), std::span<float>(rs), tensor<const float, 2>{}, tensor<float, 2>{});
      fwd(cview(xb, rows, n), view(yb, rows, n), std::span<float>{}, std::span<float>{}, cview(rb, rows, n), view(hb, rows, n));
      bool same = true, same_b = true;
      double worst = 0.0, worst_big = 0.0;
      std::vector<double> hd(n), wd(w.begin(), w.end()), bd(b.begin(), b.end()), yd(n);
      for (std::size_t r = 0; r < rows; ++r) {
        std::vector<float> xr(x.begin() + std::ptrdiff_t(r * n), x.begin() + std::ptrdiff_t((r + 1) * n));
        std::vector<bf16> xbr(xb.begin() + std::ptrdiff_t(r * n), xb.begin() + std::ptrdiff_t((r + 1) * n));
        std::vector<bf16> rbr(rb.begin() + std::ptrdiff_t(r * n), rb.begin() + std::ptrdiff_t((r + 1) * n));
        fwd(cview(xr, 1, n), view(y1, 1, n), std::span<float>(mu1), std::span<float>(rs1), tensor<const float, 2>{}, tensor<float, 2>{});
        fwd(cview(xbr, 1, n), view(yb1, 1, n), std::span<float>{}, std::span<float>{}, cview(rbr, 1, n), view(hb1, 1, n));
        same = same && std::memcmp(y1.data(), y.data() + r * n, n * 4) == 0 && rs1[0] == rs[r] && (rms || mu1[0] == mu[r]);
        same_b = same_b && std::memcmp(yb1.data(), yb.data() + r * n, n * 2) == 0 && std::memcmp(hb1.data(), hb.data() + r * n, n * 2) == 0;
        for (std::size_t j = 0; j < n; ++j) hd[j] = x[r * n + j];
        train_ref::layernorm(hd.data(), wd.data(), rms ? nullptr : bd.data(), yd.data(), n, 1e-5, rms);
        double& wr = r == 3 ? worst_big : worst;
        for (std::size_t j = 0; j < n; ++j) wr = std::max(wr, std::fabs(yd[j] - y[r * n + j]) / (std::fabs(yd[j]) + 1.0));
      }
      INFO("rms " << rms << " n " << n << " worst " << worst << " mean-1e4 row " << worst_big);
      CHECK(same);
      CHECK(same_b);
      CHECK(worst < 2e-6 * std::sqrt(double(n) + 1.0) * 4.0);
      // f32 arithmetic on values near 1e4 with unit spread: h − mean alone carries 1e4·u relative error
      CHECK(worst_big < 2e-6 * std::sqrt(double(n) + 1.0) * 4.0 * 1.0e4);
    }
  }
}

TEST_CASE("norm bad input is a typed error", "[ops][norm]") {
  host_device dev(1);
  std::vector<float> x(12), y(12), w(4), b(4), rs(3), wrong(5);
  CHECK_THROWS_AS(rmsnorm_forward(dev, cview(x, 3, 4), wrong, view(y, 3, 4), rs), layer_error);
  CHECK_THROWS_AS(rmsnorm_forward(dev, cview(x, 3, 4), w, view(y, 4, 3), rs), layer_error);
  CHECK_THROWS_AS(layernorm_forward(dev, cview(x, 3, 4), w, wrong, view(y, 3, 4), {}, rs), layer_error);
  norm_options bad;
  bad.eps = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_MATCHES(rmsnorm_forward(dev, cview(x, 3, 4), w, view(y, 3, 4), rs, bad), layer_error, is_error(errc::invalid_argument, "layers"));
  CHECK_THROWS_AS(rmsnorm_backward(dev, cview(x, 3, 4), cview(x, 3, 4), w, std::span<const float>(wrong), view(y, 3, 4), std::span<float>(w)),
                  layer_error);
}

TEST_CASE("norm bf16 outputs holding NaN and subnormal values are the rounding of the f32 outputs", "[ops][norm]") {
  // bf16 outputs are written a 64-byte line (two vectors) at a time; a line holding a NaN or a
  // subnormal takes the exact integer rounding instead of vcvtne2ps2bf16
  host_device dev(2);
  const std::size_t rows = 7, n = 200;
  auto x = train_ref::randn(rows * n, 90, 1.0f), w = train_ref::randn(n, 91);
  for (std::size_t j = 0; j < 70; ++j) w[j] *= 1e-39f;      // subnormal outputs in the first columns
  x[2 * n + 45] = std::numeric_limits<float>::quiet_NaN();  // a NaN row
  for (bool rms : {false, true}) {
    std::vector<float> y(rows * n), rs(rows), mu(rows);
    std::vector<bf16> yb(rows * n);
    if (rms) {
      rmsnorm_forward(dev, cview(x, rows, n), w, view(y, rows, n), rs);
      rmsnorm_forward(dev, cview(x, rows, n), w, view(yb, rows, n), {});
    } else {
      layernorm_forward(dev, cview(x, rows, n), w, {}, view(y, rows, n), mu, rs);
      layernorm_forward(dev, cview(x, rows, n), w, {}, view(yb, rows, n), {}, {});
    }
    bool same = true, saw_sub = false, saw_nan = false;
    for (std::size_t i = 0; i < y.size(); ++i) {
      same = same && yb[i].bits() == bf16(y[i]).bits();
      saw_sub = saw_sub || (y[i] != 0.0f && std::fabs(y[i]) < std::numeric_limits<float>::min());
      saw_nan = saw_nan || std::isnan(y[i]);
    }
    INFO("rms " << rms);
    CHECK(saw_sub);
    CHECK(saw_nan);
    CHECK(same);
  }
}

}  // namespace tessel_test_ops_norm
