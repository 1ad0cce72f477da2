// The MLP: average pool, fully connected layers, ReLU; its ModelType row.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/sample_rng.hpp"
#include "pinfeed/trainer/model.hpp"

namespace pinfeed::trainer {

namespace {

void validate_mlp(const ModelConfig& c) {
  if (c.pool < 1 || c.image_size % c.pool != 0) {
    throw ConfigError(fmt::format("model pool {} must divide the image size {}", c.pool, c.image_size));
  }
  for (const int h : c.hidden) {
    if (h < 1 || h > 65536) throw ConfigError(fmt::format("model hidden width must be 1..65536, got {}", h));
  }
  if (static_cast<long long>(c.input_features()) > 16'777'216) {
    throw ConfigError(fmt::format("model input of {} features is too large: raise pool", c.input_features()));
  }
}

std::unique_ptr<Model> make_mlp(DeviceBackend& backend, const ModelConfig& config, int max_batch) {
  return std::make_unique<Mlp>(backend, config, max_batch);
}

}  // namespace

const ModelType& mlp_model_type() {
  static const ModelType t{ModelKind::mlp,
                           "mlp",
                           "W,W...",
                           &ModelConfig::hidden,
                           /*uses_pool=*/true,
                           /*uses_batch_norm=*/false,
                           {"--hidden", "--pool"},
                           validate_mlp,
                           make_mlp};
  return t;
}

Mlp::Mlp(DeviceBackend& backend, ModelConfig config, int max_batch) : Model(backend, std::move(config), max_batch) {
  dims_.push_back(config_.input_features());
  for (const int h : config_.hidden) dims_.push_back(h);
  dims_.push_back(config_.classes);
  int widest = 0;
  for (std::size_t l = 1; l < dims_.size(); ++l) {
    const auto in = static_cast<std::size_t>(dims_[l - 1]), out = static_cast<std::size_t>(dims_[l]);
    add_param(fmt::format("fc{}.weight", l), in * out);
    add_param(fmt::format("fc{}.bias", l), out);
  }
  for (const int d : dims_) widest = std::max(widest, d);
  allocate_params();
  const auto mb = static_cast<std::size_t>(max_batch);
  for (std::size_t l = 0; l < dims_.size(); ++l) {
    a_.push_back(floats(mb * static_cast<std::size_t>(dims_[l])));
    z_.push_back(l == 0 ? DeviceBuffer() : floats(mb * static_cast<std::size_t>(dims_[l])));
  }
  dz_ = floats(mb * static_cast<std::size_t>(widest));
  da_ = floats(mb * static_cast<std::size_t>(widest));
}

std::vector<float> Mlp::initial_weights(std::uint64_t seed) const {
  std::vector<float> w(count_);
  for (std::size_t l = 1; l < dims_.size(); ++l) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(dims_[l - 1]));
    for (std::size_t p : {2 * (l - 1), 2 * (l - 1) + 1}) {
      loader::SampleRng rng(seed, 0x6d6f64656cULL, p);  // "model"
      const ParamInfo& info = params_[p];
      for (std::size_t i = 0; i < info.count; ++i) w[info.offset + i] = static_cast<float>(rng.uniform(-bound, bound));
    }
  }
  return w;
}

void Mlp::forward(Stream& s, const float* images, int n) {
  check_batch(n);
  backend_.avg_pool(s, images, a_[0].as<float>(), n, 3, config_.image_size, config_.image_size, config_.pool);
  const std::size_t layers = dims_.size() - 1;
  for (std::size_t l = 1; l <= layers; ++l) {
    const ParamInfo& w = params_[2 * (l - 1)];
    const ParamInfo& b = params_[2 * (l - 1) + 1];
    Gemm g;
    g.trans_b = true;  // Z = A W^T
    g.m = n;
    g.n = dims_[l];
    g.k = dims_[l - 1];
    g.a = a_[l - 1].as<float>();
    g.lda = dims_[l - 1];
    g.b = weights() + w.offset;
    g.ldb = dims_[l - 1];
    g.c = z_[l].as<float>();
    g.ldc = dims_[l];
    backend_.gemm(s, g);
    backend_.bias_activation(s, z_[l].as<float>(), weights() + b.offset, a_[l].as<float>(), n, dims_[l], l < layers);
  }
}

void Mlp::train_step(Stream& s, const float* images, const std::int32_t* labels, int n, float loss_scale, float* stats,
                     const GradReady& ready) {
  forward(s, images, n);
  const std::size_t layers = dims_.size() - 1;
  float* dz = dz_.as<float>();
  float* da = da_.as<float>();
  backend_.softmax_cross_entropy(s, a_[layers].as<float>(), labels, n, config_.classes, loss_scale, dz, stats);
  if (forward_hook_) forward_hook_(s);
  for (std::size_t l = layers; l >= 1; --l) {
    const ParamInfo& w = params_[2 * (l - 1)];
    const ParamInfo& b = params_[2 * (l - 1) + 1];
    Gemm gw;  // dW += dZ^T A
    gw.trans_a = true;
    gw.m = dims_[l];
    gw.n = dims_[l - 1];
    gw.k = n;
    gw.a = dz;
    gw.lda = dims_[l];
    gw.b = a_[l - 1].as<float>();
    gw.ldb = dims_[l - 1];
    gw.beta = 1;
    gw.c = grads() + w.offset;
    gw.ldc = dims_[l - 1];
    backend_.gemm(s, gw);
    backend_.bias_grad(s, dz, grads() + b.offset, n, dims_[l]);
    if (l > 1) {
      Gemm gx;  // dA = dZ W
      gx.m = n;
      gx.n = dims_[l - 1];
      gx.k = dims_[l];
      gx.a = dz;
      gx.lda = dims_[l];
      gx.b = weights() + w.offset;
      gx.ldb = dims_[l - 1];
      gx.c = da;
      gx.ldc = dims_[l - 1];
      backend_.gemm(s, gx);
      backend_.relu_backward(s, da, z_[l - 1].as<float>(),
                             static_cast<std::size_t>(n) * static_cast<std::size_t>(dims_[l - 1]));
      std::swap(dz, da);
    }
    // Bias first: backward produces parameters in reverse order.
    if (ready) {
      ready(2 * (l - 1) + 1);
      ready(2 * (l - 1));
    }
  }
}

void Mlp::evaluate(Stream& s, const float* images, const std::int32_t* labels, int n, float* stats) {
  forward(s, images, n);
  backend_.softmax_cross_entropy(s, a_.back().as<float>(), labels, n, config_.classes, 1.0F, nullptr, stats);
}

}  // namespace pinfeed::trainer
