// arch/stream.hpp: lane helpers equal their scalar twins bit for bit, bf16 RNE lanes equal
// tessel::bf16 (NaN payloads, ties, subnormals), exp_fast is within 2 ulp of exp with exact
// specials, stochastic rounding only reaches the two neighbours.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <tessel/arch/stream.hpp>
#include <tessel/types/bf16.hpp>

namespace st = tessel::arch::stream;

namespace {
std::vector<float> interesting() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          std::bit_cast<float>(0x7F800001u),
                          std::bit_cast<float>(0xFFC12345u),
                          std::bit_cast<float>(0x7F7FFFFFu),
                          std::bit_cast<float>(0x00000001u),
                          std::bit_cast<float>(0x3F808000u),
                          std::bit_cast<float>(0x3F818000u),
                          std::bit_cast<float>(0x3F808001u),
                          -200.0f,
                          100.0f,
                          88.7f,
                          -103.9f,
                          -87.5f};
  std::mt19937 rng(1);
  for (int i = 0; i < 100000; ++i) v.push_back(std::bit_cast<float>(std::uint32_t(rng())));
  while (v.size() % st::width) v.push_back(0.5f);
  return v;
}
}  // namespace

TEST_CASE("bf16 lanes equal tessel::bf16 and the scalar twin", "[arch][stream]") {
  const auto v = interesting();
  std::vector<std::uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); i += st::width) st::store_bf16(st::load(v.data() + i), out.data() + i);
  // the non-temporal form, and vectors of normal values with a single NaN or subnormal lane (the
  // hardware conversion handles clean vectors; the others must take the exact path)
  std::vector<std::uint16_t> out_nt(v.size());
  alignas(64) std::uint16_t one[st::width];
  std::size_t bad_mixed = 0;
  for (std::size_t i = 0; i < v.size(); i += st::width) st::store_bf16(st::load(v.data() + i), out_nt.data() + i, true);
  for (float odd : {std::bit_cast<float>(0x00000001u), std::bit_cast<float>(0x807FFFFFu), std::bit_cast<float>(0x7F800001u),
                    std::bit_cast<float>(0xFFC12345u), std::bit_cast<float>(0x00408000u)}) {
    for (std::size_t lane = 0; lane < st::width; ++lane) {
      alignas(64) float f[st::width];
      for (std::size_t k = 0; k < st::width; ++k) f[k] = 1.0f + float(k) / 128.0f;
      f[lane] = odd;
      st::store_bf16(st::vf::load_aligned(f), one, true);
      for (std::size_t k = 0; k < st::width; ++k) bad_mixed += one[k] != tessel::bf16(f[k]).bits();
    }
  }
  st::nt_fence();
  CHECK(bad_mixed == 0);
  CHECK(out_nt == out);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < v.size(); ++i) {
    bad += out[i] != tessel::bf16(v[i]).bits();
    bad += st::f32_to_bf16_bits(v[i]) != tessel::bf16(v[i]).bits();
    bad += std::bit_cast<std::uint32_t>(st::bf16_bits_to_f32(out[i])) != (std::uint32_t(out[i]) << 16);
  }
  CHECK(bad == 0);
  // load_bf16 of every code
  std::vector<std::uint16_t> codes(65536);
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = std::uint16_t(i);
  std::size_t bad_load = 0;
  for (std::size_t i = 0; i < codes.size(); i += st::width) {
    alignas(64) float f[st::width];
    st::load_bf16(codes.data() + i).store_aligned(f);
    for (std::size_t k = 0; k < st::width; ++k) bad_load += std::bit_cast<std::uint32_t>(f[k]) != (std::uint32_t(i + k) << 16);
  }
  CHECK(bad_load == 0);
}

TEST_CASE("exp_fast: within 2 ulp, exact specials, lanes == scalar", "[arch][stream]") {
  const auto v = interesting();
  std::size_t mismatch = 0, bad = 0;
  for (std::size_t i = 0; i < v.size(); i += st::width) {
    alignas(64) float y[st::width];
    st::exp_fast(st::load(v.data() + i)).store_aligned(y);
    for (std::size_t k = 0; k < st::width; ++k) {
      const float x = v[i + k], s = st::exp_fast(x);
      if (std::memcmp(&s, &y[k], 4) != 0 && !(std::isnan(s) && std::isnan(y[k]))) ++mismatch;
      if (std::isnan(x)) {
        bad += !std::isnan(s);
        continue;
      }
      const double e = std::exp(double(x));
      const float ef = float(e);
      if (std::isinf(ef) || ef == 0.0f || std::fpclassify(ef) == FP_SUBNORMAL) {
        bad += std::fabs(double(s) - e) > 1.5e-45 && s != ef;
        continue;
      }
      const double ulp = double(std::nextafter(ef, INFINITY)) - double(ef);
      bad += std::fabs(double(s) - e) > 2.0 * ulp;
    }
  }
  CHECK(mismatch == 0);
  CHECK(bad == 0);
  CHECK(st::exp_fast(-std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(std::isinf(st::exp_fast(std::numeric_limits<float>::infinity())));
}

TEST_CASE("stochastic rounding reaches only the two neighbours and random bits are positional", "[arch][stream]") {
  const auto v = interesting();
  std::size_t bad = 0;
  for (std::size_t i = 0; i < v.size(); i += st::width) {
    alignas(64) std::uint32_t lanes[st::width];
    st::bf16_sr_lanes(st::load(v.data() + i), st::random_bits_v(77, std::uint32_t(i))).store_aligned(lanes);
    for (std::size_t k = 0; k < st::width; ++k) {
      const float x = v[i + k];
      const std::uint16_t s = st::f32_to_bf16_bits_sr(x, st::random_bits(77, std::uint32_t(i + k)));
      bad += s != lanes[k];
      if (!std::isfinite(x)) {
        bad += s != tessel::bf16(x).bits();
        continue;
      }
      const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
      bad += s != (u >> 16) && s != ((u >> 16) + 1);
    }
  }
  CHECK(bad == 0);
}

TEST_CASE("max/min lanes equal the scalar twins bit for bit (NaN, signed zeros)", "[arch][stream]") {
  const auto v = interesting();
  std::vector<float> w(v.rbegin(), v.rend());  // pairs every value with another one, NaN and zeros included
  std::size_t bad = 0;
  for (std::size_t i = 0; i < v.size(); i += st::width) {
    alignas(64) float mx[st::width], mn[st::width];
    st::max(st::load(v.data() + i), st::load(w.data() + i)).store_aligned(mx);
    st::min(st::load(v.data() + i), st::load(w.data() + i)).store_aligned(mn);
    for (std::size_t k = 0; k < st::width; ++k) {
      bad += std::bit_cast<std::uint32_t>(mx[k]) != std::bit_cast<std::uint32_t>(st::max(v[i + k], w[i + k]));
      bad += std::bit_cast<std::uint32_t>(mn[k]) != std::bit_cast<std::uint32_t>(st::min(v[i + k], w[i + k]));
    }
  }
  for (float a : {0.0f, -0.0f})
    for (float b : {0.0f, -0.0f, std::numeric_limits<float>::quiet_NaN()}) {
      alignas(64) float mx[st::width];
      st::max(st::vf(a), st::vf(b)).store_aligned(mx);
      bad += std::bit_cast<std::uint32_t>(mx[0]) != std::bit_cast<std::uint32_t>(st::max(a, b));
      st::max(st::vf(b), st::vf(a)).store_aligned(mx);
      bad += std::bit_cast<std::uint32_t>(mx[0]) != std::bit_cast<std::uint32_t>(st::max(b, a));
    }
  CHECK(bad == 0);
}
