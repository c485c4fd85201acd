// The collectives over the MPI transport (4 processes under mpirun): verifiable data equal bit for
// bit to the canonical rank-order reduction (so equal to the threads transport's results), every
// dtype x op x algorithm x in/out-of-place x count; data movement collectives; async handles.
// Only CHECK is used: a REQUIRE that stops one rank early would leave its peers waiting.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/collectives/transport/mpi.hpp>

#include "reference/collectives_ref.hpp"

using namespace tessel;

namespace {
using all_types = std::tuple<double, float, bf16, fp16, e4m3, e5m2, std::int32_t, std::int64_t, std::uint8_t>;
constexpr std::size_t counts[] = {0, 1, 7, 53327};
constexpr reduce_op ops[] = {reduce_op::sum, reduce_op::prod, reduce_op::min, reduce_op::max, reduce_op::avg};
constexpr algorithm algos[] = {algorithm::automatic,        algorithm::ring, algorithm::direct,
                               algorithm::halving_doubling, algorithm::tree, algorithm::hierarchical};

communicator& comm() {
  static communicator c = [] {
    comm_options o;
    o.node_size = 2;  // two "super-nodes" of two processes: exercises hierarchical
    o.segment_bytes = 16384;
    return communicator(mpi_transport(MPI_COMM_WORLD), o);
  }();
  return c;
}

template <class T>
std::size_t wrong(const std::vector<T>& got, const T* want) {
  return tessel_ref::count_wrong(got.data(), want, got.size());
}
}  // namespace

TEST_CASE("mpi: all_reduce, reduce_scatter and reduce equal the canonical reduction bitwise", "[mpi][collectives]") {
  auto& c = comm();
  const int n = c.size(), r = c.rank();
  std::apply(
      [&](auto... x) {
        (
            [&]<class T>(T) {
              for (reduce_op op : ops)
                for (std::size_t count : counts) {
                  const std::uint64_t seed = 77 + count;
                  const auto in = tessel_ref::gen_vec<T>(seed, r, count, op);
                  const auto want = tessel_ref::reduce_vec<T>(seed, n, count, op);
                  const std::size_t rc = count / static_cast<std::size_t>(n);
                  for (algorithm a : algos) {
                    INFO(dtype_name(dtype_of<T>) << " " << reduce_op_name(op) << " count " << count << " algo " << algorithm_name(a));
                    std::vector<T> out(count);
                    c.all_reduce(in.data(), out.data(), count, dtype_of<T>, op, {a});
                    CHECK(wrong(out, want.data()) == 0);
                    std::vector<T> buf = in;
                    c.all_reduce(buf.data(), buf.data(), count, dtype_of<T>, op, {a});
                    CHECK(wrong(buf, want.data()) == 0);
                    // reduce_scatter over the first n*rc elements (same canonical values)
                    std::vector<T> rs(rc);
                    c.reduce_scatter(in.data(), rs.data(), rc, dtype_of<T>, op, {a});
                    CHECK(wrong(rs, want.data() + static_cast<std::size_t>(r) * rc) == 0);
                    std::vector<T> red(count);
                    c.reduce(in.data(), red.data(), count, dtype_of<T>, op, n - 1, {a});
                    if (r == n - 1) CHECK(wrong(red, want.data()) == 0);
                  }
                }
            }(x),
            ...);
      },
      all_types{});
}

TEST_CASE("mpi: 2^20 f32 and bf16 sums", "[mpi][collectives]") {
  auto& c = comm();
  const std::size_t count = std::size_t{1} << 20;
  const auto inf = tessel_ref::gen_vec<float>(9, c.rank(), count, reduce_op::sum);
  const auto wantf = tessel_ref::reduce_vec<float>(9, c.size(), count, reduce_op::sum);
  const auto inb = tessel_ref::gen_vec<bf16>(10, c.rank(), count, reduce_op::sum);
  const auto wantb = tessel_ref::reduce_vec<bf16>(10, c.size(), count, reduce_op::sum);
  for (algorithm a : algos) {
    std::vector<float> of(count);
    c.all_reduce(inf.data(), of.data(), count, dtype::f32, reduce_op::sum, {a});
    CHECK(wrong(of, wantf.data()) == 0);
    std::vector<bf16> ob(count);
    c.all_reduce(inb.data(), ob.data(), count, dtype::bf16, reduce_op::sum, {a});
    CHECK(wrong(ob, wantb.data()) == 0);
  }
}

TEST_CASE("mpi: data movement collectives, send/recv, barrier, async", "[mpi][collectives]") {
  auto& c = comm();
  const int n = c.size(), r = c.rank();
  const auto N = static_cast<std::size_t>(n);
  for (std::size_t count : counts) {
    const auto mine = tessel_ref::gen_vec<e4m3>(5, r, count, reduce_op::sum);
    std::vector<e4m3> all(count * N);
    for (int q = 0; q < n; ++q) {
      auto v = tessel_ref::gen_vec<e4m3>(5, q, count, reduce_op::sum);
      std::copy(v.begin(), v.end(), all.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(q)));
    }
    for (algorithm a : algos) {
      std::vector<e4m3> b = mine;
      c.broadcast(b.data(), b.data(), count, dtype::e4m3, 1 % n, {a});
      CHECK(wrong(b, all.data() + count * static_cast<std::size_t>(1 % n)) == 0);
      std::vector<e4m3> ag(count * N);
      c.all_gather(mine.data(), ag.data(), count, dtype::e4m3, {a});
      CHECK(wrong(ag, all.data()) == 0);
    }
    std::vector<e4m3> g(count * N);
    c.gather(mine.data(), g.data(), count, dtype::e4m3, 0);
    if (r == 0) CHECK(wrong(g, all.data()) == 0);
    std::vector<e4m3> s(count);
    c.scatter(all.data(), s.data(), count, dtype::e4m3, 0);
    CHECK(wrong(s, all.data() + count * static_cast<std::size_t>(r)) == 0);
    std::vector<e4m3> a2a(count * N);
    c.all_to_all(all.data(), a2a.data(), count, dtype::e4m3);  // every rank sends the same blocks
    for (int q = 0; q < n; ++q)
      CHECK(tessel_ref::count_wrong(a2a.data() + count * static_cast<std::size_t>(q), all.data() + count * static_cast<std::size_t>(r), count) == 0);
    std::vector<e4m3> got(count);
    if (r % 2 == 0) {
      c.send(mine.data(), count, dtype::e4m3, (r + 1) % n, 3);
      c.recv(got.data(), count, dtype::e4m3, (r + n - 1) % n, 3);
    } else {
      c.recv(got.data(), count, dtype::e4m3, (r + n - 1) % n, 3);
      c.send(mine.data(), count, dtype::e4m3, (r + 1) % n, 3);
    }
    CHECK(wrong(got, all.data() + count * static_cast<std::size_t>((r + n - 1) % n)) == 0);
    c.barrier();
  }
  // async: two all-reduces in flight, then wait
  const std::size_t count = 4096;
  const auto in = tessel_ref::gen_vec<float>(6, r, count, reduce_op::sum);
  const auto want = tessel_ref::reduce_vec<float>(6, n, count, reduce_op::sum);
  std::vector<float> o1(count), o2(count);
  auto h1 = c.all_reduce_async(in.data(), o1.data(), count, dtype::f32, reduce_op::sum);
  auto h2 = c.all_reduce_async(in.data(), o2.data(), count, dtype::f32, reduce_op::sum, {algorithm::ring});
  h1.wait();
  h2.wait();
  CHECK(wrong(o1, want.data()) == 0);
  CHECK(wrong(o2, want.data()) == 0);
}
