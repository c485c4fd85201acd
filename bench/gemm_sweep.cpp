// GEMM sweep: tessel against its peers on a few hundred shapes that models actually run, not
// only the tuned squares. Shapes come from transformer training (forward NN, data-gradient NT,
// weight-gradient TN over hidden 512-8192, FFN x2.7 and x4, 1-16384 tokens), attention-like
// batched products, ResNet-50's convolutions as im2col GEMMs, a few named problem shapes, and
// seeded random shapes (1-4096, random transposes); each for f32 and bf16 (f32 out), 1 and 2
// threads. Every shape calls tessel, OpenBLAS (cblas_sgemm; cblas_sbgemm where exported) and oneDNN (matmul,
// B as the caller holds it) in turn inside one timed loop (bench/common/paired.hpp) and reports
// vs_best_peer = best peer's time / tessel's time (above 1, tessel is faster).
//
//   build/default/bench/bench_gemm_sweep [--quick] [--peers=openblas,onednn] [--tessel_tune[=PATH]] [--benchmark_filter=...] [--benchmark_out=f.json]
//
// tessel runs with the plans of the GEMM tuning cache when one exists (gemm_tune.hpp; the context
// line "gemm_plans" says which file and how many plans). --tessel_tune first tunes every selected
// one-matrix shape (f32 and bf16, 1 and 2 threads), writes the cache (PATH, else the default) and
// then runs the sweep with those plans; TESSEL_GEMM_TUNE=off runs the built-in heuristic alone.
//
// ends with a summary per (dtype, threads): geometric mean and minimum of vs_best_peer, and the
// ten worst shapes. --quick runs every fourth shape plus the named ones (about a quarter of the
// time). Shapes are capped in work (4 GFLOP) and memory (40 M elements) so that one stays short.
#include <benchmark/benchmark.h>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// tessel first: arch/target.hpp parses the intrinsic headers under a GCC 12 false-positive guard.
#include <tessel/device.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/gemm_autotune.hpp>

#include "common/limits.hpp"
#include "common/paired.hpp"

#if defined(TESSEL_HAVE_OPENBLAS)
#include <cblas.h>
#endif
#if defined(TESSEL_HAVE_ONEDNN)
#include <dnnl.hpp>
extern "C" void omp_set_num_threads(int) __attribute__((weak));
#endif

using namespace tessel;

namespace {

struct shape {
  std::string family;
  bool ta = false, tb = false;
  std::size_t M = 0, N = 0, K = 0, batch = 1;
  bool named = false;  // always in --quick
  double flops() const { return 2.0 * double(M) * double(N) * double(K) * double(batch); }
  double elements() const { return (double(M) * K + double(K) * N + double(M) * N) * double(batch); }
  std::string ops() const { return std::string(ta ? "T" : "N") + (tb ? "T" : "N"); }
  std::string str() const {
    std::string s = family + "/" + ops() + "/" + std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K);
    if (batch > 1) s += "/batch:" + std::to_string(batch);
    return s;
  }
  auto key() const { return std::tuple(ta, tb, M, N, K, batch); }
};

// One call stays under ~4 GFLOP (tens of ms) and its operands under 40 M elements.
constexpr double max_flops = 4e9, max_elements = 40e6;

std::size_t round_up(double x, std::size_t m) { return (static_cast<std::size_t>(std::ceil(x)) + m - 1) / m * m; }

