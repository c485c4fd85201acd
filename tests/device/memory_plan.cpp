// memory_plan: the liveness planner. Properties: tensors live at the same op never share bytes
// (checked by brute force, not by the planner's own structures), offsets are aligned, the arena
// sits between the lower bound and one-buffer-per-tensor; structured workloads (a transformer
// training step, an MLP, a U-Net) come within 10% of the lower bound; in-place chains share one
// buffer; a program run in the planned arena, poisoned with NaN wherever a tensor is dead, gives
// the same bits as one buffer per tensor; bad requests are typed errors; plans are deterministic.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <tessel/device.hpp>
#include "error_match.hpp"

namespace tessel_test_device_memory_plan {

using tessel_test::is_error;
using namespace tessel;

tensor_life life(std::size_t bytes, std::size_t first, std::size_t last, std::optional<std::size_t> reuse = std::nullopt, std::string name = {}) {
  return tensor_life{bytes, first, last, reuse, std::move(name)};
}

std::size_t align_up(std::size_t b, std::size_t a) { return (b + a - 1) / a * a; }

// The in-place groups, computed here from reuse_input alone: a tensor that takes an input joins
// that input's group (inputs come first, so one pass in index order).
std::vector<std::size_t> groups_of(const std::vector<tensor_life>& t, bool allow_in_place) {
  std::vector<std::size_t> g(t.size());
  for (std::size_t i = 0; i < t.size(); ++i) g[i] = (allow_in_place && t[i].bytes > 0 && t[i].reuse_input) ? g[*t[i].reuse_input] : i;
  return g;
}

// Every property of a plan that does not depend on how it was found, checked by brute force:
// O(n^2) pairs and O(n * ops) for the lower bound, so n stays in the thousands here.
struct plan_check {
  std::size_t overlaps = 0, misaligned = 0, outside = 0, nonzero_empty = 0;
  std::size_t lower_bound = 0, unplanned = 0, in_place = 0;
  std::string first_overlap;
};

plan_check check_plan(const std::vector<tensor_life>& t, const memory_plan& p, const plan_options& opt) {
  plan_check c;
  const std::size_t n = t.size();
  const auto g = groups_of(t, opt.allow_in_place);
  std::vector<std::size_t> sz(n);
  for (std::size_t i = 0; i < n; ++i) {
    sz[i] = align_up(t[i].bytes, opt.alignment);
    c.unplanned += sz[i];
    if (g[i] != i) ++c.in_place;
    if (p.offset[i] % opt.alignment) ++c.misaligned;
    if (p.offset[i] + sz[i] > p.arena_bytes) ++c.outside;
    if (sz[i] == 0 && p.offset[i] != 0) ++c.nonzero_empty;
  }
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = i + 1; j < n; ++j) {
      if (sz[i] == 0 || sz[j] == 0 || g[i] == g[j]) continue;
      if (t[i].last < t[j].first || t[j].last < t[i].first) continue;
      const bool disjoint = p.offset[i] + sz[i] <= p.offset[j] || p.offset[j] + sz[j] <= p.offset[i];
      if (!disjoint && c.overlaps++ == 0) c.first_overlap = std::to_string(i) + std::string(" and ") + std::to_string(j);
    }
  // Lower bound: at every op where something starts, the live groups' sizes (a group's buffer is
  // its first tensor's; its lifetime the union of its members').
  std::vector<std::size_t> gfirst(n, SIZE_MAX), glast(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    if (sz[i] == 0) continue;
    gfirst[g[i]] = std::min(gfirst[g[i]], t[i].first);
    glast[g[i]] = std::max(glast[g[i]], t[i].last);
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (g[i] != i || sz[i] == 0) continue;
    std::size_t live = 0;
    for (std::size_t j = 0; j < n; ++j)
      if (g[j] == j && sz[j] != 0 && gfirst[j] <= gfirst[i] && gfirst[i] <= glast[j]) live += sz[j];
    c.lower_bound = std::max(c.lower_bound, live);
  }
  return c;
}

void require_valid(const std::vector<tensor_life>& t, const memory_plan& p, const plan_options& opt = {}) {
  REQUIRE(p.offset.size() == t.size());
  const plan_check c = check_plan(t, p, opt);
  CAPTURE(t.size(), opt.alignment, opt.allow_in_place, c.first_overlap);
  REQUIRE(c.overlaps == 0);
  REQUIRE(c.misaligned == 0);
  REQUIRE(c.outside == 0);
  REQUIRE(c.nonzero_empty == 0);
  REQUIRE(p.arena_bytes % opt.alignment == 0);
  REQUIRE(p.unplanned_bytes == c.unplanned);
  REQUIRE(p.lower_bound_bytes == c.lower_bound);
  REQUIRE(p.in_place == c.in_place);
  REQUIRE(p.arena_bytes >= p.lower_bound_bytes);
  REQUIRE(p.arena_bytes <= p.unplanned_bytes);
}

