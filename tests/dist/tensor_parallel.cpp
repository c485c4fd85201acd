// Tensor-parallel layers (tessel/dist/tensor_parallel.hpp) on tp = 2 thread ranks against the same
// layer on one device, the shards loaded from the single device's checkpoint by name (nn's
// registry slices them). What may differ is where a K-dimension sum is split: the single device
// sums K products in one GEMM, tp sums K/tp on each rank and adds the partials in rank order. Both
// are sums of the same products, each within γ_K·Σ|products| of the exact value, so
//   |tp − one device| <= 2·γ_K·(|A|·|B|) elementwise, γ_K = K·u / (1 − K·u), u = 2^-24 (f32),
// with K the summed length (+1 where a bias is added after the sum). Products of small integers
// are exact and their sums stay below 2^24, so integer inputs must match bitwise.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include <unistd.h>

#include <tessel/collectives.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/dist.hpp>
#include <tessel/nn.hpp>
#include <tessel/ops/activation.hpp>

#include "dist/thread_check.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_dist_tensor_parallel {

using namespace tessel;
using nn::cview;
using nn::mview;

namespace {

constexpr int TP = 2;

double gamma_k(std::size_t k) {
  const double u = std::ldexp(1.0, -24);
  return double(k) * u / (1.0 - double(k) * u);
}

// Values: small integers in [-2, 2] (exact arithmetic) or normal samples.
std::vector<float> values(std::size_t n, std::uint64_t seed, bool integers) {
  nn::normal_rng r(seed);
  std::vector<float> v(n);
  for (float& x : v) x = integers ? float(std::lround(std::fmod(r() * 3.0, 3.0))) : float(r());
  return v;
}

// |A|·|B|ᵀ for row-major A (m, k), B (n, k): the bound's scale.
std::vector<double> abs_mm_t(const std::vector<float>& a, const std::vector<float>& b, std::size_t m, std::size_t n, std::size_t k) {
  std::vector<double> c(m * n, 0.0);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j)
      for (std::size_t q = 0; q < k; ++q) c[i * n + j] += std::fabs(double(a[i * k + q]) * double(b[j * k + q]));
  return c;
}

std::vector<float> tr(const std::vector<float>& a, std::size_t rows, std::size_t cols) {
  std::vector<float> t(a.size());
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

// Columns [c0, c0 + nc) of a row-major (rows, cols) matrix.
template <class E>
std::vector<E> cols_of(const E* a, std::size_t rows, std::size_t cols, std::size_t c0, std::size_t nc) {
  std::vector<E> s(rows * nc);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < nc; ++c) s[r * nc + c] = a[r * cols + c0 + c];
  return s;
}

std::vector<double> cols_of_d(const std::vector<double>& a, std::size_t rows, std::size_t cols, std::size_t c0, std::size_t nc) {
  return cols_of(a.data(), rows, cols, c0, nc);
}

struct compare {
  std::mutex mu;
  double worst = 0;  // largest |diff| / bound seen
  void check(const char* what, const float* got, const float* want, std::size_t n, const std::vector<double>& scale, std::size_t k, bool integers) {
    std::lock_guard lk(tessel_test::catch_mutex());
    INFO(what);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (integers) {
        bad += got[i] != want[i];
        continue;
      }
      const double bound = 2.0 * gamma_k(k) * scale[i] + 1e-30;
      const double d = std::fabs(double(got[i]) - double(want[i]));
      worst = std::max(worst, d / bound);
      bad += d > bound;
    }
    CHECK(bad == 0);
  }
};

std::filesystem::path tmp_file(const std::string& tag) {
  return std::filesystem::temp_directory_path() / ("dist_tp_" + tag + "_" + std::to_string(::getpid()) + ".safetensors");
}

}  // namespace

