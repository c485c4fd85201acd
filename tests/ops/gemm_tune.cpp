// GEMM plans, the tuning cache and the tuner: every candidate plan gives the heuristic's bits (1
// and 2 workers, every transpose, f32 and bf16, edge and prime sizes), a plan in effect is the
// plan recorded, the cache round-trips, and an absent, stale or corrupt cache means the heuristic
// (with a warning for the last two), as does TESSEL_GEMM_TUNE=off.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <tessel/device.hpp>
#include <tessel/ops/gemm_autotune.hpp>

#include "error_match.hpp"
#include "host_devices.hpp"
#include "reference/gemm_ref.hpp"

namespace tessel_test_ops_gemm_tune {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;

namespace {

using tessel_test::host;

// Leaves the process with no plans (and the default cache counted as read) however a test ends.
struct clean_table {
  clean_table() { clear_gemm_tune(); }
  ~clean_table() { clear_gemm_tune(); }
};

// Keeps bf16 products with a small row-major B on the packed path for one scope: these tests are
// about the packed path's plans, which the direct pair-rows path (no plan) would otherwise take.
struct packed_pair_products {
  detail::gemm_tuning saved = detail::gemm_tune();
  packed_pair_products() { detail::gemm_tune().direct_pair_rows_max_kn = 0; }
  ~packed_pair_products() { detail::gemm_tune() = saved; }
};

// A scratch folder of this test's own.
std::filesystem::path scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("tessel_gemm_tune_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << text;
}

template <class T>
std::vector<T> values(std::size_t n, std::uint32_t seed, bool integers) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> small(-3, 3);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<T> v(n);
  for (auto& x : v) x = T(integers ? float(small(rng)) : d(rng));
  return v;
}

// C = op(A)·op(B) with `plan` forced (nullptr: the table/heuristic), returning C and the applied plan.
template <class T>
std::vector<float> run(unsigned threads, bool ta, bool tb, std::size_t M, std::size_t N, std::size_t K, const std::vector<T>& a,
                       const std::vector<T>& b, const gemm_plan* plan, gemm_plan* applied = nullptr) {
  std::vector<float> c(M * N, -7.0f);
  detail::gemm_plan_forced = plan;
  gemm(host(threads), ta ? transpose::yes : transpose::none, tb ? transpose::yes : transpose::none, M, N, K, 1.0f, a.data(), ta ? M : K, b.data(),
       tb ? K : N, 0.0f, c.data(), N);
  detail::gemm_plan_forced = nullptr;
  if (applied) *applied = detail::gemm_plan_applied;
  return c;
}

gemm_tune_key key_of(bool ta, bool tb, std::size_t M, std::size_t N, std::size_t K, unsigned workers, dtype t = dtype::f32) {
  return gemm_tune_key{t, t, dtype::f32, ta, tb, M, N, K, workers};
}

std::string cache_text(const std::string& cpu, const std::string& target, int revision, const std::string& plans) {
  return "{\"format\": \"tessel-gemm-tune-1\", \"cpu\": \"" + cpu + "\", \"target\": \"" + target + "\", \"revision\": " + std::to_string(revision) +
         ", \"plans\": [" + plans + "]}";
}
const std::string good_plan =
    R"({"a": "f32", "b": "f32", "c": "f32", "ta": "N", "tb": "T", "M": 300, "N": 520, "K": 200, "workers": 2, "block_rows": 144, "pack_a": -1, "calling_thread": false, "swap": -1})";

}  // namespace

