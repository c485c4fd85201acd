// The description of an emulated cluster (UBL128 defaults; every figure a parameter), the one
// table of its configuration keys (name, type, unit, range, meaning: used by the parsers, the
// validator and the printed documentation), and its two text forms: `key = value` lines and JSON
// (nlohmann-json), read and written, so users can model other machines without recompiling.
#pragma once

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

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

  bool operator==(const card_spec&) const = default;
};

struct fabric_spec {
  std::size_t planes = 8;                  // switch planes (one switch each)
  std::size_t ports_per_card = 8;          // must be a multiple of `planes`; ports_per_card/planes per plane
  double port_bandwidth = 50e9;            // bytes/s, each direction
  double port_latency = 150e-9;            // card <-> switch wire, seconds
  double switch_latency = 250e-9;          // switch traversal, seconds
  std::size_t chunk_bytes = 256 << 10;     // simulation granularity (messages are split further so every plane gets a chunk)
  bool shaping = false;                    // credit-based pacing of senders per receiving port
  std::size_t shaping_window = 128 << 10;  // bytes of credit per receiving port
  std::size_t switch_buffer = 0;           // bytes per switch output port; 0 = lossless (unbounded)
  double retransmit_timeout = 20e-6;       // a chunk dropped at a full switch buffer is resent after this
  routing_policy routing = routing_policy::adaptive;
  bool transit = true;            // allow 2-hop paths through another card
  double transit_latency = 1e-6;  // forwarding cost at the intermediate card

  bool operator==(const fabric_spec&) const = default;
};

struct scaleout_spec {
  std::size_t supernodes = 1;      // super-nodes of `cards_per_supernode` cards each
  double nic_bandwidth = 50e9;     // bytes/s per card into the fat tree
  std::size_t spines = 8;          // spine switches of the 2-level fat tree (non-blocking)
  double link_latency = 500e-9;    // per NIC/leaf/spine wire
  double switch_latency = 350e-9;  // per leaf/spine traversal

  bool operator==(const scaleout_spec&) const = default;
};

struct fault_spec {
  double heartbeat_interval = 10e-6;  // every card heartbeats this often
  unsigned missed_heartbeats = 3;     // declared dead after this many are missed
  double link_detect = 1e-6;          // PHY-level detection of a link/plane loss
  double op_timeout = 10e-3;          // a transfer with no progress for this long fails
  // seeded random faults (rate 0 = off): exponential times over [0, horizon]
  double link_failure_rate = 0;  // failures per second per link
  double card_failure_rate = 0;  // failures per second per card
  double repair_time = 1e-3;     // a random fault recovers after this long (0 = never)
  double horizon = 0;
  std::uint64_t seed = 1;

  bool operator==(const fault_spec&) const = default;
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
  double link_bandwidth() const { return fabric.port_bandwidth * static_cast<double>(fabric.ports_per_card / (fabric.planes ? fabric.planes : 1)); }
  double card_bandwidth() const { return link_bandwidth() * static_cast<double>(fabric.planes); }
  // Latency of one direct transfer inside a super-node (uplink wire + switch + downlink wire).
  double direct_latency() const { return 2 * fabric.port_latency + fabric.switch_latency; }

  bool operator==(const cluster_config&) const = default;

  // Throws config_error naming the first bad key: each key's range from the key table, then the
  // rules that tie keys together.
  void validate() const;
};

// ---- the key table -------------------------------------------------------------------------------
// Every configuration key, once: its flat name (`key = value` lines, flat JSON), the JSON object it
// sits in when nested (`{"fabric": {"planes": 4}}`) and its name there, an accepted alias, type,
// unit, accepted range and meaning. Defaults are not restated: they are `cluster_config{}`'s.

enum class key_type : std::uint8_t {
  count,   // a non-negative integer (a quantity with a unit suffix is allowed: 64Ki, 16Gi)
  real,    // a finite real (a quantity with a unit suffix is allowed: 50G, 400Gb/s, 150ns)
  flag,    // true/false (also on/off, yes/no, 1/0)
  choice,  // one of the words listed in the key's `choices`
};

constexpr std::string_view key_type_name(key_type t) {
  switch (t) {
    case key_type::count: return "count";
    case key_type::real: return "real";
    case key_type::flag: return "flag";
    case key_type::choice: return "choice";
  }
  return "?";
}

// What a key's accessor points at (std::uint64_t is std::size_t on the LP64 targets tessel builds for).
static_assert(std::is_same_v<std::uint64_t, std::size_t>, "tessel's emulator config assumes an LP64 target");
using config_field = std::variant<std::size_t*, unsigned*, double*, bool*, routing_policy*>;

