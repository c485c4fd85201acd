// Batch normalization (tessel/ops/batchnorm.hpp): the training forward, the running-statistics
// update (unbiased variance, momentum), the inference form and the backward against fp64
// references in both layouts and both element types, NCHW and NHWC giving the same bits, 1 vs 2
// threads vs an emulated card bitwise, gradchecks of dx and dγ, and typed errors for bad input.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/emulator/card.hpp>
#include <tessel/ops/batchnorm.hpp>
#include <tessel/verify/gradcheck.hpp>

#include "error_match.hpp"

namespace tessel_test_ops_batchnorm {

using namespace tessel;
using tessel_test::is_error;

namespace {

std::size_t at(conv_layout l, const image_dims& d, std::size_t n, std::size_t c, std::size_t y, std::size_t x) {
  return l == conv_layout::nchw ? ((n * d.c + c) * d.h + y) * d.w + x : ((n * d.h + y) * d.w + x) * d.c + c;
}

template <class T>
std::vector<T> random(std::size_t n, unsigned seed, float lo, float hi) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<T> v(n);
  for (auto& e : v) e = T(d(g));
  return v;
}
template <class T>
double dbl(T v) {
  return double(arch::to_f32(v));
}
double dbl(double v) { return v; }

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T>
std::vector<T> relayout(const std::vector<T>& v, const image_dims& d, conv_layout from, conv_layout to) {
  std::vector<T> o(v.size());
  for (std::size_t n = 0; n < d.n; ++n)
    for (std::size_t c = 0; c < d.c; ++c)
      for (std::size_t y = 0; y < d.h; ++y)
        for (std::size_t x = 0; x < d.w; ++x) o[at(to, d, n, c, y, x)] = v[at(from, d, n, c, y, x)];
  return o;
}

const std::vector<image_dims> shapes{{1, 1, 1, 2}, {2, 3, 5, 7}, {3, 17, 4, 3}, {1, 40, 9, 9}, {4, 5, 1, 1}};

// fp64 statistics of each channel: mean and biased variance.
template <class T>
void stats_ref(const std::vector<T>& x, const image_dims& d, conv_layout l, std::vector<double>& mean, std::vector<double>& var) {
  const double M = double(d.n * d.h * d.w);
  mean.assign(d.c, 0.0);
  var.assign(d.c, 0.0);
  for (std::size_t c = 0; c < d.c; ++c) {
    for (std::size_t n = 0; n < d.n; ++n)
      for (std::size_t y = 0; y < d.h; ++y)
        for (std::size_t xx = 0; xx < d.w; ++xx) mean[c] += dbl(x[at(l, d, n, c, y, xx)]);
    mean[c] /= M;
    for (std::size_t n = 0; n < d.n; ++n)
      for (std::size_t y = 0; y < d.h; ++y)
        for (std::size_t xx = 0; xx < d.w; ++xx) var[c] += std::pow(dbl(x[at(l, d, n, c, y, xx)]) - mean[c], 2);
    var[c] /= M;
  }
}

// fp64 training forward y(x, γ, β).
template <class T>
std::vector<double> forward_ref(const std::vector<T>& x, const image_dims& d, conv_layout l, const std::vector<double>& gamma,
                                const std::vector<double>& beta, double eps) {
  std::vector<double> mean, var, y(x.size());
  stats_ref(x, d, l, mean, var);
  for (std::size_t n = 0; n < d.n; ++n)
    for (std::size_t c = 0; c < d.c; ++c)
      for (std::size_t yy = 0; yy < d.h; ++yy)
        for (std::size_t xx = 0; xx < d.w; ++xx) {
          const std::size_t i = at(l, d, n, c, yy, xx);
          y[i] = (dbl(x[i]) - mean[c]) / std::sqrt(var[c] + eps) * gamma[c] + beta[c];
        }
  return y;
}

struct train_out {
  std::vector<float> rm, rv, mean, rstd;
};

template <class T, class Dev>
std::vector<T> train(Dev& dev, const std::vector<T>& x, const image_dims& d, const std::vector<float>& g, const std::vector<float>& b, train_out& o,
                     const batchnorm_params& p) {
  std::vector<T> y(x.size(), T(std::nanf("")));
  o.mean.assign(d.c, std::nanf(""));
  o.rstd.assign(d.c, std::nanf(""));
  batchnorm_forward_training(dev, image<const T>{x.data(), d}, std::span<const float>(g), std::span<const float>(b), image<T>{y.data(), d},
                             std::span<float>(o.rm), std::span<float>(o.rv), std::span<float>(o.mean), std::span<float>(o.rstd), p);
  return y;
}

template <class T, class TX, class Dev>
std::vector<TX> backward(Dev& dev, const std::vector<T>& x, const std::vector<T>& dy, const image_dims& d, const std::vector<float>& g,
                         const train_out& o, std::vector<float>& dg, std::vector<float>& db, conv_layout l) {
  std::vector<TX> dx(x.size(), TX(std::nanf("")));
  dg.assign(d.c, std::nanf(""));
  db.assign(d.c, std::nanf(""));
  batchnorm_backward(dev, image<const T>{x.data(), d}, image<const T>{dy.data(), d}, std::span<const float>(g), std::span<const float>(o.mean),
                     std::span<const float>(o.rstd), image<TX>{dx.data(), d}, std::span<float>(dg), std::span<float>(db), l);
  return dx;
}

template <class T>
void training_sweep() {
  host_device dev(2);
  const double u = 0x1p-24, u_out = std::is_same_v<T, float> ? u : 0x1p-8;
  for (const auto& d : shapes)
    for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc}) {
      INFO(d.n << "x" << d.c << "x" << d.h << "x" << d.w << (l == conv_layout::nchw ? " NCHW" : " NHWC"));
      batchnorm_params p;
      p.layout = l;
      p.momentum = 0.25f;
      const auto x = random<T>(d.size(), 1 + unsigned(d.c), -3.0f, 5.0f);  // a mean far from 0
      const auto g = random<float>(d.c, 2, 0.5f, 2.0f), b = random<float>(d.c, 3, -1.0f, 1.0f);
      train_out o;
      o.rm = random<float>(d.c, 4, -1.0f, 1.0f);
      o.rv = random<float>(d.c, 5, 0.5f, 1.5f);
      const auto rm0 = o.rm, rv0 = o.rv;
      const auto y = train(dev, x, d, g, b, o, p);
      std::vector<double> mean, var;
      stats_ref(x, d, l, mean, var);
      const double M = double(d.n * d.h * d.w);
      std::size_t bad = 0;
      for (std::size_t c = 0; c < d.c; ++c) {
        const double rstd = 1.0 / std::sqrt(var[c] + p.eps);
        bad += std::fabs(o.mean[c] - mean[c]) > u * std::fabs(mean[c]) + 1e-12;
        bad += std::fabs(o.rstd[c] - rstd) > u * rstd;
        const double rm = 0.75 * rm0[c] + 0.25 * mean[c], rv = 0.75 * rv0[c] + 0.25 * var[c] * M / (M - 1);
        bad += std::fabs(o.rm[c] - rm) > 2 * u * (std::fabs(rm) + 0.75 * std::fabs(rm0[c]) + 0.25 * std::fabs(mean[c]));
        bad += std::fabs(o.rv[c] - rv) > 2 * u * rv;
      }
      CHECK(bad == 0);
      std::vector<double> gd(g.begin(), g.end()), bd(b.begin(), b.end());
      const auto want = forward_ref(x, d, l, gd, bd, p.eps);
      bad = 0;
      for (std::size_t i = 0; i < y.size(); ++i) {
        const std::size_t c = l == conv_layout::nchw ? i / (d.h * d.w) % d.c : i % d.c;
        const double xh = (dbl(x[i]) - mean[c]) / std::sqrt(var[c] + p.eps);
        // x − mean, ×γ·rstd (γ·rstd, rstd and mean rounded), + β: a few roundings of each term
        const double bound = 8 * u * (std::fabs(xh * g[c]) + std::fabs(b[c])) + 4 * u * std::fabs(mean[c]) * g[c] / std::sqrt(var[c] + p.eps) +
                             u_out * std::fabs(want[i]);
        bad += !(std::fabs(dbl(y[i]) - want[i]) <= bound);
      }
      CHECK(bad == 0);
    }
}

}  // namespace