TEMPLATE_TEST_CASE("every candidate plan gives the heuristic's bits", "[ops][gemm_tune]", float, bf16) {
  clean_table clean;
  packed_pair_products packed;
  struct shape {
    std::size_t M, N, K;
  };
  // packed-path shapes: ragged row and column blocks, a prime, a split-K depth, a transposed A
  // packed once (N > 256), and one with a single row slab
  // and narrow ones that run as their transpose (N <= 32) or may (N <= 64)
  const std::vector<shape> shapes = {{150, 300, 70}, {257, 521, 131}, {73, 600, 97},  {144, 130, 2100},
                                     {400, 96, 64},  {600, 12, 300},  {700, 24, 130}, {300, 61, 90}};
  for (const auto& s : shapes)
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const bool integers = t % 2 == 0;
      const auto a = values<TestType>(s.M * s.K, 11 + t, integers), b = values<TestType>(s.K * s.N, 23 + t, integers);
      const auto ref = run(1, ta, tb, s.M, s.N, s.K, a, b, nullptr);
      for (unsigned threads : {1u, 2u}) {
        gemm_plan heuristic;
        const auto base = run(threads, ta, tb, s.M, s.N, s.K, a, b, nullptr, &heuristic);
        REQUIRE(detail::gemm_plan_consulted);
        CHECK(std::memcmp(base.data(), ref.data(), ref.size() * sizeof(float)) == 0);
        for (const gemm_plan& plan : detail::gemm_tune_candidates(key_of(ta, tb, s.M, s.N, s.K, threads))) {
          gemm_plan applied;
          const auto c = run(threads, ta, tb, s.M, s.N, s.K, a, b, &plan, &applied);
          INFO(s.M << "x" << s.N << "x" << s.K << " ta " << ta << " tb " << tb << " threads " << threads << " plan rows " << plan.block_rows
                   << " pack " << plan.pack_a << " calling " << plan.calling_thread);
          CHECK(std::memcmp(c.data(), ref.data(), ref.size() * sizeof(float)) == 0);
          // (rows of C, or of Cᵀ when the product ran as its transpose)
          if (plan.block_rows > 0) CHECK(applied.block_rows == std::min(plan.block_rows, ((applied.swap == 1 ? s.N : s.M) + 71) / 72 * 72));
          if (plan.pack_a >= 0 && ta && applied.pack_a != -1) CHECK(applied.pack_a == plan.pack_a);  // (-1: the split-K path packs in its blocks)
          if (plan.calling_thread) CHECK(applied.calling_thread);
          if (plan.swap == 1)
            CHECK(applied.swap == int(detail::gemm_swappable<TestType, TestType>(s.M, s.N, s.K)));  // (not on the skinny or split-K paths)
          if (plan.swap == 0) CHECK(applied.swap == 0);
        }
      }
      if (integers) {  // and the bits are the exact product
        std::vector<double> ad(a.begin(), a.end()), bd(b.begin(), b.end());
        for (std::size_t i = 0; i < s.M; ++i)
          for (std::size_t j = 0; j < s.N; j += 37) {
            double acc = 0;
            for (std::size_t k = 0; k < s.K; ++k) acc += ad[ta ? k * s.M + i : i * s.K + k] * bd[tb ? j * s.K + k : k * s.N + j];
            REQUIRE(ref[i * s.N + j] == float(acc));
          }
      }
    }
}

TEST_CASE("a narrow product run as its transpose: alpha, beta, the epilogue and the output type as without", "[ops][gemm_tune]") {
  clean_table clean;
  packed_pair_products packed;
  // C's rows and columns index the epilogue (bias per column, bias_row per row) after the swap too
  struct shape {
    std::size_t M, N, K;
  };
  for (const shape& sh : {shape{600, 12, 300}, shape{333, 30, 177}, shape{520, 100, 64}})
    for (int t = 0; t < 4; ++t) {
      const std::size_t M = sh.M, N = sh.N, K = sh.K;  // (named copies: Clang 14 lambdas cannot capture structured bindings)
      const bool ta = t & 1, tb = t & 2;
      const auto a = values<float>(M * K, 5 + t, false), b = values<float>(K * N, 9 + t, false);
      const auto ab = values<bf16>(M * K, 5 + t, false), bb = values<bf16>(K * N, 9 + t, false);
      const auto bias = values<float>(N, 3, false), rbias = values<float>(M, 4, false);
      const auto c0 = values<float>(M * N + 5, 7, false);
      for (unsigned threads : {1u, 2u}) {
        INFO(M << "x" << N << "x" << K << " ta " << ta << " tb " << tb << " threads " << threads);
        auto one = [&](int swap, const auto& x, const auto& y, auto out) {
          using TO = decltype(out);
          std::vector<TO> c(M * (N + 5));
          for (std::size_t i = 0; i < c.size(); ++i) c[i] = TO(c0[i % c0.size()]);
          const gemm_plan plan{0, -1, false, swap};
          detail::gemm_plan_forced = &plan;
          gemm(host(threads), ta ? transpose::yes : transpose::none, tb ? transpose::yes : transpose::none, M, N, K, 0.75f, x.data(), ta ? M : K,
               y.data(), tb ? K : N, 0.5f, c.data(), N + 5, epilogue::bias(bias) | epilogue::bias_row(rbias) | epilogue::gelu_tanh);
          detail::gemm_plan_forced = nullptr;
          CHECK(detail::gemm_plan_applied.swap == swap);
          return c;
        };
        const auto f0 = one(0, a, b, float{}), f1 = one(1, a, b, float{});
        CHECK(std::memcmp(f0.data(), f1.data(), f0.size() * sizeof(float)) == 0);
        const auto h0 = one(0, ab, bb, bf16{}), h1 = one(1, ab, bb, bf16{});
        CHECK(std::memcmp(h0.data(), h1.data(), h0.size() * sizeof(bf16)) == 0);
      }
    }
}

