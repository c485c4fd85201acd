// The auto-parallel planner: for a model (an nn/ config), a global batch and sequence length, and a
// cluster (the emulator's config), it enumerates layouts — dp × tp × pp × ep, micro-batch size,
// ZeRO stage, activation recompute, sequence parallelism, pipeline schedule (1F1B, interleaved,
// ZB-H1) and gradient compression — prunes those that cannot run (with the reason), prices the rest
// and ranks them by predicted step time.
//
// Prices come from the figures the emulator charges, in one place each:
//   - every kernel of a layer's forward and backward at the card's roofline (emu::roofline_time, the
//     function the emulated card's clock uses), from its FLOPs and bytes;
//   - every collective from emu::comm_model (closed forms of the communicator's algorithms on the
//     fabric model, tested against timing-only runs), with the group's placement under the layout's
//     rank order (tp fastest, then dp, then pp: dist::parallel_layout);
//   - the pipeline's bubble from its schedule: (pp − 1) slots for 1F1B, (pp − 1)/v for interleaved
//     with v virtual stages, (pp − 1)·(F + B − W) for ZB-H1 (Qi et al. 2023);
//   - memory per card in closed form: weights, gradients, optimizer state (master copy and Adam
//     moments) under ZeRO 0–3, activations per layer per micro-batch (flash attention: no s² term)
//     times the micro-batches the schedule keeps in flight, under none/selective/full recompute.
//
// Modelling choices (say what is priced, not what is hoped):
//   - communication is exposed: tensor-parallel collectives and pipeline messages sit on the
//     critical path; the data-parallel reduction follows the last backward unless
//     plan_constraints::overlap_grad_reduce (then only what exceeds the last micro-batch's
//     backward shows), as tessel's dist::data_parallel reduces after the backward today;
//   - MoE experts are split over ep and replicated over tp (as dist::tp_decoder_lm builds them);
//     tokens are routed evenly;
//   - "selective" recompute drops the MLP's intermediates (gate, up, activation: 3·I per token)
//     and recomputes them from the normed input; "full" keeps each layer's input only;
//   - each plan says whether tessel's dist/ can run it today (`built`) and why not.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <tessel/collectives/compression.hpp>
#include <tessel/device/device.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/dist/layout.hpp>
#include <tessel/emulator/card.hpp>
#include <tessel/emulator/comm_model.hpp>
#include <tessel/emulator/config.hpp>
#include <tessel/io/model_config.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

enum class recompute_mode : std::uint8_t { none, selective, full };
enum class pipeline_schedule : std::uint8_t { one_f_one_b, interleaved, zb_h1 };

inline const char* to_string(recompute_mode r) {
  switch (r) {
    case recompute_mode::none: return "none";
    case recompute_mode::selective: return "selective";
    case recompute_mode::full: return "full";
  }
  return "?";
}
inline const char* to_string(pipeline_schedule s) {
  switch (s) {
    case pipeline_schedule::one_f_one_b: return "1f1b";
    case pipeline_schedule::interleaved: return "interleaved";
    case pipeline_schedule::zb_h1: return "zb-h1";
  }
  return "?";
}

// Bytes per element of each kind of state (mixed precision by default: BF16 weights and
// activations, FP32 gradients, FP32 master weights, two FP32 Adam moments).
struct plan_precision {
  double param_bytes = 2;
  double grad_bytes = 4;
  double master_bytes = 4;  // 0: no master copy (the weights are the master)
  double moment_bytes = 8;
  double act_bytes = 2;
  math_precision math = math_precision::bf16;
};

// What the search may choose. A fixed degree (non-zero) pins it; the lists are the options tried.
struct plan_constraints {
  double memory_fraction = 0.9;  // of each card's HBM a plan may use
  int dp = 0, tp = 0, pp = 0, ep = 0;
  std::size_t micro_batch = 0;  // sequences per micro-batch; 0: any divisor of the replica's batch
  std::size_t max_micro_batch = 64;
  int max_tp = 0;  // 0: the cards of one super-node
  std::vector<int> zero_stages = {0, 1, 2, 3};
  std::vector<recompute_mode> recompute = {recompute_mode::none, recompute_mode::selective, recompute_mode::full};
  std::vector<pipeline_schedule> schedules = {pipeline_schedule::one_f_one_b, pipeline_schedule::interleaved, pipeline_schedule::zb_h1};
  std::vector<int> virtual_stages = {2, 4};
  std::vector<wire_format> compression = {wire_format::none, wire_format::bf16, wire_format::e4m3, wire_format::int4};
  std::vector<bool> sequence_parallel = {false, true};
  bool overlap_grad_reduce = false;
  bool built_only = false;  // keep only plans tessel's dist/ runs today
};

struct plan_request {
  io::model_config model;
  emu::cluster_config cluster;
  std::size_t global_batch = 0;  // sequences per optimizer step
  std::size_t seq = 0;           // tokens per sequence
  std::size_t cards = 0;         // 0: every card of the cluster
  plan_precision precision;
  plan_constraints constraints;
};

struct plan_layout {
  int dp = 1, tp = 1, pp = 1, ep = 1, vpp = 1;
  std::size_t micro_batch = 1, micro_batches = 1;
  int zero = 0;
  recompute_mode recompute = recompute_mode::none;
  bool sp = false;
  pipeline_schedule schedule = pipeline_schedule::one_f_one_b;
  wire_format compression = wire_format::none;

  std::string to_string() const {
    std::ostringstream o;
    o << "dp" << dp << " tp" << tp << " pp" << pp;
    if (ep > 1) o << " ep" << ep;
    o << " mb" << micro_batch << "x" << micro_batches << " zero" << zero << " rc-" << dist::to_string(recompute);
    if (sp) o << " sp";
    if (pp > 1) {
      o << " " << dist::to_string(schedule);
      if (vpp > 1) o << "/v" << vpp;
    }
    if (compression != wire_format::none) o << " " << wire_format_name(compression);
    return o.str();
  }
};

