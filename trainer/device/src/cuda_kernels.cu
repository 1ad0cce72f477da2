// The reference model's element-wise kernels. Simple grid-stride loops: the
// model is small and these are a minor share of a step next to the GEMMs.
// bias_grad sums each column in a fixed order (one thread per column), so
// gradients are deterministic; only the loss/accuracy statistics use atomics.
#include "cuda_kernels.hpp"

#include "batch_norm_stats.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>

namespace pinfeed::trainer::kernels {
namespace {

constexpr int kThreads = 256;
// BatchNorm's partial sums (bn_stats, bn_backward_reduce): 4 MiB per backend.
constexpr std::size_t kBnWorkspaceDoubles = std::size_t{1} << 19;

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
__device__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <class T>
__global__ void normalize_u8_kernel(const std::uint8_t* in, T* out, int n, int plane, Channels ch) {
  const std::size_t total = static_cast<std::size_t>(n) * plane * 3;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    // i indexes the output: ((sample * 3 + c) * plane + p)
    const std::size_t p = i % plane;
    const std::size_t c = (i / plane) % 3;
    const std::size_t sample = i / (static_cast<std::size_t>(plane) * 3);
    const float x = static_cast<float>(in[(sample * plane + p) * 3 + c]);
    // Rounded as the host rounds (a multiply, then an add): nvcc would
    // contract x * scale + bias into one FMA, one ulp off the loader's
    // float output, which the device= tests compare bit for bit.
    out[i] = from_float<T>(__fadd_rn(__fmul_rn(x, ch.scale[c]), ch.bias[c]));
  }
}

__global__ void avg_pool_kernel(const float* in, float* out, int planes, int h, int w, int f) {
  const int oh = h / f, ow = w / f;
  const std::size_t total = static_cast<std::size_t>(planes) * oh * ow;
  const float inv = 1.0f / static_cast<float>(f * f);
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
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
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    const float v = z[i] + bias[i % d];
    z[i] = v;
    a[i] = relu ? fmaxf(v, 0.0f) : v;
  }
}

__global__ void relu_backward_kernel(float* g, const float* z, std::size_t count) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
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
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    const float g = grad[i] + wd * w[i];
    m[i] = mom * m[i] + g;
    w[i] -= lr * m[i];
  }
}

__global__ void scale_kernel(float* x, std::size_t count, float f) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x)
    x[i] *= f;
}

__global__ void fill_kernel(float* x, std::size_t count, float v) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x)
    x[i] = v;
}

__global__ void widen_labels_kernel(const std::int32_t* in, std::int64_t* out, std::size_t n) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x)
    out[i] = in[i];
}

// ---- the CNN's layers ------------------------------------------------------
// One thread per output element (im2col, col2im in gather form, the
// element-wise BatchNorm steps), one block per channel for the row
// reductions, summed in double in a fixed tree: deterministic.

__global__ void im2col_kernel(const float* x, std::size_t cs, std::size_t ns, Conv sh, float* col) {
  const std::size_t cols = static_cast<std::size_t>(sh.n) * sh.oh * sh.ow;
  const std::size_t total = static_cast<std::size_t>(sh.c) * 9 * cols;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    const std::size_t row = i / cols, j = i % cols;
    const int ci = static_cast<int>(row / 9), k = static_cast<int>(row % 9);
    const int sample = static_cast<int>(j / (static_cast<std::size_t>(sh.oh) * sh.ow));
    const int rem = static_cast<int>(j % (static_cast<std::size_t>(sh.oh) * sh.ow));
    const int iy = (rem / sh.ow) * sh.stride + k / 3 - 1, ix = (rem % sh.ow) * sh.stride + k % 3 - 1;
    const bool inside = iy >= 0 && iy < sh.h && ix >= 0 && ix < sh.w;
    col[i] = inside ? x[ci * cs + sample * ns + static_cast<std::size_t>(iy) * sh.w + ix] : 0.0f;
  }
}

