// The emulated cluster: N cards (tessel devices with their own memory and clocks) joined by the
// modelled fabric, with a data plane for collectives and users.
//
// Data plane (what a collectives transport builds on):
//   put(src, src_ptr, dst, dst_ptr, n)   one-sided write, initiated by `src` at its clock
//   get(me, my_ptr, peer, peer_ptr, n)   one-sided read: a request travels to `peer`, data back
//   send(src, dst, ptr, n, tag) / recv(dst, src, ptr, n, tag)
//                                        two-sided; matched in order per (src, dst, tag); the
//                                        transfer starts when both sides have posted
// Each returns a `completion`. Nothing moves until someone waits: `wait(c)` runs the fabric
// simulation until that transfer is done, copies the bytes for real (unless timing_only), and
// advances the initiator's clock (for recv: the receiver's; `wait(c, card)` names another card,
// e.g. the target of a put learning that its data arrived) to the completion time.
// Waits never hang: an unmatched send/recv, a dead peer or a path with no progress ends, in
// simulated time, with a typed error naming the card or link (card_failed_error,
// link_failed_error, timeout_error; all derive from fault_error / std::runtime_error).
// Failure notification: `on_failure(cb)` is called when the heartbeat monitor reports a fault
// (within fabric().detection_bound() of it); `failed(card)` polls what every card knows.
//
// Timing model: a transfer is posted at its initiator's clock. The fabric never goes back in
// time, so a transfer posted at a clock behind the simulation starts "now" instead. Two ways to
// drive it exactly:
//  - one host thread for all cards: post every transfer of a step, then wait (bulk-synchronous);
//  - one host thread per card (e.g. a collectives transport): each thread holds a
//    `cluster::driver_scope scope(cl, card)` while it drives its card. Waits then advance the
//    simulation only up to the earliest clock of the cards still running (conservative parallel
//    discrete-event simulation), so no thread's later post lands in the simulated past, and an
//    unmatched recv times out only when every other driver is blocked too.
// All methods are thread-safe (one lock). Each card is driven by at most one thread at a time.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <tessel/device/executor.hpp>
#include <tessel/emulator/card.hpp>
#include <tessel/emulator/config.hpp>
#include <tessel/emulator/errors.hpp>
#include <tessel/emulator/fabric.hpp>
#include <tessel/emulator/trace.hpp>

