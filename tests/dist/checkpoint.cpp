// Sharded checkpoints with resharding load (tessel/dist/checkpoint.hpp): a tiny 4-layer Llama
// trained 2 AdamW steps on layout A, saved, loaded onto layout B, for every ordered pair of 7
// layouts (one device; dp 2; dp 2 ZeRO-1; tp 2; tp 2 x pp 2; dp 2 x tp 2 ZeRO-1; dp 2 x pp 2
// ZeRO-1).
//  * Loading only moves bytes: B's state, saved again and gathered onto one device, must equal A's
//    gathered state byte for byte (every parameter and both AdamW moments), and the step and the
//    caller's metadata come back.
//  * The next step on B from the loaded state: its loss equals A's own next step's bitwise when
//    B = A, and within 1e-5 relative otherwise (the layouts group the sums differently).
//  * A corrupted file, a missing manifest and a model the checkpoint does not fit are typed
//    errors naming the file or the tensor.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

#include <tessel/collectives.hpp>
#include <tessel/device/host_device.hpp>
#include <tessel/dist.hpp>
#include <tessel/nn.hpp>

#include "error_match.hpp"
#include "dist/layout_run.hpp"
#include "dist/thread_check.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_dist_checkpoint {

using namespace tessel;
using tessel_test::is_error;
namespace fs = std::filesystem;

namespace {

struct spec {
  int dp = 1, tp = 1, pp = 1, zero = 0;
  std::size_t micro = 1;
  std::string name() const {
    return "dp " + std::to_string(dp) + " x tp " + std::to_string(tp) + " x pp " + std::to_string(pp) + " ZeRO-" + std::to_string(zero);
  }
};

using tensors = std::map<std::string, std::vector<float>>;

struct phase_result {
  std::vector<double> losses;  // world rank 0's, by step
};

fs::path tmp_dir(const std::string& tag) { return fs::temp_directory_path() / ("dist_ckpt_" + tag + "_" + std::to_string(::getpid())); }

// Trains `sp` from `from` (a weights file, or a checkpoint directory when `checkpoint`) for steps
// [first, first + before), saves to `save` (if not empty) with step first + before, then trains
// `after` more steps.
phase_result phase(const spec& sp, const fs::path& from, bool checkpoint, std::size_t first, std::size_t before, const fs::path& save,
                   std::size_t after) {
  constexpr std::size_t B = 4, S = 6;
  phase_result out;
  std::mutex mu;
  threads_world::run(sp.dp * sp.tp * sp.pp, [&](threads_transport t) {
    dist::process_groups grp(std::move(t), {.dp = sp.dp, .tp = sp.tp, .pp = sp.pp, .zero_stage = sp.zero});
    host_device dv(1);
    dist::tp_decoder_lm<host_device> m(dv, tessel_test::layout_run_llama(), grp.tp(), {.pp = sp.pp > 1 ? &grp.pp() : nullptr});
    dist::pipeline pipe(m, {.micro_batches = sp.micro});
    dist::data_parallel dp(pipe, grp.dp(), {.bucket_bytes = 4 << 10, .zero_stage = sp.zero});
    std::size_t step = first;
    if (checkpoint) {
      const auto st = dist::load_checkpoint(from, dp);
      TS_CHECK(st.step == first);
      TS_CHECK(st.extra.at("loader") == "batch " + std::to_string(first));
    } else {
      nn::load_options lo;
      lo.allow_unexpected = true;
      m.load(from, lo);
    }
    nn::adamw_config h;
    h.hyper.lr = 1e-3f;
    h.hyper.weight_decay = 0.01f;
    const std::size_t b = B / std::size_t(sp.dp), off = std::size_t(grp.coords().dp) * b * S;
    std::vector<double> losses;
    auto train = [&](std::size_t n) {
      for (std::size_t i = 0; i < n; ++i, ++step) {
        const auto data = tessel_test::make_batch(100 + step, B, S, 37);
        losses.push_back(dp.forward_backward(std::span(data.ids).subspan(off, b * S), std::span(data.targets).subspan(off, b * S), b, S));
        dp.adamw(h, step + 1);
      }
    };
    train(before);
    if (!save.empty()) dist::save_checkpoint(save, dp, grp.world(), {.step = step, .extra = {{"loader", "batch " + std::to_string(step)}}});
    train(after);
    if (grp.world().rank() == 0) {
      std::lock_guard lk(mu);
      out.losses = losses;
    }
  });
  return out;
}

// A checkpoint gathered onto one device, by name (its values and moments).
tensors gather(const fs::path& dir) { return tessel_test::checkpoint_gathered(dir); }

std::size_t differing(const tensors& a, const tensors& b, std::string& first) {
  std::size_t n = 0;
  for (const auto& [k, v] : a) {
    const auto it = b.find(k);
    if (it == b.end() || it->second.size() != v.size() || std::memcmp(v.data(), it->second.data(), v.size() * sizeof(float)) != 0) {
      if (n++ == 0) first = k;
    }
  }
  return n + (a.size() != b.size() ? 1 : 0);
}

const std::vector<spec>& layouts() {
  static const std::vector<spec> l = {{},
                                      {.dp = 2},
                                      {.dp = 2, .zero = 1},
                                      {.tp = 2},
                                      {.tp = 2, .pp = 2, .micro = 2},
                                      {.dp = 2, .tp = 2, .zero = 1},
                                      {.dp = 2, .pp = 2, .zero = 1, .micro = 2}};
  return l;
}

}  // namespace

