// Built without the CUDA toolkit: NCCL's factories say so at run time.
#include "pinfeed/trainer/nccl_communicator.hpp"

namespace pinfeed::trainer {

bool nccl_available() noexcept { return false; }

std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<DeviceBackend*>& /*backends*/,
                                                           CommConfig) {
  throw CudaError("NCCL: this pinfeed was built without CUDA");
}

std::unique_ptr<Communicator> make_nccl_communicator_launched(DeviceBackend& /*backend*/, CommConfig,
                                                              const LaunchEnv&) {
  throw CudaError("NCCL: this pinfeed was built without CUDA");
}

}  // namespace pinfeed::trainer
