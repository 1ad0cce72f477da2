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
cudaError_t sgd(cudaStream_t s, float* w, float* grad, float* momentum, std::size_t count, float lr, float mom, float wd);
cudaError_t scale(cudaStream_t s, float* x, std::size_t count, float factor);
cudaError_t fill(cudaStream_t s, float* x, std::size_t count, float value);
/// `type`: 0 float32, 1 float16, 2 bfloat16 (FloatType's values).
cudaError_t normalize_u8_as(cudaStream_t s, const std::uint8_t* nhwc, void* nchw, int type, int n, int h, int w,
                            const float scale[3], const float bias[3]);
cudaError_t widen_labels(cudaStream_t s, const std::int32_t* in, std::int64_t* out, std::size_t n);

}  // namespace pinfeed::trainer::kernels
