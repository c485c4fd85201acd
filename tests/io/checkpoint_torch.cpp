// tessel::io against the PyTorch reference checkpoints (tools/torch/reference_models.py, CTest
// fixture torch_reference_fixtures): each model's config.json parses, model.safetensors holds exactly
// the tensors its config implies for its family (names and shapes: the contract the nn layer codes
// against) with parameter_count() elements, the sharded copy loads through the index bit for bit,
// and inputs/reference files have the names, dtypes and shapes tools/torch/README.md documents.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <tessel/io/model_config.hpp>
#include <tessel/io/safetensors.hpp>

namespace tessel_test_io_checkpoint_torch {

namespace {

namespace fs = std::filesystem;
namespace io = tessel::io;
using io::st_dtype;
using shape_t = std::vector<std::size_t>;

// The build's fixture directory; TESSEL_TORCH_FIXTURES in the environment points elsewhere.
fs::path fixtures_root() {
  if (const char* env = std::getenv("TESSEL_TORCH_FIXTURES"); env != nullptr && *env != '\0') return env;
  return TESSEL_TORCH_FIXTURES;
}

// Every model directory the script wrote (those with a reference.safetensors), sorted.
std::vector<fs::path> model_dirs() {
  const fs::path root = fixtures_root();
  INFO("no fixtures in " << root.string()
                         << ": run `ctest -L torch` (its setup test torch_reference_fixtures writes them) or "
                            "tools/torch/reference_models.py DIR with TESSEL_TORCH_FIXTURES=DIR");
  REQUIRE(fs::is_directory(root));
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory() && fs::exists(e.path() / "reference.safetensors")) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end());
  REQUIRE_FALSE(dirs.empty());
  return dirs;
}

shape_t shape_of(const io::tensor_view& t) { return shape_t(t.shape().begin(), t.shape().end()); }

std::set<std::string> names_of(const io::safetensors_reader& r) {
  const auto n = r.names();
  return {n.begin(), n.end()};
}

// The parameters a Hugging Face model of this config holds, by name, with their shapes. This is
// the contract nn/ relies on: a weight of nn.Linear is (out, in); GPT-2's Conv1D stores (in, out)
// (linear_weights_transposed) and fuses q|k|v into c_attn; a tied lm_head is not stored.
std::map<std::string, shape_t> expected_parameters(const io::model_config& c) {
  const std::size_t hid = c.hidden_size, voc = c.vocab_size, inter = c.intermediate_size;
  const std::size_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  std::map<std::string, shape_t> p;
  const auto linear = [&](const std::string& name, std::size_t in, std::size_t out, bool bias) {
    p[name + ".weight"] = c.linear_weights_transposed ? shape_t{in, out} : shape_t{out, in};
    if (bias) p[name + ".bias"] = {out};
  };
  const auto norm = [&](const std::string& name) {
    p[name + ".weight"] = {hid};
    if (c.norm == io::norm_kind::layer_norm) p[name + ".bias"] = {hid};
  };
  if (c.naming == io::param_naming::gpt2) {
    p["transformer.wte.weight"] = {voc, hid};
    p["transformer.wpe.weight"] = {c.max_position_embeddings, hid};
    for (std::size_t i = 0; i < c.num_hidden_layers; ++i) {
      const std::string h = "transformer.h." + std::to_string(i) + ".";
      norm(h + "ln_1");
      linear(h + "attn.c_attn", hid, q + 2 * kv, c.qkv_bias);
      linear(h + "attn.c_proj", q, hid, c.o_bias);
      norm(h + "ln_2");
      linear(h + "mlp.c_fc", hid, inter, c.mlp_bias);
      linear(h + "mlp.c_proj", inter, hid, c.mlp_bias);
    }
    norm("transformer.ln_f");
  } else {
    p["model.embed_tokens.weight"] = {voc, hid};
    for (std::size_t i = 0; i < c.num_hidden_layers; ++i) {
      const std::string l = "model.layers." + std::to_string(i) + ".";
      norm(l + "input_layernorm");
      linear(l + "self_attn.q_proj", hid, q, c.qkv_bias);
      linear(l + "self_attn.k_proj", hid, kv, c.qkv_bias);
      linear(l + "self_attn.v_proj", hid, kv, c.qkv_bias);
      linear(l + "self_attn.o_proj", q, hid, c.o_bias);
      norm(l + "post_attention_layernorm");
      if (c.is_moe()) {
        REQUIRE(c.naming == io::param_naming::mixtral);
        linear(l + "block_sparse_moe.gate", hid, c.num_local_experts, false);
        for (std::size_t e = 0; e < c.num_local_experts; ++e) {
          const std::string x = l + "block_sparse_moe.experts." + std::to_string(e) + ".";
          linear(x + "w1", hid, inter, c.mlp_bias);  // gate
          linear(x + "w3", hid, inter, c.mlp_bias);  // up
          linear(x + "w2", inter, hid, c.mlp_bias);  // down
        }
      } else {
        linear(l + "mlp.gate_proj", hid, inter, c.mlp_bias);
        linear(l + "mlp.up_proj", hid, inter, c.mlp_bias);
        linear(l + "mlp.down_proj", inter, hid, c.mlp_bias);
      }
    }
    norm("model.norm");
  }
  if (!c.tie_word_embeddings) p["lm_head.weight"] = {voc, hid};
  return p;
}