TEST_CASE("a recorded plan is the plan a GEMM runs, and only for its own problem", "[ops][gemm_tune]") {
  clean_table clean;
  const std::size_t M = 300, N = 520, K = 200;
  const auto a = values<float>(M * K, 1, false), b = values<float>(K * N, 2, false);
  gemm_plan before;
  (void)run(1, false, true, M, N, K, a, b, nullptr, &before);
  const auto base = run(2, false, true, M, N, K, a, b, nullptr);
  const gemm_plan plan{144, -1, true};
  set_gemm_plan(key_of(false, true, M, N, K, 2), plan);
  REQUIRE(find_gemm_plan(key_of(false, true, M, N, K, 2)) == plan);
  CHECK_FALSE(find_gemm_plan(key_of(false, true, M, N, K, 1)));               // another worker count
  CHECK_FALSE(find_gemm_plan(key_of(false, false, M, N, K, 2)));              // another transpose
  CHECK_FALSE(find_gemm_plan(key_of(false, true, M, N, K, 2, dtype::bf16)));  // other types
  gemm_plan applied;
  const auto c = run(2, false, true, M, N, K, a, b, nullptr, &applied);
  CHECK(applied.block_rows == 144);
  CHECK(applied.calling_thread);
  CHECK(std::memcmp(c.data(), base.data(), c.size() * sizeof(float)) == 0);
  (void)run(1, false, true, M, N, K, a, b, nullptr, &applied);  // 1 worker: not this plan
  CHECK(applied.block_rows == before.block_rows);
  set_gemm_plan(key_of(false, true, M, N, K, 2), gemm_plan{});  // a default plan removes it
  CHECK_FALSE(find_gemm_plan(key_of(false, true, M, N, K, 2)));
  // plans a GEMM could not run are refused
  CHECK_THROWS_MATCHES(set_gemm_plan(key_of(false, true, M, N, K, 2), gemm_plan{100, -1, false}), gemm_error,
                       is_error(errc::invalid_argument, "gemm", "multiple of 72"));
  CHECK_THROWS_MATCHES(set_gemm_plan(key_of(false, true, M, N, K, 2), gemm_plan{72 * 30, -1, false}), gemm_error,
                       is_error(errc::invalid_argument, "gemm", "multiple of 72"));
  CHECK_THROWS_MATCHES(set_gemm_plan(key_of(false, true, M, N, K, 2), gemm_plan{72, 2, false}), gemm_error,
                       is_error(errc::invalid_argument, "gemm", "pack_a"));
  CHECK_THROWS_MATCHES(set_gemm_plan(key_of(false, true, M, N, K, 2), gemm_plan{72, 1, false, 3}), gemm_error,
                       is_error(errc::invalid_argument, "gemm", "swap"));
  CHECK_THROWS_MATCHES(set_gemm_plan(key_of(false, true, 0, N, K, 2), gemm_plan{72, 1, false}), gemm_error,
                       is_error(errc::invalid_argument, "gemm", "M, N, K"));
}

