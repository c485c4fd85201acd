#include <catch2/catch.hpp>

#include <random>
#include <tessel/emulator/fabric.hpp>
#include "error_match.hpp"

namespace tessel_test_emulator_fabric {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel::emu;

namespace {
cluster_config small(std::size_t cards, std::size_t planes = 8) {
  cluster_config c;
  c.cards_per_supernode = cards;
  c.fabric.planes = planes;
  c.fabric.ports_per_card = planes;
  return c;
}
double finish_all(fabric& f, const std::vector<fabric::msg_id>& ids) {
  double t = 0;
  for (auto id : ids) {
    f.run_until_done(id);
    REQUIRE(f.state(id) == msg_state::done);
    t = std::max(t, f.completion_time(id));
  }
  return t;
}
}  // namespace

TEST_CASE("one transfer takes latency + S / (planes x port bandwidth)", "[emulator][fabric]") {
  for (std::uint64_t S : {std::uint64_t{1}, std::uint64_t{4096}, std::uint64_t{65536}, std::uint64_t{1} << 20, std::uint64_t{100} << 20}) {
    for (std::size_t planes : {1, 4, 8}) {
      auto c = small(4, planes);
      fabric f(c);
      auto id = f.post(1, 2, S, 0);
      f.run();
      double expect = c.direct_latency() + static_cast<double>(S) / (static_cast<double>(planes) * c.fabric.port_bandwidth);
      CHECK(f.completion_time(id) == Approx(expect).epsilon(0.01));
    }
  }
}

TEST_CASE("ring of n cards: 2(n-1) steps of S/n", "[emulator][fabric]") {
  for (std::size_t n : {2, 5, 8}) {
    auto c = small(n);
    fabric f(c);
    const std::uint64_t S = 64ull << 20;
    double t = 0;
    for (std::size_t step = 0; step < 2 * (n - 1); ++step) {
      std::vector<fabric::msg_id> ids;
      for (std::size_t r = 0; r < n; ++r) ids.push_back(f.post(r, (r + 1) % n, S / n, t));
      t = finish_all(f, ids);
    }
    double expect = 2.0 * static_cast<double>(n - 1) * (c.direct_latency() + static_cast<double>(S / n) / c.card_bandwidth());
    CHECK(t == Approx(expect).epsilon(0.01));
  }
}

TEST_CASE("k-to-1 incast shares the receiver's ports", "[emulator][fabric]") {
  for (std::size_t k : {2, 7, 16}) {
    auto c = small(k + 1);
    fabric f(c);
    const std::uint64_t S = 8ull << 20;
    std::vector<fabric::msg_id> ids;
    for (std::size_t s = 1; s <= k; ++s) ids.push_back(f.post(s, 0, S, 0));
    double t = finish_all(f, ids);
    CHECK(t == Approx(static_cast<double>(k * S) / c.card_bandwidth() + c.direct_latency()).epsilon(0.01));
    // the queue built at the switch side of the receiver's ports
    std::uint64_t q = 0;
    for (std::size_t p = 0; p < c.fabric.planes; ++p) q = std::max(q, f.stats_of(f.down(0, p)).max_queue_bytes);
    CHECK(q > 0);
  }
}

TEST_CASE("a failed plane drops pair bandwidth by exactly its share", "[emulator][fabric][faults]") {
  auto c = small(4);
  const std::uint64_t S = 64ull << 20;
  for (int what = 0; what < 3; ++what) {
    fabric f(c);
    if (what == 0) f.schedule_fault({0, fault_kind::plane_down, 0, 3, 0});
    if (what == 1) f.schedule_fault({0, fault_kind::link_down, 0, 5, 0});  // sender's link
    if (what == 2) f.schedule_fault({0, fault_kind::link_down, 1, 6, 0});  // receiver's link
    f.run_until(1e-5);                                                     // detection
    const double t0 = f.now();
    auto id = f.post(0, 1, S, t0);
    f.run_until_done(id);
    REQUIRE(f.state(id) == msg_state::done);
    double bw = c.card_bandwidth() * 7.0 / 8.0;
    CHECK(f.latency(id) == Approx(c.direct_latency() + static_cast<double>(S) / bw).epsilon(0.01));
    CHECK(f.via(id) == -1);
  }
}

TEST_CASE("no common plane: traffic takes a 2-hop path through another card", "[emulator][fabric][routing]") {
  auto c = small(6);
  fabric f(c);
  for (std::size_t p = 1; p < 8; ++p) f.schedule_fault({0, fault_kind::link_down, 0, p, 0});  // card 0 keeps plane 0
  f.schedule_fault({0, fault_kind::link_down, 1, 0, 0});                                      // card 1 lost plane 0
  f.run_until(1e-5);
  const std::uint64_t S = 4ull << 20;
  auto id = f.post(0, 1, S, f.now());
  f.run_until_done(id);
  REQUIRE(f.state(id) == msg_state::done);
  CHECK(f.via(id) >= 2);
  // one plane out of card 0, then 8 (well, 7 usable by card 1) from the transit card
  double expect = 2 * c.direct_latency() + c.fabric.transit_latency + static_cast<double>(S) / c.link_bandwidth();
  CHECK(f.latency(id) == Approx(expect).epsilon(0.01));
  CHECK(f.route_computations() >= 1);
}

TEST_CASE("static plane assignment uses one plane per pair", "[emulator][fabric][routing]") {
  auto c = small(4);
  c.fabric.routing = routing_policy::static_plane;
  fabric f(c);
  const std::uint64_t S = 8ull << 20;
  auto id = f.post(0, 1, S, 0);
  f.run();
  CHECK(f.latency(id) == Approx(c.direct_latency() + static_cast<double>(S) / c.link_bandwidth()).epsilon(0.01));
}

TEST_CASE("traffic shaping bounds the receiver queue and keeps throughput", "[emulator][fabric][shaping]") {
  auto c = small(17);
  c.fabric.shaping = true;
  fabric f(c);
  const std::uint64_t S = 4ull << 20;
  std::vector<fabric::msg_id> ids;
  for (std::size_t s = 1; s <= 16; ++s) ids.push_back(f.post(s, 0, S, 0));
  double t = finish_all(f, ids);
  const double ideal = 16.0 * static_cast<double>(S) / c.card_bandwidth() + c.direct_latency();
  CHECK(t >= ideal * 0.999);
  CHECK(t <= ideal * 1.05);
  for (std::size_t p = 0; p < c.fabric.planes; ++p) CHECK(f.stats_of(f.down(0, p)).max_queue_bytes <= c.fabric.shaping_window);
}

TEST_CASE("scale-out: super-nodes joined through per-card NICs", "[emulator][fabric][scaleout]") {
  auto c = small(4);
  c.scaleout.supernodes = 3;
  c.scaleout.spines = 2;  // leaf-spine links at 2x NIC speed: one flow is NIC-bound
  fabric f(c);
  const std::uint64_t S = 16ull << 20;
  auto id = f.post(1, 9, S, 0);  // super-node 0 -> 2
  auto local = f.post(2, 3, S, 0);
  f.run();
  const double lat = 4 * c.scaleout.link_latency + 3 * c.scaleout.switch_latency;
  CHECK(f.latency(id) == Approx(lat + static_cast<double>(S) / c.scaleout.nic_bandwidth).epsilon(0.01));
  CHECK(f.latency(local) == Approx(c.direct_latency() + static_cast<double>(S) / c.card_bandwidth()).epsilon(0.01));
}

TEST_CASE("a dead card is reported within the heartbeat bound and its transfers fail", "[emulator][fabric][faults]") {
  auto c = small(4);
  fabric f(c);
  std::vector<failure_notice> seen;
  f.on_failure = [&](const failure_notice& n) { seen.push_back(n); };
  const double tf = 123.4e-6;
  f.schedule_fault({tf, fault_kind::card_down, 2, 0, 0});
  auto id = f.post(0, 2, 1ull << 30, 100e-6);  // still running at tf
  f.run_until_done(id);
  REQUIRE(f.state(id) == msg_state::failed);
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].card == 2);
  CHECK(seen[0].detected - seen[0].happened <= f.detection_bound());
  CHECK(seen[0].detected > seen[0].happened);
  CHECK(f.known_failed(2));
  try {
    f.rethrow_if_failed(id);
    FAIL("expected card_failed_error");
  } catch (const card_failed_error& e) {
    CHECK(e.card == 2);
    CHECK(e.at <= tf + f.detection_bound());
  }
  // a new transfer to the dead card fails at once, naming it
  auto late = f.post(1, 2, 100, f.now());
  f.run_until_done(late);
  CHECK_THROWS_AS(f.rethrow_if_failed(late), card_failed_error);
}