std::vector<float> floats(const io::tensor_view& t) {
  const auto d = t.data<float>();
  return {d.span().begin(), d.span().end()};
}
std::vector<std::int64_t> ints(const io::tensor_view& t) {
  const auto d = t.data<std::int64_t>();
  return {d.span().begin(), d.span().end()};
}

void check_provenance(const io::safetensors_reader& r) {
  INFO(r.file());
  for (const char* key : {"torch_version", "seed", "model", "generator"}) {
    INFO(key);
    CHECK(r.metadata().count(key) == 1);
  }
}

constexpr std::int64_t ignore_index = -100;

// Mean of logsumexp(logits[b,t]) - logits[b,t,y] over targets y != -100, in double.
double cross_entropy(const std::vector<float>& logits, const std::vector<std::int64_t>& targets, std::size_t vocab) {
  double total = 0;
  std::size_t count = 0;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] == ignore_index) continue;
    const float* row = logits.data() + i * vocab;
    const double mx = *std::max_element(row, row + vocab);
    double z = 0;
    for (std::size_t v = 0; v < vocab; ++v) z += std::exp(row[v] - mx);
    total += mx + std::log(z) - row[static_cast<std::size_t>(targets[i])];
    ++count;
  }
  REQUIRE(count > 0);
  return total / static_cast<double>(count);
}

}  // namespace

TEST_CASE("torch fixtures: model.safetensors holds exactly the tensors its config implies", "[io][torch]") {
  for (const auto& dir : model_dirs()) {
    INFO(dir.string());
    const auto c = io::load_model_config(dir);
    CHECK(c.torch_dtype == "float32");
    const auto model = io::safetensors_reader::open(dir / "model.safetensors");
    const auto expected = expected_parameters(c);
    std::set<std::string> want;
    for (const auto& [name, _] : expected) want.insert(name);
    CHECK(names_of(model) == want);
    std::size_t numel = 0;
    for (const auto& t : model.tensors()) {
      INFO(t.name());
      CHECK(t.dtype() == st_dtype::f32);
      if (expected.count(t.name()) != 0) CHECK(shape_of(t) == expected.at(t.name()));
      CHECK(t.aligned<float>());  // the writer's order keeps every tensor zero-copy
      numel += t.numel();
    }
    CHECK(numel == c.parameter_count());
  }
}

