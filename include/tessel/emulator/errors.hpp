// Typed errors raised by the UBL128 emulator: bad configurations, capacity, and runtime faults.
// All derive from emulator_error (a tessel::error, area "emulator"); every fault error names the
// card or link it concerns, so a collective can report who failed.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include <tessel/error.hpp>

namespace tessel {
inline namespace v0 {
namespace emu {

// Base of every emulator error; code() says which kind.
struct emulator_error : error_of<emulator_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "emulator";
};

// A cluster description that cannot describe a machine (zero cards, zero bandwidth, ...), or a
// configuration file that cannot be read (errc::io) or parsed (errc::format). `key` names the
// configuration key at fault (empty when the whole description is), `line` its line in the text
// (0 when unknown).
struct config_error : emulator_error {
  std::string key;
  std::size_t line = 0;
  explicit config_error(const std::string& what, errc code = errc::config) : emulator_error(code, what) {}
  config_error(std::string k, std::size_t ln, const std::string& what, errc code = errc::config)
      : emulator_error(code, what), key(std::move(k)), line(ln) {}
};

// A memory request above what a card has left.
struct capacity_error : emulator_error {
  std::size_t card;
  std::size_t requested, available;
  capacity_error(std::size_t c, std::size_t req, std::size_t avail)
      : emulator_error(errc::capacity, "card " + std::to_string(c) + ": allocation of " + std::to_string(req) + " bytes exceeds the " +
                                           std::to_string(avail) + " bytes left"),
        card(c),
        requested(req),
        available(avail) {}
};

// A card index, plane, pointer or byte range that does not belong to the card it is used on.
struct invalid_card_error : emulator_error {
  explicit invalid_card_error(const std::string& what) : emulator_error(errc::out_of_range, what) {}
};

// Base of the runtime faults: the operation could not complete.
struct fault_error : emulator_error {
  double at;  // simulated time (seconds) at which the failure was reported
  fault_error(const std::string& what, double t, errc code = errc::fault) : emulator_error(code, what), at(t) {}
};

// A peer card is (or became) dead; `card` is the failed one.
struct card_failed_error : fault_error {
  std::size_t card;
  card_failed_error(std::size_t c, double t, const std::string& ctx = {})
      : fault_error("card " + std::to_string(c) + " failed" + (ctx.empty() ? "" : ": " + ctx), t), card(c) {}
};

// No usable path remained for a transfer; names the first failed link (card, plane) on its way.
struct link_failed_error : fault_error {
  std::size_t card, plane;
  link_failed_error(std::size_t c, std::size_t p, double t, const std::string& ctx = {})
      : fault_error("link card " + std::to_string(c) + " plane " + std::to_string(p) + " is down" + (ctx.empty() ? "" : ": " + ctx), t),
        card(c),
        plane(p) {}
};

// A wait reached its simulated timeout; names the peer card it was waiting on.
struct timeout_error : fault_error {
  std::size_t card;
  timeout_error(std::size_t c, double t, const std::string& ctx = {})
      : fault_error("timed out at t=" + std::to_string(t) + " s waiting on card " + std::to_string(c) + (ctx.empty() ? "" : ": " + ctx), t,
                    errc::timeout),
        card(c) {}
};

}  // namespace emu
}  // namespace v0
}  // namespace tessel
