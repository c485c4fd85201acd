// graph/ir.hpp: building graphs by name (in any order), lookups, the printer, a deterministic
// topological order, verify() and every rule it enforces (each error names the node or value), typed
// attributes, constants and their byte counts, and the rewiring helpers a fusion pass uses.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <tessel/graph.hpp>
#include "error_match.hpp"
#include "graph/graph_models.hpp"

namespace tessel_test_graph_ir {

using tessel::dtype;
using tessel::errc;
using tessel_test::is_error;
using namespace tessel_test_graph;
using tg::graph_error;

std::shared_ptr<const std::vector<std::byte>> bytes(std::size_t n) { return std::make_shared<std::vector<std::byte>>(n); }

std::vector<std::string> op_names(const tg::graph& g, const std::vector<tg::node_id>& order) {
  std::vector<std::string> r;
  for (tg::node_id n : order) r.push_back(g.get(n).name);
  return r;
}

TEST_CASE("graph: an MLP builds, verifies and prints with its inferred shapes", "[graph][ir]") {
  tg::graph g = make_mlp();
  g.verify();
  CHECK(g.node_count() == 4);
  CHECK(g.inputs().size() == 1);
  CHECK(g.constants().size() == 4);
  CHECK(g.outputs().size() == 1);
  CHECK(g.get(g.value_named("h")).shape.to_string() == "[*]");  // nothing inferred yet
  g.infer_shapes();
  CHECK(g.to_string() ==
        "graph mlp(%x: f32[batch,16])\n"
        "  const %w1: f32[32,16]\n"
        "  const %b1: f32[32]\n"
        "  const %w2: f32[32,4]\n"
        "  const %b2: f32[4]\n"
        "  %h: f32[batch,32] = Gemm(%x, %w1, %b1) {transB=1}  # fc1\n"
        "  %a: f32[batch,32] = Relu(%h)  # act\n"
        "  %z: f32[batch,4] = MatMul(%a, %w2)  # fc2\n"
        "  %y: f32[batch,4] = Add(%z, %b2)  # bias2\n"
        "return %y\n");
  const auto counts = g.count_by_op();
  CHECK(counts.size() == 4);
  CHECK(counts.at("Gemm") == 1);
  CHECK(counts.at("Relu") == 1);
  CHECK(counts.at("MatMul") == 1);
  CHECK(counts.at("Add") == 1);
}

TEST_CASE("graph: the transformer block verifies, counts its ops and prints one line per node", "[graph][ir]") {
  tg::graph g = make_transformer_block();
  g.verify();
  g.infer_shapes();
  const auto counts = g.count_by_op();
  CHECK(counts.at("MatMul") == 8);
  CHECK(counts.at("Add") == 8);
  CHECK(counts.at("Reshape") == 4);
  CHECK(counts.at("Transpose") == 4);
  CHECK(counts.at("LayerNormalization") == 2);
  CHECK(counts.at("Softmax") == 1);
  CHECK(counts.at("Gelu") == 1);
  CHECK(counts.at("Mul") == 1);
  const std::string s = g.to_string();
  CHECK(s.find("  %qt: f32[batch,4,6,8] = Transpose(%q_heads) {perm=[0,2,1,3]}  # q_t\n") != std::string::npos);
  CHECK(s.find("  %n1: f32[batch,6,32] = LayerNormalization(%x, %ln1_g, %ln1_b) {axis=-1, epsilon=1e-05}  # ln1\n") != std::string::npos);
  CHECK(s.find("  const %heads_shape: i64[4]\n") != std::string::npos);
  std::size_t lines = 0;
  for (char ch : s) lines += ch == '\n';
  CHECK(lines == 1 + g.constants().size() + g.node_count() + 1);
}

TEST_CASE("graph: lookups by name and id", "[graph][ir]") {
  tg::graph g = make_mlp();
  const tg::value_id h = g.value_named("h");
  const tg::node_id fc1 = g.node_named("fc1");
  CHECK(g.get(h).producer == fc1);
  CHECK(g.get(h).role == tg::value_role::node_output);
  REQUIRE(g.get(h).consumers.size() == 1);
  CHECK(g.get(g.get(h).consumers[0].node).name == "act");
  CHECK(g.get(g.value_named("x")).role == tg::value_role::input);
  CHECK(g.get(g.value_named("w1")).role == tg::value_role::constant);
  CHECK(g.get(g.value_named("y")).is_output);
  CHECK(g.get(fc1).label() == "Gemm 'fc1'");
  CHECK(!g.find_value("nope"));
  CHECK(!g.find_node("nope"));
  CHECK_THROWS_MATCHES(g.value_named("nope"), graph_error, is_error(errc::out_of_range, "graph", "value 'nope': no such value"));
  CHECK_THROWS_MATCHES(g.node_named("nope"), graph_error, is_error(errc::out_of_range, "graph", "node 'nope': no such node"));
  CHECK_THROWS_MATCHES(g.get(static_cast<tg::value_id>(999)), graph_error, is_error(errc::out_of_range, "graph", "value id 999"));
  CHECK_THROWS_MATCHES(g.get(static_cast<tg::node_id>(999)), graph_error, is_error(errc::out_of_range, "graph", "node id 999"));
}

TEST_CASE("graph: nodes may come before the values they read", "[graph][ir]") {
  tg::graph g("reversed");
  g.add_node("Relu", "second", {"h"}, {"y"});
  g.add_node("Neg", "first", {"x"}, {"h"});
  g.add_input("x", dtype::f32, {3});
  g.mark_output("y");
  g.verify();
  CHECK(op_names(g, g.topological_order()) == std::vector<std::string>{"first", "second"});
  g.infer_shapes();
  CHECK(g.get(g.value_named("y")).type_info().to_string() == "f32[3]");
  // An empty node name is generated from the op.
  const tg::node_id n = g.add_node("Identity", "", {"y"}, {"y2"});
  CHECK(g.get(n).name == "Identity_2");
}

TEST_CASE("graph: topological order is deterministic: producers first, then the earliest added", "[graph][ir]") {
  // A diamond plus an independent branch, added in a scrambled order.
  auto build = [] {
    tg::graph g;
    g.add_input("x", dtype::f32, {4});
    g.add_node("Add", "join", {"l", "r"}, {"j"});
    g.add_node("Relu", "left", {"s"}, {"l"});
    g.add_node("Neg", "solo", {"x"}, {"o"});
    g.add_node("Exp", "right", {"s"}, {"r"});
    g.add_node("Abs", "split", {"x"}, {"s"});
    g.mark_output("j");
    g.mark_output("o");
    return g;
  };
  const tg::graph a = build(), b = build();
  const auto order = op_names(a, a.topological_order());
  CHECK(order == std::vector<std::string>{"solo", "split", "left", "right", "join"});
  CHECK(op_names(b, b.topological_order()) == order);
  CHECK(op_names(a, a.topological_order()) == order);  // and again: no hidden state
  // Every node comes after the producers of its inputs.
  const auto ids = a.topological_order();
  for (std::size_t i = 0; i < ids.size(); ++i)
    for (tg::value_id v : a.get(ids[i]).inputs) {
      const tg::value& x = a.get(v);
      if (x.role != tg::value_role::node_output) continue;
      const auto p = std::find(ids.begin(), ids.end(), x.producer);
      CHECK(p - ids.begin() < static_cast<std::ptrdiff_t>(i));
    }
}

TEST_CASE("graph: an input nothing defines is an error naming the node and the value", "[graph][ir]") {
  tg::graph g;
  g.add_input("x", dtype::f32, {2});
  g.add_node("Add", "sum", {"x", "z"}, {"y"});
  g.mark_output("y");
  CHECK_THROWS_MATCHES(g.verify(), graph_error,
                       is_error(errc::invalid_argument, "graph", "Add 'sum': input 'z' is not defined by any node, graph input or constant"));
  CHECK_THROWS_MATCHES(g.infer_shapes(), graph_error, is_error(errc::invalid_argument, "graph", "Add 'sum': input 'z' is not defined"));
  // Defining it later repairs the graph.
  g.add_input("z", dtype::f32, {2});
  g.verify();

  tg::graph h;
  h.add_input("x", dtype::f32, {2});
  h.mark_output("ghost");
  CHECK_THROWS_MATCHES(h.verify(), graph_error, is_error(errc::invalid_argument, "graph", "graph output 'ghost' is not defined"));

  tg::graph none;
  none.add_input("x", dtype::f32, {2});
  CHECK_THROWS_MATCHES(none.verify(), graph_error, is_error(errc::invalid_argument, "graph", "no graph outputs"));
}

TEST_CASE("graph: a value has one producer", "[graph][ir]") {
  tg::graph g = make_mlp();
  CHECK_THROWS_MATCHES(g.add_node("Relu", "again", {"x"}, {"h"}), graph_error,
                       is_error(errc::invalid_argument, "graph", "Relu 'again': output 'h' is already the output of Gemm 'fc1'"));
  CHECK_THROWS_MATCHES(g.add_node("Relu", "over_input", {"h"}, {"x"}), graph_error,
                       is_error(errc::invalid_argument, "graph", "Relu 'over_input': output 'x' is already a graph input"));
  CHECK_THROWS_MATCHES(g.add_node("Relu", "over_const", {"h"}, {"w1"}), graph_error,
                       is_error(errc::invalid_argument, "graph", "output 'w1' is already a constant"));
  CHECK_THROWS_MATCHES(g.add_node("Split", "twice", {"h"}, {"p", "p"}), graph_error,
                       is_error(errc::invalid_argument, "graph", "Split 'twice': output 'p' is listed twice"));
  CHECK_THROWS_MATCHES(g.add_input("h", dtype::f32, {1}), graph_error,
                       is_error(errc::invalid_argument, "graph", "graph input 'h': the name is already the output of Gemm 'fc1'"));
  CHECK_THROWS_MATCHES(g.add_constant_ints("x", {1}), graph_error,
                       is_error(errc::invalid_argument, "graph", "constant 'x': the name is already a graph input"));
  // A failed add leaves the graph as it was.
  CHECK(g.node_count() == 4);
  CHECK(!g.find_node("again"));
  CHECK(!g.find_value("p"));
  g.verify();
}

TEST_CASE("graph: node names are unique", "[graph][ir]") {
  tg::graph g = make_mlp();
  CHECK_THROWS_MATCHES(g.add_node("Relu", "fc1", {"y"}, {"y2"}), graph_error,
                       is_error(errc::invalid_argument, "graph", "duplicate node name: Relu 'fc1' and Gemm 'fc1'"));
  CHECK_THROWS_MATCHES(g.mark_output("y"), graph_error, is_error(errc::invalid_argument, "graph", "value 'y': already a graph output"));
  CHECK_THROWS_MATCHES(g.add_node("", "n", {"y"}, {"y3"}), graph_error, is_error(errc::invalid_argument, "graph", "empty op type"));
}

TEST_CASE("graph: a cycle is an error that names the nodes on it", "[graph][ir]") {
  tg::graph g;
  g.add_input("x", dtype::f32, {2});
  g.add_node("Neg", "downstream", {"c"}, {"y"});  // reads the cycle, is not on it
  g.add_node("Add", "a", {"x", "c"}, {"b"});
  g.add_node("Relu", "r", {"b"}, {"c"});
  g.mark_output("y");
  const auto on_cycle = is_error(errc::invalid_argument, "graph", "graph has a cycle: Add 'a' -> Relu 'r' -> Add 'a'");
  CHECK_THROWS_MATCHES(g.topological_order(), graph_error, on_cycle);
  CHECK_THROWS_MATCHES(g.verify(), graph_error, on_cycle);
  CHECK_THROWS_MATCHES(g.infer_shapes(), graph_error, on_cycle);
  try {
    (void)g.topological_order();
  } catch (const graph_error& e) { CHECK(std::string(e.what()).find("downstream") == std::string::npos); }
  // The printer still works (insertion order).
  CHECK(g.to_string().find("= Relu(%b)  # r") != std::string::npos);

  tg::graph self;
  self.add_node("Relu", "loop", {"s"}, {"s"});
  self.mark_output("s");
  CHECK_THROWS_MATCHES(self.verify(), graph_error, is_error(errc::invalid_argument, "graph", "graph has a cycle: Relu 'loop' -> Relu 'loop'"));
}

TEST_CASE("graph: a constant holds exactly numel * dtype_size bytes", "[graph][ir]") {
  tg::graph g;
  CHECK_THROWS_MATCHES(g.add_constant("w", dtype::f32, {2, 2}, bytes(12)), graph_error,
                       is_error(errc::invalid_argument, "graph", "constant 'w': holds 12 bytes, f32[2,2] needs 16"));
  CHECK_THROWS_MATCHES(g.add_constant("w", dtype::bf16, {3}, bytes(8)), graph_error,
                       is_error(errc::invalid_argument, "graph", "constant 'w': holds 8 bytes, bf16[3] needs 6"));
  CHECK_THROWS_MATCHES(g.add_constant("w", dtype::f32, {2}, nullptr), graph_error,
                       is_error(errc::invalid_argument, "graph", "constant 'w': no bytes"));
  CHECK_THROWS_MATCHES(g.add_constant("w", dtype::f32, {-1}, bytes(0)), graph_error,
                       is_error(errc::invalid_argument, "graph", "value 'w': dim 0: a constant's dims must be known"));
  CHECK(!g.find_value("w"));
  g.add_constant("w", dtype::i4x2, {3}, bytes(3));  // i4x2 counts pairs, one byte each
  g.add_constant("s", dtype::f64, {}, bytes(8));    // a scalar
  CHECK(g.byte_size(g.value_named("w")) == 3u);
  CHECK(g.byte_size(g.value_named("s")) == 8u);
  CHECK_THROWS_MATCHES(g.set_value_type(g.value_named("s"), dtype::f32, {2}), graph_error,
                       is_error(errc::invalid_argument, "graph", "value 's': a constant's type is fixed by its bytes"));

  // The bytes are shared, not copied: if their owner resizes them, verify() notices.
  auto owned = std::make_shared<std::vector<std::byte>>(16);
  g.add_constant("m", dtype::f32, {4}, owned);
  g.add_node("Identity", "id", {"m"}, {"y"});
  g.mark_output("y");
  g.verify();
  owned->resize(20);
  CHECK_THROWS_MATCHES(g.verify(), graph_error, is_error(errc::invalid_argument, "graph", "constant 'm': holds 20 bytes, f32[4] needs 16"));
}

TEST_CASE("graph: dims are sizes, unknown or symbols", "[graph][ir]") {
  tg::graph g;
  CHECK_THROWS_MATCHES(g.add_input("x", dtype::f32, {2, -2}), graph_error, is_error(errc::invalid_argument, "graph", "value 'x': dim 1 is -2"));
  tg::dim both(3);
  both.symbol = "n";
  CHECK_THROWS_MATCHES(g.add_input("x", dtype::f32, {both}), graph_error,
                       is_error(errc::invalid_argument, "graph", "value 'x': dim 0 has both a size and a symbol ('n')"));
  const tg::value_id x = g.add_input("x", dtype::f32, {"batch", -1, tg::dim(), 5});
  CHECK(g.get(x).shape.to_string() == "[batch,?,?,5]");
  CHECK(g.get(x).shape.dims[0].symbolic());
  CHECK(!g.get(x).shape.dims[1].symbolic());
  CHECK(!g.byte_size(x));
  CHECK(tg::tensor_shape{}.to_string() == "[]");
  CHECK(tg::tensor_shape::unknown_rank().to_string() == "[*]");
  CHECK(tg::tensor_shape{2, 3}.numel() == 6u);
  CHECK(!tg::tensor_shape{2, "n"}.numel());
}

TEST_CASE("graph: sizes that would overflow are errc::overflow naming the value", "[graph][ir]") {
  tg::graph g;
  const std::int64_t big = std::int64_t{1} << 40;
  CHECK_THROWS_MATCHES(g.add_constant("huge", dtype::f32, {big, big}, bytes(0)), graph_error,
                       is_error(errc::overflow, "graph", "value 'huge': f32[1099511627776,1099511627776]: size"));
  const tg::value_id x = g.add_input("x", dtype::f64, {big, big / 8});
  CHECK_THROWS_MATCHES(g.byte_size(x), graph_error, is_error(errc::overflow, "graph", "value 'x'"));
  const tg::value_id ok = g.add_input("ok", dtype::f64, {big, 8});
  CHECK(g.byte_size(ok) == static_cast<std::size_t>(big) * 64);
}

TEST_CASE("graph: typed attribute getters name the node and attribute on a wrong kind", "[graph][ir]") {
  tg::graph g;
  g.add_input("x", dtype::f32, {2, 3});
  const tg::node_id n = g.add_node(
      "Softmax", "sm", {"x"}, {"y"},
      {{"axis", "last"}, {"eps", 1e-5}, {"perm", tg::ints{1, 0}}, {"scales", tg::floats{0.5, 2}}, {"names", tg::strings{"a", "b"}}, {"k", 3}});
  g.mark_output("y");
  const tg::node& sm = g.get(n);
  CHECK(sm.get_int("k") == 3);
  CHECK(sm.get_int("missing", 7) == 7);
  CHECK(sm.get_float("eps") == 1e-5);
  CHECK(sm.get_float("missing", 0.25) == 0.25);
  CHECK(sm.get_string("axis") == "last");
  CHECK(sm.get_ints("perm") == tg::ints{1, 0});
  CHECK(sm.get_floats("scales") == tg::floats{0.5, 2});
  CHECK(sm.get_strings("names") == tg::strings{"a", "b"});
  CHECK(sm.get_strings("missing", {"z"}) == tg::strings{"z"});
  CHECK(sm.has_attribute("perm"));
  CHECK_THROWS_MATCHES(sm.get_int("axis"), graph_error,
                       is_error(errc::invalid_argument, "graph", "Softmax 'sm': attribute 'axis' is a string, expected an int"));
  CHECK_THROWS_MATCHES(sm.get_int("axis", -1), graph_error, is_error(errc::invalid_argument, "graph", "attribute 'axis' is a string"));
  CHECK_THROWS_MATCHES(sm.get_float("k"), graph_error,
                       is_error(errc::invalid_argument, "graph", "Softmax 'sm': attribute 'k' is an int, expected a float"));
  CHECK_THROWS_MATCHES(sm.get_ints("scales"), graph_error,
                       is_error(errc::invalid_argument, "graph", "attribute 'scales' is a list of floats, expected a list of ints"));
  CHECK_THROWS_MATCHES(sm.get_int("missing"), graph_error,
                       is_error(errc::invalid_argument, "graph", "Softmax 'sm': attribute 'missing' (an int) is required"));
  // Shape inference reads through the same getters.
  CHECK_THROWS_MATCHES(g.infer_shapes(), graph_error,
                       is_error(errc::invalid_argument, "graph", "Softmax 'sm': attribute 'axis' is a string, expected an int"));
  CHECK(g.to_string().find("{axis=\"last\", eps=1e-05, k=3, names=[\"a\",\"b\"], perm=[1,0], scales=[0.5,2]}") != std::string::npos);
}

TEST_CASE("graph: integer constants and Constant nodes read back as ints", "[graph][ir]") {
  tg::graph g;
  const tg::value_id a = g.add_constant_ints("a", {3, -1, 0});
  const tg::value_id b = g.add_constant<std::int32_t>("b", {2}, std::vector<std::int32_t>{7, -8});
  const tg::value_id f = g.add_constant<float>("f", {1}, std::vector<float>{1.0f});
  g.add_node("Constant", "c1", {}, {"c"}, {{"value_ints", tg::ints{4, 5}}});
  g.add_node("Constant", "c2", {}, {"d"}, {{"value_int", 9}});
  g.add_input("x", dtype::i64, {2});
  CHECK(g.constant_ints(a) == tg::ints{3, -1, 0});
  CHECK(g.constant_ints(b) == tg::ints{7, -8});
  CHECK(!g.constant_ints(f));
  CHECK(g.constant_ints(g.value_named("c")) == tg::ints{4, 5});
  CHECK(g.constant_ints(g.value_named("d")) == tg::ints{9});
  CHECK(!g.constant_ints(g.value_named("x")));
}

TEST_CASE("graph: ONNX element type codes map to dtypes", "[graph][ir]") {
  CHECK(tg::dtype_from_onnx(1) == dtype::f32);
  CHECK(tg::dtype_from_onnx(7) == dtype::i64);
  CHECK(tg::dtype_from_onnx(9) == tg::bool_dtype);
  CHECK(tg::dtype_from_onnx(10) == dtype::fp16);
  CHECK(tg::dtype_from_onnx(11) == dtype::f64);
  CHECK(tg::dtype_from_onnx(16) == dtype::bf16);
  CHECK(tg::dtype_from_onnx(17) == dtype::e4m3);
  CHECK(tg::dtype_from_onnx(19) == dtype::e5m2);
  for (std::int64_t unknown : {0, 8, 14, 15, 18, 20, 21, 22, 99, -1}) CHECK(!tg::dtype_from_onnx(unknown));
}

TEST_CASE("graph: fusing MatMul and Add into Gemm with replace_all_uses and remove_dead_nodes", "[graph][ir]") {
  tg::graph g = make_mlp();
  g.infer_shapes();
  const tg::node_id fused = g.add_node("Gemm", "fc2_fused", {"a", "w2", "b2"}, {"y_fused"});
  CHECK(g.replace_all_uses(g.value_named("y"), g.value_named("y_fused")) == 0);  // y had no reader, only the output mark
  CHECK(g.get(g.outputs()[0]).name == "y_fused");
  CHECK(!g.get(g.value_named("y")).is_output);
  CHECK(g.remove_dead_nodes() == 2);  // fc2 and bias2
  CHECK(!g.find_node("fc2"));
  CHECK(!g.find_value("y"));  // the name is free again
  g.rename_value(g.value_named("y_fused"), "y");
  g.verify();
  g.infer_shapes();
  CHECK(g.count_by_op().at("Gemm") == 2);
  CHECK(g.count_by_op().count("MatMul") == 0);
  CHECK(g.get(g.value_named("y")).type_info().to_string() == "f32[batch,4]");
  CHECK(g.get(g.value_named("y")).producer == fused);
  CHECK(g.node_count() == 3);
  CHECK(g.to_string().find("%y: f32[batch,4] = Gemm(%a, %w2, %b2)  # fc2_fused") != std::string::npos);
}

TEST_CASE("graph: rewiring keeps the consumer lists right", "[graph][ir]") {
  tg::graph g = make_mlp();
  // Insert a Neg after the Relu: every reader of a reads n instead, except the Neg itself.
  const tg::node_id neg = g.add_node("Neg", "neg", {"a"}, {"n"});
  CHECK(g.replace_all_uses(g.value_named("a"), g.value_named("n"), neg) == 1);
  const tg::value& a = g.get(g.value_named("a"));
  REQUIRE(a.consumers.size() == 1);
  CHECK(a.consumers[0].node == neg);
  CHECK(g.get(g.node_named("fc2")).inputs[0] == g.value_named("n"));
  g.verify();
  CHECK(op_names(g, g.topological_order()) == std::vector<std::string>{"fc1", "act", "neg", "fc2", "bias2"});

  // set_input moves one read.
  g.set_input(g.node_named("fc2"), 0, g.value_named("a"));
  CHECK(g.get(g.value_named("n")).consumers.empty());
  CHECK(g.get(g.value_named("a")).consumers.size() == 2);
  CHECK_THROWS_MATCHES(g.set_input(g.node_named("fc2"), 5, g.value_named("a")), graph_error,
                       is_error(errc::out_of_range, "graph", "MatMul 'fc2': input slot 5 out of range (2 inputs)"));

  // remove_node refuses a node whose output is read or is a graph output.
  CHECK_THROWS_MATCHES(g.remove_node(g.node_named("act")), graph_error,
                       is_error(errc::invalid_argument, "graph", "cannot remove Relu 'act': its output 'a' is read by"));
  CHECK_THROWS_MATCHES(g.remove_node(g.node_named("bias2")), graph_error,
                       is_error(errc::invalid_argument, "graph", "cannot remove Add 'bias2': its output 'y' is a graph output"));
  g.remove_node(neg);  // n is unread now
  CHECK(!g.find_node("neg"));
  CHECK(g.get(g.value_named("a")).consumers.size() == 1);
  CHECK_THROWS_MATCHES(g.get(neg), graph_error, is_error(errc::out_of_range, "graph", "Neg 'neg': removed"));
  g.verify();
  CHECK(g.remove_dead_nodes() == 0);

  CHECK_THROWS_MATCHES(g.rename_value(g.value_named("a"), "h"), graph_error,
                       is_error(errc::invalid_argument, "graph", "value 'a': cannot take the name of value 'h'"));
}

}  // namespace tessel_test_graph_ir
