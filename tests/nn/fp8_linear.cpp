// FP8 linear layers (nn::linear::set_fp8, DeepSeek-V3's block-scaled recipe): the forward and both
// gradients against fp64 products of the test's own quantisation of each operand (the GEMM's f32
// rounding bound), against the unquantised fp64 products (the e4m3 bound), in Hugging Face's and
// GPT-2's weight layouts; amax tracking; a decoder trained with FP8 projections.
#include <catch2/catch.hpp>

#include <algorithm>
#include <type_traits>
#include <string>
#include <span>
#include <cstring>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/nn.hpp>

#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_nn_fp8_linear {

using namespace tessel;

namespace {

// A dense (R, C) matrix in fp64 with element access, for references.
struct mat {
  std::size_t R = 0, C = 0;
  std::vector<double> v;
  mat(std::size_t r, std::size_t c) : R(r), C(c), v(r * c, 0.0) {}
  double& operator()(std::size_t r, std::size_t c) { return v[r * C + c]; }
  double operator()(std::size_t r, std::size_t c) const { return v[r * C + c]; }
  mat t() const {
    mat o(C, R);
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t c = 0; c < C; ++c) o(c, r) = (*this)(r, c);
    return o;
  }
};

// The recipe's quantisation, written out: blocks of (br x 128), scale amax / 448, e4m3 of x / scale;
// returns the dequantised values (q · scale) and each element's scale.
struct dequantised {
  mat x, scale;
};
dequantised quantise(const mat& a, std::size_t br) {
  dequantised o{mat(a.R, a.C), mat(a.R, a.C)};
  for (std::size_t r0 = 0; r0 < a.R; r0 += br)
    for (std::size_t c0 = 0; c0 < a.C; c0 += 128) {
      const std::size_t r1 = std::min(a.R, r0 + br), c1 = std::min(a.C, c0 + 128);
      float am = 0;
      for (std::size_t r = r0; r < r1; ++r)
        for (std::size_t c = c0; c < c1; ++c) am = std::max(am, std::fabs(float(a(r, c))));
      const float s = am > 0 ? am / 448.0f : 1.0f;
      for (std::size_t r = r0; r < r1; ++r)
        for (std::size_t c = c0; c < c1; ++c) {
          o.x(r, c) = double(float(e4m3(std::clamp(float(a(r, c)) / s, -448.0f, 448.0f)))) * s;
          o.scale(r, c) = s;
        }
    }
  return o;
}

// c = a · b in fp64 with, per element, Σ|a||b| (for rounding bounds).
struct product {
  mat c, abs;
};
product multiply(const mat& a, const mat& b) {
  product p{mat(a.R, b.C), mat(a.R, b.C)};
  for (std::size_t i = 0; i < a.R; ++i)
    for (std::size_t k = 0; k < a.C; ++k)
      for (std::size_t j = 0; j < b.C; ++j) {
        p.c(i, j) += a(i, k) * b(k, j);
        p.abs(i, j) += std::fabs(a(i, k) * b(k, j));
      }
  return p;
}

// The e4m3 error of a·b from quantising both operands: per term |Δa||b| + |a||Δb| + |Δa||Δb| with
// |Δ| <= 2^-4 |x| + 2^-10 scale (half a step: normals, then e4m3's subnormals).
mat quantisation_bound(const mat& a, const dequantised& qa, const mat& b, const dequantised& qb) {
  mat e(a.R, b.C);
  for (std::size_t i = 0; i < a.R; ++i)
    for (std::size_t k = 0; k < a.C; ++k) {
      const double da = std::ldexp(std::fabs(a(i, k)), -4) + std::ldexp(qa.scale(i, k), -10);
      for (std::size_t j = 0; j < b.C; ++j) {
        const double db = std::ldexp(std::fabs(b(k, j)), -4) + std::ldexp(qb.scale(k, j), -10);
        e(i, j) += da * std::fabs(b(k, j)) + std::fabs(a(i, k)) * db + da * db;
      }
    }
  return e;
}

mat random_mat(std::size_t R, std::size_t C, std::uint64_t seed, double scale) {
  nn::normal_rng g(seed);
  mat m(R, C);
  for (auto& x : m.v) x = double(float(g() * scale));
  for (std::size_t i = 0; i < m.v.size(); i += 97) m.v[i] *= 30.0;  // outlier channels stretch some blocks' scales
  return m;
}

