// tessel::communicator: the user API of the collectives layer. It wraps any transport model and
// runs every collective (all_reduce, reduce, broadcast, all_gather, reduce_scatter, gather,
// scatter, all_to_all(v), send/recv, barrier) with a chosen or default algorithm, blocking or
// asynchronously (start -> request -> test/wait). Results are bitwise deterministic (see reduce_op.hpp).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <tessel/detail/checked.hpp>
#include <tessel/device/profiler.hpp>
#include <tessel/collectives/algorithm.hpp>
#include <tessel/collectives/detail/algorithms.hpp>
#include <tessel/collectives/errors.hpp>
#include <tessel/collectives/reduce_op.hpp>
#include <tessel/collectives/transport.hpp>
#include <tessel/types/dtype.hpp>

namespace tessel {
inline namespace v0 {

// Per-call choices.
struct call_options {
  algorithm algo = algorithm::automatic;
};

// Per-communicator tuning.
struct comm_options {
  std::size_t segment_bytes = std::size_t{512} << 10;  // pipelining unit of the ring and direct algorithms
  int node_size = 0;                                   // ranks per super-node; 0: ask the transport
  // Size thresholds (bytes per rank) of algorithm::automatic at n >= 4; unset: the transport's.
  // Real transports: the fewest-latency algorithm (a tree) up to 32 KiB, halving-doubling up to
  // 1 MiB, then direct. A modelled fabric charges no per-message cost and overlaps posted receives
  // completely, so there the fewest-latency algorithm is direct (one step) and direct wins at every
  // size (measured on 16 and 128 emulated cards): small 4 KiB (broadcast: direct up to it, then
  // halving-doubling) and no halving-doubling band.
  std::optional<std::size_t> small_bytes;
  std::optional<std::size_t> medium_bytes;
};

}  // namespace v0
namespace detail {
// The algorithm the running collective chose, for the profiler (set by communicator::pick).
inline thread_local const char* coll_algorithm = nullptr;

struct async_state {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr err;
};

// One background thread per communicator runs asynchronous collectives in submission order, so
// every rank issues them in the same order (the matching rule of every transport).
class comm_worker {
 public:
  comm_worker() : th_([this] { loop(); }) {}
  ~comm_worker() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    th_.join();
  }
  std::shared_ptr<async_state> submit(std::function<void()> job) {
    auto st = std::make_shared<async_state>();
    {
      std::lock_guard lk(mu_);
      q_.push_back({std::move(job), st});
    }
    cv_.notify_all();
    return st;
  }

