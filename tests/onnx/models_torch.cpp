// graph/onnx.hpp against the reference models of tools/torch/onnx_models.py (fixture onnx_reference):
// six networks exported by PyTorch at opsets 14 and 17 import with ONNX's own op histogram (every
// Constant node a graph constant), their inputs and outputs with the symbolic batch, and every value's
// dtype and shape inferred; with the batch of the saved inputs every dim is known and the outputs
// take the shapes PyTorch computed. Then each runs: optimized (graph/passes.hpp), compiled on the host
// and on an emulated UBL128 card, f32 and bf16 compute, planned and unplanned arenas, against
// PyTorch's saved outputs (TESSEL_MODEL_TABLE=1 prints the per-model numbers).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/emulator/card.hpp>
#include <tessel/graph/executor.hpp>
#include <tessel/graph/onnx.hpp>
#include <tessel/graph/passes.hpp>
#include <tessel/io/safetensors.hpp>

namespace tessel_test_onnx_models_torch {

namespace tg = tessel::graph;
namespace fs = std::filesystem;

fs::path fixtures() {
  if (const char* e = std::getenv("TESSEL_ONNX_FIXTURES")) return e;
  return TESSEL_ONNX_FIXTURES;
}

struct model_facts {
  std::vector<std::pair<std::string, std::string>> inputs, outputs;  // name, type with the symbolic batch
  std::map<std::string, std::size_t> ops;                            // a few counts from the model's structure
};

const std::map<std::string, model_facts>& facts() {
  static const std::map<std::string, model_facts> f = {
      {"gpt2", {{{"ids", "i64[batch,8]"}}, {{"output", "f32[batch,8,61]"}}, {{"Softmax", 2}, {"Tanh", 2}, {"Split", 2}}}},
      {"bert",
       {{{"ids", "i64[batch,8]"}, {"attention_mask", "i64[batch,8]"}},
        {{"hidden", "f32[batch,8,32]"}, {"pooled", "f32[batch,32]"}},
        {{"Softmax", 2}, {"Erf", 2}, {"Gemm", 1}}}},
      {"llama", {{{"ids", "i64[batch,8]"}}, {{"output", "f32[batch,8,61]"}}, {{"Softmax", 2}, {"Sigmoid", 2}, {"Neg", 4}}}},
      {"resnet",
       {{{"image", "f32[batch,3,32,32]"}}, {{"output", "f32[batch,10]"}}, {{"Conv", 20}, {"Add", 8}, {"MaxPool", 1}, {"GlobalAveragePool", 1}}}},
      {"vit", {{{"image", "f32[batch,3,16,16]"}}, {{"output", "f32[batch,10]"}}, {{"Conv", 1}, {"Softmax", 2}, {"Erf", 2}}}},
      {"unet", {{{"image", "f32[batch,3,32,32]"}}, {{"output", "f32[batch,4,32,32]"}}, {{"Conv", 11}, {"Resize", 2}, {"Concat", 2}, {"MaxPool", 2}}}},
  };
  return f;
}

void require_all_shapes(const tg::graph& g, bool batch_known) {
  for (tg::node_id id : g.node_ids())
    for (tg::value_id v : g.get(id).outputs) {
      if (v == tg::value_id::none) continue;
      const tg::value& x = g.get(v);
      INFO(x.name << ": " << x.type_info().to_string());
      REQUIRE(x.type.has_value());
      REQUIRE(x.shape.rank_known);
      for (const tg::dim& d : x.shape.dims) REQUIRE((d.known() || (!batch_known && d.symbol == "batch")));
    }
}

TEST_CASE("onnx: the PyTorch reference models import at opsets 14 and 17", "[onnx][torch]") {
  for (const auto& [model, f] : facts()) {
    for (int opset : {14, 17}) {
      const std::string stem = model + "_op" + std::to_string(opset);
      INFO(stem);
      const fs::path file = fixtures() / (stem + ".onnx");
      REQUIRE(fs::exists(file));
      nlohmann::json manifest;
      std::ifstream(fixtures() / (stem + ".json")) >> manifest;
      REQUIRE(manifest.at("opset").get<int>() == opset);

      tg::onnx_import_info info;
      tg::onnx_options o;
      o.info = &info;
      tg::graph g = tg::import_onnx(file, o);
      CHECK(info.opset == opset);
      CHECK_FALSE(info.converted);

      // ONNX's histogram, less the Constant nodes, which became constants.
      const auto hist = g.count_by_op();
      std::size_t onnx_constants = 0;
      for (const auto& [op, n] : manifest.at("ops").items()) {
        INFO(op);
        if (op == "Constant") {
          onnx_constants = n.get<std::size_t>();
          continue;
        }
        REQUIRE(hist.count(op));
        CHECK(hist.at(op) == n.get<std::size_t>());
      }
      CHECK(hist.size() == manifest.at("ops").size() - (onnx_constants ? 1 : 0));
      CHECK(g.node_count() == manifest.at("nodes").get<std::size_t>() - onnx_constants);
      CHECK(g.constants().size() == manifest.at("initializers").get<std::size_t>() + onnx_constants);
      for (const auto& [op, n] : f.ops) {
        INFO(op);
        CHECK((hist.count(op) ? hist.at(op) : 0) == n);
      }
      // Opset 17 has LayerNormalization; 14 spells it out (ReduceMean, Sub, Pow, Sqrt, Div).
      if (model != "llama" && model != "resnet" && model != "unet") {
        CHECK(hist.count("LayerNormalization") == (opset == 17 ? 1u : 0u));
        CHECK(hist.count("ReduceMean") == (opset == 17 ? 0u : 1u));
      }

      REQUIRE(g.inputs().size() == f.inputs.size());
      for (std::size_t i = 0; i < f.inputs.size(); ++i) {
        CHECK(g.get(g.inputs()[i]).name == f.inputs[i].first);
        CHECK(g.get(g.inputs()[i]).type_info().to_string() == f.inputs[i].second);
      }
      REQUIRE(g.outputs().size() == f.outputs.size());
      for (std::size_t i = 0; i < f.outputs.size(); ++i) {
        CHECK(g.get(g.outputs()[i]).name == f.outputs[i].first);
        CHECK(g.get(g.outputs()[i]).type_info().to_string() == f.outputs[i].second);
      }
      require_all_shapes(g, false);

      // The saved inputs' batch makes every dim known, and the outputs PyTorch's shapes.
      const auto io = tessel::io::safetensors_reader::open(fixtures() / (model + ".io.safetensors"));
      for (tg::value_id v : g.inputs()) {
        const tg::value& x = g.get(v);
        const auto t = io.tensor("input." + x.name);
        tg::tensor_shape s;
        for (std::size_t d : t.shape()) s.dims.emplace_back(d);
        g.set_value_type(v, x.type, s);
      }
      g.infer_shapes();
      require_all_shapes(g, true);
      for (tg::value_id v : g.outputs()) {
        const tg::value& x = g.get(v);
        const auto t = io.tensor("output." + x.name);
        std::vector<std::int64_t> want(t.shape().begin(), t.shape().end());
        std::vector<std::int64_t> got;
        for (const tg::dim& d : x.shape.dims) got.push_back(d.size);
        CHECK(got == want);
      }
    }
  }
}

// ---- the imported models run on tessel's operators, against PyTorch ------------------------------------------

// The numbers a model's run is judged by: its GEMM-like depth and widest reduction, both read off
// the optimized graph (MatMul/Gemm/Conv and their fused forms).
struct depth_info {
  std::size_t layers = 0, k_max = 1;
};

depth_info depth_of(const tg::graph& g) {
  depth_info d;
  for (tg::node_id id : g.node_ids()) {
    const tg::node& n = g.get(id);
    std::size_t k = 0;
    const auto dims = [&](std::size_t i) {
      std::vector<std::size_t> s;
      for (const tg::dim& x : g.get(n.inputs[i]).shape.dims) s.push_back(static_cast<std::size_t>(x.size));
      return s;
    };
    if (n.op == "MatMul" || n.op == "FusedMatMul")
      k = dims(0).back();
    else if (n.op == "Gemm")
      k = n.get_int("transA", 0) ? dims(0)[0] : dims(0)[1];
    else if (n.op == "Conv" || n.op == "FusedConv") {
      const auto w = dims(1);
      k = 1;
      for (std::size_t i = 1; i < w.size(); ++i) k *= w[i];
    } else if (n.op == "Attention") {
      k = std::max(dims(0).back(), dims(1)[2]);  // the head dim (QK^T), the keys (PV)
      ++d.layers;                                // two GEMMs
    } else
      continue;
    ++d.layers;
    d.k_max = std::max(d.k_max, k);
  }
  return d;
}

struct run_error {
  double max_abs = 0, max_rel = 0, ref_max = 0;
};

// Max |got − want| and the same over max|want| (a normwise relative error: the elementwise one is
// meaningless at the outputs' zeros), over every float output.
run_error compare(const tg::tensor_map& got, const tessel::io::safetensors_reader& io) {
  run_error e;
  for (const auto& [name, t] : got) {
    const auto ref = io.tensor("output." + name);
    REQUIRE(t.type == tessel::dtype::f32);
    REQUIRE(t.data.size() == ref.bytes().size());
    const auto v = t.values<float>();
    std::vector<float> r(v.size());
    std::memcpy(r.data(), ref.bytes().data(), ref.bytes().size());
    double m = 0, a = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      m = std::max(m, std::fabs(double(r[i])));
      const double d = std::fabs(double(v[i]) - double(r[i]));
      a = std::isnan(d) ? INFINITY : std::max(a, d);
    }
    e.max_abs = std::max(e.max_abs, a);
    e.ref_max = std::max(e.ref_max, m);
    e.max_rel = std::max(e.max_rel, m > 0 ? a / m : a);
  }
  return e;
}

