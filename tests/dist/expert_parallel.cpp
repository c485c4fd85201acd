// Expert parallelism (tessel/dist/expert_parallel.hpp): a Mixtral block with its 8 experts over
// ep = 1, 2, 4 thread ranks, each rank with its own tokens (unequal counts, one rank with none),
// against nn::sparse_moe on one device over all ranks' tokens in rank order, f32 and BF16.
//  * Every expert sees the same rows in the same order and every token adds the same expert rows in
//    top-k order, so the output, the input gradient and the experts' weight gradients must be the
//    same bits as on one device.
//  * The router's weight gradient is a sum over tokens, taken per rank and then summed over the
//    ranks (data parallelism's all-reduce): the same products grouped differently, so
//    |Δg| <= 2·γ_N·Σ|terms| with N the token count; Σ|terms| is bounded by N·max|g| when terms do
//    not cancel by more than a factor N (the test's bound, as in data_parallel.cpp).
//  * FP8 dispatch (E4M3 rows with per-128-channel scales): the routing is unchanged (it precedes
//    the dispatch), the output moves by E4M3's rounding (a loose sanity bound: 10% of max |y|), the
//    payload bytes are about a quarter of f32's.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/dist.hpp>
#include <tessel/nn.hpp>

#include "error_match.hpp"
#include "dist/thread_check.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_dist_expert_parallel {

using namespace tessel;
using nn::cview;
using nn::mview;
using tessel_test::is_error;

namespace {

constexpr std::size_t E = 8, K = 2, I = 24;

std::vector<float> normals(std::size_t n, std::uint64_t seed, double scale) {
  nn::normal_rng r(seed);
  std::vector<float> v(n);
  for (float& x : v) x = float(r() * scale);
  return v;
}

std::string expert_name(std::size_t j, int w) { return "experts." + std::to_string(j) + ".w" + std::to_string(w) + ".weight"; }

// The block's parameters in a registry (router "gate.weight" and the experts [first, first + count)),
// values drawn per name so that every registry holds the same numbers.
template <class T>
std::vector<std::array<nn::parameter<host_device>*, 3>> add_block(nn::parameters<host_device>& reg, std::size_t d, std::size_t first, std::size_t count,
                                                                   nn::parameter<host_device>*& router) {
  constexpr bool b = std::is_same_v<T, bf16>;
  auto fill = [&](nn::parameter<host_device>& p, std::uint64_t seed, double scale) {
    const auto v = normals(p.numel, seed, scale);
    std::copy(v.begin(), v.end(), p.value.data());
  };
  router = &reg.add("gate.weight", {E, d}, b);
  fill(*router, 1, 0.5);
  std::vector<std::array<nn::parameter<host_device>*, 3>> ex;
  for (std::size_t j = first; j < first + count; ++j) {
    auto& w1 = reg.add(expert_name(j, 1), {I, d}, b);
    auto& w3 = reg.add(expert_name(j, 3), {I, d}, b);
    auto& w2 = reg.add(expert_name(j, 2), {d, I}, b);
    fill(w1, 100 + 3 * j, 0.3), fill(w3, 101 + 3 * j, 0.3), fill(w2, 102 + 3 * j, 0.3);
    ex.push_back({&w1, &w3, &w2});
  }
  reg.refresh_bf16();
  return ex;
}

template <class T>
std::vector<T> as(const std::vector<float>& v) {
  std::vector<T> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = T(v[i]);
  return r;
}

std::size_t differing(const float* a, const float* b, std::size_t n) {
  std::size_t c = 0;
  for (std::size_t i = 0; i < n; ++i) c += std::memcmp(a + i, b + i, sizeof(float)) != 0;
  return c;
}

template <class T>
void check_ep(int ep, const std::vector<std::size_t>& tokens, bool fp8, std::size_t d) {
  std::vector<std::size_t> first(tokens.size() + 1, 0);
  for (std::size_t r = 0; r < tokens.size(); ++r) first[r + 1] = first[r] + tokens[r];
  const std::size_t N = first.back();
  const auto x = as<T>(normals(N * d, 7, 1.0));
  const auto dy = normals(N * d, 8, 1.0);
  std::vector<double> dprob(E);
  for (std::size_t e = 0; e < E; ++e) dprob[e] = 0.01 * double(e) - 0.03;
  // one device, every token
  host_device dev(1);
  nn::parameters<host_device> reg(dev);
  nn::parameter<host_device>* router = nullptr;
  auto experts = add_block<T>(reg, d, 0, E, router);
  nn::sparse_moe<host_device, T> one(router, experts, d, I, K);
  std::vector<float> y(N * d), dx(N * d);
  one.forward(dev, cview<T>(x.data(), N, d), mview<float>(y.data(), N, d), true);
  one.backward(dev, cview<float>(dy.data(), N, d), mview<float>(dx.data(), N, d), dprob);
  const std::vector<float> logits(one.router_logits().begin(), one.router_logits().end());

  std::mutex mu;
  std::vector<std::string> problems;
  auto fail = [&](std::string s) {
    std::lock_guard lk(mu);
    problems.push_back(std::move(s));
  };
  double worst_router = 0.0, router_bound = 0.0, fp8_dev = 0.0, ymax = 0.0;
  std::size_t fp8_bytes = 0;
  threads_world::run(ep, [&](threads_transport t) {
    communicator c(std::move(t));
    const auto r = static_cast<std::size_t>(c.rank());
    host_device dv(1);
    nn::parameters<host_device> pr(dv);
    const auto [e0, ne] = dist::local_experts(E, ep, c.rank());
    nn::parameter<host_device>* rt = nullptr;
    auto local = add_block<T>(pr, d, e0, ne, rt);
    dist::ep_moe<host_device, T> m(rt, local, d, I, E, K, c, {.fp8_dispatch = fp8});
    const std::size_t n = tokens[r], o = first[r] * d;
    std::vector<float> ye(n * d), dxe(n * d);
    m.forward(dv, cview<T>(x.data() + o, n, d), mview<float>(ye.data(), n, d), true);
    const std::string who = "ep=" + std::to_string(ep) + " rank " + std::to_string(r) + ": ";
    if (differing(m.router_logits().data(), logits.data() + first[r] * E, n * E)) fail(who + "router logits differ");
    if (fp8) {
      std::lock_guard lk(mu);
      for (std::size_t i = 0; i < n * d; ++i) {
        fp8_dev = std::max(fp8_dev, double(std::fabs(ye[i] - y[o + i])));
        ymax = std::max(ymax, double(std::fabs(y[o + i])));
      }
      fp8_bytes += m.dispatch_wire_bytes();
      return;
    }
    if (differing(ye.data(), y.data() + o, n * d)) fail(who + "output differs from one device");
    m.backward(dv, cview<float>(dy.data() + o, n, d), mview<float>(dxe.data(), n, d), dprob);
    if (differing(dxe.data(), dx.data() + o, n * d)) fail(who + "input gradient differs from one device");
    for (std::size_t j = e0; j < e0 + ne; ++j)
      for (int w : {1, 2, 3})
        if (differing(pr.at(expert_name(j, w)).grad.data(), reg.at(expert_name(j, w)).grad.data(), I * d))
          fail(who + "expert " + std::to_string(j) + " w" + std::to_string(w) + " gradient differs from one device");
    // the router's gradient summed over the ranks (what data parallelism's all-reduce does)
    std::vector<float> g(rt->grad.data(), rt->grad.data() + E * d);
    c.all_reduce(std::span<float>(g), reduce_op::sum);
    const float* want = router->grad.data();
    double gmax = 0.0, dmax = 0.0;
    for (std::size_t i = 0; i < g.size(); ++i) gmax = std::max(gmax, double(std::fabs(want[i]))), dmax = std::max(dmax, double(std::fabs(g[i] - want[i])));
    const double u = std::ldexp(1.0, -24), gN = double(N) * u / (1.0 - double(N) * u), bound = 2.0 * gN * double(N) * gmax;
    std::lock_guard lk(mu);
    worst_router = std::max(worst_router, dmax);
    router_bound = bound;
    if (dmax > bound) problems.push_back(who + "router gradient off by " + std::to_string(dmax) + " > " + std::to_string(bound));
  });
  for (auto& p : problems) FAIL_CHECK(p);
  if (fp8) {
    INFO("fp8 dispatch: max |Δy| " << fp8_dev << ", max |y| " << ymax << ", payload bytes to other ranks " << fp8_bytes);
    CHECK(fp8_dev > 0.0);
    CHECK(fp8_dev <= 0.1 * ymax);
    // E4M3 + one f32 scale per 128 channels: d + 4·d/128 bytes a row against 4·d for f32 rows
    const std::size_t per_row = d + 4 * (d / 128);
    CHECK(fp8_bytes % per_row == 0);
  } else {
    INFO("router gradient: max |Δ| " << worst_router << " (bound " << router_bound << ")");
    CHECK(worst_router <= router_bound);
  }
}

}  // namespace

