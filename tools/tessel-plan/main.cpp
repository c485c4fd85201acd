// tessel-plan: ranks the parallel layouts of a model on a cluster by predicted step time
// (dist/planner.hpp), as a table or JSON.
//   tessel-plan --model config.json [--cluster ubl128.conf] --batch 512 --seq 4096 [--top 10] [--json]
// Exit status: 0 with plans, 1 when no layout fits (the reasons are printed), 2 on bad arguments.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include <tessel/dist/planner.hpp>
#include <tessel/emulator/config.hpp>
#include <tessel/io/model_config.hpp>

#include "../common/args.hpp"

using namespace tessel;
using tessel_tools::parse_int;
using tessel_tools::parse_real;

namespace {

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr,
               "tessel-plan: %s\n"
               "usage: tessel-plan --model config.json --batch SEQUENCES --seq TOKENS [options]\n"
               "  --model FILE         a Hugging Face config.json (Llama, Mixtral, Qwen2, GPT-2 families)\n"
               "  --cluster FILE       the emulator's cluster config (default: UBL128, 128 cards)\n"
               "  --cards N            plan for N of the cluster's cards (default: all)\n"
               "  --batch N            sequences per optimizer step (global batch)\n"
               "  --seq N              tokens per sequence\n"
               "  --top K              plans to show (default 10)\n"
               "  --json               JSON instead of a table\n"
               "  --dp/--tp/--pp/--ep N   fix a degree    --zero S   fix the ZeRO stage (0-3)\n"
               "  --micro-batch N      fix the micro-batch size    --max-tp N\n"
               "  --memory-fraction F  share of each card's memory a plan may use (default 0.9)\n"
               "  --schedule 1f1b|interleaved|zb-h1   only this pipeline schedule\n"
               "  --recompute none|selective|full     only this recompute mode\n"
               "  --no-compression     no gradient compression\n"
               "  --overlap-grad-reduce  price the gradient reduction as overlapped with the last backward\n"
               "  --built-only         only plans tessel's dist/ runs today\n",
               msg.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  dist::plan_request req;
  std::string model_path, cluster_path;
  std::size_t top = 10;
  bool json = false;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto val = [&]() -> std::string {
        if (i + 1 >= argc) usage("missing value for " + a);
        return argv[++i];
      };
      auto& k = req.constraints;
      if (a == "--model")
        model_path = val();
      else if (a == "--cluster")
        cluster_path = val();
      else if (a == "--cards")
        req.cards = std::size_t(parse_int(a, val(), 1, 1 << 20));
      else if (a == "--batch")
        req.global_batch = std::size_t(parse_int(a, val(), 1, 1ll << 40));
      else if (a == "--seq")
        req.seq = std::size_t(parse_int(a, val(), 1, 1ll << 30));
      else if (a == "--top")
        top = std::size_t(parse_int(a, val(), 1, 1000000));
      else if (a == "--json")
        json = true;
      else if (a == "--dp")
        k.dp = int(parse_int(a, val(), 1, 1 << 20));
      else if (a == "--tp")
        k.tp = int(parse_int(a, val(), 1, 1 << 20));
      else if (a == "--pp")
        k.pp = int(parse_int(a, val(), 1, 1 << 20));
      else if (a == "--ep")
        k.ep = int(parse_int(a, val(), 1, 1 << 20));
      else if (a == "--max-tp")
        k.max_tp = int(parse_int(a, val(), 1, 1 << 20));
      else if (a == "--zero")
        k.zero_stages = {int(parse_int(a, val(), 0, 3))};
      else if (a == "--micro-batch")
        k.micro_batch = std::size_t(parse_int(a, val(), 1, 1ll << 40));
      else if (a == "--memory-fraction")
        k.memory_fraction = parse_real(a, val(), 1e-6, 1.0);
      else if (a == "--schedule") {
        const std::string v = val();
        if (v == "1f1b")
          k.schedules = {dist::pipeline_schedule::one_f_one_b};
        else if (v == "interleaved")
          k.schedules = {dist::pipeline_schedule::interleaved};
        else if (v == "zb-h1")
          k.schedules = {dist::pipeline_schedule::zb_h1};
        else
          usage("--schedule: '" + v + "' is not 1f1b, interleaved or zb-h1");
      } else if (a == "--recompute") {
        const std::string v = val();
        if (v == "none")
          k.recompute = {dist::recompute_mode::none};
        else if (v == "selective")
          k.recompute = {dist::recompute_mode::selective};
        else if (v == "full")
          k.recompute = {dist::recompute_mode::full};
        else
          usage("--recompute: '" + v + "' is not none, selective or full");
      } else if (a == "--no-compression")
        k.compression = {wire_format::none};
      else if (a == "--overlap-grad-reduce")
        k.overlap_grad_reduce = true;
      else if (a == "--built-only")
        k.built_only = true;
      else if (a == "-h" || a == "--help")
        usage("help");
      else
        usage("unknown option '" + a + "'");
    }
  } catch (const std::invalid_argument& e) { usage(e.what()); }
  if (model_path.empty()) usage("--model is required");
  if (req.global_batch == 0) usage("--batch is required");
  if (req.seq == 0) usage("--seq is required");
  try {
    req.model = io::load_model_config(model_path);
    if (!cluster_path.empty()) req.cluster = emu::load_cluster_config(cluster_path);
    bool told = false;
    auto progress = [&](std::size_t n) {
      if (n % (1u << 18) == 0) {
        std::fprintf(stderr, "tessel-plan: %zu layouts searched...\n", n);
        told = true;
      }
    };
    const auto res = dist::plan_search(req, top, progress);
    if (told) std::fprintf(stderr, "tessel-plan: done, %zu layouts\n", res.considered);
    if (json)
      std::cout << dist::to_json(res).dump(2) << "\n";
    else
      std::cout << dist::plan_table(res);
    if (res.plans.empty()) {
      std::fprintf(stderr, "tessel-plan: no layout fits (%zu considered); see the pruned reasons\n", res.considered);
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessel-plan: %s\n", e.what());
    return 1;
  }
  return 0;
}
