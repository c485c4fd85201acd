#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <tessel/emulator/config.hpp>
#include "error_match.hpp"

namespace tessel_test_emulator_config {

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
  auto a = parse_cluster_config(
      "# a smaller machine\ncards = 16\nplanes = 4\nports_per_card = 8\nport_bandwidth = 100GB/s\n"
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
    } catch (const config_error& e) { return std::string(e.what()); }
    return std::string("no error");
  };
  CHECK_THAT(msg_of("cards = 0"), Catch::Contains("'cards_per_supernode' is 0, outside its range [1, "));
  CHECK_THAT(msg_of("port_bandwidth = 0"), Catch::Contains("port_bandwidth"));
  CHECK_THAT(msg_of("planes = 3"), Catch::Contains("does not fit"));
  CHECK_THAT(msg_of("planes = 0"), Catch::Contains("'planes' is 0, outside its range [1, 64]"));
  CHECK_THAT(msg_of("cardz = 4"), Catch::Contains("unknown key"));
  CHECK_THAT(msg_of("cards = four"), Catch::Contains("non-numeric"));
  CHECK_THAT(msg_of("cards = 2.5"), Catch::Contains("integer"));
  CHECK_THAT(msg_of("port_latency = 5 furlongs"), Catch::Contains("unknown unit"));
  CHECK_THAT(msg_of("shaping = maybe"), Catch::Contains("true/false"));
  CHECK_THAT(msg_of("switch_buffer = 16"), Catch::Contains("too small"));
  CHECK(parse_cluster_config("switch_buffer = 64Ki\nretransmit_timeout = 5us").fabric.switch_buffer == 65536);
  CHECK_THAT(msg_of("routing = random"), Catch::Contains("routing"));
  CHECK_THAT(msg_of("just words"), Catch::Contains("not 'key = value'"));
  CHECK_THAT(msg_of("port_bandwidth = 5us"), Catch::Contains("wrong unit"));
  CHECK_THAT(msg_of("port_latency = 5GB/s"), Catch::Contains("wrong unit"));
  CHECK_THAT(msg_of("planes = 4\nplanes = 2"), Catch::Contains("given twice"));
  CHECK_THAT(msg_of("cards = 4\ncards_per_supernode = 4"), Catch::Contains("given twice"));
  CHECK_THAT(msg_of("missed_heartbeats = 4294967296"), Catch::Contains("outside its range"));
  CHECK_THAT(msg_of("seed = 18446744073709551616"), Catch::Contains("too large"));
  CHECK(parse_cluster_config("seed = 18446744073709551615").faults.seed == 18446744073709551615ull);
  cluster_config c;
  c.card.hbm_bandwidth = -1;
  CHECK_THROWS_AS(c.validate(), config_error);
  c = cluster_config{};
  c.card.memory_bytes = 0;
  CHECK_THROWS_MATCHES(c.validate(), config_error, is_error(errc::config, "emulator", "config"));
}

namespace {
const std::filesystem::path clusters = std::filesystem::path(__FILE__).parent_path().parent_path().parent_path() / "configs" / "clusters";

config_error error_of(const std::string& text) {
  try {
    parse_cluster_config(text);
  } catch (const config_error& e) { return e; }
  FAIL("no error for: " << text);
  return config_error("unreachable");
}
}  // namespace

