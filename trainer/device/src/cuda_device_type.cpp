// The CUDA device type (device_type.hpp): its factory is cuda_backend.cpp's,
// or cuda_absent.cpp's in a build without the toolkit (which says so). Built
// in both.
#include "pinfeed/trainer/cuda_backend.hpp"
#include "pinfeed/trainer/device_type.hpp"

namespace pinfeed::trainer {
namespace {
std::unique_ptr<DeviceBackend> make_cuda_device(int index, const BackendOptions& options) {
  return make_cuda_backend(index, options.keep_caller_device);
}
}  // namespace

const DeviceType& cuda_device_type() {
  static const DeviceType type{BackendKind::cuda, "cuda", true, &cuda_device_count, &make_cuda_device};
  return type;
}

}  // namespace pinfeed::trainer
