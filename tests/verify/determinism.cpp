// tessel/verify/determinism.hpp: the library GEMM gives the same bits on 1..4 threads, repeated, and
// on an emulated card; a planted nondeterminism (a sum split by the number of workers) is found,
// with the first differing index.
#include <catch2/catch.hpp>

#include <cstddef>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/emulator/card.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/verify/determinism.hpp>

#include "error_match.hpp"

namespace tessel_test_verify_determinism {

using namespace tessel;
using tessel_test::is_error;

template <class Dev>
std::vector<float> run_gemm(Dev& dev) {
  const std::size_t m = 67, n = 45, k = 301;
  const auto a = verify::filled<float>(m * k, verify::fill::normal, 1), b = verify::filled<float>(k * n, verify::fill::normal, 2);
  std::vector<float> c(m * n);
  gemm(dev, transpose::none, transpose::yes, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
  return c;
}

TEST_CASE("verify determinism: the library GEMM has the same bits on any thread count and on a card", "[verify][determinism]") {
  const auto s = verify::same_across_threads<float>(
      "gemm", [](host_device& d) { return run_gemm(d); }, {1, 2, 3, 4}, 2);
  INFO(s.summary(true));
  CHECK(s.passed());
  CHECK(s.reports.size() == 7);
  executor ex(2);
  emu::card_spec spec;
  spec.memory_bytes = std::size_t(64) << 20;
  emu::card card(0, spec, ex, false, nullptr);
  const auto hc = verify::same_bits<float>("gemm", {{"host",
                                                     [] {
                                                       host_device d(2);
                                                       return run_gemm(d);
                                                     }},
                                                    {"card", [&card] { return run_gemm(card); }}});
  INFO(hc.summary(true));
  CHECK(hc.passed());
}

// Planted: each worker sums a contiguous share, so the split (and the rounding) follows the thread count.
struct split_sum {
  const float* x;
  std::size_t n;
  float* partial;
  void operator()(block_ctx& ctx) const {
    const std::size_t parts = ctx.dims().x, p = ctx.block_linear();
    float s = 0;
    for (std::size_t i = p * n / parts; i < (p + 1) * n / parts; ++i) s += x[i];
    partial[p] = s;
  }
};

TEST_CASE("verify determinism finds a sum whose split follows the thread count", "[verify][determinism][planted]") {
  const auto x = verify::filled<float>(100003, verify::fill::uniform, 3);
  auto run = [&x](host_device& d) {
    const unsigned parts = d.capabilities().workers;
    std::vector<float> partial(parts), out(3, 0.0f);
    d.launch(grid{parts}, split_sum{x.data(), x.size(), partial.data()});
    for (float p : partial) out[1] += p;
    out[0] = 1.0f;
    out[2] = 2.0f;
    return out;
  };
  const auto s = verify::same_across_threads<float>("split sum", run, {1, 2, 3}, 1);
  INFO(s.summary(true));
  CHECK_FALSE(s.passed());
  REQUIRE(!s.reports.empty());
  const auto& r = s.reports.back();
  REQUIRE(r.worst);
  CHECK(r.worst->index == 1);
  CHECK(r.name.find("1 thread vs 3 threads") != std::string::npos);
  CHECK_THROWS_MATCHES(verify::same_across_threads<float>("one", run, {2}, 1), verify::verify_error,
                       is_error(errc::invalid_argument, "verify", "two runs"));
  CHECK_THROWS_MATCHES(verify::same_across_threads<float>("zero", run, {0, 1}, 1), verify::verify_error,
                       is_error(errc::invalid_argument, "verify", "one thread"));
}

}  // namespace tessel_test_verify_determinism
