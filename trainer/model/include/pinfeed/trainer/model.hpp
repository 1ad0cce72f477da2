#pragma once
// The reference models: small image classifiers that really learn the
// classes `pinfeed-data make` writes, on both backends. Matrix products go
// through the backend's gemm (cuBLAS on a GPU, OpenBLAS on the CPU); the
// other layers are the backend's kernels (device_backend.hpp).
//   mlp  average pooling + an MLP: almost free, so a run is input-bound.
//   cnn  conv3x3 + BatchNorm + ReLU blocks: real compute, and BatchNorm's
//        per-worker statistics (or SyncBN's global ones) in data parallel.
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pinfeed/trainer/device_backend.hpp"

namespace pinfeed::trainer {

/// Which reference model: "mlp" (average pooling + MLP, the fast one that
/// leaves every run input-bound) or "cnn" (conv3x3 + BatchNorm + ReLU blocks,
/// each halving the resolution, global average pooling, a linear classifier).
enum class ModelKind { mlp, cnn };

struct ModelConfig {
  ModelKind kind = ModelKind::mlp;
  int image_size = 224;                    ///< the loader's output side (square)
  int pool = 8;                            ///< mlp: average pooling factor before the MLP (image_size % pool == 0)
  std::vector<int> hidden{256};            ///< mlp: hidden layer widths
  std::vector<int> channels{32, 64, 128};  ///< cnn: output channels of each block
  int classes = 10;                        ///< output classes
  bool sync_bn = false;                    ///< cnn: BatchNorm statistics over every worker (not part of the shape)
  void validate() const;                   ///< ConfigError naming the field
  [[nodiscard]] int input_features() const noexcept { return 3 * (image_size / pool) * (image_size / pool); }
  /// "mlp:256,128" or "cnn:32,64,128": what --model takes.
  [[nodiscard]] std::string spec() const;
  /// Sets kind and widths from a --model value; ConfigError naming it.
  void parse_spec(const std::string& spec);
};

class Model;

/// The model registry, as DeviceType is the devices': one row per kind,
/// defined by the model's own translation unit (mlp.cpp, cnn.cpp) and listed
/// in model_types() (model.cpp). Every
/// caller that decides something by the kind (validation, --model, the
/// flags that belong to one kind, --sync-bn, --compare's SyncBN curves, a
/// checkpoint's shape) asks the row, so a new model is one row and its class.
struct ModelType {
  ModelKind kind = ModelKind::mlp;
  std::string_view word;         ///< "mlp": --model's prefix, spec()'s
  std::string_view widths_help;  ///< "W,W...": what the widths after the colon are
  /// The widths "word:W,W" sets (ModelConfig::hidden, ::channels).
  std::vector<int> ModelConfig::*widths = nullptr;
  /// The model uses ModelConfig::pool (a checkpoint's pool must match).
  bool uses_pool = false;
  /// The model has BatchNorm: --sync-bn applies, --compare adds the SyncBN curve.
  bool uses_batch_norm = false;
  /// pinfeed-train's flags that only this kind reads ("--hidden", "--pool").
  std::vector<std::string_view> own_flags;
  /// The kind's own checks, after ModelConfig::validate()'s common ones.
  void (*validate)(const ModelConfig& config) = nullptr;
  std::unique_ptr<Model> (*make)(DeviceBackend& backend, const ModelConfig& config, int max_batch) = nullptr;
};

/// Every kind, in ModelKind's order.
std::span<const ModelType* const> model_types();
const ModelType& model_type(ModelKind kind);
/// The kind named `word`; ConfigError naming the known ones (with `what` first).
const ModelType& model_type(std::string_view word, std::string_view what);
/// Each kind's registration.
const ModelType& mlp_model_type();
const ModelType& cnn_model_type();

struct ParamInfo {
  std::string name;        ///< "fc1.weight", "bn2.bias", ...
  std::size_t offset = 0;  ///< in floats, into the flat buffers
  std::size_t count = 0;
};

/// Sums `count` floats of device memory over every worker, ordered on
/// stream `s` (SyncBN's statistics; DdpEngine::collective).
using AllReduceSum = std::function<void(Stream& s, float* data, std::size_t count)>;

/// A reference model. Parameters live in one flat device buffer, in forward
/// order, and so do their gradients and momentum: a DDP bucket is then one
/// contiguous range (see ddp.hpp). State that is not a parameter (BatchNorm
/// running statistics) lives in buffers(): checkpointed, not trained.
class Model {
 public:
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;
  virtual ~Model() = default;

