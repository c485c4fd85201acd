// GEMM plans and the tuning cache. The built-in heuristic picks how a packed GEMM is cut into
// blocks (gemm.hpp); a plan overrides the choices that never change a result's bits — rows of C
// per block, whether a transposed A is packed once for all column blocks, whether the blocks run on
// the calling thread, whether a narrow C is computed as its transpose — for one exact problem
// (types, transposes, M, N, K, worker count).
// gemm_autotune (gemm_autotune.hpp) times the candidates on this machine and records the winners;
// the cache file keeps them per CPU model:
//
//   $TESSEL_GEMM_TUNE                      a path, or "off" to ignore every cache
//   ${XDG_CACHE_HOME:-$HOME/.cache}/tessel/gemm-tune-<cpu model>.json   otherwise
//
// read on the first packed GEMM of the process. An absent file means the heuristic, silently; a
// file written for another CPU model, target or blocking revision (stale), or one that breaks the
// format (corrupt), means the heuristic too, with one warning on stderr. Blocking choices that
// change the order of the sums along K (the K chunk, split-K, the direct paths) are functions of
// the shape alone and are never in a plan.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <system_error>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <tessel/arch/target.hpp>
#include <tessel/ops/errors.hpp>
#include <tessel/types/dtype.hpp>

namespace tessel {
namespace detail {
// Rows of C per accumulator slab of every packed GEMM config (gemm_config::MC); a plan's
// block_rows is a multiple of it.
inline constexpr std::size_t gemm_mc = 72;
// Rows per block the resident program takes at most (2 · gemm_config::MB_max).
inline constexpr std::size_t gemm_max_block_rows = 2048;
}  // namespace detail

inline namespace v0 {

// The bit-neutral choices of one packed GEMM. Zero / -1 / false: the heuristic's choice. With
// swap, block_rows counts rows of Cᵀ.
struct gemm_plan {
  std::size_t block_rows = 0;   // rows of C per block: a multiple of 72, at most 2048; 0 = heuristic
  int pack_a = -1;              // a transposed A packed once for all column blocks: 1 yes, 0 no, -1 heuristic
  bool calling_thread = false;  // every block on the calling thread (no hand-off to workers)
  int swap = -1;                // C computed as its transpose, Cᵀ = op(B)ᵀ·op(A)ᵀ (packed products only): 1 yes, 0 no, -1 heuristic
  bool operator==(const gemm_plan&) const = default;
  bool is_default() const { return *this == gemm_plan{}; }
};

// The exact problem a plan is for. ta/tb: the operand is stored transposed (its column stride is
// not 1). workers: the device's worker count.
struct gemm_tune_key {
  dtype a = dtype::f32, b = dtype::f32, c = dtype::f32;
  bool ta = false, tb = false;
  std::size_t M = 0, N = 0, K = 0;
  unsigned workers = 1;
  bool operator==(const gemm_tune_key&) const = default;
};

// What loading a cache found.
struct gemm_tune_status {
  enum class state { loaded, absent, stale, corrupt, disabled };
  state what = state::absent;
  std::string path;
  std::string message;  // why the cache is not used (stale, corrupt), or what it holds
  std::size_t plans = 0;
  bool warning() const { return what == state::stale || what == state::corrupt; }
};

// Bumped whenever the heuristic's blocking or the meaning of a plan's fields changes: caches
// written under another revision are stale.
inline constexpr int gemm_tune_revision = 2;  // 2: a transposed A is packed once only when C has more column blocks than workers
inline constexpr const char* gemm_tune_format = "tessel-gemm-tune-1";

}  // namespace v0

namespace detail {

struct gemm_tune_key_hash {
  std::size_t operator()(const gemm_tune_key& k) const noexcept {
    std::size_t h = 1469598103934665603ull;
    auto mix = [&](std::size_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(static_cast<std::size_t>(k.a));
    mix(static_cast<std::size_t>(k.b));
    mix(static_cast<std::size_t>(k.c));
    mix(std::size_t(k.ta) * 2 + std::size_t(k.tb));
    mix(k.M);
    mix(k.N);
    mix(k.K);
    mix(k.workers);
    return h;
  }
};

struct gemm_tune_table {
  std::shared_mutex mu;
  std::unordered_map<gemm_tune_key, gemm_plan, gemm_tune_key_hash> plans;
  std::atomic<bool> any{false};
  std::once_flag loaded;
};
inline gemm_tune_table& gemm_tune_store() {
  static gemm_tune_table t;
  return t;
}

// The tuner's candidate for GEMMs launched by this thread (overrides the table), and whether the
// last GEMM this thread launched consulted a plan at all (the direct, skinny and block-scaled paths
// do not).
inline thread_local const gemm_plan* gemm_plan_forced = nullptr;
inline thread_local bool gemm_plan_consulted = false;
// What that launch did, spelled as an explicit plan (rows per block, 1/0 for a transposed A packed
// once or not, -1 where A is not transposed, whether it ran on the calling thread, whether it ran
// as its transpose): the tuner compares candidates by it, so two spellings of one blocking are
// timed once.
inline thread_local gemm_plan gemm_plan_applied{};

inline std::string gemm_tune_cpu_slug() {
  std::string s;
  for (char ch : arch::cpu_model()) {
    const bool keep = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
    if (keep)
      s += ch;
    else if (!s.empty() && s.back() != '-')
      s += '-';
  }
  while (!s.empty() && s.back() == '-') s.pop_back();
  return s.empty() ? std::string("unknown") : s;
}

inline bool gemm_tune_disabled_by_env() {
  const char* p = std::getenv("TESSEL_GEMM_TUNE");
  if (!p) return false;
  const std::string v = p;
  return v == "off" || v == "0" || v == "none";
}

inline gemm_tune_status gemm_tune_reject(gemm_tune_status::state what, const std::string& path, const std::string& why) {
  gemm_tune_status st;
  st.what = what;
  st.path = path;
  st.message = "tessel: GEMM tuning cache '" + path + "' is " + (what == gemm_tune_status::state::stale ? "stale" : "corrupt") + " (" + why +
               "); using the built-in blocking heuristic";
  return st;
}

inline void gemm_tune_replace(std::unordered_map<gemm_tune_key, gemm_plan, gemm_tune_key_hash> plans) {
  auto& t = gemm_tune_store();
  std::unique_lock lock(t.mu);
  t.plans = std::move(plans);
  t.any.store(!t.plans.empty(), std::memory_order_release);
}

}  // namespace detail

inline namespace v0 {

// Where the tuning cache lives ("" when TESSEL_GEMM_TUNE is off, or neither HOME nor
// XDG_CACHE_HOME is set).
inline std::string gemm_tune_path() {
  if (const char* p = std::getenv("TESSEL_GEMM_TUNE"); p && *p) return detail::gemm_tune_disabled_by_env() ? std::string() : std::string(p);
  const std::string file = "/tessel/gemm-tune-" + detail::gemm_tune_cpu_slug() + ".json";
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + file;
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache" + file;
  return {};
}

// Parses a cache file's text. On success the plans are returned through `out`; otherwise the
// status says why (stale or corrupt) and `out` is left empty.
inline gemm_tune_status parse_gemm_tune(std::string_view text, const std::string& path, std::vector<std::pair<gemm_tune_key, gemm_plan>>& out) {
  using state = gemm_tune_status::state;
  out.clear();
  std::vector<std::pair<gemm_tune_key, gemm_plan>> plans;  // handed out only when every plan is good
  const nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded()) return detail::gemm_tune_reject(state::corrupt, path, "not JSON");
  if (!j.is_object() || !j.contains("format") || !j["format"].is_string() || j["format"].get<std::string>() != gemm_tune_format)
    return detail::gemm_tune_reject(state::corrupt, path, std::string("not a tessel GEMM tuning file (format ") + gemm_tune_format + ")");
  auto text_field = [&](const char* k) -> std::optional<std::string> {
    const auto it = j.find(k);
    if (it == j.end() || !it->is_string()) return std::nullopt;
    return it->get<std::string>();
  };
  const auto cpu = text_field("cpu"), target = text_field("target");
  const auto rev = j.find("revision");
  if (!cpu || !target || rev == j.end() || !rev->is_number_integer() || !j.contains("plans") || !j["plans"].is_array())
    return detail::gemm_tune_reject(state::corrupt, path, "cpu, target, revision or plans missing or of the wrong type");
  if (*cpu != arch::cpu_model())
    return detail::gemm_tune_reject(state::stale, path, "written for CPU '" + *cpu + "', this is '" + arch::cpu_model() + "'");
  if (*target != arch::target_name())
    return detail::gemm_tune_reject(state::stale, path, "written for target " + *target + ", this build is " + arch::target_name());
  if (rev->get<std::int64_t>() != gemm_tune_revision)
    return detail::gemm_tune_reject(
        state::stale, path,
        "blocking revision " + std::to_string(rev->get<std::int64_t>()) + ", this library is " + std::to_string(gemm_tune_revision));
  std::size_t index = 0;
  for (const auto& e : j["plans"]) {
    const std::string where = "plan " + std::to_string(index++) + ": ";
    if (!e.is_object()) return detail::gemm_tune_reject(state::corrupt, path, where + "not an object");
    auto count = [&](const char* k, std::uint64_t lo, std::uint64_t hi) -> std::optional<std::uint64_t> {
      const auto it = e.find(k);
      if (it == e.end() || !it->is_number_unsigned()) return std::nullopt;
      const std::uint64_t v = it->get<std::uint64_t>();
      if (v < lo || v > hi) return std::nullopt;
      return v;
    };
    auto type = [&](const char* k) -> std::optional<dtype> {
      const auto it = e.find(k);
      if (it == e.end() || !it->is_string()) return std::nullopt;
      for (dtype d : {dtype::f32, dtype::bf16, dtype::fp16, dtype::e4m3, dtype::e5m2})
        if (dtype_name(d) == it->get<std::string>()) return d;
      return std::nullopt;
    };
    auto op = [&](const char* k) -> std::optional<bool> {
      const auto it = e.find(k);
      if (it == e.end() || !it->is_string()) return std::nullopt;
      const std::string v = it->get<std::string>();
      if (v == "N") return false;
      if (v == "T") return true;
      return std::nullopt;
    };
    constexpr std::uint64_t max_dim = std::uint64_t{1} << 40;
    const auto a = type("a"), b = type("b"), c = type("c");
    const auto ta = op("ta"), tb = op("tb");
    const auto M = count("M", 1, max_dim), N = count("N", 1, max_dim), K = count("K", 1, max_dim), workers = count("workers", 1, 1u << 16);
    const auto rows = count("block_rows", 0, detail::gemm_max_block_rows);
    const auto pack = e.find("pack_a");
    const auto swap = e.find("swap");
    const auto calling = e.find("calling_thread");
    if (!a || !b || !c) return detail::gemm_tune_reject(state::corrupt, path, where + "a, b or c is not a GEMM element type");
    if (!ta || !tb) return detail::gemm_tune_reject(state::corrupt, path, where + "ta or tb is not \"N\" or \"T\"");
    if (!M || !N || !K || !workers) return detail::gemm_tune_reject(state::corrupt, path, where + "M, N, K or workers missing or out of range");
    if (!rows || *rows % detail::gemm_mc != 0)
      return detail::gemm_tune_reject(state::corrupt, path, where + "block_rows is not a multiple of 72 in [0, 2048]");
    if (pack == e.end() || !pack->is_number_integer() || pack->get<std::int64_t>() < -1 || pack->get<std::int64_t>() > 1)
      return detail::gemm_tune_reject(state::corrupt, path, where + "pack_a is not -1, 0 or 1");
    if (calling == e.end() || !calling->is_boolean())
      return detail::gemm_tune_reject(state::corrupt, path, where + "calling_thread is not a boolean");
    if (swap == e.end() || !swap->is_number_integer() || swap->get<std::int64_t>() < -1 || swap->get<std::int64_t>() > 1)
      return detail::gemm_tune_reject(state::corrupt, path, where + "swap is not -1, 0 or 1");
    gemm_tune_key key{*a, *b, *c, *ta, *tb, *M, *N, *K, static_cast<unsigned>(*workers)};
    gemm_plan plan{*rows, static_cast<int>(pack->get<std::int64_t>()), calling->get<bool>(), static_cast<int>(swap->get<std::int64_t>())};
    plans.emplace_back(key, plan);
  }
  out = std::move(plans);
  gemm_tune_status st;
  st.what = state::loaded;
  st.path = path;
  st.plans = out.size();
  st.message = path + ": " + std::to_string(out.size()) + " GEMM plans";
  return st;
}

}  // namespace v0

namespace detail {
// Reads the cache at `path` into the table (see load_gemm_tune).
inline gemm_tune_status gemm_tune_read(const std::string& path) {
  using state = gemm_tune_status::state;
  std::vector<std::pair<gemm_tune_key, gemm_plan>> plans;
  gemm_tune_status st;
  std::ifstream f(path, std::ios::binary);
  if (path.empty() || !f) {
    st.what = state::absent;
    st.path = path;
    st.message = path.empty() ? std::string("no GEMM tuning cache path") : path + " not found";
  } else {
    std::stringstream ss;
    ss << f.rdbuf();
    st = parse_gemm_tune(ss.str(), path, plans);
  }
  std::unordered_map<gemm_tune_key, gemm_plan, gemm_tune_key_hash> table;
  for (auto& [k, p] : plans)
    if (!p.is_default()) table[k] = p;
  gemm_tune_replace(std::move(table));
  return st;
}

// Reads the cache at gemm_tune_path() (none when TESSEL_GEMM_TUNE is off), printing the status
// on stderr when it is a warning.
inline gemm_tune_status gemm_tune_read_default() {
  if (gemm_tune_disabled_by_env()) {
    gemm_tune_replace({});
    gemm_tune_status st;
    st.what = gemm_tune_status::state::disabled;
    st.message = "TESSEL_GEMM_TUNE=off";
    return st;
  }
  gemm_tune_status st = gemm_tune_read(gemm_tune_path());
  if (st.warning()) std::fprintf(stderr, "%s\n", st.message.c_str());
  return st;
}

// The lazy load every reader runs first: the default cache, once per process (unless an explicit
// load or clear came first).
inline void gemm_tune_ensure_loaded() {
  std::call_once(gemm_tune_store().loaded, [] { (void)gemm_tune_read_default(); });
}
inline void gemm_tune_mark_loaded() {
  std::call_once(gemm_tune_store().loaded, [] {});
}
}  // namespace detail

inline namespace v0 {

// Replaces the process's plans with those of the cache at `path`. An absent, stale or corrupt
// cache leaves no plans (the heuristic everywhere); the status says which and why.
inline gemm_tune_status load_gemm_tune(const std::string& path) {
  detail::gemm_tune_mark_loaded();
  return detail::gemm_tune_read(path);
}

// Loads the cache at gemm_tune_path() (nothing when TESSEL_GEMM_TUNE is off), printing the
// status on stderr when it is a warning: what the first packed GEMM of a process does.
inline gemm_tune_status load_default_gemm_tune() {
  detail::gemm_tune_mark_loaded();
  return detail::gemm_tune_read_default();
}

// Forgets every plan (the heuristic everywhere) until the next load or record.
inline void clear_gemm_tune() {
  detail::gemm_tune_mark_loaded();
  detail::gemm_tune_replace({});
}

// Records (or, with a default plan, removes) the plan for one problem in this process. A plan no
// GEMM could run (rows per block not a multiple of 72 in [0, 2048], pack_a outside -1..1) or an
// empty problem is a gemm_error(errc::invalid_argument).
inline void set_gemm_plan(const gemm_tune_key& key, const gemm_plan& plan) {
  if (key.M == 0 || key.N == 0 || key.K == 0 || key.workers == 0)
    throw gemm_error(errc::invalid_argument, "set_gemm_plan: M, N, K and workers must be positive");
  if (plan.block_rows % detail::gemm_mc != 0 || plan.block_rows > detail::gemm_max_block_rows)
    throw gemm_error(errc::invalid_argument,
                     "set_gemm_plan: block_rows " + std::to_string(plan.block_rows) + " is not a multiple of 72 in [0, 2048]");
  if (plan.pack_a < -1 || plan.pack_a > 1)
    throw gemm_error(errc::invalid_argument, "set_gemm_plan: pack_a " + std::to_string(plan.pack_a) + " is not -1, 0 or 1");
  if (plan.swap < -1 || plan.swap > 1)
    throw gemm_error(errc::invalid_argument, "set_gemm_plan: swap " + std::to_string(plan.swap) + " is not -1, 0 or 1");
  auto& t = detail::gemm_tune_store();
  detail::gemm_tune_ensure_loaded();
  std::unique_lock lock(t.mu);
  if (plan.is_default())
    t.plans.erase(key);
  else
    t.plans[key] = plan;
  t.any.store(!t.plans.empty(), std::memory_order_release);
}

// The plan recorded for a problem, if any (loading the default cache first, as a GEMM would).
inline std::optional<gemm_plan> find_gemm_plan(const gemm_tune_key& key) {
  auto& t = detail::gemm_tune_store();
  detail::gemm_tune_ensure_loaded();
  if (!t.any.load(std::memory_order_acquire)) return std::nullopt;
  std::shared_lock lock(t.mu);
  const auto it = t.plans.find(key);
  if (it == t.plans.end()) return std::nullopt;
  return it->second;
}

// Every recorded plan, in a stable order.
inline std::vector<std::pair<gemm_tune_key, gemm_plan>> gemm_plans() {
  auto& t = detail::gemm_tune_store();
  detail::gemm_tune_ensure_loaded();
  std::vector<std::pair<gemm_tune_key, gemm_plan>> out;
  {
    std::shared_lock lock(t.mu);
    out.assign(t.plans.begin(), t.plans.end());
  }
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) {
    const auto& a = x.first;
    const auto& b = y.first;
    return std::tie(a.a, a.b, a.c, a.ta, a.tb, a.M, a.N, a.K, a.workers) < std::tie(b.a, b.b, b.c, b.ta, b.tb, b.M, b.N, b.K, b.workers);
  });
  return out;
}

