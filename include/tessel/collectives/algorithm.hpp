// The collective algorithms a caller may name (communicator options, benchmarks, the emulator's
// cost model): the enum and its names. The algorithms themselves live in collectives/detail/.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <tessel/collectives/errors.hpp>

namespace tessel {
inline namespace v0 {

enum class algorithm : std::uint8_t { automatic, ring, direct, halving_doubling, tree, hierarchical };

constexpr std::string_view algorithm_name(algorithm a) {
  switch (a) {
    case algorithm::automatic: return "auto";
    case algorithm::ring: return "ring";
    case algorithm::direct: return "direct";
    case algorithm::halving_doubling: return "halving_doubling";
    case algorithm::tree: return "tree";
    case algorithm::hierarchical: return "hierarchical";
  }
  throw comm_error(errc::invalid_argument, "invalid algorithm value " + std::to_string(static_cast<int>(a)));
}

inline algorithm algorithm_from_name(std::string_view s) {
  for (auto a : {algorithm::automatic, algorithm::ring, algorithm::direct, algorithm::halving_doubling, algorithm::tree, algorithm::hierarchical})
    if (algorithm_name(a) == s) return a;
  if (s == "hd" || s == "rabenseifner") return algorithm::halving_doubling;
  throw comm_error(errc::invalid_argument, "unknown algorithm '" + std::string(s) + "'");
}

}  // namespace v0
}  // namespace tessel
