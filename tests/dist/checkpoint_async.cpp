// Asynchronous and incremental checkpoints (tessel/dist/checkpoint.hpp: checkpointer).
//  * An asynchronous save holds the state of the moment save() was called, though the model
//    changes while it is written: its files are byte for byte those of a synchronous save at the
//    same moment.
//  * Incremental saves: every checkpoint of a chain of deltas loads back to the state of its step
//    byte for byte; a delta writes only the blocks that changed; max_deltas bounds the chain; a
//    save after a failed one is full.
//  * Tiers save at their intervals and keep their newest durable checkpoints and the bases those
//    need; restorable_checkpoints lists what is on disk, newest first; resume loads the newest that
//    loads on every rank.
//  * Staging copies every piece whole, on several threads for a large state, into a reused store.
//  * A sparse model (an embedding table stepped with lazy rows): a delta is at least 6x smaller
//    than a full checkpoint.
//  * A missing base, a chain that loops and a bad option are typed errors naming them.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include <unistd.h>

#include <tessel/collectives.hpp>
#include <tessel/collectives/transport/emulated.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/dist.hpp>
#include <tessel/nn.hpp>

#include "error_match.hpp"
#include "dist/layout_run.hpp"
#include "dist/thread_check.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_dist_checkpoint_async {

using namespace tessel;
using tessel_test::is_error;
namespace fs = std::filesystem;

namespace {

fs::path tmp_dir(const std::string& tag) { return fs::temp_directory_path() / ("dist_ckpt_async_" + tag + "_" + std::to_string(::getpid())); }

std::string file_bytes(const fs::path& f) {
  std::ifstream in(f, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

using tensors = std::map<std::string, std::vector<float>>;

// A checkpoint gathered onto one device, by name (its values and moments).
tensors gather(const fs::path& dir) { return tessel_test::checkpoint_gathered(dir); }
bool same(const tensors& a, const tensors& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, v] : a) {
    const auto it = b.find(k);
    if (it == b.end() || it->second.size() != v.size() || std::memcmp(v.data(), it->second.data(), v.size() * sizeof(float)) != 0) return false;
  }
  return true;
}

// Trains a tiny Llama on dp x tp (ZeRO `zero`) for `steps` steps, calling at(step, dp, world)
// after each; on threads, or on the emulated cluster.
template <class At>
void train(int dp_n, int tp_n, int zero, std::size_t steps, bool lazy, At&& at, bool emulated = false) {
  const fs::path init = tessel_test::layout_run_checkpoint();
  auto rank = [&](auto t) {
    dist::process_groups grp(std::move(t), {.dp = dp_n, .tp = tp_n, .zero_stage = zero});
    host_device dv(1);
    dist::tp_decoder_lm<host_device> m(dv, tessel_test::layout_run_llama(), grp.tp());
    dist::pipeline pipe(m, {.micro_batches = 1});
    dist::data_parallel dp(pipe, grp.dp(), {.bucket_bytes = 4 << 10, .zero_stage = zero});
    nn::load_options lo;
    lo.allow_unexpected = true;
    m.load(init, lo);
    nn::adamw_config h;
    h.hyper.lr = 1e-3f;
    h.lazy_rows = lazy;
    constexpr std::size_t B = 4, S = 6;
    const std::size_t b = B / std::size_t(dp_n), off = std::size_t(grp.coords().dp) * b * S;
    for (std::size_t step = 1; step <= steps; ++step) {
      // few tokens per step: most embedding rows are unused (lazy rows leave them as they were)
      auto data = tessel_test::make_batch(200 + step, B, S, 7);
      dp.forward_backward(std::span(data.ids).subspan(off, b * S), std::span(data.targets).subspan(off, b * S), b, S);
      dp.adamw(h, step);
      at(step, dp, grp.world());
    }
  };
  if (emulated)
    emulated_world::run_default(dp_n * tp_n, rank, false);
  else
    threads_world::run(dp_n * tp_n, rank);
}

// A recommendation-style model: a 20000 x 32 table whose rows a step looks up, and a small dense
// tower.
struct sparse_model {
  using device_type = host_device;
  explicit sparse_model(host_device& d) : reg(d) {
    auto& t = reg.add("table", {20000, 32});
    t.sparse_row = 32;
    reg.add("tower", {32, 64});
    nn::normal_rng r(5);
    for (auto& p : reg)
      for (std::size_t i = 0; i < p.numel; ++i) p.value.data()[i] = float(0.1 * r());
  }
  nn::parameters<host_device>& params() { return reg; }
  nn::parameters<host_device> reg;
};

}  // namespace

