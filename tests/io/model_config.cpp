// tessel::io model configs: the five families from real Hugging Face config.json files (fixtures/),
// defaults, every contradiction as a typed error naming the field, and the writer's round trip.
#include "io_test_util.hpp"

#include <fstream>
#include <random>
#include <sstream>

#include <tessel/io/model_config.hpp>

namespace tessel_test_io_model_config {

using io_test::require_io_error;
using io_test::temp_dir;
using tessel::errc;
namespace io = tessel::io;
using nlohmann::json;

namespace {

const std::filesystem::path fixtures = std::filesystem::path(__FILE__).parent_path() / "fixtures";

json fixture(const std::string& name) {
  std::ifstream in(fixtures / (name + ".json"));
  REQUIRE(in.good());
  return json::parse(in);
}

io::model_config parse(const json& j) { return io::parse_model_config(j.dump(), "cfg.json"); }

// parse(to_json(c)) == c, and writing again gives the same text.
void check_round_trip(const io::model_config& c) {
  const std::string text = io::to_json(c).dump(2);
  INFO(text);
  const auto again = io::parse_model_config(text);
  CHECK(again == c);
  CHECK(io::to_json(again).dump(2) == text);
}

}  // namespace

TEST_CASE("model_config Llama 3 and 3.1 (llama3 rope scaling)", "[io][model_config]") {
  const auto c = io::load_model_config(fixtures / "llama-3-8b.json");
  CHECK(c.family == io::model_family::llama);
  CHECK(c.architectures == std::vector<std::string>{"LlamaForCausalLM"});
  CHECK(c.vocab_size == 128256);
  CHECK(c.hidden_size == 4096);
  CHECK(c.intermediate_size == 14336);
  CHECK(c.num_hidden_layers == 32);
  CHECK(c.num_attention_heads == 32);
  CHECK(c.num_key_value_heads == 8);
  CHECK(c.head_dim == 128);
  CHECK(c.max_position_embeddings == 8192);
  CHECK(c.act == io::activation::silu);
  CHECK(c.norm == io::norm_kind::rms_norm);
  CHECK(c.norm_eps == 1e-5);
  CHECK(c.rope_theta == 500000.0);
  CHECK(c.rope_scaling.type == io::rope_scaling_type::none);
  CHECK_FALSE(c.tie_word_embeddings);
  CHECK_FALSE((c.qkv_bias || c.o_bias || c.mlp_bias));
  CHECK_FALSE(c.sliding_window);
  CHECK_FALSE(c.is_moe());
  CHECK_FALSE(c.linear_weights_transposed);
  CHECK(c.naming == io::param_naming::llama);
  CHECK(c.bos_token_id == 128000);
  CHECK(c.eos_token_ids == std::vector<std::int64_t>{128001});
  CHECK(c.torch_dtype == "bfloat16");
  CHECK(c.parameter_count() == 8'030'261'248ULL);  // Meta-Llama-3-8B
  check_round_trip(c);

  const auto c31 = io::load_model_config(fixtures / "llama-3.1-8b.json");
  CHECK(c31.max_position_embeddings == 131072);
  CHECK(c31.rope_scaling.type == io::rope_scaling_type::llama3);
  CHECK(c31.rope_scaling.factor == 8.0);
  CHECK(c31.rope_scaling.low_freq_factor == 1.0);
  CHECK(c31.rope_scaling.high_freq_factor == 4.0);
  CHECK(c31.rope_scaling.original_max_position_embeddings == 8192);
  CHECK(c31.eos_token_ids == std::vector<std::int64_t>{128001, 128008, 128009});
  CHECK(c31.parameter_count() == c.parameter_count());
  check_round_trip(c31);
}

TEST_CASE("model_config Mistral, Qwen2, Mixtral, GPT-2", "[io][model_config]") {
  const auto m = io::load_model_config(fixtures / "mistral-7b.json");
  CHECK(m.family == io::model_family::mistral);
  CHECK(m.sliding_window == 4096u);
  CHECK(m.num_key_value_heads == 8);
  CHECK(m.parameter_count() == 7'241'732'096ULL);  // Mistral-7B-v0.1
  check_round_trip(m);

  const auto q = io::load_model_config(fixtures / "qwen2-7b.json");
  CHECK(q.family == io::model_family::qwen2);
  CHECK(q.head_dim == 128);
  CHECK(q.num_key_value_heads == 4);
  CHECK(q.qkv_bias);      // bias on q, k, v ...
  CHECK_FALSE(q.o_bias);  // ... not on o_proj
  CHECK_FALSE(q.mlp_bias);
  CHECK_FALSE(q.sliding_window);  // use_sliding_window is false
  CHECK(q.norm_eps == 1e-6);
  CHECK(q.rope_theta == 1e6);
  CHECK(q.parameter_count() == 7'615'616'512ULL);  // Qwen2-7B
  check_round_trip(q);

  const auto x = io::load_model_config(fixtures / "mixtral-8x7b.json");
  CHECK(x.family == io::model_family::mixtral);
  CHECK(x.is_moe());
  CHECK(x.num_local_experts == 8);
  CHECK(x.num_experts_per_tok == 2);
  CHECK(x.router_aux_loss_coef == 0.02);
  CHECK_FALSE(x.sliding_window);  // null in the file
  CHECK(x.naming == io::param_naming::mixtral);
  CHECK(x.parameter_count() == 46'702'792'704ULL);  // Mixtral-8x7B
  check_round_trip(x);

  const auto g = io::load_model_config(fixtures / "gpt2.json");
  CHECK(g.family == io::model_family::gpt2);
  CHECK(g.hidden_size == 768);
  CHECK(g.num_hidden_layers == 12);
  CHECK(g.num_attention_heads == 12);
  CHECK(g.num_key_value_heads == 12);
  CHECK(g.head_dim == 64);
  CHECK(g.intermediate_size == 3072);  // n_inner absent: 4 * n_embd
  CHECK(g.max_position_embeddings == 1024);
  CHECK(g.hidden_act == "gelu_new");
  CHECK(g.act == io::activation::gelu_tanh);
  CHECK(g.norm == io::norm_kind::layer_norm);
  CHECK(g.norm_eps == 1e-5);
  CHECK(g.positions == io::position_kind::learned);
  CHECK(g.tie_word_embeddings);
  CHECK((g.qkv_bias && g.o_bias && g.mlp_bias));
  CHECK(g.linear_weights_transposed);
  CHECK(g.naming == io::param_naming::gpt2);
  CHECK(g.parameter_count() == 124'439'808ULL);  // GPT-2 small
  check_round_trip(g);
  auto g2 = fixture("gpt2");
  g2["n_inner"] = 1000;
  CHECK(parse(g2).intermediate_size == 1000);
}

TEST_CASE("model_config defaults and optional fields", "[io][model_config]") {
  const json minimal = {{"model_type", "llama"},    {"vocab_size", 1000},     {"hidden_size", 256},
                        {"intermediate_size", 512}, {"num_hidden_layers", 2}, {"num_attention_heads", 8}};
  const auto c = parse(minimal);
  CHECK(c.num_key_value_heads == 8);  // no GQA
  CHECK(c.head_dim == 32);
  CHECK(c.max_position_embeddings == 2048);
  CHECK(c.hidden_act == "silu");
  CHECK(c.norm_eps == 1e-6);
  CHECK(c.rope_theta == 10000.0);
  CHECK_FALSE(c.tie_word_embeddings);
  CHECK_FALSE(c.bos_token_id);
  CHECK(c.eos_token_ids.empty());
  check_round_trip(c);

  // Nulls mean "the default", as transformers writes them.
  auto nulls = minimal;
  nulls["num_key_value_heads"] = nullptr;
  nulls["head_dim"] = nullptr;
  nulls["rope_scaling"] = nullptr;
  CHECK(parse(nulls) == c);

  // head_dim given need not be hidden / heads (Mistral-Nemo: 5120 hidden, 32 heads of 128).
  auto nemo = fixture("mistral-7b");
  nemo["hidden_size"] = 5120;
  nemo["head_dim"] = 128;
  nemo.erase("sliding_window");
  const auto n = parse(nemo);
  CHECK(n.head_dim == 128);
  CHECK(n.sliding_window == 4096u);  // transformers' default when the key is absent
  check_round_trip(n);
  nemo["sliding_window"] = nullptr;
  CHECK_FALSE(parse(nemo).sliding_window);

  auto llama_bias = minimal;
  llama_bias["attention_bias"] = true;
  llama_bias["mlp_bias"] = true;
  llama_bias["tie_word_embeddings"] = true;
  const auto lb = parse(llama_bias);
  CHECK((lb.qkv_bias && lb.o_bias && lb.mlp_bias && lb.tie_word_embeddings));
  // Tied: one embedding less; per layer q, k, v and o biases, and the MLP's three biases.
  CHECK(lb.parameter_count() == c.parameter_count() - 1000 * 256 + 2 * (3 * 256 + 256) + 2 * (2 * 512 + 256));
  check_round_trip(lb);

  auto qwen_window = fixture("qwen2-7b");
  qwen_window["use_sliding_window"] = true;
  const auto qw = parse(qwen_window);
  CHECK(qw.sliding_window == 131072u);
  CHECK(qw.max_window_layers == 28);
  check_round_trip(qw);

  for (const char* type : {"linear", "dynamic"}) {
    auto scaled = minimal;
    scaled["rope_scaling"] = {{"type", type}, {"factor", 2.0}};  // the older key name
    const auto s = parse(scaled);
    CHECK(s.rope_scaling.type == (type == std::string("linear") ? io::rope_scaling_type::linear : io::rope_scaling_type::dynamic));
    CHECK(s.rope_scaling.factor == 2.0);
    check_round_trip(s);
  }
  auto dflt = minimal;
  dflt["rope_scaling"] = {{"rope_type", "default"}};
  CHECK(parse(dflt).rope_scaling.type == io::rope_scaling_type::none);

  // model_type may be missing when architectures names the family.
  auto by_arch = fixture("mixtral-8x7b");
  by_arch.erase("model_type");
  CHECK(parse(by_arch) == parse(fixture("mixtral-8x7b")));
  // An architecture tessel does not know is fine when model_type is given.
  auto other_arch = fixture("llama-3-8b");
  other_arch["architectures"] = {"LlamaForSequenceClassification"};
  CHECK(parse(other_arch).family == io::model_family::llama);
}

TEST_CASE("model_config bad fields give typed errors naming them", "[io][model_config]") {
  struct bad_case {
    std::string base;
    std::function<void(json&)> edit;
    errc code;
    std::string text;
  };
  const auto set = [](std::string k, json v) { return [k, v](json& j) { j[k] = v; }; };
  const auto drop = [](std::string k) { return [k](json& j) { j.erase(k); }; };
  const auto rope = [](json v) { return [v](json& j) { j["rope_scaling"] = v; }; };
  const json l3 = {
      {"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  const auto l3_with = [&](std::string k, json v) {
    json r = l3;
    if (v.is_discarded())
      r.erase(k);
    else
      r[k] = v;
    return rope(r);
  };
  const json gone = json(json::value_t::discarded);
  const std::vector<bad_case> cases = {
      {"llama-3-8b", drop("hidden_size"), errc::config, "tessel::io: cfg.json: field 'hidden_size': missing"},
      {"llama-3-8b", set("hidden_size", nullptr), errc::config, "field 'hidden_size': missing"},
      {"llama-3-8b", drop("vocab_size"), errc::config, "field 'vocab_size': missing"},
      {"llama-3-8b", drop("intermediate_size"), errc::config, "field 'intermediate_size': missing"},
      {"llama-3-8b", drop("num_hidden_layers"), errc::config, "field 'num_hidden_layers': missing"},
      {"llama-3-8b", drop("num_attention_heads"), errc::config, "field 'num_attention_heads': missing"},
      {"llama-3-8b", set("hidden_size", "4096"), errc::config, "field 'hidden_size': expected a positive integer, got \"4096\""},
      {"llama-3-8b", set("hidden_size", 4096.0), errc::config, "field 'hidden_size': expected a positive integer, got 4096.0"},
      {"llama-3-8b", set("hidden_size", 0), errc::config, "field 'hidden_size': expected a positive integer, got 0"},
      {"llama-3-8b", set("hidden_size", -4096), errc::config, "expected a positive integer, got -4096"},
      {"llama-3-8b", set("hidden_size", 1ULL << 63), errc::overflow, "field 'hidden_size': 9223372036854775808 is too large"},
      {"llama-3-8b", set("num_attention_heads", 5), errc::config,
       "field 'num_attention_heads': 5 does not divide hidden_size 4096 (and head_dim is not given)"},
      {"llama-3-8b", set("num_key_value_heads", 5), errc::config, "field 'num_key_value_heads': 5 does not divide num_attention_heads 32"},
      {"llama-3-8b", set("num_key_value_heads", 64), errc::config, "field 'num_key_value_heads': 64 does not divide"},
      {"llama-3-8b", set("head_dim", 0), errc::config, "field 'head_dim': expected a positive integer"},
      {"llama-3-8b", set("rms_norm_eps", "1e-5"), errc::config, "field 'rms_norm_eps': expected a number, got \"1e-5\""},
      {"llama-3-8b", set("rms_norm_eps", -1e-5), errc::config, "field 'rms_norm_eps': expected a positive number"},
      {"llama-3-8b", set("rope_theta", 0), errc::config, "field 'rope_theta': expected a positive number, got 0"},
      {"llama-3-8b", set("tie_word_embeddings", "false"), errc::config, "field 'tie_word_embeddings': expected true or false"},
      {"llama-3-8b", set("attention_bias", 1), errc::config, "field 'attention_bias': expected true or false, got 1"},
      {"llama-3-8b", set("hidden_act", "mish"), errc::unsupported, "field 'hidden_act': activation 'mish' is not supported"},
      {"llama-3-8b", set("hidden_act", 3), errc::config, "field 'hidden_act': expected a string, got 3"},
      {"llama-3-8b", rope(5), errc::config, "field 'rope_scaling': expected an object or null, got 5"},
      {"llama-3-8b", rope({{"factor", 8.0}}), errc::config, "field 'rope_scaling.rope_type': missing"},
      {"llama-3-8b", rope({{"rope_type", "yarn"}, {"factor", 4.0}}), errc::unsupported, "field 'rope_scaling.rope_type': 'yarn' is not supported"},
      {"llama-3-8b", rope({{"rope_type", "linear"}, {"type", "dynamic"}, {"factor", 2.0}}), errc::config,
       "field 'rope_scaling.rope_type': 'linear' contradicts type 'dynamic'"},
      {"llama-3-8b", rope({{"rope_type", "linear"}}), errc::config, "field 'rope_scaling.factor': missing"},
      {"llama-3-8b", rope({{"rope_type", "linear"}, {"factor", 0.5}}), errc::config, "field 'rope_scaling.factor': must be at least 1"},
      {"llama-3-8b", rope({{"rope_type", "dynamic"}, {"factor", "2"}}), errc::config, "field 'rope_scaling.factor': expected a number"},
      {"llama-3.1-8b", l3_with("low_freq_factor", gone), errc::config, "field 'rope_scaling.low_freq_factor': missing"},
      {"llama-3.1-8b", l3_with("high_freq_factor", gone), errc::config, "field 'rope_scaling.high_freq_factor': missing"},
      {"llama-3.1-8b", l3_with("high_freq_factor", 1.0), errc::config, "field 'rope_scaling.high_freq_factor': must exceed low_freq_factor"},
      {"llama-3.1-8b", l3_with("original_max_position_embeddings", gone), errc::config,
       "field 'rope_scaling.original_max_position_embeddings': missing"},
      {"llama-3.1-8b", l3_with("original_max_position_embeddings", 1 << 20), errc::config,
       "field 'rope_scaling.original_max_position_embeddings': 1048576 exceeds max_position_embeddings 131072"},
      {"llama-3.1-8b", set("eos_token_id", json{128001, "x"}), errc::config, "field 'eos_token_id': expected a token id"},
      {"llama-3-8b", set("eos_token_id", -1), errc::config, "field 'eos_token_id': expected a token id"},
      {"llama-3-8b", set("bos_token_id", 1.5), errc::config, "field 'bos_token_id': expected a token id"},
      {"llama-3-8b", set("model_type", "bert"), errc::unsupported, "field 'model_type': 'bert' is not supported"},
      {"llama-3-8b", set("model_type", 7), errc::config, "field 'model_type': expected a string, got 7"},
      {"llama-3-8b", set("architectures", "LlamaForCausalLM"), errc::config, "field 'architectures': expected an array of strings"},
      {"llama-3-8b", set("architectures", json{1}), errc::config, "field 'architectures': expected an array of strings"},
      {"llama-3-8b", set("architectures", json{"GPT2LMHeadModel"}), errc::config,
       "field 'architectures': names a gpt2 model, but model_type is 'llama'"},
      {"llama-3-8b",
       [](json& j) {
         j.erase("model_type");
         j["architectures"] = {"BertModel"};
       },
       errc::config, "field 'model_type': missing"},
      {"llama-3-8b",
       [](json& j) {
         j["vocab_size"] = 1ULL << 40;
         j["hidden_size"] = 1ULL << 40;
         j["head_dim"] = 128;
       },
       errc::overflow, "parameter count"},
      {"mistral-7b", set("sliding_window", 0), errc::config, "field 'sliding_window': expected a positive integer, got 0"},
      {"mistral-7b", set("sliding_window", "4096"), errc::config, "field 'sliding_window': expected a positive integer"},
      {"qwen2-7b",
       [](json& j) {
         j["use_sliding_window"] = true;
         j["sliding_window"] = -1;
       },
       errc::config, "field 'sliding_window': expected a positive integer, got -1"},
      {"qwen2-7b", set("use_sliding_window", "yes"), errc::config, "field 'use_sliding_window': expected true or false"},
      {"mixtral-8x7b", set("num_experts_per_tok", 9), errc::config, "field 'num_experts_per_tok': 9 exceeds num_local_experts 8"},
      {"mixtral-8x7b", set("num_experts_per_tok", 0), errc::config, "field 'num_experts_per_tok': expected a positive integer"},
      {"mixtral-8x7b", set("num_local_experts", 0), errc::config, "field 'num_local_experts': expected a positive integer"},
      {"mixtral-8x7b", set("router_aux_loss_coef", -0.5), errc::config, "field 'router_aux_loss_coef': expected a non-negative number"},
      {"gpt2", drop("n_embd"), errc::config, "field 'n_embd': missing"},
      {"gpt2", drop("n_head"), errc::config, "field 'n_head': missing"},
      {"gpt2", drop("n_layer"), errc::config, "field 'n_layer': missing"},
      {"gpt2", drop("vocab_size"), errc::config, "field 'vocab_size': missing"},
      {"gpt2", set("n_head", 7), errc::config, "field 'n_head': 7 does not divide n_embd 768"},
      {"gpt2", set("n_inner", -1), errc::config, "field 'n_inner': expected a positive integer"},
      {"gpt2", set("activation_function", 5), errc::config, "field 'activation_function': expected a string"},
      {"gpt2", set("activation_function", "tanh"), errc::unsupported, "field 'activation_function': activation 'tanh'"},
      {"gpt2", set("layer_norm_epsilon", 0.0), errc::config, "field 'layer_norm_epsilon': expected a positive number"},
  };
  for (const auto& c : cases) {
    json j = fixture(c.base);
    c.edit(j);
    INFO(c.base << ": " << j.dump());
    require_io_error([&] { (void)parse(j); }, c.code, c.text);
  }
  // Text that is not a config at all.
  require_io_error([] { (void)io::parse_model_config("[1, 2]", "x.json"); }, errc::format, "x.json: config is not a JSON object");
  require_io_error([] { (void)io::parse_model_config("{\"hidden_size\": 1, \"hidden_size\": 2}"); }, errc::format,
                   "config.json: duplicate key 'hidden_size'");
  require_io_error([] { (void)io::parse_model_config("{\"model_type\": \"llama\","); }, errc::format, "invalid JSON");
  require_io_error([] { (void)io::parse_model_config(""); }, errc::format, "invalid JSON");
}

TEST_CASE("model_config files: load from a directory, save, OS errors", "[io][model_config]") {
  temp_dir dir;
  const auto g = io::load_model_config(fixtures / "gpt2.json");
  io::save_model_config(g, dir / "config.json");
  CHECK(io::load_model_config(dir.path()) == g);
  std::filesystem::create_directory(dir / "empty");
  require_io_error([&] { (void)io::load_model_config(dir / "empty"); }, errc::io,
                   (dir / "empty" / "config.json").string() + ": cannot open: No such file or directory");
  require_io_error([&] { (void)io::load_model_config(dir / "nope.json"); }, errc::io,
                   (dir / "nope.json").string() + ": cannot open: No such file or directory");
  auto not_utf8 = g;
  not_utf8.torch_dtype = "\xc3";
  require_io_error([&] { io::save_model_config(not_utf8, dir / "x.json"); }, errc::invalid_argument, "cannot write the config");
  CHECK_FALSE(std::filesystem::exists(dir / "x.json"));
  std::ofstream(dir / "bad.json") << R"({"model_type": "gpt2", "n_embd": 768})";
  require_io_error([&] { (void)io::load_model_config(dir / "bad.json"); }, errc::config, (dir / "bad.json").string() + ": field 'n_layer': missing");
}

TEST_CASE("model_config random field values give a config or a typed error", "[io][model_config]") {
  std::mt19937_64 rng(31337);
  const json values[] = {nullptr,
                         -1,
                         0,
                         1,
                         2,
                         3,
                         7,
                         64,
                         4096,
                         1ULL << 62,
                         18446744073709551615ULL,
                         0.5,
                         1e300,
                         -2.5,
                         "",
                         "llama",
                         "silu",
                         true,
                         false,
                         json::array(),
                         json::object(),
                         json{1, 2},
                         json{{"rope_type", "llama3"}, {"factor", 2}}};
  const char* bases[] = {"llama-3-8b", "llama-3.1-8b", "mistral-7b", "qwen2-7b", "mixtral-8x7b", "gpt2"};
  int ok = 0, refused = 0;
  for (int i = 0; i < 2000; ++i) {
    json j = fixture(bases[rng() % std::size(bases)]);
    std::vector<std::string> keys;
    for (const auto& [k, _] : j.items()) keys.push_back(k);
    for (int e = 0, n = 1 + int(rng() % 3); e < n; ++e) {
      const auto& k = keys[rng() % keys.size()];
      if (rng() % 4 == 0)
        j.erase(k);
      else
        j[k] = values[rng() % std::size(values)];
    }
    try {
      const auto c = parse(j);
      ++ok;
      // What parses is consistent.
      CHECK(c.num_attention_heads % c.num_key_value_heads == 0);
      CHECK(c.head_dim > 0);
      CHECK(c.num_experts_per_tok <= c.num_local_experts);
      CHECK(io::parse_model_config(io::to_json(c).dump()) == c);
    } catch (const io::io_error&) { ++refused; }
  }
  CHECK(ok > 100);
  CHECK(refused > 100);
}
}  // namespace tessel_test_io_model_config