 private:
  void loop() {
    for (;;) {
      std::pair<std::function<void()>, std::shared_ptr<async_state>> item;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;
        item = std::move(q_.front());
        q_.pop_front();
      }
      std::exception_ptr err;
      try {
        item.first();
      } catch (...) { err = std::current_exception(); }
      item.first = nullptr;
      {
        // The state takes the only reference to the error, and wait() takes it from the state,
        // so the exception is freed on the waiting thread. Freed here instead, it would be
        // released by libstdc++'s uninstrumented reference count after the waiter read it
        // (a TSan report, and no ordering a reader of the code can see).
        std::lock_guard lk(item.second->mu);
        item.second->done = true;
        item.second->err = std::move(err);
      }
      item.second->cv.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<async_state>>> q_;
  bool stop_ = false;
  std::thread th_;
};

inline std::size_t checked_bytes(std::size_t count, dtype d, const char* what) {
  const std::size_t es = dtype_size(d);
  if (count > std::numeric_limits<std::size_t>::max() / es) throw comm_error(errc::overflow, std::string(what) + ": count * element size overflows");
  return count * es;
}
inline void check_buffer(const void* p, std::size_t count, dtype d, const char* what, const char* which) {
  checked_bytes(count, d, what);
  if (count == 0 || (coll_dry_run && !p)) return;  // timing-only runs may pass no buffers
  if (!p) throw comm_error(errc::invalid_argument, std::string(what) + ": " + which + " buffer is null");
  if (reinterpret_cast<std::uintptr_t>(p) % dtype_size(d) != 0)
    throw comm_error(errc::invalid_argument, std::string(what) + ": " + which + " buffer is misaligned for " + std::string(dtype_name(d)));
}
}  // namespace detail
inline namespace v0 {

// Handle of an asynchronous collective. wait() rethrows the collective's error.
class request {
 public:
  request() = default;
  bool valid() const { return st_ != nullptr; }
  bool test() const {
    if (!st_) return true;
    std::lock_guard lk(st_->mu);
    return st_->done;
  }
  void wait() {
    if (!st_) return;
    std::unique_lock lk(st_->mu);
    st_->cv.wait(lk, [&] { return st_->done; });
    auto e = std::exchange(st_->err, nullptr);
    lk.unlock();
    st_.reset();
    if (e) std::rethrow_exception(e);
  }

 private:
  friend class communicator;
  explicit request(std::shared_ptr<detail::async_state> s) : st_(std::move(s)) {}
  std::shared_ptr<detail::async_state> st_;
};

class communicator {
 public:
  template <transport T>
  explicit communicator(T t, comm_options o = {})
      : communicator(std::static_pointer_cast<detail::transport_iface>(std::make_shared<detail::transport_model<T>>(std::move(t))), o) {}
  explicit communicator(std::shared_ptr<detail::transport_iface> tp, comm_options o = {}) : s_(std::make_unique<state>()) {
    if (!tp) throw comm_error(errc::invalid_argument, "communicator: null transport");
    if (o.segment_bytes < 64) throw comm_error(errc::invalid_argument, "communicator: segment_bytes must be >= 64");
    s_->tp = std::move(tp);
    s_->opt = o;
  }
  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  ~communicator() = default;

  int rank() const { return s_->tp->rank(); }
  int size() const { return s_->tp->size(); }
  double now() const { return s_->tp->now(); }
  detail::transport_iface& transport_handle() { return *s_->tp; }
  const comm_options& options() const { return s_->opt; }

  // Releases every waiter (on every rank that shares the transport's world) with comm_aborted_error.
  void abort() { s_->tp->abort(); }
  // While the returned guard lives, this rank waits on the host (a thread, a file another rank
  // writes) and posts no transfer: on a simulated transport the other ranks' time runs on without
  // it (otherwise a rank blocked on the host would hold back every card's simulated clock).
  class host_wait_guard {
   public:
    explicit host_wait_guard(detail::transport_iface& t) : t_(&t) { t_->idle(true); }
    host_wait_guard(const host_wait_guard&) = delete;
    host_wait_guard& operator=(const host_wait_guard&) = delete;
    ~host_wait_guard() { t_->idle(false); }

   private:
    detail::transport_iface* t_;
  };
  [[nodiscard]] host_wait_guard host_wait() { return host_wait_guard(*s_->tp); }
  // ULFM shrink: a communicator over the surviving ranks (throws if the transport cannot shrink).
  communicator shrink() {
    if (!s_->tp->can_shrink()) throw comm_error(errc::unsupported, "communicator: this transport cannot shrink");
    return communicator(s_->tp->shrink(), s_->opt);
  }

  // The algorithm the default selection picks for a collective of `bytes` per rank.
  algorithm default_algorithm(std::size_t bytes) const {
    const int n = size();
    if (n >= 4 && bytes <= small_limit()) return latency_algorithm();
    if (n >= 4 && bytes <= medium_limit()) return algorithm::halving_doubling;
    const int g = node_size();
    if (g > 1 && g < n && n % g == 0) return algorithm::hierarchical;
    return algorithm::direct;
  }

  // ------------------------------------------------------------------ untyped (dtype) API
  void all_reduce(const void* send, void* recv, std::size_t count, dtype d, reduce_op op, call_options o = {}) {
    sync(
        "all_reduce", [&] { return nbytes(count, d); }, [&] { do_all_reduce(send, recv, count, d, op, o); });
  }
  void reduce(const void* send, void* recv, std::size_t count, dtype d, reduce_op op, int root, call_options o = {}) {
    sync(
        "reduce", [&] { return nbytes(count, d); }, [&] { do_reduce(send, recv, count, d, op, root, o); });
  }
  void broadcast(const void* send, void* recv, std::size_t count, dtype d, int root, call_options o = {}) {
    sync(
        "broadcast", [&] { return nbytes(count, d); }, [&] { do_broadcast(send, recv, count, d, root, o); });
  }
  // recv holds size()*sendcount elements; in place when send == recv + rank*sendcount.
  void all_gather(const void* send, void* recv, std::size_t sendcount, dtype d, call_options o = {}) {
    sync(
        "all_gather", [&] { return nbytes(sendcount, d, size()); }, [&] { do_all_gather(send, recv, sendcount, d, o); });
  }
  // send holds size()*recvcount elements; in place when recv == send + rank*recvcount.
  void reduce_scatter(const void* send, void* recv, std::size_t recvcount, dtype d, reduce_op op, call_options o = {}) {
    sync(
        "reduce_scatter", [&] { return nbytes(recvcount, d, size()); }, [&] { do_reduce_scatter(send, recv, recvcount, d, op, o); });
  }
  void gather(const void* send, void* recv, std::size_t sendcount, dtype d, int root) {
    sync(
        "gather", [&] { return nbytes(sendcount, d, size()); }, [&] { do_gather(send, recv, sendcount, d, root); });
  }
  void scatter(const void* send, void* recv, std::size_t recvcount, dtype d, int root) {
    sync(
        "scatter", [&] { return nbytes(recvcount, d, size()); }, [&] { do_scatter(send, recv, recvcount, d, root); });
  }
  // Block q of send (count elements) goes to rank q; block q of recv comes from rank q. No aliasing.
  void all_to_all(const void* send, void* recv, std::size_t count, dtype d) {
    sync(
        "all_to_all", [&] { return nbytes(count, d, size()); },
        [&] { do_all_to_allv(send, uniform(count), uniform_displs(count), recv, uniform(count), uniform_displs(count), d); });
  }
  void all_to_allv(const void* send, std::span<const std::size_t> sendcounts, std::span<const std::size_t> sdispls, void* recv,
                   std::span<const std::size_t> recvcounts, std::span<const std::size_t> rdispls, dtype d) {
    sync(
        "all_to_allv", [&] { return nbytes(total(sendcounts), d); },
        [&] {
          do_all_to_allv(send, {sendcounts.begin(), sendcounts.end()}, {sdispls.begin(), sdispls.end()}, recv, {recvcounts.begin(), recvcounts.end()},
                         {rdispls.begin(), rdispls.end()}, d);
        });
  }
  // Timing-only all_to_allv: the same message schedule with these counts, but no payload exists
  // (nothing is read or written; displacements are irrelevant). Needs a transport that times byte
  // counts (counts_only: the emulated one); it is how MoE measures 128-card dispatches whose
  // payloads would not fit in host memory.
  void all_to_allv_timing(std::span<const std::size_t> sendcounts, std::span<const std::size_t> recvcounts, dtype d) {
    if (!s_->tp->counts_only())
      throw comm_error(errc::invalid_argument, "all_to_allv_timing: the transport cannot time payload-free messages (use the emulated one)");
    const std::vector<std::size_t> zero(sendcounts.size(), 0), zr(recvcounts.size(), 0);
    sync(
        "all_to_allv_timing", [&] { return nbytes(total(sendcounts), d); },
        [&] {
          do_all_to_allv(nullptr, {sendcounts.begin(), sendcounts.end()}, zero, nullptr, {recvcounts.begin(), recvcounts.end()}, zr, d);
        },
        true);
  }
  void send(const void* buf, std::size_t count, dtype d, int peer, int tag = 0) {
    sync(
        "send", [&] { return nbytes(count, d); }, [&] { do_send(buf, count, d, peer, tag); });
  }
  void recv(void* buf, std::size_t count, dtype d, int peer, int tag = 0) {
    sync(
        "recv", [&] { return nbytes(count, d); }, [&] { do_recv(buf, count, d, peer, tag); });
  }
  // A send to `dst` and a receive from `src` as one call (MPI_Sendrecv): the send is posted before
  // the receive waits, so ranks exchanging with each other (a pipeline's activations one way and
  // gradients the other) cannot deadlock on a transport whose sends complete only when received.
  // A peer of -1 leaves that half out; the tags match send()'s and recv()'s.
  void send_recv(const void* sbuf, std::size_t scount, int dst, int send_tag, void* rbuf, std::size_t rcount, int src, int recv_tag, dtype d) {
    sync(
        "send_recv", [&] { return nbytes((dst >= 0 ? scount : 0) + (src >= 0 ? rcount : 0), d); },
        [&] { do_send_recv(sbuf, scount, dst, send_tag, rbuf, rcount, src, recv_tag, d); });
  }
  void barrier() {
    sync(
        "barrier", [] { return 0.0; }, [&] { do_barrier(); });
  }

  // ------------------------------------------------------------------ typed API
  template <dtype_element T>
  void all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op, call_options o = {}) {
    same_size(send.size(), recv.size(), "all_reduce");
    all_reduce(send.data(), recv.data(), send.size(), dtype_of<T>, op, o);
  }
  template <dtype_element T>
  void all_reduce(std::span<T> buf, reduce_op op, call_options o = {}) {
    all_reduce(buf.data(), buf.data(), buf.size(), dtype_of<T>, op, o);
  }
  template <dtype_element T>
  void broadcast(std::span<T> buf, int root, call_options o = {}) {
    broadcast(buf.data(), buf.data(), buf.size(), dtype_of<T>, root, o);
  }
  template <dtype_element T>
  void send_recv(std::span<const T> s, int dst, int send_tag, std::span<T> r, int src, int recv_tag) {
    send_recv(s.data(), s.size(), dst, send_tag, r.data(), r.size(), src, recv_tag, dtype_of<T>);
  }
  template <dtype_element T>
  void all_gather(std::span<const T> send, std::span<T> recv, call_options o = {}) {
    if (recv.size() != detail::mul_checked(send.size(), static_cast<std::size_t>(size()), "all_gather"))
      throw comm_error(errc::invalid_argument, "all_gather: recv must hold size() * send.size() elements");
    all_gather(send.data(), recv.data(), send.size(), dtype_of<T>, o);
  }
  template <dtype_element T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op, call_options o = {}) {
    if (send.size() != detail::mul_checked(recv.size(), static_cast<std::size_t>(size()), "reduce_scatter"))
      throw comm_error(errc::invalid_argument, "reduce_scatter: send must hold size() * recv.size() elements");
    reduce_scatter(send.data(), recv.data(), recv.size(), dtype_of<T>, op, o);
  }