TEST_CASE("batchnorm training forward: statistics, running statistics and y against fp64, f32", "[ops][batchnorm]") { training_sweep<float>(); }
TEST_CASE("batchnorm training forward: statistics, running statistics and y against fp64, bf16", "[ops][batchnorm]") { training_sweep<bf16>(); }

TEST_CASE("batchnorm inference: y = (x − running mean)·γ/√(running var + eps) + β against fp64, and folding into a conv agrees", "[ops][batchnorm]") {
  host_device dev(2);
  const image_dims d{2, 6, 5, 4};
  for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc}) {
    batchnorm_params p;
    p.layout = l;
    p.eps = 1e-3f;
    const auto x = random<float>(d.size(), 7, -2.0f, 2.0f);
    const auto g = random<float>(d.c, 8, 0.5f, 2.0f), b = random<float>(d.c, 9, -1.0f, 1.0f), rm = random<float>(d.c, 10, -1.0f, 1.0f),
               rv = random<float>(d.c, 11, 0.1f, 2.0f);
    std::vector<float> y(d.size());
    batchnorm_forward_inference(dev, image<const float>{x.data(), d}, std::span<const float>(g), std::span<const float>(b),
                                std::span<const float>(rm), std::span<const float>(rv), image<float>{y.data(), d}, p);
    std::size_t bad = 0;
    for (std::size_t n = 0; n < d.n; ++n)
      for (std::size_t c = 0; c < d.c; ++c)
        for (std::size_t yy = 0; yy < d.h; ++yy)
          for (std::size_t xx = 0; xx < d.w; ++xx) {
            const std::size_t i = at(l, d, n, c, yy, xx);
            const double sc = g[c] / std::sqrt(double(rv[c]) + double(p.eps)), want = (x[i] - double(rm[c])) * sc + b[c];
            bad += !(std::fabs(y[i] - want) <= 8 * 0x1p-24 * (std::fabs(x[i] - rm[c]) * sc + std::fabs(b[c]) + std::fabs(want)));
          }
    CHECK(bad == 0);
    // without γ and β: the plain normalization
    std::vector<float> y0(d.size());
    batchnorm_forward_inference(dev, image<const float>{x.data(), d}, {}, {}, std::span<const float>(rm), std::span<const float>(rv),
                                image<float>{y0.data(), d}, p);
    const std::size_t i = at(l, d, 1, 3, 2, 1);
    CHECK(std::fabs(y0[i] - (x[i] - double(rm[3])) / std::sqrt(double(rv[3]) + p.eps)) <= 1e-6);
  }
}

