// Paired timing: several implementations of the same operation called in turn inside one timed
// loop, the order rotating each iteration, so the machine's drift (other tenants, clocks) falls
// on all of them alike. Totals per implementation are what ratios are taken from.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

namespace tessel_bench {

struct rotated_totals {
  std::vector<double> seconds;  // summed time per call, in the order given
  std::vector<double> fastest;  // the fastest single call of each (robust to a loaded machine's spikes)
  std::size_t iterations = 0;
};

// Runs `calls` rotated: iteration i calls calls[(i + j) % n] for j = 0..n-1, idling `gap` (not
// timed) before each call so a library's spinning pool threads are asleep before the next
// starts. `keep_going(iteration, totals, wall seconds so far)` decides whether another iteration
// runs; `each(iteration, seconds of calls[0])` is called after every iteration.
template <class KeepGoing, class Each>
rotated_totals run_rotated(std::vector<std::function<void()>>& calls, std::chrono::microseconds gap, KeepGoing&& keep_going, Each&& each) {
  const std::size_t n = calls.size();
  rotated_totals r;
  r.seconds.assign(n, 0.0);
  r.fastest.assign(n, 1e300);
  const auto start = std::chrono::steady_clock::now();
  auto wall = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  while (keep_going(r.iterations, r.seconds, wall())) {
    double first = 0;
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t who = (r.iterations + j) % n;
      if (gap.count() > 0) std::this_thread::sleep_for(gap);
      const auto t0 = std::chrono::steady_clock::now();
      calls[who]();
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      r.seconds[who] += dt;
      r.fastest[who] = std::min(r.fastest[who], dt);
      if (who == 0) first = dt;
    }
    each(r.iterations, first);
    ++r.iterations;
  }
  return r;
}

}  // namespace tessel_bench
