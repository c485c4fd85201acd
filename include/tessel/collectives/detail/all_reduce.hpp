// All-reduce: direct over a shared address space (threads, with streaming stores above the
// last-level cache), direct pipelined by segments, the ring (with posted receives on a modelled
// fabric), halving-doubling, tree and hierarchical (super-nodes). Built on the reduce-scatter,
// all-gather and tree blocks.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <tessel/arch/copy.hpp>
#include <tessel/collectives/detail/all_gather.hpp>
#include <tessel/collectives/detail/coll_ctx.hpp>
#include <tessel/collectives/detail/reduce_scatter.hpp>
#include <tessel/collectives/detail/tree.hpp>

namespace tessel::detail {

// direct all-reduce over a shared address space (threads): every rank posts the addresses of its
// buffers to every peer; the owner of block r reads block r of every rank's input in place, folds it
// in rank order and writes the result straight into every rank's output, chunk by chunk (all reads
// of a chunk before its writes, so in-place works). For n = 2 that is 2S read and 2S written in all,
// the minimum, with one message each way instead of a pipeline of them. A peer's buffers are used
// only inside the receive of its address message, which keeps that send pending: the peer cannot
// return, or be unwound by a failure, while this rank is inside its memory. Completion is that same
// send's: its wait returns once the peer's receive (and so all its work on our buffers) is over,
// and throws if the peer's consumer threw part-way (the threads transport's guarantee; it is what
// makes a second "done" round unnecessary). Returns false, on every rank alike (all see the same
// addresses), when buffers of different ranks overlap.
//
// When the buffers are far larger than the last-level cache, f32/f64 sums (gradients) run as one
// fused pass that loads every input and writes every output with streaming stores: ordinary stores
// read each destination line before writing it (write-allocate), 3 bytes of traffic per byte
// written, so 6S in all for n = 2 instead of the minimal 4S. Other types and ops keep ordinary
// stores: folding a chunk into L1 and then stream-copying it (reads and writes in separate phases)
// measured slower than ordinary stores (2 threads, 64 MiB f32: 9.6 vs 10.4 GiB/s; fused 13.1).
struct shared_bufs {
  const std::byte* send;
  std::byte* recv;
};
// The L3 this CPU shares with its neighbours: sysfs first, since in a VM sysconf can report the
// sum over the host's L3 slices (384 MiB on this one, against 32 MiB actually shared).
inline std::size_t last_level_cache_bytes() {
  static const std::size_t v = [] {
    std::size_t b = 0;
#if defined(__linux__)
    if (std::FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
      unsigned long x = 0;
      char unit = 0;
      if (std::fscanf(f, "%lu%c", &x, &unit) >= 1) b = std::size_t{x} << (unit == 'K' ? 10 : unit == 'M' ? 20 : 0);
      std::fclose(f);
    }
#endif
#if defined(_SC_LEVEL3_CACHE_SIZE)
    if (!b) b = static_cast<std::size_t>(std::max(0L, ::sysconf(_SC_LEVEL3_CACHE_SIZE)));
#endif
    return b ? b : std::size_t{32} << 20;
  }();
  return v;
}
// Streaming stores are used when 2nS exceeds this many bytes; 0 (default): the last-level cache.
// Benchmarks and tests set it to compare the two paths or to reach the streaming one with small
// buffers; SIZE_MAX turns streaming off.
inline std::atomic<std::size_t> ar_stream_above{0};
inline bool ar_direct_shared(coll_ctx& c, const std::byte* send, std::byte* recv, std::size_t count, dtype d, reduce_op op) {
  const int r = c.rank, n = c.n;
  const std::size_t es = dtype_size(d), as = dtype_size(accumulator_dtype(d)), bytes = count * es;
  const tag_t tag = c.tag + 70;
  std::vector<shared_bufs> bufs(static_cast<std::size_t>(n));
  bufs[r] = {send, recv};
  // declared after bufs: on unwinding these sends are withdrawn (or their readers waited for)
  // before the addresses they point at go away
  std::vector<treq> addr(static_cast<std::size_t>(n));
  for (int q = 0; q < n; ++q)
    if (q != r) addr[q] = c.tp.isend(q, tag, {reinterpret_cast<const std::byte*>(&bufs[r]), sizeof(shared_bufs)});
  bool ok = true;
  auto work = [&] {
    for (int p = 0; p < n && ok; ++p)
      for (int q = 0; q < n && ok; ++q)
        if (p != q && (overlaps(bufs[p].recv, bytes, bufs[q].send, bytes) || overlaps(bufs[p].recv, bytes, bufs[q].recv, bytes))) ok = false;
    if (!ok) return;
    const auto off = even_blocks(count, n);
    const std::size_t lo0 = off[r], hi0 = off[r + 1];
    // inputs and outputs of all ranks together (2nS) against the cache (bytes <= count * 8: no overflow)
    const std::size_t above = ar_stream_above.load(std::memory_order_relaxed);
    const bool streaming = !coll_dry_run && bytes > (above ? above : last_level_cache_bytes()) / (2 * static_cast<std::size_t>(n));
    if (streaming && op == reduce_op::sum && (d == dtype::f32 || d == dtype::f64)) {
      // the common case (gradients) in one pass: every input read and every output streamed
      // together, the same rank-order additions as fold_kernel
      auto sum_all = [&]<class T>(std::type_identity<T>) {
        std::vector<const T*> in(static_cast<std::size_t>(n));
        std::vector<T*> outs(static_cast<std::size_t>(n));
        for (int q = 0; q < n; ++q) {
          in[q] = reinterpret_cast<const T*>(bufs[q].send) + lo0;
          outs[q] = reinterpret_cast<T*>(bufs[(r + q) % n].recv) + lo0;
        }
        tessel::arch::sum_streaming(in.data(), n, outs.data(), n, hi0 - lo0);
      };
      if (d == dtype::f32)
        sum_all(std::type_identity<float>{});
      else
        sum_all(std::type_identity<double>{});
      tessel::arch::store_fence();
      return;
    }
    // chunks small enough that the result is still in L1/L2 when it is copied to the peers
    const std::size_t chunk = std::max<std::size_t>(1, (std::size_t{32} << 10) / as);
    // the accumulator may be our output unless in place with our input folded after the first two
    // (ordered_fold's aliasing rule); peers' inputs never overlap our output (checked above)
    const bool acc_in_out = accumulator_dtype(d) == d && (r < 2 || !overlaps(recv + lo0 * es, (hi0 - lo0) * es, send + lo0 * es, (hi0 - lo0) * es));
    scratch accs(acc_in_out ? 0 : std::min(chunk, hi0 - lo0) * as);
    std::vector<fold_src> seq(static_cast<std::size_t>(n));
    for (std::size_t lo = lo0; lo < hi0; lo += chunk) {
      const std::size_t len = std::min(chunk, hi0 - lo);
      std::byte* out = recv + lo * es;
      std::byte* a = acc_in_out ? out : accs.data();
      for (int q = 0; q < n; ++q) seq[q] = fold_src{-1, bufs[q].send + lo * es, false};
      ordered_fold(c, d, op, seq, a, len, tag);
      finalize_kernel(op, d, n, a, out, len);
      for (int q = 0; q < n; ++q)
        if (q != r) copy_bytes(bufs[q].recv + lo * es, out, len * es);
    }
  };
  // receive the peers' addresses nested, so that every peer's send stays pending during the work
  auto nest = [&](auto& self, int k) -> void {
    if (k == n) return work();
    const int q = (r + k) % n;
    auto* dst = reinterpret_cast<std::byte*>(&bufs[q]);
    c.tp.recv(q, tag, sizeof(shared_bufs), [&](std::span<const std::byte> p, std::size_t o) {
      std::memcpy(dst + o, p.data(), p.size());
      if (o + p.size() == sizeof(shared_bufs)) self(self, k + 1);
    });
  };
  nest(nest, 1);
  // every peer has finished its block (in our output too) and left our buffers; a peer that failed
  // half-way makes this wait throw
  for (auto& a : addr) c.tp.wait(a);
  return ok;
}

// direct all-reduce, pipelined by segments: the owner of block q folds segment s of it and sends
// the result at once, so peers copy it while it is still in cache (the gather costs little DRAM
// traffic) and the reduce and gather phases overlap.
inline void ar_direct(coll_ctx& c, const std::byte* send, std::byte* recv, std::size_t count, dtype d, reduce_op op) {
  if (c.tp.shared_address_space() && !c.tp.is_simulated() && ar_direct_shared(c, send, recv, count, d, op)) return;
  const std::size_t es = dtype_size(d);
  const int r = c.rank, n = c.n;
  const auto off = even_blocks(count, n);
  const std::size_t seg = std::max<std::size_t>(1, c.segment_bytes / es);
  auto nseg = [&](int q) { return (off[q + 1] - off[q] + seg - 1) / seg; };
  std::size_t maxseg = 0;
  for (int q = 0; q < n; ++q) maxseg = std::max(maxseg, nseg(q));
  const tag_t tin = c.tag + 1, tout = c.tag + 3;
  // contributions: segment s of block q goes to owner q (posted up front; owners pull them)
  std::vector<treq> in_sends(maxseg * static_cast<std::size_t>(n));  // [s * n + q]
  for (std::size_t s = 0; s < maxseg; ++s)
    for (int k = 1; k < n; ++k) {
      const int q = (r - k + n) % n;
      if (s < nseg(q)) {
        const std::size_t lo = off[q] + s * seg, len = std::min(seg, off[q + 1] - lo);
        in_sends[s * static_cast<std::size_t>(n) + static_cast<std::size_t>(q)] = c.tp.isend(q, tin, {send + lo * es, len * es});
      }
    }
  const std::byte* local = send + off[r] * es;
  std::byte* out = recv + off[r] * es;
  const std::size_t m = off[r + 1] - off[r];
  const bool early = r < 2;
  auto acc = place_acc(d, out, std::min(m, seg), early || !overlaps(out, m * es, local, m * es));
  const bool acc_is_out = acc.p == out;
  std::vector<fold_src> seq(static_cast<std::size_t>(n));
  for (std::size_t s = 0; s < maxseg; ++s) {
    if (s < nseg(r)) {
      const std::size_t lo = s * seg, len = std::min(seg, m - lo);
      std::byte* a = acc_is_out ? out + lo * es : acc.p;
      for (int q = 0; q < n; ++q) seq[q] = q == r ? fold_src{-1, local + lo * es, false} : fold_src{q, nullptr, false};
      ordered_fold(c, d, op, seq, a, len, tin);
      finalize_kernel(op, d, n, a, out + lo * es, len);
      for (int q = 0; q < n; ++q)
        if (q != r) c.send(q, tout, out + lo * es, len * es);
    }
    // our contribution to each segment must have been read before the result overwrites it (in
    // place); the owner read it before sending the result, so these waits do not block. Then
    // every result receive is posted at once, so their latencies overlap.
    for (int k = 1; k < n; ++k) {
      const int q = (r - k + n) % n;
      if (s < nseg(q)) c.tp.wait(in_sends[s * static_cast<std::size_t>(n) + static_cast<std::size_t>(q)]);
    }
    for (int k = 1; k < n; ++k) {
      const int q = (r - k + n) % n;
      if (s < nseg(q)) {
        const std::size_t lo = off[q] + s * seg, len = std::min(seg, off[q + 1] - lo);
        c.post_recv(q, tout, recv + lo * es, len * es);
      }
    }
    c.wait_recvs();
  }
  for (auto& rq : in_sends) c.tp.wait(rq);
  c.wait_all();
}

// ring on a modelled fabric, where a transfer starts only once its receive is posted and then pays
// the link latency: with one segment in flight per hop, every segment would pay latency + S/bw in
// turn (0.70 of the link at 512 KiB on UBL128). Here every hop keeps `ring_window` segments'
// receives posted ahead (staged, then folded from memory), so the latency of segment s+1 overlaps
// the transfer of segment s. The fold order is the chain's (the partial from rank k-1, then rank
// k's data), so the result is the same bits.
inline constexpr std::size_t ring_window = 4;
inline void ar_ring_posted(coll_ctx& c, const std::byte* send, std::byte* recv, std::size_t count, dtype d, reduce_op op) {
  const std::size_t es = dtype_size(d), as = dtype_size(accumulator_dtype(d));
  const int k = c.rank, n = c.n;
  const std::size_t seg = std::max<std::size_t>(1, c.segment_bytes / es);
  const std::size_t nseg = (count + seg - 1) / seg;
  auto lo_of = [&](std::size_t s) { return s * seg; };
  auto len_of = [&](std::size_t s) { return std::min(count, (s + 1) * seg) - s * seg; };
  scratch accs(accumulator_dtype(d) == d ? 0 : count * as);
  std::byte* acc = accumulator_dtype(d) == d ? recv : accs.data();
  const tag_t tr = c.tag + 4, tb = c.tag + 5;
  std::vector<treq> red(nseg);  // this rank's chain sends (rank 0: its raw data), per segment
  if (k == 0) {
    for (std::size_t s = 0; s < nseg; ++s) red[s] = c.tp.isend(1, tr, {send + lo_of(s) * es, len_of(s) * es});
  } else {
    // the incoming chain: rank 1 receives rank 0's raw elements, later ranks accumulator partials
    const bool raw_in = k == 1;
    const std::size_t in_size = raw_in ? es : as;
    const std::size_t slots = std::min(ring_window, nseg);
    scratch stage(slots * seg * in_size);
    std::vector<treq> in(nseg);
    auto post = [&](std::size_t s) { in[s] = c.tp.irecv_into(k - 1, tr, {stage.data() + (s % slots) * seg * in_size, len_of(s) * in_size}); };
    for (std::size_t s = 0; s < slots; ++s) post(s);
    for (std::size_t s = 0; s < nseg; ++s) {
      const std::size_t lo = lo_of(s), m = len_of(s);
      c.tp.wait(in[s]);
      const std::vector<fold_src> seq{fold_src{-1, stage.data() + (s % slots) * seg * in_size, !raw_in}, fold_src{-1, send + lo * es, false}};
      ordered_fold(c, d, op, seq, acc + lo * as, m, tr);  // both local: a plain fold
      if (s + slots < nseg) post(s + slots);              // its slot is free again
      if (k < n - 1) {
        red[s] = c.tp.isend(k + 1, tr, {acc + lo * as, m * as});
      } else {
        finalize_kernel(op, d, n, acc + lo * as, recv + lo * es, m);
        c.send(0, tb, recv + lo * es, m * es);
      }
    }
  }
  if (k != n - 1) {
    // the result comes back round: n-1 -> 0 -> 1 -> ... -> n-2, straight into recv. A segment's
    // receive is posted only once this rank's chain send of it has completed (recv may hold the
    // partial, or be the in-place send buffer).
    const int from = k == 0 ? n - 1 : k - 1;
    std::vector<treq> back(nseg);
    std::size_t posted = 0;
    auto post_upto = [&](std::size_t end) {
      for (; posted < std::min(end, nseg); ++posted) {
        c.tp.wait(red[posted]);
        back[posted] = c.tp.irecv_into(from, tb, {recv + lo_of(posted) * es, len_of(posted) * es});
      }
    };
    for (std::size_t s = 0; s < nseg; ++s) {
      post_upto(s + ring_window);
      c.tp.wait(back[s]);
      if (k + 1 < n - 1) c.send(k + 1, tb, recv + lo_of(s) * es, len_of(s) * es);
    }
  }
  for (auto& q : red) c.tp.wait(q);
  c.wait_all();
}

inline void ar_ring(coll_ctx& c, const std::byte* send, std::byte* recv, std::size_t count, dtype d, reduce_op op) {
  if (c.tp.is_simulated() && c.n > 1) return ar_ring_posted(c, send, recv, count, d, op);
  const std::size_t es = dtype_size(d), as = dtype_size(accumulator_dtype(d));
  const int k = c.rank, n = c.n;
  const std::size_t seg = std::max<std::size_t>(1, c.segment_bytes / es);
  const std::size_t nseg = (count + seg - 1) / seg;
  // partials live in recv when the accumulator is the element type (element-wise aliasing is safe)
  scratch accs(accumulator_dtype(d) == d ? 0 : count * as);
  std::byte* acc = accumulator_dtype(d) == d ? recv : accs.data();
  const tag_t tr = c.tag + 4, tb = c.tag + 5;
  std::vector<treq> red(nseg);
  for (std::size_t s = 0; s < nseg; ++s) {
    const std::size_t lo = s * seg, hi = std::min(count, lo + seg);
    const std::size_t before = c.pending.size();
    chain_reduce(c, send, d, op, lo, hi, acc + lo * as, recv + lo * es, tr);
    if (c.pending.size() > before) {
      red[s] = std::move(c.pending.back());
      c.pending.pop_back();
    }
    if (k == n - 1) c.send(0, tb, recv + lo * es, (hi - lo) * es);
  }
  if (k != n - 1) {
    for (std::size_t s = 0; s < nseg; ++s) {
      const std::size_t lo = s * seg, hi = std::min(count, lo + seg);
      c.tp.wait(red[s]);  // our partial (or raw data) of s was read: its memory may be overwritten
      c.tp.recv_into(k == 0 ? n - 1 : k - 1, tb, {recv + lo * es, (hi - lo) * es});
      if (k + 1 < n - 1) c.send(k + 1, tb, recv + lo * es, (hi - lo) * es);
    }
  }
  for (auto& q : red) c.tp.wait(q);
  c.wait_all();
}

inline void ar_hd(coll_ctx& c, const std::byte* send, std::byte* recv, std::size_t count, dtype d, reduce_op op) {
  const std::size_t es = dtype_size(d);
  const auto off = even_blocks(count, c.n);
  const hd_plan h = hd_halving(c, send, recv, d, op, off);
  const int r = c.rank;
  const tag_t tag = c.tag + 40;
  if (r >= h.p) {
    c.wait_all();
    c.tp.recv_into(r - h.p, tag, {recv, count * es});
    return;
  }
  for (std::size_t s = h.dists.size(); s-- > 0;) {
    const int partner = r ^ h.dists[s];
    const auto mine = h.ranges[s + 1][r], theirs = h.ranges[s + 1][partner];
    c.send(partner, tag + 1 + s, recv + off[mine.first] * es, (off[mine.second] - off[mine.first]) * es);
    c.tp.recv_into(partner, tag + 1 + s, {recv + off[theirs.first] * es, (off[theirs.second] - off[theirs.first]) * es});
    c.wait_all();
  }
  if (r + h.p < c.n) c.send(r + h.p, tag, recv, count * es);
  c.wait_all();
}

inline void ar_tree(coll_ctx& c, const std::byte* send, std::byte* recv, std::size_t count, dtype d, reduce_op op) {
  const std::size_t es = dtype_size(d);
  scratch g = tree_gather(c, send, count * es, 0, c.tag + 6);
  if (c.rank == 0) fold_gathered(c, g, count, d, op, 0, recv);
  tree_bcast(c, recv, count * es, 0, c.tag + 7);
}

// hierarchical: inside each super-node of g ranks local rank l collects raw block l from its node;
// across nodes the rank-order prefix partial of block l travels node 0 -> 1 -> ... -> m-1; the last
// node sends the result back to every node, and each node all-gathers its blocks.
inline void ar_hier(coll_ctx& c, const std::byte* send, std::byte* recv, std::size_t count, dtype d, reduce_op op) {
  const int g = c.node_size, n = c.n, m = n / g;
  const int node = c.rank / g, l = c.rank % g;
  const std::size_t es = dtype_size(d), as = dtype_size(accumulator_dtype(d));
  const auto off = even_blocks(count, g);
  const tag_t t1 = c.tag + 8, t2 = c.tag + 9, t3 = c.tag + 10, t4 = c.tag + 11;
  for (int q = 0; q < g; ++q)
    if (q != l) c.send(node * g + q, t1, send + off[q] * es, (off[q + 1] - off[q]) * es);
  const std::size_t bm = off[l + 1] - off[l];
  std::vector<fold_src> seq;
  if (node > 0) seq.push_back({(node - 1) * g + l, nullptr, true});
  for (int q = 0; q < g; ++q) seq.push_back(q == l ? fold_src{-1, send + off[l] * es, false} : fold_src{node * g + q, nullptr, false});
  scratch acc(bm * as);
  ordered_fold(c, d, op, seq, acc.data(), bm, t1, t2);  // the prefix partial (tag t2) first, then this node's blocks
  std::byte* myblk = recv + off[l] * es;
  if (node < m - 1) {
    c.send((node + 1) * g + l, t2, acc.data(), bm * as);
    c.wait_all();
    c.tp.recv_into((m - 1) * g + l, t3, {myblk, bm * es});
  } else {
    c.wait_all();  // node peers consumed our raw blocks before the result overwrites anything
    finalize_kernel(op, d, n, acc.data(), myblk, bm);
    for (int i = 0; i < m - 1; ++i) c.send(i * g + l, t3, myblk, bm * es);
    c.wait_all();
  }
  // intra-node all-gather of the g blocks
  for (int q = 0; q < g; ++q)
    if (q != l) c.send(node * g + q, t4, myblk, bm * es);
  for (int q = 0; q < g; ++q)
    if (q != l) c.post_recv(node * g + q, t4, recv + off[q] * es, (off[q + 1] - off[q]) * es);
  c.wait_recvs();
  c.wait_all();
}

}  // namespace tessel::detail
