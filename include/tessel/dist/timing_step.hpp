// The timing-only training step: one optimizer step of a layout on the emulated cluster, every card
// running its rank's schedule without computing. Kernels are charged to the card's clock at their
// roofline cost (emu::card::charge: the same cost the card charges a real launch), and every
// message moves its byte count through the fabric model (timing-only transfers), so a 100B-class
// model on hundreds of cards simulates in seconds on this machine. It is the planner's proof: the
// planner (dist/planner.hpp) predicts from closed forms what this step measures by running the
// schedule on the emulator, with contention, latencies and the schedule's real dependencies.
//
// What runs on each card, in order (the same structure the model-parallel layers run):
//   - the process groups of the layout (dist::process_groups: tp, dp, pp, ep, edp communicators);
//   - the pipeline's 1F1B schedule (dist::one_f_one_b, the function dist::pipeline runs), with
//     each micro-batch's forward and backward as the planner's kernel lists (one place:
//     plan_detail::pricer::kernels) and the layer's collectives on the tp and ep groups between
//     them (all-reduce, or all-gather and reduce-scatter with sequence parallelism; MoE dispatch
//     and combine all-to-alls);
//   - the data-parallel gradient traffic of the ZeRO stage on the dp group (experts on edp), the
//     optimizer step's kernel.
// 1F1B is the schedule simulated (the one dist/ runs); interleaved and ZB-H1 layouts are rejected.
#pragma once

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include <tessel/collectives/communicator.hpp>
#include <tessel/collectives/transport/emulated.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/dist/groups.hpp>
#include <tessel/dist/pipeline.hpp>
#include <tessel/dist/planner.hpp>
#include <tessel/emulator/cluster.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

struct timing_step_result {
  double step_time = 0;          // simulated seconds: the last card's clock at the end of the step
  std::vector<double> card_end;  // each rank's clock at the end
  double compute_busy = 0;       // mean over cards of the seconds spent in kernels
  emu::cluster_report report;    // the fabric's and cards' counters
};