// Writes the process's plans to `path` (creating its folder), replacing the file in one rename.
// Throws gemm_error(errc::io) when it cannot.
inline void save_gemm_tune(const std::string& path) {
  if (path.empty()) throw gemm_error(errc::io, "no GEMM tuning cache path (set TESSEL_GEMM_TUNE or HOME)");
  nlohmann::json plans = nlohmann::json::array();
  for (const auto& [k, p] : gemm_plans())
    plans.push_back({{"a", dtype_name(k.a)},
                     {"b", dtype_name(k.b)},
                     {"c", dtype_name(k.c)},
                     {"ta", k.ta ? "T" : "N"},
                     {"tb", k.tb ? "T" : "N"},
                     {"M", k.M},
                     {"N", k.N},
                     {"K", k.K},
                     {"workers", k.workers},
                     {"block_rows", p.block_rows},
                     {"pack_a", p.pack_a},
                     {"calling_thread", p.calling_thread},
                     {"swap", p.swap}});
  const nlohmann::json j = {
      {"format", gemm_tune_format}, {"cpu", arch::cpu_model()}, {"target", arch::target_name()}, {"revision", gemm_tune_revision}, {"plans", plans}};
  const std::filesystem::path target(path);
  std::error_code ec;
  if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path(), ec);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw gemm_error(errc::io, "cannot write the GEMM tuning cache '" + tmp + "'");
    f << j.dump(1) << "\n";
    if (!f) throw gemm_error(errc::io, "writing the GEMM tuning cache '" + tmp + "' failed");
  }
  std::filesystem::rename(tmp, target, ec);
  if (ec) throw gemm_error(errc::io, "cannot move '" + tmp + "' to '" + path + "': " + ec.message());
}

}  // namespace v0

namespace detail {

// The plan for one launch: the tuner's candidate, else the recorded plan, else the heuristic's
// (a default plan). Cheap when nothing is recorded (one atomic load after the first call).
inline gemm_plan gemm_plan_lookup(const gemm_tune_key& key) {
  gemm_plan_consulted = true;
  if (gemm_plan_forced) return *gemm_plan_forced;
  auto& t = gemm_tune_store();
  detail::gemm_tune_ensure_loaded();
  if (!t.any.load(std::memory_order_acquire)) return {};
  std::shared_lock lock(t.mu);
  const auto it = t.plans.find(key);
  return it == t.plans.end() ? gemm_plan{} : it->second;
}

}  // namespace detail
}  // namespace tessel