  [[nodiscard]] const ModelConfig& config() const noexcept { return config_; }
  [[nodiscard]] const std::vector<ParamInfo>& params() const noexcept { return params_; }
  [[nodiscard]] std::size_t param_count() const noexcept { return count_; }
  [[nodiscard]] float* weights() const noexcept { return weights_.as<float>(); }
  [[nodiscard]] float* grads() const noexcept { return grads_.as<float>(); }
  [[nodiscard]] float* momentum() const noexcept { return momentum_.as<float>(); }
  /// Non-parameter state (running statistics), `buffer_count()` floats.
  [[nodiscard]] virtual std::size_t buffer_count() const noexcept { return 0; }
  [[nodiscard]] virtual float* buffers() const noexcept { return nullptr; }
  [[nodiscard]] virtual std::vector<float> initial_buffers() const { return {}; }

  /// PyTorch's default initialization (uniform +-1/sqrt(fan_in) for
  /// weights and biases; BatchNorm's scale 1 and shift 0) from a fixed,
  /// platform-independent generator.
  [[nodiscard]] virtual std::vector<float> initial_weights(std::uint64_t seed) const = 0;

  /// Called with a parameter's index once its gradient is complete, in
  /// reverse parameter order, on the compute stream's timeline.
  using GradReady = std::function<void(std::size_t param)>;

  /// Forward and backward for one batch already on the device: `images`
  /// float32 NCHW (n x 3 x S x S), labels int32. Gradients are ADDED to
  /// grads() (zero them with zero_grad()), scaled by `loss_scale` (1/k for
  /// k accumulation steps). Adds summed loss and correct count to stats[0..1].
  virtual void train_step(Stream& s, const float* images, const std::int32_t* labels, int n, float loss_scale,
                          float* stats, const GradReady& ready) = 0;
  /// Forward only, in evaluation mode (running statistics): adds summed
  /// loss and correct count to stats.
  virtual void evaluate(Stream& s, const float* images, const std::int32_t* labels, int n, float* stats) = 0;
  /// SyncBN: statistics summed over `world` workers through `sum` (called
  /// when config().sync_bn). Every model says what it does with it: a model
  /// without BatchNorm (its ModelType's uses_batch_norm false, so --sync-bn
  /// is refused before this) does nothing; a new BatchNorm model cannot
  /// silently ignore --sync-bn by inheriting a no-op.
  virtual void set_sync(int world, AllReduceSum sum) = 0;
  /// Called on the compute stream's timeline once forward and loss are
  /// enqueued in train_step (profiling marks).
  void set_forward_hook(std::function<void(Stream&)> hook) { forward_hook_ = std::move(hook); }
  void zero_grad(Stream& s);
  /// One SGD step over every parameter.
  void sgd(Stream& s, const SgdStep& step);

 protected:
  Model(DeviceBackend& backend, ModelConfig config, int max_batch);
  /// Adds a parameter of `count` floats named `name`; its index.
  std::size_t add_param(std::string name, std::size_t count);
  /// Allocates weights, gradients and momentum once every parameter is added.
  void allocate_params();
  [[nodiscard]] DeviceBuffer floats(std::size_t n) { return backend_.allocate(n * sizeof(float)); }
  void check_batch(int n) const;

