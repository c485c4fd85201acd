// graph/shape_inference.hpp: the MLP and the transformer block against hand-computed shapes (with a
// symbolic batch and a concrete one), numpy broadcasting as a table, every operator's rule on its
// ordinary cases and its contradictions (each a graph_error naming the node), unknown ops, declared
// types, and sizes that overflow.
#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <tessel/graph.hpp>
#include "error_match.hpp"
#include "graph/graph_models.hpp"

namespace tessel_test_graph_shape_inference {

using tessel::dtype;
using tessel::errc;
using tessel_test::is_error;
using namespace tessel_test_graph;
using tg::graph_error;

// One node over fresh inputs a, b, c, ... (graph inputs or i64 constants), its outputs y0, y1, ...
struct one_op {
  tg::graph g;
  std::vector<std::string> names;
  std::string domain;  // "tessel" for the fused ops

  one_op& fused() {
    domain = "tessel";
    return *this;
  }

  std::string next() { return std::string(1, static_cast<char>('a' + names.size())); }
  one_op& in(tg::tensor_shape s, dtype t = dtype::f32) {
    names.push_back(next());
    g.add_input(names.back(), t, std::move(s));
    return *this;
  }
  one_op& ints(const tg::ints& v) {
    names.push_back(next());
    g.add_constant_ints(names.back(), v);
    return *this;
  }
  one_op& absent() {
    names.push_back("");
    return *this;
  }
  std::vector<tg::tensor_type> run(const std::string& op, tg::attribute_map attrs = {}, std::size_t outputs = 1, const std::string& name = "n") {
    std::vector<std::string> outs;
    for (std::size_t k = 0; k < outputs; ++k) outs.push_back(std::string("y") + std::to_string(k));
    g.add_node(op, name, names, outs, std::move(attrs), domain);
    g.mark_output("y0");
    g.infer_shapes();
    std::vector<tg::tensor_type> r;
    for (const std::string& o : outs) r.push_back(g.get(g.value_named(o)).type_info());
    return r;
  }
  std::string shape(const std::string& op, tg::attribute_map attrs = {}) { return run(op, std::move(attrs))[0].shape.to_string(); }
  std::string type(const std::string& op, tg::attribute_map attrs = {}) { return run(op, std::move(attrs))[0].to_string(); }
};

auto invalid(const std::string& fragment) { return is_error(errc::invalid_argument, "graph", fragment); }

std::string type_of(const tg::graph& g, const std::string& v) { return g.get(g.value_named(v)).type_info().to_string(); }

TEST_CASE("graph: MLP shapes keep the symbolic batch", "[graph][shape_inference]") {
  tg::graph g = make_mlp();
  g.infer_shapes();
  CHECK(type_of(g, "h") == "f32[batch,32]");
  CHECK(type_of(g, "a") == "f32[batch,32]");
  CHECK(type_of(g, "z") == "f32[batch,4]");
  CHECK(type_of(g, "y") == "f32[batch,4]");
}

TEST_CASE("graph: transformer block shapes match the hand-computed ones", "[graph][shape_inference]") {
  // batch is symbolic; S=6 tokens, D=32 wide, H=4 heads of HD=8, FF=128.
  const std::map<std::string, std::string> expected = {
      {"n1", "f32[batch,6,32]"},       {"q_mm", "f32[batch,6,32]"},     {"q", "f32[batch,6,32]"},         {"q_heads", "f32[batch,6,4,8]"},
      {"k_heads", "f32[batch,6,4,8]"}, {"v_heads", "f32[batch,6,4,8]"}, {"qt", "f32[batch,4,6,8]"},       {"kt", "f32[batch,4,8,6]"},
      {"vt", "f32[batch,4,6,8]"},      {"s", "f32[batch,4,6,6]"},       {"s_scaled", "f32[batch,4,6,6]"}, {"p", "f32[batch,4,6,6]"},
      {"c", "f32[batch,4,6,8]"},       {"ct", "f32[batch,6,4,8]"},      {"cm", "f32[batch,6,32]"},        {"attn", "f32[batch,6,32]"},
      {"r", "f32[batch,6,32]"},        {"n2", "f32[batch,6,32]"},       {"u", "f32[batch,6,128]"},        {"u_act", "f32[batch,6,128]"},
      {"d", "f32[batch,6,32]"},        {"y", "f32[batch,6,32]"},
  };
  tg::graph g = make_transformer_block();
  g.infer_shapes();
  for (const auto& [v, t] : expected) {
    INFO(v);
    CHECK(type_of(g, v) == t);
  }
  // Inference is idempotent.
  g.infer_shapes();
  CHECK(type_of(g, "cm") == "f32[batch,6,32]");

  SECTION("with a concrete batch every dim is known") {
    tg::graph c = make_transformer_block();
    c.set_value_type(c.value_named("x"), dtype::f32, {3, S, D});
    c.infer_shapes();
    for (const auto& [v, t] : expected) {
      const std::string concrete = std::string("f32[3") + t.substr(std::string("f32[batch").size());  // every entry starts so
      INFO(v);
      CHECK(type_of(c, v) == concrete);
    }
    CHECK(c.byte_size(c.value_named("p")) == std::size_t{3 * 4 * 6 * 6 * 4});
  }
}

TEST_CASE("graph: numpy broadcasting, with unknown and symbolic dims", "[graph][shape_inference]") {
  struct row {
    tg::tensor_shape a, b;
    std::string expected;  // "" : the shapes do not broadcast
  };
  const std::vector<row> table = {
      {{2, 3}, {2, 3}, "[2,3]"},
      {{2, 3}, {3}, "[2,3]"},
      {{2, 1}, {1, 3}, "[2,3]"},
      {{}, {2, 3}, "[2,3]"},
      {{}, {}, "[]"},
      {{4, 1, 5}, {3, 1}, "[4,3,5]"},
      {{0}, {1}, "[0]"},
      {{"batch", 1, 8}, {1, "seq", 8}, "[batch,seq,8]"},
      {{"batch", 8}, {"batch", 8}, "[batch,8]"},
      {{"batch", 8}, {1, 8}, "[batch,8]"},
      {{"batch", 8}, {5, 8}, "[5,8]"},  // batch must be 5 (or 1)
      {{"batch", 8}, {"seq", 8}, "[?,8]"},
      {{tg::dim(), 8}, {5, 1}, "[5,8]"},
      {{tg::dim(), 8}, {1, 8}, "[?,8]"},
      {{3}, {4}, ""},
      {{2, 3}, {3, 2}, ""},
      {{0}, {2}, ""},
      {{5, "n"}, {4, "n"}, ""},
  };
  for (const row& r : table) {
    INFO(r.a.to_string() << " + " << r.b.to_string());
    for (const char* op : {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"}) {
      INFO(op);
      if (r.expected.empty()) {
        CHECK_THROWS_MATCHES(one_op().in(r.a).in(r.b).run(op), graph_error, invalid(std::string(op) + " 'n': shapes "));
      } else {
        CHECK(one_op().in(r.a).in(r.b).shape(op) == r.expected);
        CHECK(one_op().in(r.b).in(r.a).shape(op) == r.expected);  // symmetric
      }
    }
  }
  CHECK_THROWS_MATCHES(one_op().in({2, 3}).in({4}).run("Add"), graph_error,
                       invalid("Add 'n': shapes [2,3] and [4] do not broadcast: dims 3 and 4 at axis -1"));
  CHECK(one_op().in({2, 1}).in({1, 3}).in({1}).shape("Max") == "[2,3]");
  CHECK(one_op().in({2, 1}, tg::bool_dtype).in({1, 3}).in({3}).type("Where") == "f32[2,3]");
  CHECK(one_op().in({2, 3}).in({3}).type("Equal") == "u8[2,3]");
  CHECK(one_op().in({2, 3}).in({1}, dtype::i32).type("Pow") == "f32[2,3]");
}

TEST_CASE("graph: elementwise dtypes must agree", "[graph][shape_inference]") {
  CHECK_THROWS_MATCHES(one_op().in({2}).in({2}, dtype::fp16).run("Add"), graph_error,
                       invalid("Add 'n': input dtypes differ: f32 ('a') and fp16 ('b')"));
  CHECK_THROWS_MATCHES(one_op().in({2}, dtype::f32).in({2}).in({2}).run("Where"), graph_error,
                       invalid("Where 'n': condition 'a' is f32, expected bool (u8)"));
  CHECK_THROWS_MATCHES(one_op().in({2}).run("Add"), graph_error, invalid("Add 'n': takes 2 inputs, not 1"));
  CHECK_THROWS_MATCHES(one_op().in({2}).run("Relu", {}, 2), graph_error, invalid("Relu 'n': has 1 outputs, not 2"));
}

TEST_CASE("graph: unary ops keep shape and dtype", "[graph][shape_inference]") {
  for (const char* op : {"Relu", "Gelu", "Erf", "Tanh", "Sigmoid", "Exp", "Log", "Sqrt", "Neg", "Abs", "Reciprocal", "Identity"}) {
    INFO(op);
    CHECK(one_op().in({"batch", 7}, dtype::bf16).type(op) == "bf16[batch,7]");
  }
  CHECK(one_op().in({2, 3}).type("Gelu", {{"approximate", "tanh"}}) == "f32[2,3]");
  CHECK_THROWS_MATCHES(one_op().in({2}).run("Gelu", {{"approximate", "fast"}}), graph_error, invalid("Gelu 'n': attribute 'approximate' is 'fast'"));
  CHECK(one_op().in({2, 3}).type("Softmax", {{"axis", 0}}) == "f32[2,3]");
  CHECK(one_op().in({2, 3}).type("Softmax") == "f32[2,3]");
  CHECK_THROWS_MATCHES(one_op().in({2, 3}).run("Softmax", {{"axis", 2}}), graph_error,
                       is_error(errc::out_of_range, "graph", "Softmax 'n': axis 2 is out of range for rank 2"));
  CHECK(one_op().in({2, 3}).type("Cast", {{"to", 16}}) == "bf16[2,3]");
  CHECK(one_op().in({2, 3}).type("Cast", {{"to", "e4m3"}}) == "e4m3[2,3]");
  CHECK_THROWS_MATCHES(one_op().in({2}).run("Cast", {{"to", 8}}), graph_error,
                       is_error(errc::unsupported, "graph", "Cast 'n': attribute 'to' is ONNX element type 8"));
  CHECK_THROWS_MATCHES(one_op().in({2}).run("Cast"), graph_error, invalid("Cast 'n': attribute 'to' is required"));
  const auto d = one_op().in({"batch", 4}).run("Dropout", {}, 2);
  CHECK(d[0].to_string() == "f32[batch,4]");
  CHECK(d[1].to_string() == "u8[batch,4]");
}

TEST_CASE("graph: MatMul follows numpy matmul, batched and 1-D", "[graph][shape_inference]") {
  CHECK(one_op().in({2, 3}).in({3, 4}).shape("MatMul") == "[2,4]");
  CHECK(one_op().in({3}).in({3, 4}).shape("MatMul") == "[4]");
  CHECK(one_op().in({2, 3}).in({3}).shape("MatMul") == "[2]");
  CHECK(one_op().in({3}).in({3}).shape("MatMul") == "[]");
  CHECK(one_op().in({5, 1, 2, 3}).in({4, 3, 6}).shape("MatMul") == "[5,4,2,6]");
  CHECK(one_op().in({"batch", 6, 32}).in({32, 8}).shape("MatMul") == "[batch,6,8]");
  CHECK(one_op().in({2, tg::dim()}).in({7, 4}).shape("MatMul") == "[2,4]");
  tg::graph g;
  g.add_input("x", dtype::f32, {2, 64});
  g.add_input("w", dtype::f32, {48, 8});
  g.add_node("MatMul", "fc1", {"x", "w"}, {"y"});
  g.mark_output("y");
  CHECK_THROWS_MATCHES(g.infer_shapes(), graph_error, invalid("MatMul 'fc1': inner dims 64 and 48 differ ([2,64] x [48,8])"));
  CHECK_THROWS_MATCHES(one_op().in({2, 2, 3}).in({3, 3, 4}).run("MatMul"), graph_error,
                       invalid("MatMul 'n': batch dims [2] and [3] do not broadcast"));
  CHECK_THROWS_MATCHES(one_op().in({}).in({3}).run("MatMul"), graph_error, invalid("MatMul 'n': input 'a' is a scalar"));
}

TEST_CASE("graph: Gemm with transA, transB and a broadcast C", "[graph][shape_inference]") {
  CHECK(one_op().in({4, 3}).in({3, 5}).shape("Gemm") == "[4,5]");
  CHECK(one_op().in({3, 4}).in({3, 5}).shape("Gemm", {{"transA", 1}}) == "[4,5]");
  CHECK(one_op().in({4, 3}).in({5, 3}).in({5}).shape("Gemm", {{"transB", 1}}) == "[4,5]");
  CHECK(one_op().in({4, 3}).in({3, 5}).in({4, 1}).shape("Gemm") == "[4,5]");
  CHECK_THROWS_MATCHES(one_op().in({4, 3}).in({5, 3}).run("Gemm"), graph_error, invalid("Gemm 'n': inner dims 3 and 5 differ"));
  CHECK_THROWS_MATCHES(one_op().in({4, 3}).in({3, 5}).in({4}).run("Gemm"), graph_error, invalid("Gemm 'n': C [4] does not broadcast to [4,5]"));
  CHECK_THROWS_MATCHES(one_op().in({4, 3}).in({3, 5}).in({2, 4, 5}).run("Gemm"), graph_error,
                       invalid("Gemm 'n': C [2,4,5] does not broadcast to [4,5]"));
  CHECK_THROWS_MATCHES(one_op().in({4, 3, 1}).in({3, 5}).run("Gemm"), graph_error,
                       invalid("Gemm 'n': input 'a' has shape [4,3,1]; Gemm needs rank 2"));
}

TEST_CASE("graph: Transpose by perm, reversed by default", "[graph][shape_inference]") {
  CHECK(one_op().in({"batch", 6, 4, 8}).shape("Transpose", {{"perm", tg::ints{0, 2, 1, 3}}}) == "[batch,4,6,8]");
  CHECK(one_op().in({2, 3, 5}).shape("Transpose") == "[5,3,2]");
  for (const tg::ints& bad : {tg::ints{0, 0, 1}, tg::ints{0, 1}, tg::ints{0, 1, 3}, tg::ints{-1, 0, 1}}) {
    INFO(tg::detail::ints_to_string(bad));
    CHECK_THROWS_MATCHES(
        one_op().in({2, 3, 5}).run("Transpose", {{"perm", bad}}), graph_error,
        invalid(std::string("Transpose 'n': perm ") + tg::detail::ints_to_string(bad) + " is not a permutation of 0..2 (input [2,3,5])"));
  }
}

TEST_CASE("graph: Reshape copies 0, infers -1, and checks the element count", "[graph][shape_inference]") {
  CHECK(one_op().in({2, 3, 4}).ints({6, 4}).shape("Reshape") == "[6,4]");
  CHECK(one_op().in({2, 3, 4}).ints({0, -1}).shape("Reshape") == "[2,12]");
  CHECK(one_op().in({2, 3, 4}).ints({-1}).shape("Reshape") == "[24]");
  CHECK(one_op().in({"batch", 6, 32}).ints({0, 0, 4, 8}).shape("Reshape") == "[batch,6,4,8]");
  CHECK(one_op().in({"batch", 6, 32}).ints({-1, 32}).shape("Reshape") == "[?,32]");  // batch*6 is no one symbol
  CHECK(one_op().in({"batch", 4, 16}).ints({-1, 64}).shape("Reshape") == "[batch,64]");
  CHECK(one_op().in({"batch", 4, 16}).ints({0, -1}).shape("Reshape") == "[batch,64]");
  CHECK(one_op().in({0, 3}).ints({-1, 3}).shape("Reshape") == "[0,3]");
  CHECK(one_op().in({2, 0}).ints({2, 0}).shape("Reshape", {{"allowzero", 1}}) == "[2,0]");
  CHECK(one_op().in({tg::dim(), 4}).ints({2, -1}).shape("Reshape") == "[2,?]");
  // A computed shape: the rank is its length.
  CHECK(one_op().in({2, 3}).in({3}, dtype::i64).shape("Reshape") == "[?,?,?]");
  CHECK_THROWS_MATCHES(one_op().in({2, 3}).ints({4, 2}).run("Reshape"), graph_error,
                       invalid("Reshape 'n': cannot reshape [2,3] to [4,2]: 6 elements vs 8"));
  CHECK_THROWS_MATCHES(one_op().in({2, 3}).ints({4, -1}).run("Reshape"), graph_error,
                       invalid("Reshape 'n': cannot reshape [2,3] to [4,-1]: 6 elements do not divide into blocks of 4"));
  CHECK_THROWS_MATCHES(one_op().in({2, 3}).ints({-1, -1}).run("Reshape"), graph_error, invalid("more than one -1"));
  CHECK_THROWS_MATCHES(one_op().in({6}).ints({2, 0}).run("Reshape"), graph_error, invalid("0 at index 1 copies a dim the input does not have"));
  CHECK_THROWS_MATCHES(one_op().in({6}).ints({-2, -3}).run("Reshape"), graph_error, invalid("negative size -2"));
  CHECK_THROWS_MATCHES(one_op().in({"batch", 6}).ints({0, 5}).run("Reshape"), graph_error,
                       invalid("cannot reshape [batch,6] to [0,5]: 6 elements vs 5"));
  CHECK_THROWS_MATCHES(one_op().in({6}).in({2}, dtype::i32).run("Reshape"), graph_error, invalid("shape 'b' is i32, expected i64"));
  CHECK_THROWS_MATCHES(one_op().in({6}).ints({0, -1}).run("Reshape", {{"allowzero", 1}}), graph_error,
                       invalid("with allowzero, a 0 next to -1 leaves -1 undetermined"));
}

TEST_CASE("graph: Flatten, Squeeze and Unsqueeze", "[graph][shape_inference]") {
  CHECK(one_op().in({2, 3, 4}).shape("Flatten") == "[2,12]");
  CHECK(one_op().in({2, 3, 4}).shape("Flatten", {{"axis", 0}}) == "[1,24]");
  CHECK(one_op().in({2, 3, 4}).shape("Flatten", {{"axis", 3}}) == "[24,1]");
  CHECK(one_op().in({2, 3, 4}).shape("Flatten", {{"axis", -1}}) == "[6,4]");
  CHECK(one_op().in({"batch", 8, 1, 1}).shape("Flatten") == "[batch,8]");
  CHECK(one_op().in({"batch", tg::dim(), 3}).shape("Flatten") == "[batch,?]");
  CHECK_THROWS_MATCHES(one_op().in({2, 3}).run("Flatten", {{"axis", 3}}), graph_error,
                       is_error(errc::out_of_range, "graph", "Flatten 'n': axis 3 is out of range for rank 2"));

  CHECK(one_op().in({1, 3, 1, 5}).ints({0, 2}).shape("Squeeze") == "[3,5]");
  CHECK(one_op().in({1, 3, 1, 5}).shape("Squeeze", {{"axes", tg::ints{-2}}}) == "[1,3,5]");
  CHECK(one_op().in({1, 3, 1, 5}).shape("Squeeze") == "[3,5]");
  CHECK(one_op().in({1, "n", 1}).shape("Squeeze") == "[*]");  // n might be 1
  CHECK(one_op().in({"n", 3}).ints({0}).shape("Squeeze") == "[3]");
  CHECK_THROWS_MATCHES(one_op().in({1, 3}).ints({1}).run("Squeeze"), graph_error,
                       invalid("Squeeze 'n': cannot squeeze axis 1 of size 3 (input [1,3])"));
  CHECK_THROWS_MATCHES(one_op().in({1, 1}).ints({0, -2}).run("Squeeze"), graph_error, invalid("axes [0,-2] repeat axis 0"));

  CHECK(one_op().in({3, 5}).ints({0, 3}).shape("Unsqueeze") == "[1,3,5,1]");
  CHECK(one_op().in({3, 5}).ints({-1}).shape("Unsqueeze") == "[3,5,1]");
  CHECK(one_op().in({"batch", 5}).shape("Unsqueeze", {{"axes", tg::ints{1}}}) == "[batch,1,5]");
  CHECK(one_op().in({}).ints({0}).shape("Unsqueeze") == "[1]");
  CHECK_THROWS_MATCHES(one_op().in({3}).run("Unsqueeze"), graph_error, invalid("Unsqueeze 'n': axes are required"));
  CHECK_THROWS_MATCHES(one_op().in({3}).ints({2}).run("Unsqueeze"), graph_error,
                       is_error(errc::out_of_range, "graph", "Unsqueeze 'n': axes 2 is out of range for rank 2"));
}

TEST_CASE("graph: Concat and Split", "[graph][shape_inference]") {
  CHECK(one_op().in({2, 3}).in({2, 5}).shape("Concat", {{"axis", 1}}) == "[2,8]");
  CHECK(one_op().in({"b", 3}).in({2, 3}).in({4, 3}).shape("Concat", {{"axis", 0}}) == "[?,3]");
  CHECK(one_op().in({"b", 3}).in({"b", 5}).shape("Concat", {{"axis", -1}}) == "[b,8]");
  CHECK(one_op().in({tg::dim(), 3}).in({2, 5}).shape("Concat", {{"axis", 1}}) == "[2,8]");
  CHECK_THROWS_MATCHES(one_op().in({2, 3}).in({4, 5}).run("Concat", {{"axis", 1}}), graph_error,
                       invalid("Concat 'n': dim 0 differs: 2 before input 'b', 4 in it"));
  CHECK_THROWS_MATCHES(one_op().in({2, 3}).in({2}).run("Concat", {{"axis", 0}}), graph_error,
                       invalid("Concat 'n': input 'b' has rank 1, input 'a' rank 2"));
  CHECK_THROWS_MATCHES(one_op().in({2}).in({2}).run("Concat"), graph_error, invalid("Concat 'n': attribute 'axis' (an int) is required"));

  auto split = one_op().in({2, 12}).run("Split", {{"axis", 1}}, 3);
  for (const auto& t : split) CHECK(t.to_string() == "f32[2,4]");
  split = one_op().in({2, 12}).ints({2, 10}).run("Split", {{"axis", -1}}, 2);
  CHECK(split[0].shape.to_string() == "[2,2]");
  CHECK(split[1].shape.to_string() == "[2,10]");
  split = one_op().in({7, 2}).run("Split", {{"num_outputs", 3}}, 3);
  CHECK(split[0].shape.to_string() == "[3,2]");
  CHECK(split[2].shape.to_string() == "[1,2]");
  split = one_op().in({"n", 2}).run("Split", {}, 2);
  CHECK(split[1].shape.to_string() == "[?,2]");
  CHECK_THROWS_MATCHES(one_op().in({7, 2}).run("Split", {}, 2), graph_error,
                       invalid("Split 'n': axis 0 of size 7 does not split evenly into 2 outputs"));
  CHECK_THROWS_MATCHES(one_op().in({7}).ints({3, 3}).run("Split", {}, 2), graph_error, invalid("Split 'n': split [3,3] sums to 6, but axis 0 has 7"));
  CHECK_THROWS_MATCHES(one_op().in({7}).ints({3, 3, 1}).run("Split", {}, 2), graph_error,
                       invalid("Split 'n': split [3,3,1] has 3 sizes for 2 outputs"));
}

TEST_CASE("graph: Slice with constant starts, ends, axes and steps", "[graph][shape_inference]") {
  const std::int64_t end = std::numeric_limits<std::int64_t>::max();
  CHECK(one_op().in({10, 8}).ints({2}).ints({7}).shape("Slice") == "[5,8]");
  CHECK(one_op().in({10, 8}).ints({1}).ints({end}).ints({1}).shape("Slice") == "[10,7]");
  CHECK(one_op().in({10, 8}).ints({0, -3}).ints({-1, 100}).ints({0, 1}).ints({3, 1}).shape("Slice") == "[3,3]");
  CHECK(one_op().in({10}).ints({-1}).ints({std::numeric_limits<std::int64_t>::min()}).ints({0}).ints({-1}).shape("Slice") == "[10]");
  CHECK(one_op().in({10}).ints({8}).ints({2}).ints({0}).ints({-3}).shape("Slice") == "[2]");
  CHECK(one_op().in({10}).ints({5}).ints({2}).shape("Slice") == "[0]");
  CHECK(one_op().in({10}).ints({0}).ints({10}).ints({0}).ints({std::numeric_limits<std::int64_t>::min()}).shape("Slice") == "[0]");
  CHECK(one_op().in({10}).ints({9}).ints({-11}).ints({0}).ints({std::numeric_limits<std::int64_t>::min()}).shape("Slice") == "[1]");
  CHECK(one_op().in({"seq", 8}).ints({0}).ints({end}).shape("Slice") == "[seq,8]");
  CHECK(one_op().in({"seq", 8}).ints({1}).ints({end}).shape("Slice") == "[?,8]");
  CHECK(one_op().in({10, 8}).in({1}, dtype::i64).ints({5}).ints({1}).shape("Slice") == "[10,?]");           // computed starts
  CHECK(one_op().in({10, 8}).shape("Slice", {{"starts", tg::ints{1}}, {"ends", tg::ints{3}}}) == "[2,8]");  // opset 1
  CHECK_THROWS_MATCHES(one_op().in({10}).ints({0}).ints({5}).ints({0}).ints({0}).run("Slice"), graph_error, invalid("Slice 'n': step 0 on axis 0"));
  CHECK_THROWS_MATCHES(one_op().in({10, 8}).ints({0, 1}).ints({5}).run("Slice"), graph_error, invalid("Slice 'n': starts [0,1], ends [5]"));
  CHECK_THROWS_MATCHES(one_op().in({10, 8}).ints({0}).ints({5}).ints({2}).run("Slice"), graph_error,
                       is_error(errc::out_of_range, "graph", "Slice 'n': axes 2 is out of range for rank 2"));
}

TEST_CASE("graph: Gather, Shape, Constant and Expand", "[graph][shape_inference]") {
  CHECK(one_op().in({50, 16}).in({"batch", 7}, dtype::i64).shape("Gather") == "[batch,7,16]");
  CHECK(one_op().in({4, 50, 16}).in({3}, dtype::i32).shape("Gather", {{"axis", 1}}) == "[4,3,16]");
  CHECK(one_op().in({4, 5}).ints({-5, 4}).shape("Gather", {{"axis", 1}}) == "[4,2]");
  CHECK(one_op().in({4, 5}).in({}, dtype::i64).shape("Gather") == "[5]");
  CHECK_THROWS_MATCHES(one_op().in({4, 5}).ints({5}).run("Gather", {{"axis", 1}}), graph_error,
                       is_error(errc::out_of_range, "graph", "Gather 'n': index 5 is out of range for axis 1 of size 5"));
  CHECK_THROWS_MATCHES(one_op().in({4, 5}).in({2}).run("Gather"), graph_error, invalid("Gather 'n': indices 'b' are f32"));

  CHECK(one_op().in({"batch", 3, 5}).type("Shape") == "i64[3]");
  CHECK(one_op().in({2, 3, 5}).type("Shape", {{"start", 1}}) == "i64[2]");
  CHECK(one_op().in({2, 3, 5}).type("Shape", {{"start", -1}, {"end", 10}}) == "i64[1]");
  CHECK(one_op().in({}).type("Shape") == "i64[0]");

  CHECK(one_op().type("Constant", {{"value_ints", tg::ints{1, 2, 3}}}) == "i64[3]");
  CHECK(one_op().type("Constant", {{"value_float", 0.5}}) == "f32[]");
  CHECK(one_op().type("Constant", {{"value_floats", tg::floats{0.5}}}) == "f32[1]");
  CHECK(one_op().type("Constant", {{"value_int", 2}}) == "i64[]");
  CHECK_THROWS_MATCHES(one_op().run("Constant", {{"value_string", "x"}}), graph_error,
                       is_error(errc::unsupported, "graph", "Constant 'n': attribute 'value_string' is not taken here"));
  CHECK_THROWS_MATCHES(one_op().run("Constant"), graph_error, invalid("Constant 'n': needs exactly one value attribute, has 0"));

  CHECK(one_op().in({3, 1}).ints({2, 1, 6}).shape("Expand") == "[2,3,6]");
  CHECK(one_op().in({"batch", 1}).ints({1, 4}).shape("Expand") == "[batch,4]");
  CHECK_THROWS_MATCHES(one_op().in({3, 2}).ints({3, 4}).run("Expand"), graph_error, invalid("Expand 'n': shapes [3,2] and [3,4] do not broadcast"));
}

TEST_CASE("graph: ReduceMean and ReduceSum with axes as attribute or input, keepdims", "[graph][shape_inference]") {
  CHECK(one_op().in({2, 3, 4}).shape("ReduceMean", {{"axes", tg::ints{-1}}}) == "[2,3,1]");
  CHECK(one_op().in({2, 3, 4}).shape("ReduceMean", {{"axes", tg::ints{0, 2}}, {"keepdims", 0}}) == "[3]");
  CHECK(one_op().in({2, 3, 4}).ints({1}).shape("ReduceSum") == "[2,1,4]");
  CHECK(one_op().in({"batch", 3, 4}).ints({1}).shape("ReduceSum", {{"keepdims", 0}}) == "[batch,4]");
  CHECK(one_op().in({2, 3, 4}).shape("ReduceSum") == "[1,1,1]");  // no axes: all
  CHECK(one_op().in({2, 3, 4}).shape("ReduceSum", {{"keepdims", 0}}) == "[]");
  CHECK(one_op().in({2, 3, 4}).shape("ReduceSum", {{"noop_with_empty_axes", 1}}) == "[2,3,4]");
  CHECK(one_op().in({2, 3, 4}).in({1}, dtype::i64).shape("ReduceSum") == "[?,?,?]");  // computed axes, kept rank
  CHECK(one_op().in({2, 3, 4}).in({1}, dtype::i64).shape("ReduceSum", {{"keepdims", 0}}) == "[*]");
  CHECK_THROWS_MATCHES(one_op().in({2, 3}).ints({2}).run("ReduceMean"), graph_error,
                       is_error(errc::out_of_range, "graph", "ReduceMean 'n': axes 2 is out of range for rank 2"));
}

TEST_CASE("graph: Conv takes its kernel from the weight, with strides, pads, dilations and groups", "[graph][shape_inference]") {
  CHECK(one_op().in({1, 3, 32, 32}).in({16, 3, 3, 3}).shape("Conv") == "[1,16,30,30]");
  CHECK(one_op().in({"n", 3, 32, 32}).in({16, 3, 3, 3}).in({16}).shape("Conv", {{"pads", tg::ints{1, 1, 1, 1}}}) == "[n,16,32,32]");
  CHECK(one_op().in({1, 3, 32, 32}).in({16, 3, 3, 3}).shape("Conv", {{"strides", tg::ints{2, 2}}, {"pads", tg::ints{1, 1, 1, 1}}}) == "[1,16,16,16]");
  CHECK(one_op().in({1, 3, 32, 32}).in({16, 3, 3, 3}).shape("Conv", {{"dilations", tg::ints{2, 2}}}) == "[1,16,28,28]");
  CHECK(one_op().in({1, 8, 10, 12}).in({8, 1, 3, 5}).shape("Conv", {{"group", 8}}) == "[1,8,8,8]");
  CHECK(one_op().in({1, 3, 15, 15}).in({4, 3, 3, 3}).shape("Conv", {{"strides", tg::ints{2, 2}}, {"auto_pad", "SAME_UPPER"}}) == "[1,4,8,8]");
  CHECK(one_op().in({1, 3, 15}).in({4, 3, 3}).shape("Conv", {{"auto_pad", "VALID"}, {"pads", tg::ints{5, 5}}}) == "[1,4,13]");
  CHECK(one_op().in({1, 3, "h", 8}).in({4, 3, 3, 3}).shape("Conv") == "[1,4,?,6]");
  CHECK_THROWS_MATCHES(one_op().in({1, 4, 8, 8}).in({16, 3, 3, 3}).run("Conv"), graph_error,
                       invalid("Conv 'n': input 'a' has 4 channels, weight 'b' takes 3 per group x group 1"));
  CHECK_THROWS_MATCHES(one_op().in({1, 8, 8, 8}).in({16, 2, 3, 3}).run("Conv", {{"group", 2}}), graph_error,
                       invalid("Conv 'n': input 'a' has 8 channels, weight 'b' takes 2 per group x group 2"));
  CHECK_THROWS_MATCHES(one_op().in({1, 8, 8, 8}).in({6, 2, 3, 3}).run("Conv", {{"group", 4}}), graph_error,
                       invalid("Conv 'n': weight 'b' has 6 output channels, not a multiple of group 4"));
  CHECK_THROWS_MATCHES(one_op().in({1, 3, 8, 8}).in({4, 3, 3, 3}).in({5}).run("Conv"), graph_error,
                       invalid("Conv 'n': bias 'c' has shape [5], expected [4]"));
  CHECK_THROWS_MATCHES(one_op().in({1, 3, 2, 2}).in({4, 3, 3, 3}).run("Conv"), graph_error,
                       invalid("Conv 'n': spatial axis 0: the window spans 3 but the padded input has 2"));
  CHECK_THROWS_MATCHES(one_op().in({1, 3, 8, 8}).in({4, 3, 3, 3}).run("Conv", {{"strides", tg::ints{1}}}), graph_error,
                       invalid("Conv 'n': attribute 'strides' [1] has 1 values, expected 2"));
  CHECK_THROWS_MATCHES(one_op().in({1, 3, 8, 8}).in({4, 3, 3, 3}).run("Conv", {{"kernel_shape", tg::ints{3, 2}}}), graph_error,
                       invalid("Conv 'n': kernel_shape [3,2] differs from weight 'b' [4,3,3,3]"));
  CHECK_THROWS_MATCHES(one_op().in({3, 8}).in({4, 3}).run("Conv"), graph_error,
                       invalid("Conv 'n': input 'a' has shape [3,8]; Conv needs N, C and at least one spatial dim"));
  CHECK_THROWS_MATCHES(one_op().in({1, 3, 8, 8}).in({4, 3, 3, 3}).run("Conv", {{"auto_pad", "SAME"}}), graph_error,
                       invalid("Conv 'n': auto_pad 'SAME' is not NOTSET"));
}

TEST_CASE("graph: pools and BatchNormalization", "[graph][shape_inference]") {
  CHECK(one_op().in({1, 16, 32, 32}).shape("MaxPool", {{"kernel_shape", tg::ints{2, 2}}, {"strides", tg::ints{2, 2}}}) == "[1,16,16,16]");
  const auto mp = one_op().in({1, 1, 5, 5}).run("MaxPool", {{"kernel_shape", tg::ints{2, 2}}, {"strides", tg::ints{2, 2}}, {"ceil_mode", 1}}, 2);
  CHECK(mp[0].to_string() == "f32[1,1,3,3]");
  CHECK(mp[1].to_string() == "i64[1,1,3,3]");
  // ceil_mode rounds up, but never starts a window in the end padding: length 5 padded by 1 on each
  // side would give windows at 0, 2, 4 and 6, and 6 starts in the padding (PyTorch gives 3 as well).
  const tg::attribute_map ceil_pool = {{"kernel_shape", tg::ints{2}}, {"strides", tg::ints{2}}, {"pads", tg::ints{1, 1}}, {"ceil_mode", 1}};
  CHECK(one_op().in({1, 1, 5}).shape("MaxPool", ceil_pool) == "[1,1,3]");
  CHECK(one_op().in({1, 1, 6}).shape("MaxPool", ceil_pool) == "[1,1,4]");
  CHECK(one_op().in({2, 4, 7, 7}).shape("AveragePool", {{"kernel_shape", tg::ints{3, 3}}, {"pads", tg::ints{1, 1, 1, 1}}}) == "[2,4,7,7]");
  CHECK(one_op().in({"n", 64, 7, 7}).shape("GlobalAveragePool") == "[n,64,1,1]");
  CHECK_THROWS_MATCHES(one_op().in({1, 1, 4, 4}).run("MaxPool"), graph_error, invalid("MaxPool 'n': attribute 'kernel_shape' is required"));

  CHECK(one_op().in({"n", 3, 8, 8}).in({3}).in({3}).in({3}).in({3}).type("BatchNormalization") == "f32[n,3,8,8]");
  CHECK_THROWS_MATCHES(one_op().in({1, 3, 8, 8}).in({3}).in({4}).in({3}).in({3}).run("BatchNormalization"), graph_error,
                       invalid("BatchNormalization 'n': input 'c' has shape [4], expected [3] (the channels)"));
  CHECK_THROWS_MATCHES(one_op().in({1, 3}).in({3}).in({3}).in({3}).in({3}).run("BatchNormalization", {{"training_mode", 1}}), graph_error,
                       is_error(errc::unsupported, "graph", "BatchNormalization 'n': training_mode 1 is not supported"));
}

TEST_CASE("graph: LayerNormalization and its statistics outputs", "[graph][shape_inference]") {
  const auto ln = one_op().in({"batch", 6, 32}, dtype::bf16).in({32}, dtype::bf16).in({32}, dtype::bf16).run("LayerNormalization", {}, 3);
  CHECK(ln[0].to_string() == "bf16[batch,6,32]");
  CHECK(ln[1].to_string() == "f32[batch,6,1]");
  CHECK(ln[2].to_string() == "f32[batch,6,1]");
  const auto ln1 = one_op().in({2, 6, 32}).in({6, 32}).run("LayerNormalization", {{"axis", 1}}, 2);
  CHECK(ln1[1].to_string() == "f32[2,1,1]");
  CHECK_THROWS_MATCHES(one_op().in({2, 6, 64}).in({32}).run("LayerNormalization"), graph_error,
                       invalid("LayerNormalization 'n': scale 'b' [32] does not broadcast to the normalized shape [64]"));
  CHECK_THROWS_MATCHES(one_op().in({2, 6}).in({6}).run("LayerNormalization", {{"epsilon", 1}}), graph_error,
                       invalid("LayerNormalization 'n': attribute 'epsilon' is an int, expected a float"));
}

TEST_CASE("graph: unknown ops are an error, or leave their outputs unknown when allowed", "[graph][shape_inference]") {
  tg::graph g;
  g.add_input("x", dtype::f32, {2, 3});
  g.add_node("FancyAttention", "fa", {"x"}, {"a"}, {}, "com.example");
  g.add_node("Relu", "r", {"a"}, {"b"});
  g.add_node("Shape", "s", {"a"}, {"c"});
  g.add_node("Cast", "cast", {"a"}, {"d"}, {{"to", 1}});
  g.mark_output("b");
  CHECK_THROWS_MATCHES(g.infer_shapes(), graph_error,
                       is_error(errc::unsupported, "graph", "FancyAttention 'fa': unknown op 'com.example::FancyAttention'"));
  g.infer_shapes({.allow_unknown_ops = true});
  CHECK(type_of(g, "a") == "?[*]");
  CHECK(type_of(g, "b") == "?[*]");
  CHECK(type_of(g, "c") == "i64[?]");
  CHECK(type_of(g, "d") == "f32[*]");
  CHECK(tg::has_shape_rule("MatMul"));
  CHECK(!tg::has_shape_rule("FancyAttention"));
  // An ONNX op name in another domain is not ONNX's op.
  tg::graph h;
  h.add_input("x", dtype::f32, {2});
  h.add_node("Relu", "r", {"x"}, {"y"}, {}, "com.example");
  h.mark_output("y");
  CHECK_THROWS_MATCHES(h.infer_shapes(), graph_error, is_error(errc::unsupported, "graph", "Relu 'r': unknown op 'com.example::Relu'"));
}

TEST_CASE("graph: declared output types are checked and refine inference", "[graph][shape_inference]") {
  tg::graph g;
  g.add_input("x", dtype::f32, {tg::dim(), 8});
  g.add_input("w", dtype::f32, {8, 4});
  g.add_node("MatMul", "mm", {"x", "w"}, {"y"});
  g.mark_output("y");
  g.set_value_type(g.value_named("y"), dtype::f32, {"rows", 4});
  g.infer_shapes();
  CHECK(type_of(g, "y") == "f32[rows,4]");
  g.set_value_type(g.value_named("y"), dtype::f32, {2, 5});
  CHECK_THROWS_MATCHES(g.infer_shapes(), graph_error, invalid("MatMul 'mm': output 'y' is declared f32[2,5] but infers f32[?,4]"));
  g.set_value_type(g.value_named("y"), dtype::fp16, tg::tensor_shape::unknown_rank());
  CHECK_THROWS_MATCHES(g.infer_shapes(), graph_error, invalid("output 'y' is declared fp16[*] but infers f32[?,4]"));
}

TEST_CASE("graph: dim arithmetic that overflows is errc::overflow naming the node", "[graph][shape_inference]") {
  const std::int64_t big = std::int64_t{1} << 32;
  CHECK_THROWS_MATCHES(one_op().in({big, big, 2}).run("Flatten", {{"axis", 3}}), graph_error,
                       is_error(errc::overflow, "graph", "Flatten 'n': tessel::size: graph: dim product overflows"));
  CHECK_THROWS_MATCHES(one_op().in({big, big}).ints({-1}).run("Reshape"), graph_error,
                       is_error(errc::overflow, "graph", "Reshape 'n': tessel::size:"));
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  CHECK_THROWS_MATCHES(one_op().in({max}).in({max}).run("Concat", {{"axis", 0}}), graph_error, is_error(errc::overflow, "graph", "Concat 'n'"));
  CHECK(one_op().in({big, big / 2}).shape("Flatten") == "[4294967296,2147483648]");
}

TEST_CASE("graph: the fused ops' rules (domain tessel)", "[graph][shape_inference]") {
  // FusedMatMul: MatMul's broadcasting, bias and residual broadcast to the product.
  CHECK(one_op().fused().in({"batch", 6, 32}).in({32, 64}).in({64}).shape("FusedMatMul", {{"activation", "Gelu"}}) == "[batch,6,64]");
  CHECK(one_op().fused().in({2, 6, 32}).in({32, 64}).absent().in({2, 6, 64}).shape("FusedMatMul") == "[2,6,64]");
  CHECK_THROWS_MATCHES(one_op().fused().in({6, 32}).in({32, 64}).in({32}).run("FusedMatMul"), graph_error,
                       invalid("FusedMatMul 'n': bias 'c' [32] does not broadcast to [6,64]"));
  CHECK_THROWS_MATCHES(one_op().fused().in({6, 32}).in({32, 64}).run("FusedMatMul", {{"activation", "Swish"}}), graph_error,
                       is_error(errc::unsupported, "graph", "FusedMatMul 'n': activation 'Swish' is not one of"));
  CHECK_THROWS_MATCHES(one_op().fused().in({6, 32}).in({16, 64}).run("FusedMatMul"), graph_error, invalid("inner dims 32 and 16 differ"));
  // FusedConv: Conv's shape, and a residual of the output's shape.
  CHECK(one_op().fused().in({1, 8, 10, 10}).in({16, 8, 3, 3}).in({16}).shape("FusedConv", {{"pads", tg::ints{1, 1, 1, 1}}, {"activation", "Relu"}}) ==
        "[1,16,10,10]");
  CHECK_THROWS_MATCHES(one_op().fused().in({1, 8, 10, 10}).in({16, 8, 3, 3}).absent().in({1, 16, 10, 10}).run("FusedConv"), graph_error,
                       invalid("FusedConv 'n': residual 'd' [1,16,10,10] is not the output's shape [1,16,8,8]"));
  // The norms.
  CHECK(one_op().fused().in({"batch", 6, 32}).in({32}).type("RMSNormalization") == "f32[batch,6,32]");
  CHECK_THROWS_MATCHES(one_op().fused().in({2, 32}).in({16}).run("RMSNormalization"), graph_error,
                       invalid("RMSNormalization 'n': scale 'b' [16] does not broadcast to [32]"));
  const auto skip = one_op().fused().in({2, 6, 32}).in({2, 6, 32}).in({32}).in({32}).run("SkipLayerNormalization", {{"epsilon", 1e-6}}, 2);
  CHECK(skip[0].to_string() == "f32[2,6,32]");
  CHECK(skip[1].to_string() == "f32[2,6,32]");
  CHECK_THROWS_MATCHES(one_op().fused().in({2, 32}).in({2, 32}).in({32}).in({32}).run("SkipRMSNormalization"), graph_error,
                       invalid("SkipRMSNormalization 'n': takes 3 inputs, not 4"));
  // Attention: GQA, a broadcast mask, head dims of V.
  CHECK(one_op().fused().in({2, 8, 5, 16}).in({2, 2, 7, 16}).in({2, 2, 7, 24}).in({1, 1, 5, 7}).shape("Attention", {{"causal", 1}}) == "[2,8,5,24]");
  CHECK_THROWS_MATCHES(one_op().fused().in({2, 6, 5, 16}).in({2, 4, 7, 16}).in({2, 4, 7, 16}).run("Attention"), graph_error,
                       invalid("Attention 'n': query heads 6 are not a multiple of key/value heads 4"));
  CHECK_THROWS_MATCHES(one_op().fused().in({2, 4, 5, 16}).in({2, 4, 7, 8}).in({2, 4, 7, 16}).run("Attention"), graph_error,
                       invalid("Attention 'n': query and key head dims differ"));
  CHECK_THROWS_MATCHES(one_op().fused().in({2, 4, 5}).in({2, 4, 7, 8}).in({2, 4, 7, 16}).run("Attention"), graph_error,
                       invalid("Attention 'n': input 'a' has shape [2,4,5]; Attention takes [batch, heads, seq, head dim]"));
  // An unknown op of the tessel domain is named with its domain.
  CHECK_THROWS_MATCHES(one_op().fused().in({2}).run("FusedSoftmax"), graph_error,
                       is_error(errc::unsupported, "graph", "unknown op 'tessel::FusedSoftmax'"));
}

}  // namespace tessel_test_graph_shape_inference
