#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <vector>

#include <tessel/device/device_buffer.hpp>
#include <tessel/device/profiler.hpp>
#include <tessel/emulator/card.hpp>
#include "error_match.hpp"

namespace tessel_test_emulator_card {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;
using namespace tessel::emu;

namespace {
// Fills out[i] = i for one block of 1024 elements; declares 2 FLOP and 4 bytes per element.
struct fill_prog {
  float* out;
  std::size_t n;
  void operator()(block_ctx& ctx) const {
    std::size_t b = ctx.block_linear();
    for (std::size_t i = b * 1024; i < std::min(n, (b + 1) * 1024); ++i) out[i] = static_cast<float>(i);
  }
  kernel_cost cost(const grid&) const { return {2.0 * static_cast<double>(n), 4.0 * static_cast<double>(n), math_precision::bf16}; }
};
struct plain_prog {
  std::atomic<int>* count;
  void operator()(block_ctx&) const { count->fetch_add(1); }
};
}  // namespace

TEST_CASE("a card is a tessel device", "[emulator][card]") {
  static_assert(device<card>);
  executor ex(2);
  card_spec spec;
  card c(3, spec, ex, false, nullptr);
  auto caps = c.capabilities();
  CHECK(caps.memory_capacity == spec.memory_bytes);
  CHECK(caps.name.find("3") != std::string::npos);
}

TEST_CASE("allocation enforces capacity and takes host memory only when used", "[emulator][card]") {
  executor ex(1);
  card_spec spec;
  spec.memory_bytes = 64 << 20;
  card c(0, spec, ex, false, nullptr);
  void* a = c.allocate(40 << 20);
  CHECK(c.used() == (40u << 20));
  CHECK(c.owns(a, 40 << 20));
  CHECK_FALSE(c.owns(a, (40 << 20) + 1));
  CHECK_FALSE(c.owns(static_cast<char*>(a) + 1, 40 << 20));
  try {
    c.allocate(30 << 20);
    FAIL("expected capacity_error");
  } catch (const capacity_error& e) {
    CHECK(e.card == 0);
    CHECK(e.requested == (30u << 20));
    CHECK(e.available == (24u << 20));
  }
  CHECK_THROWS_MATCHES(c.allocate(30 << 20), emu::capacity_error, is_error(errc::capacity, "emulator", "exceeds"));
  c.deallocate(a);
  CHECK(c.used() == 0);
  CHECK_THROWS_AS(c.deallocate(a), invalid_card_error);
  void* b = c.allocate(60 << 20);
  std::memset(b, 1, 60 << 20);
  CHECK(c.memory().peak_in_use == (60u << 20));
  c.deallocate(b);
  // the default 64 GiB card holds far more than this host could back, because nothing is
  // taken until allocated: a timing-only card even hands out 64 GiB without host memory
  card big(1, card_spec{}, ex, true, nullptr);
  void* h = big.allocate(std::size_t{60} << 30);
  CHECK(big.used() == (std::size_t{60} << 30));
  CHECK_THROWS_AS(big.allocate(std::size_t{5} << 30), capacity_error);
  big.deallocate(h);
}

TEST_CASE("launch runs the program and charges the roofline + launch overhead", "[emulator][card]") {
  executor ex(2);
  card_spec spec;
  card c(0, spec, ex, false, nullptr);
  const std::size_t n = 100000;
  float* out = c.allocate_n<float>(n);
  c.launch(grid{ceil_div(n, 1024)}, fill_prog{out, n});
  for (std::size_t i = 0; i < n; i += 997) REQUIRE(out[i] == static_cast<float>(i));
  // bytes bound: 4n / 3.2 TB/s vs 2n / 400 TFLOP/s
  double expect = std::max(2.0 * n / spec.peak_bf16, 4.0 * n / spec.hbm_bandwidth) + spec.launch_overhead;
  CHECK(c.clock() == Approx(expect).epsilon(1e-9));
  // a program without a declared cost costs the launch overhead
  std::atomic<int> count{0};
  c.launch(grid{7, 3}, plain_prog{&count});
  CHECK(count.load() == 21);
  CHECK(c.clock() == Approx(expect + spec.launch_overhead));
  // explicit cost: compute bound FP8
  c.launch(grid{1}, plain_prog{&count}, kernel_cost{8e12, 0, math_precision::fp8});
  CHECK(c.clock() == Approx(expect + spec.launch_overhead + 8e12 / spec.peak_fp8 + spec.launch_overhead));
  auto k = c.counters();
  CHECK(k.launches == 3);
  CHECK(k.math_time == Approx(2.0 * n / spec.peak_bf16 + 8e12 / spec.peak_fp8));
  c.deallocate(out);
}

TEST_CASE("the profiler records a card's launches with their declared or explicit cost", "[emulator][card][profiler]") {
  executor ex(2);
  card c(5, card_spec{}, ex, false, nullptr);
  const std::size_t n = 4096;
  float* out = c.allocate_n<float>(n);
  std::atomic<int> count{0};
  {
    profiler::session s;
    c.launch(grid{4}, fill_prog{out, n});
    c.launch(grid{2}, plain_prog{&count}, kernel_cost{1e6, 0, math_precision::fp8});
    c.launch(grid{3}, plain_prog{&count});
  }
  const auto rs = profiler::launches();
  REQUIRE(rs.size() == 3);
  for (const auto& r : rs) {
    CHECK(std::string(r.device) == "card");
    CHECK(r.device_index == 5);
    CHECK(r.workers == 2);
  }
  CHECK(profiler::name_of(rs[0].name) == "tessel_test_emulator_card::fill_prog");
  CHECK(rs[0].costed);
  CHECK(rs[0].cost.flops == 2.0 * n);
  CHECK(rs[0].cost.precision == math_precision::bf16);
  CHECK(profiler::name_of(rs[1].name) == "tessel_test_emulator_card::plain_prog");
  CHECK(rs[1].costed);  // the explicit cost of the launch
  CHECK(rs[1].cost.flops == 1e6);
  CHECK(rs[1].cost.precision == math_precision::fp8);
  CHECK_FALSE(rs[2].costed);
  CHECK(rs[2].dims == grid{3});
  c.deallocate(out);
}

TEST_CASE("streams have their own clocks and share the compute engine", "[emulator][card]") {
  executor ex(1);
  card_spec spec;
  card c(0, spec, ex, false, nullptr);
  std::atomic<int> count{0};
  auto s1 = c.make_stream();
  auto s2 = c.make_stream();
  const kernel_cost k{400e9, 0, math_precision::bf16};  // 1 ms
  s1.launch(grid{1}, plain_prog{&count}, k);
  s2.launch(grid{1}, plain_prog{&count}, k);
  CHECK(s1.clock() == Approx(1e-3 + spec.launch_overhead));
  CHECK(s2.clock() == Approx(2 * (1e-3 + spec.launch_overhead)));  // waited for the engine
  CHECK(c.clock() == 0);
  auto e = s2.record();
  e.wait();  // the default stream catches up
  CHECK(c.clock() == Approx(s2.clock()));
  CHECK(e.ready());
  s1.wait(e);
  CHECK(s1.clock() == Approx(s2.clock()));
}

TEST_CASE("copies move bytes and cost HBM time", "[emulator][card]") {
  executor ex(1);
  card_spec spec;
  card c(0, spec, ex, false, nullptr);
  auto* a = static_cast<char*>(c.allocate(1 << 20));
  auto* b = static_cast<char*>(c.allocate(1 << 20));
  std::memset(a, 7, 1 << 20);
  c.copy(a, b, 1 << 20);
  CHECK(b[12345] == 7);
  CHECK(c.clock() == Approx(2.0 * (1 << 20) / spec.hbm_bandwidth));
  CHECK_THROWS_MATCHES(c.copy(nullptr, b, 4), emu::emulator_error, is_error(errc::invalid_argument, "emulator", "null pointer"));
  c.deallocate(a);
  c.deallocate(b);
}

TEST_CASE("a dead card refuses work with card_failed_error", "[emulator][card]") {
  executor ex(1);
  card c(5, card_spec{}, ex, false, nullptr);
  c.add_outage(0, 1);
  std::atomic<int> count{0};
  try {
    c.launch(grid{1}, plain_prog{&count});
    FAIL("expected card_failed_error");
  } catch (const card_failed_error& e) { CHECK(e.card == 5); }
  CHECK(count.load() == 0);
}

TEST_CASE("device_buffer on an emulated card uses the card's arena and its capacity", "[emulator][card][device_buffer]") {
  executor ex(1);
  card_spec spec;
  spec.memory_bytes = 1 << 20;
  card c(0, spec, ex, false, nullptr);
  {
    auto a = device_buffer<float, card>::zeros(c, 1000);
    CHECK(c.used() >= 4000);
    CHECK(c.owns(a.data(), a.size_bytes()));
    std::vector<float> v(1000, 3.0f);
    a.copy_from(v);
    CHECK(a.span()[999] == 3.0f);
    // more than the card has: the card's own typed error, and nothing leaks
    CHECK_THROWS_MATCHES((device_buffer<float, card>(c, 1 << 20)), emu::capacity_error, is_error(errc::capacity, "emulator"));
  }
  CHECK(c.used() == 0);
}
}  // namespace tessel_test_emulator_card
