// The profiler: a session records exactly the launches made during it (names from name(), a static
// name or the cleaned type name; grids; declared costs; the device and its workers), from several
// threads at once; nothing when off; the trace is valid JSON with the launches, the counters and
// the summary; the summary orders operators by time and derives each one's bound from the limits;
// the limits cache round-trips; an unwritable path and a second start are typed errors.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <tessel/device.hpp>
#include "error_match.hpp"

namespace tessel_test_device_profiler {

using namespace tessel;
using tessel_test::is_error;
namespace fs = std::filesystem;

// Declares 100 FLOPs and 64 bytes per block, in bf16; counts the blocks it ran.
struct costed_program {
  std::atomic<std::size_t>* blocks;
  static constexpr const char* name = "test::costed";
  void operator()(block_ctx&) const { blocks->fetch_add(1, std::memory_order_relaxed); }
  kernel_cost cost(const grid& g) const { return {100.0 * double(g.size()), 64.0 * double(g.size()), math_precision::bf16}; }
};
// Names itself at run time.
struct named_program {
  int variant = 0;
  std::string name() const { return "named/" + std::to_string(variant); }
  void operator()(block_ctx&) const {}
};
// No name, no cost: reported by its cleaned type name.
template <class T>
struct unnamed_program {
  void operator()(block_ctx&) const {}
};

auto make_lambda() {
  return [] {};
}

fs::path temp_file(const std::string& stem) { return fs::temp_directory_path() / (stem + "_" + std::to_string(::getpid()) + ".json"); }

profiler::machine_limits test_limits() {
  profiler::machine_limits m;
  m.fp32_gflops = {100, 200};
  m.bf16_gflops = {400, 800};
  m.stream_gbs = {10, 15};
  m.source = "test figures";
  return m;
}

TEST_CASE("the profiler records exactly the launches of a session, with names, grids and costs", "[device][profiler]") {
  host_device d(2);
  std::atomic<std::size_t> blocks{0};
  d.launch(grid{3}, costed_program{&blocks});  // before the session: not recorded
  {
    profiler::session s;
    REQUIRE(profiler::active());
    d.launch(grid{4}, costed_program{&blocks});
    d.launch(grid{2, 3}, costed_program{&blocks});
    d.launch(grid{1, 1, 5}, costed_program{&blocks});
    d.launch(grid{2}, named_program{7});
    d.launch(grid{1}, unnamed_program<float>{});
  }
  REQUIRE_FALSE(profiler::active());
  d.launch(grid{3}, costed_program{&blocks});  // after: not recorded
  REQUIRE(blocks.load() == 3 + 4 + 6 + 5 + 3);

  const auto rs = profiler::launches();
  REQUIRE(rs.size() == 5);
  const grid want[] = {grid{4}, grid{2, 3}, grid{1, 1, 5}};
  for (int i = 0; i < 3; ++i) {
    CHECK(profiler::name_of(rs[i].name) == "test::costed");
    CHECK(rs[i].dims == want[i]);
    CHECK(rs[i].costed);
    CHECK(rs[i].cost.flops == 100.0 * double(want[i].size()));
    CHECK(rs[i].cost.bytes == 64.0 * double(want[i].size()));
    CHECK(rs[i].cost.precision == math_precision::bf16);
    CHECK(std::string(rs[i].device) == "host");
    CHECK(rs[i].device_index == d.index());
    CHECK(rs[i].workers == 2);
    CHECK(rs[i].seconds >= 0);
    if (i > 0) CHECK(rs[i].start >= rs[i - 1].start + rs[i - 1].seconds);
  }
  CHECK(profiler::name_of(rs[3].name) == "named/7");
  CHECK_FALSE(rs[3].costed);
  CHECK(profiler::name_of(rs[4].name) == "tessel_test_device_profiler::unnamed_program");
  CHECK_FALSE(rs[4].costed);
}

// A program that describes its operands for the trace.
struct shaped_program {
  std::size_t m, n;
  std::string shape() const { return "m=" + std::to_string(m) + ",n=" + std::to_string(n); }
  void operator()(block_ctx&) const {}
};

TEST_CASE("a program's shape() is recorded and written into the trace", "[device][profiler]") {
  const fs::path path = temp_file("tessel_profile_shape");
  host_device d(1);
  {
    profiler::session s(path.string());
    d.launch(grid{1}, shaped_program{3, 5});
    d.launch(grid{1}, shaped_program{7, 11});
    d.launch(grid{1}, named_program{1});
  }
  const auto rs = profiler::launches();
  REQUIRE(rs.size() == 3);
  CHECK(profiler::name_of(rs[0].shape) == "m=3,n=5");
  CHECK(profiler::name_of(rs[1].shape) == "m=7,n=11");
  CHECK(rs[2].shape == profiler::launch_record::no_shape);
  std::ifstream f(path);
  const auto j = nlohmann::json::parse(f);
  std::vector<std::string> shapes;
  for (const auto& ev : j["traceEvents"])
    if (ev.value("cat", "") == "launch" && ev.at("args").contains("shape")) shapes.push_back(ev.at("args").at("shape").get<std::string>());
  CHECK(shapes == std::vector<std::string>{"m=3,n=5", "m=7,n=11"});
  fs::remove(path);
}

TEST_CASE("the profiler records nothing when off", "[device][profiler]") {
  host_device d(1);
  { profiler::session s; }
  REQUIRE(profiler::launches().empty());
  REQUIRE_FALSE(profiler::active());
  std::atomic<std::size_t> blocks{0};
  for (int i = 0; i < 10; ++i) d.launch(grid{2}, costed_program{&blocks});
  REQUIRE(blocks.load() == 20);
  REQUIRE(profiler::launches().empty());
  REQUIRE(profiler::summary().launches == 0);
}

TEST_CASE("launches from several threads are each recorded once", "[device][profiler]") {
  host_device d(2);
  std::atomic<std::size_t> blocks{0};
  constexpr int threads = 4, per_thread = 50;
  {
    profiler::session s;
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&] {
        for (int i = 0; i < per_thread; ++i) d.launch(grid{3}, costed_program{&blocks});
      });
    for (auto& t : ts) t.join();
  }
  const auto rs = profiler::launches();
  REQUIRE(rs.size() == threads * per_thread);
  REQUIRE(blocks.load() == 3u * threads * per_thread);
  std::set<unsigned> ids;
  for (const auto& r : rs) ids.insert(r.thread);
  REQUIRE(ids.size() == threads);
  const auto sum = profiler::summary();
  REQUIRE(sum.ops.size() == 1);
  CHECK(sum.ops[0].calls == threads * per_thread);
  CHECK(sum.ops[0].flops == 300.0 * threads * per_thread);
}

