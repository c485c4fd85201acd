// tessel/verify/check.hpp: the numbers (unit roundoff, γ_K, ULPs), the fills, the shape sweep, the
// comparison report, and the planted bugs it must find: a tail off-by-one in a user tile program,
// one wrong element among 10^5 (its exact index), a missing rescale in an online softmax, NaN that
// does not propagate, and a check that cannot discriminate (mistrusted).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/verify/check.hpp>

#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt).
namespace tessel_test_verify_check {

using namespace tessel;
using tessel_test::is_error;

TEST_CASE("verify numbers: unit roundoff, gamma_K and ULPs of each dtype", "[verify][check]") {
  CHECK(verify::unit_roundoff<float>() == std::ldexp(1.0, -24));
  CHECK(verify::unit_roundoff<double>() == std::ldexp(1.0, -53));
  CHECK(verify::unit_roundoff<bf16>() == std::ldexp(1.0, -8));
  CHECK(verify::unit_roundoff<fp16>() == std::ldexp(1.0, -11));
  CHECK(verify::unit_roundoff<e4m3>() == std::ldexp(1.0, -4));
  CHECK(verify::unit_roundoff<e5m2>() == std::ldexp(1.0, -3));
  CHECK(verify::unit_roundoff<int>() == 0.0);
  CHECK(verify::unit_roundoff(dtype::bf16) == std::ldexp(1.0, -8));
  CHECK(verify::gamma(1000, 0x1p-24) == Approx(1000 * 0x1p-24 / (1 - 1000 * 0x1p-24)));
  CHECK(std::isinf(verify::gamma(256, 1.0 / 256)));
  CHECK(verify::ulp<float>(1.0) == 0x1p-23);
  CHECK(verify::ulp<float>(1.5) == 0x1p-23);
  CHECK(verify::ulp<float>(-3.0) == 0x1p-22);
  CHECK(verify::ulp<float>(0.0) == 0x1p-149);  // subnormal spacing
  CHECK(verify::ulp<bf16>(1.0) == 0x1p-7);
  CHECK(verify::ulp<e4m3>(256.0) == 32.0);
  CHECK(verify::ulp<e4m3>(0.0) == 0x1p-9);
  CHECK(verify::ulp<int>(12345.0) == 1.0);
}

TEST_CASE("verify fills are seeded, in range, and adversarial fills hold every special", "[verify][check]") {
  const auto a = verify::filled<float>(1000, verify::fill::normal, 7), b = verify::filled<float>(1000, verify::fill::normal, 7);
  const auto c = verify::filled<float>(1000, verify::fill::normal, 8);
  CHECK(a == b);
  CHECK(a != c);
  double mean = 0, var = 0;
  for (float x : a) mean += x;
  mean /= 1000;
  for (float x : a) var += (x - mean) * (x - mean);
  CHECK(std::fabs(mean) < 0.15);
  CHECK(var / 1000 == Approx(1.0).margin(0.15));

  verify::fill_options o;
  o.range = 2;
  for (float x : verify::filled<float>(500, verify::fill::small_int, 3, o)) {
    CHECK(x == std::round(x));
    CHECK(std::fabs(x) <= 2);
  }
  o.lo = 2;
  o.hi = 3;
  for (bf16 x : verify::filled<bf16>(500, verify::fill::uniform, 3, o)) {
    CHECK(float(x) >= 2.0f);
    CHECK(float(x) <= 3.0f);
  }

  auto specials = [](const auto& v, double max, double min_normal) {
    bool nan = false, pinf = false, ninf = false, sub = false, big = false, zero = false;
    for (auto x : v) {
      const double d = double(x);
      nan |= std::isnan(d);
      pinf |= d == std::numeric_limits<double>::infinity();
      ninf |= d == -std::numeric_limits<double>::infinity();
      sub |= d != 0 && std::fabs(d) < min_normal;
      big |= std::fabs(d) == max;
      zero |= d == 0;
    }
    return nan && pinf && ninf && sub && big && zero;
  };
  CHECK(specials(verify::filled<float>(4096, verify::fill::adversarial, 1), std::numeric_limits<float>::max(), std::numeric_limits<float>::min()));
  CHECK(specials(verify::filled<bf16>(4096, verify::fill::adversarial, 1), double(std::numeric_limits<bf16>::max()),
                 double(std::numeric_limits<bf16>::min())));
  verify::fill_options finite;
  finite.specials = false;
  for (float x : verify::filled<float>(4096, verify::fill::adversarial, 1, finite)) CHECK(std::isfinite(x));

  verify::fill_options bad;
  bad.lo = 1;
  bad.hi = 1;
  CHECK_THROWS_MATCHES(verify::filled<float>(4, verify::fill::uniform, 1, bad), verify::verify_error,
                       is_error(errc::invalid_argument, "verify", "uniform bounds"));
  bad = {};
  bad.range = -1;
  CHECK_THROWS_MATCHES(verify::filled<float>(4, verify::fill::small_int, 1, bad), verify::verify_error,
                       is_error(errc::invalid_argument, "verify", "negative"));
}

TEST_CASE("verify sizes: zero, one, primes, tile edges and their neighbours", "[verify][check]") {
  const auto s = verify::sizes({16, 64}, 1009);
  for (std::size_t want : {0u, 1u, 2u, 3u, 7u, 15u, 16u, 17u, 33u, 63u, 64u, 65u, 129u, 1009u}) CHECK(std::find(s.begin(), s.end(), want) != s.end());
  CHECK(std::is_sorted(s.begin(), s.end()));
  CHECK(std::adjacent_find(s.begin(), s.end()) == s.end());
  const auto nz = verify::sizes({4}, 0, false);
  CHECK(nz.front() == 1);
  CHECK(std::find(nz.begin(), nz.end(), 0u) == nz.end());
}

// ---- planted bug 1: a tail off-by-one in a user tile program --------------------------------
// y = a·x + b in blocks of 16 elements; the buggy launch forgets the last partial block.
struct axpb_blocks {
  const float* x;
  float* y;
  std::size_t n;
  float a, b;
  void operator()(block_ctx& ctx) const {
    const std::size_t begin = ctx.block_linear() * 16, end = std::min(n, begin + 16);
    for (std::size_t i = begin; i < end; ++i) y[i] = a * x[i] + b;
  }
};

TEST_CASE("verify finds a tail off-by-one in a user tile program, at the first element of the tail", "[verify][check][planted]") {
  host_device dev(2);
  for (const bool buggy : {false, true}) {
    verify::suite s;
    for (std::size_t n : verify::sizes({16}, 1009)) {
      const auto x = verify::filled<float>(n, verify::fill::small_int, n);
      std::vector<float> y(n, 0.0f);
      std::vector<double> want(n);
      for (std::size_t i = 0; i < n; ++i) want[i] = 3.0 * x[i] + 1.0;
      const std::size_t blocks = buggy ? n / 16 : ceil_div(n, 16);  // the bug: n / 16 drops the tail
      dev.launch(grid{blocks}, axpb_blocks{x.data(), y.data(), n, 3.0f, 1.0f});
      auto r = verify::compare("axpb n=" + std::to_string(n), y, want, verify::tolerance::exact());
      if (buggy && n % 16 != 0) {
        INFO(r.to_string());
        CHECK_FALSE(r.passed());
        REQUIRE(!r.first.empty());
        CHECK(r.first.front().index == n / 16 * 16);  // the first element of the dropped tail
      } else {
        CHECK(r.passed());
      }
      s.add(std::move(r));
    }
    CHECK(s.passed() == !buggy);
    if (buggy) CHECK(s.summary().find("FAIL") != std::string::npos);
  }
}

// ---- planted bug 2: one wrong element among 10^5 ------------------------------------------
TEST_CASE("verify names the one wrong element among 10^5 by its index", "[verify][check][planted]") {
  const std::size_t n = 100000, bad = 73421;
  const auto x = verify::filled<float>(n, verify::fill::uniform, 11);
  std::vector<float> y(n);
  std::vector<double> want(n);
  for (std::size_t i = 0; i < n; ++i) {
    y[i] = x[i] * x[i];  // correctly rounded in float
    want[i] = double(x[i]) * double(x[i]);
  }
  const auto tol = verify::tolerance::ulps_of(dtype::f32, 0.5);  // correct rounding: within half an ULP
  CHECK(verify::compare("square", y, want, tol).passed());
  y[bad] = std::nextafter(y[bad], 2.0f);  // one ULP off
  const auto r = verify::compare("square", y, want, tol);
  INFO(r.to_string());
  CHECK(r.over == 1);
  REQUIRE(r.worst);
  CHECK(r.worst->index == bad);
  CHECK(r.worst->got == double(y[bad]));
  CHECK(r.worst->ulps > 0.5);
  CHECK(r.worst->ulps < 1.5);
  CHECK(r.first.size() == 1);
  CHECK(r.to_string().find("[73421]") != std::string::npos);
}

// ---- planted bug 3: an online softmax that forgets to rescale its running sum -----------------
std::vector<float> online_softmax(const std::vector<float>& x, std::size_t rows, std::size_t cols, bool rescale) {
  std::vector<float> y(x.size());
  for (std::size_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * cols;
    float m = -std::numeric_limits<float>::infinity(), s = 0;
    for (std::size_t c = 0; c < cols; ++c) {
      const float mn = std::max(m, xr[c]);
      if (rescale) s *= std::exp(m - mn);  // the bug: without this line, old terms keep the old max
      s += std::exp(xr[c] - mn);
      m = mn;
    }
    for (std::size_t c = 0; c < cols; ++c) y[r * cols + c] = std::exp(xr[c] - m) / s;
  }
  return y;
}

TEST_CASE("verify finds a missing rescale in an online softmax, and a fill that hides it does not", "[verify][check][planted]") {
  const std::size_t rows = 7;
  for (std::size_t cols : {5u, 33u, 257u}) {
    const auto x = verify::filled<float>(rows * cols, verify::fill::normal, cols);
    std::vector<double> want(x.size());
    for (std::size_t r = 0; r < rows; ++r) {
      double m = -INFINITY, s = 0;
      for (std::size_t c = 0; c < cols; ++c) m = std::max(m, double(x[r * cols + c]));
      for (std::size_t c = 0; c < cols; ++c) s += std::exp(double(x[r * cols + c]) - m);
      for (std::size_t c = 0; c < cols; ++c) want[r * cols + c] = std::exp(double(x[r * cols + c]) - m) / s;
    }
    const auto tol = verify::tolerance::relative(4 * cols * verify::unit_roundoff<float>());
    CHECK(verify::compare("softmax", online_softmax(x, rows, cols, true), want, tol).passed());
    const auto r = verify::compare("softmax", online_softmax(x, rows, cols, false), want, tol);
    INFO(r.to_string());
    CHECK_FALSE(r.passed());
    // rows whose maximum comes first never rescale: a descending fill cannot see the bug
    std::vector<float> sorted = x;
    for (std::size_t r0 = 0; r0 < rows; ++r0) std::sort(sorted.begin() + r0 * cols, sorted.begin() + (r0 + 1) * cols, std::greater<>());
    std::vector<double> want_sorted(sorted.size());
    const auto ys = online_softmax(sorted, rows, cols, true);
    for (std::size_t i = 0; i < ys.size(); ++i) want_sorted[i] = ys[i];
    CHECK(verify::compare("softmax sorted", online_softmax(sorted, rows, cols, false), want_sorted, verify::tolerance::exact()).passed());
  }
}

TEST_CASE("verify: NaN must propagate, infinities must match, and a mostly-zero reference is mistrusted", "[verify][check]") {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  std::vector<float> got = {1.0f, std::numeric_limits<float>::quiet_NaN(), float(inf), 0.0f};
  std::vector<double> want = {1.0, nan, inf, nan};
  auto r = verify::compare("nan", got, want, verify::tolerance::relative(1e-6));
  CHECK(r.over == 1);
  REQUIRE(r.worst);
  CHECK(r.worst->index == 3);  // want NaN, got 0
  got[2] = -float(inf);
  CHECK(verify::compare("inf", got, want, verify::tolerance::relative(1e-6)).over == 2);

  // relu of mostly negative input: 95% zeros, so a kernel that writes nothing would pass too
  const auto x = verify::filled<float>(1000, verify::fill::uniform, 5, {3, -20.0, 1.0, 1.0, true});
  std::vector<float> y(x.size()), nothing(x.size(), 0.0f);
  std::vector<double> w(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    y[i] = std::max(x[i], 0.0f);
    w[i] = std::max(double(x[i]), 0.0);
  }
  const auto rr = verify::compare("relu", y, w, verify::tolerance::exact());
  CHECK(rr.passed());
  CHECK(rr.mistrusted);
  CHECK(rr.to_string().find("mistrusted") != std::string::npos);
  CHECK(verify::compare("relu writes nothing", nothing, w, verify::tolerance::exact()).mistrusted);
  std::vector<float> ones(100, 1.0f);
  CHECK(verify::compare("constant", ones, std::vector<double>(100, 1.0), verify::tolerance::exact()).mistrusted);
  CHECK_FALSE(verify::compare("few", std::vector<float>(4, 0.0f), std::vector<double>(4, 0.0), verify::tolerance::exact()).mistrusted);

  CHECK_THROWS_MATCHES(verify::compare("sizes", std::vector<float>(3), std::vector<double>(4), verify::tolerance::exact()), verify::verify_error,
                       is_error(errc::invalid_argument, "verify", "3 elements"));
  CHECK_THROWS_MATCHES(verify::compare("tol", std::vector<float>(3), std::vector<double>(3), verify::tolerance::relative(-1)), verify::verify_error,
                       is_error(errc::invalid_argument, "verify", "negative"));
}

// The library's GEMM under DESIGN.md's bound: integer fills compare bitwise; real fills pass the γ_K
// bound and fail an exact one (so the bound is what makes the check pass).
TEST_CASE("verify checks the library GEMM: exact on small integers, gamma_K on real values", "[verify][check]") {
  host_device dev(2);
  for (std::size_t m : {1u, 17u, 64u})
    for (std::size_t k : {1u, 31u, 300u}) {
      const std::size_t n = 23;
      for (auto f : {verify::fill::small_int, verify::fill::uniform}) {
        const auto a = verify::filled<bf16>(m * k, f, m * 1000 + k), b = verify::filled<bf16>(k * n, f, k * 7 + 3);
        std::vector<float> c(m * n);
        gemm(dev, transpose::none, transpose::none, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
        std::vector<double> want(m * n), mag(m * n);
        for (std::size_t i = 0; i < m; ++i)
          for (std::size_t j = 0; j < n; ++j)
            for (std::size_t p = 0; p < k; ++p) {
              const double t = double(a[i * k + p]) * double(b[p * n + j]);
              want[i * n + j] += t;
              mag[i * n + j] += std::fabs(t);
            }
        const auto tol = f == verify::fill::small_int ? verify::tolerance::exact() : verify::tolerance::reduction(k, dtype::f32, dtype::f32);
        const auto r = verify::compare("gemm", c, want, tol, mag);
        INFO(r.to_string());
        CHECK(r.passed());
        if (f == verify::fill::uniform && k >= 300) CHECK_FALSE(verify::compare("gemm exact", c, want, verify::tolerance::exact()).passed());
      }
    }
}

TEST_CASE("verify compare_bits reports the first differing element", "[verify][check]") {
  std::vector<float> a = {1, 2, 3, 4}, b = a;
  CHECK(verify::compare_bits("same", a, b).passed());
  b[2] = -0.0f;
  a[2] = 0.0f;  // equal values, different bits
  auto r = verify::compare_bits("zero", a, b);
  CHECK(r.over == 1);
  REQUIRE(r.worst);
  CHECK(r.worst->index == 2);
  CHECK_THROWS_AS(verify::compare_bits("len", a, std::vector<float>(3)), verify::verify_error);
}

}  // namespace tessel_test_verify_check
