// graph/fusion.hpp: each pattern fusion on its exporter spellings (positive: the fused node, its
// inputs and attributes, the replaced value's name kept, verify and infer_shapes pass) and on near
// misses that must stay unfused (an interior value read elsewhere, a non-constant epsilon, a γ of rank
// 2, a wrong axis or constant); BatchNormalization folded into the conv's W and B, checked against a
// direct double computation.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <tessel/graph.hpp>
#include "graph/exported_models.hpp"

namespace tessel_test_graph_fusion {

using tessel::dtype;
using namespace tessel_test_graph;

// Runs one pass the way optimize does (shapes inferred before, dead code removed after) and checks
// the result is a valid graph whose shapes infer.
template <class Pass>
std::size_t run(tg::graph& g, Pass pass) {
  g.infer_shapes({.allow_unknown_ops = true});
  const std::size_t n = pass(g);
  tg::remove_dead_code(g);
  g.verify();
  g.infer_shapes({.allow_unknown_ops = true});
  return n;
}

std::size_t ops(const tg::graph& g, const std::string& op) {
  const auto c = g.count_by_op();
  auto it = c.find(op);
  return it == c.end() ? 0 : it->second;
}

// The one live node running `op`.
const tg::node& only(const tg::graph& g, const std::string& op) {
  const tg::node* r = nullptr;
  for (tg::node_id id : g.node_ids())
    if (g.get(id).op == op) {
      REQUIRE(r == nullptr);
      r = &g.get(id);
    }
  REQUIRE(r != nullptr);
  return *r;
}

std::vector<std::string> input_names(const tg::graph& g, const tg::node& n) {
  std::vector<std::string> r;
  for (tg::value_id v : n.inputs) r.push_back(v == tg::value_id::none ? std::string() : g.get(v).name);
  return r;
}

std::vector<float> floats_of(const tg::graph& g, tg::value_id v) {
  const tg::value& x = g.get(v);
  REQUIRE(x.role == tg::value_role::constant);
  std::vector<float> r(x.data->size() / 4);
  std::memcpy(r.data(), x.data->data(), x.data->size());
  return r;
}

// ---- LayerNormalization ------------------------------------------------------------------------------

struct ln_case {
  bool pow = true, beta = true, extra_reader = false, eps_input = false, gamma_rank2 = false, wrong_axis = false;
};

tg::graph ln_graph(const ln_case& c) {
  tg::graph g("ln");
  builder b{g};
  g.add_input("x", dtype::f32, {"batch", S, D});
  weight(g, "gamma", c.gamma_rank2 ? std::vector<std::int64_t>{1, D} : std::vector<std::int64_t>{D});
  weight(g, "beta", {D});
  std::string eps = b.f32(1e-5f);
  if (c.eps_input) g.add_input(eps = "eps", dtype::f32, {});
  const tg::attribute_map axes{{"axes", tg::ints{c.wrong_axis ? 1 : -1}}};
  const std::string mean = b.op("ReduceMean", {"x"}, axes);
  const std::string d = b.op("Sub", {"x", mean});
  const std::string sq = c.pow ? b.op("Pow", {d, b.f32(2.0f)}) : b.op("Mul", {d, d});
  const std::string var = b.op("ReduceMean", {sq}, axes);
  const std::string sd = b.op("Sqrt", {b.op("Add", {var, eps})});
  const std::string n = b.op("Div", {d, sd});
  if (c.beta) {
    g.add_node("Add", "add_beta", {b.op("Mul", {"gamma", n}), "beta"}, {"y"});
  } else {
    g.add_node("Mul", "mul_gamma", {n, "gamma"}, {"y"});
  }
  g.mark_output("y");
  if (c.extra_reader) {
    g.add_node("Relu", "extra", {d}, {"e"});
    g.mark_output("e");
  }
  return g;
}

TEST_CASE("graph fusion: decomposed LayerNorm becomes LayerNormalization", "[graph][fusion]") {
  for (bool pow : {true, false})
    for (bool beta : {true, false}) {
      CAPTURE(pow, beta);
      tg::graph g = ln_graph({.pow = pow, .beta = beta});
      CHECK(g.node_count() == (beta ? 9u : 8u));
      CHECK(run(g, tg::fuse_layer_norm) == 1);
      CHECK(g.node_count() == 1);
      const tg::node& ln = only(g, "LayerNormalization");
      CHECK(ln.domain.empty());
      CHECK(input_names(g, ln) == (beta ? std::vector<std::string>{"x", "gamma", "beta"} : std::vector<std::string>{"x", "gamma"}));
      CHECK(ln.get_int("axis") == -1);
      CHECK(ln.get_float("epsilon") == static_cast<double>(1e-5f));
      CHECK(g.get(ln.outputs[0]).name == "y");
      CHECK(g.get(ln.outputs[0]).shape.to_string() == "[batch,6,32]");
    }
}

TEST_CASE("graph fusion: LayerNorm near misses stay unfused", "[graph][fusion]") {
  const ln_case cases[] = {{.extra_reader = true}, {.eps_input = true}, {.gamma_rank2 = true}, {.wrong_axis = true}};
  for (const ln_case& c : cases) {
    CAPTURE(c.extra_reader, c.eps_input, c.gamma_rank2, c.wrong_axis);
    tg::graph g = ln_graph(c);
    const std::size_t before = g.node_count();
    CHECK(run(g, tg::fuse_layer_norm) == 0);
    CHECK(g.node_count() == before);
    CHECK(ops(g, "LayerNormalization") == 0);
  }
}

// ---- RMSNormalization ---------------------------------------------------------------------------------

enum class rms_inv { reciprocal, div_x, div_one };

struct rms_case {
  rms_inv inv = rms_inv::reciprocal;
  bool pow = true, gamma_first = false, extra_reader = false, gamma_rank2 = false, eps_input = false;
};

tg::graph rms_graph(const rms_case& c) {
  tg::graph g("rms");
  builder b{g};
  g.add_input("x", dtype::f32, {"batch", S, D});
  weight(g, "gamma", c.gamma_rank2 ? std::vector<std::int64_t>{S, D} : std::vector<std::int64_t>{D});
  std::string eps = b.f32(1e-6f);
  if (c.eps_input) g.add_input(eps = "eps", dtype::f32, {});
  const std::string sq = c.pow ? b.op("Pow", {"x", b.f32(2.0f)}) : b.op("Mul", {"x", "x"});
  const std::string ms = b.op("ReduceMean", {sq}, {{"axes", tg::ints{-1}}});
  const std::string r = b.op("Sqrt", {b.op("Add", {ms, eps})});
  std::string n;
  if (c.inv == rms_inv::reciprocal) n = b.op("Mul", {"x", b.op("Reciprocal", {r})});
  if (c.inv == rms_inv::div_x) n = b.op("Div", {"x", r});
  if (c.inv == rms_inv::div_one) n = b.op("Mul", {b.op("Div", {b.f32(1.0f), r}), "x"});
  g.add_node("Mul", "scale", c.gamma_first ? std::vector<std::string>{"gamma", n} : std::vector<std::string>{n, "gamma"}, {"y"});
  g.mark_output("y");
  if (c.extra_reader) {
    g.add_node("Neg", "extra", {r}, {"e"});
    g.mark_output("e");
  }
  return g;
}

TEST_CASE("graph fusion: decomposed RMSNorm becomes tessel's RMSNormalization", "[graph][fusion]") {
  for (rms_inv inv : {rms_inv::reciprocal, rms_inv::div_x, rms_inv::div_one})
    for (bool pow : {true, false}) {
      CAPTURE(static_cast<int>(inv), pow);
      tg::graph g = rms_graph({.inv = inv, .pow = pow, .gamma_first = pow});
      CHECK(run(g, tg::fuse_rms_norm) == 1);
      CHECK(g.node_count() == 1);
      const tg::node& n = only(g, "RMSNormalization");
      CHECK(n.domain == "tessel");
      CHECK(input_names(g, n) == std::vector<std::string>{"x", "gamma"});
      CHECK(n.get_float("epsilon") == static_cast<double>(1e-6f));
      CHECK(g.get(n.outputs[0]).name == "y");
    }
}

TEST_CASE("graph fusion: RMSNorm near misses stay unfused", "[graph][fusion]") {
  const rms_case cases[] = {{.extra_reader = true}, {.gamma_rank2 = true}, {.eps_input = true}};
  for (const rms_case& c : cases) {
    tg::graph g = rms_graph(c);
    const std::size_t before = g.node_count();
    CHECK(run(g, tg::fuse_rms_norm) == 0);
    CHECK(g.node_count() == before);
  }
}

// ---- GELU -----------------------------------------------------------------------------------------------

tg::graph unary_graph(const std::string& name, std::vector<tg::dim> shape = {"batch", FF}) {
  tg::graph g(name);
  g.add_input("x", dtype::f32, tg::tensor_shape(std::move(shape)));
  return g;
}

TEST_CASE("graph fusion: exact GELU in its exporter spellings becomes Gelu", "[graph][fusion]") {
  SECTION("torch's: x * (erf(x / sqrt2) + 1) * 0.5") {
    tg::graph g = unary_graph("gelu");
    builder b{g};
    g.mark_output(b.gelu_erf("x"));
    CHECK(run(g, tg::fuse_gelu_erf) == 1);
    CHECK(g.node_count() == 1);
    CHECK_FALSE(only(g, "Gelu").has_attribute("approximate"));
  }
  SECTION("(x * 0.5) * (1 + erf(x * (1/sqrt2)))") {
    tg::graph g = unary_graph("gelu");
    builder b{g};
    const std::string half = b.op("Mul", {"x", b.f32(0.5f)});
    const std::string e = b.op("Erf", {b.op("Mul", {b.f32(0.70710678f), "x"})});
    g.add_node("Mul", "out", {half, b.op("Add", {b.f32(1.0f), e})}, {"y"});
    g.mark_output("y");
    CHECK(run(g, tg::fuse_gelu_erf) == 1);
    CHECK(g.node_count() == 1);
    CHECK(g.get(only(g, "Gelu").outputs[0]).name == "y");
  }
  SECTION("x * ((1 + erf(x / sqrt2)) * 0.5)") {
    tg::graph g = unary_graph("gelu");
    builder b{g};
    const std::string t = b.op("Add", {b.op("Erf", {b.op("Div", {"x", b.f32(1.41421356f)})}), b.f32(1.0f)});
    g.add_node("Mul", "out", {"x", b.op("Mul", {t, b.f32(0.5f)})}, {"y"});
    g.mark_output("y");
    CHECK(run(g, tg::fuse_gelu_erf) == 1);
    CHECK(g.node_count() == 1);
  }
  SECTION("near misses: 0.6 for 0.5, 2 for sqrt2, erf read elsewhere, another value's half") {
    for (int k = 0; k < 4; ++k) {
      CAPTURE(k);
      tg::graph g = unary_graph("gelu");
      g.add_input("z", dtype::f32, {"batch", FF});
      builder b{g};
      const std::string e = b.op("Erf", {b.op("Div", {"x", b.f32(k == 1 ? 2.0f : 1.41421356f)})});
      const std::string m = b.op("Mul", {k == 3 ? "z" : "x", b.op("Add", {e, b.f32(1.0f)})});
      g.mark_output(b.op("Mul", {m, b.f32(k == 0 ? 0.6f : 0.5f)}));
      if (k == 2) g.mark_output(b.op("Neg", {e}));
      const std::size_t before = g.node_count();
      CHECK(run(g, tg::fuse_gelu_erf) == 0);
      CHECK(g.node_count() == before);
    }
  }
}

TEST_CASE("graph fusion: tanh GELU becomes Gelu with approximate tanh", "[graph][fusion]") {
  SECTION("HF's NewGELU (Pow 3)") {
    tg::graph g = unary_graph("gelu_tanh");
    builder b{g};
    g.mark_output(b.gelu_tanh("x"));
    CHECK(g.node_count() == 8);
    CHECK(run(g, tg::fuse_gelu_tanh) == 1);
    CHECK(g.node_count() == 1);
    CHECK(only(g, "Gelu").get_string("approximate") == "tanh");
  }
  SECTION("x^3 as x * (x * x), (x * t) * 0.5") {
    tg::graph g = unary_graph("gelu_tanh");
    builder b{g};
    const std::string cube = b.op("Mul", {"x", b.op("Mul", {"x", "x"})});
    const std::string inner = b.op("Add", {b.op("Mul", {cube, b.f32(0.044715f)}), "x"});
    const std::string th = b.op("Tanh", {b.op("Mul", {inner, b.f32(0.79788456f)})});
    g.add_node("Mul", "out", {b.op("Mul", {"x", b.op("Add", {th, b.f32(1.0f)})}), b.f32(0.5f)}, {"y"});
    g.mark_output("y");
    CHECK(run(g, tg::fuse_gelu_tanh) == 1);
    CHECK(g.node_count() == 1);
    CHECK(g.get(only(g, "Gelu").outputs[0]).name == "y");
  }
  SECTION("near misses: 0.05 for 0.044715, the cube of another value, the tanh read elsewhere") {
    for (int k = 0; k < 3; ++k) {
      CAPTURE(k);
      tg::graph g = unary_graph("gelu_tanh");
      g.add_input("z", dtype::f32, {"batch", FF});
      builder b{g};
      const std::string cube = b.op("Pow", {k == 1 ? "z" : "x", b.f32(3.0f)});
      const std::string inner = b.op("Add", {"x", b.op("Mul", {b.f32(k == 0 ? 0.05f : 0.044715f), cube})});
      const std::string th = b.op("Tanh", {b.op("Mul", {b.f32(0.7978845608f), inner})});
      g.mark_output(b.op("Mul", {b.op("Mul", {b.f32(0.5f), "x"}), b.op("Add", {b.f32(1.0f), th})}));
      if (k == 2) g.mark_output(b.op("Neg", {th}));
      const std::size_t before = g.node_count();
      CHECK(run(g, tg::fuse_gelu_tanh) == 0);
      CHECK(g.node_count() == before);
    }
  }
}

// ---- FusedMatMul ------------------------------------------------------------------------------------------

TEST_CASE("graph fusion: MatMul + bias + activation (+ residual) becomes FusedMatMul", "[graph][fusion]") {
  SECTION("bias and Relu") {
    tg::graph g = unary_graph("mm", {"batch", D});
    builder b{g};
    weight(g, "w", {D, FF});
    weight(g, "b", {FF});
    g.add_node("Relu", "act", {b.linear("x", "w", "b")}, {"y"});
    g.mark_output("y");
    CHECK(run(g, tg::fuse_matmul) == 1);
    CHECK(g.node_count() == 1);
    const tg::node& f = only(g, "FusedMatMul");
    CHECK(f.domain == "tessel");
    CHECK(input_names(g, f) == std::vector<std::string>{"x", "w", "b"});
    CHECK(f.get_string("activation") == "Relu");
    CHECK(g.get(f.outputs[0]).name == "y");
    CHECK(g.get(f.outputs[0]).shape.to_string() == "[batch,128]");
  }
  SECTION("bias, residual, then Gelu: the residual goes in before the activation") {
    tg::graph g = unary_graph("mm", {"batch", S, D});
    g.add_input("r", dtype::f32, {"batch", S, D});
    builder b{g};
    weight(g, "w", {D, D});
    weight(g, "b", {D});
    g.add_node("Gelu", "act", {b.op("Add", {"r", b.linear("x", "w", "b")})}, {"y"});
    g.mark_output("y");
    CHECK(run(g, tg::fuse_matmul) == 1);
    const tg::node& f = only(g, "FusedMatMul");
    CHECK(g.node_count() == 1);
    CHECK(input_names(g, f) == std::vector<std::string>{"x", "w", "b", "r"});
    CHECK(f.get_string("activation") == "Gelu");
  }
  SECTION("x * sigmoid(x) is Silu; Gelu tanh is GeluTanh; no bias, only an activation") {
    for (bool silu : {true, false}) {
      tg::graph g = unary_graph("mm", {"batch", D});
      builder b{g};
      weight(g, "w", {D, FF});
      const std::string h = b.op("MatMul", {"x", "w"});
      if (silu)
        g.add_node("Mul", "silu", {b.op("Sigmoid", {h}), h}, {"y"});
      else
        g.add_node("Gelu", "gelu", {h}, {"y"}, {{"approximate", std::string("tanh")}});
      g.mark_output("y");
      CHECK(run(g, tg::fuse_matmul) == 1);
      CHECK(g.node_count() == 1);
      const tg::node& f = only(g, "FusedMatMul");
      CHECK(f.get_string("activation") == (silu ? "Silu" : "GeluTanh"));
      CHECK(f.inputs.size() == 2);
    }
  }
  SECTION("Gemm with transB: the weight is transposed into a new constant") {
    tg::graph g = make_mlp();  // Gemm(x, w1 [32,16], b1) {transB} -> Relu -> MatMul -> Add
    const auto w = floats_of(g, g.value_named("w1"));
    CHECK(run(g, tg::fuse_matmul) == 2);
    CHECK(g.node_count() == 2);
    const tg::node& fc1 = g.get(g.get(g.value_named("a")).producer);
    CHECK(fc1.op == "FusedMatMul");
    CHECK(fc1.get_string("activation") == "Relu");
    CHECK_FALSE(fc1.has_attribute("transB"));
    const auto wt = floats_of(g, fc1.inputs[1]);
    CHECK_FALSE(g.find_value("w1"));  // nothing reads the untransposed weight any more
    REQUIRE(wt.size() == 512);
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 32; ++j) CHECK(wt[static_cast<std::size_t>(i * 32 + j)] == w[static_cast<std::size_t>(j * 16 + i)]);
    CHECK(g.get(fc1.inputs[1]).shape.to_string() == "[16,32]");
    const tg::node& fc2 = g.get(g.get(g.value_named("y")).producer);
    CHECK(input_names(g, fc2) == std::vector<std::string>{"a", "w2", "b2"});
  }
  SECTION("near misses: nothing after the product; the product read twice; a non-constant bias") {
    for (int k = 0; k < 3; ++k) {
      CAPTURE(k);
      tg::graph g = unary_graph("mm", {"batch", D});
      g.add_input("bias_in", dtype::f32, {FF});
      builder b{g};
      weight(g, "w", {D, FF});
      weight(g, "b", {FF});
      const std::string h = b.op("MatMul", {"x", "w"});
      if (k == 0) g.mark_output(h);
      if (k == 1) {
        g.mark_output(b.op("Relu", {b.op("Add", {h, "b"})}));
        g.mark_output(b.op("Neg", {h}));
      }
      if (k == 2) g.mark_output(b.op("Relu", {b.op("Add", {h, "bias_in"})}));
      const std::size_t before = g.node_count();
      CHECK(run(g, tg::fuse_matmul) == 0);
      CHECK(g.node_count() == before);
    }
  }
  SECTION("Gemm: alpha carries over; transB of a non-constant weight, transA and beta != 1 stay") {
    for (int k = 0; k < 4; ++k) {
      CAPTURE(k);
      tg::graph g = unary_graph("gemm", {8, D});
      g.add_input("w_in", dtype::f32, {FF, D});
      weight(g, "w", {D, FF});
      weight(g, "b", {FF});
      tg::attribute_map attrs{{"alpha", 0.5}};
      std::vector<std::string> in{"x", "w", "b"};
      if (k == 1) attrs["transB"] = std::int64_t{1}, in[1] = "w_in";
      if (k == 2) attrs["transA"] = std::int64_t{1}, g.add_input("xt", dtype::f32, {D, 8}), in[0] = "xt";
      if (k == 3) attrs["beta"] = 2.0;
      g.add_node("Gemm", "fc", in, {"h"}, attrs);
      g.add_node("Tanh", "act", {"h"}, {"y"});
      g.mark_output("y");
      CHECK(run(g, tg::fuse_matmul) == (k == 0 ? 1u : 0u));
      if (k == 0) {
        const tg::node& f = only(g, "FusedMatMul");
        CHECK(f.get_float("alpha") == 0.5);
        CHECK(f.get_string("activation") == "Tanh");
        CHECK(input_names(g, f) == std::vector<std::string>{"x", "w", "b"});
      }
    }
  }
  SECTION("a biased product read twice fuses the bias but leaves the activation") {
    tg::graph g = unary_graph("mm", {"batch", D});
    builder b{g};
    weight(g, "w", {D, FF});
    weight(g, "b", {FF});
    g.add_node("Add", "bias", {b.op("MatMul", {"x", "w"}), "b"}, {"h"});
    g.add_node("Relu", "act", {"h"}, {"y"});
    g.mark_output("y");
    g.mark_output("h");
    CHECK(run(g, tg::fuse_matmul) == 1);
    CHECK(g.node_count() == 2);
    CHECK_FALSE(only(g, "FusedMatMul").has_attribute("activation"));
    CHECK(g.get(only(g, "FusedMatMul").outputs[0]).name == "h");
    CHECK(g.get(g.value_named("h")).is_output);
  }
}

