// RoPE (tessel/ops/rope.hpp): both pair layouts vs an fp64 rotation, backward inverts forward,
// a rope_table gives the same bits as computing, bad input.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/rope.hpp>

#include "reference/train_ref.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_ops_rope {

using namespace tessel;

TEST_CASE("rope matches an fp64 rotation and backward inverts it", "[ops][rope]") {
  host_device dev(2);
  for (bool inter : {false, true}) {
    const std::size_t T = 13, H = 3, D = 64;
    auto x = train_ref::randn(T * H * D, 1);
    std::vector<std::int64_t> pos(T);
    for (std::size_t t = 0; t < T; ++t) pos[t] = std::int64_t(t * 1000 + 3);
    auto y = x;
    rope_options o;
    o.interleaved = inter;
    rope_forward(dev, tensor<float, 2>(y.data(), T, H * D), D, pos, o);
    double worst = 0;
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t h = 0; h < H; ++h)
        for (std::size_t j = 0; j < D / 2; ++j) {
          const double a = double(pos[t]) * std::pow(10000.0, -2.0 * double(j) / double(D));
          const std::size_t i0 = t * H * D + h * D + (inter ? 2 * j : j), i1 = i0 + (inter ? 1 : D / 2);
          const double r0 = x[i0] * std::cos(a) - x[i1] * std::sin(a), r1 = x[i0] * std::sin(a) + x[i1] * std::cos(a);
          worst = std::max({worst, std::fabs(r0 - y[i0]), std::fabs(r1 - y[i1])});
        }
    CHECK(worst < 1e-6 * 8);
    rope_backward(dev, tensor<float, 2>(y.data(), T, H * D), D, pos, o);
    double back = 0;
    for (std::size_t i = 0; i < x.size(); ++i) back = std::max(back, double(std::fabs(y[i] - x[i])));
    CHECK(back < 1e-6 * 8);
  }
  std::vector<float> x(12);
  std::vector<std::int64_t> pos(2);
  CHECK_THROWS_AS(rope_forward(dev, tensor<float, 2>(x.data(), 2, 6), 3, pos), layer_error);
  CHECK_THROWS_AS(rope_forward(dev, tensor<float, 2>(x.data(), 2, 6), 4, pos), layer_error);
  CHECK_THROWS_AS(rope_forward(dev, tensor<float, 2>(x.data(), 3, 4), 4, pos), layer_error);
}

TEST_CASE("rope takes given frequencies in place of theta's", "[ops][rope]") {
  host_device dev(2);
  const std::size_t T = 5, D = 16;
  auto x = train_ref::randn(T * D, 3);
  std::vector<std::int64_t> pos{0, 1, 7, 100, 4096};
  std::vector<double> freq(D / 2);
  for (std::size_t j = 0; j < freq.size(); ++j) freq[j] = std::pow(500000.0, -2.0 * double(j) / double(D));
  auto a = x, b = x;
  rope_options by_theta;
  by_theta.theta = 500000.0;
  rope_options by_freq;
  by_freq.inv_freq = freq;
  rope_forward(dev, tensor<float, 2>(a.data(), T, D), D, pos, by_theta);
  rope_forward(dev, tensor<float, 2>(b.data(), T, D), D, pos, by_freq);
  CHECK(a == b);                    // the same doubles give the same bits
  for (double& f : freq) f /= 8.0;  // linear scaling: position p behaves as p / 8
  auto c = x, d = x;
  by_freq.inv_freq = freq;
  rope_forward(dev, tensor<float, 2>(c.data(), T, D), D, std::vector<std::int64_t>{0, 8, 56, 800, 8 * 4096}, by_freq);
  rope_forward(dev, tensor<float, 2>(d.data(), T, D), D, pos, by_theta);
  for (std::size_t i = 0; i < c.size(); ++i) CHECK(std::fabs(c[i] - d[i]) < 1e-5);
  freq.pop_back();
  by_freq.inv_freq = freq;
  CHECK_THROWS_AS(rope_forward(dev, tensor<float, 2>(a.data(), T, D), D, pos, by_freq), layer_error);
}

TEST_CASE("a rope_table changes no bits, only where cos and sin come from", "[ops][rope]") {
  host_device dev(2);
  const std::size_t T = 9, H = 2, D = 32;
  auto x = train_ref::randn(T * H * D, 5);
  // positions below, inside and past what the table will hold, repeated and out of order, negative
  const std::vector<std::int64_t> pos{0, 5, 63, 64, 200, 5, -3, 100000, 127};
  std::vector<double> freq(D / 2);
  for (std::size_t j = 0; j < freq.size(); ++j) freq[j] = std::pow(500000.0, -2.0 * double(j) / double(D)) / (j % 3 + 1.0);
  for (bool inter : {false, true})
    for (bool given : {false, true}) {
      rope_options o;
      o.interleaved = inter;
      o.theta = 20000.0;
      if (given) o.inv_freq = freq;
      // 128 positions at most: 100000 is computed by the call even with the table
      rope_table tab(D, o, 128 * D * sizeof(float));
      CHECK(tab.positions() == 0);
      tab.cover(std::vector<std::int64_t>{3});
      CHECK(tab.positions() == 64);  // grows to at least 64 positions
      tab.cover(pos);
      CHECK(tab.positions() == 128);  // capped by max_bytes
      rope_options ot = o;
      ot.table = &tab;
      auto a = x, b = x;
      rope_forward(dev, tensor<float, 2>(a.data(), T, H * D), D, pos, o);
      rope_forward(dev, tensor<float, 2>(b.data(), T, H * D), D, pos, ot);
      CHECK(a == b);
      rope_backward(dev, tensor<float, 2>(a.data(), T, H * D), D, pos, o);
      rope_backward(dev, tensor<float, 2>(b.data(), T, H * D), D, pos, ot);
      CHECK(a == b);
      // a table of other frequencies (theta's vs given, or another theta) or head_dim is refused
      rope_options other = o;
      if (given)
        other.inv_freq = {};
      else
        other.theta = 10000.0;
      rope_table wrong(D, other), wrong_d(D / 2, o.inv_freq.empty() ? o : rope_options{});
      wrong.cover(pos);
      wrong_d.cover(pos);
      ot.table = &wrong;
      CHECK_THROWS_WITH(rope_forward(dev, tensor<float, 2>(b.data(), T, H * D), D, pos, ot),
                        Catch::Contains("rope_forward: the rope_table was built for other frequencies"));
      ot.table = &wrong_d;
      CHECK_THROWS_AS(rope_backward(dev, tensor<float, 2>(b.data(), T, H * D), D, pos, ot), layer_error);
    }
  CHECK_THROWS_AS(rope_table(7), layer_error);
  rope_options few;
  few.inv_freq = std::span<const double>(freq).first(3);
  CHECK_THROWS_AS(rope_table(D, few), layer_error);
}

}  // namespace tessel_test_ops_rope
