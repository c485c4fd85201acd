// bench_graph_models: whole ONNX models through the graph layer (issue 21's speed table): for each
// model file in a directory, import_onnx, optimize (the fusions), compile for host_device at batch B
// with compute f32 or bf16, then time executable::run (inputs copied in, outputs copied out: what a
// user's call costs). The models are tools/torch/onnx_models.py --size bench; PyTorch's eager time on
// the same models and the paired table: tools/torch/bench_onnx_models.py.
//
//   bench_graph_models --models_dir=DIR [--batches=1,8] [--threads=1,2] [--dtypes=f32,bf16] [benchmark flags]
//   (or TESSEL_BENCH_MODELS=DIR). Names: graph_models/tessel/<model>/batch:B/threads:T/<dtype>.
//
// Counters: flops (rate) = flops_per_sample x B per run, flops_per_sample read from <stem>.json next to
// the model (written by onnx_models.py: 2 x the MACs of every matmul and convolution); of_limit = that
// rate / the measured peak of the dtype on T threads (bf16: the bf16 dot peak, f32: the FP32 FMA peak,
// bench/common/limits.hpp), of_fma = the rate / the FP32 FMA peak whatever the dtype; nodes before
// and after optimize; arena_MB. A model the executor cannot run (an op without a kernel, a shape
// computed at run time) is reported as a benchmark error with the executor's message, not a crash.
#include <tessel/device/host_device.hpp>
#include <tessel/graph.hpp>
#include <tessel/graph/onnx.hpp>
#include <tessel/types.hpp>

#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "common/limits.hpp"

// GCC 12 at -O3 reports a false -Wrestrict inside std::string's operator+ (GCC bug 105329).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wrestrict"
#endif

namespace {

using namespace tessel;
namespace fs = std::filesystem;

struct model_file {
  fs::path path;
  std::string name;             // the file's stem: bert_op17
  double flops_per_sample = 0;  // 0: unknown (no manifest), no flops counters
};

// flops_per_sample from <stem>.json beside the model, if it is there and says so.
double read_flops(const fs::path& model) {
  fs::path manifest = model;
  manifest.replace_extension(".json");
  std::ifstream f(manifest);
  if (!f) return 0;
  const auto j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw std::runtime_error(manifest.string() + ": not valid JSON");
  const auto it = j.find("flops_per_sample");
  if (it == j.end()) return 0;
  if (!it->is_number() || it->get<double>() < 0) throw std::runtime_error(manifest.string() + ": flops_per_sample is not a non-negative number");
  return it->get<double>();
}

// Seeded inputs of a bound shape: floats in [-1, 1); integers in [0, 8) (token ids stay inside any
// vocabulary), except an input named attention_mask, which is all ones (every token attended).
graph::host_tensor make_input(const std::string& name, dtype type, const std::vector<std::size_t>& shape, std::mt19937_64& rng) {
  graph::host_tensor t;
  t.type = type;
  std::size_t n = 1;
  for (std::size_t d : shape) {
    t.shape.push_back(static_cast<std::int64_t>(d));
    n *= d;
  }
  t.data.resize(n * dtype_size(type));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const bool ones = name.find("mask") != std::string::npos;
  auto fill = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t i = 0; i < n; ++i) {
      T x;
      if constexpr (std::is_floating_point_v<T>)
        x = static_cast<T>(u(rng));
      else
        x = static_cast<T>(ones ? 1 : rng() % 8);
      std::memcpy(t.data.data() + i * sizeof(T), &x, sizeof(T));
    }
  };
  switch (type) {
    case dtype::f32: fill(float{}); break;
    case dtype::i64: fill(std::int64_t{}); break;
    case dtype::i32: fill(std::int32_t{}); break;
    default: throw std::runtime_error("input '" + name + "': no generator for dtype " + std::string(dtype_name(type)));
  }
  return t;
}

// The optimized graph of the model being benchmarked and the executable of the current case; one
// of each is kept (cases of a model run one after the other, their repetitions back to back), so
// that memory holds one model and repetitions do not compile again.
struct cached_graph {
  std::string path;
  graph::graph g;
  std::size_t nodes_before = 0, nodes_after = 0;
};
struct cached_case {
  std::string key;
  std::unique_ptr<host_device> dev;
  std::optional<graph::executable<host_device>> exe;
  graph::tensor_map inputs;
};

cached_graph& graph_of(const model_file& m) {
  static cached_graph c;
  if (c.path != m.path.string()) {
    c.path.clear();
    c.g = graph::import_onnx(m.path);
    const auto r = graph::optimize(c.g);
    c.nodes_before = r.nodes_before;
    c.nodes_after = r.nodes_after;
    c.path = m.path.string();
  }
  return c;
}

cached_case& case_of(const model_file& m, long batch, unsigned threads, dtype compute, const std::string& key) {
  static cached_case c;
  if (c.key != key) {
    c.exe.reset();  // before the device it lives on
    c.inputs.clear();
    c.dev.reset();
    c.key.clear();
    const cached_graph& g = graph_of(m);
    c.dev = std::make_unique<host_device>(threads);
    graph::compile_options opt;
    opt.compute = compute;
    for (graph::value_id v : g.g.inputs())
      for (const graph::dim& d : g.g.get(v).shape.dims)
        if (!d.known() && !d.symbol.empty()) opt.symbols[d.symbol] = batch;  // the models' one symbol is the batch
    c.exe.emplace(graph::compile(g.g, *c.dev, opt));
    std::mt19937_64 rng(1);
    for (graph::value_id v : c.exe->bound_graph().inputs()) {
      const graph::value& x = c.exe->bound_graph().get(v);
      c.inputs.emplace(x.name, make_input(x.name, *x.type, c.exe->shape_of(x.name), rng));
    }
    c.key = key;
  }
  return c;
}