TEST_CASE("an asynchronous save writes the state of the moment it was called, byte for byte as a synchronous save", "[dist][checkpoint]") {
  // (the emulated cluster: the save's agreement runs over the fabric, and the layouts train to the
  // same bits as on threads, so the files match the threads' synchronous save too)
  for (const auto& layout : {std::tuple{2, 1, 1, false}, std::tuple{1, 2, 0, false}, std::tuple{2, 1, 1, true}}) {
    // (not a structured binding: Clang 14 cannot capture one in the lambdas below)
    const int dp_n = std::get<0>(layout), tp_n = std::get<1>(layout), zero = std::get<2>(layout);
    const bool emulated = std::get<3>(layout);
    INFO("dp " << dp_n << " x tp " << tp_n << ", ZeRO-" << zero << (emulated ? ", emulated cluster" : ", threads"));
    const fs::path sync = tmp_dir("sync" + std::to_string(dp_n) + std::to_string(tp_n) + std::to_string(zero)), async = tmp_dir("async");
    std::mutex mu;
    std::vector<dist::save_report> reports;
    std::vector<dist::checkpointer> cks(std::size_t(dp_n * tp_n));  // one per rank
    train(
        dp_n, tp_n, zero, 2, false,
        [&](std::size_t step, auto& dp, communicator& world) {
          if (step != 2) return;
          const dist::checkpoint_state st{.step = step, .extra = {{"loader", "at 2"}}};
          if (!emulated) dist::save_checkpoint(sync, dp, world, st);
          auto& ck = cks[std::size_t(world.rank())];
          auto f = ck.save(async, dp, world, st);  // returns once staged
          // the model changes while the save is written: every value and moment
          const float nan = std::numeric_limits<float>::quiet_NaN();
          for (auto& p : dp.model().params()) {
            std::fill(p.value.data(), p.value.data() + p.numel, nan);
            if (p.m.size() == p.numel) std::fill(p.m.data(), p.m.data() + p.numel, nan), std::fill(p.v.data(), p.v.data() + p.numel, nan);
          }
          if (dp.zero_stage() == 1) {
            const auto mv = dp.shard_moments();
            std::fill(mv.first.begin(), mv.first.end(), nan), std::fill(mv.second.begin(), mv.second.end(), nan);
          }
          const auto r = f.wait();
          TS_CHECK(f.durable());
          std::lock_guard lk(mu);
          reports.push_back(r);
        },
        emulated);
    REQUIRE(reports.size() == std::size_t(dp_n * tp_n));
    for (const auto& r : reports) {
      CHECK_FALSE(r.delta);
      CHECK(r.staged_bytes > 0);
      CHECK(r.written_bytes > r.staged_bytes);  // the data plus the header
    }
    for (int w = 0; w < dp_n * tp_n; ++w) {
      const std::string f = dist::ckpt::rank_file(w);
      CHECK(file_bytes(sync / f) == file_bytes(async / f));
      CHECK_FALSE(fs::exists(async / dist::ckpt::done_file(w)));  // the markers are gone
    }
    CHECK(file_bytes(sync / dist::checkpoint_manifest) == file_bytes(async / dist::checkpoint_manifest));
    fs::remove_all(async);
  }
  for (const char* t : {"sync211", "sync120"}) fs::remove_all(tmp_dir(t));
  tessel_test::layout_run_cleanup();
}

