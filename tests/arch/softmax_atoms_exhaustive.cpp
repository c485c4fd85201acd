// All 2^32 floats through the softmax atoms' bf16 packing (to_bf16_row: vector bodies through
// store_bf16, scalar tails through f32_to_bf16_bits) against tessel::bf16's own conversion, bit
// for bit: RNE, subnormals kept, Inf, and NaN payloads by bf16's rule. Multi-threaded; label
// "exhaustive".
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <thread>
#include <vector>

#include <tessel/arch/softmax_atoms.hpp>
#include <tessel/types/bf16.hpp>

using namespace tessel;

TEST_CASE("to_bf16_row equals bf16(x) for all 2^32 floats", "[arch][softmax][exhaustive]") {
  const unsigned nt = std::max(1u, std::thread::hardware_concurrency());
  constexpr std::uint64_t chunk = (1u << 16) + 3, total = 1ull << 32;  // + 3: every chunk ends in a scalar tail
  std::atomic<std::uint64_t> next{0}, bad{0};
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < nt; ++t)
    ts.emplace_back([&] {
      std::vector<float> x(chunk);
      std::vector<std::uint16_t> out(chunk);
      for (std::uint64_t b; (b = next.fetch_add(chunk)) < total;) {
        const std::uint64_t n = std::min(chunk, total - b);
        for (std::uint64_t i = 0; i < n; ++i) x[i] = std::bit_cast<float>(static_cast<std::uint32_t>(b + i));
        arch::softmax::to_bf16_row(x.data(), n, out.data());
        std::uint64_t local = 0;
        for (std::uint64_t i = 0; i < n; ++i) local += out[i] != bf16(x[i]).bits();
        bad += local;
      }
    });
  for (auto& t : ts) t.join();
  CHECK(bad == 0);
}