// Bytes per card on the fullest stage.
struct plan_memory {
  double weights = 0, grads = 0, optimizer = 0, activations = 0, buffers = 0;
  double total() const { return weights + grads + optimizer + activations + buffers; }
};

struct plan_estimate {
  plan_layout layout;
  // seconds per optimizer step, and where they go (on the critical path)
  double step_time = 0;
  double compute = 0;                                         // kernels of the busiest stage, recompute included
  double recompute = 0;                                       // of which recompute
  double bubble = 0;                                          // pipeline fill and drain
  double tp_comm = 0, pp_comm = 0, ep_comm = 0, dp_comm = 0;  // exposed
  double zero_comm = 0;                                       // ZeRO-3's weight gathers (each micro-batch's forward and backward)
  double optimizer = 0;
  double tokens_per_s = 0, mfu = 0;
  double comm_share = 0, bubble_share = 0;
  plan_memory memory;
  bool built = false;
  std::string not_built;  // why tessel's dist/ cannot run it today (empty when built)
};

struct plan_rejection {
  plan_layout layout;
  std::string category, reason;
};

struct plan_result {
  std::vector<plan_estimate> plans;  // ranked, fastest first (at most `top`)
  std::size_t considered = 0, feasible = 0;
  std::map<std::string, std::size_t> pruned;       // category -> layouts pruned for it
  std::map<std::string, plan_rejection> examples;  // category -> the first layout pruned for it
  double search_seconds = 0;
};

namespace plan_detail {

inline std::vector<std::size_t> divisors(std::size_t n) {
  std::vector<std::size_t> d;
  for (std::size_t i = 1; i * i <= n; ++i)
    if (n % i == 0) {
      d.push_back(i);
      if (i != n / i) d.push_back(n / i);
    }
  std::sort(d.begin(), d.end());
  return d;
}

// Wire bytes per gradient element under a compression format (scales: one f32 per 256 elements).
inline double wire_bytes(wire_format f, double grad_bytes) {
  switch (f) {
    case wire_format::none: return grad_bytes;
    case wire_format::bf16: return 2;
    case wire_format::e4m3:
    case wire_format::e5m2: return 1 + 4.0 / 256;
    case wire_format::int4: return 0.5 + 4.0 / 256;
  }
  return grad_bytes;
}

// The kernels of one phase of work on one card, in launch order.
using kernel_list = std::vector<kernel_cost>;

// One decoder layer's kernels for a micro-batch on one card, split where its collectives fall:
// attention, then (tensor parallel) a reduction, then the MLP, then a reduction; the backward runs
// the MLP's kernels first. Rules: a GEMM's backward is two GEMMs of its size (input and weight
// gradients), flash attention's backward one kernel of 2.5x its FLOPs and 2x its bytes, an
// elementwise op's backward two passes over its forward's bytes.
struct layer_kernels {
  kernel_list attn_fwd, mlp_fwd, attn_bwd, mlp_bwd;
  kernel_list wgrad;      // the weight-gradient GEMMs among the backward's (ZB-H1's W)
  kernel_list recompute;  // what the recompute mode runs again before the backward
  bool moe = false;
  double dispatch_bytes = 0;  // MoE: bytes each rank sends per all-to-all (dispatch or combine)
};

// The LM head and loss (last stage) or the embedding (first stage) per micro-batch.
struct end_kernels {
  kernel_list fwd, bwd, wgrad;
};

inline double list_time(const emu::card_spec& spec, const kernel_list& k) {
  double t = 0;
  for (const auto& c : k) t += emu::roofline_time(spec, c);
  return t;
}

// Time of a stage's work per micro-batch, split for the schedules and the report.
struct stage_cost {
  double fwd = 0, bwd = 0, wgrad = 0, recompute = 0;  // kernels
  double tp = 0, ep = 0;                              // collectives per micro-batch (fwd + bwd)
};

class pricer {
 public:
  explicit pricer(const plan_request& r) : r_(r), comm_(r.cluster) {}

  kernel_cost kernel(double flops, double bytes) const { return kernel_cost{flops, bytes, r_.precision.math}; }
  static kernel_cost stream(double bytes) { return kernel_cost{0, bytes, math_precision::f32}; }
  double time(const kernel_list& k) const { return list_time(r_.cluster.card, k); }
  double time(const kernel_cost& k) const { return emu::roofline_time(r_.cluster.card, k); }

  // Placement of a group of `size` ranks `stride` apart in the rank order.
  emu::group_shape group(std::size_t size, std::size_t stride) const {
    const std::size_t cps = r_.cluster.cards_per_supernode;
    if (size <= 1) return emu::group_shape::local(1);
    if (size * stride <= cps || stride == 0) return emu::group_shape::local(size);
    if (stride >= cps) return emu::group_shape{size, 1};  // every member in its own super-node
    if (cps % stride == 0) {
      const std::size_t per = cps / stride;
      if (size % per == 0) return emu::group_shape{size, per};
    }
    return emu::group_shape{size, 1};  // irregular: price as if every member were remote
  }
  const emu::comm_model& comm() const { return comm_; }