std::vector<shape> sweep_shapes() {
  std::vector<shape> out;
  std::set<std::tuple<bool, bool, std::size_t, std::size_t, std::size_t, std::size_t>> seen;
  auto add = [&](shape s) {
    if (s.M == 0 || s.N == 0 || s.K == 0 || s.flops() > max_flops || s.elements() > max_elements) return;
    if (seen.insert(s.key()).second) out.push_back(std::move(s));
  };
  // Named: the reports and the tuned squares' small cousins.
  for (auto [ta, tb, M, N, K] : std::vector<std::tuple<bool, bool, std::size_t, std::size_t, std::size_t>>{{false, false, 1024, 1024, 1024},
                                                                                                           {false, true, 1024, 1024, 1024},
                                                                                                           {true, false, 1024, 1024, 1024},
                                                                                                           {true, true, 1024, 1024, 1024},
                                                                                                           {false, false, 3000, 200, 700},
                                                                                                           {false, false, 64, 8192, 512},
                                                                                                           {false, false, 256, 256, 256},
                                                                                                           {false, true, 128, 128, 4096},
                                                                                                           {true, false, 128, 128, 4096},
                                                                                                           {false, false, 64, 64, 64},
                                                                                                           {false, false, 512, 512, 512},
                                                                                                           {true, false, 512, 512, 8192}}) {
    add({"named", ta, tb, M, N, K, 1, true});
  }
  // Transformer training: a linear (in -> out) over T tokens is Y(T,out) = X(T,in)·W(in,out) (NN),
  // dX(T,in) = dY·Wᵀ (NT), dW(in,out) = Xᵀ·dY (TN, K = tokens).
  std::vector<shape> tr;
  for (std::size_t h : {512, 1024, 2048, 4096, 8192})
    for (double ratio : {2.7, 4.0}) {
      const std::size_t f = round_up(double(h) * ratio, 64);
      const std::vector<std::pair<std::size_t, std::size_t>> linears{{h, 3 * h}, {h, h}, {h, f}, {f, h}};
      for (std::size_t T : {1, 16, 128, 512, 2048, 4096, 16384})
        for (std::size_t li = 0; li < linears.size(); ++li) {
          if (ratio != 2.7 && li < 2) continue;  // attention linears do not depend on the FFN ratio
          const auto [in, o] = linears[li];
          tr.push_back({"train_fwd", false, false, T, o, in});
          tr.push_back({"train_dx", false, true, T, in, o});
          tr.push_back({"train_dw", true, false, in, o, T});
        }
    }
  for (auto& s : tr) add(s);
  // Attention-like batched products (batch = sequences x heads): S = Q·Kᵀ (NT), O = P·V (NN),
  // dV = Pᵀ·dO (TN), dP = dO·Vᵀ (NT), dQ = dS·K (NN), dK = dSᵀ·Q (TN); and tiny 64³ batches.
  for (std::size_t S : {64, 128, 256, 512, 1024, 2048})
    for (std::size_t d : {64, 128}) {
      const std::size_t b = std::max<std::size_t>(1, std::min<std::size_t>(64, std::size_t(5e8 / (2.0 * S * S * d))));
      add({"attn_qk", false, true, S, S, d, b});
      add({"attn_pv", false, false, S, d, S, b});
      add({"attn_dv", true, false, S, d, S, b});
      add({"attn_dk", true, false, S, d, S, b});
    }
  for (std::size_t b : {8, 64, 512}) add({"batch64", false, false, 64, 64, 64, b});
  // ResNet-50 convolutions as im2col GEMMs: (images·Ho·Wo, Cout, Cin·kh·kw), 1 and 8 images.
  const std::vector<std::tuple<std::size_t, std::size_t, std::size_t>> convs{
      {112 * 112, 64, 3 * 49}, {56 * 56, 64, 64},    {56 * 56, 64, 576},   {56 * 56, 256, 64},  {56 * 56, 64, 256},  {28 * 28, 128, 256},
      {28 * 28, 128, 1152},    {28 * 28, 512, 128},  {28 * 28, 512, 256},  {28 * 28, 128, 512}, {14 * 14, 256, 512}, {14 * 14, 256, 2304},
      {14 * 14, 1024, 256},    {14 * 14, 1024, 512}, {14 * 14, 256, 1024}, {7 * 7, 512, 1024},  {7 * 7, 512, 4608},  {7 * 7, 2048, 512},
      {7 * 7, 2048, 1024},     {7 * 7, 512, 2048},   {1, 1000, 2048}};
  for (std::size_t images : {1, 8})
    for (auto [px, co, k] : convs) add({"resnet50", false, false, images * px, co, k});
  // Seeded random shapes: sizes log-uniform in [1, 4096], random transposes.
  std::mt19937 g(20240523);
  std::uniform_real_distribution<double> lg(0.0, std::log(4096.0));
  std::bernoulli_distribution coin(0.5);
  for (int i = 0, got = 0; got < 64 && i < 10000; ++i) {
    shape s{"random", coin(g), coin(g), std::size_t(std::exp(lg(g))), std::size_t(std::exp(lg(g))), std::size_t(std::exp(lg(g)))};
    const std::size_t before = out.size();
    add(s);
    got += out.size() > before;
  }
  return out;
}

