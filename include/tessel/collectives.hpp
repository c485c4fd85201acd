// tessel/collectives.hpp: umbrella header of the collectives layer (see DESIGN.md): the transport
// concept and its models, the communicator and its algorithms, wire compression and MoE dispatch.
// The MPI transport (tessel/collectives/transport/mpi.hpp, link tessel::mpi) and the emulated one
// (tessel/collectives/transport/emulated.hpp, pulls in the emulator) are included separately.
#pragma once

#include <tessel/collectives/algorithm.hpp>
#include <tessel/collectives/communicator.hpp>
#include <tessel/collectives/compression.hpp>
#include <tessel/collectives/errors.hpp>
#include <tessel/collectives/moe.hpp>
#include <tessel/collectives/reduce_op.hpp>
#include <tessel/collectives/transport.hpp>
#include <tessel/collectives/transport/threads.hpp>
