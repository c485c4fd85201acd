// Parallel layouts (tessel/dist/layout.hpp) and their process groups (tessel/dist/groups.hpp): the
// rank <-> (dp, tp) map is a bijection, bad layouts are typed errors naming the numbers before any
// work, and the tp and dp groups reduce over exactly their members, concurrently, in a fixed order.
#include <catch2/catch.hpp>

#include <array>

#include <set>
#include <string>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/dist.hpp>

#include "error_match.hpp"
#include "dist/thread_check.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_dist_layout {

using namespace tessel;
using tessel_test::is_error;

namespace {
io::model_config llama(std::size_t heads, std::size_t kv, std::size_t inter) {
  return io::parse_model_config(R"({"model_type": "llama", "vocab_size": 37, "hidden_size": 64, "intermediate_size": )" + std::to_string(inter) +
                                R"(, "num_hidden_layers": 1, "num_attention_heads": )" + std::to_string(heads) + R"(, "num_key_value_heads": )" +
                                std::to_string(kv) + R"(, "head_dim": 16, "hidden_act": "silu"})");
}
}  // namespace

TEST_CASE("dist layout: rank to (dp, tp) and back is a bijection with tp fastest", "[dist][layout]") {
  for (int dp = 1; dp <= 5; ++dp)
    for (int tp = 1; tp <= 5; ++tp) {
      const dist::parallel_layout l{.dp = dp, .tp = tp};
      REQUIRE(l.world_size() == dp * tp);
      std::set<std::pair<int, int>> seen;
      for (int r = 0; r < dp * tp; ++r) {
        const auto c = l.coords(r);
        CHECK(c.tp == r % tp);
        CHECK(c.dp == r / tp);
        CHECK(l.rank_of(c) == r);
        seen.insert({c.dp, c.tp});
      }
      CHECK(seen.size() == std::size_t(dp * tp));
    }
}

TEST_CASE("dist layout: bad layouts are typed errors naming the numbers", "[dist][layout][errors]") {
  const dist::parallel_layout l{.dp = 2, .tp = 3};
  CHECK_THROWS_MATCHES(l.validate(4), dist::dist_error, is_error(errc::config, "dist", "needs dp·tp·pp = 6 ranks, the world has 4"));
  CHECK_NOTHROW(l.validate(6));
  CHECK_THROWS_MATCHES((dist::parallel_layout{.dp = 0, .tp = 2}.validate(2)), dist::dist_error, is_error(errc::config, "dist", "at least 1"));
  CHECK_NOTHROW((dist::parallel_layout{.dp = 1, .tp = 1, .pp = 2}.validate(2)));
  CHECK_THROWS_MATCHES((dist::parallel_layout{.dp = 1, .tp = 1, .pp = 2, .ep = 2}.validate(2)), dist::dist_error,
                       is_error(errc::config, "dist", "ep = 2 does not divide dp = 1"));
  CHECK_THROWS_MATCHES((dist::parallel_layout{.dp = 6, .ep = 4}.validate(6)), dist::dist_error,
                       is_error(errc::config, "dist", "ep = 4 does not divide dp = 6"));
  CHECK_NOTHROW((dist::parallel_layout{.dp = 4, .tp = 2, .ep = 2}.validate(8)));
  CHECK_NOTHROW((dist::parallel_layout{.dp = 2, .tp = 1, .zero_stage = 1}.validate(2)));
  CHECK_THROWS_MATCHES((dist::parallel_layout{.dp = 2, .tp = 1, .zero_stage = 2}.validate(2)), dist::dist_error,
                       is_error(errc::unsupported, "dist", "ZeRO stage 2"));
  CHECK_THROWS_MATCHES((dist::parallel_layout{.zero_stage = 4}.validate(1)), dist::dist_error, is_error(errc::config, "dist", "ZeRO stage 4"));
  CHECK_THROWS_MATCHES(l.coords(6), dist::dist_error, is_error(errc::out_of_range, "dist", "rank 6"));
  CHECK_THROWS_MATCHES(l.rank_of({.dp = 0, .tp = 3}), dist::dist_error, is_error(errc::out_of_range, "dist", "tp 3"));

  const dist::parallel_layout t2{.tp = 2}, t4{.tp = 4};
  CHECK_NOTHROW(t2.validate(llama(4, 2, 96)));
  CHECK_THROWS_MATCHES(t2.validate(llama(3, 3, 96)), dist::dist_error,
                       is_error(errc::config, "dist", "tp = 2 does not divide the 3 attention heads"));
  CHECK_THROWS_MATCHES(t2.validate(llama(6, 3, 96)), dist::dist_error,
                       is_error(errc::config, "dist", "tp = 2 and the 3 kv heads: one must divide the other"));
  CHECK_NOTHROW(t4.validate(llama(4, 2, 96)));  // each kv head replicated on 2 ranks
  CHECK_NOTHROW(t4.validate(llama(8, 1, 96)));  // multi-query: the one kv head on every rank
  CHECK_THROWS_MATCHES((dist::parallel_layout{.tp = 6}.validate(llama(12, 4, 96))), dist::dist_error,
                       is_error(errc::config, "dist", "tp = 6 and the 4 kv heads"));
  CHECK_THROWS_MATCHES(t2.validate(llama(4, 2, 95)), dist::dist_error, is_error(errc::config, "dist", "does not divide the intermediate size 95"));
  CHECK_THROWS_MATCHES((dist::parallel_layout{.dp = 2, .ep = 2}.validate(llama(4, 2, 96))), dist::dist_error,
                       is_error(errc::config, "dist", "ep = 2 for a model without experts"));
  io::model_config moe = llama(4, 2, 96);
  moe.num_local_experts = 6, moe.num_experts_per_tok = 2;
  CHECK_NOTHROW((dist::parallel_layout{.dp = 2, .ep = 2}.validate(moe)));
  CHECK_THROWS_MATCHES((dist::parallel_layout{.dp = 4, .ep = 4}.validate(moe)), dist::dist_error,
                       is_error(errc::config, "dist", "ep = 4 does not divide the 6 experts"));
}

