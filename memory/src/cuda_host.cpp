// Built only when the CUDA toolkit is found (PINFEED_HAVE_CUDA). Links the
// static CUDA runtime, so a machine with no toolkit can still start the
// binary; with no driver, cudaGetDeviceCount fails and we say so.
#include "pinfeed/memory/cuda_host.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <fstream>

#include "pinfeed/error.hpp"
#include "pinfeed/log.hpp"

namespace pinfeed::memory::cuda {

namespace {
std::string describe(cudaError_t e) { return fmt::format("{} ({})", cudaGetErrorString(e), cudaGetErrorName(e)); }
}  // namespace

const RuntimeStatus& runtime_status() {
  static const RuntimeStatus status = [] {
    RuntimeStatus s;
    s.compiled = true;
    int driver = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
      s.message = "no CUDA driver";
      (void)cudaGetLastError();  // reset the last error (a sticky one stays: the context is lost)
      return s;
    }
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
      s.message = fmt::format("CUDA driver {} present, no usable device: {}", driver, describe(e));
      (void)cudaGetLastError();
      return s;
    }
    s.device_count = count;
    s.available = count > 0;
    s.message = count > 0 ? fmt::format("CUDA driver {}.{}, {} device(s)", driver / 1000, (driver % 1000) / 10, count)
                          : "CUDA driver present, no device";
    return s;
  }();
  return status;
}

std::vector<DeviceInfo> devices() {
  std::vector<DeviceInfo> out;
  if (!runtime_status().available) return out;
  for (int i = 0; i < runtime_status().device_count; ++i) {
    cudaDeviceProp prop{};
    if (const cudaError_t e = cudaGetDeviceProperties(&prop, i); e != cudaSuccess) {
      (void)cudaGetLastError();
      throw CudaError(fmt::format("cudaGetDeviceProperties(device {}) failed: {}", i, describe(e)));
    }
    DeviceInfo d;
    d.index = i;
    d.name = prop.name;
    d.total_bytes = prop.totalGlobalMem;
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, i) == cudaSuccess) {
      d.pci_bus_id = bus;
      std::transform(d.pci_bus_id.begin(), d.pci_bus_id.end(), d.pci_bus_id.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      // The kernel knows which node the device's PCI root hangs off.
      std::ifstream numa("/sys/bus/pci/devices/" + d.pci_bus_id + "/numa_node");
      if (!(numa >> d.numa_node)) d.numa_node = -1;
    } else {
      (void)cudaGetLastError();
    }
    int host_tables = 0;
    if (cudaDeviceGetAttribute(&host_tables, cudaDevAttrPageableMemoryAccessUsesHostPageTables, i) == cudaSuccess) {
      d.host_page_tables = host_tables != 0;
    } else {
      (void)cudaGetLastError();
    }
    out.push_back(std::move(d));
  }
  return out;
}

bool context_current() noexcept {
  // The driver's cuCtxGetCurrent through the runtime's entry-point lookup:
  // the static runtime links no libcuda, and this asks without creating.
  using GetCurrent = int (*)(void**);
  static const GetCurrent get_current = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return GetCurrent{nullptr};
    }
    return reinterpret_cast<GetCurrent>(fn);
  }();
  if (get_current == nullptr) return true;  // cannot tell: behave as if the thread had one (restore its device)
  void* ctx = nullptr;
  return get_current(&ctx) == 0 && ctx != nullptr;
}

DeviceGuard::DeviceGuard(int device) noexcept {
  if (device < 0) return;
  int previous = -1;
  if (context_current() && cudaGetDevice(&previous) == cudaSuccess && previous != device) previous_ = previous;
  ok_ = cudaSetDevice(device) == cudaSuccess;
  (void)cudaGetLastError();
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) (void)cudaSetDevice(previous_);
  (void)cudaGetLastError();
}

void host_register(void* ptr, std::size_t bytes, int device) {
  if (!runtime_status().available) {
    throw CudaError(fmt::format("cudaHostRegister: CUDA not available ({})", runtime_status().message));
  }
  const DeviceGuard guard(device);
  if (!guard.ok()) throw CudaError(fmt::format("cudaSetDevice({}) before cudaHostRegister failed", device));
  if (const cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable); e != cudaSuccess) {
    (void)cudaGetLastError();
    const std::string what =
        fmt::format("cudaHostRegister of {} bytes on cuda:{} failed: {}", bytes, device, describe(e));
    switch (e) {
      case cudaErrorMemoryAllocation:
      case cudaErrorNotSupported:
      case cudaErrorInvalidValue: throw OutOfMemory("cuda register", what);  // the pool pins less and says why
      default: throw CudaError(what);  // already registered, a lost context: pinning less would hide it
    }
  }
}

bool host_registered(const void* ptr, int device) noexcept {
  if (!runtime_status().available) return false;
  const DeviceGuard guard(device);
  if (!guard.ok()) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeHost;
}

void host_unregister(void* ptr, int device) noexcept {
  const DeviceGuard guard(device);
  const cudaError_t e = cudaHostUnregister(ptr);
  if (e == cudaSuccess || e == cudaErrorCudartUnloading) return;  // shutting down: nothing to do
  (void)cudaGetLastError();
  pinfeed::detail::log().error("cudaHostUnregister({}) failed: {}", ptr, describe(e));
}

}  // namespace pinfeed::memory::cuda
