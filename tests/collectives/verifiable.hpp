// Verifiable-data checks of every collective (nccl-tests style), shared by the default suite
// (communicator.cpp) and the exhaustive label (communicator_exhaustive.cpp): each rank regenerates
// any rank's input from (seed, rank, index), and results must equal the canonical rank-order
// reduction bit for bit, for every dtype x op x algorithm x in/out-of-place x count x rank count.
#pragma once
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <tessel/collectives.hpp>

#include "reference/collectives_ref.hpp"

using namespace tessel;

namespace {

using all_types = std::tuple<double, float, bf16, fp16, e4m3, e5m2, std::int32_t, std::int64_t, std::uint8_t>;
constexpr int rank_counts[] = {1, 2, 3, 5, 8};
constexpr std::size_t counts[] = {0, 1, 7, 53327};  // the default suite's full matrix
constexpr reduce_op ops[] = {reduce_op::sum, reduce_op::prod, reduce_op::min, reduce_op::max, reduce_op::avg};
constexpr algorithm algos[] = {algorithm::automatic,        algorithm::ring, algorithm::direct,
                               algorithm::halving_doubling, algorithm::tree, algorithm::hierarchical};

// Runs f(comm, errors) on n thread ranks; returns every failure message (Catch is not thread-safe).
template <class F>
std::vector<std::string> on_ranks(int n, F f, comm_options opt = {}) {
  std::mutex mu;
  std::vector<std::string> errs;
  threads_world::run(n, [&](threads_transport t) {
    communicator c(std::move(t), opt);
    std::vector<std::string> mine;
    f(c, mine);
    std::lock_guard lk(mu);
    errs.insert(errs.end(), mine.begin(), mine.end());
  });
  return errs;
}

std::atomic<std::size_t> elements_checked{0};

template <class T>
void expect_bits(std::vector<std::string>& errs, const T* got, const T* want, std::size_t n, const std::string& what) {
  elements_checked += n;
  const std::size_t bad = tessel_ref::count_wrong(got, want, n);
  if (bad) errs.push_back(what + ": " + std::to_string(bad) + " wrong of " + std::to_string(n));
}

template <class T>
std::string label(const char* coll, int n, reduce_op op, std::size_t count, algorithm a, bool inplace, int rank) {
  return std::string(coll) + " " + std::string(dtype_name(dtype_of<T>)) + " " + std::string(reduce_op_name(op)) + " n=" + std::to_string(n) +
         " count=" + std::to_string(count) + " algo=" + std::string(algorithm_name(a)) + (inplace ? " in-place" : " out-of-place") +
         " rank=" + std::to_string(rank);
}

template <class F>
void for_each_type(F&& f) {
  std::apply([&](auto... x) { (f(x), ...); }, all_types{});
}

// Hierarchical needs super-nodes: give 8 ranks two nodes of 4 (others fall back to one level).
comm_options opts_for(int n) {
  comm_options o;
  if (n == 8) o.node_size = 4;
  if (n == 5) o.segment_bytes = 4096;  // exercise ring pipelining with many segments
  return o;
}

template <class T>
void check_all_reduce(int n, reduce_op op, std::size_t count, std::uint64_t seed) {
  const auto want = tessel_ref::reduce_vec<T>(seed, n, count, op);
  auto errs = on_ranks(
      n,
      [&](communicator& c, std::vector<std::string>& e) {
        const auto in = tessel_ref::gen_vec<T>(seed, c.rank(), count, op);
        for (algorithm a : algos) {
          std::vector<T> out(count);
          c.all_reduce(in.data(), out.data(), count, dtype_of<T>, op, {a});
          expect_bits(e, out.data(), want.data(), count, label<T>("all_reduce", n, op, count, a, false, c.rank()));
          std::vector<T> buf = in;
          c.all_reduce(buf.data(), buf.data(), count, dtype_of<T>, op, {a});
          expect_bits(e, buf.data(), want.data(), count, label<T>("all_reduce", n, op, count, a, true, c.rank()));
        }
      },
      opts_for(n));
  for (auto& s : errs) FAIL_CHECK(s);
}

template <class T>
void check_reduce_scatter(int n, reduce_op op, std::size_t rc, std::uint64_t seed) {
  const std::size_t total = rc * static_cast<std::size_t>(n);
  const auto want = tessel_ref::reduce_vec<T>(seed, n, total, op);
  auto errs = on_ranks(
      n,
      [&](communicator& c, std::vector<std::string>& e) {
        const auto in = tessel_ref::gen_vec<T>(seed, c.rank(), total, op);
        const T* w = want.data() + static_cast<std::size_t>(c.rank()) * rc;
        for (algorithm a : algos) {
          std::vector<T> out(rc);
          c.reduce_scatter(in.data(), out.data(), rc, dtype_of<T>, op, {a});
          expect_bits(e, out.data(), w, rc, label<T>("reduce_scatter", n, op, rc, a, false, c.rank()));
          std::vector<T> buf = in;
          T* mine = buf.data() + static_cast<std::size_t>(c.rank()) * rc;
          c.reduce_scatter(buf.data(), mine, rc, dtype_of<T>, op, {a});
          expect_bits(e, mine, w, rc, label<T>("reduce_scatter", n, op, rc, a, true, c.rank()));
        }
      },
      opts_for(n));
  for (auto& s : errs) FAIL_CHECK(s);
}

template <class T>
void check_reduce(int n, reduce_op op, std::size_t count, std::uint64_t seed) {
  const auto want = tessel_ref::reduce_vec<T>(seed, n, count, op);
  auto errs = on_ranks(
      n,
      [&](communicator& c, std::vector<std::string>& e) {
        const auto in = tessel_ref::gen_vec<T>(seed, c.rank(), count, op);
        for (int root : {0, n - 1})
          for (algorithm a : algos) {
            std::vector<T> out(count);
            c.reduce(in.data(), out.data(), count, dtype_of<T>, op, root, {a});
            if (c.rank() == root) expect_bits(e, out.data(), want.data(), count, label<T>("reduce", n, op, count, a, false, c.rank()));
            std::vector<T> buf = in;
            c.reduce(buf.data(), buf.data(), count, dtype_of<T>, op, root, {a});
            if (c.rank() == root) expect_bits(e, buf.data(), want.data(), count, label<T>("reduce", n, op, count, a, true, c.rank()));
          }
      },
      opts_for(n));
  for (auto& s : errs) FAIL_CHECK(s);
}

// Data movement collectives: broadcast, all_gather, gather, scatter, all_to_all, all_to_allv, send/recv.
template <class T>
void check_movement(int n, std::size_t count, std::uint64_t seed) {
  const reduce_op g = reduce_op::sum;  // only picks the generator's value range
  const std::size_t N = static_cast<std::size_t>(n);
  auto errs = on_ranks(
      n,
      [&](communicator& c, std::vector<std::string>& e) {
        const int r = c.rank();
        const auto mine = tessel_ref::gen_vec<T>(seed, r, count, g);
        std::vector<T> all(count * N);  // rank q's data in block q
        for (int q = 0; q < n; ++q) {
          auto v = tessel_ref::gen_vec<T>(seed, q, count, g);
          std::copy(v.begin(), v.end(), all.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(q)));
        }
        for (algorithm a : algos) {
          for (int root : {0, n - 1}) {
            const auto rootdata = tessel_ref::gen_vec<T>(seed, root, count, g);
            std::vector<T> out(count);
            c.broadcast(mine.data(), out.data(), count, dtype_of<T>, root, {a});
            expect_bits(e, out.data(), rootdata.data(), count, label<T>("broadcast", n, g, count, a, false, r));
            std::vector<T> buf = mine;
            c.broadcast(buf.data(), buf.data(), count, dtype_of<T>, root, {a});
            expect_bits(e, buf.data(), rootdata.data(), count, label<T>("broadcast", n, g, count, a, true, r));
          }
          std::vector<T> ag(count * N);
          c.all_gather(mine.data(), ag.data(), count, dtype_of<T>, {a});
          expect_bits(e, ag.data(), all.data(), count * N, label<T>("all_gather", n, g, count, a, false, r));
          std::vector<T> ag2(count * N);
          std::copy(mine.begin(), mine.end(), ag2.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(r)));
          c.all_gather(ag2.data() + count * static_cast<std::size_t>(r), ag2.data(), count, dtype_of<T>, {a});
          expect_bits(e, ag2.data(), all.data(), count * N, label<T>("all_gather", n, g, count, a, true, r));
        }
        for (int root : {0, n - 1}) {
          std::vector<T> gt(r == root ? count * N : 0);
          c.gather(mine.data(), gt.data(), count, dtype_of<T>, root);
          if (r == root) expect_bits(e, gt.data(), all.data(), count * N, label<T>("gather", n, g, count, algorithm::direct, false, r));
          std::vector<T> sc(count);
          c.scatter(all.data(), sc.data(), count, dtype_of<T>, root);
          expect_bits(e, sc.data(), all.data() + count * static_cast<std::size_t>(r), count,
                      label<T>("scatter", n, g, count, algorithm::direct, false, r));
        }
        // all_to_all: block q of rank r's send is element (r, q) data; receiver checks
        std::vector<T> a2a_in(count * N), a2a_out(count * N), a2a_want(count * N);
        for (int q = 0; q < n; ++q) {
          auto v = tessel_ref::gen_vec<T>(seed + 1, r, count, g, count * static_cast<std::size_t>(q));
          std::copy(v.begin(), v.end(), a2a_in.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(q)));
          auto w = tessel_ref::gen_vec<T>(seed + 1, q, count, g, count * static_cast<std::size_t>(r));
          std::copy(w.begin(), w.end(), a2a_want.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(q)));
        }
        c.all_to_all(a2a_in.data(), a2a_out.data(), count, dtype_of<T>);
        expect_bits(e, a2a_out.data(), a2a_want.data(), count * N, label<T>("all_to_all", n, g, count, algorithm::direct, false, r));
        // all_to_allv: rank r sends (r + q) % 3 * count / 2 elements to q
        auto cnt = [&](int from, int to) { return static_cast<std::size_t>((from + to) % 3) * count / 2; };
        std::vector<std::size_t> sc(N), sd(N), rcv(N), rd(N);
        std::size_t st = 0, rt = 0;
        for (int q = 0; q < n; ++q) {
          sc[q] = cnt(r, q), sd[q] = st, st += sc[q];
          rcv[q] = cnt(q, r), rd[q] = rt, rt += rcv[q];
        }
        std::vector<T> vin(st), vout(rt), vwant(rt);
        for (int q = 0; q < n; ++q) {
          auto v = tessel_ref::gen_vec<T>(seed + 2, r * 64 + q, sc[q], g);
          std::copy(v.begin(), v.end(), vin.begin() + static_cast<std::ptrdiff_t>(sd[q]));
          auto w = tessel_ref::gen_vec<T>(seed + 2, q * 64 + r, rcv[q], g);
          std::copy(w.begin(), w.end(), vwant.begin() + static_cast<std::ptrdiff_t>(rd[q]));
        }
        c.all_to_allv(vin.data(), sc, sd, vout.data(), rcv, rd, dtype_of<T>);
        expect_bits(e, vout.data(), vwant.data(), rt, label<T>("all_to_allv", n, g, count, algorithm::direct, false, r));
        // send/recv around the ring
        if (n > 1) {
          std::vector<T> got(count);
          const auto prevdata = tessel_ref::gen_vec<T>(seed, (r + n - 1) % n, count, g);
          if (r % 2 == 0) {
            c.send(mine.data(), count, dtype_of<T>, (r + 1) % n, 7);
            c.recv(got.data(), count, dtype_of<T>, (r + n - 1) % n, 7);
          } else {
            c.recv(got.data(), count, dtype_of<T>, (r + n - 1) % n, 7);
            c.send(mine.data(), count, dtype_of<T>, (r + 1) % n, 7);
          }
          expect_bits(e, got.data(), prevdata.data(), count, label<T>("send/recv", n, g, count, algorithm::direct, false, r));
        }
        c.barrier();
      },
      opts_for(n));
  for (auto& s : errs) FAIL_CHECK(s);
}

}  // namespace

