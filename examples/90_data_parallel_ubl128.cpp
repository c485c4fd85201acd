// 90_data_parallel_ubl128: the flagship. Data-parallel training on cards of an emulated UBL128
// super-node, with every layer of tessel in one program:
//
//   * each card is a tessel device: its parameters, moments and gradients live in the card's own
//     memory, and the forward/backward pass is the library's GEMM, fused GELU and fused
//     cross-entropy tile programs launched on that card (the GEMMs charge the card's simulated
//     clock with their roofline cost);
//   * the gradients are averaged by an all-reduce of the collectives layer over the emulated
//     fabric (8 ports per card, 8 switch planes), deterministic, so every replica stays bitwise
//     identical, which the program checks at the end;
//   * each card applies one fused multi-tensor AdamW step (bf16 parameters + f32 master weights);
//   * the emulator reports simulated time, link utilization and the bottleneck, and writes a
//     Chrome trace (open it in Perfetto: ui.perfetto.dev, "Open trace file").
//
//   ./90_data_parallel_ubl128 [cards=8] [steps=60] [trace=flagship_trace.json]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/collectives/transport/emulated.hpp>
#include <tessel/emulator.hpp>
#include <tessel/ops/activation.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/loss.hpp>
#include <tessel/ops/optim.hpp>

#include "example_args.hpp"

using namespace tessel;