host_device& dev(unsigned threads) {
  static host_device d1(1), d2(2);
  return threads >= 2 ? d2 : d1;
}

// Operands filled by a cheap hash (uniform in [-1, 1)): far faster than a Mersenne twister on
// 40 M elements, and the values do not matter to the timing.
template <class T>
tessel_bench::huge_buffer<T> filled(std::size_t n, std::uint32_t seed) {
  tessel_bench::huge_buffer<T> b(std::max<std::size_t>(n, 1), 2);
  std::uint32_t x = seed * 2654435761u + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    b[i] = T(float(x >> 8) * (2.0f / 16777216.0f) - 1.0f);
  }
  return b;
}

#if defined(TESSEL_HAVE_ONEDNN)
// A oneDNN matmul C(f32) = op(A)·op(B) (batched when batch > 1) over the caller's row-major
// buffers; transposes are the ba / acb memory formats, and B is taken where it lies.
template <dnnl::memory::data_type DT>
struct onednn_matmul {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream s{eng};
  dnnl::memory a_m, b_m, c_m;
  dnnl::matmul prim;
  onednn_matmul(const shape& sh, void* A, void* B, float* C) {
    using namespace dnnl;
    using tag = memory::format_tag;
    const auto m = memory::dim(sh.M), n = memory::dim(sh.N), k = memory::dim(sh.K), b = memory::dim(sh.batch);
    const bool bat = sh.batch > 1;
    auto md = [&](memory::dim r, memory::dim c, bool t, memory::data_type dt) {
      return bat ? memory::desc({b, r, c}, dt, t ? tag::acb : tag::abc) : memory::desc({r, c}, dt, t ? tag::ba : tag::ab);
    };
    const auto a_md = md(m, k, sh.ta, DT), b_md = md(k, n, sh.tb, DT), c_md = md(m, n, false, memory::data_type::f32);
    const matmul::primitive_desc pd(matmul::desc(a_md, b_md, c_md), eng);
    a_m = memory(a_md, eng, A);
    b_m = memory(b_md, eng, B);
    c_m = memory(c_md, eng, C);
    prim = matmul(pd);
  }
  void run() {
    prim.execute(s, {{DNNL_ARG_SRC, a_m}, {DNNL_ARG_WEIGHTS, b_m}, {DNNL_ARG_DST, c_m}});
    s.wait();
  }
};
#endif

#if defined(TESSEL_HAVE_OPENBLAS)
// cblas_sbgemm is declared by OpenBLAS's header but exported only by builds with BUILD_BFLOAT16
// (Debian 12's 0.3.21 is built without it): looked up at run time, and bf16 runs without
// OpenBLAS when it is absent.
using sbgemm_fn = void (*)(CBLAS_ORDER, CBLAS_TRANSPOSE, CBLAS_TRANSPOSE, blasint, blasint, blasint, float, const bfloat16*, blasint, const bfloat16*,
                           blasint, float, float*, blasint);
sbgemm_fn sbgemm() {
  static const auto f = reinterpret_cast<sbgemm_fn>(dlsym(RTLD_DEFAULT, "cblas_sbgemm"));
  return f;
}
#endif

// --peers=a,b limits the peers (default: every peer built in)
std::string& peer_filter() {
  static std::string f;
  return f;
}
[[maybe_unused]] bool use_peer(const std::string& name) {
  return peer_filter().empty() || ("," + peer_filter() + ",").find("," + name + ",") != std::string::npos;
}

struct result {
  std::string dtype, what, best;
  unsigned threads = 1;
  double ratio = 0, fastest_ratio = 0, tessel_gflops = 0, best_gflops = 0;
};
std::vector<result>& results() {
  static std::vector<result> r;
  return r;
}