  // ------------------------------------------------------------------ asynchronous forms
  // Buffers must stay alive and untouched until the request completes.
  request all_reduce_async(const void* send, void* recv, std::size_t count, dtype d, reduce_op op, call_options o = {}) {
    return submit("all_reduce", nbytes_async(count, d), [=, this] { do_all_reduce(send, recv, count, d, op, o); });
  }
  request broadcast_async(const void* send, void* recv, std::size_t count, dtype d, int root, call_options o = {}) {
    return submit("broadcast", nbytes_async(count, d), [=, this] { do_broadcast(send, recv, count, d, root, o); });
  }
  request all_gather_async(const void* send, void* recv, std::size_t sendcount, dtype d, call_options o = {}) {
    return submit("all_gather", nbytes_async(sendcount, d, size()), [=, this] { do_all_gather(send, recv, sendcount, d, o); });
  }
  request reduce_scatter_async(const void* send, void* recv, std::size_t recvcount, dtype d, reduce_op op, call_options o = {}) {
    return submit("reduce_scatter", nbytes_async(recvcount, d, size()), [=, this] { do_reduce_scatter(send, recv, recvcount, d, op, o); });
  }
  request all_to_all_async(const void* send, void* recv, std::size_t count, dtype d) {
    return submit("all_to_all", nbytes_async(count, d, size()),
                  [=, this] { do_all_to_allv(send, uniform(count), uniform_displs(count), recv, uniform(count), uniform_displs(count), d); });
  }
  // Extension point for layers built on the communicator (compression, MoE): runs f(ctx) as one
  // collective (its own tag space, in order with every other call). All ranks must call it together.
  // `name` and `bytes` (the message size, nccl-tests' convention) are what the profiler records.
  template <class F>
  void run_collective(F&& f, const char* name = "collective", double bytes = 0) {
    sync(
        name, [bytes] { return bytes; },
        [&] {
          auto c = ctx();
          f(c);
        });
  }