// ---- Attention ------------------------------------------------------------------------------------------

constexpr std::int64_t AB = 2, AH = 4, AS = 6, AD = 8;

enum class mask_kind { none, causal_add, causal_where, causal_where_inverted, input, upper_where, zero_scalar, zero_matrix };

struct attn_case {
  mask_kind mask = mask_kind::causal_add;
  bool div_scale = false, gqa = false, bshd_key = false, softmax_axis2 = false, scores_read = false, scale_input = false;
  bool gqa_gather = false, gather_tiled = false;  // index_select's repeat: [0, 0, 1, 1] (or [0, 1, 0, 1]: not GQA's order)
  bool q_scaled = false;                          // Q times 0.5 before the product
};

tg::graph attention_graph(const attn_case& c) {
  tg::graph g("attn");
  builder b{g};
  const std::int64_t hkv = c.gqa || c.gqa_gather ? 2 : AH;
  g.add_input("q", dtype::f32, {AB, AH, AS, AD});
  if (c.bshd_key)
    g.add_input("k", dtype::f32, {AB, AS, hkv, AD});
  else
    g.add_input("k", dtype::f32, {AB, hkv, AS, AD});
  g.add_input("v", dtype::f32, {AB, hkv, AS, AD});
  g.add_input("m", dtype::f32, {AB, 1, 1, AS});
  g.add_input("sc", dtype::f32, {});
  std::string k = "k", v = "v";
  if (c.gqa) {
    auto repeat = [&](const std::string& x) {
      const std::string u = b.op("Unsqueeze", {x, b.i64s({2})});
      const std::string e = b.op("Expand", {u, b.i64s({AB, hkv, AH / hkv, AS, AD})});
      return b.op("Reshape", {e, b.i64s({AB, AH, AS, AD})});
    };
    k = repeat(k);
    v = repeat(v);
  }
  if (c.gqa_gather) {
    const std::string idx = c.gather_tiled ? b.i64s({0, 1, 0, 1}) : b.i64s({0, 0, 1, 1});
    k = b.op("Gather", {k, idx}, {{"axis", std::int64_t{1}}});
    v = b.op("Gather", {v, idx}, {{"axis", std::int64_t{1}}});
  }
  const std::string q = c.q_scaled ? b.op("Mul", {"q", b.f32(0.5f)}) : std::string("q");
  const std::string kt = b.op("Transpose", {k}, {{"perm", c.bshd_key ? tg::ints{0, 2, 3, 1} : tg::ints{0, 1, 3, 2}}});
  const std::string s = b.op("MatMul", {q, kt});
  std::string w = c.scale_input ? b.op("Mul", {s, "sc"})
                  : c.div_scale ? b.op("Div", {s, b.f32(std::sqrt(static_cast<float>(AD)))})
                                : b.op("Mul", {b.f32(0.35355339f), s});
  std::vector<float> add_mask(AS * AS);
  std::vector<std::uint8_t> keep(AS * AS), drop(AS * AS), upper(AS * AS);
  for (int i = 0; i < AS; ++i)
    for (int j = 0; j < AS; ++j) {
      const std::size_t at = static_cast<std::size_t>(i * AS + j);
      add_mask[at] = j <= i ? 0.0f : -std::numeric_limits<float>::infinity();
      keep[at] = j <= i;
      drop[at] = j > i;
      upper[at] = j >= i;
    }
  switch (c.mask) {
    case mask_kind::none: break;
    case mask_kind::causal_add:
      g.add_constant<float>("mask", {AS, AS}, add_mask);
      w = b.op("Add", {w, "mask"});
      break;
    case mask_kind::causal_where:
      g.add_constant<std::uint8_t>("mask", {1, 1, AS, AS}, keep);
      w = b.op("Where", {"mask", w, b.f32(-1e9f)});
      break;
    case mask_kind::causal_where_inverted:
      g.add_constant<std::uint8_t>("mask", {1, 1, AS, AS}, drop);
      w = b.op("Where", {"mask", b.f32(-std::numeric_limits<float>::infinity()), w});
      break;
    case mask_kind::upper_where:
      g.add_constant<std::uint8_t>("mask", {1, 1, AS, AS}, upper);
      w = b.op("Where", {"mask", w, b.f32(-1e9f)});
      break;
    case mask_kind::input: w = b.op("Add", {"m", w}); break;
    case mask_kind::zero_scalar: w = b.op("Add", {w, b.f32(0.0f)}); break;  // a traced "no mask" (+ 0.0)
    case mask_kind::zero_matrix:
      g.add_constant<float>("mask", {AS, AS}, std::vector<float>(AS * AS, -0.0f));
      w = b.op("Add", {"mask", w});
      break;
  }
  const std::string p = b.op("Softmax", {w}, {{"axis", std::int64_t{c.softmax_axis2 ? 2 : -1}}});
  g.add_node("MatMul", "pv", {p, v}, {"y"});
  g.mark_output("y");
  if (c.scores_read) g.mark_output(s);
  return g;
}

