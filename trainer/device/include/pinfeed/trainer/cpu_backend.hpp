#pragma once
// CpuBackend: the DeviceBackend of machines without a GPU. "Device" memory is
// host memory; each Stream is a worker thread that runs its queue in order,
// so copies and math really run asynchronously to the thread that enqueues
// them, and events complete when the worker reaches them. Math is plain C++
// loops and OpenBLAS's cblas_sgemm (single-threaded: one rank is one thread).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "pinfeed/trainer/device_backend.hpp"

namespace pinfeed::trainer {

struct StreamSet;

struct CpuBackendConfig {
  int index = 0;                            ///< shown as "cpu:<index>"
  std::chrono::microseconds copy_delay{0};  ///< added to every copy: simulates a slow link (tests, demos)
  std::size_t max_queued = 4096;            ///< tasks a stream holds before enqueueing blocks
};

class CpuBackend final : public DeviceBackend {
 public:
  explicit CpuBackend(CpuBackendConfig config = {});
  ~CpuBackend() override;

  [[nodiscard]] BackendKind kind() const noexcept override { return BackendKind::cpu; }
  [[nodiscard]] std::string name() const override;
  [[nodiscard]] memory::PinMethod host_pin_method() const noexcept override { return memory::PinMethod::mlock; }
  /// Records the calling thread as driving this backend (a CUDA backend sets
  /// its device): calls from other threads are counted, so the CPU tests
  /// hold the rule the GPU needs (see calls_off_current()).
  void make_current() override;
  std::shared_ptr<void> scoped_current() override;

  DeviceBuffer allocate(std::size_t bytes) override;
  std::unique_ptr<Stream> create_stream() override;
  std::shared_ptr<Event> create_event() override;
  void copy_h2d(Stream& s, void* dst, const void* src, std::size_t bytes) override;
  void copy_d2h(Stream& s, void* dst, const void* src, std::size_t bytes) override;
  void copy_d2d(Stream& s, void* dst, const void* src, std::size_t bytes) override;
  void record(Event& e, Stream& s) override;
  void stream_wait(Stream& s, Event& e) override;
  void synchronize(Stream& s) override;
  void host_callback(Stream& s, std::function<void()> f) override;
  void consumer_wait(std::uintptr_t consumer, Event& e) override;
  void consumer_record(std::uintptr_t consumer, Event& e) override;

  void gemm(Stream& s, const Gemm& g) override;
  void normalize_u8(Stream& s, const std::uint8_t* nhwc, float* nchw, int n, int h, int w,
                    const Normalization& norm) override;
  void avg_pool(Stream& s, const float* nchw, float* out, int n, int c, int h, int w, int factor) override;
  void bias_activation(Stream& s, float* z, const float* bias, float* a, int n, int d, bool relu) override;
  void relu_backward(Stream& s, float* grad, const float* z, std::size_t count) override;
  void bias_grad(Stream& s, const float* dz, float* db, int n, int d) override;
  void softmax_cross_entropy(Stream& s, const float* logits, const std::int32_t* labels, int n, int k, float scale,
                             float* dlogits, float* stats) override;
  void sgd(Stream& s, float* w, float* grad, float* momentum, std::size_t count, const SgdStep& step) override;
  void scale(Stream& s, float* x, std::size_t count, float factor) override;
  void fill(Stream& s, float* x, std::size_t count, float value) override;
  void widen_labels(Stream& s, const std::int32_t* in, std::int64_t* out, std::size_t n) override;
  void normalize_u8_as(Stream& s, const std::uint8_t* nhwc, void* nchw, FloatType type, int n, int h, int w,
                       const Normalization& norm) override;
  void im2col(Stream& s, const float* x, std::size_t c_stride, std::size_t n_stride, const ConvShape& shape,
              float* col) override;
  void col2im(Stream& s, const float* col, const ConvShape& shape, float* dx) override;
  void bn_stats(Stream& s, const float* x, int c, std::size_t m, float* sums) override;
  void bn_forward(Stream& s, const float* x, const float* sums, const BatchNormArgs& a, float* xhat, float* y) override;
  void bn_backward_reduce(Stream& s, float* dy, const float* y, const float* xhat, const BatchNormArgs& a, float* red,
                          float* dgamma, float* dbeta) override;
  void bn_backward_input(Stream& s, const float* dy, const float* xhat, const float* red, const BatchNormArgs& a,
                         float* dx) override;
  void channel_mean(Stream& s, const float* x, int c, int n, std::size_t hw, float* out) override;
  void channel_mean_backward(Stream& s, const float* dout, int c, int n, std::size_t hw, float* dx) override;

  /// Runs `task` on the stream's worker, in order with the rest of its work
  /// (the CPU communicators run their collectives this way, on a comm stream).
  /// An exception from `task` becomes the stream's sticky error.
  void enqueue(Stream& s, std::function<void()> task);

  /// Allocations made by every CpuBackend of the process so far: tests hold
  /// that training allocates nothing once its collectives have begun (Note
  /// [No allocation during collectives] in trainer.cpp).
  [[nodiscard]] static std::uint64_t allocations() noexcept;
  /// Buffers freed (by any CpuBackend) while one of the backend's streams
  /// still had work queued or running. A CPU stream drains before it goes,
  /// which hides a teardown that frees too early; on a GPU that is a
  /// use-after-free. Logged; tests hold it at 0 through a failed run.
  [[nodiscard]] static std::uint64_t frees_with_work_pending() noexcept;
  /// Calls into any CpuBackend from a thread that had not made that backend
  /// current (DeviceBackend::make_current). On a GPU, a thread whose first
  /// CUDA call comes before cudaSetDevice creates a context on device 0: the
  /// CPU backend stands in for the device and counts them, so a thread added
  /// without make_current() fails the training tests. The first is logged.
  [[nodiscard]] static std::uint64_t calls_off_current() noexcept;

 protected:
  void free(void* ptr, std::size_t bytes) noexcept override;

 private:
  void note_thread() const noexcept;
  CpuBackendConfig config_;
  std::shared_ptr<StreamSet> streams_;  // every live stream of this backend
};

}  // namespace pinfeed::trainer
