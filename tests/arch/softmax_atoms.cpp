// The online-softmax row kernels against scalar forms and an fp64 reference. exp2_nonpos is within
// 3 ulp of 2^x over [-126, 0] (0 below, exactly 1 at 0); its vector, scalef and scalar forms agree
// bit for bit (scalef also for -inf and NaN); the row kernels equal their scalar definitions for
// every length (vector body and tail); f32 -> bf16 is RNE on every rounding boundary; and an online
// softmax over random blocks of a row matches fp64 softmax within the bound its roundings give:
// |o/l - ref| <= (ln2 u max|x| + 8u + 2 n u) * sum_j pi_j |v_j|, u = 2^-24.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <tessel/arch/softmax_atoms.hpp>
#include <tessel/types/bf16.hpp>

using namespace tessel;
namespace sm = tessel::arch::softmax;

namespace {
std::uint32_t fbits(float x) { return std::bit_cast<std::uint32_t>(x); }
constexpr double u = 1.0 / (1 << 24);

std::vector<float> nonpos_sweep() {
  std::vector<float> x;
  for (int k = 0; k <= 127 * 1024; ++k) x.push_back(-float(k) / 1024.0f);
  std::mt19937 g(91);
  std::uniform_real_distribution<float> d(-130.0f, 0.0f);
  for (int i = 0; i < 50000; ++i) x.push_back(d(g));
  for (float f : {-0.0f, -1e-30f, -126.0f, std::nextafter(-126.0f, 0.0f), std::nextafter(-126.0f, -200.0f), -127.0f, -1e9f,
                  -std::numeric_limits<float>::infinity()})
    x.push_back(f);
  return x;
}

std::vector<float> random_scores(std::size_t n, std::mt19937& g, float sd = 4.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> s(n);
  for (auto& x : s) x = d(g);
  return s;
}
}  // namespace

TEST_CASE("exp2_nonpos: within 3 ulp of 2^x on [-126, 0], exactly 1 at 0, 0 below -126 and at -inf", "[arch][softmax]") {
  const auto xs = nonpos_sweep();
  double worst = 0;
  std::size_t bad = 0;
  for (float x : xs) {
    const float e = sm::exp2_nonpos(x);
    if (x >= -126.0f) {
      const double ref = std::exp2(double(x));
      const double ulp = std::ldexp(1.0, std::ilogb(ref) - 23);
      worst = std::max(worst, std::fabs(double(e) - ref) / ulp);
    } else {
      bad += e != 0.0f;
    }
  }
  INFO("worst error " << worst << " ulp");
  REQUIRE(worst <= 3.0);
  REQUIRE(bad == 0);
  REQUIRE(sm::exp2_nonpos(0.0f) == 1.0f);
  REQUIRE(sm::exp2_nonpos(-0.0f) == 1.0f);
  REQUIRE(sm::exp2_nonpos(std::numeric_limits<float>::quiet_NaN()) == 0.0f);
}

TEST_CASE("exp2_nonpos: vector, scalef and scalar forms give the same bits", "[arch][softmax]") {
  auto xs = nonpos_sweep();
  while (xs.size() % sm::W) xs.push_back(-1.0f);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < xs.size(); i += sm::W) {
    const sm::vf v = sm::vf::load_unaligned(xs.data() + i);
    alignas(64) float a[sm::W], b[sm::W];
    sm::exp2_nonpos(v).store_aligned(a);
    sm::exp2_nonpos_scalef(v).store_aligned(b);
    for (std::size_t l = 0; l < sm::W; ++l) {
      const float s = sm::exp2_nonpos(xs[i + l]);
      bad += fbits(b[l]) != fbits(s);
      bad += std::isinf(xs[i + l]) ? a[l] != 0.0f : fbits(a[l]) != fbits(s);
    }
  }
  REQUIRE(bad == 0);
  // scalef: NaN lanes give 0 like the scalar form
  std::vector<float> nan(sm::W, std::numeric_limits<float>::quiet_NaN());
  alignas(64) float out[sm::W];
  sm::exp2_nonpos_scalef(sm::vf::load_unaligned(nan.data())).store_aligned(out);
  for (float o : out) REQUIRE(o == 0.0f);
}

