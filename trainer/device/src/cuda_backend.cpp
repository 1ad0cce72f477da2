// CudaBackend: the runtime API (linked statically), our kernels, and cuBLAS
// loaded with dlopen when the first backend is made, so binaries run on
// machines without it. Every call first selects the backend's device: one
// host thread may drive several devices.
#include <cublas_api.h>
#include <fmt/format.h>

#include <mutex>
#include <optional>
#include <thread>

#include "cuda_backend_impl.hpp"
#include "cuda_kernels.hpp"
#include "dynamic_library.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/trainer/cuda_backend.hpp"

namespace pinfeed::trainer {
namespace detail {

void cuda_check(cudaError_t e, const char* what, int device) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();  // reset the last error (a sticky one stays: the context is lost)
  throw CudaError(fmt::format("{} on cuda:{}: {} ({})", what, device, cudaGetErrorString(e), cudaGetErrorName(e)));
}

std::unique_ptr<CudaStream> CudaStream::create(int device, std::size_t workspace_bytes) {
  const memory::cuda::DeviceGuard guard(device);
  PINFEED_CUDA_TRY(cudaSetDevice(device), device);
  void* work = nullptr;
  if (workspace_bytes > 0) {
    const cudaError_t e = cudaMalloc(&work, workspace_bytes);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      throw OutOfMemory("device",
                        fmt::format("cuda:{}: cannot allocate a stream's {} byte workspace", device, workspace_bytes));
    }
    PINFEED_CUDA_TRY(e, device);
  }
  cudaStream_t s = nullptr;
  if (const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); e != cudaSuccess) {
    if (work != nullptr) (void)cudaFree(work);
    PINFEED_CUDA_TRY(e, device);
  }
  return std::unique_ptr<CudaStream>(new CudaStream(device, s, work));
}

CudaStream& cuda(Stream& s) { return dynamic_cast<CudaStream&>(s); }

}  // namespace detail

namespace {

using detail::cuda;

/// The cuBLAS entry points we use, from libcublas.so.N.
struct Cublas {
  using Create = cublasStatus_t (*)(cublasHandle_t*);
  using Destroy = cublasStatus_t (*)(cublasHandle_t);
  using SetStream = cublasStatus_t (*)(cublasHandle_t, cudaStream_t);
  using Sgemm = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const float*,
                                   const float*, int, const float*, int, const float*, float*, int);
  Create create = nullptr;
  Destroy destroy = nullptr;
  SetStream set_stream = nullptr;
  Sgemm sgemm = nullptr;
  std::string error;

  static const Cublas& get() {
    static const Cublas lib = load();
    return lib;
  }

