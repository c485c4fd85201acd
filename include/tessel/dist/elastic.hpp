// Elastic training on the emulated cluster: a job that survives dead cards.
//
// elastic_run(cluster, cards, options, job) runs `job(elastic_rank&)` on one thread per card (an
// emulated world, rank r on cards[r]). The job builds its groups and model on the rank's transport,
// calls restore() once, and snapshot() after the steps it wants to be able to return to. A snapshot
// is kept in memory twice (Gemini's peer-memory checkpoints): on the rank's own card, and on a
// "buddy" card in another failure domain (options.failure_domain consecutive ranks share one, e.g.
// a server's cards), sent over the fabric. Each card keeps the two newest generations of both (a
// world-wide barrier after each snapshot bounds the ranks' drift to one generation, so the newest
// generation every rank holds is one of them).
//
// When a card fails, the heartbeat monitor reports it (emu::fabric's detection bound), the ranks
// waiting on it get peer_failed_error, the first one revokes the world (every pending transfer
// ends at once, ULFM's revoke), and every survivor calls agree (ULFM's agree: a fault-tolerant
// exchange that never waits for a dead rank) with the generations it holds. From the same answer
// each survivor computes the same plan: the newest step every survivor holds and every dead rank's
// buddy holds a copy of. Then, by options.policy:
//   replace: each dead rank's place goes to a hot spare (options.spares, in order), or to the same
//            card once its hot swap brings it back; the world is rebuilt and restore() rolls every
//            rank back to that step (survivors from their own memory, the new card from its
//            buddy's copy, over the fabric): the training continues with no step lost beyond the
//            snapshot, and the same bits as a run without the failure.
//   shrink:  every data-parallel replica that lost a card is dropped (options.layout names the
//            replicas; its live cards become spares) and the survivors, renumbered in order, roll
//            back to the newest step all of them hold in their own memory; the job reads its new
//            world size (dp shrinks; it keeps the global batch by giving each replica more). ZeRO-0
//            only: ZeRO-1's moment shards would have to be re-sharded over the new dp.
//   restart: (also when no memory copy survives: a rank and its buddy both dead) restore() loads
//            the newest checkpoint of options.tiers that loads on every rank (dist::resume).
// The report gives each recovery's parts in simulated seconds: detect (failure -> monitor's
// report), agree (report -> plan: a survivor learns of the failure at its next message, so this
// includes the kernel it was running, then the revoke and the agreement), restore (plan -> every rank
// restored), warm-up (restored -> the first snapshot after it: the steps redone).
// A job error that is not a fault (a bug, a bad argument) ends the run with that error.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <tessel/collectives/communicator.hpp>
#include <tessel/collectives/transport/emulated.hpp>
#include <tessel/dist/checkpoint.hpp>
#include <tessel/dist/data_parallel.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/dist/layout.hpp>
#include <tessel/emulator/cluster.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

enum class recovery_policy : std::uint8_t { replace, shrink, restart };

struct elastic_options {
  recovery_policy policy = recovery_policy::replace;
  std::size_t failure_domain = 1;      // consecutive ranks sharing a failure domain: a snapshot's copy goes to rank r + failure_domain
  std::vector<std::size_t> spares;     // hot spare cards (outside the world), used in order
  std::vector<checkpoint_tier> tiers;  // durable checkpoints for a restart (and for a fresh start's resume)
  std::size_t max_recoveries = 16;     // more failures than this end the run with the last one's error
  parallel_layout layout = {};         // shrink: the job's layout (dp·tp·pp = the world); its dp shrinks with each recovery
};

// One recovery, times in simulated seconds.
struct recovery_record {
  int rank = -1;                                      // the dead rank (its place in the world)
  std::size_t failed_card = 0, replacement_card = 0;  // (shrink: no replacement, replacement_card = SIZE_MAX)
  std::uint64_t step = 0;                             // the step the world rolled back to
  std::string source;                                 // "peer memory", "durable tier" or "start" (nothing to restore)
  double happened = 0, detected = 0, agreed = 0, restored = 0, warmed = 0;
  double detect() const { return detected - happened; }
  double agree() const { return agreed - detected; }
  double restore() const { return restored - agreed; }
  double warm_up() const { return warmed - restored; }
  double total() const { return warmed - happened; }
};

