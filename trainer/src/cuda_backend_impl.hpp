#pragma once
// CudaBackend's declaration, shared by cuda_backend.cpp and the NCCL
// communicator (which enqueues on the backend's streams). Not installed.
#include <cuda_runtime_api.h>

#include <string>

#include "pinfeed/error.hpp"
#include "pinfeed/memory/cuda_host.hpp"
#include "pinfeed/trainer/device_backend.hpp"

namespace pinfeed::trainer::detail {

/// Throws CudaError "<what> on cuda:<device>: <error>" after resetting the
/// thread's last error (a sticky error, a kernel fault, cannot be reset: the
/// context stays unusable and every later call reports it).
void cuda_check(cudaError_t e, const char* what, int device);
#define PINFEED_CUDA_TRY(call, device) ::pinfeed::trainer::detail::cuda_check((call), #call, (device))

/// A CUDA handle owned by value: move-only, destroyed by `Destroy`. get() is
/// deleted on temporaries so a raw handle cannot outlive its owner.
template <class H, cudaError_t (*Destroy)(H)>
class CudaHandle {
 public:
  CudaHandle() = default;
  explicit CudaHandle(H h) noexcept : h_(h) {}
  CudaHandle(CudaHandle&& o) noexcept : h_(o.h_) { o.h_ = nullptr; }
  CudaHandle& operator=(CudaHandle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = o.h_;
      o.h_ = nullptr;
    }
    return *this;
  }
  CudaHandle(const CudaHandle&) = delete;
  CudaHandle& operator=(const CudaHandle&) = delete;
  ~CudaHandle() { reset(); }
  [[nodiscard]] H get() const& noexcept { return h_; }
  H get() const&& = delete;

  /// Destroys the handle now: its owner does so with its device current
  /// (on a thread with none, the runtime would create device 0's context).
  void reset() noexcept {
    // Errors here (driver shutting down at exit) are ignored: destructors never throw.
    if (h_ != nullptr) (void)Destroy(h_);
    (void)cudaGetLastError();
    h_ = nullptr;
  }

 private:
  H h_ = nullptr;
};

/// Destroying a stream drains it first, as the CPU backend's streams do:
/// cudaStreamDestroy returns at once with work still queued, and the
/// buffers that work reads are freed right after (a worker unwinding from
/// an exception mid-step). Errors are ignored: destructors never throw.
class CudaStream final : public Stream {
 public:
  static std::unique_ptr<CudaStream> create(int device);
  ~CudaStream() override {
    // Also on threads pinfeed does not own (Python's): the guard gives them
    // their device back.
    const memory::cuda::DeviceGuard guard(device_);
    if (handle_.get() != nullptr && guard.ok()) (void)cudaStreamSynchronize(handle_.get());
    (void)cudaGetLastError();
    handle_.reset();
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  [[nodiscard]] cudaStream_t get() const noexcept { return handle_.get(); }
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  CudaStream(int device, cudaStream_t s) : handle_(s), device_(device) {}
  CudaHandle<cudaStream_t, cudaStreamDestroy> handle_;
  int device_;
};

CudaStream& cuda(Stream& s);

}  // namespace pinfeed::trainer::detail
