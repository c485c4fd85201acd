// The switch fabric of the emulated cluster: a deterministic discrete-event simulation at chunk
// granularity. Each card has one link into each switch plane; every link has a queue on both
// sides (the card's uplink, where the card's messages share it round-robin, and the switch's
// output port towards the receiver, a FIFO in arrival order, where incast contends). Chunks are
// forwarded cut-through, so a lone transfer takes exactly latency + S / (planes x link bandwidth).
// Messages are striped over planes by letting every usable uplink pull the next chunk, which also
// balances load. Optional credit-based shaping bounds what senders may have in flight towards one
// receiving port. Faults (links, planes, cards, hot swap) are events in the same timeline; a
// heartbeat health monitor detects them within a bounded time, and routing then moves traffic to
// the remaining planes or to a 2-hop path through another card. Super-nodes are joined by a
// 2-level fat tree through per-card NICs. No payload moves here: the cluster copies bytes when a
// message completes, and timing-only runs use this class alone.
//
// In parts: the fault types in emulator/faults.hpp, route choice in emulator/routing.hpp, the ports
// (serialization, forwarding, shaping) in emulator/detail/fabric_ports.hpp, the fault model and
// health monitor in emulator/detail/fabric_faults.hpp; here the class, its traffic API, the event
// queue and the message lifecycle.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <queue>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include <tessel/emulator/config.hpp>
#include <tessel/emulator/errors.hpp>
#include <tessel/emulator/faults.hpp>
#include <tessel/emulator/routing.hpp>