TEST_CASE("the trace is valid JSON with the launches, counters and summary", "[device][profiler]") {
  const fs::path path = temp_file("tessel_profile_trace");
  profiler::set_limits(test_limits());
  host_device d(2);
  std::atomic<std::size_t> blocks{0};
  profiler::start(path.string());
  for (int i = 0; i < 3; ++i) d.launch(grid{8}, costed_program{&blocks});
  d.launch(grid{1}, named_program{1});
  profiler::flush();  // a trace mid-session is complete JSON too
  {
    std::ifstream f(path);
    const auto j = nlohmann::json::parse(f);
    CHECK(j.at("traceEvents").size() > 0);
  }
  d.launch(grid{8}, costed_program{&blocks});
  profiler::stop();

  std::ifstream f(path);
  nlohmann::json j;
  REQUIRE_NOTHROW(j = nlohmann::json::parse(f));
  std::size_t costed = 0, named = 0, achieved = 0, of_limit = 0;
  bool process_named = false;
  for (const auto& e : j.at("traceEvents")) {
    const std::string ph = e.at("ph"), name = e.at("name");
    if (ph == "X" && name == "test::costed") {
      ++costed;
      CHECK(e.at("args").at("grid") == nlohmann::json::array({8, 1, 1}));
      CHECK(e.at("args").at("flops").get<double>() == 800.0);
      CHECK(e.at("args").at("bytes").get<double>() == 512.0);
      CHECK(e.at("args").at("precision") == "bf16");
      CHECK(e.at("pid").get<std::size_t>() == 1 + d.index());
      CHECK(e.at("dur").get<double>() >= 0);
    }
    if (ph == "X" && name == "named/1") {
      ++named;
      CHECK_FALSE(e.at("args").contains("flops"));
    }
    if (ph == "C" && name == "achieved") {
      ++achieved;
      CHECK(e.at("args").contains("GFLOP/s"));
      CHECK(e.at("args").contains("GB/s"));
    }
    if (ph == "C" && name == "of machine limit") ++of_limit;
    if (ph == "M" && name == "process_name" && e.at("args").at("name") == "host_device " + std::to_string(d.index())) process_named = true;
  }
  CHECK(costed == 4);
  CHECK(named == 1);
  CHECK(achieved == 8);  // a rate at each costed launch's start, zero at its end
  CHECK(of_limit == 8);
  CHECK(process_named);
  const auto& ops = j.at("tesselSummary").at("operators");
  REQUIRE(ops.size() == 2);
  for (const auto& o : ops)
    if (o.at("name") == "test::costed") {
      CHECK(o.at("calls") == 4);
      CHECK(o.at("bound") == "memory");  // 100 flops per 64 bytes at 800 GFLOP/s and 15 GB/s (2 workers): the bytes take longer
    }
  fs::remove(path);
  profiler::set_limits(profiler::load_limits());
}

