// fp16 linear layers (nn::linear::set_precision(fp16)): the forward and both gradients against fp64
// products of the operands rounded to fp16 (the GEMM's f32 accumulation bound, which the
// unrounded operands miss), in Hugging Face's and GPT-2's weight layouts; the overflow record; a
// decoder with fp16 projections and dynamic loss scaling tracks the f32 one, skips the steps whose
// gradients overflow, and its policy moves a projection whose fp16 operands keep overflowing back to
// the compute type, logged.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/nn.hpp>

#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_nn_fp16_linear {

using namespace tessel;
using tessel_test::is_error;

namespace {

std::vector<float> random_vec(std::size_t n, std::uint64_t seed, double scale) {
  nn::normal_rng g(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = float(g() * scale);
  return v;
}
double h(float x) { return double(float(fp16(x))); }  // x rounded to fp16

// got (R, C), row-major with leading dimension ld, against sum_k a(i, k) b(k, j) of the fp16
// roundings of a and b (+ off(i, j)): within f32 accumulation's bound, and for at least one element
// farther from the product of the unrounded operands than that bound (so the operands were fp16).
template <class A, class B, class Off>
void check(const float* got, std::size_t ld, std::size_t R, std::size_t C, std::size_t K, A a, B b, Off off) {
  const double gamma = double(K + 2) * std::ldexp(1.0, -24) * 1.01;
  bool rounded_visible = false;
  for (std::size_t i = 0; i < R; ++i)
    for (std::size_t j = 0; j < C; ++j) {
      double p = off(i, j), abs = std::fabs(off(i, j)), raw = off(i, j);
      for (std::size_t k = 0; k < K; ++k) {
        p += h(a(i, k)) * h(b(k, j));
        abs += std::fabs(h(a(i, k)) * h(b(k, j)));
        raw += double(a(i, k)) * double(b(k, j));
      }
      INFO("element (" << i << ", " << j << ") of " << R << "x" << C << "x" << K);
      REQUIRE(std::fabs(double(got[i * ld + j]) - p) <= gamma * abs + 1e-30);
      rounded_visible = rounded_visible || std::fabs(double(got[i * ld + j]) - raw) > gamma * abs;
    }
  CHECK(rounded_visible);
}

const char* llama_json = R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 37, "hidden_size": 128,
  "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
  "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": false})";

struct batch {
  static constexpr std::size_t B = 2, S = 16;
  std::vector<std::int64_t> ids, targets;
  batch() : ids(B * S), targets(B * S) {
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = std::int64_t((i * 7 + 3) % 37);
    for (std::size_t i = 0; i < ids.size(); ++i) targets[i] = (i % S + 1 < S) ? ids[i + 1] : -100;
  }
};

}  // namespace