TEST_CASE("staging copies every piece whole, on several threads and into a reused store", "[dist][checkpoint]") {
  // 40 MiB in pieces of odd lengths (the copy's threads split the store inside pieces)
  std::vector<std::vector<float>> src;
  std::vector<dist::ckpt::out_piece> pieces;
  for (std::size_t i = 0, left = 10u << 20; left > 0; ++i) {
    const std::size_t n = std::min(left, 1 + (i * 7919 + 12345) % 3000001);
    src.emplace_back(n);
    for (std::size_t k = 0; k < n; ++k) src.back()[k] = float(i) + float(k) * 1e-7f;
    dist::ckpt::out_piece p;
    p.param = "p" + std::to_string(i), p.kind = "value", p.first = 0, p.last = n, p.data = src.back().data();
    pieces.push_back(p);
    left -= n;
  }
  auto check = [&](const dist::ckpt::snapshot& s) {
    std::size_t bad = 0;
    for (std::size_t i = 0; i < src.size(); ++i) bad += std::memcmp(s.pieces[i].data, src[i].data(), src[i].size() * sizeof(float)) != 0;
    return bad;
  };
  auto a = dist::ckpt::stage(pieces, true);
  CHECK(a->elements == 10u << 20);
  CHECK(check(*a) == 0);
  const float* store = a->store.get();
  for (auto& v : src) std::reverse(v.begin(), v.end());
  auto b = dist::ckpt::stage(pieces, true, std::move(a));  // nobody else holds a: its store is reused
  CHECK(b->store.get() == store);
  CHECK(check(*b) == 0);
  auto held = b;
  auto c = dist::ckpt::stage(pieces, true, b);  // b is held elsewhere: a new store
  CHECK(c->store.get() != store);
  CHECK(check(*c) == 0);
}

TEST_CASE("incremental saves: every checkpoint of a chain of deltas loads back byte for byte", "[dist][checkpoint]") {
  const fs::path root = tmp_dir("chain");
  fs::create_directories(root);
  constexpr std::size_t steps = 6;
  std::mutex mu;
  std::map<std::size_t, std::vector<dist::save_report>> reports;
  std::vector<dist::checkpointer> cks;
  for (int w = 0; w < 4; ++w) cks.emplace_back(dist::checkpointer_options{.incremental = true, .delta_block = 64, .max_deltas = 3});
  train(2, 2, 0, steps, true, [&](std::size_t step, auto& dp, communicator& world) {
    const std::string s = std::to_string(step);
    dist::save_checkpoint(root / ("full-" + s), dp, world, {.step = step});
    const auto r = cks[std::size_t(world.rank())].save(root / ("inc-" + s), dp, world, {.step = step}).wait();
    std::lock_guard lk(mu);
    reports[step].push_back(r);
  });
  for (std::size_t step = 1; step <= steps; ++step) {
    INFO("step " << step);
    const std::string s = std::to_string(step);
    const bool delta = step != 1 && step != 5;  // full, 3 deltas, full (max_deltas), delta
    std::uint64_t full = 0, written = 0;
    for (const auto& r : reports[step]) {
      CHECK(r.delta == delta);
      written += r.written_bytes;
    }
    for (int w = 0; w < 4; ++w) full += fs::file_size(root / ("full-" + s) / dist::ckpt::rank_file(w));
    if (delta)
      CHECK(written < full);
    else
      CHECK(written == full);
    const auto a = gather(root / ("full-" + s)), b = gather(root / ("inc-" + s));
    CHECK(same(a, b));
  }
  // a delta's base gone: a typed error naming it
  fs::remove_all(root / "inc-3");
  CHECK_THROWS_MATCHES(gather(root / "inc-4"), dist::dist_error, is_error(errc::io, "dist", "inc-3/checkpoint.json"));
  CHECK_NOTHROW(gather(root / "inc-5"));  // full: needs no base
  fs::remove_all(root);
  tessel_test::layout_run_cleanup();
}

