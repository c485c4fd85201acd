// Fused optimizers (tessel/ops/optim.hpp) against the unfused loops of tests/reference/train_ref.hpp:
// bitwise where the operation order matches, thread-count independence, stochastic rounding
// unbiasedness, loss scaling, clipping, and bad input that writes nothing.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/optim.hpp>

#include "error_match.hpp"
#include "reference/train_ref.hpp"

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;

namespace {

const std::vector<std::size_t> mixed_sizes = {1, 7, 100, 1000, 70001, 131072 + 5};

struct f32_set {
  std::vector<std::vector<float>> p, g, m, v, vm;
  explicit f32_set(std::uint64_t seed, float gscale = 1.0f) {
    for (std::size_t k = 0; k < mixed_sizes.size(); ++k) {
      const std::size_t n = mixed_sizes[k];
      p.push_back(train_ref::randn(n, seed + 10 * k));
      g.push_back(train_ref::randn(n, seed + 10 * k + 1, gscale));
      m.push_back(train_ref::randn(n, seed + 10 * k + 2, 0.1f));
      auto vv = train_ref::randn(n, seed + 10 * k + 3, 0.1f);
      for (auto& x : vv) x = x * x;
      v.push_back(vv);
      vm.push_back(vv);
    }
  }
  std::vector<optim_tensor<float, float>> tensors(bool amsgrad) {
    std::vector<optim_tensor<float, float>> ts(p.size());
    for (std::size_t k = 0; k < p.size(); ++k) {
      ts[k].param = p[k];
      ts[k].grad = g[k];
      ts[k].m = m[k];
      ts[k].v = v[k];
      if (amsgrad) ts[k].v_max = vm[k];
    }
    return ts;
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("adamw f32 multi-tensor equals the unfused reference bitwise", "[ops][optim]") {
  for (bool ams : {false, true}) {
    for (unsigned threads : {1u, 2u}) {
      host_device dev(threads);
      f32_set a(42), r(42);
      adamw_params h;
      h.lr = 1e-2f;
      h.weight_decay = 0.1f;
      h.amsgrad = ams;
      step_options o;
      o.loss_scale = 128.0f;
      for (std::uint64_t step = 1; step <= 3; ++step) {
        auto ts = a.tensors(ams);
        const step_result res = adamw_step(dev, std::span<const optim_tensor<float, float>>(ts), h, step, o);
        REQUIRE_FALSE(res.skipped);
        REQUIRE(res.grad_multiplier == 1.0f / 128.0f);
        for (std::size_t k = 0; k < r.p.size(); ++k)
          train_ref::adamw(r.p[k], r.g[k], r.m[k], r.v[k], r.vm[k], {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, ams}, step, res.grad_multiplier);
      }
      for (std::size_t k = 0; k < r.p.size(); ++k) {
        CHECK(same_bits(a.p[k], r.p[k]));
        CHECK(same_bits(a.m[k], r.m[k]));
        CHECK(same_bits(a.v[k], r.v[k]));
        if (ams) CHECK(same_bits(a.vm[k], r.vm[k]));
      }
    }
  }
}

TEST_CASE("global grad-norm clipping: norm is deterministic and the update uses the clip coefficient", "[ops][optim]") {
  f32_set a(7, 3.0f), b(7, 3.0f), r(7, 3.0f);
  adamw_params h;
  step_options o;
  o.max_grad_norm = 1.0f;
  o.loss_scale = 4.0f;
  host_device d1(1), d2(2);
  auto ta = a.tensors(false);
  auto tb = b.tensors(false);
  o.chunk = 4096;  // many chunks
  const auto ra = adamw_step(d1, std::span<const optim_tensor<float, float>>(ta), h, 1, o);
  const auto rb = adamw_step(d2, std::span<const optim_tensor<float, float>>(tb), h, 1, o);
  REQUIRE(ra.grad_norm == rb.grad_norm);
  double ss = 0.0;
  for (auto& g : r.g)
    for (float x : g) ss += double(x / 4.0f) * double(x / 4.0f);
  CHECK(ra.grad_norm == Approx(std::sqrt(ss)).epsilon(1e-5));
  CHECK(ra.grad_multiplier == Approx(0.25 * 1.0 / (std::sqrt(ss) + 1e-6)).epsilon(1e-5));
  for (std::size_t k = 0; k < r.p.size(); ++k) {
    train_ref::adamw(r.p[k], r.g[k], r.m[k], r.v[k], r.vm[k], {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, false}, 1, ra.grad_multiplier);
    CHECK(same_bits(a.p[k], r.p[k]));
    CHECK(same_bits(b.p[k], r.p[k]));
  }
}

TEST_CASE("sgd momentum / nesterov and lion equal the reference bitwise", "[ops][optim]") {
  host_device dev(2);
  for (int variant = 0; variant < 3; ++variant) {
    f32_set a(11), r(11);
    sgd_params h;
    h.lr = 0.05f;
    h.momentum = variant == 0 ? 0.0f : 0.9f;
    h.nesterov = variant == 2;
    h.dampening = variant == 1 ? 0.1f : 0.0f;
    h.weight_decay = 1e-3f;
    for (std::uint64_t step = 1; step <= 3; ++step) {
      auto ts = a.tensors(false);
      for (auto& t : ts) t.v = {};
      if (h.momentum == 0.0f)
        for (auto& t : ts) t.m = {};
      sgd_step(dev, std::span<const optim_tensor<float, float>>(ts), h, step);
      for (std::size_t k = 0; k < r.p.size(); ++k)
        train_ref::sgd(r.p[k], r.g[k], r.m[k], h.lr, h.momentum, h.dampening, h.weight_decay, h.nesterov, step, 1.0f);
    }
    for (std::size_t k = 0; k < r.p.size(); ++k) CHECK(same_bits(a.p[k], r.p[k]));
  }
  f32_set a(12), r(12);
  lion_params lh;
  lh.weight_decay = 0.1f;
  for (std::uint64_t step = 1; step <= 3; ++step) {
    auto ts = a.tensors(false);
    for (auto& t : ts) t.v = {};
    lion_step(dev, std::span<const optim_tensor<float, float>>(ts), lh, step);
    for (std::size_t k = 0; k < r.p.size(); ++k) train_ref::lion(r.p[k], r.g[k], r.m[k], lh.lr, lh.beta1, lh.beta2, lh.weight_decay, 1.0f);
  }
  for (std::size_t k = 0; k < r.p.size(); ++k) {
    CHECK(same_bits(a.p[k], r.p[k]));
    CHECK(same_bits(a.m[k], r.m[k]));
  }
}

TEST_CASE("bf16 parameter storages: master and remainder rebuild the f32 reference exactly", "[ops][optim]") {
  host_device dev(2);
  f32_set r(5);
  // bf16 grads and bf16 state for the master run; f32 state for the remainder run.
  std::vector<std::vector<bf16>> pb(r.p.size()), pb2(r.p.size()), gb(r.p.size());
  std::vector<std::vector<float>> master = r.p, m1 = r.m, v1 = r.v, m2 = r.m, v2 = r.v;
  std::vector<std::vector<std::uint16_t>> rem(r.p.size());
  std::vector<std::vector<float>> gf(r.p.size());
  for (std::size_t k = 0; k < r.p.size(); ++k) {
    for (float x : r.g[k]) gb[k].push_back(bf16(x));
    for (bf16 x : gb[k]) gf[k].push_back(float(x));
    pb[k].assign(r.p[k].size(), bf16(0.0f));
    pb2[k].resize(r.p[k].size());
    rem[k].resize(r.p[k].size());
    for (std::size_t i = 0; i < r.p[k].size(); ++i) {  // split the master into (hi, lo)
      const std::uint32_t u = std::bit_cast<std::uint32_t>(r.p[k][i]);
      pb2[k][i] = bf16::from_bits(std::uint16_t((u + 0x8000u) >> 16));
      rem[k][i] = std::uint16_t(u & 0xFFFFu);
    }
  }
  adamw_params h;
  h.lr = 3e-3f;
  for (std::uint64_t step = 1; step <= 2; ++step) {
    std::vector<optim_tensor<float, bf16>> t1(r.p.size());
    std::vector<optim_tensor<float, bf16>> t2(r.p.size());
    for (std::size_t k = 0; k < r.p.size(); ++k) {
      t1[k].param_bf16 = pb[k];
      t1[k].master = master[k];
      t1[k].grad = gb[k];
      t1[k].m = m1[k];
      t1[k].v = v1[k];
      t2[k].param_bf16 = pb2[k];
      t2[k].remainder = rem[k];
      t2[k].grad = gb[k];
      t2[k].m = m2[k];
      t2[k].v = v2[k];
    }
    step_options o1;
    o1.storage = param_storage::bf16_master;
    step_options o2;
    o2.storage = param_storage::bf16_remainder;
    adamw_step(dev, std::span<const optim_tensor<float, bf16>>(t1), h, step, o1);
    adamw_step(dev, std::span<const optim_tensor<float, bf16>>(t2), h, step, o2);
    for (std::size_t k = 0; k < r.p.size(); ++k)
      train_ref::adamw(r.p[k], gf[k], r.m[k], r.v[k], r.vm[k], {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, false}, step, 1.0f);
  }
  for (std::size_t k = 0; k < r.p.size(); ++k) {
    CHECK(same_bits(master[k], r.p[k]));
    bool bf_ok = true, rem_ok = true, half_ok = true;
    for (std::size_t i = 0; i < r.p[k].size(); ++i) {
      bf_ok = bf_ok && pb[k][i].bits() == bf16(r.p[k][i]).bits();
      const std::uint32_t hi = pb2[k][i].bits(), lo = rem[k][i];
      const std::uint32_t joined = ((hi << 16) | lo) - ((lo & 0x8000u) << 1);
      rem_ok = rem_ok && joined == std::bit_cast<std::uint32_t>(r.p[k][i]);
      half_ok = half_ok && std::fabs(float(pb2[k][i]) - r.p[k][i]) <= std::fabs(r.p[k][i]) * (1.0f / 256.0f);
    }
    CHECK(bf_ok);
    CHECK(rem_ok);
    CHECK(half_ok);
  }
}

TEST_CASE("bf16 optimizer state rounds the moments once after the update", "[ops][optim]") {
  host_device dev(1);
  f32_set r(9);
  std::vector<std::vector<bf16>> mb(r.p.size()), vb(r.p.size());
  std::vector<std::vector<float>> p = r.p;
  for (std::size_t k = 0; k < r.p.size(); ++k) {
    for (auto& x : r.m[k]) {
      x = train_ref::bf16_round(x);
      mb[k].push_back(bf16(x));
    }
    for (auto& x : r.v[k]) {
      x = train_ref::bf16_round(x);
      vb[k].push_back(bf16(x));
    }
  }
  adamw_params h;
  std::vector<optim_tensor<bf16, float>> ts(r.p.size());
  for (std::size_t k = 0; k < r.p.size(); ++k) {
    ts[k].param = p[k];
    ts[k].grad = r.g[k];
    ts[k].m = mb[k];
    ts[k].v = vb[k];
  }
  adamw_step(dev, std::span<const optim_tensor<bf16, float>>(ts), h, 1);
  for (std::size_t k = 0; k < r.p.size(); ++k) {
    train_ref::adamw(r.p[k], r.g[k], r.m[k], r.v[k], r.vm[k], {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, false}, 1, 1.0f);
    CHECK(same_bits(p[k], r.p[k]));
    bool ok = true;
    for (std::size_t i = 0; i < p[k].size(); ++i) ok = ok && mb[k][i].bits() == bf16(r.m[k][i]).bits() && vb[k][i].bits() == bf16(r.v[k][i]).bits();
    CHECK(ok);
  }
}

TEST_CASE("stochastic rounding to bf16 is unbiased, seeded and thread-count independent", "[ops][optim]") {
  const std::size_t n = 1 << 18;
  auto x = train_ref::randn(n, 3);
  auto run = [&](unsigned threads, std::uint64_t seed, std::uint64_t step) {
    host_device dev(threads);
    std::vector<float> master = x, g(n, 0.0f);
    std::vector<bf16> pb(n);
    optim_tensor<float, float> t;
    t.param_bf16 = pb;
    t.master = master;
    t.grad = g;
    sgd_params h;
    h.lr = 0.0f;
    step_options o;
    o.storage = param_storage::bf16_master;
    o.round = rounding::stochastic;
    o.seed = seed;
    sgd_step(dev, std::span<const optim_tensor<float, float>>(&t, 1), h, step, o);
    REQUIRE(same_bits(master, x));
    return pb;
  };
  const auto a = run(1, 99, 1), b = run(2, 99, 1), c = run(2, 100, 1), d = run(2, 99, 2);
  bool same_ab = true, same_ac = true, same_ad = true;
  double sum = 0.0, sumsq = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    same_ab = same_ab && a[i].bits() == b[i].bits();
    same_ac = same_ac && a[i].bits() == c[i].bits();
    same_ad = same_ad && a[i].bits() == d[i].bits();
    // error in units of the bf16 spacing at x (so every element weighs alike)
    const float lo = std::bit_cast<float>(std::bit_cast<std::uint32_t>(x[i]) & 0xFFFF0000u);
    const float up = std::bit_cast<float>((std::bit_cast<std::uint32_t>(x[i]) & 0xFFFF0000u) + 0x10000u);
    const double ulp = std::fabs(double(up) - double(lo));
    const double e = (double(float(a[i])) - double(x[i])) / ulp;
    CHECK_FALSE(std::fabs(e) >= 1.0);  // only the two neighbours are reachable
    sum += e;
    sumsq += e * e;
  }
  CHECK(same_ab);
  CHECK_FALSE(same_ac);
  CHECK_FALSE(same_ad);
  const double mean = sum / double(n), var = sumsq / double(n) - mean * mean;
  const double se = std::sqrt(var / double(n));
  INFO("mean error " << mean << " ulp, standard error " << se);
  CHECK(std::fabs(mean) < 4.0 * se);
  CHECK(var > 0.05);  // really random, not nearest
}

TEST_CASE("a non-finite gradient skips the step and writes nothing, the loss scaler backs off and grows", "[ops][optim]") {
  host_device dev(2);
  f32_set a(21);
  a.g[4][777] = std::numeric_limits<float>::infinity();
  const f32_set before = a;
  auto ts = a.tensors(false);
  const auto res = adamw_step(dev, std::span<const optim_tensor<float, float>>(ts), adamw_params{}, 1);
  CHECK(res.skipped);
  CHECK(res.found_inf);
  for (std::size_t k = 0; k < a.p.size(); ++k) {
    CHECK(same_bits(a.p[k], before.p[k]));
    CHECK(same_bits(a.m[k], before.m[k]));
    CHECK(same_bits(a.v[k], before.v[k]));
  }
  a.g[4][777] = std::numeric_limits<float>::quiet_NaN();
  CHECK(adamw_step(dev, std::span<const optim_tensor<float, float>>(ts), adamw_params{}, 1).skipped);

  loss_scaler s(1024.0f, 2.0f, 0.5f, 3);
  CHECK(s.update(true) == 512.0f);
  CHECK(s.update(false) == 512.0f);
  CHECK(s.update(false) == 512.0f);
  CHECK(s.update(false) == 1024.0f);
  CHECK(s.update(false) == 1024.0f);
  CHECK(s.update(true) == 512.0f);
  CHECK(s.clean_steps() == 0);
  CHECK_THROWS_AS(loss_scaler(0.0f), optim_error);
  CHECK_THROWS_MATCHES(loss_scaler(1.0f, 2.0f, 1.5f), optim_error, is_error(errc::invalid_argument, "optim", "loss_scaler"));
}

TEST_CASE("adaptive gradient clipping clips each unit to lambda * |w|", "[ops][optim]") {
  host_device dev(2);
  const std::size_t rows = 37, cols = 300;
  auto p = train_ref::randn(rows * cols, 1, 0.1f);
  auto g = train_ref::randn(rows * cols, 2, 1.0f);
  for (std::size_t c = 0; c < cols; ++c) g[5 * cols + c] *= 1e-4f;  // one small row: not clipped
  const auto p0 = p;
  optim_tensor<float, float> t;
  t.param = p;
  t.grad = g;
  t.unit = cols;
  sgd_params h;
  h.lr = 1.0f;
  step_options o;
  o.agc_clip = 0.02f;
  o.chunk = 1000;  // not a multiple of the unit: chunks round to whole rows
  sgd_step(dev, std::span<const optim_tensor<float, float>>(&t, 1), h, 1, o);
  for (std::size_t r = 0; r < rows; ++r) {
    double wn = 0, gn = 0;
    for (std::size_t c = 0; c < cols; ++c) {
      wn += double(p0[r * cols + c]) * p0[r * cols + c];
      gn += double(g[r * cols + c]) * g[r * cols + c];
    }
    wn = std::max(std::sqrt(wn), 1e-3);
    gn = std::sqrt(gn);
    const double coef = gn > 0.02 * wn ? 0.02 * wn / gn : 1.0;
    double err = 0, gmax = 0;
    for (std::size_t c = 0; c < cols; ++c) {
      const double want = double(p0[r * cols + c]) - coef * double(g[r * cols + c]);
      err = std::max(err, std::fabs(want - double(p[r * cols + c])));
      gmax = std::max(gmax, std::fabs(coef * g[r * cols + c]));
    }
    err /= gmax;  // relative to the largest clipped gradient of the row (f32 rounding of p is ~1e-7 |p|)
    INFO("row " << r);
    CHECK(err < 1e-3);
    if (r == 5) CHECK(coef == 1.0);
  }
  t.unit = 7;  // does not divide 37*300
  CHECK_THROWS_AS(sgd_step(dev, std::span<const optim_tensor<float, float>>(&t, 1), h, 1, o), optim_error);
}

TEST_CASE("bad optimizer input is a typed error and writes nothing", "[ops][optim]") {
  host_device dev(2);
  f32_set a(31);
  const f32_set before = a;
  auto ts = a.tensors(false);
  auto run = [&](const adamw_params& h, const step_options& o = {}) {
    return adamw_step(dev, std::span<const optim_tensor<float, float>>(ts), h, 1, o);
  };
  adamw_params nan_lr;
  nan_lr.lr = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(run(nan_lr), optim_error);
  adamw_params bad_beta;
  bad_beta.beta2 = 1.0f;
  CHECK_THROWS_AS(run(bad_beta), optim_error);
  step_options bad_scale;
  bad_scale.loss_scale = 0.0f;
  CHECK_THROWS_AS(run(adamw_params{}, bad_scale), optim_error);
  step_options sr_f32;
  sr_f32.round = rounding::stochastic;
  CHECK_THROWS_AS(run(adamw_params{}, sr_f32), optim_error);
  // last tensor has a short moment: nothing of the earlier tensors may be written either
  ts.back().v = ts.back().v.subspan(1);
  CHECK_THROWS_AS(run(adamw_params{}), optim_error);
  ts = a.tensors(false);
  ts[2].grad = {};
  CHECK_THROWS_MATCHES(run(adamw_params{}), optim_error, is_error(errc::invalid_argument, "optim"));
  ts = a.tensors(false);
  step_options bf;
  bf.storage = param_storage::bf16_master;  // tensors carry f32 params only
  CHECK_THROWS_AS(run(adamw_params{}, bf), optim_error);
  CHECK_THROWS_AS(adamw_step(dev, std::span<const optim_tensor<float, float>>(ts), adamw_params{}, 0), optim_error);
  for (std::size_t k = 0; k < a.p.size(); ++k) {
    CHECK(same_bits(a.p[k], before.p[k]));
    CHECK(same_bits(a.m[k], before.m[k]));
    CHECK(same_bits(a.v[k], before.v[k]));
  }
  std::vector<std::span<float>> params = {a.p[0], a.p[1]};
  std::vector<std::span<const float>> grads = {a.g[0]};
  CHECK_THROWS_MATCHES((zip_tensors<float, float>(params, grads)), optim_error, is_error(errc::invalid_argument, "optim", "zip_tensors"));
  // empty list: a no-op
  CHECK_FALSE(adamw_step(dev, std::span<const optim_tensor<float, float>>(), adamw_params{}, 1).skipped);
}

#include <tessel/emulator/card.hpp>
#include <tessel/ops/loss.hpp>
#include <tessel/ops/norm.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_ops_optim {

TEST_CASE("the training programs run unchanged on an emulator card, with the host's bits", "[ops][optim]") {
  executor ex(2);
  emu::card_spec spec;
  spec.memory_bytes = std::size_t(256) << 20;
  emu::card card(0, spec, ex, false, nullptr);
  host_device host(2);
  const std::size_t n = 100003;
  auto p0 = train_ref::randn(n, 1), g0 = train_ref::randn(n, 2);
  // card memory for the parameter tensor and its state
  float* p = static_cast<float*>(card.allocate(n * sizeof(float)));
  float* g = static_cast<float*>(card.allocate(n * sizeof(float)));
  float* m = static_cast<float*>(card.allocate(n * sizeof(float)));
  float* v = static_cast<float*>(card.allocate(n * sizeof(float)));
  card.copy(p0.data(), p, n * sizeof(float));
  card.copy(g0.data(), g, n * sizeof(float));
  std::memset(m, 0, n * sizeof(float));
  std::memset(v, 0, n * sizeof(float));
  std::vector<float> hp = p0, hm(n, 0.0f), hv(n, 0.0f);
  optim_tensor<float, float> tc, th;
  tc.param = {p, n};
  tc.grad = {g, n};
  tc.m = {m, n};
  tc.v = {v, n};
  th.param = hp;
  th.grad = g0;
  th.m = hm;
  th.v = hv;
  step_options o;
  o.max_grad_norm = 10.0f;
  const auto rc = adamw_step(card, std::span<const optim_tensor<float, float>>(&tc, 1), adamw_params{}, 1, o);
  const auto rh = adamw_step(host, std::span<const optim_tensor<float, float>>(&th, 1), adamw_params{}, 1, o);
  CHECK(rc.grad_norm == rh.grad_norm);
  CHECK(std::memcmp(p, hp.data(), n * sizeof(float)) == 0);
  // a norm and a loss on the card too
  const std::size_t rows = 64, cols = 1000;
  std::vector<float> w(cols, 1.0f), yc(rows * cols), yh(rows * cols), rs(rows);
  rmsnorm_forward(card, tensor<const float, 2>(p, rows, cols), w, tensor<float, 2>(yc.data(), rows, cols), rs);
  rmsnorm_forward(host, tensor<const float, 2>(hp.data(), rows, cols), w, tensor<float, 2>(yh.data(), rows, cols), rs);
  CHECK(std::memcmp(yc.data(), yh.data(), yc.size() * sizeof(float)) == 0);
  std::vector<std::int64_t> labels(rows, 3);
  const auto lc = cross_entropy(card, tensor<const float, 2>(yc.data(), rows, cols), labels, tensor<float, 2>(m, rows, cols));
  const auto lh = cross_entropy(host, tensor<const float, 2>(yh.data(), rows, cols), labels, tensor<float, 2>(hm.data(), rows, cols));
  CHECK(lc.loss == lh.loss);
  CHECK(std::memcmp(m, hm.data(), rows * cols * sizeof(float)) == 0);
  for (float* q : {p, g, m, v}) card.deallocate(q);
}

TEST_CASE("dynamic loss scaling in a loop: overflow halves and skips, clean steps double", "[ops][optim]") {
  host_device dev(2);
  const std::size_t n = 5000;
  const auto g_true = train_ref::randn(n, 41, 1.0f);
  std::vector<float> p(n, 1.0f), m(n), v(n), g(n);
  optim_tensor<float, float> t;
  t.param = p;
  t.grad = g;
  t.m = m;
  t.v = v;
  loss_scaler scaler(std::ldexp(1.0f, 127), 2.0f, 0.5f, 4);
  int skipped = 0, applied = 0;
  float last_scale = scaler.scale();
  for (int step = 1; step <= 20; ++step) {
    // the "backward pass" of a scaled loss: gradients are true gradients times the scale (may overflow)
    for (std::size_t i = 0; i < n; ++i) g[i] = g_true[i] * scaler.scale();
    step_options o;
    o.loss_scale = scaler.scale();
    const auto before = p;
    const auto r = adamw_step(dev, std::span<const optim_tensor<float, float>>(&t, 1), adamw_params{}, std::uint64_t(applied + 1), o);
    if (r.skipped) {
      ++skipped;
      CHECK(std::memcmp(before.data(), p.data(), n * sizeof(float)) == 0);
    } else {
      ++applied;
    }
    const float next = scaler.update(r.found_inf);
    if (r.found_inf) CHECK(next == last_scale * 0.5f);
    last_scale = next;
  }
  // 2^127 * |g| overflows for |g| >= 2: a few halvings, then steps apply and every 4 clean steps double the scale
  CHECK(skipped >= 1);
  CHECK(applied >= 12);
  CHECK(std::isfinite(scaler.scale()));
}

}  // namespace tessel_test_ops_optim