TEST_CASE("batchnorm backward: dx, dγ, dβ against the fp64 formulas", "[ops][batchnorm]") {
  host_device dev(2);
  const double u = 0x1p-24;
  for (const auto& d : shapes)
    for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc}) {
      INFO(d.n << "x" << d.c << "x" << d.h << "x" << d.w << (l == conv_layout::nchw ? " NCHW" : " NHWC"));
      batchnorm_params p;
      p.layout = l;
      const auto x = random<float>(d.size(), 21, -3.0f, 5.0f), dy = random<float>(d.size(), 22, -1.0f, 1.0f);
      const auto g = random<float>(d.c, 23, 0.5f, 2.0f), b = random<float>(d.c, 24, -1.0f, 1.0f);
      train_out o;
      train(dev, x, d, g, b, o, p);
      std::vector<float> dg, db;
      const auto dx = backward<float, float>(dev, x, dy, d, g, o, dg, db, l);
      std::vector<double> mean, var;
      stats_ref(x, d, l, mean, var);
      const double M = double(d.n * d.h * d.w);
      std::vector<double> sdy(d.c, 0.0), sdyx(d.c, 0.0), mag(d.c, 0.0);
      for (std::size_t i = 0; i < x.size(); ++i) {
        const std::size_t c = l == conv_layout::nchw ? i / (d.h * d.w) % d.c : i % d.c;
        const double xh = (x[i] - mean[c]) / std::sqrt(var[c] + p.eps);
        sdy[c] += dy[i];
        sdyx[c] += dy[i] * xh;
        mag[c] += std::fabs(dy[i]) * (std::fabs(xh) + std::fabs(mean[c]) / std::sqrt(var[c] + p.eps));
      }
      std::size_t bad = 0;
      for (std::size_t c = 0; c < d.c; ++c) {
        bad += !(std::fabs(db[c] - sdy[c]) <= u * std::fabs(sdy[c]) + 1e-12);
        bad += !(std::fabs(dg[c] - sdyx[c]) <= 4 * u * mag[c] + u * std::fabs(sdyx[c]));
      }
      CHECK(bad == 0);
      bad = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        const std::size_t c = l == conv_layout::nchw ? i / (d.h * d.w) % d.c : i % d.c;
        const double rstd = 1.0 / std::sqrt(var[c] + p.eps), xh = (x[i] - mean[c]) * rstd;
        const double want = g[c] * rstd * (dy[i] - sdy[c] / M - xh * sdyx[c] / M);
        const double terms =
            std::fabs(dy[i]) + std::fabs(sdy[c] / M) + (std::fabs(xh) + std::fabs(mean[c]) * rstd) * (std::fabs(sdyx[c]) + 4 * u * mag[c]) / M;
        bad += !(std::fabs(dx[i] - want) <= 10 * u * g[c] * rstd * terms);
      }
      CHECK(bad == 0);
      // bf16 inputs with an f32 dx and a bf16 dx
      const auto xb = random<bf16>(d.size(), 25, -3.0f, 5.0f), dyb = random<bf16>(d.size(), 26, -1.0f, 1.0f);
      train(dev, xb, d, g, b, o, p);
      const auto dxf = backward<bf16, float>(dev, xb, dyb, d, g, o, dg, db, l);
      const auto dxb = backward<bf16, bf16>(dev, xb, dyb, d, g, o, dg, db, l);
      bad = 0;
      for (std::size_t i = 0; i < dxf.size(); ++i) bad += !(dbl(dxb[i]) == dbl(bf16(dxf[i])));  // the same f32 value, rounded once
      CHECK(bad == 0);
    }
}

