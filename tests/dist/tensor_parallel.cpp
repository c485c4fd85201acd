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
    const auto x = values(N * in, 31, integers), dyc = values(N * out, 32, integers), xr = values(N * out, 33, integers), dyr = values(N * in, 34, integers);
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
      cmp.check("row dW", pr.at("r.weight").grad.data(), cols_of(wr.grad.data(), in, out, k * ic, ic).data(), in * ic, cols_of_d(s_dwr, in, out, k * ic, ic),
                N, integers);
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