  // Any sequence of blocking calls on this communicator, run in the background in order.
  request start(std::function<void()> job) {
    if (!s_->worker) s_->worker = std::make_unique<detail::comm_worker>();
    const bool dry = s_->tp->timing_only();
    return request(s_->worker->submit([dry, job = std::move(job)] {
      dry_guard g(dry);
      job();
    }));
  }

 private:
  struct state {
    std::shared_ptr<detail::transport_iface> tp;
    comm_options opt;
    std::uint64_t seq = 0;
    std::unique_ptr<detail::comm_worker> worker;  // declared last: joined first
  };

  static constexpr tag_t p2p_space = tag_t{1} << 63;

  // Runs collective `op` (whose size `bytes()` gives, asked only after it succeeded and only when
  // profiling) on this thread, or in order behind the queued asynchronous ones.
  template <class Bytes, class F>
  void sync(const char* op, Bytes&& bytes, F&& f, bool force_dry = false) {
    const bool dry = force_dry || s_->tp->timing_only();
    auto body = [&] {
      dry_guard g(dry);
      if (profiler::detail::level.load(std::memory_order_relaxed) != 0) [[unlikely]]
        return profiled(op, bytes, f);
      f();
    };
    if (s_->worker) {  // keep the order with asynchronous calls already queued
      auto st = s_->worker->submit(std::function<void()>(std::ref(body)));
      request(st).wait();
    } else {
      body();
    }
  }
  // An asynchronous collective: profiled like a blocking one, on the worker thread that runs it.
  template <class F>
  request submit(const char* op, double bytes, F&& f) {
    return start([this, op, bytes, f = std::forward<F>(f)] {
      if (profiler::detail::level.load(std::memory_order_relaxed) != 0) [[unlikely]]
        return profiled(
            op, [bytes] { return bytes; }, f);
      f();
    });
  }
  // Runs f() and records it as collective `op` when the profiler is recording.
  template <class Bytes, class F>
  [[gnu::noinline]] void profiled(const char* op, Bytes&& bytes, F&& f) {
    if (!profiler::detail::recording()) return f();
    detail::coll_algorithm = nullptr;
    const double tp0 = s_->tp->now();
    const auto t0 = profiler::detail::clock::now();
    f();
    const auto t1 = profiler::detail::clock::now();
    profiler::collective_record r;
    r.op = op;
    r.transport = s_->tp->name();
    r.algorithm = detail::coll_algorithm ? detail::coll_algorithm : (size() == 1 ? "local" : "-");
    r.bytes = bytes();
    r.rank = rank();
    r.ranks = size();
    r.transport_seconds = s_->tp->now() - tp0;
    r.thread = profiler::detail::thread_index();
    profiler::detail::record_collective(r, t0, t1);
  }
  static double nbytes(std::size_t count, dtype d, int times = 1) {
    return static_cast<double>(count) * static_cast<double>(dtype_size(d)) * static_cast<double>(times);
  }
  // The size of an asynchronous call, computed before it is queued (0 for an invalid dtype,
  // which the call itself then reports).
  static double nbytes_async(std::size_t count, dtype d, int times = 1) {
    if (profiler::detail::level.load(std::memory_order_relaxed) == 0) return 0;
    try {
      return nbytes(count, d, times);
    } catch (const error&) { return 0; }
  }
  static std::size_t total(std::span<const std::size_t> counts) {
    std::size_t t = 0;
    for (std::size_t c : counts) t += c;
    return t;
  }
  // Notes the algorithm a collective runs, for the profiler.
  static algorithm noted(algorithm a) {
    detail::coll_algorithm = algorithm_name(a).data();
    return a;
  }
  static void note(const char* a) { detail::coll_algorithm = a; }

  // Runs a collective body with the timing-only flag of this transport set on this thread.
  struct dry_guard {
    bool old;
    explicit dry_guard(bool on) : old(detail::coll_dry_run) { detail::coll_dry_run = on; }
    ~dry_guard() { detail::coll_dry_run = old; }
  };

  int node_size() const { return s_->opt.node_size > 0 ? s_->opt.node_size : s_->tp->node_size(); }

