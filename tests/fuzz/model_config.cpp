// libFuzzer target: arbitrary bytes as config.json text, through the model config parser. Any
// tessel::error is a refusal; anything else is a bug. What parses must be consistent and survive
// the writer: parse(to_json(c)) == c.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <tessel/io/model_config.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace io = tessel::io;
  try {
    const auto c = io::parse_model_config(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    if (c.head_dim == 0 || c.num_key_value_heads == 0 || c.num_attention_heads % c.num_key_value_heads != 0 ||
        c.num_experts_per_tok > c.num_local_experts)
      __builtin_trap();
    if (io::parse_model_config(io::to_json(c).dump()) != c) __builtin_trap();
  } catch (const tessel::error&) {}
  return 0;
}
