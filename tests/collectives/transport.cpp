// The transport concept, point to point, on every in-process model (threads and the emulated
// fabric with payloads), directly and through the type-erased transport_model the algorithms use:
// every ordered pair of ranks exchanges messages of 0, 1, 7, 4096 and 65537 bytes intact;
// messages with one tag between one pair arrive in posting order (non-overtaking) while other tags
// may be received first; a consumer sees pieces covering the message once, in order; and the
// error paths (peer out of range, size mismatch, abort, timeout, bad worlds) throw with a message.
// Rank threads only count failures (Catch2 is not thread-safe); the test thread checks.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <tessel/collectives/transport.hpp>
#include <tessel/collectives/transport/emulated.hpp>
#include <tessel/collectives/transport/threads.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_collectives_transport {

using namespace tessel;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;

namespace {
std::byte payload(int src, int dst, tag_t tag, std::size_t i) {
  std::uint64_t h = (std::uint64_t(src) * 1000003u) ^ (std::uint64_t(dst) * 7919u) ^ (tag * 104729u) ^ (i * 2654435761u);
  h ^= h >> 29;
  return std::byte(h * 0xBF58476D1CE4E5B9ull >> 56);
}
std::vector<std::byte> message(int src, int dst, tag_t tag, std::size_t n) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = payload(src, dst, tag, i);
  return v;
}
const std::size_t sizes[] = {0, 1, 7, 4096, 65537};

emu::cluster_config cluster_of(std::size_t cards) {
  emu::cluster_config cfg;
  cfg.cards_per_supernode = cards;
  cfg.scaleout.supernodes = 1;
  cfg.card.memory_bytes = std::size_t{1} << 28;
  return cfg;
}

// Runs f(transport) on n ranks of the model.
struct threads_model {
  static constexpr const char* name = "threads";
  template <class F>
  static void run(int n, F f) {
    threads_world::run(n, f);
  }
};
struct emulated_model {
  static constexpr const char* name = "emulated";
  template <class F>
  static void run(int n, F f) {
    emu::cluster cl(cluster_of(std::size_t(n)), 1);
    emulated_world(cl).run(f);
  }
};

// Every rank sends every size to every other rank (tag = size index), all sends posted before any
// receive; receives go peer by peer.
template <class Model>
std::size_t all_pairs(int n) {
  std::atomic<std::size_t> bad{0};
  Model::run(n, [&](auto t) {
    const int me = t.rank();
    if (t.size() != n) ++bad;
    std::vector<std::vector<std::byte>> out;
    std::vector<typename decltype(t)::send_request> reqs;
    for (int p = 0; p < n; ++p)
      for (std::size_t k = 0; k < std::size(sizes); ++k) {
        if (p == me) continue;
        out.push_back(message(me, p, k, sizes[k]));
        reqs.push_back(t.isend(p, k, out.back()));
      }
    for (int p = 0; p < n; ++p)
      for (std::size_t k = 0; k < std::size(sizes); ++k) {
        if (p == me) continue;
        std::vector<std::byte> in(sizes[k], std::byte{0xEE});
        t.recv_into(p, k, in);
        if (in != message(p, me, k, sizes[k])) ++bad;
      }
    for (auto& r : reqs) t.wait(r);
  });
  return bad;
}

// Ordering, consumer pieces and the type-erased interface between ranks 0 and 1.
template <class Model>
std::size_t ordering_and_consumers() {
  std::atomic<std::size_t> bad{0};
  Model::run(2, [&](auto t) {
    using T = decltype(t);
    tessel::detail::transport_model<T> m(std::move(t));
    if (m.rank() < 0 || m.size() != 2 || !m.can_shrink()) ++bad;
    if (m.shared_address_space() != std::is_same_v<T, threads_transport>) ++bad;
    if (m.is_simulated() != std::is_same_v<T, emulated_transport>) ++bad;
    if (m.rank() == 0) {
      std::vector<std::vector<std::byte>> out;
      for (int i = 0; i < 3; ++i) out.push_back(message(0, 1, 100 + i, 1000));  // three on tag 7, in order
      out.push_back(message(0, 1, 1, 33));
      out.push_back(message(0, 1, 2, 44));
      out.push_back(message(0, 1, 3, 5000));
      std::vector<tessel::detail::transport_iface::request> reqs;
      for (int i = 0; i < 3; ++i) reqs.push_back(m.isend(1, 7, out[std::size_t(i)]));
      reqs.push_back(m.isend(1, 1, out[3]));
      reqs.push_back(m.isend(1, 2, out[4]));
      reqs.push_back(m.isend(1, 3, out[5]));
      for (auto& r : reqs) m.wait(r);
      for (auto& r : reqs) m.wait(r);  // waiting twice is harmless
    } else {
      for (int i = 0; i < 3; ++i) {
        std::vector<std::byte> in(1000);
        m.recv_into(0, 7, in);
        if (in != message(0, 1, 100 + i, 1000)) ++bad;  // posting order
      }
      std::vector<std::byte> b2(44), b1(33);
      m.recv_into(0, 2, b2);  // tag 2 before tag 1: tags only disambiguate
      auto r1 = m.irecv_into(0, 1, b1);
      m.wait(r1);
      if (b2 != message(0, 1, 2, 44) || b1 != message(0, 1, 1, 33)) ++bad;
      std::vector<std::byte> got(5000);
      std::size_t covered = 0;
      m.recv(0, 3, 5000, [&](std::span<const std::byte> piece, std::size_t off) {
        if (off != covered) ++bad;  // consecutive pieces
        std::copy(piece.begin(), piece.end(), got.begin() + std::ptrdiff_t(off));
        covered += piece.size();
      });
      if (covered != 5000 || got != message(0, 1, 3, 5000)) ++bad;
    }
  });
  return bad;
}
}  // namespace