  detail::coll_ctx ctx() {
    detail::coll_ctx c{*s_->tp, rank(), size(), (++s_->seq) << 8, s_->opt.segment_bytes, node_size(), {}, {}};
    return c;
  }
  // The automatic choice's pieces (see comm_options).
  bool modelled() const { return s_->tp->is_simulated(); }
  algorithm latency_algorithm() const { return modelled() ? algorithm::direct : algorithm::tree; }
  std::size_t small_limit() const { return s_->opt.small_bytes.value_or(modelled() ? std::size_t{4} << 10 : std::size_t{32} << 10); }
  std::size_t medium_limit() const { return std::max(small_limit(), s_->opt.medium_bytes.value_or(modelled() ? 0 : std::size_t{1} << 20)); }
  algorithm pick(algorithm a, std::size_t bytes) const { return noted(a == algorithm::automatic ? default_algorithm(bytes) : a); }

  std::vector<std::size_t> uniform(std::size_t count) const { return std::vector<std::size_t>(static_cast<std::size_t>(size()), count); }
  std::vector<std::size_t> uniform_displs(std::size_t count) const {
    std::vector<std::size_t> v(static_cast<std::size_t>(size()));
    for (std::size_t q = 0; q < v.size(); ++q) v[q] = detail::mul_checked(q, count, "all_to_all");
    return v;
  }
  static void same_size(std::size_t a, std::size_t b, const char* what) {
    if (a != b) throw comm_error(errc::invalid_argument, std::string(what) + ": send and recv sizes differ");
  }
  void check_root(int root, const char* what) const {
    if (root < 0 || root >= size())
      throw comm_error(errc::out_of_range, std::string(what) + ": root " + std::to_string(root) + " outside [0, " + std::to_string(size()) + ")");
  }
  static void check_reducible(dtype d, reduce_op op, const char* what) {
    (void)dtype_size(d);  // rejects an invalid enum value
    (void)reduce_op_name(op);
    if (!reducible(d)) throw comm_error(errc::invalid_argument, std::string(what) + ": dtype " + std::string(dtype_name(d)) + " cannot be reduced");
  }
  // In-place means exactly equal (or the NCCL offset); any other overlap is an error.
  // A timing-only run may pass null buffers (nothing is read or written); the algorithms still
  // compute addresses in them, so a null buffer gets an inaccessible stand-in of its size.
  template <class P>
  static P* stand_in(P* p, std::size_t bytes, detail::dry_region& keep) {
    if (p || !detail::coll_dry_run || bytes == 0) return p;
    keep = detail::dry_region(bytes);
    return static_cast<P*>(static_cast<void*>(keep.data()));
  }
  static void check_alias(const void* a, std::size_t an, const void* b, std::size_t bn, bool allowed, const char* what) {
    if (!allowed && detail::overlaps(a, an, b, bn))
      throw comm_error(errc::invalid_argument, std::string(what) + ": send and recv overlap but are not in place");
  }

  void do_all_reduce(const void* send, void* recv, std::size_t count, dtype d, reduce_op op, call_options o) {
    check_reducible(d, op, "all_reduce");
    detail::check_buffer(send, count, d, "all_reduce", "send");
    detail::check_buffer(recv, count, d, "all_reduce", "recv");
    detail::dry_region dry_s, dry_r;
    send = stand_in(send, detail::checked_bytes(count, d, "all_reduce"), dry_s);
    recv = stand_in(recv, detail::checked_bytes(count, d, "all_reduce"), dry_r);
    const std::size_t bytes = count * dtype_size(d);
    check_alias(send, bytes, recv, bytes, send == recv, "all_reduce");
    auto c = ctx();
    if (count == 0) return;
    auto* sb = static_cast<const std::byte*>(send);
    auto* rb = static_cast<std::byte*>(recv);
    if (c.n == 1) return local_reduce(sb, rb, count, d, op);
    switch (pick(o.algo, bytes)) {
      case algorithm::ring: return detail::ar_ring(c, sb, rb, count, d, op);
      case algorithm::halving_doubling: return detail::ar_hd(c, sb, rb, count, d, op);
      case algorithm::tree: return detail::ar_tree(c, sb, rb, count, d, op);
      case algorithm::hierarchical:
        if (c.node_size > 1 && c.node_size < c.n && c.n % c.node_size == 0) return detail::ar_hier(c, sb, rb, count, d, op);
        noted(algorithm::direct);
        [[fallthrough]];  // no super-nodes: one flat level
      default: return detail::ar_direct(c, sb, rb, count, d, op);
    }
  }

  static void local_reduce(const std::byte* sb, std::byte* rb, std::size_t count, dtype d, reduce_op op) {
    note("local");
    detail::scratch acc(count * dtype_size(accumulator_dtype(d)));
    detail::to_acc_kernel(d, sb, acc.data(), count);
    detail::finalize_kernel(op, d, 1, acc.data(), rb, count);
  }

  void rs_dispatch(detail::coll_ctx& c, algorithm a, const std::byte* sb, std::byte* out, dtype d, reduce_op op,
                   const std::vector<std::size_t>& off) {
    switch (a) {
      case algorithm::ring: return detail::rs_ring(c, sb, out, d, op, off);
      case algorithm::halving_doubling: return detail::rs_hd(c, sb, out, d, op, off);
      case algorithm::tree: return detail::rs_tree(c, sb, out, d, op, off);
      default: return detail::rs_direct(c, sb, out, d, op, off);
    }
  }

