// The emulator's error types: each carries the card/link/time it concerns and says so in its
// message; every fault is a fault_error with the simulated time (the emulated transport maps them
// by that). Which standard class each derives from is not asserted beyond std::exception: the
// tessel::error family is reshaping it.
#include <catch2/catch.hpp>

#include <stdexcept>
#include <string>
#include <type_traits>

#include <tessel/emulator/errors.hpp>

namespace tessel_test_emulator_errors {

using namespace tessel;
using Catch::Matchers::Contains;

TEST_CASE("emulator errors carry what they concern and say it", "[emulator][errors]") {
  const emu::capacity_error cap(3, 1000, 200);
  REQUIRE(cap.card == 3);
  REQUIRE(cap.requested == 1000);
  REQUIRE(cap.available == 200);
  REQUIRE_THAT(cap.what(), Contains("card 3") && Contains("1000") && Contains("200"));
  const emu::card_failed_error dead(7, 1.5, "during all_reduce");
  REQUIRE(dead.card == 7);
  REQUIRE(dead.at == 1.5);
  REQUIRE_THAT(dead.what(), Contains("card 7 failed") && Contains("during all_reduce"));
  REQUIRE(std::string(emu::card_failed_error(2, 0.0).what()) == "tessel::emulator: card 2 failed");
  const emu::link_failed_error link(4, 1, 2.25);
  REQUIRE(link.card == 4);
  REQUIRE(link.plane == 1);
  REQUIRE(link.at == 2.25);
  REQUIRE_THAT(link.what(), Contains("link card 4 plane 1 is down"));
  const emu::timeout_error to(9, 0.5, "recv");
  REQUIRE(to.card == 9);
  REQUIRE_THAT(to.what(), Contains("waiting on card 9") && Contains("recv"));
  const emu::fault_error plain("x", 3.0);
  REQUIRE(plain.at == 3.0);
}

TEST_CASE("emulator errors are std::exceptions, and every fault is caught as fault_error with its time", "[emulator][errors]") {
  // (which standard class each derives from is left to the tessel::error family; std::exception holds)
  STATIC_REQUIRE(std::is_base_of_v<std::exception, emu::config_error>);
  STATIC_REQUIRE(std::is_base_of_v<std::exception, emu::capacity_error>);
  STATIC_REQUIRE(std::is_base_of_v<std::exception, emu::invalid_card_error>);
  STATIC_REQUIRE(std::is_base_of_v<std::exception, emu::fault_error>);
  // ... and every one is a tessel::error of area "emulator" with the code of its kind
  STATIC_REQUIRE(std::is_base_of_v<tessel::error, emu::emulator_error>);
  STATIC_REQUIRE(std::is_base_of_v<emu::emulator_error, emu::config_error>);
  STATIC_REQUIRE(std::is_base_of_v<emu::emulator_error, emu::fault_error>);
  CHECK(emu::config_error("x").code() == tessel::errc::config);
  CHECK(emu::capacity_error(0, 2, 1).code() == tessel::errc::capacity);
  CHECK(emu::invalid_card_error("x").code() == tessel::errc::out_of_range);
  CHECK(emu::card_failed_error(1, 0.0).code() == tessel::errc::fault);
  CHECK(emu::link_failed_error(1, 0, 0.0).code() == tessel::errc::fault);
  CHECK(emu::timeout_error(1, 0.0).code() == tessel::errc::timeout);
  CHECK(std::string(emu::timeout_error(1, 0.0).area()) == "emulator");
  STATIC_REQUIRE(std::is_base_of_v<emu::fault_error, emu::card_failed_error>);
  STATIC_REQUIRE(std::is_base_of_v<emu::fault_error, emu::link_failed_error>);
  STATIC_REQUIRE(std::is_base_of_v<emu::fault_error, emu::timeout_error>);
  auto thrown_time = [](auto&& e) {
    try {
      throw e;
    } catch (const emu::fault_error& f) { return f.at; }
  };
  REQUIRE(thrown_time(emu::card_failed_error(1, 4.0)) == 4.0);
  REQUIRE(thrown_time(emu::link_failed_error(1, 0, 5.0)) == 5.0);
  REQUIRE(thrown_time(emu::timeout_error(1, 6.0)) == 6.0);
  REQUIRE_THROWS_WITH(throw emu::config_error("zero cards"), "tessel::emulator: zero cards");
  REQUIRE_THROWS_AS(throw emu::invalid_card_error("card 200"), std::exception);
}
}  // namespace tessel_test_emulator_errors