namespace tessel {
inline namespace v0 {
namespace emu {

enum class msg_state : std::uint8_t { scheduled, active, done, failed };

struct port_stats {
  double busy = 0;  // seconds spent serializing
  std::uint64_t bytes = 0;
  std::uint64_t max_queue_bytes = 0;
  std::uint64_t drops = 0;  // chunks dropped at a full switch buffer
};

class fabric {
 public:
  using msg_id = std::uint32_t;

  explicit fabric(const cluster_config& cfg) : cfg_(cfg) {
    cfg_.validate();
    n_ = cfg_.cards();
    planes_ = cfg_.fabric.planes;
    sn_ = cfg_.scaleout.supernodes;
    spines_ = sn_ > 1 ? cfg_.scaleout.spines : 0;
    const double link_bw = cfg_.link_bandwidth();
    card_ports_ = 2 * n_ * planes_;
    nic_base_ = card_ports_;
    ls_base_ = nic_base_ + (sn_ > 1 ? 2 * n_ : 0);
    std::size_t total = ls_base_ + 2 * sn_ * spines_;
    ports_.resize(total);
    for (std::size_t c = 0; c < n_; ++c)
      for (std::size_t p = 0; p < planes_; ++p) {
        ports_[up(c, p)].bw = link_bw;
        ports_[up(c, p)].lat = cfg_.fabric.port_latency + cfg_.fabric.switch_latency;
        ports_[down(c, p)].bw = link_bw;
        ports_[down(c, p)].lat = cfg_.fabric.port_latency;
      }
    if (sn_ > 1) {
      const auto& so = cfg_.scaleout;
      for (std::size_t c = 0; c < n_; ++c) {
        ports_[nic_up(c)].bw = ports_[nic_down(c)].bw = so.nic_bandwidth;
        ports_[nic_up(c)].lat = so.link_latency + so.switch_latency;
        ports_[nic_down(c)].lat = so.link_latency;
      }
      // Non-blocking tree: each leaf's uplinks carry all of its cards' NIC bandwidth.
      const double ls_bw = so.nic_bandwidth * static_cast<double>(cfg_.cards_per_supernode) / static_cast<double>(spines_);
      for (std::size_t l = 0; l < sn_; ++l)
        for (std::size_t k = 0; k < spines_; ++k) {
          ports_[leaf_up(l, k)].bw = ports_[spine_down(k, l)].bw = ls_bw;
          ports_[leaf_up(l, k)].lat = ports_[spine_down(k, l)].lat = so.link_latency + so.switch_latency;
        }
    }
    for (auto& pt : ports_) pt.credit = static_cast<std::int64_t>(cfg_.fabric.shaping_window);
    card_alive_.assign(n_, 1);
    card_known_alive_.assign(n_, 1);
    link_ok_.assign(n_ * planes_, 1);
    link_known_ok_.assign(n_ * planes_, 1);
    plane_ok_.assign(planes_, 1);
    plane_known_ok_.assign(planes_, 1);
    build_graph();
    if (cfg_.faults.horizon > 0 && (cfg_.faults.link_failure_rate > 0 || cfg_.faults.card_failure_rate > 0)) schedule_random_faults();
  }

  fabric(const fabric&) = delete;
  fabric& operator=(const fabric&) = delete;

  const cluster_config& config() const { return cfg_; }
  std::size_t cards() const { return n_; }
  double now() const { return now_; }

  // ---- hooks (set once by the owner, e.g. the cluster) ----
  std::function<void(msg_id, double, bool)> on_complete;                      // message finished (ok) or failed
  std::function<void(const failure_notice&)> on_failure;                      // health monitor detections
  std::function<void(std::size_t card, double t)> on_rejoin;                  // a hot-swapped card is back, empty
  std::function<void(std::size_t card, bool alive, double t)> on_card_state;  // physical up/down

  // ---- traffic ----
  // Posts a message of `bytes` from `src` to `dst` at simulated time `at` (clamped to now() if
  // earlier: the simulation never goes back in time). `tag` is the owner's, returned by tag().
  msg_id post(std::size_t src, std::size_t dst, std::uint64_t bytes, double at, std::uint64_t tag = 0) {
    check_card(src, "post source");
    check_card(dst, "post destination");
    if (!(at >= 0) || !std::isfinite(at)) throw emulator_error(errc::invalid_argument, "post time must be finite and >= 0");
    if (msgs_.size() >= std::numeric_limits<msg_id>::max() - 1) throw emulator_error(errc::invalid_argument, "too many messages");
    msg_id id = static_cast<msg_id>(msgs_.size());
    message m;
    m.src = static_cast<std::uint32_t>(src);
    m.dst = static_cast<std::uint32_t>(dst);
    m.bytes = bytes;
    m.tag = tag;
    m.post = std::max(at, now_);
    msgs_.push_back(m);
    // Activation is an event ordered by (time, source, destination, per-pair count), not by the
    // order posts arrive: threads driving cards post same-time messages in any order, and the
    // simulation must not depend on it (same inputs, same simulated times).
    std::uint32_t& pc = pair_posts_[static_cast<std::uint64_t>(src) * n_ + dst];
    push_keyed(m.post, ev_post, id, (static_cast<std::uint64_t>(src) << 42) | (static_cast<std::uint64_t>(dst) << 22) | (pc++ & 0x3FFFFFu));
    return id;
  }

  void schedule_fault(const fault& f) {
    if (!(f.at >= 0) || !std::isfinite(f.at)) throw emulator_error(errc::invalid_argument, "fault time must be finite and >= 0");
    if (f.kind == fault_kind::plane_down || f.kind == fault_kind::plane_up) {
      if (f.plane >= planes_) throw invalid_card_error("fault names plane " + std::to_string(f.plane) + " of " + std::to_string(planes_));
    } else {
      check_card(f.card, "fault");
      if ((f.kind == fault_kind::link_down || f.kind == fault_kind::link_up) && f.plane >= planes_)
        throw invalid_card_error("fault names plane " + std::to_string(f.plane) + " of " + std::to_string(planes_));
    }
    faults_.push_back(f);
    push_event(std::max(f.at, now_), ev_fault, static_cast<std::uint32_t>(faults_.size() - 1));
  }

  // ---- running ----
  void run() {
    while (!events_.empty()) step();
  }
  void run_until(double t) {
    while (!events_.empty() && events_.top().t <= t) step();
    now_ = std::max(now_, t);
  }
  // Runs until message `id` is done or failed. Always terminates: an active message that makes
  // no progress fails at its timeout.
  void run_until_done(msg_id id) {
    check_msg(id);
    while (msgs_[id].state != msg_state::done && msgs_[id].state != msg_state::failed && !events_.empty()) step();
  }
  bool idle() const { return events_.empty(); }
  // Time of the next pending event (infinity if none), and processing exactly one event: for
  // drivers that synchronize several threads conservatively (see cluster::driver_scope).
  double next_event_time() const { return events_.empty() ? std::numeric_limits<double>::infinity() : events_.top().t; }
  void step_once() {
    if (!events_.empty()) step();
  }

  // ---- results ----
  msg_state state(msg_id id) const {
    check_msg(id);
    return msgs_[id].state;
  }
  bool finished(msg_id id) const {
    auto s = state(id);
    return s == msg_state::done || s == msg_state::failed;
  }
  double completion_time(msg_id id) const {
    check_msg(id);
    return msgs_[id].done;
  }
  double post_time(msg_id id) const {
    check_msg(id);
    return msgs_[id].post;
  }
  double latency(msg_id id) const {
    check_msg(id);
    return msgs_[id].done - msgs_[id].post;
  }
  std::uint64_t tag(msg_id id) const {
    check_msg(id);
    return msgs_[id].tag;
  }
  std::size_t source(msg_id id) const {
    check_msg(id);
    return msgs_[id].src;
  }
  std::size_t destination(msg_id id) const {
    check_msg(id);
    return msgs_[id].dst;
  }
  std::uint64_t bytes(msg_id id) const {
    check_msg(id);
    return msgs_[id].bytes;
  }
  std::size_t messages() const { return msgs_.size(); }
  // Which transit card a message was last routed through (or -1 for direct paths).
  long via(msg_id id) const {
    check_msg(id);
    return msgs_[id].route.kind == route_kind::transit ? static_cast<long>(msgs_[id].route.via) : -1;
  }

  // Throws the typed error of a failed message (no-op otherwise).
  void rethrow_if_failed(msg_id id) const {
    check_msg(id);
    const message& m = msgs_[id];
    if (m.state != msg_state::failed) return;
    std::string ctx = "transfer " + std::to_string(m.src) + "->" + std::to_string(m.dst) + " of " + std::to_string(m.bytes) + " bytes";
    switch (m.err) {
      case err_card: throw card_failed_error(m.err_card, m.done, ctx);
      case err_link: throw link_failed_error(m.err_card, m.err_plane, m.done, ctx);
      default: throw timeout_error(m.err_card, m.done, ctx);
    }
  }

  // Per-message latency (completion - post) percentile over completed messages, q in [0, 100].
  double latency_percentile(double q) const {
    std::vector<double> v;
    for (const auto& m : msgs_)
      if (m.state == msg_state::done) v.push_back(m.done - m.post);
    return percentile(v, q);
  }
  static double percentile(std::vector<double> v, double q) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    double r = std::clamp(q, 0.0, 100.0) / 100.0 * static_cast<double>(v.size() - 1);
    std::size_t lo = static_cast<std::size_t>(r);
    std::size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (r - static_cast<double>(lo));
  }

  std::uint64_t events_processed() const { return events_done_; }
  // Chunks dropped at full switch buffers (only with a finite switch_buffer).
  std::uint64_t drops() const { return drops_; }
  double makespan() const { return last_delivery_; }

  // ---- topology state ----
  bool card_alive(std::size_t c) const {
    check_card(c, "query");
    return card_alive_[c] != 0;
  }
  bool link_up(std::size_t c, std::size_t p) const {
    check_card(c, "query");
    check_plane(p);
    return link_ok_[c * planes_ + p] && plane_ok_[p] && card_alive_[c];
  }
  bool plane_up(std::size_t p) const {
    check_plane(p);
    return plane_ok_[p] != 0;
  }
  // Whether the health monitor has reported card `c` dead (as every card sees it now).
  bool known_failed(std::size_t c) const {
    check_card(c, "query");
    return card_known_alive_[c] == 0;
  }
  const std::vector<failure_notice>& notices() const { return notices_; }
  // Every fault scheduled so far (explicit and seeded random), in scheduling order.
  const std::vector<fault>& faults() const { return faults_; }
  // Worst-case detection delay of a card failure: the monitor misses `missed_heartbeats`
  // heartbeats, then tells every card over the fabric.
  double detection_bound() const {
    return static_cast<double>(cfg_.faults.missed_heartbeats) * cfg_.faults.heartbeat_interval + 2 * cfg_.direct_latency();
  }

  // ---- ports ----
  std::size_t ports() const { return ports_.size(); }
  std::size_t up(std::size_t c, std::size_t p) const { return 2 * (c * planes_ + p); }
  std::size_t down(std::size_t c, std::size_t p) const { return 2 * (c * planes_ + p) + 1; }
  std::size_t nic_up(std::size_t c) const { return nic_base_ + 2 * c; }
  std::size_t nic_down(std::size_t c) const { return nic_base_ + 2 * c + 1; }
  std::size_t leaf_up(std::size_t l, std::size_t k) const { return ls_base_ + 2 * (l * spines_ + k); }
  std::size_t spine_down(std::size_t k, std::size_t l) const { return ls_base_ + 2 * (l * spines_ + k) + 1; }
  port_stats stats_of(std::size_t port) const { return ports_.at(port).st; }
  double port_bandwidth(std::size_t port) const { return ports_.at(port).bw; }
  std::string port_name(std::size_t q) const {
    if (q < card_ports_) {
      std::size_t c = q / 2 / planes_, p = (q / 2) % planes_;
      return (q % 2 ? "card " + std::to_string(c) + " plane " + std::to_string(p) + " rx (switch->card)"
                    : "card " + std::to_string(c) + " plane " + std::to_string(p) + " tx (card->switch)");
    }
    if (q < ls_base_) return "card " + std::to_string((q - nic_base_) / 2) + (q % 2 ? " nic rx" : " nic tx");
    std::size_t i = (q - ls_base_) / 2;
    return (q % 2 ? "spine " + std::to_string(i % spines_) + " -> leaf " + std::to_string(i / spines_)
                  : "leaf " + std::to_string(i / spines_) + " -> spine " + std::to_string(i % spines_));
  }
  // Utilization of a port over [0, horizon] (default: the last delivery).
  double utilization(std::size_t port, double horizon = 0) const {
    double h = horizon > 0 ? horizon : last_delivery_;
    return h > 0 ? ports_.at(port).st.busy / h : 0;
  }
  // The busiest port (the run's top communication bottleneck).
  std::size_t busiest_port() const {
    std::size_t best = 0;
    for (std::size_t q = 1; q < ports_.size(); ++q)
      if (ports_[q].st.busy > ports_[best].st.busy) best = q;
    return best;
  }
  const topology_graph& graph() const { return router_.graph(); }

  // ---- what routing reads (emulator/routing.hpp's routing_state) ----
  // Health as the monitor has reported it: what routing acts on.
  bool known_alive(std::size_t c) const { return card_known_alive_[c] != 0; }
  bool known_link(std::size_t c, std::size_t p) const { return link_known_ok_[c * planes_ + p] && plane_known_ok_[p] && card_known_alive_[c]; }
  double port_latency(std::size_t q) const { return ports_[q].lat; }
  // Bytes waiting at a port plus bytes already routed towards it, in seconds of its bandwidth (so
  // simultaneous choices spread out instead of all picking the same idle port).
  double port_backlog(std::size_t q) const { return static_cast<double>(ports_[q].queued + ports_[q].reserved) / ports_[q].bw; }

  // After run(): every port idle with empty queues, no bytes reserved or queued, every credit
  // back, no active message. Returns a description of the first violation, or "" (for tests).
  std::string check_quiescent() const {
    for (std::size_t q = 0; q < ports_.size(); ++q) {
      const port& pt = ports_[q];
      if (pt.busy || !pt.fifo.empty() || pt.queued || pt.reserved)
        return port_name(q) + ": busy " + std::to_string(pt.busy) + " fifo " + std::to_string(pt.fifo.size()) + " queued " +
               std::to_string(pt.queued) + " reserved " + std::to_string(pt.reserved);
      if (cfg_.fabric.shaping && pt.credit != static_cast<std::int64_t>(cfg_.fabric.shaping_window))
        return port_name(q) + ": credit " + std::to_string(pt.credit) + " not returned";
    }
    if (!active_.empty()) return std::to_string(active_.size()) + " messages still active";
    for (const auto& m : msgs_)
      if (m.state == msg_state::active || m.state == msg_state::scheduled) return "a message never finished";
    return {};
  }
  std::uint64_t route_computations() const { return router_.computations(); }

 private:
  // ---------------------------------------------------------------- data
  enum : std::uint8_t { err_none, err_card, err_link, err_timeout };
  enum : std::uint32_t { ev_post, ev_free, ev_arrive, ev_deliver, ev_fault, ev_detect, ev_timeout, ev_rejoin, ev_wake, ev_retry };

  struct message {
    std::uint32_t src = 0, dst = 0;
    std::uint64_t bytes = 0, tag = 0;
    double post = 0, done = 0, last_progress = 0;
    msg_state state = msg_state::scheduled;
    std::uint8_t err = err_none;
    std::uint32_t err_card = 0, err_plane = 0;
    emu::route route;
    std::uint32_t route_gen = 0;
    std::uint32_t nchunks = 0, next_chunk = 0, chunks_done = 0;
    std::uint64_t chunk_base = 0, chunk_extra = 0;  // first `extra` chunks carry one more byte
    std::vector<std::uint32_t> retry;               // lost chunks to resend
    std::uint32_t active_slot = 0;
    bool has_more() const { return next_chunk < nchunks || !retry.empty(); }
  };
  struct chunk {
    std::uint32_t msg = 0, index = 0, gen = 0;
    std::uint64_t bytes = 0;
    std::uint32_t ports[4] = {0, 0, 0, 0};
    std::uint8_t len = 0, hop = 0;
    bool lost = false, credited = false;
    double tail = 0;  // when the chunk's last byte reaches the port it is queued at
  };
  struct port {
    double bw = 1, lat = 0;
    bool busy = false;
    std::uint32_t cur = 0, cur_gen = 0;
    double cur_start = 0;
    std::uint64_t queued = 0, reserved = 0;
    std::deque<std::uint32_t> fifo;                          // chunks, in arrival order
    std::deque<std::pair<std::uint32_t, std::uint32_t>> rr;  // (message, route gen) to pull from
    std::uint32_t last_dst = UINT32_MAX;                     // destination of the last own chunk
    std::int64_t credit = 0;                                 // shaping: bytes a sender may still send here
    std::vector<std::uint32_t> waiters;                      // source ports blocked on credit here
    port_stats st;
  };
  struct event {
    double t;
    std::uint64_t seq;
    std::uint32_t kind, a, b;
    bool operator>(const event& o) const { return t != o.t ? t > o.t : seq > o.seq; }
  };

  cluster_config cfg_;
  std::size_t n_ = 0, planes_ = 0, sn_ = 1, spines_ = 0;
  std::size_t card_ports_ = 0, nic_base_ = 0, ls_base_ = 0;
  std::vector<port> ports_;
  std::vector<message> msgs_;
  std::vector<chunk> chunks_;
  std::vector<std::uint32_t> free_chunks_;
  std::vector<std::uint32_t> active_;
  std::unordered_map<std::uint64_t, std::uint32_t> pair_posts_;  // posts per (src, dst): activation order
  std::priority_queue<event, std::vector<event>, std::greater<event>> events_;
  std::uint64_t seq_ = 0, events_done_ = 0, drops_ = 0;
  double now_ = 0, last_delivery_ = 0;
  std::vector<std::uint8_t> card_alive_, card_known_alive_, link_ok_, link_known_ok_, plane_ok_, plane_known_ok_;
  std::vector<fault> faults_;
  std::vector<failure_notice> notices_;
  router router_;

  // ---------------------------------------------------------------- helpers
  void check_card(std::size_t c, const char* what) const {
    if (c >= n_)
      throw invalid_card_error(std::string(what) + ": invalid card index " + std::to_string(c) + " (cluster has " + std::to_string(n_) + " cards)");
  }
  void check_plane(std::size_t p) const {
    if (p >= planes_) throw invalid_card_error("invalid plane " + std::to_string(p) + " of " + std::to_string(planes_));
  }
  void check_msg(msg_id id) const {
    if (id >= msgs_.size()) throw emulator_error(errc::out_of_range, "unknown message id " + std::to_string(id));
  }
  void push_event(double t, std::uint32_t kind, std::uint32_t a, std::uint32_t b = 0) { events_.push(event{t, seq_++, kind, a, b}); }
  // Events whose order at equal times must not depend on the caller's order: after every
  // sequenced event of that time, among themselves by key (posts, then port wake-ups).
  void push_keyed(double t, std::uint32_t kind, std::uint32_t a, std::uint64_t key) {
    events_.push(event{t, (std::uint64_t{1} << 63) | key, kind, a, 0});
  }

  std::uint32_t new_chunk() {
    if (!free_chunks_.empty()) {
      std::uint32_t c = free_chunks_.back();
      free_chunks_.pop_back();
      return c;
    }
    chunks_.emplace_back();
    return static_cast<std::uint32_t>(chunks_.size() - 1);
  }
  void free_chunk(std::uint32_t c) {
    chunks_[c].gen++;
    free_chunks_.push_back(c);
  }

  std::uint64_t chunk_bytes(const message& m, std::uint32_t i) const { return m.chunk_base + (i < m.chunk_extra ? 1 : 0); }

  void build_graph() {
    // nodes: cards, then plane switches per super-node, then leaves, then spines
    const std::size_t sw0 = n_, leaf0 = n_ + sn_ * planes_, spine0 = leaf0 + (sn_ > 1 ? sn_ : 0);
    router_.graph().resize(spine0 + spines_);
    for (std::size_t c = 0; c < n_; ++c) {
      std::size_t s = cfg_.supernode_of(c);
      for (std::size_t p = 0; p < planes_; ++p) {
        auto sw = static_cast<std::uint32_t>(sw0 + s * planes_ + p);
        router_.graph().add_edge(static_cast<std::uint32_t>(c), sw, static_cast<std::uint32_t>(up(c, p)));
        router_.graph().add_edge(sw, static_cast<std::uint32_t>(c), static_cast<std::uint32_t>(down(c, p)));
      }
      if (sn_ > 1) {
        router_.graph().add_edge(static_cast<std::uint32_t>(c), static_cast<std::uint32_t>(leaf0 + s), static_cast<std::uint32_t>(nic_up(c)));
        router_.graph().add_edge(static_cast<std::uint32_t>(leaf0 + s), static_cast<std::uint32_t>(c), static_cast<std::uint32_t>(nic_down(c)));
      }
    }
    for (std::size_t l = 0; l < (sn_ > 1 ? sn_ : 0); ++l)
      for (std::size_t k = 0; k < spines_; ++k) {
        router_.graph().add_edge(static_cast<std::uint32_t>(leaf0 + l), static_cast<std::uint32_t>(spine0 + k),
                                 static_cast<std::uint32_t>(leaf_up(l, k)));
        router_.graph().add_edge(static_cast<std::uint32_t>(spine0 + k), static_cast<std::uint32_t>(leaf0 + l),
                                 static_cast<std::uint32_t>(spine_down(k, l)));
      }
  }

  // ---------------------------------------------------------------- routing (emulator/routing.hpp)
  route choose_route(const message& m) { return router_.choose(*this, m.src, m.dst, static_cast<double>(m.bytes)); }

  // Source ports a message pulls chunks from under its route.
  template <class F>
  void for_source_ports(const message& m, F&& f) const {
    if (m.route.kind == route_kind::scaleout) {
      f(nic_up(m.src));
      return;
    }
    if (m.route.kind == route_kind::none) return;
    for (std::size_t p = 0; p < planes_; ++p)
      if (m.route.mask1 >> p & 1) f(up(m.src, p));
  }

  void register_sources(msg_id id) {
    message& m = msgs_[id];
    for_source_ports(m, [&](std::size_t q) {
      ports_[q].rr.emplace_back(id, m.route_gen);
      // the port picks once every message of this instant is active (see try_start's order)
      if (!ports_[q].busy) push_keyed(now_, ev_wake, static_cast<std::uint32_t>(q), (std::uint64_t{1} << 62) | q);
    });
  }

  void set_route(msg_id id) {
    message& m = msgs_[id];
    route r = choose_route(m);
    if (r == m.route && m.route_gen != 0) return;
    m.route = r;
    m.route_gen++;
    register_sources(id);
  }

  // ---------------------------------------------------------------- message lifecycle
  void activate(msg_id id) {
    message& m = msgs_[id];
    m.state = msg_state::active;
    m.last_progress = now_;
    m.active_slot = static_cast<std::uint32_t>(active_.size());
    active_.push_back(id);
    if (!card_known_alive_[m.src] || !card_known_alive_[m.dst]) {
      fail(id, err_card, card_known_alive_[m.dst] ? m.src : m.dst, 0);
      return;
    }
    // Chunking: at most chunk_bytes each (and a quarter of the credit window or switch buffer,
    // so several chunks fit), and a multiple of the source-port count so every
    // plane carries an equal share (this is what makes one transfer take S/(planes x bw)).
    m.route = choose_route(m);
    std::uint64_t width = 1;
    if (m.route.kind == route_kind::direct || m.route.kind == route_kind::transit) width = std::max(1, std::popcount(m.route.mask1));
    std::uint64_t cb = cfg_.fabric.chunk_bytes;
    if (cfg_.fabric.shaping) cb = std::max<std::uint64_t>(1, std::min<std::uint64_t>(cb, cfg_.fabric.shaping_window / 4));
    if (cfg_.fabric.switch_buffer) cb = std::max<std::uint64_t>(1, std::min<std::uint64_t>(cb, cfg_.fabric.switch_buffer / 4));
    std::uint64_t n = (m.bytes + cb - 1) / cb;
    n = std::max<std::uint64_t>(1, (n + width - 1) / width * width);
    if (m.bytes > 0) n = std::min<std::uint64_t>(n, m.bytes);
    if (n > std::numeric_limits<std::uint32_t>::max() / 2)
      throw emulator_error(errc::invalid_argument, "message of " + std::to_string(m.bytes) + " bytes needs too many chunks; raise chunk_bytes");
    m.nchunks = static_cast<std::uint32_t>(n);
    m.chunk_base = m.bytes / n;
    m.chunk_extra = m.bytes % n;
    push_event(now_ + cfg_.faults.op_timeout, ev_timeout, id);
    m.route_gen++;
    register_sources(id);
  }

  void retire(msg_id id) {
    message& m = msgs_[id];
    std::uint32_t slot = m.active_slot;
    active_[slot] = active_.back();
    msgs_[active_[slot]].active_slot = slot;
    active_.pop_back();
    m.retry.clear();
    m.retry.shrink_to_fit();
  }

  void complete(msg_id id) {
    message& m = msgs_[id];
    m.state = msg_state::done;
    m.done = now_;
    last_delivery_ = std::max(last_delivery_, now_);
    retire(id);
    if (on_complete) on_complete(id, now_, true);
  }

  void fail(msg_id id, std::uint8_t err, std::size_t card, std::size_t plane) {
    message& m = msgs_[id];
    if (m.state == msg_state::done || m.state == msg_state::failed) return;
    if (m.state == msg_state::active) retire(id);
    m.state = msg_state::failed;
    m.done = now_;
    m.err = err;
    m.err_card = static_cast<std::uint32_t>(card);
    m.err_plane = static_cast<std::uint32_t>(plane);
    if (on_complete) on_complete(id, now_, false);
  }

  // A chunk that will never arrive: give its index back to the message to resend.
  void lose(std::uint32_t ci) {
    chunk& ch = chunks_[ci];
    if (ch.lost) return;
    ch.lost = true;
    const std::uint32_t id = ch.msg, index = ch.index;
    return_credit(ch);  // may start chunks and grow chunks_: `ch` dangles after it
    message& m = msgs_[id];
    if (m.state != msg_state::active) return;
    m.retry.push_back(index);
    register_sources(id);
  }

  // Returns the chunk's credit to its final port and restarts the sources waiting on it. Starting
  // them allocates chunks, which can move chunks_: callers must not touch `ch` afterwards.
  void return_credit(chunk& ch) {
    if (!ch.credited) return;
    ch.credited = false;
    port& fin = ports_[ch.ports[ch.len - 1]];
    fin.credit += static_cast<std::int64_t>(ch.bytes);
    if (!fin.waiters.empty()) {
      std::vector<std::uint32_t> w;
      w.swap(fin.waiters);
      for (std::uint32_t q : w) try_start(q);
    }
  }

  // ---------------------------------------------------------------- ports
  // Defined in emulator/detail/fabric_ports.hpp: port liveness, chunk paths, serialization and
  // cut-through forwarding, round-robin over a card's messages, credit-based shaping.
  bool port_alive(std::size_t q) const;
  void build_path(chunk& ch, const message& m, std::size_t q);
  bool route_uses_source(const message& m, std::size_t q) const;
  void start(std::size_t q, std::uint32_t ci);
  void try_start(std::size_t q);

  // ---------------------------------------------------------------- events
  void step() {
    event e = events_.top();
    events_.pop();
    // A timeout of a message that already finished is not an event: it must not drag the clock
    // forward (run() would otherwise end op_timeout after the last delivery).
    if (e.kind == ev_timeout && msgs_[e.a].state != msg_state::active) return;
    now_ = std::max(now_, e.t);
    events_done_++;
    switch (e.kind) {
      case ev_post: activate(e.a); break;
      case ev_free: on_free(e.a, e.b); break;
      case ev_arrive: on_arrive(e.a, e.b); break;
      case ev_deliver: on_deliver(e.a, e.b); break;
      case ev_fault: apply_fault(faults_[e.a], e.b); break;
      case ev_detect: on_detect(e.a); break;
      case ev_timeout: on_timeout(e.a); break;
      case ev_rejoin: on_rejoin_event(e.a); break;
      case ev_wake: try_start(e.a); break;
      case ev_retry: on_retry(e.a, e.b); break;
      default: break;
    }
  }

  void on_free(std::uint32_t q, std::uint32_t bytes) {
    port& pt = ports_[q];
    pt.busy = false;
    pt.st.busy += now_ - pt.cur_start;
    pt.queued -= bytes;
    try_start(q);
  }

  void on_arrive(std::uint32_t ci, std::uint32_t gen) {
    chunk& ch = chunks_[ci];
    if (ch.gen != gen) return;
    ch.hop++;
    const std::size_t q = ch.ports[ch.hop];
    ports_[q].reserved -= ch.bytes;
    if (ch.lost) {
      release_after(ch);
      free_chunk(ci);
      return;
    }
    if (!port_alive(q)) {
      release_after(ch);
      lose(ci);
      free_chunk(ci);
      return;
    }
    port& pt = ports_[q];
    if (cfg_.fabric.switch_buffer && is_switch_output(q) && pt.queued > 0 && pt.queued + ch.bytes > cfg_.fabric.switch_buffer) {
      // Buffer full: the chunk is dropped; the sender resends it after its retransmit timeout.
      pt.st.drops++;
      drops_++;
      release_after(ch);
      const std::uint32_t id = ch.msg, index = ch.index;
      return_credit(ch);  // may grow chunks_: `ch` dangles after it
      push_event(now_ + cfg_.fabric.retransmit_timeout, ev_retry, id, index);
      free_chunk(ci);
      return;
    }
    pt.fifo.push_back(ci);
    pt.queued += ch.bytes;
    pt.st.max_queue_bytes = std::max(pt.st.max_queue_bytes, pt.queued);
    try_start(q);
  }

  void on_deliver(std::uint32_t ci, std::uint32_t gen) {
    chunk& ch = chunks_[ci];
    if (ch.gen != gen) return;
    if (ch.lost) {
      free_chunk(ci);
      return;
    }
    const std::uint32_t id = ch.msg;
    return_credit(ch);  // may grow chunks_: `ch` dangles after it
    free_chunk(ci);
    message& m = msgs_[id];
    if (m.state != msg_state::active) return;
    m.last_progress = now_;
    if (++m.chunks_done == m.nchunks) complete(id);
  }

  void on_retry(std::uint32_t id, std::uint32_t index) {
    message& m = msgs_[id];
    if (m.state != msg_state::active) return;
    m.retry.push_back(index);
    register_sources(id);
  }

  // Ports whose queue is inside a switch (bounded by switch_buffer when set).
  bool is_switch_output(std::size_t q) const {
    if (q < card_ports_) return q % 2 == 1;
    if (q < ls_base_) return (q - nic_base_) % 2 == 1;
    return true;
  }

  void on_timeout(std::uint32_t id) {
    message& m = msgs_[id];
    if (m.state != msg_state::active) return;
    if (now_ - m.last_progress < cfg_.faults.op_timeout * (1 - 1e-12)) {
      push_event(m.last_progress + cfg_.faults.op_timeout, ev_timeout, id);
      return;
    }
    // Name the link that blocks the pair, if any; else the peer we were waiting on.
    for (std::size_t c : {static_cast<std::size_t>(m.src), static_cast<std::size_t>(m.dst)}) {
      if (!card_alive_[c]) {
        fail(id, err_card, c, 0);
        return;
      }
      for (std::size_t p = 0; p < planes_; ++p)
        if (!link_ok_[c * planes_ + p] || !plane_ok_[p]) {
          fail(id, err_link, c, p);
          return;
        }
    }
    fail(id, err_timeout, m.dst, 0);
  }

  // Defined in emulator/detail/fabric_faults.hpp: link, card and plane faults, hot swap, the
  // health monitor's detection and the seeded random fault schedule.
  void set_link(std::size_t c, std::size_t p, bool ok);
  void release_after(const chunk& ch);
  void kill_port(std::size_t q);
  void kill_card_ports(std::size_t c, std::size_t only_plane = SIZE_MAX);
  void wake_card_ports(std::size_t c);
  void apply_fault(const fault& f, std::uint32_t phase);
  void on_rejoin_event(std::uint32_t c);
  void on_detect(std::uint32_t code);
  void schedule_random_faults();
};

}  // namespace emu
}  // namespace v0
}  // namespace tessel

#include <tessel/emulator/detail/fabric_faults.hpp>
#include <tessel/emulator/detail/fabric_ports.hpp>