struct config_key {
  std::string_view name;   // flat name, unique
  std::string_view group;  // JSON object when nested: "" (top level), "card", "fabric", "scaleout", "faults"
  std::string_view field;  // name inside `group`
  std::string_view alias;  // another accepted flat name ("" for none)
  key_type type;
  std::string_view unit;     // "B", "B/s", "s", "FLOP/s", "1/s" or "" (a plain number)
  double min, max;           // accepted range, inclusive (counts and reals)
  bool min_open;             // the range excludes `min` (must be > min)
  std::string_view choices;  // choice keys: the accepted words, '|'-separated (the first of each '/' pair is written)
  std::string_view meaning;
  config_field (*at)(cluster_config&);

  std::string nested_name() const { return group.empty() ? std::string(field) : std::string(group) + std::string(".").append(field); }
};

namespace detail {
inline constexpr double inf = std::numeric_limits<double>::infinity();
inline constexpr double u32max = 4294967295.0;
inline constexpr double u64max = 18446744073709551615.0;
}  // namespace detail

inline std::span<const config_key> cluster_config_keys() {
  using k = key_type;
  constexpr double inf = detail::inf;
  static const config_key keys[] = {
      {"cards_per_supernode", "", "cards_per_supernode", "cards", k::count, "", 1, 1 << 20, false, "",
       "cards in each super-node (one single-layer switch per plane)", +[](cluster_config& c) -> config_field { return &c.cards_per_supernode; }},
      {"timing_only", "", "timing_only", "", k::flag, "", 0, 1, false, "", "no payloads: transfers move no bytes, allocations take no host memory",
       +[](cluster_config& c) -> config_field { return &c.timing_only; }},
      {"trace", "", "trace", "", k::flag, "", 0, 1, false, "", "record a Chrome-trace timeline",
       +[](cluster_config& c) -> config_field { return &c.trace; }},
      // card
      {"memory_bytes", "card", "memory_bytes", "memory", k::count, "B", 1, 1125899906842624.0, false, "", "HBM capacity of each card",
       +[](cluster_config& c) -> config_field { return &c.card.memory_bytes; }},
      {"hbm_bandwidth", "card", "hbm_bandwidth", "", k::real, "B/s", 0, inf, true, "", "HBM bandwidth of each card",
       +[](cluster_config& c) -> config_field { return &c.card.hbm_bandwidth; }},
      {"peak_bf16", "card", "peak_bf16", "", k::real, "FLOP/s", 0, inf, true, "", "peak BF16 (and FP16) math rate",
       +[](cluster_config& c) -> config_field { return &c.card.peak_bf16; }},
      {"peak_fp8", "card", "peak_fp8", "", k::real, "FLOP/s", 0, inf, true, "", "peak FP8 math rate",
       +[](cluster_config& c) -> config_field { return &c.card.peak_fp8; }},
      {"peak_fp32", "card", "peak_fp32", "", k::real, "FLOP/s", 0, inf, true, "", "peak FP32 math rate",
       +[](cluster_config& c) -> config_field { return &c.card.peak_fp32; }},
      {"launch_overhead", "card", "launch_overhead", "", k::real, "s", 0, inf, false, "", "time added to every launch",
       +[](cluster_config& c) -> config_field { return &c.card.launch_overhead; }},
      // fabric
      {"planes", "fabric", "planes", "", k::count, "", 1, 64, false, "", "switch planes (one switch each)",
       +[](cluster_config& c) -> config_field { return &c.fabric.planes; }},
      {"ports_per_card", "fabric", "ports_per_card", "", k::count, "", 1, 4096, false, "",
       "ports of each card, a multiple of planes (ports_per_card/planes on each plane)",
       +[](cluster_config& c) -> config_field { return &c.fabric.ports_per_card; }},
      {"port_bandwidth", "fabric", "port_bandwidth", "", k::real, "B/s", 0, inf, true, "", "bandwidth of one port, each direction",
       +[](cluster_config& c) -> config_field { return &c.fabric.port_bandwidth; }},
      {"port_latency", "fabric", "port_latency", "", k::real, "s", 0, inf, false, "", "card <-> switch wire latency",
       +[](cluster_config& c) -> config_field { return &c.fabric.port_latency; }},
      {"switch_latency", "fabric", "switch_latency", "", k::real, "s", 0, inf, false, "", "switch traversal latency",
       +[](cluster_config& c) -> config_field { return &c.fabric.switch_latency; }},
      {"chunk_bytes", "fabric", "chunk_bytes", "", k::count, "B", 1, 1099511627776.0, false, "",
       "simulation granularity (messages are split further so every plane gets a chunk)",
       +[](cluster_config& c) -> config_field { return &c.fabric.chunk_bytes; }},
      {"shaping", "fabric", "shaping", "", k::flag, "", 0, 1, false, "", "credit-based pacing of senders per receiving port",
       +[](cluster_config& c) -> config_field { return &c.fabric.shaping; }},
      {"shaping_window", "fabric", "shaping_window", "", k::count, "B", 0, 1099511627776.0, false, "",
       "credit per receiving port (positive when shaping is on)", +[](cluster_config& c) -> config_field { return &c.fabric.shaping_window; }},
      {"switch_buffer", "fabric", "switch_buffer", "", k::count, "B", 0, 1099511627776.0, false, "",
       "buffer per switch output port, 0 = lossless (else at least chunk_bytes/64)",
       +[](cluster_config& c) -> config_field { return &c.fabric.switch_buffer; }},
      {"retransmit_timeout", "fabric", "retransmit_timeout", "", k::real, "s", 0, inf, false, "",
       "a chunk dropped at a full switch buffer is resent after this",
       +[](cluster_config& c) -> config_field { return &c.fabric.retransmit_timeout; }},
      {"routing", "fabric", "routing", "", k::choice, "", 0, 0, false, "adaptive|static/static_plane",
       "adaptive: shortest latency + load, striped over every healthy plane, 2-hop failover; static: one fixed plane per pair",
       +[](cluster_config& c) -> config_field { return &c.fabric.routing; }},
      {"transit", "fabric", "transit", "", k::flag, "", 0, 1, false, "", "allow 2-hop paths through another card",
       +[](cluster_config& c) -> config_field { return &c.fabric.transit; }},
      {"transit_latency", "fabric", "transit_latency", "", k::real, "s", 0, inf, false, "", "forwarding cost at the intermediate card",
       +[](cluster_config& c) -> config_field { return &c.fabric.transit_latency; }},
      // scale-out
      {"supernodes", "scaleout", "supernodes", "", k::count, "", 1, 1 << 12, false, "", "super-nodes joined by the fat tree",
       +[](cluster_config& c) -> config_field { return &c.scaleout.supernodes; }},
      {"nic_bandwidth", "scaleout", "nic_bandwidth", "", k::real, "B/s", 0, inf, false, "",
       "bandwidth of each card into the fat tree (positive with several super-nodes)",
       +[](cluster_config& c) -> config_field { return &c.scaleout.nic_bandwidth; }},
      {"spines", "scaleout", "spines", "", k::count, "", 0, 1 << 16, false, "",
       "spine switches of the 2-level fat tree (positive with several super-nodes)",
       +[](cluster_config& c) -> config_field { return &c.scaleout.spines; }},
      {"scaleout_link_latency", "scaleout", "link_latency", "", k::real, "s", 0, inf, false, "", "latency of each NIC/leaf/spine wire",
       +[](cluster_config& c) -> config_field { return &c.scaleout.link_latency; }},
      {"scaleout_switch_latency", "scaleout", "switch_latency", "", k::real, "s", 0, inf, false, "", "latency of each leaf/spine traversal",
       +[](cluster_config& c) -> config_field { return &c.scaleout.switch_latency; }},
      // faults
      {"heartbeat_interval", "faults", "heartbeat_interval", "", k::real, "s", 0, inf, true, "", "every card heartbeats this often",
       +[](cluster_config& c) -> config_field { return &c.faults.heartbeat_interval; }},
      {"missed_heartbeats", "faults", "missed_heartbeats", "", k::count, "", 1, detail::u32max, false, "",
       "a card is declared dead after this many missed heartbeats", +[](cluster_config& c) -> config_field { return &c.faults.missed_heartbeats; }},
      {"link_detect", "faults", "link_detect", "", k::real, "s", 0, inf, false, "", "PHY-level detection time of a link or plane loss",
       +[](cluster_config& c) -> config_field { return &c.faults.link_detect; }},
      {"op_timeout", "faults", "op_timeout", "", k::real, "s", 0, inf, true, "", "a transfer with no progress for this long fails",
       +[](cluster_config& c) -> config_field { return &c.faults.op_timeout; }},
      {"link_failure_rate", "faults", "link_failure_rate", "", k::real, "1/s", 0, inf, false, "",
       "random link failures per second per link (0 = off)", +[](cluster_config& c) -> config_field { return &c.faults.link_failure_rate; }},
      {"card_failure_rate", "faults", "card_failure_rate", "", k::real, "1/s", 0, inf, false, "",
       "random card failures per second per card (0 = off)", +[](cluster_config& c) -> config_field { return &c.faults.card_failure_rate; }},
      {"repair_time", "faults", "repair_time", "", k::real, "s", 0, inf, false, "", "a random fault recovers after this long (0 = never)",
       +[](cluster_config& c) -> config_field { return &c.faults.repair_time; }},
      {"horizon", "faults", "horizon", "", k::real, "s", 0, inf, false, "", "random faults are drawn over [0, horizon]",
       +[](cluster_config& c) -> config_field { return &c.faults.horizon; }},
      {"seed", "faults", "seed", "", k::count, "", 0, detail::u64max, false, "", "seed of the random faults",
       +[](cluster_config& c) -> config_field { return &c.faults.seed; }},
  };
  return keys;
}

