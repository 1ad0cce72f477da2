#pragma once
// The small training job the trainer tests share: 16 px crops of a
// make_small_dataset() folder, a two-hidden-layer MLP, global batch 16,
// 2 epochs, one process whatever the environment says.
#include <cmath>
#include <string>
#include <vector>

#include "pinfeed/trainer/trainer.hpp"

namespace pinfeed::testing {

inline trainer::TrainConfig tiny_train_config(const std::string& dataset, const std::string& devices) {
  trainer::TrainConfig c;
  c.loader.dataset = dataset;
  c.loader.threads = 2;
  c.loader.prefetch = 3;
  c.loader.seed = 11;
  c.loader.transform.size = 16;
  c.loader.watch_pressure = false;
  c.devices = trainer::parse_devices(devices);
  c.global_batch = 16;
  c.epochs = 2;
  c.lr = 0.8;
  c.warmup_epochs = 0.5;
  c.model.pool = 2;
  c.model.hidden = {32, 16};
  c.launch = trainer::LaunchEnv{};
  return c;
}

/// ||a - b|| / ||b||: how far a run's weights are from a reference run's.
inline double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return a.size() == b.size() ? std::sqrt(diff / norm) : HUGE_VAL;
}

}  // namespace pinfeed::testing