TEST_CASE("no path and no transit: the wait ends with a link error at the timeout", "[emulator][fabric][faults]") {
  auto c = small(3, 2);
  c.fabric.ports_per_card = 2;
  c.fabric.transit = false;
  c.faults.op_timeout = 50e-6;
  fabric f(c);
  f.schedule_fault({0, fault_kind::link_down, 0, 0, 0});
  f.schedule_fault({0, fault_kind::link_down, 1, 1, 0});
  f.run_until(1e-5);
  auto id = f.post(0, 1, 4096, f.now());
  f.run_until_done(id);
  REQUIRE(f.state(id) == msg_state::failed);
  try {
    f.rethrow_if_failed(id);
    FAIL("expected link_failed_error");
  } catch (const link_failed_error& e) {
    CHECK(e.card == 0);
    CHECK(e.plane == 0);
    CHECK(e.at == Approx(f.post_time(id) + 50e-6));
  }
}

TEST_CASE("a link that fails mid-transfer: chunks are resent on the other planes", "[emulator][fabric][faults]") {
  auto c = small(4);
  fabric f(c);
  const std::uint64_t S = 64ull << 20;
  const double t_single = c.direct_latency() + static_cast<double>(S) / c.card_bandwidth();
  f.schedule_fault({t_single / 2, fault_kind::link_down, 0, 3, 0});
  auto id = f.post(0, 1, S, 0);
  f.run();
  REQUIRE(f.state(id) == msg_state::done);
  CHECK(f.completion_time(id) > t_single);
  CHECK(f.completion_time(id) < t_single * 1.2);
}

