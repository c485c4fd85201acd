// Softmax (tessel/ops/softmax.hpp): forward vs fp64 (relative 1e-5), masks (additive, causal, fully
// masked rows), backward vs fp64 finite differences, thread-count independence, bad input.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/softmax.hpp>
#include <tessel/types/bf16.hpp>

#include "reference/train_ref.hpp"
#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_ops_softmax {

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
}  // namespace

TEST_CASE("softmax forward matches fp64, masks and thread counts", "[ops][softmax]") {
  host_device d1(1), d2(2);
  for (std::size_t n : {1u, 3u, 16u, 33u, 1000u, 5000u}) {
    const std::size_t rows = 9;
    auto x = train_ref::randn(rows * n, n, 3.0f);
    std::vector<float> y(rows * n), y2(rows * n);
    softmax_options o;
    o.scale = 0.5f;
    softmax_forward(d1, cview(x, rows, n), view(y, rows, n), o);
    softmax_forward(d2, cview(x, rows, n), view(y2, rows, n), o);
    CHECK(std::memcmp(y.data(), y2.data(), y.size() * 4) == 0);
    std::vector<double> xd(n), yd(n);
    double worst = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t j = 0; j < n; ++j) xd[j] = 0.5 * double(x[r * n + j]);
      train_ref::softmax(xd.data(), yd.data(), n);
      for (std::size_t j = 0; j < n; ++j) worst = std::max(worst, std::fabs(y[r * n + j] - yd[j]) / yd[j]);
    }
    INFO("n " << n << " worst relative error " << worst);
    CHECK(worst < 1e-5);
  }
  // causal == explicit -inf mask (within rounding), fully masked rows are zero
  const std::size_t rows = 20, n = 37;
  auto x = train_ref::randn(rows * n, 5);
  std::vector<float> mask(rows * n, 0.0f), yc(rows * n), ym(rows * n);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < n; ++j)
      if (std::int64_t(j) > std::int64_t(r) - 3) mask[r * n + j] = ninf;
  softmax_options oc;
  oc.causal = true;
  oc.causal_offset = -3;
  softmax_options om;
  om.mask = cview(mask, rows, n);
  softmax_forward(d2, cview(x, rows, n), view(yc, rows, n), oc);
  softmax_forward(d2, cview(x, rows, n), view(ym, rows, n), om);
  for (std::size_t r = 0; r < rows; ++r) {
    double s = 0;
    for (std::size_t j = 0; j < n; ++j) {
      CHECK(yc[r * n + j] == Approx(ym[r * n + j]).epsilon(1e-6).margin(1e-30));
      if (mask[r * n + j] == ninf) CHECK(yc[r * n + j] == 0.0f);
      s += yc[r * n + j];
    }
    if (r < 3)
      CHECK(s == 0.0);  // nothing visible
    else
      CHECK(s == Approx(1.0).epsilon(1e-5));
  }
}

TEST_CASE("softmax backward agrees with fp64 finite differences", "[ops][softmax]") {
  host_device dev(2);
  const std::size_t rows = 4, n = 29;
  auto x = train_ref::randn(rows * n, 7), dy = train_ref::randn(rows * n, 8);
  std::vector<float> y(rows * n), dx(rows * n);
  softmax_options o;
  o.scale = 1.7f;
  softmax_forward(dev, cview(x, rows, n), view(y, rows, n), o);
  softmax_backward(dev, cview(dy, rows, n), cview(y, rows, n), view(dx, rows, n), o.scale);
  auto loss = [&](const std::vector<double>& xd) {
    double L = 0;
    std::vector<double> z(n), yy(n);
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t j = 0; j < n; ++j) z[j] = 1.7 * xd[r * n + j];
      train_ref::softmax(z.data(), yy.data(), n);
      for (std::size_t j = 0; j < n; ++j) L += yy[j] * dy[r * n + j];
    }
    return L;
  };
  std::vector<double> xd(x.begin(), x.end());
  double worst = 0;
  for (std::size_t k = 0; k < xd.size(); ++k) {
    auto p = xd, m = xd;
    p[k] += 1e-6;
    m[k] -= 1e-6;
    worst = std::max(worst, std::fabs((loss(p) - loss(m)) / 2e-6 - dx[k]));
  }
  INFO("worst " << worst);
  CHECK(worst < 1e-5);
}

TEST_CASE("softmax bad input", "[ops][softmax]") {
  host_device dev(1);
  std::vector<float> x(12), y(12);
  CHECK_THROWS_AS(softmax_forward(dev, cview(x, 3, 4), view(y, 4, 3)), layer_error);
  softmax_options o;
  o.mask = cview(x, 2, 6);
  CHECK_THROWS_AS(softmax_forward(dev, cview(x, 3, 4), view(y, 3, 4), o), layer_error);
  o = {};
  o.scale = std::numeric_limits<float>::infinity();
  CHECK_THROWS_MATCHES(softmax_forward(dev, cview(x, 3, 4), view(y, 3, 4), o), layer_error, is_error(errc::invalid_argument, "layers"));
}

TEST_CASE("softmax rows in a pipelined block equal rows computed alone, bf16 output is one rounding", "[ops][softmax]") {
  host_device dev(2);
  for (std::size_t n : {5u, 16u, 77u, 2048u}) {
    const std::size_t rows = 13;
    auto x = train_ref::randn(rows * n, 40 + n, 2.0f);
    std::vector<float> mask(rows * n, 0.0f);
    const float ninf = -std::numeric_limits<float>::infinity();
    for (std::size_t j = 0; j < n; ++j) mask[5 * n + j] = ninf;     // a fully masked row mid-block
    for (std::size_t j = 0; j < n; j += 3) mask[8 * n + j] = ninf;  // a partly masked row
    softmax_options o;
    o.scale = 0.7f;
    o.mask = cview(mask, rows, n);
    std::vector<float> y(rows * n), one(n);
    std::vector<bf16> yb(rows * n);
    softmax_forward(dev, cview(x, rows, n), view(y, rows, n), o);
    softmax_forward(dev, cview(x, rows, n), view(yb, rows, n), o);
    bool same = true, rounded = true;
    for (std::size_t r = 0; r < rows; ++r) {
      std::vector<float> xr(x.begin() + std::ptrdiff_t(r * n), x.begin() + std::ptrdiff_t((r + 1) * n));
      std::vector<float> mr(mask.begin() + std::ptrdiff_t(r * n), mask.begin() + std::ptrdiff_t((r + 1) * n));
      softmax_options o1 = o;
      o1.mask = cview(mr, 1, n);
      softmax_forward(dev, cview(xr, 1, n), view(one, 1, n), o1);
      same = same && std::memcmp(one.data(), y.data() + r * n, n * 4) == 0;
      for (std::size_t j = 0; j < n; ++j) rounded = rounded && yb[r * n + j].bits() == bf16(y[r * n + j]).bits();
    }
    INFO("n " << n);
    CHECK(same);
    CHECK(rounded);
    for (std::size_t j = 0; j < n; ++j) CHECK(y[5 * n + j] == 0.0f);
  }
}

}  // namespace tessel_test_ops_softmax
