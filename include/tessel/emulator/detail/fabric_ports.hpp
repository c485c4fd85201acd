// The fabric's ports (part of emulator/fabric.hpp, which includes it): which ports are alive, the
// path a chunk takes, a port serializing one chunk at a time with cut-through forwarding, the
// round-robin in destination order over a card's own messages, and credit-based shaping towards a
// receiving port.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

#include <tessel/emulator/fabric.hpp>

namespace tessel {
inline namespace v0 {
namespace emu {

inline bool fabric::port_alive(std::size_t q) const {
  if (q < card_ports_) {
    std::size_t c = q / 2 / planes_, p = (q / 2) % planes_;
    return link_ok_[c * planes_ + p] && plane_ok_[p] && card_alive_[c];
  }
  if (q < ls_base_) return card_alive_[(q - nic_base_) / 2] != 0;
  return true;
}

// Builds the path of chunk `ci` of message `m` leaving through source port `q`.
inline void fabric::build_path(chunk& ch, const message& m, std::size_t q) {
  if (m.route.kind == route_kind::scaleout) {
    std::size_t ls = cfg_.supernode_of(m.src), ld = cfg_.supernode_of(m.dst);
    std::size_t best = 0;
    if (cfg_.fabric.routing == routing_policy::static_plane) {
      best = (m.src + m.dst) % spines_;
    } else {  // least-loaded spine (ECMP with load awareness)
      double bl = std::numeric_limits<double>::infinity();
      const std::size_t off = (m.src + ch.index) % spines_;  // spreads ties
      for (std::size_t i = 0; i < spines_; ++i) {
        std::size_t k = (off + i) % spines_;
        double l = port_backlog(leaf_up(ls, k)) + port_backlog(spine_down(k, ld));
        if (l < bl) {
          bl = l;
          best = k;
        }
      }
    }
    ch.ports[0] = static_cast<std::uint32_t>(q);
    ch.ports[1] = static_cast<std::uint32_t>(leaf_up(ls, best));
    ch.ports[2] = static_cast<std::uint32_t>(spine_down(best, ld));
    ch.ports[3] = static_cast<std::uint32_t>(nic_down(m.dst));
    ch.len = 4;
    return;
  }
  const std::size_t p = (q / 2) % planes_;
  if (m.route.kind == route_kind::direct) {
    ch.ports[0] = static_cast<std::uint32_t>(q);
    ch.ports[1] = static_cast<std::uint32_t>(down(m.dst, p));
    ch.len = 2;
    return;
  }
  // transit: second plane = least backlog among the planes via -> dst can use
  std::size_t best = planes_;
  double bl = std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < planes_; ++i) {
    const std::size_t p2 = (ch.index + i) % planes_;
    if (!(m.route.mask2 >> p2 & 1)) continue;
    double l = port_backlog(up(m.route.via, p2));
    if (l < bl) {
      bl = l;
      best = p2;
    }
  }
  ch.ports[0] = static_cast<std::uint32_t>(q);
  ch.ports[1] = static_cast<std::uint32_t>(down(m.route.via, p));
  ch.ports[2] = static_cast<std::uint32_t>(up(m.route.via, best));
  ch.ports[3] = static_cast<std::uint32_t>(down(m.dst, best));
  ch.len = 4;
}

inline bool fabric::route_uses_source(const message& m, std::size_t q) const {
  if (m.route.kind == route_kind::scaleout) return q == nic_up(m.src);
  if (m.route.kind == route_kind::none || q >= card_ports_ || q % 2) return false;
  return q / 2 / planes_ == m.src && (m.route.mask1 >> ((q / 2) % planes_) & 1);
}

inline void fabric::start(std::size_t q, std::uint32_t ci) {
  port& pt = ports_[q];
  chunk& ch = chunks_[ci];
  // The port is occupied for the chunk's serialization only; its last byte cannot leave
  // before it has arrived (cut-through), but a fast port keeps serving other chunks meanwhile,
  // as a switch interleaving packets would.
  const double ser = static_cast<double>(ch.bytes) / pt.bw;
  const double finish = std::max(now_ + ser, ch.tail);
  pt.busy = true;
  pt.cur = ci;
  pt.cur_gen = ch.gen;
  pt.cur_start = now_;
  pt.st.bytes += ch.bytes;
  push_event(now_ + ser, ev_free, static_cast<std::uint32_t>(q), static_cast<std::uint32_t>(ch.bytes));
  if (ch.hop + 1 < ch.len) {
    double extra = 0;
    std::size_t nq = ch.ports[ch.hop + 1];
    if (ch.len == 4 && ch.ports[0] < card_ports_ && nq == ch.ports[2]) extra = cfg_.fabric.transit_latency;
    ch.tail = finish + pt.lat + extra;
    push_event(now_ + pt.lat + extra, ev_arrive, ci, ch.gen);
  } else {
    push_event(finish + pt.lat, ev_deliver, ci, ch.gen);
  }
}

// Starts the next chunk on an idle port: forwarded chunks first (FIFO), then the card's own
// messages round-robin (a source port pulls the next chunk of the next message).
inline void fabric::try_start(std::size_t q) {
  port& pt = ports_[q];
  if (pt.busy || !port_alive(q)) return;
  while (!pt.fifo.empty()) {
    std::uint32_t ci = pt.fifo.front();
    pt.fifo.pop_front();
    if (chunks_[ci].lost) {
      pt.queued -= chunks_[ci].bytes;
      release_after(chunks_[ci]);
      free_chunk(ci);
      continue;
    }
    start(q, ci);
    return;
  }
  // Own messages are served in destination order, rotating on from the last destination served
  // (ties: activation order). Activation order alone follows the host threads when cards are
  // driven concurrently, so concurrent messages (an all-to-all) would collide at receivers by
  // chance; in destination order an all-to-all sends one permutation per round, deterministically.
  if (pt.rr.size() > 1) {
    std::size_t best = SIZE_MAX, best_key = SIZE_MAX;
    for (std::size_t i = 0; i < pt.rr.size(); ++i) {
      const auto [id, gen] = pt.rr[i];
      const message& m = msgs_[id];
      if (m.state != msg_state::active || m.route_gen != gen || !m.has_more() || !route_uses_source(m, q)) continue;
      const std::size_t from = pt.last_dst == UINT32_MAX ? m.src : pt.last_dst;
      const std::size_t key = (m.dst + n_ - from - 1) % n_;
      if (key < best_key) best_key = key, best = i;
    }
    if (best != SIZE_MAX && best != 0) {
      const auto e = pt.rr[best];
      pt.rr.erase(pt.rr.begin() + static_cast<std::ptrdiff_t>(best));
      pt.rr.push_front(e);
    }
  }
  std::size_t tries = pt.rr.size();
  while (tries-- > 0 && !pt.rr.empty()) {
    auto [id, gen] = pt.rr.front();
    pt.rr.pop_front();
    message& m = msgs_[id];
    if (m.state != msg_state::active || m.route_gen != gen || !m.has_more() || !route_uses_source(m, q)) continue;
    std::uint32_t index = m.retry.empty() ? m.next_chunk : m.retry.back();
    std::uint32_t ci = new_chunk();
    chunk& ch = chunks_[ci];
    ch.msg = id;
    ch.index = index;
    ch.bytes = chunk_bytes(m, index);
    ch.hop = 0;
    ch.lost = false;
    ch.credited = false;
    ch.tail = now_;
    build_path(ch, m, q);
    for (std::uint8_t h = 1; h < ch.len; ++h) ports_[ch.ports[h]].reserved += ch.bytes;
    if (cfg_.fabric.shaping) {
      port& fin = ports_[ch.ports[ch.len - 1]];
      const auto need = static_cast<std::int64_t>(ch.bytes);
      if (fin.credit < need && fin.credit < static_cast<std::int64_t>(cfg_.fabric.shaping_window)) {
        for (std::uint8_t h = 1; h < ch.len; ++h) ports_[ch.ports[h]].reserved -= ch.bytes;
        free_chunk(ci);
        pt.rr.emplace_back(id, gen);
        if (std::find(fin.waiters.begin(), fin.waiters.end(), static_cast<std::uint32_t>(q)) == fin.waiters.end())
          fin.waiters.push_back(static_cast<std::uint32_t>(q));
        continue;
      }
      fin.credit -= need;
      ch.credited = true;
    }
    if (m.retry.empty())
      m.next_chunk++;
    else
      m.retry.pop_back();
    if (m.has_more()) pt.rr.emplace_back(id, gen);
    // the rotation restarts after the source itself once the port has nothing more of its own,
    // so every exchange starts in the same phase on every card (one permutation per round)
    pt.last_dst = pt.rr.empty() ? UINT32_MAX : m.dst;
    pt.queued += ch.bytes;
    start(q, ci);
    return;
  }
  // Nothing of its own left: the loop above has dropped the stale entries (messages whose last
  // chunks left through another plane), so the next exchange starts its rotation after the
  // source again. Without this a port kept the last destination of the previous exchange and
  // later iterations of the same exchange started out of phase (MoE dispatch 89% -> 82%).
  pt.last_dst = UINT32_MAX;
}

}  // namespace emu
}  // namespace v0
}  // namespace tessel
