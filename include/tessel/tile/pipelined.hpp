// `pipelined(n)`: the K loop of a tile program. Iterating yields stages k = 0..n-1 that convert
// to their index and know the next one, so a program can `prefetch` tile k+1 while computing k
// (on CPUs the overlap comes from the caches' prefetchers; `Depth` is how far ahead to hint).
#pragma once

#include <cstddef>

namespace tessel {
inline namespace v0 {

struct stage {
  std::size_t index, count;
  constexpr operator std::size_t() const { return index; }
  constexpr bool has_next() const { return index + 1 < count; }
  constexpr std::size_t next() const { return index + 1; }
  constexpr bool first() const { return index == 0; }
  constexpr bool last() const { return index + 1 == count; }
};

template <std::size_t Depth = 1>
class pipelined_range {
 public:
  constexpr explicit pipelined_range(std::size_t n) : n_(n) {}
  struct iterator {
    std::size_t i, n;
    constexpr stage operator*() const { return {i, n}; }
    constexpr iterator& operator++() {
      ++i;
      return *this;
    }
    constexpr bool operator!=(const iterator& o) const { return i != o.i; }
    constexpr bool operator==(const iterator& o) const { return i == o.i; }
  };
  constexpr iterator begin() const { return {0, n_}; }
  constexpr iterator end() const { return {n_, n_}; }
  constexpr std::size_t size() const { return n_; }
  static constexpr std::size_t depth = Depth;

 private:
  std::size_t n_;
};

template <std::size_t Depth = 1>
constexpr pipelined_range<Depth> pipelined(std::size_t n) {
  return pipelined_range<Depth>(n);
}

}  // namespace v0
}  // namespace tessel
