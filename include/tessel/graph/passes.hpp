// graph::optimize: constant folding, CSE, dead-code removal and the pattern fusions, run in an order
// where each fusion sees the ops it builds on (norms and GELU before the matmul epilogues, attention
// before the matmuls it consumes, skip norms before residual adds become matmul epilogues), repeated
// to a fixed point; and the fusion report it returns (nodes by op before and after, each pattern's
// count, the reduction).
#pragma once

#include <cstddef>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <string_view>

#include <tessel/graph/fold.hpp>
#include <tessel/graph/fusion.hpp>
#include <tessel/graph/ir.hpp>
#include <tessel/graph/shape_inference.hpp>

namespace tessel {
inline namespace v0 {
namespace graph {

struct optimize_options {
  fold_options fold;
  bool fold_constants = true;
  bool eliminate_common_subexpressions = true;
  bool fuse = true;
  // Rounds of all passes at most; optimize stops earlier when a round changes nothing.
  std::size_t max_rounds = 8;
};

struct fusion_report {
  using counts = std::map<std::string, std::size_t, std::less<>>;
  counts ops_before, ops_after;  // live nodes by op
  counts patterns;               // fused pattern -> how many times
  std::size_t nodes_before = 0, nodes_after = 0;
  std::size_t folded = 0;  // nodes replaced by constants
  std::size_t merged = 0;  // constants and nodes merged by CSE
  std::size_t dead = 0;    // nodes removed as dead
  std::size_t rounds = 0;

  std::size_t pattern(std::string_view name) const {
    auto it = patterns.find(name);
    return it == patterns.end() ? 0 : it->second;
  }
  static std::size_t count(const counts& c, std::string_view op) {
    auto it = c.find(op);
    return it == c.end() ? 0 : it->second;
  }
  // The share of nodes that went, in percent (0 for an empty graph).
  double reduction_percent() const {
    if (nodes_before == 0) return 0.0;
    return 100.0 * (static_cast<double>(nodes_before) - static_cast<double>(nodes_after)) / static_cast<double>(nodes_before);
  }

  // A summary line, the op table (before, after) and the pattern table.
  std::string to_string() const {
    char buf[160];
    std::snprintf(buf, sizeof buf, "nodes: %zu -> %zu (-%.1f%%) in %zu rounds; folded %zu, merged %zu, dead %zu\n", nodes_before, nodes_after,
                  reduction_percent(), rounds, folded, merged, dead);
    std::string s = buf;
    std::snprintf(buf, sizeof buf, "%-26s %7s %7s\n", "op", "before", "after");
    s += buf;
    counts all = ops_before;
    for (const auto& [op, n] : ops_after) all.emplace(op, 0);
    for (const auto& [op, n] : all) {
      (void)n;
      std::snprintf(buf, sizeof buf, "%-26s %7zu %7zu\n", op.c_str(), count(ops_before, op), count(ops_after, op));
      s += buf;
    }
    std::snprintf(buf, sizeof buf, "%-26s %7s\n", "fused pattern", "count");
    s += buf;
    for (const auto& [p, n] : patterns) {
      std::snprintf(buf, sizeof buf, "%-26s %7zu\n", p.c_str(), n);
      s += buf;
    }
    return s;
  }
};

// Runs every pass until a round changes nothing (or max_rounds), then verifies the graph and infers
// its shapes. Ops without a shape rule are left alone (their outputs stay unknown).
inline fusion_report optimize(graph& g, const optimize_options& opt = {}) {
  fusion_report r;
  g.verify();
  const infer_options lenient{.allow_unknown_ops = true};
  r.ops_before = g.count_by_op();
  r.nodes_before = g.node_count();
  g.infer_shapes(lenient);
  auto record = [&](const char* name, std::size_t n) {
    if (n) r.patterns[name] += n;
    return n;
  };
  for (std::size_t round = 0; round < opt.max_rounds; ++round) {
    std::size_t changed = 0;
    if (opt.fold_constants) {
      const std::size_t f = fold_constants(g, opt.fold);
      r.folded += f;
      changed += f;
    }
    if (opt.eliminate_common_subexpressions) {
      const std::size_t m = eliminate_common_subexpressions(g);
      r.merged += m;
      changed += m;
    }
    const std::size_t d = remove_dead_code(g);
    r.dead += d;
    changed += d;
    g.infer_shapes(lenient);
    if (opt.fuse) {
      // Each family sees the shapes of what the one before built.
      auto step = [&](std::size_t n) {
        if (n) g.infer_shapes(lenient);
        changed += n;
      };
      step(record("LayerNormalization", fuse_layer_norm(g)));
      step(record("RMSNormalization", fuse_rms_norm(g)));
      step(record("Gelu", fuse_gelu_erf(g)));
      step(record("GeluTanh", fuse_gelu_tanh(g)));
      step(record("RotaryEmbedding", fuse_rotary(g)));
      step(record("Attention", fuse_attention(g)));
      std::size_t rms = 0;
      const std::size_t skip = fuse_skip_norm(g, &rms);
      record("SkipLayerNormalization", skip - rms);
      record("SkipRMSNormalization", rms);
      step(skip);
      step(record("FusedConv", fuse_conv(g)));
      step(record("FusedMatMul", fuse_matmul(g)));
    }
    ++r.rounds;
    if (changed == 0) break;
  }
  r.dead += remove_dead_code(g);
  g.infer_shapes(lenient);
  g.verify();
  r.ops_after = g.count_by_op();
  r.nodes_after = g.node_count();
  return r;
}

}  // namespace graph
}  // namespace v0
}  // namespace tessel