// Runs one step of layout `l` for request `r` on the cluster `r.cluster` (timing-only, whatever
// its flag says). Throws dist_error(errc::config) for a layout the planner rejects and
// dist_error(errc::unsupported) for a schedule other than 1F1B.
inline timing_step_result timing_step(const plan_request& r, const plan_layout& l) {
  if (auto why = plan_check(r, l)) throw dist_error(errc::config, "timing step " + l.to_string() + ": " + why->reason);
  if (l.schedule != pipeline_schedule::one_f_one_b)
    throw dist_error(errc::unsupported, "timing step " + l.to_string() + ": only the 1F1B schedule is simulated");
  if (l.zero == 3) throw dist_error(errc::unsupported, "timing step " + l.to_string() + ": ZeRO-3's per-micro-batch gathers are not simulated");
  emu::cluster_config cfg = r.cluster;
  cfg.timing_only = true;
  cfg.trace = false;
  cfg.faults.op_timeout = 1e6;  // a stage may wait for seconds of simulated compute upstream
  const std::size_t cards = r.cards ? r.cards : cfg.cards();
  emu::cluster cl(cfg, 1);
  std::vector<std::size_t> ids(cards);
  std::iota(ids.begin(), ids.end(), std::size_t{0});

  plan_detail::pricer pr(r);
  const auto& c = r.model;
  const std::size_t b = l.micro_batch, m = l.micro_batches, P = std::size_t(l.pp);
  const auto lk = pr.kernels(l, b);
  const auto head = pr.head_kernels(l, b), emb = pr.embedding_kernels(l, b);
  const double T = double(b) * double(r.seq), h = double(c.hidden_size), e = r.precision.act_bytes;
  const double t = double(l.tp);
  const std::size_t rows_elems = std::size_t(T * h * e / 2);  // a stage's rows as BF16 elements
  const std::size_t stream_floats = std::size_t(T * h * e / 4 / (l.sp ? t : 1.0));

  timing_step_result res;
  res.card_end.assign(cards, 0.0);
  std::vector<double> busy(cards, 0.0);
  std::mutex mu;
  emulated_world(cl, ids).run([&](emulated_transport tr) {
    const std::size_t rank = std::size_t(tr.rank());
    emu::card& card = cl[tr.card()];
    comm_options co;
    co.segment_bytes = std::size_t{64} << 20;  // fewer, larger messages simulate faster; direct steps lose nothing
    process_groups g(std::move(tr), parallel_layout{.dp = l.dp, .tp = l.tp, .pp = l.pp, .ep = l.ep, .zero_stage = 0}, co);
    const int s = g.coords().pp;
    const auto share = pr.stage(l, std::size_t(s));
    const std::size_t nl = share.layers;
    double kernels = 0;
    auto charge = [&](const plan_detail::kernel_list& k) {
      for (const auto& kc : k) {
        card.charge(kc);
        kernels += emu::roofline_time(cfg.card, kc);
      }
    };
    auto tp_collective = [&] {
      if (l.tp <= 1) return;
      if (l.sp) {
        g.tp().all_gather(nullptr, nullptr, rows_elems / std::size_t(l.tp), dtype::bf16);
        g.tp().reduce_scatter(nullptr, nullptr, rows_elems / std::size_t(l.tp), dtype::bf16, reduce_op::sum);
      } else {
        g.tp().all_reduce(nullptr, nullptr, rows_elems, dtype::bf16, reduce_op::sum);
      }
    };
    auto all_to_all = [&] {
      if (l.ep > 1) g.ep().all_to_all(nullptr, nullptr, std::size_t(lk.dispatch_bytes / 2) / std::size_t(l.ep), dtype::bf16);
    };
    auto layer_forward = [&] {
      charge(lk.attn_fwd);
      tp_collective();
      if (lk.moe) {
        all_to_all();
        charge(lk.mlp_fwd);
        all_to_all();
      } else {
        charge(lk.mlp_fwd);
        tp_collective();
      }
    };
    auto head_collectives = [&] {
      if (l.tp <= 1) return;
      for (int i = 0; i < 3; ++i) g.tp().all_reduce(nullptr, nullptr, std::size_t(T), dtype::f32, reduce_op::sum);
      if (l.sp) {
        for (int i = 0; i < 2; ++i) g.tp().all_gather(nullptr, nullptr, rows_elems / std::size_t(l.tp), dtype::bf16);
      } else {
        g.tp().all_reduce(nullptr, nullptr, rows_elems, dtype::bf16, reduce_op::sum);
      }
    };
    auto embedding_collective = [&] {
      if (l.tp <= 1) return;
      if (l.sp)
        g.tp().reduce_scatter(nullptr, nullptr, rows_elems / std::size_t(l.tp), dtype::bf16, reduce_op::sum);
      else
        g.tp().all_reduce(nullptr, nullptr, rows_elems, dtype::bf16, reduce_op::sum);
    };
    auto forward = [&](std::size_t) {
      if (s == 0) {
        charge(emb.fwd);
        embedding_collective();
      }
      for (std::size_t i = 0; i < nl; ++i) layer_forward();
      if (std::size_t(s) == P - 1) {
        charge(head.fwd);
        head_collectives();
      }
    };
    auto backward = [&](std::size_t) {
      if (std::size_t(s) == P - 1) charge(head.bwd);
      for (std::size_t i = 0; i < nl; ++i) {
        if (l.recompute == recompute_mode::full) {
          layer_forward();  // the recomputed forward, with its collectives
        } else {
          charge(lk.recompute);
        }
        if (lk.moe) {
          all_to_all();
          charge(lk.mlp_bwd);
          all_to_all();
        } else {
          charge(lk.mlp_bwd);
          tp_collective();
        }
        charge(lk.attn_bwd);
        tp_collective();
      }
      if (s == 0) charge(emb.bwd);
    };
    const int p = int(P);
    one_f_one_b(&g.pp(), p, s, m,
                one_f_one_b_hooks{
                    .forward = forward,
                    .backward = backward,
                    .input =
                        [&](std::size_t) {
                          return stream_slot{nullptr, s > 0 ? stream_floats : 0};
                        },
                    .output =
                        [&] {
                          return stream_view{nullptr, s + 1 < p ? stream_floats : 0};
                        },
                    .output_grad =
                        [&] {
                          return stream_slot{nullptr, s + 1 < p ? stream_floats : 0};
                        },
                    .input_grad =
                        [&] {
                          return stream_view{nullptr, s > 0 ? stream_floats : 0};
                        },
                });
    // data-parallel gradient traffic of this stage's parameters (per card), then the optimizer
    const double wire = plan_detail::wire_bytes(l.compression, r.precision.grad_bytes);
    auto reduce = [&](communicator& grp, double params) {
      if (grp.size() <= 1 || params <= 0) return;
      const std::size_t n = std::size_t(grp.size());
      const std::size_t grad_bytes = std::size_t(params * wire) / (4 * n) * (4 * n);
      const std::size_t weight_bytes = std::size_t(params * r.precision.param_bytes) / (4 * n) * (4 * n);
      switch (l.zero) {
        case 0: grp.all_reduce(nullptr, nullptr, grad_bytes / 4, dtype::f32, reduce_op::sum); break;
        case 1:
          grp.reduce_scatter(nullptr, nullptr, grad_bytes / 4 / n, dtype::f32, reduce_op::sum);
          grp.all_gather(nullptr, nullptr, weight_bytes / 4 / n, dtype::f32);
          break;
        case 2:
          for (std::size_t i = 0; i < m; ++i) grp.reduce_scatter(nullptr, nullptr, grad_bytes / 4 / n, dtype::f32, reduce_op::sum);
          grp.all_gather(nullptr, nullptr, weight_bytes / 4 / n, dtype::f32);
          break;
        default:
          for (std::size_t i = 0; i < m; ++i) grp.reduce_scatter(nullptr, nullptr, grad_bytes / 4 / n, dtype::f32, reduce_op::sum);
          break;
      }
    };
    reduce(g.dp(), share.dense);
    reduce(g.edp(), share.experts);
    if (l.compression != wire_format::none) charge({pr.compression_kernel(share)});
    charge({pr.optimizer_kernel(l, share)});
    std::lock_guard lk2(mu);
    res.card_end[rank] = card.clock();
    busy[rank] = kernels;
  });
  res.step_time = *std::max_element(res.card_end.begin(), res.card_end.end());
  res.compute_busy = std::accumulate(busy.begin(), busy.end(), 0.0) / double(cards);
  res.report = cl.report();
  return res;
}

}  // namespace dist
}  // namespace v0
}  // namespace tessel