// Calls keep alternating until tessel has run `target` seconds (at least 3 rounds) or the case
// has taken `wall_max` seconds; 2-thread rounds idle 1 ms between calls (every pool asleep:
// tessel's workers spin 200 us, OpenBLAS's and OpenMP's are told to sleep sooner by main).
constexpr double target = 0.05, wall_max = 0.6;

template <class T>
void sweep_case(benchmark::State& st, shape sh, unsigned th) {
  constexpr bool is_bf16 = std::is_same_v<T, bf16>;
  const std::size_t M = sh.M, N = sh.N, K = sh.K, batch = sh.batch;
  const std::size_t sa = M * K, sb = K * N, sc = M * N;
  auto A = filled<T>(sa * batch, 1), B = filled<T>(sb * batch, 2);
  tessel_bench::huge_buffer<float> C(sc * batch, 2);
  const std::size_t lda = sh.ta ? M : K, ldb = sh.tb ? K : N;
  const transpose ta = sh.ta ? transpose::yes : transpose::none, tb = sh.tb ? transpose::yes : transpose::none;
  std::vector<std::function<void()>> calls;
  std::vector<std::string> names;
  calls.emplace_back([&] {
    if (batch == 1)
      gemm(dev(th), ta, tb, M, N, K, 1.0f, A.data(), lda, B.data(), ldb, 0.0f, C.data(), N);
    else
      gemm_strided_batched(dev(th), ta, tb, M, N, K, 1.0f, A.data(), lda, sa, B.data(), ldb, sb, 0.0f, C.data(), N, sc, batch);
  });
  names.emplace_back("tessel");
#if defined(TESSEL_HAVE_OPENBLAS)
  openblas_set_num_threads(static_cast<int>(th));
  if (use_peer("openblas") && (!is_bf16 || sbgemm()))
    calls.emplace_back([&] {
      const auto ota = sh.ta ? CblasTrans : CblasNoTrans, otb = sh.tb ? CblasTrans : CblasNoTrans;
      for (std::size_t z = 0; z < batch; ++z) {  // OpenBLAS 0.3.21 has no batched GEMM
        if constexpr (is_bf16)
          sbgemm()(CblasRowMajor, ota, otb, int(M), int(N), int(K), 1.0f, reinterpret_cast<const bfloat16*>(A.data() + z * sa), int(lda),
                   reinterpret_cast<const bfloat16*>(B.data() + z * sb), int(ldb), 0.0f, C.data() + z * sc, int(N));
        else
          cblas_sgemm(CblasRowMajor, ota, otb, int(M), int(N), int(K), 1.0f, A.data() + z * sa, int(lda), B.data() + z * sb, int(ldb), 0.0f,
                      C.data() + z * sc, int(N));
      }
    });
  if (calls.size() > names.size()) names.emplace_back("openblas");
#endif
#if defined(TESSEL_HAVE_ONEDNN)
  if (omp_set_num_threads) omp_set_num_threads(static_cast<int>(th));
  std::optional<onednn_matmul<is_bf16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32>> mm;
  if (use_peer("onednn")) {
    mm.emplace(sh, A.data(), B.data(), C.data());
    calls.emplace_back([&] { mm->run(); });
    names.emplace_back("onednn");
  }
#endif
  for (auto& c : calls) c();  // warm: pools started, scratch grown, primitives' first run done
  const auto gap = std::chrono::microseconds(th > 1 ? 1000 : 0);
  tessel_bench::rotated_totals r;
  for (auto _ : st) {
    r = tessel_bench::run_rotated(
        calls, gap, [&](std::size_t it, const std::vector<double>& s, double wall) { return it < 3 || (s[0] < target && wall < wall_max); },
        [](std::size_t, double) { benchmark::ClobberMemory(); });
    st.SetIterationTime(r.seconds[0] / double(r.iterations));
  }
  const double flops = sh.flops() * double(r.iterations);
  const double peak = is_bf16 ? tessel_bench::peak_bf16_gflops(th) : tessel_bench::peak_fp32_gflops(th);
  result res{is_bf16 ? "bf16" : "f32", sh.str(), "", th};
  double best = 0, best_fastest = 0;
  for (std::size_t j = 0; j < calls.size(); ++j) {
    st.counters[names[j] + "_gflops"] = flops / r.seconds[j] / 1e9;
    if (j > 0 && (best == 0 || r.seconds[j] < best)) best = r.seconds[j], res.best = names[j];
    if (j > 0 && (best_fastest == 0 || r.fastest[j] < best_fastest)) best_fastest = r.fastest[j];
  }
  // the same ratio from each library's fastest call: a cross-check when the machine is loaded
  if (best_fastest > 0) st.counters["vs_best_peer_fastest"] = best_fastest / r.fastest[0], res.fastest_ratio = best_fastest / r.fastest[0];
  st.counters["of_limit"] = flops / r.seconds[0] / 1e9 / peak;
  st.counters["rounds"] = double(r.iterations);
  if (best > 0) {
    st.counters["vs_best_peer"] = best / r.seconds[0];
    res.ratio = best / r.seconds[0];
    res.tessel_gflops = flops / r.seconds[0] / 1e9;
    res.best_gflops = flops / best / 1e9;
    results().push_back(res);
  }
}