// The key named `name`: a flat name, an alias, or "group.field". Null when there is none.
inline const config_key* find_config_key(std::string_view name) {
  for (const auto& k : cluster_config_keys())
    if (k.name == name || (!k.alias.empty() && k.alias == name) || k.nested_name() == name) return &k;
  return nullptr;
}

namespace detail {

inline std::string config_where(std::string_view key, std::size_t line) {
  std::string s = "config: ";
  if (line) s += "line " + std::to_string(line) + ": ";
  if (!key.empty()) s += std::string("'").append(key) + "' ";
  return s;
}
[[noreturn]] inline void key_error(std::string_view key, std::size_t line, const std::string& what, errc code = errc::config) {
  throw config_error(std::string(key), line, config_where(key, line) + what, code);
}

inline std::string show_number(double v) {
  std::ostringstream o;
  o.precision(17);
  o << v;
  return o.str();
}

inline std::string range_text(const config_key& k) {
  // appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on "(" + std::string&&
  std::string r(k.min_open ? "(" : "[");
  r += show_number(k.min);
  r += ", ";
  if (std::isinf(k.max))
    r += "inf)";
  else if (k.max >= detail::u64max)
    r += "2^64-1]";
  else
    r += show_number(k.max), r += "]";
  return r;
}

// The words a choice key accepts; `canonical` keeps only the first of each '/' group.
inline std::vector<std::string_view> choice_words(const config_key& k, bool canonical) {
  std::vector<std::string_view> out;
  std::string_view s = k.choices;
  while (!s.empty()) {
    const auto bar = s.find('|');
    std::string_view group = s.substr(0, bar);
    while (!group.empty()) {
      const auto slash = group.find('/');
      out.push_back(group.substr(0, slash));
      if (canonical || slash == std::string_view::npos) break;
      group.remove_prefix(slash + 1);
    }
    if (bar == std::string_view::npos) break;
    s.remove_prefix(bar + 1);
  }
  return out;
}

// A choice key's value as its index among the '|' groups.
inline unsigned choice_index(const config_key& k, std::string_view word, std::size_t line) {
  unsigned idx = 0;
  std::string_view s = k.choices;
  while (true) {
    const auto bar = s.find('|');
    std::string_view group = s.substr(0, bar);
    while (true) {
      const auto slash = group.find('/');
      if (group.substr(0, slash) == word) return idx;
      if (slash == std::string_view::npos) break;
      group.remove_prefix(slash + 1);
    }
    if (bar == std::string_view::npos) break;
    s.remove_prefix(bar + 1);
    ++idx;
  }
  std::string list;
  for (auto w : choice_words(k, false)) {
    list += list.empty() ? "'" : ", '";
    list += w;
    list += '\'';
  }
  key_error(k.name, line, "must be one of " + list + std::string(" (got '").append(word) + "')");
}

// Reads the current value of a key as a double (counts: exact below 2^53; flags 0/1; choices their index).
inline double numeric_value(const config_key& k, const cluster_config& c) {
  auto& m = const_cast<cluster_config&>(c);  // the accessor is shared with the setters; nothing is written here
  return std::visit(
      [](auto* p) -> double {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, routing_policy>)
          return static_cast<double>(static_cast<unsigned>(*p));
        else
          return static_cast<double>(*p);
      },
      k.at(m));
}

