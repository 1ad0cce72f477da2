#pragma once
// MPI initialization shared by the MPI communicator and the NCCL bootstrap.
namespace pinfeed::trainer::detail {
/// MPI_Init_thread(MPI_THREAD_MULTIPLE) once per process, MPI_Finalize at
/// exit. Throws ConfigError when MPI cannot start or lacks thread support.
void mpi_init();
}  // namespace pinfeed::trainer::detail
