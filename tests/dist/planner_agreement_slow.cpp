// The planner's agreement table (issue 19): 30 layouts over four requests (dense models of two
// sizes and a MoE model, on 16, 32 and 64 emulated cards), each predicted by the planner and
// measured by the timing-only step: mean |error| <= 5%, max <= 10%, Kendall tau >= 0.9 within each
// request, the planner's choice within 3% of the emulator's best. Label slow (CI runs it).
#include <catch2/catch.hpp>

#include "dist/planner_agreement.hpp"

namespace tessel_test_dist_planner_agreement_slow {

using namespace tessel;
using dist::recompute_mode;
using tessel_test::agreement_layout;

TEST_CASE("planner agreement table: 30 layouts on 16-64 emulated cards", "[dist][planner][agreement][slow]") {
  std::vector<tessel_test::agreement_row> rows;
  std::vector<int> group;
  auto run = [&](const dist::plan_request& r, int g, const std::vector<dist::plan_layout>& ls) {
    for (const auto& l : ls) {
      rows.push_back(tessel_test::agreement_run(r, l));
      group.push_back(g);
    }
  };
  const auto none = recompute_mode::none, sel = recompute_mode::selective, full = recompute_mode::full;
  {  // 16 cards, 8 layers x 1024
    auto r = tessel_test::agreement_request(tessel_test::agreement_model(8, 1024, 16, 4), 16, 32, 1024);
    run(r, 0,
        {agreement_layout(r, 16, 1, 1, 2, 0, none, false), agreement_layout(r, 16, 1, 1, 1, 1, none, false),
         agreement_layout(r, 8, 2, 1, 4, 0, none, false), agreement_layout(r, 8, 2, 1, 2, 1, sel, true),
         agreement_layout(r, 4, 4, 1, 8, 0, none, true), agreement_layout(r, 4, 1, 4, 2, 0, full, false),
         agreement_layout(r, 2, 2, 4, 2, 1, full, false), agreement_layout(r, 8, 1, 2, 1, 2, full, false),
         agreement_layout(r, 2, 8, 1, 8, 1, none, true), agreement_layout(r, 1, 2, 8, 4, 0, full, true)});
  }
  {  // 32 cards, 8 layers x 2048
    auto r = tessel_test::agreement_request(tessel_test::agreement_model(8, 2048, 16, 8), 32, 64, 1024);
    run(r, 1,
        {agreement_layout(r, 32, 1, 1, 2, 1, none, false), agreement_layout(r, 16, 2, 1, 4, 1, none, true),
         agreement_layout(r, 8, 4, 1, 8, 0, none, true), agreement_layout(r, 8, 2, 2, 4, 1, full, false),
         agreement_layout(r, 4, 4, 2, 8, 1, full, true), agreement_layout(r, 4, 2, 4, 4, 0, full, false),
         agreement_layout(r, 16, 1, 2, 2, 2, full, false), agreement_layout(r, 2, 8, 2, 16, 0, full, true)});
  }
  {  // 64 cards, 16 layers x 2048
    auto r = tessel_test::agreement_request(tessel_test::agreement_model(16, 2048, 16, 8), 64, 128, 512);
    run(r, 2,
        {agreement_layout(r, 64, 1, 1, 2, 1, none, false), agreement_layout(r, 32, 2, 1, 4, 1, none, true),
         agreement_layout(r, 16, 1, 4, 2, 1, full, false), agreement_layout(r, 8, 2, 4, 4, 0, full, false),
         agreement_layout(r, 16, 4, 1, 8, 2, none, true), agreement_layout(r, 4, 4, 4, 8, 1, full, true)});
  }
  {  // a small Mixtral-shaped MoE on 16 cards: experts over ep
    dist::plan_request r;
    r.model = tessel_test::agreement_model(4, 1024, 16, 4);
    r.model.num_local_experts = 8;
    r.model.num_experts_per_tok = 2;
    r.model.intermediate_size = 1792;
    r.cluster.cards_per_supernode = 16;
    r.global_batch = 32;
    r.seq = 512;
    auto ep = [&](int dp, int tp, int pp, int e, std::size_t mb, recompute_mode rc) {
      auto l = agreement_layout(r, dp, tp, pp, mb, 0, rc, false);
      l.ep = e;
      return l;
    };
    run(r, 3,
        {ep(16, 1, 1, 1, 2, none), ep(16, 1, 1, 4, 2, none), ep(16, 1, 1, 8, 2, none), ep(8, 2, 1, 4, 4, none), ep(8, 1, 2, 8, 2, full),
         ep(4, 2, 2, 4, 4, full)});
  }
  REQUIRE(rows.size() == 30);
  tessel_test::agreement_check(rows, group);
}

}  // namespace tessel_test_dist_planner_agreement_slow
