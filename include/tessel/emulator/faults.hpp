// The faults the emulated fabric models (links, planes, cards, hot swap) and what its health
// monitor reports when it detects one.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tessel {
inline namespace v0 {
namespace emu {

enum class fault_kind : std::uint8_t { link_down, link_up, plane_down, plane_up, card_down, card_up, hot_swap };

inline const char* fault_kind_name(fault_kind k) {
  switch (k) {
    case fault_kind::link_down: return "link_down";
    case fault_kind::link_up: return "link_up";
    case fault_kind::plane_down: return "plane_down";
    case fault_kind::plane_up: return "plane_up";
    case fault_kind::card_down: return "card_down";
    case fault_kind::card_up: return "card_up";
    case fault_kind::hot_swap: return "hot_swap";
  }
  return "?";
}

// A scheduled fault. `card`/`plane` name the target (a link is (card, plane)); hot_swap takes the
// card down at `at` and brings it back empty at `at + duration`.
struct fault {
  double at = 0;
  fault_kind kind = fault_kind::link_down;
  std::size_t card = 0;
  std::size_t plane = 0;
  double duration = 0;
};

// What the health monitor reports to every card.
struct failure_notice {
  fault_kind kind;
  std::size_t card, plane;
  double happened, detected;  // simulated seconds
};

}  // namespace emu
}  // namespace v0
}  // namespace tessel