// For the classifiers and language models: the argmax of each row (the last axis) of `got` equals
// PyTorch's, except where PyTorch's own top two are closer than `tie` (a bound on the difference of
// two outputs' errors: there either answer is right within the bound).
void check_argmax(const tg::host_tensor& got, const tessel::io::safetensors_reader& io, const std::string& name, double tie,
                  std::size_t& rows_checked) {
  const auto ref = io.tensor("output." + name);
  const auto v = got.values<float>();
  std::vector<float> r(v.size());
  std::memcpy(r.data(), ref.bytes().data(), ref.bytes().size());
  const std::size_t n = static_cast<std::size_t>(got.shape.back());
  for (std::size_t row = 0; row + n <= v.size(); row += n) {
    const auto gi = std::max_element(v.begin() + long(row), v.begin() + long(row + n)) - v.begin();
    const auto ri = std::max_element(r.begin() + long(row), r.begin() + long(row + n)) - r.begin();
    float second = -INFINITY;
    for (std::size_t j = row; j < row + n; ++j)
      if (long(j) != ri) second = std::max(second, r[j]);
    if (double(r[std::size_t(ri)]) - double(second) <= tie) continue;
    INFO(name << " row " << row / n);
    CHECK(gi == ri);
    ++rows_checked;
  }
}

