// Decoder models (tessel/nn/decoder.hpp): gradients against central differences of the loss,
// determinism across thread counts, bf16 against f32, recomputation (same bits, less memory),
// checkpoints round-trip by name, training
// lowers the loss, and bad input is a typed error. The PyTorch conformance lives in *_torch.cpp.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/nn.hpp>

#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_nn_decoder {

using namespace tessel;
using tessel_test::is_error;

namespace {

io::model_config llama_config(bool tie = false, bool bias = false, int window = 0) {
  std::string j = R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 37, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu")";
  j += std::string(", \"tie_word_embeddings\": ") + (tie ? "true" : "false");
  j += std::string(", \"attention_bias\": ") + (bias ? "true" : "false");
  if (window) {
    j.replace(j.find("\"llama\""), 7, "\"mistral\"");
    j.replace(j.find("LlamaForCausalLM"), 16, "MistralForCausalLM");
    j += ", \"sliding_window\": " + std::to_string(window);
  }
  return io::parse_model_config(j + "}");
}

io::model_config gpt2_config() {
  return io::parse_model_config(R"({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 41, "n_embd": 64,
    "n_layer": 2, "n_head": 4, "n_positions": 32, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"})");
}

// A tiny Mixtral: 4 experts, top-2, the aux term weighted enough (0.3) to show in the gradients.
io::model_config mixtral_config(double coef = 0.3) {
  auto c = io::parse_model_config(R"({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 37, "hidden_size": 64,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": false})");
  c.router_aux_loss_coef = coef;
  return c;
}

struct batch {
  std::size_t b = 2, s = 7;
  std::vector<std::int64_t> ids, targets;
};
batch make_batch(std::size_t vocab, std::uint64_t seed = 1) {
  batch x;
  nn::normal_rng r(seed);
  for (std::size_t i = 0; i < x.b * x.s; ++i) x.ids.push_back(std::int64_t(std::fabs(r() * 1000.0)) % std::int64_t(vocab));
  x.targets.resize(x.ids.size());
  for (std::size_t i = 0; i < x.ids.size(); ++i) x.targets[i] = (i % x.s + 1 < x.s) ? x.ids[i + 1] : -100;
  x.targets[3] = -100;
  return x;
}

// d loss / d p·u against central differences (Richardson-extrapolated) along a random direction u of each
// parameter, in f32: the two agree to the rounding of the loss.
// MoE models: the objective is the loss plus coef · aux, as their gradient holds both.
template <class Model>
void check_directional_gradients(Model& m, const batch& x) {
  const double coef = m.config().router_aux_loss_coef;
  auto& ps = m.params();
  ps.zero_grad();
  (void)m.forward_backward(x.ids, x.targets, x.b, x.s);
  nn::normal_rng r(99);
  for (auto& p : ps) {
    std::vector<float> u(p.numel), saved(p.value.data(), p.value.data() + p.numel);
    double gu = 0.0, uu = 0.0;
    for (std::size_t i = 0; i < p.numel; ++i) {
      u[i] = float(r());
      gu += double(p.grad.data()[i]) * u[i];
      uu += double(u[i]) * u[i];
    }
    const double h = 2e-3 / std::sqrt(uu / double(p.numel));
    auto loss_at = [&](double s) {
      for (std::size_t i = 0; i < p.numel; ++i) p.value.data()[i] = float(double(saved[i]) + s * h * u[i]);
      const double l = m.loss(x.ids, x.targets, x.b, x.s);
      return l + coef * m.last_aux_loss();
    };
    // Richardson: (4 D(h/2) - D(h)) / 3 cancels the h^2 term of the central difference D.
    const double d1 = (loss_at(1.0) - loss_at(-1.0)) / (2.0 * h), d2 = (loss_at(0.5) - loss_at(-0.5)) / h;
    const double fd = (4.0 * d2 - d1) / 3.0;
    std::copy(saved.begin(), saved.end(), p.value.data());
    INFO(p.name << ": analytic " << gu << ", central difference " << fd);
    CHECK(std::fabs(fd - gu) <= 2e-3 * std::max(1.0, std::fabs(gu)) + 2e-3);
  }
}

}  // namespace

