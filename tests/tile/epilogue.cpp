// Epilogue ops and chains against plain loops: alpha/beta (beta = 0 never reads the destination),
// scale, column and row bias at any global position, residual of f32 and bf16, ReLU exactly and
// GELU (tanh, erf) and SiLU against an fp64 reference with a stated bound, the amax of cast_amax
// under concurrent stores, chain order and associativity, the chain's cast type, and the errors.
#include <catch2/catch.hpp>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#include <tessel/tile/epilogue.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp8.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_tile_epilogue {

using namespace tessel;
using Catch::Matchers::Contains;
namespace ep = tessel::epilogue;

namespace {
std::vector<float> random_row(std::size_t n, std::mt19937& g, float sd = 3.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}
std::uint32_t bits(float x) { return std::bit_cast<std::uint32_t>(x); }

template <class Op>
std::vector<float> applied(const Op& op, std::vector<float> v, const ep::row_info& ri = {}) {
  op.apply(v.data(), v.size(), ri);
  return v;
}

float read_f32(const void* p, std::size_t i) { return static_cast<const float*>(p)[i]; }

const std::size_t lengths[] = {0, 1, 7, 15, 16, 17, 64, 97, 300};
}  // namespace

TEST_CASE("alpha_beta: v = alpha v + beta C_old (through the reader or a direct f32 row), and beta = 0 never reads C", "[tile][epilogue]") {
  std::mt19937 g(51);
  for (std::size_t n : lengths) {
    const auto v = random_row(n, g);
    // beta == 0: old values are NaN and the reader is null: neither may be touched
    ep::row_info none;
    REQUIRE(none.old_at == nullptr);
    const auto same = applied(ep::alpha_beta(1.0f, 0.0f), v, none);
    for (std::size_t j = 0; j < n; ++j) REQUIRE(bits(same[j]) == bits(v[j]));  // alpha 1: bitwise identity
    const auto scaled = applied(ep::alpha_beta(-1.5f, 0.0f), v, none);
    for (std::size_t j = 0; j < n; ++j) REQUIRE(scaled[j] == -1.5f * v[j]);
    // beta != 0 reads the old row with its stride (every other element of `old`)
    std::vector<float> old(2 * n + 1);
    for (auto& x : old) x = float(int(g() % 64) - 32);
    std::vector<float> vi(n);
    for (auto& x : vi) x = float(int(g() % 64) - 32);
    ep::row_info ri;
    ri.old = old.data();
    ri.old_stride = 2;
    ri.old_at = &read_f32;
    const auto r = applied(ep::alpha_beta(4.0f, -0.25f), vi, ri);
    for (std::size_t j = 0; j < n; ++j) REQUIRE(r[j] == 4.0f * vi[j] - 0.25f * old[2 * j]);  // exact: powers of two
    // a contiguous f32 row given as old_f32 is read directly (a vector loop), not through old_at:
    // the right elements (exact) and, on real values, the reader's bits
    ep::row_info direct;
    direct.old_f32 = old.data() + 1;
    const auto rd = applied(ep::alpha_beta(4.0f, -0.25f), vi, direct);
    for (std::size_t j = 0; j < n; ++j) REQUIRE(rd[j] == 4.0f * vi[j] - 0.25f * old[j + 1]);
    const auto real_old = random_row(n, g);
    ep::row_info by_reader;
    by_reader.old = real_old.data();
    by_reader.old_at = &read_f32;
    direct.old_f32 = real_old.data();
    const auto x = applied(ep::alpha_beta(0.7f, 1.3f), v, by_reader), y = applied(ep::alpha_beta(0.7f, 1.3f), v, direct);
    for (std::size_t j = 0; j < n; ++j) REQUIRE(bits(x[j]) == bits(y[j]));
  }
}