TEST_CASE("torch fixtures: the sharded llama loads through the index bit for bit", "[io][torch]") {
  const fs::path root = fixtures_root();
  REQUIRE(fs::is_directory(root / "llama_sharded"));
  CHECK(io::load_model_config(root / "llama_sharded") == io::load_model_config(root / "llama"));
  const auto sharded = io::safetensors_checkpoint::open(root / "llama_sharded");
  const auto single = io::safetensors_checkpoint::open(root / "llama");
  // (as strings: Catch's string_view printer is missing where catch_main.cpp is built before C++17)
  CHECK(fs::path(sharded.file()).filename().string() == std::string(io::index_file_name));
  std::set<std::string> shard_files;
  for (const auto& s : sharded.shards()) shard_files.insert(fs::path(s.file()).filename().string());
  CHECK(shard_files == std::set<std::string>{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"});
  CHECK(single.shards().size() == 1);
  REQUIRE(sharded.names() == single.names());
  std::size_t bytes = 0;
  for (const auto& name : single.names()) {
    INFO(name);
    const auto a = sharded.tensor(name), b = single.tensor(name);
    CHECK(a.dtype() == b.dtype());
    CHECK(shape_of(a) == shape_of(b));
    REQUIRE(a.bytes().size() == b.bytes().size());
    CHECK(std::memcmp(a.bytes().data(), b.bytes().data(), a.bytes().size()) == 0);
    bytes += a.bytes().size();
  }
  std::ifstream index_file(root / "llama_sharded" / io::index_file_name);
  const auto index = nlohmann::json::parse(index_file);
  CHECK(index.at("metadata").at("total_size").get<std::size_t>() == bytes);
}

TEST_CASE("torch fixtures: inputs hold input_ids, labels and shifted targets", "[io][torch]") {
  for (const auto& dir : model_dirs()) {
    INFO(dir.string());
    const auto c = io::load_model_config(dir);
    const auto in = io::safetensors_reader::open(dir / "inputs.safetensors");
    check_provenance(in);
    CHECK(names_of(in) == std::set<std::string>{"input_ids", "labels", "targets"});
    const auto ids_t = in.tensor("input_ids");
    REQUIRE(ids_t.shape().size() == 2);
    const shape_t bs = shape_of(ids_t);
    const std::size_t seq = bs[1];
    for (const char* n : {"input_ids", "labels", "targets"}) {
      INFO(n);
      CHECK(in.tensor(n).dtype() == st_dtype::i64);
      CHECK(shape_of(in.tensor(n)) == bs);
    }
    const auto ids = ints(ids_t), labels = ints(in.tensor("labels")), targets = ints(in.tensor("targets"));
    std::size_t ignored = 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      CHECK((ids[i] >= 0 && static_cast<std::size_t>(ids[i]) < c.vocab_size));
      CHECK((labels[i] == ignore_index || labels[i] == ids[i]));  // HF convention: labels are the ids
      const std::size_t t = i % seq;
      CHECK(targets[i] == (t + 1 < seq ? labels[i + 1] : ignore_index));
      if (t > 0 && labels[i] == ignore_index) ++ignored;
    }
    CHECK(ignored > 0);  // the ignore index is exercised where it counts (not only at t = 0)
  }
}

TEST_CASE("torch fixtures: reference tensors have the documented names, dtypes and shapes", "[io][torch]") {
  for (const auto& dir : model_dirs()) {
    INFO(dir.string());
    const auto c = io::load_model_config(dir);
    const auto model = io::safetensors_reader::open(dir / "model.safetensors");
    const auto ref = io::safetensors_reader::open(dir / "reference.safetensors");
    check_provenance(ref);
    const shape_t bs = shape_of(io::safetensors_reader::open(dir / "inputs.safetensors").tensor("input_ids"));
    const std::size_t steps = 20;
    std::map<std::string, shape_t> want = {{"logits", {bs[0], bs[1], c.vocab_size}}, {"loss", {1}}, {"losses20", {steps}}, {"losses20_f64", {steps}}};
    for (const auto& t : model.tensors())
      for (const char* prefix : {"grad.", "adamw20.", "adamw20_f64."}) want[prefix + t.name()] = shape_of(t);
    if (c.is_moe()) {
      want["aux_loss"] = {1};
      for (std::size_t i = 0; i < c.num_hidden_layers; ++i) want["router_logits." + std::to_string(i)] = {bs[0] * bs[1], c.num_local_experts};
      for (const auto& t : model.tensors()) want["grad_total." + t.name()] = shape_of(t);
    }
    std::set<std::string> names;
    for (const auto& [n, _] : want) names.insert(n);
    CHECK(names_of(ref) == names);
    for (const auto& t : ref.tensors()) {
      INFO(t.name());
      CHECK(t.dtype() == st_dtype::f32);
      if (want.count(t.name()) != 0) CHECK(shape_of(t) == want.at(t.name()));
      const auto v = floats(t);
      CHECK(std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); }));
    }
    // AdamW moved every parameter (weight decay alone does), and the loss went down.
    for (const auto& t : model.tensors()) {
      INFO(t.name());
      CHECK(floats(t) != floats(ref.tensor("adamw20." + t.name())));
    }
    const auto losses = floats(ref.tensor("losses20"));
    CHECK(losses.back() < losses.front());
  }
}

