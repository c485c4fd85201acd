// MoE dispatch/combine (DeepEP semantics) against a single-process reference built from every
// rank's regenerated inputs: rows grouped by local expert, per-expert counts, BF16 and FP8 payloads,
// combine's rank-order FP32 sum of BF16 partials, both backward passes, empty ranks, -1 slots and
// bad expert indices.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/collectives/moe.hpp>
#include <tessel/collectives/transport/emulated.hpp>
#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_collectives_moe {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;

namespace {
struct rank_input {
  std::vector<bf16> x;
  std::vector<std::int64_t> idx;
  std::vector<float> w;
  std::size_t tokens;
};
rank_input make_input(int r, std::size_t hidden, std::size_t top_k, int num_experts, std::uint64_t seed) {
  std::mt19937_64 g(seed * 1000 + static_cast<std::uint64_t>(r));
  rank_input in;
  in.tokens = r == 1 ? 0 : 3 + g() % 9;  // rank 1 has no tokens
  in.x.resize(in.tokens * hidden);
  for (auto& v : in.x) v = bf16(static_cast<float>(static_cast<int>(g() % 2001) - 1000) / 256.0f);
  in.idx.resize(in.tokens * top_k);
  in.w.resize(in.tokens * top_k);
  for (std::size_t i = 0; i < in.idx.size(); ++i) {
    const auto u = g() % 10;
    in.idx[i] = u == 0 ? -1 : static_cast<std::int64_t>(g() % static_cast<std::uint64_t>(num_experts));
    in.w[i] = static_cast<float>(g() % 1000) / 997.0f;
  }
  if (in.tokens > 2)  // one token with no expert at all
    for (std::size_t k = 0; k < top_k; ++k) in.idx[2 * top_k + k] = -1;
  return in;
}
bf16 expert_out(bf16 x, int global_expert) { return bf16(static_cast<float>(x) * (0.5f + static_cast<float>(global_expert))); }
}  // namespace

