// emu::comm_model (the collectives' closed forms the planner prices with) against timing-only runs
// of the communicator's default algorithms on the emulated fabric: the default UBL128 figures and
// clusters with other planes, port bandwidths, card counts that are not powers of two, and two
// super-nodes (the hierarchical forms).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/collectives/transport/emulated.hpp>
#include <tessel/emulator/cluster.hpp>
#include <tessel/emulator/comm_model.hpp>

namespace tessel_test_emulator_comm_model {

namespace {

using namespace tessel;

enum class kind { all_reduce, reduce_scatter, all_gather, all_to_all, message };

const char* name_of(kind k) {
  switch (k) {
    case kind::all_reduce: return "all_reduce";
    case kind::reduce_scatter: return "reduce_scatter";
    case kind::all_gather: return "all_gather";
    case kind::all_to_all: return "all_to_all";
    case kind::message: return "message";
  }
  return "?";
}

// Simulated seconds of one collective of `bytes` per rank (the whole vector), from the slowest
// rank's start to the slowest rank's end.
double measure(const emu::cluster_config& cfg, kind k, std::size_t bytes) {
  emu::cluster cl(cfg, 1);
  std::mutex mu;
  double start = 0, end = 0;
  const std::size_t count = bytes / 4;
  emulated_world(cl).run([&](emulated_transport t) {
    comm_options o;
    o.segment_bytes = std::size_t{64} << 20;  // as tessel-perf: fewer, larger messages simulate faster
    communicator c(std::move(t), o);
    const int n = c.size();
    c.barrier();
    const double t0 = c.now();
    switch (k) {
      case kind::all_reduce: c.all_reduce(nullptr, nullptr, count, dtype::f32, reduce_op::sum); break;
      case kind::reduce_scatter: c.reduce_scatter(nullptr, nullptr, count / std::size_t(n), dtype::f32, reduce_op::sum); break;
      case kind::all_gather: c.all_gather(nullptr, nullptr, count / std::size_t(n), dtype::f32); break;
      case kind::all_to_all: c.all_to_all(nullptr, nullptr, count / std::size_t(n), dtype::f32); break;
      case kind::message:
        if (c.rank() == 0) c.send(nullptr, count, dtype::f32, n - 1, 3);
        if (c.rank() == n - 1) c.recv(nullptr, count, dtype::f32, 0, 3);
        break;
    }
    const double t1 = c.now();
    std::lock_guard lk(mu);
    start = std::max(start, t0);
    end = std::max(end, t1);
  });
  return end - start;
}

double predict(const emu::cluster_config& cfg, kind k, std::size_t bytes) {
  const emu::comm_model m(cfg);
  const emu::group_shape g{cfg.cards(), cfg.cards_per_supernode};
  const double b = double(bytes / 4 * 4);
  switch (k) {
    case kind::all_reduce: return m.all_reduce(g, b);
    case kind::reduce_scatter: return m.reduce_scatter(g, b);
    case kind::all_gather: return m.all_gather(g, b);
    case kind::all_to_all: return m.all_to_all(g, b);
    case kind::message: return m.message(b, cfg.scaleout.supernodes == 1);
  }
  return 0;
}

emu::cluster_config make(std::size_t cards, std::size_t planes, double port_bw, std::size_t supernodes = 1) {
  emu::cluster_config c;
  c.cards_per_supernode = cards;
  c.scaleout.supernodes = supernodes;
  c.fabric.planes = planes;
  c.fabric.ports_per_card = planes;
  c.fabric.port_bandwidth = port_bw;
  c.timing_only = true;
  c.faults.op_timeout = 1.0;
  c.validate();
  return c;
}

}  // namespace

TEST_CASE("the collectives' closed forms match timing-only runs on several clusters", "[emulator][comm_model]") {
  struct cluster_case {
    std::string name;
    emu::cluster_config cfg;
  };
  std::vector<cluster_case> clusters = {
      {"default figures, 8 cards", make(8, 8, 50e9)},           {"8 cards x 4 planes x 25 GB/s", make(8, 4, 25e9)},
      {"24 cards x 2 planes x 100 GB/s", make(24, 2, 100e9)},   {"5 cards x 1 plane x 50 GB/s", make(5, 1, 50e9)},
      {"12 cards x 8 planes x 12.5 GB/s", make(12, 8, 12.5e9)},
  };
  const kind kinds[] = {kind::all_reduce, kind::reduce_scatter, kind::all_gather, kind::all_to_all, kind::message};
  for (const auto& cc : clusters) {
    for (kind k : kinds) {
      for (std::size_t mib : {std::size_t{1}, std::size_t{48}}) {
        const std::size_t n = cc.cfg.cards();
        const std::size_t bytes = (mib << 20) / (4 * n) * (4 * n);
        const double got = measure(cc.cfg, k, bytes), want = predict(cc.cfg, k, bytes);
        INFO(cc.name << ", " << name_of(k) << ", " << mib << " MiB: emulator " << got * 1e6 << " us, closed form " << want * 1e6 << " us");
        CHECK(got > 0);
        CHECK(std::abs(got - want) <= 0.02 * want + 0.2e-6);
      }
    }
  }
}

TEST_CASE("the hierarchical closed forms match a cluster of two super-nodes", "[emulator][comm_model]") {
  auto cfg = make(4, 8, 50e9, 2);
  cfg.scaleout.nic_bandwidth = 25e9;
  for (kind k : {kind::all_reduce, kind::reduce_scatter, kind::all_gather, kind::all_to_all, kind::message}) {
    const std::size_t bytes = std::size_t{32} << 20;
    const double got = measure(cfg, k, bytes), want = predict(cfg, k, bytes);
    INFO(name_of(k) << ": emulator " << got * 1e6 << " us, closed form " << want * 1e6 << " us");
    CHECK(std::abs(got - want) <= 0.05 * want + 1e-6);
  }
}
}  // namespace tessel_test_emulator_comm_model