namespace {

constexpr std::size_t D = 64, H = 256, C = 10;  // model: D -> H (GELU) -> C
constexpr std::size_t B = 64;                   // rows per card per step
constexpr std::size_t N = 16384;                // training set

struct dataset {
  std::vector<float> x;              // (N, D)
  std::vector<std::int64_t> labels;  // N: the argmax of a random linear teacher
};

dataset make_task() {
  dataset t{std::vector<float>(N * D), std::vector<std::int64_t>(N)};
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> teacher(D * C);
  for (auto& w : teacher) w = nd(rng);
  for (auto& v : t.x) v = nd(rng);
  for (std::size_t i = 0; i < N; ++i) {
    std::size_t best = 0;
    float bv = -1e30f;
    for (std::size_t c = 0; c < C; ++c) {
      float s = 0;
      for (std::size_t d = 0; d < D; ++d) s += t.x[i * D + d] * teacher[d * C + c];
      if (s > bv) bv = s, best = c;
    }
    t.labels[i] = std::int64_t(best);
  }
  return t;
}

struct replica_result {
  std::vector<float> w1, w2;   // final master weights, to compare across cards
  std::vector<double> losses;  // global mean loss per step (rank 0 prints it)
  double compute_s = 0, comm_s = 0;
};

// One card's whole training run; `comm` connects it to the other cards.
replica_result train_on_card(emu::card& card, communicator& comm, const dataset& t, int steps) {
  const std::size_t rank = static_cast<std::size_t>(comm.rank()), cards = static_cast<std::size_t>(comm.size());
  // The same seed on every card: replicas start identical.
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  // Arrays in the card's memory (the card enforces its capacity and counts what is allocated).
  using f32s = device_buffer<float, emu::card>;
  using bf16s = device_buffer<bf16, emu::card>;
  f32s w1(card, D * H, 0.0f), w2(card, H * C, 0.0f), g1(card, D * H, 0.0f), g2(card, H * C, 0.0f);
  f32s m1(card, D * H, 0.0f), v1(card, D * H, 0.0f), m2(card, H * C, 0.0f), v2(card, H * C, 0.0f);
  bf16s w1b(card, D * H, bf16{}), w2b(card, H * C, bf16{}), xb(card, B * D, bf16{}), hb(card, B * H, bf16{});
  bf16s dlog(card, B * C, bf16{}), dpre(card, B * H, bf16{});
  f32s pre(card, B * H, 0.0f), logits(card, B * C, 0.0f), dh(card, B * H, 0.0f);
  for (std::size_t i = 0; i < w1.size(); ++i) w1.data()[i] = nd(rng) / std::sqrt(float(D));
  for (std::size_t i = 0; i < w2.size(); ++i) w2.data()[i] = nd(rng) / std::sqrt(float(H));
  for (std::size_t i = 0; i < w1.size(); ++i) w1b.data()[i] = bf16(w1.data()[i]);
  for (std::size_t i = 0; i < w2.size(); ++i) w2b.data()[i] = bf16(w2.data()[i]);

  adamw_params hp;
  hp.lr = 4e-3f;
  hp.weight_decay = 1e-4f;
  step_options opt;
  opt.max_grad_norm = 1.0f;
  opt.storage = param_storage::bf16_master;

  auto view = [](bf16s& a, std::size_t r, std::size_t c) { return tensor<const bf16, 2>(a.data(), r, c); };
  replica_result res;
  for (int step = 1; step <= steps; ++step) {
    // This card's shard of the global batch.
    const std::size_t off = ((std::size_t(step - 1) * cards + rank) * B) % N;
    for (std::size_t i = 0; i < B * D; ++i) xb.data()[i] = bf16(t.x[off * D + i]);
    const std::span<const std::int64_t> labels(t.labels.data() + off, B);

    const double t0 = card.clock();
    // forward: pre = x W1, h = gelu(pre), logits = h W2; loss and d(logits) in one fused pass
    gemm(card, view(xb, B, D), view(w1b, D, H), tensor<float, 2>(pre.data(), B, H));
    gelu_forward(card, pre.cspan(), hb.span());
    gemm(card, view(hb, B, H), view(w2b, H, C), tensor<float, 2>(logits.data(), B, C));
    const double loss = cross_entropy(card, tensor<const float, 2>(logits.data(), B, C), labels, tensor<bf16, 2>(dlog.data(), B, C)).loss;
    // backward: dW2 = h^T dlogits, dh = dlogits W2^T, dpre = dh * gelu'(pre), dW1 = x^T dpre
    gemm(card, view(hb, B, H).transposed(), view(dlog, B, C), tensor<float, 2>(g2.data(), H, C));
    gemm(card, view(dlog, B, C), view(w2b, H, C).transposed(), tensor<float, 2>(dh.data(), B, H));
    gelu_backward(card, dh.cspan(), pre.cspan(), dpre.span());
    gemm(card, view(xb, B, D).transposed(), view(dpre, B, H), tensor<float, 2>(g1.data(), D, H));
    const double t1 = card.clock();

    // Data parallelism: average the gradients (and the loss, for printing) over all cards.
    comm.all_reduce(std::span<const float>(g1.data(), g1.size()), g1.span(), reduce_op::avg);
    comm.all_reduce(std::span<const float>(g2.data(), g2.size()), g2.span(), reduce_op::avg);
    double global_loss = 0;
    comm.all_reduce(std::span<const double>(&loss, 1), std::span<double>(&global_loss, 1), reduce_op::avg);
    const double t2 = card.clock();

    std::vector<optim_tensor<float, float>> ts(2);
    ts[0].grad = g1.cspan();
    ts[0].m = m1.span();
    ts[0].v = v1.span();
    ts[0].param_bf16 = w1b.span();
    ts[0].master = w1.span();
    ts[1].grad = g2.cspan();
    ts[1].m = m2.span();
    ts[1].v = v2.span();
    ts[1].param_bf16 = w2b.span();
    ts[1].master = w2.span();
    adamw_step(card, std::span<const optim_tensor<float, float>>(ts), hp, std::uint64_t(step), opt);

    res.losses.push_back(global_loss);
    res.compute_s += (t1 - t0) + (card.clock() - t2);
    res.comm_s += t2 - t1;
  }
  res.w1.assign(w1.data(), w1.data() + w1.size());
  res.w2.assign(w2.data(), w2.data() + w2.size());
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  const example_args::positional args(argc, argv, "[cards 1..128] [steps 1..1000000] [trace.json]", 3);
  const auto cards = std::size_t(args.integer(1, "cards", 1, 128, 8));
  const int steps = int(args.integer(2, "steps", 1, 1000000, 60));
  const std::string trace_path = args.output(3, "trace", "flagship_trace.json");

  emu::cluster_config cfg;  // UBL128 figures: 8 ports x 50 GB/s per card, 8 planes, 400 TFLOP/s bf16
  cfg.cards_per_supernode = cards;
  cfg.card.memory_bytes = std::size_t{256} << 20;  // small cards: the model needs a few MiB
  cfg.trace = true;                                // record the timeline for Perfetto
  emu::cluster cluster(cfg);
  const dataset task = make_task();

  std::printf("tessel flagship: data-parallel MLP %zu-%zu-%zu on %zu emulated UBL128 cards\n", D, H, C, cards);
  std::printf("  per card: %zu rows/step, bf16 GEMMs + fused GELU + fused cross-entropy, AdamW (bf16 + f32 master)\n", B);
  std::printf("  gradients: all-reduce (avg) over the emulated fabric, %zu planes x %.0f GB/s per card and plane\n", cfg.fabric.planes,
              cfg.link_bandwidth() / 1e9);

  std::vector<replica_result> results(cards);
  emulated_world(cluster).run([&](emulated_transport tp) {
    communicator comm(std::move(tp));
    const std::size_t r = static_cast<std::size_t>(comm.rank());
    results[r] = train_on_card(cluster[r], comm, task, steps);
  });

  const auto& l = results[0].losses;
  for (int s = 0; s < steps; ++s)
    if (s == 0 || (s + 1) % 10 == 0 || s + 1 == steps) std::printf("  step %3d  global loss %.4f\n", s + 1, l[std::size_t(s)]);

  bool identical = true;
  for (std::size_t r = 1; r < cards; ++r) identical = identical && results[r].w1 == results[0].w1 && results[r].w2 == results[0].w2;
  std::printf("replicas bitwise identical after %d steps: %s\n", steps, identical ? "yes" : "NO");
  std::printf("simulated time per step on card 0: compute %.2f us, all-reduce %.2f us\n", results[0].compute_s / steps * 1e6,
              results[0].comm_s / steps * 1e6);
  std::printf("cluster report:\n%s\n", cluster.report().to_string().c_str());
  cluster.write_trace(trace_path);
  std::printf("Chrome trace written to %s (open in Perfetto)\n", trace_path.c_str());

  const bool learned = l.back() < 0.6 * std::log(double(C));
  if (!learned) std::printf("the loss did not fall below 0.6 ln(%zu)\n", C);
  return identical && learned ? 0 : 1;
}