TEST_CASE("an fp16 linear layer's forward and gradients are products of fp16 operands", "[nn][fp16]") {
  host_device dev(2);
  const std::size_t M = 70, K = 96, N = 50;  // tokens, in, out
  // packed operands (one conversion each), and rows with padding between them (converted row by
  // row; the padding holds NaN, which would reach the results and the amax if it were read)
  for (const auto& [conv1d, strided] : {std::pair{false, false}, std::pair{true, false}, std::pair{false, true}, std::pair{true, true}}) {
    INFO((conv1d ? "GPT-2 Conv1D layout, a column slice" : "Hugging Face layout") << (strided ? ", strided rows" : ", packed rows"));
    nn::parameters<host_device> ps(dev);
    const std::size_t total = N + 20, col0 = 20;
    auto& w = conv1d ? ps.add("w", {K, total}) : ps.add("w", {N, K});
    auto& b = ps.add("b", {conv1d ? total : N});
    const auto W = random_vec(N * K, 1, 0.05);  // (out, in)
    for (std::size_t o = 0; o < N; ++o)
      for (std::size_t i = 0; i < K; ++i) (conv1d ? w.value.data()[i * total + col0 + o] : w.value.data()[o * K + i]) = W[o * K + i];
    for (std::size_t j = 0; j < b.numel; ++j) b.value.data()[j] = float(0.01 * double(j % 7));
    nn::linear<host_device, float> lin(&w, &b, K, N, conv1d, conv1d ? col0 : 0);
    lin.set_precision(nn::linear_precision::fp16);
    REQUIRE(lin.precision() == nn::linear_precision::fp16);
    REQUIRE_FALSE(lin.fp8());

    const auto x = random_vec(M * K, 2, 1.0), dy = random_vec(M * N, 3, 0.1);
    const std::size_t lx = strided ? K + 5 : K, ly = strided ? N + 3 : N;
    std::vector<float> xs(M * lx, std::numeric_limits<float>::quiet_NaN()), dys(M * ly, std::numeric_limits<float>::quiet_NaN());
    for (std::size_t t = 0; t < M; ++t) {
      std::copy(x.begin() + std::ptrdiff_t(t * K), x.begin() + std::ptrdiff_t((t + 1) * K), xs.begin() + std::ptrdiff_t(t * lx));
      std::copy(dy.begin() + std::ptrdiff_t(t * N), dy.begin() + std::ptrdiff_t((t + 1) * N), dys.begin() + std::ptrdiff_t(t * ly));
    }
    std::vector<float> y(M * ly), dx(M * lx);
    lin.forward(dev, nn::cview<float>(xs.data(), M, K, lx), nn::mview<float>(y.data(), M, N, ly), true);
    const float* bias = b.value.data() + (conv1d ? col0 : 0);
    check(
        y.data(), ly, M, N, K, [&](std::size_t i, std::size_t k) { return x[i * K + k]; }, [&](std::size_t k, std::size_t j) { return W[j * K + k]; },
        [&](std::size_t, std::size_t j) { return double(bias[j]); });

    lin.backward(dev, nn::cview<float>(dys.data(), M, N, ly), nn::mview<float>(dx.data(), M, K, lx), false);
    const auto zero = [](std::size_t, std::size_t) { return 0.0; };
    check(
        dx.data(), lx, M, K, N, [&](std::size_t i, std::size_t k) { return dy[i * N + k]; },
        [&](std::size_t k, std::size_t j) { return W[k * K + j]; }, zero);
    // dW (out, in) = dyᵀ x, read out of either layout
    std::vector<float> dw(N * K);
    for (std::size_t o = 0; o < N; ++o)
      for (std::size_t i = 0; i < K; ++i) dw[o * K + i] = conv1d ? w.grad.data()[i * total + col0 + o] : w.grad.data()[o * K + i];
    check(
        dw.data(), K, N, K, M, [&](std::size_t o, std::size_t t) { return dy[t * N + o]; },
        [&](std::size_t t, std::size_t i) { return x[t * K + i]; }, zero);
    // the bias gradient: column sums of dy (the compute type's GEMM)
    for (std::size_t j = 0; j < N; ++j) {
      double s = 0, a = 0;
      for (std::size_t t = 0; t < M; ++t) s += dy[t * N + j], a += std::fabs(dy[t * N + j]);
      REQUIRE(std::fabs(double(b.grad.data()[(conv1d ? col0 : 0) + j]) - s) <= double(M + 2) * std::ldexp(1.0, -24) * a * 1.01);
    }
    // the record holds the operands' amax, nothing overflowed
    const auto& o = lin.overflow();
    float xmax = 0;
    for (float v : x) xmax = std::max(xmax, std::fabs(v));
    CHECK(o.x == xmax);
    CHECK(o.dy > 0.0f);
    CHECK(o.w > 0.0f);
    CHECK_FALSE(o.forward());
    CHECK_FALSE(o.backward());
  }
}