TEST_CASE("llama-style decoder gradients match central differences of the loss", "[nn][decoder]") {
  host_device dev(2);
  for (bool tie : {false, true}) {
    nn::decoder_lm<host_device> m(dev, llama_config(tie, !tie));
    m.init(7, 0.2);
    check_directional_gradients(m, make_batch(37));
  }
}

TEST_CASE("mistral sliding-window decoder gradients match central differences", "[nn][decoder]") {
  host_device dev(2);
  nn::decoder_lm<host_device> m(dev, llama_config(false, false, 3));
  m.init(8, 0.2);
  check_directional_gradients(m, make_batch(37));
}

TEST_CASE("gpt2 decoder gradients match central differences of the loss", "[nn][decoder]") {
  host_device dev(2);
  nn::decoder_lm<host_device> m(dev, gpt2_config());
  m.init(9, 0.2);
  check_directional_gradients(m, make_batch(41));
}

TEST_CASE("mixtral decoder gradients (cross-entropy + coef · aux) match central differences", "[nn][decoder][moe]") {
  // The top-k routing is piecewise constant: at this seed no token's top 2 changes within the
  // steps taken (a flip would show as a jump of the difference quotient, failing the check).
  host_device dev(2);
  nn::decoder_lm<host_device> m(dev, mixtral_config());
  m.init(12, 0.2);
  check_directional_gradients(m, make_batch(37));
}

TEST_CASE("decoder loss and gradients are the same bits on 1 and 2 threads", "[nn][decoder]") {
  host_device d1(1), d2(2);
  for (const auto& cfg : {llama_config(), mixtral_config()}) {
    nn::decoder_lm<host_device> a(d1, cfg), b(d2, cfg);
    a.init(3, 0.1);
    b.init(3, 0.1);
    const auto x = make_batch(37, 5);
    const double la = a.forward_backward(x.ids, x.targets, x.b, x.s), lb = b.forward_backward(x.ids, x.targets, x.b, x.s);
    CHECK(la == lb);
    CHECK(a.last_aux_loss() == b.last_aux_loss());
    auto pb = b.params().begin();
    for (auto& p : a.params()) {
      INFO(p.name);
      CHECK(std::equal(p.grad.data(), p.grad.data() + p.numel, pb->grad.data()));
      ++pb;
    }
  }
}

TEST_CASE("a bf16 decoder tracks the f32 one", "[nn][decoder][bf16]") {
  host_device dev(2);
  for (const auto& cfg : {llama_config(), gpt2_config()}) {
    nn::decoder_lm<host_device, float> f(dev, cfg);
    nn::decoder_lm<host_device, bf16> h(dev, cfg);
    f.init(11, 0.1);
    h.init(11, 0.1);
    const auto x = make_batch(cfg.vocab_size, 6);
    const double lf = f.forward_backward(x.ids, x.targets, x.b, x.s), lh = h.forward_backward(x.ids, x.targets, x.b, x.s);
    // bf16 rounds each GEMM operand to 8 bits: the loss moves by a few units of 2^-8 relative.
    CHECK(std::fabs(lf - lh) <= 0.02 * std::fabs(lf));
    double dot = 0.0, nf = 0.0, nh = 0.0;
    auto ph = h.params().begin();
    for (auto& p : f.params()) {
      for (std::size_t i = 0; i < p.numel; ++i) {
        dot += double(p.grad.data()[i]) * ph->grad.data()[i];
        nf += double(p.grad.data()[i]) * p.grad.data()[i];
        nh += double(ph->grad.data()[i]) * ph->grad.data()[i];
      }
      ++ph;
    }
    CHECK(dot / std::sqrt(nf * nh) > 0.99);  // the gradients point the same way
  }
}