bool same_bits(const tg::tensor_map& a, const tg::tensor_map& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, t] : a)
    if (!b.count(k) || t.shape != b.at(k).shape || t.data != b.at(k).data) return false;
  return true;
}

TEST_CASE("onnx: the six PyTorch models run on tessel's operators, on the host and an emulated card, f32 and bf16, within their bounds",
          "[onnx][torch][executor]") {
  const bool table = std::getenv("TESSEL_MODEL_TABLE") != nullptr;
  if (table)
    std::printf("%-7s %3s %6s %6s %-44s %9s %9s %6s %5s %10s %10s %10s %10s\n", "model", "op", "nodes", "after", "fusions", "planned", "unplanned",
                "layers", "K", "f32 err", "f32 bound", "bf16 err", "bf16 bound");
  tessel::host_device host(2);
  tessel::executor ex(2);
  tessel::emu::card_spec spec;
  spec.memory_bytes = std::size_t(256) << 20;
  tessel::emu::card card(0, spec, ex, false, nullptr);
  std::size_t argmax_rows = 0;
  for (const auto& [model, f] : facts()) {
    const auto io = tessel::io::safetensors_reader::open(fixtures() / (model + ".io.safetensors"));
    for (int opset : {14, 17}) {
      const std::string stem = model + "_op" + std::to_string(opset);
      INFO(stem);
      tg::graph g = tg::import_onnx(fixtures() / (stem + ".onnx"));
      const tg::fusion_report rep = tg::optimize(g);
      CHECK(rep.nodes_after < rep.nodes_before);
      // the inputs as saved; the batch symbol bound to theirs
      tg::tensor_map in;
      tg::compile_options o;
      for (tg::value_id v : g.inputs()) {
        const tg::value& x = g.get(v);
        const auto t = io.tensor("input." + x.name);
        tg::host_tensor h;
        h.type = *x.type;
        for (std::size_t d : t.shape()) h.shape.push_back(static_cast<std::int64_t>(d));
        h.data.assign(t.bytes().begin(), t.bytes().end());
        REQUIRE(h.data.size() == h.numel() * tessel::dtype_size(h.type));
        o.symbols["batch"] = h.shape.at(0);
        in.emplace(x.name, std::move(h));
      }
      auto exe = tg::compile(g, host, o);
      const depth_info depth = depth_of(exe.bound_graph());
      const tg::tensor_map y = exe.run(in);
      // the arena: smaller than one buffer per value, and the same bits as no planning
      const std::size_t planned = exe.activations().plan.arena_bytes, unplanned = exe.activations().plan.unplanned_bytes;
      CHECK(planned < unplanned);
      tg::compile_options un = o;
      un.plan_memory = false;
      CHECK(same_bits(y, tg::compile(g, host, un).run(in)));
      // the emulated card runs the same programs: the same bits
      CHECK(same_bits(y, tg::compile(g, card, o).run(in)));

      // f32 bound. A dot product of length K in f32 is off from the exact by at most γ_K·Σ|a·b|
      // ≈ K·u·Σ|a·b| in the worst case, and by about √K·u·Σ|a·b| when the roundings are independent
      // (the probabilistic analysis of Higham & Mary, 2019, which holds with high probability and is
      // the one that matches practice at these sizes). A network adds one such error per GEMM-like
      // layer on the path to the output; independent errors of `layers` layers add in quadrature
      // (√layers), each carried forward with gain about 1 by these normalized networks
      // (LayerNorm/BatchNorm, softmax), so against the output's scale max|y| (standing for Σ|a·b|)
      // the error is about √(layers·K)·u. PyTorch's f32 result has the same bound, doubling it; a
      // factor 2 more covers the normalizations' division by a computed statistic and the
      // probabilistic bound's constant: 4·√(layers·K)·u32, relative to max|y|.
      constexpr double u32 = 0x1p-24, u16 = 0x1p-8;
      const run_error e32 = compare(y, io);
      const double bound32 = 4.0 * std::sqrt(double(depth.layers) * double(depth.k_max)) * u32;
      CHECK(e32.max_rel <= bound32);
      // bf16 bound: each GEMM's inputs are rounded to bf16 (relative u16 each, so a product is off
      // by ≤ 2·u16 and a dot product by ≤ 2·u16·Σ|a·b|, independently of K as accumulation stays
      // f32; the f32 part is negligible next to it); convolution inputs are rounded as GEMM's
      // and attention's. Over `layers` such layers, in quadrature as above, with the same factor 2 for the
      // normalizations: 2·2·u16·√layers, relative to max|y| (PyTorch's f32 result adds nothing).
      tg::compile_options bf = o;
      bf.compute = tessel::dtype::bf16;
      const tg::tensor_map y16 = tg::compile(g, host, bf).run(in);
      CHECK(same_bits(y16, tg::compile(g, card, bf).run(in)));
      const run_error e16 = compare(y16, io);
      const double bound16 = 2.0 * 2.0 * u16 * std::sqrt(double(depth.layers));
      CHECK(e16.max_rel <= bound16);
      if (model == "gpt2" || model == "llama" || model == "resnet" || model == "vit") {
        // a row's two top logits each off by at most bound·max|y|: closer than twice that, either is right
        check_argmax(y.at("output"), io, "output", 2 * bound32 * e32.ref_max, argmax_rows);
        check_argmax(y16.at("output"), io, "output", 2 * bound16 * e16.ref_max, argmax_rows);
      }
      std::string which;
      for (const auto& [p, n] : rep.patterns) which += (which.empty() ? "" : ",") + p + ":" + std::to_string(n);
      if (table)
        std::printf("%-7s %3d %6zu %6zu %-44s %9zu %9zu %6zu %5zu %10.2e %10.2e %10.2e %10.2e\n", model.c_str(), opset, rep.nodes_before,
                    rep.nodes_after, which.c_str(), planned, unplanned, depth.layers, depth.k_max, e32.max_rel, bound32, e16.max_rel, bound16);
    }
  }
  CHECK(argmax_rows > 0);
}

}  // namespace tessel_test_onnx_models_torch