 private:
  static Cublas load() {
    Cublas c;
    detail::DynamicLibrary lib("cuBLAS", {"libcublas.so.13", "libcublas.so.12", "libcublas.so"});
    lib.bind(c.create, "cublasCreate_v2");
    lib.bind(c.destroy, "cublasDestroy_v2");
    lib.bind(c.set_stream, "cublasSetStream_v2");
    lib.bind(c.sgemm, "cublasSgemm_v2");
    c.error = lib.error();
    return c;
  }
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int device) : device_(device) {
    // Made, queried and destroyed from threads pinfeed may not own (TBB's,
    // the pool's, the NCCL watchdog, Python's): the event's device is made
    // current for the call only, so none of them creates device 0's context
    // or finds its own device changed.
    const memory::cuda::DeviceGuard guard(device);
    PINFEED_CUDA_TRY(cudaSetDevice(device), device);
    cudaEvent_t e = nullptr;
    // Blocking sync: wait() sleeps in the driver instead of spinning a core.
    PINFEED_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync), device);
    handle_ = detail::CudaHandle<cudaEvent_t, cudaEventDestroy>(e);
  }
  ~CudaEvent() override {
    const memory::cuda::DeviceGuard guard(device_);
    handle_.reset();
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  [[nodiscard]] cudaEvent_t get() const noexcept { return handle_.get(); }
  // cudaEventQuery's cudaErrorNotReady ("not yet") is also left as the
  // thread's last error; it is taken off at once, or the next kernel
  // launch's cudaGetLastError() would report it (PyTorch's query does the
  // same). Any other error means the work failed: nothing will read the
  // memory any more, so the event counts as complete (and a destructor
  // waiting on it, ~BufferPool's, never throws); it is logged.
  [[nodiscard]] bool ready() noexcept override {
    const memory::cuda::DeviceGuard guard(device_);
    const cudaError_t e = cudaEventQuery(handle_.get());
    (void)cudaGetLastError();
    if (e == cudaErrorNotReady) return false;
    if (e != cudaSuccess && e != cudaErrorCudartUnloading) {
      pinfeed::detail::log().error("cuda:{}: an event's work failed ({}): treated as complete", device_,
                                   cudaGetErrorName(e));
    }
    return true;
  }
  void wait() override {
    const memory::cuda::DeviceGuard guard(device_);
    PINFEED_CUDA_TRY(cudaSetDevice(device_), device_);
    PINFEED_CUDA_TRY(cudaEventSynchronize(handle_.get()), device_);
  }
  bool wait_for(std::chrono::microseconds timeout) noexcept override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (auto pause = std::chrono::microseconds(20);; pause = std::min(pause * 2, std::chrono::microseconds(1000))) {
      if (ready()) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(pause);
    }
  }

 private:
  int device_;
  detail::CudaHandle<cudaEvent_t, cudaEventDestroy> handle_;
};

CudaEvent& cuda(Event& e) { return dynamic_cast<CudaEvent&>(e); }

class CudaBackend final : public DeviceBackend {
 public:
  CudaBackend(int device, bool keep_caller_device) : device_(device) {
    // Made on a thread of another library (Python's): that thread keeps its
    // device (if it had a context; DeviceGuard). Not by default: the
    // trainer's workers make their backend's device theirs.
    std::optional<memory::cuda::DeviceGuard> keep;
    if (keep_caller_device) keep.emplace(device);
    PINFEED_CUDA_TRY(cudaSetDevice(device), device);
    cudaDeviceProp prop{};
    PINFEED_CUDA_TRY(cudaGetDeviceProperties(&prop, device), device);
    name_ = fmt::format("cuda:{} ({})", device, prop.name);
    // Zero-filling a new buffer runs here, not on the legacy default
    // stream: that one waits for all of torch's default-stream work.
    init_stream_ = detail::CudaStream::create(device);
    // cuBLAS is loaded, and a stream's handle made, at the first GEMM: a
    // backend that only feeds batches (device=) never needs libcublas.
  }

  [[nodiscard]] BackendKind kind() const noexcept override { return BackendKind::cuda; }
  [[nodiscard]] int cuda_device() const noexcept override { return device_; }
  [[nodiscard]] memory::PinMethod host_pin_method() const noexcept override { return memory::PinMethod::cuda_register; }
  void make_current() override { select(); }
  std::shared_ptr<void> scoped_current() override {
    // Nothing to do, and nothing to restore, on a thread already on this
    // device (torch.cuda.set_device(local_rank) has been called): restoring
    // a device the thread never used would make a context there.
    int previous = 0;
    PINFEED_CUDA_TRY(cudaGetDevice(&previous), device_);
    if (previous == device_ && memory::cuda::context_current()) return nullptr;
    auto guard = std::make_shared<memory::cuda::DeviceGuard>(device_);
    select();
    return guard;
  }
  [[nodiscard]] std::string name() const override { return name_; }