struct elastic_report {
  std::vector<recovery_record> recoveries;
  std::size_t rounds = 0;       // worlds run (1 + recoveries)
  double end = 0;               // simulated time the last world finished
  std::uint64_t snapshots = 0;  // snapshot() calls, all ranks
};

// A part of a rank's training state, for a job that describes its state itself (snapshot() and
// restore() take a std::vector<elastic_part>& as the model). On a timing-only cluster `data` may be
// null: only the sizes move.
struct elastic_part {
  std::string key;
  float* data = nullptr;
  std::size_t count = 0;
};

namespace elastic_detail {

using state_part = elastic_part;
template <device Dev>
void add_params(std::vector<state_part>& out, nn::parameters<Dev>& reg, const std::set<std::string>* alloc) {
  for (auto& p : reg) {
    out.push_back({"value/" + p.name, p.value.data(), p.numel});
    const bool want = alloc && alloc->count("m/" + p.name);
    if (want && p.m.size() != p.numel) {
      p.m = device_buffer<float, Dev>::zeros(reg.device(), p.numel);
      p.v = device_buffer<float, Dev>::zeros(reg.device(), p.numel);
    }
    if (p.m.size() == p.numel && (!alloc || want)) {
      out.push_back({"m/" + p.name, p.m.data(), p.numel});
      out.push_back({"v/" + p.name, p.v.data(), p.numel});
    }
  }
}
// Everything a rank holds of its training state, in a fixed order: each parameter's value and
// its model-held moments (once allocated), a data_parallel job's ZeRO-1 shard of the moments.
// `alloc` (restore): exactly the parts a snapshot named, allocating moments not yet allocated.
template <class Model>
std::vector<state_part> parts(Model& m, const std::set<std::string>* alloc) {
  std::vector<state_part> out;
  add_params(out, m.params(), alloc);
  return out;
}
template <class Model>
std::vector<state_part> parts(data_parallel<Model>& dp, const std::set<std::string>* alloc) {
  std::vector<state_part> out;
  add_params(out, dp.model().params(), alloc);
  const bool real = dp.zero_stage() == 1 && dp.has_shard_moments() && dp.owned_range().second > dp.owned_range().first;
  if (dp.zero_stage() == 1 && (alloc ? alloc->count("zero1/m") > 0 : real)) {
    const auto mv = dp.shard_moments();
    out.push_back({"zero1/m", mv.first.data(), mv.first.size()});
    out.push_back({"zero1/v", mv.second.data(), mv.second.size()});
  }
  return out;
}
inline std::vector<state_part> parts(std::vector<elastic_part>& v, const std::set<std::string>*) { return v; }
inline void refresh(std::vector<elastic_part>&) {}
template <class Model>
void refresh(Model& m) {
  m.params().refresh_bf16();
}
template <class Model>
void refresh(data_parallel<Model>& dp) {
  dp.model().params().refresh_bf16();
}

// One generation of a snapshot in a card's memory.
struct generation {
  std::uint64_t step = 0;
  bool complete = false;
  std::string meta;         // JSON: step, extra, parts (key, count)
  std::vector<float> data;  // (empty on a timing-only cluster: only `elements` is kept)
  std::size_t elements = 0;
};
using generations = std::array<generation, 2>;
inline generation& older(generations& g) {
  if (!g[0].complete) return g[0];
  if (!g[1].complete) return g[1];
  return g[0].step <= g[1].step ? g[0] : g[1];
}
inline generation* at_step(generations& g, std::uint64_t s) {
  for (auto& x : g)
    if (x.complete && x.step == s) return &x;
  return nullptr;
}
// What a card's memory holds: its rank's snapshots and copies of other ranks'.
struct card_memory {
  generations own;
  std::map<int, generations> held;  // by rank
};

// The plan every survivor computes from the agreement.
struct plan {
  bool restart = false;  // from the tiers (no memory copy for some dead rank)
  std::uint64_t step = 0;
  std::map<int, int> from_peer;  // rank restored from a copy (a dead rank's replacement, or a live rank without the step) -> the rank holding it
  std::vector<int> dead;
  bool shrunk = false;  // the world lost whole data-parallel replicas: no copies move
};

// State shared by the ranks of the run (the driver's).
struct shared {
  emu::cluster* cl = nullptr;
  elastic_options opt;
  std::mutex mu;
  std::map<std::size_t, card_memory> memory;  // by card
  std::optional<plan> recovering;             // this round restores by it
  std::size_t round = 0;
  std::vector<double> restored_at, first_snapshot_at;
  std::uint64_t snapshots = 0;
  // the round's outcome (written by the lowest member of the final agreement)
  bool finished = false, fatal = false;
  std::optional<plan> next;
  double agreed_at = 0;
  emulated_transport::agreement last;  // the round's final agreement
  std::vector<std::exception_ptr> fatal_errors;
  // a timing-only cluster moves no bytes: a message's sizes are posted here before it is sent
  std::map<int, std::array<std::uint64_t, 3>> posted;
  void publish(int rank, const std::array<std::uint64_t, 3>& w) {
    std::lock_guard lk(mu);
    posted[rank] = w;
  }
  std::array<std::uint64_t, 3> published(int rank) {
    std::lock_guard lk(mu);
    return posted.at(rank);
  }
  card_memory& mem(std::size_t card) {
    std::lock_guard lk(mu);
    return memory[card];
  }
};

inline std::string meta_of(const checkpoint_state& st, const std::vector<state_part>& ps) {
  nlohmann::json j;
  j["step"] = st.step;
  j["extra"] = st.extra;
  auto& a = j["parts"] = nlohmann::json::array();
  for (const auto& p : ps) a.push_back({p.key, p.count});
  return j.dump();
}

}  // namespace elastic_detail

