// tessel/verify/gradcheck.hpp: the library's softmax and RMSNorm backward against fp64 central
// differences of independent fp64 forwards (full and random-direction modes), and the planted bugs
// it must find: a wrong gradient sign, one coordinate's gradient dropped; option errors.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/norm.hpp>
#include <tessel/ops/softmax.hpp>
#include <tessel/verify/gradcheck.hpp>

#include "error_match.hpp"

namespace tessel_test_verify_gradcheck {

using namespace tessel;
using tessel_test::is_error;

constexpr std::size_t rows = 3, cols = 19;

std::vector<double> softmax64(std::span<const double> x) {
  std::vector<double> y(x.size());
  for (std::size_t r = 0; r < rows; ++r) {
    double m = -INFINITY, s = 0;
    for (std::size_t c = 0; c < cols; ++c) m = std::max(m, x[r * cols + c]);
    for (std::size_t c = 0; c < cols; ++c) s += std::exp(x[r * cols + c] - m);
    for (std::size_t c = 0; c < cols; ++c) y[r * cols + c] = std::exp(x[r * cols + c] - m) / s;
  }
  return y;
}

// The library's backward, in float, wrapped to doubles; `sign` and `drop` plant bugs.
verify::backward_fn softmax_backward_of(host_device& dev, float sign = 1.0f, std::size_t drop = SIZE_MAX) {
  return [&dev, sign, drop](std::span<const double> x, std::span<const double> dy) {
    const auto y64 = softmax64(x);
    std::vector<float> y(y64.begin(), y64.end()), g(dy.begin(), dy.end()), dx(x.size());
    softmax_backward(dev, tensor<const float, 2>(g.data(), rows, cols), tensor<const float, 2>(y.data(), rows, cols),
                     tensor<float, 2>(dx.data(), rows, cols));
    std::vector<double> out(dx.begin(), dx.end());
    for (auto& v : out) v *= sign;
    if (drop < out.size()) out[drop] = 0;
    return out;
  };
}

TEST_CASE("gradcheck passes the library softmax backward, full and random directions", "[verify][gradcheck]") {
  host_device dev(2);
  const auto xf = verify::filled<double>(rows * cols, verify::fill::normal, 3);
  for (auto mode : {verify::grad_mode::full, verify::grad_mode::random_directions}) {
    verify::gradcheck_options o;
    o.mode = mode;
    const auto r = verify::gradcheck("softmax", softmax64, softmax_backward_of(dev), xf, o);
    INFO(r.to_string());
    CHECK(r.passed());
    CHECK_FALSE(r.mistrusted);
    CHECK(r.count == (mode == verify::grad_mode::full ? rows * cols : o.directions));
  }
}

TEST_CASE("gradcheck finds a wrong gradient sign and a dropped coordinate (its index)", "[verify][gradcheck][planted]") {
  host_device dev(1);
  const auto x = verify::filled<double>(rows * cols, verify::fill::normal, 4);
  for (auto mode : {verify::grad_mode::full, verify::grad_mode::random_directions}) {
    verify::gradcheck_options o;
    o.mode = mode;
    const auto r = verify::gradcheck("softmax sign", softmax64, softmax_backward_of(dev, -1.0f), x, o);
    INFO(r.to_string());
    CHECK_FALSE(r.passed());
    CHECK(r.over > r.count / 2);
  }
  const auto r = verify::gradcheck("softmax drop", softmax64, softmax_backward_of(dev, 1.0f, 40), x);
  INFO(r.to_string());
  CHECK(r.over == 1);
  REQUIRE(r.worst);
  CHECK(r.worst->index == 40);
  CHECK(r.worst->analytic == 0.0);
}

TEST_CASE("gradcheck passes the library RMSNorm backward (dx) against an fp64 forward", "[verify][gradcheck]") {
  host_device dev(2);
  const std::size_t n = 24, m = 4;
  const auto w = verify::filled<float>(n, verify::fill::uniform, 9, {3, 0.5, 1.5, 1, true});
  const float eps = 1e-5f;
  auto fwd = [&](std::span<const double> x) {
    std::vector<double> y(x.size());
    for (std::size_t r = 0; r < m; ++r) {
      double ss = 0;
      for (std::size_t c = 0; c < n; ++c) ss += x[r * n + c] * x[r * n + c];
      const double rs = 1.0 / std::sqrt(ss / n + eps);
      for (std::size_t c = 0; c < n; ++c) y[r * n + c] = x[r * n + c] * rs * w[c];
    }
    return y;
  };
  auto bwd = [&](std::span<const double> x, std::span<const double> dy) {
    std::vector<float> xf(x.begin(), x.end()), g(dy.begin(), dy.end()), y(x.size()), rstd(m), dx(x.size()), dw(n);
    norm_options o;
    o.eps = eps;
    rmsnorm_forward(dev, tensor<const float, 2>(xf.data(), m, n), std::span<const float>(w), tensor<float, 2>(y.data(), m, n), rstd, o);
    rmsnorm_backward(dev, tensor<const float, 2>(g.data(), m, n), tensor<const float, 2>(xf.data(), m, n), std::span<const float>(w), rstd,
                     tensor<float, 2>(dx.data(), m, n), dw, o);
    return std::vector<double>(dx.begin(), dx.end());
  };
  const auto x = verify::filled<double>(m * n, verify::fill::normal, 5);
  const auto r = verify::gradcheck("rmsnorm", fwd, bwd, x);
  INFO(r.to_string());
  CHECK(r.passed());
}

TEST_CASE("gradcheck rejects what it cannot check", "[verify][gradcheck]") {
  auto id = [](std::span<const double> x) { return std::vector<double>(x.begin(), x.end()); };
  auto gid = [](std::span<const double>, std::span<const double> dy) { return std::vector<double>(dy.begin(), dy.end()); };
  const std::vector<double> x = {1, 2, 3};
  CHECK(verify::gradcheck("identity", id, gid, x).passed());
  verify::gradcheck_options o;
  o.step = 0;
  CHECK_THROWS_MATCHES(verify::gradcheck("step", id, gid, x, o), verify::verify_error, is_error(errc::invalid_argument, "verify", "step"));
  o = {};
  o.mode = verify::grad_mode::random_directions;
  o.directions = 0;
  CHECK_THROWS_MATCHES(verify::gradcheck("dirs", id, gid, x, o), verify::verify_error,
                       is_error(errc::invalid_argument, "verify", "zero random directions"));
  auto short_bwd = [](std::span<const double>, std::span<const double>) { return std::vector<double>(2); };
  CHECK_THROWS_MATCHES(verify::gradcheck("len", id, short_bwd, x), verify::verify_error,
                       is_error(errc::invalid_argument, "verify", "2 gradients for 3"));
  CHECK_THROWS_MATCHES(verify::gradcheck("nan", id, gid, std::vector<double>{1, NAN}), verify::verify_error,
                       is_error(errc::invalid_argument, "verify", "x[1]"));
  auto zero = [](std::span<const double> x0) { return std::vector<double>(x0.size(), 0.0); };
  auto gzero = [](std::span<const double> x0, std::span<const double>) { return std::vector<double>(x0.size(), 0.0); };
  const auto r = verify::gradcheck("constant", zero, gzero, x);
  CHECK(r.passed());
  CHECK(r.mistrusted);
}

}  // namespace tessel_test_verify_gradcheck