TEST_CASE("checkpointer errors: a loop of bases, a bad option, and a failed save that is no delta's base", "[dist][checkpoint][errors]") {
  const fs::path root = tmp_dir("err");
  fs::create_directories(root);
  CHECK_THROWS_MATCHES(dist::checkpointer(dist::checkpointer_options{.delta_block = 0}), dist::dist_error,
                       is_error(errc::invalid_argument, "dist", "delta_block must be > 0"));
  std::ofstream(root / "blocker") << "a file where a checkpoint's directory would go";
  fs::create_directories(root / "s2" / dist::ckpt::rank_file(0));  // a directory where rank 0's file would go
  std::vector<bool> deltas;
  dist::checkpointer ck({.incremental = true});
  train(1, 1, 0, 7, true, [&](std::size_t step, auto& dp, communicator& world) {
    const std::size_t at[] = {0, 1, 2, 3, 3, 5, 1, 3};  // the directory of each step
    const fs::path dir = root / ("s" + std::to_string(at[step]));
    if (step == 2) {
      auto f = ck.save(dir, dp, world);  // staged, then the write fails in the background
      CHECK_THROWS_MATCHES(f.wait(), io::io_error, is_error(errc::io, "io", "cannot rename"));
      CHECK_FALSE(f.durable());
      CHECK_THROWS_MATCHES(ck.save(root / "blocker" / "x", dp, world), dist::dist_error, is_error(errc::io, "dist", "cannot create"));
      return;
    }
    deltas.push_back(ck.save(dir, dp, world).wait().delta);
  });
  // s1 full; s3 full (the save before it failed); s3 again, full (it is in the chain: a delta would
  // be on itself); s5 a delta on s3; s1 a delta on s5 (not in the chain s3, s5); s3 again, full (in
  // the chain s3, s5, s1)
  CHECK(deltas == std::vector<bool>{false, false, false, true, true, false});
  CHECK_NOTHROW(gather(root / "s3"));
  // s5 and s1 are deltas on the s3 that the last save rewrote: refused, not loaded onto other bits
  CHECK_THROWS_MATCHES(gather(root / "s5"), dist::dist_error, is_error(errc::format, "dist", "s3/checkpoint.json was rewritten after a delta"));
  CHECK_THROWS_MATCHES(gather(root / "s1"), dist::dist_error, is_error(errc::format, "dist", "was rewritten after a delta"));
  // a manifest whose base is itself
  {
    const fs::path m = root / "s3" / dist::checkpoint_manifest;
    auto j = nlohmann::json::parse(file_bytes(m));
    j["base"] = "../s3";
    j["base_hash"] = "0123456789abcdef";
    std::ofstream(m) << j.dump();
  }
  CHECK_THROWS_MATCHES(gather(root / "s3"), dist::dist_error, is_error(errc::format, "dist", "returns to"));
  // a rank that cannot prepare: it throws its own error, the other one naming it (neither waits)
  std::vector<std::string> what(2);
  train(2, 1, 0, 1, false, [&](std::size_t, auto& dp, communicator& world) {
    const std::size_t w = std::size_t(world.rank());
    dist::checkpointer c;
    try {
      c.save(w == 0 ? root / "ok" : root / "blocker" / "x", dp, world).wait();
    } catch (const dist::dist_error& e) { what[w] = e.what(); }
  });
  CHECK_THAT(what[0], Catch::Contains("rank 1 cannot prepare"));
  CHECK_THAT(what[1], Catch::Contains("cannot create"));
  // a rank whose write fails in the background: rank 0 learns it from its failure marker at once
  // (not after the timeout) and names it; the failing rank has its own error
  fs::create_directories(root / "two" / dist::ckpt::rank_file(1));  // a directory where rank 1's file would go
  std::vector<std::string> late(2);
  train(2, 1, 0, 1, false, [&](std::size_t, auto& dp, communicator& world) {
    dist::checkpointer c({.timeout = std::chrono::seconds(100)});
    try {
      c.save(root / "two", dp, world).wait();
    } catch (const tessel::error& e) { late[std::size_t(world.rank())] = e.what(); }
  });
  CHECK_THAT(late[0], Catch::Contains("rank 1 could not write its file") && Catch::Contains("cannot rename"));
  CHECK_THAT(late[1], Catch::Contains("cannot rename"));
  // rank 0's write fails: the other rank learns it from checkpoint.failed instead of waiting for the manifest
  fs::create_directories(root / "three" / dist::ckpt::rank_file(0));
  train(2, 1, 0, 1, false, [&](std::size_t, auto& dp, communicator& world) {
    dist::checkpointer c({.timeout = std::chrono::seconds(100)});
    try {
      c.save(root / "three", dp, world).wait();
    } catch (const tessel::error& e) { late[std::size_t(world.rank())] = e.what(); }
  });
  CHECK_THAT(late[0], Catch::Contains("cannot rename"));
  CHECK_THAT(late[1], Catch::Contains("the save failed on another rank") && Catch::Contains("cannot rename"));
  fs::remove_all(root);
  tessel_test::layout_run_cleanup();
}