__global__ void col2im_kernel(const float* col, Conv sh, float* dx) {
  const std::size_t cols = static_cast<std::size_t>(sh.n) * sh.oh * sh.ow;
  const std::size_t total = static_cast<std::size_t>(sh.c) * sh.n * sh.h * sh.w;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    const int ix = static_cast<int>(i % sh.w);
    const int iy = static_cast<int>((i / sh.w) % sh.h);
    const int sample = static_cast<int>((i / (static_cast<std::size_t>(sh.w) * sh.h)) % sh.n);
    const int ci = static_cast<int>(i / (static_cast<std::size_t>(sh.w) * sh.h * sh.n));
    float sum = 0;
    for (int k = 0; k < 9; ++k) {
      const int ty = iy + 1 - k / 3, tx = ix + 1 - k % 3;
      if (ty < 0 || tx < 0 || ty % sh.stride != 0 || tx % sh.stride != 0 || ty / sh.stride >= sh.oh ||
          tx / sh.stride >= sh.ow)
        continue;
      sum += col[(static_cast<std::size_t>(ci) * 9 + k) * cols +
                 (static_cast<std::size_t>(sample) * sh.oh + ty / sh.stride) * sh.ow + tx / sh.stride];
    }
    dx[i] = sum;
  }
}

/// Sums over the block of two per-thread doubles; thread 0 gets the totals.
__device__ void block_sum2(double& a, double& b) {
  __shared__ double sa[kThreads], sb[kThreads];
  sa[threadIdx.x] = a;
  sb[threadIdx.x] = b;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) {
      sa[threadIdx.x] += sa[threadIdx.x + half];
      sb[threadIdx.x] += sb[threadIdx.x + half];
    }
    __syncthreads();
  }
  a = sa[0];
  b = sb[0];
  __syncthreads();
}

// BatchNorm's reductions over each channel's m values (n * h * w: 3.2 M at
// 224 px and batch 256) run on `chunks` blocks per channel, not one: a CNN
// has 32-512 channels and an H100/H200 132 SMs. Each block sums a fixed
// slice into a partial (pass 1), one block per channel adds the partials in
// a fixed tree (pass 2): the same order every run, so results stay
// deterministic. `chunks` depends on m and c only, never on the GPU.
__device__ void bn_slice(std::size_t m, int chunks, int k, std::size_t& begin, std::size_t& end) {
  begin = m * static_cast<std::size_t>(k) / static_cast<std::size_t>(chunks);
  end = m * static_cast<std::size_t>(k + 1) / static_cast<std::size_t>(chunks);
}

/// Pass 1 of the statistics: part[(r * chunks + k) * 2 + {0, 1}] = the
/// sum and the sum of squares of slice k of channel r.
__global__ void bn_stats_partial_kernel(const float* x, std::size_t m, int chunks, double* part) {
  const int k = blockIdx.x, r = blockIdx.y;
  const float* row = x + static_cast<std::size_t>(r) * m;
  std::size_t begin = 0, end = 0;
  bn_slice(m, chunks, k, begin, end);
  double sum = 0, sq = 0;
  for (std::size_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    sum += row[j];
    sq += static_cast<double>(row[j]) * row[j];
  }
  block_sum2(sum, sq);
  if (threadIdx.x == 0) {
    part[(static_cast<std::size_t>(r) * chunks + k) * 2] = sum;
    part[(static_cast<std::size_t>(r) * chunks + k) * 2 + 1] = sq;
  }
}

/// Pass 2: channel r's partials, added in a fixed tree.
__device__ void bn_add_partials(const double* part, int chunks, int r, double& a, double& b) {
  a = 0;
  b = 0;
  for (int k = threadIdx.x; k < chunks; k += blockDim.x) {
    a += part[(static_cast<std::size_t>(r) * chunks + k) * 2];
    b += part[(static_cast<std::size_t>(r) * chunks + k) * 2 + 1];
  }
  block_sum2(a, b);
}

__global__ void bn_stats_finish_kernel(const double* part, int c, int chunks, float* sums) {
  const int r = blockIdx.x;
  double sum = 0, sq = 0;
  bn_add_partials(part, chunks, r, sum, sq);
  if (threadIdx.x == 0) {
    sums[r] = static_cast<float>(sum);
    sums[c + r] = static_cast<float>(sq);
  }
}