  layer_kernels kernels(const plan_layout& l, std::size_t b) const {
    const auto& c = r_.model;
    const double e = r_.precision.act_bytes, s = double(r_.seq), T = double(b) * s, t = double(l.tp);
    const double h = double(c.hidden_size), q = double(c.num_attention_heads * c.head_dim), kv = double(c.num_key_value_heads * c.head_dim);
    const double I = double(c.intermediate_size);
    const double rows = l.sp ? T / t : T;                     // the rows elementwise ops see
    const double kvt = std::max(kv / t, double(c.head_dim));  // kv heads replicated when tp > kv heads
    layer_kernels k;
    auto gemm = [&](double m, double kk, double n, kernel_list& fwd, kernel_list& bwd) {
      const auto g = kernel(2 * m * kk * n, (m * kk + kk * n + m * n) * e);
      fwd.push_back(g);
      bwd.push_back(g);
      bwd.push_back(g);
      k.wgrad.push_back(g);
      return g;
    };
    auto elementwise = [&](double bytes, kernel_list& fwd, kernel_list& bwd) {
      fwd.push_back(stream(bytes));
      bwd.push_back(stream(bytes));
      bwd.push_back(stream(bytes));
    };
    // attention: norm, q/k/v, rope, flash attention (causal), output projection, residual
    kernel_list attn_bwd_rev;
    elementwise(2 * rows * h * e, k.attn_fwd, attn_bwd_rev);
    gemm(T, h, q / t + 2 * kvt, k.attn_fwd, attn_bwd_rev);
    elementwise(2 * T * (q / t + kvt) * e, k.attn_fwd, attn_bwd_rev);
    const double attn_flops = 2 * double(b) * s * s * q / t;  // 4·b·s²·q, halved by the causal mask
    const double attn_bytes = T * (2 * q / t + 2 * kvt) * e;
    k.attn_fwd.push_back(kernel(attn_flops, attn_bytes));
    attn_bwd_rev.push_back(kernel(2.5 * attn_flops, 2 * attn_bytes));
    gemm(T, q / t, h, k.attn_fwd, attn_bwd_rev);
    elementwise(3 * rows * h * e, k.attn_fwd, attn_bwd_rev);
    // MLP: norm, then SwiGLU (dense) or routed experts (MoE), residual
    kernel_list mlp_bwd_rev;
    elementwise(2 * rows * h * e, k.mlp_fwd, mlp_bwd_rev);
    if (c.is_moe()) {
      k.moe = true;
      const double E = double(c.num_local_experts), kk = double(c.num_experts_per_tok);
      gemm(T, h, E, k.mlp_fwd, mlp_bwd_rev);  // router (replicated over tp)
      // each ep rank runs T·k rows through its E/ep experts (even routing); each expert's weights read once
      const double er = T * kk, ne = E / double(l.ep);
      const auto up = kernel(2 * er * h * 2 * I, (er * h + ne * h * 2 * I + er * 2 * I) * e);
      const auto down = kernel(2 * er * I * h, (er * I + ne * I * h + er * h) * e);
      for (const auto& g : {up, down}) {
        k.mlp_fwd.push_back(g);
        mlp_bwd_rev.push_back(g);
        mlp_bwd_rev.push_back(g);
        k.wgrad.push_back(g);
      }
      elementwise(3 * er * I * e, k.mlp_fwd, mlp_bwd_rev);
      k.recompute = {up, stream(3 * er * I * e)};
      k.dispatch_bytes = e * T * kk * h;
    } else {
      const auto up = gemm(T, h, 2 * I / t, k.mlp_fwd, mlp_bwd_rev);
      elementwise(3 * T * I / t * e, k.mlp_fwd, mlp_bwd_rev);
      gemm(T, I / t, h, k.mlp_fwd, mlp_bwd_rev);
      k.recompute = {up, stream(3 * T * I / t * e)};
    }
    elementwise(3 * rows * h * e, k.mlp_fwd, mlp_bwd_rev);
    k.attn_bwd.assign(attn_bwd_rev.rbegin(), attn_bwd_rev.rend());
    k.mlp_bwd.assign(mlp_bwd_rev.rbegin(), mlp_bwd_rev.rend());
    if (l.recompute == recompute_mode::full) {
      k.recompute = k.attn_fwd;
      k.recompute.insert(k.recompute.end(), k.mlp_fwd.begin(), k.mlp_fwd.end());
    } else if (l.recompute == recompute_mode::none) {
      k.recompute.clear();
    }
    return k;
  }

  // The tensor-parallel collective after attention or a dense MLP (forward; its backward twin is
  // the same): an all-reduce of the rows, or with sequence parallelism an all-gather before and a
  // reduce-scatter after.
  double tp_collective(const plan_layout& l, std::size_t b) const {
    if (l.tp <= 1) return 0;
    const auto g = group(std::size_t(l.tp), 1);
    const double e = r_.precision.act_bytes, bytes = double(b) * double(r_.seq) * double(r_.model.hidden_size) * e;
    return l.sp ? comm_.all_gather(g, bytes) + comm_.reduce_scatter(g, bytes) : comm_.all_reduce(g, bytes, e < 4 ? 4 / e : 1, false);
  }

  stage_cost layer(const plan_layout& l, std::size_t b) const {
    const auto k = kernels(l, b);
    stage_cost sc;
    sc.fwd = time(k.attn_fwd) + time(k.mlp_fwd);
    sc.bwd = time(k.attn_bwd) + time(k.mlp_bwd);
    sc.wgrad = time(k.wgrad);
    sc.recompute = time(k.recompute);
    // attention's collective, and the dense MLP's (MoE experts are replicated over tp), each once
    // forward and once backward, and again in a fully recomputed forward
    const double one = tp_collective(l, b);
    const double per_pass = (k.moe ? 1 : 2) * one;
    sc.tp = 2 * per_pass + (l.recompute == recompute_mode::full ? per_pass : 0);
    if (k.moe)
      sc.ep = (l.recompute == recompute_mode::full ? 6 : 4) * comm_.all_to_all(group(std::size_t(l.ep), std::size_t(l.tp)), k.dispatch_bytes);
    return sc;
  }