TEST_CASE("moe: dispatch groups rows by local expert, and combine and backward match the reference bitwise", "[collectives][moe]") {
  const std::size_t hidden = 256, top_k = 4;
  for (int n : {1, 2, 3, 4}) {
    const int E = 4 * n, epr = E / n;
    std::vector<rank_input> ins;
    for (int r = 0; r < n; ++r) ins.push_back(make_input(r, hidden, top_k, E, 5));
    std::mutex mu;
    std::vector<std::string> problems;
    auto fail = [&](const std::string& s) {
      std::lock_guard lk(mu);
      problems.push_back("n=" + std::to_string(n) + ": " + s);
    };
    threads_world::run(n, [&](threads_transport t) {
      communicator c(std::move(t));
      const int me = c.rank();
      const auto& in = ins[static_cast<std::size_t>(me)];
      auto d = moe_dispatch(c, in.x, hidden, in.idx, in.w, top_k, E);
      // reference rows on this rank
      struct row {
        int src;
        std::size_t tok, k;
        int expert;
      };
      std::vector<std::pair<int, std::size_t>> distinct;
      for (int q = 0; q < n; ++q)
        for (std::size_t tk = 0; tk < ins[q].tokens; ++tk) {
          bool mine = false;
          for (std::size_t k = 0; k < top_k; ++k) mine |= ins[q].idx[tk * top_k + k] >= 0 && ins[q].idx[tk * top_k + k] / epr == me;
          if (mine) distinct.push_back({q, tk});
        }
      std::vector<row> rows;
      std::vector<std::size_t> per_expert(static_cast<std::size_t>(epr), 0);
      for (int e = 0; e < epr; ++e)
        for (auto [q, tk] : distinct)
          for (std::size_t k = 0; k < top_k; ++k)
            if (ins[q].idx[tk * top_k + k] == me * epr + e) {
              rows.push_back({q, tk, k, e});
              ++per_expert[static_cast<std::size_t>(e)];
            }
      if (d.handle.rows() != rows.size() || d.tokens_per_expert() != per_expert) return fail("row counts differ");
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const auto& rw = rows[i];
        if (std::memcmp(d.x.data() + i * hidden, ins[rw.src].x.data() + rw.tok * hidden, hidden * 2) != 0) return fail("row data differ");
        if (d.weights()[i] != ins[rw.src].w[rw.tok * top_k + rw.k]) return fail("row weight differs");
      }
      // expert outputs, then combine
      std::vector<bf16> y(rows.size() * hidden);
      for (std::size_t i = 0; i < rows.size(); ++i)
        for (std::size_t j = 0; j < hidden; ++j) y[i * hidden + j] = expert_out(d.x[i * hidden + j], me * epr + rows[i].expert);
      const auto out = moe_combine(c, y, d.handle);
      const auto gx = moe_dispatch_backward(c, y, d.handle);
      // reference combine for this rank's tokens: per destination rank (ascending) a BF16 partial
      // of w * y over its rows in (local expert, k) order, then the FP32 sum of partials
      for (std::size_t tk = 0; tk < in.tokens; ++tk)
        for (std::size_t j = 0; j < hidden; ++j) {
          float acc = 0, accg = 0;
          bool any = false;
          for (int q = 0; q < n; ++q) {
            float part = 0, partg = 0;
            bool has = false;
            for (int e = 0; e < epr; ++e)
              for (std::size_t k = 0; k < top_k; ++k)
                if (in.idx[tk * top_k + k] == q * epr + e) {
                  const float yv = static_cast<float>(expert_out(in.x[tk * hidden + j], q * epr + e));
                  part += in.w[tk * top_k + k] * yv;
                  partg += yv;
                  has = true;
                }
            if (!has) continue;
            const float p = static_cast<float>(bf16(part)), pg = static_cast<float>(bf16(partg));
            acc = any ? acc + p : p;
            accg = any ? accg + pg : pg;
            any = true;
          }
          if (bf16(acc).bits() != out[tk * hidden + j].bits()) return fail("combine differs at token " + std::to_string(tk));
          if (bf16(accg).bits() != gx[tk * hidden + j].bits()) return fail("dispatch_backward differs");
        }
      // combine backward: each row gets weight * grad_out[token]
      const auto gy = moe_combine_backward(c, in.x, d.handle);
      for (std::size_t i = 0; i < rows.size(); ++i)
        for (std::size_t j = 0; j < hidden; ++j) {
          const bf16 want(ins[rows[i].src].w[rows[i].tok * top_k + rows[i].k] * static_cast<float>(ins[rows[i].src].x[rows[i].tok * hidden + j]));
          if (want.bits() != gy[i * hidden + j].bits()) return fail("combine_backward differs");
        }
      // FP8 dispatch carries the quantized bytes and scales unchanged
      std::vector<e4m3> q8(in.x.size());
      std::vector<float> sc(in.x.size() / 128);
      moe_quantize_fp8(in.x, hidden, q8, sc);
      auto d8 = moe_dispatch_fp8(c, q8, sc, hidden, in.idx, in.w, top_k, E);
      if (d8.handle.rows() != rows.size()) return fail("fp8 row count differs");
      for (std::size_t i = 0; i < rows.size(); ++i)
        for (std::size_t j = 0; j < hidden; ++j) {
          const float deq = static_cast<float>(d8.x[i * hidden + j]) * d8.scales[i * (hidden / 128) + j / 128];
          const float orig = static_cast<float>(ins[rows[i].src].x[rows[i].tok * hidden + j]);
          if (std::fabs(deq - orig) > std::fabs(orig) * 0.0625f + d8.scales[i * (hidden / 128) + j / 128] * 0x1p-9f)
            return fail("fp8 payload outside the E4M3 rounding bound");
        }
    });
    for (auto& p : problems) FAIL_CHECK(p);
  }
}

