// Hugging Face config.json for the decoder families tessel builds (Llama, Mistral, Qwen2, Mixtral,
// GPT-2), parsed into one model_config with every default and contradiction resolved here, so the
// model layer never reads JSON; and written back (parse(to_json(c)) == c).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <tessel/io/detail/file.hpp>
#include <tessel/io/errors.hpp>

namespace tessel {
inline namespace v0 {
namespace io {

enum class model_family : std::uint8_t { llama, mistral, qwen2, mixtral, gpt2 };
enum class activation : std::uint8_t { silu, gelu, gelu_tanh, relu };
enum class norm_kind : std::uint8_t { rms_norm, layer_norm };
enum class position_kind : std::uint8_t { rotary, learned };
enum class rope_scaling_type : std::uint8_t { none, linear, dynamic, llama3 };

// How checkpoint tensors are named:
//   llama:   model.embed_tokens, model.layers.{i}.self_attn.{q,k,v,o}_proj, .mlp.{gate,up,down}_proj,
//            .input_layernorm, .post_attention_layernorm, model.norm, lm_head (Mistral, Qwen2 too)
//   mixtral: llama's, with .block_sparse_moe.gate and .block_sparse_moe.experts.{j}.{w1,w2,w3}
//   gpt2:    transformer.{wte,wpe}, transformer.h.{i}.{ln_1,attn.c_attn (fused q|k|v),attn.c_proj,
//            ln_2,mlp.c_fc,mlp.c_proj}, transformer.ln_f
enum class param_naming : std::uint8_t { llama, mixtral, gpt2 };

constexpr std::string_view model_type_name(model_family f) noexcept {
  switch (f) {
    case model_family::llama: return "llama";
    case model_family::mistral: return "mistral";
    case model_family::qwen2: return "qwen2";
    case model_family::mixtral: return "mixtral";
    case model_family::gpt2: return "gpt2";
  }
  return "?";
}

struct rope_scaling_config {
  rope_scaling_type type = rope_scaling_type::none;
  double factor = 1.0;
  // llama3 only: wavelengths between original/low and original/high are interpolated.
  double low_freq_factor = 0.0, high_freq_factor = 0.0;
  std::size_t original_max_position_embeddings = 0;
  bool operator==(const rope_scaling_config&) const = default;
};

struct model_config {
  model_family family = model_family::llama;
  std::vector<std::string> architectures;
  std::size_t vocab_size = 0;
  std::size_t hidden_size = 0;
  std::size_t intermediate_size = 0;  // per expert for MoE; GPT-2's n_inner (default 4 * n_embd)
  std::size_t num_hidden_layers = 0;
  std::size_t num_attention_heads = 0;
  std::size_t num_key_value_heads = 0;  // == num_attention_heads without grouped-query attention
  std::size_t head_dim = 0;             // may differ from hidden_size / num_attention_heads when given
  std::size_t max_position_embeddings = 0;
  std::string hidden_act;  // as spelled in the file; `act` is what it means
  activation act = activation::silu;
  norm_kind norm = norm_kind::rms_norm;
  double norm_eps = 1e-6;
  position_kind positions = position_kind::rotary;
  double rope_theta = 10000.0;  // 0 for learned positions
  rope_scaling_config rope_scaling;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // q, k and v projections have a bias (Llama's attention_bias, always for Qwen2)
  bool o_bias = false;    // the output projection has a bias (Llama's attention_bias; not Qwen2)
  bool mlp_bias = false;
  // Attention window in tokens (Mistral; Qwen2 when enabled): query i attends to keys j with
  // i - window < j <= i, as transformers' mask code does (tools/torch/README.md).
  std::optional<std::size_t> sliding_window;
  std::size_t max_window_layers = 0;  // Qwen2: layers below this index attend fully
  std::size_t num_local_experts = 0;  // 0: dense MLP
  std::size_t num_experts_per_tok = 0;
  double router_aux_loss_coef = 0.0;
  bool linear_weights_transposed = false;  // GPT-2's Conv1D stores weights as (in, out), not (out, in)
  param_naming naming = param_naming::llama;
  std::optional<std::int64_t> bos_token_id;
  std::vector<std::int64_t> eos_token_ids;  // Llama 3.1 lists several
  std::string torch_dtype;                  // "bfloat16", "float32", ... or empty

  bool is_moe() const noexcept { return num_local_experts > 0; }
  bool operator==(const model_config&) const = default;

  // Parameters of the model as Hugging Face builds it (tied embeddings counted once); throws
  // io_error(errc::overflow) when the count would wrap.
  std::size_t parameter_count() const {
    const std::string_view f = "model_config";
    const std::string ctx = "parameter count: ";
    const auto mul = [&](std::size_t a, std::size_t b) { return detail::mul_checked(a, b, f, ctx); };
    const auto add = [&](std::size_t a, std::size_t b) { return detail::add_checked(a, b, f, ctx); };
    const std::size_t q = mul(num_attention_heads, head_dim), kv = mul(num_key_value_heads, head_dim);
    std::size_t layer = add(mul(hidden_size, q), mul(mul(2, hidden_size), kv));  // q, k, v
    layer = add(layer, mul(q, hidden_size));                                     // o
    if (qkv_bias) layer = add(layer, add(q, mul(2, kv)));
    if (o_bias) layer = add(layer, hidden_size);
    const std::size_t norm_params = norm == norm_kind::layer_norm ? mul(2, hidden_size) : hidden_size;
    layer = add(layer, mul(2, norm_params));
    std::size_t mlp = 0;
    if (naming == param_naming::gpt2) {
      mlp = mul(mul(2, hidden_size), intermediate_size);
      if (mlp_bias) mlp = add(mlp, add(intermediate_size, hidden_size));
    } else {
      mlp = mul(mul(3, hidden_size), intermediate_size);
      if (mlp_bias) mlp = add(mlp, add(mul(2, intermediate_size), hidden_size));
    }
    if (is_moe()) mlp = add(mul(mlp, num_local_experts), mul(hidden_size, num_local_experts));  // + router
    layer = add(layer, mlp);
    std::size_t total = add(mul(layer, num_hidden_layers), norm_params);  // + final norm
    const std::size_t embed = mul(vocab_size, hidden_size);
    total = add(total, tie_word_embeddings ? embed : mul(2, embed));
    if (positions == position_kind::learned) total = add(total, mul(max_position_embeddings, hidden_size));
    return total;
  }
};

namespace detail {

// Typed access to config fields; a JSON null counts as absent (HF writes null for "use the default").
class config_fields {
 public:
  config_fields(const nlohmann::json& j, std::string_view file, std::string prefix = {}) : j_(j), file_(file), prefix_(std::move(prefix)) {}

  [[noreturn]] void fail(std::string_view name, const std::string& detail, errc code = errc::config) const {
    throw io_error(code, file_, field_context(prefix_ + std::string(name)) + detail);
  }
  const nlohmann::json* get(std::string_view name) const {
    const auto it = j_.find(name);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  bool present(std::string_view name) const { return j_.find(name) != j_.end(); }

  std::optional<std::size_t> size(std::string_view name) const {
    const auto* v = get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number_integer()) fail(name, "expected a positive integer, got " + v->dump());
    if (v->is_number_unsigned()) {
      const auto u = v->get<std::uint64_t>();
      // Kept within int64 so that the model layer's signed index arithmetic cannot wrap either.
      if (u > static_cast<std::uint64_t>(INT64_MAX)) fail(name, std::to_string(u) + " is too large", errc::overflow);
      if (u > 0) return static_cast<std::size_t>(u);
    }
    fail(name, "expected a positive integer, got " + v->dump());
  }
  std::size_t size_or(std::string_view name, std::size_t fallback) const { return size(name).value_or(fallback); }
  std::size_t required_size(std::string_view name) const {
    if (const auto s = size(name)) return *s;
    fail(name, "missing");
  }

  std::optional<double> number(std::string_view name, bool allow_zero = false) const {
    const auto* v = get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) fail(name, "expected a number, got " + v->dump());
    const double d = v->get<double>();
    if (!std::isfinite(d) || d < 0 || (d == 0 && !allow_zero))
      fail(name, "expected a " + std::string(allow_zero ? "non-negative" : "positive") + " number, got " + v->dump());
    return d;
  }

  bool flag(std::string_view name, bool fallback) const {
    const auto* v = get(name);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) fail(name, "expected true or false, got " + v->dump());
    return v->get<bool>();
  }

  std::optional<std::string> string(std::string_view name) const {
    const auto* v = get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) fail(name, "expected a string, got " + v->dump());
    return v->get<std::string>();
  }

  std::optional<std::int64_t> token(const nlohmann::json& v, std::string_view name) const {
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<std::uint64_t>() > INT64_MAX) || v.get<std::int64_t>() < 0)
      fail(name, "expected a token id (a non-negative integer), got " + v.dump());
    return v.get<std::int64_t>();
  }

 private:
  const nlohmann::json& j_;
  std::string_view file_;
  std::string prefix_;
};