// The range check of one numeric value, shared by the parsers and validate().
inline void check_range(const config_key& k, double v, std::size_t line) {
  if (k.type != key_type::count && k.type != key_type::real) return;
  if (!std::isfinite(v)) key_error(k.name, line, "must be finite (got " + show_number(v) + ")");
  if ((k.min_open ? !(v > k.min) : !(v >= k.min)) || !(v <= k.max))
    key_error(k.name, line,
              "is " + show_number(v) + ", outside its range " + range_text(k) + (k.unit.empty() ? "" : std::string(" ").append(k.unit)));
}

inline std::string trim(std::string_view s) {
  std::size_t b = 0, e = s.size();
  while (b < e && (std::isspace(static_cast<unsigned char>(s[b])) || s[b] == '"' || s[b] == '\'' || s[b] == ',' || s[b] == '{' || s[b] == '}')) ++b;
  while (e > b && (std::isspace(static_cast<unsigned char>(s[e - 1])) || s[e - 1] == '"' || s[e - 1] == '\'' || s[e - 1] == ',' || s[e - 1] == '{' ||
                   s[e - 1] == '}'))
    --e;
  return std::string(s.substr(b, e - b));
}

// A number with an optional unit suffix: K M G T (x1000), Ki Mi Gi Ti (x1024), ns us ms s, and an
// optional trailing "B/s", "B", "b/s"/"bps" (bits: /8) or "FLOP/s". A suffix of another dimension
// than the key's unit (a time for a bandwidth) is an error.
inline double parse_quantity(const config_key& k, const std::string& v, std::size_t line) {
  const std::string_view key = k.name;
  const char* b = v.c_str();
  char* end = nullptr;
  errno = 0;
  double x = std::strtod(b, &end);
  if (end == b || v.empty() || !(std::isdigit(static_cast<unsigned char>(v[0])) || v[0] == '.' || v[0] == '-' || v[0] == '+'))
    key_error(key, line, "has a non-numeric value '" + v + "'");
  const std::string digits(b, static_cast<std::size_t>(end - b));
  std::string u(end);
  while (!u.empty() && std::isspace(static_cast<unsigned char>(u.front()))) u.erase(u.begin());
  int exp10 = 0;   // decimal prefixes: applied in the text, so "3.2T" reads as exactly as 3.2e12
  double bin = 1;  // binary prefixes: exact powers of two
  char dim = 0;    // 't' time, 'b' bytes, 'r' byte rate, 'f' FLOP rate, 0 none
  auto eat = [&](std::string_view pre, int e, double s, char d) {
    if (u.rfind(pre, 0) == 0) {
      exp10 = e;
      bin = s;
      u.erase(0, pre.size());
      if (d) dim = d;
      return true;
    }
    return false;
  };
  (void)(eat("Ki", 0, 1024.0, 0) || eat("Mi", 0, 1048576.0, 0) || eat("Gi", 0, 1073741824.0, 0) || eat("Ti", 0, 1099511627776.0, 0) ||
         eat("ns", -9, 1, 't') || eat("us", -6, 1, 't') || eat("ms", -3, 1, 't') || eat("K", 3, 1, 0) || eat("k", 3, 1, 0) || eat("M", 6, 1, 0) ||
         eat("G", 9, 1, 0) || eat("T", 12, 1, 0));
  double bits = 1;
  if (dim == 't') {
    if (!(u.empty() || u == "s")) key_error(key, line, "has an unknown unit '" + u + "' after a time prefix");
  } else if (u == "b/s" || u == "bps") {
    bits = 8;
    dim = 'r';
  } else if (u == "B/s")
    dim = 'r';
  else if (u == "B")
    dim = 'b';
  else if (u == "s")
    dim = 't';
  else if (u == "FLOP/s")
    dim = 'f';
  else if (!u.empty())
    key_error(key, line, "has an unknown unit '" + u + "'");
  const char want = k.unit == "s" ? 't' : k.unit == "B" ? 'b' : k.unit == "B/s" ? 'r' : k.unit == "FLOP/s" ? 'f' : 0;
  if (dim && dim != want)
    key_error(key, line,
              "'" + v + "' has the wrong unit for a key measured in " + (k.unit.empty() ? std::string("plain numbers") : std::string(k.unit)));
  if (exp10 != 0) {
    if (digits.find_first_of("eExXpP") == std::string::npos && digits.find_first_not_of("+-.0123456789") == std::string::npos)
      x = std::strtod((digits + "e" + std::to_string(exp10)).c_str(), nullptr);  // one correctly rounded conversion
    else
      x *= std::pow(10.0, exp10);
  }
  return x * bin / bits;
}