TEST_CASE("moe: row-exact forms move f32 rows to their experts and each expert row back to its own slot", "[collectives][moe]") {
  const std::size_t hidden = 24, top_k = 3;  // any hidden: these forms have no 128-channel groups
  for (int n : {1, 2, 3, 4}) {
    const int E = 2 * n, epr = E / n;
    std::vector<rank_input> ins;
    for (int r = 0; r < n; ++r) ins.push_back(make_input(r, hidden, top_k, E, 11));
    std::mutex mu;
    std::vector<std::string> problems;
    auto fail = [&](const std::string& s) {
      std::lock_guard lk(mu);
      problems.push_back("n=" + std::to_string(n) + ": " + s);
    };
    auto value = [](int src, std::size_t tok, std::size_t j) { return static_cast<float>(src * 1000 + static_cast<int>(tok)) + 0.001f * float(j); };
    threads_world::run(n, [&](threads_transport t) {
      communicator c(std::move(t));
      const int me = c.rank();
      const auto& in = ins[static_cast<std::size_t>(me)];
      std::vector<float> x(in.tokens * hidden);
      for (std::size_t tk = 0; tk < in.tokens; ++tk)
        for (std::size_t j = 0; j < hidden; ++j) x[tk * hidden + j] = value(me, tk, j);
      auto d = moe_dispatch_rows<float>(c, x, hidden, in.idx, in.w, top_k, E);
      const auto& h = d.handle;
      // every row is its source token's f32 row, unchanged, grouped by local expert
      for (std::size_t i = 0; i < h.rows(); ++i) {
        const int src = h.recv_src_rank[h.row_token[i]];
        const auto tok = static_cast<std::size_t>(h.recv_src_token[h.row_token[i]]);
        if (ins[src].idx[tok * top_k + static_cast<std::size_t>(h.row_k[i])] != me * epr + h.row_expert[i])
          return fail("row routed to the wrong expert");
        for (std::size_t j = 0; j < hidden; ++j)
          if (d.x[i * hidden + j] != value(src, tok, j)) return fail("row data changed");
      }
      // each expert row, tagged with its expert and slot, comes back to exactly that slot
      std::vector<float> y(h.rows() * hidden);
      for (std::size_t i = 0; i < h.rows(); ++i)
        for (std::size_t j = 0; j < hidden; ++j)
          y[i * hidden + j] = d.x[i * hidden + j] * 2.0f + float(me * epr + h.row_expert[i]) + 0.25f * float(h.row_k[i]);
      const auto back = moe_return_rows<float>(c, y, h);
      if (back.size() != in.tokens * top_k * hidden) return fail("returned slots have the wrong size");
      for (std::size_t tk = 0; tk < in.tokens; ++tk)
        for (std::size_t k = 0; k < top_k; ++k) {
          const std::int64_t e = in.idx[tk * top_k + k];
          for (std::size_t j = 0; j < hidden; ++j) {
            const float want = e < 0 ? 0.0f : value(me, tk, j) * 2.0f + float(e) + 0.25f * float(k);
            if (back[(tk * top_k + k) * hidden + j] != want) return fail("slot " + std::to_string(tk) + "," + std::to_string(k) + " got another row");
          }
        }
      // and moe_send_rows is its inverse: the slots go back to the rows they came from
      const auto rows = moe_send_rows<float>(c, back, h);
      if (rows != y) return fail("send_rows(return_rows(y)) != y");
      // the same with BF16 rows (moe_dispatch_rows<bf16> is moe_dispatch)
      auto db = moe_dispatch_rows<bf16>(c, in.x, hidden, in.idx, in.w, top_k, E);
      auto dd = moe_dispatch(c, in.x, hidden, in.idx, in.w, top_k, E);
      if (db.x.size() != dd.x.size() || std::memcmp(db.x.data(), dd.x.data(), db.x.size() * sizeof(bf16)) != 0)
        return fail("bf16 rows differ from moe_dispatch");
      const auto bb = moe_send_rows<bf16>(c, moe_return_rows<bf16>(c, db.x, db.handle), db.handle);
      if (bb.size() != db.x.size() || std::memcmp(bb.data(), db.x.data(), bb.size() * sizeof(bf16)) != 0) return fail("bf16 round trip differs");
    });
    for (auto& p : problems) FAIL_CHECK(p);
  }
}