TEST_CASE("graph fusion: scaled masked softmax attention becomes tessel's Attention", "[graph][fusion]") {
  SECTION("an additive causal mask and a scale by Mul") {
    tg::graph g = attention_graph({});
    CHECK(run(g, tg::fuse_attention) == 1);
    CHECK(g.node_count() == 1);
    const tg::node& a = only(g, "Attention");
    CHECK(a.domain == "tessel");
    CHECK(input_names(g, a) == std::vector<std::string>{"q", "k", "v"});
    CHECK(a.get_int("causal") == 1);
    CHECK(a.get_float("scale") == static_cast<double>(0.35355339f));
    CHECK(g.get(a.outputs[0]).name == "y");
    CHECK(g.get(a.outputs[0]).shape.to_string() == "[2,4,6,8]");
  }
  SECTION("Where(tril, scores, -1e9), Where(triu, -inf, scores), scale by Div") {
    for (mask_kind mk : {mask_kind::causal_where, mask_kind::causal_where_inverted}) {
      tg::graph g = attention_graph({.mask = mk, .div_scale = true});
      CHECK(run(g, tg::fuse_attention) == 1);
      const tg::node& a = only(g, "Attention");
      CHECK(a.get_int("causal") == 1);
      CHECK(a.get_float("scale") == Approx(1.0 / std::sqrt(8.0)).epsilon(1e-7));
      CHECK(a.inputs.size() == 3);
    }
  }
  SECTION("no mask: causal stays 0 and the scale is explicit") {
    tg::graph g = attention_graph({.mask = mask_kind::none});
    CHECK(run(g, tg::fuse_attention) == 1);
    const tg::node& a = only(g, "Attention");
    CHECK_FALSE(a.has_attribute("causal"));
    CHECK(a.has_attribute("scale"));
  }
  SECTION("an added constant of zeros (a traced '+ 0.0', or -0.0 everywhere) is no mask") {
    for (mask_kind mk : {mask_kind::zero_scalar, mask_kind::zero_matrix}) {
      CAPTURE(static_cast<int>(mk));
      tg::graph g = attention_graph({.mask = mk});
      CHECK(run(g, tg::fuse_attention) == 1);
      const tg::node& a = only(g, "Attention");
      CHECK(input_names(g, a) == std::vector<std::string>{"q", "k", "v"});
      CHECK_FALSE(a.has_attribute("causal"));
    }
  }
  SECTION("a mask input is Attention's input 3") {
    tg::graph g = attention_graph({.mask = mask_kind::input});
    CHECK(run(g, tg::fuse_attention) == 1);
    const tg::node& a = only(g, "Attention");
    CHECK(input_names(g, a) == std::vector<std::string>{"q", "k", "v", "m"});
    CHECK_FALSE(a.has_attribute("causal"));
  }
  SECTION("GQA: repeat_kv's Unsqueeze, Expand and Reshape of K and V go; Attention reads 2 kv heads") {
    tg::graph g = attention_graph({.gqa = true});
    CHECK(g.node_count() == 12);
    CHECK(run(g, tg::fuse_attention) == 1);
    CHECK(g.node_count() == 1);
    const tg::node& a = only(g, "Attention");
    CHECK(input_names(g, a) == std::vector<std::string>{"q", "k", "v"});
    CHECK(g.get(a.outputs[0]).shape.to_string() == "[2,4,6,8]");
  }
  SECTION("GQA by index_select: the Gathers of K and V go; heads repeated out of GQA's order stay") {
    for (bool tiled : {false, true}) {
      CAPTURE(tiled);
      tg::graph g = attention_graph({.gqa_gather = true, .gather_tiled = tiled});
      CHECK(run(g, tg::fuse_attention) == 1);
      CHECK(g.node_count() == (tiled ? 3u : 1u));
      const tg::node& a = only(g, "Attention");
      CHECK((input_names(g, a) == std::vector<std::string>{"q", "k", "v"}) == !tiled);
      CHECK(g.get(a.inputs[1]).shape.to_string() == (tiled ? "[2,4,6,8]" : "[2,2,6,8]"));
    }
  }
  SECTION("a scale on Q before the product joins the scale") {
    tg::graph g = attention_graph({.q_scaled = true});
    CHECK(run(g, tg::fuse_attention) == 1);
    CHECK(g.node_count() == 1);
    const tg::node& a = only(g, "Attention");
    CHECK(input_names(g, a) == std::vector<std::string>{"q", "k", "v"});
    CHECK(a.get_float("scale") == Approx(0.5 * static_cast<double>(0.35355339f)).epsilon(1e-12));
  }
  SECTION("K in [B, S, H, D] transposed straight to Kᵀ: one Transpose to [B, H, S, D] stays") {
    tg::graph g = attention_graph({.bshd_key = true});
    CHECK(run(g, tg::fuse_attention) == 1);
    CHECK(g.node_count() == 2);
    const tg::node& t = only(g, "Transpose");
    CHECK(t.get_ints("perm") == tg::ints{0, 2, 1, 3});
    CHECK(g.get(t.inputs[0]).name == "k");
    CHECK(only(g, "Attention").inputs[1] == t.outputs[0]);
  }
}

