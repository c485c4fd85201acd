// The MPI transport: ranks are MPI processes (mpirun), bytes move with MPI point-to-point so that
// tessel's algorithms (and its bitwise-deterministic reductions) run across machines. Link
// tessel::mpi. Without <mpi.h> this header is empty, so it still compiles on its own.
#pragma once

#if __has_include(<mpi.h>)
// the C API is all we use; OpenMPI's deprecated C++ bindings do not build warning-free
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <tessel/collectives/errors.hpp>
#include <tessel/collectives/transport.hpp>

namespace tessel {
inline namespace v0 {

class mpi_transport {
 public:
  // Messages travel in pieces of at most this many bytes (keeps MPI's int counts safe and lets
  // the receiver reduce piece by piece out of a small bounce buffer).
  static constexpr std::size_t piece_bytes = std::size_t{4} << 20;

  class send_request {
   public:
    send_request() = default;
    send_request(send_request&& o) noexcept : reqs_(std::move(o.reqs_)) { o.reqs_.clear(); }
    send_request& operator=(send_request&& o) noexcept {
      std::swap(reqs_, o.reqs_);
      return *this;
    }
    ~send_request() {
      // a dropped unfinished send (error unwinding): cancel what MPI has not matched yet
      for (auto& r : reqs_)
        if (r != MPI_REQUEST_NULL) {
          MPI_Cancel(&r);
          MPI_Request_free(&r);
        }
    }

   private:
    friend class mpi_transport;
    std::vector<MPI_Request> reqs_;
  };

  // Duplicates `comm` (two duplicates: collectives and user point-to-point never match each other).
  explicit mpi_transport(MPI_Comm comm = MPI_COMM_WORLD, std::chrono::milliseconds timeout = std::chrono::minutes(5))
      : st_(std::make_shared<shared>()) {
    int init = 0;
    MPI_Initialized(&init);
    if (!init) throw comm_error(errc::invalid_argument, "mpi_transport: MPI is not initialized (call MPI_Init first)");
    MPI_Comm_dup(comm, &st_->coll);
    MPI_Comm_dup(comm, &st_->p2p);
    MPI_Comm_rank(st_->coll, &st_->rank);
    MPI_Comm_size(st_->coll, &st_->size);
    int* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(st_->coll, MPI_TAG_UB, &ub, &flag);
    st_->tag_ub = flag && ub ? *ub : 32767;
    st_->timeout = timeout;
  }

  int rank() const { return st_->rank; }
  int size() const { return st_->size; }
  double now() const { return MPI_Wtime(); }
  void abort() { st_->aborted = true; }

  send_request isend(int peer, tag_t tag, std::span<const std::byte> src) {
    check_peer(peer);
    send_request r;
    const std::size_t pieces = std::max<std::size_t>(1, (src.size() + piece_bytes - 1) / piece_bytes);
    r.reqs_.resize(pieces, MPI_REQUEST_NULL);
    for (std::size_t k = 0; k < pieces; ++k) {
      const std::size_t off = k * piece_bytes, len = std::min(piece_bytes, src.size() - std::min(src.size(), off));
      MPI_Isend(len ? src.data() + off : nullptr, static_cast<int>(len), MPI_BYTE, peer, mpi_tag(tag), comm_of(tag), &r.reqs_[k]);
    }
    return r;
  }
  void wait(send_request& r) {
    wait_all(r.reqs_, -1);
    r.reqs_.clear();
  }

  void recv(int peer, tag_t tag, std::size_t bytes, recv_consumer fn) {
    check_peer(peer);
    const std::size_t pieces = std::max<std::size_t>(1, (bytes + piece_bytes - 1) / piece_bytes);
    std::vector<std::byte> bounce(std::min(bytes, piece_bytes));
    for (std::size_t k = 0; k < pieces; ++k) {
      const std::size_t off = k * piece_bytes, len = std::min(piece_bytes, bytes - std::min(bytes, off));
      std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
      MPI_Status stt;
      MPI_Irecv(bounce.data(), static_cast<int>(len), MPI_BYTE, peer, mpi_tag(tag), comm_of(tag), &req[0]);
      wait_all(req, peer, &stt);
      check_len(stt, len, peer);
      fn(std::span<const std::byte>(bounce.data(), len), off);
    }
  }
  void recv_into(int peer, tag_t tag, std::span<std::byte> dst) {
    check_peer(peer);
    const std::size_t pieces = std::max<std::size_t>(1, (dst.size() + piece_bytes - 1) / piece_bytes);
    std::vector<MPI_Request> reqs(pieces, MPI_REQUEST_NULL);
    for (std::size_t k = 0; k < pieces; ++k) {
      const std::size_t off = k * piece_bytes, len = std::min(piece_bytes, dst.size() - std::min(dst.size(), off));
      MPI_Irecv(len ? dst.data() + off : nullptr, static_cast<int>(len), MPI_BYTE, peer, mpi_tag(tag), comm_of(tag), &reqs[k]);
    }
    wait_all(reqs, peer);
  }

 private:
  struct shared {
    MPI_Comm coll = MPI_COMM_NULL, p2p = MPI_COMM_NULL;
    int rank = 0, size = 1, tag_ub = 32767;
    std::chrono::milliseconds timeout{};
    std::atomic<bool> aborted{false};
    ~shared() {
      int fin = 0;
      MPI_Finalized(&fin);
      if (!fin) {
        if (coll != MPI_COMM_NULL) MPI_Comm_free(&coll);
        if (p2p != MPI_COMM_NULL) MPI_Comm_free(&p2p);
      }
    }
  };

  static constexpr tag_t p2p_bit = tag_t{1} << 63;
  MPI_Comm comm_of(tag_t t) const { return (t & p2p_bit) ? st_->p2p : st_->coll; }
  // Tags only disambiguate (pairs match in posting order), so folding them into MPI's range is safe.
  int mpi_tag(tag_t t) const { return static_cast<int>((t & ~p2p_bit) % static_cast<tag_t>(st_->tag_ub)); }

  void check_peer(int peer) const {
    if (peer < 0 || peer >= st_->size)
      throw comm_error(errc::out_of_range, "mpi_transport: peer " + std::to_string(peer) + " outside [0, " + std::to_string(st_->size) + ")");
  }
  static void check_len(const MPI_Status& s, std::size_t want, int peer) {
    int got = 0;
    MPI_Get_count(&s, MPI_BYTE, &got);
    if (static_cast<std::size_t>(got) != want)
      throw comm_error(errc::invalid_argument, "mpi_transport: expected " + std::to_string(want) + " bytes from rank " + std::to_string(peer) +
                                                   ", got " + std::to_string(got));
  }
  // Polls so that abort() and the timeout can end the wait (a blocking MPI_Wait could not).
  void wait_all(std::vector<MPI_Request>& reqs, int peer, MPI_Status* one = nullptr) {
    const auto deadline = std::chrono::steady_clock::now() + st_->timeout;
    for (unsigned spins = 0;; ++spins) {
      int done = 0;
      if (one)
        MPI_Test(&reqs[0], &done, one);
      else
        MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
      if (done) return;
      if (st_->aborted) throw comm_aborted_error("mpi_transport: communicator aborted");
      if ((spins & 1023) == 0 && std::chrono::steady_clock::now() > deadline)
        throw comm_timeout_error(peer, "mpi_transport: rank " + std::to_string(st_->rank) + " timed out waiting on rank " + std::to_string(peer));
      if (spins > 64) std::this_thread::yield();  // oversubscribed runs: let the peer process work
    }
  }

  std::shared_ptr<shared> st_;
};

static_assert(transport<mpi_transport>);

}  // namespace v0
}  // namespace tessel
#endif