TEST_CASE("moe: row-exact forms reject sizes that do not match the handle", "[collectives][moe][errors]") {
  std::atomic<int> good{0};
  threads_world::run(2, [&](threads_transport t) {
    communicator c(std::move(t));
    auto throws = [&](auto&& fn, errc code, const char* fragment) {
      try {
        fn();
      } catch (const comm_error& e) {
        if (is_error(code, "comm", fragment).match(e)) ++good;
      }
    };
    const std::vector<float> x(4 * 8, 1.0f);
    const std::vector<std::int64_t> idx{0, 1, 2, 3};
    const std::vector<float> w(4, 0.25f);
    auto d = moe_dispatch_rows<float>(c, x, 8, idx, w, 1, 4);
    const std::vector<float> wrong(d.x.size() + 8);
    throws([&] { (void)moe_return_rows<float>(c, wrong, d.handle); }, errc::invalid_argument, "y must hold rows * hidden");
    throws([&] { (void)moe_send_rows<float>(c, wrong, d.handle); }, errc::invalid_argument, "tokens * top_k * hidden");
    moe_handle empty;
    empty.ranks = 2;
    throws([&] { (void)moe_return_rows<float>(c, d.x, empty); }, errc::invalid_argument, "not filled by a dispatch");
  });
  CHECK(good == 6);
}

TEST_CASE("moe: bad routing is a typed error on every rank", "[collectives][moe][errors]") {
  std::mutex mu;
  int oor = 0, inv = 0;
  threads_world::run(2, [&](threads_transport t) {
    communicator c(std::move(t));
    std::vector<bf16> x(2 * 128);
    std::vector<std::int64_t> idx{0, 8, -1, 1};
    std::vector<float> w(4, 1.0f);
    try {
      moe_dispatch(c, x, 128, idx, w, 2, 8);
    } catch (const comm_error& e) {
      std::lock_guard lk(mu);
      if (e.code() == errc::out_of_range) ++oor;
    }
    idx[1] = 1;
    try {
      moe_dispatch(c, x, 128, idx, w, 2, 7);
    } catch (const comm_error& e) {
      std::lock_guard lk(mu);
      if (e.code() == errc::invalid_argument) ++inv;
    }
  });
  CHECK(oor == 2);
  CHECK(inv == 2);
}