TEST_CASE("graph fusion: attention near misses stay unfused", "[graph][fusion]") {
  const attn_case cases[] = {{.softmax_axis2 = true}, {.scores_read = true}, {.scale_input = true}, {.mask = mask_kind::upper_where}};
  for (const attn_case& c : cases) {
    CAPTURE(c.softmax_axis2, c.scores_read, c.scale_input, static_cast<int>(c.mask));
    tg::graph g = attention_graph(c);
    const std::size_t before = g.node_count();
    CHECK(run(g, tg::fuse_attention) == 0);
    CHECK(g.node_count() == before);
  }
}

// ---- Skip norms ---------------------------------------------------------------------------------------

// ---- rotary embedding -------------------------------------------------------------------------------

struct rotary_case {
  bool swap_mul = false, swap_add = false, axis_positive = false, end_max = true, cos_4d = false, steps_one = false;
  // near misses
  bool halves_swapped = false, split_off_centre = false, extra_reader = false, other_x = false;
  bool cos_wrong = false;  // cos widens the result (rank 5): it does not broadcast one way to q
};

// q [batch, 2, 6, 8] rotated as HF's apply_rotary_pos_emb: q·cos + rotate_half(q)·sin.
tg::graph rotary_graph(const rotary_case& c) {
  constexpr std::int64_t RD = 8, RS = 6;
  tg::graph g("rotary");
  builder b{g};
  g.add_input("q", dtype::f32, {"batch", 2, RS, RD});
  g.add_input("p", dtype::f32, {"batch", 2, RS, RD});
  const std::vector<std::int64_t> cs = c.cos_wrong ? std::vector<std::int64_t>{2, 1, 1, RS, RD}
                                       : c.cos_4d  ? std::vector<std::int64_t>{1, 1, RS, RD}
                                                   : std::vector<std::int64_t>{RS, RD};
  weight(g, "cos", cs);
  weight(g, "sin", {RS, RD});
  const std::int64_t last = c.axis_positive ? 3 : -1;
  auto slice = [&](const std::string& x, std::int64_t from, std::int64_t to) {
    std::vector<std::string> in{x, b.i64s({from}), b.i64s({to}), b.i64s({last})};
    if (c.steps_one) in.push_back(b.i64s({1}));
    return b.op("Slice", in);
  };
  const std::int64_t end = c.end_max ? std::numeric_limits<std::int64_t>::max() : RD;
  const std::int64_t split = c.split_off_centre ? RD / 2 - 1 : RD / 2;  // rotates pairs (i, i + 3): not the contract
  const std::string x1 = slice("q", 0, split);
  const std::string x2 = slice(c.other_x ? "p" : "q", split, end);
  const std::string rot =
      c.halves_swapped ? b.op("Concat", {b.op("Neg", {x1}), x2}, {{"axis", last}}) : b.op("Concat", {b.op("Neg", {x2}), x1}, {{"axis", last}});
  const std::string a = c.swap_mul ? b.op("Mul", {"cos", "q"}) : b.op("Mul", {"q", "cos"});
  const std::string r = c.swap_mul ? b.op("Mul", {"sin", rot}) : b.op("Mul", {rot, "sin"});
  g.add_node("Add", "rope", c.swap_add ? std::vector<std::string>{r, a} : std::vector<std::string>{a, r}, {"y"});
  g.mark_output("y");
  if (c.extra_reader) {
    g.add_node("Neg", "extra", {rot}, {"e"});
    g.mark_output("e");
  }
  return g;
}

