// Vocabulary-parallel embedding and LM head + cross-entropy (tessel/dist/vocab_parallel.hpp) on
// tp = 2 and 3 thread ranks with V = 11 (divisible by neither), against one device: ops'
// embedding_forward/backward and nn::linear + tessel::cross_entropy, the shards loaded from the one
// device's checkpoint by name.
//
// Embedding: a sum of one value and −0.0s is exact, so forward and the owned rows of the gradient
// must match bitwise (a −0.0 table entry included).
//
// LM head. u = 2^-24, γ_K = K·u/(1 − K·u), r(a) = 2·u·|a| (one rounding on each side).
//   logits   the same K = hidden dot products on both sides: checked bitwise, so every e^{z−M}
//            term is the same bits (same exp_fast, same M) on both sides.
//   S        the same V positive terms summed in two groupings: |S' − S| <= 2γ_V·S, δ = 2γ_V/(1 − γ_V)
//            relative.
//   L        = log S (logf within 1 ulp <= 2u|L|): ΔL <= δ/(1 − δ) + 2·2u|L|
//   lse      = M + L: Δlse <= ΔL + r(lse);   row = lse − z_y: Δrow <= Δlse + r(row)
//   loss     mean of the rows in double, same order: Δloss <= Σ Δrow / count (+ double rounding).
//   f        = exp_fast(M − lse) (within 2 ulp of e^a, so 2.5 ulp <= 5u·e^a of the exact value):
//            Δa <= Δlse + r(M − lse), |f' − f|/f <= expm1(Δa) + 10u =: ρ
//   g        = scale·(e·f) (− scale on the label): Δp <= p·(ρ + 2u), Δg <= scale·Δp (+ r(p − 1) on
//            the label) + r(g)
//   dx       = Σ_v g_v W_v, K = V split over ranks: Δdx <= Σ Δg·|W| + 2γ_V·Σ|g|·|W|
//   dW       = Σ_n g_n x_n, K = N: ΔdW <= Σ Δg·|x| + 2γ_N·Σ|g|·|x|
// bf16 (x, W and the stored dlogits in bf16, f32 accumulation): x and W round the same on both
// sides, so the only change is the dlogits' store: r(g) with u = 2^-9 (a value a few f32 ulps away
// may round to the neighbouring bf16).
// Each bound gets a factor 1.01 for the second-order terms dropped above. The worst |diff|/bound
// seen is reported with WARN.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include <tessel/collectives.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/dist.hpp>
#include <tessel/nn.hpp>
#include <tessel/ops/embedding.hpp>
#include <tessel/ops/loss.hpp>

#include "dist/thread_check.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_dist_vocab_parallel {

using namespace tessel;
using nn::cview;
using nn::mview;