namespace tessel {
inline namespace v0 {
namespace emu {

// Utilization counters of a run.
struct cluster_report {
  double makespan = 0;                                    // latest card clock or delivery, seconds
  double flop_utilization = 0;                            // mean over cards: time at peak FLOP rate / makespan
  double hbm_saturation = 0;                              // mean over cards: time at full HBM bandwidth / makespan
  double max_port_utilization = 0;                        // busiest port: busy time / makespan
  double mean_port_utilization = 0;                       // over the card ports that carried traffic
  std::string bottleneck;                                 // the busiest port, named
  std::vector<std::pair<std::string, double>> top_ports;  // the 5 busiest ports and their utilization
  std::uint64_t messages = 0;
  double latency_p50 = 0, latency_p99 = 0;  // per-message, seconds
  std::string to_string() const {
    std::ostringstream o;
    o << "makespan " << makespan * 1e6 << " us, FLOP utilization " << flop_utilization * 100 << " %, HBM saturation " << hbm_saturation * 100
      << " %\nlinks: busiest " << bottleneck << " at " << max_port_utilization * 100 << " %, mean of active ports " << mean_port_utilization * 100
      << " %\n";
    for (const auto& [name, u] : top_ports) o << "  " << name << ": " << u * 100 << " %\n";
    o << "messages " << messages << ", latency p50 " << latency_p50 * 1e6 << " us, p99 " << latency_p99 * 1e6 << " us";
    return o.str();
  }
};

// The report as JSON (seconds and fractions as they are; ports by name), for tools.
inline nlohmann::json to_json(const cluster_report& r) {
  nlohmann::json ports = nlohmann::json::array();
  for (const auto& [name, u] : r.top_ports) ports.push_back({{"port", name}, {"utilization", u}});
  return {{"makespan", r.makespan},
          {"flop_utilization", r.flop_utilization},
          {"hbm_saturation", r.hbm_saturation},
          {"max_port_utilization", r.max_port_utilization},
          {"mean_port_utilization", r.mean_port_utilization},
          {"bottleneck", r.bottleneck},
          {"top_ports", std::move(ports)},
          {"messages", r.messages},
          {"latency_p50", r.latency_p50},
          {"latency_p99", r.latency_p99}};
}

inline void write_report(const cluster_report& r, const std::string& path) {
  std::ofstream f(path, std::ios::binary);
  if (!f) throw emulator_error(errc::io, "cannot write the report to '" + path + "'");
  f << to_json(r).dump(2) << "\n";
  if (!f) throw emulator_error(errc::io, "writing the report '" + path + "' failed");
}

class cluster {
 public:
  using op_id = std::uint32_t;

  // A pending transfer. Cheap to copy; valid while the cluster lives.
  struct completion {
    cluster* owner = nullptr;
    op_id id = 0;
    void wait() const { owner->wait(*this); }
    bool ready() const { return owner->test(*this); }
    double time() const { return owner->completion_time(*this); }
  };

  // A cluster running its cards' programs on its own executor (`threads` workers, default all cores).
  explicit cluster(const cluster_config& cfg, unsigned threads = 0)
      : cfg_(checked(cfg)),
        owned_exec_(std::make_unique<executor>(threads ? threads : std::max(1u, std::thread::hardware_concurrency()))),
        exec_(owned_exec_.get()),
        net_(cfg_) {
    init();
  }
  // A cluster sharing an executor (which must outlive it).
  cluster(const cluster_config& cfg, executor& shared) : cfg_(checked(cfg)), exec_(&shared), net_(cfg_) { init(); }

  cluster(const cluster&) = delete;
  cluster& operator=(const cluster&) = delete;

  std::size_t size() const { return cards_.size(); }
  const cluster_config& config() const { return cfg_; }
  card& operator[](std::size_t i) { return at(i); }
  card& at(std::size_t i) {
    check_card(i, "card");
    return *cards_[i];
  }
  fabric& net() { return net_; }
  trace_recorder& timeline() { return trace_; }
  executor& exec() { return *exec_; }
  // Marks the calling thread as the driver of `card` for its lifetime (see the header comment).
  // Attach every driven card before any driver waits (a card not yet attached is not waited
  // for): call cl.attach(card) for all of them before starting the threads, and have each
  // thread adopt its card with `driver_scope scope(cl, card, cluster::adopt)`; the scope
  // detaches when the thread is done, so the others stop waiting for its clock.
  struct adopt_t {};
  static constexpr adopt_t adopt{};
  class driver_scope {
   public:
    driver_scope(cluster& cl, std::size_t card) : cl_(&cl), card_(card) { cl.attach(card); }
    driver_scope(cluster& cl, std::size_t card, adopt_t) : cl_(&cl), card_(card) {}
    driver_scope(const driver_scope&) = delete;
    driver_scope& operator=(const driver_scope&) = delete;
    ~driver_scope() { cl_->detach(card_); }

   private:
    cluster* cl_;
    std::size_t card_;
  };
  void attach(std::size_t c) {
    check_card(c, "attach");
    std::lock_guard lk(mu_);
    if (drivers_[c].attached) throw emulator_error(errc::invalid_argument, "card " + std::to_string(c) + " already has a driver thread");
    drivers_[c].attached = true;
    attached_++;
    cv_.notify_all();
  }
  // The driver of card `c` waits on the host (a thread, a file) and posts nothing meanwhile: it no
  // longer holds back the others' simulated time, and their waits for a transfer it has not posted
  // yet do not time out (it posts when it is back, at its clock).
  void set_idle(std::size_t c, bool on) {
    check_card(c, "set_idle");
    std::lock_guard lk(mu_);
    drivers_[c].idle = on;
    cv_.notify_all();
  }
  void detach(std::size_t c) {
    std::lock_guard lk(mu_);
    if (c < drivers_.size() && drivers_[c].attached) {
      drivers_[c].attached = false;
      attached_--;
    }
    cv_.notify_all();
  }
  // Also allow send/recv (not put/get) on buffers outside card memory, e.g. a transport's staging
  // vectors. Off by default: a pointer into the wrong card is then an error, not a silent copy.
  void set_allow_host_buffers(bool on) {
    std::lock_guard lk(mu_);
    host_buffers_ = on;
  }
  // Also allow send/recv with a null buffer in a cluster that moves payloads: such a transfer is
  // timed like any other (links, latency, shaping) but moves no bytes. A transport uses it for
  // payload-free timing runs next to real metadata messages (e.g. MoE dispatch). Off by default.
  void set_allow_count_only(bool on) {
    std::lock_guard lk(mu_);
    count_only_ = on;
  }

  // ---- data plane ----
  completion put(std::size_t src, const void* src_ptr, std::size_t dst, void* dst_ptr, std::size_t bytes) {
    std::lock_guard lk(mu_);
    check_buf(src, src_ptr, bytes, "put source");
    check_buf(dst, dst_ptr, bytes, "put destination");
    op o = make_op(op_put, src, src, dst, src_ptr, dst_ptr, bytes, 0);
    o.posted = cards_[src]->clock();
    op_id id = push(o);
    start(id, o.posted);
    return {this, id};
  }
  completion get(std::size_t me, void* my_ptr, std::size_t peer, const void* peer_ptr, std::size_t bytes) {
    std::lock_guard lk(mu_);
    check_buf(me, my_ptr, bytes, "get destination");
    check_buf(peer, peer_ptr, bytes, "get source");
    op o = make_op(op_get, me, peer, me, peer_ptr, my_ptr, bytes, 0);
    o.posted = cards_[me]->clock();
    op_id id = push(o);
    start(id, o.posted + cfg_.direct_latency());  // the request reaches the peer first
    return {this, id};
  }
  completion send(std::size_t src, std::size_t dst, const void* ptr, std::size_t bytes, std::uint64_t tag = 0) {
    std::lock_guard lk(mu_);
    check_card(dst, "send destination");
    check_buf(src, ptr, bytes, "send buffer", host_buffers_, count_only_);
    op o = make_op(op_send, src, src, dst, ptr, nullptr, bytes, tag);
    o.posted = cards_[src]->clock();
    op_id id = push(o);
    auto& q = unmatched_[{src, dst, tag}];
    if (!q.recvs.empty()) {
      op_id r = q.recvs.front();
      q.recvs.pop_front();
      match(id, r);
    } else {
      q.sends.push_back(id);
    }
    cv_.notify_all();
    return {this, id};
  }
  completion recv(std::size_t dst, std::size_t src, void* ptr, std::size_t bytes, std::uint64_t tag = 0) {
    std::lock_guard lk(mu_);
    check_card(src, "recv source");
    check_buf(dst, ptr, bytes, "recv buffer", host_buffers_, count_only_);
    op o = make_op(op_recv, dst, src, dst, nullptr, ptr, bytes, tag);
    o.posted = cards_[dst]->clock();
    op_id id = push(o);
    auto& q = unmatched_[{src, dst, tag}];
    if (!q.sends.empty()) {
      op_id s = q.sends.front();
      q.sends.pop_front();
      match(s, id);
    } else {
      q.recvs.push_back(id);
    }
    cv_.notify_all();
    return {this, id};
  }

  // Waits (in simulated time) for a transfer; advances the initiator's clock, or `who`'s.
  void wait(const completion& c) { wait_impl(c, SIZE_MAX); }
  void wait(const completion& c, std::size_t who) {
    check_card(who, "wait");
    wait_impl(c, who);
  }
  void wait_all(const std::vector<completion>& cs) {
    std::exception_ptr first;
    for (const auto& c : cs) {
      try {
        wait(c);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }
  // Whether the transfer has finished by the simulation's current time (does not advance it).
  bool test(const completion& c) {
    std::lock_guard lk(mu_);
    check_op(c);
    return ops_[c.id].state != op_pending;
  }
  double completion_time(const completion& c) {
    std::lock_guard lk(mu_);
    check_op(c);
    return ops_[c.id].done;
  }
  // The fabric message carrying a transfer (for latency queries), or -1 if none yet.
  long message_of(const completion& c) {
    std::lock_guard lk(mu_);
    check_op(c);
    return ops_[c.id].msg;
  }

  // Runs the fabric until nothing is left to simulate (all posted transfers finished).
  void drain() {
    std::lock_guard lk(mu_);
    net_.run();
  }

  // ---- faults and health ----
  void schedule(const fault& f) {
    std::lock_guard lk(mu_);
    net_.schedule_fault(f);
    note_outage(f);
  }
  void on_failure(std::function<void(const failure_notice&)> cb) {
    std::lock_guard lk(mu_);
    failure_cbs_.push_back(std::move(cb));
  }
  // Whether the health monitor has reported card `c` dead.
  bool failed(std::size_t c) {
    std::lock_guard lk(mu_);
    return net_.known_failed(c);
  }
  std::vector<failure_notice> notices() {
    std::lock_guard lk(mu_);
    return net_.notices();
  }

  // Ends every pending transfer with a fault_error (for a transport's abort()); later posts
  // throw too. Fabric messages already in flight still finish in the model, but nobody waits.
  void abort(const std::string& why = "aborted") {
    std::lock_guard lk(mu_);
    aborted_ = why;
    for (op& o : ops_)
      if (o.state == op_pending) {
        o.state = op_failed;
        o.done = std::max(o.posted, net_.now());
        o.err = std::make_exception_ptr(fault_error(why, o.done));
      }
    for (auto& [k, q] : unmatched_) {
      q.sends.clear();
      q.recvs.clear();
    }
    horizon_dirty_ = true;
    cv_.notify_all();
  }
  bool aborted() {
    std::lock_guard lk(mu_);
    return !aborted_.empty();
  }
  // Ends every pending transfer between two of `cards` with a fault_error at simulated time
  // max(its post, `at`): a revoke (ULFM) reaching the transfers of one group of cards, e.g. one
  // communicator's, while other cards' transfers go on. Unlike abort() it is not sticky: later
  // posts run (the caller's transport refuses them itself). Returns how many transfers it ended.
  std::size_t cancel(const std::vector<std::size_t>& cards, double at, const std::string& why) {
    std::lock_guard lk(mu_);
    std::vector<char> in(cards_.size(), 0);
    for (std::size_t c : cards) {
      check_card(c, "cancel");
      in[c] = 1;
    }
    std::size_t n = 0;
    for (op& o : ops_)
      if (o.state == op_pending && in[o.src] && in[o.dst]) {
        o.state = op_failed;
        o.done = std::max(o.posted, at);
        o.err = std::make_exception_ptr(fault_error(why, o.done));
        ++n;
      }
    for (auto& [k, q] : unmatched_)
      if (in[std::get<0>(k)] && in[std::get<1>(k)]) q.sends.clear(), q.recvs.clear();
    horizon_dirty_ = true;
    cv_.notify_all();
    return n;
  }

  // ---- time ----
  double clock(std::size_t c) { return at(c).clock(); }
  double max_clock() {
    double t = 0;
    for (auto& c : cards_) t = std::max(t, c->clock());
    return t;
  }
  // Every card's clock moves to the latest one (a barrier that costs no modelled time).
  void align_clocks() {
    double t = max_clock();
    for (auto& c : cards_) c->advance_to(t);
  }

  // ---- observability ----
  void write_trace(const std::string& path) const { trace_.write_chrome_json(path, cards_.size()); }
  void write_trace(std::ostream& o) const { trace_.write_chrome_json(o, cards_.size()); }

  cluster_report report() {
    std::lock_guard lk(mu_);
    cluster_report r;
    r.makespan = std::max(net_.makespan(), max_clock());
    if (r.makespan <= 0) return r;
    for (auto& c : cards_) {
      auto k = c->counters();
      r.flop_utilization += k.math_time / r.makespan;
      r.hbm_saturation += k.hbm_time / r.makespan;
    }
    r.flop_utilization /= static_cast<double>(cards_.size());
    r.hbm_saturation /= static_cast<double>(cards_.size());
    std::size_t best = net_.busiest_port();
    r.max_port_utilization = net_.utilization(best, r.makespan);
    r.bottleneck = net_.port_name(best);
    double sum = 0;
    std::size_t n = 0;
    for (std::size_t q = 0; q < net_.ports(); ++q)
      if (net_.stats_of(q).bytes > 0) {
        sum += net_.utilization(q, r.makespan);
        ++n;
      }
    r.mean_port_utilization = n ? sum / static_cast<double>(n) : 0;
    std::vector<std::pair<double, std::size_t>> busy;
    for (std::size_t q = 0; q < net_.ports(); ++q)
      if (net_.stats_of(q).bytes > 0) busy.emplace_back(-net_.utilization(q, r.makespan), q);
    std::partial_sort(busy.begin(), busy.begin() + static_cast<std::ptrdiff_t>(std::min<std::size_t>(5, busy.size())), busy.end());
    for (std::size_t i = 0; i < std::min<std::size_t>(5, busy.size()); ++i) r.top_ports.emplace_back(net_.port_name(busy[i].second), -busy[i].first);
    r.messages = net_.messages();
    r.latency_p50 = net_.latency_percentile(50);
    r.latency_p99 = net_.latency_percentile(99);
    return r;
  }

 private:
  enum : std::uint8_t { op_put, op_get, op_send, op_recv };
  enum : std::uint8_t { op_pending, op_done, op_failed };
  struct op {
    std::uint8_t kind = op_put, state = op_pending;
    std::uint32_t initiator = 0, src = 0, dst = 0;
    const void* sptr = nullptr;
    void* dptr = nullptr;
    std::uint64_t bytes = 0, tag = 0;
    std::uint64_t inc_src = 0, inc_dst = 0;
    double posted = 0, done = 0;
    long msg = -1;
    op_id partner = UINT32_MAX;
    std::exception_ptr err;
  };
  struct queues {
    std::deque<op_id> sends, recvs;
  };

  static const cluster_config& checked(const cluster_config& c) {
    c.validate();
    return c;
  }

  void init() {
    drivers_.resize(cfg_.cards());
    cards_.reserve(cfg_.cards());
    for (std::size_t i = 0; i < cfg_.cards(); ++i)
      cards_.push_back(std::make_unique<card>(i, cfg_.card, *exec_, cfg_.timing_only, cfg_.trace ? &trace_ : nullptr));
    net_.on_complete = [this](fabric::msg_id m, double t, bool ok) { finish_message(m, t, ok); };
    net_.on_card_state = [this](std::size_t c, bool alive, double) { cards_[c]->set_alive(alive); };
    net_.on_rejoin = [this](std::size_t c, double t) { cards_[c]->wipe(t); };
    net_.on_failure = [this](const failure_notice& n) {
      for (auto& cb : failure_cbs_) cb(n);
    };
    for (const fault& f : net_.faults()) note_outage(f);
  }

  void note_outage(const fault& f) {
    if (f.kind == fault_kind::hot_swap) cards_[f.card]->add_outage(f.at, f.at + f.duration);
    if (f.kind == fault_kind::card_down) {
      double back = std::numeric_limits<double>::infinity();
      for (const fault& g : net_.faults())
        if (g.kind == fault_kind::card_up && g.card == f.card && g.at > f.at) back = std::min(back, g.at);
      cards_[f.card]->add_outage(f.at, back);
    }
  }

  void check_card(std::size_t c, const char* what) const {
    if (c >= cards_.size())
      throw invalid_card_error(std::string(what) + ": invalid card index " + std::to_string(c) + " (cluster has " + std::to_string(cards_.size()) +
                               " cards)");
  }
  void check_buf(std::size_t c, const void* p, std::size_t bytes, const char* what, bool host_ok = false, bool null_ok = false) const {
    check_card(c, what);
    if (bytes == 0) return;
    if ((cfg_.timing_only || null_ok) && p == nullptr) return;
    if (!p) throw emulator_error(errc::invalid_argument, std::string(what) + ": null pointer for " + std::to_string(bytes) + " bytes");
    if (!host_ok && !cards_[c]->owns(p, bytes))
      throw invalid_card_error(std::string(what) + ": [" + std::to_string(reinterpret_cast<std::uintptr_t>(p)) + ", +" + std::to_string(bytes) +
                               ") is not inside one allocation of card " + std::to_string(c));
  }
  void check_op(const completion& c) const {
    if (c.owner != this || c.id >= ops_.size()) throw emulator_error(errc::invalid_argument, "completion does not belong to this cluster");
  }

  op make_op(std::uint8_t kind, std::size_t initiator, std::size_t src, std::size_t dst, const void* s, void* d, std::size_t bytes,
             std::uint64_t tag) {
    op o;
    o.kind = kind;
    o.initiator = static_cast<std::uint32_t>(initiator);
    o.src = static_cast<std::uint32_t>(src);
    o.dst = static_cast<std::uint32_t>(dst);
    o.sptr = s;
    o.dptr = d;
    o.bytes = bytes;
    o.tag = tag;
    o.inc_src = cards_[src]->incarnation();
    o.inc_dst = cards_[dst]->incarnation();
    return o;
  }
  op_id push(const op& o) {
    if (!aborted_.empty()) throw fault_error(aborted_, cards_[o.initiator]->clock());
    if (ops_.size() >= UINT32_MAX - 1) throw emulator_error(errc::invalid_argument, "too many transfers");
    ops_.push_back(o);
    return static_cast<op_id>(ops_.size() - 1);
  }
  void start(op_id id, double at) {
    op& o = ops_[id];
    o.msg = net_.post(o.src, o.dst, o.bytes, at, id);
    cv_.notify_all();
  }
  void match(op_id s, op_id r) {
    op& so = ops_[s];
    op& ro = ops_[r];
    so.partner = r;
    ro.partner = s;
    if (so.bytes != ro.bytes) {
      auto e = std::make_exception_ptr(
          emulator_error(errc::invalid_argument, "send of " + std::to_string(so.bytes) + " bytes from card " + std::to_string(so.src) +
                                                     " matched a recv of " + std::to_string(ro.bytes) + " bytes on card " + std::to_string(ro.dst)));
      so.state = ro.state = op_failed;
      so.err = ro.err = e;
      so.done = ro.done = std::max(so.posted, ro.posted);
    } else {
      ro.sptr = so.sptr;
      so.dptr = ro.dptr;
      start(s, std::max(so.posted, ro.posted));
      ro.msg = so.msg;
    }
    cv_.notify_all();
  }

  // Called by the fabric when a message ends: copy the payload, settle the op and its partner.
  void finish_message(fabric::msg_id m, double t, bool ok) {
    op_id id = static_cast<op_id>(net_.tag(m));
    op& o = ops_[id];
    if (o.state != op_pending) return;  // aborted meanwhile
    std::exception_ptr err;
    if (!ok) {
      try {
        net_.rethrow_if_failed(m);
      } catch (...) { err = std::current_exception(); }
    } else if (cards_[o.src]->incarnation() != o.inc_src || cards_[o.dst]->incarnation() != o.inc_dst) {
      std::size_t who = cards_[o.src]->incarnation() != o.inc_src ? o.src : o.dst;
      err = std::make_exception_ptr(card_failed_error(who, t, "hot-swapped during a transfer; its memory is gone"));
    } else if (!cfg_.timing_only && o.bytes > 0 && o.sptr && o.dptr) {
      std::memcpy(o.dptr, o.sptr, o.bytes);
    }
    auto settle = [&](op& x) {
      x.done = t;
      x.state = err ? op_failed : op_done;
      x.err = err;
    };
    horizon_dirty_ = true;
    settle(o);
    if (o.partner != UINT32_MAX) settle(ops_[o.partner]);
    if (cfg_.trace) {
      trace_.record({o.src, track::send, "send " + std::to_string(o.bytes) + " B to " + std::to_string(o.dst), net_.post_time(m),
                     t - net_.post_time(m), o.bytes, 0, o.dst});
      trace_.record({o.dst, track::recv, "recv " + std::to_string(o.bytes) + " B from " + std::to_string(o.src), net_.post_time(m),
                     t - net_.post_time(m), o.bytes, 0, o.src});
    }
  }

  void wait_impl(const completion& c, std::size_t who) {
    std::unique_lock lk(mu_);
    check_op(c);
    const std::size_t target = who == SIZE_MAX ? ops_[c.id].initiator : who;
    if (attached_ > 0 && drivers_[target].attached) {
      wait_conservative(lk, c.id, target);
    } else {
      if (ops_[c.id].state == op_pending && ops_[c.id].msg < 0) {
        net_.run_until(ops_[c.id].posted + cfg_.faults.op_timeout);
        if (ops_[c.id].state == op_pending && ops_[c.id].msg < 0) expire(c.id);
      }
      if (ops_[c.id].state == op_pending) net_.run_until_done(static_cast<fabric::msg_id>(ops_[c.id].msg));
    }
    op& o = ops_[c.id];
    if (o.state == op_pending) throw emulator_error(errc::invalid_argument, "transfer did not finish");
    cards_[target]->advance_to(o.done);
    if (o.state == op_failed) std::rethrow_exception(o.err);
  }

  // An unmatched send/recv reached its timeout: fail it, naming the peer it waited on.
  void expire(op_id id) {
    op& o = ops_[id];
    const double deadline = o.posted + cfg_.faults.op_timeout;
    const std::size_t peer = o.kind == op_send ? o.dst : o.src;
    o.state = op_failed;
    o.done = deadline;
    o.err = std::make_exception_ptr(timeout_error(peer, deadline, std::string(o.kind == op_send ? "send" : "recv") + " never matched"));
    auto& q = unmatched_[{o.src, o.dst, o.tag}];
    auto& v = o.kind == op_send ? q.sends : q.recvs;
    v.erase(std::remove(v.begin(), v.end(), id), v.end());
    horizon_dirty_ = true;
  }

  // Earliest simulated time at which an attached driver other than `me` may still post: its
  // card's clock while it runs, the completion time of what it waits on once that finished.
  double horizon(std::size_t me) const {
    double h = std::numeric_limits<double>::infinity();
    for (std::size_t c = 0; c < drivers_.size(); ++c) {
      const driver& d = drivers_[c];
      if (!d.attached || c == me || d.idle) continue;
      if (d.waiting == UINT32_MAX)
        h = std::min(h, cards_[c]->clock());
      else if (ops_[d.waiting].state != op_pending)
        h = std::min(h, ops_[d.waiting].done);
      // An unmatched wait ends at its deadline (a timeout no fabric event marks), and that driver
      // may post again from there: nobody may simulate past it first.
      else if (ops_[d.waiting].msg < 0)
        h = std::min(h, ops_[d.waiting].posted + cfg_.faults.op_timeout);
    }
    return h;
  }

  static bool before(double t, double h) { return t < h || (std::isinf(h) && !std::isinf(t)); }
  void wait_conservative(std::unique_lock<std::mutex>& lk, op_id id, std::size_t me) {
    drivers_[me].waiting = id;
    cv_.notify_all();
    struct clear_t {
      cluster* cl;
      std::size_t me;
      ~clear_t() {
        cl->drivers_[me].waiting = UINT32_MAX;
        cl->cv_.notify_all();
      }
    } clear{this, me};
    while (ops_[id].state == op_pending) {
      const double h = horizon(me);
      horizon_dirty_ = false;
      bool progressed = false;
      const op& w = ops_[id];
      const std::size_t peer = w.kind == op_send ? w.dst : w.src;
      if (w.msg < 0 && drivers_[peer].attached && drivers_[peer].idle) {
        // the peer waits on the host: its post comes when it is back, so this wait cannot time out
        while (!horizon_dirty_ && before(net_.next_event_time(), h)) {
          net_.step_once();
          progressed = true;
        }
      } else if (ops_[id].msg < 0) {
        const double deadline = ops_[id].posted + cfg_.faults.op_timeout;
        // strictly before the horizon: a driver at clock h may still post at h, and what it posts
        // must be ordered among that instant's events by the fabric's keys, not by host timing
        // (at a deadline on the horizon itself, that instant is processed: two unmatched waits
        // with the same deadline must not wait for each other)
        while (!horizon_dirty_ && ops_[id].msg < 0 && net_.next_event_time() <= deadline &&
               (before(net_.next_event_time(), h) || (h >= deadline && net_.next_event_time() <= h))) {
          net_.step_once();
          progressed = true;
        }
        if (ops_[id].msg < 0 && h >= deadline && net_.next_event_time() > deadline) {
          net_.run_until(deadline);
          expire(id);
          break;
        }
      } else {
        while (!horizon_dirty_ && ops_[id].state == op_pending && before(net_.next_event_time(), h)) {
          net_.step_once();
          progressed = true;
        }
      }
      if (ops_[id].state != op_pending) break;
      if (progressed) {
        cv_.notify_all();
        continue;
      }
      // Blocked on another driver: wait for it to post, wait or advance its clock (launches
      // advance clocks without taking our lock, hence the bounded sleep).
      cv_.wait_for(lk, std::chrono::microseconds(200));
    }
    cv_.notify_all();
  }

  cluster_config cfg_;
  std::unique_ptr<executor> owned_exec_;
  executor* exec_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  fabric net_;
  trace_recorder trace_;
  std::vector<std::unique_ptr<card>> cards_;
  std::vector<op> ops_;
  std::map<std::tuple<std::size_t, std::size_t, std::uint64_t>, queues> unmatched_;
  std::vector<std::function<void(const failure_notice&)>> failure_cbs_;
  struct driver {
    bool attached = false;
    bool idle = false;  // waiting on the host (set_idle)
    op_id waiting = UINT32_MAX;
  };
  std::vector<driver> drivers_;
  std::size_t attached_ = 0;
  bool horizon_dirty_ = false;
  bool host_buffers_ = false;
  bool count_only_ = false;
  std::string aborted_;
};

}  // namespace emu
}  // namespace v0
}  // namespace tessel
