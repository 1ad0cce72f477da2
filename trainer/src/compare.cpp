#include "pinfeed/trainer/compare.hpp"

#include <fmt/format.h>

#include "pinfeed/trainer/device_type.hpp"
#include "pinfeed/trainer/schedule.hpp"

namespace pinfeed::trainer {
namespace {

Curve run(TrainConfig c, std::string label, const TrainCallbacks& callbacks) {
  Curve curve;
  curve.label = std::move(label);
  curve.global_batch = c.global_batch;
  curve.peak_lr = LrSchedule{c.lr, c.global_batch, 0, 1}.peak();
  curve.result = train(c, callbacks);
  std::uint64_t step = 0;
  for (const EpochSummary& e : curve.result.epochs) {
    const double steps = static_cast<double>(e.step_loss.size());
    for (std::size_t k = 0; k < e.step_loss.size(); ++k, ++step) {
      curve.points.push_back(
          CurvePoint{static_cast<double>(e.epoch) + static_cast<double>(k + 1) / steps, step + 1, e.step_loss[k]});
    }
  }
  return curve;
}

}  // namespace

std::vector<Curve> compare_workers(const TrainConfig& config, int workers, const TrainCallbacks& callbacks) {
  if (workers < 2) throw ConfigError(fmt::format("compare: workers must be >= 2, got {}", workers));
  const auto devices_for = [&](int n) {
    DeviceSpec d = config.devices;
    d.all = false;
    d.count = n;
    if (device_type(d.kind).indexed) {  // n devices: the ones given, else 0..n-1
      d.devices.clear();
      for (int i = 0; i < n; ++i)
        d.devices.push_back(config.devices.devices.empty() ? i
                                                           : config.devices.devices.at(static_cast<std::size_t>(i)));
    }
    return d;
  };
  std::vector<Curve> curves;
  TrainConfig c = config;
  c.checkpoint.clear();
  c.resume = false;
  c.devices = devices_for(1);
  curves.push_back(run(c, "1 worker", callbacks));
  c.devices = devices_for(workers);
  const bool batch_norm = model_type(config.model.kind).uses_batch_norm;
  if (batch_norm) {
    // BatchNorm: with statistics over the global batch (SyncBN) the same
    // computation as 1 worker; with each worker's own (DDP's default) not.
    c.model.sync_bn = true;
    curves.push_back(run(c, fmt::format("{} workers: same global batch and lr; SyncBN", workers), callbacks));
    c.model.sync_bn = false;
    curves.push_back(run(c, fmt::format("{} workers: same global batch and lr; BN per worker", workers), callbacks));
  } else {
    curves.push_back(run(c, fmt::format("{} workers: same global batch and lr", workers), callbacks));
  }
  c.model.sync_bn = false;  // the reported setup: DataParallel's per-device statistics
  c.global_batch = config.global_batch * static_cast<std::size_t>(workers);
  c.lr = config.lr / workers;  // the peak rate stays the 1-worker value: not scaled for the larger batch
  curves.push_back(run(c,
                       fmt::format("{} workers: {} each (global batch x{}); lr not scaled{}", workers,
                                   config.global_batch, workers, batch_norm ? "; BN per worker" : ""),
                       callbacks));
  return curves;
}

std::string curves_csv(const std::vector<Curve>& curves) {
  std::string out = "run,label,global_batch,peak_lr,step,epoch,loss\n";
  for (std::size_t r = 0; r < curves.size(); ++r) {
    const Curve& c = curves[r];
    for (const CurvePoint& p : c.points) {
      out += fmt::format("{},\"{}\",{},{:.6g},{},{:.6f},{:.6f}\n", r, c.label, c.global_batch, c.peak_lr, p.step,
                         p.epoch, p.loss);
    }
  }
  return out;
}

}  // namespace pinfeed::trainer