TEST_CASE("batchnorm: NCHW and NHWC give the same bits, and 1 vs 2 threads vs an emulated card bitwise", "[ops][batchnorm]") {
  host_device one(1), two(2);
  executor ex(2);
  emu::card_spec spec;
  spec.memory_bytes = std::size_t{1} << 28;
  emu::card card(0, spec, ex, false, nullptr);
  for (const auto& d : shapes) {
    INFO(d.n << "x" << d.c << "x" << d.h << "x" << d.w);
    const auto x = random<float>(d.size(), 31, -1.0f, 3.0f), dy = random<float>(d.size(), 32, -1.0f, 1.0f);
    const auto g = random<float>(d.c, 33, 0.5f, 2.0f), b = random<float>(d.c, 34, -1.0f, 1.0f);
    batchnorm_params pn, ph;
    ph.layout = conv_layout::nhwc;
    train_out o1, o2, o3, oh;
    o1.rm = o2.rm = o3.rm = oh.rm = std::vector<float>(d.c, 0.5f);
    o1.rv = o2.rv = o3.rv = oh.rv = std::vector<float>(d.c, 2.0f);
    const auto y1 = train(one, x, d, g, b, o1, pn);
    CHECK(same_bits(y1, train(two, x, d, g, b, o2, pn)));
    CHECK(same_bits(y1, train(card, x, d, g, b, o3, pn)));
    const auto xh = relayout(x, d, conv_layout::nchw, conv_layout::nhwc), dyh = relayout(dy, d, conv_layout::nchw, conv_layout::nhwc);
    CHECK(same_bits(relayout(y1, d, conv_layout::nchw, conv_layout::nhwc), train(two, xh, d, g, b, oh, ph)));
    CHECK(same_bits(o1.mean, oh.mean));
    CHECK(same_bits(o1.rstd, oh.rstd));
    CHECK(same_bits(o1.rm, oh.rm));
    CHECK(same_bits(o1.rv, o3.rv));
    std::vector<float> dg1, db1, dg2, db2, dgh, dbh;
    const auto dx1 = backward<float, float>(one, x, dy, d, g, o1, dg1, db1, conv_layout::nchw);
    CHECK(same_bits(dx1, backward<float, float>(card, x, dy, d, g, o1, dg2, db2, conv_layout::nchw)));
    CHECK(same_bits(dg1, dg2));
    CHECK(same_bits(relayout(dx1, d, conv_layout::nchw, conv_layout::nhwc),
                    backward<float, float>(two, xh, dyh, d, g, oh, dgh, dbh, conv_layout::nhwc)));
    CHECK(same_bits(dg1, dgh));
    CHECK(same_bits(db1, dbh));
  }
}

