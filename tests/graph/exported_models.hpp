// Graphs spelled the way PyTorch's ONNX exporter writes them (decomposed norms and GELUs, Shape ->
// Gather -> Unsqueeze -> Concat -> Reshape chains, one Shape node per use, a sliced causal buffer
// and Where), for the passes' tests: a small builder and a GPT-2 style block.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <tessel/graph.hpp>
#include "graph/graph_models.hpp"

namespace tessel_test_graph {

// Adds nodes with generated names: `op("Add", {a, b})` returns the output's name.
struct builder {
  tg::graph& g;
  std::string prefix = "n";
  int next = 0;

  std::string fresh(const std::string& what) { return prefix + std::to_string(next++) + "_" + what; }
  std::string op(const std::string& type, const std::vector<std::string>& in, tg::attribute_map attrs = {}, std::string domain = {}) {
    const std::string out = fresh(type);
    g.add_node(type, out + "_node", in, {out}, std::move(attrs), std::move(domain));
    return out;
  }
  std::string f32(float v) {
    const std::string n = fresh("f");
    g.add_constant<float>(n, {}, std::vector<float>{v});
    return n;
  }
  std::string i64(std::int64_t v) {  // a scalar
    const std::string n = fresh("i");
    g.add_constant<std::int64_t>(n, {}, std::vector<std::int64_t>{v});
    return n;
  }
  std::string i64s(const tg::ints& v) {
    const std::string n = fresh("is");
    g.add_constant_ints(n, v);
    return n;
  }
  std::string weight(const std::string& name, std::vector<std::int64_t> dims) {
    tessel_test_graph::weight(g, name, std::move(dims));
    return name;
  }
  // The exporter's dim read: Unsqueeze(Gather(Shape(x), k), [0]), a fresh Shape node each time.
  std::string dim_of(const std::string& x, std::int64_t k) {
    const std::string s = op("Shape", {x});
    const std::string d = op("Gather", {s, i64(k)}, {{"axis", std::int64_t{0}}});
    return op("Unsqueeze", {d, i64s({0})});
  }
  // LayerNorm over the last axis as torch.nn.LayerNorm's decomposition: (x - mean) / sqrt(var + eps)
  // · γ + β, the square as Pow 2 or as Mul(d, d).
  std::string layer_norm(const std::string& x, const std::string& gamma, const std::string& beta, bool pow_spelling = true, float eps = 1e-5f) {
    const tg::attribute_map last{{"axes", tg::ints{-1}}};
    const std::string mean = op("ReduceMean", {x}, last);
    const std::string d = op("Sub", {x, mean});
    const std::string sq = pow_spelling ? op("Pow", {d, f32(2.0f)}) : op("Mul", {d, d});
    const std::string var = op("ReduceMean", {sq}, last);
    const std::string sd = op("Sqrt", {op("Add", {var, f32(eps)})});
    const std::string n = op("Div", {d, sd});
    return op("Add", {op("Mul", {n, gamma}), beta});
  }
  // HF's NewGELUActivation: 0.5 · x · (1 + tanh(sqrt(2/pi) · (x + 0.044715 · x^3))).
  std::string gelu_tanh(const std::string& x) {
    const std::string half_x = op("Mul", {f32(0.5f), x});
    const std::string cube = op("Pow", {x, f32(3.0f)});
    const std::string inner = op("Add", {x, op("Mul", {f32(0.044715f), cube})});
    const std::string th = op("Tanh", {op("Mul", {f32(0.7978845608f), inner})});
    return op("Mul", {half_x, op("Add", {f32(1.0f), th})});
  }
  // torch's exact GELU as the exporter writes it: x · (erf(x / sqrt 2) + 1) · 0.5.
  std::string gelu_erf(const std::string& x) {
    const std::string e = op("Erf", {op("Div", {x, f32(1.41421356f)})});
    return op("Mul", {op("Mul", {x, op("Add", {e, f32(1.0f)})}), f32(0.5f)});
  }
  std::string linear(const std::string& x, const std::string& w, const std::string& b) { return op("Add", {op("MatMul", {x, w}), b}); }
};

// A GPT-2 block (S = 6, D = 32, H = 4 heads of 8, FF = 128) with input x [batch, S, D], batch
// symbolic ("batch") or a number; as the exporter writes HF's GPT2Block.
inline tg::graph make_gpt_block_exported(tg::dim batch = tg::dim("batch")) {
  tg::graph g("gpt_block");
  builder b{g};
  g.add_input("x", tessel::dtype::f32, {batch, S, D});
  b.weight("ln1_g", {D});
  b.weight("ln1_b", {D});
  b.weight("ln2_g", {D});
  b.weight("ln2_b", {D});
  b.weight("w_attn", {D, 3 * D});
  b.weight("b_attn", {3 * D});
  b.weight("w_proj", {D, D});
  b.weight("b_proj", {D});
  b.weight("w_fc", {D, FF});
  b.weight("b_fc", {FF});
  b.weight("w_out", {FF, D});
  b.weight("b_out", {D});
  // The registered causal buffer, larger than the sequence (max positions 8), sliced per call.
  std::vector<std::uint8_t> tril(64);
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) tril[static_cast<std::size_t>(i * 8 + j)] = j <= i ? 1 : 0;
  g.add_constant<std::uint8_t>("attn_bias", {1, 1, 8, 8}, tril);