TEST_CASE("column- and row-parallel linear on tp=2 equal one device (bitwise on integers)", "[dist][tensor_parallel]") {
  const std::size_t N = 7, in = 24, out = 16;
  for (bool integers : {true, false}) {
    INFO((integers ? "integers" : "normal floats"));
    host_device dev(1);
    // One device: a (out, in) column layer "c" and an (in, out) row layer "r" (the latter's input
    // is the former's output width, as in an MLP: here simply separate layers).
    nn::parameters<host_device> reg(dev);
    auto& wc = reg.add("c.weight", {out, in});
    auto& bc = reg.add("c.bias", {out});
    auto& wr = reg.add("r.weight", {in, out});
    auto& br = reg.add("r.bias", {in});
    {
      std::size_t s = 10;
      for (auto* p : {&wc, &bc, &wr, &br}) {
        const auto v = values(p->numel, ++s, integers);
        std::copy(v.begin(), v.end(), p->value.data());
      }
    }
    const auto path = tmp_file(integers ? "lin_int" : "lin_f");
    reg.save(path);
    nn::linear<host_device, float> lc(&wc, &bc, in, out), lr(&wr, &br, out, in);
    const auto x = values(N * in, 31, integers), dyc = values(N * out, 32, integers), xr = values(N * out, 33, integers),
               dyr = values(N * in, 34, integers);
    std::vector<float> yc(N * out), dxc(N * in), yr(N * in), dxr(N * out);
    lc.forward(dev, cview<float>(x.data(), N, in), mview<float>(yc.data(), N, out), true);
    lc.backward(dev, cview<float>(dyc.data(), N, out), mview<float>(dxc.data(), N, in), false);
    lr.forward(dev, cview<float>(xr.data(), N, out), mview<float>(yr.data(), N, in), true);
    lr.backward(dev, cview<float>(dyr.data(), N, in), mview<float>(dxr.data(), N, out), false);
    // bound scales
    const std::vector<float> Wc(wc.value.data(), wc.value.data() + wc.numel), Wr(wr.value.data(), wr.value.data() + wr.numel);
    const auto s_yc = abs_mm_t(x, Wc, N, out, in);
    const auto s_dxc = abs_mm_t(dyc, tr(Wc, out, in), N, in, out);
    const auto s_dwc = abs_mm_t(tr(dyc, N, out), tr(x, N, in), out, in, N);
    auto s_yr = abs_mm_t(xr, Wr, N, in, out);
    for (std::size_t i = 0; i < s_yr.size(); ++i) s_yr[i] += std::fabs(br.value.data()[i % in]);
    const auto s_dxr = abs_mm_t(dyr, tr(Wr, in, out), N, out, in);
    const auto s_dwr = abs_mm_t(tr(dyr, N, in), tr(xr, N, out), in, out, N);
    std::vector<double> s_db(std::max(in, out));
    compare cmp;

    threads_world::run(TP, [&](threads_transport t) {
      dist::process_groups g(t, {.dp = 1, .tp = TP});
      host_device d(1);
      nn::parameters<host_device> pr(d);
      dist::column_parallel_linear<host_device, float> c(pr, "c", in, out, true, g.tp());
      dist::row_parallel_linear<host_device, float> r(pr, "r", out, in, true, g.tp());
      pr.load(path);
      const std::size_t oc = out / TP, ic = out / TP, k = std::size_t(g.tp().rank());
      // shard info as DESIGN.md's registry describes it
      TS_CHECK(pr.at("c.weight").shard.dim == 0);
      TS_CHECK(pr.at("c.weight").shard.offset == k * oc);
      TS_CHECK(pr.at("r.weight").shard.dim == 1);
      TS_CHECK(pr.at("r.weight").shard.length == ic);
      TS_CHECK(!pr.at("r.bias").shard.sharded());
      // column-parallel: y_k = columns of y; dx all-reduced
      std::vector<float> y(N * oc), dx(N * in, 1.0f);
      const auto dy = cols_of(dyc.data(), N, out, k * oc, oc);
      c.forward(d, cview<float>(x.data(), N, in), mview<float>(y.data(), N, oc), true);
      c.backward(d, cview<float>(dy.data(), N, oc), mview<float>(dx.data(), N, in), false);
      cmp.check("column y", y.data(), cols_of(yc.data(), N, out, k * oc, oc).data(), y.size(), cols_of_d(s_yc, N, out, k * oc, oc), in, integers);
      cmp.check("column dx", dx.data(), dxc.data(), dx.size(), s_dxc, out, integers);
      cmp.check("column dW", pr.at("c.weight").grad.data(), wc.grad.data() + k * oc * in, oc * in,
                std::vector<double>(s_dwc.begin() + std::ptrdiff_t(k * oc * in), s_dwc.begin() + std::ptrdiff_t((k + 1) * oc * in)), N, integers);
      // db: a sum over N rows on both sides (scale: Σ|dy|)
      std::vector<double> sdb(oc, 0.0);
      for (std::size_t i = 0; i < N; ++i)
        for (std::size_t j = 0; j < oc; ++j) sdb[j] += std::fabs(dy[i * oc + j]);
      cmp.check("column db", pr.at("c.bias").grad.data(), bc.grad.data() + k * oc, oc, sdb, N, integers);
      // the same call again, accumulating: dx doubles
      std::vector<float> dx2 = dx;
      c.forward(d, cview<float>(x.data(), N, in), mview<float>(y.data(), N, oc), true);
      c.backward(d, cview<float>(dy.data(), N, oc), mview<float>(dx2.data(), N, in), true);
      std::size_t not_doubled = 0;
      for (std::size_t i = 0; i < dx.size(); ++i) not_doubled += dx2[i] != 2.0f * dx[i];
      TS_CHECK(not_doubled == 0);

      // row-parallel: x_k = columns of x; y all-reduced + bias; dx_k local
      std::vector<float> yk(N * in), dxk(N * ic);
      const auto xk = cols_of(xr.data(), N, out, k * ic, ic);
      r.forward(d, cview<float>(xk.data(), N, ic), mview<float>(yk.data(), N, in), true);
      r.backward(d, cview<float>(dyr.data(), N, in), mview<float>(dxk.data(), N, ic), false);
      cmp.check("row y", yk.data(), yr.data(), yk.size(), s_yr, out + 1, integers);
      cmp.check("row dx", dxk.data(), cols_of(dxr.data(), N, out, k * ic, ic).data(), dxk.size(), cols_of_d(s_dxr, N, out, k * ic, ic), in, integers);
      cmp.check("row dW", pr.at("r.weight").grad.data(), cols_of(wr.grad.data(), in, out, k * ic, ic).data(), in * ic,
                cols_of_d(s_dwr, in, out, k * ic, ic), N, integers);
      std::vector<double> sdbr(in, 0.0);
      for (std::size_t i = 0; i < N; ++i)
        for (std::size_t j = 0; j < in; ++j) sdbr[j] += std::fabs(dyr[i * in + j]);
      cmp.check("row db", pr.at("r.bias").grad.data(), br.grad.data(), in, sdbr, N, integers);
    });
    std::filesystem::remove(path);
    if (!integers) WARN("linear layers: worst |tp - one device| / bound = " << cmp.worst);
  }
}

