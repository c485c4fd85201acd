// The planner against the timing-only step on a handful of small layouts of one request (16
// emulated cards): step time within 5% mean / 10% max, the ranking (Kendall tau >= 0.9), and the
// planner's choice within 3% of the emulator's best. The 30-layout table is
// tests/dist/planner_agreement_slow.cpp (label slow). Also: a layout the planner rejects, and a
// schedule the step does not simulate, are errors.
#include <catch2/catch.hpp>

#include "dist/planner_agreement.hpp"
#include "error_match.hpp"

namespace tessel_test_dist_planner_agreement {

using namespace tessel;
using dist::recompute_mode;

TEST_CASE("planner: predicted step times agree with the timing-only step on the emulator", "[dist][planner][agreement]") {
  auto r = tessel_test::agreement_request(tessel_test::agreement_model(4, 512, 8, 4), 16, 16, 512);
  const std::vector<dist::plan_layout> layouts = {
      tessel_test::agreement_layout(r, 16, 1, 1, 1, 0, recompute_mode::none, false),
      tessel_test::agreement_layout(r, 8, 2, 1, 1, 1, recompute_mode::none, true),
      tessel_test::agreement_layout(r, 4, 4, 1, 2, 0, recompute_mode::none, false),
      tessel_test::agreement_layout(r, 4, 1, 4, 1, 0, recompute_mode::full, false),
      tessel_test::agreement_layout(r, 2, 2, 4, 1, 1, recompute_mode::full, false),
      tessel_test::agreement_layout(r, 1, 4, 4, 1, 2, recompute_mode::selective, true),
  };
  std::vector<tessel_test::agreement_row> rows;
  for (const auto& l : layouts) rows.push_back(tessel_test::agreement_run(r, l));
  tessel_test::agreement_check(rows, std::vector<int>(rows.size(), 0));
}

TEST_CASE("timing step: layouts it cannot run are errors", "[dist][planner][agreement]") {
  auto r = tessel_test::agreement_request(tessel_test::agreement_model(4, 512, 8, 4), 8, 16, 256);
  auto l = tessel_test::agreement_layout(r, 2, 2, 2, 1, 0, recompute_mode::full, false);
  l.schedule = dist::pipeline_schedule::zb_h1;
  CHECK_THROWS_MATCHES(dist::timing_step(r, l), dist::dist_error, tessel_test::is_error(errc::unsupported, "dist", "1F1B"));
  l.schedule = dist::pipeline_schedule::one_f_one_b;
  l.zero = 3;
  CHECK_THROWS_MATCHES(dist::timing_step(r, l), dist::dist_error, tessel_test::is_error(errc::unsupported, "dist", "ZeRO-3"));
  l.zero = 0;
  l.tp = 3;
  CHECK_THROWS_MATCHES(dist::timing_step(r, l), dist::dist_error, tessel_test::is_error(errc::config, "dist", "cards"));
}

}  // namespace tessel_test_dist_planner_agreement