// What the job sees on one rank.
class elastic_rank {
 public:
  emulated_transport transport() const { return t_; }
  int rank() const { return t_.rank(); }
  int size() const { return t_.size(); }
  std::size_t card() const { return t_.card(); }
  std::size_t round() const { return s_->round; }
  // The rank holding this rank's snapshot copies, and the rank whose copies this one holds.
  int buddy() const { return (rank() + shift()) % size(); }
  int buddy_of() const { return (rank() - shift() + size()) % size(); }

  // Call once, before training, on every rank (`world`: the job's world communicator, over this
  // rank's transport): nothing on a fresh start without tiers; the newest tier checkpoint on a
  // fresh start with tiers or after a restart; after a recovery from memory, the agreed step's
  // snapshot (a replacement card's from its buddy's copy). Returns the state restored.
  template <class Model>
  std::optional<checkpoint_state> restore(Model& m, communicator& world) {
    check_world(world, "restore");
    std::optional<checkpoint_state> out;
    const auto& rec = s_->recovering;
    if (!rec || rec->restart) {
      if constexpr (std::is_same_v<Model, std::vector<elastic_part>>) {
        if (!s_->opt.tiers.empty())
          throw dist_error(errc::unsupported, "elastic_rank::restore: durable tiers need a model (a list of parts is restored from memory only)");
      } else if (!s_->opt.tiers.empty()) {
        out = resume(s_->opt.tiers, m, world);
      }
    } else {
      out = restore_from_memory(m, world, *rec);
    }
    s_->restored_at[std::size_t(rank())] = world.now();
    return out;
  }