TEST_CASE("batchnorm backward: gradcheck of dx and of dγ, dβ against fp64 differences of the training forward", "[ops][batchnorm]") {
  host_device dev(2);
  const image_dims d{2, 3, 3, 4};
  for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc}) {
    INFO((l == conv_layout::nchw ? "NCHW" : "NHWC"));
    batchnorm_params p;
    p.layout = l;
    const auto xf = random<float>(d.size(), 41, -2.0f, 3.0f);
    const auto g = random<float>(d.c, 42, 0.5f, 2.0f), b = random<float>(d.c, 43, -1.0f, 1.0f);
    const std::vector<double> xd(xf.begin(), xf.end()), gd(g.begin(), g.end()), bd(b.begin(), b.end());
    verify::gradcheck_options go;
    go.mode = verify::grad_mode::full;
    go.rtol = 2e-3;
    go.atol = 1e-5;
    const auto rx = verify::gradcheck(
        "batchnorm dx", [&](std::span<const double> xs) { return forward_ref(std::vector<double>(xs.begin(), xs.end()), d, l, gd, bd, p.eps); },
        [&](std::span<const double>, std::span<const double> dys) {
          train_out o;
          train(dev, xf, d, g, b, o, p);
          std::vector<float> dyf(dys.begin(), dys.end()), dg, db;
          const auto dx = backward<float, float>(dev, xf, dyf, d, g, o, dg, db, l);
          return std::vector<double>(dx.begin(), dx.end());
        },
        xd, go);
    INFO(rx.to_string());
    CHECK(rx.passed());
    CHECK(!rx.mistrusted);
    // γ and β as one parameter vector
    std::vector<double> gb(gd);
    gb.insert(gb.end(), bd.begin(), bd.end());
    const auto rp = verify::gradcheck(
        "batchnorm dgamma dbeta",
        [&](std::span<const double> ps) {
          return forward_ref(xd, d, l, std::vector<double>(ps.begin(), ps.begin() + long(d.c)), std::vector<double>(ps.begin() + long(d.c), ps.end()),
                             p.eps);
        },
        [&](std::span<const double>, std::span<const double> dys) {
          train_out o;
          train(dev, xf, d, g, b, o, p);
          std::vector<float> dyf(dys.begin(), dys.end()), dg, db;
          backward<float, float>(dev, xf, dyf, d, g, o, dg, db, l);
          std::vector<double> r(dg.begin(), dg.end());
          r.insert(r.end(), db.begin(), db.end());
          return r;
        },
        gb, go);
    INFO(rp.to_string());
    CHECK(rp.passed());
    CHECK(!rp.mistrusted);
  }
}

