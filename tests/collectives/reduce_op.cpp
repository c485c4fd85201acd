// Reduction operators and kernels over every dtype x op: folding rank contributions 0..n-1 with
// to_acc / fold / finalize (from raw or accumulator inputs, in place or not) equals the independent
// canonical reduction (tests/reference/collectives_ref.hpp) bitwise, for n in {1, 2, 3, 5, 8} and
// counts {0, 1, 7, 53}; the exact ops are exact algebra (integer sum/prod wrap and commute, min/max
// commute and are idempotent, ties keep the earlier rank, NaN propagates); names round-trip;
// i4x2, unknown names and invalid values are errors; timing-only runs touch nothing.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <tessel/collectives/reduce_op.hpp>

#include "reference/collectives_ref.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_collectives_reduce_op {

using namespace tessel;
using Catch::Matchers::Contains;

namespace {
constexpr reduce_op every_op[] = {reduce_op::sum, reduce_op::prod, reduce_op::min, reduce_op::max, reduce_op::avg};
constexpr dtype every_dtype[] = {dtype::f64, dtype::f32, dtype::bf16, dtype::fp16, dtype::e4m3, dtype::e5m2, dtype::i64, dtype::i32,
                                 dtype::i16, dtype::i8,  dtype::u64,  dtype::u32,  dtype::u16,  dtype::u8,   dtype::i4x2};

// The library's kernels folding n ranks' inputs in rank order; `raw_first` starts with fold(x0, x1)
// instead of to_acc(x0); `in_place` lets the accumulator alias the output.
template <class T>
std::vector<T> kernel_reduce(std::uint64_t seed, int n, std::size_t count, reduce_op op, bool raw_first, bool in_place) {
  using A = tessel::detail::acc_t<T>;
  const dtype d = dtype_of<T>;
  std::vector<std::vector<T>> x;
  for (int r = 0; r < n; ++r) x.push_back(tessel_ref::gen_vec<T>(seed, r, count, op));
  std::vector<A> acc(count);
  auto* accb = reinterpret_cast<std::byte*>(acc.data());
  int r = 1;
  if (raw_first && n > 1) {
    tessel::detail::fold_kernel(op, d, reinterpret_cast<const std::byte*>(x[0].data()), false, reinterpret_cast<const std::byte*>(x[1].data()), accb,
                                count);
    r = 2;
  } else {
    tessel::detail::to_acc_kernel(d, reinterpret_cast<const std::byte*>(x[0].data()), accb, count);
  }
  for (; r < n; ++r) tessel::detail::fold_kernel(op, d, accb, true, reinterpret_cast<const std::byte*>(x[r].data()), accb, count);
  std::vector<T> out(count);
  if constexpr (std::is_same_v<A, T>) {
    if (in_place) {
      tessel::detail::finalize_kernel(op, d, n, accb, accb, count);
      if (count) std::memcpy(out.data(), acc.data(), count * sizeof(T));
      return out;
    }
  }
  tessel::detail::finalize_kernel(op, d, n, accb, reinterpret_cast<std::byte*>(out.data()), count);
  return out;
}

template <class T>
void check_dtype() {
  for (reduce_op op : every_op)
    for (int n : {1, 2, 3, 5, 8})
      for (std::size_t count : {0, 1, 7, 53}) {
        const std::uint64_t seed = 1000 * std::uint64_t(op) + 10 * std::uint64_t(n) + count;
        const auto want = tessel_ref::reduce_vec<T>(seed, n, count, op);
        for (bool raw_first : {false, true})
          for (bool in_place : {false, true}) {
            const auto got = kernel_reduce<T>(seed, n, count, op, raw_first, in_place);
            INFO(dtype_name(dtype_of<T>) << " " << reduce_op_name(op) << " n " << n << " count " << count << " raw_first " << raw_first);
            REQUIRE(tessel_ref::count_wrong(got.data(), want.data(), count) == 0);
          }
      }
}
}  // namespace

