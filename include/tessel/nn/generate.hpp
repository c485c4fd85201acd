// Sampling the next token from a row of logits (greedy, temperature, top-k, top-p, seeded), a
// plain generation loop over any model with forward(ids, batch, seq) -> logits, and batched
// generation with a paged KV cache over a model with prefill and decode_step (nn/decoder.hpp).
//
// The plain loop re-runs the whole context for every new token (cost quadratic in the length): it
// is the reference the KV-cache generation is checked against, and enough for short samples.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include <tessel/nn/errors.hpp>

namespace tessel {
inline namespace v0 {
namespace nn {

struct sampling {
  float temperature = 1.0f;  // 0: greedy (the first largest logit)
  std::size_t top_k = 0;     // > 0: only the k largest logits
  float top_p = 1.0f;        // < 1: the smallest set of most likely tokens holding this probability
  std::uint64_t seed = 0;
};

// Counter-based uniform numbers in [0, 1): draw i of a seed is the same on every machine.
inline double uniform01(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return double(z >> 11) * 0x1.0p-53;
}

// The token drawn from `logits` with the `draw`-th random number of s.seed.
inline std::int64_t sample_token(std::span<const float> logits, const sampling& s, std::uint64_t draw) {
  if (logits.empty()) throw nn_error(errc::invalid_argument, "sample_token: no logits");
  if (!(s.temperature >= 0.0f) || !std::isfinite(s.temperature))
    throw nn_error(errc::invalid_argument, "sample_token: temperature must be finite and >= 0");
  if (!(s.top_p > 0.0f && s.top_p <= 1.0f)) throw nn_error(errc::invalid_argument, "sample_token: top_p must be in (0, 1]");
  for (float x : logits)
    if (std::isnan(x)) throw nn_error(errc::invalid_argument, "sample_token: NaN logit");
  if (s.temperature == 0.0f) return std::int64_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<std::size_t> order(logits.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return logits[a] > logits[b]; });
  std::size_t keep = s.top_k > 0 ? std::min(s.top_k, order.size()) : order.size();
  const double top = double(logits[order[0]]) / s.temperature;
  std::vector<double> p(keep);
  double sum = 0.0;
  for (std::size_t i = 0; i < keep; ++i) sum += p[i] = std::exp(double(logits[order[i]]) / s.temperature - top);
  if (s.top_p < 1.0f) {
    double acc = 0.0;
    std::size_t i = 0;
    while (i < keep && acc < double(s.top_p) * sum) acc += p[i++];
    keep = std::max<std::size_t>(i, 1);
    sum = std::accumulate(p.begin(), p.begin() + std::ptrdiff_t(keep), 0.0);
  }
  const double u = uniform01(s.seed, draw) * sum;
  double acc = 0.0;
  for (std::size_t i = 0; i < keep; ++i) {
    acc += p[i];
    if (u < acc) return std::int64_t(order[i]);
  }
  return std::int64_t(order[keep - 1]);
}

// prompt + up to max_new sampled tokens (stops after `stop` when it is >= 0). The context given to
// the model is the last `window` tokens (the model's maximum sequence).
template <class Model>
std::vector<std::int64_t> generate(Model& m, std::span<const std::int64_t> prompt, std::size_t max_new, const sampling& s, std::size_t window,
                                   std::int64_t stop = -1) {
  if (prompt.empty()) throw nn_error(errc::invalid_argument, "generate: an empty prompt");
  if (window == 0) throw nn_error(errc::invalid_argument, "generate: a zero context window");
  std::vector<std::int64_t> out(prompt.begin(), prompt.end());
  for (std::size_t i = 0; i < max_new; ++i) {
    const std::size_t n = std::min(out.size(), window);
    const std::span<const std::int64_t> ctx(out.data() + out.size() - n, n);
    const auto logits = m.forward(ctx, 1, n);
    const std::size_t V = logits.size() / n;
    const std::int64_t t = sample_token(logits.subspan((n - 1) * V, V), s, i);
    out.push_back(t);
    if (t == stop) break;
  }
  return out;
}

// Timings of a cached generation: the prefill (every prompt, one batch) and the decode steps.
struct generation_stats {
  std::size_t prefill_tokens = 0, decode_tokens = 0, decode_steps = 0;
  double prefill_seconds = 0.0, decode_seconds = 0.0;
};

// Batched generation with a KV cache: each prompt + up to max_new sampled tokens (a request stops
// after `stop` when it is >= 0). All prompts are prefilled as one batch, then every unfinished
// request decodes one token per step. Request r draws its i-th token with the i-th random number
// of its sampling's seed, as the plain loop does, so a request gives the same tokens alone as in
// a batch. `per_request` holds one sampling per prompt (the overload below shares one).
// The requests take sequences of `cache` for the call and give them back (also on an error);
// prompt + max_new - 1 tokens of each must fit m.max_length(cache) (checked before any work).
template <class Model, class Cache>
requires requires(Model& m, Cache& c, std::size_t id) {
  c.add_sequence();
  c.release(id);
  m.decode_step(c, std::span<const std::size_t>{}, std::span<const std::int64_t>{});
}
std::vector<std::vector<std::int64_t>> generate(Model& m, Cache& cache, const std::vector<std::vector<std::int64_t>>& prompts, std::size_t max_new,
                                                const std::vector<sampling>& per_request, std::int64_t stop = -1, generation_stats* stats = nullptr) {
  using clock = std::chrono::steady_clock;
  const std::size_t R = prompts.size();
  std::vector<std::vector<std::int64_t>> out(prompts.begin(), prompts.end());
  if (R == 0) throw nn_error(errc::invalid_argument, "generate: no prompts");
  if (per_request.size() != R)
    throw nn_error(errc::invalid_argument, "generate: " + std::to_string(per_request.size()) + " samplings for " + std::to_string(R) + " prompts");
  for (std::size_t r = 0; r < R; ++r) {
    if (prompts[r].empty()) throw nn_error(errc::invalid_argument, "generate: prompt " + std::to_string(r) + " is empty");
    if (max_new > 0 && prompts[r].size() + max_new - 1 > m.max_length(cache))
      throw nn_error(errc::out_of_range, "generate: prompt " + std::to_string(r) + " of " + std::to_string(prompts[r].size()) + " tokens + " +
                                             std::to_string(max_new) + " new ones exceeds the " + std::to_string(m.max_length(cache)) +
                                             " positions of the model and cache");
  }
  if (max_new == 0) return out;
  // the sequences of this call, released however it ends
  struct lease {
    Cache& c;
    std::vector<std::size_t> ids;
    ~lease() {
      for (std::size_t id : ids) c.release(id);
    }
  } seqs{cache, {}};
  for (std::size_t r = 0; r < R; ++r) seqs.ids.push_back(cache.add_sequence());
  std::vector<std::int64_t> tokens;
  std::vector<std::size_t> lengths;
  for (const auto& p : prompts) {
    tokens.insert(tokens.end(), p.begin(), p.end());
    lengths.push_back(p.size());
  }
  auto t0 = clock::now();
  auto logits =
      m.prefill(cache, std::span<const std::size_t>(seqs.ids), std::span<const std::int64_t>(tokens), std::span<const std::size_t>(lengths));
  generation_stats st;
  st.prefill_tokens = tokens.size();
  st.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  const std::size_t V = logits.size() / R;
  std::vector<std::size_t> live(R), ids;  // live: requests still generating, in request order
  std::iota(live.begin(), live.end(), std::size_t{0});
  std::vector<std::int64_t> next;
  for (std::size_t i = 0;; ++i) {
    // logits row j belongs to request live[j]; draw token i of each
    std::vector<std::size_t> still;
    next.clear();
    ids.clear();
    for (std::size_t j = 0; j < live.size(); ++j) {
      const std::size_t r = live[j];
      const std::int64_t t = sample_token(logits.subspan(j * V, V), per_request[r], i);
      out[r].push_back(t);
      if (t == stop || i + 1 == max_new) continue;
      still.push_back(r);
      next.push_back(t);
      ids.push_back(seqs.ids[r]);
    }
    live.swap(still);
    if (live.empty()) break;
    t0 = clock::now();
    logits = m.decode_step(cache, std::span<const std::size_t>(ids), std::span<const std::int64_t>(next));
    st.decode_seconds += std::chrono::duration<double>(clock::now() - t0).count();
    st.decode_tokens += ids.size();
    ++st.decode_steps;
  }
  if (stats) *stats = st;
  return out;
}
// The same with one sampling for every request.
template <class Model, class Cache>
requires requires(Model& m, Cache& c, std::size_t id) {
  c.add_sequence();
  c.release(id);
  m.decode_step(c, std::span<const std::size_t>{}, std::span<const std::int64_t>{});
}
std::vector<std::vector<std::int64_t>> generate(Model& m, Cache& cache, const std::vector<std::vector<std::int64_t>>& prompts, std::size_t max_new,
                                                const sampling& s, std::int64_t stop = -1, generation_stats* stats = nullptr) {
  return generate(m, cache, prompts, max_new, std::vector<sampling>(prompts.size(), s), stop, stats);
}

}  // namespace nn
}  // namespace v0
}  // namespace tessel