TEST_CASE("the summary orders operators by time and derives bounds from the limits", "[device][profiler]") {
  std::vector<std::string> names = {"a", "b", "c"};
  std::vector<profiler::launch_record> rs;
  auto add = [&](std::uint32_t name, double seconds, double flops, double bytes, math_precision p, unsigned workers, bool costed) {
    profiler::launch_record r;
    r.name = name;
    r.seconds = seconds;
    r.cost = {flops, bytes, p};
    r.costed = costed;
    r.workers = workers;
    rs.push_back(r);
  };
  // a: compute-bound, 2 x (1e9 flops at 100 GFLOP/s = 10 ms) in 2 x 100 ms
  add(0, 0.1, 1e9, 1e6, math_precision::f32, 1, true);
  add(0, 0.1, 1e9, 1e6, math_precision::f32, 1, true);
  // b: memory-bound, 3e9 bytes at 15 GB/s (2 workers) = 200 ms in 1 s
  add(1, 1.0, 1e6, 3e9, math_precision::bf16, 2, true);
  // c: no declared cost
  add(2, 0.5, 0, 0, math_precision::f32, 1, false);

  const auto s = profiler::summarize(rs, {}, names, test_limits(), 2.0);
  REQUIRE(s.ops.size() == 3);
  CHECK(s.ops[0].name == "b");
  CHECK(s.ops[1].name == "c");
  CHECK(s.ops[2].name == "a");
  const auto& b = s.ops[0];
  CHECK(b.bound == profiler::bound_kind::memory);
  CHECK(b.of_bound == Approx(0.2));
  CHECK(b.gbs == Approx(3.0));
  CHECK(b.of_bandwidth == Approx(0.2));
  CHECK(b.of_peak_flops == Approx(1e6 / 800e9 / 1.0));
  CHECK(s.ops[1].bound == profiler::bound_kind::unknown);
  CHECK(s.ops[1].calls == 1);
  const auto& a = s.ops[2];
  CHECK(a.calls == 2);
  CHECK(a.bound == profiler::bound_kind::compute);
  CHECK(a.roofline_seconds == Approx(0.02));
  CHECK(a.of_bound == Approx(0.1));
  CHECK(a.gflops == Approx(10.0));
  CHECK(a.of_peak_flops == Approx(0.1));
  const std::string table = s.to_string();
  CHECK(table.find("limits: test figures") != std::string::npos);
  CHECK(table.find("memory") != std::string::npos);
  CHECK(table.find("20.0%") != std::string::npos);  // b at 20% of its bound

  // Without limits: nothing is invented.
  const auto u = profiler::summarize(rs, {}, names, profiler::machine_limits{{}, {}, {}, "no file"}, 2.0);
  for (const auto& o : u.ops) {
    CHECK(o.bound == profiler::bound_kind::unknown);
    CHECK(o.of_bound == 0);
  }
  CHECK(u.ops[2].gflops == Approx(10.0));  // achieved rates need no limits
  CHECK(u.to_string().find("limits unknown: no file") != std::string::npos);
}

TEST_CASE("the limits of a precision and a worker count", "[device][profiler]") {
  const auto m = test_limits();
  CHECK(m.peak_gflops(math_precision::f32, 1) == 100);
  CHECK(m.peak_gflops(math_precision::f32, 2) == 200);
  CHECK(m.peak_gflops(math_precision::f32, 64) == 200);  // more workers than measured: the largest figure
  CHECK(m.peak_gflops(math_precision::f64, 1) == 50);
  CHECK(m.peak_gflops(math_precision::bf16, 1) == 400);
  CHECK(m.peak_gflops(math_precision::fp8, 2) == 800);
  CHECK(m.peak_gflops(math_precision::none, 2) == 0);
  CHECK(m.bandwidth_gbs(0) == 10);
  auto no_bf16 = m;
  no_bf16.bf16_gflops.clear();
  CHECK(no_bf16.peak_gflops(math_precision::bf16, 2) == 200);  // the FP32 roof
}