TEST_CASE("every key of the table parses in both forms and round-trips through JSON", "[emulator][config]") {
  // A config with every key moved off its default, written as key = value lines and as JSON
  // (flat and nested), read back equal; then parse(to_json(c)) == c.
  cluster_config want;
  want.cards_per_supernode = 16;
  want.timing_only = true;
  want.trace = true;
  want.card = {std::size_t{8} << 30, 1e12, 2e14, 4e14, 5e13, 3e-6};
  want.fabric.planes = 4;
  want.fabric.ports_per_card = 8;
  want.fabric.port_bandwidth = 100e9;
  want.fabric.port_latency = 200e-9;
  want.fabric.switch_latency = 300e-9;
  want.fabric.chunk_bytes = 128 << 10;
  want.fabric.shaping = true;
  want.fabric.shaping_window = 64 << 10;
  want.fabric.switch_buffer = 1 << 20;
  want.fabric.retransmit_timeout = 10e-6;
  want.fabric.routing = routing_policy::static_plane;
  want.fabric.transit = false;
  want.fabric.transit_latency = 2e-6;
  want.scaleout = {2, 25e9, 4, 400e-9, 300e-9};
  want.faults = {20e-6, 5, 2e-6, 5e-3, 0.5, 0.25, 2e-3, 1e-2, 99};
  REQUIRE_NOTHROW(want.validate());
  const std::string lines =
      "cards = 16\ntiming_only = yes\ntrace = on\nmemory = 8Gi\nhbm_bandwidth = 1T\npeak_bf16 = 200T\npeak_fp8 = 400TFLOP/s\n"
      "peak_fp32 = 50T\nlaunch_overhead = 3us\nfabric.planes = 4\nports_per_card = 8\nport_bandwidth = 800Gb/s\n"
      "port_latency = 200ns\nswitch_latency = 0.3us\nchunk_bytes = 128Ki\nshaping = true\nshaping_window = 64KiB\n"
      "switch_buffer = 1Mi\nretransmit_timeout = 10us\nrouting = static\ntransit = off\ntransit_latency = 2us\n"
      "supernodes = 2\nnic_bandwidth = 25GB/s\nspines = 4\nscaleout_link_latency = 400ns\nscaleout.switch_latency = 300ns\n"
      "heartbeat_interval = 20us\nmissed_heartbeats = 5\nlink_detect = 2us\nop_timeout = 5ms\nlink_failure_rate = 0.5\n"
      "card_failure_rate = 0.25\nrepair_time = 2ms\nhorizon = 10ms\nseed = 99\n";
  CHECK(parse_cluster_config(lines) == want);
  const std::string nested = R"({
    // a JSON config may hold comments
    "cards_per_supernode": 16, "timing_only": true, "trace": true,
    "card": {"memory_bytes": "8Gi", "hbm_bandwidth": 1e12, "peak_bf16": "200T", "peak_fp8": 4e14, "peak_fp32": 5e13,
             "launch_overhead": "3us"},
    "fabric": {"planes": 4, "ports_per_card": 8, "port_bandwidth": "100GB/s", "port_latency": 2e-7, "switch_latency": "300ns",
               "chunk_bytes": 131072, "shaping": true, "shaping_window": "64Ki", "switch_buffer": 1048576,
               "retransmit_timeout": 1e-5, "routing": "static_plane", "transit": false, "transit_latency": "2us"},
    "scaleout": {"supernodes": 2, "nic_bandwidth": 25e9, "spines": 4, "link_latency": "400ns", "switch_latency": 3e-7},
    /* and block comments */
    "faults": {"heartbeat_interval": 2e-5, "missed_heartbeats": 5, "link_detect": 2e-6, "op_timeout": "5ms",
               "link_failure_rate": 0.5, "card_failure_rate": 0.25, "repair_time": 2e-3, "horizon": 1e-2, "seed": 99}
  })";
  CHECK(parse_cluster_config(nested) == want);
  CHECK(parse_cluster_config(to_json(want).dump()) == want);
  CHECK(parse_cluster_config(to_json(want).dump(2)) == want);
  CHECK(parse_cluster_config(to_json(cluster_config{}).dump()) == cluster_config{});
  // every key of the table is written, under its group
  const auto j = to_json(want);
  std::size_t written = 0;
  for (const auto& [k, v] : j.items()) written += v.is_object() ? v.size() : 1;
  CHECK(written == cluster_config_keys().size());
}

TEST_CASE("the key table: unique names, every key documented and reachable", "[emulator][config]") {
  const auto keys = cluster_config_keys();
  REQUIRE(keys.size() >= 30);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::string name(keys[i].name);  // std::string: Catch's StringMaker for string_view is not in every build of catch_main
    CAPTURE(name);
    CHECK_FALSE(keys[i].meaning.empty());
    CHECK(find_config_key(keys[i].name) == &keys[i]);
    CHECK(find_config_key(keys[i].nested_name()) == &keys[i]);
    if (!keys[i].alias.empty()) CHECK(find_config_key(keys[i].alias) == &keys[i]);
    for (std::size_t j = i + 1; j < keys.size(); ++j) {
      CHECK(std::string(keys[i].name) != std::string(keys[j].name));
      CHECK(keys[i].nested_name() != keys[j].nested_name());
    }
    // the defaults are inside their own ranges
    if (keys[i].type == key_type::count || keys[i].type == key_type::real)
      CHECK_NOTHROW(detail::check_range(keys[i], detail::numeric_value(keys[i], cluster_config{}), 0));
  }
  CHECK(find_config_key("cardz") == nullptr);
  // the printed documentation has one row per key, with its default
  const std::string doc = describe_cluster_keys();
  std::size_t rows = 0;
  for (std::size_t at = 0; (at = doc.find('\n', at)) != std::string::npos; ++at) ++rows;
  CHECK(rows == keys.size() + 3);  // two comment lines and a header
  for (const auto& k : keys) CHECK_THAT(doc, Catch::Contains(std::string(k.name)));
  CHECK_THAT(doc, Catch::Contains("fabric.port_bandwidth") && Catch::Contains("adaptive|static|static_plane"));
}

