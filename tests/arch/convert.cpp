// The vector conversion kernels against the scalar codec (types/detail/codec.hpp), bit for bit:
// decode of every code (all 65536 bf16/fp16 codes, all 256 e4m3/e5m2 codes) at every start offset
// (vector body and scalar tail); encode in both overflow modes over every value that decides a
// rounding (every code's value, every midpoint between neighbouring codes, one float ulp either
// side of each, the overflow threshold, NaN payloads, Inf) plus random bit patterns; scaled
// quantize/dequantize; the NaN-proof amax; block-scaled quantization. The all-2^32-floats sweeps of
// the same kernels (through tessel::convert) are in tests/types/convert_exhaustive.cpp.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <tessel/arch/convert.hpp>

using namespace tessel;
using tessel::detail::bf16_format;
using tessel::detail::e4m3_format;
using tessel::detail::e5m2_format;
using tessel::detail::fp16_format;

namespace {
std::uint32_t fbits(float x) { return std::bit_cast<std::uint32_t>(x); }

template <class Fmt>
constexpr std::uint32_t code_count = 1u << Fmt::total_bits;

template <class Fmt>
float decoded(std::uint32_t c) {
  return tessel::detail::decode<Fmt, float>(static_cast<typename Fmt::storage>(c));
}

// Every float at which encoding to Fmt changes its mind: each code's value, the midpoints between
// neighbouring magnitudes (ties: RNE), one ulp either side of each, above max, NaN payloads, Inf.
template <class Fmt>
std::vector<float> deciding_values() {
  std::vector<float> v;
  const std::uint32_t mags = code_count<Fmt> / 2;
  std::vector<double> finite;
  for (std::uint32_t c = 0; c < mags; ++c) {
    const float f = decoded<Fmt>(c);
    if (std::isfinite(f)) finite.push_back(double(f));
  }
  auto push = [&](float f) {
    for (float x : {f, std::nextafter(f, 0.0f), std::nextafter(f, INFINITY)}) {
      v.push_back(x);
      v.push_back(-x);
    }
  };
  for (std::size_t i = 0; i < finite.size(); ++i) {
    push(float(finite[i]));
    const double next = i + 1 < finite.size() ? finite[i + 1] : 2 * finite[i] - finite[i - 1];  // one step past max
    push(float((finite[i] + next) / 2));                                                        // exact in float: narrow values have few bits
  }
  for (float f : {INFINITY, std::numeric_limits<float>::max(), std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min(),
                  std::bit_cast<float>(0x7FC00000u), std::bit_cast<float>(0x7F800001u), std::bit_cast<float>(0x7FBFFFFFu),
                  std::bit_cast<float>(0x7FFFFFFFu), std::bit_cast<float>(0x7F812345u)}) {
    v.push_back(f);
    v.push_back(-f);
  }
  std::mt19937 g(71);
  for (int i = 0; i < 20000; ++i) v.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(g())));
  return v;
}

// arch::encode_f32 over v, run from several start offsets so every element meets both the vector
// body and the scalar tail; counts codes differing from the scalar encode.
template <class Fmt, overflow Ov>
std::size_t encode_mismatches(const std::vector<float>& v) {
  using St = typename Fmt::storage;
  std::vector<St> out(v.size());
  std::size_t bad = 0;
  for (std::size_t off : {0, 1, 3, 7, 15, 16, 17}) {
    if (off > v.size()) break;
    const std::size_t n = v.size() - off;
    arch::encode_f32<Fmt, Ov>(v.data() + off, out.data(), n);
    for (std::size_t i = 0; i < n; ++i) bad += out[i] != tessel::detail::encode<Fmt, Ov>(v[off + i]);
  }
  // short runs: the tail alone
  for (std::size_t n = 0; n < 40 && n <= v.size(); ++n) {
    arch::encode_f32<Fmt, Ov>(v.data() + 100, out.data(), n);
    for (std::size_t i = 0; i < n; ++i) bad += out[i] != tessel::detail::encode<Fmt, Ov>(v[100 + i]);
  }
  return bad;
}