TEST_CASE("graph fusion: rotate-half rotary embedding becomes tessel's RotaryEmbedding", "[graph][fusion]") {
  const rotary_case cases[] = {
      {}, {.swap_mul = true}, {.swap_add = true, .axis_positive = true}, {.end_max = false, .cos_4d = true, .steps_one = true}};
  for (const rotary_case& c : cases) {
    CAPTURE(c.swap_mul, c.swap_add, c.axis_positive, c.end_max, c.cos_4d, c.steps_one);
    tg::graph g = rotary_graph(c);
    CHECK(run(g, tg::fuse_rotary) == 1);
    CHECK(g.node_count() == 1);
    const tg::node& n = only(g, "RotaryEmbedding");
    CHECK(n.domain == "tessel");
    CHECK(input_names(g, n) == std::vector<std::string>{"q", "cos", "sin"});
    CHECK(n.get_int("interleaved", -1) == 0);
    CHECK(g.get(n.outputs[0]).name == "y");
    CHECK(g.get(n.outputs[0]).type_info().to_string() == "f32[batch,2,6,8]");
  }
}

TEST_CASE("graph fusion: rotary near misses stay unfused", "[graph][fusion]") {
  const rotary_case cases[] = {{.halves_swapped = true}, {.split_off_centre = true}, {.extra_reader = true}, {.cos_wrong = true}, {.other_x = true}};
  for (const rotary_case& c : cases) {
    CAPTURE(c.halves_swapped, c.split_off_centre, c.extra_reader, c.cos_wrong, c.other_x);
    tg::graph g = rotary_graph(c);
    const std::size_t before = g.node_count();
    CHECK(run(g, tg::fuse_rotary) == 0);
    CHECK(g.node_count() == before);
  }
}