// Random lifetimes over about n ops: sizes 0 (1 in 20) or log-uniform up to ~1 MB and not multiples
// of the alignment; lifetimes short (a few ops) or, one in `long_every`, anything up to the whole
// program; a share of tensors take an earlier tensor's buffer in place (valid requests only).
std::vector<tensor_life> random_workload(std::mt19937_64& rng, std::size_t n, std::size_t long_every, double in_place_share) {
  std::vector<tensor_life> t;
  t.reserve(n);
  const std::size_t ops = std::max<std::size_t>(n, 1);
  std::vector<std::size_t> free_inputs;  // tensors no one has taken in place yet
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  auto bytes = [&] {
    if (rng() % 20 == 0) return std::size_t{0};
    return static_cast<std::size_t>(std::exp(unit(rng) * std::log(1.0e6)));
  };
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t len = (long_every && rng() % long_every == 0) ? rng() % ops : rng() % 6;
    if (!free_inputs.empty() && unit(rng) < in_place_share) {
      const std::size_t k = rng() % free_inputs.size();
      const std::size_t r = free_inputs[k];
      free_inputs.erase(free_inputs.begin() + static_cast<std::ptrdiff_t>(k));
      const std::size_t b = t[r].bytes == 0 ? 0 : rng() % (t[r].bytes + 1);
      t.push_back(life(b, t[r].last, t[r].last + len, r));
    } else {
      const std::size_t first = rng() % ops;
      t.push_back(life(bytes(), first, first + len));
    }
    free_inputs.push_back(i);
  }
  return t;
}

// A program's tensors, built op by op: `use` marks a read at the current op, `def` a new tensor.
struct program_builder {
  std::vector<tensor_life> t;
  std::size_t op = 0;
  std::size_t def(std::size_t bytes, std::string name, std::optional<std::size_t> in_place = std::nullopt) {
    t.push_back(life(bytes, op, op, in_place, std::move(name)));
    return t.size() - 1;
  }
  template <class... I>
  void use(I... ids) {
    ((t[ids].last = op), ...);
  }
  void next() { ++op; }
};

// A Llama-style decoder's training step: the forward pass saves what backward reads (norm inputs
// and outputs, rotated q/k, v, attention probabilities, the MLP's gate/up/act), the loss head, and
// the backward pass in reverse layer order freeing each layer's saved tensors. Elementwise ops
// (rope, softmax, residual adds, the loss gradient, the backward of rope/softmax/norm) take their
// input in place where it dies there. bf16 activations, f32 scores and logits.
struct llama_shape {
  std::size_t batch, seq, dim, heads, kv_heads, ffn, vocab, layers;
};

std::vector<tensor_life> llama_training_step(const llama_shape& s) {
  program_builder b;
  const std::size_t tok = s.batch * s.seq;
  const std::size_t act = tok * s.dim * 2, kv = tok * (s.dim / s.heads) * s.kv_heads * 2, ffn = tok * s.ffn * 2;
  const std::size_t scores = s.batch * s.heads * s.seq * s.seq * 4, logits_bytes = tok * s.vocab * 4;
  struct saved {
    std::size_t x, n1, qr, kr, v, p, a, x1, n2, g, u, h;
  };
  std::vector<saved> layers;
  std::size_t x = b.def(act, "embed");
  b.next();
  for (std::size_t l = 0; l < s.layers; ++l) {
    saved k{};
    k.x = x;
    b.use(x), k.n1 = b.def(act, "attn_norm"), b.next();
    b.use(k.n1);
    const std::size_t q = b.def(act, "q");
    b.next();
    b.use(k.n1);
    const std::size_t kk = b.def(kv, "k");
    b.next();
    b.use(k.n1), k.v = b.def(kv, "v"), b.next();
    b.use(q), k.qr = b.def(act, "q_rope", q), b.next();
    b.use(kk), k.kr = b.def(kv, "k_rope", kk), b.next();
    b.use(k.qr, k.kr);
    const std::size_t sc = b.def(scores, "scores");
    b.next();
    b.use(sc), k.p = b.def(scores, "probs", sc), b.next();
    b.use(k.p, k.v), k.a = b.def(act, "attn_out"), b.next();
    b.use(k.a);
    const std::size_t o = b.def(act, "o_proj");
    b.next();
    b.use(x, o), k.x1 = b.def(act, "resid_attn", o), b.next();
    b.use(k.x1), k.n2 = b.def(act, "mlp_norm"), b.next();
    b.use(k.n2), k.g = b.def(ffn, "gate"), b.next();
    b.use(k.n2), k.u = b.def(ffn, "up"), b.next();
    b.use(k.g, k.u), k.h = b.def(ffn, "silu_gate_up"), b.next();
    b.use(k.h);
    const std::size_t dn = b.def(act, "down");
    b.next();
    b.use(k.x1, dn), x = b.def(act, "resid_mlp", dn), b.next();
    layers.push_back(k);
  }
  const std::size_t xl = x;
  b.use(xl);
  const std::size_t nf = b.def(act, "final_norm");
  b.next();
  b.use(nf);
  const std::size_t logits = b.def(logits_bytes, "logits");
  b.next();
  b.use(logits), b.def(4, "loss");
  const std::size_t dlogits = b.def(logits_bytes, "d_logits", logits);
  b.next();
  b.use(dlogits, nf);
  const std::size_t dnf = b.def(act, "d_final_norm");
  b.next();
  b.use(dnf, xl);
  std::size_t dx = b.def(act, "d_resid", dnf);
  b.next();
  for (std::size_t l = s.layers; l-- > 0;) {
    const saved& k = layers[l];
    b.use(dx, k.h);
    const std::size_t dh = b.def(ffn, "d_silu_gate_up");
    b.next();
    b.use(dh, k.g, k.u);
    const std::size_t dg = b.def(ffn, "d_gate", dh), du = b.def(ffn, "d_up");
    b.next();
    b.use(dg, du, k.n2);
    const std::size_t dn2 = b.def(act, "d_mlp_norm");
    b.next();
    b.use(dn2, k.x1, dx);
    const std::size_t dx1 = b.def(act, "d_resid_attn", dn2);
    b.next();
    b.use(dx1, k.a);
    const std::size_t da = b.def(act, "d_attn_out");
    b.next();
    b.use(da, k.v);
    const std::size_t dp = b.def(scores, "d_probs");
    b.next();
    b.use(da, k.p);
    const std::size_t dv = b.def(kv, "d_v");
    b.next();
    b.use(dp, k.p);
    const std::size_t ds = b.def(scores, "d_scores", dp);
    b.next();
    b.use(ds, k.kr);
    const std::size_t dqr = b.def(act, "d_q_rope");
    b.next();
    b.use(ds, k.qr);
    const std::size_t dkr = b.def(kv, "d_k_rope");
    b.next();
    b.use(dqr);
    const std::size_t dq = b.def(act, "d_q", dqr);
    b.next();
    b.use(dkr);
    const std::size_t dk = b.def(kv, "d_k", dkr);
    b.next();
    b.use(dq, dk, dv, k.n1);
    const std::size_t dn1 = b.def(act, "d_attn_norm");
    b.next();
    b.use(dn1, k.x, dx1);
    dx = b.def(act, "d_resid", dn1);
    b.next();
  }
  b.use(dx);  // the embedding's backward
  return b.t;
}