  // Every rank, collectively: copies this rank's state into its card's memory and to its buddy's
  // (`st.step`: the optimizer steps taken; what restore() returns), then a barrier.
  template <class Model>
  void snapshot(Model& m, communicator& world, const checkpoint_state& st) {
    check_world(world, "snapshot");
    using namespace elastic_detail;
    const bool timing = world.transport_handle().timing_only();
    auto ps = parts(m, nullptr);
    auto& mem = s_->mem(card());
    generation& g = older(mem.own);
    g.complete = false;
    g.step = st.step;
    g.meta = meta_of(st, ps);
    std::size_t total = 0;
    for (const auto& p : ps) total = tessel::detail::add_checked(total, p.count, "elastic: snapshot elements");
    g.elements = total;
    t_.cluster().at(card()).charge(kernel_cost{0, 8.0 * double(total)}, "elastic snapshot copy");  // a card-local copy: read and write
    g.data.resize(timing ? 0 : total);
    if (!timing) {
      std::size_t at = 0;
      for (const auto& p : ps) {
        std::copy(p.data, p.data + p.count, g.data.begin() + std::ptrdiff_t(at));
        at += p.count;
      }
    }
    if (size() > 1) {
      // the copy: sizes, then the description, then the data (to the buddy; from the rank whose
      // buddy this is). On a timing-only cluster the messages carry their sizes only.
      const int to = buddy(), from = buddy_of();
      std::array<std::uint64_t, 3> mine{g.step, g.meta.size(), g.elements}, theirs{};
      if (timing) s_->publish(rank(), mine);  // no bytes move: the sizes go through the host
      world.send_recv(std::span<const std::uint64_t>(mine), to, 71, std::span<std::uint64_t>(theirs), from, 71);
      if (timing) theirs = s_->published(from);  // (posted before its send, which this receive matched)
      generation& h = older(mem.held[from]);
      h.complete = false;
      h.step = theirs[0];
      h.meta.assign(std::size_t(theirs[1]), '\0');
      h.elements = std::size_t(theirs[2]);
      h.data.resize(timing ? 0 : h.elements);
      world.send_recv(g.meta.data(), g.meta.size(), to, 72, h.meta.data(), h.meta.size(), from, 72, dtype::u8);
      world.send_recv(timing ? nullptr : g.data.data(), g.elements, to, 73, timing ? nullptr : h.data.data(), h.elements, from, 73, dtype::f32);
      h.complete = true;
    }
    g.complete = true;
    world.barrier();  // bounds the drift: nobody overwrites a generation another rank may still need
    {
      std::lock_guard lk(s_->mu);
      ++s_->snapshots;
      auto& first = s_->first_snapshot_at[std::size_t(rank())];
      if (first < 0) first = world.now();
    }
  }

 private:
  template <class Job>
  friend elastic_report elastic_run(emu::cluster&, std::vector<std::size_t>, elastic_options, Job&&);
  elastic_rank(std::shared_ptr<elastic_detail::shared> s, emulated_transport t) : s_(std::move(s)), t_(std::move(t)) {}

  int shift() const {
    const std::size_t d = s_->opt.failure_domain;
    return d > 0 && d < std::size_t(size()) ? int(d) : 1;
  }
  void check_world(communicator& world, const char* what) const {
    if (world.size() != size() || world.rank() != rank())
      throw dist_error(errc::invalid_argument, std::string("elastic_rank::") + what + ": the communicator is not this rank's world (rank " +
                                                   std::to_string(world.rank()) + " of " + std::to_string(world.size()) + ", expected " +
                                                   std::to_string(rank()) + " of " + std::to_string(size()) + ")");
  }