template <class Fmt>
void check_decode_all_codes() {
  using St = typename Fmt::storage;
  std::vector<St> codes(code_count<Fmt> + 40);
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<St>(i);
  std::vector<float> out(codes.size());
  std::size_t bad = 0;
  for (std::size_t off = 0; off < 33; ++off) {
    const std::size_t n = code_count<Fmt> + (off % 5);  // every code, ragged tails
    arch::decode_f32<Fmt>(codes.data() + off, out.data(), n);
    for (std::size_t i = 0; i < n; ++i) bad += fbits(out[i]) != fbits(decoded<Fmt>(codes[off + i]));
    arch::dequantize_f32<Fmt>(codes.data() + off, out.data(), n, 0.375f);
    for (std::size_t i = 0; i < n; ++i) bad += fbits(out[i]) != fbits(decoded<Fmt>(codes[off + i]) * 0.375f);
  }
  CHECK(bad == 0);
}
}  // namespace

TEST_CASE("decode_f32 and dequantize_f32 equal the scalar decode for every code at every offset", "[arch][convert]") {
  check_decode_all_codes<bf16_format>();
  check_decode_all_codes<fp16_format>();
  check_decode_all_codes<e4m3_format>();
  check_decode_all_codes<e5m2_format>();
}

TEST_CASE("encode_f32 equals the scalar encode on every rounding boundary, both overflow modes", "[arch][convert]") {
  const auto b = deciding_values<bf16_format>();
  const auto h = deciding_values<fp16_format>();
  const auto e4 = deciding_values<e4m3_format>();
  const auto e5 = deciding_values<e5m2_format>();
  CHECK(encode_mismatches<bf16_format, overflow::propagate>(b) == 0);
  CHECK(encode_mismatches<bf16_format, overflow::saturate>(b) == 0);
  CHECK(encode_mismatches<fp16_format, overflow::propagate>(h) == 0);
  CHECK(encode_mismatches<fp16_format, overflow::saturate>(h) == 0);
  CHECK(encode_mismatches<e4m3_format, overflow::propagate>(e4) == 0);
  CHECK(encode_mismatches<e4m3_format, overflow::saturate>(e4) == 0);
  CHECK(encode_mismatches<e5m2_format, overflow::propagate>(e5) == 0);
  CHECK(encode_mismatches<e5m2_format, overflow::saturate>(e5) == 0);
}

TEST_CASE("encode then decode is the identity on every code's value (NaN as NaN)", "[arch][convert]") {
  auto round_trip = [](auto fmt_tag) {
    using Fmt = decltype(fmt_tag);
    using St = typename Fmt::storage;
    std::vector<float> vals(code_count<Fmt>);
    for (std::uint32_t c = 0; c < code_count<Fmt>; ++c) vals[c] = decoded<Fmt>(c);
    std::vector<St> codes(vals.size());
    arch::encode_f32<Fmt, overflow::propagate>(vals.data(), codes.data(), vals.size());
    std::size_t bad = 0;
    for (std::uint32_t c = 0; c < code_count<Fmt>; ++c) bad += std::isnan(vals[c]) ? !std::isnan(decoded<Fmt>(codes[c])) : codes[c] != c;
    return bad;
  };
  CHECK(round_trip(bf16_format{}) == 0);
  CHECK(round_trip(fp16_format{}) == 0);
  CHECK(round_trip(e4m3_format{}) == 0);
  CHECK(round_trip(e5m2_format{}) == 0);
}