// An MLP of linear + ReLU layers (f32, batch rows): inference (each activation dies at the next
// layer) or a training step (ReLU outputs saved for the weight gradients, backward in reverse).
std::vector<tensor_life> mlp(const std::vector<std::size_t>& widths, std::size_t batch, bool training) {
  program_builder b;
  auto bytes = [&](std::size_t w) { return batch * w * 4; };
  std::size_t x = b.def(bytes(widths[0]), "input");
  b.next();
  std::vector<std::size_t> acts{x};
  for (std::size_t l = 1; l < widths.size(); ++l) {
    b.use(x);
    const std::size_t h = b.def(bytes(widths[l]), "linear");
    b.next();
    b.use(h), x = b.def(bytes(widths[l]), "relu", h), b.next();
    acts.push_back(x);
  }
  if (!training) {
    b.use(x);
    return b.t;
  }
  b.use(x);
  std::size_t d = b.def(bytes(widths.back()), "d_out");
  b.next();
  for (std::size_t l = widths.size() - 1; l >= 1; --l) {
    b.use(d, acts[l]);
    const std::size_t dh = b.def(bytes(widths[l]), "d_linear", d);  // relu backward, in place
    b.next();
    b.use(dh, acts[l - 1]);  // weight gradient and input gradient
    d = b.def(bytes(widths[l - 1]), "d_act");
    b.next();
  }
  b.use(d);
  return b.t;
}

// A U-Net's inference: per level two conv + ReLU (in place), the second kept as the skip until the
// decoder's level concatenates it; max-pool down, transposed conv up (f32, NCHW).
std::vector<tensor_life> unet(std::size_t batch, std::size_t size, std::size_t base_channels, std::size_t levels) {
  program_builder b;
  auto bytes = [&](std::size_t c, std::size_t hw) { return batch * c * hw * hw * 4; };
  std::size_t x = b.def(bytes(3, size), "image");
  b.next();
  auto double_conv = [&](std::size_t c, std::size_t hw) {
    b.use(x);
    const std::size_t c1 = b.def(bytes(c, hw), "conv1");
    b.next();
    b.use(c1), x = b.def(bytes(c, hw), "relu1", c1), b.next();
    b.use(x);
    const std::size_t c2 = b.def(bytes(c, hw), "conv2");
    b.next();
    b.use(c2), x = b.def(bytes(c, hw), "relu2", c2), b.next();
  };
  std::vector<std::size_t> skips;
  std::size_t c = base_channels, hw = size;
  for (std::size_t l = 0; l < levels; ++l, c *= 2, hw /= 2) {
    double_conv(c, hw);
    skips.push_back(x);
    b.use(x), x = b.def(bytes(c, hw / 2), "pool"), b.next();
  }
  double_conv(c, hw);  // the bottleneck
  for (std::size_t l = levels; l-- > 0;) {
    c /= 2, hw *= 2;
    b.use(x);
    const std::size_t up = b.def(bytes(c, hw), "up");
    b.next();
    b.use(up, skips[l]), x = b.def(bytes(2 * c, hw), "concat"), b.next();
    double_conv(c, hw);
  }
  b.use(x);
  const std::size_t head = b.def(bytes(2, size), "logits");
  b.next();
  b.use(head);
  return b.t;
}