TEST_CASE("recomputing attention or whole blocks gives the same loss and gradient bits with less activation memory", "[nn][decoder][recompute]") {
  host_device dev(2);
  for (const auto& cfg : {llama_config(), gpt2_config(), mixtral_config()}) {
    INFO(cfg.vocab_size << " vocab, moe " << cfg.is_moe());
    const auto x = make_batch(cfg.vocab_size, 4);
    std::vector<std::vector<float>> ref;
    double ref_loss = 0;
    std::size_t last_bytes = 0;
    for (nn::recompute r : {nn::recompute::none, nn::recompute::attention, nn::recompute::blocks}) {
      nn::decoder_lm<host_device, bf16> m(dev, cfg);
      m.init(31, 0.1);
      m.set_recompute(r);
      CHECK(m.recompute_mode() == r);
      // two steps: the second runs on buffers the first left behind (recomputation must overwrite them all)
      double loss = 0;
      for (int step = 0; step < 2; ++step) {
        m.params().zero_grad();
        loss = m.forward_backward(x.ids, x.targets, x.b, x.s);
      }
      std::vector<std::vector<float>> grads;
      for (auto& p : m.params()) grads.emplace_back(p.grad.data(), p.grad.data() + p.numel);
      const std::size_t bytes = m.activation_bytes();
      if (r == nn::recompute::none) {
        ref = grads;
        ref_loss = loss;
      } else {
        CHECK(loss == ref_loss);
        REQUIRE(grads.size() == ref.size());
        for (std::size_t i = 0; i < grads.size(); ++i) CHECK(grads[i] == ref[i]);
        CHECK(bytes < last_bytes);  // attention keeps less than none, blocks less than attention
      }
      last_bytes = bytes;
    }
  }
  // switching back frees nothing it needs: none after blocks trains like none from the start
  nn::decoder_lm<host_device, float> m(dev, llama_config());
  m.init(3, 0.1);
  const auto x = make_batch(37, 5);
  m.set_recompute(nn::recompute::blocks);
  (void)m.forward_backward(x.ids, x.targets, x.b, x.s);
  const std::size_t small = m.activation_bytes();
  m.set_recompute(nn::recompute::none);
  m.params().zero_grad();
  const double l1 = m.forward_backward(x.ids, x.targets, x.b, x.s);
  CHECK(m.activation_bytes() > small);
  nn::decoder_lm<host_device, float> f(dev, llama_config());
  f.init(3, 0.1);
  CHECK(f.forward_backward(x.ids, x.targets, x.b, x.s) == l1);
}

// The activation arena: every step's tensors planned into shared bytes by their lifetimes. The
// reference gives each tensor its own bytes; the checked run poisons every byte no live tensor
// covers with NaN at each phase, so a tensor read outside its planned lifetime (or overwritten by
// one planned beside it) changes the loss or a gradient.
template <class T>
void check_arena(host_device& dev, const io::model_config& cfg, nn::recompute r, std::size_t head_rows) {
  const auto x = make_batch(cfg.vocab_size, 5);
  nn::decoder_lm<host_device, T> ref(dev, cfg), m(dev, cfg);
  ref.init(41, 0.1);
  m.init(41, 0.1);
  for (auto* model : {&ref, &m}) {
    model->set_recompute(r);
    model->set_head_chunk_rows(head_rows);
  }
  ref.set_activation_checks(false, false);
  m.set_activation_checks(true, true);
  double lr = 0, lm = 0;
  for (int step = 0; step < 2; ++step) {  // the second step runs on what the first left in the arena
    ref.params().zero_grad();
    m.params().zero_grad();
    lr = ref.forward_backward(x.ids, x.targets, x.b, x.s);
    lm = m.forward_backward(x.ids, x.targets, x.b, x.s);
  }
  REQUIRE(std::isfinite(lm));
  CHECK(lm == lr);
  auto pm = m.params().begin();
  for (auto& p : ref.params()) {
    INFO(p.name);
    CHECK(std::equal(p.grad.data(), p.grad.data() + p.numel, pm->grad.data()));
    ++pm;
  }
  // the reference layout is one buffer per tensor; the plan shares, and no placement beats the
  // most bytes live in one phase
  CHECK(ref.activation_bytes() == ref.activation_bytes_per_tensor());
  CHECK(m.activation_bytes_per_tensor() == ref.activation_bytes_per_tensor());
  CHECK(m.activation_bytes() < m.activation_bytes_per_tensor());
  CHECK(m.activation_bytes() >= m.activation_plan().lower_bound_bytes);
  // a forward without training after the step, and the step again: the same logits and loss
  const auto lf = ref.forward(x.ids, x.b, x.s);
  const std::vector<float> want(lf.begin(), lf.end());
  const auto got = m.forward(x.ids, x.b, x.s);
  CHECK(std::equal(want.begin(), want.end(), got.begin(), got.end()));
  m.params().zero_grad();
  CHECK(m.forward_backward(x.ids, x.targets, x.b, x.s) == lr);
}

