// The collective algorithms, written once against the type-erased transport. Each one reduces
// every element in rank order 0..n-1 (the canonical order): algorithms move raw contributions or
// rank-order prefix partials, never partial sums in another order, so all of them give the same bits.
#pragma once

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <exception>
#include <utility>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <tessel/collectives/errors.hpp>
#include <tessel/arch/copy.hpp>
#include <tessel/collectives/reduce_op.hpp>
#include <tessel/collectives/transport.hpp>
#include <tessel/types/dtype.hpp>

namespace tessel {
inline namespace v0 {

enum class algorithm : std::uint8_t { automatic, ring, direct, halving_doubling, tree, hierarchical };

constexpr std::string_view algorithm_name(algorithm a) {
  switch (a) {
    case algorithm::automatic: return "auto";
    case algorithm::ring: return "ring";
    case algorithm::direct: return "direct";
    case algorithm::halving_doubling: return "halving_doubling";
    case algorithm::tree: return "tree";
    case algorithm::hierarchical: return "hierarchical";
  }
  throw comm_error(errc::invalid_argument, "invalid algorithm value " + std::to_string(static_cast<int>(a)));
}

inline algorithm algorithm_from_name(std::string_view s) {
  for (auto a : {algorithm::automatic, algorithm::ring, algorithm::direct, algorithm::halving_doubling,
                 algorithm::tree, algorithm::hierarchical})
    if (algorithm_name(a) == s) return a;
  if (s == "hd" || s == "rabenseifner") return algorithm::halving_doubling;
  throw comm_error(errc::invalid_argument, "unknown algorithm '" + std::string(s) + "'");
}

}  // namespace v0
namespace detail {

using treq = transport_iface::request;

// Process-wide cache of scratch blocks. First-touching fresh 4 KiB pages costs far more than the
// copies themselves (DESIGN.md, Memory), so blocks are reused across collectives; blocks of 2 MiB
// and more are 2 MiB-aligned and advised to use huge pages.
class scratch_pool {
 public:
  static scratch_pool& instance() {
    static scratch_pool p;
    return p;
  }
  std::pair<std::byte*, std::size_t> get(std::size_t bytes) {
    std::size_t cls = 4096;
    while (cls < bytes) cls *= 2;
    {
      std::lock_guard lk(mu_);
      auto& v = free_[bit(cls)];
      if (!v.empty()) {
        std::byte* p = v.back();
        v.pop_back();
        cached_ -= cls;
        return {p, cls};
      }
    }
    const std::size_t align = cls >= (std::size_t{2} << 20) ? (std::size_t{2} << 20) : 64;
    auto* p = static_cast<std::byte*>(::operator new(cls, std::align_val_t{align}));
#if defined(__linux__)
    if (align > 64) ::madvise(p, cls, MADV_HUGEPAGE);
#endif
    return {p, cls};
  }
  void put(std::byte* p, std::size_t cls) {
    {
      std::lock_guard lk(mu_);
      if (cached_ + cls <= limit) {
        free_[bit(cls)].push_back(p);
        cached_ += cls;
        return;
      }
    }
    ::operator delete(p, std::align_val_t{cls >= (std::size_t{2} << 20) ? (std::size_t{2} << 20) : 64});
  }
  // Kept until the process ends (still reachable, so leak checkers stay quiet); failures are rare.
  void quarantine(std::byte* p, std::size_t cls) {
    std::lock_guard lk(mu_);
    quarantined_.emplace_back(p, cls);
  }
  ~scratch_pool() {
    for (auto [p, cls] : quarantined_)
      ::operator delete(p, std::align_val_t{cls >= (std::size_t{2} << 20) ? (std::size_t{2} << 20) : 64});
    for (std::size_t b = 0; b < 64; ++b)
      for (auto* p : free_[b]) {
        const std::size_t cls = std::size_t{1} << b;
        ::operator delete(p, std::align_val_t{cls >= (std::size_t{2} << 20) ? (std::size_t{2} << 20) : 64});
      }
  }
  static constexpr std::size_t limit = std::size_t{2} << 30;  // cached bytes kept for reuse

