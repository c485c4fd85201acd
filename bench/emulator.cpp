// Emulator speed: (1) timing-only all-to-all on 128 cards, 1 GiB from every card (16,256 flows):
// wall time and simulated events per second (target <= 2 s on one core); (2) functional: 128
// cards each allocate 4 MiB, exchange with every other card, verify; wall time and peak RSS.
// of_limit here is the simulated time's fraction of the port-bandwidth bound (1 = at the bound).
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <cstring>
#include <tessel/emulator.hpp>

using namespace tessel;
using namespace tessel::emu;

namespace {

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // ru_maxrss is KiB on Linux
}

void alltoall_timing(benchmark::State& state) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  const std::uint64_t per_card = std::uint64_t{1} << state.range(1);
  cluster_config c;
  c.cards_per_supernode = n;
  c.timing_only = true;
  const std::uint64_t per = per_card / n;
  double events = 0, sim = 0;
  for (auto _ : state) {
    fabric f(c);
    for (std::size_t i = 1; i < n; ++i)
      for (std::size_t s = 0; s < n; ++s) f.post(s, (s + i) % n, per, 0);
    f.run();
    events += static_cast<double>(f.events_processed());
    sim = f.makespan();
  }
  const double bound = static_cast<double>(n - 1) * static_cast<double>(per) / c.card_bandwidth();
  state.counters["events"] = benchmark::Counter(events, benchmark::Counter::kIsRate);
  state.counters["bytes"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * static_cast<double>(n * (n - 1) * per), benchmark::Counter::kIsRate);
  state.counters["flows"] = static_cast<double>(n * (n - 1));
  state.counters["sim_us"] = sim * 1e6;
  state.counters["of_limit"] = bound / sim;
}
BENCHMARK(alltoall_timing)->Name("alltoall/tessel/timing/128cards/1GiB")->Args({128, 30})->Unit(benchmark::kMillisecond)->UseRealTime();

void exchange_functional(benchmark::State& state) {
  const std::size_t n = 128, buf = std::size_t{4} << 20, per = buf / n;
  cluster_config c;
  c.card.memory_bytes = 64 << 20;
  std::size_t wrong = 0;
  double sim = 0;
  for (auto _ : state) {
    cluster cl(c, 1);
    std::vector<unsigned char*> sb(n), rb(n);
    for (std::size_t r = 0; r < n; ++r) {
      sb[r] = static_cast<unsigned char*>(cl[r].allocate(buf));
      rb[r] = static_cast<unsigned char*>(cl[r].allocate(buf));
      for (std::size_t d = 0; d < n; ++d) std::memset(sb[r] + d * per, static_cast<int>((r * 31 + d * 7 + 1) & 255), per);
      std::memset(rb[r], 0, buf);
    }
    std::vector<cluster::completion> cs;
    cs.reserve(n * n);
    for (std::size_t i = 1; i < n; ++i)
      for (std::size_t s = 0; s < n; ++s) {
        const std::size_t d = (s + i) % n;
        cs.push_back(cl.put(s, sb[s] + d * per, d, rb[d] + s * per, per));
      }
    cl.wait_all(cs);
    std::vector<unsigned char> want(per);
    for (std::size_t d = 0; d < n; ++d)
      for (std::size_t s = 0; s < n; ++s) {
        if (s == d) continue;
        std::memset(want.data(), static_cast<int>((s * 31 + d * 7 + 1) & 255), per);
        wrong += std::memcmp(rb[d] + s * per, want.data(), per) != 0;
      }
    sim = cl.max_clock();
  }
  if (wrong) state.SkipWithError("exchange verification failed");
  state.counters["wrong"] = static_cast<double>(wrong);
  state.counters["bytes"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * static_cast<double>(n * (n - 1) * per), benchmark::Counter::kIsRate);
  state.counters["peak_rss_MiB"] = peak_rss_mib();
  state.counters["sim_us"] = sim * 1e6;
  state.counters["of_limit"] = (static_cast<double>(n - 1) * static_cast<double>(per) / c.card_bandwidth()) / sim;
}
BENCHMARK(exchange_functional)->Name("exchange/tessel/functional/128cards/4MiB")->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
