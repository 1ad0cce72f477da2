#pragma once
// Launchers for the trainer's CUDA kernels (cuda_kernels.cu). Each enqueues
// on `stream` and returns the launch status (cudaGetLastError).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace pinfeed::trainer::kernels {

cudaError_t avg_pool(cudaStream_t s, const float* nchw, float* out, int n, int c, int h, int w, int factor);
cudaError_t bias_activation(cudaStream_t s, float* z, const float* bias, float* a, int n, int d, bool relu);
cudaError_t relu_backward(cudaStream_t s, float* grad, const float* z, std::size_t count);
cudaError_t bias_grad(cudaStream_t s, const float* dz, float* db, int n, int d);
cudaError_t softmax_cross_entropy(cudaStream_t s, const float* logits, const std::int32_t* labels, int n, int k,
                                  float scale, float* dlogits, float* stats);
cudaError_t sgd(cudaStream_t s, float* w, float* grad, float* momentum, std::size_t count, float lr, float mom,
                float wd);
cudaError_t scale(cudaStream_t s, float* x, std::size_t count, float factor);
cudaError_t fill(cudaStream_t s, float* x, std::size_t count, float value);
/// `type`: 0 float32, 1 float16, 2 bfloat16 (FloatType's values).
cudaError_t normalize_u8_as(cudaStream_t s, const std::uint8_t* nhwc, void* nchw, int type, int n, int h, int w,
                            const float scale[3], const float bias[3]);
cudaError_t widen_labels(cudaStream_t s, const std::int32_t* in, std::int64_t* out, std::size_t n);

/// The CNN's layers (DeviceBackend's im2col ... channel_mean_backward).
struct Conv {
  int n, c, h, w, stride, oh, ow;
};
struct BatchNorm {
  int c;
  std::size_t m;
  float eps, momentum, count;
  bool relu;
  const float* gamma;
  const float* beta;
  float* running_mean;
  float* running_var;
  float* invstd;
};
cudaError_t im2col(cudaStream_t s, const float* x, std::size_t c_stride, std::size_t n_stride, Conv shape, float* col);
cudaError_t col2im(cudaStream_t s, const float* col, Conv shape, float* dx);
/// BatchNorm's workspace, in doubles: one per stream, allocated with it
/// (Note [One stream, one workspace], cuda_backend_impl.hpp); `work` below.
/// The kernels of one stream use it in turn.
std::size_t bn_workspace_doubles();
cudaError_t bn_stats(cudaStream_t s, const float* x, int c, std::size_t m, float* sums, double* work);
cudaError_t bn_forward(cudaStream_t s, const float* x, const float* sums, BatchNorm a, float* xhat, float* y,
                       double* work);
cudaError_t bn_backward_reduce(cudaStream_t s, float* dy, const float* y, const float* xhat, BatchNorm a, float* red,
                               float* dgamma, float* dbeta, double* work);
cudaError_t bn_backward_input(cudaStream_t s, const float* dy, const float* xhat, const float* red, BatchNorm a,
                              float* dx);
cudaError_t channel_mean(cudaStream_t s, const float* x, int c, int n, std::size_t hw, float* out);
cudaError_t channel_mean_backward(cudaStream_t s, const float* dout, int c, int n, std::size_t hw, float* dx);

}  // namespace pinfeed::trainer::kernels
