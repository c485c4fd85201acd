// The threads transport: ranks are threads of one process. A send posts (pointer, size) in the
// receiver's inbox and the receiver reads the sender's memory directly (one copy, or none when the
// receiver reduces straight out of it); flags and waits go through one mutex and per-rank condition
// variables, after a short bounded spin. Supports abort(), timeouts, stopping a rank (fault
// injection) and ULFM-like shrink().
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <tessel/arch/copy.hpp>
#include <tessel/collectives/errors.hpp>
#include <tessel/collectives/transport.hpp>

namespace tessel {
inline namespace v0 {}  // namespace v0
namespace detail {

struct threads_desc {
  int src;
  int dst;
  tag_t tag;
  const std::byte* data;
  std::size_t size;
  bool claimed = false;  // a receiver is reading it (outside the lock)
  bool done = false;     // the receiver finished reading: the sender's buffer is free again
  bool failed = false;   // ... but its consumer threw part-way: the sender's wait reports an error
};

// Takes the mutex, spinning briefly first: the critical sections are a few dozen instructions, and
// a contended std::mutex puts the thread to sleep, whose wake-up costs tens of microseconds on a VM.
inline std::unique_lock<std::mutex> lock_spinning(std::mutex& m) {
  std::unique_lock lk(m, std::try_to_lock);
  for (int i = 0; i < 512 && !lk.owns_lock(); ++i) {
    tessel::arch::cpu_relax();
    if (i % 8 == 7) (void)lk.try_lock();
  }
  if (!lk.owns_lock()) lk.lock();
  return lk;
}

struct threads_shared {
  explicit threads_shared(int ranks, std::chrono::nanoseconds to)
      : n(ranks),
        cv(std::make_unique<std::condition_variable[]>(static_cast<std::size_t>(ranks))),
        inbox(static_cast<std::size_t>(ranks)),
        alive(static_cast<std::size_t>(ranks), 1),
        reading_from(static_cast<std::size_t>(ranks), 0),
        fail_after(static_cast<std::size_t>(ranks), -1),
        timeout(to),
        epoch(std::make_unique<padded_epoch[]>(static_cast<std::size_t>(ranks))) {}
  int n;
  std::mutex mu;
  std::unique_ptr<std::condition_variable[]> cv;  // cv[r]: rank r waits on it
  std::vector<std::deque<std::shared_ptr<threads_desc>>> inbox;
  std::vector<char> alive;
  std::vector<int> reading_from;         // readers currently inside rank r's send buffers
  std::vector<std::int64_t> fail_after;  // transport operations left before rank r stops (-1: never)
  bool aborted = false;
  bool revoked = false;
  int revoked_by = -1;
  std::chrono::nanoseconds timeout;
  // Waits spin this long (re-checking when rank r's epoch changes) before sleeping on cv[r]. Short
  // and bounded: long enough to catch a peer that is running and a few microseconds from posting
  // (a futex sleep and wake-up costs tens of microseconds on a VM), never long enough to burn a
  // core for a descheduled peer. 0 disables spinning.
  std::chrono::nanoseconds spin{std::chrono::microseconds(20)};
  struct alignas(64) padded_epoch {
    std::atomic<std::uint32_t> v{0};
  };
  std::unique_ptr<padded_epoch[]> epoch;      // epoch[r] changes (under mu) whenever cv[r] is notified
  std::shared_ptr<threads_shared> successor;  // the shrunk world, once a survivor asked for it
  std::vector<int> successor_ranks;           // old rank of each new rank

