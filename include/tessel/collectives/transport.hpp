// The transport concept: what collective algorithms need from a way of moving bytes between ranks.
// Algorithms are written once against it (through the type-erased transport_ref below); the models
// are threads (shared memory), emulated (the UBL128 fabric) and mpi (MPI point-to-point).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include <tessel/detail/type_name.hpp>

namespace tessel {
inline namespace v0 {

// Message tag. Tags only disambiguate: between one ordered pair of ranks, messages with the same
// tag are matched in the order they were posted (MPI's non-overtaking rule).
using tag_t = std::uint64_t;

// A non-owning callable reference (the consumer of received bytes): no allocation per message.
template <class Sig>
class function_ref;
template <class R, class... A>
class function_ref<R(A...)> {
 public:
  template <class F>
  requires(!std::same_as<std::remove_cvref_t<F>, function_ref> && std::is_invocable_r_v<R, F&, A...>) function_ref(F&& f)
  noexcept  // NOLINT: implicit by design, like std::function_ref
      : obj_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* o, A... a) -> R { return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<A>(a)...); }) {}
  R operator()(A... a) const { return call_(obj_, std::forward<A>(a)...); }

 private:
  void* obj_;
  R (*call_)(void*, A...);
};

// Called with consecutive pieces of a received message: (bytes, offset of the piece in the message).
// On the threads transport the piece is the sender's own memory (a one-sided read, no copy).
using recv_consumer = function_ref<void(std::span<const std::byte>, std::size_t)>;

// What a transport model provides. `isend` must not block (the data stays valid until `wait`);
// `recv` blocks until the whole message went through the consumer. Any wait may throw a
// comm_error (dead peer, abort, revoke, timeout).
template <class T>
concept transport = std::movable<typename T::send_request> && requires(T& t, const T& ct, int peer, tag_t tag, std::span<const std::byte> src,
                                                                       std::span<std::byte> dst, typename T::send_request& req, recv_consumer fn) {
  { ct.rank() } -> std::convertible_to<int>;
  { ct.size() } -> std::convertible_to<int>;
  { t.isend(peer, tag, src) } -> std::same_as<typename T::send_request>;
  t.wait(req);
  t.recv(peer, tag, dst.size(), fn);
  t.recv_into(peer, tag, dst);
  t.abort();
  { ct.now() } -> std::convertible_to<double>;  // seconds: wall clock, or simulated time
};

// Optional capabilities, detected with requires-expressions:
//   t.node_size()  ranks per super-node (enables the hierarchical algorithm),
//   t.shrink()     a transport over the surviving ranks (ULFM shrink),
//   t.revoke(int)  mark the world failed so every rank's waits end.
//   t.idle(bool)   the rank starts (true) or stops (false) waiting on the host (a file, a thread)
//                  and takes part in no transfer meanwhile: a simulated transport lets the other
//                  ranks' simulated time run on without it (communicator::host_wait()).
//   T::shared_address_space  true when every rank's buffers are readable and writable from every
//                  other rank (threads of one process): the direct algorithms then read the peers'
//                  buffers in place and write results straight into them. Such a transport
//                  must also guarantee that a send's wait returns only after the receiver's
//                  consumer has returned, and throws if that consumer threw: the in-place
//                  algorithms use a pending send to keep the peer's buffers alive.
//   T::counts_only  true when a null buffer of n bytes is timed as n bytes that carry no payload
//                  (a simulated transport: payload-free timing runs of real message schedules).

}  // namespace v0
namespace detail {

// Type-erased transport so that algorithms are compiled once, not once per transport model.
class transport_iface {
 public:
  struct request_base {
    virtual ~request_base() = default;
  };
  using request = std::unique_ptr<request_base>;
  virtual ~transport_iface() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual request isend(int peer, tag_t tag, std::span<const std::byte> src) = 0;
  virtual void wait(request& r) = 0;
  virtual void recv(int peer, tag_t tag, std::size_t bytes, recv_consumer fn) = 0;
  virtual void recv_into(int peer, tag_t tag, std::span<std::byte> dst) = 0;
  // A receive whose completion is awaited later with wait(). Transports with native posted
  // receives (emulated: all of an all_to_all's receives in flight at once, as on a real fabric)
  // start it now; the others receive at wait() time, which is what recv_into would have done.
  virtual request irecv_into(int peer, tag_t tag, std::span<std::byte> dst) = 0;
  virtual void abort() = 0;
  virtual double now() const = 0;
  virtual int node_size() const = 0;
  virtual void revoke(int failed) = 0;
  virtual void idle(bool on) = 0;
  virtual bool can_shrink() const = 0;
  virtual std::shared_ptr<transport_iface> shrink() = 0;
  virtual bool is_simulated() const = 0;
  virtual bool shared_address_space() const = 0;
  virtual bool timing_only() const = 0;
  virtual bool counts_only() const = 0;
  // The transport model's short name for reports ("threads", "emulated", "mpi").
  virtual const char* name() const { return "transport"; }
};

// A transport's name from its type ("tessel::v0::threads_transport" -> "threads"). Never freed:
// the profiler keeps the pointer and may write its trace during static destruction.
template <class T>
const char* transport_name() {
  static const std::string* const n = [] {
    std::string c = clean_type_name(raw_type_name<T>());
    if (c.size() > 10 && c.ends_with("_transport")) c.resize(c.size() - 10);
    return new std::string(std::move(c));
  }();
  return n->c_str();
}

template <transport T>
class transport_model final : public transport_iface {
  struct req final : request_base {
    typename T::send_request r;
    explicit req(typename T::send_request&& x) : r(std::move(x)) {}
  };
  static constexpr bool native_irecv = requires(T & t, int p, tag_t g, std::span<std::byte> d) {
    { t.irecv_into(p, g, d) } -> std::same_as<typename T::send_request>;
  };
  struct deferred_recv final : request_base {  // a receive run at wait() time
    int peer;
    tag_t tag;
    std::span<std::byte> dst;
    deferred_recv(int p, tag_t g, std::span<std::byte> d) : peer(p), tag(g), dst(d) {}
  };