namespace {

constexpr std::size_t V = 11, H = 16, N = 9;
constexpr double u = 0x1.0p-24;

double gamma_k(std::size_t k) { return double(k) * u / (1.0 - double(k) * u); }

std::vector<float> normals(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  nn::normal_rng r(seed);
  std::vector<float> v(n);
  for (float& x : v) x = float(r() * scale);
  return v;
}

dist::parallel_layout tp_layout(int tp) { return {.dp = 1, .tp = tp, .pp = 1, .ep = 1, .zero_stage = 0}; }

std::filesystem::path tmp_file(const std::string& tag) {
  return std::filesystem::temp_directory_path() / ("vocab_" + tag + "_" + std::to_string(::getpid()) + ".safetensors");
}

bool same_bits(const float* a, const float* b, std::size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

// The text of the dist_error `f` throws with `code` ("" if it throws nothing or something else).
std::string dist_error_text(const std::function<void()>& f, errc code) {
  try {
    f();
  } catch (const dist::dist_error& e) { return e.code() == code ? std::string(e.what()) : std::string(); }
  return {};
}
bool has(const std::string& s, const std::string& frag) { return !s.empty() && s.find(frag) != std::string::npos; }

struct worst_ratio {
  std::mutex mu;
  double worst = 0;
  // counts the elements above their bound; records the worst |diff| / bound
  std::size_t check(const float* got, const float* want, const double* bound, std::size_t n) {
    std::size_t bad = 0;
    std::lock_guard lk(mu);
    for (std::size_t i = 0; i < n; ++i) {
      const double d = std::fabs(double(got[i]) - double(want[i]));
      worst = std::max(worst, d / (bound[i] + 1e-300));
      bad += !(d <= bound[i]);
    }
    return bad;
  }
};

}  // namespace

TEST_CASE("vocab_rows: a contiguous cover of the V rows, the first V % tp ranks one row longer, V < tp a config error", "[dist][vocab]") {
  for (std::size_t tp = 1; tp <= 6; ++tp)
    for (std::size_t v = tp; v <= 40; ++v) {
      std::size_t next = 0;
      for (std::size_t r = 0; r < tp; ++r) {
        const dist::vocab_range g = dist::vocab_rows(v, tp, r);
        CHECK(g.offset == next);
        CHECK(g.length == v / tp + (r < v % tp ? 1 : 0));
        CHECK(g.length >= 1);
        CHECK(g.contains(std::int64_t(g.offset)));
        CHECK(!g.contains(std::int64_t(g.offset) - 1));
        CHECK(!g.contains(std::int64_t(g.offset + g.length)));
        next += g.length;
      }
      CHECK(next == v);
    }
  CHECK(!dist::vocab_rows(11, 3, 0).contains(-1));
  const std::string e = dist_error_text([] { (void)dist::vocab_rows(2, 3, 0); }, errc::config);
  CHECK(has(e, "V = 2"));
  CHECK(has(e, "tp = 3"));
}

TEST_CASE("vocab_parallel_embedding on tp = 2, 3 with V = 11: forward and owned-row gradient bitwise one device's, -0.0 kept", "[dist][vocab]") {
  host_device dev(1);
  nn::parameters<host_device> reg(dev);
  auto& w = reg.add("model.embed_tokens.weight", {V, H});
  {
    const auto v = normals(V * H, 5);
    std::copy(v.begin(), v.end(), w.value.data());
  }
  // −0.0 entries in rows owned by rank 0 and by the last rank (either tp), read by tokens below
  w.value.data()[0 * H + 3] = -0.0f;
  w.value.data()[10 * H + 5] = -0.0f;
  w.value.data()[7 * H + 0] = -0.0f;
  const auto path = tmp_file("embed");
  reg.save(path);
  const std::vector<std::int64_t> ids{7, 0, 10, 3, 7, 5, 10, 6, 4};  // repeats: 7 and 10
  std::vector<float> ref(N * H), dout = normals(N * H, 6);
  embedding_forward(dev, std::span<const std::int64_t>(ids), cview<float>(w.value.data(), V, H), mview<float>(ref.data(), N, H));
  embedding_backward(dev, std::span<const std::int64_t>(ids), cview<float>(dout.data(), N, H), mview<float>(w.grad.data(), V, H));
  REQUIRE(std::signbit(ref[1 * H + 3]));  // the reference itself keeps −0.0 (token 1 reads row 0)

  for (int TP : {2, 3}) {
    INFO("tp = " << TP);
    threads_world::run(TP, [&](threads_transport t) {
      dist::process_groups g(t, tp_layout(TP));
      host_device d(1);
      nn::parameters<host_device> pr(d);
      dist::vocab_parallel_embedding<host_device> emb(pr, "model.embed_tokens.weight", V, H, g.tp());
      pr.load(path);
      const dist::vocab_range rows = emb.rows();
      TS_CHECK(pr.at("model.embed_tokens.weight").shard.offset == rows.offset);
      TS_CHECK(pr.at("model.embed_tokens.weight").shard.length == rows.length);
      std::vector<float> out(N * H, 1.0f);
      emb.forward(d, std::span<const std::int64_t>(ids), mview<float>(out.data(), N, H));
      TS_CHECK(same_bits(out.data(), ref.data(), N * H));
      TS_CHECK(std::signbit(out[1 * H + 3]));  // row 0, rank 0's
      TS_CHECK(std::signbit(out[2 * H + 5]));  // row 10, the last rank's
      TS_CHECK(std::signbit(out[0 * H + 0]));  // row 7
      emb.backward(d, std::span<const std::int64_t>(ids), cview<float>(dout.data(), N, H));
      TS_CHECK(same_bits(emb.weight()->grad.data(), w.grad.data() + rows.offset * H, rows.length * H));

      // out-of-range ids: typed errors naming the id, raised before any communication
      const std::vector<std::int64_t> bad_hi{1, 11}, bad_lo{-1, 2};
      std::vector<float> o2(2 * H);
      const std::string hi =
          dist_error_text([&] { emb.forward(d, std::span<const std::int64_t>(bad_hi), mview<float>(o2.data(), 2, H)); }, errc::out_of_range);
      const std::string lo =
          dist_error_text([&] { emb.backward(d, std::span<const std::int64_t>(bad_lo), cview<float>(o2.data(), 2, H)); }, errc::out_of_range);
      TS_CHECK(has(hi, "id 11 of token 1"));
      TS_CHECK(has(lo, "id -1 of token 0"));
    });
  }
  std::filesystem::remove(path);
}

namespace {

// The one-device reference of the LM head + loss in compute type T (the logits are f32 on both
// sides; bf16 rounds x, W and the stored dlogits) and the bounds of the header comment.
template <class T>
struct lm_reference {
  static constexpr double u_store = std::is_same_v<T, bf16> ? 0x1.0p-9 : u;  // the dlogits' rounding
  std::vector<float> W, xf, logits, dx, dW, g;                               // W, x as the GEMMs read them; g: the dlogits
  std::vector<T> x, dlogits;
  std::vector<std::int64_t> labels;
  cross_entropy_result r;
  double loss_bound = 0;
  std::vector<double> dx_bound, dW_bound;