  void notify_locked(int r) {
    epoch[r].v.fetch_add(1, std::memory_order_release);
    cv[r].notify_all();
  }
  void notify_all_locked() {
    for (int r = 0; r < n; ++r) notify_locked(r);
  }
  void revoke_locked(int failed) {
    if (!revoked) {
      revoked = true;
      revoked_by = failed;
    }
    notify_all_locked();
  }
  // Marks `r` dead: unread sends are withdrawn; readers inside its buffers are waited for, so its
  // thread can unwind safely.
  void kill_locked(std::unique_lock<std::mutex>& lk, int r) {
    alive[static_cast<std::size_t>(r)] = 0;
    for (auto& q : inbox) std::erase_if(q, [r](const std::shared_ptr<threads_desc>& d) { return d->src == r; });
    notify_all_locked();
    cv[r].wait(lk, [&] { return reading_from[static_cast<std::size_t>(r)] == 0; });
  }
};

}  // namespace detail
inline namespace v0 {

class threads_transport;

// The shared state of n thread ranks. Copies share it.
class threads_world {
 public:
  explicit threads_world(int ranks, std::chrono::milliseconds timeout = std::chrono::seconds(120)) {
    if (ranks <= 0) throw comm_error(errc::invalid_argument, "threads_world: rank count must be positive");
    if (timeout.count() <= 0) throw comm_error(errc::invalid_argument, "threads_world: timeout must be positive");
    s_ = std::make_shared<detail::threads_shared>(ranks, timeout);
  }
  int size() const { return s_->n; }
  inline threads_transport transport(int rank) const;

  // Releases every waiter of every rank with comm_aborted_error (callable from any thread).
  void abort() {
    std::lock_guard lk(s_->mu);
    s_->aborted = true;
    s_->notify_all_locked();
  }
  // Fault injection: rank r stops (throws rank_stopped_error on its own thread) at its ops-th
  // transport operation from now; its peers then see peer_failed_error / comm_revoked_error.
  void fail_after(int rank, std::int64_t ops) {
    check_rank(rank);
    std::lock_guard lk(s_->mu);
    s_->fail_after[static_cast<std::size_t>(rank)] = ops;
  }
  bool alive(int rank) const {
    check_rank(rank);
    std::lock_guard lk(s_->mu);
    return s_->alive[static_cast<std::size_t>(rank)] != 0;
  }
  void set_timeout(std::chrono::milliseconds t) {
    std::lock_guard lk(s_->mu);
    s_->timeout = t;
  }
  // How long a wait spins before it sleeps (default 20 us; 0: sleep at once). Spinning saves the
  // futex round trip when the peer is running; the bound keeps a descheduled peer from costing a core.
  void set_spin(std::chrono::nanoseconds t) {
    if (t.count() < 0) throw comm_error(errc::invalid_argument, "threads_world: spin time must not be negative");
    std::lock_guard lk(s_->mu);
    s_->spin = t;
  }

  // Runs f(threads_transport) on `ranks` threads and joins them; rethrows the lowest rank's exception.
  template <class F>
  static void run(int ranks, F&& f, std::chrono::milliseconds timeout = std::chrono::seconds(120)) {
    threads_world w(ranks, timeout);
    w.run(std::forward<F>(f));
  }
  template <class F>
  void run(F&& f) const;

 private:
  void check_rank(int r) const {
    if (r < 0 || r >= s_->n)
      throw comm_error(errc::out_of_range, "threads_world: rank " + std::to_string(r) + " outside [0, " + std::to_string(s_->n) + ")");
  }
  std::shared_ptr<detail::threads_shared> s_;
  friend class threads_transport;
};

// One rank's endpoint (a model of `transport`).
class threads_transport {
 public:
  // ranks are threads of one process: peers' buffers can be used in place (see transport.hpp).
  // What in-place algorithms rely on: a send's wait returns only after the receiver's consumer
  // returned, and throws (peer_failed_error, or the revoke/abort that caused it) if the consumer
  // threw part-way, so completing a send means the receiver did all it meant to do with it.
  static constexpr bool shared_address_space = true;

  class send_request {
   public:
    send_request() = default;
    send_request(send_request&& o) noexcept : s_(std::move(o.s_)), d_(std::move(o.d_)) {}
    send_request& operator=(send_request&& o) noexcept {
      if (this != &o) {
        cancel();
        s_ = std::move(o.s_);
        d_ = std::move(o.d_);
      }
      return *this;
    }
    ~send_request() { cancel(); }

   private:
    friend class threads_transport;
    send_request(std::shared_ptr<detail::threads_shared> s, std::shared_ptr<detail::threads_desc> d) : s_(std::move(s)), d_(std::move(d)) {}
    // An unfinished send that is dropped (an exception unwinds the algorithm) is withdrawn, or
    // waited for if a reader is inside it, so the buffer can be freed.
    void cancel() noexcept {
      if (!d_) return;
      std::unique_lock lk(s_->mu);
      if (!d_->done) {
        if (!d_->claimed) {
          std::erase(s_->inbox[static_cast<std::size_t>(d_->dst)], d_);
        } else {
          s_->cv[d_->src].wait(lk, [&] { return d_->done; });
        }
      }
      lk.unlock();
      d_.reset();
    }
    std::shared_ptr<detail::threads_shared> s_;
    std::shared_ptr<detail::threads_desc> d_;
  };

  int rank() const { return rank_; }
  int size() const { return s_->n; }
  double now() const { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

  send_request isend(int peer, tag_t tag, std::span<const std::byte> src) {
    check_peer(peer);
    auto lk = detail::lock_spinning(s_->mu);
    tick_locked(lk);
    check_state_locked(peer);
    auto d = std::make_shared<detail::threads_desc>(detail::threads_desc{rank_, peer, tag, src.data(), src.size()});
    s_->inbox[static_cast<std::size_t>(peer)].push_back(d);
    s_->notify_locked(peer);
    return send_request(s_, std::move(d));
  }

  void wait(send_request& r) {
    if (!r.d_) return;
    auto lk = detail::lock_spinning(s_->mu);
    tick_locked(lk);
    auto* d = r.d_.get();
    const int peer = d->dst;
    wait_locked(
        lk, peer, [d] { return d->done; }, "send completion");
    const bool failed = d->failed;
    lk.unlock();
    r.d_.reset();
    // the receiver's consumer threw part-way (it failed inside a collective): whatever it was to do
    // with this message (write results into our buffers, say) may be unfinished
    if (failed) {
      {
        std::lock_guard g(s_->mu);
        check_state_locked(peer);  // revoked / aborted / dead: say so
      }
      throw peer_failed_error(
          peer, "threads_transport: rank " + std::to_string(peer) + " failed while consuming a message from rank " + std::to_string(rank_));
    }
  }

  void recv(int peer, tag_t tag, std::size_t bytes, recv_consumer fn) {
    check_peer(peer);
    std::shared_ptr<detail::threads_desc> d;
    {
      auto lk = detail::lock_spinning(s_->mu);
      tick_locked(lk);
      auto& q = s_->inbox[static_cast<std::size_t>(rank_)];
      auto find = [&] {
        for (auto it = q.begin(); it != q.end(); ++it)
          if ((*it)->src == peer && (*it)->tag == tag) {
            d = *it;
            q.erase(it);
            return true;
          }
        return false;
      };
      wait_locked(lk, peer, find, "a message");
      d->claimed = true;
      ++s_->reading_from[static_cast<std::size_t>(peer)];
    }
    auto finish = [&](bool ok) {
      auto lk = detail::lock_spinning(s_->mu);
      d->done = true;
      d->failed = !ok;
      --s_->reading_from[static_cast<std::size_t>(peer)];
      s_->notify_locked(peer);
    };
    if (d->size != bytes) {
      const std::size_t got = d->size;
      finish(true);  // rejected unread: the sender's buffer is simply free again
      throw comm_error(errc::invalid_argument, "threads_transport: rank " + std::to_string(rank_) + " expected " + std::to_string(bytes) +
                                                   " bytes from rank " + std::to_string(peer) + ", got " + std::to_string(got));
    }
    try {
      fn(std::span<const std::byte>(d->data, d->size), 0);
    } catch (...) {
      finish(false);
      throw;
    }
    finish(true);
  }

  void recv_into(int peer, tag_t tag, std::span<std::byte> dst) {
    recv(peer, tag, dst.size(), [&](std::span<const std::byte> piece, std::size_t off) {
      if (!piece.empty()) std::memcpy(dst.data() + off, piece.data(), piece.size());
    });
  }

  void abort() {
    std::lock_guard lk(s_->mu);
    s_->aborted = true;
    s_->notify_all_locked();
  }
  void revoke(int failed) {
    std::lock_guard lk(s_->mu);
    s_->revoke_locked(failed);
  }
  // This rank stops now (as if its process died): peers see it as failed.
  void stop() {
    std::unique_lock lk(s_->mu);
    s_->kill_locked(lk, rank_);
  }

  // ULFM shrink: a transport over the ranks still alive, numbered in their old order. Every
  // survivor calls it; the first one creates the new world.
  threads_transport shrink() {
    std::lock_guard lk(s_->mu);
    if (!s_->alive[static_cast<std::size_t>(rank_)]) throw rank_stopped_error(rank_, "threads_transport: a stopped rank cannot shrink");
    if (!s_->successor) {
      for (int r = 0; r < s_->n; ++r)
        if (s_->alive[static_cast<std::size_t>(r)]) s_->successor_ranks.push_back(r);
      s_->successor = std::make_shared<detail::threads_shared>(static_cast<int>(s_->successor_ranks.size()), s_->timeout);
    }
    const auto it = std::find(s_->successor_ranks.begin(), s_->successor_ranks.end(), rank_);
    if (it == s_->successor_ranks.end())
      throw comm_revoked_error(-1, "threads_transport: rank " + std::to_string(rank_) + " was not alive when the communicator shrank");
    return threads_transport(s_->successor, static_cast<int>(it - s_->successor_ranks.begin()));
  }

 private:
  friend class threads_world;
  threads_transport(std::shared_ptr<detail::threads_shared> s, int r) : s_(std::move(s)), rank_(r) {}

  void check_peer(int peer) const {
    if (peer < 0 || peer >= s_->n)
      throw comm_error(errc::out_of_range, "threads_transport: peer " + std::to_string(peer) + " outside [0, " + std::to_string(s_->n) + ")");
  }
  // Counts this rank's operations for fault injection; stops the rank when its count runs out.
  void tick_locked(std::unique_lock<std::mutex>& lk) {
    auto& left = s_->fail_after[static_cast<std::size_t>(rank_)];
    if (!s_->alive[static_cast<std::size_t>(rank_)])
      throw rank_stopped_error(rank_, "threads_transport: rank " + std::to_string(rank_) + " was stopped");
    if (left < 0) return;
    if (left > 0) {
      --left;
      return;
    }
    left = -1;
    s_->kill_locked(lk, rank_);
    throw rank_stopped_error(rank_, "threads_transport: rank " + std::to_string(rank_) + " stopped (fault injection)");
  }
  void check_state_locked(int peer) {
    if (s_->aborted) throw comm_aborted_error("threads_transport: communicator aborted");
    if (s_->revoked)
      throw comm_revoked_error(s_->revoked_by, "threads_transport: communicator revoked after rank " + std::to_string(s_->revoked_by) + " failed");
    if (peer >= 0 && !s_->alive[static_cast<std::size_t>(peer)]) {
      s_->revoke_locked(peer);
      throw peer_failed_error(peer, "threads_transport: peer rank " + std::to_string(peer) + " is dead");
    }
  }
  template <class Ready>
  void wait_locked(std::unique_lock<std::mutex>& lk, int peer, Ready ready, const char* what) {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + s_->timeout;
    const auto spin_end = start + s_->spin;
    bool spinning = s_->spin.count() > 0;
    auto& epoch = s_->epoch[rank_].v;
    for (;;) {
      if (ready()) return;
      if (!s_->alive[static_cast<std::size_t>(rank_)])
        throw rank_stopped_error(rank_, "threads_transport: rank " + std::to_string(rank_) + " was stopped");
      check_state_locked(peer);
      if (spinning) {
        // every change a waiter of this rank could be waiting for bumps epoch[rank] under the lock,
        // so a value read under the lock that stays the same means nothing happened yet
        const std::uint32_t seen = epoch.load(std::memory_order_relaxed);
        lk.unlock();
        for (unsigned i = 1; epoch.load(std::memory_order_acquire) == seen; ++i) {
          tessel::arch::cpu_relax();
          if (i % 16 == 0 && std::chrono::steady_clock::now() >= spin_end) {
            spinning = false;
            break;
          }
        }
        lk = detail::lock_spinning(s_->mu);
        continue;
      }
      if (s_->cv[rank_].wait_until(lk, deadline) == std::cv_status::timeout) {
        if (ready()) return;
        check_state_locked(peer);
        s_->revoke_locked(peer);
        throw comm_timeout_error(
            peer, "threads_transport: rank " + std::to_string(rank_) + " timed out waiting for " + what + " from rank " + std::to_string(peer));
      }
    }
  }

  std::shared_ptr<detail::threads_shared> s_;
  int rank_ = 0;
};

inline threads_transport threads_world::transport(int rank) const {
  check_rank(rank);
  return threads_transport(s_, rank);
}

template <class F>
void threads_world::run(F&& f) const {
  std::vector<std::exception_ptr> errs(static_cast<std::size_t>(s_->n));
  std::vector<std::thread> ts;
  ts.reserve(static_cast<std::size_t>(s_->n));
  for (int r = 0; r < s_->n; ++r) {
    try {
      ts.emplace_back([&, r] {
        try {
          f(transport(r));
        } catch (...) {
          errs[static_cast<std::size_t>(r)] = std::current_exception();
          // a rank that fails for its own reasons must not leave its peers waiting for it
          std::lock_guard lk(s_->mu);
          s_->revoke_locked(r);
        }
      });
    } catch (const std::system_error& e) {
      // The OS refused a thread (e.g. -g 100000): release the ranks already running, which would
      // otherwise wait for peers that never start, join them, and say what happened.
      {
        std::lock_guard lk(s_->mu);
        s_->aborted = true;
        s_->notify_all_locked();
      }
      for (auto& t : ts) t.join();
      throw comm_error(errc::capacity, "threads_world: the system could not start the thread of rank " + std::to_string(r) + " of " +
                                           std::to_string(s_->n) + " (" + e.what() + "); use fewer ranks");
    }
  }
  for (auto& t : ts) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

static_assert(transport<threads_transport>);

}  // namespace v0
}  // namespace tessel
