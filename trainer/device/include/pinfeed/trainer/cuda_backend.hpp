#pragma once
// The CUDA side of the trainer, behind factories: CudaBackend (streams and
// events in move-only RAII owners, cudaMemcpyAsync, our kernels, cuBLAS) and
// NcclCommunicator. cuBLAS and NCCL are loaded at run time (dlopen), so the
// binaries start, and the CPU path works, on machines without them. Built
// without the CUDA toolkit, these report "not available".
#include <memory>
#include <string>
#include <vector>

#include "pinfeed/trainer/device_backend.hpp"

namespace pinfeed::trainer {

/// Visible CUDA devices; 0 without a driver or without CUDA support. Never throws.
int cuda_device_count() noexcept;

/// A backend on CUDA device `device`. Throws CudaError (no driver, no such
/// device, cuBLAS missing) with the device and the reason.
/// `keep_caller_device`: the calling thread's current device is restored
/// (a thread of another library, Python's).
std::unique_ptr<DeviceBackend> make_cuda_backend(int device, bool keep_caller_device = false);

}  // namespace pinfeed::trainer