  lm_reference(nn::parameters<host_device>& reg, host_device& dev, std::vector<std::int64_t> labs, std::uint64_t seed) : labels(std::move(labs)) {
    auto& w = reg.at("lm_head.weight");
    const T* wt = nn::compute_data<T>(w);
    for (std::size_t i = 0; i < V * H; ++i) W.push_back(float(wt[i]));
    for (float v : normals(N * H, seed)) x.push_back(T(v));
    for (T v : x) xf.push_back(float(v));
    nn::linear<host_device, T> head(&w, nullptr, H, V);
    logits.resize(N * V);
    dlogits.resize(N * V);
    dx.resize(N * H);
    head.forward(dev, cview<T>(x.data(), N, H), mview<float>(logits.data(), N, V), true);
    cross_entropy_options co;
    co.ignore_index = -100;
    r = cross_entropy(dev, cview<float>(logits.data(), N, V), std::span<const std::int64_t>(labels), mview<T>(dlogits.data(), N, V), {}, co);
    head.backward(dev, cview<T>(dlogits.data(), N, V), mview<float>(dx.data(), N, H), false);
    dW.assign(w.grad.data(), w.grad.data() + V * H);
    for (T v : dlogits) g.push_back(float(v));
    bounds();
  }

  void bounds() {
    const double d = 2.0 * gamma_k(V) / (1.0 - gamma_k(V));
    const double scale = r.counted ? 1.0 / double(r.counted) : 0.0;
    std::vector<double> dg(N * V, 0.0);  // bound on |Δg| per logit
    double sum_drow = 0, sum_row = 0;
    for (std::size_t i = 0; i < N; ++i) {
      if (labels[i] == -100) continue;
      double M = -INFINITY, S = 0;
      for (std::size_t j = 0; j < V; ++j) M = std::max(M, double(logits[i * V + j]));
      for (std::size_t j = 0; j < V; ++j) S += std::exp(double(logits[i * V + j]) - M);
      const double L = std::log(S), lse = M + L, row = lse - double(logits[i * V + std::size_t(labels[i])]);
      const double dL = d / (1.0 - d) + 4.0 * u * std::fabs(L);
      const double dlse = dL + 2.0 * u * std::fabs(lse);
      sum_drow += 1.01 * (dlse + 2.0 * u * std::fabs(row));
      sum_row += std::fabs(row);
      const double da = dlse + 2.0 * u * std::fabs(M - lse);
      const double rho = std::expm1(da) + 10.0 * u;
      for (std::size_t j = 0; j < V; ++j) {
        const double p = std::exp(double(logits[i * V + j]) - lse);
        double b = scale * p * (rho + 2.0 * u);
        if (std::int64_t(j) == labels[i]) b += scale * 2.0 * u * std::fabs(p - 1.0);
        dg[i * V + j] = 1.01 * (b + 2.0 * u_store * std::fabs(double(g[i * V + j])));
      }
    }
    loss_bound = r.counted ? sum_drow / double(r.counted) + 4.0 * double(N) * 0x1.0p-53 * sum_row : 0.0;
    dx_bound.assign(N * H, 0.0);
    for (std::size_t i = 0; i < N; ++i)
      for (std::size_t k = 0; k < H; ++k) {
        double a = 0, s = 0;
        for (std::size_t j = 0; j < V; ++j) {
          a += dg[i * V + j] * std::fabs(double(W[j * H + k]));
          s += std::fabs(double(g[i * V + j]) * double(W[j * H + k]));
        }
        dx_bound[i * H + k] = 1.01 * (a + 2.0 * gamma_k(V) * s);
      }
    dW_bound.assign(V * H, 0.0);
    for (std::size_t j = 0; j < V; ++j)
      for (std::size_t k = 0; k < H; ++k) {
        double a = 0, s = 0;
        for (std::size_t i = 0; i < N; ++i) {
          a += dg[i * V + j] * std::fabs(double(xf[i * H + k]));
          s += std::fabs(double(g[i * V + j]) * double(xf[i * H + k]));
        }
        dW_bound[j * H + k] = 1.01 * (a + 2.0 * gamma_k(N) * s);
      }
  }
};

}  // namespace

namespace {

template <class T>
void lm_head_against_one_device(const char* tname) {
  host_device dev(1);
  nn::parameters<host_device> reg(dev);
  auto& w = reg.add("lm_head.weight", {V, H}, std::is_same_v<T, bf16>);
  {
    const auto v = normals(V * H, 7, 2.0);  // logits of a few units: a softmax far from uniform
    std::copy(v.begin(), v.end(), w.value.data());
    reg.refresh_bf16();
  }
  const auto path = tmp_file(std::string("head_") + tname);
  reg.save(path);
  // ignored rows 2 and 5; labels on every rank of either tp (0, 5, 6, 10)
  const lm_reference<T> ref(reg, dev, {3, 10, -100, 0, 6, -100, 5, 10, 1}, 8);
  REQUIRE(ref.r.counted == 7);
  worst_ratio loss_w, dx_w, dw_w;

  for (int TP : {2, 3}) {
    INFO("tp = " << TP);
    std::vector<double> losses(std::size_t(TP), -1.0);
    threads_world::run(TP, [&](threads_transport t) {
      dist::process_groups g(t, tp_layout(TP));
      host_device d(1);
      nn::parameters<host_device> pr(d);
      dist::vocab_parallel_lm_head<host_device, T> head(pr, "lm_head.weight", V, H, g.tp());
      pr.load(path);
      const dist::vocab_range rows = head.rows();
      const std::size_t rk = std::size_t(g.tp().rank());
      TS_CHECK(rows.offset == dist::vocab_rows(V, std::size_t(TP), rk).offset);
      // the local logits are the one device's columns, bit for bit
      std::vector<float> z(N * rows.length);
      head.local().forward(d, cview<T>(ref.x.data(), N, H), mview<float>(z.data(), N, rows.length), false);
      std::size_t logit_diff = 0;
      for (std::size_t i = 0; i < N; ++i)
        for (std::size_t j = 0; j < rows.length; ++j)
          logit_diff += std::bit_cast<std::uint32_t>(z[i * rows.length + j]) != std::bit_cast<std::uint32_t>(ref.logits[i * V + rows.offset + j]);
      TS_CHECK(logit_diff == 0);

      std::vector<float> dx(N * H, 7.0f);
      const cross_entropy_result r =
          head.loss(d, cview<T>(ref.x.data(), N, H), std::span<const std::int64_t>(ref.labels), mview<float>(dx.data(), N, H));
      losses[rk] = r.loss;
      TS_CHECK(r.counted == 7);
      const double lb = ref.loss_bound;
      {
        std::lock_guard lk(loss_w.mu);
        loss_w.worst = std::max(loss_w.worst, std::fabs(r.loss - ref.r.loss) / lb);
      }
      TS_CHECK(std::fabs(r.loss - ref.r.loss) <= lb);
      TS_CHECK(dx_w.check(dx.data(), ref.dx.data(), ref.dx_bound.data(), N * H) == 0);
      TS_CHECK(dw_w.check(head.weight()->grad.data(), ref.dW.data() + rows.offset * H, ref.dW_bound.data() + rows.offset * H, rows.length * H) == 0);
      // ignored rows get an exactly zero gradient
      std::size_t nonzero = 0;
      for (std::size_t i : {2u, 5u})
        for (std::size_t k = 0; k < H; ++k) nonzero += dx[i * H + k] != 0.0f;
      TS_CHECK(nonzero == 0);

      // loss only (empty dx): the same loss, no gradient touched
      std::vector<float> before(head.weight()->grad.data(), head.weight()->grad.data() + rows.length * H);
      const cross_entropy_result e = head.loss(d, cview<T>(ref.x.data(), N, H), std::span<const std::int64_t>(ref.labels), mview<float>{});
      TS_CHECK(e.loss == r.loss);
      TS_CHECK(same_bits(before.data(), head.weight()->grad.data(), before.size()));

      // every row ignored: loss 0 over 0 rows, dx 0
      const std::vector<std::int64_t> none(N, -7);
      const cross_entropy_result z0 =
          head.loss(d, cview<T>(ref.x.data(), N, H), std::span<const std::int64_t>(none), mview<float>(dx.data(), N, H), -7);
      TS_CHECK(z0.counted == 0);
      TS_CHECK(z0.loss == 0.0);
      std::size_t nz = 0;
      for (float v : dx) nz += v != 0.0f;
      TS_CHECK(nz == 0);

      // out-of-range labels: typed errors naming the label and row (before any communication)
      const std::vector<std::int64_t> hi{0, 1, 11, 2, 3, 4, 5, 6, 7}, lo{0, 1, 2, -5, 3, 4, 5, 6, 7};
      const std::string eh =
          dist_error_text([&] { head.loss(d, cview<T>(ref.x.data(), N, H), std::span<const std::int64_t>(hi), mview<float>{}); }, errc::out_of_range);
      const std::string el =
          dist_error_text([&] { head.loss(d, cview<T>(ref.x.data(), N, H), std::span<const std::int64_t>(lo), mview<float>{}); }, errc::out_of_range);
      TS_CHECK(has(eh, "label 11 of row 2"));
      TS_CHECK(has(el, "label -5 of row 3"));
    });
    for (double l : losses) CHECK(std::bit_cast<std::uint64_t>(l) == std::bit_cast<std::uint64_t>(losses[0]));  // the same bits on every rank
  }
  std::filesystem::remove(path);
  WARN("vocab-parallel LM head (" << tname << "): worst |tp - one device| / bound: loss " << loss_w.worst << ", dx " << dx_w.worst << ", dW "
                                  << dw_w.worst);
}

}  // namespace

TEST_CASE("vocab_parallel_lm_head on tp = 2, 3 with V = 11: loss, dx and dW within the split-sum bound of one device's (f32)", "[dist][vocab]") {
  lm_head_against_one_device<float>("f32");
}

TEST_CASE("vocab_parallel_lm_head on tp = 2, 3 with V = 11: loss, dx and dW within the split-sum bound of one device's (bf16)", "[dist][vocab]") {
  lm_head_against_one_device<bf16>("bf16");
}

TEST_CASE("vocab_parallel_lm_head tied to the embedding shares its shard and gives the untied head's loss", "[dist][vocab]") {
  host_device dev(1);
  nn::parameters<host_device> reg(dev);
  const auto table = normals(V * H, 9);
  auto& e = reg.add("model.embed_tokens.weight", {V, H});
  auto& h = reg.add("lm_head.weight", {V, H});
  std::copy(table.begin(), table.end(), e.value.data());
  std::copy(table.begin(), table.end(), h.value.data());
  const auto path = tmp_file("tied");
  reg.save(path);
  const auto x = normals(N * H, 10);
  const std::vector<std::int64_t> labels{1, 2, 3, 4, 5, 6, 7, 8, 9};
  threads_world::run(3, [&](threads_transport t) {
    dist::process_groups g(t, tp_layout(3));
    host_device d(1);
    nn::parameters<host_device> pr(d);
    dist::vocab_parallel_embedding<host_device> emb(pr, "model.embed_tokens.weight", V, H, g.tp(), true);
    dist::vocab_parallel_lm_head<host_device, float> tied(emb);
    dist::vocab_parallel_lm_head<host_device, float> untied(pr, "lm_head.weight", V, H, g.tp());
    pr.load(path);
    TS_CHECK(tied.weight() == emb.weight());
    std::vector<float> dx1(N * H), dx2(N * H);
    const auto a = tied.loss(d, cview<float>(x.data(), N, H), std::span<const std::int64_t>(labels), mview<float>(dx1.data(), N, H));
    const auto b = untied.loss(d, cview<float>(x.data(), N, H), std::span<const std::int64_t>(labels), mview<float>(dx2.data(), N, H));
    TS_CHECK(a.loss == b.loss);
    TS_CHECK(same_bits(dx1.data(), dx2.data(), N * H));
    TS_CHECK(same_bits(emb.weight()->grad.data(), untied.weight()->grad.data(), emb.rows().length * H));
    // a bf16 head tied to an f32-only embedding is a config error
    nn::parameters<host_device> p2(d);
    dist::vocab_parallel_embedding<host_device> f32_only(p2, "model.embed_tokens.weight", V, H, g.tp());
    TS_CHECK(has(dist_error_text([&] { dist::vocab_parallel_lm_head<host_device, bf16> bad(f32_only); }, errc::config), "with_bf16"));
  });
  std::filesystem::remove(path);
}

TEST_CASE("vocabulary-parallel layers reject a tp that leaves a rank without rows (V = 2, tp = 3), naming the numbers", "[dist][vocab]") {
  threads_world::run(3, [&](threads_transport t) {
    dist::process_groups g(t, tp_layout(3));
    host_device d(1);
    nn::parameters<host_device> pr(d);
    const std::string a =
        dist_error_text([&] { dist::vocab_parallel_embedding<host_device> e(pr, "model.embed_tokens.weight", 2, H, g.tp()); }, errc::config);
    const std::string b =
        dist_error_text([&] { dist::vocab_parallel_lm_head<host_device, float> h(pr, "lm_head.weight", 2, H, g.tp()); }, errc::config);
    TS_CHECK(has(a, "V = 2 rows over tp = 3"));
    TS_CHECK(has(b, "V = 2 rows over tp = 3"));
    TS_CHECK(pr.size() == 0);
  });
}

}  // namespace tessel_test_dist_vocab_parallel
