// Tensor views: checked construction, strides, transposes, tile sub-views with edge clipping.
#include <catch2/catch.hpp>

#include <vector>

#include <tessel/tile/tensor.hpp>
#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_tile_tensor {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;
using tensor_f = tensor<float, 2>;

TEST_CASE("construction checks leading dimension, null and storage size", "[tile][tensor]") {
  std::vector<float> s(20);
  REQUIRE_NOTHROW(tensor_f(std::span<float>(s), 4, 5));
  REQUIRE_THROWS_MATCHES(tensor_f(std::span<float>(s), 4, 6), tile_error, is_error(errc::out_of_range, "tile"));
  REQUIRE_THROWS_MATCHES(tensor_f(s.data(), 4, 5, 4), tile_error, is_error(errc::invalid_argument, "tile"));                    // ld < cols
  REQUIRE_THROWS_MATCHES(tensor_f(s.data(), 5, 4, 4, order::col_major), tile_error, is_error(errc::invalid_argument, "tile"));  // ld < rows
  REQUIRE_THROWS_MATCHES(tensor_f(static_cast<float*>(nullptr), 2, 2), tile_error, is_error(errc::invalid_argument, "tile"));
  REQUIRE_NOTHROW(tensor_f(static_cast<float*>(nullptr), 0, 2));
  REQUIRE_THROWS_MATCHES(tensor_f(s.data(), std::size_t{1} << 62, 8, 8), tessel::overflow_error, is_error(errc::overflow, "size", "tensor extent"));
  // ld > cols still must fit: 3 rows * ld 7 needs 2*7+5 = 19 elements
  REQUIRE_NOTHROW(tensor_f(std::span<float>(s), 3, 5, 7));
  REQUIRE_THROWS_MATCHES(tensor_f(std::span<float>(s).first(18), 3, 5, 7), tile_error, is_error(errc::out_of_range, "tile"));
}

TEST_CASE("indexing, transposes and sub-views", "[tile][tensor]") {
  std::vector<int> s(12);
  for (int i = 0; i < 12; ++i) s[i] = i;
  tensor<int, 2> t(s.data(), 3, 4);
  REQUIRE(t(1, 2) == 6);
  REQUIRE(t.transposed()(2, 1) == 6);
  REQUIRE(t.transposed().rows() == 4);
  tensor<int, 2> cm(s.data(), 3, 4, 3, order::col_major);
  REQUIRE(cm(1, 2) == 7);
  REQUIRE(t.sub(1, 1, 2, 2)(1, 1) == 10);
  REQUIRE_THROWS_MATCHES(t.sub(2, 2, 2, 2), tile_error, is_error(errc::out_of_range, "tile"));
  REQUIRE_THROWS_MATCHES(t.at(3, 0), tile_error, is_error(errc::out_of_range, "tile"));
  tensor<const int, 2> c = t;
  REQUIRE(c(2, 3) == 11);
}

TEST_CASE("tile<R,C> clips at the edges", "[tile][tensor]") {
  std::vector<float> s(10 * 7);
  tensor<float, 2> t(s.data(), 10, 7);
  auto a = t.tile<4, 4>(0, 0);
  REQUIRE(a.rows == 4);
  REQUIRE(a.cols == 4);
  REQUIRE(a.full());
  auto e = t.tile<4, 4>(2, 1);
  REQUIRE(e.rows == 2);
  REQUIRE(e.cols == 3);
  REQUIRE(e.row0 == 8);
  REQUIRE(e.col0 == 4);
  REQUIRE(&e(0, 0) == &s[8 * 7 + 4]);
  REQUIRE_THROWS_MATCHES((t.tile<4, 4>(3, 0)), tile_error, is_error(errc::out_of_range, "tile"));
  auto tt = t.transposed().tile<4, 4>(1, 2);
  REQUIRE(&tt(0, 0) == &s[8 * 7 + 4]);
  REQUIRE(tt.rows == 3);
  REQUIRE(tt.cols == 2);
}

}  // namespace tessel_test_tile_tensor