inline std::optional<model_family> family_of_architecture(std::string_view a) {
  struct known {
    std::string_view name;
    model_family family;
  };
  static constexpr known table[] = {
      {"LlamaForCausalLM", model_family::llama},     {"LlamaModel", model_family::llama},
      {"MistralForCausalLM", model_family::mistral}, {"MistralModel", model_family::mistral},
      {"Qwen2ForCausalLM", model_family::qwen2},     {"Qwen2Model", model_family::qwen2},
      {"MixtralForCausalLM", model_family::mixtral}, {"MixtralModel", model_family::mixtral},
      {"GPT2LMHeadModel", model_family::gpt2},       {"GPT2Model", model_family::gpt2},
  };
  for (const auto& k : table)
    if (k.name == a) return k.family;
  return std::nullopt;
}

inline activation parse_activation(const config_fields& f, std::string_view field, const std::string& name) {
  if (name == "silu" || name == "swish") return activation::silu;
  if (name == "gelu") return activation::gelu;
  if (name == "gelu_new" || name == "gelu_pytorch_tanh" || name == "gelu_fast") return activation::gelu_tanh;
  if (name == "relu") return activation::relu;
  f.fail(field, "activation '" + name + "' is not supported (silu, swish, gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, relu)", errc::unsupported);
}