// ---- a small interpreter: the same program in one buffer per tensor and in the planned arena ----

enum class op_kind { source, add, mul, reduce, relu_in_place, scale_in_place };
struct prog_op {
  op_kind kind;
  std::size_t a = 0, b = 0;  // inputs (b unused by unary ops)
};
// Op j defines tensor j (so a tensor's index is its op); `outputs` are read by a last op n.
struct program {
  std::vector<prog_op> ops;
  std::vector<std::size_t> len;  // floats per tensor
  std::vector<std::size_t> outputs;
  std::vector<tensor_life> lives;
};

program random_program(std::uint64_t seed, std::size_t n) {
  std::mt19937_64 rng(seed);
  program p;
  std::vector<std::size_t> readable;  // defined and not consumed by an in-place op
  auto pick = [&] {                   // mostly recent tensors, sometimes an old one (a long lifetime)
    const std::size_t k = readable.size();
    const std::size_t i = rng() % 5 == 0 ? rng() % k : k - 1 - rng() % std::min<std::size_t>(k, 6);
    return readable[i];
  };
  for (std::size_t j = 0; j < n; ++j) {
    prog_op op{op_kind::source};
    std::size_t len = 1 + rng() % 700;
    if (readable.size() >= 2 && rng() % 8 != 0) {
      switch (rng() % 5) {
        case 0:
          op = {op_kind::add, pick(), pick()};
          len = p.len[op.a];
          break;
        case 1:
          op = {op_kind::mul, pick(), pick()};
          len = p.len[op.a];
          break;
        case 2:
          op = {op_kind::reduce, pick(), pick()};
          len = 1 + rng() % 64;
          break;
        default:
          op = {rng() % 2 ? op_kind::relu_in_place : op_kind::scale_in_place, pick()};
          len = p.len[op.a];
          readable.erase(std::find(readable.begin(), readable.end(), op.a));  // it dies here
      }
    }
    p.ops.push_back(op);
    p.len.push_back(len);
    readable.push_back(j);
  }
  for (std::size_t k = 0; k < 4 && k < readable.size(); ++k) p.outputs.push_back(readable[readable.size() - 1 - k]);
  p.outputs.push_back(readable[rng() % readable.size()]);
  std::sort(p.outputs.begin(), p.outputs.end());
  p.outputs.erase(std::unique(p.outputs.begin(), p.outputs.end()), p.outputs.end());

  p.lives.resize(n);
  for (std::size_t j = 0; j < n; ++j) p.lives[j] = life(p.len[j] * sizeof(float), j, j);
  for (std::size_t j = 0; j < n; ++j) {
    const prog_op& op = p.ops[j];
    if (op.kind == op_kind::source) continue;
    p.lives[op.a].last = j;
    if (op.kind == op_kind::add || op.kind == op_kind::mul || op.kind == op_kind::reduce) p.lives[op.b].last = j;
    if (op.kind == op_kind::relu_in_place || op.kind == op_kind::scale_in_place) p.lives[j].reuse_input = op.a;
  }
  for (std::size_t o : p.outputs) p.lives[o].last = n;
  return p;
}

