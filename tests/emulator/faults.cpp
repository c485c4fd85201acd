// emulator/faults.hpp: every fault kind has its own name (traces, notices and config files print
// it), and a scheduled fault of each kind shows up in the health monitor's notices under that kind.
#include <catch2/catch.hpp>

#include <set>
#include <string>

#include <tessel/emulator/fabric.hpp>
#include <tessel/emulator/faults.hpp>

namespace tessel_test_emulator_faults {

using namespace tessel::emu;

constexpr fault_kind kinds[] = {fault_kind::link_down, fault_kind::link_up, fault_kind::plane_down, fault_kind::plane_up,
                                fault_kind::card_down, fault_kind::card_up, fault_kind::hot_swap};

TEST_CASE("fault kinds: distinct names, and a value outside the enum prints as '?'", "[emulator][faults]") {
  std::set<std::string> names;
  for (fault_kind k : kinds) {
    const std::string name = fault_kind_name(k);
    CHECK(name != "?");
    CHECK(names.insert(name).second);
  }
  CHECK(names.size() == std::size(kinds));
  CHECK(std::string(fault_kind_name(static_cast<fault_kind>(99))) == "?");
}

TEST_CASE("fault kinds: each failing kind is detected and reported under its own kind", "[emulator][faults]") {
  for (fault_kind k : {fault_kind::link_down, fault_kind::plane_down, fault_kind::card_down, fault_kind::hot_swap}) {
    INFO(fault_kind_name(k));
    cluster_config cfg;
    cfg.cards_per_supernode = 4;
    cfg.fabric.planes = 2;
    fabric f(cfg);
    f.schedule_fault(fault{1e-3, k, 2, 1, k == fault_kind::hot_swap ? 1.0 : 0.0});
    f.run_until(0.5);
    REQUIRE_FALSE(f.notices().empty());
    CHECK(f.notices().front().kind == k);
    CHECK(f.notices().front().happened == Approx(1e-3));
    CHECK(f.notices().front().detected >= f.notices().front().happened);
    CHECK(f.notices().front().detected <= f.notices().front().happened + f.detection_bound() + 1e-12);
  }
}

}  // namespace tessel_test_emulator_faults
