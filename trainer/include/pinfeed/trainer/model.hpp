#pragma once
// The reference model: a small image classifier that really learns the
// classes `pinfeed-data make` writes. The image (float32 NCHW, normalized)
// is average-pooled by `pool` in both axes, flattened, and fed to an MLP:
// Linear -> ReLU -> ... -> Linear -> softmax cross-entropy. Matrix products
// go through the backend's gemm (cuBLAS on a GPU, OpenBLAS on the CPU).
//
// Parameters live in one flat device buffer, in forward order (W1, b1, W2,
// b2, ...; W is out x in, as torch.nn.Linear), and so do their gradients:
// a DDP bucket is then one contiguous range (see ddp.hpp).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "pinfeed/trainer/device_backend.hpp"

namespace pinfeed::trainer {

struct ModelConfig {
  int image_size = 224;          ///< the loader's output side (square)
  int pool = 8;                  ///< average pooling factor before the MLP (image_size % pool == 0)
  std::vector<int> hidden{256};  ///< hidden layer widths
  int classes = 10;              ///< output classes
  void validate() const;         ///< ConfigError naming the field
  [[nodiscard]] int input_features() const noexcept { return 3 * (image_size / pool) * (image_size / pool); }
};

struct ParamInfo {
  std::string name;         ///< "fc1.weight", "fc1.bias", ...
  std::size_t offset = 0;   ///< in floats, into the flat buffers
  std::size_t count = 0;
};

class Mlp {
 public:
  /// Allocates parameters, gradients, momentum and activations for batches
  /// of up to `max_batch` samples on `backend`. Parameters start at zero:
  /// call load() (rank 0's initial weights come from initial_weights()).
  Mlp(DeviceBackend& backend, ModelConfig config, int max_batch);

  [[nodiscard]] const ModelConfig& config() const noexcept { return config_; }
  [[nodiscard]] const std::vector<ParamInfo>& params() const noexcept { return params_; }
  [[nodiscard]] std::size_t param_count() const noexcept { return count_; }
  [[nodiscard]] float* weights() const noexcept { return weights_.as<float>(); }
  [[nodiscard]] float* grads() const noexcept { return grads_.as<float>(); }
  [[nodiscard]] float* momentum() const noexcept { return momentum_.as<float>(); }

  /// torch.nn.Linear's default initialization (uniform +-1/sqrt(fan_in) for
  /// weights and biases) from a fixed, platform-independent generator.
  [[nodiscard]] std::vector<float> initial_weights(std::uint64_t seed) const;

  /// Called with a parameter's index once its gradient is complete, in
  /// reverse parameter order, on the compute stream's timeline.
  using GradReady = std::function<void(std::size_t param)>;

  /// Forward and backward for one batch already on the device: `images`
  /// float32 NCHW (n x 3 x S x S), labels int32. Gradients are ADDED to
  /// grads() (zero them with zero_grad()), scaled by `loss_scale` (1/k for
  /// k accumulation steps). Adds summed loss and correct count to stats[0..1].
  void train_step(Stream& s, const float* images, const std::int32_t* labels, int n, float loss_scale, float* stats,
                  const GradReady& ready);
  /// Forward only (validation): adds summed loss and correct count to stats.
  void evaluate(Stream& s, const float* images, const std::int32_t* labels, int n, float* stats);
  void zero_grad(Stream& s);
  /// One SGD step over every parameter.
  void sgd(Stream& s, const SgdStep& step);

 private:
  void forward(Stream& s, const float* images, int n);

  DeviceBackend& backend_;
  ModelConfig config_;
  int max_batch_;
  std::vector<int> dims_;  // input features, hidden..., classes
  std::vector<ParamInfo> params_;
  std::size_t count_ = 0;
  DeviceBuffer weights_, grads_, momentum_;
  std::vector<DeviceBuffer> z_, a_;  // per layer: pre-activation and activation (a_[0] = pooled input)
  DeviceBuffer dz_, da_;             // backward scratch, widest layer
};

}  // namespace pinfeed::trainer
