// graph/onnx.hpp against the reference models of tools/torch/onnx_models.py (fixture onnx_reference):
// six networks exported by PyTorch at opsets 14 and 17 import with ONNX's own op histogram (every
// Constant node a graph constant), their inputs and outputs with the symbolic batch, and every value's
// dtype and shape inferred; with the batch of the saved inputs every dim is known and the outputs
// take the shapes PyTorch computed.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <tessel/graph/onnx.hpp>
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
      {"unet",
       {{{"image", "f32[batch,3,32,32]"}}, {{"output", "f32[batch,4,32,32]"}}, {{"Conv", 11}, {"Resize", 2}, {"Concat", 2}, {"MaxPool", 2}}}},
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

}  // namespace tessel_test_onnx_models_torch
