// tessel::verify determinism checks: DESIGN.md promises the same bits whatever the thread count,
// the device or the run. These run one computation several ways and compare the outputs bitwise
// against the first way's: 1 vs N threads, repeated runs, host vs an emulated card (any set of
// named runs). A difference is reported with its first index and both values.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/verify/check.hpp>

namespace tessel {
inline namespace v0 {
namespace verify {

template <checkable T>
struct named_run {
  std::string name;
  std::function<std::vector<T>()> run;
};

// Runs each named computation and compares every output with the first one's, bitwise; one report
// per run after the first, named "<name>: <first> vs <other>".
template <checkable T>
suite same_bits(const std::string& name, const std::vector<named_run<T>>& runs) {
  if (runs.size() < 2) throw verify_error(name + ": a determinism check needs at least two runs");
  for (const auto& r : runs)
    if (!r.run) throw verify_error(name + ": run '" + r.name + "' has no function");
  suite s;
  const std::vector<T> base = runs[0].run();
  for (std::size_t i = 1; i < runs.size(); ++i) {
    const std::vector<T> other = runs[i].run();
    s.add(compare_bits(name + ": " + runs[0].name + " vs " + runs[i].name, base, other));
  }
  return s;
}

// The same computation on host devices with each thread count, `repeats` times each: every output
// must equal the first one bitwise. `run(dev)` computes on the given device and returns its output.
template <checkable T>
suite same_across_threads(const std::string& name, const std::function<std::vector<T>(host_device&)>& run,
                          const std::vector<unsigned>& threads = {1, 2, 3, 4}, unsigned repeats = 2) {
  if (threads.empty()) throw verify_error(name + ": no thread counts to compare");
  if (repeats == 0) throw verify_error(name + ": zero repeats");
  for (unsigned t : threads)
    if (t == 0) throw verify_error(name + ": a host device needs at least one thread");
  std::vector<named_run<T>> runs;
  for (unsigned t : threads)
    for (unsigned k = 0; k < repeats; ++k)
      runs.push_back({std::to_string(t) + " thread" + (t == 1 ? "" : "s") + (repeats > 1 ? " run " + std::to_string(k + 1) : ""), [t, &run] {
                        host_device dev(t);
                        return run(dev);
                      }});
  return same_bits(name, runs);
}

}  // namespace verify
}  // namespace v0
}  // namespace tessel