  DeviceBuffer allocate(std::size_t bytes) override {
    if (bytes == 0) return DeviceBuffer(this, nullptr, 0);  // as the CPU backend: cudaMalloc(0) is no buffer
    select();
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      throw OutOfMemory("device", fmt::format("{}: cannot allocate {} bytes", name_, bytes));
    }
    PINFEED_CUDA_TRY(e, device_);
    // Zeroed on the backend's own stream and finished here, before any
    // stream writes the buffer (allocation is never on the hot path). Not
    // cudaMemset: the legacy default stream would wait for torch's work.
    PINFEED_CUDA_TRY(cudaMemsetAsync(p, 0, bytes, init_stream_->get()), device_);
    PINFEED_CUDA_TRY(cudaStreamSynchronize(init_stream_->get()), device_);
    return DeviceBuffer(this, p, bytes);
  }
  /// Every stream may run kernels: it comes with its BatchNorm workspace
  /// (Note [One stream, one workspace]).
  std::unique_ptr<Stream> create_stream() override {
    return detail::CudaStream::create(device_, kernels::bn_workspace_doubles() * sizeof(double));
  }
  std::unique_ptr<Stream> create_copy_stream() override { return detail::CudaStream::create(device_); }
  std::shared_ptr<Event> create_event() override { return std::make_shared<CudaEvent>(device_); }

  void copy_h2d(Stream& s, void* dst, const void* src, std::size_t bytes) override {
    copy(s, dst, src, bytes, cudaMemcpyHostToDevice);
  }
  void copy_d2h(Stream& s, void* dst, const void* src, std::size_t bytes) override {
    copy(s, dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  void copy_d2d(Stream& s, void* dst, const void* src, std::size_t bytes) override {
    copy(s, dst, src, bytes, cudaMemcpyDeviceToDevice);
  }
  void record(Event& e, Stream& s) override {
    select();
    PINFEED_CUDA_TRY(cudaEventRecord(cuda(e).get(), cuda(s).get()), device_);
  }
  void stream_wait(Stream& s, Event& e) override {
    select();
    PINFEED_CUDA_TRY(cudaStreamWaitEvent(cuda(s).get(), cuda(e).get(), 0), device_);
  }
  void synchronize(Stream& s) override {
    select();
    PINFEED_CUDA_TRY(cudaStreamSynchronize(cuda(s).get()), device_);
  }
  void host_callback(Stream& s, std::function<void()> f) override {
    select();
    auto* task = new std::function<void()>(std::move(f));
    const cudaError_t e = cudaLaunchHostFunc(
        cuda(s).get(),
        [](void* p) {
          std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(p));
          (*fn)();
        },
        task);
    if (e != cudaSuccess) delete task;  // never queued
    PINFEED_CUDA_TRY(e, device_);
  }
  /// torch's default stream is 0: the legacy default stream, named as such
  /// (a build with per-thread default streams would read 0 otherwise).
  static cudaStream_t foreign(std::uintptr_t consumer) noexcept {
    return consumer == 0 ? cudaStreamLegacy : reinterpret_cast<cudaStream_t>(consumer);
  }
  void consumer_wait(std::uintptr_t consumer, Event& e) override {
    select();
    PINFEED_CUDA_TRY(cudaStreamWaitEvent(foreign(consumer), cuda(e).get(), 0), device_);
  }
  void consumer_record(std::uintptr_t consumer, Event& e) override {
    select();
    PINFEED_CUDA_TRY(cudaEventRecord(cuda(e).get(), foreign(consumer)), device_);
  }

  void gemm(Stream& s, const Gemm& g) override {
    select();
    const Cublas& lib = Cublas::get();
    if (!lib.error.empty()) throw CudaError(fmt::format("{}: {}", name_, lib.error));
    // The stream's own handle (Note [One stream, one workspace]): no lock,
    // and no stream to set before each GEMM.
    cublasHandle_t handle = cuda(s).blas(
        [&](cudaStream_t stream) {
          cublasHandle_t h = nullptr;
          if (lib.create(&h) != CUBLAS_STATUS_SUCCESS) throw CudaError(fmt::format("{}: cublasCreate failed", name_));
          if (lib.set_stream(h, stream) != CUBLAS_STATUS_SUCCESS) {
            (void)lib.destroy(h);
            throw CudaError(fmt::format("{}: cublasSetStream failed", name_));
          }
          return h;
        },
        lib.destroy);
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T:
    // swap the operands and the dimensions m and n.
    if (lib.sgemm(handle, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.n, g.m, g.k,
                  &g.alpha, g.b, g.ldb, g.a, g.lda, &g.beta, g.c, g.ldc) != CUBLAS_STATUS_SUCCESS) {
      throw CudaError(fmt::format("{}: cublasSgemm {}x{}x{} failed", name_, g.m, g.n, g.k));
    }
  }
  void normalize_u8(Stream& s, const std::uint8_t* nhwc, float* nchw, int n, int h, int w,
                    const Normalization& norm) override {
    normalize_u8_as(s, nhwc, nchw, FloatType::f32, n, h, w, norm);
  }
  void avg_pool(Stream& s, const float* nchw, float* out, int n, int c, int h, int w, int factor) override {
    select();
    PINFEED_CUDA_TRY(kernels::avg_pool(cuda(s).get(), nchw, out, n, c, h, w, factor), device_);
  }
  void bias_activation(Stream& s, float* z, const float* bias, float* a, int n, int d, bool relu) override {
    select();
    PINFEED_CUDA_TRY(kernels::bias_activation(cuda(s).get(), z, bias, a, n, d, relu), device_);
  }
  void relu_backward(Stream& s, float* grad, const float* z, std::size_t count) override {
    select();
    PINFEED_CUDA_TRY(kernels::relu_backward(cuda(s).get(), grad, z, count), device_);
  }
  void bias_grad(Stream& s, const float* dz, float* db, int n, int d) override {
    select();
    PINFEED_CUDA_TRY(kernels::bias_grad(cuda(s).get(), dz, db, n, d), device_);
  }
  void softmax_cross_entropy(Stream& s, const float* logits, const std::int32_t* labels, int n, int k, float scale,
                             float* dlogits, float* stats) override {
    select();
    PINFEED_CUDA_TRY(kernels::softmax_cross_entropy(cuda(s).get(), logits, labels, n, k, scale, dlogits, stats),
                     device_);
  }
  void im2col(Stream& s, const float* x, std::size_t c_stride, std::size_t n_stride, const ConvShape& shape,
              float* col) override {
    select();
    PINFEED_CUDA_TRY(kernels::im2col(cuda(s).get(), x, c_stride, n_stride, conv(shape), col), device_);
  }
  void col2im(Stream& s, const float* col, const ConvShape& shape, float* dx) override {
    select();
    PINFEED_CUDA_TRY(kernels::col2im(cuda(s).get(), col, conv(shape), dx), device_);
  }
  void bn_stats(Stream& s, const float* x, int c, std::size_t m, float* sums) override {
    select();
    PINFEED_CUDA_TRY(kernels::bn_stats(cuda(s).get(), x, c, m, sums, workspace(s)), device_);
  }
  void bn_forward(Stream& s, const float* x, const float* sums, const BatchNormArgs& a, float* xhat,
                  float* y) override {
    select();
    PINFEED_CUDA_TRY(kernels::bn_forward(cuda(s).get(), x, sums, bn(a), xhat, y, workspace(s)), device_);
  }
  void bn_backward_reduce(Stream& s, float* dy, const float* y, const float* xhat, const BatchNormArgs& a, float* red,
                          float* dgamma, float* dbeta) override {
    select();
    PINFEED_CUDA_TRY(kernels::bn_backward_reduce(cuda(s).get(), dy, y, xhat, bn(a), red, dgamma, dbeta, workspace(s)),
                     device_);
  }
  void bn_backward_input(Stream& s, const float* dy, const float* xhat, const float* red, const BatchNormArgs& a,
                         float* dx) override {
    select();
    PINFEED_CUDA_TRY(kernels::bn_backward_input(cuda(s).get(), dy, xhat, red, bn(a), dx), device_);
  }
  void channel_mean(Stream& s, const float* x, int c, int n, std::size_t hw, float* out) override {
    select();
    PINFEED_CUDA_TRY(kernels::channel_mean(cuda(s).get(), x, c, n, hw, out), device_);
  }
  void channel_mean_backward(Stream& s, const float* dout, int c, int n, std::size_t hw, float* dx) override {
    select();
    PINFEED_CUDA_TRY(kernels::channel_mean_backward(cuda(s).get(), dout, c, n, hw, dx), device_);
  }
  static kernels::Conv conv(const ConvShape& c) { return {c.n, c.c, c.h, c.w, c.stride, c.out_h(), c.out_w()}; }
  static kernels::BatchNorm bn(const BatchNormArgs& a) {
    return {a.c, a.m, a.eps, a.momentum, a.count, a.relu, a.gamma, a.beta, a.running_mean, a.running_var, a.invstd};
  }
  void sgd(Stream& s, float* w, float* grad, float* momentum, std::size_t count, const SgdStep& step) override {
    select();
    PINFEED_CUDA_TRY(kernels::sgd(cuda(s).get(), w, grad, momentum, count, step.lr, step.momentum, step.weight_decay),
                     device_);
  }
  void scale(Stream& s, float* x, std::size_t count, float factor) override {
    select();
    PINFEED_CUDA_TRY(kernels::scale(cuda(s).get(), x, count, factor), device_);
  }
  void fill(Stream& s, float* x, std::size_t count, float value) override {
    select();
    PINFEED_CUDA_TRY(kernels::fill(cuda(s).get(), x, count, value), device_);
  }
  void normalize_u8_as(Stream& s, const std::uint8_t* nhwc, void* nchw, FloatType type, int n, int h, int w,
                       const Normalization& norm) override {
    select();
    float sc[3], bi[3];
    for (std::size_t c = 0; c < 3; ++c) {
      sc[c] = 1.0F / (255.0F * norm.std[c]);
      bi[c] = -norm.mean[c] / norm.std[c];
    }
    PINFEED_CUDA_TRY(kernels::normalize_u8_as(cuda(s).get(), nhwc, nchw, static_cast<int>(type), n, h, w, sc, bi),
                     device_);
  }
  void widen_labels(Stream& s, const std::int32_t* in, std::int64_t* out, std::size_t n) override {
    select();
    PINFEED_CUDA_TRY(kernels::widen_labels(cuda(s).get(), in, out, n), device_);
  }

 protected:
  void free(void* ptr, std::size_t /*bytes*/) noexcept override {
    if (ptr == nullptr) return;
    const memory::cuda::DeviceGuard guard(device_);  // a thread of another library keeps its device
    (void)cudaFree(ptr);                             // at process exit the driver may already be gone: ignored
    (void)cudaGetLastError();
  }

 private:
  void select() const { PINFEED_CUDA_TRY(cudaSetDevice(device_), device_); }
  /// The stream's BatchNorm workspace (Note [One stream, one workspace]).
  double* workspace(Stream& s) const {
    double* w = cuda(s).workspace();
    if (w == nullptr) {
      throw CudaError(
          fmt::format("{}: a BatchNorm kernel on a copy stream (create_copy_stream has no workspace)", name_));
    }
    return w;
  }
  void copy(Stream& s, void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
    select();
    PINFEED_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, kind, cuda(s).get()), device_);
  }

  int device_;
  std::string name_;
  std::unique_ptr<detail::CudaStream> init_stream_;  // zero-fills new buffers
};

}  // namespace

int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::unique_ptr<DeviceBackend> make_cuda_backend(int device, bool keep_caller_device) {
  const int n = cuda_device_count();
  if (device < 0 || device >= n) {
    throw CudaError(
        fmt::format("cuda:{}: no such device ({} visible{})", device, n, n == 0 ? ": no driver or no GPU" : ""));
  }
  return std::make_unique<CudaBackend>(device, keep_caller_device);
}

}  // namespace pinfeed::trainer