// The MLP: gate and up are the same dot products (K = hidden) on both sides and silu·up is
// elementwise, so h must be the same bits (checked); down's output then differs only by the split
// of its K = I sum, and dx (gate's and up's partials, K = 2I) only by its split over tp.
TEST_CASE("the tp=2 SwiGLU MLP equals one device: h bitwise, the rest within the K-split bound", "[dist][tensor_parallel][mlp]") {
  const std::size_t N = 6, d = 16, I = 32;
  host_device dev(1);
  nn::parameters<host_device> reg(dev);
  auto& wg = reg.add("mlp.gate_proj.weight", {I, d});
  auto& wu = reg.add("mlp.up_proj.weight", {I, d});
  auto& wd = reg.add("mlp.down_proj.weight", {d, I});
  reg.init_normal(5, 0.3);
  const auto path = tmp_file("mlp");
  reg.save(path);
  nn::linear<host_device, float> lg(&wg, nullptr, d, I), lu(&wu, nullptr, d, I), ld(&wd, nullptr, I, d);
  const auto x = values(N * d, 41, false), dy = values(N * d, 42, false);
  std::vector<float> g(N * I), u(N * I), h(N * I), y(N * d), dh(N * I), dg(N * I), du(N * I), dx(N * d);
  lg.forward(dev, cview<float>(x.data(), N, d), mview<float>(g.data(), N, I), true);
  lu.forward(dev, cview<float>(x.data(), N, d), mview<float>(u.data(), N, I), true);
  swiglu_forward(dev, std::span<const float>(g), std::span<const float>(u), std::span<float>(h));
  ld.forward(dev, cview<float>(h.data(), N, I), mview<float>(y.data(), N, d), true);
  ld.backward(dev, cview<float>(dy.data(), N, d), mview<float>(dh.data(), N, I), false);
  swiglu_backward(dev, std::span<const float>(dh), std::span<const float>(g), std::span<const float>(u), std::span<float>(dg), std::span<float>(du));
  lg.backward(dev, cview<float>(dg.data(), N, I), mview<float>(dx.data(), N, d), false);
  lu.backward(dev, cview<float>(du.data(), N, I), mview<float>(dx.data(), N, d), true);
  const std::vector<float> Wg(wg.value.data(), wg.value.data() + wg.numel), Wu(wu.value.data(), wu.value.data() + wu.numel),
      Wd(wd.value.data(), wd.value.data() + wd.numel);
  const auto s_y = abs_mm_t(h, Wd, N, d, I);
  auto s_dx = abs_mm_t(dg, tr(Wg, I, d), N, d, I);
  const auto s_dx2 = abs_mm_t(du, tr(Wu, I, d), N, d, I);
  for (std::size_t i = 0; i < s_dx.size(); ++i) s_dx[i] += s_dx2[i];
  const auto s_dwd = abs_mm_t(tr(dy, N, d), tr(h, N, I), d, I, N);
  const auto s_dwg = abs_mm_t(tr(dg, N, I), tr(x, N, d), I, d, N);
  const auto s_dwu = abs_mm_t(tr(du, N, I), tr(x, N, d), I, d, N);
  compare cmp;
  threads_world::run(TP, [&](threads_transport t) {
    dist::process_groups grp(t, {.tp = TP});
    host_device dv(1);
    nn::parameters<host_device> pr(dv);
    dist::tp_swiglu_mlp<host_device, float> mlp(pr, "mlp", d, I, false, grp.tp());
    pr.load(path);
    const std::size_t il = I / TP, k = std::size_t(grp.tp().rank());
    std::vector<float> yk(N * d), dxk(N * d, 0.0f);
    mlp.forward(dv, cview<float>(x.data(), N, d), mview<float>(yk.data(), N, d), true);
    const auto hk = mlp.hidden(N);
    const auto h_want = cols_of(h.data(), N, I, k * il, il);
    TS_CHECK(std::equal(hk.begin(), hk.end(), h_want.begin()));
    mlp.backward(dv, cview<float>(dy.data(), N, d), mview<float>(dxk.data(), N, d), true);  // the accumulating path, onto 0
    cmp.check("mlp y", yk.data(), y.data(), y.size(), s_y, I, false);
    cmp.check("mlp dx", dxk.data(), dx.data(), dx.size(), s_dx, 2 * I, false);
    cmp.check("mlp dW down", pr.at("mlp.down_proj.weight").grad.data(), cols_of(wd.grad.data(), d, I, k * il, il).data(), d * il,
              cols_of_d(s_dwd, d, I, k * il, il), N, false);
    cmp.check("mlp dW gate", pr.at("mlp.gate_proj.weight").grad.data(), wg.grad.data() + k * il * d, il * d,
              std::vector<double>(s_dwg.begin() + std::ptrdiff_t(k * il * d), s_dwg.begin() + std::ptrdiff_t((k + 1) * il * d)), N, false);
    cmp.check("mlp dW up", pr.at("mlp.up_proj.weight").grad.data(), wu.grad.data() + k * il * d, il * d,
              std::vector<double>(s_dwu.begin() + std::ptrdiff_t(k * il * d), s_dwu.begin() + std::ptrdiff_t((k + 1) * il * d)), N, false);
  });
  std::filesystem::remove(path);
  WARN("tp MLP: worst |tp - one device| / bound = " << cmp.worst);
}

