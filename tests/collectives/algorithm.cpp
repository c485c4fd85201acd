// collectives/algorithm.hpp: the algorithm names a caller can give (communicator options, tessel-perf,
// the planner) map one to one onto the enum, and a name or value that is none of them is a typed error.
#include <catch2/catch.hpp>

#include <set>
#include <string>

#include <tessel/collectives/algorithm.hpp>
#include "error_match.hpp"

namespace tessel_test_collectives_algorithm {

using tessel::algorithm;
using tessel::errc;
using tessel_test::is_error;

constexpr algorithm all[] = {algorithm::automatic,        algorithm::ring, algorithm::direct,
                             algorithm::halving_doubling, algorithm::tree, algorithm::hierarchical};

TEST_CASE("algorithm names: distinct, and each parses back to its algorithm", "[collectives][algorithm]") {
  std::set<std::string> names;
  for (algorithm a : all) {
    const std::string name(tessel::algorithm_name(a));
    CHECK_FALSE(name.empty());
    CHECK(names.insert(name).second);
    CHECK(tessel::algorithm_from_name(name) == a);
  }
  CHECK(names.size() == std::size(all));
  // the short spellings users type for halving-doubling
  CHECK(tessel::algorithm_from_name("hd") == algorithm::halving_doubling);
  CHECK(tessel::algorithm_from_name("rabenseifner") == algorithm::halving_doubling);
  CHECK(tessel::algorithm_from_name("auto") == algorithm::automatic);
}

TEST_CASE("algorithm names: an unknown name or an out-of-range value is comm_error(invalid_argument)", "[collectives][algorithm][errors]") {
  for (const char* bad : {"", "Ring", "ring ", "butterfly", "automatic"}) {
    INFO("name '" << bad << "'");
    CHECK_THROWS_MATCHES(tessel::algorithm_from_name(bad), tessel::comm_error, is_error(errc::invalid_argument, "comm"));
  }
  CHECK_THROWS_MATCHES(tessel::algorithm_name(static_cast<algorithm>(200)), tessel::comm_error, is_error(errc::invalid_argument, "comm", "200"));
}

}  // namespace tessel_test_collectives_algorithm
