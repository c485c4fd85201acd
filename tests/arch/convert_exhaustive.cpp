// All 2^32 floats through the scaled quantization kernel (arch::quantize_f32, which the
// convert_exhaustive sweep of tests/types does not reach: it divides by the scale first) against
// the scalar encode of x / scale, for e4m3 and e5m2 in both overflow modes, with a scale that is
// not a power of two (so the division itself rounds). Multi-threaded; label "exhaustive".
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <thread>
#include <vector>

#include <tessel/arch/convert.hpp>

using namespace tessel;

namespace {
template <class Fmt, overflow Ov>
std::uint64_t sweep(float scale) {
  const unsigned nt = std::max(1u, std::thread::hardware_concurrency());
  constexpr std::uint64_t chunk = 1u << 16, total = 1ull << 32;
  std::atomic<std::uint64_t> next{0}, bad{0};
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < nt; ++t)
    ts.emplace_back([&] {
      std::vector<float> x(chunk);
      std::vector<typename Fmt::storage> q(chunk);
      for (std::uint64_t b; (b = next.fetch_add(chunk)) < total;) {
        for (std::uint64_t i = 0; i < chunk; ++i) x[i] = std::bit_cast<float>(static_cast<std::uint32_t>(b + i));
        arch::quantize_f32<Fmt, Ov>(x.data(), q.data(), chunk, scale);
        std::uint64_t local = 0;
        for (std::uint64_t i = 0; i < chunk; ++i) local += q[i] != tessel::detail::encode<Fmt, Ov>(x[i] / scale);
        bad += local;
      }
    });
  for (auto& t : ts) t.join();
  return bad;
}
}  // namespace

TEST_CASE("quantize_f32 equals encode(x / scale) for all 2^32 floats", "[arch][convert][exhaustive]") {
  CHECK(sweep<tessel::detail::e4m3_format, overflow::saturate>(0.75f) == 0);
  CHECK(sweep<tessel::detail::e4m3_format, overflow::propagate>(0.75f) == 0);
  CHECK(sweep<tessel::detail::e5m2_format, overflow::saturate>(3.0f / 7.0f) == 0);
  CHECK(sweep<tessel::detail::e5m2_format, overflow::propagate>(3.0f / 7.0f) == 0);
}