TEST_CASE("f32_to_bf16_bits, store_bf16 and to_bf16_row give tessel::bf16 bits on every boundary, Inf and NaN", "[arch][softmax]") {
  std::vector<float> x;
  for (std::uint32_t c = 0; c < 0x7F80u; ++c) {  // every finite positive bf16 value, its midpoint up, +-1 ulp
    const float v = std::bit_cast<float>(c << 16), mid = std::bit_cast<float>((c << 16) | 0x8000u);
    for (float f : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      x.push_back(f);
      x.push_back(-f);
    }
  }
  x.push_back(std::numeric_limits<float>::max());
  // Inf and NaN payloads (quiet, signalling, payload only below bf16's mantissa): tessel::bf16's rule
  for (std::uint32_t b : {0x7F800000u, 0x7F800001u, 0x7F810000u, 0x7FA00000u, 0x7FC00000u, 0x7FFFFFFFu, 0x7F80FFFFu, 0x7FBF0000u})
    for (int k = 0; k < 2 * int(sm::W); ++k) {  // whole vectors of them, too
      x.push_back(std::bit_cast<float>(b));
      x.push_back(std::bit_cast<float>(b | 0x80000000u));
    }
  std::vector<std::uint16_t> row(x.size() + 8, 0xAAAA);
  sm::to_bf16_row(x.data(), x.size(), row.data());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const std::uint16_t want = bf16(x[i]).bits();
    bad += sm::f32_to_bf16_bits(x[i]) != want;
    bad += row[i] != want;
  }
  for (std::size_t i = x.size(); i < row.size(); ++i) bad += row[i] != 0xAAAA;
  for (std::size_t i = 0; i + sm::W <= x.size(); i += 997 * sm::W) {
    std::uint16_t a[sm::W], b[sm::W];
    sm::store_bf16(x.data() + i, a);
    sm::store_bf16(sm::vf::load_unaligned(x.data() + i), b);
    for (std::size_t l = 0; l < sm::W; ++l) bad += a[l] != bf16(x[i + l]).bits() || b[l] != a[l];
  }
  REQUIRE(bad == 0);
  REQUIRE(std::isnan(float(bf16::from_bits(sm::f32_to_bf16_bits(std::bit_cast<float>(0x7F800001u))))));
  REQUIRE(sm::f32_to_bf16_bits(INFINITY) == 0x7F80);
}

