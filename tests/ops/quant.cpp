// Bulk conversion (tessel/ops/quant.hpp): every bf16 code round-trips, f32 -> bf16/fp16/e4m3 agree
// bitwise with the scalar RNE conversions of types/ (specials and subnormals included), scales
// apply before rounding, mismatched sizes are errors. Block quantisation to e4m3 (DeepSeek-V3's 1x128
// and 128x128 blocks) gives the scalar definition's bits, any source layout, and typed errors.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/quant.hpp>
#include <tessel/tile/tensor.hpp>

#include "error_match.hpp"
#include "reference/train_ref.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_ops_quant {

using namespace tessel;

TEST_CASE("convert agrees with the scalar conversions for every bf16 code and random floats", "[ops][quant]") {
  host_device dev(2);
  std::vector<bf16> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = std::bit_cast<bf16>(std::uint16_t(i));
  std::vector<float> wide(all.size());
  convert(dev, std::span<const bf16>(all), std::span<float>(wide));
  std::vector<bf16> back(all.size());
  convert(dev, std::span<const float>(wide), std::span<bf16>(back));
  for (std::size_t i = 0; i < all.size(); ++i) {
    REQUIRE(std::bit_cast<std::uint32_t>(wide[i]) == std::uint32_t(i) << 16);
    if (!std::isnan(wide[i]))
      REQUIRE(back[i].bits() == all[i].bits());
    else
      REQUIRE(std::isnan(float(back[i])));
  }
  auto x = train_ref::randn(100003, 5, 300.0f);
  x[0] = std::numeric_limits<float>::denorm_min();
  x[1] = -std::numeric_limits<float>::infinity();
  x[2] = 1.00390625f;  // a bf16 tie: rounds to even
  std::vector<bf16> h(x.size());
  std::vector<fp16> f(x.size());
  std::vector<e4m3> q(x.size());
  convert(dev, std::span<const float>(x), std::span<bf16>(h));
  convert(dev, std::span<const float>(x), std::span<fp16>(f));
  convert(dev, std::span<const float>(x), std::span<e4m3>(q), 0.5f);
  for (std::size_t i = 0; i < x.size(); ++i) {
    REQUIRE(h[i].bits() == bf16(x[i]).bits());
    REQUIRE(f[i].bits() == fp16(x[i]).bits());
    const e4m3 want(x[i] * 0.5f);
    REQUIRE((q[i].bits() == want.bits() || (std::isnan(float(q[i])) && std::isnan(float(want)))));
  }
  std::vector<float> scaled(x.size());
  convert(dev, std::span<const float>(x), std::span<float>(scaled), 3.0f);
  for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(std::bit_cast<std::uint32_t>(scaled[i]) == std::bit_cast<std::uint32_t>(x[i] * 3.0f));
}

TEST_CASE("convert reports the largest magnitude it read, Inf and NaN included", "[ops][quant]") {
  host_device dev(2);
  auto x = train_ref::randn(200001, 9, 2.0f);  // four chunks
  x[150000] = -70000.0f;                       // past fp16's range
  std::vector<fp16> f(x.size());
  float amax = -1.0f;
  convert(dev, std::span<const float>(x), std::span<fp16>(f), 1.0f, &amax);
  float want = 0.0f;
  for (float v : x) want = std::max(want, std::fabs(v));
  REQUIRE(amax == want);
  REQUIRE(amax == 70000.0f);
  REQUIRE(std::isinf(float(f[150000])));  // the conversion itself is unchanged by the report
  convert(dev, std::span<const float>(x), std::span<fp16>(f), 0.5f, &amax);
  REQUIRE(amax == 35000.0f);  // of the scaled values
  std::vector<bf16> h(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) h[i] = bf16(x[i]);
  convert(dev, std::span<const bf16>(h), std::span<fp16>(f), 1.0f, &amax);
  float want_h = 0.0f;
  for (bf16 v : h) want_h = std::max(want_h, std::fabs(float(v)));
  REQUIRE(amax == want_h);
  x[7] = std::numeric_limits<float>::infinity();
  convert(dev, std::span<const float>(x), std::span<fp16>(f), 1.0f, &amax);
  REQUIRE(std::isinf(amax));
  x[190000] = std::numeric_limits<float>::quiet_NaN();  // NaN outranks Inf, in another chunk
  convert(dev, std::span<const float>(x), std::span<fp16>(f), 1.0f, &amax);
  REQUIRE(std::isnan(amax));
  convert(dev, std::span<const float>(x.data(), 0), std::span<fp16>(f.data(), 0), 1.0f, &amax);
  REQUIRE(amax == 0.0f);
  std::vector<float> same(x.begin(), x.begin() + 4);
  convert(dev, std::span<const float>(same), std::span<float>(same), 1.0f, &amax);  // in place: still reports
  REQUIRE(amax == std::max({std::fabs(same[0]), std::fabs(same[1]), std::fabs(same[2]), std::fabs(same[3])}));
}

