// Binomial trees, root-relative: gather to a root, broadcast from it, and the root's fold of the
// gathered raw contributions in rank order.
#pragma once

#include <cstddef>

#include <tessel/collectives/detail/coll_ctx.hpp>

namespace tessel::detail {

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
      c.tp.recv_into((child + root) % n, tag, {buf.data() + static_cast<std::size_t>(mask) * bytes, static_cast<std::size_t>(csub) * bytes});
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
inline void fold_gathered(coll_ctx& c, const scratch& g, std::size_t count, dtype d, reduce_op op, int root, std::byte* out) {
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

}  // namespace tessel::detail
