// The description of an emulated cluster (UBL128 defaults; every figure a parameter), its
// validation with typed errors, and a loader for a small `key = value` / flat-JSON text format,
// so users can model other machines without recompiling.
#pragma once

#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <tessel/emulator/errors.hpp>

namespace tessel {
inline namespace v0 {
namespace emu {

enum class routing_policy : std::uint8_t {
  adaptive,      // Dijkstra on latency + load, striping over every healthy plane, 2-hop failover
  static_plane,  // each pair uses one fixed plane ((src + dst) mod planes), next plane if it is down
};

struct card_spec {
  std::size_t memory_bytes = std::size_t{64} << 30;  // HBM capacity
  double hbm_bandwidth = 3.2e12;                     // bytes/s
  double peak_bf16 = 400e12;                         // FLOP/s (also fp16)
  double peak_fp8 = 800e12;
  double peak_fp32 = 100e12;
  double launch_overhead = 5e-6;  // seconds added to every launch
};

struct fabric_spec {
  std::size_t planes = 8;            // switch planes (one switch each)
  std::size_t ports_per_card = 8;    // must be a multiple of `planes`; ports_per_card/planes per plane
  double port_bandwidth = 50e9;      // bytes/s, each direction
  double port_latency = 150e-9;      // card <-> switch wire, seconds
  double switch_latency = 250e-9;    // switch traversal, seconds
  std::size_t chunk_bytes = 256 << 10;  // simulation granularity (messages are split further so every plane gets a chunk)
  bool shaping = false;              // credit-based pacing of senders per receiving port
  std::size_t shaping_window = 128 << 10;  // bytes of credit per receiving port
  std::size_t switch_buffer = 0;     // bytes per switch output port; 0 = lossless (unbounded)
  double retransmit_timeout = 20e-6; // a chunk dropped at a full switch buffer is resent after this
  routing_policy routing = routing_policy::adaptive;
  bool transit = true;               // allow 2-hop paths through another card
  double transit_latency = 1e-6;     // forwarding cost at the intermediate card
};

struct scaleout_spec {
  std::size_t supernodes = 1;        // super-nodes of `cards_per_supernode` cards each
  double nic_bandwidth = 50e9;       // bytes/s per card into the fat tree
  std::size_t spines = 8;            // spine switches of the 2-level fat tree (non-blocking)
  double link_latency = 500e-9;      // per NIC/leaf/spine wire
  double switch_latency = 350e-9;    // per leaf/spine traversal
};

struct fault_spec {
  double heartbeat_interval = 10e-6;  // every card heartbeats this often
  unsigned missed_heartbeats = 3;     // declared dead after this many are missed
  double link_detect = 1e-6;          // PHY-level detection of a link/plane loss
  double op_timeout = 10e-3;          // a transfer with no progress for this long fails
  // seeded random faults (rate 0 = off): exponential times over [0, horizon]
  double link_failure_rate = 0;       // failures per second per link
  double card_failure_rate = 0;       // failures per second per card
  double repair_time = 1e-3;          // a random fault recovers after this long (0 = never)
  double horizon = 0;
  std::uint64_t seed = 1;
};

struct cluster_config {
  std::size_t cards_per_supernode = 128;
  card_spec card;
  fabric_spec fabric;
  scaleout_spec scaleout;
  fault_spec faults;
  bool timing_only = false;  // no payloads: transfers move no bytes, allocations take no host memory
  bool trace = false;        // record a Chrome-trace timeline

  std::size_t cards() const { return cards_per_supernode * scaleout.supernodes; }
  std::size_t supernode_of(std::size_t c) const { return c / cards_per_supernode; }
  // Bandwidth of one card into one plane (all of its ports on that plane together).
  double link_bandwidth() const {
    return fabric.port_bandwidth * static_cast<double>(fabric.ports_per_card / (fabric.planes ? fabric.planes : 1));
  }
  double card_bandwidth() const { return link_bandwidth() * static_cast<double>(fabric.planes); }
  // Latency of one direct transfer inside a super-node (uplink wire + switch + downlink wire).
  double direct_latency() const { return 2 * fabric.port_latency + fabric.switch_latency; }

  // Throws config_error naming the first bad field.
  void validate() const {
    auto bad = [](const std::string& m) { throw config_error("config: " + m); };
    auto pos = [&](double v, const char* name) {
      if (!(v > 0) || !std::isfinite(v)) bad(std::string(name) + " must be positive and finite (got " + std::to_string(v) + ")");
    };
    auto nonneg = [&](double v, const char* name) {
      if (!(v >= 0) || !std::isfinite(v)) bad(std::string(name) + " must be >= 0 and finite (got " + std::to_string(v) + ")");
    };
    if (cards_per_supernode == 0) bad("zero cards per super-node");
    if (scaleout.supernodes == 0) bad("zero super-nodes");
    if (cards_per_supernode > (std::size_t{1} << 20) || scaleout.supernodes > (std::size_t{1} << 12) ||
        cards() > (std::size_t{1} << 20))
      bad("too many cards (" + std::to_string(cards_per_supernode) + " x " + std::to_string(scaleout.supernodes) + ", max 2^20)");
    if (fabric.planes == 0) bad("zero switch planes");
    if (fabric.planes > 64) bad("at most 64 switch planes (got " + std::to_string(fabric.planes) + ")");
    if (fabric.ports_per_card == 0) bad("zero ports per card");
    if (fabric.ports_per_card % fabric.planes != 0)
      bad("ports_per_card " + std::to_string(fabric.ports_per_card) + " does not fit " + std::to_string(fabric.planes) +
          " planes (must be a multiple)");
    pos(fabric.port_bandwidth, "port_bandwidth");
    nonneg(fabric.port_latency, "port_latency");
    nonneg(fabric.switch_latency, "switch_latency");
    nonneg(fabric.transit_latency, "transit_latency");
    nonneg(fabric.retransmit_timeout, "retransmit_timeout");
    if (fabric.switch_buffer != 0 && fabric.switch_buffer < fabric.chunk_bytes / 64)
      bad("switch_buffer " + std::to_string(fabric.switch_buffer) + " is too small for chunk_bytes " + std::to_string(fabric.chunk_bytes) + " (need >= chunk_bytes/64)");
    if (fabric.chunk_bytes == 0) bad("chunk_bytes must be positive");
    if (fabric.shaping && fabric.shaping_window == 0) bad("shaping_window must be positive when shaping is on");
    if (card.memory_bytes == 0) bad("card memory_bytes must be positive");
    pos(card.hbm_bandwidth, "hbm_bandwidth");
    pos(card.peak_bf16, "peak_bf16");
    pos(card.peak_fp8, "peak_fp8");
    pos(card.peak_fp32, "peak_fp32");
    nonneg(card.launch_overhead, "launch_overhead");
    if (scaleout.supernodes > 1) {
      pos(scaleout.nic_bandwidth, "nic_bandwidth");
      if (scaleout.spines == 0) bad("zero spine switches with several super-nodes");
      nonneg(scaleout.link_latency, "scaleout link_latency");
      nonneg(scaleout.switch_latency, "scaleout switch_latency");
    }
    pos(faults.heartbeat_interval, "heartbeat_interval");
    if (faults.missed_heartbeats == 0) bad("missed_heartbeats must be >= 1");
    nonneg(faults.link_detect, "link_detect");
    pos(faults.op_timeout, "op_timeout");
    nonneg(faults.link_failure_rate, "link_failure_rate");
    nonneg(faults.card_failure_rate, "card_failure_rate");
    nonneg(faults.repair_time, "repair_time");
    nonneg(faults.horizon, "horizon");
  }
};

namespace detail {
inline std::string trim(std::string_view s) {
  std::size_t b = 0, e = s.size();
  while (b < e && (std::isspace(static_cast<unsigned char>(s[b])) || s[b] == '"' || s[b] == '\'' || s[b] == ',' || s[b] == '{' || s[b] == '}')) ++b;
  while (e > b && (std::isspace(static_cast<unsigned char>(s[e - 1])) || s[e - 1] == '"' || s[e - 1] == '\'' || s[e - 1] == ',' || s[e - 1] == '{' || s[e - 1] == '}')) --e;
  return std::string(s.substr(b, e - b));
}

// A number with an optional unit suffix: K M G T (x1000), Ki Mi Gi Ti (x1024), ns us ms s,
// and an optional trailing "B/s", "B", "b/s" (bits: /8).
inline double parse_quantity(const std::string& key, const std::string& v) {
  std::size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    throw config_error("config: '" + key + "' has a non-numeric value '" + v + "'");
  }
  std::string u = v.substr(used);
  while (!u.empty() && std::isspace(static_cast<unsigned char>(u.front()))) u.erase(u.begin());
  double scale = 1;
  auto eat = [&](std::string_view pre, double s) {
    if (u.rfind(pre, 0) == 0) { scale *= s; u.erase(0, pre.size()); return true; }
    return false;
  };
  if (!(eat("Ki", 1024.0) || eat("Mi", 1048576.0) || eat("Gi", 1073741824.0) || eat("Ti", 1099511627776.0) ||
        eat("ns", 1e-9) || eat("us", 1e-6) || eat("ms", 1e-3) || eat("K", 1e3) || eat("k", 1e3) ||
        eat("M", 1e6) || eat("G", 1e9) || eat("T", 1e12)))
    (void)0;
  if (u == "b/s" || u == "bps") scale /= 8;
  else if (!(u.empty() || u == "B" || u == "B/s" || u == "s" || u == "FLOP/s"))
    throw config_error("config: '" + key + "' has an unknown unit '" + u + "'");
  return x * scale;
}

inline std::size_t to_count(const std::string& key, double x) {
  if (!(x >= 0) || x != std::floor(x) || x > 9.0e18)
    throw config_error("config: '" + key + "' must be a non-negative integer (got " + std::to_string(x) + ")");
  return static_cast<std::size_t>(x);
}
inline bool to_bool(const std::string& key, const std::string& v) {
  if (v == "true" || v == "1" || v == "on" || v == "yes") return true;
  if (v == "false" || v == "0" || v == "off" || v == "no") return false;
  throw config_error("config: '" + key + "' must be true/false (got '" + v + "')");
}
}  // namespace detail

// Parses `key = value` or `"key": value` pairs (one or more per line, '#' and '//' comments;
// braces and commas of a flat JSON object are accepted). Unknown keys are errors, so a typo is
// not silently ignored. Starts from the UBL128 defaults and validates the result.
inline cluster_config parse_cluster_config(std::string_view text) {
  cluster_config c;
  // One line at a time: comments go first (a comment may hold commas), then the pairs of a JSON
  // line are split on commas outside quotes.
  std::istringstream lines{std::string(text)};
  std::string raw;
  int lineno = 0;
  std::vector<std::pair<int, std::string>> pairs;
  while (std::getline(lines, raw)) {
    ++lineno;
    if (auto h = raw.find('#'); h != std::string::npos) raw.erase(h);
    if (auto h = raw.find("//"); h != std::string::npos) raw.erase(h);
    std::string cur;
    bool in_str = false;
    for (char ch : raw) {
      if (ch == '"') in_str = !in_str;
      if (ch == ',' && !in_str) {
        pairs.emplace_back(lineno, std::move(cur));
        cur.clear();
      } else {
        cur.push_back(ch);
      }
    }
    pairs.emplace_back(lineno, std::move(cur));
  }
  for (auto& [ln, line] : pairs) {
    lineno = ln;
    std::string t = detail::trim(line);
    if (t.empty()) continue;
    std::size_t sep = t.find('=');
    if (sep == std::string::npos) sep = t.find(':');
    if (sep == std::string::npos)
      throw config_error("config: line " + std::to_string(lineno) + " is not 'key = value': '" + t + "'");
    std::string key = detail::trim(t.substr(0, sep)), val = detail::trim(t.substr(sep + 1));
    auto num = [&] { return detail::parse_quantity(key, val); };
    auto cnt = [&] { return detail::to_count(key, num()); };
    if (key == "cards" || key == "cards_per_supernode") c.cards_per_supernode = cnt();
    else if (key == "supernodes") c.scaleout.supernodes = cnt();
    else if (key == "planes") c.fabric.planes = cnt();
    else if (key == "ports_per_card") c.fabric.ports_per_card = cnt();
    else if (key == "port_bandwidth") c.fabric.port_bandwidth = num();
    else if (key == "port_latency") c.fabric.port_latency = num();
    else if (key == "switch_latency") c.fabric.switch_latency = num();
    else if (key == "chunk_bytes") c.fabric.chunk_bytes = cnt();
    else if (key == "shaping") c.fabric.shaping = detail::to_bool(key, val);
    else if (key == "shaping_window") c.fabric.shaping_window = cnt();
    else if (key == "switch_buffer") c.fabric.switch_buffer = cnt();
    else if (key == "retransmit_timeout") c.fabric.retransmit_timeout = num();
    else if (key == "routing") {
      if (val == "adaptive") c.fabric.routing = routing_policy::adaptive;
      else if (val == "static" || val == "static_plane") c.fabric.routing = routing_policy::static_plane;
      else throw config_error("config: routing must be 'adaptive' or 'static' (got '" + val + "')");
    } else if (key == "transit") c.fabric.transit = detail::to_bool(key, val);
    else if (key == "transit_latency") c.fabric.transit_latency = num();
    else if (key == "memory" || key == "memory_bytes") c.card.memory_bytes = cnt();
    else if (key == "hbm_bandwidth") c.card.hbm_bandwidth = num();
    else if (key == "peak_bf16") c.card.peak_bf16 = num();
    else if (key == "peak_fp8") c.card.peak_fp8 = num();
    else if (key == "peak_fp32") c.card.peak_fp32 = num();
    else if (key == "launch_overhead") c.card.launch_overhead = num();
    else if (key == "nic_bandwidth") c.scaleout.nic_bandwidth = num();
    else if (key == "spines") c.scaleout.spines = cnt();
    else if (key == "scaleout_link_latency") c.scaleout.link_latency = num();
    else if (key == "scaleout_switch_latency") c.scaleout.switch_latency = num();
    else if (key == "heartbeat_interval") c.faults.heartbeat_interval = num();
    else if (key == "missed_heartbeats") c.faults.missed_heartbeats = static_cast<unsigned>(cnt());
    else if (key == "link_detect") c.faults.link_detect = num();
    else if (key == "op_timeout") c.faults.op_timeout = num();
    else if (key == "link_failure_rate") c.faults.link_failure_rate = num();
    else if (key == "card_failure_rate") c.faults.card_failure_rate = num();
    else if (key == "repair_time") c.faults.repair_time = num();
    else if (key == "horizon") c.faults.horizon = num();
    else if (key == "seed") c.faults.seed = cnt();
    else if (key == "timing_only") c.timing_only = detail::to_bool(key, val);
    else if (key == "trace") c.trace = detail::to_bool(key, val);
    else throw config_error("config: unknown key '" + key + "' on line " + std::to_string(lineno));
  }
  c.validate();
  return c;
}

inline cluster_config load_cluster_config(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw config_error("config: cannot open '" + path + "'", errc::io);
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_cluster_config(ss.str());
}

}  // namespace emu
}  // namespace v0
}  // namespace tessel