TEST_CASE("convert rejects mismatched sizes and null buffers", "[ops][quant]") {
  host_device dev(1);
  std::vector<float> a(4);
  std::vector<bf16> b(3);
  CHECK_THROWS_MATCHES(convert(dev, std::span<const float>(a), std::span<bf16>(b)), layer_error,
                       tessel_test::is_error(errc::invalid_argument, "layers", "source has 4 elements, destination 3"));
  CHECK_THROWS_AS(convert(dev, std::span<const float>(static_cast<const float*>(nullptr), 2), std::span<float>(a.data(), 2)), layer_error);
  convert(dev, std::span<const float>(a), std::span<float>(a));  // the same storage: nothing to do
}

namespace {

// The definition, one element at a time: block (i, j) of (br x 128) has scale amax / 448 (1 when
// the block is all zeros), and each element is e4m3(clamp(x / scale, ±448)).
struct ref_quantized {
  std::vector<e4m3> q;
  std::vector<float> scales;
  float amax = 0;
};
ref_quantized ref_quantize(const std::vector<float>& x, std::size_t R, std::size_t C, bool transposed_src, std::size_t br) {
  auto at = [&](std::size_t r, std::size_t c) { return transposed_src ? x[c * R + r] : x[r * C + c]; };
  const std::size_t bi = (R + br - 1) / br, bj = (C + 127) / 128;
  ref_quantized o{std::vector<e4m3>(R * C), std::vector<float>(bi * bj), 0.0f};
  for (std::size_t i = 0; i < bi; ++i)
    for (std::size_t j = 0; j < bj; ++j) {
      float am = 0;
      for (std::size_t r = i * br; r < std::min(R, (i + 1) * br); ++r)
        for (std::size_t c = j * 128; c < std::min(C, (j + 1) * 128); ++c) am = std::max(am, std::fabs(at(r, c)));
      const float s = am > 0 ? am / 448.0f : 1.0f;
      o.scales[i * bj + j] = s;
      o.amax = std::max(o.amax, am);
      for (std::size_t r = i * br; r < std::min(R, (i + 1) * br); ++r)
        for (std::size_t c = j * 128; c < std::min(C, (j + 1) * 128); ++c) o.q[r * C + c] = e4m3(std::clamp(at(r, c) / s, -448.0f, 448.0f));
    }
  return o;
}

}  // namespace