TEST_CASE("fold kernels equal the canonical reduction for every dtype x op x ranks x count", "[collectives][reduce_op]") {
  check_dtype<double>();
  check_dtype<float>();
  check_dtype<bf16>();
  check_dtype<fp16>();
  check_dtype<e4m3>();
  check_dtype<e5m2>();
  check_dtype<std::int64_t>();
  check_dtype<std::int32_t>();
  check_dtype<std::int16_t>();
  check_dtype<std::int8_t>();
  check_dtype<std::uint64_t>();
  check_dtype<std::uint32_t>();
  check_dtype<std::uint16_t>();
  check_dtype<std::uint8_t>();
}

namespace {
template <class A>
void check_exact_algebra(std::mt19937_64& g) {
  using tessel::detail::apply_op;
  for (int i = 0; i < 2000; ++i) {
    A a, b, c;
    if constexpr (std::is_integral_v<A>) {
      a = static_cast<A>(g());
      b = static_cast<A>(g());
      c = static_cast<A>(g());
      // wrapping sum and product: commutative and associative, like two's complement hardware
      REQUIRE(apply_op<reduce_op::sum>(a, b) == apply_op<reduce_op::sum>(b, a));
      REQUIRE(apply_op<reduce_op::sum>(apply_op<reduce_op::sum>(a, b), c) == apply_op<reduce_op::sum>(a, apply_op<reduce_op::sum>(b, c)));
      REQUIRE(apply_op<reduce_op::prod>(a, b) == apply_op<reduce_op::prod>(b, a));
      REQUIRE(apply_op<reduce_op::prod>(apply_op<reduce_op::prod>(a, b), c) == apply_op<reduce_op::prod>(a, apply_op<reduce_op::prod>(b, c)));
      using U = std::make_unsigned_t<A>;
      REQUIRE(apply_op<reduce_op::sum>(a, b) == static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b))));
    } else {
      a = A(std::normal_distribution<double>(0, 100)(g));
      b = A(std::normal_distribution<double>(0, 100)(g));
      c = A(std::normal_distribution<double>(0, 100)(g));
    }
    // min/max: commutative (for distinct values), associative, idempotent
    for (auto [x, y] : {std::pair{a, b}, std::pair{b, c}}) {
      if (!(x == y)) {
        REQUIRE(apply_op<reduce_op::min>(x, y) == apply_op<reduce_op::min>(y, x));
        REQUIRE(apply_op<reduce_op::max>(x, y) == apply_op<reduce_op::max>(y, x));
      }
      REQUIRE(apply_op<reduce_op::min>(x, x) == x);
      REQUIRE(apply_op<reduce_op::max>(x, x) == x);
      REQUIRE(!(apply_op<reduce_op::max>(x, y) < apply_op<reduce_op::min>(x, y)));
    }
    REQUIRE(apply_op<reduce_op::min>(apply_op<reduce_op::min>(a, b), c) == apply_op<reduce_op::min>(a, apply_op<reduce_op::min>(b, c)));
    REQUIRE(apply_op<reduce_op::max>(apply_op<reduce_op::max>(a, b), c) == apply_op<reduce_op::max>(a, apply_op<reduce_op::max>(b, c)));
  }
}
}  // namespace

TEST_CASE("exact ops are exact algebra: wrapping integer sum/prod, min/max", "[collectives][reduce_op]") {
  std::mt19937_64 g(111);
  check_exact_algebra<std::int64_t>(g);
  check_exact_algebra<std::int32_t>(g);
  check_exact_algebra<std::uint64_t>(g);
  check_exact_algebra<std::uint32_t>(g);
  check_exact_algebra<float>(g);
  check_exact_algebra<double>(g);
  using tessel::detail::apply_op;
  // narrow integers wrap through 32 bits without UB (checked under UBSan in the asan build)
  REQUIRE(apply_op<reduce_op::sum>(std::int8_t{127}, std::int8_t{1}) == std::int8_t{-128});
  REQUIRE(apply_op<reduce_op::prod>(std::int16_t{256}, std::int16_t{256}) == std::int16_t{0});
  REQUIRE(apply_op<reduce_op::sum>(std::numeric_limits<std::int64_t>::max(), std::int64_t{1}) == std::numeric_limits<std::int64_t>::min());
  REQUIRE(apply_op<reduce_op::prod>(std::numeric_limits<std::int32_t>::min(), std::int32_t{-1}) == std::numeric_limits<std::int32_t>::min());
  // avg of integers truncates toward zero
  REQUIRE(tessel::detail::coll_narrow<reduce_op::avg, std::int32_t>(-7, 2) == -3);
  REQUIRE(tessel::detail::coll_narrow<reduce_op::avg, std::uint8_t>(7, 2) == 3);
}