 private:
  static std::size_t bit(std::size_t cls) {
    std::size_t b = 0;
    while ((std::size_t{1} << b) < cls) ++b;
    return b;
  }
  std::mutex mu_;
  std::vector<std::byte*> free_[64];
  std::vector<std::pair<std::byte*, std::size_t>> quarantined_;
  std::size_t cached_ = 0;
};

// Timing-only runs move no bytes: their buffers may be null and their scratch holds no memory, yet
// the algorithms still compute addresses inside them. A dry_region stands in for such a buffer: an
// inaccessible (PROT_NONE), unreserved mapping of the same size, so that address arithmetic stays
// inside a mapping instead of offsetting a null pointer. It costs address space only.
class dry_region {
 public:
  dry_region() = default;
  explicit dry_region(std::size_t bytes) {
    if (!bytes) return;
    void* q = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (q == MAP_FAILED) throw std::bad_alloc();
    p_ = static_cast<std::byte*>(q);
    n_ = bytes;
  }
  dry_region(dry_region&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  dry_region& operator=(dry_region&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~dry_region() {
    if (p_) ::munmap(p_, n_);
  }
  std::byte* data() const { return p_; }

 private:
  std::byte* p_ = nullptr;
  std::size_t n_ = 0;
};

// Scratch bytes from the pool (at least 64-byte aligned, so any element type can live in them); in
// a timing-only run, a dry_region of that size.
class scratch {
 public:
  scratch() = default;
  explicit scratch(std::size_t bytes) : n_(bytes) {
    if (bytes && !coll_dry_run) std::tie(p_, cls_) = scratch_pool::instance().get(bytes);
    else if (bytes) dry_ = dry_region(bytes);
  }
  scratch(scratch&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)), cls_(std::exchange(o.cls_, 0)), dry_(std::move(o.dry_)) {}
  scratch& operator=(scratch&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(cls_, o.cls_);
    std::swap(dry_, o.dry_);
    return *this;
  }
  // A collective that fails (a dead peer, an abort) unwinds with sends still posted from its
  // scratch, and a peer may be copying out of them at that moment: the transports withdraw those
  // sends only when the collective's context is destroyed, after this scratch. So scratch released
  // during unwinding is quarantined, never handed to another collective while a reader may be in it.
  ~scratch() {
    if (!p_) return;
    if (std::uncaught_exceptions() > 0)
      scratch_pool::instance().quarantine(p_, cls_);
    else
      scratch_pool::instance().put(p_, cls_);
  }
  std::byte* data() const { return p_ ? p_ : dry_.data(); }
  std::size_t size() const { return n_; }

 private:
  std::byte* p_ = nullptr;
  std::size_t n_ = 0, cls_ = 0;
  dry_region dry_;
};

struct coll_ctx {
  transport_iface& tp;
  int rank;
  int n;
  tag_t tag;                          // base tag of this collective
  std::size_t segment_bytes = 1 << 20;  // pipelining unit of the ring algorithms
  int node_size = 1;                  // ranks per super-node for hierarchical