TEST_CASE("expert parallel MoE equals one device bitwise (f32 and bf16, ep 1, 2, 4)", "[dist][expert_parallel]") {
  for (int ep : {1, 2, 4}) {
    std::vector<std::size_t> tokens;
    for (int r = 0; r < ep; ++r) tokens.push_back(r == 1 ? 0 : 9 + 2 * std::size_t(r));  // rank 1 has no tokens
    INFO("ep = " << ep);
    check_ep<float>(ep, tokens, false, 32);
    check_ep<bf16>(ep, tokens, false, 32);
  }
}

TEST_CASE("expert parallel MoE with FP8 dispatch stays within E4M3's rounding", "[dist][expert_parallel]") {
  check_ep<float>(2, {12, 10}, true, 128);
  check_ep<bf16>(4, {6, 7, 8, 9}, true, 128);
}

TEST_CASE("expert parallel MoE rejects layouts that do not fit", "[dist][expert_parallel][errors]") {
  CHECK_THROWS_MATCHES(dist::local_experts(8, 3, 0), dist::dist_error, is_error(errc::config, "dist", "ep = 3 does not divide the 8 experts"));
  CHECK_THROWS_MATCHES(dist::local_experts(8, 2, 2), dist::dist_error, is_error(errc::invalid_argument, "dist", "rank 2 of ep = 2"));
  std::mutex mu;
  int good = 0;
  threads_world::run(2, [&](threads_transport t) {
    communicator c(std::move(t));
    host_device dv(1);
    nn::parameters<host_device> pr(dv);
    nn::parameter<host_device>* rt = nullptr;
    auto all = add_block<float>(pr, 32, 0, E, rt);
    auto throws = [&](auto&& fn, const char* fragment) {
      try {
        fn();
      } catch (const dist::dist_error& e) {
        if (is_error(errc::config, "dist", fragment).match(e)) {
          std::lock_guard lk(mu);
          ++good;
        }
      }
    };
    throws([&] { dist::ep_moe<host_device, float>(rt, all, 32, I, E, K, c); }, "is given 8 experts, but ep = 2 over 8 experts is 4 per rank");
    std::vector<std::array<nn::parameter<host_device>*, 3>> half(all.begin(), all.begin() + 4);
    throws([&] { dist::ep_moe<host_device, float>(rt, half, 32, I, E, K, c, {.fp8_dispatch = true}); }, "multiple of 128, not 32");
  });
  CHECK(good == 4);
}

}  // namespace tessel_test_dist_expert_parallel
