// Built without the CUDA toolkit: the factories say so at run time.
#include <fmt/format.h>

#include "pinfeed/trainer/cuda_backend.hpp"
#include "pinfeed/trainer/device_type.hpp"

namespace pinfeed::trainer {

int cuda_device_count() noexcept { return 0; }

std::unique_ptr<DeviceBackend> make_cuda_backend(int device) {
  throw CudaError(fmt::format("cuda:{}: this pinfeed was built without CUDA (rebuild with the toolkit installed)", device));
}

bool nccl_available() noexcept { return false; }

std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<DeviceBackend*>& /*backends*/, CommConfig) {
  throw CudaError("NCCL: this pinfeed was built without CUDA");
}

std::unique_ptr<Communicator> make_nccl_communicator_mpi(DeviceBackend& /*backend*/, CommConfig) {
  throw CudaError("NCCL: this pinfeed was built without CUDA");
}

namespace {
std::unique_ptr<DeviceBackend> make_cuda_device(int index, const BackendOptions& /*options*/) {
  return make_cuda_backend(index);
}
}  // namespace

const DeviceType& cuda_device_type() {
  static const DeviceType type{BackendKind::cuda, "cuda", true, &cuda_device_count, &make_cuda_device,
                               &make_nccl_group, &make_nccl_communicator_mpi};
  return type;
}

}  // namespace pinfeed::trainer