  // sends must complete before their buffers are reused; dropping them cancels (see transports)
  std::vector<treq> pending;
  void send(int peer, tag_t t, const std::byte* p, std::size_t bytes) {
    pending.push_back(tp.isend(peer, t, {p, bytes}));
  }
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
inline void ordered_fold(coll_ctx& c, dtype d, reduce_op op, const std::vector<fold_src>& seq, std::byte* acc,
                         std::size_t m, tag_t tag, tag_t partial_tag) {
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
    if (s0.rank < 0) to_acc_kernel(d, s0.local, acc, m);
    else if (s0.is_acc) c.tp.recv_into(s0.rank, partial_tag, {acc, m * as});
    else
      c.tp.recv(s0.rank, tag, bytes_of(s0), [&](std::span<const std::byte> p, std::size_t off) {
        to_acc_kernel(d, p.data(), acc + elem_of(s0, off) * as, p.size() / es);
      });
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
    if (s0.is_acc) c.tp.recv_into(s0.rank, partial_tag, {acc, m * as});
    else
      c.tp.recv(s0.rank, tag, bytes_of(s0), [&](std::span<const std::byte> p, std::size_t off) {
        to_acc_kernel(d, p.data(), acc + elem_of(s0, off) * as, p.size() / es);
      });
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

inline void ordered_fold(coll_ctx& c, dtype d, reduce_op op, const std::vector<fold_src>& seq, std::byte* acc,
                         std::size_t m, tag_t tag) {
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

// ---------------------------------------------------------------- reduce-scatter building blocks

// direct: every rank sends block q to its owner q, which folds the n contributions in rank order.
inline void rs_direct(coll_ctx& c, const std::byte* send, std::byte* out, dtype d, reduce_op op,
                      const std::vector<std::size_t>& off) {
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
inline void chain_reduce(coll_ctx& c, const std::byte* send, dtype d, reduce_op op, std::size_t lo, std::size_t hi,
                         std::byte* acc_space, std::byte* final_out, tag_t tag) {
  const std::size_t es = dtype_size(d), as = dtype_size(accumulator_dtype(d));
  const int k = c.rank, n = c.n;
  const std::size_t m = hi - lo;
  if (k == 0) {
    c.send(1, tag, send + lo * es, m * es);
    return;
  }
  std::vector<fold_src> seq{fold_src{k - 1, nullptr, k >= 2}, fold_src{-1, send + lo * es, false}};
  ordered_fold(c, d, op, seq, acc_space, m, tag);
  if (k < n - 1) c.send(k + 1, tag, acc_space, m * as);
  else finalize_kernel(op, d, n, acc_space, final_out, m);
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
inline hd_plan hd_halving(coll_ctx& c, const std::byte* send, std::byte* out_full, dtype d, reduce_op op,
                          const std::vector<std::size_t>& off) {
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

// ---------------------------------------------------------------- all-gather building blocks

inline void ag_direct(coll_ctx& c, std::byte* buf, dtype d, const std::vector<std::size_t>& off, tag_t tag) {
  const std::size_t es = dtype_size(d);
  const int r = c.rank;
  for (int q = 0; q < c.n; ++q)
    if (q != r) c.send(q, tag, buf + off[r] * es, (off[r + 1] - off[r]) * es);
  for (int k = 1; k < c.n; ++k) {  // rotated: at every step each sender serves one receiver
    const int q = (r - k + c.n) % c.n;
    c.post_recv(q, tag, buf + off[q] * es, (off[q + 1] - off[q]) * es);
  }
  c.wait_recvs();
  c.wait_all();
}

inline void ag_ring(coll_ctx& c, std::byte* buf, dtype d, const std::vector<std::size_t>& off, tag_t tag) {
  const std::size_t es = dtype_size(d);
  const int r = c.rank, n = c.n;
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  for (int s = 0; s + 1 < n; ++s) {
    const int sb = (r - s + n) % n, rb = (r - s - 1 + 2 * n) % n;
    c.send(next, tag, buf + off[sb] * es, (off[sb + 1] - off[sb]) * es);
    c.tp.recv_into(prev, tag, {buf + off[rb] * es, (off[rb + 1] - off[rb]) * es});
  }
  c.wait_all();
}

// recursive doubling (power-of-two n only)
inline void ag_doubling(coll_ctx& c, std::byte* buf, dtype d, const std::vector<std::size_t>& off, tag_t tag) {
  const std::size_t es = dtype_size(d);
  const int r = c.rank;
  for (int dd = 1; dd < c.n; dd *= 2) {
    const int partner = r ^ dd;
    const int mylo = r & ~(dd - 1), plo = partner & ~(dd - 1);
    c.send(partner, tag, buf + off[mylo] * es, (off[mylo + dd] - off[mylo]) * es);
    c.tp.recv_into(partner, tag, {buf + off[plo] * es, (off[plo + dd] - off[plo]) * es});
    c.wait_all();
  }
}

// ---------------------------------------------------------------- trees (binomial, root-relative)

// Gathers every rank's `bytes` to the root; on the root returns them in virtual-rank order
// (virtual v = (rank - root) mod n). Other ranks return an empty buffer.
inline scratch tree_gather(coll_ctx& c, const std::byte* send, std::size_t bytes, int root, tag_t tag) {
  const int n = c.n, v = (c.rank - root + n) % n;
  int sub = 1;
  while (sub < n && !(v & sub)) sub *= 2;  // lowest set bit of v (n-ish for the root)
  const int span_n = std::min(sub, n - v);
  scratch buf(static_cast<std::size_t>(span_n) * bytes);
  copy_bytes(buf.data(), send, bytes);
  for (int mask = 1; mask < n; mask *= 2) {
    if (v & mask) {
      c.send((v - mask + root) % n, tag, buf.data(), static_cast<std::size_t>(span_n) * bytes);
      c.wait_all();
      return {};
    }
    if (v + mask < n) {
      const int child = v + mask, csub = std::min(mask, n - child);
      c.tp.recv_into((child + root) % n, tag,
                     {buf.data() + static_cast<std::size_t>(mask) * bytes, static_cast<std::size_t>(csub) * bytes});
    }
  }
  return buf;
}

inline void tree_bcast(coll_ctx& c, std::byte* buf, std::size_t bytes, int root, tag_t tag) {
  const int n = c.n, v = (c.rank - root + n) % n;
  int mask = 1;
  while (mask < n) {
    if (v & mask) {
      c.tp.recv_into((v - mask + root) % n, tag, {buf, bytes});
      break;
    }
    mask *= 2;
  }
  for (mask /= 2; mask > 0; mask /= 2)
    if (v + mask < n) c.send((v + mask + root) % n, tag, buf, bytes);
  c.wait_all();
}

// Root folds the gathered raw contributions (virtual order) in real rank order into out.
inline void fold_gathered(coll_ctx& c, const scratch& g, std::size_t count, dtype d, reduce_op op, int root,
                          std::byte* out) {
  const std::size_t es = dtype_size(d);
  std::vector<fold_src> seq;
  for (int q = 0; q < c.n; ++q) {
    const int v = (q - root + c.n) % c.n;
    seq.push_back({-1, g.data() + static_cast<std::size_t>(v) * count * es, false});
  }
  scratch acc(count * dtype_size(accumulator_dtype(d)));
  ordered_fold(c, d, op, seq, acc.data(), count, c.tag);
  finalize_kernel(op, d, c.n, acc.data(), out, count);
}

// ---------------------------------------------------------------- all-reduce

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
inline bool ar_direct_shared(coll_ctx& c, const std::byte* send, std::byte* recv, std::size_t count, dtype d,
                             reduce_op op) {
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
        if (p != q && (overlaps(bufs[p].recv, bytes, bufs[q].send, bytes) || overlaps(bufs[p].recv, bytes, bufs[q].recv, bytes)))
          ok = false;
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
      if (d == dtype::f32) sum_all(std::type_identity<float>{});
      else sum_all(std::type_identity<double>{});
      tessel::arch::store_fence();
      return;
    }
    // chunks small enough that the result is still in L1/L2 when it is copied to the peers
    const std::size_t chunk = std::max<std::size_t>(1, (std::size_t{32} << 10) / as);
    // the accumulator may be our output unless in place with our input folded after the first two
    // (ordered_fold's aliasing rule); peers' inputs never overlap our output (checked above)
    const bool acc_in_out = accumulator_dtype(d) == d &&
                            (r < 2 || !overlaps(recv + lo0 * es, (hi0 - lo0) * es, send + lo0 * es, (hi0 - lo0) * es));
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
    auto post = [&](std::size_t s) {
      in[s] = c.tp.irecv_into(k - 1, tr, {stage.data() + (s % slots) * seg * in_size, len_of(s) * in_size});
    };
    for (std::size_t s = 0; s < slots; ++s) post(s);
    for (std::size_t s = 0; s < nseg; ++s) {
      const std::size_t lo = lo_of(s), m = len_of(s);
      c.tp.wait(in[s]);
      const std::vector<fold_src> seq{fold_src{-1, stage.data() + (s % slots) * seg * in_size, !raw_in}, fold_src{-1, send + lo * es, false}};
      ordered_fold(c, d, op, seq, acc + lo * as, m, tr);  // both local: a plain fold
      if (s + slots < nseg) post(s + slots);                // its slot is free again
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


// ---------------------------------------------------------------- reduce-scatter variants

inline void rs_ring(coll_ctx& c, const std::byte* send, std::byte* out, dtype d, reduce_op op,
                    const std::vector<std::size_t>& off) {
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

inline void rs_hd(coll_ctx& c, const std::byte* send, std::byte* out, dtype d, reduce_op op,
                  const std::vector<std::size_t>& off) {
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

inline void rs_tree(coll_ctx& c, const std::byte* send, std::byte* out, dtype d, reduce_op op,
                    const std::vector<std::size_t>& off) {
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

}  // namespace detail
inline namespace v0 {
}  // namespace v0
}  // namespace tessel
