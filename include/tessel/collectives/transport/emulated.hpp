// The emulated transport: ranks are cards of an emulated UBL128 cluster (tessel/emulator.hpp).
// Messages are the cluster's two-sided send/recv, so their timing comes from the fabric model and
// now() is the card's simulated clock. Payloads move between the algorithms' host buffers (the
// cluster allows host buffers for send/recv); in a timing-only cluster no bytes move and the
// collectives run their message schedule without arithmetic (see detail::coll_dry_run). In a
// cluster that moves payloads, a null buffer is still a timed, payload-free message of its size
// (communicator::all_to_allv_timing), so real metadata and timing-only payloads can mix.
// Emulator faults become comm errors: a failed card -> peer_failed_error, a simulated timeout ->
// comm_timeout_error, a lost link -> comm_error; shrink() keeps the cards not known to have failed.
// ULFM's other two verbs: revoke() ends every pending transfer of the world at once (its message
// reaches the others a direct latency after the revoking card's clock; later posts are refused),
// and agree() is a fault-tolerant agreement: every live rank's contribution, returned to each
// caller alike, which never waits for a rank whose card failed or whose thread has ended.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <map>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <tessel/collectives/errors.hpp>
#include <tessel/collectives/transport.hpp>
#include <tessel/emulator/cluster.hpp>

