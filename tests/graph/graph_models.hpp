// Small graphs the graph tests share: an MLP and a pre-norm transformer block, both with a symbolic
// batch, built the way an ONNX importer would (ONNX op names, constants for weights and shapes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <tessel/graph.hpp>

namespace tessel_test_graph {

namespace tg = tessel::graph;

// A constant of `dims` filled with 0.01 * i: the values do not matter to these tests, the sizes do.
inline tg::value_id weight(tg::graph& g, const std::string& name, std::vector<std::int64_t> dims) {
  std::int64_t n = 1;
  for (std::int64_t d : dims) n *= d;
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * static_cast<float>(i);
  return g.add_constant<float>(name, std::move(dims), v);
}

// x: f32[batch,16] -> Gemm(transB) 32 -> Relu -> MatMul 4 -> Add -> y: f32[batch,4]
inline tg::graph make_mlp() {
  tg::graph g("mlp");
  g.add_input("x", tessel::dtype::f32, {"batch", 16});
  weight(g, "w1", {32, 16});
  weight(g, "b1", {32});
  weight(g, "w2", {32, 4});
  weight(g, "b2", {4});
  g.add_node("Gemm", "fc1", {"x", "w1", "b1"}, {"h"}, {{"transB", 1}});
  g.add_node("Relu", "act", {"h"}, {"a"});
  g.add_node("MatMul", "fc2", {"a", "w2"}, {"z"});
  g.add_node("Add", "bias2", {"z", "b2"}, {"y"});
  g.mark_output("y");
  return g;
}

// The transformer block's sizes: sequence, model width, heads, head width, feed-forward width.
inline constexpr std::int64_t S = 6, D = 32, H = 4, HD = 8, FF = 128;

// A pre-norm block: y = r + FF(LN2(r)), r = x + Attn(LN1(x)), with heads split by Reshape and
// Transpose, scores scaled by a scalar constant, Softmax over the last axis, a Gelu MLP.
inline tg::graph make_transformer_block() {
  tg::graph g("block");
  g.add_input("x", tessel::dtype::f32, {"batch", S, D});
  weight(g, "ln1_g", {D});
  weight(g, "ln1_b", {D});
  weight(g, "ln2_g", {D});
  weight(g, "ln2_b", {D});
  for (const char* p : {"q", "k", "v", "o"}) {
    weight(g, std::string("w") + p, {D, D});
    weight(g, std::string("b") + p, {D});
  }
  weight(g, "w_up", {D, FF});
  weight(g, "b_up", {FF});
  weight(g, "w_down", {FF, D});
  weight(g, "b_down", {D});
  g.add_constant<float>("scale", {}, std::vector<float>{0.35355339f});  // 1/sqrt(HD)
  g.add_constant_ints("heads_shape", {0, 0, H, HD});
  g.add_constant_ints("merge_shape", {0, 0, D});

  g.add_node("LayerNormalization", "ln1", {"x", "ln1_g", "ln1_b"}, {"n1"}, {{"axis", -1}, {"epsilon", 1e-5}});
  for (const char* p : {"q", "k", "v"}) {
    const std::string s = p;
    g.add_node("MatMul", std::string("proj_") + s, {"n1", std::string("w") + s}, {s + "_mm"});
    g.add_node("Add", std::string("bias_") + s, {s + "_mm", std::string("b") + s}, {s});
    g.add_node("Reshape", std::string("split_") + s, {s, "heads_shape"}, {s + "_heads"});
  }
  g.add_node("Transpose", "q_t", {"q_heads"}, {"qt"}, {{"perm", tg::ints{0, 2, 1, 3}}});
  g.add_node("Transpose", "k_t", {"k_heads"}, {"kt"}, {{"perm", tg::ints{0, 2, 3, 1}}});
  g.add_node("Transpose", "v_t", {"v_heads"}, {"vt"}, {{"perm", tg::ints{0, 2, 1, 3}}});
  g.add_node("MatMul", "scores", {"qt", "kt"}, {"s"});
  g.add_node("Mul", "scale_s", {"s", "scale"}, {"s_scaled"});
  g.add_node("Softmax", "softmax", {"s_scaled"}, {"p"}, {{"axis", -1}});
  g.add_node("MatMul", "context", {"p", "vt"}, {"c"});
  g.add_node("Transpose", "c_t", {"c"}, {"ct"}, {{"perm", tg::ints{0, 2, 1, 3}}});
  g.add_node("Reshape", "merge", {"ct", "merge_shape"}, {"cm"});
  g.add_node("MatMul", "proj_o", {"cm", "wo"}, {"o_mm"});
  g.add_node("Add", "bias_o", {"o_mm", "bo"}, {"attn"});
  g.add_node("Add", "residual1", {"x", "attn"}, {"r"});
  g.add_node("LayerNormalization", "ln2", {"r", "ln2_g", "ln2_b"}, {"n2"}, {{"axis", -1}, {"epsilon", 1e-5}});
  g.add_node("MatMul", "up", {"n2", "w_up"}, {"u_mm"});
  g.add_node("Add", "bias_up", {"u_mm", "b_up"}, {"u"});
  g.add_node("Gelu", "gelu", {"u"}, {"u_act"});
  g.add_node("MatMul", "down", {"u_act", "w_down"}, {"d_mm"});
  g.add_node("Add", "bias_down", {"d_mm", "b_down"}, {"d"});
  g.add_node("Add", "residual2", {"r", "d"}, {"y"});
  g.mark_output("y");
  return g;
}

}  // namespace tessel_test_graph