  template <class Model>
  static checkpoint_state apply(Model& m, const elastic_detail::generation& g, const std::string& who) {
    using namespace elastic_detail;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(g.meta);
    } catch (const nlohmann::json::exception& e) {
      throw dist_error(errc::format, "elastic: " + who + ": the snapshot's description is not JSON: " + e.what());
    }
    std::set<std::string> keys;
    std::vector<std::pair<std::string, std::size_t>> want;
    for (const auto& e : j.at("parts")) want.push_back({e.at(0).get<std::string>(), e.at(1).get<std::size_t>()}), keys.insert(want.back().first);
    auto ps = parts(m, &keys);
    if (ps.size() != want.size())
      throw dist_error(errc::format,
                       "elastic: " + who + ": the snapshot has " + std::to_string(want.size()) + " parts, the model " + std::to_string(ps.size()));
    std::size_t at = 0;
    for (std::size_t i = 0; i < ps.size(); ++i) {
      if (ps[i].key != want[i].first || ps[i].count != want[i].second || want[i].second > g.data.size() - at)
        throw dist_error(errc::format, "elastic: " + who + ": the snapshot's part " + want[i].first + " (" + std::to_string(want[i].second) +
                                           " elements) does not fit the model's " + ps[i].key + " (" + std::to_string(ps[i].count) + ")");
      std::copy(g.data.begin() + std::ptrdiff_t(at), g.data.begin() + std::ptrdiff_t(at + want[i].second), ps[i].data);
      at += want[i].second;
    }
    refresh(m);
    checkpoint_state st;
    st.step = j.at("step").get<std::uint64_t>();
    for (const auto& kv : j.at("extra").items()) st.extra[kv.key()] = kv.value().template get<std::string>();
    return st;
  }

  template <class Model>
  checkpoint_state restore_from_memory(Model& m, communicator& world, const elastic_detail::plan& pl) {
    using namespace elastic_detail;
    const bool timing = world.transport_handle().timing_only();
    auto& mem = s_->mem(card());
    // the copies dead ranks need, from the ranks holding them
    for (const auto& [d, h] : pl.from_peer) {
      if (rank() == h) {
        generation* g = at_step(mem.held[d], pl.step);
        if (!g) throw dist_error(errc::fault, "elastic: rank " + std::to_string(h) + " lost the copy of rank " + std::to_string(d) + "'s snapshot");
        std::array<std::uint64_t, 3> n{g->step, g->meta.size(), g->elements};
        if (timing) s_->publish(rank(), n);
        world.send(n.data(), 3, dtype::u64, d, 74);
        world.send(g->meta.data(), g->meta.size(), dtype::u8, d, 75);
        world.send(timing ? nullptr : g->data.data(), g->elements, dtype::f32, d, 76);
      } else if (rank() == d) {
        std::array<std::uint64_t, 3> n{};
        world.recv(n.data(), 3, dtype::u64, h, 74);
        if (timing) n = s_->published(h);
        generation& g = mem.own[0];
        mem.own[1] = generation{};
        g.step = pl.step;
        g.meta.assign(std::size_t(n[1]), '\0');
        g.elements = std::size_t(n[2]);
        g.data.resize(timing ? 0 : g.elements);
        world.recv(g.meta.data(), g.meta.size(), dtype::u8, h, 75);
        world.recv(timing ? nullptr : g.data.data(), g.elements, dtype::f32, h, 76);
        g.complete = true;
      }
    }
    // generations newer than the agreed step are history that will be redone
    auto drop_newer = [&](generations& gs) {
      for (auto& g : gs)
        if (g.complete && g.step > pl.step) g = generation{};
    };
    drop_newer(mem.own);
    for (auto& [r, gs] : mem.held) drop_newer(gs);
    generation* g = at_step(mem.own, pl.step);
    if (!g) throw dist_error(errc::fault, "elastic: rank " + std::to_string(rank()) + " holds no snapshot of step " + std::to_string(pl.step));
    if (pl.shrunk && g->meta.find("\"zero1/m\"") != std::string::npos)
      throw dist_error(errc::unsupported,
                       "elastic: a shrunk world re-shards ZeRO-1's moments over its new dp, which is not built: use the replace policy, or ZeRO-0");
    t_.cluster().at(card()).charge(kernel_cost{0, 8.0 * double(g->elements)}, "elastic restore copy");
    if (timing) return checkpoint_state{.step = pl.step};  // nothing to copy on a timing-only cluster
    return apply(m, *g, "rank " + std::to_string(rank()));
  }

  std::shared_ptr<elastic_detail::shared> s_;
  emulated_transport t_;
};