  const std::string n1 = b.layer_norm("x", "ln1_g", "ln1_b", true);
  const std::string qkv = b.linear(n1, "w_attn", "b_attn");
  g.add_node("Split", "split_qkv", {qkv, b.i64s({D, D, D})}, {"q", "k", "v"}, {{"axis", std::int64_t{2}}});
  std::string heads[3];
  const char* names[3] = {"q", "k", "v"};
  for (int t = 0; t < 3; ++t) {
    const std::string x = names[t];
    const std::string shape = b.op("Concat", {b.dim_of(x, 0), b.dim_of(x, 1), b.i64s({H}), b.i64s({HD})}, {{"axis", std::int64_t{0}}});
    heads[t] = b.op("Transpose", {b.op("Reshape", {x, shape})}, {{"perm", tg::ints{0, 2, 1, 3}}});
  }
  const std::string kt = b.op("Transpose", {heads[1]}, {{"perm", tg::ints{0, 1, 3, 2}}});
  std::string w = b.op("MatMul", {heads[0], kt});
  w = b.op("Div", {w, b.f32(std::sqrt(static_cast<float>(HD)))});
  // causal_mask = bias[:, :, k_len - q_len : k_len, :k_len], lengths read from the shapes.
  auto len = [&](const std::string& x) { return b.op("Gather", {b.op("Shape", {x}), b.i64(2)}, {{"axis", std::int64_t{0}}}); };
  const std::string q_len = len(heads[0]), k_len = len(heads[1]);
  const std::string start = b.op("Unsqueeze", {b.op("Sub", {k_len, q_len}), b.i64s({0})});
  const std::string end = b.op("Unsqueeze", {k_len, b.i64s({0})});
  const std::string rows = b.op("Slice", {"attn_bias", start, end, b.i64s({2}), b.i64s({1})});
  const std::string mask = b.op("Slice", {rows, b.i64s({0}), end, b.i64s({3}), b.i64s({1})});
  w = b.op("Where", {mask, w, b.f32(-3.4028234663852886e38f)});
  const std::string p = b.op("Softmax", {w}, {{"axis", std::int64_t{-1}}});
  g.add_node("MatMul", "context", {p, heads[2]}, {"context"});
  const std::string a = b.op("Transpose", {"context"}, {{"perm", tg::ints{0, 2, 1, 3}}});
  const std::string merged = b.op("Reshape", {a, b.op("Concat", {b.dim_of(a, 0), b.dim_of(a, 1), b.i64s({D})}, {{"axis", std::int64_t{0}}})});
  const std::string attn = b.linear(merged, "w_proj", "b_proj");
  const std::string r = b.op("Add", {attn, "x"});
  const std::string n2 = b.layer_norm(r, "ln2_g", "ln2_b", false);
  const std::string h = b.gelu_tanh(b.linear(n2, "w_fc", "b_fc"));
  const std::string m = b.linear(h, "w_out", "b_out");
  g.add_node("Add", "residual2", {r, m}, {"y"});
  g.mark_output("y");
  return g;
}

