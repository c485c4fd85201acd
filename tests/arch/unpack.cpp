// Widening decoders against the number types' own conversions over every code: to_f32 and
// to_bf16_bits for all 65536 bf16/fp16 codes and all 256 e4m3/e5m2 codes (exact; RNE where bf16
// cannot hold the value), the FP8 tables, widen for every (source, stage) pair at every start
// offset and length (vector body and tail), and interleave_u16's K-pairs (never writing past 2n).
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include <tessel/arch/unpack.hpp>

using namespace tessel;

namespace {
std::uint32_t fbits(float x) { return std::bit_cast<std::uint32_t>(x); }
bool same_f32(float a, float b) { return std::isnan(a) || std::isnan(b) ? std::isnan(a) && std::isnan(b) : fbits(a) == fbits(b); }
bool same_bf16(std::uint16_t a, std::uint16_t b) {
  const float fa = float(bf16::from_bits(a)), fb = float(bf16::from_bits(b));
  return std::isnan(fa) || std::isnan(fb) ? std::isnan(fa) && std::isnan(fb) : a == b;
}

// Every code of T (for float: a seeded sample incl. specials), as T values.
template <class T>
std::vector<T> every_code() {
  std::vector<T> v;
  if constexpr (std::is_same_v<T, float>) {
    std::mt19937 g(81);
    for (int i = 0; i < 70000; ++i) v.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(g())));
    for (float f : {0.0f, -0.0f, INFINITY, -INFINITY, 1.0f, 3.0e38f, 1e-45f}) v.push_back(f);
  } else {
    using St = typename T::storage_type;
    for (std::uint32_t c = 0; c < (1u << (8 * sizeof(St))); ++c) v.push_back(T::from_bits(static_cast<St>(c)));
  }
  return v;
}

template <class T>
void check_scalar_decoders() {
  std::size_t bad = 0;
  for (const T x : every_code<T>()) {
    const float f = static_cast<float>(x);
    bad += !same_f32(arch::to_f32(x), f);
    const std::uint16_t b = arch::to_bf16_bits(x);
    if constexpr (std::is_same_v<T, bf16>)
      bad += b != x.bits();  // identity
    else if constexpr (std::is_same_v<T, e4m3> || std::is_same_v<T, e5m2>)
      bad += !same_f32(float(bf16::from_bits(b)), f);  // exact
    else
      bad += b != bf16(f).bits();  // one RNE
  }
  CHECK(bad == 0);
}

template <class S, class D>
void check_widen() {
  const auto src = every_code<S>();
  std::vector<D> out(src.size() + 8);
  std::size_t bad = 0;
  auto want_ok = [&](S x, D y) {
    if constexpr (std::is_same_v<D, float>)
      return same_f32(y, arch::to_f32(x));
    else
      return same_bf16(y.bits(), arch::to_bf16_bits(x));
  };
  for (std::size_t off = 0; off < 34; off += (off < 3 ? 1 : 7)) {
    const std::size_t n = src.size() - off;
    arch::widen(src.data() + off, out.data(), n);
    for (std::size_t i = 0; i < n; ++i) bad += !want_ok(src[off + i], out[i]);
  }
  const std::size_t base = src.size() - 71;  // (FP8: 256 codes)
  for (std::size_t n = 0; n <= 70; ++n) {    // short runs: tails and one or two vectors
    for (auto& y : out) y = D(-5.0f);
    arch::widen(src.data() + base, out.data(), n);
    for (std::size_t i = 0; i < n; ++i) bad += !want_ok(src[base + i], out[i]);
    for (std::size_t i = n; i < n + 8; ++i) bad += float(out[i]) != -5.0f;  // nothing past n
  }
  INFO("widen " << typeid(S).name() << " -> " << typeid(D).name());
  CHECK(bad == 0);
}
}  // namespace

TEST_CASE("to_f32 and to_bf16_bits are exact (bf16 RNE where needed) for every code", "[arch][unpack]") {
  check_scalar_decoders<float>();
  check_scalar_decoders<bf16>();
  check_scalar_decoders<fp16>();
  check_scalar_decoders<e4m3>();
  check_scalar_decoders<e5m2>();
}

