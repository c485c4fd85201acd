// 40_train_byte_llama: train a small Llama-style model on real text, byte by byte, then sample it.
//
// The corpus is Debian's `fortunes` package (2.6 MB of quotations; tools/setup installs it). The
// model is built from a Hugging Face config (as a checkpoint's config.json would give it), computes
// in bf16 with f32 masters, and trains with AdamW on random 128-byte windows. Every 50 steps it
// prints the training loss and the loss on held-out text; at the end it samples text, saves a
// training checkpoint (weights, AdamW moments, step), reloads it into a second model and checks that
// both continue with the same bits.
//
//   ./40_train_byte_llama [steps=300] [corpus=/usr/share/games/fortunes] [checkpoint=byte_llama.safetensors]
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/io/model_config.hpp>
#include <tessel/nn.hpp>

#include "example_args.hpp"

using namespace tessel;

constexpr std::size_t batch = 8, seq = 128;

int main(int argc, char** argv) {
  const example_args::positional args(argc, argv, "[steps (1..1000000)] [corpus] [checkpoint]", 3);
  const auto steps = std::uint64_t(args.integer(1, "steps", 1, 1000000, 300));
  const std::string corpus_path = args.text(2, "/usr/share/games/fortunes");
  const std::filesystem::path ckpt = args.text(3, "byte_llama.safetensors");
  // A file, or every text file of a directory (fortune's *.dat indexes and *.u8 links skipped), in name order.
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  if (std::filesystem::is_directory(corpus_path, ec)) {
    for (const auto& e : std::filesystem::directory_iterator(corpus_path, ec))
      if (e.is_regular_file() && !e.is_symlink() && e.path().extension() != ".dat" && e.path().extension() != ".u8") files.push_back(e.path());
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(corpus_path);
  }
  std::string text;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  if (text.size() < 4 * seq) {
    std::fprintf(stderr, "cannot read a corpus at %s (install Debian's `fortunes`, or pass a text file)\n", corpus_path.c_str());
    return 2;
  }
  // The last 5% of the text is held out.
  const std::size_t split = text.size() / 20 * 19;

  const io::model_config cfg = io::parse_model_config(R"({
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
    "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": true})");
  host_device dev;
  nn::decoder_lm<host_device, bf16> model(dev, cfg);
  model.init(2024);
  std::printf("byte-level Llama: %zu parameters, %zu layers, d=%zu, bf16 compute; corpus %s (%zu files, %zu bytes)\n", model.params().numel(),
              cfg.num_hidden_layers, cfg.hidden_size, corpus_path.c_str(), files.size(), text.size());

  std::uint64_t lcg = 12345;
  auto next = [&] { return (lcg = lcg * 6364136223846793005ull + 1442695040888963407ull) >> 17; };
  std::vector<std::int64_t> ids(batch * seq), targets(batch * seq);
  auto fill = [&](std::size_t lo, std::size_t hi) {
    for (std::size_t b = 0; b < batch; ++b) {
      const std::size_t at = lo + std::size_t(next() % (hi - lo - seq - 1));
      for (std::size_t t = 0; t < seq; ++t) {
        ids[b * seq + t] = static_cast<unsigned char>(text[at + t]);
        targets[b * seq + t] = static_cast<unsigned char>(text[at + t + 1]);
      }
    }
  };
  nn::adamw_config opt;
  opt.hyper.lr = 2e-3f;
  opt.hyper.weight_decay = 0.01f;
  opt.max_grad_norm = 1.0f;
  auto train_step = [&](nn::decoder_lm<host_device, bf16>& m, std::uint64_t step) {
    m.params().zero_grad();
    const double loss = m.forward_backward(ids, targets, batch, seq);
    m.adamw(opt, step);
    return loss;
  };
  for (std::uint64_t step = 1; step <= steps; ++step) {
    fill(0, split);
    const double loss = train_step(model, step);
    if (step == 1 || step % 50 == 0 || step == steps) {
      fill(split, text.size());
      const double held = model.loss(ids, targets, batch, seq);
      std::printf("step %5llu  train loss %.3f  held-out loss %.3f  (%.2f bits per byte)\n", static_cast<unsigned long long>(step), loss, held,
                  held / 0.6931471805599453);
    }
  }

  const std::string prompt = "A ";
  std::vector<std::int64_t> p(prompt.begin(), prompt.end());
  const auto out = nn::generate(model, p, 160, nn::sampling{.temperature = 0.8f, .top_k = 40, .seed = 7}, seq);
  std::string sample;
  for (std::int64_t t : out) sample += (std::isprint(int(t)) || t == '\n') ? char(t) : '?';
  std::printf("sample (temperature 0.8, top-k 40):\n----\n%s\n----\n", sample.c_str());

  // Checkpoint, reload into a second model, and continue both: the same bits.
  model.params().save_training_state(ckpt, steps);
  nn::decoder_lm<host_device, bf16> resumed(dev, cfg);
  const std::uint64_t at = resumed.params().load_training_state(ckpt);
  fill(0, split);
  const double a = train_step(model, steps + 1), b = train_step(resumed, at + 1);
  const bool same = a == b;
  std::printf("checkpoint %s (step %llu) reloaded: next step loss %.6f vs %.6f: %s\n", ckpt.string().c_str(), static_cast<unsigned long long>(at), a,
              b, same ? "identical" : "DIFFERENT");
  return same ? 0 : 1;
}
