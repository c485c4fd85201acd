// tessel/verify/ops.hpp: every library operator's entry passes (quick shapes), on 1 and 3 threads,
// names are unique, and an operator that throws becomes a failing report that names it.
#include <catch2/catch.hpp>

#include <set>
#include <stdexcept>
#include <string>

#include <tessel/verify/ops.hpp>

#include "error_match.hpp"

namespace tessel_test_verify_ops {

using namespace tessel;
using tessel_test::is_error;

TEST_CASE("verify entries: every library operator passes its fp64 reference", "[verify][ops]") {
  std::set<std::string> names;
  for (const auto& e : verify::library()) {
    CHECK(names.insert(e.name).second);
    for (unsigned threads : {1u, 3u}) {
      verify::run_options o;
      o.quick = true;
      o.threads = threads;
      o.seed = 7;
      const auto s = verify::run(e, o);
      INFO(e.name << " on " << threads << " threads\n" << s.summary());
      CHECK(s.passed());
      CHECK(s.reports.size() >= 4);
      CHECK(s.mistrusted() == 0);
      for (const auto& r : s.reports) CHECK(r.name.rfind(e.name + ": ", 0) == 0);
    }
  }
  CHECK(names.size() >= 13);
}

TEST_CASE("verify run: an operator that throws is a failure naming it", "[verify][ops]") {
  const verify::entry bad{"broken", "throws", [](verify::suite&, const verify::run_options&) { throw std::runtime_error("kernel exploded"); }};
  const auto s = verify::run(bad);
  CHECK_FALSE(s.passed());
  REQUIRE(s.reports.size() == 1);
  CHECK(s.reports[0].name.find("kernel exploded") != std::string::npos);
  verify::run_options o;
  o.threads = 0;
  CHECK_THROWS_MATCHES(verify::run(bad, o), verify::verify_error, is_error(errc::invalid_argument, "verify", "threads"));
}

}  // namespace tessel_test_verify_ops
