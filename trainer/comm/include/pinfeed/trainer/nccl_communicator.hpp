#pragma once
// NCCL's communicators for CUDA backends (nccl_communicator.cpp; without the
// toolkit, nccl_absent.cpp, which says so at run time). NCCL is loaded with
// dlopen when one is made.
#include <memory>
#include <vector>

#include "pinfeed/launch_env.hpp"
#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/device_backend.hpp"

namespace pinfeed::trainer {

/// True when NCCL can be loaded (libnccl.so.2).
bool nccl_available() noexcept;

/// One NCCL communicator per backend (CUDA backends of this process), made
/// together with ncclCommInitAll. Throws CommError / CudaError.
std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<DeviceBackend*>& backends,
                                                           CommConfig config = {});

/// One communicator for this process's single GPU in a multi-process launch:
/// rank 0 creates the NCCL unique id; MPI broadcasts it under mpirun or srun
/// (env.mpi_launch(), on a build with MPI), torchrun's rendezvous store
/// (MASTER_ADDR:MASTER_PORT) carries it otherwise.
std::unique_ptr<Communicator> make_nccl_communicator_launched(DeviceBackend& backend, CommConfig config,
                                                              const LaunchEnv& env);

}  // namespace pinfeed::trainer
