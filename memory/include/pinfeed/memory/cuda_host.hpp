#pragma once
// The few CUDA runtime calls the memory module needs, behind one seam. When
// pinfeed is built without CUDA, or runs where there is no driver or device,
// these report that instead of failing: the CPU path is first-class.
#include <cstdint>
#include <string>
#include <vector>

namespace pinfeed::memory::cuda {

struct RuntimeStatus {
  bool compiled = false;   ///< built with the CUDA toolkit
  bool available = false;  ///< a driver answered and at least one device is present
  int device_count = 0;
  std::string message;  ///< why not available ("no CUDA driver", ...), or the driver version
};

/// Probed once per process (thread-safe), then cached. Never throws.
const RuntimeStatus& runtime_status();

struct DeviceInfo {
  int index = 0;
  std::string name;
  std::uint64_t total_bytes = 0;
  std::string pci_bus_id;  ///< "0000:3b:00.0", lower case
  int numa_node = -1;      ///< nearest NUMA node (sysfs); -1 when unknown
  /// The GPU reads pageable memory through the host's page tables (Grace
  /// Hopper, ATS): cudaHostRegister then maps the pages but need not lock
  /// them, so "pinned" there says less than on a PCIe host; VmLck is the truth.
  bool host_page_tables = false;
};

/// Every visible device; empty when none. Throws CudaError on a driver failure.
std::vector<DeviceInfo> devices();

/// Makes `device` current on the calling thread for the guard's life, then
/// gives the thread back the device it had -- but only if it had a context
/// current: on a thread that never used CUDA (a TBB worker, the pool's
/// thread, a fresh Python thread) cudaGetDevice reads 0, and "restoring" 0
/// would create device 0's primary context (~0.5 GB on GPU 0 in every rank).
/// On a thread that had one (torch's, after torch.cuda.set_device), the
/// caller's device comes back: pinfeed never changes torch's current device.
/// device < 0, or a build without CUDA: does nothing. Never throws; ok()
/// says whether `device` could be made current.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) noexcept;
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  [[nodiscard]] bool ok() const noexcept { return ok_; }

 private:
  int previous_ = -1;  ///< the device to give back; -1: none
  bool ok_ = true;
};

/// True when the calling thread has a CUDA context current (the driver's
/// cuCtxGetCurrent; false without CUDA). Creates none.
bool context_current() noexcept;

/// cudaHostRegister (portable), with `device` made current first (>= 0): a
/// thread with no current device would otherwise create device 0's primary
/// context just to register (an extra ~0.5 GB context per process on GPU 0).
/// Throws OutOfMemory("cuda register") when the driver cannot pin the pages
/// (out of memory, not supported here: the pool falls back to pageable and
/// logs the reason), CudaError for what falling back cannot fix: CUDA not
/// available, the range already registered (a bug), a lost context.
void host_register(void* ptr, std::size_t bytes, int device = -1);
/// Whether the driver knows the byte at `ptr` as page-locked host memory
/// (cudaPointerGetAttributes reads cudaMemoryTypeHost: registered or
/// allocated pinned). This is what an async copy from `ptr` relies on, so
/// it is the proof a pinning claim needs (bench/gpu_run.py). False without
/// CUDA, without a device, or for pageable memory. Never throws. `device`
/// is made current first (>= 0; DeviceGuard), so that a thread with none
/// does not make device 0's context just to ask.
bool host_registered(const void* ptr, int device = -1) noexcept;
/// cudaHostUnregister with `device` current; logs (never throws) on failure,
/// ignores driver shutdown. Both give the thread its device back (DeviceGuard).
void host_unregister(void* ptr, int device = -1) noexcept;

}  // namespace pinfeed::memory::cuda
