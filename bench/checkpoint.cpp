// bench_checkpoint: what a checkpoint costs (issue 20), side by side in one run with the bound of
// the storage it goes to.
//   BM_disk_write            the bound: the bytes of the model's checkpoint written to the same
//                            directory in 1 MiB writes, then fsync (bytes/s).
//   BM_save                  dist::save_checkpoint of bench_model's ~20M-parameter Llama after one
//                            step (values and both AdamW moments: 12 bytes per parameter), synchronous.
//   BM_load                  dist::load_checkpoint of that checkpoint (hash check + assembly).
//   BM_step/<save>           one training step of that model (bench_model's batch, 4 x 512 tokens)
//                            on a host_device of 2 threads; save 0: no checkpoint, 1: an asynchronous
//                            full checkpoint (dist::checkpointer) every step, 2: an incremental one.
//                            Counter stall: the share of the step save() blocked (the staging copy,
//                            into stores the untimed first two saves allocated);
//                            the rest of the write runs on its own thread beside the next step, and
//                            the step time against BM_step/0 shows what that costs on the cores.
//   BM_sparse_delta/<block>  an embedding table of 200,000 x 64 (and a 64 x 256 tower) stepped by
//                            AdamW with lazy rows after 1,024 uniformly drawn lookups per step, saved
//                            incrementally every step with `block`-element blocks: counter ratio =
//                            full checkpoint bytes / delta bytes.
// The checkpoints go to $TESSEL_BENCH_DIR (default: the working directory), removed at the end.
#include <benchmark/benchmark.h>

// tessel first: arch/target.hpp must be the first to include the intrinsic headers (GCC 12 warning).
#include <tessel/collectives.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/dist.hpp>
#include <tessel/nn.hpp>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "common/small_llama.hpp"

