#pragma once
// CudaBackend's declaration, shared by cuda_backend.cpp and the NCCL
// communicator (which enqueues on the backend's streams). Not installed.
#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <mutex>
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
///
/// Note [One stream, one workspace]: what a kernel keeps between launches
/// belongs to the stream it runs on, not to the backend. BatchNorm's partial
/// sums are written by one kernel and read by the next; shared by two
/// streams (a worker's compute stream and a validation pass on another, two
/// workers of one process on one device), their kernels would interleave and
/// read each other's sums. A cuBLAS handle's stream is state too: one handle
/// shared by streams needed a lock around set-stream-and-enqueue. So each
/// stream made for kernels owns a BatchNorm workspace (allocated with the
/// stream, at setup: Note [No allocation during collectives]) and a cuBLAS
/// handle bound to it (made at its first GEMM, as cuBLAS itself is loaded
/// then). Streams for copies and collectives (create_copy_stream: the
/// device feed's, a worker's copy stream, DDP's and NCCL's, the backend's
/// zero-filling one) have no workspace: a 4 MiB cudaMalloc less each, and
/// no device-wide cudaFree when they go.
class CudaStream final : public Stream {
 public:
  using BlasDestroy = cublasStatus_t (*)(cublasHandle_t);
  /// `workspace_bytes`: the BatchNorm workspace allocated with it (0: none).
  static std::unique_ptr<CudaStream> create(int device, std::size_t workspace_bytes = 0);
  ~CudaStream() override {
    // Also on threads pinfeed does not own (Python's): the guard gives them
    // their device back.
    const memory::cuda::DeviceGuard guard(device_);
    if (handle_.get() != nullptr && guard.ok()) (void)cudaStreamSynchronize(handle_.get());
    (void)cudaGetLastError();
    if (blas_ != nullptr && guard.ok()) (void)blas_destroy_(blas_);
    workspace_.reset();
    handle_.reset();
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  [[nodiscard]] cudaStream_t get() const noexcept { return handle_.get(); }
  [[nodiscard]] int device() const noexcept { return device_; }
  /// This stream's BatchNorm workspace; nullptr when it was made without one.
  [[nodiscard]] double* workspace() const noexcept { return static_cast<double*>(workspace_.get()); }
  /// This stream's cuBLAS handle, made by `make` (which binds it to the
  /// stream) at the first call; thread-safe.
  template <class Make>
  cublasHandle_t blas(Make&& make, BlasDestroy destroy) {
    std::call_once(blas_once_, [&] {
      blas_ = make(handle_.get());
      blas_destroy_ = destroy;
    });
    return blas_;
  }

 private:
  CudaStream(int device, cudaStream_t s, void* workspace) : handle_(s), workspace_(workspace), device_(device) {}
  CudaHandle<cudaStream_t, cudaStreamDestroy> handle_;
  CudaHandle<void*, cudaFree> workspace_;
  int device_;
  std::once_flag blas_once_;
  cublasHandle_t blas_ = nullptr;
  BlasDestroy blas_destroy_ = nullptr;
};

CudaStream& cuda(Stream& s);

}  // namespace pinfeed::trainer::detail