// A LLaMA block (S = 6, D = 32, 4 query heads and 2 key/value heads of 8, FF = 64, no rotary) with
// input x [batch, S, D], as the exporter writes HF's LlamaDecoderLayer: RMSNorm as Pow, ReduceMean,
// Add, Sqrt, Reciprocal (layer 1) or Div(1, ·) (layer 2), Mul, Mul; repeat_kv as Unsqueeze, Expand,
// Reshape with shapes read from the tensors; an additive causal mask; a SiLU-gated MLP.
inline tg::graph make_llama_block_exported(tg::dim batch) {
  constexpr std::int64_t HKV = 2, LFF = 64;
  tg::graph g("llama_block");
  builder b{g};
  g.add_input("x", tessel::dtype::f32, {batch, S, D});
  b.weight("rms1_g", {D});
  b.weight("rms2_g", {D});
  b.weight("wq", {D, H * HD});
  b.weight("wk", {D, HKV * HD});
  b.weight("wv", {D, HKV * HD});
  b.weight("wo", {H * HD, D});
  b.weight("w_gate", {D, LFF});
  b.weight("w_up", {D, LFF});
  b.weight("w_down", {LFF, D});
  std::vector<float> causal(static_cast<std::size_t>(S * S));
  for (std::int64_t i = 0; i < S; ++i)
    for (std::int64_t j = 0; j < S; ++j) causal[static_cast<std::size_t>(i * S + j)] = j <= i ? 0.0f : -3.4028234663852886e38f;
  g.add_constant<float>("causal_mask", {1, 1, S, S}, causal);

  auto rms = [&](const std::string& x, const std::string& gamma, bool reciprocal) {
    const std::string ms = b.op("ReduceMean", {b.op("Pow", {x, b.f32(2.0f)})}, {{"axes", tg::ints{-1}}});
    const std::string r = b.op("Sqrt", {b.op("Add", {ms, b.f32(1e-6f)})});
    const std::string inv = reciprocal ? b.op("Reciprocal", {r}) : b.op("Div", {b.f32(1.0f), r});
    return b.op("Mul", {gamma, b.op("Mul", {x, inv})});
  };
  auto heads = [&](const std::string& x, const std::string& w, std::int64_t n) {
    const std::string p = b.op("MatMul", {x, w});
    const std::string shape = b.op("Concat", {b.dim_of(p, 0), b.dim_of(p, 1), b.i64s({n}), b.i64s({HD})}, {{"axis", std::int64_t{0}}});
    return b.op("Transpose", {b.op("Reshape", {p, shape})}, {{"perm", tg::ints{0, 2, 1, 3}}});
  };
  auto repeat_kv = [&](const std::string& x) {  // x[:, :, None].expand(b, hkv, n_rep, s, d).reshape(b, hkv * n_rep, s, d)
    const std::string u = b.op("Unsqueeze", {x, b.i64s({2})});
    const std::string e5 = b.op("Concat", {b.dim_of(x, 0), b.i64s({HKV, H / HKV}), b.dim_of(x, 2), b.dim_of(x, 3)}, {{"axis", std::int64_t{0}}});
    const std::string e = b.op("Expand", {u, e5});
    const std::string r4 = b.op("Concat", {b.dim_of(x, 0), b.i64s({H}), b.dim_of(x, 2), b.dim_of(x, 3)}, {{"axis", std::int64_t{0}}});
    return b.op("Reshape", {e, r4});
  };

  const std::string n1 = rms("x", "rms1_g", true);
  const std::string q = heads(n1, "wq", H);
  const std::string k = repeat_kv(heads(n1, "wk", HKV));
  const std::string v = repeat_kv(heads(n1, "wv", HKV));
  std::string w = b.op("MatMul", {q, b.op("Transpose", {k}, {{"perm", tg::ints{0, 1, 3, 2}}})});
  w = b.op("Add", {b.op("Div", {w, b.f32(std::sqrt(static_cast<float>(HD)))}), "causal_mask"});
  g.add_node("MatMul", "context", {b.op("Softmax", {w}, {{"axis", std::int64_t{-1}}}), v}, {"context"});
  const std::string a = b.op("Transpose", {"context"}, {{"perm", tg::ints{0, 2, 1, 3}}});
  const std::string merged = b.op("Reshape", {a, b.op("Concat", {b.dim_of(a, 0), b.dim_of(a, 1), b.i64s({D})}, {{"axis", std::int64_t{0}}})});
  g.add_node("Add", "residual1", {"x", b.op("MatMul", {merged, "wo"})}, {"h"});
  const std::string n2 = rms("h", "rms2_g", false);
  const std::string gate = b.op("MatMul", {n2, "w_gate"});
  const std::string act = b.op("Mul", {gate, b.op("Sigmoid", {gate})});
  const std::string mlp = b.op("MatMul", {b.op("Mul", {act, b.op("MatMul", {n2, "w_up"})}), "w_down"});
  g.add_node("Add", "residual2", {"h", mlp}, {"y"});
  g.mark_output("y");
  return g;
}

}  // namespace tessel_test_graph
