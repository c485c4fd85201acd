// graph/passes.hpp: optimize() to a fixed point on whole graphs (the MLP, the hand-built transformer
// block, a GPT-2 block as PyTorch's exporter spells it, with a symbolic, a bound and a static batch)
// and the fusion report's counts, percentages and table.
#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include <tessel/graph.hpp>
#include "graph/exported_models.hpp"

namespace tessel_test_graph_passes {

using tessel::dtype;
using namespace tessel_test_graph;

std::size_t count(const tg::fusion_report::counts& c, const std::string& op) { return tg::fusion_report::count(c, op); }

TEST_CASE("graph optimize: the MLP's Gemm + Relu and MatMul + Add become two FusedMatMuls", "[graph][passes]") {
  tg::graph g = make_mlp();
  const tg::fusion_report r = tg::optimize(g);
  CHECK(r.nodes_before == 4);
  CHECK(r.nodes_after == 2);
  CHECK(r.reduction_percent() == Approx(50.0));
  CHECK(r.pattern("FusedMatMul") == 2);
  CHECK(r.patterns.size() == 1);
  CHECK(count(r.ops_after, "FusedMatMul") == 2);
  CHECK(count(r.ops_before, "Gemm") == 1);
  CHECK(g.get(g.value_named("y")).is_output);
  CHECK(g.get(g.value_named("y")).shape.to_string() == "[batch,4]");
}

TEST_CASE("graph optimize: the hand-built transformer block", "[graph][passes]") {
  tg::graph g = make_transformer_block();
  const tg::fusion_report r = tg::optimize(g);
  INFO(r.to_string());
  INFO(g.to_string());
  CHECK(r.nodes_before == 29);
  CHECK(r.nodes_after == 17);
  CHECK(r.pattern("Attention") == 1);
  CHECK(r.pattern("SkipLayerNormalization") == 1);
  CHECK(r.pattern("FusedMatMul") == 6);  // q, k, v, o, up (+ Gelu), down (+ residual)
  CHECK(count(r.ops_after, "LayerNormalization") == 1);
  CHECK(count(r.ops_after, "Transpose") == 4);  // q, v, K's one transpose to [B, H, S, D], the context back
  CHECK(count(r.ops_after, "Softmax") == 0);
  CHECK(count(r.ops_after, "Add") == 0);
  const tg::node& down = g.get(g.get(g.value_named("y")).producer);
  CHECK(down.op == "FusedMatMul");
  REQUIRE(down.inputs.size() == 4);
  CHECK(g.get(down.inputs[3]).name == "r");  // the residual: SkipLayerNormalization's output 1
  CHECK(g.get(g.value_named("y")).shape.to_string() == "[batch,6,32]");
}

void check_gpt_report(const tg::fusion_report& r) {
  CHECK(r.nodes_before == 88);
  CHECK(r.nodes_after == 16);
  CHECK(r.pattern("LayerNormalization") == 2);  // ln_1 (Pow), ln_2 (Mul(d, d))
  CHECK(r.pattern("GeluTanh") == 1);
  CHECK(r.pattern("Attention") == 1);
  CHECK(r.pattern("SkipLayerNormalization") == 1);  // residual 1 + ln_2
  CHECK(r.pattern("FusedMatMul") == 4);             // c_attn, attn c_proj, c_fc (+ GeluTanh), mlp c_proj (+ residual)
  CHECK(r.pattern("Gelu") == 0);
  CHECK(r.patterns.size() == 5);
  CHECK(count(r.ops_before, "Shape") == 10);
  CHECK(count(r.ops_after, "Shape") == 0);
  CHECK(count(r.ops_after, "Gather") == 0);
  CHECK(count(r.ops_after, "Where") == 0);
  CHECK(count(r.ops_after, "Reshape") == 4);
  CHECK(count(r.ops_after, "Transpose") == 4);  // q, k, v to heads, the context back
  CHECK(count(r.ops_after, "Split") == 1);
  CHECK(count(r.ops_after, "Attention") == 1);
  CHECK(r.reduction_percent() == Approx(100.0 * (88 - 16) / 88.0));
}

TEST_CASE("graph optimize: a GPT-2 block as the exporter writes it", "[graph][passes]") {
  SECTION("symbolic batch: the shape chains reduce to 0-copies, everything fuses") {
    tg::graph g = make_gpt_block_exported();
    const tg::fusion_report r = tg::optimize(g);
    INFO(r.to_string());
    INFO(g.to_string());
    check_gpt_report(r);
    CHECK(g.get(g.value_named("y")).shape.to_string() == "[batch,6,32]");
    const tg::node& a = g.get(g.get(g.value_named("context")).producer);
    REQUIRE(a.op == "Attention");
    CHECK(a.get_int("causal") == 1);
    CHECK(a.get_float("scale") == Approx(1.0 / std::sqrt(8.0)).epsilon(1e-6));
    CHECK(a.inputs.size() == 3);
  }
  SECTION("batch bound to 2 by the fold options: the same counts, shapes specialized") {
    tg::graph g = make_gpt_block_exported();
    tg::optimize_options opt;
    opt.fold.bindings["batch"] = 2;
    const tg::fusion_report r = tg::optimize(g, opt);
    INFO(r.to_string());
    check_gpt_report(r);
  }
  SECTION("a static batch") {
    tg::graph g = make_gpt_block_exported(2);
    const tg::fusion_report r = tg::optimize(g);
    check_gpt_report(r);
    CHECK(g.get(g.value_named("y")).shape.to_string() == "[2,6,32]");
  }
  SECTION("without fusions: folding, CSE and dead code only") {
    tg::graph g = make_gpt_block_exported();
    tg::optimize_options opt;
    opt.fuse = false;
    const tg::fusion_report r = tg::optimize(g, opt);
    CHECK(r.patterns.empty());
    CHECK(r.folded > 0);
    CHECK(r.nodes_after == 51);  // 88 less the 37 nodes of shape arithmetic
    CHECK(count(r.ops_after, "Shape") == 0);
    CHECK(count(r.ops_after, "Concat") == 0);
    CHECK(count(r.ops_after, "Slice") == 0);
  }
  SECTION("optimize reaches a fixed point: a second run changes nothing") {
    tg::graph g = make_gpt_block_exported();
    (void)tg::optimize(g);
    const std::string once = g.to_string();
    const tg::fusion_report r = tg::optimize(g);
    CHECK(r.nodes_before == r.nodes_after);
    CHECK(r.rounds == 1);
    CHECK(r.patterns.empty());
    CHECK(g.to_string() == once);
  }
}

TEST_CASE("graph optimize: a LLaMA block (RMSNorm, GQA, SiLU) as the exporter writes it", "[graph][passes]") {
  auto check = [](tg::graph& g, const tg::optimize_options& opt) {
    const tg::fusion_report r = tg::optimize(g, opt);
    INFO(r.to_string());
    INFO(g.to_string());
    CHECK(r.nodes_after == 19);
    CHECK(r.pattern("RMSNormalization") == 2);
    CHECK(r.pattern("SkipRMSNormalization") == 1);  // residual 1 + the second norm, the sum read by residual 2
    CHECK(r.pattern("Attention") == 1);
    CHECK(r.pattern("FusedMatMul") == 2);      // gate (+ Silu), down (+ residual 2)
    CHECK(count(r.ops_after, "Expand") == 0);  // repeat_kv is Attention's GQA
    CHECK(count(r.ops_after, "MatMul") == 5);  // q, k, v, o, up: nothing to absorb
    CHECK(count(r.ops_after, "Mul") == 1);     // the gate times up
    const tg::node& a = g.get(g.get(g.value_named("context")).producer);
    REQUIRE(a.op == "Attention");
    CHECK(a.get_int("causal") == 1);
    CHECK(g.get(a.inputs[1]).shape.to_string() == "[2,2,6,8]");  // K before repeat_kv
    const tg::node& down = g.get(g.get(g.value_named("y")).producer);
    const tg::node& gated = g.get(g.get(down.inputs[0]).producer);
    CHECK(gated.op == "Mul");
    return r;
  };
  SECTION("static batch") {
    tg::graph g = make_llama_block_exported(2);
    const auto r = check(g, {});
    CHECK(count(r.ops_before, "Expand") == 2);
  }
  SECTION("symbolic batch bound to 2") {
    tg::graph g = make_llama_block_exported("batch");
    tg::optimize_options opt;
    opt.fold.bindings["batch"] = 2;
    check(g, opt);
  }
  SECTION("symbolic batch unbound: repeat_kv's shapes stay computed, so Attention reads the repeated K and V") {
    tg::graph g = make_llama_block_exported("batch");
    const tg::fusion_report r = tg::optimize(g);
    INFO(r.to_string());
    CHECK(r.pattern("Attention") == 1);
    CHECK(r.pattern("RMSNormalization") == 2);
    CHECK(count(r.ops_after, "Expand") == 2);
    const tg::node& a = g.get(g.get(g.value_named("context")).producer);
    CHECK(g.get(g.get(a.inputs[1]).producer).op == "Reshape");
  }
}

TEST_CASE("graph optimize: ops without a shape rule are left alone, the rest still fuses", "[graph][passes]") {
  tg::graph g("custom");
  builder b{g};
  g.add_input("x", dtype::f32, {"batch", D});
  weight(g, "w", {D, FF});
  weight(g, "b", {FF});
  g.add_node("Scramble", "custom", {"x"}, {"xs"}, {}, "example.custom");
  g.add_node("Relu", "act", {b.linear("xs", "w", "b")}, {"y"});
  g.mark_output("y");
  const tg::fusion_report r = tg::optimize(g);
  CHECK(r.nodes_after == 2);
  CHECK(r.pattern("FusedMatMul") == 1);  // the product's shape is unknown; the bias [128] fits w [32, 128]
  CHECK(count(r.ops_after, "Scramble") == 1);
  CHECK(g.get(g.value_named("xs")).shape.to_string() == "[*]");
  CHECK(r.nodes_before == 4);

  tg::graph h("custom_wrong_bias");  // a bias [64] against w [32, 128]: nothing proves it fits
  builder c{h};
  h.add_input("x", dtype::f32, {"batch", D});
  weight(h, "w", {D, FF});
  weight(h, "b", {64});
  h.add_node("Scramble", "custom", {"x"}, {"xs"}, {}, "example.custom");
  h.add_node("Relu", "act", {c.linear("xs", "w", "b")}, {"y"});
  h.mark_output("y");
  const tg::fusion_report r2 = tg::optimize(h);
  CHECK(r2.pattern("FusedMatMul") == 0);
  CHECK(r2.nodes_after == 4);
}

TEST_CASE("graph optimize: the report's table", "[graph][passes]") {
  tg::graph g = make_mlp();
  const tg::fusion_report r = tg::optimize(g);
  const std::string s = r.to_string();
  CHECK(s.rfind("nodes: 4 -> 2 (-50.0%)", 0) == 0);
  CHECK(s.find("FusedMatMul                      0       2\n") != std::string::npos);
  CHECK(s.find("Gemm                             1       0\n") != std::string::npos);
  CHECK(s.find("fused pattern                count\nFusedMatMul                      2\n") != std::string::npos);
}

}  // namespace tessel_test_graph_passes