TEST_CASE("checkpoints load onto any layout: the gathered state byte for byte, the next step's loss", "[dist][checkpoint]") {
  const fs::path init = tessel_test::layout_run_checkpoint();
  struct saved {
    fs::path dir;
    tensors state;
    double next_loss;
  };
  std::vector<saved> from;
  for (std::size_t a = 0; a < layouts().size(); ++a) {
    const spec& A = layouts()[a];
    saved s;
    std::string tag = "a";
    tag += std::to_string(a);
    s.dir = tmp_dir(tag);
    const auto r = phase(A, init, false, 0, 2, s.dir, 1);
    REQUIRE(r.losses.size() == 3);
    s.next_loss = r.losses[2];
    s.state = gather(s.dir);
    std::size_t values = 0;
    for (const auto& [k, v] : s.state) values += k.rfind("value/", 0) == 0;
    CHECK(values == 3 + 4 * 9);           // embedding, final norm, head; 9 tensors per layer
    CHECK(s.state.size() == 3 * values);  // and both moments of every one
    from.push_back(std::move(s));
  }
  for (std::size_t a = 0; a < layouts().size(); ++a)
    for (std::size_t b = 0; b < layouts().size(); ++b) {
      INFO("saved on " << layouts()[a].name() << ", loaded on " << layouts()[b].name());
      std::string tag = "b";  // (appended: GCC 12's -Wrestrict misfires on "b" + std::to_string(a) here)
      tag += std::to_string(a);
      tag += '_';
      tag += std::to_string(b);
      const fs::path again = tmp_dir(tag);
      const auto r = phase(layouts()[b], from[a].dir, true, 2, 0, again, 1);
      REQUIRE(r.losses.size() == 1);
      if (a == b)
        CHECK(r.losses[0] == from[a].next_loss);
      else
        CHECK(std::fabs(r.losses[0] - from[a].next_loss) <= 1e-5 * std::fabs(from[a].next_loss));
      std::string first;
      CHECK(differing(from[a].state, gather(again), first) == 0);
      INFO("first differing tensor: " << first);
      fs::remove_all(again);
    }
  for (const auto& s : from) fs::remove_all(s.dir);
  tessel_test::layout_run_cleanup();
}

TEST_CASE("checkpoints: corrupted files, missing manifests and models they do not fit are typed errors", "[dist][checkpoint][errors]") {
  const fs::path init = tessel_test::layout_run_checkpoint();
  const fs::path dir = tmp_dir("err");
  phase({.tp = 2}, init, false, 0, 1, dir, 0);
  auto load_one = [&](const fs::path& d, io::model_config cfg) {
    threads_world::run(1, [&](threads_transport tr) {
      dist::process_groups grp(std::move(tr), {});
      host_device dv(1);
      dist::tp_decoder_lm<host_device> m(dv, cfg, grp.tp());
      dist::load_checkpoint(d, m);
    });
  };
  CHECK_NOTHROW(load_one(dir, tessel_test::layout_run_llama()));
  // a model with another vocabulary: the embedding's shape differs
  auto other = tessel_test::layout_run_llama();
  other.vocab_size = 41;
  CHECK_THROWS_MATCHES(load_one(dir, other), dist::dist_error,
                       is_error(errc::format, "dist", "'model.embed_tokens.weight' has shape [37, 64] in the checkpoint"));
  // a model with a layer more: its tensors are in no piece
  other = tessel_test::layout_run_llama();
  other.num_hidden_layers = 5;
  CHECK_THROWS_MATCHES(load_one(dir, other), dist::dist_error, is_error(errc::out_of_range, "dist", "no tensor 'model.layers.4."));
  // one flipped byte in a tensor of rank 1's file
  const fs::path f = dir / "rank-00001.safetensors";
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(-5, std::ios::end);
    char c = 0;
    io.read(&c, 1);
    c = char(c ^ 0x10);
    io.seekp(-5, std::ios::end);
    io.write(&c, 1);
  }
  CHECK_THROWS_MATCHES(load_one(dir, tessel_test::layout_run_llama()), dist::dist_error,
                       is_error(errc::format, "dist", "rank-00001.safetensors has hash"));
  fs::remove(dir / dist::checkpoint_manifest);
  CHECK_THROWS_MATCHES(load_one(dir, tessel_test::layout_run_llama()), dist::dist_error, is_error(errc::io, "dist", "no manifest"));
  fs::remove_all(dir);
  tessel_test::layout_run_cleanup();
}

}  // namespace tessel_test_dist_checkpoint
