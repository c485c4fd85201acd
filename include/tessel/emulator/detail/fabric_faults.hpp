// The fabric's faults (part of emulator/fabric.hpp, which includes it): links, planes and cards
// going down and up, hot swap, what dies with a port, the heartbeat health monitor that detects
// failures within a bounded time and tells every card, and the seeded random fault schedule.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>

#include <tessel/emulator/fabric.hpp>

namespace tessel {
inline namespace v0 {
namespace emu {

inline void fabric::set_link(std::size_t c, std::size_t p, bool ok) { link_ok_[c * planes_ + p] = ok; }

// Releases the reservations a chunk holds on the ports after the one it is at.
inline void fabric::release_after(const chunk& ch) {
  for (std::uint8_t h = ch.hop + 1; h < ch.len; ++h) ports_[ch.ports[h]].reserved -= ch.bytes;
}

// Drops whatever is queued on or passing through a port that just died.
inline void fabric::kill_port(std::size_t q) {
  port& pt = ports_[q];
  if (pt.busy && chunks_[pt.cur].gen == pt.cur_gen) lose(pt.cur);
  while (!pt.fifo.empty()) {
    std::uint32_t ci = pt.fifo.front();
    pt.fifo.pop_front();
    pt.queued -= chunks_[ci].bytes;
    release_after(chunks_[ci]);
    lose(ci);
    free_chunk(ci);
  }
}

inline void fabric::kill_card_ports(std::size_t c, std::size_t only_plane) {
  for (std::size_t p = 0; p < planes_; ++p) {
    if (only_plane != SIZE_MAX && p != only_plane) continue;
    kill_port(up(c, p));
    kill_port(down(c, p));
  }
  if (sn_ > 1 && only_plane == SIZE_MAX) {
    kill_port(nic_up(c));
    kill_port(nic_down(c));
  }
}

inline void fabric::wake_card_ports(std::size_t c) {
  for (std::size_t p = 0; p < planes_; ++p) {
    try_start(up(c, p));
    try_start(down(c, p));
  }
  if (sn_ > 1) {
    try_start(nic_up(c));
    try_start(nic_down(c));
  }
}

// `phase` 1 = the second half of a hot swap (the card comes back empty).
inline void fabric::apply_fault(const fault& f, std::uint32_t phase) {
  double detect = now_ + cfg_.faults.link_detect + cfg_.direct_latency();
  switch (f.kind) {
    case fault_kind::link_down:
      set_link(f.card, f.plane, false);
      kill_card_ports(f.card, f.plane);
      break;
    case fault_kind::link_up:
      set_link(f.card, f.plane, true);
      try_start(up(f.card, f.plane));
      try_start(down(f.card, f.plane));
      break;
    case fault_kind::plane_down:
      plane_ok_[f.plane] = 0;
      for (std::size_t c = 0; c < n_; ++c) kill_card_ports(c, f.plane);
      break;
    case fault_kind::plane_up:
      plane_ok_[f.plane] = 1;
      for (std::size_t c = 0; c < n_; ++c) {
        try_start(up(c, f.plane));
        try_start(down(c, f.plane));
      }
      break;
    case fault_kind::card_down:
    case fault_kind::hot_swap:
      if (phase == 0) {
        card_alive_[f.card] = 0;
        kill_card_ports(f.card);
        if (on_card_state) on_card_state(f.card, false, now_);
        // heartbeat monitor: the last heartbeat left at floor(t/h)*h; `missed` more are missed.
        const double h = cfg_.faults.heartbeat_interval;
        detect = (std::floor(now_ / h) + cfg_.faults.missed_heartbeats) * h + 2 * cfg_.direct_latency();
        if (detect <= now_) detect = now_ + h;
        if (f.kind == fault_kind::hot_swap)
          push_event(now_ + std::max(f.duration, 0.0), ev_fault, static_cast<std::uint32_t>(&f - faults_.data()), 1);
      } else {
        card_alive_[f.card] = 1;
        wake_card_ports(f.card);
        if (on_card_state) on_card_state(f.card, true, now_);
        push_event(now_, ev_rejoin, static_cast<std::uint32_t>(f.card));
        detect = now_ + cfg_.faults.heartbeat_interval + cfg_.direct_latency();
      }
      break;
    case fault_kind::card_up:
      card_alive_[f.card] = 1;
      wake_card_ports(f.card);
      if (on_card_state) on_card_state(f.card, true, now_);
      detect = now_ + cfg_.faults.heartbeat_interval + cfg_.direct_latency();
      break;
  }
  // detection record index encodes the fault and phase
  push_event(detect, ev_detect, static_cast<std::uint32_t>((&f - faults_.data()) * 2 + phase));
}

inline void fabric::on_rejoin_event(std::uint32_t c) {
  if (on_rejoin) on_rejoin(c, now_);
}

inline void fabric::on_detect(std::uint32_t code) {
  const fault& f = faults_[code / 2];
  const bool second = code % 2;
  bool down_now = false;
  switch (f.kind) {
    case fault_kind::link_down:
      link_known_ok_[f.card * planes_ + f.plane] = 0;
      down_now = true;
      break;
    case fault_kind::link_up: link_known_ok_[f.card * planes_ + f.plane] = 1; break;
    case fault_kind::plane_down:
      plane_known_ok_[f.plane] = 0;
      down_now = true;
      break;
    case fault_kind::plane_up: plane_known_ok_[f.plane] = 1; break;
    case fault_kind::card_down:
      card_known_alive_[f.card] = 0;
      down_now = true;
      break;
    case fault_kind::card_up: card_known_alive_[f.card] = 1; break;
    case fault_kind::hot_swap:
      card_known_alive_[f.card] = second ? 1 : 0;
      down_now = !second;
      break;
  }
  router_.invalidate();
  failure_notice note{second ? fault_kind::card_up : f.kind, f.card, f.plane, second ? f.at + f.duration : f.at, now_};
  if (down_now) notices_.push_back(note);
  // Messages to or from a card reported dead fail now; the rest are re-routed.
  std::vector<std::uint32_t> act = active_;
  for (std::uint32_t id : act) {
    message& m = msgs_[id];
    if (m.state != msg_state::active) continue;
    if (!card_known_alive_[m.src] || !card_known_alive_[m.dst]) {
      fail(id, err_card, card_known_alive_[m.src] ? m.dst : m.src, 0);
      continue;
    }
    set_route(id);
  }
  if (on_failure && down_now) on_failure(note);
}

inline void fabric::schedule_random_faults() {
  std::mt19937_64 rng(cfg_.faults.seed);
  const auto& fs = cfg_.faults;
  auto draw = [&](double rate, auto&& make) {
    if (rate <= 0) return;
    std::exponential_distribution<double> gap(rate);
    for (double t = gap(rng); t < fs.horizon; t += gap(rng) + fs.repair_time) make(t);
  };
  for (std::size_t c = 0; c < n_; ++c)
    for (std::size_t p = 0; p < planes_; ++p)
      draw(fs.link_failure_rate, [&](double t) {
        schedule_fault({t, fault_kind::link_down, c, p, 0});
        if (fs.repair_time > 0) schedule_fault({t + fs.repair_time, fault_kind::link_up, c, p, 0});
      });
  for (std::size_t c = 0; c < n_; ++c)
    draw(fs.card_failure_rate, [&](double t) {
      if (fs.repair_time > 0)
        schedule_fault({t, fault_kind::hot_swap, c, 0, fs.repair_time});
      else
        schedule_fault({t, fault_kind::card_down, c, 0, 0});
    });
}

}  // namespace emu
}  // namespace v0
}  // namespace tessel
