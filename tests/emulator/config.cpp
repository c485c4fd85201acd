#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <tessel/emulator/config.hpp>
#include "error_match.hpp"

using tessel_test::is_error;
using tessel::errc;

using namespace tessel::emu;

TEST_CASE("defaults describe UBL128", "[emulator][config]") {
  cluster_config c;
  REQUIRE_NOTHROW(c.validate());
  CHECK(c.cards() == 128);
  CHECK(c.card_bandwidth() == Approx(400e9));
  CHECK(c.link_bandwidth() == Approx(50e9));
  CHECK(c.direct_latency() == Approx(550e-9));
  CHECK(c.card.memory_bytes == (std::size_t{64} << 30));
}

TEST_CASE("key = value and flat JSON both load", "[emulator][config]") {
  auto a = parse_cluster_config("# a smaller machine\ncards = 16\nplanes = 4\nports_per_card = 8\nport_bandwidth = 100GB/s\n"
                                "port_latency = 100ns\nmemory = 16Gi\nshaping = on\nrouting = static\n");
  CHECK(a.cards() == 16);
  CHECK(a.fabric.planes == 4);
  CHECK(a.link_bandwidth() == Approx(200e9));
  CHECK(a.fabric.port_latency == Approx(100e-9));
  CHECK(a.card.memory_bytes == (std::size_t{16} << 30));
  CHECK(a.fabric.shaping);
  CHECK(a.fabric.routing == routing_policy::static_plane);
  auto b = parse_cluster_config(R"({"cards": 128, "supernodes": 8, "nic_bandwidth": "400Gb/s", "spines": 16, "seed": 7})");
  CHECK(b.cards() == 1024);
  CHECK(b.scaleout.nic_bandwidth == Approx(50e9));
  CHECK(b.faults.seed == 7);
  // a comment may hold commas and colons (it once split into bogus pairs), and a bad pair names its line
  auto c = parse_cluster_config("# smaller, slower: a test\ncards = 8 // eight, not 128\nplanes = 2, ports_per_card = 2\n");
  CHECK(c.cards() == 8);
  CHECK(c.fabric.planes == 2);
  REQUIRE_THROWS_WITH(parse_cluster_config("cards = 8\n\nbogus line\n"), Catch::Contains("line 3"));
}

TEST_CASE("a config file loads from disk", "[emulator][config]") {
  const char* path = "tessel_emulator_config_test.txt";
  {
    std::ofstream f(path);
    f << "cards = 8\nplanes = 2\nports_per_card = 2\n";
  }
  auto c = load_cluster_config(path);
  CHECK(c.cards() == 8);
  std::remove(path);
  CHECK_THROWS_AS(load_cluster_config("/nonexistent/tessel.cfg"), config_error);
}

TEST_CASE("bad configurations raise config_error naming the field", "[emulator][config]") {
  auto msg_of = [](const std::string& text) {
    try {
      parse_cluster_config(text);
    } catch (const config_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(msg_of("cards = 0"), Catch::Contains("zero cards"));
  CHECK_THAT(msg_of("port_bandwidth = 0"), Catch::Contains("port_bandwidth"));
  CHECK_THAT(msg_of("planes = 3"), Catch::Contains("does not fit"));
  CHECK_THAT(msg_of("planes = 0"), Catch::Contains("zero switch planes"));
  CHECK_THAT(msg_of("cardz = 4"), Catch::Contains("unknown key"));
  CHECK_THAT(msg_of("cards = four"), Catch::Contains("non-numeric"));
  CHECK_THAT(msg_of("cards = 2.5"), Catch::Contains("integer"));
  CHECK_THAT(msg_of("port_latency = 5 furlongs"), Catch::Contains("unknown unit"));
  CHECK_THAT(msg_of("shaping = maybe"), Catch::Contains("true/false"));
  CHECK_THAT(msg_of("switch_buffer = 16"), Catch::Contains("too small"));
  CHECK(parse_cluster_config("switch_buffer = 64Ki\nretransmit_timeout = 5us").fabric.switch_buffer == 65536);
  CHECK_THAT(msg_of("routing = random"), Catch::Contains("routing"));
  CHECK_THAT(msg_of("just words"), Catch::Contains("not 'key = value'"));
  cluster_config c;
  c.card.hbm_bandwidth = -1;
  CHECK_THROWS_AS(c.validate(), config_error);
  c = cluster_config{};
  c.card.memory_bytes = 0;
  CHECK_THROWS_MATCHES(c.validate(), config_error, is_error(errc::config, "emulator", "config"));
}
