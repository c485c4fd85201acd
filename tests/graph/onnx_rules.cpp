// graph/shape_inference.hpp: the rules added for what ONNX import meets (Resize from PyTorch's
// F.interpolate, and the small standard ops Tile, Trilu, Not/And/Or/Xor): ordinary cases with known,
// symbolic and unknown dims, and each contradiction a graph_error naming the node.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include <tessel/graph.hpp>
#include "error_match.hpp"

namespace tessel_test_graph_onnx_rules {

namespace tg = tessel::graph;
using tessel::dtype;
using tessel::errc;
using tessel_test::is_error;
using tg::graph_error;

// One node "n" over inputs a, b, c, ... and output y.
struct op1 {
  tg::graph g;
  std::vector<std::string> names;
  std::string next() { return std::string(1, static_cast<char>('a' + names.size())); }
  op1& in(tg::tensor_shape s, dtype t = dtype::f32) {
    names.push_back(next());
    g.add_input(names.back(), t, std::move(s));
    return *this;
  }
  op1& ints(const tg::ints& v) {
    names.push_back(next());
    g.add_constant_ints(names.back(), v);
    return *this;
  }
  op1& f32s(const std::vector<float>& v) {
    names.push_back(next());
    g.add_constant<float>(names.back(), {static_cast<std::int64_t>(v.size())}, v);
    return *this;
  }
  op1& absent() {
    names.push_back("");
    return *this;
  }
  std::string type(const std::string& op, tg::attribute_map attrs = {}) {
    g.add_node(op, "n", names, {"y"}, std::move(attrs));
    g.mark_output("y");
    g.infer_shapes();
    return g.get(g.value_named("y")).type_info().to_string();
  }
};

auto invalid(const std::string& fragment) { return is_error(errc::invalid_argument, "graph", fragment); }

TEST_CASE("graph: Resize by constant scales or sizes", "[graph][shape_inference]") {
  // PyTorch's nearest x2 upsampling: X, no roi, scales.
  CHECK(op1().in({"batch", 8, 4, 6}).absent().f32s({1, 1, 2, 2}).type("Resize", {{"mode", std::string("nearest")}}) == "f32[batch,8,8,12]");
  CHECK(op1().in({2, 3, 5, 5}).absent().f32s({1, 1, 0.5f, 1.5f}).type("Resize") == "f32[2,3,2,7]");  // floor
  CHECK(op1().in({2, 3, tg::dim(), 4}).absent().f32s({1, 1, 2, 1}).type("Resize") == "f32[2,3,?,4]");
  // sizes, with an empty scales tensor as exporters write it
  CHECK(op1().in({"batch", 3, 5, 5}).absent().f32s({}).ints({2, 3, 9, 10}).type("Resize") == "f32[2,3,9,10]");
  CHECK(op1().in({2, 3, 5, 5}).absent().absent().ints({2, 3, 1, 1}).type("Resize", {{"mode", std::string("linear")}}) == "f32[2,3,1,1]");
  // computed scales: the rank stays, the dims are unknown
  CHECK(op1().in({2, 3, 5, 5}).absent().in({4}).type("Resize") == "f32[?,?,?,?]");
  CHECK(op1().in({2, 3, 5, 5}).absent().absent().in({4}, dtype::i64).type("Resize") == "f32[?,?,?,?]");

  CHECK_THROWS_MATCHES(op1().in({2, 3, 5, 5}).absent().f32s({1, 2}).type("Resize"), graph_error,
                       invalid("Resize 'n': scales has 2 values for rank 4"));
  CHECK_THROWS_MATCHES(op1().in({2, 3, 5, 5}).absent().f32s({1, 1, 0, 2}).type("Resize"), graph_error, invalid("Resize 'n': scale 0"));
  CHECK_THROWS_MATCHES(op1().in({2, 3, 5, 5}).absent().f32s({1, 1, 2, 2}).ints({2, 3, 10, 10}).type("Resize"), graph_error,
                       invalid("Resize 'n': takes exactly one of 'scales'"));
  CHECK_THROWS_MATCHES(op1().in({2, 3, 5, 5}).type("Resize"), graph_error, invalid("Resize 'n': takes exactly one of 'scales'"));
  CHECK_THROWS_MATCHES(op1().in({2, 3}).absent().absent().ints({2, -3}).type("Resize"), graph_error,
                       invalid("Resize 'n': sizes [2,-3] holds a negative size"));
  CHECK_THROWS_MATCHES(op1().in({2, 3}).absent().f32s({1, 2}).type("Resize", {{"mode", std::string("area")}}), graph_error,
                       invalid("Resize 'n': attribute 'mode' is 'area'"));
  CHECK_THROWS_MATCHES(op1().in({2, 3}).absent().f32s({1, 1e10f}).type("Resize"), graph_error, invalid("Resize 'n': scale"));
}

TEST_CASE("graph: Tile by constant repeats", "[graph][shape_inference]") {
  CHECK(op1().in({"batch", 3, 4}).ints({1, 2, 3}).type("Tile") == "f32[batch,6,12]");
  CHECK(op1().in({"batch", 3}).ints({2, 0}).type("Tile") == "f32[?,0]");
  CHECK(op1().in({2, 3}).in({2}, dtype::i64).type("Tile") == "f32[?,?]");  // computed repeats: the rank stays
  CHECK_THROWS_MATCHES(op1().in({2, 3}).ints({2}).type("Tile"), graph_error, invalid("Tile 'n': repeats [2] has 1 values for rank 2"));
  CHECK_THROWS_MATCHES(op1().in({2, 3}).ints({2, -1}).type("Tile"), graph_error, invalid("Tile 'n': repeats [2,-1] holds a negative"));
  CHECK_THROWS_MATCHES(op1().in({std::int64_t{1} << 40, 1}).ints({std::int64_t{1} << 40, 1}).type("Tile"), graph_error,
                       is_error(errc::overflow, "graph", "Tile 'n'"));
}

TEST_CASE("graph: Trilu keeps the shape of a matrix stack", "[graph][shape_inference]") {
  CHECK(op1().in({"batch", 4, 4}).type("Trilu") == "f32[batch,4,4]");
  CHECK(op1().in({4, 5}, dtype::i64).in({}, dtype::i64).type("Trilu", {{"upper", 0}}) == "i64[4,5]");
  CHECK_THROWS_MATCHES(op1().in({4}).type("Trilu"), graph_error, invalid("Trilu 'n': input 'a' has shape [4]; Trilu needs rank >= 2"));
  CHECK_THROWS_MATCHES(op1().in({4, 4}).in({2}, dtype::i64).type("Trilu"), graph_error, invalid("Trilu 'n': k 'b' has shape [2]"));
}

TEST_CASE("graph: Not, And, Or and Xor take and give bool", "[graph][shape_inference]") {
  const dtype b = tg::bool_dtype;
  CHECK(op1().in({"batch", 1}, b).in({5}, b).type("And") == "u8[batch,5]");
  CHECK(op1().in({3}, b).in({}, b).type("Or") == "u8[3]");
  CHECK(op1().in({2, 3}, b).in({2, 3}, b).type("Xor") == "u8[2,3]");
  CHECK(op1().in({"batch", 7}, b).type("Not") == "u8[batch,7]");
  CHECK_THROWS_MATCHES(op1().in({3}, b).in({3}).type("And"), graph_error, invalid("And 'n': input 'b' is f32, expected bool"));
  CHECK_THROWS_MATCHES(op1().in({3}, dtype::i64).type("Not"), graph_error, invalid("Not 'n': input 'a' is i64, expected bool"));
  CHECK_THROWS_MATCHES(op1().in({3}, b).in({4}, b).type("Or"), graph_error, invalid("Or 'n': shapes [3] and [4] do not broadcast"));
}

}  // namespace tessel_test_graph_onnx_rules
