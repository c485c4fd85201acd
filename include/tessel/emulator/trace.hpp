// Observability for the emulator: a Chrome-trace (Perfetto-readable) JSON timeline with one
// process per card and tracks for compute, sends and receives, written through nlohmann-json.
// Times are simulated seconds; the file is written in microseconds as the format requires.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <tessel/emulator/errors.hpp>

namespace tessel {
inline namespace v0 {
namespace emu {

enum class track : std::uint8_t { compute = 0, send = 1, recv = 2 };

struct trace_span {
  std::size_t card;
  track where;
  std::string name;
  double start, duration;  // seconds
  std::uint64_t bytes = 0;
  double flops = 0;
  std::size_t peer = SIZE_MAX;
};

// Thread-safe span recorder. Compute spans are complete ("X") events on the card's compute
// thread; sends and receives are async ("b"/"e") events, because transfers overlap each other.
class trace_recorder {
 public:
  void record(trace_span s) {
    std::lock_guard lk(mu_);
    spans_.push_back(std::move(s));
  }
  std::vector<trace_span> spans() const {
    std::lock_guard lk(mu_);
    return spans_;
  }
  std::size_t size() const {
    std::lock_guard lk(mu_);
    return spans_.size();
  }
  void clear() {
    std::lock_guard lk(mu_);
    spans_.clear();
  }

  // Streamed one event at a time (a long run holds millions), each event an nlohmann::json object
  // dumped on its own line; names that are not valid UTF-8 are written with U+FFFD in their place.
  void write_chrome_json(std::ostream& o, std::size_t cards) const {
    using nlohmann::json;
    std::lock_guard lk(mu_);
    o << "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n";
    bool first = true;
    auto emit = [&](const json& ev) {
      o << (first ? "" : ",\n") << ev.dump(-1, ' ', false, json::error_handler_t::replace);
      first = false;
    };
    static const char* tracks[] = {"compute", "sends", "receives"};
    for (std::size_t c = 0; c < cards; ++c) {
      emit({{"ph", "M"}, {"name", "process_name"}, {"pid", c}, {"tid", 0}, {"args", {{"name", "card " + std::to_string(c)}}}});
      for (int t = 0; t < 3; ++t) emit({{"ph", "M"}, {"name", "thread_name"}, {"pid", c}, {"tid", t}, {"args", {{"name", tracks[t]}}}});
    }
    std::uint64_t id = 0;
    for (const auto& s : spans_) {
      const int tid = static_cast<int>(s.where);
      auto event = [&](const char* ph, double t) {
        return json{{"ph", ph}, {"name", s.name}, {"cat", tracks[tid]}, {"pid", s.card}, {"tid", tid}, {"ts", t * 1e6}};
      };
      if (s.where == track::compute) {
        json ev = event("X", s.start);
        ev["dur"] = s.duration * 1e6;
        ev["args"] = {{"flops", s.flops}, {"bytes", s.bytes}};
        emit(ev);
      } else {
        ++id;
        json b = event("b", s.start);
        b["id"] = id;
        b["args"] = {{"bytes", s.bytes}};
        if (s.peer != SIZE_MAX) b["args"]["peer"] = s.peer;
        emit(b);
        json e = event("e", s.start + s.duration);
        e["id"] = id;
        emit(e);
      }
    }
    o << "\n]}\n";
  }

  void write_chrome_json(const std::string& path, std::size_t cards) const {
    std::ofstream f(path);
    if (!f) throw emulator_error(errc::io, "cannot write trace to '" + path + "'");
    write_chrome_json(f, cards);
    if (!f) throw emulator_error(errc::io, "writing trace '" + path + "' failed");
  }

 private:
  mutable std::mutex mu_;
  std::vector<trace_span> spans_;
};

}  // namespace emu
}  // namespace v0
}  // namespace tessel
