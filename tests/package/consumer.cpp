// A consumer of the tessel package: includes the umbrella header and checks a few facts that need
// the number types and the io layer, so a broken install (missing header, wrong include path, a
// dependency the package config does not find) fails here.
#include <tessel/tessel.hpp>

#include <cstdio>

int main() {
  const tessel::bf16 one(1.0f);
  const tessel::e4m3 big(448.0f);
  // The io layer brings nlohmann-json: a consumer must find it through tessel's package.
  const auto cfg = tessel::io::parse_model_config(
      R"({"model_type":"llama","vocab_size":32,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4})");
  if (one.bits() != 0x3F80 || static_cast<float>(big) != 448.0f || cfg.head_dim != 16) {
    std::puts("tessel package consumer: wrong values");
    return 1;
  }
  std::puts("tessel package consumer: ok");
  return 0;
}