TEST_CASE("torch fixtures: loss and aux loss follow the documented conventions", "[io][torch]") {
  for (const auto& dir : model_dirs()) {
    INFO(dir.string());
    const auto c = io::load_model_config(dir);
    const auto in = io::safetensors_reader::open(dir / "inputs.safetensors");
    const auto ref = io::safetensors_reader::open(dir / "reference.safetensors");
    const auto logits = floats(ref.tensor("logits"));
    const double loss = floats(ref.tensor("loss"))[0];
    // HF's shift, spelled two ways: logits at t against labels at t + 1, or against targets at t.
    const auto labels = ints(in.tensor("labels")), targets = ints(in.tensor("targets"));
    const std::size_t seq = in.tensor("labels").shape()[1];
    std::vector<std::int64_t> shifted(labels.size(), ignore_index);
    for (std::size_t i = 0; i < labels.size(); ++i)
      if (i % seq + 1 < seq) shifted[i] = labels[i + 1];
    CHECK(cross_entropy(logits, targets, c.vocab_size) == Approx(loss).epsilon(1e-6));
    CHECK(cross_entropy(logits, shifted, c.vocab_size) == Approx(loss).epsilon(1e-6));
    // The f32 and f64 AdamW runs start at the reference loss.
    CHECK(floats(ref.tensor("losses20"))[0] == Approx(loss).epsilon(1e-5));
    CHECK(floats(ref.tensor("losses20_f64"))[0] == Approx(loss).epsilon(1e-6));
    if (!c.is_moe()) continue;
    // aux = E * sum_e f_e * P_e over every layer's tokens: f_e the fraction of tokens with e in
    // their top-k, P_e the mean router probability of e.
    const std::size_t experts = c.num_local_experts, k = c.num_experts_per_tok;
    std::vector<double> count(experts, 0.0), prob(experts, 0.0);
    std::size_t tokens = 0;
    for (std::size_t l = 0; l < c.num_hidden_layers; ++l) {
      const auto r = floats(ref.tensor("router_logits." + std::to_string(l)));
      for (std::size_t row = 0; row < r.size() / experts; ++row, ++tokens) {
        const float* x = r.data() + row * experts;
        const double mx = *std::max_element(x, x + experts);
        std::vector<double> p(experts);
        double z = 0;
        for (std::size_t e = 0; e < experts; ++e) z += p[e] = std::exp(x[e] - mx);
        std::vector<std::size_t> order(experts);
        for (std::size_t e = 0; e < experts; ++e) {
          order[e] = e;
          prob[e] += p[e] / z;
        }
        std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                          [&](std::size_t a, std::size_t b) { return p[a] > p[b]; });
        for (std::size_t j = 0; j < k; ++j) count[order[j]] += 1;
      }
    }
    double aux = 0;
    for (std::size_t e = 0; e < experts; ++e) aux += (count[e] / tokens) * (prob[e] / tokens);
    aux *= static_cast<double>(experts);
    CHECK(aux == Approx(floats(ref.tensor("aux_loss"))[0]).epsilon(1e-5));
  }
}

TEST_CASE("torch fixtures: cover every family and feature the model layer reads", "[io][torch]") {
  std::set<io::model_family> families;
  bool gqa = false, window = false, qkv_bias_only = false, all_bias = false, tied_rotary = false, llama3 = false, head_dim_apart = false, moe = false;
  for (const auto& dir : model_dirs()) {
    const auto c = io::load_model_config(dir);
    const std::size_t seq = io::safetensors_reader::open(dir / "inputs.safetensors").tensor("input_ids").shape()[1];
    families.insert(c.family);
    gqa |= c.num_key_value_heads < c.num_attention_heads;
    window |= c.sliding_window && *c.sliding_window < seq;
    qkv_bias_only |= c.qkv_bias && !c.o_bias;
    all_bias |= c.positions == io::position_kind::rotary && c.qkv_bias && c.o_bias && c.mlp_bias;
    tied_rotary |= c.positions == io::position_kind::rotary && c.tie_word_embeddings;
    llama3 |= c.rope_scaling.type == io::rope_scaling_type::llama3;
    head_dim_apart |= c.head_dim * c.num_attention_heads != c.hidden_size;
    moe |= c.is_moe() && c.num_experts_per_tok > 1;
  }
  CHECK(families.size() == 5);
  CHECK(gqa);
  CHECK(window);
  CHECK(qkv_bias_only);
  CHECK(all_bias);
  CHECK(tied_rotary);
  CHECK(llama3);
  CHECK(head_dim_apart);
  CHECK(moe);
}
}  // namespace tessel_test_io_checkpoint_torch