namespace {

// The attention layer on one device, built from nn's modules as the decoder composes them; the
// reference for tp_attention. Row-major (tokens, features) buffers.
struct one_device_attention {
  std::size_t batch, seq, hidden, hq, hkv, d;
  const std::vector<double>& inv_freq;
  nn::linear<host_device, float> q, k, v, o;
  std::vector<std::int64_t> pos;
  std::vector<float> qb, kb, vb, ob, lse, y, dO, dq, dk, dv, dx;

  one_device_attention(nn::parameters<host_device>& reg, std::size_t b, std::size_t s, std::size_t h, std::size_t nq, std::size_t nkv, std::size_t hd,
                       const std::vector<double>& f)
      : batch(b),
        seq(s),
        hidden(h),
        hq(nq),
        hkv(nkv),
        d(hd),
        inv_freq(f),
        q(&reg.at("a.q_proj.weight"), &reg.at("a.q_proj.bias"), h, nq * hd),
        k(&reg.at("a.k_proj.weight"), &reg.at("a.k_proj.bias"), h, nkv * hd),
        v(&reg.at("a.v_proj.weight"), &reg.at("a.v_proj.bias"), h, nkv * hd),
        o(&reg.at("a.o_proj.weight"), &reg.at("a.o_proj.bias"), nq * hd, h) {
    for (std::size_t i = 0; i < b; ++i)
      for (std::size_t j = 0; j < s; ++j) pos.push_back(std::int64_t(j));
  }
  rope_options rope() const {
    rope_options r;
    r.inv_freq = inv_freq;
    return r;
  }
  void forward(host_device& dev, const std::vector<float>& x) {
    const std::size_t n = batch * seq, qd = hq * d, kvd = hkv * d;
    qb.assign(n * qd, 0), kb.assign(n * kvd, 0), vb.assign(n * kvd, 0), ob.assign(n * qd, 0), lse.assign(batch * hq * seq, 0),
        y.assign(n * hidden, 0);
    q.forward(dev, cview<float>(x.data(), n, hidden), mview<float>(qb.data(), n, qd), true);
    k.forward(dev, cview<float>(x.data(), n, hidden), mview<float>(kb.data(), n, kvd), true);
    v.forward(dev, cview<float>(x.data(), n, hidden), mview<float>(vb.data(), n, kvd), true);
    rope_forward(dev, mview<float>(qb.data(), n, qd), d, std::span<const std::int64_t>(pos), rope());
    rope_forward(dev, mview<float>(kb.data(), n, kvd), d, std::span<const std::int64_t>(pos), rope());
    nn::self_attention<host_device, float>(hq, hkv, d, std::nullopt)
        .forward(dev, batch, seq, std::span<const float>(qb), std::span<const float>(kb), std::span<const float>(vb), std::span<float>(ob),
                 std::span<float>(lse));
    o.forward(dev, cview<float>(ob.data(), n, qd), mview<float>(y.data(), n, hidden), true);
  }
  // Backward for dy; with head >= 0, dO is kept for that query head only (its part of dk and dv).
  void backward(host_device& dev, const std::vector<float>& dy, int head = -1) {
    const std::size_t n = batch * seq, qd = hq * d, kvd = hkv * d;
    dO.assign(n * qd, 0), dq.assign(n * qd, 0), dk.assign(n * kvd, 0), dv.assign(n * kvd, 0), dx.assign(n * hidden, 0);
    o.backward(dev, cview<float>(dy.data(), n, hidden), mview<float>(dO.data(), n, qd), false);
    if (head >= 0)
      for (std::size_t t = 0; t < n; ++t)
        for (std::size_t c = 0; c < qd; ++c)
          if (c / d != std::size_t(head)) dO[t * qd + c] = 0.0f;
    nn::self_attention<host_device, float>(hq, hkv, d, std::nullopt)
        .backward(dev, batch, seq, std::span<const float>(qb), std::span<const float>(kb), std::span<const float>(vb), std::span<const float>(ob),
                  std::span<const float>(dO), std::span<const float>(lse), std::span<float>(dq), std::span<float>(dk), std::span<float>(dv));
    rope_backward(dev, mview<float>(dq.data(), n, qd), d, std::span<const std::int64_t>(pos), rope());
    rope_backward(dev, mview<float>(dk.data(), n, kvd), d, std::span<const std::int64_t>(pos), rope());
    q.backward(dev, cview<float>(dq.data(), n, qd), mview<float>(dx.data(), n, hidden), false);
    k.backward(dev, cview<float>(dk.data(), n, kvd), mview<float>(dx.data(), n, hidden), true);
    v.backward(dev, cview<float>(dv.data(), n, kvd), mview<float>(dx.data(), n, hidden), true);
  }
};

}  // namespace