  void do_reduce_scatter(const void* send, void* recv, std::size_t recvcount, dtype d, reduce_op op, call_options o) {
    check_reducible(d, op, "reduce_scatter");
    const std::size_t total = detail::mul_checked(recvcount, static_cast<std::size_t>(size()), "reduce_scatter");
    detail::check_buffer(send, total, d, "reduce_scatter", "send");
    detail::check_buffer(recv, recvcount, d, "reduce_scatter", "recv");
    detail::dry_region dry_s, dry_r;
    send = stand_in(send, detail::checked_bytes(total, d, "reduce_scatter"), dry_s);
    recv = stand_in(recv, detail::checked_bytes(recvcount, d, "reduce_scatter"), dry_r);
    const std::size_t es = dtype_size(d);
    auto* sb = static_cast<const std::byte*>(send);
    auto* rb = static_cast<std::byte*>(recv);
    const bool inplace = recvcount && rb == sb + static_cast<std::size_t>(rank()) * recvcount * es;
    check_alias(send, total * es, recv, recvcount * es, inplace, "reduce_scatter");
    auto c = ctx();
    if (recvcount == 0) return;
    if (c.n == 1) return local_reduce(sb, rb, recvcount, d, op);
    rs_dispatch(c, pick(o.algo, total * es), sb, rb, d, op, detail::equal_blocks(recvcount, c.n));
  }

  void do_reduce(const void* send, void* recv, std::size_t count, dtype d, reduce_op op, int root, call_options o) {
    check_reducible(d, op, "reduce");
    check_root(root, "reduce");
    detail::check_buffer(send, count, d, "reduce", "send");
    detail::dry_region dry_s, dry_r;
    send = stand_in(send, detail::checked_bytes(count, d, "reduce"), dry_s);
    recv = stand_in(recv, detail::checked_bytes(count, d, "reduce"), dry_r);
    const std::size_t bytes = count * dtype_size(d), es = dtype_size(d);
    if (rank() == root) {
      detail::check_buffer(recv, count, d, "reduce", "recv");
      check_alias(send, bytes, recv, bytes, send == recv, "reduce");
    }
    auto c = ctx();
    if (count == 0) return;
    auto* sb = static_cast<const std::byte*>(send);
    auto* rb = static_cast<std::byte*>(recv);
    if (c.n == 1) return local_reduce(sb, rb, count, d, op);
    const algorithm a = pick(o.algo, bytes);
    if (a == algorithm::tree) {
      detail::scratch g = detail::tree_gather(c, sb, bytes, root, c.tag + 20);
      if (c.rank == root) detail::fold_gathered(c, g, count, d, op, root, rb);
      return;
    }
    const auto off = detail::even_blocks(count, c.n);
    const std::size_t m = off[c.rank + 1] - off[c.rank];
    detail::scratch blk(m * es);
    rs_dispatch(c, a, sb, blk.data(), d, op, off);
    const tag_t tg = c.tag + 21;
    if (c.rank == root) {
      for (int q = 0; q < c.n; ++q)
        if (q != root) c.post_recv(q, tg, rb + off[q] * es, (off[q + 1] - off[q]) * es);
      c.wait_recvs();
      detail::copy_bytes(rb + off[c.rank] * es, blk.data(), m * es);
    } else {
      c.send(root, tg, blk.data(), m * es);
      c.wait_all();
    }
  }

  void do_broadcast(const void* send, void* recv, std::size_t count, dtype d, int root, call_options o) {
    check_root(root, "broadcast");
    const std::size_t bytes = detail::checked_bytes(count, d, "broadcast"), es = dtype_size(d);
    if (rank() == root) detail::check_buffer(send, count, d, "broadcast", "send");
    detail::check_buffer(recv, count, d, "broadcast", "recv");
    detail::dry_region dry_s, dry_r;
    send = stand_in(send, bytes, dry_s);
    recv = stand_in(recv, bytes, dry_r);
    if (rank() == root) check_alias(send, bytes, recv, bytes, send == recv, "broadcast");
    auto c = ctx();
    if (count == 0) return;
    auto* rb = static_cast<std::byte*>(recv);
    if (c.rank == root) detail::copy_bytes(rb, send, bytes);
    if (c.n == 1) return;
    const tag_t tg = c.tag + 22;
    algorithm a = o.algo;
    if (a == algorithm::automatic) a = (c.n >= 4 && bytes <= small_limit()) ? latency_algorithm() : algorithm::halving_doubling;
    switch (noted(a)) {
      case algorithm::tree: return detail::tree_bcast(c, rb, bytes, root, tg);
      case algorithm::ring: {
        const int v = (c.rank - root + c.n) % c.n;
        const std::size_t seg = std::max<std::size_t>(1, c.segment_bytes / es);
        for (std::size_t lo = 0; lo < count; lo += seg) {
          const std::size_t len = std::min(seg, count - lo) * es;
          if (v > 0) c.tp.recv_into((c.rank - 1 + c.n) % c.n, tg, {rb + lo * es, len});
          if (v < c.n - 1) c.send((c.rank + 1) % c.n, tg, rb + lo * es, len);
        }
        return c.wait_all();
      }
      case algorithm::halving_doubling: {  // scatter from the root, then all-gather (van de Geijn)
        const auto off = detail::even_blocks(count, c.n);
        if (c.rank == root) {
          for (int q = 0; q < c.n; ++q)
            if (q != root) c.send(q, tg, rb + off[q] * es, (off[q + 1] - off[q]) * es);
          c.wait_all();
        } else {
          c.tp.recv_into(root, tg, {rb + off[c.rank] * es, (off[c.rank + 1] - off[c.rank]) * es});
        }
        return detail::ag_direct(c, rb, d, off, tg + 1);
      }
      default: {
        if (c.rank == root) {
          for (int q = 0; q < c.n; ++q)
            if (q != root) c.send(q, tg, rb, bytes);
          c.wait_all();
        } else {
          c.tp.recv_into(root, tg, {rb, bytes});
        }
      }
    }
  }