  DeviceBackend& backend_;
  ModelConfig config_;
  int max_batch_;
  std::vector<ParamInfo> params_;
  std::size_t count_ = 0;
  DeviceBuffer weights_, grads_, momentum_;
  std::function<void(Stream&)> forward_hook_;
};

/// Average pooling by config.pool, then Linear -> ReLU -> ... -> Linear ->
/// softmax cross-entropy (W is out x in, as torch.nn.Linear).
class Mlp final : public Model {
 public:
  /// Allocates parameters, gradients, momentum and activations for batches
  /// of up to `max_batch` samples on `backend`. Parameters start at zero:
  /// copy initial_weights() in (rank 0's are broadcast).
  Mlp(DeviceBackend& backend, ModelConfig config, int max_batch);
  [[nodiscard]] std::vector<float> initial_weights(std::uint64_t seed) const override;
  void train_step(Stream& s, const float* images, const std::int32_t* labels, int n, float loss_scale, float* stats,
                  const GradReady& ready) override;
  void evaluate(Stream& s, const float* images, const std::int32_t* labels, int n, float* stats) override;
  void set_sync(int /*world*/, AllReduceSum /*sum*/) override {}  ///< no BatchNorm

 private:
  void forward(Stream& s, const float* images, int n);

  std::vector<int> dims_;            // input features, hidden..., classes
  std::vector<DeviceBuffer> z_, a_;  // per layer: pre-activation and activation (a_[0] = pooled input)
  DeviceBuffer dz_, da_;             // backward scratch, widest layer
};

/// The CNN (Note [The reference CNN] in cnn.cpp): per block, conv3x3
/// (stride 2, padding 1, no bias) -> BatchNorm -> ReLU; then global average
/// pooling and fc. Parameters: conv{k}.weight (out x in x 3 x 3, as
/// torch.nn.Conv2d), bn{k}.weight, bn{k}.bias, ..., fc.weight, fc.bias.
/// Buffers: bn{k}.running_mean, bn{k}.running_var per block.
class Cnn final : public Model {
 public:
  Cnn(DeviceBackend& backend, ModelConfig config, int max_batch);
  [[nodiscard]] std::vector<float> initial_weights(std::uint64_t seed) const override;
  [[nodiscard]] std::size_t buffer_count() const noexcept override { return buffer_count_; }
  [[nodiscard]] float* buffers() const noexcept override { return buffers_.as<float>(); }
  [[nodiscard]] std::vector<float> initial_buffers() const override;
  void train_step(Stream& s, const float* images, const std::int32_t* labels, int n, float loss_scale, float* stats,
                  const GradReady& ready) override;
  void evaluate(Stream& s, const float* images, const std::int32_t* labels, int n, float* stats) override;
  void set_sync(int world, AllReduceSum sum) override;

 private:
  struct Block {
    ConvShape shape;  // for max_batch (n is set per call)
    int out = 0;
    std::size_t conv = 0, gamma = 0, beta = 0;  // parameter indices
    std::size_t running = 0;                    // offset of its running_mean (then running_var) in buffers()
    DeviceBuffer col, z, xhat, y, invstd, sums, red;
  };
  void forward(Stream& s, const float* images, int n, bool training);
  /// Backward through the classifier head, into the last block's gradient.
  void backward_head(Stream& s, int n, const GradReady& ready);
  /// Backward through block `idx`; its input's gradient too unless it is the first.
  void backward_block(Stream& s, std::size_t idx, int n, const GradReady& ready);
  [[nodiscard]] BatchNormArgs bn_args(const Block& b, int n, bool training) const;

  std::vector<Block> blocks_;
  std::size_t fc_w_ = 0, fc_b_ = 0;
  std::size_t buffer_count_ = 0;
  DeviceBuffer buffers_;
  DeviceBuffer pooled_, logits_, dlogits_, dpooled_, g_, dz_;
  int world_ = 1;
  AllReduceSum sum_;
};

/// The model `config` names, for batches of up to `max_batch`.
std::unique_ptr<Model> make_model(DeviceBackend& backend, const ModelConfig& config, int max_batch);

}  // namespace pinfeed::trainer