TEST_CASE("graph fusion: RotaryEmbedding's shape rule names what is wrong", "[graph][fusion]") {
  auto make = [](std::vector<tg::dim> x, std::vector<tg::dim> cs, std::int64_t interleaved) {
    tg::graph g("r");
    g.add_input("x", dtype::f32, tg::tensor_shape(std::move(x)));
    g.add_input("c", dtype::f32, tg::tensor_shape(cs));
    g.add_input("s", dtype::f32, tg::tensor_shape(cs));
    g.add_node("RotaryEmbedding", "rot", {"x", "c", "s"}, {"y"}, {{"interleaved", interleaved}}, "tessel");
    g.mark_output("y");
    return g;
  };
  tg::graph ok = make({"batch", 4, 6}, {4, 6}, 1);
  ok.infer_shapes();
  CHECK(ok.get(ok.outputs()[0]).type_info().to_string() == "f32[batch,4,6]");
  auto fails = [&](tg::graph g, const std::string& what) {
    CAPTURE(what);
    try {
      g.infer_shapes();
      FAIL("no error");
    } catch (const tg::graph_error& e) { CHECK_THAT(e.what(), Catch::Contains(what)); }
  };
  fails(make({2, 5}, {2, 5}, 0), "odd last axis");
  fails(make({2, 6}, {3, 6}, 0), "cos 'c' [3,6] does not broadcast");
  fails(make({2, 6}, {2, 6}, 2), "'interleaved' is 2");
}

