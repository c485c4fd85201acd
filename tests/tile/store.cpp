// store(acc, destination tile, epilogue) against a plain loop: for every destination type (f32 and
// the saturating narrow types; random accumulators incl. NaN, Inf, overflow and subnormals), row-,
// column-major and strided destinations, tensors of 1, primes, exact multiples and ragged edges,
// every tile: the tile's valid part gets the converted value, every other element is untouched;
// epilogue ops see the global row and column (also past the 256-column row chunks) and the old
// destination values.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <tessel/tile/store.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_tile_store {

using namespace tessel;

namespace {
float random_acc(std::mt19937& g) {
  switch (g() % 5) {
    case 0: return std::bit_cast<float>(static_cast<std::uint32_t>(g()));          // any bits
    case 1: return std::ldexp(float(int(g() % 2001) - 1000), int(g() % 40) - 20);  // around the fp8/fp16 range
    case 2: return float(int(g() % 65) - 32);
    case 3: return std::ldexp(float(int(g() % 255) - 127), -int(g() % 30) - 10);  // small, fp8 subnormals
    default: return std::normal_distribution<float>(0.0f, 1000.0f)(g);
  }
}

template <class T>
std::uint32_t bits_of(T x) {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<std::uint32_t>(x);
  else
    return x.bits();
}

// The documented conversion: f32 unchanged, narrow types round to nearest even and saturate.
template <class T>
T expected(float v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return T::from_bits(tessel::detail::encode<typename T::format, overflow::saturate>(v));
}

template <class T>
T sentinel() {
  if constexpr (std::is_same_v<T, float>)
    return -777.0f;
  else
    return T::from_bits(0x5A);
}

// Every tile of a (m, n) destination of kind 0 (row-major, padded), 1 (column-major), 2 (strided).
template <class T, std::size_t R, std::size_t C>
std::size_t check_store(std::size_t m, std::size_t n, int kind, std::mt19937& g, std::string& where) {
  std::size_t rs = 0, cs = 0;
  switch (kind) {
    case 0:
      rs = n + 2;
      cs = 1;
      break;
    case 1:
      rs = 1;
      cs = m + 3;
      break;
    default:
      rs = 2 * n + 1;
      cs = 2;
      break;
  }
  std::vector<T> mem((m - 1) * rs + (n - 1) * cs + 1 + 7);  // 7 past the end: never written
  const auto dst = tensor<T, 2>::strided(mem.data(), m, n, rs, cs);
  fragment<float, R, C> acc;
  std::size_t bad = 0;
  auto check_tile = [&](const tensor_tile<T, R, C>& t) {
    for (auto& x : acc.v) x = random_acc(g);
    std::fill(mem.begin(), mem.end(), sentinel<T>());
    store(acc, t);
    std::vector<long> owner(mem.size(), -1);  // which tile element a storage slot belongs to
    for (std::size_t r = 0; r < t.rows; ++r)
      for (std::size_t c = 0; c < t.cols; ++c) owner[static_cast<std::size_t>(&t(r, c) - mem.data())] = long(r * C + c);
    for (std::size_t i = 0; i < mem.size(); ++i) {
      const T want = owner[i] < 0 ? sentinel<T>() : expected<T>(acc.v[std::size_t(owner[i])]);
      if (bits_of(mem[i]) != bits_of(want) && bad++ == 0)
        where = "tile at (" + std::to_string(t.row0) + "," + std::to_string(t.col0) + ") slot " + std::to_string(i) +
                (owner[i] < 0 ? " outside the tile was written" : " holds the wrong value");
    }
  };
  for (std::size_t i = 0; i * R < m; ++i)
    for (std::size_t j = 0; j * C < n; ++j) check_tile(dst.template tile<R, C>(i, j));
  if (m > 1 && n > 1) check_tile(dst.template tile_at<R, C>(1, 1));
  return bad;
}

template <class T, std::size_t R, std::size_t C>
void check_shapes(std::mt19937& g) {
  for (std::size_t m : {std::size_t{1}, R - 1 > 0 ? R - 1 : 1, R, R + 1, 2 * R + 3})
    for (std::size_t n : {std::size_t{1}, C, C + 1, 2 * C + 5})
      for (int kind = 0; kind < 3; ++kind) {
        std::string where;
        const std::size_t bad = check_store<T, R, C>(m, n, kind, g, where);
        INFO("tensor (" << m << "," << n << ") kind " << kind << ": " << where);
        REQUIRE(bad == 0);
      }
}
}  // namespace