inline bool parse_flag(const config_key& k, std::string_view v, std::size_t line) {
  if (v == "true" || v == "1" || v == "on" || v == "yes") return true;
  if (v == "false" || v == "0" || v == "off" || v == "no") return false;
  key_error(k.name, line, std::string("must be true/false (got '").append(v) + "')");
}

// Stores one value into the field of key `k` after its range check (counts arrive as exact
// integers when the text was one, as `whole`).
struct parsed_value {
  double number = 0;
  std::uint64_t whole = 0;
  bool exact = false;  // `whole` holds the value exactly
  bool flag = false;
  unsigned choice = 0;
};

inline void store(const config_key& k, cluster_config& c, const parsed_value& v, std::size_t line) {
  if (k.type == key_type::count) {
    const double x = v.exact ? static_cast<double>(v.whole) : v.number;
    if (!v.exact && (x != std::floor(x) || !std::isfinite(x))) key_error(k.name, line, "must be a non-negative integer (got " + show_number(x) + ")");
    check_range(k, x, line);
    if (!v.exact && x >= 18446744073709551616.0) key_error(k.name, line, "is too large");
    const std::uint64_t w = v.exact ? v.whole : static_cast<std::uint64_t>(x);
    if (v.exact && static_cast<double>(w) > k.max) key_error(k.name, line, "is " + std::to_string(w) + ", outside its range " + range_text(k));
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::size_t> || std::is_same_v<T, unsigned>) *p = static_cast<T>(w);
        },
        k.at(c));
  } else if (k.type == key_type::real) {
    check_range(k, v.number, line);
    *std::get<double*>(k.at(c)) = v.number;
  } else if (k.type == key_type::flag) {
    *std::get<bool*>(k.at(c)) = v.flag;
  } else {
    *std::get<routing_policy*>(k.at(c)) = static_cast<routing_policy>(v.choice);
  }
}