namespace elastic_detail {
// The words a survivor brings to the agreement: ok, fatal, its own complete generations' steps
// (+1; 0: none), then per held rank: rank, its two steps (+1).
inline std::vector<std::uint64_t> agreement_words(card_memory& mem, bool ok, bool fatal) {
  std::vector<std::uint64_t> w{ok ? 1u : 0u, fatal ? 1u : 0u};
  for (const auto& g : mem.own) w.push_back(g.complete ? g.step + 1 : 0);
  for (const auto& [r, gs] : mem.held) {
    w.push_back(std::uint64_t(r));
    for (const auto& g : gs) w.push_back(g.complete ? g.step + 1 : 0);
  }
  return w;
}
// The plan from an agreement: the newest step that every surviving rank holds, or that a survivor
// holds a copy of for it, and that a survivor holds a copy of for every dead rank (restart when
// there is none).
// `own_only`: these ranks must hold the step in their own memory and nobody else matters (a
// shrink: no copies move, the other ranks are dropped).
inline plan plan_from(const emulated_transport::agreement& a, int n, const std::vector<int>* own_only = nullptr) {
  plan p;
  std::vector<char> member(std::size_t(n), 0);
  for (int r : a.members) member[std::size_t(r)] = 1;
  for (int r = 0; r < n; ++r)
    if (!member[std::size_t(r)]) p.dead.push_back(r);
  auto own_has = [&](int r, std::uint64_t s) { return a.values[std::size_t(r)][2] == s + 1 || a.values[std::size_t(r)][3] == s + 1; };
  auto holder = [&](int d, std::uint64_t s) {
    for (int r : a.members) {
      const auto& w = a.values[std::size_t(r)];
      for (std::size_t i = 4; i + 2 < w.size(); i += 3)
        if (w[i] == std::uint64_t(d) && (w[i + 1] == s + 1 || w[i + 2] == s + 1)) return r;
    }
    return -1;
  };
  std::set<std::uint64_t, std::greater<>> cands;
  for (int r : a.members)
    for (int k = 2; k < 4; ++k)
      if (a.values[std::size_t(r)][std::size_t(k)] > 0) cands.insert(a.values[std::size_t(r)][std::size_t(k)] - 1);
  for (std::uint64_t s : cands) {
    // a live rank without the step in its own memory (a replacement that had not finished its
    // restore) takes it from its copy like a dead rank's replacement
    bool ok = true;
    std::map<int, int> from;
    if (own_only) ok = std::all_of(own_only->begin(), own_only->end(), [&](int r) { return member[std::size_t(r)] && own_has(r, s); });
    for (int r = 0; r < n && ok && !own_only; ++r) {
      if (member[std::size_t(r)] && own_has(r, s)) continue;
      const int h = holder(r, s);
      if (h < 0 || h == r)
        ok = false;
      else
        from[r] = h;
    }
    if (ok) {
      p.step = s, p.from_peer = std::move(from);
      return p;
    }
  }
  p.restart = true;
  return p;
}

// When card `c` failed (the newest of its card_down/hot_swap faults at or before `now`), when the
// monitor reported it (its notice; before the fabric simulated it, the monitor's schedule: the
// missed heartbeats after it) and, for a hot swap, when it is back.
struct failure_times {
  double happened = 0, detected = 0, back = -1;
};
inline failure_times failure_of(emu::cluster& cl, std::size_t c, double now) {
  failure_times ft;
  now = std::max(now, cl.clock(c));  // (a card whose clock ran into its outage ahead of the others)
  const emu::fault* last = nullptr;
  for (const auto& f : cl.net().faults())
    if (f.card == c && (f.kind == emu::fault_kind::card_down || f.kind == emu::fault_kind::hot_swap) && f.at <= now * (1 + 1e-12) &&
        (!last || f.at >= last->at))
      last = &f;
  if (!last) return ft;
  const auto& fc = cl.config().faults;
  ft.happened = last->at;
  ft.detected =
      (std::floor(last->at / fc.heartbeat_interval) + double(fc.missed_heartbeats)) * fc.heartbeat_interval + 2 * cl.config().direct_latency();
  for (const auto& nt : cl.notices())
    if (nt.card == c && nt.kind == last->kind && nt.happened == last->at) ft.detected = nt.detected;
  if (last->kind == emu::fault_kind::hot_swap) ft.back = last->at + last->duration;
  return ft;
}
}  // namespace elastic_detail