TEST_CASE("random faults replay exactly for a seed", "[emulator][fabric][faults]") {
  auto run = [](std::uint64_t seed) {
    auto c = small(8);
    c.faults.link_failure_rate = 2000;  // per link per second
    c.faults.repair_time = 20e-6;
    c.faults.horizon = 1e-3;
    c.faults.seed = seed;
    fabric f(c);
    std::vector<fabric::msg_id> ids;
    for (std::size_t s = 0; s < 8; ++s)
      for (std::size_t d = 0; d < 8; ++d)
        if (s != d) ids.push_back(f.post(s, d, 2ull << 20, 0));
    f.run();
    std::vector<double> t;
    for (auto id : ids) t.push_back(f.state(id) == msg_state::done ? f.completion_time(id) : -1);
    return std::make_pair(t, f.faults().size());
  };
  auto a = run(42), b = run(42), d = run(43);
  CHECK(a.second > 0);
  CHECK(a == b);
  CHECK(a.first != d.first);
}

TEST_CASE("hot swap: the card goes down and comes back and traffic flows again", "[emulator][fabric][faults]") {
  auto c = small(4);
  fabric f(c);
  std::vector<double> rejoined;
  f.on_rejoin = [&](std::size_t card, double t) {
    if (card == 3) rejoined.push_back(t);
  };
  f.schedule_fault({10e-6, fault_kind::hot_swap, 3, 0, 100e-6});
  f.run_until(200e-6);
  REQUIRE(rejoined.size() == 1);
  CHECK(rejoined[0] == Approx(110e-6));
  CHECK_FALSE(f.known_failed(3));
  auto id = f.post(0, 3, 1 << 20, f.now());
  f.run_until_done(id);
  CHECK(f.state(id) == msg_state::done);
}

TEST_CASE("bad fabric inputs raise typed errors", "[emulator][fabric]") {
  auto c = small(4);
  fabric f(c);
  CHECK_THROWS_AS(f.post(0, 4, 1, 0), invalid_card_error);
  CHECK_THROWS_MATCHES(f.post(9, 0, 1, 0), invalid_card_error, is_error(errc::out_of_range, "emulator", "invalid card index"));
  CHECK_THROWS_MATCHES(f.post(0, 1, 1, -1), emulator_error, is_error(errc::invalid_argument, "emulator", "post time"));
  CHECK_THROWS_AS(f.schedule_fault({0, fault_kind::plane_down, 0, 8, 0}), invalid_card_error);
  CHECK_THROWS_AS(f.schedule_fault({0, fault_kind::card_down, 77, 0, 0}), invalid_card_error);
  CHECK_THROWS_MATCHES(f.state(12345), emulator_error, is_error(errc::out_of_range, "emulator", "unknown message id"));
  cluster_config bad = c;
  bad.fabric.port_bandwidth = 0;
  CHECK_THROWS_AS(fabric(bad), config_error);
}