  void do_all_gather(const void* send, void* recv, std::size_t sendcount, dtype d, call_options o) {
    const std::size_t total = detail::mul_checked(sendcount, static_cast<std::size_t>(size()), "all_gather");
    detail::check_buffer(send, sendcount, d, "all_gather", "send");
    detail::check_buffer(recv, total, d, "all_gather", "recv");
    detail::dry_region dry_s, dry_r;
    send = stand_in(send, detail::checked_bytes(sendcount, d, "all_gather"), dry_s);
    recv = stand_in(recv, detail::checked_bytes(total, d, "all_gather"), dry_r);
    const std::size_t es = dtype_size(d);
    auto* rb = static_cast<std::byte*>(recv);
    std::byte* mine = rb + static_cast<std::size_t>(rank()) * sendcount * es;
    const bool inplace = sendcount && send == mine;
    check_alias(send, sendcount * es, recv, total * es, inplace, "all_gather");
    auto c = ctx();
    if (sendcount == 0) return;
    if (!inplace) detail::copy_bytes(mine, send, sendcount * es);
    if (c.n == 1) return;
    const auto off = detail::equal_blocks(sendcount, c.n);
    const tag_t tg = c.tag + 23;
    switch (pick(o.algo, total * es)) {
      case algorithm::ring: return detail::ag_ring(c, rb, d, off, tg);
      case algorithm::halving_doubling:
        if ((c.n & (c.n - 1)) == 0) return detail::ag_doubling(c, rb, d, off, tg);
        noted(algorithm::direct);
        return detail::ag_direct(c, rb, d, off, tg);
      case algorithm::tree: {
        detail::scratch g = detail::tree_gather(c, mine, sendcount * es, 0, tg);
        if (c.rank == 0) detail::copy_bytes(rb, g.data(), total * es);
        return detail::tree_bcast(c, rb, total * es, 0, tg + 1);
      }
      default: return detail::ag_direct(c, rb, d, off, tg);
    }
  }

  void do_gather(const void* send, void* recv, std::size_t sendcount, dtype d, int root) {
    check_root(root, "gather");
    const std::size_t total = detail::mul_checked(sendcount, static_cast<std::size_t>(size()), "gather");
    detail::check_buffer(send, sendcount, d, "gather", "send");
    detail::dry_region dry_s, dry_r;
    send = stand_in(send, detail::checked_bytes(sendcount, d, "gather"), dry_s);
    recv = stand_in(recv, detail::checked_bytes(total, d, "gather"), dry_r);
    const std::size_t es = dtype_size(d);
    auto* rb = static_cast<std::byte*>(recv);
    bool inplace = false;
    if (rank() == root) {
      detail::check_buffer(recv, total, d, "gather", "recv");
      inplace = sendcount && send == rb + static_cast<std::size_t>(root) * sendcount * es;
      check_alias(send, sendcount * es, recv, total * es, inplace, "gather");
    }
    auto c = ctx();
    if (sendcount == 0) return;
    note("direct");
    const tag_t tg = c.tag + 24;
    if (c.rank == root) {
      if (!inplace) detail::copy_bytes(rb + static_cast<std::size_t>(root) * sendcount * es, send, sendcount * es);
      for (int q = 0; q < c.n; ++q)
        if (q != root) c.post_recv(q, tg, rb + static_cast<std::size_t>(q) * sendcount * es, sendcount * es);
      c.wait_recvs();
    } else {
      c.send(root, tg, static_cast<const std::byte*>(send), sendcount * es);
      c.wait_all();
    }
  }

  void do_scatter(const void* send, void* recv, std::size_t recvcount, dtype d, int root) {
    check_root(root, "scatter");
    const std::size_t total = detail::mul_checked(recvcount, static_cast<std::size_t>(size()), "scatter");
    detail::check_buffer(recv, recvcount, d, "scatter", "recv");
    detail::dry_region dry_s, dry_r;
    send = stand_in(send, detail::checked_bytes(total, d, "scatter"), dry_s);
    recv = stand_in(recv, detail::checked_bytes(recvcount, d, "scatter"), dry_r);
    const std::size_t es = dtype_size(d);
    auto* sb = static_cast<const std::byte*>(send);
    bool inplace = false;
    if (rank() == root) {
      detail::check_buffer(send, total, d, "scatter", "send");
      inplace = recvcount && recv == sb + static_cast<std::size_t>(root) * recvcount * es;
      check_alias(send, total * es, recv, recvcount * es, inplace, "scatter");
    }
    auto c = ctx();
    if (recvcount == 0) return;
    note("direct");
    const tag_t tg = c.tag + 25;
    if (c.rank == root) {
      for (int q = 0; q < c.n; ++q)
        if (q != root) c.send(q, tg, sb + static_cast<std::size_t>(q) * recvcount * es, recvcount * es);
      if (!inplace) detail::copy_bytes(recv, sb + static_cast<std::size_t>(root) * recvcount * es, recvcount * es);
      c.wait_all();
    } else {
      c.tp.recv_into(root, tg, {static_cast<std::byte*>(recv), recvcount * es});
    }
  }