// Checks `got` (row-major, ld) against the fp64 products: within the f32 accumulation bound of the
// product of the dequantised operands (γ over K plus one rounding per 128-deep block and the
// output's), and within the quantisation bound of the exact product.
// a takes 1x128 blocks along K, b 128x128 tiles.
void check_product(const float* got, std::size_t ld, const mat& a, const mat& b, const mat* base = nullptr) {
  const auto qa = quantise(a, 1), qb = quantise(b, 128);
  const auto p = multiply(qa.x, qb.x), exact = multiply(a, b);
  const auto qe = quantisation_bound(a, qa, b, qb);
  const double K = double(a.C), steps = std::ceil(K / 128.0);
  const double gamma = (K + 2 * steps + 2) * std::ldexp(1.0, -24);
  for (std::size_t i = 0; i < p.c.R; ++i)
    for (std::size_t j = 0; j < p.c.C; ++j) {
      const double off = base ? (*base)(i, j) : 0.0;
      const double g = double(got[i * ld + j]) - off;
      INFO("element (" << i << ", " << j << ") of " << p.c.R << "x" << p.c.C << "x" << a.C);
      REQUIRE(std::fabs(g - p.c(i, j)) <= gamma * (p.abs(i, j) + std::fabs(off)) * 1.01 + 1e-30);
      REQUIRE(std::fabs(g - exact.c(i, j)) <= qe(i, j) + gamma * (p.abs(i, j) + std::fabs(off)) * 1.01 + 1e-30);
    }
}

}  // namespace

TEST_CASE("an FP8 linear layer's forward and gradients are block-scaled e4m3 products", "[nn][fp8]") {
  host_device dev(2);
  const std::size_t M = 150, K = 300, N = 260;  // tokens, in, out: partial 128-blocks on every side
  for (bool conv1d : {false, true}) {
    INFO((conv1d ? "GPT-2 Conv1D layout, a column slice" : "Hugging Face layout"));
    nn::parameters<host_device> ps(dev);
    const std::size_t total = N + 40, col0 = 40;  // Conv1D: columns [40, 300) of a (K, 300) matrix
    auto& w = conv1d ? ps.add("w", {K, total}) : ps.add("w", {N, K});
    auto& b = ps.add("b", {conv1d ? total : N});
    const mat W = random_mat(N, K, 1, 0.05);  // (out, in)
    for (std::size_t o = 0; o < N; ++o)
      for (std::size_t i = 0; i < K; ++i) (conv1d ? w.value.data()[i * total + col0 + o] : w.value.data()[o * K + i]) = float(W(o, i));
    for (std::size_t j = 0; j < b.numel; ++j) b.value.data()[j] = float(0.01 * double(j % 7));
    nn::linear<host_device, float> lin(&w, &b, K, N, conv1d, conv1d ? col0 : 0);
    lin.set_fp8(true);
    REQUIRE(lin.fp8());

    const mat X = random_mat(M, K, 2, 1.0), DY = random_mat(M, N, 3, 0.1);
    std::vector<float> x(X.v.begin(), X.v.end()), y(M * N), dy(DY.v.begin(), DY.v.end()), dx(M * K);
    lin.forward(dev, nn::cview<float>(x.data(), M, K, K), nn::mview<float>(y.data(), M, N, N), true);
    mat bias(M, N);
    for (std::size_t i = 0; i < M; ++i)
      for (std::size_t j = 0; j < N; ++j) bias(i, j) = double(b.value.data()[(conv1d ? col0 : 0) + j]);
    check_product(y.data(), N, X, W.t(), &bias);

    lin.backward(dev, nn::cview<float>(dy.data(), M, N, N), nn::mview<float>(dx.data(), M, K, K), false);
    check_product(dx.data(), K, DY, W);
    // dW = dyᵀ x (N, K), or its transpose xᵀ dy into the Conv1D columns
    std::vector<float> dw(N * K);
    for (std::size_t o = 0; o < N; ++o)
      for (std::size_t i = 0; i < K; ++i) dw[o * K + i] = conv1d ? w.grad.data()[i * total + col0 + o] : w.grad.data()[o * K + i];
    if (!conv1d) {
      check_product(dw.data(), K, DY.t(), X);
    } else {
      std::vector<float> dwt(K * N);
      for (std::size_t o = 0; o < N; ++o)
        for (std::size_t i = 0; i < K; ++i) dwt[i * N + o] = dw[o * K + i];
      check_product(dwt.data(), N, X.t(), DY);
    }
    // the bias gradient is the column sums of dy (not quantised)
    for (std::size_t j = 0; j < N; ++j) {
      double s = 0, sa = 0;
      for (std::size_t i = 0; i < M; ++i) s += DY(i, j), sa += std::fabs(DY(i, j));
      REQUIRE(std::fabs(double(b.grad.data()[(conv1d ? col0 : 0) + j]) - s) <= 1e-6 * sa + 1e-30);
    }
    // amax of each operand as the layer saw it
    double ax = 0, aw = 0, ady = 0;
    for (double v : X.v) ax = std::max(ax, std::fabs(v));
    for (double v : W.v) aw = std::max(aw, std::fabs(v));
    for (double v : DY.v) ady = std::max(ady, std::fabs(v));
    CHECK(lin.amax().x == float(ax));
    CHECK(lin.amax().w == float(aw));
    CHECK(lin.amax().dy == float(ady));
    CHECK(lin.amax().x_max == float(ax));
  }
}

