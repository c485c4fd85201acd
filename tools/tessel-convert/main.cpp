// tessel-convert: imports an ONNX model, optimizes its graph (constant folding, CSE, the pattern
// fusions), plans its activations, prints the fusion and memory report, and optionally runs it on
// the host or on an emulated card with inputs from .npy files (or seeded random ones).
//   tessel-convert model.onnx [--report] [--bind batch=8] [--run] [--input [NAME=]FILE.npy]...
//                  [--out DIR] [--dtype f32|bf16] [--device host|card] [--threads N] [--repeat N]
// Exit status: 0 on success, 1 when the model cannot be imported or run (the reason is printed),
// 2 on bad arguments.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/emulator/card.hpp>
#include <tessel/graph.hpp>
#include <tessel/graph/onnx.hpp>
#include <tessel/io/npy.hpp>
#include <tessel/types.hpp>

#include "../common/args.hpp"

// GCC 12 at -O3 reports a false -Wrestrict inside std::string's operator+ (GCC bug 105329).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wrestrict"
#endif

using namespace tessel;
using tessel_tools::parse_int;

namespace {

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr,
               "tessel-convert: %s\n"
               "usage: tessel-convert MODEL.onnx [options]\n"
               "  --report             print the fusion report (ops before/after, patterns) and the memory plan\n"
               "  --bind SYM=N         the size of a symbolic dim (repeatable; unbound symbols are 1 for planning)\n"
               "  --no-fuse            import and plan without the optimization passes\n"
               "  --run                run the model once (random inputs, seed 1, unless --input names them)\n"
               "  --input [NAME=]FILE  a graph input from a .npy file (NAME may be left out for a one-input model)\n"
               "  --out DIR            write each output as DIR/<name>.npy (implies --run)\n"
               "  --dtype f32|bf16     compute dtype of GEMMs and attention (default f32)\n"
               "  --device host|card   run on the host thread pool or an emulated UBL128 card (default host)\n"
               "  --threads N          worker threads (default 2)\n"
               "  --repeat N           runs to time (default 1; prints min and median)\n",
               msg.c_str());
  std::exit(2);
}

graph::host_tensor from_npy(const io::npy_array& a) {
  graph::host_tensor t;
  t.type = a.type;
  for (std::size_t d : a.shape) t.shape.push_back(static_cast<std::int64_t>(d));
  t.data = a.data;
  return t;
}

io::npy_array to_npy(const graph::host_tensor& t) {
  io::npy_array a;
  a.type = t.type;
  for (std::int64_t d : t.shape) a.shape.push_back(static_cast<std::size_t>(d));
  a.data = t.data;
  return a;
}

// Seeded inputs for a graph input of bound shape: floats in [-1, 1), integers in [0, 8) (token ids
// and indices stay in range for the reference models' vocabularies), bools 0/1.
graph::host_tensor random_input(dtype type, const std::vector<std::size_t>& shape, std::mt19937_64& rng) {
  graph::host_tensor t;
  t.type = type;
  std::size_t n = 1;
  for (std::size_t d : shape) {
    t.shape.push_back(static_cast<std::int64_t>(d));
    n = tessel::detail::mul_checked(n, d, "tessel-convert: input size");
  }
  t.data.resize(tessel::detail::mul_checked(n, dtype_size(type), "tessel-convert: input size"));
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  auto fill = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t i = 0; i < n; ++i) {
      T x;
      if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, bf16> || std::is_same_v<T, fp16>)
        x = T(static_cast<float>(u(rng)));
      else
        x = static_cast<T>(rng() % 8);
      std::memcpy(t.data.data() + i * sizeof(T), &x, sizeof(T));
    }
  };
  switch (type) {
    case dtype::f32: fill(float{}); break;
    case dtype::f64: fill(double{}); break;
    case dtype::bf16: fill(bf16{}); break;
    case dtype::fp16: fill(fp16{}); break;
    case dtype::i64: fill(std::int64_t{}); break;
    case dtype::i32: fill(std::int32_t{}); break;
    case dtype::u8:
      for (std::size_t i = 0; i < n; ++i) t.data[i] = std::byte{static_cast<unsigned char>(rng() & 1)};
      break;
    default: throw graph::graph_error(errc::unsupported, std::string("tessel-convert: no random inputs of dtype ") + std::string(dtype_name(type)));
  }
  return t;
}

std::string shape_string(const std::vector<std::int64_t>& s) {
  std::string r = "[";
  for (std::size_t i = 0; i < s.size(); ++i) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "]";
}