TEST_CASE("an fp16 linear layer records its own overflows, not the Inf it is handed", "[nn][fp16]") {
  host_device dev(1);
  nn::parameters<host_device> ps(dev);
  const std::size_t M = 4, K = 8, N = 3;
  auto& w = ps.add("w", {N, K});
  for (std::size_t i = 0; i < w.numel; ++i) w.value.data()[i] = 0.125f;
  nn::linear<host_device, float> lin(&w, nullptr, K, N);
  lin.set_precision(nn::linear_precision::fp16);
  std::vector<float> x(M * K, 1.0f), y(M * N), dy(M * N, 1.0f), dx(M * K);
  const auto fwd = [&] { lin.forward(dev, nn::cview<float>(x.data(), M, K, K), nn::mview<float>(y.data(), M, N, N), true); };
  const auto bwd = [&] { lin.backward(dev, nn::cview<float>(dy.data(), M, N, N), nn::mview<float>(dx.data(), M, K, K), false); };

  x[5] = 70000.0f;  // past fp16's 65504: the layer's own forward overflow
  fwd();
  CHECK(lin.overflow().x == 70000.0f);
  CHECK(lin.overflow().forward());
  CHECK_FALSE(std::isfinite(y[0]));
  x[5] = 65504.0f;  // fp16's largest finite value converts exactly
  lin.clear_overflow();
  fwd();
  CHECK_FALSE(lin.overflow().forward());
  CHECK(y[0] == Approx(0.125 * (7 + 65504)));

  dy[2] = 1e6f;  // a scaled gradient past the range: the backward's overflow
  bwd();
  CHECK(lin.overflow().backward());
  lin.clear_overflow();
  CHECK(lin.overflow().dy == 0.0f);
  dy[2] = std::numeric_limits<float>::infinity();  // handed an Inf: another layer's overflow, not this one's
  bwd();
  CHECK(std::isinf(lin.overflow().dy));
  CHECK_FALSE(lin.overflow().backward());
  x[1] = std::numeric_limits<float>::quiet_NaN();
  fwd();
  CHECK(std::isnan(lin.overflow().x));
  CHECK_FALSE(lin.overflow().forward());

  w.value.data()[3] = -1e5f;  // a weight past the range
  x[1] = 1.0f;
  lin.clear_overflow();
  fwd();
  CHECK(lin.overflow().w == 1e5f);
  CHECK(lin.overflow().forward());

  // no grouped form; back to the compute type, the layer is its old self
  CHECK_THROWS_MATCHES(lin.forward_problem(nn::cview<float>(x.data(), M, K, K), nn::mview<float>(y.data(), M, N, N), true), nn::nn_error,
                       is_error(errc::unsupported, "nn", "fp16 mode has no grouped product"));
  lin.set_precision(nn::linear_precision::compute);
  fwd();
  CHECK(y[0] == Approx(0.125 * (6 + 65504) - 1e5).epsilon(1e-6));  // x[3] meets the weight -1e5
}

TEST_CASE("a decoder with fp16 projections and loss scaling tracks the f32 one and trains", "[nn][fp16][decoder]") {
  const auto cfg = io::parse_model_config(llama_json);
  host_device dev(2);
  nn::decoder_lm<host_device, float> ref(dev, cfg), m(dev, cfg);
  ref.init(7, 0.05);
  m.init(7, 0.05);
  std::vector<std::string> log;
  m.set_fp16_linears(true, {.log = [&](const std::string& s) { log.push_back(s); }});
  REQUIRE(m.fp16_linears() == 2 * 7);  // q, k, v, o, gate, up, down per layer
  m.set_loss_scaler(loss_scaler(65536.0f));
  const batch bt;
  nn::adamw_config hp;
  hp.hyper.lr = 1e-2f;
  double first = 0, last = 0;
  for (std::uint64_t step = 1; step <= 20; ++step) {
    ref.params().zero_grad();
    m.params().zero_grad();
    const double lr = ref.forward_backward(bt.ids, bt.targets, bt.B, bt.S), lm = m.forward_backward(bt.ids, bt.targets, bt.B, bt.S);
    if (step == 1) {
      first = lm;
      CHECK(std::fabs(lm - lr) <= 2e-3 * lr);  // fp16 operands keep 11 significant bits
      // the gradients carry the loss scale until the step divides it out
      double dot = 0, na = 0, nb = 0;
      auto pr = ref.params().begin();
      for (auto& p : m.params()) {
        for (std::size_t i = 0; i < p.numel; ++i) {
          const double g = double(p.grad.data()[i]) / 65536.0;
          dot += g * pr->grad.data()[i];
          na += g * g;
          nb += double(pr->grad.data()[i]) * pr->grad.data()[i];
        }
        ++pr;
      }
      CHECK(std::fabs(std::sqrt(na / nb) - 1.0) < 0.01);
      CHECK(dot / std::sqrt(na * nb) > 0.999);
    }
    last = lm;
    CHECK_FALSE(ref.adamw(hp, step).skipped);
    CHECK_FALSE(m.adamw(hp, step).skipped);
  }
  CHECK(last < 0.5 * first);
  CHECK(m.fp16_linears() == 2 * 7);
  CHECK(log.empty());
  CHECK(m.loss_scale() == 65536.0f);  // 20 clean steps: below the growth interval
}

