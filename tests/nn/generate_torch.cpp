// KV-cache decoding against PyTorch (tools/torch/reference_models.py, label torch): for every model
// of the fixtures, the rows of the input batch are prefilled with prompts of different lengths
// and the rest decoded token by token, all rows in one batch; the logits of every position give
// the fp64 reference's within the f32 bound of tests/nn/decoder_torch.cpp, γ_256·(1 + max|logit|)
// (1.5e-5: the cached path reorders a few f32 sums of the recompute, see tests/nn/generate.cpp).
// Mistral's sequence is longer than its window of 5; GPT-2 decodes up to its learned positions.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/nn.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_nn_generate_torch {

using namespace tessel;
namespace fs = std::filesystem;

namespace {

fs::path fixtures() {
  if (const char* env = std::getenv("TESSEL_TORCH_FIXTURES"); env != nullptr && *env != '\0') return env;
  return TESSEL_TORCH_FIXTURES;
}

std::vector<float> read_f32(const io::safetensors_reader& r, const std::string& name) {
  const auto d = r.tensor(name).data<float>();
  return {d.span().begin(), d.span().end()};
}

}  // namespace

TEST_CASE("cached decoding gives PyTorch's fp64 logits at every position", "[nn][torch][generate]") {
  host_device dev(2);
  for (const char* name : {"llama", "llama_bias", "llama3_rope", "mistral", "qwen2", "mixtral", "gpt2"}) {
    INFO("model " << name);
    const fs::path dir = fixtures() / name;
    auto m = nn::decoder_lm<host_device>::from_pretrained(dev, dir);
    const auto inputs = io::safetensors_reader::open(dir / "inputs.safetensors");
    const auto ref = io::safetensors_reader::open(dir / "reference.safetensors");
    const auto t = inputs.tensor("input_ids");
    const std::size_t B = t.shape()[0], S = t.shape()[1], V = m->config().vocab_size;
    const auto idv = t.data<std::int64_t>();
    const std::vector<std::int64_t> ids(idv.span().begin(), idv.span().end());
    const auto want = read_f32(ref, "logits");
    REQUIRE(want.size() == B * S * V);
    // prompts of 1, 4, 7, ... tokens
    auto cache = m->make_cache(B, B * S, 4, S);
    std::vector<std::size_t> seqs, lens;
    std::vector<std::int64_t> packed;
    for (std::size_t b = 0; b < B; ++b) {
      seqs.push_back(cache.add_sequence());
      lens.push_back(std::min(S - 1, 1 + 3 * b));
      packed.insert(packed.end(), ids.begin() + std::ptrdiff_t(b * S), ids.begin() + std::ptrdiff_t(b * S + lens[b]));
    }
    double worst = 0.0;
    auto check_row = [&](std::span<const float> got, std::size_t b, std::size_t pos) {
      const float* w = want.data() + (b * S + pos) * V;
      double err = 0.0, mx = 0.0;
      for (std::size_t v = 0; v < V; ++v) {
        err = std::max(err, std::fabs(double(got[v]) - w[v]));
        mx = std::max(mx, std::fabs(double(w[v])));
      }
      INFO("row " << b << " position " << pos << ": error " << err << ", max |logit| " << mx);
      CHECK(err <= 1.5e-5 * (1.0 + mx));
      worst = std::max(worst, err / (1.0 + mx));
    };
    const auto pre = m->prefill(cache, seqs, packed, lens);
    for (std::size_t b = 0; b < B; ++b) check_row(pre.subspan(b * V, V), b, lens[b] - 1);
    for (;;) {
      std::vector<std::size_t> live, rows;
      std::vector<std::int64_t> tok;
      for (std::size_t b = 0; b < B; ++b) {
        const std::size_t len = cache.length(seqs[b]);
        if (len == S) continue;
        live.push_back(seqs[b]);
        rows.push_back(b);
        tok.push_back(ids[b * S + len]);
      }
      if (live.empty()) break;
      std::vector<std::size_t> pos;
      for (std::size_t b : rows) pos.push_back(cache.length(seqs[b]));
      const auto l = m->decode_step(cache, live, tok);
      for (std::size_t j = 0; j < rows.size(); ++j) check_row(l.subspan(j * V, V), rows[j], pos[j]);
    }
    if (std::getenv("TESSEL_REPORT")) std::printf("| %s | cached decode vs torch fp64 | %.2e |\n", name, worst);
  }
}

}  // namespace tessel_test_nn_generate_torch
