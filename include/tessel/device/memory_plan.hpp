// The one liveness memory planner (DESIGN.md, "Memory plan"): tensors with a size and a [first,
// last] op range get offsets in one arena, so the training step's activations (nn/) and the graph
// executor (graph/) allocate one device_buffer instead of one buffer per tensor.
//
// Algorithm (greedy with best fit over lifetimes, the idea of TFLite's arena planner and of
// Pisarchyk & Lee's greedy-by-size / greedy-by-breadth, plus in-place reuse):
//  1. In-place chains merge first: a tensor whose reuse_input is allowed takes that tensor's buffer
//     (an elementwise op), so the chain is one group whose lifetime is the union and whose size is
//     its first (largest) tensor's.
//  2. Groups are placed one by one; each goes to the smallest gap that fits between the already
//     placed groups whose lifetimes overlap its own (the lowest such gap on a tie), else after the
//     highest of them. The order is by decreasing aligned size (ties: earlier first op, then lower
//     index). Unless that plan already meets the lower bound, a second order is tried too, by
//     breadth: the groups live at the widest op first, then those of the next widest, largest
//     first within one. The smaller arena wins (by size on a tie). By size alone, an MLP whose
//     narrow layer sits between wide ones planned at 1.125x the lower bound; by breadth at 1.000x.
// Every step is deterministic. Sizes are rounded up to `alignment`, so every offset is aligned;
// zero-byte tensors get offset 0 and take no space.
//
// Complexity: the overlapping groups are found with a segment tree over the (compressed) op axis
// whose nodes keep merged lists of occupied offset ranges, so a placement reads O(log n) lists
// whose total length K counts disjoint occupied runs rather than tensors, and sorts them:
// O(n log n (log n + K)). K stays small when lifetimes are short or nest the way a training step's
// do: 10^5 tensors plan in about 0.5 s (a 3,300-layer training step) to 0.7 s (random short
// lifetimes, both orders run) on this machine. When most tensors live across most of the program
// with unrelated sizes, every op has O(n) holes and K grows with n: the planner is then quadratic
// like TFLite's (2*10^4 such tensors take several seconds), because best fit must see every hole.
// Memory: O(n log n) ranges in the worst case.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <tessel/detail/checked.hpp>
#include <tessel/device/errors.hpp>

