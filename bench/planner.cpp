// The planner's search time and the timing-only step's simulation cost (issue 19).
//   BM_plan_search/<cards>/<model>: the whole space for a model on a UBL cluster of `cards` cards
//     (128: one super-node; 4096: 32 super-nodes), model 0 = dense-110b, 1 = mixtral-8x7b
//     (configs/models). Targets: <= 10 s for 128 cards, <= 60 s for 4,096, on one core.
//   BM_timing_step/<cards>/<tp>: wall time to simulate one step of a 16-layer 2048-wide Llama on
//     `cards` emulated cards (dp = cards / tp / 2, pp = 2, rc-full): how the simulation grows.
#include <benchmark/benchmark.h>

#include <tessel/dist/planner.hpp>
#include <tessel/dist/timing_step.hpp>

#include <filesystem>
#include <string>

namespace {

using namespace tessel;

const std::filesystem::path configs = std::filesystem::path(__FILE__).parent_path().parent_path() / "configs";

void BM_plan_search(benchmark::State& st) {
  dist::plan_request r;
  r.model = io::load_model_config(configs / "models" / (st.range(1) == 0 ? "dense-110b.json" : "mixtral-8x7b.json"));
  r.cluster.scaleout.supernodes = std::size_t(st.range(0)) / 128;
  r.global_batch = std::size_t(st.range(0)) * 4;
  r.seq = 4096;
  std::size_t considered = 0;
  for (auto _ : st) {
    const auto res = dist::plan_search(r, 10);
    considered = res.considered;
    benchmark::DoNotOptimize(res.plans.data());
  }
  st.counters["layouts"] = double(considered);
}
BENCHMARK(BM_plan_search)->Args({128, 0})->Args({128, 1})->Args({4096, 0})->Args({4096, 1})->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_timing_step(benchmark::State& st) {
  dist::plan_request r;
  r.model = io::load_model_config(configs / "models" / "llama-3.1-8b.json");
  r.model.num_hidden_layers = 16;
  r.model.hidden_size = 2048;
  r.model.intermediate_size = 7168;
  r.model.num_attention_heads = 16;
  r.model.head_dim = 128;
  const std::size_t cards = std::size_t(st.range(0));
  const int tp = int(st.range(1));
  r.cluster.cards_per_supernode = std::min<std::size_t>(cards, 128);
  r.cluster.scaleout.supernodes = cards / r.cluster.cards_per_supernode;
  r.seq = 1024;
  dist::plan_layout l;
  l.tp = tp, l.pp = 2, l.dp = int(cards) / tp / 2;
  l.micro_batch = 2, l.micro_batches = 4;
  l.recompute = dist::recompute_mode::full;
  r.global_batch = std::size_t(l.dp) * l.micro_batch * l.micro_batches;
  double simulated = 0;
  for (auto _ : st) simulated = dist::timing_step(r, l).step_time;
  st.counters["simulated_ms"] = simulated * 1e3;
  st.counters["planned_ms"] = dist::plan_evaluate(r, l).step_time * 1e3;
}
BENCHMARK(BM_timing_step)
    ->Args({16, 1})
    ->Args({64, 1})
    ->Args({128, 1})
    ->Args({16, 4})
    ->Args({64, 4})
    ->Args({128, 4})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(1);

}  // namespace

BENCHMARK_MAIN();