  end_kernels head_kernels(const plan_layout& l, std::size_t b) const {
    const auto& c = r_.model;
    const double e = r_.precision.act_bytes, T = double(b) * double(r_.seq), t = double(l.tp);
    const double h = double(c.hidden_size), V = double(c.vocab_size);
    end_kernels k;
    const auto g = kernel(2 * T * h * V / t, (T * h + h * V / t) * e + T * V / t * 4);
    k.fwd = {g, stream(3 * T * V / t * 4)};
    k.bwd = {stream(2 * T * V / t * 4), g, g};
    k.wgrad = {g};
    return k;
  }
  // The vocabulary-parallel loss's collectives (max, sum and target logit: three all-reduces of
  // one f32 per row) and the gathered input rows, per micro-batch.
  double head_collectives(const plan_layout& l, std::size_t b) const {
    if (l.tp <= 1) return 0;
    const auto g = group(std::size_t(l.tp), 1);
    const double T = double(b) * double(r_.seq), rows = T * double(r_.model.hidden_size) * r_.precision.act_bytes;
    return 3 * comm_.all_reduce(g, T * 4, 1, false) + (l.sp ? 2 * comm_.all_gather(g, rows) : comm_.all_reduce(g, rows, 1, false));
  }
  stage_cost head(const plan_layout& l, std::size_t b) const {
    const auto k = head_kernels(l, b);
    stage_cost sc;
    sc.fwd = time(k.fwd), sc.bwd = time(k.bwd), sc.wgrad = time(k.wgrad);
    sc.tp = head_collectives(l, b);
    return sc;
  }

  end_kernels embedding_kernels(const plan_layout& l, std::size_t b) const {
    (void)l;
    const double e = r_.precision.act_bytes, T = double(b) * double(r_.seq), h = double(r_.model.hidden_size);
    return {{stream(2 * T * h * e)}, {stream(3 * T * h * 4)}, {}};
  }
  double embedding_collectives(const plan_layout& l, std::size_t b) const {
    if (l.tp <= 1) return 0;
    const auto g = group(std::size_t(l.tp), 1);
    const double rows = double(b) * double(r_.seq) * double(r_.model.hidden_size) * r_.precision.act_bytes;
    return l.sp ? comm_.reduce_scatter(g, rows) : comm_.all_reduce(g, rows, 1, false);
  }
  stage_cost embedding(const plan_layout& l, std::size_t b) const {
    const auto k = embedding_kernels(l, b);
    stage_cost sc;
    sc.fwd = time(k.fwd), sc.bwd = time(k.bwd);
    sc.tp = embedding_collectives(l, b);
    return sc;
  }

  // What stage s of layout l holds per card: its layers, and its parameters split into dense ones
  // (over tp; the embedding on the first stage, the final norm and the head on the last, a tied
  // head copied there when pp > 1) and expert ones (over ep).
  struct stage_share {
    std::size_t layers = 0;
    double dense = 0, experts = 0;
  };
  stage_share stage(const plan_layout& l, std::size_t s) const;

  // The optimizer step over this card's share of the stage (ZeRO >= 1: 1/dp of the dense
  // parameters, 1/(dp/ep) of the experts'), and the quantize and dequantize passes of compressed
  // gradients.
  kernel_cost optimizer_kernel(const plan_layout& l, const stage_share& st) const {
    const double dp = double(l.dp), rep_e = dp / double(l.ep);
    const double shard = l.zero >= 1 ? st.dense / dp + st.experts / rep_e : st.dense + st.experts;
    const auto& k = r_.precision;
    return stream(shard * (2 * k.param_bytes + k.grad_bytes + 2 * k.master_bytes + 2 * k.moment_bytes));
  }
  kernel_cost compression_kernel(const stage_share& st) const { return stream(3 * (st.dense + st.experts) * r_.precision.grad_bytes); }

 private:
  const plan_request& r_;
  emu::comm_model comm_;
};

// Parameters of one decoder layer: dense (split over tp) and experts (split over ep).
struct layer_params {
  double dense = 0, experts = 0;
};
inline layer_params params_of_layer(const io::model_config& c) {
  const double h = double(c.hidden_size), q = double(c.num_attention_heads * c.head_dim), kv = double(c.num_key_value_heads * c.head_dim);
  const double I = double(c.intermediate_size);
  layer_params p;
  p.dense = h * (q + 2 * kv) + q * h + 2 * h;
  if (c.qkv_bias) p.dense += q + 2 * kv;
  if (c.o_bias) p.dense += h;
  const double mlp = (c.naming == io::param_naming::gpt2 ? 2 : 3) * h * I;
  if (c.is_moe()) {
    p.dense += h * double(c.num_local_experts);  // router
    p.experts = mlp * double(c.num_local_experts);
  } else {
    p.dense += mlp;
  }
  return p;
}

inline pricer::stage_share pricer::stage(const plan_layout& l, std::size_t s) const {
  const auto& c = r_.model;
  const std::size_t L = c.num_hidden_layers, P = std::size_t(l.pp);
  const double t = double(l.tp), h = double(c.hidden_size), V = double(c.vocab_size);
  const auto lp = params_of_layer(c);
  stage_share st;
  st.layers = L / P + (s < L % P ? 1 : 0);
  st.dense = double(st.layers) * lp.dense / t;
  st.experts = double(st.layers) * lp.experts / double(l.ep);
  if (s == 0) st.dense += V * h / t;
  if (s == P - 1) {
    st.dense += h / t;  // final norm (replicated; counted per card)
    if (!c.tie_word_embeddings || P > 1) st.dense += V * h / t;
  }
  return st;
}

}  // namespace plan_detail