// tp_attention against the same layer on one device. Each rank runs whole heads, so q, k, v (dot
// products of the same length) and each head's attention are the same computation on both sides:
// the attention output must be the same bits (checked). o_proj's output and the gradients then
// differ only by how their sums are grouped:
//   y, dW_o, dW_q            a K-split of the same products: 2·γ_K·Σ|products|;
//   dk, dv of a kv head      on one device the attention kernel sums the group's query heads; with
//                            kv heads replicated (heads_kv < tp) each replica sums its own heads and
//                            the parts are added after. Let P_h be head h's part (one device, dO kept
//                            for head h only: the same bits as the rank that runs h). Then
//                            |tp − one device| <= |Σ_h P_h − P| · |X| + 2·γ_K·Σ_h |P_h|·|X|,
//                            with both terms computed here, K the summed length.
TEST_CASE("tp_attention equals one device: heads bitwise, o_proj and gradients within the sum-grouping bound", "[dist][tensor_parallel][attention]") {
  const std::size_t B = 2, S = 5, H = 32, D = 16, HQ = 4, HKV = 2, n = B * S;
  std::vector<double> inv_freq(D / 2);
  for (std::size_t j = 0; j < D / 2; ++j) inv_freq[j] = std::pow(10000.0, -2.0 * double(j) / double(D));
  host_device dev(1);
  nn::parameters<host_device> reg(dev);
  reg.add("a.q_proj.weight", {HQ * D, H});
  reg.add("a.q_proj.bias", {HQ * D});
  reg.add("a.k_proj.weight", {HKV * D, H});
  reg.add("a.k_proj.bias", {HKV * D});
  reg.add("a.v_proj.weight", {HKV * D, H});
  reg.add("a.v_proj.bias", {HKV * D});
  reg.add("a.o_proj.weight", {H, HQ * D});
  reg.add("a.o_proj.bias", {H});
  reg.init_normal(7, 0.3);
  const auto path = tmp_file("attn");
  reg.save(path);
  const auto x = values(n * H, 51, false), dy = values(n * H, 52, false);
  one_device_attention one(reg, B, S, H, HQ, HKV, D, inv_freq);
  one.forward(dev, x);
  one.backward(dev, dy);
  const std::size_t qd = HQ * D, kvd = HKV * D, G = HQ / HKV;
  auto W = [&](const char* name) {
    const auto& p = reg.at(name);
    return std::vector<float>(p.value.data(), p.value.data() + p.numel);
  };
  auto G_ = [&](const char* name) {
    const auto& p = reg.at(name);
    return std::vector<float>(p.grad.data(), p.grad.data() + p.numel);
  };
  const auto Wq = W("a.q_proj.weight"), Wk = W("a.k_proj.weight"), Wv = W("a.v_proj.weight"), Wo = W("a.o_proj.weight"), bo = W("a.o_proj.bias");
  const auto gq = G_("a.q_proj.weight"), gk = G_("a.k_proj.weight"), gv = G_("a.v_proj.weight"), go = G_("a.o_proj.weight");
  const auto gbk = G_("a.k_proj.bias");
  const auto O = one.ob, dq = one.dq, dk = one.dk, dv = one.dv, dx = one.dx, y = one.y;
  // each query head's part of dk and dv (the rest of the registry's gradients are not read again)
  std::vector<std::vector<float>> dk_h(HQ), dv_h(HQ);
  for (std::size_t h = 0; h < HQ; ++h) {
    one.backward(dev, dy, int(h));
    dk_h[h] = one.dk, dv_h[h] = one.dv;
  }
  // Σ_h |P_h| and |Σ_h P_h − P| for dk and dv (fp64)
  std::vector<double> adk(n * kvd, 0), adv(n * kvd, 0), edk(n * kvd, 0), edv(n * kvd, 0);
  for (std::size_t i = 0; i < n * kvd; ++i) {
    double sk = 0, sv = 0;
    for (std::size_t h = 0; h < HQ; ++h) {
      adk[i] += std::fabs(dk_h[h][i]), adv[i] += std::fabs(dv_h[h][i]);
      sk += dk_h[h][i], sv += dv_h[h][i];
    }
    edk[i] = std::fabs(sk - dk[i]), edv[i] = std::fabs(sv - dv[i]);
  }
  // (|A|ᵀ|B|) for A (n, a), B (n, b): a weight gradient's scale
  auto atb = [&](const std::vector<double>& A, std::size_t a, const std::vector<double>& Bm, std::size_t b) {
    std::vector<double> c(a * b, 0.0);
    for (std::size_t t = 0; t < n; ++t)
      for (std::size_t i = 0; i < a; ++i)
        for (std::size_t j = 0; j < b; ++j) c[i * b + j] += A[t * a + i] * Bm[t * b + j];
    return c;
  };
  auto absd = [](const std::vector<float>& v) {
    std::vector<double> r(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) r[i] = std::fabs(double(v[i]));
    return r;
  };
  // |A|·|W| for A (n, a), W (a, H) stored (a rows of H): dx's scale from one projection
  auto aw = [&](const std::vector<double>& A, std::size_t a, const std::vector<float>& Wm) {
    std::vector<double> c(n * H, 0.0);
    for (std::size_t t = 0; t < n; ++t)
      for (std::size_t i = 0; i < a; ++i)
        for (std::size_t j = 0; j < H; ++j) c[t * H + j] += A[t * a + i] * std::fabs(double(Wm[i * H + j]));
    return c;
  };
  const auto ax = absd(x);

  for (int tp : {2, 4}) {  // tp = 2: kv heads split; tp = 4: each kv head on two ranks
    INFO("tp = " << tp);
    compare cmp;
    threads_world::run(tp, [&](threads_transport t) {
      dist::process_groups grp(t, {.tp = tp});
      host_device dv1(1);
      nn::parameters<host_device> pr(dv1);
      rope_options ro;
      ro.inv_freq = inv_freq;
      dist::tp_attention<host_device, float> at(
          pr, "a", {.hidden = H, .heads_q = HQ, .heads_kv = HKV, .head_dim = D, .qkv_bias = true, .o_bias = true, .window = std::nullopt, .rope = ro},
          grp.tp());
      pr.load(path);
      const std::size_t r = std::size_t(grp.tp().rank()), hq = HQ / std::size_t(tp), rep = at.kv_replicas();
      TS_CHECK(rep == (tp == 4 ? 2u : 1u));
      const std::size_t kv0 = (rep > 1 ? r / rep : r * at.local_heads_kv()) * D, kvl = at.local_heads_kv() * D;
      std::vector<float> yk(n * H), dxk(n * H, 0.0f);
      const std::vector<std::int64_t> pos = one.pos;
      at.forward(dv1, B, S, cview<float>(x.data(), n, H), std::span<const std::int64_t>(pos), mview<float>(yk.data(), n, H), true);
      const auto Ok = at.attention_output();
      const auto O_want = cols_of(O.data(), n, qd, r * hq * D, hq * D);
      TS_CHECK(std::equal(Ok.begin(), Ok.end(), O_want.begin()));
      at.backward(dv1, cview<float>(dy.data(), n, H), mview<float>(dxk.data(), n, H), true);  // accumulating, onto 0
      // y: K = qd products + the bias
      auto s_y = abs_mm_t(O, Wo, n, H, qd);
      for (std::size_t i = 0; i < s_y.size(); ++i) s_y[i] += std::fabs(bo[i % H]);
      cmp.check("y", yk.data(), y.data(), y.size(), s_y, qd + 1, false);
      // dW_o (H, qd) columns of this rank; dW_q rows of this rank
      cmp.check("dW o", pr.at("a.o_proj.weight").grad.data(), cols_of(go.data(), H, qd, r * hq * D, hq * D).data(), H * hq * D,
                cols_of_d(abs_mm_t(tr(dy, n, H), tr(O, n, qd), H, qd, n), H, qd, r * hq * D, hq * D), n, false);
      {
        const auto s = atb(absd(dq), qd, ax, H);
        cmp.check("dW q", pr.at("a.q_proj.weight").grad.data(), gq.data() + r * hq * D * H, hq * D * H,
                  std::vector<double>(s.begin() + std::ptrdiff_t(r * hq * D * H), s.begin() + std::ptrdiff_t((r + 1) * hq * D * H)), n, false);
      }
      // dW_k, dW_v rows [kv0, kv0 + kvl): the kernel's grouping term plus the split of G·n terms
      for (int which = 0; which < 2; ++which) {
        const auto& e = which ? edv : edk;
        const auto& a = which ? adv : adk;
        const auto se = atb(e, kvd, ax, H), sa = atb(a, kvd, ax, H);
        const float* got = pr.at(which ? "a.v_proj.weight" : "a.k_proj.weight").grad.data();
        const float* want = (which ? gv : gk).data() + kv0 * H;
        const double gk_ = gamma_k(G * n);
        std::size_t bad = 0;
        for (std::size_t i = 0; i < kvl * H; ++i) {
          const double bound = se[kv0 * H + i] + 2.0 * gk_ * sa[kv0 * H + i] + 1e-30;
          bad += std::fabs(double(got[i]) - double(want[i])) > bound;
        }
        TS_CHECK(bad == 0);
      }
      // dx: q's qd products, and k's and v's G·kvd (each kv head's parts), grouped differently
      {
        auto s = aw(absd(dq), qd, Wq);
        const auto sk = aw(adk, kvd, Wk), sv = aw(adv, kvd, Wv), ek = aw(edk, kvd, Wk), ev = aw(edv, kvd, Wv);
        const double g = gamma_k(qd + 2 * G * kvd + 3);
        std::size_t bad = 0;
        for (std::size_t i = 0; i < n * H; ++i) {
          const double bound = ek[i] + ev[i] + 2.0 * g * (s[i] + sk[i] + sv[i]) + 1e-30;
          bad += std::fabs(double(dxk[i]) - double(dx[i])) > bound;
        }
        TS_CHECK(bad == 0);
      }
      // replicas of a kv head end with the same gradient bits: gather rank 0's and compare
      if (rep > 1) {
        std::vector<float> gkr(pr.at("a.k_proj.bias").grad.data(), pr.at("a.k_proj.bias").grad.data() + kvl), all(kvl * std::size_t(tp));
        grp.tp().all_gather(std::span<const float>(gkr), std::span<float>(all));
        const std::size_t first = (r / rep) * rep;
        TS_CHECK(std::equal(gkr.begin(), gkr.end(), all.begin() + std::ptrdiff_t(first * kvl)));
        // and their sum is one device's within the grouping bound
        for (std::size_t i = 0; i < kvl; ++i) {
          double sab = 0, err = 0;
          for (std::size_t t2 = 0; t2 < n; ++t2) sab += adk[t2 * kvd + kv0 + i], err += edk[t2 * kvd + kv0 + i];
          TS_CHECK(std::fabs(double(gkr[i]) - double(gbk[kv0 + i])) <= err + 2.0 * gamma_k(G * n) * sab + 1e-30);
        }
      }
    });
    WARN("tp_attention tp=" << tp << ": worst |tp - one device| / bound = " << cmp.worst);
  }
  std::filesystem::remove(path);
}