inline rope_scaling_config parse_rope_scaling(const nlohmann::json& j, std::string_view file, std::size_t max_positions) {
  const config_fields top(j, file);
  const auto* rs = top.get("rope_scaling");
  if (rs == nullptr) return {};
  if (!rs->is_object()) top.fail("rope_scaling", "expected an object or null, got " + rs->dump());
  const config_fields f(*rs, file, "rope_scaling.");
  // Transformers renamed "type" to "rope_type" and accepts either.
  const auto type = f.string("rope_type"), old_type = f.string("type");
  if (type && old_type && *type != *old_type) f.fail("rope_type", "'" + *type + "' contradicts type '" + *old_type + "'");
  const std::string name = type ? *type : old_type ? *old_type : "";
  if (name.empty()) f.fail("rope_type", "missing");
  rope_scaling_config r;
  if (name == "default") return r;
  if (name == "linear")
    r.type = rope_scaling_type::linear;
  else if (name == "dynamic")
    r.type = rope_scaling_type::dynamic;
  else if (name == "llama3")
    r.type = rope_scaling_type::llama3;
  else
    f.fail("rope_type", "'" + name + "' is not supported (default, linear, dynamic, llama3)", errc::unsupported);
  const auto factor = f.number("factor");
  if (!factor) f.fail("factor", "missing");
  if (*factor < 1.0) f.fail("factor", "must be at least 1, got " + std::to_string(*factor));
  r.factor = *factor;
  if (r.type == rope_scaling_type::llama3) {
    const auto low = f.number("low_freq_factor"), high = f.number("high_freq_factor");
    if (!low) f.fail("low_freq_factor", "missing");
    if (!high) f.fail("high_freq_factor", "missing");
    if (*high <= *low) f.fail("high_freq_factor", "must exceed low_freq_factor (" + std::to_string(*low) + "), got " + std::to_string(*high));
    r.low_freq_factor = *low;
    r.high_freq_factor = *high;
    r.original_max_position_embeddings = f.required_size("original_max_position_embeddings");
    if (r.original_max_position_embeddings > max_positions)
      f.fail("original_max_position_embeddings",
             std::to_string(r.original_max_position_embeddings) + " exceeds max_position_embeddings " + std::to_string(max_positions));
  }
  return r;
}

}  // namespace detail