 public:
  explicit transport_model(T t) : t_(std::move(t)) {}
  const char* name() const override { return transport_name<T>(); }
  int rank() const override { return static_cast<int>(t_.rank()); }
  int size() const override { return static_cast<int>(t_.size()); }
  request isend(int peer, tag_t tag, std::span<const std::byte> src) override { return std::make_unique<req>(t_.isend(peer, tag, src)); }
  void wait(request& r) override {
    if (!r) return;
    if (auto* d = dynamic_cast<deferred_recv*>(r.get())) {
      const deferred_recv x = *d;
      r.reset();  // done or failed, the receive is consumed
      t_.recv_into(x.peer, x.tag, x.dst);
      return;
    }
    t_.wait(static_cast<req&>(*r).r);
    r.reset();
  }
  request irecv_into(int peer, tag_t tag, std::span<std::byte> dst) override {
    if constexpr (native_irecv)
      return std::make_unique<req>(t_.irecv_into(peer, tag, dst));
    else
      return std::make_unique<deferred_recv>(peer, tag, dst);
  }
  void recv(int peer, tag_t tag, std::size_t bytes, recv_consumer fn) override { t_.recv(peer, tag, bytes, fn); }
  void recv_into(int peer, tag_t tag, std::span<std::byte> dst) override { t_.recv_into(peer, tag, dst); }
  void abort() override { t_.abort(); }
  double now() const override { return static_cast<double>(t_.now()); }
  int node_size() const override {
    if constexpr (requires { t_.node_size(); })
      return static_cast<int>(t_.node_size());
    else
      return 1;
  }
  void revoke(int failed) override {
    if constexpr (requires { t_.revoke(failed); }) t_.revoke(failed);
  }
  void idle(bool on) override {
    if constexpr (requires { t_.idle(on); }) t_.idle(on);
  }
  bool can_shrink() const override {
    return requires(T & x) { x.shrink(); };
  }
  std::shared_ptr<transport_iface> shrink() override {
    if constexpr (requires { t_.shrink(); })
      return std::make_shared<transport_model<T>>(t_.shrink());
    else
      return nullptr;
  }
  bool is_simulated() const override {
    if constexpr (requires { T::simulated; })
      return T::simulated;
    else
      return false;
  }
  bool shared_address_space() const override {
    if constexpr (requires { T::shared_address_space; })
      return T::shared_address_space;
    else
      return false;
  }
  bool timing_only() const override {
    if constexpr (requires { t_.timing_only(); })
      return t_.timing_only();
    else
      return false;
  }
  bool counts_only() const override {
    if constexpr (requires { T::counts_only; })
      return T::counts_only;
    else
      return false;
  }
  T& get() { return t_; }

 private:
  T t_;
};

}  // namespace detail
inline namespace v0 {}  // namespace v0
}  // namespace tessel