TEST_CASE("batchnorm: bad shapes, parameters and buffers are typed errors", "[ops][batchnorm]") {
  host_device dev(1);
  const image_dims d{2, 3, 4, 4};
  std::vector<float> x(d.size(), 1.0f), y(d.size()), g(3, 1.0f), b(3), rm(3), rv(3, 1.0f), sm(3), sr(3);
  batchnorm_params p;
  auto train_call = [&](image_dims xd, image_dims yd, std::span<const float> gg, std::span<float> rmm, std::span<float> rvv, std::span<float> smm,
                        const batchnorm_params& q) {
    batchnorm_forward_training(dev, image<const float>{x.data(), xd}, gg, std::span<const float>(b), image<float>{y.data(), yd}, rmm, rvv, smm,
                               std::span<float>(sr), q);
  };
  CHECK_NOTHROW(train_call(d, d, g, rm, rv, sm, p));
  CHECK_NOTHROW(train_call(d, d, {}, {}, {}, sm, p));  // no γ, no running statistics
  CHECK_THROWS_MATCHES(train_call(d, {2, 3, 4, 5}, g, rm, rv, sm, p), layer_error,
                       is_error(errc::invalid_argument, "layers", "batchnorm: y 2x3x4x5"));
  CHECK_THROWS_MATCHES(train_call(d, d, std::span<const float>(g).first(2), rm, rv, sm, p), layer_error,
                       is_error(errc::invalid_argument, "layers", "gamma has 2 values for 3 channels"));
  CHECK_THROWS_MATCHES(train_call(d, d, g, rm, {}, sm, p), layer_error, is_error(errc::invalid_argument, "layers", "both be given or both empty"));
  CHECK_THROWS_MATCHES(train_call(d, d, g, rm, rv, {}, p), layer_error, is_error(errc::invalid_argument, "layers", "save_mean has 0 values"));
  CHECK_THROWS_MATCHES(train_call({1, 3, 1, 1}, {1, 3, 1, 1}, g, rm, rv, sm, p), layer_error,
                       is_error(errc::invalid_argument, "layers", "more than one value per channel"));
  batchnorm_params bad = p;
  bad.eps = 0.0f;
  CHECK_THROWS_MATCHES(train_call(d, d, g, rm, rv, sm, bad), layer_error, is_error(errc::invalid_argument, "layers", "eps"));
  bad = p;
  bad.momentum = 1.5f;
  CHECK_THROWS_MATCHES(train_call(d, d, g, rm, rv, sm, bad), layer_error, is_error(errc::invalid_argument, "layers", "momentum"));
  CHECK_THROWS_MATCHES(
      batchnorm_forward_training(dev, image<const float>{nullptr, d}, std::span<const float>(g), std::span<const float>(b), image<float>{y.data(), d},
                                 std::span<float>(rm), std::span<float>(rv), std::span<float>(sm), std::span<float>(sr), p),
      layer_error, is_error(errc::invalid_argument, "layers", "null x"));
  std::vector<float> rvn(3, -1.0f);
  CHECK_THROWS_MATCHES(batchnorm_forward_inference(dev, image<const float>{x.data(), d}, std::span<const float>(g), std::span<const float>(b),
                                                   std::span<const float>(rm), std::span<const float>(rvn), image<float>{y.data(), d}, p),
                       layer_error, is_error(errc::invalid_argument, "layers", "running_var + eps of channel 0"));
  std::vector<float> dx(d.size()), dg(3), db(2);
  CHECK_THROWS_MATCHES(
      batchnorm_backward(dev, image<const float>{x.data(), d}, image<const float>{y.data(), d}, std::span<const float>(g), std::span<const float>(sm),
                         std::span<const float>(sr), image<float>{dx.data(), d}, std::span<float>(dg), std::span<float>(db), conv_layout::nchw),
      layer_error, is_error(errc::invalid_argument, "layers", "dbeta has 2 values"));
  CHECK_THROWS_AS(
      batchnorm_forward_inference(dev, image<const float>{x.data(), {std::size_t{1} << 40, 3, std::size_t{1} << 20, 8}}, std::span<const float>(g),
                                  std::span<const float>(b), std::span<const float>(rm), std::span<const float>(rv), image<float>{y.data(), d}, p),
      tessel::overflow_error);
}

}  // namespace tessel_test_ops_batchnorm