TEST_CASE("row kernels equal their scalar definitions at every length", "[arch][softmax]") {
  std::mt19937 g(92);
  std::size_t bad = 0;
  for (std::size_t n = 0; n <= 3 * sm::W + 3; ++n) {
    const auto s = random_scores(n + 1, g), y = random_scores(n + 1, g);
    const float c = 0.3f;
    // row_max, hmax
    float mx = -INFINITY;
    for (std::size_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
    bad += fbits(sm::row_max(s.data(), n)) != fbits(mx);
    const float m = n ? mx * c : 0.0f;
    // exp2_row (f32 and bf16 outputs), exp2_inplace
    std::vector<float> p(n + 1, -1.0f), q = s;
    std::vector<std::uint16_t> pb(n + 1, 0xAAAA);
    const float sum = sm::exp2_row(s.data(), n, c, m, p.data());
    const float sumb = sm::exp2_row(s.data(), n, c, m, pb.data());
    sm::exp2_inplace(q.data(), n, c, m);
    double ref_sum = 0;
    for (std::size_t j = 0; j < n; ++j) {
      const float e = sm::exp2_nonpos(std::fma(s[j], c, -m));
      bad += fbits(p[j]) != fbits(e) || pb[j] != sm::f32_to_bf16_bits(e) || fbits(q[j]) != fbits(e);
      ref_sum += e;
    }
    bad += p[n] != -1.0f || pb[n] != 0xAAAA || q[n] != s[n];  // nothing past n
    bad += fbits(sum) != fbits(sumb);
    bad += std::fabs(sum - ref_sum) > double(n) * u * ref_sum;  // any order of n f32 additions
    // exp2_inplace with m = -inf: zeros
    q = s;
    sm::exp2_inplace(q.data(), n, c, -INFINITY);
    for (std::size_t j = 0; j < n; ++j) bad += q[j] != 0.0f;
    // exp2_cols with a per-column shift (+inf gives 0)
    std::vector<float> mc(n), pc(n);
    for (std::size_t j = 0; j < n; ++j) mc[j] = j % 5 == 4 ? INFINITY : s[j] * c + float(j % 3);
    sm::exp2_cols(s.data(), mc.data(), n, c, pc.data());
    for (std::size_t j = 0; j < n; ++j) bad += fbits(pc[j]) != fbits(sm::exp2_nonpos(std::fma(s[j], c, -mc[j])));
    // exp2_row shifted by t: exp2((s - t)·c - m)
    const float t = n ? mx : 0.0f;
    const float sum_t = sm::exp2_row(s.data(), n, c, 0.25f, p.data(), t);
    double ref_t = 0;
    for (std::size_t j = 0; j < n; ++j) {
      const float e = sm::exp2_nonpos(std::fma(s[j] - t, c, -0.25f));
      bad += fbits(p[j]) != fbits(e);
      ref_t += e;
    }
    bad += std::fabs(sum_t - ref_t) > double(n) * u * ref_t;
    // scale_row, dot_row, softmax_grad_row, softmax_grad_cols
    std::vector<float> o = y;
    sm::scale_row(o.data(), n, 0.7f);
    for (std::size_t j = 0; j < n; ++j) bad += fbits(o[j]) != fbits(y[j] * 0.7f);
    double dref = 0, dabs = 0;
    for (std::size_t j = 0; j < n; ++j) {
      dref += double(s[j]) * y[j];
      dabs += std::fabs(double(s[j]) * y[j]);
    }
    bad += std::fabs(sm::dot_row(s.data(), y.data(), n) - dref) > double(n + 1) * u * dabs;
    std::vector<float> dp = y, dpc = y, delta(n);
    for (std::size_t j = 0; j < n; ++j) delta[j] = s[j] * 0.5f;
    sm::softmax_grad_row(p.data(), dp.data(), n, 0.25f, 1.5f);
    sm::softmax_grad_cols(p.data(), dpc.data(), delta.data(), n);
    for (std::size_t j = 0; j < n; ++j) {
      bad += fbits(dp[j]) != fbits(p[j] * (y[j] - 0.25f) * 1.5f);
      bad += fbits(dpc[j]) != fbits(p[j] * (y[j] - delta[j]));
    }
    INFO("n " << n);
    REQUIRE(bad == 0);
  }
}

TEST_CASE("online_row and online_step32_bf16: one step equals the two-pass definition", "[arch][softmax]") {
  std::mt19937 g(93);
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t n = trial < 40 ? std::size_t(trial + 1) : 1 + g() % 200;
    const auto s = random_scores(n, g);
    const float c = 0.5f;
    const float m0 = trial % 3 == 0 ? -INFINITY : std::normal_distribution<float>(0.0f, 2.0f)(g), l0 = trial % 3 == 0 ? 0.0f : 3.0f;
    float m = m0, l = l0;
    std::vector<float> p(n);
    const float alpha = sm::online_row(s.data(), n, c, m, l, p.data());
    const float t = sm::row_max(s.data(), n), mn = std::max(m0, t * c);
    REQUIRE(fbits(m) == fbits(mn));
    REQUIRE(fbits(alpha) == fbits(mn == m0 ? 1.0f : sm::exp2_nonpos(m0 - mn)));
    double sum = 0;
    std::size_t bad = 0;
    for (std::size_t j = 0; j < n; ++j) {
      const float e = std::fabs(mn) < sm::online_exact_max ? sm::exp2_nonpos(std::fma(s[j], c, -mn))
                                                           : sm::exp2_nonpos(std::fma(s[j] - t, c, t * c - mn));  // from the block's max t
      bad += fbits(p[j]) != fbits(e);
      sum += e;
    }
    REQUIRE(bad == 0);
    REQUIRE(std::fabs(l - (double(l0) * alpha + sum)) <= double(n + 2) * u * (double(l0) * alpha + sum));
    // bf16 output: the same probabilities, rounded once
    float mb = m0, lb = l0;
    std::vector<std::uint16_t> pb(n);
    REQUIRE(fbits(sm::online_row(s.data(), n, c, mb, lb, pb.data())) == fbits(alpha));
    REQUIRE(fbits(mb) == fbits(m));
    REQUIRE(fbits(lb) == fbits(l));
    for (std::size_t j = 0; j < n; ++j) bad += pb[j] != sm::f32_to_bf16_bits(p[j]);
    REQUIRE(bad == 0);
    if (n == 32) {
      float m32 = m0, l32 = l0;
      std::vector<std::uint16_t> p32(32);
      const float a32 = sm::online_step32_bf16(s.data(), c, m32, l32, p32.data());
      REQUIRE(fbits(a32) == fbits(alpha));
      REQUIRE(fbits(m32) == fbits(m));
      REQUIRE(std::fabs(l32 - l) <= 34 * u * l);
      for (std::size_t j = 0; j < 32; ++j) bad += p32[j] != pb[j];
      REQUIRE(bad == 0);
    }
  }
}

