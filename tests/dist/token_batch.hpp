// A deterministic batch of token ids for the dist tests' tiny language models.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <tessel/nn/parameters.hpp>

namespace tessel_test {

struct token_batch {
  std::vector<std::int64_t> ids, targets;
};

// batch x seq ids in [0, vocab) drawn from `seed`; target t is the next id of its sequence, and the
// last position of each sequence is ignored (-100).
inline token_batch make_batch(std::uint64_t seed, std::size_t batch, std::size_t seq, std::size_t vocab) {
  token_batch x;
  tessel::nn::normal_rng r(seed);
  for (std::size_t i = 0; i < batch * seq; ++i) x.ids.push_back(std::int64_t(std::fabs(r() * 1000.0)) % std::int64_t(vocab));
  for (std::size_t i = 0; i < batch * seq; ++i) x.targets.push_back((i % seq + 1 < seq) ? x.ids[i + 1] : -100);
  return x;
}

}  // namespace tessel_test