TEST_CASE("JSON configs: typed errors name the key and its line", "[emulator][config]") {
  auto e = error_of("{\n  \"cards\": 16,\n  \"fabric\": {\"planes\": \"four\"}\n}");
  CHECK(e.key == "planes");
  CHECK(e.line == 3);
  CHECK(e.code() == errc::config);
  CHECK_THAT(e.what(), Catch::Contains("line 3") && Catch::Contains("non-numeric"));

  e = error_of("{\"fabric\": {\"plane\": 4}}");  // a typo inside a group
  CHECK(e.key == "fabric.plane");
  CHECK_THAT(e.what(), Catch::Contains("unknown key"));
  e = error_of("{\"card\": {\"planes\": 4}}");  // a real key in the wrong group
  CHECK(e.key == "card.planes");
  e = error_of("{\"fabric.planes\": 4}");  // dotted names are for key = value lines only
  CHECK_THAT(e.what(), Catch::Contains("unknown key"));
  e = error_of("{\"planes\": true}");
  CHECK(e.key == "planes");
  CHECK_THAT(e.what(), Catch::Contains("got a boolean"));
  e = error_of("{\"shaping\": 1}");
  CHECK_THAT(e.what(), Catch::Contains("true or false"));
  e = error_of("{\"routing\": 1}");
  CHECK(e.key == "routing");
  e = error_of("{\"routing\": \"random\"}");
  CHECK_THAT(e.what(), Catch::Contains("'adaptive', 'static', 'static_plane'"));
  e = error_of("{\"port_bandwidth\": [1, 2]}");
  CHECK_THAT(e.what(), Catch::Contains("got an array"));
  e = error_of("{\"cards\": -3}");
  CHECK(e.key == "cards_per_supernode");
  CHECK_THAT(e.what(), Catch::Contains("outside its range"));
  e = error_of("{\"cards\": 2.5}");
  CHECK_THAT(e.what(), Catch::Contains("integer"));
  CHECK(parse_cluster_config("{\"cards\": 2.0}").cards() == 2);  // an integral JSON float is a count
  e = error_of("{\"port_latency\": 1e400}");                     // nlohmann refuses the overflow as malformed
  CHECK(e.code() == errc::format);
  e = error_of("{\n\"planes\": 4,\n\"planes\": 2}");  // nlohmann would keep the last one silently
  CHECK(e.key == "planes");
  CHECK_THAT(e.what(), Catch::Contains("twice"));
  e = error_of("{\"planes\": 4, \"fabric\": {\"planes\": 2}}");  // the same key flat and nested
  CHECK_THAT(e.what(), Catch::Contains("given twice"));
  e = error_of("{\"planes\": 3}");  // a rule between keys, after parsing
  CHECK(e.key == "ports_per_card");
  CHECK(e.line == 0);

  // malformed JSON: errc::format, with the line nlohmann stopped at
  e = error_of("{\n  \"cards\": 4,\n  \"planes\": 2,,\n}");
  CHECK(e.code() == errc::format);
  CHECK(e.line == 3);
  CHECK_THAT(e.what(), Catch::Contains("malformed JSON"));
  CHECK(error_of("{\"cards\": 4").code() == errc::format);
  CHECK(error_of("{\"cards\": 4} trailing").code() == errc::format);
  // key = value format errors
  e = error_of("cards = 8\n = 4\n");
  CHECK(e.code() == errc::format);
  CHECK(e.line == 2);
  e = error_of("cards = 8\nplanes =\n");
  CHECK(e.key == "planes");
  CHECK(e.line == 2);
  e = error_of("cards = 8\n\ncardz = 4\n");
  CHECK(e.key == "cardz");
  CHECK(e.line == 3);
}

TEST_CASE("the configs in configs/clusters load and survive a JSON round trip", "[emulator][config]") {
  std::size_t files = 0;
  for (const auto& f : std::filesystem::directory_iterator(clusters)) {
    CAPTURE(f.path().string());
    const auto c = load_cluster_config(f.path().string());
    CHECK(parse_cluster_config(to_json(c).dump()) == c);
    ++files;
  }
  CHECK(files >= 5);
  CHECK(load_cluster_config((clusters / "ubl1024.conf").string()).cards() == 1024);
  const auto g = load_cluster_config((clusters / "gen2_32.json").string());  // the JSON example, nested
  CHECK(g.cards() == 32);
  CHECK(g.card_bandwidth() == 800e9);
  CHECK(g.direct_latency() == Approx(600e-9));
  CHECK(g.card.hbm_bandwidth == 4.8e12);
  CHECK(load_cluster_config((clusters / "ubl128.conf").string()) == cluster_config{});
  // a file's errors name the file
  const char* path = "tessel_emulator_config_bad.json";
  {
    std::ofstream f(path);
    f << "{\n  \"planes\": 0\n}\n";
  }
  try {
    load_cluster_config(path);
    FAIL("no error");
  } catch (const config_error& e) {
    CHECK(e.key == "planes");
    CHECK(e.line == 2);
    CHECK_THAT(e.what(), Catch::Contains(path));
  }
  // and write_cluster_config writes what load reads
  cluster_config c;
  c.fabric.planes = 2;
  c.fabric.ports_per_card = 4;
  write_cluster_config(c, path);
  CHECK(load_cluster_config(path) == c);
  std::remove(path);
  CHECK_THROWS_MATCHES(write_cluster_config(c, "/nonexistent/dir/x.json"), config_error, is_error(errc::io, "emulator", "cannot write"));
}
}  // namespace tessel_test_emulator_config