// Runs `p` with tensor j at data(j). Values stay in [-1, 1], so a NaN can only come from poison.
// `record` keeps every tensor as written by its op, and the outputs at the end.
template <class Data, class Poison>
std::vector<std::vector<float>> run_program(const program& p, Data data, Poison poison) {
  const std::size_t n = p.ops.size();
  std::vector<std::vector<float>> record;
  for (std::size_t j = 0; j < n; ++j) {
    const prog_op& op = p.ops[j];
    const bool in_place = op.kind == op_kind::relu_in_place || op.kind == op_kind::scale_in_place;
    if (!in_place) poison(j);  // whatever was there before belongs to a dead tensor
    float* out = data(j);
    const std::size_t m = p.len[j];
    switch (op.kind) {
      case op_kind::source:
        for (std::size_t i = 0; i < m; ++i) out[i] = std::sin(static_cast<float>(j * 131 + i)) * 0.9f;
        break;
      case op_kind::add: {
        const float *a = data(op.a), *b = data(op.b);
        for (std::size_t i = 0; i < m; ++i) out[i] = 0.5f * (a[i] + b[i % p.len[op.b]]);
        break;
      }
      case op_kind::mul: {
        const float *a = data(op.a), *b = data(op.b);
        for (std::size_t i = 0; i < m; ++i) out[i] = a[i] * b[i % p.len[op.b]];
        break;
      }
      case op_kind::reduce: {  // a matmul-like row: 16 products summed in order
        const float *a = data(op.a), *b = data(op.b);
        for (std::size_t i = 0; i < m; ++i) {
          float s = 0.0f;
          for (std::size_t k = 0; k < 16; ++k) s += a[(i * 16 + k) % p.len[op.a]] * b[(k * 5 + i) % p.len[op.b]];
          out[i] = s / 16.0f;
        }
        break;
      }
      case op_kind::relu_in_place: {
        const float* a = data(op.a);  // the same bytes as out in the planned run
        for (std::size_t i = 0; i < m; ++i) out[i] = a[i] > 0.0f ? a[i] : 0.1f * a[i];
        break;
      }
      case op_kind::scale_in_place: {
        const float* a = data(op.a);
        for (std::size_t i = 0; i < m; ++i) out[i] = a[i] * 0.75f + 0.125f;
        break;
      }
    }
    record.emplace_back(out, out + m);
    // Free what died at this op (a tensor nobody reads dies where it is born), except the input an
    // in-place op just turned into its output.
    for (std::size_t i = 0; i <= j; ++i)
      if (p.lives[i].last == j && !(in_place && i == op.a)) poison(i);
  }
  for (std::size_t o : p.outputs) record.emplace_back(data(o), data(o) + p.len[o]);
  return record;
}

constexpr std::uint32_t poison_bits = 0x7fc0deadu;

std::vector<std::vector<float>> run_unplanned(const program& p) {
  std::vector<std::vector<float>> buf(p.ops.size());
  for (std::size_t j = 0; j < p.ops.size(); ++j) buf[j].resize(p.len[j]);
  return run_program(
      p, [&](std::size_t j) { return buf[j].data(); }, [](std::size_t) {});
}

// In `arena` at the planned offsets; a tensor's whole aligned range is poisoned when it is born
// (unless in place) and when it dies, so a plan that lets two live tensors share a byte shows up
// as a NaN or a changed value.
std::vector<std::vector<float>> run_planned(const program& p, const memory_plan& plan, std::size_t alignment, float* arena) {
  const float nan = std::bit_cast<float>(poison_bits);
  std::fill_n(arena, plan.arena_bytes / sizeof(float), nan);
  auto data = [&](std::size_t j) { return arena + plan.offset[j] / sizeof(float); };
  auto poison = [&](std::size_t j) { std::fill_n(data(j), align_up(p.len[j] * sizeof(float), alignment) / sizeof(float), nan); };
  return run_program(p, data, poison);
}

std::size_t mismatches(const std::vector<std::vector<float>>& x, const std::vector<std::vector<float>>& y) {
  std::size_t bad = 0;
  for (std::size_t k = 0; k < x.size(); ++k)
    if (x[k].size() != y[k].size() || std::memcmp(x[k].data(), y[k].data(), x[k].size() * sizeof(float)) != 0) ++bad;
  return bad;
}

// ---- tests ----

TEST_CASE("plans of random workloads never let live tensors share a byte", "[device][memory_plan]") {
  std::mt19937_64 rng(20240611);
  for (std::size_t n : {0, 1, 2, 3, 7, 40, 300, 1500}) {
    for (std::size_t long_every : {0, 3, 50}) {
      const auto t = random_workload(rng, n, long_every, n % 2 ? 0.3 : 0.1);
      for (const plan_options opt : {plan_options{}, plan_options{1, true}, plan_options{64, false}, plan_options{4096, true}}) {
        CAPTURE(n, long_every);
        const memory_plan p = plan_memory(t, opt);
        require_valid(t, p, opt);
      }
    }
  }
  const auto big = random_workload(rng, 4000, 20, 0.2);  // a few thousand, once
  require_valid(big, plan_memory(big));
}