TEST_CASE("floating min/max: NaN propagates from either side, ties keep the earlier rank", "[collectives][reduce_op]") {
  using tessel::detail::apply_op;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float x : {0.0f, -1.0f, INFINITY, -INFINITY}) {
    REQUIRE(std::isnan(apply_op<reduce_op::min>(nan, x)));
    REQUIRE(std::isnan(apply_op<reduce_op::min>(x, nan)));
    REQUIRE(std::isnan(apply_op<reduce_op::max>(nan, x)));
    REQUIRE(std::isnan(apply_op<reduce_op::max>(x, nan)));
  }
  REQUIRE_FALSE(std::signbit(apply_op<reduce_op::min>(0.0f, -0.0f)));
  REQUIRE(std::signbit(apply_op<reduce_op::min>(-0.0f, 0.0f)));
  REQUIRE_FALSE(std::signbit(apply_op<reduce_op::max>(0.0f, -0.0f)));
  REQUIRE(std::signbit(apply_op<reduce_op::max>(-0.0f, 0.0f)));
}

TEST_CASE("names round-trip, accumulator types, reducible dtypes", "[collectives][reduce_op]") {
  for (reduce_op op : every_op) REQUIRE(reduce_op_from_name(reduce_op_name(op)) == op);
  REQUIRE_THROWS_WITH(reduce_op_from_name("mean"), Contains("unknown reduce_op 'mean'"));
  REQUIRE_THROWS_WITH(reduce_op_name(static_cast<reduce_op>(99)), Contains("invalid reduce_op value 99"));
  STATIC_REQUIRE(reduce_op_name(reduce_op::avg) == "avg");
  for (dtype d : every_dtype) {
    const bool narrow_float = d == dtype::bf16 || d == dtype::fp16 || d == dtype::e4m3 || d == dtype::e5m2;
    REQUIRE(accumulator_dtype(d) == (narrow_float ? dtype::f32 : d));
    REQUIRE(reducible(d) == (d != dtype::i4x2));
  }
}

TEST_CASE("kernels reject i4x2 and invalid ops, and timing-only runs touch nothing", "[collectives][reduce_op][errors]") {
  std::vector<std::byte> a(64, std::byte{1}), b(64, std::byte{2}), out(64, std::byte{3});
  REQUIRE_THROWS_WITH(tessel::detail::fold_kernel(reduce_op::sum, dtype::i4x2, a.data(), false, b.data(), out.data(), 4),
                      Contains("cannot be reduced"));
  REQUIRE_THROWS_WITH(tessel::detail::to_acc_kernel(dtype::i4x2, a.data(), out.data(), 4), Contains("i4x2"));
  REQUIRE_THROWS_WITH(tessel::detail::fold_kernel(static_cast<reduce_op>(42), dtype::f32, a.data(), false, b.data(), out.data(), 4),
                      Contains("invalid reduce_op"));
  tessel::detail::coll_dry_run = true;
  tessel::detail::fold_kernel(reduce_op::sum, dtype::f32, a.data(), false, b.data(), out.data(), 16);
  tessel::detail::to_acc_kernel(dtype::bf16, a.data(), out.data(), 16);
  tessel::detail::finalize_kernel(reduce_op::avg, dtype::i32, 3, a.data(), out.data(), 16);
  tessel::detail::copy_bytes(out.data(), a.data(), 64);
  tessel::detail::coll_dry_run = false;
  for (auto x : out) REQUIRE(std::to_integer<int>(x) == 3);
  tessel::detail::copy_bytes(out.data(), a.data(), 64);
  for (auto x : out) REQUIRE(std::to_integer<int>(x) == 1);
}

}  // namespace tessel_test_collectives_reduce_op
