// What every collective algorithm shares: its context (transport, rank, tags, pending sends and
// posted receives), the block layout helpers, and the ordered fold that adds contributions in rank
// order (the canonical order that makes every algorithm give the same bits).
#pragma once

#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <tessel/collectives/errors.hpp>
#include <tessel/collectives/reduce_op.hpp>
#include <tessel/collectives/transport.hpp>
#include <tessel/collectives/detail/scratch.hpp>
#include <tessel/types/dtype.hpp>

namespace tessel::detail {

using treq = transport_iface::request;

struct coll_ctx {
  transport_iface& tp;
  int rank;
  int n;
  tag_t tag;                            // base tag of this collective
  std::size_t segment_bytes = 1 << 20;  // pipelining unit of the ring algorithms
  int node_size = 1;                    // ranks per super-node for hierarchical

  // sends must complete before their buffers are reused; dropping them cancels (see transports)
  std::vector<treq> pending;
  void send(int peer, tag_t t, const std::byte* p, std::size_t bytes) { pending.push_back(tp.isend(peer, t, {p, bytes})); }
  void wait_all() {
    for (auto& r : pending) tp.wait(r);
    pending.clear();
  }
  // Receives from several peers: post each one, then wait for all of them. On a modelled fabric a
  // transfer starts only once its receive is posted and then pays the link latency, so receiving
  // one peer after another would add n-1 latencies; posted together they overlap and share the
  // port. Transports without native posted receives run them in posting order at wait time, as a
  // loop of recv_into would.
  std::vector<treq> posted;
  void post_recv(int peer, tag_t t, std::byte* p, std::size_t bytes) { posted.push_back(tp.irecv_into(peer, t, {p, bytes})); }
  void wait_recvs() {
    for (auto& r : posted) tp.wait(r);
    posted.clear();
  }
};

inline std::size_t block_off(std::size_t count, int n, int b) {
  const std::size_t q = count / static_cast<std::size_t>(n), r = count % static_cast<std::size_t>(n);
  return q * static_cast<std::size_t>(b) + std::min<std::size_t>(static_cast<std::size_t>(b), r);
}
inline std::vector<std::size_t> even_blocks(std::size_t count, int n) {
  std::vector<std::size_t> off(static_cast<std::size_t>(n) + 1);
  for (int b = 0; b <= n; ++b) off[static_cast<std::size_t>(b)] = block_off(count, n, b);
  return off;
}
inline std::vector<std::size_t> equal_blocks(std::size_t per, int n) {
  std::vector<std::size_t> off(static_cast<std::size_t>(n) + 1);
  for (int b = 0; b <= n; ++b) off[static_cast<std::size_t>(b)] = per * static_cast<std::size_t>(b);
  return off;
}
inline bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  if (!an || !bn || !a || !b) return false;  // timing-only runs pass null buffers
  const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + bn && pb < pa + an;
}

// One contribution to an ordered fold: a local buffer, or a message from `rank` holding raw
// elements (T) or an accumulator-typed prefix partial (only ever first in the sequence).
struct fold_src {
  int rank = -1;                     // -1: local
  const std::byte* local = nullptr;  // local data (T) when rank == -1
  bool is_acc = false;
};