TEST_CASE("quantize_f32 is encode(x / scale) for every lane", "[arch][convert]") {
  std::mt19937 g(72);
  std::vector<float> x(5000);
  for (auto& v : x) v = g() % 4 == 0 ? std::bit_cast<float>(static_cast<std::uint32_t>(g())) : std::normal_distribution<float>(0.0f, 300.0f)(g);
  std::vector<std::uint8_t> q(x.size());
  std::vector<std::uint16_t> q16(x.size());
  std::size_t bad = 0;
  for (float scale : {1.0f, 0.37f, 3.0f, 1e-3f, 1e4f}) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{17}, x.size()}) {
      arch::quantize_f32<e4m3_format, overflow::saturate>(x.data(), q.data(), n, scale);
      for (std::size_t i = 0; i < n; ++i) bad += q[i] != tessel::detail::encode<e4m3_format, overflow::saturate>(x[i] / scale);
      arch::quantize_f32<e5m2_format, overflow::propagate>(x.data(), q.data(), n, scale);
      for (std::size_t i = 0; i < n; ++i) bad += q[i] != tessel::detail::encode<e5m2_format, overflow::propagate>(x[i] / scale);
      arch::quantize_f32<fp16_format, overflow::saturate>(x.data(), q16.data(), n, scale);
      for (std::size_t i = 0; i < n; ++i) bad += q16[i] != tessel::detail::encode<fp16_format, overflow::saturate>(x[i] / scale);
      arch::quantize_f32<bf16_format, overflow::propagate>(x.data(), q16.data(), n, scale);
      for (std::size_t i = 0; i < n; ++i) bad += q16[i] != tessel::detail::encode<bf16_format, overflow::propagate>(x[i] / scale);
    }
  }
  REQUIRE(bad == 0);
}

TEST_CASE("amax_finite_f32 is the largest finite magnitude, ignoring NaN and Inf, at every length", "[arch][convert]") {
  std::mt19937 g(73);
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t n = trial < 70 ? std::size_t(trial) : 1 + g() % 3000;
    std::vector<float> x(n);
    for (auto& v : x) {
      switch (g() % 6) {
        case 0: v = std::numeric_limits<float>::quiet_NaN(); break;
        case 1: v = g() % 2 ? INFINITY : -INFINITY; break;
        case 2: v = std::bit_cast<float>(static_cast<std::uint32_t>(g())); break;  // incl. subnormals, NaN payloads
        default: v = std::normal_distribution<float>(0.0f, 10.0f)(g);
      }
    }
    float want = 0.0f;
    for (float v : x)
      if (std::isfinite(v)) want = std::max(want, std::fabs(v));
    INFO("n " << n);
    REQUIRE(fbits(arch::amax_finite_f32(x.data(), n)) == fbits(want));
  }
  REQUIRE(arch::amax_finite_f32(nullptr, 0) == 0.0f);
}

TEST_CASE("block-scaled quantize and dequantize equal per-block scalar loops", "[arch][convert]") {
  std::mt19937 g(74);
  std::vector<float> x(3 * 5000);
  for (auto& v : x) v = g() % 50 == 0 ? INFINITY : std::normal_distribution<float>(0.0f, 50.0f)(g) * float(1 + g() % 8);
  for (std::size_t block : {1, 3, 32, 128, 5000}) {
    const std::size_t n = x.size() / block * block, nb = n / block;
    std::vector<std::uint8_t> q(n);
    std::vector<float> scales(nb), back(n);
    const auto scale_of = [](float amax) { return amax > 0.0f ? amax / 448.0f : 1.0f; };
    arch::quantize_blocks_f32<e4m3_format, overflow::saturate>(x.data(), q.data(), scales.data(), n, block, scale_of);
    arch::dequantize_blocks_f32<e4m3_format>(q.data(), scales.data(), back.data(), n, block);
    std::size_t bad = 0;
    for (std::size_t b = 0; b < nb; ++b) {
      float amax = 0.0f;
      for (std::size_t i = 0; i < block; ++i)
        if (std::isfinite(x[b * block + i])) amax = std::max(amax, std::fabs(x[b * block + i]));
      bad += fbits(scales[b]) != fbits(scale_of(amax));
      for (std::size_t i = 0; i < block; ++i) {
        const std::size_t k = b * block + i;
        const auto want = tessel::detail::encode<e4m3_format, overflow::saturate>(x[k] / scales[b]);
        bad += q[k] != want;
        bad += fbits(back[k]) != fbits(decoded<e4m3_format>(want) * scales[b]);
      }
    }
    INFO("block " << block);
    REQUIRE(bad == 0);
  }
}