TEST_CASE("dist groups: ep splits blocks of consecutive dp replicas, edp joins the replicas holding the same experts", "[dist][groups]") {
  const dist::parallel_layout l{.dp = 4, .tp = 2, .ep = 2};
  std::vector<std::array<double, 2>> got(8);
  threads_world::run(8, [&](threads_transport t) {
    const int r = t.rank();
    dist::process_groups g(t, l);
    TS_CHECK(g.ep().size() == 2);
    TS_CHECK(g.edp().size() == 2);
    TS_CHECK(g.ep().rank() == g.coords().dp % 2);
    TS_CHECK(g.edp().rank() == g.coords().dp / 2);
    double v = double(1 << r), a = 0, b = 0;
    g.ep().all_reduce(std::span<const double>(&v, 1), std::span<double>(&a, 1), reduce_op::sum);
    g.edp().all_reduce(std::span<const double>(&v, 1), std::span<double>(&b, 1), reduce_op::sum);
    got[std::size_t(r)] = {a, b};
  });
  for (int r = 0; r < 8; ++r) {
    const auto c = l.coords(r);
    double ep_sum = 0, edp_sum = 0;
    for (int i = 0; i < 2; ++i) ep_sum += double(1 << l.rank_of({.dp = c.dp / 2 * 2 + i, .tp = c.tp}));
    for (int i = c.dp % 2; i < 4; i += 2) edp_sum += double(1 << l.rank_of({.dp = i, .tp = c.tp}));
    CHECK(got[std::size_t(r)][0] == ep_sum);
    CHECK(got[std::size_t(r)][1] == edp_sum);
  }
}

TEST_CASE("dist groups: a layout that does not fit the world fails before any message", "[dist][groups][errors]") {
  // Each rank throws on its own, without waiting for a peer: the run ends instead of hanging.
  CHECK_THROWS_MATCHES(threads_world::run(3, [](threads_transport t) { dist::process_groups g(t, {.dp = 2, .tp = 2}); }), dist::dist_error,
                       is_error(errc::config, "dist", "the world has 3"));
}

TEST_CASE("dist groups: tp and dp groups of a 2x3 layout reduce over their members only", "[dist][groups]") {
  const dist::parallel_layout l{.dp = 2, .tp = 3};
  std::vector<std::vector<double>> got(6);
  threads_world::run(6, [&](threads_transport t) {
    const int r = t.rank();
    dist::process_groups g(t, l);
    TS_CHECK(g.coords() == l.coords(r));
    TS_CHECK(g.tp().size() == 3);
    TS_CHECK(g.dp().size() == 2);
    TS_CHECK(g.tp().rank() == g.coords().tp);
    TS_CHECK(g.dp().rank() == g.coords().dp);
    // tp, dp and world collectives interleaved, several times: separate tag spaces keep them apart.
    std::vector<double> out;
    for (int rep = 0; rep < 3; ++rep) {
      double v = double(1 << r), s = 0;
      g.tp().all_reduce(std::span<const double>(&v, 1), std::span<double>(&s, 1), reduce_op::sum);
      out.push_back(s);
      g.dp().all_reduce(std::span<const double>(&v, 1), std::span<double>(&s, 1), reduce_op::sum);
      out.push_back(s);
      g.world().all_reduce(std::span<const double>(&v, 1), std::span<double>(&s, 1), reduce_op::sum);
      out.push_back(s);
    }
    got[std::size_t(r)] = out;
  });
  for (int r = 0; r < 6; ++r) {
    const auto c = l.coords(r);
    double tp_sum = 0, dp_sum = 0;
    for (int i = 0; i < 3; ++i) tp_sum += double(1 << l.rank_of({.dp = c.dp, .tp = i}));
    for (int i = 0; i < 2; ++i) dp_sum += double(1 << l.rank_of({.dp = i, .tp = c.tp}));
    for (int rep = 0; rep < 3; ++rep) {
      CHECK(got[std::size_t(r)][std::size_t(3 * rep)] == tp_sum);
      CHECK(got[std::size_t(r)][std::size_t(3 * rep + 1)] == dp_sum);
      CHECK(got[std::size_t(r)][std::size_t(3 * rep + 2)] == 63.0);
    }
  }
}

}  // namespace tessel_test_dist_layout
