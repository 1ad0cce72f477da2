#pragma once
// One channel's BatchNorm statistics, shared by the CPU backend
// (cpu_backend.cpp) and the CUDA kernel (cuda_kernels.cu) so that the two
// cannot drift: the mean and the biased variance the forward pass
// normalizes with, from the batch's sums (training, which also moves the
// running statistics by `momentum`, with the unbiased variance, as
// torch.nn.BatchNorm2d does) or from the running statistics (evaluation,
// sums == nullptr). `Args` is the backend's argument struct (BatchNormArgs,
// kernels::BatchNorm): c, count, momentum, running_mean, running_var.
#if defined(__CUDACC__)
#define PINFEED_HOST_DEVICE __host__ __device__
#else
#define PINFEED_HOST_DEVICE
#endif

namespace pinfeed::trainer {

struct ChannelMoments {
  double mean;
  double var;
};

/// `sums` holds c sums then c sums of squares (a null pointer in evaluation).
template <typename Args>
PINFEED_HOST_DEVICE inline ChannelMoments batch_norm_moments(const float* sums, const Args& a, int r) {
  if (sums == nullptr) return {a.running_mean[r], a.running_var[r]};
  const double mean = static_cast<double>(sums[r]) / a.count;
  const double raw = static_cast<double>(sums[a.c + r]) / a.count - mean * mean;
  const double var = raw > 0.0 ? raw : 0.0;  // rounding can take it below 0 (and NaN to 0)
  const double unbiased = a.count > 1 ? var * a.count / (a.count - 1) : var;
  a.running_mean[r] = static_cast<float>((1 - a.momentum) * a.running_mean[r] + a.momentum * mean);
  a.running_var[r] = static_cast<float>((1 - a.momentum) * a.running_var[r] + a.momentum * unbiased);
  return {mean, var};
}

}  // namespace pinfeed::trainer

#undef PINFEED_HOST_DEVICE
