// pinfeed-train: train the reference classifier on 1..N GPUs or CPU workers,
// fed by the pinfeed loader. Parsing and printing only; the work is in
// pinfeed::trainer (trainer.hpp, compare.hpp).
//
// Exit codes: 0 done; 1 an error (named: file, rank, reason); 2 bad flags.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <charconv>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "loader_flags.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/memory/pressure_monitor.hpp"
#include "pinfeed/trainer/checkpoint.hpp"
#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/compare.hpp"
#include "pinfeed/trainer/trainer.hpp"
#include "pinfeed/units.hpp"
#include "plot.hpp"
#include "progress.hpp"
#include "tool_main.hpp"

namespace {

namespace pt = pinfeed::trainer;
namespace pl = pinfeed::loader;
using json = nlohmann::ordered_json;

std::string percent(double x) { return std::isnan(x) ? "-" : fmt::format("{:.1f}%", 100 * x); }
std::string number(double x) { return std::isnan(x) ? "-" : fmt::format("{:.4f}", x); }

/// Progress on stderr: a bar per epoch on a terminal (progress.hpp), nothing
/// otherwise (the per-epoch line says it all in logs).
pt::TrainCallbacks callbacks(bool quiet, unsigned epochs) {
  pt::TrainCallbacks cb;
  if (quiet) return cb;
  auto bar = std::make_shared<std::unique_ptr<pinfeed::tools::ProgressBar>>();
  cb.on_step = [epochs, bar](const pt::StepProgress& p) {
    if (p.step == 1 || !*bar) {
      *bar = std::make_unique<pinfeed::tools::ProgressBar>(fmt::format("epoch {}/{}", p.epoch + 1, epochs), true);
    }
    (*bar)->update(p.step, p.steps, fmt::format("steps {:.0f} img/s", p.images_per_second));
  };
  cb.on_epoch = [epochs](const pt::EpochSummary& e) {
    fmt::print(
        "epoch {}/{}  loss {:.4f}  acc {}  val_loss {}  val_acc {}  {:.0f} img/s  data wait {}  lr {:.4g}  batches "
        "{} pinned / {} pageable  pool {} pinned, {} pageable, {}/{} slots live{}  pressure {}\n",
        e.epoch + 1, epochs, e.loss, percent(e.accuracy), number(e.val_loss), percent(e.val_accuracy),
        e.images_per_second, percent(e.data_wait_fraction), e.lr, e.pinned_batches, e.pageable_batches,
        pinfeed::format_bytes(e.pool_pinned_bytes), pinfeed::format_bytes(e.pool_pageable_bytes),
        e.pool_slots - e.pool_released_slots, e.pool_slots,
        e.pool_given_back_bytes == 0
            ? std::string{}
            : fmt::format(" ({} given back{})", pinfeed::format_bytes(e.pool_given_back_bytes),
                          e.pool_release_seconds < 0
                              ? std::string{}
                              : fmt::format(", {:.0f} ms after critical", e.pool_release_seconds * 1e3)),
        e.pressure);
    if (e.profile.measured) {
      const auto ms = [](double s) { return s * 1e3; };
      const pt::StepProfile& p = e.profile;
      fmt::print(
          "  step ms: wait {:.2f}  copy {:.2f}  forward {:.2f}  backward {:.2f}  all-reduce {:.2f} (exposed "
          "{:.2f})  optimizer {:.2f}\n",
          ms(p.wait), ms(p.copy), ms(p.forward), ms(p.backward), ms(p.allreduce), ms(p.allreduce_exposed),
          ms(p.optimizer));
    }
    std::fflush(stdout);
  };
  return cb;
}

/// Writes prefix.csv and, with gnuplot, prefix.png. Returns the PNG path or "".
std::string plot(const std::vector<pt::Curve>& curves, const std::string& prefix) {
  std::string commands =
      "set key below vertical maxcols 1 Left reverse\n"
      "set xlabel 'epoch'\nset ylabel 'training loss (mean over the global batch)'\n"
      "set title 'pinfeed-train --compare: same data, same initial weights'\n"
      "plot ";
  for (std::size_t i = 0; i < curves.size(); ++i) {
    commands +=
        fmt::format("{}'{{csv}}' using 6:($1 == {} ? $7 : 1/0) with lines lw {} title '{} (batch {}, peak lr {:.3g})'",
                    i ? ", " : "", i, i == 0 ? 6 : 2, curves[i].label, curves[i].global_batch, curves[i].peak_lr);
  }
  commands += "\n";
  return pinfeed::tools::write_plot(prefix, pt::curves_csv(curves), commands, "pinfeed-train");
}

/// --compare N: the curves, their CSV and plot, and a line (or JSON) per run.
int run_compare(const pt::TrainConfig& config, int workers, const pt::TrainCallbacks& cb, const std::string& out,
                bool as_json) {
  const auto curves = pt::compare_workers(config, workers, cb);
  const std::string png = plot(curves, out);
  json j = json::array();
  for (const auto& c : curves) {
    const auto& last = c.result.epochs.back();
    j.push_back(c);
    if (!as_json) {
      fmt::print("{:<50} batch {:>5}  steps {:>5}  final loss {:.4f}  acc {}\n", c.label, c.global_batch,
                 c.result.steps, last.loss, percent(last.accuracy));
    }
  }
  if (as_json) {
    fmt::print("{}\n", json{{"compare", j}, {"csv", out + ".csv"}, {"png", png}}.dump(2));
  } else {
    fmt::print("curves: {}.csv{}\n", out, png.empty() ? "" : fmt::format(", plot: {}", png));
  }
  return 0;
}

/// One training run; rank 0 reports (a line, or JSON with every epoch).
int run_training(const pt::TrainConfig& config, const pt::TrainCallbacks& cb, bool as_json) {
  const pt::TrainResult r = pt::train(config, cb);
  if (r.rank != 0) return 0;  // in multi-process runs, rank 0 reports
  if (as_json) {
    fmt::print("{}\n", json(r).dump(2));
  } else {
    fmt::print("trained on {} ({} workers, {}): {} steps in {:.1f} s\n", r.devices, r.world_size, r.communicator,
               r.steps, r.seconds);
    if (config.devices.kind == pt::BackendKind::cpu) {
      // The CPU backend computes on one thread per worker (OpenBLAS single
      // threaded); the loader decodes on its own threads: they share the cores.
      fmt::print(
          "cores: {} on this machine; {} loader thread(s) decode, {} worker thread(s) compute "
          "(--loader-threads to change the split)\n",
          std::thread::hardware_concurrency(), r.loader_threads, r.local_workers);
    }
  }
  return 0;
}

/// The model flags given must be the chosen kind's (the model registry's
/// own_flags and uses_batch_norm): --pool on a CNN or --sync-bn on an MLP
/// would otherwise be ignored.
void check_model_flags(const CLI::App& app, const pt::ModelConfig& model) {
  const pt::ModelType& chosen = pt::model_type(model.kind);
  for (const pt::ModelType* t : pt::model_types()) {
    if (t == &chosen) continue;
    for (std::string_view flag : t->own_flags) {
      if (std::find(chosen.own_flags.begin(), chosen.own_flags.end(), flag) == chosen.own_flags.end() &&
          app.count(std::string(flag)) > 0) {
        throw pinfeed::ConfigError(fmt::format("{} is the {}'s: --model {}:{} sets the {}'s widths", flag, t->word,
                                               chosen.word, chosen.widths_help, chosen.word));
      }
    }
  }
  if (model.sync_bn && !chosen.uses_batch_norm) {
    throw pinfeed::ConfigError(fmt::format("--sync-bn is for a model with BatchNorm (the {} has none)", chosen.word));
  }
}

/// What the command line sets, beside the TrainConfig itself.
struct TrainFlags {
  pt::TrainConfig config;
  std::string devices = "auto", compare_out = "compare", model_spec;
  double bucket_mb = 25, comm_timeout_s = 300;
  int compare = 0;
  bool as_json = false, quiet = false, host_normalize = false;

