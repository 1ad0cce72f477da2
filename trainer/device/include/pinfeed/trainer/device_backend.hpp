#pragma once
// DeviceBackend: the seam between the trainer and a device. Device memory,
// streams (ordered queues of work), events (completion markers), async
// host-to-device copies, and the handful of math operations the reference
// model needs, all enqueued on a stream.
//
//   CudaBackend  the CUDA runtime: plain cudaMalloc (allocation happens
//                before training, never per step),
//                cudaMemcpyAsync, events, cuBLAS (loaded at run time) and
//                our kernels (cuda_kernels.cu).
//   CpuBackend   real memory and one worker thread per stream, so ordering,
//                asynchrony and completion are exercised in every test run.
//                Its math is plain C++ and OpenBLAS (cblas_sgemm).
//
// Note [Slot lifetime] (see buffer_pool.hpp): a pool slot that a copy reads
// goes back to the pool only after that copy has completed. An Event is a
// memory::Fence, so the trainer releases a batch's lease with
// `lease.release_after(event)` right after recording the copy's event.
//
// Errors: work that fails on a stream (a CUDA error, an exception in a CPU
// stream's task, a collective that timed out) is sticky on that stream:
// synchronize() and Event::wait_for() rethrow it, and later work on the
// stream is skipped. Thread-safety: a backend may be used from several host
// threads (the CUDA backend keeps a cuBLAS handle and a BatchNorm workspace
// per stream: Note [One stream, one workspace]); one Stream must be fed by
// one host thread at a time.
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "pinfeed/memory/fence.hpp"
#include "pinfeed/memory/pinned_resource.hpp"

