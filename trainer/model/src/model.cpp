// The model registry (one ModelType row per kind, as DeviceType is the
// devices') and what every model shares: ModelConfig's checks and its
// --model spelling, the parameter table, SGD. A new model is a row in
// model_types() and its own file (mlp.cpp, cnn.cpp).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <charconv>

#include "pinfeed/enum_words.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/trainer/model.hpp"

namespace pinfeed::trainer {

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
  if (image_size < 1 || image_size > 4096)
    throw ConfigError(fmt::format("model image_size must be 1..4096, got {}", image_size));
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

}  // namespace pinfeed::trainer
