// A lifetime-planned arena (DESIGN.md, nn/: "activation memory"): the tensors of a step, each with
// its size in bytes and the interval of phases [first, last] in which it is written or read, get
// offsets in one buffer such that two tensors live in a common phase never share a byte. The plan
// is made before the step runs, from the step's lifetime table (decoder_lm builds one per batch
// shape, recompute mode and training flag); the step then fetches each tensor's place from it.
//
// Placement: the tensors in order of decreasing size (then first phase, then insertion order),
// each at the lowest 64-byte-aligned offset that no already placed tensor overlapping it in time
// covers (greedy first fit, deterministic). The arena's size is the step's planned peak; total()
// is what one buffer per tensor would take (the same rounding), the baseline it is reported
// against. solve(false) places every tensor in its own bytes (total() == size()): the reference
// layout the planned one is checked against bit for bit.
//
// free_ranges(phase) lists the bytes no tensor live in `phase` covers: a test fills them with NaN
// at each phase boundary, so a tensor read outside its planned interval reads NaN (and changes the
// step's bits) instead of a stale value that happens to be right.
#pragma once

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include <tessel/detail/checked.hpp>
#include <tessel/nn/errors.hpp>

namespace tessel {
inline namespace v0 {
namespace nn {

class arena_plan {
 public:
  static constexpr std::size_t alignment = 64;

  // A tensor of `bytes` live from phase `first` to phase `last` (inclusive); returns its id (ids
  // count from 0 in insertion order). Invalidates a previous solve().
  std::size_t add(std::size_t bytes, std::size_t first, std::size_t last) {
    if (first > last)
      throw nn_error(errc::invalid_argument,
                     "arena_plan: tensor " + std::to_string(t_.size()) + " lives from phase " + std::to_string(first) + " to " + std::to_string(last));
    const std::size_t rounded = detail::mul_checked(detail::add_checked(bytes, alignment - 1, "arena tensor bytes") / alignment, alignment,
                                                    "arena tensor bytes");
    t_.push_back({rounded, first, last, 0});
    total_ = detail::add_checked(total_, rounded, "arena total bytes");
    phases_ = std::max(phases_, last + 1);
    solved_ = false;
    return t_.size() - 1;
  }

  void solve(bool reuse = true) {
    size_ = 0;
    if (!reuse) {
      std::size_t off = 0;
      for (tensor& t : t_) {
        t.offset = off;
        off += t.bytes;  // within total_, checked in add()
      }
      size_ = off;
      solved_ = true;
      return;
    }
    std::vector<std::size_t> order(t_.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      if (t_[a].bytes != t_[b].bytes) return t_[a].bytes > t_[b].bytes;
      return t_[a].first < t_[b].first;
    });
    std::vector<std::size_t> placed;
    std::vector<std::pair<std::size_t, std::size_t>> busy;  // [begin, end) of placed tensors overlapping in time
    for (std::size_t id : order) {
      tensor& t = t_[id];
      busy.clear();
      for (std::size_t p : placed)
        if (overlap(t_[p], t) && t_[p].bytes) busy.emplace_back(t_[p].offset, t_[p].offset + t_[p].bytes);
      std::sort(busy.begin(), busy.end());
      std::size_t off = 0;
      for (const auto& [b, e] : busy) {
        if (b >= off + t.bytes) break;  // the gap before this range holds the tensor
        off = std::max(off, e);
      }
      t.offset = off;
      size_ = std::max(size_, off + t.bytes);  // <= total_: a tensor never lands past every other
      placed.push_back(id);
    }
    solved_ = true;
  }

  std::size_t tensors() const noexcept { return t_.size(); }
  std::size_t phases() const noexcept { return phases_; }
  bool solved() const noexcept { return solved_; }
  std::size_t bytes(std::size_t id) const { return at(id).bytes; }
  std::size_t first(std::size_t id) const { return at(id).first; }
  std::size_t last(std::size_t id) const { return at(id).last; }
  std::size_t offset(std::size_t id) const {
    if (!solved_) throw nn_error(errc::invalid_argument, "arena_plan: offset() before solve()");
    return at(id).offset;
  }
  // The arena's bytes (the planned peak) and one buffer per tensor's.
  std::size_t size() const noexcept { return size_; }
  std::size_t total() const noexcept { return total_; }
  // The most bytes live in any one phase: no placement can take less than this.
  std::size_t live_peak() const {
    std::size_t best = 0;
    for (std::size_t ph = 0; ph < phases_; ++ph) {
      std::size_t s = 0;
      for (const tensor& t : t_)
        if (t.first <= ph && ph <= t.last) s += t.bytes;
      best = std::max(best, s);
    }
    return best;
  }

  // The byte ranges [begin, end) of the arena that no tensor live in `phase` covers, in order.
  std::vector<std::pair<std::size_t, std::size_t>> free_ranges(std::size_t phase) const {
    if (!solved_) throw nn_error(errc::invalid_argument, "arena_plan: free_ranges() before solve()");
    std::vector<std::pair<std::size_t, std::size_t>> live, out;
    for (const tensor& t : t_)
      if (t.first <= phase && phase <= t.last && t.bytes) live.emplace_back(t.offset, t.offset + t.bytes);
    std::sort(live.begin(), live.end());
    std::size_t at = 0;
    for (const auto& [b, e] : live) {
      if (b > at) out.emplace_back(at, b);
      at = std::max(at, e);
    }
    if (at < size_) out.emplace_back(at, size_);
    return out;
  }

 private:
  struct tensor {
    std::size_t bytes, first, last, offset;
  };
  static bool overlap(const tensor& a, const tensor& b) { return a.first <= b.last && b.first <= a.last; }
  const tensor& at(std::size_t id) const {
    if (id >= t_.size()) throw nn_error(errc::out_of_range, "arena_plan: no tensor " + std::to_string(id));
    return t_[id];
  }

  std::vector<tensor> t_;
  std::size_t total_ = 0, size_ = 0, phases_ = 0;
  bool solved_ = false;
};

}  // namespace nn
}  // namespace v0
}  // namespace tessel