TEST_CASE("structured workloads come within 10% of the lower bound", "[device][memory_plan][quality]") {
  struct workload {
    std::string name;
    std::vector<tensor_life> t;
  };
  // Llama shapes: TinyLlama-1.1B (dim 2048, 32 heads, 4 kv heads, ffn 5632) at seq 2048, and a
  // 7B layer (dim 4096, 32 heads, ffn 11008) at seq 1024; 4 to 12 layers.
  std::vector<workload> w;
  for (std::size_t layers : {4, 8, 12}) {
    w.push_back({std::string("tinyllama step, layers ") + std::to_string(layers), llama_training_step({1, 2048, 2048, 32, 4, 5632, 32000, layers})});
    w.push_back({std::string("llama-7b step, layers ") + std::to_string(layers), llama_training_step({1, 1024, 4096, 32, 32, 11008, 32000, layers})});
  }
  w.push_back({"mlp inference", mlp({784, 4096, 4096, 1024, 4096, 512, 10}, 256, false)});
  w.push_back({"mlp training step", mlp({784, 4096, 4096, 1024, 4096, 512, 10}, 256, true)});
  w.push_back({"mlp training step, narrowing", mlp({8192, 4096, 2048, 1024, 512, 256, 128}, 64, true)});
  w.push_back({"unet inference", unet(1, 256, 64, 4)});
  w.push_back({"unet inference, 5 levels", unet(2, 512, 32, 5)});
  // Measured (this planner, GCC 12): arena / lower bound 1.000 for every TinyLlama step, U-Net and
  // MLP here, 1.001-1.003 for the 7B steps (1.002-1.005 without in-place); arena / unplanned
  // 0.28-0.37 for the steps, 0.29-0.42 for the MLPs, 0.18-0.19 for the U-Nets. The by-size order
  // alone gave 1.125 for the MLP inference (a 1024-wide layer between 4096-wide ones finds the
  // next layer already at offset 0); the by-breadth order places it at 1.000. TESSEL_REPORT=1
  // prints each plan.
  const bool report = std::getenv("TESSEL_REPORT") != nullptr;
  for (const auto& x : w) {
    for (bool in_place : {true, false}) {
      const plan_options opt{64, in_place};
      const memory_plan p = plan_memory(x.t, opt);
      INFO(x.name << (in_place ? "" : ", no in-place") << ": " << to_string(p));
      require_valid(x.t, p, opt);
      CHECK(p.vs_lower_bound() <= 1.10);
      if (report) WARN(x.name << (in_place ? "" : ", no in-place") << ": " << to_string(p));
    }
  }
}

TEST_CASE("random interval workloads stay within a measured bound of the lower bound", "[device][memory_plan][quality]") {
  // The lower bound ignores fragmentation, so random lifetimes cannot always reach it; these
  // bounds guard against regressions. Measured: this test's 60 workloads (1000 tensors) give mean
  // 1.028, worst 1.128. Over 300 other seeds per lifetime mix, the worst at n = 1000 was 1.20
  // (1.28 at n = 100, 1.26 at n = 3000) and the means 1.00-1.09; so the bounds are worst <= 1.25
  // and mean <= 1.06, which no seed we tried at this size exceeded.
  std::mt19937_64 rng(77);
  double worst = 1.0, sum = 0.0;
  int count = 0;
  for (int seed = 0; seed < 20; ++seed) {
    for (std::size_t long_every : {0, 4, 30}) {
      const auto t = random_workload(rng, 1000, long_every, 0.0);
      const memory_plan p = plan_memory(t);
      REQUIRE(p.arena_bytes >= p.lower_bound_bytes);
      worst = std::max(worst, p.vs_lower_bound());
      sum += p.vs_lower_bound();
      ++count;
    }
  }
  WARN("memory plan, random intervals (60 x 1000 tensors): arena / lower bound mean " << sum / count << ", worst " << worst);
  CHECK(worst <= 1.25);
  CHECK(sum / count <= 1.06);
}

TEST_CASE("an elementwise chain taken in place needs one buffer", "[device][memory_plan][in_place]") {
  // x -> relu -> scale -> add bias -> ... each op the last use of its input.
  std::vector<tensor_life> t{life(1000, 0, 1, std::nullopt, "x")};
  for (std::size_t i = 1; i < 10; ++i) t.push_back(life(1000, i, i + 1, i - 1, std::string("op") + std::to_string(i)));
  const memory_plan p = plan_memory(t);
  require_valid(t, p);
  CHECK(p.arena_bytes == 1024);
  CHECK(p.lower_bound_bytes == 1024);
  CHECK(p.in_place == 9);
  for (std::size_t o : p.offset) CHECK(o == 0);
  CHECK(to_string(p).find("(9 in place)") != std::string::npos);

  // Without in-place the neighbours overlap at their shared op: two buffers, alternating.
  const memory_plan q = plan_memory(t, {64, false});
  require_valid(t, q, {64, false});
  CHECK(q.arena_bytes == 2048);
  CHECK(q.lower_bound_bytes == 2048);
  CHECK(q.in_place == 0);
  CHECK(q.unplanned_bytes == 10240);

  // A chain that shrinks keeps its first buffer's size; a zero-byte tensor takes nothing.
  const std::vector<tensor_life> s{life(1000, 0, 1), life(600, 1, 2, 0), life(0, 2, 3, 1), life(100, 0, 3)};
  const memory_plan sp = plan_memory(s);
  require_valid(s, sp);
  CHECK(sp.arena_bytes == 1024 + 128);
  CHECK(sp.offset[1] == sp.offset[0]);
  CHECK(sp.offset[2] == 0);
  CHECK(sp.in_place == 1);
}