void run_case(benchmark::State& st, const std::string& key, const model_file& m, long batch, unsigned threads, dtype compute) {
  cached_case* c = nullptr;
  try {
    c = &case_of(m, batch, threads, compute, key);
    benchmark::DoNotOptimize(c->exe->run(c->inputs));  // warm: pages touched, pools filled
  } catch (const std::exception& x) {
    std::fprintf(stderr, "bench_graph_models: %s: %s\n", m.name.c_str(), x.what());
    st.SkipWithError(x.what());
    return;
  }
  for (auto _ : st) benchmark::DoNotOptimize(c->exe->run(c->inputs));
  const cached_graph& g = graph_of(m);
  st.counters["nodes_before"] = double(g.nodes_before);
  st.counters["nodes_after"] = double(g.nodes_after);
  st.counters["arena_MB"] = double(c->exe->arena_bytes()) / 1e6;
  if (m.flops_per_sample > 0) {
    const double flops = m.flops_per_sample * double(batch);
    const double fma = tessel_bench::peak_fp32_gflops(threads) * 1e9;
    const double peak = compute == dtype::bf16 ? tessel_bench::peak_bf16_gflops(threads) * 1e9 : fma;
    st.counters["flops"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
    st.counters["of_limit"] = benchmark::Counter(flops / peak, benchmark::Counter::kIsIterationInvariantRate);
    st.counters["of_fma"] = benchmark::Counter(flops / fma, benchmark::Counter::kIsIterationInvariantRate);
  }
}

std::vector<long> parse_list(std::string_view flag, std::string_view s) {
  std::vector<long> r;
  std::size_t at = 0;
  while (at <= s.size()) {
    const std::size_t end = std::min(s.find(',', at), s.size());
    const std::string item(s.substr(at, end - at));
    char* stop = nullptr;
    const long v = std::strtol(item.c_str(), &stop, 10);
    if (item.empty() || *stop != '\0' || v < 1 || v > 4096)
      throw std::invalid_argument(std::string(flag) + ": '" + item + "' is not a count in 1..4096");
    r.push_back(v);
    at = end + 1;
  }
  return r;
}

std::vector<dtype> parse_dtypes(std::string_view s) {
  std::vector<dtype> r;
  std::size_t at = 0;
  while (at <= s.size()) {
    const std::size_t end = std::min(s.find(',', at), s.size());
    const std::string_view item = s.substr(at, end - at);
    if (item == "f32")
      r.push_back(dtype::f32);
    else if (item == "bf16")
      r.push_back(dtype::bf16);
    else
      throw std::invalid_argument("--dtypes: '" + std::string(item) + "' is not f32 or bf16");
    at = end + 1;
  }
  return r;
}

std::vector<model_file> find_models(const fs::path& dir) {
  if (!fs::is_directory(dir))
    throw std::invalid_argument("models directory '" + dir.string() + "' does not exist (make it: tools/torch/onnx_models.py DIR --size bench)");
  std::vector<model_file> r;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && e.path().extension() == ".onnx") r.push_back({e.path(), e.path().stem().string(), read_flops(e.path())});
  if (r.empty()) throw std::invalid_argument("models directory '" + dir.string() + "' holds no .onnx file");
  std::sort(r.begin(), r.end(), [](const model_file& a, const model_file& b) { return a.name < b.name; });
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  // Our flags first (Google Benchmark rejects flags it does not know).
  std::string dir;
  if (const char* e = std::getenv("TESSEL_BENCH_MODELS")) dir = e;
  std::string batches = "1,8", threads = "1,2", dtypes = "f32,bf16";
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&](std::string_view flag, std::string& out) {
      if (a.substr(0, flag.size()) != flag) return false;
      out = std::string(a.substr(flag.size()));
      return true;
    };
    if (!value("--models_dir=", dir) && !value("--batches=", batches) && !value("--threads=", threads) && !value("--dtypes=", dtypes))
      rest.push_back(argv[i]);
  }
  std::vector<model_file> models;
  std::vector<long> bs, ts;
  std::vector<dtype> ds;
  try {
    if (dir.empty()) throw std::invalid_argument("no models directory: pass --models_dir=DIR or set TESSEL_BENCH_MODELS");
    models = find_models(dir);
    bs = parse_list("--batches", batches);
    ts = parse_list("--threads", threads);
    ds = parse_dtypes(dtypes);
  } catch (const std::exception& x) {
    std::fprintf(stderr, "bench_graph_models: %s\n", x.what());
    return 2;
  }
  for (const model_file& m : models)
    for (long b : bs)
      for (long t : ts)
        for (dtype d : ds) {
          const std::string name =
              "graph_models/tessel/" + m.name + "/batch:" + std::to_string(b) + "/threads:" + std::to_string(t) + "/" + std::string(dtype_name(d));
          benchmark::RegisterBenchmark(name.c_str(), [name, m, b, t, d](benchmark::State& st) { run_case(st, name, m, b, unsigned(t), d); })
              ->Unit(benchmark::kMillisecond)
              ->UseRealTime();
        }
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  if (benchmark::ReportUnrecognizedArguments(n, rest.data())) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