// A value given as text (a `key = value` line, or a JSON string).
inline parsed_value parse_text_value(const config_key& k, const std::string& v, std::size_t line) {
  parsed_value out;
  switch (k.type) {
    case key_type::count: {
      if (!v.empty() && std::all_of(v.begin(), v.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
        errno = 0;
        char* end = nullptr;
        const unsigned long long w = std::strtoull(v.c_str(), &end, 10);
        if (errno == ERANGE) key_error(k.name, line, "'" + v + "' is too large");
        out.whole = w;
        out.exact = true;
      } else {
        out.number = parse_quantity(k, v, line);
      }
      break;
    }
    case key_type::real: out.number = parse_quantity(k, v, line); break;
    case key_type::flag: out.flag = parse_flag(k, v, line); break;
    case key_type::choice: out.choice = choice_index(k, v, line); break;
  }
  return out;
}

inline std::string json_kind(const nlohmann::json& j) {
  return j.is_object()    ? "an object"
         : j.is_array()   ? "an array"
         : j.is_string()  ? "a string"
         : j.is_boolean() ? "a boolean"
         : j.is_null()    ? "null"
                          : "a number";
}

// A value given as a JSON value of any kind.
inline parsed_value parse_json_value(const config_key& k, const nlohmann::json& j, std::size_t line) {
  if (j.is_string()) return parse_text_value(k, j.get<std::string>(), line);
  parsed_value out;
  const char* want = k.type == key_type::count  ? "a non-negative integer or a quantity string"
                     : k.type == key_type::real ? "a number or a quantity string"
                     : k.type == key_type::flag ? "true or false"
                                                : "a string";
  switch (k.type) {
    case key_type::count:
      if (j.is_number_unsigned()) {
        out.whole = j.get<std::uint64_t>();
        out.exact = true;
      } else if (j.is_number()) {
        out.number = j.get<double>();
      } else {
        key_error(k.name, line, std::string("must be ") + want + " (got " + json_kind(j) + ")");
      }
      break;
    case key_type::real:
      if (!j.is_number()) key_error(k.name, line, std::string("must be ") + want + " (got " + json_kind(j) + ")");
      out.number = j.get<double>();
      break;
    case key_type::flag:
      if (!j.is_boolean()) key_error(k.name, line, std::string("must be ") + want + " (got " + json_kind(j) + ")");
      out.flag = j.get<bool>();
      break;
    case key_type::choice: key_error(k.name, line, std::string("must be ") + want + " (got " + json_kind(j) + ")");
  }
  return out;
}

// Line (1-based) of the first mention of "name" in JSON text, 0 if none: JSON keys carry no
// position once parsed, so errors point at the first place the key is spelled.
inline std::size_t json_key_line(std::string_view text, std::string_view name) {
  const std::string quoted = std::string("\"").append(name) + "\"";
  const auto at = text.find(quoted);
  if (at == std::string_view::npos) return 0;
  return 1 + static_cast<std::size_t>(std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(at), '\n'));
}

// Whether the text is JSON: its first character outside whitespace and comments is '{'.
inline bool looks_like_json(std::string_view t) {
  std::size_t i = 0;
  while (i < t.size()) {
    if (std::isspace(static_cast<unsigned char>(t[i])))
      ++i;
    else if (t[i] == '#' || t.substr(i, 2) == "//") {
      while (i < t.size() && t[i] != '\n') ++i;
    } else if (t.substr(i, 2) == "/*") {
      const auto e = t.find("*/", i + 2);
      i = e == std::string_view::npos ? t.size() : e + 2;
    } else {
      return t[i] == '{';
    }
  }
  return false;
}

// Applies one key's value once (a second mention of the same key, under any of its names, is an error).
struct key_setter {
  cluster_config& c;
  std::vector<bool> seen = std::vector<bool>(cluster_config_keys().size(), false);
  const config_key& lookup(const std::string& name, std::size_t line) {
    const config_key* k = find_config_key(name);
    if (!k) key_error(name, line, "is an unknown key (tessel-perf --cluster-keys lists them)");
    const auto idx = static_cast<std::size_t>(k - cluster_config_keys().data());
    if (seen[idx]) key_error(name, line, std::string("is given twice (as '").append(k->name) + "' or one of its other names)");
    seen[idx] = true;
    return *k;
  }
};