  TrainFlags() {
    config.loader.transform.size = 64;
    config.model.pool = 4;
  }
};

/// The version names the communicators this build has: a wheel has no MPI
/// (its plugins live at Debian's paths), and a launcher can ask first.
std::string version_text() {
  std::string communicators = "threads";
  for (const pt::LaunchBootstrap& b : pt::launch_bootstraps()) {
    if (b.compiled()) communicators += fmt::format(", {}", b.cpu_communicator);
  }
  return fmt::format("pinfeed-train 0.1.0 (communicators: {})", communicators);
}

void add_data_and_schedule_flags(CLI::App& app, TrainFlags& f) {
  pt::TrainConfig& config = f.config;
  app.add_option("--data", config.loader.dataset,
                 "training data: folder, file list, or tar shard pattern or URLs (http://, https://, s3://, pipe:)")
      ->required();
  app.add_option("--val", config.val_dataset, "validation data (center crop)");
  app.add_option("--cache-dir", config.loader.remote.cache_dir,
                 "where shards given as URLs (http://, https://, s3://, pipe:) are kept across runs and shared by "
                 "this node's ranks (default: a private folder removed at the end)");
  app.add_option("--val-resize", config.val_resize,
                 "validation: shorter side before the center crop (default: size * 256 / 224, torchvision's ratio)")
      ->check(CLI::Range(1, 16384));
  app.add_option("--devices", f.devices, "cpu:N, cuda:0,1, cuda:all, or auto (every GPU, else 2 CPU workers)");
  app.add_option("--epochs", config.epochs, "epochs")->check(CLI::Range(1, 100000));
  app.add_option("--batch-size", config.global_batch, "global batch: samples per step over all workers")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--accumulation", config.accumulation, "micro-batches per step (no_sync on all but the last)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--lr", config.lr, "learning rate per 256 samples (scaled by batch/256), warm-up then cosine")
      ->check(CLI::PositiveNumber);
  app.add_option("--momentum", config.momentum, "SGD momentum")->check(CLI::Range(0.0, 0.999));
  app.add_option("--weight-decay", config.weight_decay, "SGD weight decay")->check(CLI::Range(0.0, 1.0));
  app.add_option("--warmup-epochs", config.warmup_epochs, "linear warm-up length in epochs")
      ->check(CLI::Range(0.0, 1000.0));
  app.add_option("--checkpoint", config.checkpoint, "checkpoint file, written atomically at every epoch end");
  app.add_option("--checkpoint-every", config.checkpoint_every, "also every N steps");
  app.add_flag("--resume", config.resume, "continue from --checkpoint");
  app.add_flag("--allow-dataset-change", config.allow_dataset_change,
               "--resume even if the training set changed since the checkpoint (classes, samples, files; refused "
               "otherwise, naming what changed)");
  app.add_option("--max-steps", config.max_steps, "stop after this many steps in all");
  // The loader's own options, from its table: every one but what the
  // trainer sets or keeps fixed (the batch is --batch-size over the workers,
  // every step takes whole batches, the layout follows --host-normalize, the
  // models take square images of --size, the backend picks how slots are
  // pinned, and the order, shuffled and padded as DistributedSampler's, is
  // what a checkpoint's position means). seed also draws the initial
  // weights; threads are shared by the workers; prefetch is per worker.
  pinfeed::tools::add_loader_flags_except(
      app, config.loader, {"batch_size", "drop_last_batch", "layout", "height", "pin_method", "shuffle", "drop_last"},
      {"threads:--loader-threads"});
}

void add_model_flags(CLI::App& app, TrainFlags& f) {
  app.add_option(
      "--model", f.model_spec,
      "mlp[:W,W...] (average pooling + MLP, the default) or cnn[:C,C...] (conv3x3+BatchNorm+ReLU blocks of C "
      "channels, each halving the resolution; cnn alone is cnn:32,64,128)");
  app.add_flag("--sync-bn", f.config.model.sync_bn,
               "cnn: BatchNorm statistics over every worker (SyncBatchNorm), not each worker's own (DDP's default)");
  app.add_option("--pool", f.config.model.pool, "average pooling before the MLP (must divide --size)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--hidden", f.config.model.hidden, "hidden layer widths, comma separated")
      ->delimiter(',')
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
}

void add_run_flags(CLI::App& app, TrainFlags& f) {
  app.add_option("--bucket-cap-mb", f.bucket_mb, "DDP bucket size cap in MiB")->check(CLI::Range(0.0001, 4096.0));
  app.add_flag("--host-normalize", f.host_normalize,
               "normalize on the host (float32 batches) instead of on the device");
  app.add_option("--compare", f.compare,
                 "train with 1 and with N workers (same global batch) and plot both loss curves")
      ->check(CLI::Range(2, 64));
  app.add_option("--compare-out", f.compare_out, "prefix of the --compare CSV and PNG");
  app.add_flag("--profile", f.config.profile,
               "break each step down: wait for the batch, H2D copy, forward, backward, all-reduce (and its exposed "
               "part), optimizer; per epoch, in ms per step (host callbacks in stream order: a little GPU latency)");
  app.add_option("--comm-timeout", f.comm_timeout_s,
                 "seconds the rendezvous and each collective may wait for the other ranks; then every rank stops "
                 "with a message (torch's init_process_group timeout)")
      ->check(CLI::Range(1.0, 86400.0));
  app.add_flag("--json", f.as_json, "print a JSON summary at the end (and no per-epoch lines)");
  app.add_flag("-q,--quiet", f.quiet, "no progress output");
}

/// The parsed flags into the config: the model, the devices, the timeouts.
void apply_flags(const CLI::App& app, TrainFlags& f) {
  pt::TrainConfig& config = f.config;
  if (!f.model_spec.empty()) {
    if (f.model_spec.find(':') != std::string::npos && app.count("--hidden") > 0) {
      throw pinfeed::ConfigError("--hidden and --model with widths both set the widths: give one");
    }
    config.model.parse_spec(f.model_spec);
  }
  check_model_flags(app, config.model);
  config.devices = pt::parse_devices(f.devices);
  config.comm.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(f.comm_timeout_s * 1000));
  config.device_normalize = !f.host_normalize;
  config.ddp.bucket_cap_bytes = static_cast<std::size_t>(f.bucket_mb * 1024 * 1024);
  config.ddp.first_bucket_bytes = std::min(config.ddp.first_bucket_bytes, config.ddp.bucket_cap_bytes);
  // In a multi-process launch every rank trains; rank 0 alone reports.
  config.launch = pinfeed::read_launch_env();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pinfeed-train: data-parallel training of the reference classifier, fed by the pinfeed loader"};
  app.set_version_flag("--version", version_text());
  TrainFlags f;
  add_data_and_schedule_flags(app, f);
  add_model_flags(app, f);
  add_run_flags(app, f);
  return pinfeed::tools::run_tool("pinfeed-train", app, argc, argv, [&] {
    spdlog::set_level(f.quiet || f.as_json ? spdlog::level::warn : spdlog::level::info);
    apply_flags(app, f);
    const auto cb = callbacks(f.quiet || f.as_json || f.config.launch->rank != 0, f.config.epochs);
    pt::install_checkpoint_signal_handlers();  // Ctrl-C / SIGTERM during a save leave no temporary
    if (f.compare > 0) {
      pinfeed::tools::check_plot_prefix(f.compare_out, "--compare-out");
      return run_compare(f.config, f.compare, cb, f.compare_out, f.as_json);
    }
    return run_training(f.config, cb, f.as_json);
  });
}
