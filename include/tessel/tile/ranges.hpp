// Contiguous ranges of a 1-D index space for streaming (memory-bound) tile programs: a list of
// tensors of mixed sizes is cut into fixed-size chunks, one block each. Chunk boundaries depend only
// on the sizes (never on the thread count), so per-chunk partial reductions combined in chunk
// order give the same bits on any device and any number of workers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <tessel/tile/errors.hpp>

namespace tessel {
inline namespace v0 {

// One chunk: elements [begin, end) of tensor `tensor`.
struct chunk_range {
  std::size_t tensor = 0, begin = 0, end = 0;
  std::size_t size() const { return end - begin; }
};

// Default chunk: 64 Ki elements (256 KiB of f32): large enough that a block amortises its
// scheduling, small enough that two workers balance on a few MiB.
inline constexpr std::size_t default_stream_chunk = std::size_t{1} << 16;

// Chunks of at most `chunk` elements covering each size in `sizes` in order; a tensor with a unit
// (row) length u > 0 is cut at multiples of u so that whole units stay inside one chunk.
inline std::vector<chunk_range> make_chunks(const std::vector<std::size_t>& sizes, std::size_t chunk = default_stream_chunk,
                                            const std::vector<std::size_t>& units = {}) {
  if (chunk == 0) throw tile_error(errc::invalid_argument, "make_chunks: chunk size must be positive");
  std::vector<chunk_range> out;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const std::size_t u = t < units.size() ? units[t] : 0;
    std::size_t step = chunk;
    if (u > 0) step = (chunk / u > 0 ? chunk / u : 1) * u;
    for (std::size_t b = 0; b < sizes[t]; b += step) out.push_back({t, b, sizes[t] - b < step ? sizes[t] : b + step});
  }
  return out;
}

// Part `i` of `parts` near-equal contiguous ranges of [0, n) (for splitting rows over workers).
inline chunk_range split_even(std::size_t n, std::size_t parts, std::size_t i) {
  if (parts == 0 || i >= parts) throw tile_error(errc::out_of_range, "split_even part " + std::to_string(i) + " of " + std::to_string(parts));
  const std::size_t q = n / parts, r = n % parts;
  const std::size_t b = i * q + (i < r ? i : r);
  return {0, b, b + q + (i < r ? 1 : 0)};
}

}  // namespace v0
}  // namespace tessel
