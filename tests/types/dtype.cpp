// tessel::dtype: sizes, names, type mapping, dispatch, bad values.
#include <catch2/catch.hpp>
#include <tessel/types/dtype.hpp>
#include "error_match.hpp"

using tessel_test::is_error;
using tessel::errc;

using tessel::dtype;

TEST_CASE("dtype traits", "[types][dtype]") {
  static_assert(tessel::dtype_of<tessel::bf16> == dtype::bf16);
  static_assert(tessel::dtype_of<const float> == dtype::f32);
  static_assert(tessel::dtype_of<tessel::e4m3> == dtype::e4m3);
  static_assert(std::is_same_v<tessel::dtype_type_t<dtype::e5m2>, tessel::e5m2>);
  static_assert(tessel::dtype_size(dtype::fp16) == 2 && tessel::dtype_size(dtype::i4x2) == 1);
  static_assert(tessel::dtype_name(dtype::e4m3) == "e4m3");
  static_assert(!tessel::dtype_element<long double>);
  for (dtype d : tessel::all_dtypes) {
    INFO(tessel::dtype_name(d));
    CHECK(tessel::dtype_from_name(tessel::dtype_name(d)) == d);
    const bool round_trip = tessel::visit_dtype(d, []<class T>(std::type_identity<T>) { return tessel::dtype_of<T>; }) == d;
    CHECK(round_trip);
    CHECK(tessel::dtype_size(d) == tessel::visit_dtype(d, []<class T>(std::type_identity<T>) { return sizeof(T); }));
  }
  CHECK(tessel::dtype_bits(dtype::i4x2) == 4);
  CHECK(tessel::dtype_bits(dtype::bf16) == 16);
  CHECK(tessel::dtype_is_floating(dtype::e5m2));
  CHECK_FALSE(tessel::dtype_is_floating(dtype::i8));
  CHECK_FALSE(tessel::dtype_is_signed(dtype::u16));
}

TEST_CASE("dtype rejects bad values and names", "[types][dtype]") {
  CHECK_THROWS_MATCHES(tessel::dtype_from_name("f128"), tessel::type_error, is_error(errc::invalid_argument, "types"));
  CHECK_THROWS_WITH(tessel::dtype_from_name("f128"), Catch::Contains("f128"));
  CHECK_THROWS_MATCHES(tessel::dtype_size(static_cast<dtype>(200)), tessel::type_error, is_error(errc::invalid_argument, "types"));
  CHECK_THROWS_MATCHES(tessel::dtype_name(static_cast<dtype>(200)), tessel::type_error, is_error(errc::invalid_argument, "types"));
}