// Why `l` cannot run for `r` ("category: reason"), or nothing. Memory is checked by plan_evaluate.
inline std::optional<plan_rejection> plan_check(const plan_request& r, const plan_layout& l) {
  auto no = [&](const char* cat, std::string why) { return plan_rejection{l, cat, std::move(why)}; };
  const std::size_t cards = r.cards ? r.cards : r.cluster.cards();
  if (std::size_t(l.dp) * std::size_t(l.tp) * std::size_t(l.pp) != cards)
    return no("layout", "dp·tp·pp = " + std::to_string(l.dp * l.tp * l.pp) + " is not the " + std::to_string(cards) + " cards");
  try {
    parallel_layout pl{.dp = l.dp, .tp = l.tp, .pp = l.pp, .ep = l.ep, .zero_stage = l.zero};
    pl.validate(r.model);
    if (l.dp % l.ep != 0) return no("layout", "ep = " + std::to_string(l.ep) + " does not divide dp = " + std::to_string(l.dp));
  } catch (const dist_error& e) { return no("layout", e.what()); }
  const int max_tp = r.constraints.max_tp > 0 ? r.constraints.max_tp : int(r.cluster.cards_per_supernode);
  if (l.tp > max_tp)
    return no("tp", "tp = " + std::to_string(l.tp) + " exceeds " + std::to_string(max_tp) + " (a tensor-parallel group stays inside one super-node)");
  if (r.global_batch % std::size_t(l.dp) != 0)
    return no("batch", "dp = " + std::to_string(l.dp) + " does not divide the global batch of " + std::to_string(r.global_batch));
  if (l.micro_batch * l.micro_batches * std::size_t(l.dp) != r.global_batch)
    return no("batch", "micro-batch " + std::to_string(l.micro_batch) + " x " + std::to_string(l.micro_batches) + " is not the replica's batch");
  if (l.sp && l.tp == 1) return no("sp", "sequence parallelism needs tp > 1");
  if (l.pp == 1 && (l.schedule != pipeline_schedule::one_f_one_b || l.vpp != 1)) return no("schedule", "no pipeline schedule without pp > 1");
  if (l.schedule == pipeline_schedule::interleaved) {
    if (l.vpp < 2) return no("schedule", "interleaved needs 2 or more virtual stages");
    if (r.model.num_hidden_layers % (std::size_t(l.pp) * std::size_t(l.vpp)) != 0)
      return no("schedule", "interleaved: pp·v = " + std::to_string(l.pp * l.vpp) + " does not divide the " +
                                std::to_string(r.model.num_hidden_layers) + " layers");
    if (l.micro_batches % std::size_t(l.pp) != 0)
      return no("schedule",
                "interleaved: pp = " + std::to_string(l.pp) + " does not divide the " + std::to_string(l.micro_batches) + " micro-batches");
  } else if (l.vpp != 1) {
    return no("schedule", "virtual stages only with the interleaved schedule");
  }
  if (l.compression != wire_format::none && l.dp == 1) return no("compression", "no gradient traffic to compress with dp = 1");
  return std::nullopt;
}

// Why tessel's dist/ cannot run `l` today (empty: it can).
inline std::string plan_not_built(const plan_request& r, const plan_layout& l) {
  if (l.zero > 1) return "ZeRO-" + std::to_string(l.zero) + " is not built (0 and 1 are)";
  if (l.schedule != pipeline_schedule::one_f_one_b) return std::string(to_string(l.schedule)) + " schedule is not built (1F1B is)";
  if (l.pp > 1 && l.recompute != recompute_mode::full) return "pipeline stages recompute every layer today (rc-full)";
  if (l.pp == 1 && l.recompute != recompute_mode::none) return "recompute without pipeline stages is not built";
  if (l.compression != wire_format::none && l.zero > 0) return "compressed gradients with ZeRO are not built";
  if (r.model.is_moe() && l.sp) return "MoE with sequence parallelism is not built";
  if (l.ep > 1 && l.pp > 1) return "expert parallelism inside a pipeline is not built";
  if (l.ep > 1 && l.zero > 0) return "ZeRO-1 with expert parallelism is not built";
  return {};
}

