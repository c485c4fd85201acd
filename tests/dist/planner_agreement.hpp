// The planner's proof: its predicted step time against the timing-only step on the emulator
// (dist/timing_step.hpp) for a list of layouts of one request. Shared by the default test (a few
// small layouts, tests/dist/planner_agreement.cpp) and the slow table (30 layouts over model sizes
// and 16-128 cards, tests/dist/planner_agreement_slow.cpp).
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <tessel/dist/planner.hpp>
#include <tessel/dist/timing_step.hpp>

namespace tessel_test {

struct agreement_row {
  tessel::dist::plan_layout layout;
  std::string name;
  double predicted = 0, measured = 0;
  double error() const { return predicted / measured - 1; }
};

// A Llama-shaped model small enough to simulate quickly: `layers` layers of width `hidden`.
inline tessel::io::model_config agreement_model(std::size_t layers, std::size_t hidden, std::size_t heads, std::size_t kv_heads) {
  auto c = tessel::io::load_model_config(std::filesystem::path(__FILE__).parent_path().parent_path() / "io" / "fixtures" / "llama-3.1-8b.json");
  c.num_hidden_layers = layers;
  c.hidden_size = hidden;
  c.intermediate_size = hidden * 7 / 2 / 64 * 64;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = hidden / heads;
  c.vocab_size = 32000;
  return c;
}

// A request for `cards` cards of one super-node (the UBL128 card and fabric figures).
inline tessel::dist::plan_request agreement_request(tessel::io::model_config model, std::size_t cards, std::size_t batch, std::size_t seq) {
  tessel::dist::plan_request r;
  r.model = std::move(model);
  r.cluster.cards_per_supernode = cards;
  r.global_batch = batch;
  r.seq = seq;
  return r;
}

inline tessel::dist::plan_layout agreement_layout(const tessel::dist::plan_request& r, int dp, int tp, int pp, std::size_t mb, int zero,
                                                  tessel::dist::recompute_mode rc, bool sp) {
  tessel::dist::plan_layout l;
  l.dp = dp, l.tp = tp, l.pp = pp, l.micro_batch = mb, l.micro_batches = r.global_batch / std::size_t(dp) / mb;
  l.zero = zero, l.recompute = rc, l.sp = sp;
  return l;
}

inline agreement_row agreement_run(const tessel::dist::plan_request& r, const tessel::dist::plan_layout& l) {
  agreement_row row;
  row.layout = l;
  row.name = std::to_string(r.cards ? r.cards : r.cluster.cards()) + " cards, " + std::to_string(r.model.num_hidden_layers) + "x" +
             std::to_string(r.model.hidden_size) + ": " + l.to_string();
  row.predicted = tessel::dist::plan_evaluate(r, l).step_time;
  row.measured = tessel::dist::timing_step(r, l).step_time;
  return row;
}

// Kendall's tau-b of two orderings (ties count neither way).
inline double kendall_tau(const std::vector<double>& a, const std::vector<double>& b) {
  double concordant = 0, discordant = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t j = i + 1; j < a.size(); ++j) {
      const double x = (a[i] - a[j]) * (b[i] - b[j]);
      if (x > 0)
        ++concordant;
      else if (x < 0)
        ++discordant;
    }
  const double n = concordant + discordant;
  return n > 0 ? (concordant - discordant) / n : 1.0;
}

// Prints the table and checks mean |error| <= 5%, max <= 10%; for the rows of one request (same
// `group`), Kendall tau >= 0.9 and the planner's choice within 3% of the emulator's best.
inline void agreement_check(const std::vector<agreement_row>& rows, const std::vector<int>& group) {
  double sum = 0, worst = 0;
  for (const auto& r : rows) {
    std::printf("  %-78s planned %10.4f ms  emulated %10.4f ms  %+6.2f%%\n", r.name.c_str(), r.predicted * 1e3, r.measured * 1e3, 100 * r.error());
    sum += std::abs(r.error());
    worst = std::max(worst, std::abs(r.error()));
  }
  const double mean = sum / double(rows.size());
  std::printf("  %zu layouts: mean |error| %.2f%%, max %.2f%%\n", rows.size(), 100 * mean, 100 * worst);
  CHECK(mean <= 0.05);
  CHECK(worst <= 0.10);
  for (int g = 0; g <= *std::max_element(group.begin(), group.end()); ++g) {
    std::vector<double> p, m;
    for (std::size_t i = 0; i < rows.size(); ++i)
      if (group[i] == g) p.push_back(rows[i].predicted), m.push_back(rows[i].measured);
    if (p.size() < 2) continue;
    const double tau = kendall_tau(p, m);
    const std::size_t pick = std::size_t(std::min_element(p.begin(), p.end()) - p.begin());
    const double best = *std::min_element(m.begin(), m.end());
    std::printf("  request %d: %zu layouts, Kendall tau %.3f, the planner's choice is %.2f%% from the emulator's best\n", g, p.size(), tau,
                100 * (m[pick] / best - 1));
    INFO("request " << g);
    CHECK(tau >= 0.9);
    CHECK(m[pick] <= 1.03 * best);
  }
}

}  // namespace tessel_test