// acc (m accumulator elements) = contributions folded in sequence order. acc may alias a local
// contribution only if that contribution is one of the first two (element-wise reads come first).
// Messages carry `tag`; a partial (is_acc) message carries `partial_tag`.
inline void ordered_fold(coll_ctx& c, dtype d, reduce_op op, const std::vector<fold_src>& seq, std::byte* acc, std::size_t m, tag_t tag,
                         tag_t partial_tag) {
  const std::size_t es = dtype_size(d), as = dtype_size(accumulator_dtype(d));
  auto bytes_of = [&](const fold_src& s) { return m * (s.is_acc ? as : es); };
  auto elem_of = [&](const fold_src& s, std::size_t off) { return off / (s.is_acc ? as : es); };
  if (seq.empty()) throw comm_error(errc::invalid_argument, "empty fold");
  if (c.tp.is_simulated() && std::count_if(seq.begin(), seq.end(), [](const fold_src& s) { return s.rank >= 0; }) > 1) {
    // modelled fabric: pull every message at once into staging (see coll_ctx::post_recv), then
    // fold the same sequence from memory; the order of the additions is unchanged
    std::size_t total = 0;
    for (const auto& s : seq)
      if (s.rank >= 0) total += bytes_of(s);
    scratch staged(total);
    std::vector<fold_src> local = seq;
    for (std::size_t k = 0, pos = 0; k < seq.size(); ++k)
      if (seq[k].rank >= 0) {
        c.post_recv(seq[k].rank, seq[k].is_acc ? partial_tag : tag, staged.data() + pos, bytes_of(seq[k]));
        local[k] = fold_src{-1, staged.data() + pos, seq[k].is_acc};
        pos += bytes_of(seq[k]);
      }
    c.wait_recvs();
    return ordered_fold(c, d, op, local, acc, m, tag, partial_tag);  // all sources local now (at least two)
  }
  const fold_src& s0 = seq[0];
  std::size_t next = 1;
  if (seq.size() == 1) {
    if (s0.rank < 0)
      to_acc_kernel(d, s0.local, acc, m);
    else if (s0.is_acc)
      c.tp.recv_into(s0.rank, partial_tag, {acc, m * as});
    else
      c.tp.recv(s0.rank, tag, bytes_of(s0),
                [&](std::span<const std::byte> p, std::size_t off) { to_acc_kernel(d, p.data(), acc + elem_of(s0, off) * as, p.size() / es); });
    return;
  }
  const fold_src& s1 = seq[1];
  if (s1.is_acc) throw comm_error(errc::invalid_argument, "only the first fold source may be a partial");
  if (s0.rank < 0 && s1.rank < 0) {
    fold_kernel(op, d, s0.local, s0.is_acc, s1.local, acc, m);
    next = 2;
  } else if (s0.rank >= 0 && s1.rank < 0) {  // fused: acc = op(message, local) in one pass
    c.tp.recv(s0.rank, s0.is_acc ? partial_tag : tag, bytes_of(s0), [&](std::span<const std::byte> p, std::size_t off) {
      const std::size_t e = elem_of(s0, off), len = p.size() / (s0.is_acc ? as : es);
      fold_kernel(op, d, p.data(), s0.is_acc, s1.local + e * es, acc + e * as, len);
    });
    next = 2;
  } else if (s0.rank < 0 && s1.rank >= 0) {  // fused: acc = op(local, message)
    c.tp.recv(s1.rank, tag, bytes_of(s1), [&](std::span<const std::byte> p, std::size_t off) {
      const std::size_t e = off / es, len = p.size() / es;
      fold_kernel(op, d, s0.local + e * (s0.is_acc ? as : es), s0.is_acc, p.data(), acc + e * as, len);
    });
    next = 2;
  } else {
    if (s0.is_acc)
      c.tp.recv_into(s0.rank, partial_tag, {acc, m * as});
    else
      c.tp.recv(s0.rank, tag, bytes_of(s0),
                [&](std::span<const std::byte> p, std::size_t off) { to_acc_kernel(d, p.data(), acc + elem_of(s0, off) * as, p.size() / es); });
  }
  for (std::size_t k = next; k < seq.size(); ++k) {
    const fold_src& s = seq[k];
    if (s.is_acc) throw comm_error(errc::invalid_argument, "only the first fold source may be a partial");
    if (s.rank < 0) {
      fold_kernel(op, d, acc, true, s.local, acc, m);
    } else {
      c.tp.recv(s.rank, tag, m * es, [&](std::span<const std::byte> p, std::size_t off) {
        const std::size_t e = off / es;
        fold_kernel(op, d, acc + e * as, true, p.data(), acc + e * as, p.size() / es);
      });
    }
  }
}

inline void ordered_fold(coll_ctx& c, dtype d, reduce_op op, const std::vector<fold_src>& seq, std::byte* acc, std::size_t m, tag_t tag) {
  ordered_fold(c, d, op, seq, acc, m, tag, tag);
}

// Where an accumulator for m elements lives: in `out` when the types agree and aliasing is safe.
struct acc_place {
  scratch buf;
  std::byte* p;
};
inline acc_place place_acc(dtype d, std::byte* out, std::size_t m, bool out_ok) {
  if (accumulator_dtype(d) == d && out_ok) return {scratch{}, out};
  scratch s(m * dtype_size(accumulator_dtype(d)));
  std::byte* p = s.data();
  return {std::move(s), p};
}

}  // namespace tessel::detail
