// libFuzzer target: arbitrary bytes as a cluster config (`key = value` lines or JSON), through the
// emulator's config parser. Any tessel::error is a refusal; anything else is a bug. What parses
// must validate and survive the writer: parse(to_json(c)) == c.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <tessel/emulator/config.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace emu = tessel::emu;
  try {
    const auto c = emu::parse_cluster_config(std::string_view(reinterpret_cast<const char*>(data), size));
    c.validate();  // parse validated already: a second check must agree
    if (c.cards() == 0 || c.fabric.ports_per_card % c.fabric.planes != 0) __builtin_trap();
    if (emu::parse_cluster_config(emu::to_json(c).dump()) != c) __builtin_trap();
  } catch (const tessel::error&) {}
  return 0;
}
