// The reference model's element-wise kernels. Simple grid-stride loops: the
// model is small and these are a minor share of a step next to the GEMMs.
// bias_grad sums each column in a fixed order (one thread per column), so
// gradients are deterministic; only the loss/accuracy statistics use atomics.
#include "cuda_kernels.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace pinfeed::trainer::kernels {
namespace {

constexpr int kThreads = 256;

int blocks_for(std::size_t count) {
  const std::size_t b = (count + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 ? (b == 0 ? 1 : b) : 65535);
}

struct Channels {
  float scale[3], bias[3];
};

template <class T>
__device__ T from_float(float x);
template <>
__device__ float from_float<float>(float x) { return x; }
template <>
__device__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <class T>
__global__ void normalize_u8_kernel(const std::uint8_t* in, T* out, int n, int plane, Channels ch) {
  const std::size_t total = static_cast<std::size_t>(n) * plane * 3;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    // i indexes the output: ((sample * 3 + c) * plane + p)
    const std::size_t p = i % plane;
    const std::size_t c = (i / plane) % 3;
    const std::size_t sample = i / (static_cast<std::size_t>(plane) * 3);
    const float x = static_cast<float>(in[(sample * plane + p) * 3 + c]);
    out[i] = from_float<T>(x * ch.scale[c] + ch.bias[c]);
  }
}

__global__ void avg_pool_kernel(const float* in, float* out, int planes, int h, int w, int f) {
  const int oh = h / f, ow = w / f;
  const std::size_t total = static_cast<std::size_t>(planes) * oh * ow;
  const float inv = 1.0f / static_cast<float>(f * f);
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    const int x = static_cast<int>(i % ow);
    const int y = static_cast<int>((i / ow) % oh);
    const std::size_t plane = i / (static_cast<std::size_t>(oh) * ow);
    const float* src = in + plane * h * w + static_cast<std::size_t>(y * f) * w + x * f;
    float sum = 0;
    for (int dy = 0; dy < f; ++dy) {
      for (int dx = 0; dx < f; ++dx) sum += src[dy * w + dx];
    }
    out[i] = sum * inv;
  }
}

__global__ void bias_activation_kernel(float* z, const float* bias, float* a, int n, int d, bool relu) {
  const std::size_t total = static_cast<std::size_t>(n) * d;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    const float v = z[i] + bias[i % d];
    z[i] = v;
    a[i] = relu ? fmaxf(v, 0.0f) : v;
  }
}

__global__ void relu_backward_kernel(float* g, const float* z, std::size_t count) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    if (!(z[i] > 0)) g[i] = 0;
  }
}

__global__ void bias_grad_kernel(const float* dz, float* db, int n, int d) {
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < d; j += blockDim.x * gridDim.x) {
    float sum = 0;
    for (int i = 0; i < n; ++i) sum += dz[static_cast<std::size_t>(i) * d + j];
    db[j] += sum;
  }
}

__global__ void softmax_xent_kernel(const float* logits, const std::int32_t* labels, int n, int k, float scale,
                                    float* dlogits, float* stats) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
    const float* z = logits + static_cast<std::size_t>(i) * k;
    int best = 0;
    for (int j = 1; j < k; ++j) best = z[j] > z[best] ? j : best;
    const float zmax = z[best];
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += exp(static_cast<double>(z[j] - zmax));
    const int label = labels[i];
    const double loss = log(sum) - static_cast<double>(z[label] - zmax);
    atomicAdd(&stats[0], static_cast<float>(loss));
    if (best == label) atomicAdd(&stats[1], 1.0f);
    if (dlogits != nullptr) {
      float* g = dlogits + static_cast<std::size_t>(i) * k;
      const float f = scale / static_cast<float>(n);
      for (int j = 0; j < k; ++j) {
        const float p = static_cast<float>(exp(static_cast<double>(z[j] - zmax)) / sum);
        g[j] = f * (p - (j == label ? 1.0f : 0.0f));
      }
    }
  }
}

__global__ void sgd_kernel(float* w, const float* grad, float* m, std::size_t count, float lr, float mom, float wd) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    const float g = grad[i] + wd * w[i];
    m[i] = mom * m[i] + g;
    w[i] -= lr * m[i];
  }
}

