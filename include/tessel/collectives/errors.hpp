// Typed errors of the collectives layer. All derive from comm_error (a tessel::error, area
// "comm"): argument errors carry errc::invalid_argument / out_of_range / overflow, faults the
// subclasses below (an aborted or revoked communicator, a timeout, a dead peer, a stopped rank).
#pragma once

#include <string>

#include <tessel/error.hpp>

namespace tessel {
inline namespace v0 {

// Base of every collectives error; code() says which kind.
struct comm_error : error_of<comm_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "comm";
};

// abort() was called on the communicator (from any thread, on any rank of a shared world).
struct comm_aborted_error : comm_error {
  explicit comm_aborted_error(const std::string& what) : comm_error(errc::aborted, what) {}
};

// A wait on `peer` passed the configured timeout (the peer may be hung rather than dead).
struct comm_timeout_error : comm_error {
  int peer;
  comm_timeout_error(int p, const std::string& what) : comm_error(errc::timeout, what), peer(p) {}
};

// `peer` is known to be dead (a stopped thread rank, a failed emulated card).
struct peer_failed_error : comm_error {
  int peer;
  peer_failed_error(int p, const std::string& what) : comm_error(errc::fault, what), peer(p) {}
};

// Another rank saw a failure and revoked the communicator (ULFM's MPI_Comm_revoke): every
// pending and later operation fails with this until the survivors build a new one with shrink().
struct comm_revoked_error : comm_error {
  int failed_rank;  // the rank whose failure caused the revoke, -1 if unknown
  comm_revoked_error(int f, const std::string& what) : comm_error(errc::aborted, what), failed_rank(f) {}
};

// Thrown on the rank that a fault injection stopped: that thread should just unwind.
struct rank_stopped_error : comm_error {
  int rank;
  rank_stopped_error(int r, const std::string& what) : comm_error(errc::aborted, what), rank(r) {}
};

}  // namespace v0
}  // namespace tessel
