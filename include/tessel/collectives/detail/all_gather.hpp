// All-gather building blocks: direct, ring and recursive doubling over per-rank block offsets.
#pragma once

#include <cstddef>
#include <vector>

#include <tessel/collectives/detail/coll_ctx.hpp>

namespace tessel::detail {

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

}  // namespace tessel::detail
