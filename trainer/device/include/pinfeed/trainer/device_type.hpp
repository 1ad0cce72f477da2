#pragma once
// DeviceType: one implementation per kind of device, the way PyTorch
// registers one per device type. Callers (train(), compare, the benchmarks,
// the Python module) make backends through the type of the device they were
// given, and never switch on the kind or name a backend class: the CUDA
// backend is named only by its own translation units (cuda_backend.cpp, or
// cuda_absent.cpp when pinfeed is built without the toolkit). The
// communicators of each kind are the comm layer's (communicator.hpp,
// comm_type()): a device type knows nothing of them.
#include <chrono>
#include <memory>
#include <string_view>
#include <vector>

#include "pinfeed/trainer/device_backend.hpp"

namespace pinfeed::trainer {

/// What a backend is made with, beyond its index.
struct BackendOptions {
  std::chrono::microseconds copy_delay{0};  ///< CPU only: added to every copy (tests, demos)
  /// CUDA: the thread making the backend keeps its current device (a thread
  /// of another library, Python's; not the trainer's, see CudaBackend).
  bool keep_caller_device = false;
};

struct DeviceType {
  BackendKind kind = BackendKind::cpu;
  std::string_view name;  ///< "cpu", "cuda": the prefix of --devices
  /// "cuda:0,1" names device indices; "cpu:4" counts workers.
  bool indexed = false;
  /// Devices present: the largest index + 1 for an indexed type; the most
  /// workers for a counted one. 0 when none (no driver, built without).
  int (*visible)() noexcept = nullptr;
  /// A backend on device `index` (an indexed type), or worker `index` (shown
  /// as its name). Throws ConfigError / CudaError with the reason.
  std::unique_ptr<DeviceBackend> (*make_backend)(int index, const BackendOptions& options) = nullptr;
};

/// Every type pinfeed knows, CPU first.
std::vector<const DeviceType*> device_types();
/// The type of `kind`.
const DeviceType& device_type(BackendKind kind);
/// The type named `name` ("cpu", "cuda"); ConfigError naming the known ones.
const DeviceType& device_type(std::string_view name);

/// Each implementation's registration (cpu_backend.cpp; cuda_backend.cpp or
/// cuda_absent.cpp).
const DeviceType& cpu_device_type();
const DeviceType& cuda_device_type();

}  // namespace pinfeed::trainer
