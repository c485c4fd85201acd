// graph/fold.hpp: constant folding (the exporter's shape chains with static, symbolic and bound dims;
// the integer and float evaluator op by op; the size cap; typed errors), CSE and dead-code removal.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <tessel/graph.hpp>
#include "error_match.hpp"
#include "graph/exported_models.hpp"

namespace tessel_test_graph_fold {

using tessel::dtype;
using tessel::errc;
using tessel_test::is_error;
using namespace tessel_test_graph;
using tg::graph_error;

std::vector<float> floats_of(const tg::graph& g, const std::string& name) {
  const tg::value& x = g.get(g.value_named(name));
  REQUIRE(x.role == tg::value_role::constant);
  REQUIRE(*x.type == dtype::f32);
  std::vector<float> r(x.data->size() / 4);
  std::memcpy(r.data(), x.data->data(), x.data->size());
  return r;
}

tg::ints ints_of(const tg::graph& g, const std::string& name) {
  const tg::value_id v = g.value_named(name);
  REQUIRE(g.get(v).role == tg::value_role::constant);
  auto r = g.constant_ints(v);
  REQUIRE(r.has_value());
  return *r;
}

std::vector<std::uint8_t> bytes_of(const tg::graph& g, const std::string& name) {
  const tg::value& x = g.get(g.value_named(name));
  REQUIRE(x.role == tg::value_role::constant);
  std::vector<std::uint8_t> r(x.data->size());
  std::memcpy(r.data(), x.data->data(), x.data->size());
  return r;
}

// Reshape(x, Concat(dim(x, 0), dim(x, 1), [H], [HD])) of x [b0, 6, 32] (the exporter's split of heads),
// and a second Reshape of y by the dims of x (not its own input).
tg::graph heads_graph(tg::dim b0) {
  tg::graph g("heads");
  builder b{g};
  g.add_input("x", dtype::f32, {b0, S, D});
  g.add_input("y", dtype::f32, {b0, S, D});
  const std::string shape = b.op("Concat", {b.dim_of("x", 0), b.dim_of("x", 1), b.i64s({H}), b.i64s({HD})}, {{"axis", std::int64_t{0}}});
  g.add_node("Reshape", "split_x", {"x", shape}, {"xh"});
  g.add_node("Reshape", "split_y", {"y", shape}, {"yh"});
  g.mark_output("xh");
  g.mark_output("yh");
  return g;
}

TEST_CASE("graph passes: the exporter's Shape-Gather-Unsqueeze-Concat-Reshape chain folds to a constant shape", "[graph][fold]") {
  tg::graph g = heads_graph(2);
  g.infer_shapes();
  const std::size_t before = g.node_count();
  CHECK(before == 9);                 // 2 x (Shape, Gather, Unsqueeze), Concat, 2 Reshapes
  CHECK(tg::fold_constants(g) == 7);  // all but the Reshapes
  tg::remove_dead_code(g);
  g.verify();
  CHECK(g.node_count() == 2);
  CHECK(g.count_by_op().at("Reshape") == 2);
  const tg::node& rs = g.get(g.node_named("split_y"));
  CHECK(g.constant_ints(rs.inputs[1]) == tg::ints{2, 6, 4, 8});
  g.infer_shapes();
  CHECK(g.get(g.value_named("yh")).shape.to_string() == "[2,6,4,8]");
}

TEST_CASE("graph passes: a symbolic batch keeps the chain unless the dim is copied in place or bound", "[graph][fold]") {
  SECTION("symbolic: the sequence dim folds; x's own reshape takes 0 for batch; y's stays computed") {
    tg::graph g = heads_graph("batch");
    g.infer_shapes();
    tg::fold_constants(g);
    tg::remove_dead_code(g);
    g.verify();
    g.infer_shapes();
    const tg::node& rx = g.get(g.node_named("split_x"));
    REQUIRE(g.get(rx.inputs[1]).role == tg::value_role::constant);
    CHECK(g.constant_ints(rx.inputs[1]) == tg::ints{0, 6, 4, 8});
    CHECK(g.get(g.value_named("xh")).shape.to_string() == "[batch,6,4,8]");
    const tg::node& ry = g.get(g.node_named("split_y"));
    CHECK(g.get(ry.inputs[1]).role == tg::value_role::node_output);  // batch of x is unknown here
    const auto ops = g.count_by_op();
    CHECK(ops.at("Shape") == 1);   // dim 0 of x
    CHECK(ops.at("Gather") == 1);  // dim 1 (6) folded
    CHECK(ops.at("Concat") == 1);
  }
  SECTION("bound: batch = 3 folds everything") {
    tg::graph g = heads_graph("batch");
    g.infer_shapes();
    tg::fold_options opt;
    opt.bindings["batch"] = 3;
    tg::fold_constants(g, opt);
    tg::remove_dead_code(g);
    g.verify();
    CHECK(g.node_count() == 2);
    CHECK(g.constant_ints(g.get(g.node_named("split_y")).inputs[1]) == tg::ints{3, 6, 4, 8});
  }
  SECTION("a binding for another symbol changes nothing about batch") {
    tg::graph g = heads_graph("batch");
    g.infer_shapes();
    tg::fold_options opt;
    opt.bindings["seq"] = 3;
    tg::fold_constants(g, opt);
    tg::remove_dead_code(g);
    CHECK(g.get(g.get(g.node_named("split_y")).inputs[1]).role == tg::value_role::node_output);
  }
}

TEST_CASE("graph passes: the reshape rewrite takes only dims copied at their own position", "[graph][fold]") {
  tg::graph g("swap");
  builder b{g};
  g.add_input("x", dtype::f32, {"batch", "seq", D});
  // [seq, batch, 32]: dims read from x but at other positions: not a copy.
  const std::string shape = b.op("Concat", {b.dim_of("x", 1), b.dim_of("x", 0), b.i64s({D})}, {{"axis", std::int64_t{0}}});
  g.add_node("Reshape", "rs", {"x", shape}, {"y"});
  g.mark_output("y");
  g.infer_shapes();
  tg::fold_constants(g);
  CHECK(g.get(g.get(g.node_named("rs")).inputs[1]).role == tg::value_role::node_output);
}

// One node over constants, folded: the value it defined is then a constant of the same name.
struct one_node {
  tg::graph g{"one"};
  builder b{g};
  std::string run(const std::string& op, const std::vector<std::string>& in, tg::attribute_map attrs = {}, tg::fold_options opt = {}) {
    const std::string out = b.op(op, in, std::move(attrs));
    g.mark_output(out);
    g.infer_shapes({.allow_unknown_ops = true});
    folded = tg::fold_constants(g, opt);
    tg::remove_dead_code(g);
    g.verify();
    return out;
  }
  std::size_t folded = 0;
};

TEST_CASE("graph passes: integer shape arithmetic folds exactly", "[graph][fold]") {
  SECTION("Gather with negative and 2-D indices") {
    one_node t;
    t.g.add_constant<std::int64_t>("ix", {2, 2}, std::vector<std::int64_t>{-1, 0, 1, -2});
    const auto y = t.run("Gather", {t.b.i64s({10, 20, 30}), "ix"});
    CHECK(ints_of(t.g, y) == tg::ints{30, 10, 20, 20});
    CHECK(t.g.get(t.g.value_named(y)).shape.to_string() == "[2,2]");
  }
  SECTION("Gather along axis 1") {
    one_node t;
    t.g.add_constant<std::int64_t>("m", {2, 3}, std::vector<std::int64_t>{1, 2, 3, 4, 5, 6});
    const auto y = t.run("Gather", {"m", t.b.i64s({2, 0})}, {{"axis", std::int64_t{1}}});
    CHECK(ints_of(t.g, y) == tg::ints{3, 1, 6, 4});
  }
  SECTION("Concat, Unsqueeze, Squeeze") {
    one_node t;
    const auto c = t.b.op("Concat", {t.b.i64s({1, 2}), t.b.i64s({3})}, {{"axis", std::int64_t{0}}});
    const auto u = t.b.op("Unsqueeze", {c, t.b.i64s({0})});
    const auto y = t.run("Squeeze", {u, t.b.i64s({0})});
    CHECK(ints_of(t.g, y) == tg::ints{1, 2, 3});
    CHECK(t.folded == 3);
    CHECK(t.g.node_count() == 0);
  }
  SECTION("Slice with negative starts, clamped ends and a negative step") {
    one_node t;
    const auto a = t.b.op("Slice", {t.b.i64s({0, 1, 2, 3, 4, 5}), t.b.i64s({-4}), t.b.i64s({1000})});
    t.g.mark_output(a);
    const auto y = t.run("Slice", {a, t.b.i64s({-1}), t.b.i64s({-1000}), t.b.i64s({0}), t.b.i64s({-2})});
    CHECK(ints_of(t.g, a) == tg::ints{2, 3, 4, 5});
    CHECK(ints_of(t.g, y) == tg::ints{5, 3});
  }
  SECTION("Add, Sub, Mul, Div (truncating) broadcast") {
    one_node t;
    const auto s = t.b.op("Sub", {t.b.i64s({7, -7}), t.b.i64(1)});
    const auto m = t.b.op("Mul", {s, t.b.i64s({2, 3})});
    const auto d = t.b.op("Div", {m, t.b.i64(4)});
    for (const auto& v : {s, m, d}) t.g.mark_output(v);
    const auto y = t.run("Add", {d, t.b.i64(100)});
    CHECK(ints_of(t.g, s) == tg::ints{6, -8});
    CHECK(ints_of(t.g, m) == tg::ints{12, -24});
    CHECK(ints_of(t.g, d) == tg::ints{3, -6});
    CHECK(ints_of(t.g, y) == tg::ints{103, 94});
  }
  SECTION("integer division by zero and overflow stay nodes") {
    one_node t;
    const auto d = t.b.op("Div", {t.b.i64s({1}), t.b.i64(0)});
    const auto y = t.run("Mul", {t.b.i64s({std::int64_t{1} << 62}), t.b.i64(4)});
    CHECK(t.folded == 0);
    CHECK(t.g.count_by_op().at("Mul") == 1);
    (void)d;
  }
  SECTION("Equal and Where pick per element; Range; ConstantOfShape; Expand; Reshape with 0 and -1; Cast") {
    one_node t;
    const auto eq = t.b.op("Equal", {t.b.i64s({1, 2, 3}), t.b.i64(2)});
    const auto wh = t.b.op("Where", {eq, t.b.i64s({-1, -1, -1}), t.b.i64s({4, 5, 6})});
    const auto rg = t.b.op("Range", {t.b.i64(5), t.b.i64(-2), t.b.i64(-3)});
    const auto co = t.b.op("ConstantOfShape", {t.b.i64s({2, 2})}, {{"value", std::int64_t{7}}});
    const auto ex = t.b.op("Expand", {t.b.i64s({1, 2}), t.b.i64s({2, 1, 2})});
    const auto rs = t.b.op("Reshape", {ex, t.b.i64s({0, -1})});
    for (const auto& v : {eq, wh, rg, co, ex, rs}) t.g.mark_output(v);
    const auto y = t.run("Cast", {t.b.f32(-2.75f)}, {{"to", std::int64_t{7}}});
    CHECK(bytes_of(t.g, eq) == std::vector<std::uint8_t>{0, 1, 0});
    CHECK(ints_of(t.g, wh) == tg::ints{4, -1, 6});
    CHECK(ints_of(t.g, rg) == tg::ints{5, 2, -1});
    CHECK(ints_of(t.g, co) == tg::ints{7, 7, 7, 7});
    CHECK(ints_of(t.g, ex) == tg::ints{1, 2, 1, 2});
    CHECK(t.g.get(t.g.value_named(ex)).shape.to_string() == "[2,1,2]");
    CHECK(t.g.get(t.g.value_named(rs)).shape.to_string() == "[2,2]");
    CHECK(ints_of(t.g, y) == tg::ints{-2});
    CHECK(t.g.node_count() == 0);
  }
  SECTION("a Constant node becomes a graph constant") {
    one_node t;
    const auto c = t.b.op("Constant", {}, {{"value_ints", tg::ints{4, 5}}});
    const auto y = t.run("Add", {c, t.b.i64(1)});
    CHECK(ints_of(t.g, y) == tg::ints{5, 6});
  }
}

TEST_CASE("graph passes: float constants fold elementwise to the float result", "[graph][fold]") {
  SECTION("Sqrt, Reciprocal, Div: the correctly rounded float") {
    one_node t;
    const auto s = t.b.op("Sqrt", {t.b.f32(2.0f)});
    const auto r = t.b.op("Reciprocal", {s});
    t.g.mark_output(s);
    t.g.mark_output(r);
    const auto y = t.run("Div", {t.b.f32(1.0f), t.b.f32(3.0f)});
    CHECK(floats_of(t.g, s) == std::vector<float>{std::sqrt(2.0f)});
    CHECK(floats_of(t.g, r) == std::vector<float>{1.0f / std::sqrt(2.0f)});
    CHECK(floats_of(t.g, y) == std::vector<float>{1.0f / 3.0f});
  }
  SECTION("Transpose of a weight") {
    one_node t;
    t.g.add_constant<float>("w", {2, 3}, std::vector<float>{1, 2, 3, 4, 5, 6});
    const auto y = t.run("Transpose", {"w"});
    CHECK(floats_of(t.g, y) == std::vector<float>{1, 4, 2, 5, 3, 6});
    CHECK(t.g.get(t.g.value_named(y)).shape.to_string() == "[3,2]");
  }
  SECTION("Transpose with a perm of rank 3") {
    one_node t;
    std::vector<float> v(24);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
    t.g.add_constant<float>("w", {2, 3, 4}, v);
    const auto y = t.run("Transpose", {"w"}, {{"perm", tg::ints{1, 2, 0}}});
    const auto got = floats_of(t.g, y);
    REQUIRE(got.size() == 24);
    for (int a = 0; a < 3; ++a)
      for (int c = 0; c < 4; ++c)
        for (int bb = 0; bb < 2; ++bb)
          CHECK(got[static_cast<std::size_t>((a * 4 + c) * 2 + bb)] == v[static_cast<std::size_t>((bb * 3 + a) * 4 + c)]);
  }
  SECTION("Pow, Neg, Tanh, Erf; Cast i64 -> f32") {
    one_node t;
    const auto p = t.b.op("Pow", {t.b.f32(3.0f), t.b.f32(2.0f)});
    const auto n = t.b.op("Neg", {p});
    const auto th = t.b.op("Tanh", {t.b.f32(0.5f)});
    const auto e = t.b.op("Erf", {t.b.f32(0.5f)});
    for (const auto& v : {n, th, e}) t.g.mark_output(v);
    const auto y = t.run("Cast", {t.b.i64s({3, -4})}, {{"to", std::int64_t{1}}});
    CHECK(floats_of(t.g, n) == std::vector<float>{-9.0f});
    CHECK(floats_of(t.g, th) == std::vector<float>{static_cast<float>(std::tanh(0.5))});
    CHECK(floats_of(t.g, e) == std::vector<float>{static_cast<float>(std::erf(0.5))});
    CHECK(floats_of(t.g, y) == std::vector<float>{3.0f, -4.0f});
  }
  SECTION("a graph input blocks folding") {
    one_node t;
    t.g.add_input("x", dtype::f32, {2});
    t.run("Sqrt", {t.b.op("Add", {"x", t.b.f32(1.0f)})});
    CHECK(t.folded == 0);
    CHECK(t.g.node_count() == 2);
  }
}

TEST_CASE("graph passes: the size cap keeps large constants as nodes", "[graph][fold]") {
  one_node t;
  tg::fold_options opt;
  opt.max_constant_bytes = 4096;
  const auto small = t.b.op("ConstantOfShape", {t.b.i64s({32, 32})}, {{"value", 1.5}});  // 4 KiB: at the cap
  const auto big = t.b.op("ConstantOfShape", {t.b.i64s({33, 32})}, {{"value", 1.5}});    // over it
  t.g.mark_output(small);
  t.run("Identity", {big}, {}, opt);
  CHECK(t.g.get(t.g.value_named(small)).role == tg::value_role::constant);
  CHECK(floats_of(t.g, small).size() == 1024);
  CHECK(t.g.get(t.g.value_named(big)).role == tg::value_role::node_output);
  CHECK(t.g.count_by_op().at("ConstantOfShape") == 1);
}

TEST_CASE("graph passes: folding a node that is wrong is a typed error naming it", "[graph][fold]") {
  tg::graph g("bad");
  builder b{g};
  g.add_node("Gather", "pick", {b.i64s({1, 2, 3}), b.i64s({3})}, {"y"});
  g.mark_output("y");
  CHECK_THROWS_MATCHES(tg::fold_constants(g), graph_error, is_error(errc::out_of_range, "graph", "Gather 'pick': index 3"));
  tg::graph h("bad_range");  // Range has no shape rule: only the evaluator sees this
  builder c{h};
  h.add_node("Range", "steps", {c.i64(0), c.i64(4), c.i64(0)}, {"y"});
  h.mark_output("y");
  CHECK_THROWS_MATCHES(tg::fold_constants(h), graph_error, is_error(errc::invalid_argument, "graph", "Range 'steps': delta 0"));
}

TEST_CASE("graph passes: CSE merges identical constants and nodes, never graph outputs", "[graph][cse]") {
  tg::graph g("cse");
  g.add_input("x", dtype::f32, {"batch", 4});
  g.add_constant<float>("two_a", {}, std::vector<float>{2.0f});
  g.add_constant<float>("two_b", {}, std::vector<float>{2.0f});
  g.add_constant<float>("three", {}, std::vector<float>{3.0f});
  g.add_node("Mul", "m1", {"x", "two_a"}, {"a"});
  g.add_node("Mul", "m2", {"x", "two_b"}, {"b"});  // same as m1 once the constants merge
  g.add_node("Mul", "m3", {"x", "three"}, {"c"});  // another constant
  g.add_node("Softmax", "s1", {"a"}, {"sa"}, {{"axis", std::int64_t{1}}});
  g.add_node("Softmax", "s2", {"b"}, {"sb"}, {{"axis", std::int64_t{0}}});  // another attribute
  g.add_node("Softmax", "s3", {"b"}, {"sc"}, {{"axis", std::int64_t{1}}});  // same as s1 after m2 -> m1
  g.add_node("Add", "out1", {"sa", "sb"}, {"y1"});
  g.add_node("Add", "out2", {"sc", "c"}, {"y2"});
  g.add_node("Relu", "r1", {"y1"}, {"z1"});
  g.add_node("Relu", "r2", {"y1"}, {"z2"});  // same as r1, but both are graph outputs
  g.mark_output("y2");
  g.mark_output("z1");
  g.mark_output("z2");
  CHECK(tg::eliminate_common_subexpressions(g) == 3);  // two_b, m2, s3
  g.verify();
  CHECK_FALSE(g.find_value("two_b"));
  CHECK_FALSE(g.find_node("m2"));
  CHECK_FALSE(g.find_node("s3"));
  CHECK(g.find_node("s2"));
  CHECK(g.find_node("m3"));
  CHECK(g.find_node("r1"));
  CHECK(g.find_node("r2"));
  CHECK(g.get(g.node_named("out2")).inputs[0] == g.value_named("sa"));
  CHECK(g.get(g.node_named("s2")).inputs[0] == g.value_named("a"));
  g.infer_shapes();
}

TEST_CASE("graph passes: CSE tells attributes apart exactly", "[graph][cse]") {
  tg::graph g("eps");
  g.add_input("x", dtype::f32, {2, D});
  weight(g, "gamma", {D});
  g.add_node("LayerNormalization", "a", {"x", "gamma"}, {"ya"}, {{"epsilon", 1e-5}});
  g.add_node("LayerNormalization", "b", {"x", "gamma"}, {"yb"}, {{"epsilon", 1.000001e-5}});  // the same to 6 digits
  g.add_node("LayerNormalization", "c", {"x", "gamma"}, {"yc"}, {{"epsilon", 1e-5}});
  g.add_node("Add", "ab", {"ya", "yb"}, {"s"});
  g.add_node("Add", "sc", {"s", "yc"}, {"y"});
  g.mark_output("y");
  CHECK(tg::eliminate_common_subexpressions(g) == 1);
  CHECK(g.find_node("b"));
  CHECK_FALSE(g.find_node("c"));
  CHECK(g.get(g.node_named("sc")).inputs[1] == g.value_named("ya"));
}

TEST_CASE("graph passes: CSE merges the exporter's repeated Shape reads", "[graph][cse]") {
  tg::graph g("shapes");
  builder b{g};
  g.add_input("x", dtype::f32, {"batch", "seq", D});
  const std::string shape = b.op("Concat", {b.dim_of("x", 0), b.dim_of("x", 1), b.i64s({D})}, {{"axis", std::int64_t{0}}});
  g.add_node("Expand", "ex", {"x", shape}, {"y"});
  g.mark_output("y");
  CHECK(g.count_by_op().at("Shape") == 2);
  tg::eliminate_common_subexpressions(g);
  CHECK(g.count_by_op().at("Shape") == 1);
  CHECK(g.count_by_op().at("Gather") == 2);  // different indices
  g.verify();
}

TEST_CASE("graph passes: dead-code removal takes unreachable nodes and unread constants", "[graph][dce]") {
  tg::graph g("dead");
  g.add_input("x", dtype::f32, {4});
  g.add_constant<float>("c", {}, std::vector<float>{1.0f});
  g.add_constant<float>("unused", {}, std::vector<float>{2.0f});
  g.add_node("Add", "live", {"x", "c"}, {"y"});
  g.add_node("Relu", "dead1", {"y"}, {"d1"});
  g.add_node("Neg", "dead2", {"d1"}, {"d2"});
  g.mark_output("y");
  const tg::node_id dead = g.node_named("dead2");
  const tg::value_id unused = g.value_named("unused");
  CHECK(g.contains(dead));
  CHECK(g.contains(unused));
  CHECK(tg::remove_dead_code(g) == 2);
  CHECK_FALSE(g.contains(dead));
  CHECK_FALSE(g.contains(unused));
  CHECK_FALSE(g.contains(static_cast<tg::node_id>(1000)));
  g.verify();
  CHECK(g.node_count() == 1);
  CHECK(g.constants().size() == 1);
  CHECK_FALSE(g.find_value("unused"));
  CHECK(g.find_value("c"));
}

}  // namespace tessel_test_graph_fold