inline cluster_config parse_cluster_json(std::string_view text) {
  using nlohmann::json;
  // Duplicate keys inside one object: nlohmann keeps the last silently, so a callback records them.
  std::vector<std::vector<std::string>> open;
  std::string duplicate;
  auto cb = [&](int /*depth*/, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start)
      open.emplace_back();
    else if (ev == json::parse_event_t::object_end && !open.empty())
      open.pop_back();
    else if (ev == json::parse_event_t::key && !open.empty() && parsed.is_string()) {
      auto& keys = open.back();
      const auto& s = parsed.get_ref<const std::string&>();
      if (std::find(keys.begin(), keys.end(), s) != keys.end() && duplicate.empty()) duplicate = s;
      keys.push_back(s);
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    const std::size_t upto = std::min<std::size_t>(e.byte ? e.byte - 1 : 0, text.size());
    const std::size_t line = 1 + static_cast<std::size_t>(std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(upto), '\n'));
    std::string what = e.what();
    if (const auto p = what.find("parse error"); p != std::string::npos) what = what.substr(p);
    throw config_error("", line, config_where("", line) + "malformed JSON: " + what, errc::format);
  } catch (const json::exception& e) {  // a number nlohmann cannot hold (out_of_range.406), ...
    std::string what = e.what();
    if (const auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
    throw config_error("", 0, "config: malformed JSON: " + what, errc::format);
  }
  if (!duplicate.empty()) key_error(duplicate, json_key_line(text, duplicate), "appears twice in one JSON object");
  if (!j.is_object()) throw config_error("", 1, "config: a JSON cluster config must be an object", errc::format);
  cluster_config c;
  key_setter set{c};
  static constexpr std::string_view groups[] = {"card", "fabric", "scaleout", "faults"};
  for (const auto& [name, v] : j.items()) {
    if (v.is_object() && std::find(std::begin(groups), std::end(groups), name) != std::end(groups)) {
      for (const auto& [field, w] : v.items()) {
        const std::string full = name + "." + field;
        const std::size_t line = json_key_line(text, field);
        const config_key* k = find_config_key(full);
        if (!k || k->group != name) key_error(full, line, "is an unknown key (tessel-perf --cluster-keys lists them)");
        const config_key& key = set.lookup(full, line);
        store(key, c, parse_json_value(key, w, line), line);
      }
      continue;
    }
    const std::size_t line = json_key_line(text, name);
    if (name.find('.') != std::string::npos) key_error(name, line, "is an unknown key (nest it: {\"group\": {\"key\": ...}})");
    const config_key& key = set.lookup(name, line);
    store(key, c, parse_json_value(key, v, line), line);
  }
  return c;
}

inline cluster_config parse_cluster_lines(std::string_view text) {
  cluster_config c;
  key_setter set{c};
  // One line at a time: comments go first (a comment may hold commas), then several pairs on a
  // line are split on commas outside quotes.
  std::istringstream lines{std::string(text)};
  std::string raw;
  std::size_t lineno = 0;
  while (std::getline(lines, raw)) {
    ++lineno;
    if (auto h = raw.find('#'); h != std::string::npos) raw.erase(h);
    if (auto h = raw.find("//"); h != std::string::npos) raw.erase(h);
    std::vector<std::string> pairs(1);
    bool in_str = false;
    for (char ch : raw) {
      if (ch == '"') in_str = !in_str;
      if (ch == ',' && !in_str)
        pairs.emplace_back();
      else
        pairs.back().push_back(ch);
    }
    for (const auto& pair : pairs) {
      const std::string t = trim(pair);
      if (t.empty()) continue;
      std::size_t sep = t.find('=');
      if (sep == std::string::npos) sep = t.find(':');
      if (sep == std::string::npos) throw config_error("", lineno, config_where("", lineno) + "not 'key = value': '" + t + "'", errc::format);
      const std::string key = trim(t.substr(0, sep)), val = trim(t.substr(sep + 1));
      if (key.empty()) throw config_error("", lineno, config_where("", lineno) + "no key before the '='", errc::format);
      const config_key& k = set.lookup(key, lineno);
      if (val.empty()) key_error(k.name, lineno, "has no value");
      store(k, c, parse_text_value(k, val, lineno), lineno);
    }
  }
  return c;
}

}  // namespace detail

inline void cluster_config::validate() const {
  for (const auto& k : cluster_config_keys()) detail::check_range(k, detail::numeric_value(k, *this), 0);
  auto bad = [](std::string_view key, const std::string& m) { detail::key_error(key, 0, m); };
  if (cards() > (std::size_t{1} << 20))
    bad("supernodes", "makes too many cards (" + std::to_string(cards_per_supernode) + " x " + std::to_string(scaleout.supernodes) + ", max 2^20)");
  if (fabric.ports_per_card % fabric.planes != 0)
    bad("ports_per_card", std::to_string(fabric.ports_per_card) + " does not fit " + std::to_string(fabric.planes) + " planes (must be a multiple)");
  if (fabric.switch_buffer != 0 && fabric.switch_buffer < fabric.chunk_bytes / 64)
    bad("switch_buffer",
        std::to_string(fabric.switch_buffer) + " is too small for chunk_bytes " + std::to_string(fabric.chunk_bytes) + " (need >= chunk_bytes/64)");
  if (fabric.shaping && fabric.shaping_window == 0) bad("shaping_window", "must be positive when shaping is on");
  if (scaleout.supernodes > 1) {
    if (!(scaleout.nic_bandwidth > 0)) bad("nic_bandwidth", "must be positive with several super-nodes");
    if (scaleout.spines == 0) bad("spines", "must be positive with several super-nodes");
  }
}

