// dist/planner.hpp: the closed forms (parameters and memory per card against the model config's
// own count and against each other under ZeRO and recompute), the schedules' bubbles, the pruning
// reasons, and the search's invariants (every plan feasible and within the constraints, ranked,
// every layout counted once).
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <set>
#include <string>

#include <tessel/dist/planner.hpp>

#include "error_match.hpp"

namespace tessel_test_dist_planner {

using namespace tessel;
using dist::pipeline_schedule;
using dist::plan_layout;
using dist::recompute_mode;

namespace {

io::model_config fixture(const char* name) {
  return io::load_model_config(std::filesystem::path(__FILE__).parent_path().parent_path() / "io" / "fixtures" / name);
}

dist::plan_request request(const char* model, std::size_t cards, std::size_t batch, std::size_t seq) {
  dist::plan_request r;
  r.model = fixture(model);
  r.cluster.cards_per_supernode = cards;
  r.global_batch = batch;
  r.seq = seq;
  return r;
}

plan_layout layout(int dp, int tp, int pp, std::size_t mb, std::size_t batch) {
  plan_layout l;
  l.dp = dp, l.tp = tp, l.pp = pp, l.micro_batch = mb, l.micro_batches = batch / std::size_t(dp) / mb;
  return l;
}

}  // namespace

TEST_CASE("planner: the weights of one card on one device are the model's parameter count", "[dist][planner]") {
  for (const char* m : {"llama-3.1-8b.json", "mistral-7b.json", "mixtral-8x7b.json", "qwen2-7b.json"}) {
    INFO(m);
    auto r = request(m, 1, 8, 512);
    r.cluster.card.memory_bytes = std::size_t{1} << 50;  // no memory pruning here
    r.precision.param_bytes = 1;
    const auto e = dist::plan_evaluate(r, layout(1, 1, 1, 1, 8));
    CHECK(e.memory.weights == double(r.model.parameter_count()));
    // ZeRO-0: gradients and optimizer state are per-parameter multiples of the weights
    CHECK(e.memory.grads == e.memory.weights * r.precision.grad_bytes);
    CHECK(e.memory.optimizer == e.memory.weights * (r.precision.master_bytes + r.precision.moment_bytes));
  }
}

TEST_CASE("planner: ZeRO stages shard optimizer state, then gradients, then weights over dp", "[dist][planner]") {
  auto r = request("llama-3.1-8b.json", 8, 64, 2048);
  r.cluster.card.memory_bytes = std::size_t{1} << 50;
  plan_layout l = layout(8, 1, 1, 1, 64);
  dist::plan_memory m[4];
  for (int z = 0; z < 4; ++z) {
    l.zero = z;
    m[z] = dist::plan_evaluate(r, l).memory;
  }
  CHECK(m[1].optimizer == Approx(m[0].optimizer / 8));
  CHECK(m[1].grads == m[0].grads);
  CHECK(m[2].grads == Approx(m[0].grads / 8));
  CHECK(m[2].weights == m[0].weights);
  CHECK(m[3].weights < m[0].weights / 4);  // a shard plus two gathered layers
  CHECK(m[3].activations == m[0].activations);
  CHECK(m[0].total() > m[1].total());
  CHECK(m[1].total() > m[2].total());
  CHECK(m[2].total() > m[3].total());
}

TEST_CASE("planner: recompute and sequence parallelism trade activation memory for time", "[dist][planner]") {
  auto r = request("llama-3.1-8b.json", 16, 64, 4096);
  r.cluster.card.memory_bytes = std::size_t{1} << 50;
  plan_layout l = layout(4, 4, 1, 1, 64);
  dist::plan_estimate e[3];
  const recompute_mode modes[] = {recompute_mode::none, recompute_mode::selective, recompute_mode::full};
  for (int i = 0; i < 3; ++i) {
    l.recompute = modes[i];
    e[i] = dist::plan_evaluate(r, l);
  }
  CHECK(e[0].memory.activations > e[1].memory.activations);
  CHECK(e[1].memory.activations > e[2].memory.activations);
  CHECK(e[0].recompute == 0);
  CHECK(e[0].compute < e[1].compute);
  CHECK(e[1].compute < e[2].compute);
  l.recompute = recompute_mode::none;
  l.sp = true;
  const auto with_sp = dist::plan_evaluate(r, l);
  CHECK(with_sp.memory.activations < e[0].memory.activations);
}

TEST_CASE("planner: the schedules' bubbles follow their closed forms", "[dist][planner]") {
  auto r = request("llama-3.1-8b.json", 16, 64, 2048);
  r.cluster.card.memory_bytes = std::size_t{1} << 50;
  plan_layout l = layout(1, 4, 4, 1, 64);  // 64 micro-batches over 4 stages
  l.recompute = recompute_mode::full;
  const auto f = dist::plan_evaluate(r, l);
  const double pipeline = f.step_time - f.dp_comm - f.optimizer;
  // 1F1B: m slots of the busiest stage, and the fill and drain through each other stage once: at
  // most p - 1 slots of the busiest, at least p - 1 of a layer-only stage (the first and last
  // stages also hold the embedding and the head)
  CHECK(f.bubble / pipeline <= 3.0 / 67.0 + 1e-12);
  CHECK(f.bubble / pipeline >= 0.5 * 3.0 / 67.0);
  // with equal stages (a vocabulary too small to weigh), the textbook (p - 1) / (m + p - 1)
  auto eq = r;
  eq.model.vocab_size = 8;
  const auto fe = dist::plan_evaluate(eq, l);
  CHECK(fe.bubble / (fe.step_time - fe.dp_comm - fe.optimizer) == Approx(3.0 / 67.0).epsilon(0.01));
  l.schedule = pipeline_schedule::zb_h1;
  const auto z = dist::plan_evaluate(r, l);
  CHECK(z.bubble < f.bubble);
  CHECK(z.bubble > 0);
  l.schedule = pipeline_schedule::interleaved;
  l.vpp = 2;
  const auto v2 = dist::plan_evaluate(r, l);
  l.vpp = 4;
  const auto v4 = dist::plan_evaluate(r, l);
  CHECK(v2.bubble < f.bubble);
  CHECK(v4.bubble < v2.bubble);
  CHECK(v4.pp_comm > v2.pp_comm);  // v times the stage crossings
  l.pp = 1, l.tp = 16, l.schedule = pipeline_schedule::one_f_one_b, l.vpp = 1;
  CHECK(dist::plan_evaluate(r, l).bubble == 0);
}

TEST_CASE("planner: layouts that cannot run are pruned with the reason", "[dist][planner]") {
  auto r = request("llama-3.1-8b.json", 16, 64, 2048);
  auto reason = [&](const plan_layout& l) {
    auto why = dist::plan_check(r, l);
    return why ? why->category + ": " + why->reason : std::string();
  };
  CHECK(reason(layout(16, 1, 1, 1, 64)).empty());
  CHECK_THAT(reason(layout(8, 1, 1, 1, 64)), Catch::Contains("is not the 16 cards"));
  auto odd = request("llama-3.1-8b.json", 48, 96, 2048);
  auto why = dist::plan_check(odd, layout(1, 48, 1, 1, 96));
  REQUIRE(why);
  CHECK(why->category == "layout");
  CHECK_THAT(why->reason, Catch::Contains("does not divide the 32 attention heads"));
  auto b = request("llama-3.1-8b.json", 16, 40, 2048);
  why = dist::plan_check(b, layout(16, 1, 1, 1, 48));
  REQUIRE(why);
  CHECK(why->category == "batch");
  plan_layout il = layout(1, 4, 4, 1, 64);
  il.schedule = pipeline_schedule::interleaved;
  il.vpp = 3;  // 4 x 3 does not divide 32 layers
  CHECK_THAT(reason(il), Catch::Contains("does not divide the 32 layers"));
  plan_layout sp = layout(16, 1, 1, 1, 64);
  sp.sp = true;
  CHECK_THAT(reason(sp), Catch::Contains("sequence parallelism needs tp > 1"));
  plan_layout mo = layout(16, 1, 1, 1, 64);
  mo.ep = 2;
  CHECK_THAT(reason(mo), Catch::Contains("model without experts"));
  // memory: 8B parameters with Adam on one 64 GiB card do not fit, and the error says how much
  auto big = request("llama-3.1-8b.json", 1, 8, 2048);
  REQUIRE_THROWS_MATCHES(dist::plan_evaluate(big, layout(1, 1, 1, 1, 8)), dist::dist_error,
                         tessel_test::is_error(errc::config, "dist", "GiB usable"));
}

TEST_CASE("planner: the search ranks feasible plans within the constraints and counts every layout once", "[dist][planner]") {
  auto r = request("llama-3.1-8b.json", 32, 256, 4096);
  const auto all = dist::plan_search(r, 1000000);
  REQUIRE(!all.plans.empty());
  std::size_t pruned = 0;
  for (const auto& [cat, n] : all.pruned) pruned += n;
  CHECK(all.considered == all.feasible + pruned);
  CHECK(all.plans.size() == all.feasible);
  std::set<std::string> names;
  for (std::size_t i = 0; i < all.plans.size(); ++i) {
    const auto& p = all.plans[i];
    INFO(p.layout.to_string());
    CHECK(!dist::plan_check(r, p.layout));
    CHECK(p.memory.total() <= 0.9 * double(r.cluster.card.memory_bytes));
    CHECK(p.step_time > 0);
    CHECK(p.mfu > 0);
    CHECK(p.mfu < 1);
    CHECK(p.step_time == Approx(p.compute + p.tp_comm + p.pp_comm + p.ep_comm + p.zero_comm + p.bubble + p.dp_comm + p.optimizer).epsilon(1e-9));
    if (i) CHECK(all.plans[i - 1].step_time <= p.step_time);
    CHECK(names.insert(p.layout.to_string()).second);  // no layout twice
  }
  // constraints pin what they name
  r.constraints.tp = 2;
  r.constraints.zero_stages = {1};
  r.constraints.built_only = true;
  const auto pinned = dist::plan_search(r, 50);
  REQUIRE(!pinned.plans.empty());
  for (const auto& p : pinned.plans) {
    CHECK(p.layout.tp == 2);
    CHECK(p.layout.zero == 1);
    CHECK(p.built);
  }
  CHECK(pinned.pruned.count("not built"));
  // the explanation names the two plans and a component
  const auto why = dist::plan_explain(all.plans[0], all.plans.back());
  CHECK_THAT(why, Catch::Contains(all.plans[0].layout.to_string()));
  CHECK_THAT(why, Catch::Contains(" ms"));
  const auto j = dist::to_json(pinned);
  CHECK(j["plans"].size() == pinned.plans.size());
  CHECK(j["plans"][0]["layout"]["tp"] == 2);
}

TEST_CASE("planner: a MoE model's experts split over ep and their all-to-all is priced", "[dist][planner]") {
  auto r = request("mixtral-8x7b.json", 16, 64, 2048);
  r.cluster.card.memory_bytes = std::size_t{1} << 50;
  plan_layout l = layout(16, 1, 1, 1, 64);
  const auto e1 = dist::plan_evaluate(r, l);
  l.ep = 8;
  const auto e8 = dist::plan_evaluate(r, l);
  CHECK(e1.ep_comm == 0);
  CHECK(e8.ep_comm > 0);
  CHECK(e8.memory.weights < e1.memory.weights / 4);
  CHECK(e8.dp_comm < e1.dp_comm);  // expert gradients reduce over dp / ep replicas only
}

TEST_CASE("planner: bad requests are errors that name the problem", "[dist][planner]") {
  auto r = request("llama-3.1-8b.json", 16, 64, 2048);
  r.global_batch = 0;
  REQUIRE_THROWS_MATCHES(dist::plan_search(r), dist::dist_error, tessel_test::is_error(errc::invalid_argument, "dist", "global batch"));
  r.global_batch = 64;
  r.cards = 17;
  REQUIRE_THROWS_MATCHES(dist::plan_search(r), dist::dist_error, tessel_test::is_error(errc::invalid_argument, "dist", "17 cards"));
  r.cards = 0;
  r.constraints.memory_fraction = 1.5;
  REQUIRE_THROWS_MATCHES(dist::plan_search(r), dist::dist_error, tessel_test::is_error(errc::invalid_argument, "dist", "memory_fraction"));
  r.constraints.memory_fraction = 0.9;
  r.cluster.fabric.planes = 0;
  CHECK_THROWS_AS(dist::plan_search(r), emu::config_error);
  // nothing fits: an empty ranking, and the memory reason is kept
  auto tiny = request("llama-3.1-8b.json", 2, 2, 4096);
  tiny.cluster.card.memory_bytes = std::size_t{1} << 30;
  const auto none = dist::plan_search(tiny);
  CHECK(none.plans.empty());
  CHECK(none.pruned.count("memory"));
}

}  // namespace tessel_test_dist_planner
