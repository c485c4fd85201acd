// tessel/verify/ops.hpp: an operator that throws becomes a failing report that names it. That every
// library entry passes (on 1 and 3 threads, unique names, >= 4 checks, none mistrusted) is the CTest
// tools_tessel_verify_all (`tessel-verify --all --threads 3`, label verify): the entries are
// compiled once, in the tool, not again in this executable.
#include <catch2/catch.hpp>

#include <stdexcept>
#include <string>

#include <tessel/verify/ops.hpp>

#include "error_match.hpp"

namespace tessel_test_verify_ops {

using namespace tessel;
using tessel_test::is_error;

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