// Per (dtype, threads): geometric mean and minimum of vs_best_peer over shapes (a shape run with
// repetitions counts once, by its median), the same from the fastest calls (less sensitive to a
// loaded machine), and the ten worst shapes by the fastest calls.
void print_summary() {
  std::map<std::pair<std::string, unsigned>, std::map<std::string, std::vector<result>>> groups;
  for (const auto& r : results()) groups[{r.dtype, r.threads}][r.what].push_back(r);
  if (groups.empty()) return;
  std::printf("\nvs_best_peer = best peer time / tessel time (above 1: tessel faster); sums of all calls | fastest calls\n");
  for (auto& [g, shapes] : groups) {
    std::vector<result> med;
    for (auto& [what, rs] : shapes) {
      std::sort(rs.begin(), rs.end(), [](const result& a, const result& b) { return a.fastest_ratio < b.fastest_ratio; });
      med.push_back(rs[rs.size() / 2]);
    }
    double lsum = 0, lfast = 0, mn = 1e300;
    for (const auto& r : med) lsum += std::log(r.ratio), lfast += std::log(r.fastest_ratio), mn = std::min(mn, r.ratio);
    std::sort(med.begin(), med.end(), [](const result& a, const result& b) { return a.fastest_ratio < b.fastest_ratio; });
    const auto below = std::count_if(med.begin(), med.end(), [](const result& r) { return r.fastest_ratio < 0.9; });
    const double n = double(med.size());
    std::printf("\n%s, %u thread%s: %zu shapes, geomean %.3f | %.3f, min %.3f | %.3f, %td below 0.90 (fastest)\n", g.first.c_str(), g.second,
                g.second > 1 ? "s" : "", med.size(), std::exp(lsum / n), std::exp(lfast / n), mn, med.front().fastest_ratio, below);
    for (std::size_t i = 0; i < std::min<std::size_t>(10, med.size()); ++i)
      std::printf("  %.3f | %.3f  %-44s tessel %7.1f GFLOP/s, %s %7.1f\n", med[i].ratio, med[i].fastest_ratio, med[i].what.c_str(),
                  med[i].tessel_gflops, med[i].best.c_str(), med[i].best_gflops);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // The peers read these when they load, so they are set here and the binary re-executes itself:
  // OpenBLAS's best kernel on AVX-512 is SkylakeX (set even over another OPENBLAS_CORETYPE), and
  // its idle threads spin for ~2^28 cycles by default, which would steal the second core from the
  // next library in a 2-thread round (2^20 cycles is well under the 1 ms gap).
  if (!std::getenv("TESSEL_SWEEP_ENV")) {
    setenv("TESSEL_SWEEP_ENV", "1", 1);
    setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
    setenv("OPENBLAS_THREAD_TIMEOUT", "20", 0);
    // oneDNN's OpenMP (libgomp) threads spin 300,000 rounds after a parallel region by default,
    // several milliseconds here, past the 1 ms gap and into the next library's call: tessel alone
    // ran NN 1024^3 on 2 threads at 194 GFLOP/s, alternated with oneDNN at 144. 10,000 rounds is
    // about tessel's own 200 us spin.
    setenv("GOMP_SPINCOUNT", "10000", 0);
    execv("/proc/self/exe", argv);  // on failure: run as is
  }
  bool quick = false, tune = false;
  std::string tune_path;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0)
      quick = true;
    else if (std::strncmp(argv[i], "--peers=", 8) == 0)
      peer_filter() = argv[i] + 8;
    else if (std::strcmp(argv[i], "--tessel_tune") == 0)
      tune = true;
    else if (std::strncmp(argv[i], "--tessel_tune=", 14) == 0)
      tune = true, tune_path = argv[i] + 14;
    else
      argv[out++] = argv[i];
  }
  argc = out;
  const auto shapes = sweep_shapes();
  std::string plans_note = "none (the built-in heuristic)";
  if (tune) {
    if (tune_path.empty()) tune_path = gemm_tune_path();
    (void)load_gemm_tune(tune_path);  // keep the plans of shapes not tuned now
    std::vector<gemm_tune_problem> problems;
    for (std::size_t i = 0; i < shapes.size(); ++i)
      if (shapes[i].batch == 1 && (!quick || shapes[i].named || i % 4 == 0))
        problems.push_back({shapes[i].ta ? transpose::yes : transpose::none, shapes[i].tb ? transpose::yes : transpose::none, shapes[i].M,
                            shapes[i].N, shapes[i].K});
    gemm_tune_options opt;
    opt.max_seconds = 1.0;
    std::size_t tuned = 0, changed = 0;
    double gain = 0;
    for (unsigned th : {1u, 2u})
      for (const auto& rs : {gemm_autotune<float, float, float>(dev(th), problems, opt), gemm_autotune<bf16, bf16, float>(dev(th), problems, opt)})
        for (const auto& r : rs) {
          tuned += r.tunable;
          changed += !r.plan.is_default();
          gain += std::log(r.speedup());
        }
    save_gemm_tune(tune_path);
    std::printf("tuned %zu problems (%zu packed): %zu plans beat the heuristic, geomean gain x%.3f over all; wrote %s\n", 4 * problems.size(), tuned,
                changed, std::exp(gain / double(std::max<std::size_t>(tuned, 1))), tune_path.c_str());
  }
  if (const auto plans = gemm_plans(); !plans.empty())
    plans_note = std::to_string(plans.size()) + " plans" + (tune ? " from --tessel_tune, in " + tune_path : " from " + gemm_tune_path());
  std::size_t registered = 0;
  for (const char* dt : {"f32", "bf16"})
    for (unsigned th : {1u, 2u})
      for (std::size_t i = 0; i < shapes.size(); ++i) {
        const shape& s = shapes[i];
        if (quick && !s.named && i % 4 != 0) continue;
        const std::string name = std::string("gemm_sweep_") + dt + "/" + s.str() + "/threads:" + std::to_string(th);
        auto* b = std::strcmp(dt, "f32") == 0
                      ? benchmark::RegisterBenchmark(name.c_str(), [s, th](benchmark::State& st) { sweep_case<float>(st, s, th); })
                      : benchmark::RegisterBenchmark(name.c_str(), [s, th](benchmark::State& st) { sweep_case<bf16>(st, s, th); });
        b->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);
        ++registered;
      }
  benchmark::AddCustomContext("sweep",
                              std::to_string(shapes.size()) + " shapes" + (quick ? " (--quick subset)" : "") + ", " + std::to_string(registered) +
                                  " cases; OPENBLAS_CORETYPE=" + (std::getenv("OPENBLAS_CORETYPE") ? std::getenv("OPENBLAS_CORETYPE") : "unset"));
  benchmark::AddCustomContext("gemm_plans", plans_note);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  print_summary();
  return 0;
}