// Runs `job` elastically on `cards` of `cl` (see the header comment). The cluster's faults
// (scheduled or seeded random) are what fails. Returns when every rank's job has returned with
// no failure left to recover; throws the job's own error (the lowest rank's) when it fails for a
// reason that is not a fault, and dist_error when a failure cannot be recovered (no spare, more
// than max_recoveries).
template <class Job>
elastic_report elastic_run(emu::cluster& cl, std::vector<std::size_t> cards, elastic_options opt, Job&& job) {
  using namespace elastic_detail;
  if (cards.empty()) throw dist_error(errc::invalid_argument, "elastic_run: no cards");
  {
    std::set<std::size_t> seen;
    for (std::size_t c : cards)
      if (c >= cl.size() || !seen.insert(c).second)
        throw dist_error(errc::invalid_argument,
                         "elastic_run: card " + std::to_string(c) + " is outside the cluster of " + std::to_string(cl.size()) + " or named twice");
    for (std::size_t c : opt.spares)
      if (c >= cl.size() || !seen.insert(c).second)
        throw dist_error(errc::invalid_argument,
                         "elastic_run: spare card " + std::to_string(c) + " is outside the cluster, in the world or named twice");
  }
  auto s = std::make_shared<shared>();
  s->cl = &cl;
  s->opt = opt;
  // the spare cards, each with the simulated time from which it can join; a hot-swapped card
  // joins the pool once it is back and its heartbeat seen
  std::vector<std::pair<std::size_t, double>> pool;
  for (std::size_t c : opt.spares) pool.push_back({c, 0.0});
  const double seen_again = cl.config().faults.heartbeat_interval + cl.config().direct_latency() + 1e-9;
  elastic_report rep;
  if (opt.policy == recovery_policy::shrink) opt.layout.validate(int(cards.size()));
  for (;;) {
    const int n = int(cards.size());
    s->restored_at.assign(cards.size(), 0);
    s->first_snapshot_at.assign(cards.size(), -1);
    s->finished = s->fatal = false;
    s->next.reset();
    s->fatal_errors.assign(cards.size(), nullptr);
    ++rep.rounds;
    emulated_world(cl, cards).run([&](emulated_transport t) {
      elastic_rank er(s, t);
      bool ok = true;
      std::exception_ptr fatal;
      try {
        job(er);
      } catch (const comm_error&) { ok = false; } catch (const emu::fault_error&) {
        ok = false;
      } catch (...) {
        ok = false;
        fatal = std::current_exception();
      }
      if (!ok) t.revoke(-1);
      if (cl.failed(t.card()) || cl.at(t.card()).down()) return;  // this card is dead: its thread ends
      emulated_transport::agreement a;
      try {
        a = t.agree(agreement_words(s->mem(t.card()), ok, fatal != nullptr));
      } catch (const comm_error&) {
        return;  // this card failed meanwhile
      }
      std::lock_guard lk(s->mu);
      if (fatal) s->fatal_errors[std::size_t(t.rank())] = fatal;
      if (t.rank() != a.members.front()) return;
      s->agreed_at = a.at;
      s->last = a;
      bool all_ok = int(a.members.size()) == n, any_fatal = false;
      for (int r : a.members) all_ok = all_ok && a.values[std::size_t(r)][0] == 1, any_fatal = any_fatal || a.values[std::size_t(r)][1] == 1;
      if (any_fatal)
        s->fatal = true;
      else if (all_ok)
        s->finished = true;
      else
        s->next = plan_from(a, n);
    });
    // the previous recovery's last parts: every rank restored, then the first snapshot after it
    for (auto& r : rep.recoveries)
      if (r.restored < 0) {
        r.restored = *std::max_element(s->restored_at.begin(), s->restored_at.end());
        r.warmed = std::max(r.restored, *std::max_element(s->first_snapshot_at.begin(), s->first_snapshot_at.end()));
      }
    if (s->fatal) {
      for (auto& e : s->fatal_errors)
        if (e) std::rethrow_exception(e);
    }
    rep.end = 0;
    for (std::size_t c : cards) rep.end = std::max(rep.end, cl.clock(c));
    rep.snapshots = s->snapshots;
    if (s->finished) return rep;
    if (!s->next) throw dist_error(errc::fault, "elastic_run: the world ended without an outcome");
    if (rep.recoveries.size() + s->next->dead.size() > opt.max_recoveries)
      throw dist_error(errc::fault, "elastic_run: more than " + std::to_string(opt.max_recoveries) + " failures");
    plan p = *s->next;
    if (opt.policy == recovery_policy::restart) p.restart = true;
    if (opt.policy == recovery_policy::shrink) {
      // drop every data-parallel replica that lost a card; the survivors keep their own snapshots
      std::set<int> gone;
      for (int d : p.dead) gone.insert(opt.layout.coords(d).dp);
      if (int(gone.size()) >= opt.layout.dp)
        throw dist_error(errc::fault, "elastic_run: every data-parallel replica lost a card: nothing to shrink to");
      std::vector<int> keep;
      for (int r = 0; r < n; ++r)
        if (!gone.count(opt.layout.coords(r).dp)) keep.push_back(r);
      const plan found = plan_from(s->last, n, &keep);
      p = plan{};
      p.shrunk = true;
      p.restart = found.restart;
      p.step = found.step;
      std::vector<recovery_record> recs;
      for (int d : s->next->dead) {
        recovery_record r;
        r.rank = d;
        r.failed_card = cards[std::size_t(d)];
        r.replacement_card = SIZE_MAX;
        const auto ft = failure_of(cl, r.failed_card, s->agreed_at);
        r.happened = ft.happened, r.detected = ft.detected;
        r.step = p.step;
        r.source = p.restart ? (opt.tiers.empty() ? "start" : "durable tier") : "peer memory";
        r.agreed = s->agreed_at;
        r.restored = -1;
        recs.push_back(r);
        s->memory.erase(r.failed_card);
      }
      std::vector<std::size_t> next;
      for (int r : keep) next.push_back(cards[std::size_t(r)]);
      for (int r = 0; r < n; ++r) {  // the dropped replicas' live cards become spares
        const bool dropped = gone.count(opt.layout.coords(r).dp) > 0;
        const bool dead = std::find(s->next->dead.begin(), s->next->dead.end(), r) != s->next->dead.end();
        if (dropped && !dead) pool.push_back({cards[std::size_t(r)], 0.0}), s->memory.erase(cards[std::size_t(r)]);
      }
      cards = std::move(next);
      opt.layout.dp -= int(gone.size());
      s->opt.layout = opt.layout;
      for (auto& [c, mem] : s->memory) mem.held.clear();  // the copies are named by the old ranks
      if (p.restart) s->memory.clear();
      double ready = s->agreed_at;
      for (std::size_t c : cards) ready = std::max(ready, cl.clock(c));
      for (std::size_t c : cards) cl.at(c).advance_to(ready);
      s->recovering = p;
      ++s->round;
      rep.recoveries.insert(rep.recoveries.end(), recs.begin(), recs.end());
      continue;
    }
    // the dead cards' memory is gone; each dead rank's place goes to a spare or its card once swapped back
    std::vector<recovery_record> recs;
    double ready = s->agreed_at;
    for (int d : p.dead) {
      recovery_record r;
      r.rank = d;
      r.failed_card = cards[std::size_t(d)];
      const auto ft = failure_of(cl, r.failed_card, s->agreed_at);
      r.happened = ft.happened, r.detected = ft.detected;
      s->memory.erase(r.failed_card);
      if (ft.back >= 0) pool.push_back({r.failed_card, ft.back + seen_again});
      // the spare ready first (one down now waits for its own return; one lost for good leaves)
      std::size_t best = pool.size();
      for (std::size_t i = 0; i < pool.size(); ++i) {
        const auto f = failure_of(cl, pool[i].first, s->agreed_at);
        if (f.happened > 0 && f.back < 0) continue;  // dead for good
        if (f.back > s->agreed_at) pool[i].second = std::max(pool[i].second, f.back + seen_again);
        if (best == pool.size() || pool[i].second < pool[best].second) best = i;
      }
      if (best == pool.size())
        throw dist_error(errc::fault, "elastic_run: card " + std::to_string(r.failed_card) + " (rank " + std::to_string(d) +
                                          ") failed and there is no spare card left and no hot swap of it");
      r.replacement_card = pool[best].first;
      ready = std::max(ready, pool[best].second);
      pool.erase(pool.begin() + std::ptrdiff_t(best));
      cards[std::size_t(d)] = r.replacement_card;
      s->memory.erase(r.replacement_card);
      r.step = p.step;
      r.source = p.restart ? (opt.tiers.empty() ? "start" : "durable tier") : "peer memory";
      r.agreed = s->agreed_at;
      recs.push_back(r);
    }
    // the new world starts when its last card is ready
    for (std::size_t c : cards) cl.at(c).advance_to(ready);
    if (p.restart) s->memory.clear();  // the newest state is on disk: memory copies are history
    s->recovering = p;
    ++s->round;
    for (auto& r : recs) r.restored = -1;  // filled in once the next world has restored
    rep.recoveries.insert(rep.recoveries.end(), recs.begin(), recs.end());
  }
}

}  // namespace dist
}  // namespace v0
}  // namespace tessel
