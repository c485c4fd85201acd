// Catch2 main for the MPI tests (run as `mpirun -np 4 test_mpi`): MPI is initialized around the
// session, and the exit code is the worst over all ranks so that mpirun reports any rank's failure.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#include <mpi.h>

int main(int argc, char** argv) {
  int provided = 0;
  // serialized: a communicator's background worker may make the MPI calls of async collectives
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  Catch::Session session;
  int rc = session.applyCommandLine(argc, argv);
  if (rc == 0) rc = session.run();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