TEST_CASE("the tuning cache: present, absent, stale, corrupt, off", "[ops][gemm_tune]") {
  clean_table clean;
  using state = gemm_tune_status::state;
  const auto dir = scratch("cache");
  const std::string path = (dir / "sub" / "gemm-tune.json").string();
  const std::string stale_path = (dir / "stale.json").string(), env_path = (dir / "env.json").string();

  SECTION("present: saved plans load back and run") {
    const gemm_plan p1{144, -1, false}, p2{216, 1, true, 0};
    set_gemm_plan(key_of(false, true, 300, 520, 200, 2), p1);
    set_gemm_plan(key_of(true, false, 500, 700, 300, 1, dtype::bf16), p2);
    save_gemm_tune(path);  // creates the folder
    clear_gemm_tune();
    CHECK_FALSE(find_gemm_plan(key_of(false, true, 300, 520, 200, 2)));
    const auto st = load_gemm_tune(path);
    CHECK(st.what == state::loaded);
    CHECK_FALSE(st.warning());
    CHECK(st.plans == 2);
    CHECK(find_gemm_plan(key_of(false, true, 300, 520, 200, 2)) == p1);
    CHECK(find_gemm_plan(key_of(true, false, 500, 700, 300, 1, dtype::bf16)) == p2);
    CHECK(gemm_plans().size() == 2);
    const auto a = values<float>(300 * 200, 3, false), b = values<float>(200 * 520, 4, false);
    gemm_plan applied;
    (void)run(2, false, true, 300, 520, 200, a, b, nullptr, &applied);
    CHECK(applied.block_rows == 144);
  }
  SECTION("absent: the heuristic, silently") {
    set_gemm_plan(key_of(false, true, 300, 520, 200, 2), gemm_plan{144, -1, false});
    const auto st = load_gemm_tune((dir / "missing.json").string());
    CHECK(st.what == state::absent);
    CHECK_FALSE(st.warning());
    CHECK(gemm_plans().empty());  // loading replaces what was there
  }
  SECTION("stale: another CPU, target or revision") {
    for (const std::string& text : {cache_text("Some Other CPU 9000", arch::target_name(), gemm_tune_revision, good_plan),
                                    cache_text(arch::cpu_model(), "not-a-target", gemm_tune_revision, good_plan),
                                    cache_text(arch::cpu_model(), arch::target_name(), gemm_tune_revision + 1, good_plan)}) {
      write_text(stale_path, text);
      const auto st = load_gemm_tune(stale_path);
      INFO(st.message);
      CHECK(st.what == state::stale);
      CHECK(st.warning());
      CHECK(st.message.find("stale") != std::string::npos);
      CHECK(st.message.find("heuristic") != std::string::npos);
      CHECK(gemm_plans().empty());
    }
  }
  SECTION("corrupt: bad JSON, another format, bad fields") {
    std::filesystem::create_directories(dir / "sub");
    const std::string ok = cache_text(arch::cpu_model(), arch::target_name(), gemm_tune_revision, good_plan);
    write_text(path, ok);
    REQUIRE(load_gemm_tune(path).what == state::loaded);  // the baseline is good
    auto field = [&](const std::string& from, const std::string& to) {
      std::string p = good_plan;
      p.replace(p.find(from), from.size(), to);
      return cache_text(arch::cpu_model(), arch::target_name(), gemm_tune_revision, good_plan + ", " + p);
    };
    const std::vector<std::pair<std::string, std::string>> cases = {
        {ok.substr(0, ok.size() / 2), "not JSON"},
        {"[1, 2, 3]", "format"},
        {R"({"format": "tessel-limits-1"})", "format"},
        {R"({"format": "tessel-gemm-tune-1", "cpu": "x"})", "missing"},
        {field("\"block_rows\": 144", "\"block_rows\": 100"), "plan 1: block_rows"},
        {field("\"block_rows\": 144", "\"block_rows\": 4320"), "plan 1: block_rows"},
        {field("\"ta\": \"N\"", "\"ta\": \"X\""), "plan 1: ta or tb"},
        {field("\"a\": \"f32\"", "\"a\": \"i8\""), "plan 1: a, b or c"},
        {field("\"M\": 300", "\"M\": -3"), "plan 1: M, N, K"},
        {field("\"K\": 200", "\"K\": 0"), "plan 1: M, N, K"},
        {field("\"workers\": 2", "\"workers\": \"two\""), "plan 1: M, N, K or workers"},
        {field("\"pack_a\": -1", "\"pack_a\": 5"), "plan 1: pack_a"},
        {field("\"calling_thread\": false", "\"calling_thread\": 0"), "plan 1: calling_thread"},
        {field("\"swap\": -1", "\"swap\": 2"), "plan 1: swap"},
        {std::string("\x00\xff\xfe garbage", 11), "not JSON"},
    };
    for (const auto& [text, why] : cases) {
      write_text(path, text);
      set_gemm_plan(key_of(false, true, 300, 520, 200, 2), gemm_plan{144, -1, false});
      const auto st = load_gemm_tune(path);
      INFO(st.message);
      CHECK(st.what == state::corrupt);
      CHECK(st.warning());
      CHECK(st.message.find(why) != std::string::npos);
      CHECK(st.message.find("heuristic") != std::string::npos);
      CHECK(gemm_plans().empty());  // the heuristic everywhere, nothing half-loaded
    }
  }
  SECTION("TESSEL_GEMM_TUNE: a path, or off") {
    const char* old = std::getenv("TESSEL_GEMM_TUNE");
    const std::string saved = old ? old : "";
    write_text(env_path, cache_text(arch::cpu_model(), arch::target_name(), gemm_tune_revision, good_plan));
    ::setenv("TESSEL_GEMM_TUNE", env_path.c_str(), 1);
    CHECK(gemm_tune_path() == env_path);
    const auto st = load_default_gemm_tune();
    CHECK(st.what == state::loaded);
    CHECK(st.plans == 1);
    ::setenv("TESSEL_GEMM_TUNE", "off", 1);
    CHECK(gemm_tune_path().empty());
    CHECK(load_default_gemm_tune().what == state::disabled);
    CHECK(gemm_plans().empty());
    ::unsetenv("TESSEL_GEMM_TUNE");
    const std::string def = gemm_tune_path();  // the per-CPU default under the cache folder
    if (std::getenv("HOME") || std::getenv("XDG_CACHE_HOME")) CHECK(def.find("/tessel/gemm-tune-") != std::string::npos);
    if (old) ::setenv("TESSEL_GEMM_TUNE", saved.c_str(), 1);
  }
  SECTION("a cache that cannot be written is a typed error") {
    write_text(dir / "file", "x");
    CHECK_THROWS_MATCHES(save_gemm_tune((dir / "file" / "below.json").string()), gemm_error, is_error(errc::io, "gemm", "GEMM tuning cache"));
    CHECK_THROWS_MATCHES(save_gemm_tune(""), gemm_error, is_error(errc::io, "gemm", "no GEMM tuning cache path"));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("the tuner times distinct blockings and records only a real gain", "[ops][gemm_tune]") {
  clean_table clean;
  packed_pair_products packed;
  const std::vector<gemm_tune_problem> problems = {
      {transpose::none, transpose::none, 8, 8, 8},       // direct path: nothing to tune
      {transpose::yes, transpose::none, 200, 300, 150},  // transposed A: pack-once candidates
      {transpose::none, transpose::yes, 384, 384, 96},   // ragged column blocks
      {transpose::none, transpose::none, 0, 5, 5},       // empty
  };
  gemm_tune_options opt;
  opt.rounds = 2;
  for (unsigned threads : {1u, 2u}) {
    const auto f = gemm_autotune<float, float, float>(host(threads), problems, opt);
    const auto h = gemm_autotune<bf16, bf16, float>(host(threads), problems, opt);
    REQUIRE(f.size() == problems.size());
    REQUIRE(h.size() == problems.size());
    for (const auto* rs : {&f, &h}) {
      const auto& r = *rs;
      CHECK_FALSE(r[0].tunable);
      CHECK_FALSE(r[3].tunable);
      for (std::size_t i : {1u, 2u}) {
        INFO("problem " << i << " threads " << threads);
        CHECK(r[i].tunable);
        CHECK(r[i].candidates >= 2);
        CHECK(r[i].key.workers == threads);
        CHECK(r[i].heuristic_seconds > 0);
        CHECK(r[i].best_seconds <= r[i].heuristic_seconds);
        if (r[i].plan.is_default()) {
          CHECK(r[i].best_seconds == r[i].heuristic_seconds);
          CHECK_FALSE(find_gemm_plan(r[i].key));
        } else {
          CHECK(r[i].best_seconds < r[i].heuristic_seconds * (1 - opt.min_gain));
          CHECK(find_gemm_plan(r[i].key) == r[i].plan);
        }
      }
    }
  }
  // record = false leaves the table alone; bad options are typed errors
  clear_gemm_tune();
  opt.record = false;
  opt.min_gain = 0;  // any faster blocking wins...
  (void)gemm_autotune<float, float, float>(host(2), problems, opt);
  CHECK(gemm_plans().empty());  // ...but nothing is recorded
  opt.rounds = 0;
  CHECK_THROWS_MATCHES((gemm_autotune<float, float, float>(host(1), problems, opt)), gemm_error, is_error(errc::invalid_argument, "gemm", "rounds"));
}

}  // namespace tessel_test_ops_gemm_tune
