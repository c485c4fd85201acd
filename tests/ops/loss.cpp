// Cross-entropy (tessel/ops/loss.hpp): loss vs fp64 with label smoothing and ignore index, gradient
// vs fp64 finite differences, in-place gradient, large vocabularies (several column blocks),
// thread-count independence, bad labels write nothing.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/loss.hpp>

#include "reference/train_ref.hpp"
#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_ops_loss {

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

TEST_CASE("cross-entropy loss and gradient match fp64", "[ops][loss]") {
  host_device d1(1), d2(2);
  for (std::size_t V : {2u, 17u, 1000u, 10000u}) {
    for (float eps : {0.0f, 0.1f}) {
      const std::size_t rows = 7;
      auto z = train_ref::randn(rows * V, V, 4.0f);
      std::vector<std::int64_t> labels(rows);
      for (std::size_t r = 0; r < rows; ++r) labels[r] = std::int64_t((r * 7919) % V);
      labels[2] = -100;  // ignored
      std::vector<float> g(rows * V), g2(rows * V), rl(rows);
      cross_entropy_options o;
      o.label_smoothing = eps;
      const auto res = cross_entropy(d1, cview(z, rows, V), labels, view(g, rows, V), rl, o);
      const auto res2 = cross_entropy(d2, cview(z, rows, V), labels, view(g2, rows, V), {}, o);
      CHECK(res.counted == rows - 1);
      CHECK(res.loss == res2.loss);
      CHECK(std::memcmp(g.data(), g2.data(), g.size() * 4) == 0);
      std::vector<double> zd(z.begin(), z.end());
      double want = 0;
      for (std::size_t r = 0; r < rows; ++r) {
        if (labels[r] < 0) {
          CHECK(rl[r] == 0.0f);
          for (std::size_t j = 0; j < V; ++j) CHECK(g[r * V + j] == 0.0f);
          continue;
        }
        const double l = train_ref::cross_entropy(zd.data() + r * V, V, std::size_t(labels[r]), eps);
        CHECK(rl[r] == Approx(l).epsilon(1e-5).margin(1e-6));
        want += l;
        // gradient of the mean loss: (softmax - target) / count, checked by finite differences on a few entries
        for (std::size_t j : {std::size_t(0), std::size_t(labels[r]), V - 1, V / 2}) {
          auto p = zd, m = zd;
          const double h = 1e-5;
          p[r * V + j] += h;
          m[r * V + j] -= h;
          const double fdv = (train_ref::cross_entropy(p.data() + r * V, V, std::size_t(labels[r]), eps) -
                              train_ref::cross_entropy(m.data() + r * V, V, std::size_t(labels[r]), eps)) /
                             (2 * h) / double(rows - 1);
          CHECK(std::fabs(g[r * V + j] - fdv) < 1e-6 + 1e-4 * std::fabs(fdv));
        }
      }
      CHECK(res.loss == Approx(want / double(rows - 1)).epsilon(1e-5));
      // in place: the gradient overwrites the logits
      auto zi = z;
      cross_entropy(d2, cview(zi, rows, V), labels, view(zi, rows, V), {}, o);
      CHECK(std::memcmp(zi.data(), g.data(), g.size() * 4) == 0);
    }
  }
}

TEST_CASE("cross-entropy bad input writes nothing", "[ops][loss]") {
  host_device dev(2);
  const std::size_t rows = 3, V = 5;
  std::vector<float> z(rows * V, 1.0f), g(rows * V, 7.0f);
  std::vector<std::int64_t> labels = {0, 5, 1};
  CHECK_THROWS_MATCHES(cross_entropy(dev, cview(z, rows, V), labels, view(g, rows, V)), layer_error,
                       is_error(errc::out_of_range, "layers", "cross_entropy: label"));
  labels[1] = -3;
  CHECK_THROWS_MATCHES(cross_entropy(dev, cview(z, rows, V), labels, view(g, rows, V)), layer_error,
                       is_error(errc::out_of_range, "layers", "cross_entropy: label"));
  for (float v : g) CHECK(v == 7.0f);
  std::vector<std::int64_t> short_labels = {0, 1};
  CHECK_THROWS_AS(cross_entropy(dev, cview(z, rows, V), short_labels, view(g, rows, V)), layer_error);
  cross_entropy_options o;
  o.label_smoothing = 2.0f;
  labels[1] = 1;
  CHECK_THROWS_AS(cross_entropy(dev, cview(z, rows, V), labels, view(g, rows, V), {}, o), layer_error);
  // all ignored: loss 0, gradient 0
  std::vector<std::int64_t> ign(rows, -100);
  const auto r = cross_entropy(dev, cview(z, rows, V), ign, view(g, rows, V));
  CHECK(r.counted == 0);
  CHECK(r.loss == 0.0);
  for (float v : g) CHECK(v == 0.0f);
}

TEST_CASE("cross-entropy rows in a pipelined block equal rows computed alone, and loss with and without gradient agree", "[ops][loss]") {
  host_device d1(1), d2(2);
  for (std::size_t V : {3u, 40u, 4096u, 8192u, 9000u}) {
    const std::size_t rows = 11;
    auto z = train_ref::randn(rows * V, 60 + V, 3.0f);
    std::vector<std::int64_t> labels(rows);
    for (std::size_t r = 0; r < rows; ++r) labels[r] = std::int64_t((r * 31 + 1) % V);
    for (std::size_t r : {0u, 4u, 5u, 10u}) labels[r] = -100;  // first, consecutive and last rows ignored
    cross_entropy_options o;
    o.label_smoothing = 0.05f;
    o.grad_scale = 0.5f;
    std::vector<float> g(rows * V), rl(rows), rl_only(rows), g1(V), rl1(1);
    cross_entropy(d2, cview(z, rows, V), labels, view(g, rows, V), rl, o);
    const auto only = cross_entropy(d1, cview(z, rows, V), labels, tensor<float, 2>{}, rl_only, o);
    CHECK(std::memcmp(rl.data(), rl_only.data(), rows * 4) == 0);
    CHECK(only.counted == rows - 4);
    bool same = true;
    for (std::size_t r = 0; r < rows; ++r) {
      std::vector<float> zr(z.begin() + std::ptrdiff_t(r * V), z.begin() + std::ptrdiff_t((r + 1) * V));
      cross_entropy(d1, cview(zr, 1, V), std::span<const std::int64_t>(&labels[r], 1), view(g1, 1, V), rl1, o);
      same = same && std::memcmp(g1.data(), g.data() + r * V, V * 4) == 0 && rl1[0] == rl[r];
    }
    // the gradient against fp64: scale · (softmax − smoothed one-hot)
    double worst = 0.0;
    for (std::size_t r = 0; r < rows; ++r) {
      if (labels[r] < 0) continue;
      double m = -INFINITY, sum = 0.0;
      for (std::size_t j = 0; j < V; ++j) m = std::max(m, double(z[r * V + j]));
      for (std::size_t j = 0; j < V; ++j) sum += std::exp(double(z[r * V + j]) - m);
      for (std::size_t j = 0; j < V; ++j) {
        const double p = std::exp(double(z[r * V + j]) - m) / sum;
        const double t = (j == std::size_t(labels[r]) ? 1.0 - 0.05 : 0.0) + 0.05 / double(V);
        worst = std::max(worst, std::fabs(double(g[r * V + j]) - 0.5 * (p - t)));
      }
    }
    INFO("V " << V << " worst gradient error " << worst);
    CHECK(same);
    CHECK(worst < 1e-6);
  }
}

}  // namespace tessel_test_ops_loss
