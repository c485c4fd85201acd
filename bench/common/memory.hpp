// The process's resident memory, for benchmarks that report peak memory next to a peer measured
// the same way (tools/torch/bench_model.py --memory reads the same /proc fields): VmRSS now, VmHWM
// (the peak since the last reset) and a reset of the peak (clear_refs 5, Linux >= 4.0).
#pragma once

#include <algorithm>
#include <cstddef>
#include <fstream>
#include <string>

namespace tessel_bench {

// A field of /proc/self/status in bytes (0 when it cannot be read).
inline std::size_t proc_status_bytes(const std::string& field) {
  std::ifstream f("/proc/self/status");
  std::string key;
  while (f >> key) {
    if (key == field + ":") {
      std::size_t kb = 0;
      f >> kb;
      return kb * 1024;
    }
    std::getline(f, key);
  }
  return 0;
}
inline std::size_t rss_bytes() { return proc_status_bytes("VmRSS"); }
inline std::size_t peak_rss_bytes() { return proc_status_bytes("VmHWM"); }
// Sets the peak to the current resident size; false when the kernel does not allow it.
inline bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return bool(f);
}

// The peak resident memory above the level at construction: construct it before the model (and
// its device) so that mib() counts everything a training run allocates and touches.
struct peak_meter {
  bool ok = false;  // declared first: the reset comes before the base is read
  std::size_t base = 0;
  peak_meter() : ok(reset_peak_rss()), base(rss_bytes()) {}
  double mib() const { return ok ? double(peak_rss_bytes() - std::min(base, peak_rss_bytes())) / double(1 << 20) : -1.0; }
};

}  // namespace tessel_bench