// Parses config.json text; `file` names it in errors. Throws io_error: errc::format for text that
// is not a JSON object (or has duplicate keys), errc::config for a missing, mistyped or
// contradictory field, errc::unsupported for a model_type, activation or rope type tessel does not
// build, errc::overflow for a size that would wrap.
inline model_config parse_model_config(std::string_view text, std::string_view file = "config.json") {
  const nlohmann::json j = detail::parse_json(text, file, 64);
  if (!j.is_object()) throw io_error(errc::format, file, "config is not a JSON object");
  const detail::config_fields f(j, file);
  model_config c;

  // Which family: model_type, checked against architectures when both name one.
  std::optional<model_family> from_arch;
  if (const auto* a = f.get("architectures")) {
    if (!a->is_array()) f.fail("architectures", "expected an array of strings, got " + a->dump());
    for (const auto& e : *a) {
      if (!e.is_string()) f.fail("architectures", "expected an array of strings, got " + a->dump());
      c.architectures.push_back(e.get<std::string>());
      if (!from_arch) from_arch = detail::family_of_architecture(c.architectures.back());
    }
  }
  if (const auto type = f.string("model_type")) {
    const model_family all[] = {model_family::llama, model_family::mistral, model_family::qwen2, model_family::mixtral, model_family::gpt2};
    const auto it = std::find_if(std::begin(all), std::end(all), [&](model_family m) { return model_type_name(m) == *type; });
    if (it == std::end(all)) f.fail("model_type", "'" + *type + "' is not supported (llama, mistral, qwen2, mixtral, gpt2)", errc::unsupported);
    c.family = *it;
    if (from_arch && *from_arch != c.family)
      f.fail("architectures", "names a " + std::string(model_type_name(*from_arch)) + " model, but model_type is '" + *type + "'");
  } else if (from_arch) {
    c.family = *from_arch;
  } else {
    f.fail("model_type", "missing (and no known entry in architectures)");
  }

  if (c.family == model_family::gpt2) {
    c.hidden_size = f.required_size("n_embd");
    c.num_hidden_layers = f.required_size("n_layer");
    c.num_attention_heads = f.required_size("n_head");
    c.vocab_size = f.required_size("vocab_size");
    c.max_position_embeddings = f.size_or("n_positions", 1024);
    if (c.hidden_size % c.num_attention_heads != 0)
      f.fail("n_head", std::to_string(c.num_attention_heads) + " does not divide n_embd " + std::to_string(c.hidden_size));
    c.head_dim = c.hidden_size / c.num_attention_heads;
    c.num_key_value_heads = c.num_attention_heads;
    c.intermediate_size = f.size("n_inner").value_or(detail::mul_checked(4, c.hidden_size, file, detail::field_context("n_inner")));
    c.hidden_act = f.string("activation_function").value_or("gelu_new");
    c.act = detail::parse_activation(f, "activation_function", c.hidden_act);
    c.norm = norm_kind::layer_norm;
    c.norm_eps = f.number("layer_norm_epsilon").value_or(1e-5);
    c.positions = position_kind::learned;
    c.rope_theta = 0.0;
    c.tie_word_embeddings = f.flag("tie_word_embeddings", true);
    c.qkv_bias = c.o_bias = c.mlp_bias = true;
    c.linear_weights_transposed = true;
    c.naming = param_naming::gpt2;
  } else {
    const bool mix = c.family == model_family::mixtral, qwen = c.family == model_family::qwen2;
    c.vocab_size = f.required_size("vocab_size");
    c.hidden_size = f.required_size("hidden_size");
    c.intermediate_size = f.required_size("intermediate_size");
    c.num_hidden_layers = f.required_size("num_hidden_layers");
    c.num_attention_heads = f.required_size("num_attention_heads");
    if (const auto hd = f.size("head_dim")) {
      c.head_dim = *hd;
    } else {
      if (c.hidden_size % c.num_attention_heads != 0)
        f.fail("num_attention_heads", std::to_string(c.num_attention_heads) + " does not divide hidden_size " + std::to_string(c.hidden_size) +
                                          " (and head_dim is not given)");
      c.head_dim = c.hidden_size / c.num_attention_heads;
    }
    c.num_key_value_heads = f.size_or("num_key_value_heads", c.num_attention_heads);
    if (c.num_attention_heads % c.num_key_value_heads != 0)
      f.fail("num_key_value_heads",
             std::to_string(c.num_key_value_heads) + " does not divide num_attention_heads " + std::to_string(c.num_attention_heads));
    // Defaults are transformers' own for each family.
    c.max_position_embeddings = f.size_or("max_position_embeddings", c.family == model_family::llama ? 2048 : qwen ? 32768 : 131072);
    c.hidden_act = f.string("hidden_act").value_or("silu");
    c.act = detail::parse_activation(f, "hidden_act", c.hidden_act);
    c.norm = norm_kind::rms_norm;
    c.norm_eps = f.number("rms_norm_eps").value_or(mix ? 1e-5 : 1e-6);
    c.positions = position_kind::rotary;
    c.rope_theta = f.number("rope_theta").value_or(mix ? 1e6 : 1e4);
    c.rope_scaling = detail::parse_rope_scaling(j, file, c.max_position_embeddings);
    c.tie_word_embeddings = f.flag("tie_word_embeddings", false);
    if (c.family == model_family::llama) {
      c.qkv_bias = c.o_bias = f.flag("attention_bias", false);
      c.mlp_bias = f.flag("mlp_bias", false);
    }
    if (qwen) {
      c.qkv_bias = true;  // Qwen2's q/k/v projections always carry a bias, its o_proj never
      if (f.flag("use_sliding_window", false)) {
        c.sliding_window = f.size_or("sliding_window", 4096);
        c.max_window_layers = f.size_or("max_window_layers", 28);
      }
    } else if (c.family == model_family::mistral || mix) {
      // An absent key is transformers' default (4096 for Mistral); null disables the window.
      if (f.present("sliding_window"))
        c.sliding_window = f.size("sliding_window");
      else if (!mix)
        c.sliding_window = 4096;
    }
    if (mix) {
      c.num_local_experts = f.size_or("num_local_experts", 8);
      c.num_experts_per_tok = f.size_or("num_experts_per_tok", 2);
      if (c.num_experts_per_tok > c.num_local_experts)
        f.fail("num_experts_per_tok", std::to_string(c.num_experts_per_tok) + " exceeds num_local_experts " + std::to_string(c.num_local_experts));
      c.router_aux_loss_coef = f.number("router_aux_loss_coef", true).value_or(0.001);
      c.naming = param_naming::mixtral;
    }
  }
  if (const auto* b = f.get("bos_token_id")) c.bos_token_id = f.token(*b, "bos_token_id");
  if (const auto* e = f.get("eos_token_id")) {
    if (e->is_array()) {
      for (const auto& t : *e) c.eos_token_ids.push_back(*f.token(t, "eos_token_id"));
    } else {
      c.eos_token_ids.push_back(*f.token(*e, "eos_token_id"));
    }
  }
  c.torch_dtype = f.string("torch_dtype").value_or("");
  (void)c.parameter_count();  // sizes whose products wrap are refused here, not in the model layer
  return c;
}

