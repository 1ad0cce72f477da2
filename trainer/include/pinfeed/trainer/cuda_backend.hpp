#pragma once
// The CUDA side of the trainer, behind factories: CudaBackend (streams and
// events in move-only RAII owners, cudaMemcpyAsync, our kernels, cuBLAS) and
// NcclCommunicator. cuBLAS and NCCL are loaded at run time (dlopen), so the
// binaries start, and the CPU path works, on machines without them. Built
// without the CUDA toolkit, these report "not available".
#include <memory>
#include <string>
#include <vector>

#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/device_backend.hpp"

namespace pinfeed::trainer {

/// Visible CUDA devices; 0 without a driver or without CUDA support. Never throws.
int cuda_device_count() noexcept;

/// A backend on CUDA device `device`. Throws CudaError (no driver, no such
/// device, cuBLAS missing) with the device and the reason.
/// `keep_caller_device`: the calling thread's current device is restored
/// (a thread of another library, Python's).
std::unique_ptr<DeviceBackend> make_cuda_backend(int device, bool keep_caller_device = false);

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