__global__ void scale_kernel(float* x, std::size_t count, float f) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += static_cast<std::size_t>(blockDim.x) * gridDim.x) x[i] *= f;
}

__global__ void fill_kernel(float* x, std::size_t count, float v) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += static_cast<std::size_t>(blockDim.x) * gridDim.x) x[i] = v;
}

__global__ void widen_labels_kernel(const std::int32_t* in, std::int64_t* out, std::size_t n) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += static_cast<std::size_t>(blockDim.x) * gridDim.x) out[i] = in[i];
}

}  // namespace

cudaError_t normalize_u8_as(cudaStream_t s, const std::uint8_t* nhwc, void* nchw, int type, int n, int h, int w,
                            const float scale[3], const float bias[3]) {
  Channels ch{{scale[0], scale[1], scale[2]}, {bias[0], bias[1], bias[2]}};
  const std::size_t total = static_cast<std::size_t>(n) * h * w * 3;
  if (type == 1) {
    normalize_u8_kernel<__half><<<blocks_for(total), kThreads, 0, s>>>(nhwc, static_cast<__half*>(nchw), n, h * w, ch);
  } else if (type == 2) {
    normalize_u8_kernel<__nv_bfloat16>
        <<<blocks_for(total), kThreads, 0, s>>>(nhwc, static_cast<__nv_bfloat16*>(nchw), n, h * w, ch);
  } else {
    normalize_u8_kernel<float><<<blocks_for(total), kThreads, 0, s>>>(nhwc, static_cast<float*>(nchw), n, h * w, ch);
  }
  return cudaGetLastError();
}

cudaError_t avg_pool(cudaStream_t s, const float* nchw, float* out, int n, int c, int h, int w, int factor) {
  const std::size_t total = static_cast<std::size_t>(n) * c * (h / factor) * (w / factor);
  avg_pool_kernel<<<blocks_for(total), kThreads, 0, s>>>(nchw, out, n * c, h, w, factor);
  return cudaGetLastError();
}

cudaError_t bias_activation(cudaStream_t s, float* z, const float* bias, float* a, int n, int d, bool relu) {
  bias_activation_kernel<<<blocks_for(static_cast<std::size_t>(n) * d), kThreads, 0, s>>>(z, bias, a, n, d, relu);
  return cudaGetLastError();
}

cudaError_t relu_backward(cudaStream_t s, float* grad, const float* z, std::size_t count) {
  relu_backward_kernel<<<blocks_for(count), kThreads, 0, s>>>(grad, z, count);
  return cudaGetLastError();
}

cudaError_t bias_grad(cudaStream_t s, const float* dz, float* db, int n, int d) {
  bias_grad_kernel<<<blocks_for(static_cast<std::size_t>(d)), kThreads, 0, s>>>(dz, db, n, d);
  return cudaGetLastError();
}

cudaError_t softmax_cross_entropy(cudaStream_t s, const float* logits, const std::int32_t* labels, int n, int k,
                                  float scale, float* dlogits, float* stats) {
  softmax_xent_kernel<<<blocks_for(static_cast<std::size_t>(n)), kThreads, 0, s>>>(logits, labels, n, k, scale, dlogits, stats);
  return cudaGetLastError();
}

cudaError_t sgd(cudaStream_t s, float* w, float* grad, float* momentum, std::size_t count, float lr, float mom, float wd) {
  sgd_kernel<<<blocks_for(count), kThreads, 0, s>>>(w, grad, momentum, count, lr, mom, wd);
  return cudaGetLastError();
}

cudaError_t scale(cudaStream_t s, float* x, std::size_t count, float factor) {
  scale_kernel<<<blocks_for(count), kThreads, 0, s>>>(x, count, factor);
  return cudaGetLastError();
}

cudaError_t fill(cudaStream_t s, float* x, std::size_t count, float value) {
  fill_kernel<<<blocks_for(count), kThreads, 0, s>>>(x, count, value);
  return cudaGetLastError();
}

cudaError_t widen_labels(cudaStream_t s, const std::int32_t* in, std::int64_t* out, std::size_t n) {
  widen_labels_kernel<<<blocks_for(n), kThreads, 0, s>>>(in, out, n);
  return cudaGetLastError();
}

}  // namespace pinfeed::trainer::kernels
