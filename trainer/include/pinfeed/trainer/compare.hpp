#pragma once
// Does multi-worker training converge like single-worker training? Three runs
// of the same job (four with the CNN), each from the same initial weights and
// data order:
//   "1 worker"          global batch B, learning rate lr (scaled by B/256)
//   "N workers"         global batch B split N ways (B/N each), same lr:
//                       the same optimization problem, so the same curve
//   "N workers, B each" the common mistake: every worker keeps the
//                       single-worker batch, so the global batch is N x B,
//                       while the learning rate is left at the 1-worker
//                       value (not scaled by N): N times fewer steps per
//                       epoch at the same step size, so it learns slower
//                       per epoch.
// With the CNN (BatchNorm), "N workers" runs twice: with SyncBN (statistics
// over the global batch: the 1-worker computation) and with each worker's
// own statistics over B/N samples (DDP's default: another computation, and
// noisier statistics for small B/N); the mistake keeps per-worker BN, as
// DataParallel's replicas do.
#include <string>
#include <vector>

#include "pinfeed/trainer/trainer.hpp"

namespace pinfeed::trainer {

struct CurvePoint {
  double epoch = 0;  ///< fractional: samples seen / samples per epoch
  std::uint64_t step = 0;
  double loss = 0;
};

struct Curve {
  std::string label;
  std::size_t global_batch = 0;
  double peak_lr = 0;
  std::vector<CurvePoint> points;
  TrainResult result;
};

/// One run's line of pinfeed-train --compare --json (nlohmann's to_json).
template <class Json>
void to_json(Json& j, const Curve& c) {
  const EpochSummary& last = c.result.epochs.back();
  j = Json{{"label", c.label},
           {"global_batch", c.global_batch},
           {"peak_lr", c.peak_lr},
           {"steps", c.result.steps},
           {"final_loss", last.loss},
           {"final_accuracy", last.accuracy},
           {"final_val_accuracy", last.val_accuracy != last.val_accuracy ? Json(nullptr) : Json(last.val_accuracy)}};
}

/// Runs the configurations above. `config.devices` names the device
/// kind; the runs use 1 and `workers` of it. Throws what train() throws.
std::vector<Curve> compare_workers(const TrainConfig& config, int workers, const TrainCallbacks& callbacks = {});

/// CSV: run,label,global_batch,peak_lr,step,epoch,loss (labels hold no commas).
std::string curves_csv(const std::vector<Curve>& curves);

}  // namespace pinfeed::trainer