TEST_CASE("invalid in-place requests are typed errors naming the tensor", "[device][memory_plan][errors]") {
  const auto area = "memory plan";
  using E = memory_plan_error;
  std::vector<tensor_life> t{life(100, 0, 2, std::nullopt, "x"), life(100, 2, 3, std::nullopt, "y")};
  t[1].reuse_input = 5;
  CHECK_THROWS_MATCHES(plan_memory(t), E, is_error(errc::out_of_range, area, "tensor 1 ('y'): reuse_input 5 is out of range (2 tensors)"));
  t[1].reuse_input = 1;
  CHECK_THROWS_MATCHES(plan_memory(t), E, is_error(errc::invalid_argument, area, "tensor 1 ('y'): reuse_input names the tensor itself"));
  t[1].reuse_input = std::nullopt;
  t[0].reuse_input = 1;
  CHECK_THROWS_MATCHES(plan_memory(t), E, is_error(errc::invalid_argument, area, "tensor 0 ('x'): reuse_input 1 is a later tensor"));
  t[0].reuse_input = std::nullopt;
  t[1] = life(100, 1, 3, 0, "y");  // x lives on after y's first op
  CHECK_THROWS_MATCHES(plan_memory(t), E,
                       is_error(errc::invalid_argument, area, "tensor 0 ('x') is last used at op 2, not at this tensor's first op 1"));
  t[1] = life(100, 3, 4, 0, "y");  // x died before y's first op: that is reuse, not in place
  CHECK_THROWS_MATCHES(plan_memory(t), E, is_error(errc::invalid_argument, area, "not at this tensor's first op 3"));
  t[1] = life(101, 2, 4, 0, "y");
  CHECK_THROWS_MATCHES(
      plan_memory(t), E,
      is_error(errc::invalid_argument, area, "tensor 1 ('y'): reuse_input tensor 0 ('x') has 100 bytes, fewer than this tensor's 101"));
  t[1] = life(100, 2, 4, 0, "y");
  t.push_back(life(50, 2, 2, 0, "z"));
  CHECK_THROWS_MATCHES(
      plan_memory(t), E,
      is_error(errc::invalid_argument, area, "tensor 2 ('z'): reuse_input tensor 0 ('x') is already taken in place by tensor 1 ('y')"));
  // Checked even when in-place reuse is off: the request describes the program.
  CHECK_THROWS_MATCHES(plan_memory(t, {64, false}), E, is_error(errc::invalid_argument, area, "already taken in place"));
  t.pop_back();
  CHECK_NOTHROW(plan_memory(t));
  // Unnamed tensors are named by index alone.
  const std::vector<tensor_life> u{life(8, 0, 0), life(8, 1, 1, 0)};
  CHECK_THROWS_MATCHES(plan_memory(u), E, is_error(errc::invalid_argument, area, "tensor 1: reuse_input tensor 0 is last used at op 0"));
}

TEST_CASE("bad lifetimes, alignments and sizes are typed errors", "[device][memory_plan][errors]") {
  const auto area = "memory plan";
  using E = memory_plan_error;
  const std::vector<tensor_life> back{life(8, 0, 1), life(8, 5, 4, std::nullopt, "w")};
  CHECK_THROWS_MATCHES(plan_memory(back), E,
                       is_error(errc::invalid_argument, area, "tensor 1 ('w'): last use (op 4) is before its definition (op 5)"));
  const std::vector<tensor_life> ok{life(8, 0, 1)};
  for (std::size_t a : {std::size_t{0}, std::size_t{3}, std::size_t{96}, SIZE_MAX})
    CHECK_THROWS_MATCHES(plan_memory(ok, {a, true}), E,
                         is_error(errc::invalid_argument, area, std::string("alignment ") + std::to_string(a) + " is not a power of two"));
  CHECK_THROWS_MATCHES(plan_memory({}, {0, true}), E, is_error(errc::invalid_argument, area, "alignment 0"));
  for (std::size_t a : {std::size_t{1}, std::size_t{2}, std::size_t{1} << 40}) CHECK_NOTHROW(plan_memory(ok, {a, true}));

  // Rounding up to the alignment overflows.
  const std::vector<tensor_life> huge{life(SIZE_MAX - 10, 0, 0)};
  CHECK_THROWS_MATCHES(plan_memory(huge), overflow_error, is_error(errc::overflow, "size", "memory plan: aligned tensor bytes"));
  // Each fits, the unplanned total does not (even though they never meet).
  const std::size_t half = (SIZE_MAX >> 1) + 1;
  const std::vector<tensor_life> two{life(half, 0, 0), life(half, 1, 1)};
  CHECK_THROWS_MATCHES(plan_memory(two), overflow_error, is_error(errc::overflow, "size", "memory plan: unplanned bytes"));
  // The largest size that fits plans.
  const std::vector<tensor_life> one{life(SIZE_MAX, 0, 3)};
  const memory_plan p = plan_memory(one, {1, true});
  CHECK(p.arena_bytes == SIZE_MAX);
  CHECK(p.lower_bound_bytes == SIZE_MAX);
}