/// Per channel (one thread each): the mean and 1/std the forward pass uses,
/// from the batch's sums (training: the running statistics move) or from the
/// running statistics (evaluation, sums == nullptr).
__global__ void bn_finalize_kernel(const float* sums, BatchNorm a, float* mean_out) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= a.c) return;
  const ChannelMoments m = batch_norm_moments(sums, a, r);
  const double mean = m.mean, var = m.var;
  mean_out[r] = static_cast<float>(mean);
  a.invstd[r] = static_cast<float>(1.0 / sqrt(var + a.eps));
}

/// Element-wise: y = gamma * (x - mean) * invstd + beta (then ReLU).
__global__ void bn_apply_kernel(const float* x, const float* mean, BatchNorm a, float* xhat, float* y) {
  const std::size_t total = static_cast<std::size_t>(a.c) * a.m;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    const int r = static_cast<int>(i / a.m);
    const float h = (x[i] - mean[r]) * a.invstd[r];
    if (xhat != nullptr) xhat[i] = h;
    const float v = a.gamma[r] * h + a.beta[r];
    y[i] = a.relu ? fmaxf(v, 0.0f) : v;
  }
}

/// Pass 1 of the backward reductions: ReLU's mask applied to dy, then the
/// slice's sums of dy and of dy * xhat.
__global__ void bn_backward_partial_kernel(float* dy, const float* y, const float* xhat, BatchNorm a, int chunks,
                                           double* part) {
  const int k = blockIdx.x, r = blockIdx.y;
  const std::size_t first = static_cast<std::size_t>(r) * a.m;
  std::size_t begin = 0, end = 0;
  bn_slice(a.m, chunks, k, begin, end);
  double sum = 0, dot = 0;
  for (std::size_t j = first + begin + threadIdx.x; j < first + end; j += blockDim.x) {
    if (a.relu && !(y[j] > 0)) dy[j] = 0;
    sum += dy[j];
    dot += static_cast<double>(dy[j]) * xhat[j];
  }
  block_sum2(sum, dot);
  if (threadIdx.x == 0) {
    part[(static_cast<std::size_t>(r) * chunks + k) * 2] = sum;
    part[(static_cast<std::size_t>(r) * chunks + k) * 2 + 1] = dot;
  }
}

__global__ void bn_backward_finish_kernel(const double* part, int c, int chunks, float* red, float* dgamma,
                                          float* dbeta) {
  const int r = blockIdx.x;
  double sum = 0, dot = 0;
  bn_add_partials(part, chunks, r, sum, dot);
  if (threadIdx.x == 0) {
    red[r] = static_cast<float>(sum);
    red[c + r] = static_cast<float>(dot);
    dbeta[r] += red[r];
    dgamma[r] += red[c + r];
  }
}

__global__ void bn_backward_input_kernel(const float* dy, const float* xhat, const float* red, BatchNorm a, float* dx) {
  const std::size_t total = static_cast<std::size_t>(a.c) * a.m;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    const int r = static_cast<int>(i / a.m);
    const float k = a.gamma[r] * a.invstd[r];
    dx[i] = k * (dy[i] - red[r] / a.count - xhat[i] * (red[a.c + r] / a.count));
  }
}

__global__ void channel_mean_kernel(const float* x, int c, int n, std::size_t hw, float* out) {
  const std::size_t total = static_cast<std::size_t>(c) * n;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    const std::size_t sample = i / c, r = i % c;  // out is n x c
    const float* p = x + (r * n + sample) * hw;
    double sum = 0;
    for (std::size_t j = 0; j < hw; ++j) sum += p[j];
    out[i] = static_cast<float>(sum / static_cast<double>(hw));
  }
}

__global__ void channel_mean_backward_kernel(const float* dout, int c, int n, std::size_t hw, float* dx) {
  const std::size_t total = static_cast<std::size_t>(c) * n * hw;
  const float inv = 1.0f / static_cast<float>(hw);
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    const std::size_t plane = i / hw;  // r * n + sample
    const std::size_t r = plane / n, sample = plane % n;
    dx[i] = dout[sample * c + r] * inv;
  }
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
  softmax_xent_kernel<<<blocks_for(static_cast<std::size_t>(n)), kThreads, 0, s>>>(logits, labels, n, k, scale, dlogits,
                                                                                   stats);
  return cudaGetLastError();
}