// Prices one layout; throws dist_error(errc::config) naming why it cannot run (plan_check's
// reasons, or the memory it needs against what the card has).
inline plan_estimate plan_evaluate(const plan_request& r, const plan_layout& l) {
  if (auto why = plan_check(r, l)) throw dist_error(errc::config, "plan " + l.to_string() + ": " + why->reason);
  const auto& c = r.model;
  const auto& pr = r.precision;
  plan_detail::pricer p(r);
  const std::size_t L = c.num_hidden_layers, P = std::size_t(l.pp), b = l.micro_batch, m = l.micro_batches;
  const double t = double(l.tp), dp = double(l.dp), ep = double(l.ep), T = double(b) * double(r.seq);
  const double h = double(c.hidden_size), V = double(c.vocab_size);
  const auto lp = plan_detail::params_of_layer(c);
  const auto layer = p.layer(l, b), head = p.head(l, b), emb = p.embedding(l, b);

  plan_estimate est;
  est.layout = l;
  double sum_st = 0, sum_w = 0;  // over the stages: fill and drain pass through each once
  double slot = 0, slot_w = 0, slot_compute = 0, slot_recompute = 0, slot_tp = 0, slot_ep = 0, slot_gather = 0;
  double worst_mem = -1;
  plan_memory mem_worst;
  double dp_time = 0, opt_time = 0;
  for (std::size_t s = 0; s < P; ++s) {
    const auto share = p.stage(l, s);
    const double nl = double(share.layers), dense = share.dense, experts = share.experts;
    double fwd = nl * layer.fwd, bwd = nl * layer.bwd, w = nl * layer.wgrad, rc = nl * layer.recompute, tp = nl * layer.tp, epc = nl * layer.ep;
    if (s == 0) fwd += emb.fwd, bwd += emb.bwd, tp += emb.tp;
    if (s == P - 1) fwd += head.fwd, bwd += head.bwd, w += head.wgrad, tp += head.tp;
    double gather = 0;  // ZeRO-3: weights gathered for every micro-batch's forward and backward
    if (l.zero == 3) gather = 2 * p.comm().all_gather(p.group(std::size_t(l.dp), std::size_t(l.tp)), dense * pr.param_bytes);
    const double st = fwd + bwd + rc + tp + epc + gather;
    sum_st += st, sum_w += w;
    if (st > slot) { slot = st, slot_w = w, slot_compute = fwd + bwd + rc, slot_recompute = rc, slot_tp = tp, slot_ep = epc, slot_gather = gather; }
    // data-parallel gradient traffic of this stage, per card
    const auto dpg = p.group(std::size_t(l.dp), std::size_t(l.tp));
    const auto edpg = p.group(std::size_t(l.dp / l.ep), std::size_t(l.tp * l.ep));
    const double wire = plan_detail::wire_bytes(l.compression, pr.grad_bytes);
    auto reduce = [&](emu::group_shape g, double params) {
      if (g.size <= 1 || params <= 0) return 0.0;
      const double grads = params * wire;
      switch (l.zero) {
        case 0: return p.comm().all_reduce(g, grads, pr.grad_bytes < 4 ? 4 / pr.grad_bytes : 1, false);
        case 1: return p.comm().reduce_scatter(g, grads) + p.comm().all_gather(g, params * pr.param_bytes);
        case 2: return double(m) * p.comm().reduce_scatter(g, grads) + p.comm().all_gather(g, params * pr.param_bytes);
        default: return double(m) * p.comm().reduce_scatter(g, grads);
      }
    };
    double dpt = reduce(dpg, dense) + reduce(edpg, experts);
    if (l.compression != wire_format::none) dpt += p.time(p.compression_kernel(share));
    dp_time = std::max(dp_time, dpt);
    opt_time = std::max(opt_time, p.time(p.optimizer_kernel(l, share)));
    // memory of this stage
    plan_memory mem;
    const double own = dense + experts;
    const double rep_d = dp, rep_e = dp / ep;  // replicas that share each kind of state under ZeRO
    mem.weights = (l.zero == 3 ? dense / rep_d + experts / rep_e : own) * pr.param_bytes;
    if (l.zero == 3) mem.weights += 2 * (lp.dense / t + lp.experts / ep) * pr.param_bytes;  // a gathered layer, and the next prefetched
    mem.grads = (l.zero >= 2 ? dense / rep_d + experts / rep_e : own) * pr.grad_bytes;
    mem.optimizer = (l.zero >= 1 ? dense / rep_d + experts / rep_e : own) * (pr.master_bytes + pr.moment_bytes);
    if (l.compression == wire_format::int4) mem.buffers += own * 4;  // error-feedback residual
    // activations: per layer per micro-batch, times the micro-batches in flight on this stage
    const double e = pr.act_bytes, q = double(c.num_attention_heads * c.head_dim);
    const double kvt = std::max(double(c.num_key_value_heads * c.head_dim) / t, double(c.head_dim));
    const double rows = l.sp ? T / t : T;
    const double I = double(c.intermediate_size);
    const double mlp_mid =
        c.is_moe() ? T * double(c.num_experts_per_tok) * (3 * I + 2 * h) * e + T * double(c.num_local_experts) * 4 : 3 * T * I / t * e;
    const double full_layer = 4 * rows * h * e + T * (2 * q / t + 2 * kvt) * e + T * double(c.num_attention_heads) / t * 4 + mlp_mid;
    double per_layer = full_layer;
    if (l.recompute == recompute_mode::selective) per_layer = full_layer - mlp_mid;
    if (l.recompute == recompute_mode::full) per_layer = rows * h * e;
    double in_flight = double(std::min<std::size_t>(P - s, m));
    if (l.schedule == pipeline_schedule::interleaved)
      in_flight = std::min(double(m), double(P - s) * (1 + double(P - 1) / (double(P) * double(l.vpp))));
    mem.activations = per_layer * nl * in_flight;
    if (l.recompute != recompute_mode::none) mem.activations += full_layer;  // the layer being recomputed
    if (s == P - 1) mem.activations += T * V / t * 4 * 2;                    // logits and their gradient (f32)
    mem.buffers += 2 * T * h * 4;                                            // stage boundary streams
    if (mem.total() > worst_mem) worst_mem = mem.total(), mem_worst = mem;
  }
  const bool one_node = std::size_t(l.dp * l.tp * l.pp) <= r.cluster.cards_per_supernode;
  const double pp_msg = P > 1 ? 2 * p.comm().message(T * h * pr.act_bytes / (l.sp ? t : 1.0), one_node) : 0;
  // 1F1B: m slots of the busiest stage, plus the fill and drain through every other stage once
  // (for equal stages, the (p − 1) slots of the textbook bubble), each boundary crossed by one
  // activation and one gradient on the way
  double slot_pp = pp_msg;
  const double fill = sum_st - slot, fill_w = sum_w - slot_w;
  double bubble = 0;
  const double M = double(m);
  switch (l.schedule) {
    case pipeline_schedule::one_f_one_b: bubble = fill + double(P - 1) * pp_msg; break;
    case pipeline_schedule::interleaved:
      slot_pp = pp_msg * double(l.vpp);
      bubble = (fill + double(P - 1) * slot_pp) / double(l.vpp);
      break;
    case pipeline_schedule::zb_h1: bubble = std::max(0.0, fill - 2 * fill_w) + double(P - 1) * pp_msg; break;
  }
  est.compute = M * slot_compute;
  est.recompute = M * slot_recompute;
  est.tp_comm = M * slot_tp;
  est.ep_comm = M * slot_ep;
  est.pp_comm = M * slot_pp;
  est.zero_comm = M * slot_gather;
  est.bubble = bubble;
  est.dp_comm = dp_time;
  if (r.constraints.overlap_grad_reduce) est.dp_comm = std::max(0.0, dp_time - slot);
  est.optimizer = opt_time;
  est.step_time = M * (slot + slot_pp) + bubble + est.dp_comm + est.optimizer;
  est.memory = mem_worst;
  const double tokens = double(r.global_batch) * double(r.seq);
  est.tokens_per_s = tokens / est.step_time;
  const std::size_t cards = r.cards ? r.cards : r.cluster.cards();
  // model FLOPs per step (the convention of MFU: 6 per active parameter per token, plus causal
  // attention's 6·s·q per layer per token; recompute and replicated work are not counted)
  const double active = double(L) * (lp.dense + (c.is_moe() ? lp.experts * double(c.num_experts_per_tok) / double(c.num_local_experts) : 0)) + V * h;
  const double q_all = double(c.num_attention_heads * c.head_dim);
  const double model_flops = tokens * (6 * active + 6 * double(L) * double(r.seq) * q_all);
  est.mfu = model_flops / (est.step_time * double(cards) * emu::peak_of(r.cluster.card, pr.math));
  est.comm_share = (est.tp_comm + est.pp_comm + est.ep_comm + est.dp_comm + est.zero_comm) / est.step_time;
  est.bubble_share = bubble / est.step_time;
  const double cap = r.constraints.memory_fraction * double(r.cluster.card.memory_bytes);
  if (mem_worst.total() > cap) {
    std::ostringstream o;
    o.setf(std::ios::fixed);
    o.precision(1);
    o << "plan " << l.to_string() << ": needs " << mem_worst.total() / double(1ull << 30) << " GiB per card (weights "
      << mem_worst.weights / double(1ull << 30) << ", grads " << mem_worst.grads / double(1ull << 30) << ", optimizer "
      << mem_worst.optimizer / double(1ull << 30) << ", activations " << mem_worst.activations / double(1ull << 30) << "), "
      << cap / double(1ull << 30) << " GiB usable";
    throw dist_error(errc::config, o.str());
  }
  est.not_built = plan_not_built(r, l);
  est.built = est.not_built.empty();
  return est;
}