TEST_CASE("the limits cache round-trips and a bad file means unknown", "[device][profiler]") {
  const fs::path path = temp_file("tessel_limits");
  profiler::write_limits(path.string(), {101.5, 202.25}, {0, 0}, {11, 12}, {10, 13});
  const char* old = std::getenv("TESSEL_LIMITS");
  const std::string saved = old ? old : "";
  ::setenv("TESSEL_LIMITS", path.string().c_str(), 1);
  CHECK(profiler::limits_path() == path.string());
  const auto m = profiler::load_limits();
  REQUIRE(m.known());
  CHECK(m.fp32_gflops == std::vector<double>{101.5, 202.25});
  CHECK(m.stream_gbs == std::vector<double>{11, 13});      // the better of copy and triad
  CHECK(m.peak_gflops(math_precision::bf16, 1) == 101.5);  // no bf16 dot: the FP32 roof
  CHECK(m.source == path.string());
  {
    std::ofstream f(path);
    f << "{\"format\": \"tessel-limits-1\", \"fp32_fma_gflops\": [1, \"x\"], \"stream_triad_gbs\": [3]}";
  }
  const auto bad = profiler::load_limits();
  CHECK_FALSE(bad.known());
  CHECK(bad.source.find("malformed") != std::string::npos);
  for (const char* text : {"{\"format\": \"tessel-limits-1\", \"fp32_fma_gflops\": [1, 2", "{\"format\": 1}", "[1, 2]", ""}) {
    {
      std::ofstream f(path);
      f << text;  // truncated, a mistyped format, not an object, empty: unknown, never an exception
    }
    const auto u = profiler::load_limits();
    CHECK_FALSE(u.known());
    CHECK(u.source.find("not a tessel limits file") != std::string::npos);
  }
  fs::remove(path);
  const auto none = profiler::load_limits();
  CHECK_FALSE(none.known());
  CHECK(none.source.find("not found") != std::string::npos);
  if (old)
    ::setenv("TESSEL_LIMITS", saved.c_str(), 1);
  else
    ::unsetenv("TESSEL_LIMITS");
}

TEST_CASE("an unwritable trace path and a second start are typed errors at start", "[device][profiler]") {
  CHECK_THROWS_MATCHES(profiler::start("/nonexistent-tessel-dir/sub/trace.json"), profiler_error,
                       is_error(errc::io, "profiler", "/nonexistent-tessel-dir/sub/trace.json"));
  CHECK_FALSE(profiler::active());
  profiler::session s;
  CHECK_THROWS_MATCHES(profiler::start(), profiler_error, is_error(errc::invalid_argument, "profiler", "already recording"));
  CHECK(profiler::active());
}

// Run by the CTest test_device:TESSEL_PROFILE, in a process started with TESSEL_PROFILE=path.
TEST_CASE("TESSEL_PROFILE turns the profiler on at the first launch and stop() writes its trace", "[.profiler_env]") {
  const char* path = std::getenv("TESSEL_PROFILE");
  REQUIRE(path != nullptr);
  host_device d(1);
  std::atomic<std::size_t> blocks{0};
  for (int i = 0; i < 3; ++i) d.launch(grid{2}, costed_program{&blocks});
  REQUIRE(profiler::active());
  REQUIRE(profiler::launches().size() == 3);
  CHECK_THROWS_MATCHES(profiler::start(), profiler_error, is_error(errc::invalid_argument, "profiler", path));
  profiler::stop();
  std::ifstream f(path);
  const auto j = nlohmann::json::parse(f);
  int launches = 0;
  for (const auto& e : j.at("traceEvents"))
    if (e.at("ph") == "X" && e.at("name") == "test::costed") ++launches;
  CHECK(launches == 3);
  fs::remove(path);
}

TEST_CASE("type names are cleaned of the library's namespaces and template arguments", "[device][profiler]") {
  using tessel::detail::clean_type_name;
  CHECK(clean_type_name("tessel::v0::detail::softmax::fwd_program<float, tessel::v0::bf16>") == "softmax::fwd_program");
  CHECK(clean_type_name("tessel::v0::gemm_splitk_reduce<float, tessel::v0::epilogue::chain<> >") == "gemm_splitk_reduce");
  CHECK(clean_type_name("main()::<lambda(tessel::v0::block_ctx&)>") == "main::lambda");
  CHECK(
      clean_type_name(
          "tessel::v0::gelu_forward<tessel::v0::host_device, float>(tessel::v0::host_device&, std::span<const float>)::<lambda(std::size_t, auto:1, bool)>") ==
      "gelu_forward::lambda");
  CHECK(clean_type_name("(lambda at /src/include/tessel/ops/activation.hpp:119:5)") == "lambda@activation.hpp:119");
#if defined(__clang__)
  CHECK(tessel::detail::enclosing_function_name<decltype(make_lambda())>().find("lambda@profiler.cpp:") != std::string::npos);
#else
  CHECK(tessel::detail::enclosing_function_name<decltype(make_lambda())>() == "tessel_test_device_profiler::make_lambda");
#endif
  CHECK(tessel::detail::enclosing_function_name<unnamed_program<int>>() == "tessel_test_device_profiler::unnamed_program");
  CHECK(clean_type_name("{anonymous}::prog") == "prog");
  CHECK(tessel::detail::raw_type_name<unnamed_program<int>>().find("unnamed_program<int>") != std::string_view::npos);
}

}  // namespace tessel_test_device_profiler
