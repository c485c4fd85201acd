// Activations (tessel/ops/activation.hpp): forward vs fp64 (|err| <= 4e-6·(|y|+1e-3)... see bounds
// below), backward vs fp64 finite differences, bf16 output = rounding of the f32 output, bad input.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/activation.hpp>

#include "reference/train_ref.hpp"
#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_ops_activation {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;

namespace {
std::vector<float> inputs() {
  auto x = train_ref::randn(70001, 1, 3.0f);
  const float special[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 20.0f, -20.0f, 90.0f, -90.0f, 1e4f, -1e4f};
  for (std::size_t i = 0; i < std::size(special); ++i) x[i * 7] = special[i];
  return x;
}
// Error bound for the forward passes: 1e-5 relative plus 1e-6·|x| absolute (near the roots the
// result is tiny relative to x and a few ulp of x·sigmoid(x) dominate).
bool close(double got, double want, double x) { return std::fabs(got - want) <= 1e-5 * std::fabs(want) + 1e-6 * std::fabs(x) + 1e-37; }
double fd(const std::function<double(double)>& f, double x) {
  const double h = 1e-5 * std::max(1.0, std::fabs(x));
  return (f(x + h) - f(x - h)) / (2 * h);
}
}  // namespace

TEST_CASE("activations forward match fp64 and backward matches finite differences", "[ops][activation]") {
  host_device dev(2);
  const auto x = inputs();
  const std::size_t n = x.size();
  std::vector<float> y(n), dy(n, 1.0f), dx(n);
  struct cse {
    const char* name;
    std::function<void()> fwd, bwd;
    std::function<double(double)> ref;
  };
  const std::vector<cse> cases = {
      {"gelu_tanh", [&] { gelu_forward(dev, std::span<const float>(x), std::span<float>(y), gelu_approx::tanh); },
       [&] { gelu_backward(dev, std::span<const float>(dy), std::span<const float>(x), std::span<float>(dx), gelu_approx::tanh); },
       train_ref::gelu_tanh},
      {"gelu_erf", [&] { gelu_forward(dev, std::span<const float>(x), std::span<float>(y), gelu_approx::erf); },
       [&] { gelu_backward(dev, std::span<const float>(dy), std::span<const float>(x), std::span<float>(dx), gelu_approx::erf); },
       train_ref::gelu_erf},
      {"silu", [&] { silu_forward(dev, std::span<const float>(x), std::span<float>(y)); },
       [&] { silu_backward(dev, std::span<const float>(dy), std::span<const float>(x), std::span<float>(dx)); }, train_ref::silu},
  };
  for (const auto& c : cases) {
    c.fwd();
    c.bwd();
    std::size_t bad_f = 0, bad_b = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (!close(y[i], c.ref(x[i]), x[i])) bad_f++;
      if (std::fabs(x[i]) < 50 && std::fabs(dx[i] - fd(c.ref, x[i])) > 1e-4 * (1 + std::fabs(dx[i]))) bad_b++;
    }
    INFO(c.name);
    CHECK(bad_f == 0);
    CHECK(bad_b == 0);
  }
  // bf16 output is the rounding of the f32 output
  std::vector<bf16> yb(n);
  silu_forward(dev, std::span<const float>(x), std::span<float>(y));
  silu_forward(dev, std::span<const float>(x), std::span<bf16>(yb));
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += yb[i].bits() != bf16(y[i]).bits();
  CHECK(bad == 0);
}

TEST_CASE("swiglu forward/backward", "[ops][activation]") {
  host_device dev(2);
  const std::size_t n = 10007;
  auto a = train_ref::randn(n, 2, 2.0f), b = train_ref::randn(n, 3), g = train_ref::randn(n, 4);
  std::vector<float> y(n), da(n), db(n);
  swiglu_forward(dev, std::span<const float>(a), std::span<const float>(b), std::span<float>(y));
  swiglu_backward(dev, std::span<const float>(g), std::span<const float>(a), std::span<const float>(b), std::span<float>(da), std::span<float>(db));
  for (std::size_t i = 0; i < n; ++i) {
    const double want = train_ref::silu(a[i]) * b[i];
    REQUIRE(close(y[i], want, a[i] * b[i]));
    const double fa = fd([&](double t) { return train_ref::silu(t) * b[i]; }, a[i]) * g[i];
    const double fb = train_ref::silu(a[i]) * g[i];
    REQUIRE(std::fabs(da[i] - fa) <= 1e-4 * (1 + std::fabs(fa)));
    REQUIRE(std::fabs(db[i] - fb) <= 1e-5 * (1 + std::fabs(fb)));
  }
  std::vector<float> short_b(n - 1);
  CHECK_THROWS_AS(swiglu_forward(dev, std::span<const float>(a), std::span<const float>(short_b), std::span<float>(y)), layer_error);
  CHECK_THROWS_MATCHES(gelu_forward(dev, std::span<const float>(a), std::span<float>(short_b)), layer_error,
                       is_error(errc::invalid_argument, "layers"));
}