// Every layout the constraints allow, in a fixed order.
template <class F>
void plan_enumerate(const plan_request& r, F&& visit) {
  const auto& k = r.constraints;
  const std::size_t cards = r.cards ? r.cards : r.cluster.cards();
  const std::size_t E = r.model.is_moe() ? r.model.num_local_experts : 1;
  for (std::size_t tp : plan_detail::divisors(cards)) {
    if (k.tp && int(tp) != k.tp) continue;
    for (std::size_t pp : plan_detail::divisors(cards / tp)) {
      if (k.pp && int(pp) != k.pp) continue;
      const std::size_t dp = cards / tp / pp;
      if (k.dp && int(dp) != k.dp) continue;
      for (std::size_t ep : plan_detail::divisors(dp)) {
        if (E % ep != 0 || (k.ep && int(ep) != k.ep) || (k.ep == 0 && ep > 1 && !r.model.is_moe())) continue;
        const std::size_t replica = r.global_batch % dp == 0 ? r.global_batch / dp : 0;
        std::vector<std::size_t> mbs = replica ? plan_detail::divisors(replica) : std::vector<std::size_t>{1};
        for (std::size_t b : mbs) {
          if (k.micro_batch ? b != k.micro_batch : b > k.max_micro_batch) continue;
          for (bool sp : k.sequence_parallel) {
            if (sp && tp == 1) continue;
            for (recompute_mode rc : k.recompute)
              for (int z : k.zero_stages)
                for (wire_format cf : k.compression) {
                  if (cf != wire_format::none && dp == 1) continue;
                  for (pipeline_schedule sch : k.schedules) {
                    if (pp == 1 && sch != pipeline_schedule::one_f_one_b) continue;
                    std::vector<int> vs = {1};
                    if (sch == pipeline_schedule::interleaved) vs = k.virtual_stages;
                    for (int v : vs) {
                      plan_layout l;
                      l.dp = int(dp), l.tp = int(tp), l.pp = int(pp), l.ep = int(ep), l.vpp = v;
                      l.micro_batch = b, l.micro_batches = replica ? replica / b : 0;
                      l.zero = z, l.recompute = rc, l.sp = sp, l.schedule = sch, l.compression = cf;
                      visit(l);
                    }
                  }
                }
          }
        }
      }
    }
  }
}

