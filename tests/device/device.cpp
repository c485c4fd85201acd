// The device concept and its vocabulary: host_device models it, a minimal hand-written device
// models it, and a type missing any one requirement does not; costed_program needs a cost(grid)
// convertible to kernel_cost; the cost, capability and memory records start empty.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstring>
#include <vector>

#include <tessel/device/device.hpp>
#include <tessel/device/host_device.hpp>

namespace tessel_test_device_device {

using namespace tessel;

namespace {
// The smallest thing that is a device: runs blocks inline, memory from new[].
struct inline_device {
  struct event {
    void wait() {}
    bool ready() const { return true; }
  };
  void* allocate(std::size_t n) { return new std::byte[n]; }
  void deallocate(void* p) { delete[] static_cast<std::byte*>(p); }
  void copy(const void* src, void* dst, std::size_t n) { std::memcpy(dst, src, n); }
  template <class P>
  void launch(const grid& g, const P& p) {
    scratch_arena a(1024);
    for (std::size_t b = 0; b < g.size(); ++b) {
      block_ctx ctx(g, b, 0, 1, a);
      p(ctx);
      a.reset();
    }
  }
  void synchronize() {}
  event record() { return {}; }
  device_caps capabilities() const { return {.name = "inline"}; }
  memory_stats memory() const { return {}; }
};

// inline_device with one requirement taken away each.
struct no_record : inline_device {
  void record() = delete;
};
struct no_copy : inline_device {
  void copy() = delete;
};
struct no_launch {
  struct event {
    void wait() {}
    bool ready() const { return true; }
  };
  void* allocate(std::size_t) { return nullptr; }
  void deallocate(void*) {}
  void copy(const void*, void*, std::size_t) {}
  void synchronize() {}
  event record() { return {}; }
  device_caps capabilities() const { return {}; }
  memory_stats memory() const { return {}; }
};
struct event_without_ready : inline_device {
  struct event {
    void wait() {}
  };
  event record() { return {}; }
};
struct allocate_returns_int : inline_device {
  int allocate(std::size_t) { return 0; }
};

struct costed {
  void operator()(block_ctx&) const {}
  kernel_cost cost(const grid& g) const { return {.flops = 2.0 * double(g.size()), .bytes = 8, .precision = math_precision::bf16}; }
};
struct uncosted {
  void operator()(block_ctx&) const {}
};
struct cost_of_wrong_type {
  void operator()(block_ctx&) const {}
  int cost(const grid&) const { return 1; }
};
}  // namespace

TEST_CASE("host_device and a minimal device model the concept, a type missing a requirement does not", "[device][concept]") {
  STATIC_REQUIRE(device<host_device>);
  STATIC_REQUIRE(device<inline_device>);
  STATIC_REQUIRE_FALSE(device<no_record>);
  STATIC_REQUIRE_FALSE(device<no_copy>);
  STATIC_REQUIRE_FALSE(device<no_launch>);
  STATIC_REQUIRE_FALSE(device<event_without_ready>);
  STATIC_REQUIRE_FALSE(device<allocate_returns_int>);
  STATIC_REQUIRE_FALSE(device<int>);
  STATIC_REQUIRE(tile_program<detail::empty_program>);
}

TEST_CASE("a program written against the concept runs on any model", "[device][concept]") {
  auto fill = []<device D>(D& dev, std::size_t n) {
    std::vector<int> hits(n, 0);
    dev.launch(grid{n}, [&hits](block_ctx& ctx) { ++hits[ctx.block_linear()]; });
    dev.synchronize();
    auto e = dev.record();
    e.wait();
    return hits;
  };
  inline_device a;
  host_device b(1);
  for (std::size_t n : {0, 1, 7, 64}) {
    REQUIRE(fill(a, n) == std::vector<int>(n, 1));
    REQUIRE(fill(b, n) == std::vector<int>(n, 1));
  }
}

TEST_CASE("costed_program: cost(grid) convertible to kernel_cost", "[device][concept]") {
  STATIC_REQUIRE(costed_program<costed>);
  STATIC_REQUIRE_FALSE(costed_program<uncosted>);
  STATIC_REQUIRE_FALSE(costed_program<cost_of_wrong_type>);
  const kernel_cost c = costed{}.cost(grid{3, 4});
  REQUIRE(c.flops == 24.0);
  REQUIRE(c.precision == math_precision::bf16);
}

TEST_CASE("cost, capability and memory records start empty", "[device][concept]") {
  const kernel_cost k;
  REQUIRE(k.flops == 0);
  REQUIRE(k.bytes == 0);
  REQUIRE(k.precision == math_precision::f32);
  const device_caps caps;
  REQUIRE(caps.workers == 1);
  REQUIRE(caps.memory_capacity == 0);
  REQUIRE_FALSE(caps.avx512);
  const memory_stats m;
  REQUIRE(m.in_use == 0);
  REQUIRE(m.peak_reserved == 0);
  REQUIRE(m.pool_hits == 0);
}
}  // namespace tessel_test_device_device