// Reads `path`, or `path`/config.json when it is a directory.
inline model_config load_model_config(const std::filesystem::path& path) {
  std::error_code ec;
  const auto file = std::filesystem::is_directory(path, ec) ? path / "config.json" : path;
  // Real configs are a few KiB; the limit keeps a wrong path from reading a checkpoint.
  return parse_model_config(detail::read_file(file, 16u << 20), file.string());
}

// The config as Hugging Face writes it for its family (GPT-2 with its n_* names).
inline nlohmann::json to_json(const model_config& c) {
  nlohmann::json j;
  j["architectures"] = c.architectures;
  j["model_type"] = model_type_name(c.family);
  j["vocab_size"] = c.vocab_size;
  if (c.family == model_family::gpt2) {
    j["n_embd"] = c.hidden_size;
    j["n_layer"] = c.num_hidden_layers;
    j["n_head"] = c.num_attention_heads;
    j["n_positions"] = c.max_position_embeddings;
    j["n_inner"] = c.intermediate_size;
    j["activation_function"] = c.hidden_act;
    j["layer_norm_epsilon"] = c.norm_eps;
  } else {
    j["hidden_size"] = c.hidden_size;
    j["intermediate_size"] = c.intermediate_size;
    j["num_hidden_layers"] = c.num_hidden_layers;
    j["num_attention_heads"] = c.num_attention_heads;
    j["num_key_value_heads"] = c.num_key_value_heads;
    j["head_dim"] = c.head_dim;
    j["max_position_embeddings"] = c.max_position_embeddings;
    j["hidden_act"] = c.hidden_act;
    j["rms_norm_eps"] = c.norm_eps;
    j["rope_theta"] = c.rope_theta;
    const auto& r = c.rope_scaling;
    switch (r.type) {
      case rope_scaling_type::none: j["rope_scaling"] = nullptr; break;
      case rope_scaling_type::linear: j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", r.factor}}; break;
      case rope_scaling_type::dynamic: j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", r.factor}}; break;
      case rope_scaling_type::llama3:
        j["rope_scaling"] = {{"rope_type", "llama3"},
                             {"factor", r.factor},
                             {"low_freq_factor", r.low_freq_factor},
                             {"high_freq_factor", r.high_freq_factor},
                             {"original_max_position_embeddings", r.original_max_position_embeddings}};
        break;
    }
    if (c.family == model_family::llama) {
      j["attention_bias"] = c.qkv_bias;
      j["mlp_bias"] = c.mlp_bias;
    }
    if (c.family == model_family::qwen2) {
      j["use_sliding_window"] = c.sliding_window.has_value();
      if (c.sliding_window) {
        j["sliding_window"] = *c.sliding_window;
        j["max_window_layers"] = c.max_window_layers;
      }
    } else if (c.family == model_family::mistral || c.family == model_family::mixtral) {
      j["sliding_window"] = c.sliding_window ? nlohmann::json(*c.sliding_window) : nlohmann::json(nullptr);
    }
    if (c.is_moe()) {
      j["num_local_experts"] = c.num_local_experts;
      j["num_experts_per_tok"] = c.num_experts_per_tok;
      j["router_aux_loss_coef"] = c.router_aux_loss_coef;
    }
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  if (c.bos_token_id) j["bos_token_id"] = *c.bos_token_id;
  if (c.eos_token_ids.size() == 1)
    j["eos_token_id"] = c.eos_token_ids[0];
  else if (!c.eos_token_ids.empty())
    j["eos_token_id"] = c.eos_token_ids;
  if (!c.torch_dtype.empty()) j["torch_dtype"] = c.torch_dtype;
  return j;
}

// Writes config.json text atomically (temp file + rename).
inline void save_model_config(const model_config& c, const std::filesystem::path& path) {
  std::string text;
  try {
    text = to_json(c).dump(2) + "\n";
  } catch (const nlohmann::json::exception& e) {  // a string field that is not UTF-8
    throw io_error(errc::invalid_argument, path.string(), std::string("cannot write the config: ") + e.what());
  }
  detail::atomic_file f(path);
  f.write(detail::as_bytes(text));
  f.commit();
}

}  // namespace io
}  // namespace v0
}  // namespace tessel