TEST_CASE("tp_attention layers share one rotary table when their frequencies agree", "[dist][tensor_parallel][attention]") {
  threads_world::run(1, [&](threads_transport t) {
    dist::process_groups grp(t, {.tp = 1});
    host_device d(1);
    nn::parameters<host_device> pr(d);
    using A = dist::tp_attention<host_device, float>;
    auto make = [&](const std::string& name, std::optional<rope_options> ro) {
      return A(pr, name,
               {.hidden = 32, .heads_q = 2, .heads_kv = 2, .head_dim = 16, .qkv_bias = false, .o_bias = false, .window = std::nullopt, .rope = ro},
               grp.tp());
    };
    rope_options other;
    other.theta = 500000.0;
    A a = make("a", rope_options{}), b = make("b", rope_options{}), c = make("c", other), none = make("n", std::nullopt);
    TS_CHECK(a.rope_cache() != nullptr);
    TS_CHECK(a.rope_cache() != b.rope_cache());
    b.share_rope_table(a);
    TS_CHECK(a.rope_cache() == b.rope_cache());
    // b's forward grows the table a reads
    std::vector<float> x(2 * 3 * 32, 0.5f), y(2 * 3 * 32);
    const std::vector<std::int64_t> pos{0, 1, 200, 0, 1, 2};
    b.forward(d, 2, 3, cview<float>(x.data(), 6, 32), std::span<const std::int64_t>(pos), mview<float>(y.data(), 6, 32), false);
    TS_CHECK(a.rope_cache()->positions() > 200);
    bool freq = false, no_rope = false;
    try {
      c.share_rope_table(a);
    } catch (const dist::dist_error& e) {
      freq = std::string(e.what()).find("share_rope_table with a layer of other rotary frequencies") != std::string::npos;
    }
    try {
      none.share_rope_table(a);
    } catch (const dist::dist_error&) { no_rope = true; }
    TS_CHECK(freq);
    TS_CHECK(no_rope);
    TS_CHECK(c.rope_cache() != a.rope_cache());
    none.share_rope_table(make("m", std::nullopt));  // neither has rope: nothing to share
    TS_CHECK(none.rope_cache() == nullptr);
  });
}