namespace tessel {
inline namespace v0 {}  // namespace v0
namespace detail {
struct emulated_shared {
  emu::cluster* cl = nullptr;
  std::vector<std::size_t> cards;  // rank -> card
  std::mutex mu;
  std::atomic<bool> aborted{false};
  std::atomic<bool> revoked{false};
  std::atomic<int> revoked_by{-1};
  // Context of this world's messages, mixed into every cluster tag (MPI's context id): a shrunk
  // world never matches messages a failed collective of its parent left unmatched.
  std::uint64_t context = 0;
  std::uint64_t cluster_tag(std::uint64_t tag) const { return context ? tag ^ (context * 0x9E3779B97F4A7C15ull) : tag; }
  std::shared_ptr<emulated_shared> successor;
  std::vector<int> successor_ranks;
  // Posts hold it shared (check the state, then post); revoke holds it alone: a transfer is either
  // posted before the revoke (and ended by it) or refused.
  std::shared_mutex post_mu;
  // agree(): the k-th call of every rank meets in rounds[k]; `left`: ranks whose thread has ended
  std::mutex amu;
  std::condition_variable acv;
  std::vector<std::uint64_t> agree_calls;
  std::vector<char> left;
  struct agree_round {
    std::vector<std::optional<std::vector<std::uint64_t>>> dep;
    double latest = 0, end = 0;
    bool closed = false;
  };
  std::map<std::uint64_t, agree_round> rounds;
  void mark_left(int r) {
    std::shared_ptr<emulated_shared> next;
    int nr = -1;
    {
      std::lock_guard lk(amu);
      if (left.size() != cards.size()) left.assign(cards.size(), 0);
      left[std::size_t(r)] = 1;
      acv.notify_all();
    }
    {
      std::lock_guard lk(mu);
      next = successor;
      const auto it = std::find(successor_ranks.begin(), successor_ranks.end(), r);
      if (it != successor_ranks.end()) nr = int(it - successor_ranks.begin());
    }
    if (next && nr >= 0) next->mark_left(nr);
  }
  // The world failed: refuse later posts, end the pending transfers between its cards at `at`.
  void revoke(int failed, double at) {
    std::unique_lock lk(post_mu);
    if (revoked.exchange(true)) return;
    revoked_by = failed;
    cl->cancel(cards, at, "communicator revoked");
  }
  int rank_of(std::size_t card) const {
    for (std::size_t r = 0; r < cards.size(); ++r)
      if (cards[r] == card) return static_cast<int>(r);
    return -1;
  }
};
}  // namespace detail
inline namespace v0 {

class emulated_transport;

// A set of cards of one cluster acting as ranks 0..n-1 (by default every card, in order).
class emulated_world {
 public:
  explicit emulated_world(emu::cluster& cl) : emulated_world(cl, all_cards(cl)) {}
  emulated_world(emu::cluster& cl, std::vector<std::size_t> cards) : s_(std::make_shared<detail::emulated_shared>()) {
    if (cards.empty()) throw comm_error(errc::invalid_argument, "emulated_world: no cards");
    for (std::size_t c : cards)
      if (c >= cl.size())
        throw comm_error(errc::out_of_range, "emulated_world: card " + std::to_string(c) + " outside the cluster of " + std::to_string(cl.size()));
    s_->cl = &cl;
    s_->cards = std::move(cards);
    // the algorithms' own buffers (host memory) are sent and received directly, no staging copy
    cl.set_allow_host_buffers(true);
    // a null buffer is a payload-free message of its size (communicator::all_to_allv_timing)
    cl.set_allow_count_only(true);
  }
  int size() const { return static_cast<int>(s_->cards.size()); }
  inline emulated_transport transport(int rank) const;
  void abort() { s_->aborted = true; }

  // Runs f(emulated_transport) on one host thread per rank; rethrows the lowest rank's exception.
  template <class F>
  void run(F&& f) const;

  // A cluster of `ranks` cards (super-nodes of 128) with default UBL128 figures, and run(f) on it.
  template <class F>
  static void run_default(int ranks, F&& f, bool timing_only = true) {
    if (ranks <= 0) throw comm_error(errc::invalid_argument, "emulated_world: rank count must be positive");
    emu::cluster_config cfg;
    const std::size_t n = static_cast<std::size_t>(ranks);
    cfg.cards_per_supernode = std::min<std::size_t>(n, 128);
    if (n % cfg.cards_per_supernode != 0) throw comm_error(errc::invalid_argument, "emulated_world: more than 128 ranks must be a multiple of 128");
    cfg.scaleout.supernodes = n / cfg.cards_per_supernode;
    cfg.timing_only = timing_only;
    cfg.faults.op_timeout = 1.0;  // large transfers queue behind each other for long in big runs
    emu::cluster cl(cfg, 1);
    emulated_world(cl).run(std::forward<F>(f));
  }

 private:
  static std::vector<std::size_t> all_cards(emu::cluster& cl) {
    std::vector<std::size_t> v(cl.size());
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = i;
    return v;
  }
  explicit emulated_world(std::shared_ptr<detail::emulated_shared> s) : s_(std::move(s)) {}
  std::shared_ptr<detail::emulated_shared> s_;
  friend class emulated_transport;
};

class emulated_transport {
 public:
  static constexpr bool simulated = true;
  static constexpr bool counts_only = true;

  class send_request {
   public:
    send_request() = default;
    send_request(send_request&& o) noexcept { swap(o); }
    send_request& operator=(send_request&& o) noexcept {
      swap(o);
      return *this;
    }
    ~send_request() {
      // a dropped send (error unwinding): let the emulator finish with the buffer before it goes
      if (owner_ && live_ && !waited_) {
        try {
          owner_->cl->wait(done_);
        } catch (...) {}
      }
    }

   private:
    friend class emulated_transport;
    void swap(send_request& o) noexcept {
      std::swap(owner_, o.owner_);
      std::swap(done_, o.done_);
      std::swap(live_, o.live_);
      std::swap(waited_, o.waited_);
    }
    detail::emulated_shared* owner_ = nullptr;
    emu::cluster::completion done_{};
    bool live_ = false;
    bool waited_ = false;
  };

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(s_->cards.size()); }
  double now() const { return s_->cl->clock(card()); }
  bool timing_only() const { return s_->cl->config().timing_only; }
  int node_size() const {
    const auto& cfg = s_->cl->config();
    return cfg.scaleout.supernodes > 1 ? static_cast<int>(cfg.cards_per_supernode) : 1;
  }
  std::size_t card() const { return s_->cards[static_cast<std::size_t>(rank_)]; }
  emu::cluster& cluster() const { return *s_->cl; }

  send_request isend(int peer, tag_t tag, std::span<const std::byte> src) {
    check_peer(peer);
    send_request r;
    r.owner_ = s_.get();
    post([&] {
      r.done_ =
          s_->cl->send(card(), s_->cards[static_cast<std::size_t>(peer)], timing_only() ? nullptr : src.data(), src.size(), s_->cluster_tag(tag));
    });
    r.live_ = true;
    return r;
  }
  void wait(send_request& r) {
    if (!r.owner_) return;
    guard([&] { s_->cl->wait(r.done_); });
    r.waited_ = true;
  }
  void recv(int peer, tag_t tag, std::size_t bytes, recv_consumer fn) {
    check_peer(peer);
    emu::cluster::completion c{};
    if (timing_only()) {
      post([&] { c = s_->cl->recv(card(), s_->cards[static_cast<std::size_t>(peer)], nullptr, bytes, s_->cluster_tag(tag)); });
      guard([&] { s_->cl->wait(c); });
      fn(std::span<const std::byte>(static_cast<const std::byte*>(nullptr), 0), 0);
      return;
    }
    std::vector<std::byte> bounce(bytes);
    post([&] { c = s_->cl->recv(card(), s_->cards[static_cast<std::size_t>(peer)], bounce.data(), bytes, s_->cluster_tag(tag)); });
    guard([&] { s_->cl->wait(c); });
    fn(std::span<const std::byte>(bounce.data(), bytes), 0);
  }
  void recv_into(int peer, tag_t tag, std::span<std::byte> dst) {
    check_peer(peer);
    emu::cluster::completion c{};
    post([&] {
      c = s_->cl->recv(card(), s_->cards[static_cast<std::size_t>(peer)], timing_only() ? nullptr : dst.data(), dst.size(), s_->cluster_tag(tag));
    });
    guard([&] { s_->cl->wait(c); });
  }
  // A posted receive (waited with wait()): every receive of an exchange can be in flight at once.
  send_request irecv_into(int peer, tag_t tag, std::span<std::byte> dst) {
    check_peer(peer);
    send_request r;
    r.owner_ = s_.get();
    post([&] {
      r.done_ =
          s_->cl->recv(card(), s_->cards[static_cast<std::size_t>(peer)], timing_only() ? nullptr : dst.data(), dst.size(), s_->cluster_tag(tag));
    });
    r.live_ = true;
    return r;
  }
  void abort() { s_->aborted = true; }
  // Marks the world failed and ends its pending transfers: a rank waiting on any of them, or
  // posting later, gets comm_revoked_error (the revoke reaches it a direct latency after this
  // card's clock).
  void revoke(int failed) { s_->revoke(failed, s_->cl->clock(card()) + s_->cl->config().direct_latency()); }

  // The rank waits on the host: its card stops holding back the simulation, and the others'
  // waits for its transfers wait for it instead of timing out (emu::cluster::set_idle).
  void idle(bool on) { s_->cl->set_idle(card(), on); }

  // What agree() returns: `values[r]` is rank r's contribution, empty when r did not take part
  // (its card failed, or its thread ended first); `members` lists the ranks that did.
  struct agreement {
    std::vector<int> members;
    std::vector<std::vector<std::uint64_t>> values;
    double at = 0;  // simulated time every member's clock moved to
  };
  // ULFM's agree: every live rank calls it (the k-th call of each rank meets the k-th of the
  // others) with its words; each gets every member's, in rank order. It works on a revoked world,
  // never waits for a rank whose card is known failed or whose thread has ended, and costs each
  // member a reduce and a broadcast of small messages (2·ceil(log2 n) direct latencies after the
  // latest member's clock). A rank whose own card failed gets peer_failed_error. While it waits,
  // the card does not hold back the simulation (its driver steps aside), so the others' waits can
  // end at their timeouts.
  agreement agree(std::span<const std::uint64_t> mine) {
    const std::size_t c = card();
    if (s_->cl->failed(c) || s_->cl->at(c).down())
      throw peer_failed_error(rank_, "emulated_transport: agree on rank " + std::to_string(rank_) + ", whose card " + std::to_string(c) + " failed");
    const double t0 = s_->cl->clock(c);
    const std::size_t n = s_->cards.size();
    const double cost = 2 * std::ceil(std::log2(double(std::max<std::size_t>(n, 2)))) * s_->cl->config().direct_latency();
    s_->cl->detach(c);  // (not idle(): a rank waiting on this one's transfer should time out and come to agree)
    agreement out;
    {
      std::unique_lock lk(s_->amu);
      if (s_->left.size() != n) s_->left.assign(n, 0);
      if (s_->agree_calls.size() != n) s_->agree_calls.assign(n, 0);
      auto& R = s_->rounds[s_->agree_calls[std::size_t(rank_)]++];
      if (R.dep.size() != n) R.dep.resize(n);
      R.dep[std::size_t(rank_)] = std::vector<std::uint64_t>(mine.begin(), mine.end());
      R.latest = std::max(R.latest, t0);
      s_->acv.notify_all();
      auto dead = [&](std::size_t r) { return s_->left[r] || s_->cl->failed(s_->cards[r]); };
      while (!std::all_of(R.dep.begin(), R.dep.end(), [&](const auto& d) { return d.has_value() || dead(std::size_t(&d - R.dep.data())); }))
        s_->acv.wait_for(lk, std::chrono::milliseconds(1));  // (a failure the monitor reports has no notification here)
      if (!R.closed) R.closed = true, R.end = R.latest + cost;
      out.at = R.end;
      out.values.resize(n);
      for (std::size_t r = 0; r < n; ++r)
        if (R.dep[r]) out.members.push_back(int(r)), out.values[r] = *R.dep[r];
    }
    s_->cl->attach(c);
    s_->cl->at(c).advance_to(out.at);
    return out;
  }

  // ULFM shrink: the ranks whose cards the cluster has not reported failed.
  emulated_transport shrink() {
    std::lock_guard lk(s_->mu);
    if (!s_->successor) {
      auto next = std::make_shared<detail::emulated_shared>();
      next->cl = s_->cl;
      next->context = s_->context + 1;
      for (std::size_t r = 0; r < s_->cards.size(); ++r)
        if (!s_->cl->failed(s_->cards[r]) && s_->cl->at(s_->cards[r]).alive()) {
          next->cards.push_back(s_->cards[r]);
          s_->successor_ranks.push_back(static_cast<int>(r));
        }
      s_->successor = next;
    }
    const auto it = std::find(s_->successor_ranks.begin(), s_->successor_ranks.end(), rank_);
    if (it == s_->successor_ranks.end()) throw comm_revoked_error(-1, "emulated_transport: this rank's card failed; it is not in the shrunk world");
    return emulated_transport(s_->successor, static_cast<int>(it - s_->successor_ranks.begin()));
  }

 private:
  friend class emulated_world;
  emulated_transport(std::shared_ptr<detail::emulated_shared> s, int r) : s_(std::move(s)), rank_(r) {}

  void check_peer(int peer) const {
    if (peer < 0 || peer >= size())
      throw comm_error(errc::out_of_range, "emulated_transport: peer " + std::to_string(peer) + " outside [0, " + std::to_string(size()) + ")");
  }
  // Posts one transfer: the world is checked and the transfer posted under the revoke lock.
  // (An error is mapped after the lock is released: the mapping may revoke.)
  template <class F>
  void post(F&& f) {
    std::exception_ptr err;
    {
      std::shared_lock lk(s_->post_mu);
      check_state();
      try {
        f();
      } catch (...) { err = std::current_exception(); }
    }
    if (err) guard([&] { std::rethrow_exception(err); });
  }
  void check_state() const {
    if (s_->aborted) throw comm_aborted_error("emulated_transport: communicator aborted");
    if (s_->revoked)
      throw comm_revoked_error(s_->revoked_by,
                               "emulated_transport: communicator revoked after rank " + std::to_string(s_->revoked_by.load()) + " failed");
  }
  // Emulator faults -> the collectives' error types (and the communicator is revoked).
  template <class F>
  void guard(F&& f) {
    try {
      f();
    } catch (const emu::card_failed_error& e) {
      const int who = s_->rank_of(e.card);
      revoke(who);
      throw peer_failed_error(who, std::string("emulated_transport: ") + e.what());
    } catch (const emu::timeout_error& e) {
      const int who = s_->rank_of(e.card);
      revoke(who);
      throw comm_timeout_error(who, std::string("emulated_transport: ") + e.what());
    } catch (const emu::fault_error& e) {
      if (s_->revoked)  // ended by a revoke
        throw comm_revoked_error(s_->revoked_by,
                                 "emulated_transport: communicator revoked after rank " + std::to_string(s_->revoked_by.load()) + " failed");
      revoke(-1);
      throw comm_error(std::string("emulated_transport: ") + e.what());
    }
  }

  std::shared_ptr<detail::emulated_shared> s_;
  int rank_ = 0;
};

inline emulated_transport emulated_world::transport(int rank) const {
  if (rank < 0 || rank >= size())
    throw comm_error(errc::out_of_range, "emulated_world: rank " + std::to_string(rank) + " outside [0, " + std::to_string(size()) + ")");
  return emulated_transport(s_, rank);
}

template <class F>
void emulated_world::run(F&& f) const {
  const int n = size();
  std::vector<std::exception_ptr> errs(static_cast<std::size_t>(n));
  std::vector<std::thread> ts;
  ts.reserve(static_cast<std::size_t>(n));
  // one driver thread per card (the emulator's conservative synchronization): attach all first
  for (std::size_t c : s_->cards) s_->cl->attach(c);
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      emu::cluster::driver_scope scope(*s_->cl, s_->cards[static_cast<std::size_t>(r)], emu::cluster::adopt);
      try {
        f(transport(r));
      } catch (...) {
        errs[static_cast<std::size_t>(r)] = std::current_exception();
        s_->revoke(r, s_->cl->clock(s_->cards[static_cast<std::size_t>(r)]) + s_->cl->config().direct_latency());
      }
      s_->mark_left(r);
    });
  for (auto& t : ts) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

static_assert(transport<emulated_transport>);

}  // namespace v0
}  // namespace tessel