TEST_CASE("the activation arena planned from lifetimes gives the bits of one buffer per tensor with NaN in every free byte", "[nn][decoder][arena]") {
  host_device dev(2);
  for (nn::recompute r : {nn::recompute::none, nn::recompute::attention, nn::recompute::blocks}) {
    INFO("recompute " << int(r));
    for (std::size_t head : {std::size_t(0), std::size_t(4)}) {
      INFO("head rows " << head);
      check_arena<float>(dev, llama_config(), r, head);
      check_arena<bf16>(dev, llama_config(true, true), r, head);
      check_arena<float>(dev, gpt2_config(), r, head);
      check_arena<bf16>(dev, gpt2_config(), r, head);
      check_arena<bf16>(dev, mixtral_config(), r, head);
    }
  }
}

TEST_CASE("the LM head in chunks of rows gives the unchunked loss and gradients", "[nn][decoder][recompute]") {
  host_device dev(2);
  for (const auto& cfg : {llama_config(), llama_config(true), gpt2_config()}) {
    INFO("vocab " << cfg.vocab_size << ", tied " << cfg.tie_word_embeddings);
    const auto x = make_batch(cfg.vocab_size, 8);  // 14 rows: chunks of 5, 5 and 4
    nn::decoder_lm<host_device, float> whole(dev, cfg), chunked(dev, cfg);
    whole.init(17, 0.1);
    chunked.init(17, 0.1);
    whole.set_head_chunk_rows(0);
    chunked.set_head_chunk_rows(5);
    CHECK(chunked.head_chunk_rows() == 5);
    const double lw = whole.forward_backward(x.ids, x.targets, x.b, x.s), lc = chunked.forward_backward(x.ids, x.targets, x.b, x.s);
    // each row's loss from its own logits, summed in the same order; the head's GEMM may take
    // another path for 5 rows than for 14 (other f32 roundings of the same products)
    CHECK(std::fabs(lw - lc) <= 1e-6 * std::fabs(lw));
    // the logits chunk is planned smaller; the arena shrinks when the head is at the step's peak
    CHECK(chunked.activation_bytes() <= whole.activation_bytes());
    CHECK(chunked.activation_bytes_per_tensor() < whole.activation_bytes_per_tensor());
    auto pc = chunked.params().begin();
    for (auto& p : whole.params()) {
      INFO(p.name);
      // The head weight's gradient sums its 14 rows in chunks (f32 rounding of a 14-term sum); the
      // head's input gradient is row by row, but its GEMM may take another path for 5 rows than
      // for 14, so what flows back is held to the same f32 bound, not to equal bits.
      double worst = 0, scale = 0;
      for (std::size_t i = 0; i < p.numel; ++i) {
        worst = std::max(worst, std::fabs(double(p.grad.data()[i]) - double(pc->grad.data()[i])));
        scale = std::max(scale, std::fabs(double(p.grad.data()[i])));
      }
      CHECK(worst <= 1e-5 * scale);
      ++pc;
    }
  }
  {
    // a vocabulary whose logits outweigh the blocks' activations: the chunked head lowers the peak
    auto cfg = llama_config();
    cfg.vocab_size = 3000;
    const auto x = make_batch(cfg.vocab_size, 8);
    nn::decoder_lm<host_device, float> whole(dev, cfg), chunked(dev, cfg);
    whole.set_head_chunk_rows(0);
    chunked.set_head_chunk_rows(5);
    (void)whole.forward_backward(x.ids, x.targets, x.b, x.s);
    (void)chunked.forward_backward(x.ids, x.targets, x.b, x.s);
    CHECK(chunked.activation_bytes() < whole.activation_bytes());
  }
  // a target outside the vocabulary is a typed error naming it, before anything runs
  nn::decoder_lm<host_device, float> m(dev, llama_config());
  auto x = make_batch(37, 9);
  x.targets[4] = 37;
  CHECK_THROWS_MATCHES(m.forward_backward(x.ids, x.targets, x.b, x.s), nn::nn_error, is_error(errc::out_of_range, "nn", "target 37 of row 4"));
}