TEST_CASE("the FP8 tables hold every code's value, as f32 and as bf16", "[arch][unpack]") {
  auto check = [](auto tag) {
    using F8 = decltype(tag);
    std::size_t bad = 0;
    for (unsigned c = 0; c < 256; ++c) {
      const float f = float(F8::from_bits(static_cast<std::uint8_t>(c)));
      bad += !same_f32(arch::f8_to_f32_table<F8>[c], f);
      bad += !same_f32(float(bf16::from_bits(arch::f8_to_bf16_table<F8>[c])), f);
      bad += std::signbit(arch::f8_to_f32_table<F8>[c]) != bool(c & 0x80);
      bad += std::signbit(float(bf16::from_bits(arch::f8_to_bf16_table<F8>[c]))) != bool(c & 0x80);
    }
    return bad;
  };
  CHECK(check(e4m3{}) == 0);
  CHECK(check(e5m2{}) == 0);
  STATIC_REQUIRE(arch::f8_to_f32_table<e4m3>[0x7E] == 448.0f);  // built at compile time
  STATIC_REQUIRE(arch::f8_to_f32_table<e5m2>[0x7B] == 57344.0f);
}

TEST_CASE("widen equals the scalar decoders for every source/stage pair, offset and length", "[arch][unpack]") {
  check_widen<float, float>();
  check_widen<bf16, float>();
  check_widen<fp16, float>();
  check_widen<e4m3, float>();
  check_widen<e5m2, float>();
  check_widen<float, bf16>();
  check_widen<bf16, bf16>();
  check_widen<fp16, bf16>();
  check_widen<e4m3, bf16>();
  check_widen<e5m2, bf16>();
}

TEST_CASE("interleave_u16 makes K-pairs at every length and writes nothing past 2n", "[arch][unpack]") {
  std::mt19937 g(82);
  std::vector<std::uint16_t> r0(1100), r1(1100);
  for (auto& x : r0) x = static_cast<std::uint16_t>(g());
  for (auto& x : r1) x = static_cast<std::uint16_t>(g());
  std::vector<std::uint16_t> out(2 * 1100 + 16);
  for (bool prefetch : {true, false})
    for (std::size_t n = 0; n <= 1030; n += (n < 70 ? 1 : 37)) {
      std::fill(out.begin(), out.end(), std::uint16_t{0xBEEF});
      arch::interleave_u16(r0.data(), r1.data(), out.data(), n, prefetch);
      std::size_t bad = 0;
      for (std::size_t j = 0; j < n; ++j) bad += out[2 * j] != r0[j] || out[2 * j + 1] != r1[j];
      for (std::size_t j = 2 * n; j < out.size(); ++j) bad += out[j] != 0xBEEF;
      INFO("n " << n << " prefetch " << prefetch);
      REQUIRE(bad == 0);
    }
}

TEMPLATE_TEST_CASE("copy_stride2 takes every other word at every length, reads no word past src[2(n-1)] and writes nothing past n", "[arch][unpack]",
                   std::uint32_t, std::uint16_t) {
  std::mt19937 g(83);
  for (std::size_t n = 0; n <= 200; n += (n < 80 ? 1 : 29)) {
    // the source ends at its last word read, so a read past it leaves the vector (ASan)
    std::vector<TestType> src(n == 0 ? 0 : 2 * n - 1), dst(n + 40, TestType(0xBEEF));
    for (auto& x : src) x = static_cast<TestType>(g());
    arch::copy_stride2(src.data(), dst.data(), n);
    std::size_t bad = 0;
    for (std::size_t j = 0; j < n; ++j) bad += dst[j] != src[2 * j];
    for (std::size_t j = n; j < dst.size(); ++j) bad += dst[j] != TestType(0xBEEF);
    INFO("n " << n);
    REQUIRE(bad == 0);
  }
}

TEST_CASE("transpose16_b32 moves every 32-bit word to its transposed place and nothing else", "[arch][unpack]") {
  std::mt19937 g(84);
  // source rows src_ld bytes apart at an odd byte offset; destination rows dst_ld bytes apart
  for (std::size_t src_ld : {64u, 68u, 130u, 4096u})
    for (std::size_t dst_ld : {64u, 128u, 200u}) {
      std::vector<unsigned char> src(16 * src_ld + 64 + 3), dst(16 * dst_ld + 64, 0xA5);
      for (auto& x : src) x = static_cast<unsigned char>(g());
      const unsigned char* s = src.data() + 3;
      arch::transpose16_b32(s, src_ld, dst.data(), dst_ld);
      std::size_t bad = 0;
      for (std::size_t c = 0; c < 16; ++c)
        for (std::size_t r = 0; r < 16; ++r) bad += std::memcmp(dst.data() + c * dst_ld + r * 4, s + r * src_ld + c * 4, 4) != 0;
      for (std::size_t c = 0; c < 16; ++c)  // the bytes between destination rows are untouched
        for (std::size_t b = c * dst_ld + 64; b < (c + 1) * dst_ld && b < dst.size(); ++b) bad += dst[b] != 0xA5;
      INFO("src_ld " << src_ld << " dst_ld " << dst_ld);
      REQUIRE(bad == 0);
    }
}