namespace tessel {
inline namespace v0 {

// One tensor's need: `bytes`, defined by op `first`, last read by op `last` (first <= last; a
// tensor nobody reads has last == first). `reuse_input` names an earlier tensor (by index) whose
// buffer this one may take in place: that tensor's last use must be this tensor's first op and it
// must be at least as large. `name` only labels errors.
struct tensor_life {
  std::size_t bytes = 0;
  std::size_t first = 0;
  std::size_t last = 0;
  std::optional<std::size_t> reuse_input = std::nullopt;
  std::string name = {};
};

struct plan_options {
  std::size_t alignment = 64;  // a power of two; every size is rounded up to it
  bool allow_in_place = true;  // false: reuse_input is still checked, but every tensor gets its own range
};

struct memory_plan {
  std::vector<std::size_t> offset;    // per tensor, in the arena
  std::size_t arena_bytes = 0;        // the arena to allocate
  std::size_t lower_bound_bytes = 0;  // max over ops of the live aligned sizes, in-place groups counted once
  std::size_t unplanned_bytes = 0;    // one aligned buffer per tensor
  std::size_t in_place = 0;           // tensors that took their input's buffer

  // arena / lower bound (>= 1; 1 when both are 0) and arena / unplanned (<= 1; 1 when both are 0).
  double vs_lower_bound() const { return ratio(arena_bytes, lower_bound_bytes); }
  double vs_unplanned() const { return ratio(arena_bytes, unplanned_bytes); }

 private:
  static double ratio(std::size_t a, std::size_t b) { return b == 0 ? 1.0 : static_cast<double>(a) / static_cast<double>(b); }
};

}  // namespace v0

namespace detail {

// A half-open offset range [begin, end).
struct plan_range {
  std::size_t begin, end;
};

// Adds `r` to a sorted list of disjoint ranges, merging it with those it overlaps or touches (the
// lists only ever answer "which offsets are occupied", so merged runs stay short).
inline void add_plan_range(std::vector<plan_range>& v, plan_range r) {
  auto it = std::lower_bound(v.begin(), v.end(), r.begin, [](const plan_range& x, std::size_t b) { return x.end < b; });
  auto j = it;
  while (j != v.end() && j->begin <= r.end) {
    r.begin = std::min(r.begin, j->begin);
    r.end = std::max(r.end, j->end);
    ++j;
  }
  if (it == j) {
    v.insert(it, r);
  } else {
    *it = r;
    v.erase(it + 1, j);
  }
}

inline std::string plan_tensor_label(std::span<const tensor_life> t, std::size_t i) {
  std::string s = std::string("tensor ") + std::to_string(i);
  if (!t[i].name.empty()) s += std::string(" ('") + t[i].name + "')";
  return s;
}

inline std::string plan_format_bytes(std::size_t b) {
  char buf[64];
  const double x = static_cast<double>(b);
  if (b < 1024)
    std::snprintf(buf, sizeof buf, "%zu B", b);
  else if (b < (std::size_t{1} << 20))
    std::snprintf(buf, sizeof buf, "%.2f KiB", x / 1024.0);
  else if (b < (std::size_t{1} << 30))
    std::snprintf(buf, sizeof buf, "%.2f MiB", x / (1024.0 * 1024.0));
  else
    std::snprintf(buf, sizeof buf, "%.2f GiB", x / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

inline std::string plan_format_ratio(double r) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3fx", r);
  return buf;
}

// An in-place group: the chain's first tensor (`root`), its aligned size, its lifetime in ops and in
// compressed coordinates [lo, hi], and the priority of the by-breadth order.
struct plan_group {
  std::size_t root, size, first, last;
  std::size_t lo = 0, hi = 0, breadth = 0, breadth_at = 0;
};

// Places `groups` one by one in `order` (see the top of the file) over `m` compressed ops; returns
// each group's offset and sets `arena` to the highest end.
//
// Overlapping groups are found with a bottom-up segment tree over the compressed ops whose nodes
// keep sorted lists of occupied offset ranges, merged: `cover`, the ranges of the groups whose
// canonical decomposition holds the node, and `sub`, those of the groups with a canonical node
// anywhere in the node's subtree. A placed group meets the new one iff one of its canonical nodes
// is in the subtree of one of the new group's (its sub list) or a proper ancestor of one (cover).
inline std::vector<std::size_t> plan_place(const std::vector<plan_group>& groups, const std::vector<std::size_t>& order, std::size_t m,
                                           std::size_t& arena) {
  constexpr std::size_t none = static_cast<std::size_t>(-1);
  std::vector<std::vector<plan_range>> cover(2 * m), sub(2 * m);
  std::vector<std::size_t> stamp(2 * m, 0);
  std::vector<std::size_t> canon, ancestors;
  std::vector<plan_range> blocked;
  std::vector<std::size_t> offset(groups.size());
  arena = 0;
  for (std::size_t k = 0; k < order.size(); ++k) {
    const plan_group& g = groups[order[k]];
    const std::size_t stamp_now = k + 1;
    canon.clear();
    ancestors.clear();
    for (std::size_t l = g.lo + m, r = g.hi + m + 1; l < r; l >>= 1, r >>= 1) {
      if (l & 1) canon.push_back(l++);
      if (r & 1) canon.push_back(--r);
    }
    for (std::size_t c : canon) stamp[c] = stamp_now;
    for (std::size_t c : canon)  // canonical nodes are disjoint, so a stamped parent is an ancestor already walked
      for (std::size_t a = c >> 1; a >= 1 && stamp[a] != stamp_now; a >>= 1) {
        stamp[a] = stamp_now;
        ancestors.push_back(a);
      }

    blocked.clear();
    for (std::size_t c : canon) blocked.insert(blocked.end(), sub[c].begin(), sub[c].end());
    for (std::size_t a : ancestors) blocked.insert(blocked.end(), cover[a].begin(), cover[a].end());
    std::sort(blocked.begin(), blocked.end(),
              [](const plan_range& x, const plan_range& y) { return x.begin < y.begin || (x.begin == y.begin && x.end < y.end); });
    // Best fit: the smallest gap that holds the group (the lowest such on a tie), else the top.
    std::size_t top = 0, best = none, best_gap = none;
    for (const plan_range& r : blocked) {
      if (r.begin > top) {
        const std::size_t gap = r.begin - top;
        if (gap >= g.size && gap < best_gap) {
          best_gap = gap;
          best = top;
        }
      }
      top = std::max(top, r.end);
    }
    const std::size_t at = best != none ? best : top;
    const plan_range placed{at, add_checked(at, g.size, "memory plan: arena bytes")};
    offset[order[k]] = at;
    arena = std::max(arena, placed.end);
    for (std::size_t c : canon) {
      add_plan_range(cover[c], placed);
      add_plan_range(sub[c], placed);
    }
    for (std::size_t a : ancestors) add_plan_range(sub[a], placed);
  }
  return offset;
}

}  // namespace detail

inline namespace v0 {

// Checks every tensor (errors name it by index and name) and plans the arena; see the top of the
// file for the algorithm. Throws memory_plan_error for a bad lifetime, reuse request or alignment,
// and overflow_error (errc::overflow) when an aligned size or the unplanned total overflows.
inline memory_plan plan_memory(std::span<const tensor_life> t, const plan_options& opt = {}) {
  const std::size_t n = t.size();
  const std::size_t align = opt.alignment;
  if (align == 0 || (align & (align - 1)) != 0) throw memory_plan_error(std::string("alignment ") + std::to_string(align) + " is not a power of two");

  constexpr std::size_t none = static_cast<std::size_t>(-1);
  std::vector<std::size_t> taken_by(n, none);
  for (std::size_t i = 0; i < n; ++i) {
    const tensor_life& x = t[i];
    if (x.last < x.first)
      throw memory_plan_error(detail::plan_tensor_label(t, i) + ": last use (op " + std::to_string(x.last) + ") is before its definition (op " +
                              std::to_string(x.first) + ")");
    if (!x.reuse_input) continue;
    const std::size_t r = *x.reuse_input;
    const std::string who = detail::plan_tensor_label(t, i);
    if (r >= n)
      throw memory_plan_error(errc::out_of_range,
                              who + ": reuse_input " + std::to_string(r) + " is out of range (" + std::to_string(n) + " tensors)");
    if (r == i) throw memory_plan_error(who + ": reuse_input names the tensor itself");
    if (r > i)
      throw memory_plan_error(who + ": reuse_input " + std::to_string(r) +
                              " is a later tensor (a tensor may only take the buffer of an earlier one)");
    const std::string input = detail::plan_tensor_label(t, r);
    if (t[r].last != x.first)
      throw memory_plan_error(who + ": reuse_input " + input + " is last used at op " + std::to_string(t[r].last) +
                              ", not at this tensor's first op " + std::to_string(x.first));
    if (t[r].bytes < x.bytes)
      throw memory_plan_error(who + ": reuse_input " + input + " has " + std::to_string(t[r].bytes) + " bytes, fewer than this tensor's " +
                              std::to_string(x.bytes));
    if (taken_by[r] != none)
      throw memory_plan_error(who + ": reuse_input " + input + " is already taken in place by " + detail::plan_tensor_label(t, taken_by[r]));
    taken_by[r] = i;
  }

  memory_plan p;
  p.offset.assign(n, 0);
  std::vector<std::size_t> size(n);
  for (std::size_t i = 0; i < n; ++i) {
    size[i] = detail::add_checked(t[i].bytes, align - 1, "memory plan: aligned tensor bytes") & ~(align - 1);
    p.unplanned_bytes = detail::add_checked(p.unplanned_bytes, size[i], "memory plan: unplanned bytes");
  }

  // 1. In-place chains: inputs come before the tensors that take them, so one pass in index order
  // finds every tensor's group. A zero-byte tensor needs no buffer and joins no group.
  std::vector<detail::plan_group> groups;
  std::vector<std::size_t> group_of(n, none);
  for (std::size_t i = 0; i < n; ++i) {
    if (size[i] == 0) continue;
    if (opt.allow_in_place && t[i].reuse_input) {
      group_of[i] = group_of[*t[i].reuse_input];
      detail::plan_group& g = groups[group_of[i]];
      g.last = std::max(g.last, t[i].last);
      ++p.in_place;
    } else {
      group_of[i] = groups.size();
      groups.push_back({i, size[i], t[i].first, t[i].last});
    }
  }
  const std::size_t ng = groups.size();
  if (ng == 0) return p;

  // The op axis, compressed to the groups' distinct endpoints: overlap only compares endpoints,
  // and the live set only grows at one of them.
  std::vector<std::size_t> coord;
  coord.reserve(2 * ng);
  for (const detail::plan_group& g : groups) {
    coord.push_back(g.first);
    coord.push_back(g.last);
  }
  std::sort(coord.begin(), coord.end());
  coord.erase(std::unique(coord.begin(), coord.end()), coord.end());
  const std::size_t m = coord.size();
  auto rank = [&](std::size_t op) { return static_cast<std::size_t>(std::lower_bound(coord.begin(), coord.end(), op) - coord.begin()); };
  for (detail::plan_group& g : groups) {
    g.lo = rank(g.first);
    g.hi = rank(g.last);
  }

  // Breadth, the live bytes at each op (a difference array); its maximum is the lower bound.
  std::vector<std::size_t> born(m, 0), died(m + 1, 0), breadth(m);
  for (const detail::plan_group& g : groups) {
    born[g.lo] = detail::add_checked(born[g.lo], g.size, "memory plan: live bytes");
    died[g.hi + 1] = detail::add_checked(died[g.hi + 1], g.size, "memory plan: live bytes");
  }
  for (std::size_t c = 0, live = 0; c < m; ++c) {
    live = detail::add_checked(live - died[c], born[c], "memory plan: live bytes");  // died[c] was born earlier
    breadth[c] = live;
    p.lower_bound_bytes = std::max(p.lower_bound_bytes, live);
  }
  // Each group's widest op (the earliest on a tie): a max segment tree over the breadths.
  {
    std::vector<std::size_t> best(2 * m);  // a compressed op
    for (std::size_t c = 0; c < m; ++c) best[m + c] = c;
    auto wider = [&](std::size_t a, std::size_t b) { return breadth[a] > breadth[b] || (breadth[a] == breadth[b] && a < b) ? a : b; };
    for (std::size_t x = m; x-- > 1;) best[x] = wider(best[2 * x], best[2 * x + 1]);
    for (detail::plan_group& g : groups) {
      std::size_t at = g.lo;
      for (std::size_t l = g.lo + m, r = g.hi + m + 1; l < r; l >>= 1, r >>= 1) {
        if (l & 1) at = wider(at, best[l++]);
        if (r & 1) at = wider(at, best[--r]);
      }
      g.breadth = breadth[at];
      g.breadth_at = at;
    }
  }

  // 2. Two greedy orders, the smaller arena wins (the by-size one on a tie). By size: largest
  // first, then earlier first op, then lower index. By breadth: the groups of the widest op first
  // (then of the next widest, ...), largest first within an op.
  std::vector<std::size_t> by_size(ng), by_breadth(ng);
  for (std::size_t g = 0; g < ng; ++g) by_size[g] = by_breadth[g] = g;
  auto size_first = [&](std::size_t a, std::size_t b) {
    const detail::plan_group& x = groups[a];
    const detail::plan_group& y = groups[b];
    if (x.size != y.size) return x.size > y.size;
    if (x.first != y.first) return x.first < y.first;
    return x.root < y.root;
  };
  std::sort(by_size.begin(), by_size.end(), size_first);
  std::sort(by_breadth.begin(), by_breadth.end(), [&](std::size_t a, std::size_t b) {
    const detail::plan_group& x = groups[a];
    const detail::plan_group& y = groups[b];
    if (x.breadth != y.breadth) return x.breadth > y.breadth;
    if (x.breadth_at != y.breadth_at) return x.breadth_at < y.breadth_at;
    return size_first(a, b);
  });
  std::size_t arena_size = 0, arena_breadth = 0;
  std::vector<std::size_t> offset = detail::plan_place(groups, by_size, m, arena_size);
  if (arena_size > p.lower_bound_bytes && by_breadth != by_size) {  // at the lower bound, nothing can beat it
    std::vector<std::size_t> other = detail::plan_place(groups, by_breadth, m, arena_breadth);
    if (arena_breadth < arena_size) {
      offset.swap(other);
      arena_size = arena_breadth;
    }
  }
  p.arena_bytes = arena_size;
  for (std::size_t i = 0; i < n; ++i)
    if (group_of[i] != none) p.offset[i] = offset[group_of[i]];
  return p;
}

// Fills with 0xff (a NaN in every float dtype) the bytes of `arena` that no tensor live across op
// k holds (made before k and read at k or later): what the ops before freed, and the outputs op k
// is about to write. A planned run poisoned before each op gives the unplanned run's bits unless a
// tensor is read outside its lifetime (graph's executor and nn's training step use it in tests).
inline void poison_free_bytes(std::span<std::byte> arena, std::span<const tensor_life> t, const memory_plan& p, std::size_t k) {
  std::vector<detail::plan_range> keep;
  for (std::size_t i = 0; i < t.size(); ++i)
    if (t[i].first < k && t[i].last >= k && t[i].bytes) keep.push_back({p.offset[i], p.offset[i] + t[i].bytes});
  std::sort(keep.begin(), keep.end(), [](const detail::plan_range& a, const detail::plan_range& b) { return a.begin < b.begin; });
  std::size_t at = 0;
  for (const detail::plan_range& r : keep) {
    if (r.begin > at) std::memset(arena.data() + at, 0xff, r.begin - at);
    at = std::max(at, r.end);
  }
  if (arena.size() > at) std::memset(arena.data() + at, 0xff, arena.size() - at);
}

// One line: "memory plan: 120 tensors (3 in place), arena 10.50 MiB = 1.021x lower bound 10.28 MiB,
// 0.310x unplanned 33.87 MiB".
inline std::string to_string(const memory_plan& p) {
  return std::string("memory plan: ") + std::to_string(p.offset.size()) + " tensors (" + std::to_string(p.in_place) + " in place), arena " +
         detail::plan_format_bytes(p.arena_bytes) + " = " + detail::plan_format_ratio(p.vs_lower_bound()) + " lower bound " +
         detail::plan_format_bytes(p.lower_bound_bytes) + ", " + detail::plan_format_ratio(p.vs_unplanned()) + " unplanned " +
         detail::plan_format_bytes(p.unplanned_bytes);
}

}  // namespace v0
}  // namespace tessel