TEST_CASE("online softmax keeps the max key's weight and the row's log-sum-exp at any score magnitude", "[arch][softmax]") {
  // s·c - m as one fma is off by m's rounding, half an ulp of m, alike for the whole row: the max
  // key weighs 2^shift. Past 2^31 in log2 units that shift overflowed exp2 (a row of Inf and NaN)
  // or flushed the row to 0 (taken for a masked row); past online_exact_max the weight is 1.
  std::mt19937 g(95);
  for (float mag : {1.0f, 1e3f, 1e7f, 1e9f, 1e11f, 1e13f, 1e30f}) {
    for (int trial = 0; trial < 50; ++trial) {
      const std::size_t n = 1 + g() % 80;
      auto s = random_scores(n, g);
      for (float& x : s) x *= mag;
      const float c = 1.4426950f * 0.125f;
      float m = -INFINITY, l = 0.0f, mb = -INFINITY, lb = 0.0f;
      std::vector<float> p(n);
      std::vector<std::uint16_t> pb(n);
      (void)sm::online_row(s.data(), n, c, m, l, p.data());
      (void)sm::online_row(s.data(), n, c, mb, lb, pb.data());
      const std::size_t jmax = std::size_t(std::max_element(s.begin(), s.end()) - s.begin());
      const double half_ulp = std::ldexp(1.0, std::ilogb(m) - 24);  // of m, in log2 units
      INFO("magnitude " << mag << " n " << n << " p_max " << p[jmax] << " m " << m);
      if (std::fabs(m) >= sm::online_exact_max)
        REQUIRE(p[jmax] == 1.0f);
      else
        REQUIRE(std::fabs(std::log2(double(p[jmax]))) <= half_ulp + 4 * u);
      REQUIRE(pb[jmax] == sm::f32_to_bf16_bits(p[jmax]));
      REQUIRE(std::isfinite(l));
      REQUIRE(l >= p[jmax]);
      for (float x : p) REQUIRE((x >= 0.0f && x <= p[jmax]));
      // the row's log-sum-exp (log2 units), m + log2 l, within m's rounding of fp64's
      double mx = -INFINITY, sum = 0;
      for (float x : s) mx = std::max(mx, double(x) * c);
      for (float x : s) sum += std::exp2(double(x) * c - mx);
      REQUIRE(std::fabs(double(m) + std::log2(double(l)) - (mx + std::log2(sum))) <= 2 * half_ulp + double(n + 4) * u + 4 * u * std::fabs(mx));
      if (n >= 32) {  // decode's 32-key step takes its exponents from the block's max at any magnitude
        float m32 = -INFINITY, l32 = 0.0f;
        std::vector<std::uint16_t> p32(32);
        (void)sm::online_step32_bf16(s.data(), c, m32, l32, p32.data());
        const std::size_t j32 = std::size_t(std::max_element(s.begin(), s.begin() + 32) - s.begin());
        REQUIRE(p32[j32] == sm::f32_to_bf16_bits(1.0f));
        REQUIRE((std::isfinite(l32) && l32 >= 1.0f));
      }
    }
  }
}

TEST_CASE("an online softmax over random blocks of a row matches fp64 softmax within its rounding bound", "[arch][softmax]") {
  std::mt19937 g(94);
  double worst = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const std::size_t n = 1 + g() % 700;
    const auto s = random_scores(n, g, trial % 2 ? 1.0f : 8.0f), v = random_scores(n, g, 1.0f);
    const float c = 1.4426950f * 0.125f;  // log2(e) / sqrt(64): attention's scale in log2 units
    float m = -INFINITY, l = 0.0f, o = 0.0f;
    std::vector<float> p(n);
    for (std::size_t b = 0; b < n;) {
      const std::size_t len = std::min<std::size_t>(n - b, 1 + g() % 100);
      const float alpha = sm::online_row(s.data() + b, len, c, m, l, p.data());
      o = o * alpha + sm::dot_row(p.data(), v.data() + b, len);
      b += len;
    }
    // fp64 reference
    double mx = -INFINITY;
    for (float x : s) mx = std::max(mx, double(x) * c);
    double den = 0, num = 0, absnum = 0, xmax = 0;
    for (std::size_t j = 0; j < n; ++j) {
      const double e = std::exp2(double(s[j]) * c - mx);
      den += e;
      num += e * v[j];
      absnum += e * std::fabs(v[j]);
      xmax = std::max(xmax, mx - double(s[j]) * c);
    }
    const double bound = (0.7 * u * xmax + 8 * u + 2 * double(n) * u) * absnum / den;
    const double err = std::fabs(double(o) / l - num / den);
    worst = std::max(worst, err / bound);
    INFO("n " << n << " err " << err << " bound " << bound);
    REQUIRE(err <= bound);
  }
  INFO("worst error / bound " << worst);
  SUCCEED();
}
