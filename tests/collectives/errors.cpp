// Bad input to collectives gives a typed exception that names the problem, before any message is
// sent (so every rank passing the same bad input fails the same way, and nothing hangs).
#include <catch2/catch.hpp>

#include <chrono>
#include <limits>
#include <mutex>
#include <vector>

#include <tessel/collectives.hpp>
#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_collectives_errors {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;

namespace {
template <class F>
void on_two(F f) {
  std::mutex mu;
  std::exception_ptr first;
  threads_world w(2, std::chrono::seconds(5));  // a rank left waiting by a test bug fails fast
  w.run([&](threads_transport t) {
    communicator c(std::move(t));
    try {
      f(c);
    } catch (...) {
      std::lock_guard lk(mu);
      if (!first) first = std::current_exception();
    }
  });
  if (first) std::rethrow_exception(first);
}
}  // namespace

TEST_CASE("collectives: bad arguments throw typed errors", "[collectives][errors]") {
  std::vector<float> a(64), b(64);
  const std::size_t huge = std::numeric_limits<std::size_t>::max() / 2;
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.all_reduce(nullptr, b.data(), 4, dtype::f32, reduce_op::sum); }), comm_error,
                       is_error(errc::invalid_argument, "comm"));
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.all_reduce(a.data(), b.data(), huge, dtype::f32, reduce_op::sum); }), tessel::error,
                       is_error(errc::overflow, "comm"));
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.all_reduce(a.data(), a.data() + 1, 8, dtype::f32, reduce_op::sum); }), comm_error,
                       is_error(errc::invalid_argument, "comm"));  // partial overlap is not in place
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.all_reduce(reinterpret_cast<char*>(a.data()) + 1, b.data(), 4, dtype::f32, reduce_op::sum); }),
                       comm_error, is_error(errc::invalid_argument, "comm"));  // misaligned
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.all_reduce(a.data(), b.data(), 4, dtype::i4x2, reduce_op::sum); }), comm_error,
                       is_error(errc::invalid_argument, "comm"));
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.all_reduce(a.data(), b.data(), 4, static_cast<dtype>(200), reduce_op::sum); }),
                       tessel::type_error, is_error(errc::invalid_argument, "types", "invalid dtype value 200"));
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.all_reduce(a.data(), b.data(), 4, dtype::f32, static_cast<reduce_op>(9)); }), comm_error,
                       is_error(errc::invalid_argument, "comm"));
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.broadcast(a.data(), b.data(), 4, dtype::f32, 2); }), comm_error,
                       is_error(errc::out_of_range, "comm"));
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.reduce(a.data(), b.data(), 4, dtype::f32, reduce_op::sum, -1); }), comm_error,
                       is_error(errc::out_of_range, "comm"));
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.all_gather(a.data() + 1, a.data(), 8, dtype::f32); }), comm_error,
                       is_error(errc::invalid_argument, "comm"));  // in place only at recv + rank*count
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.all_gather(a.data(), b.data(), huge, dtype::f32); }), tessel::error,
                       is_error(errc::overflow, "comm"));
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.send(a.data(), 4, dtype::f32, c.rank()); }), comm_error, is_error(errc::out_of_range, "comm"));
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) {
                         std::vector<std::size_t> one(1, 0);
                         c.all_to_allv(a.data(), one, one, b.data(), one, one, dtype::f32);
                       }),
                       comm_error, is_error(errc::invalid_argument, "comm"));
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) {
                         std::span<const float> s(a.data(), 4);
                         std::span<float> r(b.data(), 5);
                         c.all_reduce(s, r, reduce_op::sum);
                       }),
                       comm_error, is_error(errc::invalid_argument, "comm"));
  CHECK_THROWS_MATCHES(threads_world(0), comm_error, is_error(errc::invalid_argument, "comm"));
  CHECK_THROWS_MATCHES(threads_world(2).transport(2), comm_error, is_error(errc::out_of_range, "comm"));
  CHECK_THROWS_MATCHES(algorithm_from_name("spiral"), comm_error, is_error(errc::invalid_argument, "comm"));
  CHECK_THROWS_MATCHES(reduce_op_from_name("xor"), comm_error, is_error(errc::invalid_argument, "comm"));
}

// Threads-transport sends complete only when received: a ring of blocking sends would deadlock,
// one of send_recv calls must not (each send is posted before the receive waits).
TEST_CASE("send_recv: a ring shift and a pairwise swap with different tags complete, and bad peers are errors", "[collectives][p2p]") {
  constexpr int n = 4;
  std::vector<std::vector<float>> got(n), swapped(n);
  threads_world::run(n, [&](threads_transport t) {
    communicator c(std::move(t));
    const int r = c.rank();
    std::vector<float> mine(5, float(r)), in(5, -1.0f);
    c.send_recv(std::span<const float>(mine), (r + 1) % n, 5, std::span<float>(in), (r + n - 1) % n, 5);
    got[std::size_t(r)] = in;
    // pairs (0,1), (2,3): forward on tag 1, back on tag 2
    const int peer = r ^ 1;
    std::vector<float> back(3, -1.0f), fwd(3, float(10 + r));
    if (r % 2 == 0)
      c.send_recv(std::span<const float>(fwd), peer, 1, std::span<float>(back), peer, 2);
    else
      c.send_recv(std::span<const float>(fwd), peer, 2, std::span<float>(back), peer, 1);
    swapped[std::size_t(r)] = back;
  });
  for (int r = 0; r < n; ++r) {
    CHECK(got[std::size_t(r)] == std::vector<float>(5, float((r + n - 1) % n)));
    CHECK(swapped[std::size_t(r)] == std::vector<float>(3, float(10 + (r ^ 1))));
  }
  std::vector<float> a(4);
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.send_recv(a.data(), 4, c.rank(), 0, a.data(), 4, -1, 0, dtype::f32); }), comm_error,
                       is_error(errc::out_of_range, "comm"));
  CHECK_THROWS_MATCHES(on_two([&](communicator& c) { c.send_recv(nullptr, 4, 1 - c.rank(), 0, a.data(), 4, 1 - c.rank(), 0, dtype::f32); }),
                       comm_error, is_error(errc::invalid_argument, "comm", "send_recv: send buffer is null"));
}

TEST_CASE("collectives: a message of the wrong size is a length_error, not a silent truncation", "[collectives][errors]") {
  int caught = 0;
  std::mutex mu;
  threads_world::run(2, [&](threads_transport t) {
    communicator c(std::move(t));
    std::vector<float> x(8);
    try {
      if (c.rank() == 0)
        c.send(x.data(), 4, dtype::f32, 1);
      else
        c.recv(x.data(), 8, dtype::f32, 0);
    } catch (const comm_error& e) {
      CHECK(e.code() == errc::invalid_argument);
      std::lock_guard lk(mu);
      ++caught;
    }
  });
  CHECK(caught == 1);
}

TEST_CASE("collectives: count 0 and one rank are no-ops that still validate", "[collectives][errors]") {
  threads_world::run(1, [&](threads_transport t) {
    communicator c(std::move(t));
    std::vector<bf16> x(3, bf16(1.5f)), y(3);
    c.all_reduce(x.data(), y.data(), 3, dtype::bf16, reduce_op::avg);
    CHECK(static_cast<float>(y[1]) == 1.5f);
    c.all_reduce(nullptr, nullptr, 0, dtype::bf16, reduce_op::sum);
    c.barrier();
    CHECK(c.shrink().size() == 1);  // nothing failed: shrink keeps everyone
  });
}

}  // namespace tessel_test_collectives_errors