TEST_CASE("graph fusion: Add + LayerNormalization becomes SkipLayerNormalization", "[graph][fusion]") {
  for (bool sum_read : {false, true}) {
    CAPTURE(sum_read);
    tg::graph g("skip");
    g.add_input("x", dtype::f32, {"batch", S, D});
    g.add_input("h", dtype::f32, {"batch", S, D});
    weight(g, "gamma", {D});
    weight(g, "beta", {D});
    g.add_node("Add", "residual", {"x", "h"}, {"s"});
    g.add_node("LayerNormalization", "ln", {"s", "gamma", "beta"}, {"y"}, {{"epsilon", 1e-6}});
    g.mark_output("y");
    if (sum_read) {
      g.add_node("Add", "again", {"s", "y"}, {"z"});
      g.mark_output("z");
    }
    CHECK(run(g, [](tg::graph& x) { return tg::fuse_skip_norm(x); }) == 1);
    const tg::node& n = only(g, "SkipLayerNormalization");
    CHECK(n.domain == "tessel");
    CHECK(input_names(g, n) == std::vector<std::string>{"x", "h", "gamma", "beta"});
    CHECK(n.get_float("epsilon") == 1e-6);
    CHECK(n.outputs.size() == (sum_read ? 2u : 1u));
    CHECK(g.get(n.outputs[0]).name == "y");
    if (sum_read) {
      CHECK(g.get(n.outputs[1]).name == "s");
      CHECK(g.get(g.node_named("again")).inputs[0] == n.outputs[1]);
    }
    CHECK(g.node_count() == (sum_read ? 2u : 1u));
  }
}

TEST_CASE("graph fusion: Add + RMSNormalization becomes SkipRMSNormalization, near misses stay", "[graph][fusion]") {
  SECTION("a bias-like skip [D] broadcasts to X") {
    tg::graph g("skip_rms");
    g.add_input("x", dtype::f32, {"batch", S, D});
    weight(g, "gamma", {D});
    weight(g, "shift", {D});
    g.add_node("Add", "residual", {"shift", "x"}, {"s"});
    g.add_node("RMSNormalization", "rms", {"s", "gamma"}, {"y"}, {}, "tessel");
    g.mark_output("y");
    std::size_t rms = 0;
    CHECK(run(g, [&](tg::graph& x) { return tg::fuse_skip_norm(x, &rms); }) == 1);
    CHECK(rms == 1);
    CHECK(input_names(g, only(g, "SkipRMSNormalization")) == std::vector<std::string>{"x", "shift", "gamma"});
  }
  SECTION("LayerNormalization's mean output read; a sum both of whose operands broadcast") {
    for (int k = 0; k < 2; ++k) {
      tg::graph g("skip_miss");
      g.add_input("x", dtype::f32, {"batch", 1, D});
      g.add_input("h", dtype::f32, k == 0 ? tg::tensor_shape{"batch", 1, D} : tg::tensor_shape{1, S, D});
      weight(g, "gamma", {D});
      g.add_node("Add", "residual", {"x", "h"}, {"s"});
      g.add_node("LayerNormalization", "ln", {"s", "gamma"}, {"y", k == 0 ? "mean" : ""});
      g.mark_output("y");
      if (k == 0) g.mark_output("mean");
      CHECK(run(g, [](tg::graph& x) { return tg::fuse_skip_norm(x); }) == 0);
      CHECK(g.node_count() == 2);
    }
  }
}

