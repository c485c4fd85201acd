// The profiler for real runs: records every launch on a device (program name, grid, wall time, the
// FLOPs and bytes a costed program declares) and every collective on every transport, and writes a
// Chrome/Perfetto trace with achieved-rate counters and a summary (top operators by time, each
// one's roofline bound from the machine's cached limits, and how far from it they ran).
//
// Off by default, and then a launch pays one relaxed atomic load and a branch. On with
// TESSEL_PROFILE=trace.json (read at the first launch, collective or profiler call; the trace and
// a summary on stderr are written at process exit) or with profiler::start(path) / stop() /
// session. The limits come from the file bench_limits --tessel_write_limits writes (limits_path()).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <tessel/detail/json.hpp>
#include <tessel/detail/type_name.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/errors.hpp>

namespace tessel {
inline namespace v0 {
namespace profiler {

// ---------------------------------------------------------------------------------- machine limits
// The machine's own limits as bench_limits measured them, indexed by thread count - 1 (entry t-1
// was measured with t threads). Empty vectors: unknown.
struct machine_limits {
  std::vector<double> fp32_gflops;  // peak FP32 FMA
  std::vector<double> bf16_gflops;  // peak BF16 dot (0 or absent: the build had none; FP32 is then the roof)
  std::vector<double> stream_gbs;   // STREAM bandwidth (the better of copy and triad)
  std::string source;               // the file read, or why the limits are unknown

  bool known() const { return !fp32_gflops.empty() && !stream_gbs.empty(); }

  // Peak GFLOP/s for a kernel of this precision on `threads` workers, 0 when unknown or when the
  // precision has no compute roof (math_precision::none). 16- and 8-bit math is computed through
  // the BF16 dot where the build has it (else FP32), f64 at half the FP32 rate.
  double peak_gflops(math_precision p, unsigned threads) const {
    const double f32 = at(fp32_gflops, threads), b16 = at(bf16_gflops, threads);
    switch (p) {
      case math_precision::none: return 0;
      case math_precision::f64: return f32 / 2;
      case math_precision::f32: return f32;
      case math_precision::bf16:
      case math_precision::fp16:
      case math_precision::fp8:
      case math_precision::i8: return b16 > 0 ? b16 : f32;
    }
    return 0;
  }
  double bandwidth_gbs(unsigned threads) const { return at(stream_gbs, threads); }

 private:
  static double at(const std::vector<double>& v, unsigned threads) {
    if (v.empty()) return 0;
    const std::size_t i = std::min<std::size_t>(std::max(threads, 1u), v.size()) - 1;
    return v[i];
  }
};

// Where the limits cache lives: $TESSEL_LIMITS, else ${XDG_CACHE_HOME:-$HOME/.cache}/tessel/limits.json
// ("" when neither HOME nor XDG_CACHE_HOME is set).
inline std::string limits_path() {
  if (const char* p = std::getenv("TESSEL_LIMITS"); p && *p) return p;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/tessel/limits.json";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/tessel/limits.json";
  return {};
}

namespace detail {
// The numbers under `key` (an array, or one number) of the limits file's JSON object. Returns false
// when the key is absent or its value is not non-negative, finite, sane numbers.
inline bool read_numbers(const nlohmann::json& j, const char* key, std::vector<double>& out) {
  out.clear();
  const auto it = j.find(key);
  if (it == j.end()) return false;
  auto take = [&](const nlohmann::json& v) {
    if (!v.is_number()) return false;
    const double x = v.get<double>();
    if (!(x >= 0) || x > 1e12) return false;  // negative, NaN or absurd
    out.push_back(x);
    return true;
  };
  if (it->is_array()) {
    for (const auto& v : *it)
      if (!take(v)) return false;
  } else if (!take(*it)) {
    return false;
  }
  return !out.empty();
}
}  // namespace detail

// Parses the limits file's text (see write_limits); on any problem the result is unknown, with
// `source` saying why.
inline machine_limits parse_limits(std::string_view text, const std::string& source) {
  machine_limits m;
  std::vector<double> copy, triad;
  const nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  const bool ours =
      !j.is_discarded() && j.is_object() && j.contains("format") && j["format"].is_string() && j["format"].get<std::string>() == "tessel-limits-1";
  if (!ours) {
    m.source = source + ": not a tessel limits file (format tessel-limits-1)";
    return m;
  }
  if (!detail::read_numbers(j, "fp32_fma_gflops", m.fp32_gflops) || !detail::read_numbers(j, "stream_triad_gbs", triad)) {
    m = {};
    m.source = source + ": fp32_fma_gflops or stream_triad_gbs missing or malformed";
    return m;
  }
  if (!detail::read_numbers(j, "bf16_dot_gflops", m.bf16_gflops)) m.bf16_gflops.clear();
  if (!detail::read_numbers(j, "stream_copy_gbs", copy)) copy.clear();
  m.stream_gbs = triad;
  for (std::size_t i = 0; i < std::min(copy.size(), triad.size()); ++i) m.stream_gbs[i] = std::max(copy[i], triad[i]);
  if (std::find(m.fp32_gflops.begin(), m.fp32_gflops.end(), 0.0) != m.fp32_gflops.end() ||
      std::find(m.stream_gbs.begin(), m.stream_gbs.end(), 0.0) != m.stream_gbs.end()) {
    m = {};
    m.source = source + ": a zero FP32 peak or bandwidth";
    return m;
  }
  m.source = source;
  return m;
}

// Reads the limits cache (limits_path()); unknown, with the reason in `source`, when it is absent.
inline machine_limits load_limits() {
  machine_limits m;
  const std::string path = limits_path();
  if (path.empty()) {
    m.source = "no cache path (set TESSEL_LIMITS or HOME)";
    return m;
  }
  std::ifstream f(path);
  if (!f) {
    m.source = path + " not found (run bench_limits --tessel_write_limits)";
    return m;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_limits(ss.str(), path);
}

// Writes the limits file (bench_limits does, after measuring): index t-1 of each array holds the
// figure for t threads. Throws profiler_error(errc::io) if the file cannot be written.
inline void write_limits(const std::string& path, const std::vector<double>& fp32_fma_gflops, const std::vector<double>& bf16_dot_gflops,
                         const std::vector<double>& stream_copy_gbs, const std::vector<double>& stream_triad_gbs) {
  std::ofstream f(path);
  if (!f) throw profiler_error(errc::io, "cannot write the limits file '" + path + "'");
  const nlohmann::json j = {{"format", "tessel-limits-1"},
                            {"fp32_fma_gflops", fp32_fma_gflops},
                            {"bf16_dot_gflops", bf16_dot_gflops},
                            {"stream_copy_gbs", stream_copy_gbs},
                            {"stream_triad_gbs", stream_triad_gbs}};
  f << j.dump(2) << "\n";
  if (!f) throw profiler_error(errc::io, "writing the limits file '" + path + "' failed");
}

// ---------------------------------------------------------------------------------- records
// One launch. Times are seconds since the session started (steady clock).
struct launch_record {
  std::uint32_t name = 0;  // index into names()
  grid dims;
  double start = 0, seconds = 0;
  kernel_cost cost;  // as the program declared it (zero when not costed)
  bool costed = false;
  const char* device = "host";  // "host" or "card"
  std::size_t device_index = 0;
  unsigned workers = 1;            // the device's worker count (which limits apply)
  unsigned thread = 0;             // the launching thread (profiler numbering, from 0)
  std::uint32_t shape = no_shape;  // into names(): the program's shape() ("M=..,N=..,K=.."), if it has one
  static constexpr std::uint32_t no_shape = UINT32_MAX;
};

// One collective call on one rank.
struct collective_record {
  const char* op = "";
  const char* transport = "";
  const char* algorithm = "";
  double bytes = 0;  // nccl-tests' size: the message (all_gather: the gathered result)
  int rank = 0, ranks = 1;
  double start = 0, seconds = 0;
  double transport_seconds = 0;  // by the transport's clock: simulated time on the emulated fabric
  unsigned thread = 0;
};

// ---------------------------------------------------------------------------------- summary
enum class bound_kind : std::uint8_t { unknown, compute, memory };
constexpr const char* bound_name(bound_kind b) {
  switch (b) {
    case bound_kind::compute: return "compute";
    case bound_kind::memory: return "memory";
    default: return "unknown";
  }
}

struct op_stats {
  std::string name;
  std::size_t calls = 0, costed_calls = 0;
  double seconds = 0;           // wall time of all calls
  double flops = 0, bytes = 0;  // declared, summed
  double gflops = 0, gbs = 0;   // achieved: declared work / wall time
  bound_kind bound = bound_kind::unknown;
  double roofline_seconds = 0;  // sum over calls of max(flops / peak, bytes / bandwidth)
  double of_bound = 0;          // roofline_seconds / seconds: 1 = at the roof
  double of_peak_flops = 0;     // share of the compute limit achieved
  double of_bandwidth = 0;      // share of the memory limit achieved
};

struct collective_stats {
  std::string op, transport, algorithm;
  std::size_t calls = 0;
  double seconds = 0, bytes = 0;
  double transport_seconds = 0;    // by the transport's clock (simulated on the emulated fabric)
  double algbw_gbs = 0;            // bytes / seconds, per rank-call
  double transport_algbw_gbs = 0;  // bytes / transport_seconds
};

struct profile_summary {
  std::vector<op_stats> ops;                  // by total time, longest first
  std::vector<collective_stats> collectives;  // by total time, longest first
  std::size_t launches = 0, collective_calls = 0;
  double seconds = 0;  // session length so far
  machine_limits limits;

  std::string to_string(std::size_t top = 15) const {
    std::ostringstream o;
    char line[512];
    o << "tessel profile: " << launches << " launches, " << collective_calls << " collective calls in ";
    std::snprintf(line, sizeof line, "%.3f s", seconds);
    o << line << "\n";
    if (limits.known())
      o << "limits: " << limits.source << "\n";
    else
      o << "limits unknown: " << limits.source << " (bound and shares not computed)\n";
    std::snprintf(line, sizeof line, "%-40s %8s %11s %6s %9s %9s %8s %9s\n", "operator", "calls", "total ms", "%time", "GFLOP/s", "GB/s", "bound",
                  "of bound");
    o << line;
    double total = 0;
    for (const auto& s : ops) total += s.seconds;
    for (std::size_t i = 0; i < ops.size() && i < top; ++i) {
      const auto& s = ops[i];
      char of[32];
      if (s.bound == bound_kind::unknown)
        std::snprintf(of, sizeof of, "-");
      else
        std::snprintf(of, sizeof of, "%.1f%%", 100 * s.of_bound);
      std::snprintf(line, sizeof line, "%-40.40s %8zu %11.3f %5.1f%% %9.2f %9.2f %8s %9s\n", s.name.c_str(), s.calls, s.seconds * 1e3,
                    total > 0 ? 100 * s.seconds / total : 0.0, s.gflops, s.gbs, bound_name(s.bound), of);
      o << line;
    }
    if (ops.size() > top) o << "(" << ops.size() - top << " more operators)\n";
    if (!collectives.empty()) {  // wall clock, then the transport's clock (simulated time on the emulated fabric)
      std::snprintf(line, sizeof line, "%-16s %-10s %-17s %8s %11s %12s %14s %12s\n", "collective", "transport", "algorithm", "calls", "total ms",
                    "algbw GB/s", "transport ms", "algbw GB/s");
      o << line;
      for (std::size_t i = 0; i < collectives.size() && i < top; ++i) {
        const auto& c = collectives[i];
        std::snprintf(line, sizeof line, "%-16.16s %-10.10s %-17.17s %8zu %11.3f %12.3f %14.3f %12.3f\n", c.op.c_str(), c.transport.c_str(),
                      c.algorithm.c_str(), c.calls, c.seconds * 1e3, c.algbw_gbs, c.transport_seconds * 1e3, c.transport_algbw_gbs);
        o << line;
      }
    }
    return o.str();
  }
};

// The summary of these records under these limits (a pure function: tests pass their own limits).
// An operator is compute-bound when its declared FLOPs take longer at the peak than its bytes at
// the bandwidth (summed over its calls, each at its own precision and worker count).
inline profile_summary summarize(const std::vector<launch_record>& launches, const std::vector<collective_record>& colls,
                                 const std::vector<std::string>& names, const machine_limits& limits, double seconds) {
  profile_summary s;
  s.launches = launches.size();
  s.collective_calls = colls.size();
  s.seconds = seconds;
  s.limits = limits;
  std::map<std::uint32_t, std::size_t> index;
  std::vector<double> compute_s, memory_s;
  for (const auto& l : launches) {
    auto [it, fresh] = index.try_emplace(l.name, s.ops.size());
    if (fresh) {
      s.ops.emplace_back();
      s.ops.back().name = l.name < names.size() ? names[l.name] : "?";
      compute_s.push_back(0);
      memory_s.push_back(0);
    }
    const std::size_t i = it->second;
    op_stats& o = s.ops[i];
    o.calls++;
    o.seconds += l.seconds;
    if (!l.costed) continue;
    o.costed_calls++;
    o.flops += l.cost.flops;
    o.bytes += l.cost.bytes;
    if (!limits.known()) continue;
    const double peak = limits.peak_gflops(l.cost.precision, l.workers) * 1e9, bw = limits.bandwidth_gbs(l.workers) * 1e9;
    const double tc = peak > 0 ? l.cost.flops / peak : 0, tm = bw > 0 ? l.cost.bytes / bw : 0;
    compute_s[i] += tc;
    memory_s[i] += tm;
    o.roofline_seconds += std::max(tc, tm);
  }
  for (std::size_t i = 0; i < s.ops.size(); ++i) {
    op_stats& o = s.ops[i];
    if (o.seconds > 0) {
      o.gflops = o.flops / o.seconds * 1e-9;
      o.gbs = o.bytes / o.seconds * 1e-9;
    }
    if (!limits.known() || o.costed_calls == 0 || (compute_s[i] == 0 && memory_s[i] == 0)) continue;
    o.bound = compute_s[i] >= memory_s[i] ? bound_kind::compute : bound_kind::memory;
    if (o.seconds > 0) {
      o.of_bound = o.roofline_seconds / o.seconds;
      o.of_peak_flops = compute_s[i] / o.seconds;
      o.of_bandwidth = memory_s[i] / o.seconds;
    }
  }
  std::stable_sort(s.ops.begin(), s.ops.end(), [](const op_stats& a, const op_stats& b) { return a.seconds > b.seconds; });

  std::map<std::tuple<std::string_view, std::string_view, std::string_view>, std::size_t> cindex;
  for (const auto& c : colls) {
    auto [it, fresh] = cindex.try_emplace({c.op, c.transport, c.algorithm}, s.collectives.size());
    if (fresh) s.collectives.push_back({c.op, c.transport, c.algorithm, 0, 0, 0, 0, 0, 0});
    collective_stats& t = s.collectives[it->second];
    t.calls++;
    t.seconds += c.seconds;
    t.bytes += c.bytes;
    t.transport_seconds += c.transport_seconds;
  }
  for (auto& t : s.collectives) {
    t.algbw_gbs = t.seconds > 0 ? t.bytes / t.seconds * 1e-9 : 0;
    t.transport_algbw_gbs = t.transport_seconds > 0 ? t.bytes / t.transport_seconds * 1e-9 : 0;
  }
  std::stable_sort(s.collectives.begin(), s.collectives.end(),
                   [](const collective_stats& a, const collective_stats& b) { return a.seconds > b.seconds; });
  return s;
}

// ---------------------------------------------------------------------------------- the recorder
namespace detail {

// -1: TESSEL_PROFILE not read yet; 0: off; 1: recording. The only thing a launch reads when off.
inline std::atomic<int> level{-1};
// Numbers host_devices for the trace ("host_device 0", "host_device 1", ...).
inline std::atomic<std::size_t> next_host_device{0};

using clock = std::chrono::steady_clock;

// Small dense thread numbers for the trace's tracks.
inline unsigned thread_index() {
  static std::atomic<unsigned> next{0};
  thread_local const unsigned me = next.fetch_add(1, std::memory_order_relaxed);
  return me;
}

struct state {
  std::mutex mu;
  bool recording = false;
  bool from_env = false;
  std::string path;
  std::ofstream out;
  clock::time_point t0 = clock::now();
  double stopped_at = 0;
  std::vector<launch_record> launches;
  std::vector<collective_record> colls;
  std::vector<std::string> names;  // interned names, never cleared (type-name ids are cached per type)
  std::unordered_map<std::string, std::uint32_t> name_ids;
  bool limits_set = false;
  machine_limits limits;
  std::once_flag env_once;

  ~state();

  double since_start(clock::time_point t) const { return std::chrono::duration<double>(t - t0).count(); }
  std::uint32_t intern_locked(std::string_view n) {
    auto [it, fresh] = name_ids.try_emplace(std::string(n), static_cast<std::uint32_t>(names.size()));
    if (fresh) names.emplace_back(n);
    return it->second;
  }
  const machine_limits& limits_locked() {
    if (!limits_set) {
      limits = load_limits();
      limits_set = true;
    }
    return limits;
  }
  void write_trace_locked(std::ostream& o);
  void write_locked();  // to `out`, from its start; throws profiler_error
};

inline state& the_state() {
  static state s;
  return s;
}

inline std::uint32_t intern(std::string_view n) {
  state& s = the_state();
  std::lock_guard lk(s.mu);
  return s.intern_locked(n);
}

// Starts recording into `path` ("" keeps the records in memory only). Caller holds no lock.
inline void start_locked(state& s, const std::string& path, bool from_env) {
  if (s.recording)
    throw profiler_error(errc::invalid_argument,
                         "profiler::start: a session is already recording" + (s.path.empty() ? std::string() : " into '" + s.path + "'"));
  std::ofstream f;
  if (!path.empty()) {
    f.open(path, std::ios::out | std::ios::trunc);
    if (!f) throw profiler_error(errc::io, "cannot open the trace file '" + path + "' for writing");
  }
  s.out = std::move(f);
  s.path = path;
  s.from_env = from_env;
  s.launches.clear();
  s.colls.clear();
  s.launches.reserve(4096);
  s.t0 = clock::now();
  s.recording = true;
  level.store(1, std::memory_order_relaxed);
}

// Reads TESSEL_PROFILE once. A path that cannot be written is reported on stderr and profiling
// stays off (a throw from a first launch deep in a program would be a worse place to learn it).
inline void init_from_env() {
  state& s = the_state();
  std::call_once(s.env_once, [&] {
    const char* p = std::getenv("TESSEL_PROFILE");
    std::lock_guard lk(s.mu);
    if (p && *p && !s.recording) {
      try {
        start_locked(s, p, true);
        return;
      } catch (const error& e) { std::fprintf(stderr, "%s (TESSEL_PROFILE ignored)\n", e.what()); }
    }
    int expected = -1;  // an API start() may already have turned it on
    level.compare_exchange_strong(expected, 0, std::memory_order_relaxed);
  });
}

// True when this launch or collective should be recorded (the slow path after level != 0).
inline bool recording() {
  int l = level.load(std::memory_order_relaxed);
  if (l < 0) {
    init_from_env();
    l = level.load(std::memory_order_relaxed);
  }
  return l > 0;
}

// Records a collective that ran from t0 to t1 (start and seconds are filled in here).
inline void record_collective(collective_record r, clock::time_point t0, clock::time_point t1) {
  state& s = the_state();
  std::lock_guard lk(s.mu);
  if (!s.recording) return;
  r.start = s.since_start(t0);
  r.seconds = std::chrono::duration<double>(t1 - t0).count();
  s.colls.push_back(r);
}

template <class P>
concept has_name_function = requires(const P& p) {
  { p.name() } -> std::convertible_to<std::string_view>;
};
template <class P>
concept has_static_name = requires {
  { P::name } -> std::convertible_to<std::string_view>;
};

// A program may describe its operands' shapes for the trace: `std::string shape() const`.
template <class P>
concept has_shape_function = requires(const P& p) {
  { p.shape() } -> std::convertible_to<std::string>;
};

// The id of a program's name: its name() member, a static `name`, or its cleaned type name.
template <class P>
std::uint32_t program_name(const P& p) {
  if constexpr (has_name_function<P>) {
    return intern(std::string_view(p.name()));
  } else if constexpr (has_static_name<P>) {
    static const std::uint32_t id = intern(std::string_view(P::name));
    return id;
  } else {
    static const std::uint32_t id = intern(::tessel::detail::clean_type_name(::tessel::detail::raw_type_name<P>()));
    return id;
  }
}

// Runs `run()` as a launch of `program` on a device, and records it. Called only when profiling
// may be on (level != 0), so the device's fast path stays a load and a branch. `cost`: the cost a
// device was given with the launch (an emulated card's explicit cost), else the program's own.
template <class P, class Run>
[[gnu::noinline]] void profiled_launch(const grid& g, const P& program, const char* device, std::size_t device_index, unsigned workers, Run&& run,
                                       const kernel_cost* cost = nullptr) {
  if (!recording()) return run();
  launch_record r;
  r.name = program_name(program);
  if constexpr (has_shape_function<P>) r.shape = intern(std::string(program.shape()));
  r.dims = g;
  if (cost) {
    r.cost = *cost;
    r.costed = costed_program<P> || cost->flops > 0 || cost->bytes > 0;
  } else if constexpr (costed_program<P>) {
    r.cost = static_cast<kernel_cost>(program.cost(g));
    r.costed = true;
  }
  r.device = device;
  r.device_index = device_index;
  r.workers = workers;
  r.thread = thread_index();
  const auto t0 = clock::now();
  run();
  const auto t1 = clock::now();
  state& s = the_state();
  std::lock_guard lk(s.mu);
  if (!s.recording) return;
  r.start = s.since_start(t0);
  r.seconds = std::chrono::duration<double>(t1 - t0).count();
  s.launches.push_back(r);
}

// ---- the trace --------------------------------------------------------------------------------
// Processes: one per device ("host_device 0", "card 3"; tracks: the launching threads) and one
// per transport ("collectives: threads"; tracks: the ranks). Launches are complete ("X") events
// with grid, flops, bytes and precision; counters ("C") give each device's achieved GFLOP/s and
// GB/s and, with known limits, their share of the machine's limits.
inline void state::write_trace_locked(std::ostream& final_out) {
  const machine_limits& lim = limits_locked();
  const profile_summary sum = summarize(launches, colls, names, lim, recording ? since_start(clock::now()) : stopped_at);
  // Built in memory and handed to the stream in pieces of ~256 KiB: one buffer the size of the
  // trace would be first-touched page by page (about 17 us per 4 KiB page here, most of the
  // writing time), while a small one stays mapped and warm.
  constexpr std::size_t piece = std::size_t{256} << 10;
  ::tessel::detail::json_out o;
  o.text.reserve(piece + 4096);
  auto drain = [&] {
    final_out.write(o.text.data(), static_cast<std::streamsize>(o.text.size()));
    o.text.clear();
  };
  o << "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n";
  bool first = true;
  auto sep = [&] {
    if (o.text.size() >= piece) drain();
    o << (first ? "" : ",\n");
    first = false;
  };
  auto us = [&](double s) { ::tessel::detail::json_fixed(o, s * 1e6, 3); };
  // pids: host devices 1.., cards 100001.., transports 200001..
  auto device_pid = [](const launch_record& l) { return (std::string_view(l.device) == "card" ? 100001 : 1) + l.device_index; };
  std::map<std::size_t, std::string> processes;
  std::map<std::pair<std::size_t, unsigned>, std::string> threads;
  std::map<std::string_view, std::size_t> transport_pid;
  for (const auto& l : launches) {
    const std::size_t pid = device_pid(l);
    processes.try_emplace(pid, std::string(std::string_view(l.device) == "card" ? "card " : "host_device ") + std::to_string(l.device_index));
    threads.try_emplace({pid, l.thread}, "thread " + std::to_string(l.thread));
  }
  for (const auto& c : colls) {
    auto [it, fresh] = transport_pid.try_emplace(c.transport, 200001 + transport_pid.size());
    processes.try_emplace(it->second, std::string("collectives: ") + c.transport);
    threads.try_emplace({it->second, static_cast<unsigned>(c.rank)}, "rank " + std::to_string(c.rank));
  }
  for (const auto& [pid, name] : processes) {
    sep();
    o << "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" << pid << ",\"tid\":0,\"args\":{\"name\":";
    ::tessel::detail::json_escape(o, name);
    o << "}}";
  }
  for (const auto& [key, name] : threads) {
    sep();
    o << "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" << key.first << ",\"tid\":" << key.second << ",\"args\":{\"name\":";
    ::tessel::detail::json_escape(o, name);
    o << "}}";
  }
  static constexpr const char* precisions[] = {"none", "f64", "f32", "bf16", "fp16", "fp8", "i8"};
  for (const auto& l : launches) {
    const std::size_t pid = device_pid(l);
    sep();
    o << "{\"ph\":\"X\",\"name\":";
    ::tessel::detail::json_escape(o, l.name < names.size() ? names[l.name] : "?");
    o << ",\"cat\":\"launch\",\"pid\":" << pid << ",\"tid\":" << l.thread << ",\"ts\":";
    us(l.start);
    o << ",\"dur\":";
    us(l.seconds);
    o << ",\"args\":{\"grid\":[" << l.dims.x << "," << l.dims.y << "," << l.dims.z << "],\"workers\":" << l.workers;
    if (l.shape != launch_record::no_shape && l.shape < names.size()) {
      o << ",\"shape\":";
      ::tessel::detail::json_escape(o, names[l.shape]);
    }
    if (l.costed) {
      o << ",\"flops\":";
      ::tessel::detail::json_number(o, l.cost.flops);
      o << ",\"bytes\":";
      ::tessel::detail::json_number(o, l.cost.bytes);
      o << ",\"precision\":\"" << precisions[std::min<std::size_t>(static_cast<std::size_t>(l.cost.precision), 6)] << "\"";
    }
    o << "}}";
    if (!l.costed || l.seconds <= 0) continue;
    // counters: the rate while the launch ran, back to zero when it ended
    const double gf = l.cost.flops / l.seconds * 1e-9, gb = l.cost.bytes / l.seconds * 1e-9;
    auto counters = [&](double ts, double f, double b, double fc, double fm) {
      sep();
      o << "{\"ph\":\"C\",\"name\":\"achieved\",\"pid\":" << pid << ",\"tid\":0,\"ts\":";
      us(ts);
      o << ",\"args\":{\"GFLOP/s\":";
      ::tessel::detail::json_number(o, f);
      o << ",\"GB/s\":";
      ::tessel::detail::json_number(o, b);
      o << "}}";
      if (!lim.known()) return;
      sep();
      o << "{\"ph\":\"C\",\"name\":\"of machine limit\",\"pid\":" << pid << ",\"tid\":0,\"ts\":";
      us(ts);
      o << ",\"args\":{\"compute\":";
      ::tessel::detail::json_number(o, fc);
      o << ",\"memory\":";
      ::tessel::detail::json_number(o, fm);
      o << "}}";
    };
    const double peak = lim.peak_gflops(l.cost.precision, l.workers), bw = lim.bandwidth_gbs(l.workers);
    counters(l.start, gf, gb, peak > 0 ? gf / peak : 0, bw > 0 ? gb / bw : 0);
    counters(l.start + l.seconds, 0, 0, 0, 0);
  }
  for (const auto& c : colls) {
    const std::size_t pid = transport_pid[c.transport];
    sep();
    o << "{\"ph\":\"X\",\"name\":";
    ::tessel::detail::json_escape(o, c.op);
    o << ",\"cat\":\"collective\",\"pid\":" << pid << ",\"tid\":" << c.rank << ",\"ts\":";
    us(c.start);
    o << ",\"dur\":";
    us(c.seconds);
    o << ",\"args\":{\"bytes\":";
    ::tessel::detail::json_number(o, c.bytes);
    o << ",\"ranks\":" << c.ranks << ",\"algorithm\":";
    ::tessel::detail::json_escape(o, c.algorithm);
    o << ",\"transport_seconds\":";
    ::tessel::detail::json_number(o, c.transport_seconds);
    o << "}}";
    if (c.seconds <= 0) continue;
    for (int k = 0; k < 2; ++k) {
      sep();
      o << "{\"ph\":\"C\",\"name\":\"algbw GB/s rank " << c.rank << "\",\"pid\":" << pid << ",\"tid\":0,\"ts\":";
      us(k == 0 ? c.start : c.start + c.seconds);
      o << ",\"args\":{\"GB/s\":";
      ::tessel::detail::json_number(o, k == 0 ? c.bytes / c.seconds * 1e-9 : 0.0);
      o << "}}";
    }
  }
  o << "\n],\"tesselSummary\":{\"limits\":";
  ::tessel::detail::json_escape(o, lim.known() ? lim.source : "unknown: " + lim.source);
  o << ",\"operators\":[";
  for (std::size_t i = 0; i < sum.ops.size(); ++i) {
    const op_stats& st = sum.ops[i];
    o << (i ? ",\n" : "\n") << "{\"name\":";
    ::tessel::detail::json_escape(o, st.name);
    o << ",\"calls\":" << st.calls << ",\"seconds\":";
    ::tessel::detail::json_number(o, st.seconds);
    o << ",\"gflops\":";
    ::tessel::detail::json_number(o, st.gflops);
    o << ",\"gbs\":";
    ::tessel::detail::json_number(o, st.gbs);
    o << ",\"bound\":\"" << bound_name(st.bound) << "\",\"of_bound\":";
    ::tessel::detail::json_number(o, st.of_bound);
    o << "}";
  }
  o << "]}}\n";
  drain();
}

inline void state::write_locked() {
  if (path.empty()) return;
  out.close();
  out.open(path, std::ios::out | std::ios::trunc);
  if (!out) throw profiler_error(errc::io, "cannot write the trace file '" + path + "'");
  write_trace_locked(out);
  out.flush();
  if (!out) throw profiler_error(errc::io, "writing the trace file '" + path + "' failed");
}

// At exit: a session still recording (TESSEL_PROFILE's, or a start() never stopped) is written,
// and TESSEL_PROFILE's summary printed on stderr. Errors are reported, never thrown.
inline state::~state() {
  level.store(0, std::memory_order_relaxed);
  std::lock_guard lk(mu);
  if (!recording) return;
  stopped_at = since_start(clock::now());
  recording = false;
  try {
    write_locked();
    if (from_env) {
      const std::string sum = summarize(launches, colls, names, limits_locked(), stopped_at).to_string();
      std::fprintf(stderr, "%s(trace: %s)\n", sum.c_str(), path.c_str());
    }
  } catch (const std::exception& e) { std::fprintf(stderr, "tessel profiler at exit: %s\n", e.what()); }
}

}  // namespace detail

// ---------------------------------------------------------------------------------- the API
// Starts recording; `path` ("" for in memory only) is opened now, so an unwritable path throws
// profiler_error(errc::io) here, not at exit. Throws errc::invalid_argument if already recording.
inline void start(const std::string& path = {}) {
  detail::init_from_env();  // settle TESSEL_PROFILE first, so it cannot turn on over this session
  detail::state& s = detail::the_state();
  std::lock_guard lk(s.mu);
  detail::start_locked(s, path, false);
}

// Writes the trace now with what was recorded so far; recording goes on.
inline void flush() {
  detail::state& s = detail::the_state();
  std::lock_guard lk(s.mu);
  if (s.recording) s.write_locked();
}

// Stops recording and writes the trace (if a path was given). The records stay readable
// (summary(), launches(), collectives()) until the next start. No-op if not recording.
inline void stop() {
  detail::state& s = detail::the_state();
  std::lock_guard lk(s.mu);
  if (!s.recording) return;
  detail::level.store(0, std::memory_order_relaxed);
  s.stopped_at = s.since_start(detail::clock::now());
  s.recording = false;
  s.write_locked();
}

inline bool active() { return detail::recording(); }

// Overrides the limits read from the cache (tests; a machine whose figures are known otherwise).
inline void set_limits(machine_limits m) {
  detail::state& s = detail::the_state();
  std::lock_guard lk(s.mu);
  s.limits = std::move(m);
  s.limits_set = true;
}
// The limits the summary uses (read from the cache on first use).
inline machine_limits limits() {
  detail::state& s = detail::the_state();
  std::lock_guard lk(s.mu);
  return s.limits_locked();
}

inline std::vector<launch_record> launches() {
  detail::state& s = detail::the_state();
  std::lock_guard lk(s.mu);
  return s.launches;
}
inline std::vector<collective_record> collectives() {
  detail::state& s = detail::the_state();
  std::lock_guard lk(s.mu);
  return s.colls;
}
// The name a launch_record's `name` refers to.
inline std::string name_of(std::uint32_t id) {
  detail::state& s = detail::the_state();
  std::lock_guard lk(s.mu);
  return id < s.names.size() ? s.names[id] : std::string("?");
}

// The summary of the current (or last) session.
inline profile_summary summary() {
  detail::state& s = detail::the_state();
  std::lock_guard lk(s.mu);
  return summarize(s.launches, s.colls, s.names, s.limits_locked(), s.recording ? s.since_start(detail::clock::now()) : s.stopped_at);
}

// A scoped session: start(path) on construction, stop() on destruction (errors at destruction
// are reported on stderr; call stop() first to see them as exceptions).
class session {
 public:
  explicit session(const std::string& path = {}) { start(path); }
  session(const session&) = delete;
  session& operator=(const session&) = delete;
  ~session() {
    try {
      stop();
    } catch (const std::exception& e) { std::fprintf(stderr, "tessel profiler: %s\n", e.what()); }
  }
  void stop() { profiler::stop(); }
  profile_summary summary() const { return profiler::summary(); }
};

}  // namespace profiler
}  // namespace v0
}  // namespace tessel