TEST_CASE("tp_attention rejects head counts tp cannot split, naming the numbers", "[dist][tensor_parallel][attention]") {
  threads_world::run(4, [&](threads_transport t) {
    dist::process_groups grp(t, {.tp = 4});
    host_device d(1);
    nn::parameters<host_device> pr(d);
    using A = dist::tp_attention<host_device, float>;
    auto make = [&](std::size_t hq, std::size_t hkv) {
      A a(pr, "x" + std::to_string(hq) + "_" + std::to_string(hkv),
          {.hidden = 8,
           .heads_q = hq,
           .heads_kv = hkv,
           .head_dim = 2,
           .qkv_bias = false,
           .o_bias = false,
           .window = std::nullopt,
           .rope = std::nullopt},
          grp.tp());
    };
    bool q = false, kv = false, g = false;
    try {
      make(6, 6);
    } catch (const dist::dist_error& e) { q = std::string(e.what()).find("tp = 4 does not divide the 6 query heads") != std::string::npos; }
    try {
      make(12, 6);
    } catch (const dist::dist_error& e) { kv = std::string(e.what()).find("tp = 4 and 6 kv heads") != std::string::npos; }
    try {
      make(8, 3);
    } catch (const dist::dist_error& e) { g = std::string(e.what()).find("8 query heads are not a multiple of 3 kv heads") != std::string::npos; }
    TS_CHECK(q);
    TS_CHECK(kv);
    TS_CHECK(g);
  });
}

}  // namespace tessel_test_dist_tensor_parallel