cudaError_t sgd(cudaStream_t s, float* w, float* grad, float* momentum, std::size_t count, float lr, float mom,
                float wd) {
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

cudaError_t im2col(cudaStream_t s, const float* x, std::size_t c_stride, std::size_t n_stride, Conv shape, float* col) {
  const std::size_t total = static_cast<std::size_t>(shape.c) * 9 * shape.n * shape.oh * shape.ow;
  im2col_kernel<<<blocks_for(total), kThreads, 0, s>>>(x, c_stride, n_stride, shape, col);
  return cudaGetLastError();
}

cudaError_t col2im(cudaStream_t s, const float* col, Conv shape, float* dx) {
  const std::size_t total = static_cast<std::size_t>(shape.c) * shape.n * shape.h * shape.w;
  col2im_kernel<<<blocks_for(total), kThreads, 0, s>>>(col, shape, dx);
  return cudaGetLastError();
}

std::size_t bn_workspace_doubles() { return kBnWorkspaceDoubles; }

int bn_chunks(int c, std::size_t m) {
  // About 8 values per thread per block, at most 256 blocks per channel,
  // and never more partials than the workspace holds.
  const std::size_t wanted = (m + kThreads * 8 - 1) / (kThreads * 8);
  const std::size_t room = kBnWorkspaceDoubles / (2 * static_cast<std::size_t>(c > 0 ? c : 1));
  return static_cast<int>(std::max<std::size_t>(1, std::min<std::size_t>({wanted, 256, room})));
}

cudaError_t bn_stats(cudaStream_t s, const float* x, int c, std::size_t m, float* sums, double* work) {
  if (c == 0) return cudaSuccess;
  const int chunks = bn_chunks(c, m);
  bn_stats_partial_kernel<<<dim3(chunks, c), kThreads, 0, s>>>(x, m, chunks, work);
  bn_stats_finish_kernel<<<c, kThreads, 0, s>>>(work, c, chunks, sums);
  return cudaGetLastError();
}

cudaError_t bn_forward(cudaStream_t s, const float* x, const float* sums, BatchNorm a, float* xhat, float* y,
                       double* work) {
  if (a.c == 0) return cudaSuccess;
  // The per-channel means go in the workspace (read after; floats in it).
  float* mean = reinterpret_cast<float*>(work);
  bn_finalize_kernel<<<(a.c + kThreads - 1) / kThreads, kThreads, 0, s>>>(sums, a, mean);
  bn_apply_kernel<<<blocks_for(static_cast<std::size_t>(a.c) * a.m), kThreads, 0, s>>>(x, mean, a, xhat, y);
  return cudaGetLastError();
}

cudaError_t bn_backward_reduce(cudaStream_t s, float* dy, const float* y, const float* xhat, BatchNorm a, float* red,
                               float* dgamma, float* dbeta, double* work) {
  if (a.c == 0) return cudaSuccess;
  const int chunks = bn_chunks(a.c, a.m);
  bn_backward_partial_kernel<<<dim3(chunks, a.c), kThreads, 0, s>>>(dy, y, xhat, a, chunks, work);
  bn_backward_finish_kernel<<<a.c, kThreads, 0, s>>>(work, a.c, chunks, red, dgamma, dbeta);
  return cudaGetLastError();
}

cudaError_t bn_backward_input(cudaStream_t s, const float* dy, const float* xhat, const float* red, BatchNorm a,
                              float* dx) {
  bn_backward_input_kernel<<<blocks_for(static_cast<std::size_t>(a.c) * a.m), kThreads, 0, s>>>(dy, xhat, red, a, dx);
  return cudaGetLastError();
}

cudaError_t channel_mean(cudaStream_t s, const float* x, int c, int n, std::size_t hw, float* out) {
  channel_mean_kernel<<<blocks_for(static_cast<std::size_t>(c) * n), kThreads, 0, s>>>(x, c, n, hw, out);
  return cudaGetLastError();
}

cudaError_t channel_mean_backward(cudaStream_t s, const float* dout, int c, int n, std::size_t hw, float* dx) {
  channel_mean_backward_kernel<<<blocks_for(static_cast<std::size_t>(c) * n * hw), kThreads, 0, s>>>(dout, c, n, hw,
                                                                                                     dx);
  return cudaGetLastError();
}

}  // namespace pinfeed::trainer::kernels