TEST_CASE("a decoder saved by name loads back to the same logits", "[nn][decoder][io]") {
  host_device dev(2);
  const auto dir = std::filesystem::temp_directory_path() / "tessel_nn_roundtrip";
  std::filesystem::create_directories(dir);
  for (const auto& cfg : {llama_config(true), gpt2_config()}) {
    nn::decoder_lm<host_device> a(dev, cfg), b(dev, cfg);
    a.init(21, 0.1);
    a.params().save(dir / "model.safetensors");
    b.load(dir / "model.safetensors");
    const auto x = make_batch(cfg.vocab_size);
    const auto la = a.forward(x.ids, x.b, x.s);
    const std::vector<float> va(la.begin(), la.end());
    const auto lb = b.forward(x.ids, x.b, x.s);
    CHECK(std::equal(va.begin(), va.end(), lb.begin()));
  }
  // a checkpoint with a tensor of the wrong shape names it
  nn::decoder_lm<host_device> small(dev, llama_config());
  small.init(1);
  small.params().save(dir / "model.safetensors");
  auto cfg = llama_config();
  cfg.intermediate_size = 40;
  nn::decoder_lm<host_device> other(dev, cfg);
  CHECK_THROWS_MATCHES(other.load(dir / "model.safetensors"), nn::nn_error, is_error(errc::format, "nn", "model.layers.0.mlp.gate_proj.weight"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("AdamW steps lower the loss of a decoder on a repeated batch", "[nn][decoder][train]") {
  host_device dev(2);
  nn::decoder_lm<host_device, bf16> m(dev, llama_config());
  m.init(5);
  const auto x = make_batch(37, 2);
  nn::adamw_config h;
  h.hyper.lr = 1e-2f;
  double first = 0.0, last = 0.0;
  for (std::uint64_t step = 1; step <= 30; ++step) {
    m.params().zero_grad();
    last = m.forward_backward(x.ids, x.targets, x.b, x.s);
    if (step == 1) first = last;
    CHECK_FALSE(m.adamw(h, step).skipped);
  }
  CHECK(last < 0.5 * first);
}

TEST_CASE("lazy rows: an AdamW step leaves the embedding rows no token used as they were", "[nn][decoder][train]") {
  // Two copies of one model after a dense first step (so every moment is non-zero); a second batch
  // that uses only some tokens; then one step lazy and one dense. Lazy: a row of the embedding no
  // token used keeps its value and moments bit for bit, where the dense step moved it (weight decay);
  // every used row, and every other parameter, is the dense step's, bit for bit (AdamW works
  // element by element).
  host_device dev(1);
  nn::decoder_lm<host_device> lazy(dev, llama_config()), dense(dev, llama_config());
  lazy.init(3);
  dense.init(3);
  nn::adamw_config h;
  h.hyper.lr = 1e-2f;
  h.hyper.weight_decay = 0.1f;
  const auto x = make_batch(lazy.config().vocab_size, 41);
  for (auto* m : {&lazy, &dense}) {
    m->params().zero_grad();
    (void)m->forward_backward(x.ids, x.targets, x.b, x.s);
    m->adamw(h, 1);
  }
  batch y = make_batch(lazy.config().vocab_size, 42);
  for (auto& id : y.ids) id = id % 5;  // tokens 0..4 only
  for (auto& t : y.targets) t = t < 0 ? t : t % 5;
  const auto& e = lazy.params().at("model.embed_tokens.weight");
  const std::vector<float> before(e.value.data(), e.value.data() + e.numel), m_before(e.m.data(), e.m.data() + e.numel),
      v_before(e.v.data(), e.v.data() + e.numel);
  for (auto* m : {&lazy, &dense}) {
    m->params().zero_grad();
    (void)m->forward_backward(y.ids, y.targets, y.b, y.s);
  }
  h.lazy_rows = true;
  lazy.adamw(h, 2);
  h.lazy_rows = false;
  dense.adamw(h, 2);
  const std::size_t d = lazy.config().hidden_size;
  std::size_t kept = 0, moved = 0;
  for (auto& p : lazy.params()) {
    const auto& q = dense.params().at(p.name);
    const bool embed = p.name == "model.embed_tokens.weight";
    CHECK(p.sparse_row == (embed ? d : 0));
    for (std::size_t i = 0; i < p.numel; ++i) {
      const bool used = !embed || i / d < 5;
      if (used) {
        moved += p.value.data()[i] == q.value.data()[i] && p.m.data()[i] == q.m.data()[i] && p.v.data()[i] == q.v.data()[i];
      } else {
        kept += p.value.data()[i] == before[i] && p.m.data()[i] == m_before[i] && p.v.data()[i] == v_before[i] &&
                p.value.data()[i] != q.value.data()[i];  // weight decay moved the dense one
      }
    }
  }
  const std::size_t embed_numel = lazy.config().vocab_size * d;
  CHECK(kept == embed_numel - 5 * d);
  CHECK(moved == lazy.params().numel() - (embed_numel - 5 * d));
}

TEST_CASE("decoder input errors are typed and name the problem", "[nn][decoder][errors]") {
  host_device dev(1);
  nn::decoder_lm<host_device> m(dev, llama_config());
  std::vector<std::int64_t> ids{1, 2, 3, 40}, targets{2, 3, 4, 5};
  CHECK_THROWS_MATCHES(m.forward(ids, 1, 4), nn::nn_error, is_error(errc::invalid_argument, "nn", "token id 40"));
  CHECK_THROWS_MATCHES(m.forward(ids, 1, 3), nn::nn_error, is_error(errc::invalid_argument, "nn", "4 token ids for batch 1 x seq 3"));
  ids[3] = 4;
  targets.pop_back();
  CHECK_THROWS_MATCHES(m.forward_backward(ids, targets, 1, 4), nn::nn_error, is_error(errc::invalid_argument, "nn", "3 targets for 4 tokens"));
  targets = {2, 3, 4, 99};
  CHECK_THROWS_AS(m.forward_backward(ids, targets, 1, 4), tessel::error);  // a label outside the vocabulary
  auto moe = io::parse_model_config(R"({"model_type": "mixtral", "vocab_size": 37, "hidden_size": 64, "intermediate_size": 48,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
    "max_position_embeddings": 64})");
  moe.num_experts_per_tok = 5;  // more than the 4 experts
  CHECK_THROWS_MATCHES((nn::decoder_lm<host_device>(dev, moe)), nn::nn_error, is_error(errc::invalid_argument, "nn", "top-5 of 4 experts"));
  auto gpt = gpt2_config();
  nn::decoder_lm<host_device> g(dev, gpt);
  std::vector<std::int64_t> long_ids(33, 1);
  CHECK_THROWS_MATCHES(g.forward(long_ids, 1, 33), nn::nn_error, is_error(errc::invalid_argument, "nn", "learned positions"));
}

}  // namespace tessel_test_nn_decoder