TEST_CASE("tiers: each saves at its interval, keeps its newest durable checkpoints and the bases they need", "[dist][checkpoint]") {
  const fs::path root = tmp_dir("tiers");
  const std::vector<dist::checkpoint_tier> tiers = {
      {.dir = root / "fast", .every = 1, .keep = 3, .options = {.incremental = true, .delta_block = 64, .max_deltas = 2}},
      {.dir = root / "slow", .every = 4, .keep = 2}};
  std::vector<dist::tiered_checkpointer> tc;
  for (int r = 0; r < 2; ++r) tc.emplace_back(tiers);
  std::mutex mu;
  std::vector<std::size_t> saved;
  train(2, 1, 0, 10, false, [&](std::size_t step, auto& dp, communicator& world) {
    auto& t = tc[std::size_t(world.rank())];
    const std::size_t n = t.save(step, dp, world, {.extra = {{"loader", std::to_string(step)}}});
    if (step == 10) t.wait(world);
    if (world.rank() == 0) {
      std::lock_guard lk(mu);
      saved.push_back(n);
    }
  });
  CHECK(saved == std::vector<std::size_t>{1, 1, 1, 2, 1, 1, 1, 2, 1, 1});
  auto on_disk = [&](const fs::path& d) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(d)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  // fast: full at 1, 4, 7, 10 (two deltas at most in a row); the newest 3 are 8, 9, 10, and 8 and 9
  // are deltas on 7: 7 stays
  CHECK(on_disk(root / "fast") == std::vector<std::string>{"step-000000000007", "step-000000000008", "step-000000000009", "step-000000000010"});
  CHECK(on_disk(root / "slow") == std::vector<std::string>{"step-000000000004", "step-000000000008"});
  const auto r = dist::restorable_checkpoints(tiers);
  REQUIRE(r.size() == 6);
  CHECK(r[0] == dist::tier_checkpoint_dir(tiers[0], 10));
  CHECK(r[3] == dist::tier_checkpoint_dir(tiers[1], 8));  // step 8 of both tiers: the faster tier's first
  CHECK(r[5] == dist::tier_checkpoint_dir(tiers[1], 4));
  // step 8 as a delta chain (fast) and as a full checkpoint (slow): the same state
  CHECK(same(gather(r[2]), gather(r[3])));
  for (const auto& d : r) CHECK_NOTHROW(gather(d));
  // resume: the newest that loads on every rank; one flipped byte in step 10's rank-1 file passes
  // it over on both ranks (each checks every file), and step 9 (a delta on 8 on 7) loads
  {
    std::fstream io(r[0] / dist::ckpt::rank_file(1), std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(100);
    io.put('\x7f');
  }
  std::vector<std::uint64_t> resumed(2, 0);
  std::vector<fs::path> from(2);
  std::vector<std::size_t> adopted(2);
  train(2, 1, 0, 1, false, [&](std::size_t, auto& dp, communicator& world) {
    const std::size_t w = std::size_t(world.rank());
    const auto st = dist::resume(tiers, dp, world, &from[w]);
    resumed[w] = st ? st->step : 0;
    // the restarted job's tiers keep what is on disk under their retention: after step 10 (full,
    // rewritten) and 11 (a delta on it) the fast tier holds 9, 10, 11 and the 7, 8 that 9 reads;
    // after 12 (a delta on 11), only 10, 11, 12
    dist::tiered_checkpointer again(tiers);
    for (std::uint64_t s = 10; s <= 11; ++s) again.save(s, dp, world);
    again.wait(world);
    adopted[w] = again.held(0).size();
    again.save(12, dp, world);
    again.wait(world);
  });
  CHECK(resumed == std::vector<std::uint64_t>{9, 9});
  CHECK(from[0] == r[1]);
  CHECK(from[1] == r[1]);
  CHECK(adopted == std::vector<std::size_t>{5, 5});
  CHECK(on_disk(root / "fast") == std::vector<std::string>{"step-000000000010", "step-000000000011", "step-000000000012"});
  CHECK(on_disk(root / "slow") == std::vector<std::string>{"step-000000000008", "step-000000000012"});  // keep 2: the adopted 4 went
  CHECK_THROWS_MATCHES(dist::tiered_checkpointer({}), dist::dist_error, is_error(errc::invalid_argument, "dist", "no tiers"));
  CHECK_THROWS_MATCHES(dist::tiered_checkpointer({{.dir = root, .every = 0}}), dist::dist_error,
                       is_error(errc::invalid_argument, "dist", "interval > 0"));
  CHECK_THROWS_MATCHES(dist::tiered_checkpointer({{.dir = root / "a"}, {.dir = root / "x" / ".." / "a"}}), dist::dist_error,
                       is_error(errc::invalid_argument, "dist", "tiers 0 and 1 share"));
  fs::remove_all(root);
  tessel_test::layout_run_cleanup();
}

TEST_CASE("a sparse model's deltas: an embedding table stepped with lazy rows writes at least 6x fewer bytes", "[dist][checkpoint]") {
  // Each step's 64 lookups touch at most 64 rows of sparse_model's table; the gradient is what the
  // lookups' backward leaves (non-zero on the rows looked up only), stepped by AdamW with lazy rows.
  const fs::path root = tmp_dir("sparse");
  host_device dev(1);
  sparse_model m(dev);
  nn::normal_rng r(9);
  std::vector<dist::save_report> reports;
  std::uint64_t first_full = 0;
  threads_world::run(1, [&](threads_transport tr) {
    communicator world(std::move(tr));
    dist::checkpointer ck({.incremental = true, .max_deltas = 100});
    for (std::uint64_t step = 1; step <= 5; ++step) {
      m.reg.zero_grad();
      auto& t = m.reg.at("table");
      for (int k = 0; k < 64; ++k) {
        const std::size_t row = std::size_t(std::fabs(r()) * 1e6) % 20000;
        for (std::size_t c = 0; c < 32; ++c) t.grad.data()[row * 32 + c] += float(r());
      }
      auto& w = m.reg.at("tower");
      for (std::size_t i = 0; i < w.numel; ++i) w.grad.data()[i] = float(r());
      step_options so;
      nn::adamw_update(dev, m.reg, adamw_params{}, step, so, true);
      reports.push_back(ck.save(root / ("s" + std::to_string(step)), m, world, {.step = step}).wait());
    }
    first_full = reports[0].written_bytes;
  });
  for (std::size_t i = 1; i < reports.size(); ++i) {
    INFO("save " << i + 1 << ": " << reports[i].written_bytes << " bytes against " << first_full);
    CHECK(reports[i].delta);
    CHECK(6 * reports[i].written_bytes <= first_full);
  }
  // the last delta, with its chain, is the model's state
  host_device d2(1);
  sparse_model back(d2);
  CHECK(dist::load_checkpoint(root / "s5", back).step == 5);
  for (auto& p : m.reg) {
    const auto& q = back.reg.at(p.name);
    CHECK(std::memcmp(p.value.data(), q.value.data(), p.numel * sizeof(float)) == 0);
    CHECK(std::memcmp(p.m.data(), q.m.data(), p.numel * sizeof(float)) == 0);
    CHECK(std::memcmp(p.v.data(), q.v.data(), p.numel * sizeof(float)) == 0);
  }
  fs::remove_all(root);
}

}  // namespace tessel_test_dist_checkpoint_async