// Searches the space, prunes what cannot run, ranks the rest by step time. `progress(done)` is
// called every 4096 layouts.
inline plan_result plan_search(const plan_request& r, std::size_t top = 10, const std::function<void(std::size_t)>& progress = {}) {
  if (r.global_batch == 0 || r.seq == 0) throw dist_error(errc::invalid_argument, "plan: the global batch and the sequence length must be positive");
  if (r.model.num_hidden_layers == 0 || r.model.hidden_size == 0) throw dist_error(errc::invalid_argument, "plan: the model config has no layers");
  r.cluster.validate();
  const std::size_t cards = r.cards ? r.cards : r.cluster.cards();
  if (cards == 0 || cards > r.cluster.cards())
    throw dist_error(errc::invalid_argument, "plan: " + std::to_string(cards) + " cards on a cluster of " + std::to_string(r.cluster.cards()));
  if (!(r.constraints.memory_fraction > 0 && r.constraints.memory_fraction <= 1))
    throw dist_error(errc::invalid_argument, "plan: memory_fraction must be in (0, 1]");
  const auto t0 = std::chrono::steady_clock::now();
  plan_result res;
  std::vector<plan_estimate> all;
  plan_enumerate(r, [&](const plan_layout& l) {
    ++res.considered;
    if (progress && res.considered % 4096 == 0) progress(res.considered);
    auto prune = [&](plan_rejection rej) {
      ++res.pruned[rej.category];
      res.examples.emplace(rej.category, std::move(rej));
    };
    if (auto why = plan_check(r, l)) return prune(std::move(*why));
    try {
      auto e = plan_evaluate(r, l);
      if (r.constraints.built_only && !e.built) return prune({l, "not built", e.not_built});
      ++res.feasible;
      all.push_back(std::move(e));
    } catch (const dist_error& e) { prune({l, "memory", e.what()}); }
  });
  std::stable_sort(all.begin(), all.end(), [](const plan_estimate& a, const plan_estimate& b) { return a.step_time < b.step_time; });
  if (all.size() > top) all.resize(top);
  res.plans = std::move(all);
  res.search_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

// Why `a` beats `b`: the components of the step that differ most, largest first.
inline std::string plan_explain(const plan_estimate& a, const plan_estimate& b) {
  struct part {
    const char* name;
    double d;
  };
  std::vector<part> parts = {{"compute", a.compute - b.compute},
                             {"tensor-parallel communication", a.tp_comm - b.tp_comm},
                             {"pipeline messages", a.pp_comm - b.pp_comm},
                             {"expert all-to-all", a.ep_comm - b.ep_comm},
                             {"gradient reduction", a.dp_comm - b.dp_comm},
                             {"ZeRO-3 weight gathers", a.zero_comm - b.zero_comm},
                             {"pipeline bubble", a.bubble - b.bubble},
                             {"optimizer step", a.optimizer - b.optimizer}};
  std::sort(parts.begin(), parts.end(), [](const part& x, const part& y) { return std::abs(x.d) > std::abs(y.d); });
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(1);
  o << a.layout.to_string() << " takes " << a.step_time * 1e3 << " ms against " << b.step_time * 1e3 << " ms for " << b.layout.to_string() << ":";
  int shown = 0;
  for (const auto& p : parts) {
    if (shown == 3 || std::abs(p.d) < 1e-3 * std::max(a.step_time, b.step_time)) break;
    o << (shown ? "," : "") << " " << p.name << " " << (p.d < 0 ? "-" : "+") << std::abs(p.d) * 1e3 << " ms";
    ++shown;
  }
  if (!shown) o << " the components are within 0.1%";
  return o.str();
}

inline nlohmann::json to_json(const plan_layout& l) {
  return {{"dp", l.dp},
          {"tp", l.tp},
          {"pp", l.pp},
          {"ep", l.ep},
          {"virtual_stages", l.vpp},
          {"micro_batch", l.micro_batch},
          {"micro_batches", l.micro_batches},
          {"zero", l.zero},
          {"recompute", to_string(l.recompute)},
          {"sequence_parallel", l.sp},
          {"schedule", to_string(l.schedule)},
          {"compression", std::string(wire_format_name(l.compression))}};
}

inline nlohmann::json to_json(const plan_estimate& e) {
  return {{"layout", to_json(e.layout)},
          {"name", e.layout.to_string()},
          {"step_time_s", e.step_time},
          {"tokens_per_s", e.tokens_per_s},
          {"mfu", e.mfu},
          {"comm_share", e.comm_share},
          {"bubble_share", e.bubble_share},
          {"seconds",
           {{"compute", e.compute},
            {"recompute", e.recompute},
            {"bubble", e.bubble},
            {"tp_comm", e.tp_comm},
            {"pp_comm", e.pp_comm},
            {"ep_comm", e.ep_comm},
            {"dp_comm", e.dp_comm},
            {"zero_comm", e.zero_comm},
            {"optimizer", e.optimizer}}},
          {"memory_bytes",
           {{"weights", e.memory.weights},
            {"grads", e.memory.grads},
            {"optimizer", e.memory.optimizer},
            {"activations", e.memory.activations},
            {"buffers", e.memory.buffers},
            {"total", e.memory.total()}}},
          {"built", e.built},
          {"not_built", e.not_built}};
}

inline nlohmann::json to_json(const plan_result& r) {
  nlohmann::json j;
  j["considered"] = r.considered;
  j["feasible"] = r.feasible;
  j["search_seconds"] = r.search_seconds;
  j["pruned"] = r.pruned;
  nlohmann::json ex = nlohmann::json::object();
  for (const auto& [cat, rej] : r.examples) ex[cat] = {{"layout", rej.layout.to_string()}, {"reason", rej.reason}};
  j["pruned_examples"] = ex;
  j["plans"] = nlohmann::json::array();
  for (const auto& p : r.plans) j["plans"].push_back(to_json(p));
  if (r.plans.size() > 1) j["why_best"] = plan_explain(r.plans[0], r.plans[1]);
  return j;
}

// A readable table of the ranked plans.
inline std::string plan_table(const plan_result& r) {
  std::ostringstream o;
  char line[512];
  std::snprintf(line, sizeof line, "%-4s %-60s %10s %12s %6s %7s %7s %9s %s\n", "rank", "layout", "step ms", "tokens/s", "MFU", "comm", "bubble",
                "GiB/card", "built");
  o << line;
  int i = 0;
  for (const auto& p : r.plans) {
    std::snprintf(line, sizeof line, "%-4d %-60s %10.2f %12.0f %5.1f%% %6.1f%% %6.1f%% %9.2f %s\n", ++i, p.layout.to_string().c_str(),
                  p.step_time * 1e3, p.tokens_per_s, 100 * p.mfu, 100 * p.comm_share, 100 * p.bubble_share, p.memory.total() / double(1ull << 30),
                  p.built ? "yes" : ("no: " + p.not_built).c_str());
    o << line;
  }
  o << r.considered << " layouts considered, " << r.feasible << " feasible, in " << r.search_seconds << " s; pruned:";
  for (const auto& [cat, n] : r.pruned) o << " " << cat << " " << n;
  o << "\n";
  for (const auto& [cat, rej] : r.examples) o << "  e.g. " << cat << ": " << rej.reason << "\n";
  if (r.plans.size() > 1) o << "why the best: " << plan_explain(r.plans[0], r.plans[1]) << "\n";
  return o.str();
}

}  // namespace dist
}  // namespace v0
}  // namespace tessel