template <class Dev>
int run_model(Dev& dev, const graph::graph& g, const graph::compile_options& copt, const std::map<std::string, std::string>& input_files,
              const std::string& out_dir, int repeat) {
  auto exe = graph::compile(g, dev, copt);
  std::printf("%s\n", exe.activations().report().c_str());
  graph::tensor_map inputs;
  std::mt19937_64 rng(1);
  for (graph::value_id v : exe.bound_graph().inputs()) {
    const graph::value& x = exe.bound_graph().get(v);
    auto it = input_files.find(x.name);
    if (it != input_files.end()) {
      inputs.emplace(x.name, from_npy(io::read_npy(it->second)));
    } else {
      if (!input_files.empty()) throw graph::graph_error(errc::invalid_argument, "tessel-convert: no --input for graph input '" + x.name + "'");
      inputs.emplace(x.name, random_input(*x.type, exe.shape_of(x.name), rng));
    }
  }
  for (const auto& [name, file] : input_files)
    if (!inputs.count(name)) throw graph::graph_error(errc::invalid_argument, "tessel-convert: --input " + name + ": the model has no such input");
  std::vector<double> seconds;
  graph::tensor_map out;
  for (int r = 0; r < repeat; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    out = exe.run(inputs);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(seconds.begin(), seconds.end());
  std::printf("run: %d time(s), min %.3f ms, median %.3f ms\n", repeat, seconds.front() * 1e3, seconds[seconds.size() / 2] * 1e3);
  for (const auto& [name, t] : out) {
    std::printf("output %s: %s%s", name.c_str(), std::string(dtype_name(t.type)).c_str(), shape_string(t.shape).c_str());
    if (t.type == dtype::f32 && !t.data.empty()) {
      const auto v = t.template values<float>();
      std::printf(" first");
      for (std::size_t i = 0; i < std::min<std::size_t>(4, v.size()); ++i) std::printf(" %.6g", static_cast<double>(v[i]));
    }
    std::printf("\n");
    if (!out_dir.empty()) {
      std::filesystem::create_directories(out_dir);
      std::string file = name;
      std::replace_if(
          file.begin(), file.end(), [](char c) { return c == '/' || c == '\\' || c == ':'; }, '_');
      io::write_npy(std::filesystem::path(out_dir) / (file + ".npy"), to_npy(t));
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model;
  bool report = false, run = false, fuse = true;
  std::map<std::string, std::string> input_files;
  std::string unnamed_input, out_dir;
  graph::symbol_bindings binds;
  graph::compile_options copt;
  std::string device = "host";
  int threads = 2, repeat = 1;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto val = [&]() -> std::string {
        if (i + 1 >= argc) usage("missing value for " + a);
        return argv[++i];
      };
      if (a == "--report")
        report = true;
      else if (a == "--run")
        run = true;
      else if (a == "--no-fuse")
        fuse = false;
      else if (a == "--bind") {
        const std::string v = val();
        const auto eq = v.find('=');
        if (eq == std::string::npos || eq == 0) usage("--bind takes SYMBOL=SIZE, not '" + v + "'");
        binds[v.substr(0, eq)] = parse_int(a, v.substr(eq + 1), 0, std::int64_t{1} << 40);
      } else if (a == "--input") {
        const std::string v = val();
        const auto eq = v.find('=');
        if (eq == std::string::npos) {
          if (!unnamed_input.empty()) usage("only one --input may leave out its NAME=");
          unnamed_input = v;
        } else {
          input_files[v.substr(0, eq)] = v.substr(eq + 1);
        }
        run = true;
      } else if (a == "--out") {
        out_dir = val();
        run = true;
      } else if (a == "--dtype") {
        const std::string v = val();
        if (v == "f32")
          copt.compute = dtype::f32;
        else if (v == "bf16")
          copt.compute = dtype::bf16;
        else
          usage("--dtype is f32 or bf16, not '" + v + "'");
      } else if (a == "--device") {
        device = val();
        if (device != "host" && device != "card") usage("--device is host or card, not '" + device + "'");
      } else if (a == "--threads")
        threads = static_cast<int>(parse_int(a, val(), 1, 1024));
      else if (a == "--repeat")
        repeat = static_cast<int>(parse_int(a, val(), 1, 1000000));
      else if (!a.empty() && a[0] == '-')
        usage("unknown option " + a);
      else if (model.empty())
        model = a;
      else
        usage("more than one model: '" + model + "' and '" + a + "'");
    }
  } catch (const std::exception& e) { usage(e.what()); }
  if (model.empty()) usage("no model given");

  try {
    graph::onnx_import_info info;
    graph::onnx_options iopt;
    iopt.info = &info;
    graph::graph g = graph::import_onnx(model, iopt);
    std::printf("%s: opset %lld%s, %zu nodes, %zu inputs, %zu outputs (%s)\n", model.c_str(), static_cast<long long>(info.opset),
                info.converted ? (" converted to " + std::to_string(info.imported_opset)).c_str() : "", g.node_count(), g.inputs().size(),
                g.outputs().size(), info.producer.c_str());
    for (const std::string& n : info.notes) std::printf("  note: %s\n", n.c_str());
    if (fuse) {
      graph::optimize_options oopt;
      oopt.fold.bindings = binds;
      const graph::fusion_report r = graph::optimize(g, oopt);
      if (report)
        std::printf("%s", r.to_string().c_str());
      else
        std::printf("nodes: %zu -> %zu (-%.1f%%)\n", r.nodes_before, r.nodes_after, r.reduction_percent());
    }
    // Every symbol left unbound is 1 for planning and running; say which.
    for (graph::value_id v : g.inputs())
      for (const graph::dim& d : g.get(v).shape.dims)
        if (d.symbolic() && !binds.count(d.symbol)) {
          binds[d.symbol] = 1;
          std::printf("  symbol '%s' unbound: 1 (use --bind %s=N)\n", d.symbol.c_str(), d.symbol.c_str());
        }
    if (report) std::printf("%s\n", graph::plan_activations(g, {}, binds).report().c_str());
    if (!unnamed_input.empty()) {
      if (g.inputs().size() != 1)
        throw graph::graph_error(errc::invalid_argument,
                                 "tessel-convert: --input without NAME= needs a one-input model; this one has " + std::to_string(g.inputs().size()));
      input_files[g.get(g.inputs()[0]).name] = unnamed_input;
    }
    if (!run) return 0;
    copt.symbols = binds;
    if (device == "card") {
      tessel::executor ex(static_cast<std::size_t>(threads));
      emu::card_spec spec;
      emu::card card(0, spec, ex, false, nullptr);
      return run_model(card, g, copt, input_files, out_dir, repeat);
    }
    host_device dev(static_cast<std::size_t>(threads));
    return run_model(dev, g, copt, input_files, out_dir, repeat);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessel-convert: %s\n", e.what());
    return 1;
  }
}