// Parses a cluster description, starting from the UBL128 defaults, and validates it. Two forms:
//  * JSON (the text starts with '{'; `//` and `/* */` comments allowed): keys flat at the top level
//    ({"planes": 4}) or nested in their group ({"fabric": {"planes": 4}}); values are JSON numbers,
//    booleans and strings, and a string may carry a unit ("400Gb/s", "150ns", "64Gi").
//  * `key = value` lines ('#' and '//' comments, several comma-separated pairs on a line allowed;
//    a key may be spelled group.field).
// Unknown or repeated keys, wrong types, out-of-range values and malformed text are config_errors
// naming the key and line (errc::format for text that is not the format at all).
inline cluster_config parse_cluster_config(std::string_view text) {
  cluster_config c = detail::looks_like_json(text) ? detail::parse_cluster_json(text) : detail::parse_cluster_lines(text);
  c.validate();
  return c;
}

inline cluster_config load_cluster_config(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw config_error("", 0, "config: '" + path + "' is a directory", errc::io);
  std::ifstream f(path, std::ios::binary);
  if (!f) throw config_error("", 0, "config: cannot open '" + path + "'", errc::io);
  std::stringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw config_error("", 0, "config: cannot read '" + path + "'", errc::io);
  try {
    return parse_cluster_config(ss.str());
  } catch (const config_error& e) {  // the same error, naming the file too
    std::string what = e.what();
    const std::string_view prefix = "tessel::emulator: config: ";
    if (what.rfind(prefix, 0) == 0) what.erase(0, prefix.size());
    throw config_error(e.key, e.line, "config: " + path + ": " + what, e.code());
  }
}

// The config as nested JSON, every key written (parse_cluster_config(to_json(c).dump()) == c).
inline nlohmann::json to_json(const cluster_config& c) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& k : cluster_config_keys()) {
    nlohmann::json& slot = k.group.empty() ? j[std::string(k.field)] : j[std::string(k.group)][std::string(k.field)];
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, routing_policy>)
            slot = std::string(detail::choice_words(k, true).at(static_cast<unsigned>(*p)));
          else
            slot = *p;
        },
        k.at(const_cast<cluster_config&>(c)));
  }
  return j;
}

inline void write_cluster_config(const cluster_config& c, const std::string& path) {
  std::ofstream f(path, std::ios::binary);
  if (!f) throw config_error("", 0, "config: cannot write '" + path + "'", errc::io);
  f << to_json(c).dump(2) << "\n";
  if (!f) throw config_error("", 0, "config: writing '" + path + "' failed", errc::io);
}

// The key table as text: one row per key with its nested name, type, unit, default (from
// `cluster_config{}`), range and meaning; `tessel-perf --cluster-keys` prints it.
inline std::string describe_cluster_keys() {
  const cluster_config d;
  std::ostringstream o;
  o << "# cluster config keys: `key = value` lines, or JSON with the keys flat or nested as group.key\n";
  o << "# quantities take suffixes K M G T (x1000), Ki Mi Gi Ti (x1024), ns us ms s, B, B/s, b/s (bits), FLOP/s\n";
  char row[512];
  std::snprintf(row, sizeof row, "%-24s %-28s %-7s %-7s %-17s %-22s %s\n", "key", "JSON", "type", "unit", "default", "range", "meaning");
  o << row;
  const nlohmann::json v = to_json(d);
  for (const auto& k : cluster_config_keys()) {
    std::string def, range;
    const nlohmann::json& dv = k.group.empty() ? v.at(std::string(k.field)) : v.at(std::string(k.group)).at(std::string(k.field));
    def = dv.is_string() ? dv.get<std::string>() : dv.dump();
    if (k.type == key_type::choice) {
      for (auto w : detail::choice_words(k, false)) {
        if (!range.empty()) range += '|';
        range += w;
      }
    } else if (k.type == key_type::flag) {
      range = "true|false";
    } else {
      range = detail::range_text(k);
    }
    std::string name(k.name);
    if (!k.alias.empty()) name += std::string(" (").append(k.alias) + ")";
    std::snprintf(row, sizeof row, "%-24s %-28s %-7s %-7s %-17s %-22s %s\n", name.c_str(), k.nested_name().c_str(),
                  std::string(key_type_name(k.type)).c_str(), k.unit.empty() ? "-" : std::string(k.unit).c_str(), def.c_str(), range.c_str(),
                  std::string(k.meaning).c_str());
    o << row;
  }
  return o.str();
}

}  // namespace emu
}  // namespace v0
}  // namespace tessel