namespace {

namespace fs = std::filesystem;
using namespace tessel;

fs::path bench_dir() {
  const char* e = std::getenv("TESSEL_BENCH_DIR");
  return fs::path(e && *e ? e : ".") / ("bench_checkpoint." + std::to_string(::getpid()));
}

// One rank's world for the whole run (a checkpoint needs a communicator; one rank: no traffic).
communicator& world1() {
  static threads_world tw(1);
  static communicator w(tw.transport(0));
  return w;
}

struct llama_fixture {
  host_device dev{2};
  nn::decoder_lm<host_device> m{dev, tessel_bench::small_llama()};
  tessel_bench::small_batch_data batch;
  std::uint64_t step = 0;
  llama_fixture() {
    m.init(1);
    tessel_bench::train_step(m, batch, ++step);  // the moments exist
  }
  std::uint64_t state_bytes() { return m.params().numel() * 3 * sizeof(float); }
};
llama_fixture& llama() {
  static llama_fixture f;
  return f;
}

void BM_disk_write(benchmark::State& state) {
  const std::size_t bytes = llama().state_bytes();
  std::vector<char> buf(std::size_t(1) << 20, 1);
  const fs::path dir = bench_dir();
  fs::create_directories(dir);
  const std::string f = (dir / "raw.bin").string();
  for (auto _ : state) {
    const int fd = ::open(f.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      state.SkipWithError("cannot create the file");
      break;
    }
    for (std::size_t left = bytes; left > 0;) {
      const std::size_t n = std::min(left, buf.size());
      if (::write(fd, buf.data(), n) != ssize_t(n)) {
        state.SkipWithError("write failed");
        break;
      }
      left -= n;
    }
    ::fsync(fd);
    ::close(fd);
  }
  fs::remove(f);
  state.SetBytesProcessed(std::int64_t(state.iterations() * bytes));
}

void BM_save(benchmark::State& state) {
  auto& f = llama();
  const fs::path dir = bench_dir() / "sync";
  for (auto _ : state) dist::save_checkpoint(dir, f.m, world1(), {.step = f.step});
  std::uint64_t file = 0;
  for (const auto& e : fs::directory_iterator(dir)) file += fs::file_size(e.path());
  state.SetBytesProcessed(std::int64_t(state.iterations() * file));
  state.counters["MiB"] = double(file) / double(1 << 20);
}

void BM_load(benchmark::State& state) {
  auto& f = llama();
  const fs::path dir = bench_dir() / "sync";
  if (!fs::exists(dir / dist::checkpoint_manifest)) dist::save_checkpoint(dir, f.m, world1(), {.step = f.step});
  for (auto _ : state) benchmark::DoNotOptimize(dist::load_checkpoint(dir, f.m));
  state.SetBytesProcessed(std::int64_t(state.iterations() * f.state_bytes()));
}

void BM_step(benchmark::State& state) {
  auto& f = llama();
  const int mode = int(state.range(0));
  dist::checkpointer ck({.incremental = mode == 2});
  const fs::path root = bench_dir() / ("steps" + std::to_string(mode));
  double staged = 0;
  std::size_t saves = 0, timed = 0;
  dist::checkpoint_future last;
  if (mode != 0)  // untimed: the first saves allocate their staging stores (reused from then on)
    for (int w = 0; w < 2; ++w) last = ck.save(root / std::to_string(saves++), f.m, world1(), {.step = f.step});
  if (last.valid()) last.wait();
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    tessel_bench::train_step(f.m, f.batch, ++f.step);
    if (mode == 0) continue;
    const auto t0 = std::chrono::steady_clock::now();
    last = ck.save(root / std::to_string(saves++), f.m, world1(), {.step = f.step});  // a directory each: a delta's chain is kept
    staged += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++timed;
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (last.valid()) last.wait();
  if (timed > 0) {
    state.counters["stage_ms"] = 1e3 * staged / double(timed);
    state.counters["stall"] = staged / elapsed;  // the share of the steps' time save() blocked
  }
  std::error_code ec;
  fs::remove_all(root, ec);
}

// A recommendation-style model: an embedding table and a dense tower.
struct sparse_model {
  using device_type = host_device;
  nn::parameters<host_device> reg;
  nn::parameters<host_device>& params() { return reg; }
};

void BM_sparse_delta(benchmark::State& state) {
  const std::size_t block = std::size_t(state.range(0)), rows = 200000, dim = 64;
  host_device dev(1);
  sparse_model m{nn::parameters<host_device>(dev)};
  m.reg.add("table", {rows, dim}).sparse_row = dim;
  m.reg.add("tower", {dim, 256});
  nn::normal_rng r(3);
  for (auto& p : m.reg)
    for (std::size_t i = 0; i < p.numel; ++i) p.value.data()[i] = float(0.01 * r());
  dist::checkpointer ck({.incremental = true, .delta_block = block, .max_deltas = 1000});
  const fs::path root = bench_dir() / "sparse";
  std::uint64_t full = 0, delta = 0, step = 0, deltas = 0;
  for (auto _ : state) {
    m.reg.zero_grad();
    auto& t = m.reg.at("table");
    for (int k = 0; k < 1024; ++k) {
      const std::size_t row = std::size_t(std::fabs(r()) * 1e9) % rows;
      for (std::size_t c = 0; c < dim; ++c) t.grad.data()[row * dim + c] += float(r());
    }
    auto& w = m.reg.at("tower");
    for (std::size_t i = 0; i < w.numel; ++i) w.grad.data()[i] = float(r());
    ++step;
    nn::adamw_update(dev, m.reg, adamw_params{}, step, step_options{}, true);
    const auto rep = ck.save(root / std::to_string(step), m, world1(), {.step = step}).wait();
    (rep.delta ? delta : full) += rep.written_bytes;
    deltas += rep.delta;
    if (step > 2) fs::remove_all(root / std::to_string(step - 1));  // keep the full one and the newest delta
  }
  if (deltas > 0) state.counters["ratio"] = double(full) / (double(delta) / double(deltas));
  state.counters["delta_MiB"] = deltas ? double(delta) / double(deltas) / double(1 << 20) : 0.0;
  state.counters["full_MiB"] = double(full) / double(1 << 20);
  fs::remove_all(root);
}

}  // namespace

BENCHMARK(BM_disk_write)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);
BENCHMARK(BM_save)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);
BENCHMARK(BM_load)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);
BENCHMARK(BM_step)->Arg(0)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(4);
BENCHMARK(BM_sparse_delta)->Arg(256)->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(6);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::error_code ec;
  fs::remove_all(bench_dir(), ec);
  return 0;
}