TEST_CASE("scale, column bias, row bias and residual add at the row's global position", "[tile][epilogue]") {
  std::mt19937 g(52);
  const std::size_t N = 400, M = 9;
  const auto bias = random_row(N, g), brow = random_row(M, g);
  std::vector<float> res(M * N);
  std::vector<bf16> resb(M * N);
  for (std::size_t i = 0; i < res.size(); ++i) {
    res[i] = float(int(g() % 200) - 100) / 4.0f;
    resb[i] = bf16(float(int(g() % 200) - 100));
  }
  const tensor<const float, 2> R(res.data(), M, N);
  const tensor<const bf16, 2> Rb(resb.data(), M, N);
  for (std::size_t n : lengths) {
    for (std::size_t col0 : {std::size_t{0}, std::size_t{3}, N - n}) {
      if (col0 + n > N) continue;
      for (std::size_t row : {std::size_t{0}, M - 1}) {
        ep::row_info ri;
        ri.row = row;
        ri.col0 = col0;
        const auto v = random_row(n, g);
        const auto s = applied(ep::scale(0.3f), v, ri);
        const auto b = applied(ep::bias(bias), v, ri);
        const auto br = applied(ep::bias_row(brow), v, ri);
        const auto rr = applied(ep::residual(R), v, ri);
        const auto rb = applied(ep::residual(Rb), v, ri);
        for (std::size_t j = 0; j < n; ++j) {
          REQUIRE(s[j] == v[j] * 0.3f);
          REQUIRE(b[j] == v[j] + bias[col0 + j]);
          REQUIRE(br[j] == v[j] + brow[row]);
          REQUIRE(rr[j] == v[j] + res[row * N + col0 + j]);
          REQUIRE(rb[j] == v[j] + float(resb[row * N + col0 + j]));
        }
      }
    }
  }
  STATIC_REQUIRE(std::is_same_v<decltype(ep::residual(Rb)), ep::residual<bf16>>);
  STATIC_REQUIRE(std::is_same_v<ep::bias_col, ep::bias>);
}

TEST_CASE("bias, bias_row and residual that are too small are errors, not reads past the end", "[tile][epilogue][errors]") {
  std::vector<float> b(10, 1.0f), r(4 * 10, 0.0f), v(8, 0.0f);
  ep::row_info ri;
  ri.col0 = 3;  // needs columns 3..10
  REQUIRE_THROWS_WITH(ep::bias(b).apply(v.data(), v.size(), ri), Contains("epilogue::bias"));
  REQUIRE_NOTHROW(ep::bias(b).apply(v.data(), 7, ri));
  ri.row = 10;
  REQUIRE_THROWS_WITH(ep::bias_row(b).apply(v.data(), 1, ri), Contains("epilogue::bias_row"));
  ri.row = 4;
  ri.col0 = 0;
  REQUIRE_THROWS_WITH(ep::residual(tensor<const float, 2>(r.data(), 4, 10)).apply(v.data(), 1, ri), Contains("epilogue::residual"));
  ri.row = 3;
  ri.col0 = 5;
  REQUIRE_THROWS_AS(ep::residual(tensor<const float, 2>(r.data(), 4, 10)).apply(v.data(), 6, ri), std::exception);
}

TEST_CASE("activations: ReLU exactly, GELU and SiLU within 2e-6 relative (+1e-7) of fp64", "[tile][epilogue]") {
  std::vector<float> v;
  for (int i = -12000; i <= 12000; ++i) v.push_back(float(i) / 1000.0f);
  for (float x : {-100.0f, 100.0f, -0.0f, 1e-30f, -1e-30f}) v.push_back(x);
  const auto gt = [](double x) { return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); };
  const auto ge = [](double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); };
  const auto si = [](double x) { return x / (1.0 + std::exp(-x)); };
  const auto relu = applied(ep::relu, v);
  const auto gtanh = applied(ep::gelu_tanh, v), gerf = applied(ep::gelu_erf, v), silu = applied(ep::silu, v), gdef = applied(ep::gelu, v);
  double worst[3] = {0, 0, 0};
  for (std::size_t j = 0; j < v.size(); ++j) {
    REQUIRE(relu[j] == (v[j] > 0.0f ? v[j] : 0.0f));
    REQUIRE(bits(gdef[j]) == bits(gtanh[j]));  // gelu is the tanh form
    const double refs[3] = {gt(v[j]), ge(v[j]), si(v[j])}, got[3] = {gtanh[j], gerf[j], silu[j]};
    for (int k = 0; k < 3; ++k) {
      const double err = std::fabs(got[k] - refs[k]) / (std::fabs(refs[k]) * 2e-6 + 1e-7);
      worst[k] = std::max(worst[k], err);
    }
  }
  INFO("worst error / bound: gelu_tanh " << worst[0] << ", gelu_erf " << worst[1] << ", silu " << worst[2]);
  for (double w : worst) REQUIRE(w <= 1.0);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  REQUIRE(std::isnan(applied(ep::relu, {nan})[0]));
}

