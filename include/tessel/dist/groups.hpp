// Process groups of a parallel layout: the world, this rank's tensor-parallel group and its
// data-parallel group, each a communicator. The communicator offers no split, so a group is a
// transport (group_transport) over the world's: it renumbers the group's members 0..k-1 and moves
// their messages into the group's own tag space (bits 48..62 of the tag hold a group id; the
// communicator's collective tags use bits 8..47 and point-to-point tags bit 63 and bits 0..31),
// so collectives of different groups between the same pair of ranks never match each other's
// messages. Each group's collectives keep the communicator's fixed reduction order (group rank 0,
// 1, ...), so results are bitwise the same whatever the thread timing.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <tessel/collectives/communicator.hpp>
#include <tessel/collectives/transport.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/dist/layout.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

// A transport over a subset of another transport's ranks (a model of `transport`). Every member
// builds one with the same `members` (world ranks, in group-rank order) and the same `group_id`
// (1..32767; 0 is left to the world itself). Two groups that share a pair of ranks need different
// ids. abort() aborts the whole world.
template <transport T>
class group_transport {
 public:
  static constexpr bool shared_address_space = requires { requires T::shared_address_space; };
  static constexpr bool simulated = requires { requires T::simulated; };
  static constexpr bool counts_only = requires { requires T::counts_only; };
  using send_request = typename T::send_request;

  group_transport(std::shared_ptr<T> world, std::vector<int> members, std::uint32_t group_id)
      : w_(std::move(world)), members_(std::move(members)), tag_bits_(tag_t(group_id) << 48) {
    if (!w_) throw dist_error(errc::invalid_argument, "group_transport: null world transport");
    if (group_id > 0x7fff) throw dist_error(errc::invalid_argument, "group_transport: group id " + std::to_string(group_id) + " above 32767");
    const int me = int(w_->rank()), n = int(w_->size());
    for (std::size_t i = 0; i < members_.size(); ++i) {
      if (members_[i] < 0 || members_[i] >= n)
        throw dist_error(errc::out_of_range,
                         "group_transport: member " + std::to_string(members_[i]) + " outside the world's [0, " + std::to_string(n) + ")");
      for (std::size_t j = 0; j < i; ++j)
        if (members_[j] == members_[i])
          throw dist_error(errc::invalid_argument, "group_transport: rank " + std::to_string(members_[i]) + " listed twice");
      if (members_[i] == me) rank_ = int(i);
    }
    if (rank_ < 0) throw dist_error(errc::invalid_argument, "group_transport: world rank " + std::to_string(me) + " is not a member of its group");
  }

  int rank() const { return rank_; }
  int size() const { return int(members_.size()); }
  const std::vector<int>& members() const { return members_; }

  send_request isend(int peer, tag_t tag, std::span<const std::byte> src) { return w_->isend(world(peer), tag | tag_bits_, src); }
  void wait(send_request& r) { w_->wait(r); }
  void recv(int peer, tag_t tag, std::size_t bytes, recv_consumer fn) { w_->recv(world(peer), tag | tag_bits_, bytes, fn); }
  void recv_into(int peer, tag_t tag, std::span<std::byte> dst) { w_->recv_into(world(peer), tag | tag_bits_, dst); }
  send_request irecv_into(int peer, tag_t tag, std::span<std::byte> dst) requires requires(T& t) { t.irecv_into(peer, tag, dst); }
  { return w_->irecv_into(world(peer), tag | tag_bits_, dst); }
  void abort() { w_->abort(); }
  double now() const { return double(w_->now()); }
  void revoke(int failed) requires requires(T& t) { t.revoke(failed); }
  { w_->revoke(failed >= 0 && failed < size() ? world(failed) : failed); }
  void idle(bool on) requires requires(T& t) { t.idle(on); }
  { w_->idle(on); }
  bool timing_only() const {
    if constexpr (requires(const T& t) { t.timing_only(); })
      return w_->timing_only();
    else
      return false;
  }

 private:
  int world(int peer) const {
    if (peer < 0 || peer >= size())
      throw comm_error(errc::out_of_range,
                       "group_transport: peer " + std::to_string(peer) + " outside the group's [0, " + std::to_string(size()) + ")");
    return members_[std::size_t(peer)];
  }
  std::shared_ptr<T> w_;
  std::vector<int> members_;
  tag_t tag_bits_;
  int rank_ = -1;
};

// This rank's groups under a layout: world() (every rank), tp() (the ranks of its replica that
// share its dp coordinate, in tp order), dp() (the ranks that hold the same shard, in dp order)
// and pp() (the stages of its replica that share its tp coordinate, in stage order); with experts,
// ep() (its dp peers in its block of ep consecutive replicas, which split the experts) and edp()
// (the dp peers holding the same experts: one per block, dp / ep of them).
class process_groups {
 public:
  // Validates the layout against the transport's world first (a dist_error naming the numbers,
  // before any message is sent).
  template <transport T>
  process_groups(T t, parallel_layout l, comm_options o = {}) : layout_(l) {
    layout_.validate(int(t.size()));
    coords_ = layout_.coords(int(t.rank()));
    auto w = std::make_shared<T>(std::move(t));
    std::vector<int> all(std::size_t(layout_.world_size())), tp_members, dp_members, pp_members, ep_members, edp_members;
    for (std::size_t r = 0; r < all.size(); ++r) all[r] = int(r);
    for (int i = 0; i < layout_.tp; ++i) tp_members.push_back(layout_.rank_of({.dp = coords_.dp, .tp = i, .pp = coords_.pp}));
    for (int i = 0; i < layout_.dp; ++i) dp_members.push_back(layout_.rank_of({.dp = i, .tp = coords_.tp, .pp = coords_.pp}));
    for (int i = 0; i < layout_.pp; ++i) pp_members.push_back(layout_.rank_of({.dp = coords_.dp, .tp = coords_.tp, .pp = i}));
    const int block = coords_.dp / layout_.ep * layout_.ep;
    for (int i = 0; i < layout_.ep; ++i) ep_members.push_back(layout_.rank_of({.dp = block + i, .tp = coords_.tp, .pp = coords_.pp}));
    for (int i = coords_.dp % layout_.ep; i < layout_.dp; i += layout_.ep)
      edp_members.push_back(layout_.rank_of({.dp = i, .tp = coords_.tp, .pp = coords_.pp}));
    world_ = std::make_unique<communicator>(group_transport<T>(w, std::move(all), 0), o);
    tp_ = std::make_unique<communicator>(group_transport<T>(w, std::move(tp_members), 1), o);
    dp_ = std::make_unique<communicator>(group_transport<T>(w, std::move(dp_members), 2), o);
    pp_ = std::make_unique<communicator>(group_transport<T>(w, std::move(pp_members), 3), o);
    ep_ = std::make_unique<communicator>(group_transport<T>(w, std::move(ep_members), 4), o);
    edp_ = std::make_unique<communicator>(group_transport<T>(w, std::move(edp_members), 5), o);
  }

  const parallel_layout& layout() const { return layout_; }
  rank_coords coords() const { return coords_; }
  communicator& world() { return *world_; }
  communicator& tp() { return *tp_; }
  communicator& dp() { return *dp_; }
  communicator& pp() { return *pp_; }
  communicator& ep() { return *ep_; }
  communicator& edp() { return *edp_; }

 private:
  parallel_layout layout_;
  rank_coords coords_;
  std::unique_ptr<communicator> world_, tp_, dp_, pp_, ep_, edp_;
};

}  // namespace dist
}  // namespace v0
}  // namespace tessel
