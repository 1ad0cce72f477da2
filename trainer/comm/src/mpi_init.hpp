#pragma once
// MPI initialization shared by the MPI communicator and the NCCL bootstrap.
#include <string>

namespace pinfeed::trainer::detail {
/// MPI_Init_thread(MPI_THREAD_MULTIPLE) once per process, MPI_Finalize at
/// exit. Throws ConfigError when MPI cannot start or lacks thread support.
void mpi_init();
/// Logs `why` and ends every process of the launch (MPI_Abort on
/// MPI_COMM_WORLD, exit code 1): a fatal error in one rank of a
/// multi-process run must not leave the others waiting for a timeout.
[[noreturn]] void mpi_abort(int rank, const std::string& why) noexcept;
}  // namespace pinfeed::trainer::detail
