// The auto-parallel planner on the seeds' first claim: 3D parallelism for a 100B-class model on 256
// cards (two UBL128 super-nodes joined by a fat tree). The planner ranks every layout from closed
// forms priced with the card's roofline and the fabric's collectives (dist/planner.hpp; its
// agreement with the timing-only step on the emulator is tests/dist/planner_agreement*.cpp), then
// prices the seeds' 8 x 8 x 4 and two plain choices beside its pick, with each one's
// communication share, so the claim ("8x8x4 reduced communication overhead from 42% to 28%") is
// checked with our numbers, whatever they are.
//   50_plan_3d_parallelism [model config.json] [cluster.conf] [global batch] [seq]
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>

#include <tessel/dist/planner.hpp>

#include "example_args.hpp"

using namespace tessel;

namespace {

void show(const char* name, const dist::plan_request& r, dist::plan_layout l) {
  try {
    const auto e = dist::plan_evaluate(r, l);
    std::printf("  %-34s %-58s %9.0f ms  MFU %5.1f%%  comm %5.1f%%  bubble %5.1f%%  %5.1f GiB/card\n", name, l.to_string().c_str(), e.step_time * 1e3,
                100 * e.mfu, 100 * e.comm_share, 100 * e.bubble_share, e.memory.total() / double(1ull << 30));
  } catch (const std::exception& ex) { std::printf("  %-34s does not run: %s\n", name, ex.what()); }
}

// The best plan among those with the given degrees (any micro-batching, ZeRO, recompute, ...).
void best_with(const char* name, dist::plan_request r, int dp, int tp, int pp, int zero = -1) {
  r.constraints.dp = dp, r.constraints.tp = tp, r.constraints.pp = pp;
  if (zero >= 0) r.constraints.zero_stages = {zero};
  const auto res = dist::plan_search(r, 1);
  if (res.plans.empty()) {
    const auto& ex = res.examples.begin()->second;
    std::printf("  %-34s dp%d tp%d pp%d: nothing fits (e.g. %s)\n", name, dp, tp, pp, ex.reason.c_str());
    return;
  }
  show(name, r, res.plans[0].layout);
}

}  // namespace

int main(int argc, char** argv) {
  const auto root = std::filesystem::path(__FILE__).parent_path().parent_path() / "configs";
  const example_args::positional args(argc, argv, "[model config.json] [cluster config] [global batch 1..1e9] [sequence 1..1e7]", 4);
  const std::string model = args.text(1, (root / "models" / "dense-110b.json").string());
  const std::string cluster = args.text(2, (root / "clusters" / "ubl256.conf").string());
  try {
    dist::plan_request r;
    r.model = io::load_model_config(model);
    r.cluster = emu::load_cluster_config(cluster);
    r.global_batch = std::size_t(args.integer(3, "global batch", 1, 1000000000, 1024));
    r.seq = std::size_t(args.integer(4, "sequence", 1, 10000000, 4096));
    std::printf("model %s: %.1fB parameters; cluster %s: %zu cards (%zu super-nodes of %zu); batch %zu x %zu tokens\n\n", model.c_str(),
                double(r.model.parameter_count()) / 1e9, cluster.c_str(), r.cluster.cards(), r.cluster.scaleout.supernodes,
                r.cluster.cards_per_supernode, r.global_batch, r.seq);
    const auto res = dist::plan_search(r, 5);
    std::printf("%s\n", dist::plan_table(res).c_str());
    std::printf("The planner's pick beside the seeds' layout and plain choices (each the best of its degrees):\n");
    if (!res.plans.empty()) show("planner's choice", r, res.plans[0].layout);
    best_with("seeds' 8x8x4 (dp8 pp8 tp4)", r, 8, 4, 8);
    best_with("pure DP + ZeRO-3", r, int(r.cluster.cards()), 1, 1, 3);
    best_with("tp8 in a card group, DP over it", r, int(r.cluster.cards()) / 8, 8, 1);
    auto built = r;
    built.constraints.built_only = true;
    const auto b = dist::plan_search(built, 1);
    if (!b.plans.empty())
      show("best that dist/ runs today", r, b.plans[0].layout);
    else
      std::printf("  nothing that dist/ runs today fits\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "50_plan_3d_parallelism: %s\n", e.what());
    return 1;
  }
  return 0;
}
