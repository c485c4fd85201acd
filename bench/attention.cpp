// bench_attention: fused flash attention (bf16, B=1, H=16, D=128, S=4096, causal and not) forward
// and backward, next to tessel's own bf16 GEMM (the throughput target), a naive materialised
// implementation, and an unfused oneDNN baseline (bf16 matmul, vectorised softmax, bf16 matmul);
// decode (1 row, 32 q heads, 8 kv heads, D=128, 32k bf16 cache, contiguous and in 16-token pages) against the STREAM bound of
// reading the cache once, and the same decode on one worker split into read-only / math-from-L2 /
// kernel time; peak extra memory of the forward pass at S = 8k and 32k.
// FLOPs: 4·Sq·Skv·D per head forward (half when causal), 2.5x that backward.
// Counters: flops (rate), of_limit (fraction of the machine's bf16 dot peak, or for decode of the
// STREAM bandwidth measured alongside it, see decode_tessel), of_gemm (fraction of the median bf16
// GEMM repetition measured earlier in this run).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <ctime>
#include <random>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/attention.hpp>
#include <tessel/ops/gemm.hpp>

#if TESSEL_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#endif

#include "common/limits.hpp"

namespace {
using namespace tessel;
using namespace tessel_bench;

constexpr unsigned threads = 2;
constexpr std::size_t H = 16, D = 128, S = 4096;

host_device& dev() {
  static host_device d(threads);
  return d;
}
// The bf16 GEMM's rate: the median of its repetitions so far (each attention repetition is then
// compared with the same middle figure; the best repetition would bias every ratio low).
std::vector<double>& gemm_rates() {
  static std::vector<double> r;
  return r;
}
double gemm_rate() {
  auto r = gemm_rates();
  if (r.empty()) return 0;
  std::sort(r.begin(), r.end());
  const std::size_t h = r.size() / 2;
  return r.size() % 2 ? r[h] : 0.5 * (r[h - 1] + r[h]);
}

struct qkv {
  huge_buffer<bf16> q, k, v, o, dout, dq, dk, dv;
  huge_buffer<float> lse;
  explicit qkv(std::size_t n = S * H * D)
      : q(n, threads),
        k(n, threads),
        v(n, threads),
        o(n, threads),
        dout(n, threads),
        dq(n, threads),
        dk(n, threads),
        dv(n, threads),
        lse(n / D, threads) {
    std::mt19937 g(1);
    std::normal_distribution<float> nd;
    for (std::size_t i = 0; i < n; ++i) {
      q[i] = bf16(nd(g));
      k[i] = bf16(nd(g));
      v[i] = bf16(nd(g));
      dout[i] = bf16(nd(g));
    }
  }
  static qkv& get() {
    static qkv x;
    return x;
  }
  template <class T>
  static std::span<T> sp(const huge_buffer<T>& b) {
    return {b.data(), b.size()};
  }
};

double fwd_flops(bool causal, std::size_t s = S, std::size_t h = H) { return 4.0 * double(s) * double(s) * double(D) * double(h) / (causal ? 2 : 1); }

void report(benchmark::State& state, double flops) {
  const double rate = flops * double(state.iterations());
  state.counters["flops"] = benchmark::Counter(rate, benchmark::Counter::kIsRate);
  state.counters["of_limit"] = benchmark::Counter(rate / peak_bf16_gflops(threads) * 1e-9, benchmark::Counter::kIsRate);
  if (gemm_rate() > 0) state.counters["of_gemm"] = benchmark::Counter(rate / gemm_rate(), benchmark::Counter::kIsRate);
}

void gemm_bf16(benchmark::State& state) {
  const std::size_t n = 4096;
  static huge_buffer<bf16> a(n * n, threads), b(n * n, threads);
  static huge_buffer<float> c(n * n, threads);
  static bool init = [] {
    std::mt19937 g(2);
    std::normal_distribution<float> nd;
    for (std::size_t i = 0; i < n * n; ++i) {
      a[i] = bf16(nd(g));
      b[i] = bf16(nd(g));
    }
    return true;
  }();
  (void)init;
  peak_bf16_gflops(threads);
  double secs = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    gemm(dev(), transpose::none, transpose::none, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    secs += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double f = 2.0 * double(n) * n * n;
  gemm_rates().push_back(f * double(state.iterations()) / secs);
  report(state, f);
}

attention_shape big_shape() { return attention_shape{1, S, S, H, H, D, attention_layout::bshd}; }

void fwd_tessel(benchmark::State& state) {
  auto& x = qkv::get();
  attention_options opt;
  opt.causal = state.range(0) != 0;
  for (auto _ : state)
    attention_forward<host_device, bf16, bf16>(dev(), big_shape(), qkv::sp(x.q), qkv::sp(x.k), qkv::sp(x.v), qkv::sp(x.o), qkv::sp(x.lse), opt);
  report(state, fwd_flops(opt.causal));
}

void bwd_tessel(benchmark::State& state) {
  auto& x = qkv::get();
  attention_options opt;
  opt.causal = state.range(0) != 0;
  attention_forward<host_device, bf16, bf16>(dev(), big_shape(), qkv::sp(x.q), qkv::sp(x.k), qkv::sp(x.v), qkv::sp(x.o), qkv::sp(x.lse), opt);
  for (auto _ : state)
    attention_backward<host_device, bf16>(dev(), big_shape(), qkv::sp(x.q), qkv::sp(x.k), qkv::sp(x.v), qkv::sp(x.o), qkv::sp(x.dout), qkv::sp(x.lse),
                                          qkv::sp(x.dq), qkv::sp(x.dk), qkv::sp(x.dv), opt);
  report(state, 2.5 * fwd_flops(opt.causal));
}

// Naive materialised attention (one head, f32 scores in memory), rows split over the workers.
void fwd_naive(benchmark::State& state) {
  auto& x = qkv::get();
  const bool causal = state.range(0) != 0;
  static std::vector<float> sbuf(S * S);
  const float scale = 1.0f / std::sqrt(float(D));
  for (auto _ : state) {
    const std::size_t h = 0;
    dev().launch(grid{S / 64}, [&](block_ctx& ctx) {
      for (std::size_t i = ctx.block_linear() * 64; i < (ctx.block_linear() + 1) * 64; ++i) {
        float* row = sbuf.data() + i * S;
        const std::size_t n = causal ? i + 1 : S;
        float m = -INFINITY;
        for (std::size_t j = 0; j < n; ++j) {
          float acc = 0;
          for (std::size_t d = 0; d < D; ++d) acc += float(x.q[(i * H + h) * D + d]) * float(x.k[(j * H + h) * D + d]);
          row[j] = acc * scale;
          m = std::max(m, row[j]);
        }
        float l = 0;
        for (std::size_t j = 0; j < n; ++j) {
          row[j] = std::exp(row[j] - m);
          l += row[j];
        }
        float o[D] = {};
        for (std::size_t j = 0; j < n; ++j) {
          const float p = float(bf16(row[j] / l));
          for (std::size_t d = 0; d < D; ++d) o[d] += p * float(x.v[(j * H + h) * D + d]);
        }
        for (std::size_t d = 0; d < D; ++d) x.o[(i * H + h) * D + d] = bf16(o[d]);
      }
    });
  }
  report(state, fwd_flops(causal, S, 1));
}

#if TESSEL_HAVE_ONEDNN
// Softmax of rows [r0, r1) of a materialised (S, S) f32 score matrix into bf16 probabilities.
void softmax_rows(float* s, bf16* p, std::size_t r0, std::size_t r1, float scale, bool causal) {
  using namespace tessel::arch::softmax;
  const float c = scale * 1.4426950408889634f;
  for (std::size_t i = r0; i < r1; ++i) {
    float* row = s + i * S;
    const std::size_t n = causal ? i + 1 : S;
    const float m = row_max(row, n) * c;
    const float l = exp2_row(row, n, c, m, row);
    scale_row(row, n, 1.0f / l);
    to_bf16_row(row, n, reinterpret_cast<std::uint16_t*>(p + i * S));
    std::fill(p + i * S + n, p + (i + 1) * S, bf16(0.0f));
  }
}

// Unfused: oneDNN bf16 matmul S = Q·Kᵀ (f32 out), tessel's vectorised softmax to bf16 P, oneDNN
// bf16 matmul O = P·V; head by head so the (S, S) buffers stay at 96 MiB.
void fwd_onednn(benchmark::State& state) {
  using namespace dnnl;
  using dt = memory::data_type;
  auto& x = qkv::get();
  const bool causal = state.range(0) != 0;
  engine eng(engine::kind::cpu, 0);
  stream st(eng);
  const memory::dim s = S, d = D, ld = H * D;
  memory::desc q_md({s, d}, dt::bf16, memory::dims{ld, 1});
  memory::desc kt_md({d, s}, dt::bf16, memory::dims{1, ld});
  memory::desc s_md({s, s}, dt::f32, memory::dims{s, 1});
  memory::desc p_md({s, s}, dt::bf16, memory::dims{s, 1});
  memory::desc v_md({s, d}, dt::bf16, memory::dims{ld, 1});
  memory::desc o_md({s, d}, dt::bf16, memory::dims{ld, 1});
  matmul qk(matmul::primitive_desc(matmul::desc(q_md, kt_md, s_md), eng));
  matmul pv(matmul::primitive_desc(matmul::desc(p_md, v_md, o_md), eng));
  static huge_buffer<float> sbuf(S * S, threads);
  static huge_buffer<bf16> pbuf(S * S, threads);
  memory qm(q_md, eng, nullptr), km(kt_md, eng, nullptr), sm(s_md, eng, sbuf.data()), pm(p_md, eng, pbuf.data()), vm(v_md, eng, nullptr),
      om(o_md, eng, nullptr);
  const float scale = 1.0f / std::sqrt(float(D));
  for (auto _ : state) {
    for (std::size_t h = 0; h < H; ++h) {
      qm.set_data_handle(x.q.data() + h * D);
      km.set_data_handle(x.k.data() + h * D);
      vm.set_data_handle(x.v.data() + h * D);
      om.set_data_handle(x.o.data() + h * D);
      qk.execute(st, {{DNNL_ARG_SRC, qm}, {DNNL_ARG_WEIGHTS, km}, {DNNL_ARG_DST, sm}});
      st.wait();
      dev().launch(grid{S / 64}, [&](block_ctx& ctx) {
        softmax_rows(sbuf.data(), pbuf.data(), ctx.block_linear() * 64, (ctx.block_linear() + 1) * 64, scale, causal);
      });
      pv.execute(st, {{DNNL_ARG_SRC, pm}, {DNNL_ARG_WEIGHTS, vm}, {DNNL_ARG_DST, om}});
      st.wait();
    }
  }
  report(state, fwd_flops(causal));
}
#endif

// Process CPU seconds so far (every thread): with the wall time it shows whether the workers had
// the cores to themselves (proc_cpu/wall near the thread count) when the machine is shared.
double process_cpu_s() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// Decode: 1 query row, 32 q heads, 8 kv heads, D=128, 32k cached bf16 tokens (K and V 64 MiB each).
//
// The bound. Decode must read the KV cache once: bytes = 2 * KV * HK * D * 2 = 128 MiB, so its
// floor is bytes / (the machine's memory bandwidth). That bandwidth is measured side by side with
// the kernel, because on this (shared, virtualised) machine it moves between ~40 and ~85 GB/s
// from minute to minute: a limit measured once at start-up and a kernel timed a minute later can
// be 2x apart. Every iteration times, back to back and in the same process:
//   1. STREAM copy on 2 threads (tessel_bench::measure_stream; 128 MiB arrays, STREAM byte count:
//      read + write) -> the STREAM bound 'stream_gbs', the one the issue names;
//   2. a read-only pass over the same 128 MiB of K and V, 2 workers, split in the kernel's chunks
//      (dec_chunk tokens per block, K and V rows of each token in address order, through the block
//      table when paged) -> 'read_gbs', what this access pattern can reach with no math at all;
//   3. the decode kernel -> the reported time and 'bytes'.
// of_limit = kernel GB/s / STREAM GB/s, as the median over the iterations of each (and
// of_limit_best: best kernel / best STREAM); of_read likewise against the read-only pass (median).
// Judge a run by of_limit; the read-only pass is usually faster than STREAM copy (no writes).
struct decode_case {
  static constexpr std::size_t HQ = 32, HK = 8, KV = 32768;
  static constexpr std::size_t row = HK * D;  // elements of one token's K (or V) row
  static constexpr double bytes = 2.0 * double(KV) * HK * D * sizeof(bf16);
  huge_buffer<bf16> kc{KV * HK * D, threads}, vc{KV * HK * D, threads}, q{HQ * D, threads}, o{HQ * D, threads};
  decode_case() {
    std::mt19937 g(3);
    std::normal_distribution<float> nd;
    for (std::size_t i = 0; i < kc.size(); ++i) {
      kc[i] = bf16(nd(g));
      vc[i] = bf16(nd(g));
    }
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = bf16(nd(g));
  }
  static decode_case& get() {
    static decode_case x;
    return x;
  }
  // The cache as contiguous (page 0) or paged: page > 0 with `table` as block table.
  static attention_decode_shape shape(std::size_t page) {
    attention_decode_shape s;
    s.batch = 1;
    s.seq_q = 1;
    s.heads_q = HQ;
    s.heads_kv = HK;
    s.head_dim = D;
    s.max_kv = KV;
    if (page > 0) {
      s.max_kv = 0;
      s.page_size = page;
      s.num_pages = KV / page;
      s.pages_per_seq = KV / page;
    }
    return s;
  }
  void kernel(host_device& d, std::size_t page, std::span<const std::int32_t> table) {
    const std::int32_t len = std::int32_t(KV);
    attention_decode<host_device, bf16, bf16>(d, shape(page), std::span<const bf16>(q.data(), q.size()), std::span<const bf16>(kc.data(), kc.size()),
                                              std::span<const bf16>(vc.data(), vc.size()), std::span<const std::int32_t>(&len, 1), table,
                                              std::span<bf16>(o.data(), o.size()));
  }
  // The read-only pass: same blocks as the kernel, each reads its chunk's K and V token rows.
  void read_pass(host_device& d, std::size_t page, const std::vector<std::int32_t>& table) {
    auto row_of = [&](std::size_t j) { return page > 0 ? std::size_t(table[j / page]) * page * row + (j % page) * row : j * row; };
    const std::size_t chunk = tessel::detail::attn::dec_chunk, words = row * sizeof(bf16) / 8;
    std::atomic<std::uint64_t> sink{0};
    d.launch(grid{KV / chunk}, [&](block_ctx& ctx) {
      const std::size_t j0 = ctx.block_linear() * chunk;
      std::uint64_t x = 0;
      for (std::size_t j = j0; j < j0 + chunk; ++j) {
        const auto* kr = reinterpret_cast<const std::uint64_t*>(kc.data() + row_of(j));
        const auto* vr = reinterpret_cast<const std::uint64_t*>(vc.data() + row_of(j));
        for (std::size_t w = 0; w < words; ++w) x ^= kr[w] ^ vr[w];  // (vectorised by the compiler)
      }
      sink.fetch_xor(x, std::memory_order_relaxed);
    });
    std::uint64_t x = sink.load();
    benchmark::DoNotOptimize(x);
  }
};

template <class F>
double seconds_of(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void decode_tessel(benchmark::State& state) {
  auto& x = decode_case::get();
  constexpr std::size_t KV = decode_case::KV;
  // page > 0: the same cache as a paged cache whose pages are used in reverse order (a block table
  // that is not the identity, so nothing relies on pages being adjacent)
  const std::size_t page = std::size_t(state.range(0));
  std::vector<std::int32_t> table;
  if (page > 0)
    for (std::size_t i = 0; i < KV / page; ++i) table.push_back(std::int32_t(KV / page - 1 - i));
  const double bytes = decode_case::bytes;
  measure_stream(stream_kind::copy, threads);  // arrays allocated and warm
  std::vector<double> tk, tr, st;
  double cpu = 0, wall = 0;
  for (auto _ : state) {
    st.push_back(measure_stream(stream_kind::copy, threads));
    tr.push_back(seconds_of([&] { x.read_pass(dev(), page, table); }));
    const double c0 = process_cpu_s();
    const double t = seconds_of([&] { x.kernel(dev(), page, table); });
    cpu += process_cpu_s() - c0;
    wall += t;
    tk.push_back(t);
    state.SetIterationTime(t);
  }
  const double k_med = bytes / median_of(tk) * 1e-9, k_best = bytes / *std::min_element(tk.begin(), tk.end()) * 1e-9;
  const double s_med = median_of(st), s_best = *std::max_element(st.begin(), st.end());
  const double r_med = bytes / median_of(tr) * 1e-9;
  state.counters["cpu_per_wall"] = cpu / wall;
  state.counters["bytes"] = benchmark::Counter(bytes * double(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["stream_gbs"] = s_med;
  state.counters["read_gbs"] = r_med;
  state.counters["of_limit"] = k_med / s_med;
  state.counters["of_limit_best"] = k_best / s_best;
  state.counters["of_read"] = k_med / r_med;
}

// The same decode on ONE worker, split into its parts, each timed every iteration (medians):
//   read_ms   the read-only pass over the 128 MiB (kernel's chunks, one core);
//   l2_ms     the kernel with every KV read hitting L2: the cache viewed as 16-token pages through a
//             block table that cycles over 8 pages (512 KiB of K and V), so the math, the softmax
//             and the kernel's own reads run without DRAM (plus the block-table lookups);
//   kernel_ms the kernel on the real 128 MiB (the reported time).
// overlap = (read + l2 - kernel) / min(read, l2): 0 when reads and math run one after the other
// on the core, 1 when the shorter one hides entirely under the longer. The split does not depend
// on the machine's bandwidth state as much as the 2-thread ratio does: it shows where the time goes.
void decode_1thread(benchmark::State& state) {
  auto& x = decode_case::get();
  constexpr std::size_t KV = decode_case::KV, page = 16, pages = 8;
  static host_device one(1);
  std::vector<std::int32_t> cycle(KV / page), none;
  for (std::size_t i = 0; i < cycle.size(); ++i) cycle[i] = std::int32_t(i % pages);
  x.kernel(one, 0, none);
  x.kernel(one, page, cycle);
  std::vector<double> tk, tr, tl;
  for (auto _ : state) {
    tr.push_back(seconds_of([&] { x.read_pass(one, 0, none); }));
    tl.push_back(seconds_of([&] { x.kernel(one, page, cycle); }));
    const double t = seconds_of([&] { x.kernel(one, 0, none); });
    tk.push_back(t);
    state.SetIterationTime(t);
  }
  const double k = median_of(tk), r = median_of(tr), l = median_of(tl);
  state.counters["bytes"] = benchmark::Counter(decode_case::bytes * double(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["kernel_ms"] = k * 1e3;
  state.counters["read_ms"] = r * 1e3;
  state.counters["l2_ms"] = l * 1e3;
  state.counters["overlap"] = (r + l - k) / std::min(r, l);
}

// Peak extra device memory (workspace from the device pool) of one forward pass, bf16, H=1,
// D=128, causal, on a fresh device; per-worker scratch is reported separately (it is constant).
void fwd_memory(benchmark::State& state) {
  const std::size_t s = std::size_t(state.range(0));
  std::vector<bf16> q(s * D, bf16(0.1f)), k(s * D, bf16(0.2f)), v(s * D, bf16(0.3f)), o(s * D);
  std::vector<float> lse(s);
  attention_options opt;
  opt.causal = true;
  double peak = 0, scratch = 0;
  for (auto _ : state) {
    host_device d(threads);
    attention_forward<host_device, bf16, bf16>(d, attention_shape{1, s, s, 1, 1, D, attention_layout::bshd}, q, k, v, o, lse, opt);
    peak = double(d.memory().peak_in_use);
    scratch = double(d.capabilities().scratch_per_worker);
  }
  state.counters["extra_bytes"] = peak;
  state.counters["extra_bytes_per_token"] = peak / double(s);
  state.counters["scratch_per_worker"] = scratch;
  state.counters["input_bytes"] = 3.0 * double(s) * D * sizeof(bf16);
}

auto min_of = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };

}  // namespace

BENCHMARK(gemm_bf16)->Name("gemm/tessel/bf16/4096x4096x4096")->Unit(benchmark::kMillisecond)->UseRealTime()->ComputeStatistics("min", min_of);
BENCHMARK(fwd_tessel)
    ->Name("attention/tessel/fwd/bf16/B1_H16_D128_S4096")
    ->ArgName("causal")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->ComputeStatistics("min", min_of);
BENCHMARK(bwd_tessel)
    ->Name("attention/tessel/bwd/bf16/B1_H16_D128_S4096")
    ->ArgName("causal")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->ComputeStatistics("min", min_of);
BENCHMARK(fwd_naive)
    ->Name("attention/naive/fwd/bf16/B1_H1_D128_S4096")
    ->ArgName("causal")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->ComputeStatistics("min", min_of);
#if TESSEL_HAVE_ONEDNN
BENCHMARK(fwd_onednn)
    ->Name("attention/onednn/fwd/bf16/B1_H16_D128_S4096")
    ->ArgName("causal")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->ComputeStatistics("min", min_of);
#endif
BENCHMARK(decode_tessel)
    ->Name("attention/tessel/decode/bf16/HQ32_HKV8_D128_KV32768")
    ->ArgName("page")
    ->Arg(0)
    ->Arg(16)
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime()
    ->ComputeStatistics("min", min_of);
BENCHMARK(decode_1thread)
    ->Name("attention/tessel/decode_1thread/bf16/HQ32_HKV8_D128_KV32768")
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime()
    ->ComputeStatistics("min", min_of);
BENCHMARK(fwd_memory)
    ->Name("attention/tessel/fwd_memory/bf16/H1_D128")
    ->ArgName("S")
    ->Arg(8192)
    ->Arg(32768)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(1);

BENCHMARK_MAIN();
