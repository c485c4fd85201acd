// Elastic training on the emulated cluster (dist/elastic.hpp): a card that dies mid-training is
// detected, the survivors revoke and agree, a hot spare (or the swapped card) takes the dead
// rank's place, and every rank rolls back to the newest snapshot all of them hold in memory (the
// new card's from its buddy's copy). The proof is bitwise: the losses of every step and the final
// parameters equal those of the same job run without the failure. When a rank and its buddy die
// together no memory copy is left: the job restarts from its durable tier, and still ends with
// the same bits. Recovery times are checked against the monitor's detection bound.
#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <unistd.h>

#include <tessel/collectives.hpp>
#include <tessel/collectives/transport/emulated.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/dist.hpp>
#include <tessel/nn.hpp>

#include "error_match.hpp"
#include "dist/layout_run.hpp"
#include "dist/thread_check.hpp"

namespace tessel_test_dist_elastic {

using namespace tessel;
using tessel_test::is_error;
namespace fs = std::filesystem;

namespace {

emu::cluster_config cluster_of(std::size_t cards) {
  emu::cluster_config cfg;
  cfg.cards_per_supernode = cards;
  cfg.card.memory_bytes = std::size_t{1} << 30;
  cfg.faults.op_timeout = 10e-3;
  return cfg;
}

// What a run produced: each step's loss (rank 0's; a step redone after a recovery must repeat
// its bits), each step's simulated end time, and every rank's parameters at the end.
struct outcome {
  std::map<std::uint64_t, double> loss;
  std::map<std::uint64_t, double> step_end;
  std::map<int, std::map<std::string, std::vector<float>>> params;
  int redo_mismatches = 0;
  int restores = 0;
};

struct job_spec {
  int dp = 2, tp = 2, zero = 1;
  std::uint64_t steps = 6;
  std::vector<dist::checkpoint_tier> tiers;  // saved through a tiered_checkpointer when not empty
  bool throw_at_step3 = false;               // a job error that is no fault
};

// The tiny Llama on dp x tp (ZeRO-`zero`), snapshotting after every step.
auto elastic_job(const job_spec& sp, outcome& out, std::mutex& mu) {
  return [&sp, &out, &mu](dist::elastic_rank& er) {
    const int dp_n = er.size() / sp.tp;  // (shrink: fewer replicas after a recovery, the same global batch)
    dist::process_groups grp(er.transport(), {.dp = dp_n, .tp = sp.tp, .zero_stage = sp.zero});
    host_device dv(1);
    dist::tp_decoder_lm<host_device> m(dv, tessel_test::layout_run_llama(), grp.tp());
    nn::load_options lo;
    lo.allow_unexpected = true;
    m.load(tessel_test::layout_run_checkpoint(), lo);
    dist::pipeline pipe(m, {.micro_batches = 1});
    dist::data_parallel dp(pipe, grp.dp(), {.bucket_bytes = 4 << 10, .zero_stage = sp.zero});
    nn::adamw_config h;
    h.hyper.lr = 1e-3f;
    h.hyper.weight_decay = 0.01f;
    std::optional<dist::tiered_checkpointer> tiers;
    if (!sp.tiers.empty()) tiers.emplace(sp.tiers);
    const auto st = er.restore(dp, grp.world());
    if (st) {
      std::lock_guard lk(mu);
      ++out.restores;
    }
    constexpr std::size_t B = 4, S = 6;
    const std::size_t b = B / std::size_t(dp_n), off = std::size_t(grp.coords().dp) * b * S;
    for (std::uint64_t step = st ? st->step : 0; step < sp.steps; ++step) {
      if (sp.throw_at_step3 && step == 3 && er.rank() == 1) throw std::logic_error("the job's own bug");
      const auto data = tessel_test::make_batch(300 + step, B, S, 37);
      const double loss = dp.forward_backward(std::span(data.ids).subspan(off, b * S), std::span(data.targets).subspan(off, b * S), b, S);
      // the loss is the step's as soon as it is computed: a failure in the snapshot or the tier
      // save after it may resume past this step (the snapshot held), and a step redone must repeat it
      if (er.rank() == 0) {
        std::lock_guard lk(mu);
        const auto [it, fresh] = out.loss.emplace(step, loss);
        if (!fresh && std::memcmp(&it->second, &loss, sizeof loss) != 0) ++out.redo_mismatches;
      }
      dp.adamw(h, step + 1);
      er.snapshot(dp, grp.world(), {.step = step + 1});
      if (tiers) tiers->save(step + 1, dp, grp.world());
      if (er.rank() == 0) {
        std::lock_guard lk(mu);
        out.step_end[step] = grp.world().now();
      }
    }
    if (tiers) tiers->wait(grp.world());
    std::lock_guard lk(mu);
    auto& mine = out.params[er.rank()];
    mine.clear();
    for (auto& p : m.params()) mine[p.name].assign(p.value.data(), p.value.data() + p.numel);
  };
}

outcome run(emu::cluster& cl, std::vector<std::size_t> cards, dist::elastic_options o, const job_spec& sp, dist::elastic_report* rep = nullptr) {
  outcome out;
  std::mutex mu;
  tessel_test::layout_run_checkpoint();  // the initialisation file, written once before the ranks read it
  auto r = dist::elastic_run(cl, std::move(cards), std::move(o), elastic_job(sp, out, mu));
  if (rep) *rep = r;
  return out;
}

std::string diff(const outcome& a, const outcome& b) {
  if (a.loss.size() != b.loss.size()) {
    std::string m = "step counts differ:";
    for (const auto* o : {&a, &b}) {
      m += " {";
      for (const auto& [s, l] : o->loss) m += " " + std::to_string(s);
      m += " }";
    }
    return m;
  }
  for (const auto& [s, l] : a.loss)
    if (!b.loss.count(s) || std::memcmp(&l, &b.loss.at(s), sizeof l) != 0) return "the loss of step " + std::to_string(s) + " differs";
  if (a.params.size() != b.params.size()) return "rank counts differ";
  for (const auto& [r, ps] : a.params)
    for (const auto& [name, v] : ps) {
      const auto& w = b.params.at(r).at(name);
      if (w.size() != v.size() || std::memcmp(v.data(), w.data(), v.size() * sizeof(float)) != 0)
        return "rank " + std::to_string(r) + "'s " + name + " differs";
    }
  return {};
}

// The uninterrupted run: the reference bits and each step's simulated end.
outcome reference(const job_spec& sp) {
  emu::cluster cl(cluster_of(4), 1);
  return run(cl, {0, 1, 2, 3}, {}, sp);
}

}  // namespace

TEST_CASE("elastic: a card dying mid-training is replaced by a hot spare, and training ends with the bits of a run without the failure",
          "[dist][elastic]") {
  job_spec sp;
  const outcome ref = reference(sp);
  REQUIRE(ref.loss.size() == sp.steps);
  REQUIRE(ref.step_end.size() == sp.steps);
  for (int zero : {1, 0}) {
    sp.zero = zero;
    const outcome want = zero == 1 ? ref : reference(sp);
    // card 1 dies in the middle of step 3 (of 0..5)
    const double at = (want.step_end.at(2) + want.step_end.at(3)) / 2;
    emu::cluster cl(cluster_of(6), 1);
    cl.schedule({at, emu::fault_kind::card_down, 1, 0, 0});
    dist::elastic_report rep;
    dist::elastic_options o;
    o.spares = {4, 5};
    const outcome got = run(cl, {0, 1, 2, 3}, o, sp, &rep);
    INFO("ZeRO-" << zero);
    CHECK(diff(got, want) == "");
    CHECK(got.redo_mismatches == 0);
    REQUIRE(rep.recoveries.size() == 1);
    const auto& r = rep.recoveries[0];
    CHECK(rep.rounds == 2);
    CHECK(r.rank == 1);
    CHECK(r.failed_card == 1);
    CHECK(r.replacement_card == 4);
    CHECK(r.source == "peer memory");
    CHECK(r.step == 3);  // the snapshot after step 2 (0-based), the newest every rank held
    CHECK(r.happened == Approx(at));
    CHECK(r.detect() >= 0);
    CHECK(r.detect() <= cl.net().detection_bound() * (1 + 1e-9));
    CHECK(r.agree() >= 0);
    CHECK(r.agree() < 1e-3);  // a revoke and an agreement: microseconds, not the 10 ms op timeout
    CHECK(r.restore() > 0);
    CHECK(r.warm_up() > 0);
    CHECK(got.restores == 4);  // every rank of the second world restored
  }
}

TEST_CASE("elastic: without a spare, the hot-swapped card takes its own place back once it returns", "[dist][elastic]") {
  job_spec sp;
  sp.steps = 5;
  const outcome want = reference(sp);
  const double at = (want.step_end.at(1) + want.step_end.at(2)) / 2, swap = 2e-3;
  emu::cluster cl(cluster_of(4), 1);
  cl.schedule({at, emu::fault_kind::hot_swap, 2, 0, swap});
  dist::elastic_report rep;
  const outcome got = run(cl, {0, 1, 2, 3}, {}, sp, &rep);
  CHECK(diff(got, want) == "");
  REQUIRE(rep.recoveries.size() == 1);
  CHECK(rep.recoveries[0].replacement_card == 2);
  CHECK(rep.recoveries[0].restored >= at + swap);  // it came back empty, then restored from its buddy
}

TEST_CASE("elastic: a rank and its buddy dying together leave no memory copy: the job restarts from its durable tier", "[dist][elastic]") {
  const fs::path dir = fs::temp_directory_path() / ("dist_elastic_tier_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  job_spec sp;
  sp.tiers = {{.dir = dir / "ref", .every = 2, .keep = 2}};
  const outcome want = reference(sp);
  sp.tiers = {{.dir = dir / "run", .every = 2, .keep = 2}};
  const double at = (want.step_end.at(3) + want.step_end.at(4)) / 2;
  emu::cluster cl(cluster_of(6), 1);
  // rank 2's copy lives on rank 3 (failure_domain 1): both die at once
  cl.schedule({at, emu::fault_kind::card_down, 2, 0, 0});
  cl.schedule({at, emu::fault_kind::card_down, 3, 0, 0});
  dist::elastic_options o;
  o.spares = {4, 5};
  o.tiers = sp.tiers;
  dist::elastic_report rep;
  const outcome got = run(cl, {0, 1, 2, 3}, o, sp, &rep);
  CHECK(diff(got, want) == "");
  CHECK(got.redo_mismatches == 0);
  REQUIRE(rep.recoveries.size() == 2);
  for (const auto& r : rep.recoveries) CHECK(r.source == "durable tier");
  CHECK(rep.recoveries[0].replacement_card == 4);
  CHECK(rep.recoveries[1].replacement_card == 5);
  // with failure domains of 2 cards the copies of ranks 2 and 3 live on ranks 0 and 1: memory suffices
  emu::cluster cl2(cluster_of(6), 1);
  cl2.schedule({at, emu::fault_kind::card_down, 2, 0, 0});
  cl2.schedule({at, emu::fault_kind::card_down, 3, 0, 0});
  o.failure_domain = 2;
  fs::remove_all(dir / "run");
  const outcome got2 = run(cl2, {0, 1, 2, 3}, o, sp, &rep);
  CHECK(diff(got2, want) == "");
  REQUIRE(rep.recoveries.size() == 2);
  for (const auto& r : rep.recoveries) CHECK(r.source == "peer memory");
  fs::remove_all(dir);
}

TEST_CASE("elastic: shrink drops the data-parallel replica that lost a card and trains on with the same global batch", "[dist][elastic]") {
  job_spec sp;
  sp.zero = 0;
  const outcome want = reference(sp);
  const double at = (want.step_end.at(2) + want.step_end.at(3)) / 2;
  emu::cluster cl(cluster_of(4), 1);
  cl.schedule({at, emu::fault_kind::card_down, 1, 0, 0});
  dist::elastic_options o;
  o.policy = dist::recovery_policy::shrink;
  o.layout = {.dp = 2, .tp = 2};
  dist::elastic_report rep;
  const outcome got = run(cl, {0, 1, 2, 3}, o, sp, &rep);
  REQUIRE(rep.recoveries.size() == 1);
  CHECK(rep.recoveries[0].replacement_card == SIZE_MAX);
  CHECK(rep.recoveries[0].source == "peer memory");
  CHECK(rep.recoveries[0].step == 3);
  CHECK(got.params.size() == 2);  // one replica of tp 2 left
  CHECK(got.redo_mismatches == 0);
  REQUIRE(got.loss.size() == want.loss.size());
  for (const auto& [step, l] : want.loss) {
    INFO("step " << step);
    if (step < 3)
      CHECK(std::memcmp(&l, &got.loss.at(step), sizeof l) == 0);  // before the failure: the same world
    else
      CHECK(got.loss.at(step) == Approx(l).epsilon(1e-5));  // one replica's mean over the whole batch: another summation order
  }
  // ZeRO-1's moment shards would need re-sharding over the new dp: refused by name
  sp.zero = 1;
  emu::cluster cl2(cluster_of(4), 1);
  cl2.schedule({at, emu::fault_kind::card_down, 1, 0, 0});
  CHECK_THROWS_MATCHES(run(cl2, {0, 1, 2, 3}, o, sp), dist::dist_error, is_error(errc::unsupported, "dist", "re-shards ZeRO-1"));
  // every replica losing a card leaves nothing to shrink to
  sp.zero = 0;
  emu::cluster cl3(cluster_of(4), 1);
  cl3.schedule({at, emu::fault_kind::card_down, 1, 0, 0});
  cl3.schedule({at, emu::fault_kind::card_down, 2, 0, 0});
  CHECK_THROWS_MATCHES(run(cl3, {0, 1, 2, 3}, o, sp), dist::dist_error, is_error(errc::fault, "dist", "every data-parallel replica"));
}

TEST_CASE("elastic: errors — no spare and no swap, a job's own error, bad cards", "[dist][elastic][errors]") {
  job_spec sp;
  sp.steps = 4;
  const outcome want = reference(sp);
  {
    emu::cluster cl(cluster_of(4), 1);
    cl.schedule({(want.step_end.at(1) + want.step_end.at(2)) / 2, emu::fault_kind::card_down, 3, 0, 0});
    CHECK_THROWS_MATCHES(run(cl, {0, 1, 2, 3}, {}, sp), dist::dist_error, is_error(errc::fault, "dist", "no spare card"));
  }
  {
    emu::cluster cl(cluster_of(4), 1);
    job_spec bug = sp;
    bug.throw_at_step3 = true;
    CHECK_THROWS_MATCHES(run(cl, {0, 1, 2, 3}, {}, bug), std::logic_error, Catch::Matchers::Message("the job's own bug"));
  }
  emu::cluster cl(cluster_of(4), 1);
  dist::elastic_options o;
  CHECK_THROWS_MATCHES(run(cl, {0, 1, 1, 2}, o, sp), dist::dist_error, is_error(errc::invalid_argument, "dist", "named twice"));
  o.spares = {1};
  CHECK_THROWS_MATCHES(run(cl, {0, 1, 2, 3}, o, sp), dist::dist_error, is_error(errc::invalid_argument, "dist", "spare card 1"));
  o.spares = {7};
  CHECK_THROWS_MATCHES(run(cl, {0, 1, 2, 3}, o, sp), dist::dist_error, is_error(errc::invalid_argument, "dist", "spare card 7"));
  CHECK_THROWS_MATCHES(run(cl, {}, {}, sp), dist::dist_error, is_error(errc::invalid_argument, "dist", "no cards"));
}

}  // namespace tessel_test_dist_elastic