namespace pinfeed::trainer {

enum class BackendKind { cpu, cuda };

class DeviceBackend;

/// Device memory, freed by its backend when dropped. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBackend* backend, void* ptr, std::size_t bytes) noexcept
      : backend_(backend), ptr_(ptr), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { swap(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    DeviceBuffer tmp(std::move(other));
    swap(tmp);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  [[nodiscard]] void* get() const noexcept { return ptr_; }
  template <class T>
  [[nodiscard]] T* as() const noexcept {
    return static_cast<T*>(ptr_);
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

 private:
  void swap(DeviceBuffer& o) noexcept {
    std::swap(backend_, o.backend_);
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
  }
  DeviceBackend* backend_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

/// An ordered queue of device work. Opaque; made by a backend.
class Stream {
 public:
  Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  virtual ~Stream() = default;
};

/// Completion of the work recorded before it on a stream. A Fence, so a pool
/// slot can be released after it (Note [Slot lifetime]). wait_for() rethrows
/// the stream's error, if the work failed. Events are reused (re-recording
/// resets one): the trainer keeps a ring of them instead of making one per
/// step.
class Event : public memory::Fence {
 public:
  /// Blocks until the work is complete, without polling: the thread sleeps
  /// until the device signals it (CUDA events are made with
  /// cudaEventBlockingSync), so the cores stay with the loader's decoders.
  /// Rethrows the work's error.
  virtual void wait() {
    while (!wait_for(std::chrono::seconds(1))) {
    }
  }
};

/// A floating-point type of device batches.
enum class FloatType : std::uint8_t { f32, f16, bf16 };
[[nodiscard]] constexpr std::size_t float_bytes(FloatType t) noexcept { return t == FloatType::f32 ? 4 : 2; }

/// Mean and standard deviation per channel (R, G, B), as in the loader.
struct Normalization {
  std::array<float, 3> mean{0.485F, 0.456F, 0.406F};
  std::array<float, 3> std{0.229F, 0.224F, 0.225F};
};

/// Row-major matrix product operands: C (m x n) = alpha * op(A) * op(B) + beta * C,
/// op(A) m x k, op(B) k x n; ld* are row strides in elements.
struct Gemm {
  bool trans_a = false, trans_b = false;
  int m = 0, n = 0, k = 0;
  float alpha = 1, beta = 0;
  const float* a = nullptr;
  int lda = 0;
  const float* b = nullptr;
  int ldb = 0;
  float* c = nullptr;
  int ldc = 0;
};

/// SGD with momentum and weight decay, PyTorch's rule:
/// g += weight_decay * w; m = momentum * m + g; w -= lr * m.
struct SgdStep {
  float lr = 0, momentum = 0.9F, weight_decay = 0;
};

/// A 3x3 convolution with padding 1 over n samples of c x h x w: the
/// output is h_out x w_out. Its im2col matrix is (c * 9) x (n * h_out *
/// w_out): row (ci * 9 + ky * 3 + kx), column (i * h_out + y) * w_out + x.
struct ConvShape {
  int n = 0, c = 0, h = 0, w = 0, stride = 1;
  [[nodiscard]] int out_h() const noexcept { return (h - 1) / stride + 1; }
  [[nodiscard]] int out_w() const noexcept { return (w - 1) / stride + 1; }
  /// Columns of the im2col matrix: every output position of every sample.
  [[nodiscard]] std::size_t columns() const noexcept {
    return static_cast<std::size_t>(n) * static_cast<std::size_t>(out_h()) * static_cast<std::size_t>(out_w());
  }
};

/// BatchNorm over the rows of a c x m matrix (a channel's m values: every
/// sample's every pixel, the CNN's "CNHW" layout), PyTorch's definitions:
/// y = gamma * (x - mean) / sqrt(var + eps) + beta with the biased batch
/// variance; running_var takes the unbiased one; momentum 0.1.
struct BatchNormArgs {
  int c = 0;
  std::size_t m = 0;
  float eps = 1e-5F, momentum = 0.1F;
  float count = 0;               ///< samples behind `sums` (m, or m over every worker with SyncBN)
  bool relu = true;              ///< y = max(0, ...)
  const float* gamma = nullptr;  ///< c
  const float* beta = nullptr;   ///< c
  float *running_mean = nullptr, *running_var = nullptr;  ///< c each
  float* invstd = nullptr;  ///< c: written by forward (1 / sqrt(var + eps)), read by backward
};

class DeviceBackend {
 public:
  DeviceBackend() = default;
  DeviceBackend(const DeviceBackend&) = delete;
  DeviceBackend& operator=(const DeviceBackend&) = delete;
  virtual ~DeviceBackend() = default;

  [[nodiscard]] virtual BackendKind kind() const noexcept = 0;
  /// "cpu:0", "cuda:1 (NVIDIA H200)".
  [[nodiscard]] virtual std::string name() const = 0;
  /// The CUDA device index, or -1 when the backend is not a GPU: what a
  /// loader feeding it registers its slots with.
  [[nodiscard]] virtual int cuda_device() const noexcept { return -1; }
  /// How host memory that this device copies from is pinned: registration
  /// with the driver for a GPU, mlock for the CPU (its copies are memcpy).
  [[nodiscard]] virtual memory::PinMethod host_pin_method() const noexcept = 0;
  /// Makes this backend's device current on the calling thread: call it at
  /// the top of every thread that will touch the device (a thread with no
  /// current device would create device 0's context on its first CUDA call).
  virtual void make_current() {}
  /// make_current() until the returned token goes, then the thread's
  /// previous device again: for calls on threads of another library
  /// (Python's), whose current device must not change under it.
  [[nodiscard]] virtual std::shared_ptr<void> scoped_current() { return nullptr; }

  /// Device memory (zeroed). Throws OutOfMemory / CudaError.
  virtual DeviceBuffer allocate(std::size_t bytes) = 0;
  virtual std::unique_ptr<Stream> create_stream() = 0;
  /// A stream for copies, collectives and element-wise kernels: without the
  /// per-stream state BatchNorm needs (Note [One stream, one workspace] in
  /// the CUDA backend; BatchNorm on it throws). A plain stream where a
  /// backend keeps no such state.
  virtual std::unique_ptr<Stream> create_copy_stream() { return create_stream(); }
  virtual std::shared_ptr<Event> create_event() = 0;

  /// Asynchronous copies: `src` must stay valid and unchanged until an event
  /// recorded after the copy is ready (pinned host memory on CUDA makes the
  /// copy truly asynchronous; pageable memory is staged by the driver).
  virtual void copy_h2d(Stream& s, void* dst, const void* src, std::size_t bytes) = 0;
  virtual void copy_d2h(Stream& s, void* dst, const void* src, std::size_t bytes) = 0;
  virtual void copy_d2d(Stream& s, void* dst, const void* src, std::size_t bytes) = 0;
  /// Marks the point in `s` that `e` completes at (re-recording resets it).
  virtual void record(Event& e, Stream& s) = 0;
  /// Work enqueued on `s` after this waits until `e` is complete.
  virtual void stream_wait(Stream& s, Event& e) = 0;
  /// Blocks until everything enqueued on `s` has run; rethrows its error.
  virtual void synchronize(Stream& s) = 0;
  /// Runs `f` on a host thread when `s` reaches this point (the work before
  /// it done); the stream waits for it. `f` must be short and must not call
  /// the backend (CUDA forbids it in a host function). For timings.
  virtual void host_callback(Stream& s, std::function<void()> f) = 0;

  // Consumers outside pinfeed (Note [Consumer streams] in device_feed.hpp).
  // `consumer` names one: on CUDA a cudaStream_t of another library (torch's
  // current stream), 0 its legacy default stream; on the CPU a Stream of
  // this backend (tests, to model asynchronous consumers), or 0: the
  // calling host thread.
  /// Work the consumer enqueues after this waits for `e`. On the CPU with
  /// consumer 0 the calling thread blocks until `e` is complete.
  virtual void consumer_wait(std::uintptr_t consumer, Event& e) = 0;
  /// Records `e` at the current end of the consumer's work: once it is
  /// complete, memory the consumer was reading is free. On the CPU with
  /// consumer 0 the host thread is done already, and `e` completes at once.
  virtual void consumer_record(std::uintptr_t consumer, Event& e) = 0;

  // Math, enqueued on a stream. Pointers are device pointers.
  virtual void gemm(Stream& s, const Gemm& g) = 0;
  /// uint8 NHWC (RGB) -> float32 NCHW, (x / 255 - mean) / std.
  virtual void normalize_u8(Stream& s, const std::uint8_t* nhwc, float* nchw, int n, int h, int w,
                            const Normalization& norm) = 0;
  /// normalize_u8 into `type`: float32, or float16 / bfloat16 rounded to
  /// nearest even from the float32 value (as torch's .to(dtype)).
  virtual void normalize_u8_as(Stream& s, const std::uint8_t* nhwc, void* nchw, FloatType type, int n, int h, int w,
                               const Normalization& norm) = 0;
  /// int32 labels -> int64 (what torch's losses take).
  virtual void widen_labels(Stream& s, const std::int32_t* in, std::int64_t* out, std::size_t n) = 0;
  /// Average pooling by `factor` in both axes, NCHW in, n x (c*h/f*w/f) out.
  virtual void avg_pool(Stream& s, const float* nchw, float* out, int n, int c, int h, int w, int factor) = 0;
  /// z (n x d) += bias per column; a = relu(z) when `relu`, else a = z.
  virtual void bias_activation(Stream& s, float* z, const float* bias, float* a, int n, int d, bool relu) = 0;
  /// grad *= (z > 0).
  virtual void relu_backward(Stream& s, float* grad, const float* z, std::size_t count) = 0;
  /// db (d) += column sums of dz (n x d).
  virtual void bias_grad(Stream& s, const float* dz, float* db, int n, int d) = 0;
  /// Softmax cross-entropy over logits (n x k), labels in [0, k): adds the
  /// summed loss and the count of correct predictions to stats[0], stats[1],
  /// and, unless dlogits is null (validation), writes
  /// dlogits = scale * (softmax - onehot) / n.
  virtual void softmax_cross_entropy(Stream& s, const float* logits, const std::int32_t* labels, int n, int k,
                                     float scale, float* dlogits, float* stats) = 0;
  virtual void sgd(Stream& s, float* w, float* grad, float* momentum, std::size_t count, const SgdStep& step) = 0;

  // The CNN's layers (cnn.hpp). Activations are "CNHW": channel-major, so
  // a convolution is one GEMM and BatchNorm reduces contiguous rows.
  /// The im2col matrix of `x` (ConvShape), element (c, i, y, x) of `x` at
  /// c * c_stride + i * n_stride + y * w + x: NCHW input or CNHW activations.
  virtual void im2col(Stream& s, const float* x, std::size_t c_stride, std::size_t n_stride, const ConvShape& shape,
                      float* col) = 0;
  /// The adjoint of im2col into CNHW `dx` (overwritten): each element of dx
  /// is the sum of the col entries that read it, in a fixed order.
  virtual void col2im(Stream& s, const float* col, const ConvShape& shape, float* dx) = 0;
  /// Per row of x (c x m): sums[r] = sum, sums[c + r] = sum of squares.
  virtual void bn_stats(Stream& s, const float* x, int c, std::size_t m, float* sums) = 0;
  /// Training (`sums` from bn_stats over `a.count` values: updates the
  /// running statistics) or evaluation (`sums` null: the running ones).
  /// Writes xhat (unless null), y and a.invstd.
  virtual void bn_forward(Stream& s, const float* x, const float* sums, const BatchNormArgs& a, float* xhat,
                          float* y) = 0;
  /// dy (gradient at y) *= (y > 0) when a.relu; red[r] = row sums of dy,
  /// red[c + r] = row sums of dy * xhat; dgamma += red[c..], dbeta += red[..c].
  virtual void bn_backward_reduce(Stream& s, float* dy, const float* y, const float* xhat, const BatchNormArgs& a,
                                  float* red, float* dgamma, float* dbeta) = 0;
  /// dx = gamma * invstd * (dy - red[r] / count - xhat * red[c + r] / count),
  /// `red` summed over every worker with SyncBN.
  virtual void bn_backward_input(Stream& s, const float* dy, const float* xhat, const float* red,
                                 const BatchNormArgs& a, float* dx) = 0;
  /// Global average pooling: x (c x n x hw, CNHW) -> out (n x c).
  virtual void channel_mean(Stream& s, const float* x, int c, int n, std::size_t hw, float* out) = 0;
  /// Its adjoint: dx (c x n x hw) = dout (n x c) / hw, broadcast.
  virtual void channel_mean_backward(Stream& s, const float* dout, int c, int n, std::size_t hw, float* dx) = 0;
  virtual void scale(Stream& s, float* x, std::size_t count, float factor) = 0;
  virtual void fill(Stream& s, float* x, std::size_t count, float value) = 0;

 protected:
  friend class DeviceBuffer;
  virtual void free(void* ptr, std::size_t bytes) noexcept = 0;
};

inline DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr && backend_ != nullptr) backend_->free(ptr_, bytes_);
}

}  // namespace pinfeed::trainer
