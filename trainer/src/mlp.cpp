#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>

#include "pinfeed/enum_words.hpp"
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
  static const ModelType t{ModelKind::mlp, "mlp", "W,W...", &ModelConfig::hidden, /*uses_pool=*/true,
                           /*uses_batch_norm=*/false, {"--hidden", "--pool"}, validate_mlp, make_mlp};
  return t;
}

std::span<const ModelType* const> model_types() {
  static const std::array<const ModelType*, 2> types{&mlp_model_type(), &cnn_model_type()};
  return types;
}

const ModelType& model_type(ModelKind kind) {
  for (const ModelType* t : model_types()) {
    if (t->kind == kind) return *t;
  }
  throw ConfigError("model: unknown kind");
}

const ModelType& model_type(std::string_view word, std::string_view what) {
  std::vector<std::string> forms;
  for (const ModelType* t : model_types()) {
    if (t->word == word) return *t;
    forms.push_back(fmt::format("{}[:{}]", t->word, t->widths_help));
  }
  throw ConfigError(fmt::format("{}: expected {} (e.g. cnn:32,64,128)", what, join_list(forms, "or")));
}

void ModelConfig::validate() const {
  if (image_size < 1 || image_size > 4096) throw ConfigError(fmt::format("model image_size must be 1..4096, got {}", image_size));
  if (classes < 2) throw ConfigError(fmt::format("model classes must be >= 2, got {}", classes));
  model_type(kind).validate(*this);
}

std::string ModelConfig::spec() const {
  const ModelType& t = model_type(kind);
  return fmt::format("{}:{}", t.word, fmt::join(this->*t.widths, ","));
}

void ModelConfig::parse_spec(const std::string& text) {
  const auto colon = text.find(':');
  const ModelType& t = model_type(text.substr(0, colon), fmt::format("--model '{}'", text));
  std::vector<int> widths;
  const bool given = colon != std::string::npos;
  if (given && colon + 1 < text.size()) {
    std::string rest = text.substr(colon + 1);
    std::size_t at = 0;
    while (at <= rest.size()) {
      const auto comma = std::min(rest.find(',', at), rest.size());
      const std::string item = rest.substr(at, comma - at);
      int v = 0;
      const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
      if (item.empty() || ec != std::errc() || end != item.data() + item.size() || v < 1) {
        throw ConfigError(fmt::format("--model '{}': '{}' is not a positive width", text, item));
      }
      widths.push_back(v);
      at = comma + 1;
    }
  }
  kind = t.kind;
  // "mlp:" is an MLP without hidden layers (what spec() writes for one).
  if (given) this->*t.widths = widths;
}

Model::Model(DeviceBackend& backend, ModelConfig config, int max_batch)
    : backend_(backend), config_(std::move(config)), max_batch_(max_batch) {
  config_.validate();
  if (max_batch < 1) throw ConfigError(fmt::format("model max_batch must be >= 1, got {}", max_batch));
}

std::size_t Model::add_param(std::string name, std::size_t count) {
  params_.push_back({std::move(name), count_, count});
  count_ += count;
  return params_.size() - 1;
}

void Model::allocate_params() {
  weights_ = floats(count_);
  grads_ = floats(count_);
  momentum_ = floats(count_);
}

void Model::check_batch(int n) const {
  if (n < 1 || n > max_batch_) throw ConfigError(fmt::format("model: batch of {} outside 1..{}", n, max_batch_));
}

void Model::zero_grad(Stream& s) { backend_.fill(s, grads(), count_, 0.0F); }

void Model::sgd(Stream& s, const SgdStep& step) { backend_.sgd(s, weights(), grads(), momentum(), count_, step); }

std::unique_ptr<Model> make_model(DeviceBackend& backend, const ModelConfig& config, int max_batch) {
  return model_type(config.kind).make(backend, config, max_batch);
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