namespace {
// A bank of FP8 experts (grouped, block-scaled launches) against each expert's FP8 layers run one
// by one on its rows: the same bits for the outputs, the input gradient and every weight gradient.
template <class T>
void check_fp8_expert_bank() {
  host_device dev(2);
  const std::size_t d = 160, I = 300, E = 4;
  const std::vector<std::size_t> off{0, 70, 70, 201, 330};  // expert 1 gets no rows
  const std::size_t rows = off.back();
  nn::parameters<host_device> pg(dev), pl(dev);  // grouped, layer by layer
  std::vector<std::array<nn::parameter<host_device>*, 3>> eg, el;
  std::uint64_t seed = 10;
  for (std::size_t j = 0; j < E; ++j) {
    std::array<nn::parameter<host_device>*, 3> a{}, b{};
    const std::size_t shapes[3][2] = {{I, d}, {I, d}, {d, I}};
    for (std::size_t w = 0; w < 3; ++w) {
      const std::string name = "e" + std::to_string(j) + "w" + std::to_string(w);
      a[w] = &pg.add(name, {shapes[w][0], shapes[w][1]}, std::is_same_v<T, bf16>);
      b[w] = &pl.add(name, {shapes[w][0], shapes[w][1]}, std::is_same_v<T, bf16>);
      const mat W = random_mat(shapes[w][0], shapes[w][1], ++seed, 0.05);
      for (std::size_t i = 0; i < W.v.size(); ++i) a[w]->value.data()[i] = b[w]->value.data()[i] = float(W.v[i]);
    }
    eg.push_back(a);
    el.push_back(b);
  }
  nn::expert_bank<host_device, T> bank(eg, d, I);
  bank.set_fp8(true);
  REQUIRE(bank.fp8());
  const mat X = random_mat(rows, d, 2, 1.0), DY = random_mat(rows, d, 3, 0.1);
  std::vector<T> x(rows * d), dy(rows * d);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = T(float(X.v[i])), dy[i] = T(float(DY.v[i]));
  std::vector<float> out(rows * d), dx(rows * d);
  bank.forward(dev, x.data(), off, out.data(), true);
  bank.backward(dev, dy.data(), dx.data());

  std::vector<float> out1(rows * d), dx1(rows * d);
  for (std::size_t j = 0; j < E; ++j) {
    const std::size_t o = off[j], c = off[j + 1] - o;
    if (c == 0) continue;
    nn::linear<host_device, T> w1(el[j][0], nullptr, d, I), w3(el[j][1], nullptr, d, I), w2(el[j][2], nullptr, I, d);
    for (auto* l : {&w1, &w3, &w2}) l->set_fp8(true);
    std::vector<T> g(c * I), u(c * I), h(c * I), dh(c * I), dg(c * I), du(c * I);
    const nn::cview<T> xj(x.data() + o * d, c, d, d), dyj(dy.data() + o * d, c, d, d);
    w1.forward(dev, xj, nn::mview<T>(g.data(), c, I, I), true);
    w3.forward(dev, xj, nn::mview<T>(u.data(), c, I, I), true);
    swiglu_forward(dev, std::span<const T>(g), std::span<const T>(u), std::span<T>(h));
    w2.forward(dev, nn::cview<T>(h.data(), c, I, I), nn::mview<float>(out1.data() + o * d, c, d, d), true);
    w2.backward(dev, dyj, nn::mview<T>(dh.data(), c, I, I), false);
    swiglu_backward(dev, std::span<const T>(dh), std::span<const T>(g), std::span<const T>(u), std::span<T>(dg), std::span<T>(du));
    w1.backward(dev, nn::cview<T>(dg.data(), c, I, I), nn::mview<float>(dx1.data() + o * d, c, d, d), false);
    w3.backward(dev, nn::cview<T>(du.data(), c, I, I), nn::mview<float>(dx1.data() + o * d, c, d, d), true);
  }
  CHECK(std::memcmp(out.data(), out1.data(), out.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(dx.data(), dx1.data(), dx.size() * sizeof(float)) == 0);
  auto it = pl.begin();
  for (auto& p : pg) {
    INFO("gradient of " << p.name);
    CHECK(std::memcmp(p.grad.data(), it->grad.data(), p.numel * sizeof(float)) == 0);
    ++it;
  }
  // amax tracked per expert projection, as a layer's
  float xm = 0;
  bank.for_each_linear([&](const nn::linear<host_device, T>& l) { xm = std::max(xm, l.amax().x_max); });
  CHECK(xm > 0.0f);
}
}  // namespace

TEST_CASE("FP8 experts: the grouped block-scaled launches give each expert's FP8 layers' bits", "[nn][fp8][moe]") {
  check_fp8_expert_bank<float>();
  check_fp8_expert_bank<bf16>();
}

TEST_CASE("an FP8 linear layer refuses grouped products and non-finite input", "[nn][fp8][errors]") {
  host_device dev(1);
  nn::parameters<host_device> ps(dev);
  auto& w = ps.add("w", {8, 16});
  nn::linear<host_device, float> lin(&w, nullptr, 16, 8);
  lin.set_fp8(true);
  std::vector<float> x(4 * 16, 1.0f), y(4 * 8);
  using tessel_test::is_error;
  CHECK_THROWS_MATCHES(lin.forward_problem(nn::cview<float>(x.data(), 4, 16, 16), nn::mview<float>(y.data(), 4, 8, 8), true), nn::nn_error,
                       is_error(errc::unsupported, "nn", "FP8 mode"));
  x[5] = std::numeric_limits<float>::infinity();
  CHECK_THROWS_MATCHES(lin.forward(dev, nn::cview<float>(x.data(), 4, 16, 16), nn::mview<float>(y.data(), 4, 8, 8), false), layer_error,
                       is_error(errc::invalid_argument, "layers", "Inf or NaN"));
}

TEST_CASE("a decoder with FP8 projections tracks the bf16 one and trains", "[nn][fp8][decoder]") {
  const char* dims = R"("vocab_size": 37, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": false)";
  // Llama, and Mixtral (4 experts, top 2) whose experts' grouped products run in FP8 too
  const bool mixtral = GENERATE(false, true);
  INFO((mixtral ? "mixtral" : "llama"));
  const auto cfg = io::parse_model_config(mixtral ? std::string(R"({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], )") + dims +
                                                        R"(, "num_local_experts": 4, "num_experts_per_tok": 2})"
                                                  : std::string(R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], )") + dims + "}");
  host_device dev(2);
  nn::decoder_lm<host_device, bf16> ref(dev, cfg), m(dev, cfg);
  ref.init(7, 0.05);
  m.init(7, 0.05);
  m.set_fp8_linears(true);
  const std::size_t B = 2, S = 16;
  std::vector<std::int64_t> ids(B * S), targets(B * S);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = std::int64_t((i * 7 + 3) % 37);
  for (std::size_t i = 0; i < ids.size(); ++i) targets[i] = (i % S + 1 < S) ? ids[i + 1] : -100;
  nn::adamw_config h;
  h.hyper.lr = 1e-2f;
  double first = 0, last = 0;
  for (std::uint64_t step = 1; step <= 20; ++step) {
    ref.params().zero_grad();
    m.params().zero_grad();
    const double lr = ref.forward_backward(ids, targets, B, S), lm = m.forward_backward(ids, targets, B, S);
    if (step == 1) {
      first = lm;
      // e4m3 keeps 3 mantissa bits: the first loss (same weights) moves by a few percent at most
      CHECK(std::fabs(lm - lr) <= 0.03 * lr);
      double dot = 0, na = 0, nb = 0;
      auto pr = ref.params().begin();
      for (auto& p : m.params()) {
        for (std::size_t i = 0; i < p.numel; ++i) {
          dot += double(p.grad.data()[i]) * pr->grad.data()[i];
          na += double(p.grad.data()[i]) * p.grad.data()[i];
          nb += double(pr->grad.data()[i]) * pr->grad.data()[i];
        }
        ++pr;
      }
      CHECK(dot / std::sqrt(na * nb) > 0.95);  // the gradients point the same way
    }
    last = lm;
    CHECK_FALSE(ref.adamw(h, step).skipped);
    CHECK_FALSE(m.adamw(h, step).skipped);
  }
  CHECK(last < 0.5 * first);
  const auto am = m.fp8_amax_max();
  CHECK(am.x_max > 0.0f);
  CHECK(am.w_max > 0.0f);
  CHECK(am.dy_max > 0.0f);
  CHECK((am.x > 0.0f && am.x <= am.x_max && am.w <= am.w_max && am.dy <= am.dy_max));  // the last step within the history
}

}  // namespace tessel_test_nn_fp8_linear
