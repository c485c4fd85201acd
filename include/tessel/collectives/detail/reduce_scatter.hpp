// Reduce-scatter: the direct fold, the pipelined chain (ring), halving-doubling (Rabenseifner's
// schedule moving raw contributions) and the tree variant. Each owner folds in rank order.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include <tessel/arch/copy.hpp>
#include <tessel/collectives/detail/coll_ctx.hpp>
#include <tessel/collectives/detail/tree.hpp>

namespace tessel::detail {

// direct: every rank sends block q to its owner q, which folds the n contributions in rank order.
inline void rs_direct(coll_ctx& c, const std::byte* send, std::byte* out, dtype d, reduce_op op, const std::vector<std::size_t>& off) {
  const std::size_t es = dtype_size(d);
  const int r = c.rank;
  const tag_t tag = c.tag + 1;
  for (int q = 0; q < c.n; ++q)
    if (q != r) c.send(q, tag, send + off[q] * es, (off[q + 1] - off[q]) * es);
  const std::size_t m = off[r + 1] - off[r];
  const std::byte* local = send + off[r] * es;
  const bool local_early = r < 2;
  auto acc = place_acc(d, out, m, local_early || !overlaps(out, m * es, local, m * es));
  std::vector<fold_src> seq(static_cast<std::size_t>(c.n));
  for (int q = 0; q < c.n; ++q) seq[q] = q == r ? fold_src{-1, local, false} : fold_src{q, nullptr, false};
  ordered_fold(c, d, op, seq, acc.p, m, tag);
  finalize_kernel(op, d, c.n, acc.p, out, m);
  c.wait_all();
}

// ring: a pipelined chain. The partial of each segment starts as rank 0's raw data, visits ranks
// 1, 2, ..., n-1 in ring order (each folds its own data in), and is complete on rank n-1.
// `final_out` gets the result on rank n-1. Returns after the rank's part of every segment.
inline void chain_reduce(coll_ctx& c, const std::byte* send, dtype d, reduce_op op, std::size_t lo, std::size_t hi, std::byte* acc_space,
                         std::byte* final_out, tag_t tag) {
  const std::size_t es = dtype_size(d), as = dtype_size(accumulator_dtype(d));
  const int k = c.rank, n = c.n;
  const std::size_t m = hi - lo;
  if (k == 0) {
    c.send(1, tag, send + lo * es, m * es);
    return;
  }
  std::vector<fold_src> seq{fold_src{k - 1, nullptr, k >= 2}, fold_src{-1, send + lo * es, false}};
  ordered_fold(c, d, op, seq, acc_space, m, tag);
  if (k < n - 1)
    c.send(k + 1, tag, acc_space, m * as);
  else
    finalize_kernel(op, d, n, acc_space, final_out, m);
}

// halving-doubling (Rabenseifner's schedule), moving raw contributions so that the owner of each
// block can fold in rank order. Result: core rank q holds blocks [range[q].first, range[q].second).
struct hd_plan {
  int p = 1;                                             // core ranks (largest power of two <= n)
  std::vector<int> dists;                                // halving distances p/2, ..., 1
  std::vector<std::vector<std::pair<int, int>>> ranges;  // ranges[s][q] after step s (s=0: before any)
  std::vector<std::vector<std::vector<int>>> sets;       // sets[s][q]: sources core q holds after step s
};
inline hd_plan make_hd_plan(int n) {
  hd_plan h;
  while (h.p * 2 <= n) h.p *= 2;
  std::vector<std::pair<int, int>> rg(static_cast<std::size_t>(h.p), {0, n});
  std::vector<std::vector<int>> st(static_cast<std::size_t>(h.p));
  for (int q = 0; q < h.p; ++q) {
    st[q].push_back(q);
    if (q + h.p < n) st[q].push_back(q + h.p);
  }
  h.ranges.push_back(rg);
  h.sets.push_back(st);
  for (int dd = h.p / 2; dd >= 1; dd /= 2) {
    h.dists.push_back(dd);
    auto nr = rg;
    auto ns = st;
    for (int q = 0; q < h.p; ++q) {
      const auto [bl, bh] = rg[q];
      const int mid = bl + (bh - bl) / 2;
      nr[q] = (q & dd) == 0 ? std::pair{bl, mid} : std::pair{mid, bh};
      ns[q].insert(ns[q].end(), st[q ^ dd].begin(), st[q ^ dd].end());
      std::sort(ns[q].begin(), ns[q].end());
    }
    rg = nr;
    st = ns;
    h.ranges.push_back(rg);
    h.sets.push_back(st);
  }
  return h;
}

// Runs the halving phase; core ranks fold their final block range into `out_full` (indexed like the
// whole buffer: element i at out_full + i*es), extra ranks only send their data. Returns the plan.
inline hd_plan hd_halving(coll_ctx& c, const std::byte* send, std::byte* out_full, dtype d, reduce_op op, const std::vector<std::size_t>& off) {
  const std::size_t es = dtype_size(d);
  const std::size_t count = off.back();
  hd_plan h = make_hd_plan(c.n);
  const int r = c.rank;
  const tag_t tag = c.tag + 2;
  if (r >= h.p) {
    c.send(r - h.p, tag, send, count * es);
    return h;
  }
  struct contrib {
    int src;
    const std::byte* ptr;
    std::size_t origin;  // element index stored at ptr
  };
  std::vector<scratch> store;
  std::vector<contrib> mine{{r, send, 0}};
  if (r + h.p < c.n) {
    store.emplace_back(count * es);
    c.tp.recv_into(r + h.p, tag, {store.back().data(), count * es});
    mine.push_back({r + h.p, store.back().data(), 0});
  }
  for (std::size_t s = 0; s < h.dists.size(); ++s) {
    const int dd = h.dists[s], partner = r ^ dd;
    const auto keep = h.ranges[s + 1][r], give = h.ranges[s + 1][partner];
    const std::size_t give_lo = off[give.first], give_n = off[give.second] - give_lo;
    const std::size_t keep_lo = off[keep.first], keep_n = off[keep.second] - keep_lo;
    store.emplace_back(mine.size() * give_n * es);
    std::byte* ob = store.back().data();
    for (std::size_t j = 0; j < mine.size(); ++j)
      if (give_n) copy_bytes(ob + j * give_n * es, mine[j].ptr + (give_lo - mine[j].origin) * es, give_n * es);
    c.send(partner, tag + 1 + s, ob, mine.size() * give_n * es);
    const auto& ps = h.sets[s][partner];
    store.emplace_back(ps.size() * keep_n * es);
    std::byte* ib = store.back().data();
    c.tp.recv_into(partner, tag + 1 + s, {ib, ps.size() * keep_n * es});
    for (std::size_t j = 0; j < ps.size(); ++j) mine.push_back({ps[j], ib + j * keep_n * es, keep_lo});
    std::sort(mine.begin(), mine.end(), [](const contrib& a, const contrib& b) { return a.src < b.src; });
  }
  const auto fin = h.ranges.back()[r];
  const std::size_t lo = off[fin.first], m = off[fin.second] - lo;
  std::vector<fold_src> seq;
  for (auto& x : mine) seq.push_back({-1, x.ptr + (lo - x.origin) * es, false});
  scratch acc(m * dtype_size(accumulator_dtype(d)));
  ordered_fold(c, d, op, seq, acc.data(), m, tag);
  c.wait_all();  // partners hold copies; our own send buffer may now be overwritten
  finalize_kernel(op, d, c.n, acc.data(), out_full + lo * es, m);
  return h;
}

inline void rs_ring(coll_ctx& c, const std::byte* send, std::byte* out, dtype d, reduce_op op, const std::vector<std::size_t>& off) {
  const std::size_t es = dtype_size(d), as = dtype_size(accumulator_dtype(d));
  const int k = c.rank, n = c.n;
  const std::size_t count = off.back();
  scratch acc(k == 0 ? 0 : count * as);
  scratch res(k == n - 1 ? count * es : 0);
  const tag_t tr = c.tag + 12, tf = c.tag + 13;
  for (int b = 0; b < n; ++b) {
    const std::size_t lo = off[b], hi = off[b + 1];
    std::byte* target = b == n - 1 ? out : (k == n - 1 ? res.data() + lo * es : nullptr);
    chain_reduce(c, send, d, op, lo, hi, k == 0 ? nullptr : acc.data() + lo * as, target, tr);
    if (k == n - 1 && b != n - 1) c.send(b, tf, target, (hi - lo) * es);
  }
  c.wait_all();
  if (k != n - 1) c.tp.recv_into(n - 1, tf, {out, (off[k + 1] - off[k]) * es});
}

inline void rs_hd(coll_ctx& c, const std::byte* send, std::byte* out, dtype d, reduce_op op, const std::vector<std::size_t>& off) {
  const std::size_t es = dtype_size(d);
  const std::size_t count = off.back();
  const int r = c.rank;
  hd_plan probe = make_hd_plan(c.n);
  scratch full(r < probe.p ? count * es : 0);
  const hd_plan h = hd_halving(c, send, full.data(), d, op, off);
  c.wait_all();
  auto holder = [&](int b) {
    for (int q = 0; q < h.p; ++q)
      if (h.ranges.back()[q].first <= b && b < h.ranges.back()[q].second) return q;
    throw comm_error(errc::invalid_argument, "halving-doubling lost a block");
  };
  const tag_t tf = c.tag + 50;
  if (r < h.p) {
    const auto fin = h.ranges.back()[r];
    for (int b = fin.first; b < fin.second; ++b) {
      const std::size_t lo = off[b], m = off[b + 1] - lo;
      if (b == r) {
        copy_bytes(out, full.data() + lo * es, m * es);
      } else {
        c.send(b, tf, full.data() + lo * es, m * es);
      }
    }
  }
  if (holder(r) != r) c.tp.recv_into(holder(r), tf, {out, (off[r + 1] - off[r]) * es});
  c.wait_all();
}

inline void rs_tree(coll_ctx& c, const std::byte* send, std::byte* out, dtype d, reduce_op op, const std::vector<std::size_t>& off) {
  const std::size_t es = dtype_size(d);
  const std::size_t count = off.back();
  scratch g = tree_gather(c, send, count * es, 0, c.tag + 14);
  const tag_t tf = c.tag + 15;
  if (c.rank == 0) {
    scratch full(count * es);
    fold_gathered(c, g, count, d, op, 0, full.data());
    for (int q = 1; q < c.n; ++q) c.send(q, tf, full.data() + off[q] * es, (off[q + 1] - off[q]) * es);
    copy_bytes(out, full.data(), off[1] * es);
    c.wait_all();
  } else {
    c.tp.recv_into(0, tf, {out, (off[c.rank + 1] - off[c.rank]) * es});
  }
}

}  // namespace tessel::detail