  void do_all_to_allv(const void* send, std::vector<std::size_t> sc, std::vector<std::size_t> sd, void* recv, std::vector<std::size_t> rc,
                      std::vector<std::size_t> rd, dtype d) {
    const auto n = static_cast<std::size_t>(size());
    if (sc.size() != n || sd.size() != n || rc.size() != n || rd.size() != n)
      throw comm_error(errc::invalid_argument, "all_to_allv: counts and displacements must have size() entries");
    const std::size_t es = dtype_size(d);
    std::size_t send_extent = 0, recv_extent = 0;
    for (std::size_t q = 0; q < n; ++q) {
      if (sc[q] && sd[q] > std::numeric_limits<std::size_t>::max() - sc[q])
        throw comm_error(errc::overflow, "all_to_allv: send displacement overflows");
      if (rc[q] && rd[q] > std::numeric_limits<std::size_t>::max() - rc[q])
        throw comm_error(errc::overflow, "all_to_allv: recv displacement overflows");
      if (sc[q]) send_extent = std::max(send_extent, sd[q] + sc[q]);
      if (rc[q]) recv_extent = std::max(recv_extent, rd[q] + rc[q]);
    }
    detail::check_buffer(send, send_extent, d, "all_to_allv", "send");
    detail::check_buffer(recv, recv_extent, d, "all_to_allv", "recv");
    check_alias(send, send_extent * es, recv, recv_extent * es, false, "all_to_allv");
    auto c = ctx();
    const int r = c.rank;
    if (sc[r] != rc[r]) throw comm_error(errc::invalid_argument, "all_to_allv: this rank's send and recv counts to itself differ");
    auto* sb = static_cast<const std::byte*>(send);
    auto* rb = static_cast<std::byte*>(recv);
    const tag_t tg = c.tag + 26;
    note("direct");
    // (timing-only runs pass null buffers: no pointer arithmetic on them)
    for (int q = 0; q < c.n; ++q)
      if (q != r) c.send(q, tg, sc[q] && sb ? sb + sd[q] * es : nullptr, sc[q] * es);
    // every receive posted before any is awaited (a fabric then serves all senders at once)
    for (int k = 1; k < c.n; ++k) {  // start with the next rank so that senders are served evenly
      const int q = (r + c.n - k) % c.n;
      c.post_recv(q, tg, rc[q] && rb ? rb + rd[q] * es : nullptr, rc[q] * es);
    }
    if (sb && rb) detail::copy_bytes(rb + rd[r] * es, sb + sd[r] * es, sc[r] * es);
    c.wait_recvs();
    c.wait_all();
  }

  void do_send(const void* buf, std::size_t count, dtype d, int peer, int tag) {
    detail::check_buffer(buf, count, d, "send", "send");
    check_peer(peer, "send");
    note("p2p");
    auto req = s_->tp->isend(peer, p2p_space | static_cast<std::uint32_t>(tag), {static_cast<const std::byte*>(buf), count * dtype_size(d)});
    s_->tp->wait(req);
  }
  void do_send_recv(const void* sbuf, std::size_t scount, int dst, int send_tag, void* rbuf, std::size_t rcount, int src, int recv_tag, dtype d) {
    if (dst >= 0) {
      detail::check_buffer(sbuf, scount, d, "send_recv", "send");
      check_peer(dst, "send_recv");
    }
    if (src >= 0) {
      detail::check_buffer(rbuf, rcount, d, "send_recv", "recv");
      check_peer(src, "send_recv");
    }
    note("p2p");
    auto receive = [&] {
      if (src >= 0) s_->tp->recv_into(src, p2p_space | static_cast<std::uint32_t>(recv_tag), {static_cast<std::byte*>(rbuf), rcount * dtype_size(d)});
    };
    if (dst < 0) return receive();
    auto req = s_->tp->isend(dst, p2p_space | static_cast<std::uint32_t>(send_tag), {static_cast<const std::byte*>(sbuf), scount * dtype_size(d)});
    receive();
    s_->tp->wait(req);
  }
  void do_recv(void* buf, std::size_t count, dtype d, int peer, int tag) {
    detail::check_buffer(buf, count, d, "recv", "recv");
    check_peer(peer, "recv");
    note("p2p");
    s_->tp->recv_into(peer, p2p_space | static_cast<std::uint32_t>(tag), {static_cast<std::byte*>(buf), count * dtype_size(d)});
  }
  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size() || peer == rank())
      throw comm_error(errc::out_of_range,
                       std::string(what) + ": peer " + std::to_string(peer) + " is not another rank of [0, " + std::to_string(size()) + ")");
  }

  void do_barrier() {
    auto c = ctx();
    note("dissemination");
    // dissemination: after round k every rank has heard (indirectly) from 2^(k+1) ranks
    for (int dist = 1; dist < c.n; dist *= 2) {
      c.send((c.rank + dist) % c.n, c.tag + 27, nullptr, 0);
      c.tp.recv_into((c.rank - dist + c.n) % c.n, c.tag + 27, {});
      c.wait_all();
    }
  }

  std::unique_ptr<state> s_;
};

}  // namespace v0
}  // namespace tessel