TEST_CASE("a planned run gives the same bits as one buffer per tensor", "[device][memory_plan][run]") {
  for (std::uint64_t seed : {1, 2, 3, 4, 5, 6}) {
    const program prog = random_program(seed, seed % 2 ? 300 : 120);
    const auto reference = run_unplanned(prog);
    std::size_t nans = 0;
    for (const auto& r : reference)
      for (float v : r) nans += std::isnan(v);
    REQUIRE(nans == 0);  // so any NaN in the planned run is poison that leaked through
    for (const plan_options opt : {plan_options{}, plan_options{4, true}, plan_options{256, false}}) {
      CAPTURE(seed, opt.alignment, opt.allow_in_place);
      const memory_plan plan = plan_memory(prog.lives, opt);
      require_valid(prog.lives, plan, opt);
      if (opt.allow_in_place) REQUIRE(plan.in_place > 0);
      REQUIRE(plan.arena_bytes < plan.unplanned_bytes);
      std::vector<float> arena(plan.arena_bytes / sizeof(float));
      CHECK(mismatches(reference, run_planned(prog, plan, opt.alignment, arena.data())) == 0);
    }
    // The poison is what makes this a test: a plan that puts every tensor at offset 0 changes bits.
    memory_plan alias = plan_memory(prog.lives);
    std::fill(alias.offset.begin(), alias.offset.end(), std::size_t{0});
    std::size_t widest = 0;
    for (const auto& l : prog.lives) widest = std::max(widest, align_up(l.bytes, 64));
    alias.arena_bytes = widest;
    std::vector<float> arena(widest / sizeof(float));
    CHECK(mismatches(reference, run_planned(prog, alias, 64, arena.data())) > 0);
  }
}

TEST_CASE("device_buffer owns the planned arena on a host_device", "[device][memory_plan][run]") {
  host_device d(1);
  const program prog = random_program(11, 250);
  const auto reference = run_unplanned(prog);
  const memory_plan plan = plan_memory(prog.lives);
  INFO(to_string(plan));
  const auto before = d.memory().in_use;
  {
    device_buffer<float, host_device> arena(d, plan.arena_bytes / sizeof(float));
    REQUIRE(d.memory().in_use >= before + plan.arena_bytes);
    for (std::size_t off : plan.offset)  // the device's 64-byte blocks plus 64-byte offsets: aligned tensors
      REQUIRE(reinterpret_cast<std::uintptr_t>(arena.data() + off / sizeof(float)) % 64 == 0);
    CHECK(mismatches(reference, run_planned(prog, plan, 64, arena.data())) == 0);
  }
  REQUIRE(d.memory().in_use == before);
}

TEST_CASE("plans are deterministic, and 10^5 tensors plan", "[device][memory_plan]") {
  std::mt19937_64 rng(5);
  const auto t = random_workload(rng, 2000, 10, 0.2);
  const memory_plan a = plan_memory(t), b = plan_memory(t);
  CHECK(a.offset == b.offset);
  CHECK(a.arena_bytes == b.arena_bytes);

  // 100k short-lived tensors, and a 3,300-layer training step (105,607 tensors): the sizes where
  // a quadratic planner would take minutes. Checked with a sweep over the groups (brute force is
  // O(n^2) here): at every op the live groups' ranges are disjoint.
  for (int which = 0; which < 2; ++which) {
    const auto w = which == 0 ? random_workload(rng, 100000, 0, 0.2) : llama_training_step({1, 128, 256, 4, 4, 704, 1000, 3300});
    const memory_plan p = plan_memory(w);
    INFO(to_string(p));
    REQUIRE(p.offset.size() == w.size());
    CHECK(p.offset == plan_memory(w).offset);
    const auto g = groups_of(w, true);
    std::vector<std::size_t> gf(w.size(), SIZE_MAX), gl(w.size(), 0);
    for (std::size_t i = 0; i < w.size(); ++i) {
      if (w[i].bytes == 0) continue;
      gf[g[i]] = std::min(gf[g[i]], w[i].first);
      gl[g[i]] = std::max(gl[g[i]], w[i].last);
    }
    std::vector<std::size_t> starts;
    for (std::size_t i = 0; i < w.size(); ++i)
      if (g[i] == i && w[i].bytes) starts.push_back(i);
    std::sort(starts.begin(), starts.end(), [&](std::size_t x, std::size_t y) { return gf[x] < gf[y]; });
    std::multimap<std::size_t, std::size_t> ending;  // last op -> group
    std::map<std::size_t, std::size_t> occupied;     // offset -> end, of the live groups
    std::size_t overlaps = 0;
    for (std::size_t s : starts) {
      while (!ending.empty() && ending.begin()->first < gf[s]) {
        occupied.erase(p.offset[ending.begin()->second]);
        ending.erase(ending.begin());
      }
      const std::size_t lo = p.offset[s], hi = lo + align_up(w[s].bytes, 64);
      auto it = occupied.lower_bound(lo);
      if (it != occupied.end() && it->first < hi) ++overlaps;
      if (it != occupied.begin() && std::prev(it)->second > lo) ++overlaps;
      if (it != occupied.end() && it->first == lo) continue;  // counted; keep the map one entry per offset
      occupied.emplace(lo, hi);
      ending.emplace(gl[s], s);
    }
    CHECK(overlaps == 0);
    CHECK(p.arena_bytes >= p.lower_bound_bytes);
  }
}

}  // namespace tessel_test_device_memory_plan