// ---- FusedConv ------------------------------------------------------------------------------------------

struct conv_case {
  bool bn = true, residual = true, relu = true, bias = true, mean_input = false, conv_read = false;
};

tg::graph conv_graph(const conv_case& c) {
  tg::graph g("conv");
  g.add_input("x", dtype::f32, {"batch", 3, 8, 8});
  g.add_input("z", dtype::f32, {"batch", 4, 8, 8});
  std::vector<float> w(4 * 3 * 3 * 3);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.1f * static_cast<float>(static_cast<int>(i % 7) - 3) + 0.013f * static_cast<float>(i);
  g.add_constant<float>("W", {4, 3, 3, 3}, w);
  g.add_constant<float>("B", {4}, std::vector<float>{0.5f, -0.25f, 0.125f, 1.0f});
  g.add_constant<float>("bn_scale", {4}, std::vector<float>{1.5f, 0.75f, -0.5f, 2.0f});
  g.add_constant<float>("bn_bias", {4}, std::vector<float>{0.1f, 0.2f, -0.3f, 0.4f});
  g.add_constant<float>("bn_mean", {4}, std::vector<float>{0.3f, -0.6f, 0.9f, 0.0f});
  g.add_constant<float>("bn_var", {4}, std::vector<float>{0.7f, 1.3f, 0.05f, 2.5f});
  if (c.mean_input) g.add_input("mean_in", dtype::f32, {4});
  std::vector<std::string> in{"x", "W"};
  if (c.bias) in.push_back("B");
  g.add_node("Conv", "conv", in, {"c"}, {{"pads", tg::ints{1, 1, 1, 1}}, {"kernel_shape", tg::ints{3, 3}}});
  std::string cur = "c";
  if (c.conv_read) g.mark_output("c");
  if (c.bn) {
    g.add_node("BatchNormalization", "bn", {cur, "bn_scale", "bn_bias", c.mean_input ? "mean_in" : "bn_mean", "bn_var"}, {"n"}, {{"epsilon", 1e-3}});
    cur = "n";
  }
  if (c.residual) {
    g.add_node("Add", "residual", {cur, "z"}, {"r"});
    cur = "r";
  }
  if (c.relu) {
    g.add_node("Relu", "relu", {cur}, {"y"});
    cur = "y";
  }
  g.mark_output(cur);
  return g;
}

TEST_CASE("graph fusion: Conv + BatchNormalization + residual + Relu becomes FusedConv with BN folded", "[graph][fusion]") {
  for (bool bias : {true, false}) {
    CAPTURE(bias);
    tg::graph g = conv_graph({.bias = bias});
    const auto w = floats_of(g, g.value_named("W"));
    CHECK(run(g, tg::fuse_conv) == 1);
    CHECK(g.node_count() == 1);
    const tg::node& f = only(g, "FusedConv");
    CHECK(f.domain == "tessel");
    CHECK(f.get_string("activation") == "Relu");
    CHECK(f.get_ints("pads") == tg::ints{1, 1, 1, 1});
    REQUIRE(f.inputs.size() == 4);
    CHECK(g.get(f.inputs[0]).name == "x");
    CHECK(g.get(f.inputs[3]).name == "z");
    CHECK(g.get(f.outputs[0]).name == "y");
    CHECK(g.get(f.outputs[0]).shape.to_string() == "[batch,4,8,8]");
    // W' = W · s, B' = (B - mean) · s + beta, s = scale / sqrt(var + eps): in double, rounded once.
    const double scale[] = {1.5f, 0.75f, -0.5f, 2.0f}, beta[] = {0.1f, 0.2f, -0.3f, 0.4f}, mean[] = {0.3f, -0.6f, 0.9f, 0.0f},
                 var[] = {0.7f, 1.3f, 0.05f, 2.5f}, b0[] = {0.5f, -0.25f, 0.125f, 1.0f};
    const auto w2 = floats_of(g, f.inputs[1]);
    const auto b2 = floats_of(g, f.inputs[2]);
    REQUIRE(w2.size() == w.size());
    REQUIRE(b2.size() == 4);
    for (std::size_t m = 0; m < 4; ++m) {
      const double s = scale[m] / std::sqrt(var[m] + 1e-3);
      CHECK(b2[m] == static_cast<float>(((bias ? b0[m] : 0.0) - mean[m]) * s + beta[m]));
      for (std::size_t k = 0; k < 27; ++k) CHECK(w2[m * 27 + k] == static_cast<float>(static_cast<double>(w[m * 27 + k]) * s));
    }
    CHECK_FALSE(g.find_value("bn_mean"));  // the folded statistics are gone
  }
}

TEST_CASE("graph fusion: Conv with part of the epilogue, near misses stay", "[graph][fusion]") {
  SECTION("Conv + BN only; Conv + Relu only") {
    for (bool bn : {true, false}) {
      tg::graph g = conv_graph({.bn = bn, .residual = false, .relu = !bn});
      CHECK(run(g, tg::fuse_conv) == 1);
      CHECK(g.node_count() == 1);
      const tg::node& f = only(g, "FusedConv");
      CHECK(f.inputs.size() == 3);
      CHECK(f.has_attribute("activation") == !bn);
      CHECK(g.get(f.inputs[1]).name == (bn ? "W_bn" : "W"));
    }
  }
  SECTION("statistics from a graph input; the conv output read elsewhere") {
    for (int k = 0; k < 2; ++k) {
      tg::graph g = conv_graph({.mean_input = k == 0, .conv_read = k == 1});
      const std::size_t before = g.node_count();
      CHECK(run(g, tg::fuse_conv) == 0);
      CHECK(g.node_count() == before);
      CHECK(ops(g, "BatchNormalization") == 1);
    }
  }
}

}  // namespace tessel_test_graph_fusion