// ReLU and the elementwise sum are exact in f32: every element equals its definition bitwise, in
// both the vector body and the scalar tail (n is not a multiple of any vector width), with NaN
// propagated by the forward, an infinite dy masked to exactly 0 where x <= 0, and aliasing allowed.
TEST_CASE("relu forward/backward and add are exact", "[ops][activation]") {
  host_device dev(2);
  auto x = train_ref::randn(10007, 5, 2.0f);
  auto g = train_ref::randn(x.size(), 6);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  x[3] = 0.0f, x[4] = -0.0f, x[5] = nan, x[6] = -1e-30f, x[7] = 1e-30f, x[8] = -inf, x[9] = inf;
  g[10] = inf, x[10] = -1.0f, g[11] = -inf, x[11] = 2.0f, x[x.size() - 1] = -3.0f, x[x.size() - 2] = 3.0f;
  const std::size_t n = x.size();
  std::vector<float> y(n), dx(n), s(n);
  relu_forward(dev, std::span<const float>(x), std::span<float>(y));
  relu_backward(dev, std::span<const float>(g), std::span<const float>(x), std::span<float>(dx));
  add_forward(dev, std::span<const float>(x), std::span<const float>(g), std::span<float>(s));
  std::size_t bad_y = 0, bad_dx = 0, bad_s = 0;
  for (std::size_t i = 0; i < n; ++i) {
    // max(0, x) as vmaxps: x unless 0 > x, so NaN and -0 come through as themselves
    const float want = 0.0f > x[i] ? 0.0f : x[i];
    bad_y += std::bit_cast<std::uint32_t>(y[i]) != std::bit_cast<std::uint32_t>(want);
    bad_dx += !(x[i] > 0.0f ? (dx[i] == g[i]) : (dx[i] == 0.0f));
    bad_s += s[i] != x[i] + g[i] && !(std::isnan(s[i]) && std::isnan(x[i] + g[i]));
  }
  CHECK(bad_y == 0);
  CHECK(bad_dx == 0);
  CHECK(bad_s == 0);
  // backward from the output gives the same gradient (y > 0 exactly where x > 0)
  std::vector<float> dx2(n);
  relu_backward(dev, std::span<const float>(g), std::span<const float>(y), std::span<float>(dx2));
  CHECK(dx2 == dx);
  // in place: y = relu(y), dy overwritten by dx, a += b
  std::vector<float> xi = x, gi = g, si = x;
  relu_forward(dev, std::span<const float>(xi), std::span<float>(xi));
  relu_backward(dev, std::span<const float>(gi), std::span<const float>(x), std::span<float>(gi));
  add_forward(dev, std::span<const float>(si), std::span<const float>(g), std::span<float>(si));
  for (std::size_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) continue;
    REQUIRE(xi[i] == y[i]);
    REQUIRE(gi[i] == dx[i]);
    REQUIRE(si[i] == s[i]);
  }
  // bf16 output: the rounding of the exact f32 result
  std::vector<bf16> sb(n);
  add_forward(dev, std::span<const float>(x), std::span<const float>(g), std::span<bf16>(sb));
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += !std::isnan(s[i]) && sb[i].bits() != bf16(s[i]).bits();
  CHECK(bad == 0);
  std::vector<float> shorter(n - 1);
  CHECK_THROWS_MATCHES(relu_forward(dev, std::span<const float>(x), std::span<float>(shorter)), layer_error,
                       is_error(errc::invalid_argument, "layers"));
  CHECK_THROWS_MATCHES(relu_backward(dev, std::span<const float>(shorter), std::span<const float>(x), std::span<float>(dx)), layer_error,
                       is_error(errc::invalid_argument, "layers"));
  CHECK_THROWS_MATCHES(add_forward(dev, std::span<const float>(x), std::span<const float>(shorter), std::span<float>(s)), layer_error,
                       is_error(errc::invalid_argument, "layers"));
  CHECK_THROWS_AS(relu_backward(dev, std::span<const float>(g), std::span<const float>(static_cast<const float*>(nullptr), n), std::span<float>(dx)),
                  layer_error);
}

}  // namespace tessel_test_ops_activation