TEST_CASE("quantize_e4m3 gives the definition's bits for 1x128 and 128x128 blocks, any source layout", "[ops][quant][fp8]") {
  host_device dev(2);
  for (std::size_t br : {1, 128})
    for (bool transposed : {false, true})
      for (auto [R, C] : {std::pair<std::size_t, std::size_t>{1, 1}, {3, 128}, {129, 300}, {300, 129}, {256, 1024}, {700, 7}})
        for (bool scales_t : {false, true}) {
          auto x = train_ref::randn(R * C, R + 3 * C + br, 2.0f);
          // outliers, exact zeros, a zero block and values that fall into e4m3's subnormals
          for (std::size_t i = 0; i < x.size(); i += 37) x[i] *= 1000.0f;
          for (std::size_t i = 5; i < x.size(); i += 11) x[i] = 0.0f;
          for (std::size_t i = 7; i < x.size(); i += 13) x[i] *= 1e-5f;
          if (R * C >= 300 && !transposed)
            for (std::size_t c = 0; c < std::min<std::size_t>(C, 128); ++c) x[c] = 0.0f;  // with br = 1: row 0's first block is zero
          const auto src = transposed ? tensor<const float, 2>::strided(x.data(), R, C, 1, R) : tensor<const float, 2>(x.data(), R, C, C);
          const auto want = ref_quantize(x, R, C, transposed, br);
          const std::size_t bi = (R + br - 1) / br, bj = (C + 127) / 128;
          std::vector<e4m3> q(R * C);
          std::vector<float> s(bi * bj);
          float amax = -1;
          quantize_e4m3(dev, src, tensor<e4m3, 2>(q.data(), R, C, C), std::span<float>(s),
                        {.block_rows = br, .scales_transposed = scales_t, .amax = &amax});
          INFO("block rows " << br << ", " << R << "x" << C << (transposed ? " transposed" : "") << (scales_t ? ", scales transposed" : ""));
          REQUIRE(amax == want.amax);
          for (std::size_t i = 0; i < bi; ++i)
            for (std::size_t j = 0; j < bj; ++j) REQUIRE(s[scales_t ? j * bi + i : i * bj + j] == want.scales[i * bj + j]);
          for (std::size_t r = 0; r < R; ++r)
            for (std::size_t c = 0; c < C; ++c) {
              REQUIRE(q[r * C + c].bits() == want.q[r * C + c].bits());
              // and what it means: dequantised, each element is within half an e4m3 step of x
              // (2^-4 relative for normals; the subnormal spacing 2^-9 times the scale below them)
              const float xv = transposed ? x[c * R + r] : x[r * C + c], sc = want.scales[(r / br) * bj + c / 128];
              REQUIRE(std::fabs(double(float(q[r * C + c])) * sc - xv) <=
                      std::ldexp(std::fabs(double(xv)), -4) + std::ldexp(double(sc), -10) * 1.0001);
            }
        }
}

TEST_CASE("quantize_e4m3 rejects bad block shapes, scale counts, layouts and non-finite input", "[ops][quant][fp8][errors]") {
  host_device dev(1);
  std::vector<float> x(4 * 200, 1.0f);
  std::vector<e4m3> q(x.size());
  std::vector<float> s(8);
  const tensor<const float, 2> src(x.data(), 4, 200, 200);
  const tensor<e4m3, 2> dst(q.data(), 4, 200, 200);
  using tessel_test::is_error;
  CHECK_THROWS_MATCHES(quantize_e4m3(dev, src, dst, std::span<float>(s), {.block_rows = 64}), layer_error,
                       is_error(errc::invalid_argument, "layers", "block_rows must be 1 or 128"));
  CHECK_THROWS_MATCHES(quantize_e4m3(dev, src, dst, std::span<float>(s.data(), 7)), layer_error,
                       is_error(errc::invalid_argument, "layers", "7 scales for 4x2 blocks"));
  CHECK_THROWS_MATCHES(quantize_e4m3(dev, src, tensor<e4m3, 2>(q.data(), 4, 100, 200), std::span<float>(s)), layer_error,
                       is_error(errc::invalid_argument, "layers", "destination shape differs"));
  CHECK_THROWS_MATCHES(quantize_e4m3(dev, src, tensor<e4m3, 2>::strided(q.data(), 4, 200, 1, 4), std::span<float>(s)), layer_error,
                       is_error(errc::invalid_argument, "layers", "row-major"));
  x[333] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_MATCHES(quantize_e4m3(dev, src, dst, std::span<float>(s)), layer_error, is_error(errc::invalid_argument, "layers", "Inf or NaN"));
  x[333] = -std::numeric_limits<float>::infinity();
  CHECK_THROWS_MATCHES(quantize_e4m3(dev, src, dst, std::span<float>(s)), layer_error, is_error(errc::invalid_argument, "layers", "Inf or NaN"));
  // an empty matrix has no blocks and amax 0
  float amax = 5;
  quantize_e4m3(dev, tensor<const float, 2>(x.data(), 0, 200, 200), tensor<e4m3, 2>(q.data(), 0, 200, 200), std::span<float>{}, {.amax = &amax});
  CHECK(amax == 0.0f);
}

}  // namespace tessel_test_ops_quant