TEMPLATE_TEST_CASE("store writes the converted (saturated) tile, only inside the tensor", "[tile][store]", float, bf16, fp16, e4m3, e5m2) {
  std::mt19937 g(41);
  check_shapes<TestType, 4, 8>(g);
  check_shapes<TestType, 7, 13>(g);
  check_shapes<TestType, 2, 300>(g);  // rows longer than the 256-column chunk
}

TEMPLATE_TEST_CASE("epilogue ops see the global row, column and the old destination", "[tile][store]", float, bf16) {
  constexpr std::size_t R = 3, C = 300;  // two row chunks
  const std::size_t m = 8, n = 700;
  std::mt19937 g(42);
  std::vector<float> bias(n), brow(m);
  for (std::size_t j = 0; j < n; ++j) bias[j] = float(j % 97);
  for (std::size_t i = 0; i < m; ++i) brow[i] = float(1000 * i);
  std::vector<TestType> mem(m * n);
  for (auto& x : mem) x = TestType(float(int(g() % 64) - 32));
  const std::vector<TestType> old = mem;
  const tensor<TestType, 2> dst(mem.data(), m, n);
  fragment<float, R, C> acc;
  for (auto& x : acc.v) x = float(int(g() % 64) - 32);
  const auto chain = epilogue::alpha_beta(2.0f, 0.5f) | epilogue::bias(bias) | epilogue::bias_row(brow) | epilogue::scale(0.25f);
  for (std::size_t i = 0; i * R < m; ++i)
    for (std::size_t j = 0; j * C < n; ++j) store(acc, dst.template tile<R, C>(i, j), chain);
  std::size_t bad = 0;
  for (std::size_t r = 0; r < m; ++r)
    for (std::size_t c = 0; c < n; ++c) {
      // powers of two and small integers: every step is exact, whatever the evaluation order
      const float v = ((2.0f * acc(r % R, c % C) + 0.5f * float(old[r * n + c])) + bias[c] + brow[r]) * 0.25f;
      bad += bits_of(mem[r * n + c]) != bits_of(expected<TestType>(v));
    }
  REQUIRE(bad == 0);
}

TEST_CASE("store_rows: an empty chain is a plain conversion, a cast chain saturates the same way", "[tile][store]") {
  std::mt19937 g(43);
  std::vector<float> acc(5 * 37);
  for (auto& x : acc) x = random_acc(g);
  std::vector<e4m3> a(5 * 37), b(5 * 37);
  tessel::detail::store_rows<e4m3>(acc.data(), 37, 5, 37, a.data(), 37, 1, 0, 0, epilogue::chain<>{});
  tessel::detail::store_rows<e4m3>(acc.data(), 37, 5, 37, b.data(), 37, 1, 0, 0, epilogue::chain<epilogue::cast_t<e4m3>>{});
  for (std::size_t i = 0; i < acc.size(); ++i) {
    REQUIRE(a[i].bits() == expected<e4m3>(acc[i]).bits());
    REQUIRE(b[i].bits() == a[i].bits());
  }
  STATIC_REQUIRE(storable_element<float>);
  STATIC_REQUIRE(storable_element<e5m2>);
  STATIC_REQUIRE_FALSE(storable_element<double>);
  STATIC_REQUIRE_FALSE(storable_element<int>);
}

}  // namespace tessel_test_tile_store