TEST_CASE("a decoder's loss scaler skips the steps whose fp16 gradients overflow and backs off", "[nn][fp16][decoder]") {
  const auto cfg = io::parse_model_config(llama_json);
  host_device dev(2);
  nn::decoder_lm<host_device, bf16> m(dev, cfg);
  m.init(7, 0.05);
  std::vector<std::string> log;
  m.set_fp16_linears(true, {.log = [&](const std::string& s) { log.push_back(s); }});
  const float init = std::ldexp(1.0f, 40);  // gradients of ~1e-3 scaled past 65504
  m.set_loss_scaler(loss_scaler(init, 2.0f, 0.5f, 1000));
  const batch bt;
  nn::adamw_config hp;
  hp.hyper.lr = 1e-2f;
  std::size_t skipped = 0, clean = 0;
  const float* w0 = m.params().at("model.layers.0.mlp.down_proj.weight").value.data();
  for (std::uint64_t step = 1; step <= 40; ++step) {
    m.params().zero_grad();
    const float before = w0[0];
    const float scale = m.loss_scale();
    (void)m.forward_backward(bt.ids, bt.targets, bt.B, bt.S);
    const auto r = m.adamw(hp, step);
    if (r.skipped) {
      ++skipped;
      CHECK(w0[0] == before);  // a skipped step writes nothing
      CHECK(m.loss_scale() == scale / 2);
    } else {
      ++clean;
      CHECK(m.loss_scale() == scale);
    }
  }
  CHECK(skipped >= 10);  // 2^40 against gradients that overflow fp16 at about 2^26
  CHECK(clean >= 10);
  CHECK(m.fp16_linears() == 2 * 7);  // the scaler's business: no projection struck (the scale stayed above 1)
  CHECK(log.empty());

  // a policy that counts every backward overflow as a strike moves projections out after `patience` steps
  nn::decoder_lm<host_device, bf16> s(dev, cfg);
  s.init(7, 0.05);
  s.set_fp16_linears(true, {.patience = 2, .min_scale = std::numeric_limits<float>::max(), .log = [&](const std::string& l) { log.push_back(l); }});
  s.set_loss_scaler(loss_scaler(init));
  for (std::uint64_t step = 1; step <= 2; ++step) {
    s.params().zero_grad();
    (void)s.forward_backward(bt.ids, bt.targets, bt.B, bt.S);
    CHECK(s.adamw(hp, step).skipped);
    if (step == 1) CHECK(s.fp16_linears() == 2 * 7);
  }
  CHECK(s.fp16_linears() < 2 * 7);
  REQUIRE_FALSE(log.empty());
  CHECK(log[0].find("leaves fp16 for bf16 after 2 steps") != std::string::npos);
  nn::fp16_policy none;
  none.patience = 0;
  CHECK_THROWS_MATCHES(s.set_fp16_linears(true, none), nn::nn_error, is_error(errc::invalid_argument, "nn", "patience"));
}

TEST_CASE("a decoder moves the projections whose fp16 inputs overflow to bf16 and trains on", "[nn][fp16][decoder]") {
  const auto cfg = io::parse_model_config(llama_json);
  host_device dev(2);
  nn::decoder_lm<host_device, bf16> m(dev, cfg);
  m.init(7, 0.05);
  // layer 0's input norm scales its output to ~1e5: its q, k and v read inputs past fp16's range
  auto& g = m.params().at("model.layers.0.input_layernorm.weight");
  for (std::size_t i = 0; i < g.numel; ++i) g.value.data()[i] = 1e5f;
  m.params().refresh_bf16();
  std::vector<std::string> log;
  m.set_fp16_linears(true, {.patience = 3, .log = [&](const std::string& s) { log.push_back(s); }});
  m.set_loss_scaler(loss_scaler(1024.0f));
  const batch bt;
  nn::adamw_config hp;
  hp.hyper.lr = 1e-3f;
  std::size_t skipped = 0;
  double last = 0;
  for (std::uint64_t step = 1; step <= 12; ++step) {
    m.params().zero_grad();
    last = m.forward_backward(bt.ids, bt.targets, bt.B, bt.S);
    const bool sk = m.adamw(hp, step).skipped;
    skipped += sk;
    if (step <= 2) CHECK(m.fp16_linears() == 2 * 7);  // two strikes: still fp16
    if (step > 8) CHECK_FALSE(sk);                    // the switched model trains
  }
  CHECK(skipped >= 3);
  CHECK(std::isfinite(last));
  std::set<std::string> moved;
  for (const auto& l : log) {
    const auto a = l.find("model."), e = l.find(".weight");
    REQUIRE(a != std::string::npos);
    moved.insert(l.substr(a, e - a));
    CHECK(l.find("leaves fp16 for bf16") != std::string::npos);
  }
  for (const char* p : {"q_proj", "k_proj", "v_proj"}) CHECK(moved.count(std::string("model.layers.0.self_attn.") + p) == 1);
  for (const auto& name : moved) CHECK(name.rfind("model.layers.0.self_attn.", 0) == 0);  // only layer 0's attention
  CHECK(m.fp16_linears() == 2 * 7 - moved.size());
}

}  // namespace tessel_test_nn_fp16_linear
