// Typed errors raised by the UBL128 emulator: bad configurations, capacity, and runtime faults.
// Every fault error names the card or link it concerns, so a collective can report who failed,
// and derives from a standard exception so plain `catch (std::runtime_error&)` also works.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace tessel {
inline namespace v0 {
namespace emu {

// A cluster description that cannot describe a machine (zero cards, zero bandwidth, ...).
struct config_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A memory request above what a card has left.
struct capacity_error : std::length_error {
  std::size_t card;
  std::size_t requested, available;
  capacity_error(std::size_t c, std::size_t req, std::size_t avail)
      : std::length_error("card " + std::to_string(c) + ": allocation of " + std::to_string(req) +
                          " bytes exceeds the " + std::to_string(avail) + " bytes left"),
        card(c), requested(req), available(avail) {}
};

// A card index, pointer or byte range that does not belong to the card it is used on.
struct invalid_card_error : std::out_of_range {
  using std::out_of_range::out_of_range;
};

// Base of the runtime faults: the operation could not complete.
struct fault_error : std::runtime_error {
  double at;  // simulated time (seconds) at which the failure was reported
  fault_error(const std::string& what, double t) : std::runtime_error(what), at(t) {}
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
      : fault_error("link card " + std::to_string(c) + " plane " + std::to_string(p) + " is down" +
                        (ctx.empty() ? "" : ": " + ctx),
                    t),
        card(c), plane(p) {}
};

// A wait reached its simulated timeout; names the peer card it was waiting on.
struct timeout_error : fault_error {
  std::size_t card;
  timeout_error(std::size_t c, double t, const std::string& ctx = {})
      : fault_error("timed out at t=" + std::to_string(t) + " s waiting on card " + std::to_string(c) +
                        (ctx.empty() ? "" : ": " + ctx),
                    t),
        card(c) {}
};

}  // namespace emu
}  // namespace v0
}  // namespace tessel