TEST_CASE("per-message latency percentiles", "[emulator][fabric]") {
  auto c = small(5);
  fabric f(c);
  for (int i = 0; i < 4; ++i) f.post(static_cast<std::size_t>(i + 1), 0, 65536, 0);
  f.run();
  CHECK(f.latency_percentile(0) > 0);
  CHECK(f.latency_percentile(99) >= f.latency_percentile(50));
  CHECK(fabric::percentile({1, 2, 3, 4, 5}, 50) == 3);
  CHECK(fabric::percentile({}, 50) == 0);
}

TEST_CASE("run() ends at the last real event and not at pending timeouts", "[emulator][fabric]") {
  auto c = small(2);
  fabric f(c);
  auto id = f.post(0, 1, 1 << 20, 0);
  f.run();
  CHECK(f.now() == Approx(f.completion_time(id)));
  CHECK(f.idle());
}

TEST_CASE("finite switch buffers drop incast chunks and shaping prevents the drops", "[emulator][fabric][shaping]") {
  auto run = [](bool shaping) {
    auto c = small(17);
    c.fabric.switch_buffer = 64 << 10;
    c.fabric.shaping = shaping;
    c.fabric.shaping_window = 64 << 10;
    fabric f(c);
    std::vector<fabric::msg_id> ids;
    for (std::size_t s = 1; s <= 16; ++s) ids.push_back(f.post(s, 0, 256 << 10, 0));
    f.run();
    double worst = 0;
    for (auto id : ids) {
      REQUIRE(f.state(id) == msg_state::done);
      worst = std::max(worst, f.latency(id));
    }
    for (std::size_t p = 0; p < 8; ++p) CHECK(f.stats_of(f.down(0, p)).max_queue_bytes <= c.fabric.switch_buffer);
    return std::make_pair(f.drops(), worst);
  };
  auto lossy = run(false);
  auto paced = run(true);
  CHECK(lossy.first > 0);
  CHECK(paced.first == 0);
  CHECK(lossy.second > 20e-6);  // someone waited for a resend timeout
  const double ideal = 16.0 * (256 << 10) / 400e9;
  CHECK(paced.second < ideal * 1.1 + 1e-6);
}

TEST_CASE("random traffic under random faults: every message ends and the books balance", "[emulator][fabric][faults]") {
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    std::mt19937_64 rng(seed);
    auto c = small(6 + seed % 5, seed % 2 ? 8 : 4);
    c.scaleout.supernodes = 1 + seed % 3;
    c.scaleout.spines = 2;
    c.fabric.shaping = seed % 4 == 0;
    c.fabric.switch_buffer = seed % 3 == 0 ? (96 << 10) : 0;
    c.fabric.routing = seed % 5 == 0 ? routing_policy::static_plane : routing_policy::adaptive;
    c.faults.link_failure_rate = 3000;
    c.faults.card_failure_rate = seed % 2 ? 300 : 0;
    c.faults.repair_time = 30e-6;
    c.faults.horizon = 400e-6;
    c.faults.seed = seed;
    c.faults.op_timeout = 200e-6;
    fabric f(c);
    f.schedule_fault({50e-6, fault_kind::plane_down, 0, 1, 0});
    f.schedule_fault({120e-6, fault_kind::plane_up, 0, 1, 0});
    std::vector<fabric::msg_id> ids;
    const std::size_t n = f.cards();
    for (int k = 0; k < 300; ++k) {
      std::size_t s = rng() % n, d = rng() % n;
      if (s == d) d = (d + 1) % n;
      ids.push_back(f.post(s, d, rng() % (1 << 20), static_cast<double>(rng() % 300) * 1e-6));
    }
    f.run();
    std::size_t done = 0;
    for (auto id : ids) {
      REQUIRE(f.finished(id));
      done += f.state(id) == msg_state::done;
      if (f.state(id) == msg_state::failed) CHECK_THROWS_AS(f.rethrow_if_failed(id), fault_error);
    }
    INFO("seed " << seed << ": " << done << " of " << ids.size() << " done, " << f.faults().size() << " faults");
    if (c.faults.card_failure_rate == 0)
      CHECK(done == ids.size());  // links come back: all arrive
    else
      CHECK(done > ids.size() / 2);
    CHECK(f.check_quiescent() == "");
  }
}
}  // namespace tessel_test_emulator_fabric