// Every test case must have compared something (a guard against a harness that checks nothing).
struct checked_guard {
  std::size_t before = elements_checked.load();
  ~checked_guard() { CHECK(elements_checked.load() > before); }
};

// The full matrices for a list of counts. For reduce_scatter a count is the total length (each rank
// receives count / n, at least 1 when count > 0), so large counts cost the same as all_reduce's.
inline std::size_t per_rank(std::size_t count, int n) { return count == 0 ? 0 : std::max<std::size_t>(1, count / static_cast<std::size_t>(n)); }

inline void all_reduce_matrix(std::span<const std::size_t> cs) {
  checked_guard guard;
  for (int n : rank_counts)
    for_each_type([&]<class T>(T) {
      for (reduce_op op : ops)
        for (std::size_t count : cs) check_all_reduce<T>(n, op, count, 1000 + static_cast<std::uint64_t>(n));
    });
}

inline void reduce_scatter_matrix(std::span<const std::size_t> cs, bool total) {
  checked_guard guard;
  for (int n : rank_counts)
    for_each_type([&]<class T>(T) {
      for (reduce_op op : ops)
        for (std::size_t count : cs) check_reduce_scatter<T>(n, op, total ? per_rank(count, n) : count, 2000 + static_cast<std::uint64_t>(n));
    });
}

inline void reduce_matrix(std::span<const std::size_t> cs) {
  checked_guard guard;
  for (int n : rank_counts)
    for_each_type([&]<class T>(T) {
      for (reduce_op op : ops)
        for (std::size_t count : cs) check_reduce<T>(n, op, count, 3000 + static_cast<std::uint64_t>(n));
    });
}

inline void movement_matrix(std::span<const std::size_t> cs) {
  checked_guard guard;
  for (int n : rank_counts)
    for_each_type([&]<class T>(T) {
      for (std::size_t count : cs) check_movement<T>(n, count, 4000 + static_cast<std::uint64_t>(n));
    });
}
