#include <catch2/catch.hpp>

#include <sstream>
#include <tessel/emulator/cluster.hpp>

#include "reference/emulator_ref.hpp"

using namespace tessel;
using namespace tessel::emu;

TEST_CASE("the Chrome trace parses back as JSON with one process per card", "[emulator][trace]") {
  cluster_config cfg;
  cfg.cards_per_supernode = 4;
  cfg.card.memory_bytes = 64 << 20;
  cfg.trace = true;
  cluster cl(cfg, 1);
  std::vector<void*> buf;
  for (std::size_t i = 0; i < 4; ++i) buf.push_back(cl[i].allocate(1 << 20));
  for (std::size_t i = 0; i < 4; ++i) cl[i].charge({1e9, 1e6, math_precision::bf16}, "gemm \"tile\"\n");
  std::vector<cluster::completion> cs;
  for (std::size_t i = 0; i < 4; ++i) cs.push_back(cl.put(i, buf[i], (i + 1) % 4, buf[(i + 1) % 4], 1 << 20));
  cl.wait_all(cs);
  std::ostringstream o;
  cl.write_trace(o);
  auto doc = tessel_test::parse_json(o.str());
  const auto& ev = doc["traceEvents"];
  REQUIRE(ev.kind == tessel_test::json::arr_v);
  std::size_t compute = 0, begins = 0, ends = 0, meta = 0;
  for (const auto& e : ev.arr) {
    const std::string ph = e["ph"].str;
    CHECK(e["pid"].num < 4);
    if (ph == "M") ++meta;
    if (ph == "X") { ++compute; CHECK(e["dur"].num > 0); CHECK(e["tid"].num == 0); }
    if (ph == "b") ++begins;
    if (ph == "e") ++ends;
  }
  CHECK(meta == 16);
  CHECK(compute == 4);
  CHECK(begins == 8);  // a send and a receive per transfer
  CHECK(ends == 8);
}

TEST_CASE("utilization counters and the top bottleneck", "[emulator][trace]") {
  cluster_config cfg;
  cfg.cards_per_supernode = 5;
  cfg.timing_only = true;
  cluster cl(cfg, 1);
  std::vector<cluster::completion> cs;
  for (std::size_t s = 1; s < 5; ++s) cs.push_back(cl.put(s, nullptr, 0, nullptr, 8 << 20));
  cl.wait_all(cs);
  auto r = cl.report();
  CHECK(r.makespan > 0);
  CHECK(r.max_port_utilization == Approx(1.0).epsilon(0.02));  // card 0's receive ports never idled
  CHECK(r.bottleneck.find("card 0") != std::string::npos);
  CHECK(r.bottleneck.find("rx") != std::string::npos);
  CHECK(r.messages == 4);
  REQUIRE(r.top_ports.size() == 5);
  CHECK(r.top_ports[0].second >= r.top_ports[4].second);
  CHECK(r.flop_utilization == 0);
  CHECK_FALSE(r.to_string().empty());
}
