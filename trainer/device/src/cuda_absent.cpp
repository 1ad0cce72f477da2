// Built without the CUDA toolkit: the factories say so at run time.
#include <fmt/format.h>

#include "pinfeed/trainer/cuda_backend.hpp"

namespace pinfeed::trainer {

int cuda_device_count() noexcept { return 0; }

std::unique_ptr<DeviceBackend> make_cuda_backend(int device, bool /*keep_caller_device*/) {
  throw CudaError(
      fmt::format("cuda:{}: this pinfeed was built without CUDA (rebuild with the toolkit installed)", device));
}

}  // namespace pinfeed::trainer