TEST_CASE("cast_amax records max |v| of every row, whatever the order and thread count", "[tile][epilogue]") {
  std::mt19937 g(53);
  std::vector<std::vector<float>> rows;
  float want = 0.0f;
  for (int i = 0; i < 64; ++i) {
    rows.push_back(random_row(1 + g() % 100, g, 100.0f));
    for (float x : rows.back()) want = std::max(want, std::fabs(x));
  }
  std::atomic<float> amax{0.0f};
  const auto cast = ep::cast_amax<e4m3>(amax);
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      for (std::size_t i = std::size_t(t); i < rows.size(); i += 4) {
        auto r = rows[i];
        cast.apply(r.data(), r.size(), {});
      }
    });
  for (auto& t : ts) t.join();
  REQUIRE(amax.load() == want);
  // without an amax the cast op leaves the row alone (the conversion itself is store's)
  const auto v = random_row(33, g);
  const auto same = applied(ep::cast<bf16>, v);
  for (std::size_t j = 0; j < v.size(); ++j) REQUIRE(bits(same[j]) == bits(v[j]));
}

TEST_CASE("chains apply left to right, compose associatively, and name their cast", "[tile][epilogue]") {
  std::mt19937 g(54);
  const auto bias = random_row(50, g);
  const auto v = random_row(50, g);
  const auto ab = ep::scale(2.0f) | ep::bias(bias);
  const auto ba = ep::bias(bias) | ep::scale(2.0f);
  const auto x = applied(ab, v), y = applied(ba, v);
  for (std::size_t j = 0; j < v.size(); ++j) {
    REQUIRE(x[j] == v[j] * 2.0f + bias[j]);
    REQUIRE(y[j] == (v[j] + bias[j]) * 2.0f);
  }
  const auto left = (ep::scale(2.0f) | ep::relu) | ep::bias(bias);
  const auto right = ep::scale(2.0f) | (ep::relu | ep::bias(bias));
  STATIC_REQUIRE(std::is_same_v<decltype(left), decltype(right)>);
  STATIC_REQUIRE(std::is_same_v<std::remove_const_t<decltype(left)>, ep::chain<ep::scale, ep::relu_t, ep::bias>>);
  const auto l = applied(left, v), r = applied(right, v);
  for (std::size_t j = 0; j < v.size(); ++j) REQUIRE(bits(l[j]) == bits(r[j]));
  // the empty chain is an identity and a unit of |
  STATIC_REQUIRE(ep::chain<>::empty);
  STATIC_REQUIRE_FALSE(decltype(left)::empty);
  const auto e = applied(ep::chain<>{}, v);
  for (std::size_t j = 0; j < v.size(); ++j) REQUIRE(bits(e[j]) == bits(v[j]));
  STATIC_REQUIRE(std::is_same_v<std::remove_const_t<decltype(ep::chain<>{} | ep::relu)>, ep::chain<ep::relu_t>>);
  // cast type: the trailing cast's, void without one
  STATIC_REQUIRE(std::is_void_v<ep::cast_type_t<ep::chain<>>>);
  STATIC_REQUIRE(std::is_void_v<ep::cast_type_t<ep::relu_t>>);
  STATIC_REQUIRE(std::is_same_v<ep::cast_type_t<ep::cast_t<bf16>>, bf16>);
  STATIC_REQUIRE(std::is_same_v<ep::cast_type_t<decltype(ep::relu | ep::cast<e4m3>)>, e4m3>);
  STATIC_REQUIRE(std::is_void_v<ep::cast_type_t<decltype(ep::cast<e4m3> | ep::relu)>>);
  STATIC_REQUIRE(ep::op<ep::relu_t>);
  STATIC_REQUIRE_FALSE(ep::op<int>);
}

}  // namespace tessel_test_tile_epilogue