TEST_CASE("transport models satisfy the concept, others do not", "[collectives][transport]") {
  STATIC_REQUIRE(transport<threads_transport>);
  STATIC_REQUIRE(transport<emulated_transport>);
  STATIC_REQUIRE_FALSE(transport<int>);
  STATIC_REQUIRE_FALSE(transport<threads_world>);
}

TEST_CASE("function_ref calls the referenced callable in place, with its state", "[collectives][transport]") {
  int calls = 0;
  std::size_t total = 0;
  auto consumer = [&](std::span<const std::byte> s, std::size_t off) {
    ++calls;
    total += s.size() + off;
  };
  recv_consumer f = consumer;
  std::vector<std::byte> buf(10);
  f(buf, 5);
  f(std::span<const std::byte>(buf.data(), 3), 0);
  REQUIRE(calls == 2);
  REQUIRE(total == 18);
  function_ref<int(int)> sq = [](int x) { return x * x; };
  REQUIRE(sq(7) == 49);
  function_ref<int(int)> copy = sq;  // copies refer to the same callable
  REQUIRE(copy(3) == 9);
}

TEMPLATE_TEST_CASE("point to point: every pair, every size, intact", "[collectives][transport]", threads_model, emulated_model) {
  for (int n : {2, 3, 5}) {
    INFO(TestType::name << " ranks " << n);
    REQUIRE(all_pairs<TestType>(n) == 0);
  }
}

TEMPLATE_TEST_CASE("point to point: non-overtaking per tag, any tag order, consumers, type-erased requests", "[collectives][transport]",
                   threads_model, emulated_model) {
  REQUIRE(ordering_and_consumers<TestType>() == 0);
}

TEMPLATE_TEST_CASE("a peer outside the ranks 0..size-1 is an error on every operation", "[collectives][transport][errors]", threads_model,
                   emulated_model) {
  std::atomic<int> thrown{0};
  TestType::run(2, [&](auto t) {
    std::vector<std::byte> b(4);
    for (int peer : {-1, 2, 100}) {
      try {
        auto r = t.isend(peer, 0, b);
      } catch (const std::exception& e) {
        if (std::string(e.what()).find("outside [0, 2)") != std::string::npos) ++thrown;
      }
      try {
        t.recv_into(peer, 0, b);
      } catch (const std::exception& e) {
        if (std::string(e.what()).find("outside [0, 2)") != std::string::npos) ++thrown;
      }
    }
  });
  REQUIRE(thrown == 2 * 2 * 3);
}

TEST_CASE("threads: a receive of the wrong size, abort, and a silent peer's timeout", "[collectives][transport][errors]") {
  std::atomic<int> ok{0};
  threads_world::run(2, [&](threads_transport t) {
    std::vector<std::byte> b(16);
    if (t.rank() == 0) {
      auto r = t.isend(1, 5, b);
      t.wait(r);  // the rejected message still completes the send
      ++ok;
    } else {
      std::vector<std::byte> small(8);
      try {
        t.recv_into(0, 5, small);
      } catch (const std::exception& e) {
        if (std::string(e.what()).find("expected 8 bytes from rank 0, got 16") != std::string::npos) ++ok;
      }
    }
  });
  REQUIRE(ok == 2);
  threads_world w(2);
  w.abort();
  std::vector<std::byte> b(4);
  REQUIRE_THROWS_WITH(w.transport(0).isend(1, 0, b), Contains("aborted"));
  REQUIRE_THROWS_WITH(w.transport(1).recv_into(0, 0, b), Contains("aborted"));
  std::string timeout_msg;
  threads_world(2, 50ms).run([&](threads_transport t) {
    if (t.rank() == 0) {
      std::vector<std::byte> in(4);
      try {
        t.recv_into(1, 9, in);  // rank 1 never sends
      } catch (const std::exception& e) { timeout_msg = e.what(); }
    }
  });
  REQUIRE_THAT(timeout_msg, Contains("timed out"));
}

TEST_CASE("emulated: after abort every operation fails", "[collectives][transport][errors]") {
  emu::cluster cl(cluster_of(2), 1);
  std::atomic<int> ok{0};
  emulated_world(cl).run([&](emulated_transport t) {
    std::vector<std::byte> b(4);
    t.abort();
    try {
      auto r = t.isend(1 - t.rank(), 0, b);
    } catch (const std::exception& e) {
      if (std::string(e.what()).find("aborted") != std::string::npos) ++ok;
    }
  });
  REQUIRE(ok == 2);
}

TEST_CASE("worlds reject empty or out-of-range rank sets", "[collectives][transport][errors]") {
  REQUIRE_THROWS_WITH(threads_world(0), Contains("rank count must be positive"));
  REQUIRE_THROWS_WITH(threads_world(2, 0ms), Contains("timeout must be positive"));
  REQUIRE_THROWS_WITH(threads_world(2).transport(2), Contains("outside [0, 2)"));
  REQUIRE_THROWS_WITH(threads_world(2).set_spin(std::chrono::nanoseconds(-1)), Contains("spin"));
  emu::cluster cl(cluster_of(2), 1);
  REQUIRE_THROWS_WITH(emulated_world(cl, {}), Contains("no cards"));
  REQUIRE_THROWS_WITH(emulated_world(cl, {0, 5}), Contains("outside the cluster"));
  REQUIRE_THROWS_WITH(emulated_world(cl).transport(-1), Contains("outside [0, 2)"));
  REQUIRE_THROWS_WITH(emulated_world::run_default(0, [](emulated_transport) {}), Contains("rank count must be positive"));
}

}  // namespace tessel_test_collectives_transport
