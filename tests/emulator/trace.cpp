#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>
#include <tessel/emulator/cluster.hpp>

#include "reference/emulator_ref.hpp"

namespace tessel_test_emulator_trace {

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
    if (ph == "X") {
      ++compute;
      CHECK(e["dur"].num > 0);
      CHECK(e["tid"].num == 0);
    }
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

TEST_CASE("the Chrome trace is JSON nlohmann reads back, names escaped, times in microseconds", "[emulator][trace]") {
  cluster_config cfg;
  cfg.cards_per_supernode = 2;
  cfg.card.memory_bytes = 16 << 20;
  cfg.trace = true;
  cluster cl(cfg, 1);
  void* a = cl[0].allocate(1 << 16);
  void* b = cl[1].allocate(1 << 16);
  const std::string odd = std::string("q\"uote\\ tab\t bell\x07 ") + "\xff\xfe";  // control bytes and invalid UTF-8
  cl[0].charge({2e9, 0, math_precision::bf16}, odd);
  cl.put(0, a, 1, b, 1 << 16).wait();
  std::ostringstream o;
  cl.write_trace(o);
  const auto doc = nlohmann::json::parse(o.str());
  const auto& ev = doc.at("traceEvents");
  REQUIRE(ev.is_array());
  CHECK(doc.at("displayTimeUnit") == "ns");
  std::size_t found = 0, sends = 0;
  for (const auto& e : ev) {
    if (e.at("ph") == "X") {
      ++found;
      const std::string name = e.at("name");
      CHECK(name.rfind("q\"uote\\ tab\t bell\x07 ", 0) == 0);  // kept, escaped on the way
      CHECK(name.find("\xef\xbf\xbd") != std::string::npos);   // invalid bytes became U+FFFD
      // 2e9 FLOP at 400 TFLOP/s bf16 = 5 us, plus the 5 us launch overhead at most
      CHECK(e.at("dur").get<double>() >= 5.0);
      CHECK(e.at("dur").get<double>() <= 10.0 + 1e-9);
      CHECK(e.at("args").at("flops").get<double>() == 2e9);
    }
    if (e.at("ph") == "b" && e.at("cat") == "sends") {
      ++sends;
      CHECK(e.at("args").at("bytes") == 1 << 16);
      CHECK(e.at("args").at("peer") == 1);
    }
  }
  CHECK(found == 1);
  CHECK(sends == 1);
}

TEST_CASE("the report as JSON carries every counter", "[emulator][trace]") {
  cluster_config cfg;
  cfg.cards_per_supernode = 3;
  cfg.timing_only = true;
  cluster cl(cfg, 1);
  cl.put(1, nullptr, 0, nullptr, 4 << 20).wait();
  const auto r = cl.report();
  const auto j = to_json(r);
  CHECK(j.at("makespan").get<double>() == r.makespan);
  CHECK(j.at("bottleneck").get<std::string>() == r.bottleneck);
  CHECK(j.at("messages").get<std::uint64_t>() == r.messages);
  CHECK(j.at("latency_p99").get<double>() == r.latency_p99);
  REQUIRE(j.at("top_ports").size() == r.top_ports.size());
  CHECK(j.at("top_ports").at(0).at("port") == r.top_ports.at(0).first);
  const char* path = "tessel_report_test.json";
  write_report(r, path);
  std::ifstream in(path);
  CHECK(nlohmann::json::parse(in) == j);
  std::remove(path);
  CHECK_THROWS_AS(write_report(r, "/nonexistent/dir/report.json"), emulator_error);
}
}  // namespace tessel_test_emulator_trace
