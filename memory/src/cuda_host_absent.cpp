// Built when pinfeed is configured without CUDA: the same interface, saying
// at run time that CUDA was not compiled in.
#include <fmt/format.h>

#include "pinfeed/error.hpp"
#include "pinfeed/memory/cuda_host.hpp"

namespace pinfeed::memory::cuda {

const RuntimeStatus& runtime_status() {
  static const RuntimeStatus status{false, false, 0, "built without CUDA (PINFEED_CUDA=OFF or no toolkit)"};
  return status;
}

std::vector<DeviceInfo> devices() { return {}; }

void host_register(void* /*ptr*/, std::size_t bytes, int /*device*/) {
  throw CudaError(fmt::format("cudaHostRegister of {} bytes: {}", bytes, runtime_status().message));
}

void host_unregister(void* /*ptr*/, int /*device*/) noexcept {}
bool host_registered(const void* /*ptr*/, int /*device*/) noexcept { return false; }

DeviceGuard::DeviceGuard(int /*device*/) noexcept {}
DeviceGuard::~DeviceGuard() { (void)previous_; }  // no device to give back (and clang sees the field used)
bool context_current() noexcept { return false; }

}  // namespace pinfeed::memory::cuda