namespace {
// Per rank: simulated seconds of dispatch, combine, dispatch_backward and combine_backward, and the routing.
struct moe_timing {
  std::vector<double> t;
  std::vector<std::size_t> per_expert, row_token;
  std::size_t x_size = 0;
};
std::vector<moe_timing> time_moe_on_cluster(bool timing_only, std::size_t ranks, std::size_t tokens, std::size_t hidden, std::size_t top_k, int E) {
  emu::cluster_config cfg;
  cfg.cards_per_supernode = ranks;
  cfg.card.memory_bytes = std::size_t{1} << 30;
  emu::cluster cl(cfg, 1);
  std::vector<moe_timing> out(ranks);
  emulated_world(cl).run([&](emulated_transport tp) {
    communicator c(std::move(tp));
    const int me = c.rank();
    std::mt19937_64 g(77 + static_cast<std::uint64_t>(me));
    const std::size_t nt = me == 1 ? 0 : tokens + g() % 5;  // rank 1 sends nothing
    std::vector<std::int64_t> idx(nt * top_k);
    std::vector<float> w(idx.size());
    for (std::size_t i = 0; i < idx.size(); ++i) {
      idx[i] = g() % 7 == 0 ? -1 : static_cast<std::int64_t>(g() % static_cast<std::uint64_t>(E));
      w[i] = static_cast<float>(g() % 100) / 97.0f;
    }
    auto& o = out[static_cast<std::size_t>(me)];
    double t0 = c.now();
    moe_dispatch_result<e4m3> d;
    std::vector<e4m3> x(nt * hidden, e4m3(1.0f));
    std::vector<float> sc(nt * hidden / 128, 1.0f);
    if (timing_only)
      d = moe_dispatch_fp8(c, moe_timing_only, nt, hidden, idx, w, top_k, E);
    else
      d = moe_dispatch_fp8(c, x, sc, hidden, idx, w, top_k, E);
    o.t.push_back(c.now() - t0);
    o.per_expert = d.tokens_per_expert();
    o.row_token = d.handle.row_token;
    o.x_size = d.x.size();
    std::vector<bf16> y(timing_only ? 0 : d.handle.rows() * hidden, bf16(0.5f)), go(timing_only ? 0 : nt * hidden, bf16(0.25f));
    t0 = c.now();
    auto r1 = moe_combine(c, y, d.handle);
    o.t.push_back(c.now() - t0);
    t0 = c.now();
    auto r2 = moe_dispatch_backward(c, y, d.handle);
    o.t.push_back(c.now() - t0);
    t0 = c.now();
    auto r3 = moe_combine_backward(c, go, d.handle);
    o.t.push_back(c.now() - t0);
    if (timing_only && (!r1.empty() || !r2.empty() || !r3.empty())) o.t.push_back(-1);  // must stay empty
  });
  return out;
}
}  // namespace

TEST_CASE("moe: timing-only dispatch/combine takes the same simulated time as with payloads", "[collectives][moe][emulated]") {
  const std::size_t ranks = 4, tokens = 40, hidden = 512, top_k = 4;
  const int E = 16;
  const auto real = time_moe_on_cluster(false, ranks, tokens, hidden, top_k, E);
  const auto dry = time_moe_on_cluster(true, ranks, tokens, hidden, top_k, E);
  for (std::size_t r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    REQUIRE(real[r].t.size() == 4);
    REQUIRE(dry[r].t.size() == 4);
    for (std::size_t i = 0; i < 4; ++i) {
      INFO("phase " << i << ": real " << real[r].t[i] << " s, timing-only " << dry[r].t[i] << " s");
      CHECK(real[r].t[i] > 0);
      CHECK(real[r].t[i] == dry[r].t[i]);
    }
    CHECK(real[r].per_expert == dry[r].per_expert);
    CHECK(real[r].row_token == dry[r].row_token);
    CHECK(real[r].x_size == real[r].row_token.size() * hidden);
    CHECK(dry[r].x_size == 0);
  }
}

TEST_CASE("moe: timing-only needs a transport that times byte counts, and routing needs real metadata", "[collectives][moe][errors]") {
  std::atomic<int> inv{0};
  threads_world::run(2, [&](threads_transport t) {
    communicator c(std::move(t));
    std::vector<std::int64_t> idx{0, 1};
    std::vector<float> w(2, 1.0f);
    try {
      moe_dispatch_fp8(c, moe_timing_only, 1, 128, idx, w, 2, 4);
    } catch (const comm_error& e) {
      if (e.code() == errc::invalid_argument) ++inv;
    }
  });
  CHECK(inv == 2);
  emu::cluster_config cfg;  // a timing-only cluster moves no bytes at all: routing cannot be exchanged
  cfg.cards_per_supernode = 2;
  cfg.timing_only = true;
  emu::cluster cl(cfg, 1);
  inv = 0;
  emulated_world(cl).run([&](emulated_transport tp) {
    communicator c(std::move(tp));
    std::vector<std::int64_t> idx{0, 1};
    std::vector<float> w(2, 1.0f);
    try {
      moe_dispatch_fp8(c, moe_timing_only, 1, 128, idx, w, 2, 4);
    } catch (const comm_error& e) {
      if (e.code() == errc::unsupported) ++inv;
    }
  });
  CHECK(inv == 2);
}

}  // namespace tessel_test_collectives_moe
