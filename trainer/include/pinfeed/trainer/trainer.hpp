#pragma once
// train(): data-parallel training of the reference model, one worker per
// device, fed by the loader.
//
// Per worker (a host thread):
//   batch = loader.next()                    (its shard: rank r of world R)
//   copy stream:    wait until the device input buffer is free, async H2D
//                   copy of the slot (and labels), record an event;
//                   the slot is released after that event (Note [Slot lifetime])
//   compute stream: wait for the copy's event, normalize on the device
//                   (uint8 NHWC input), forward, backward with DDP bucket
//                   all-reduces overlapping it on the comm stream, SGD step.
// Two input buffers alternate, so the copy of batch k+1 overlaps the compute
// of batch k. Every rank runs the same number of steps: the loader pads the
// shards (DistributedSampler) and the trainer checks the batch counts of all
// ranks before every epoch, failing clearly instead of hanging.
//
// Devices: "cpu:N" runs N CPU workers as threads of this process (the
// ThreadCommunicator); "cuda:0,1" / "cuda:all" one worker per GPU with NCCL.
// Under mpirun (or torchrun's variables) each process is one rank and runs
// one worker: MPI all-reduce on the CPU, NCCL bootstrapped through MPI on GPUs.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "pinfeed/loader/loader.hpp"
#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/ddp.hpp"
#include "pinfeed/trainer/device_backend.hpp"
#include "pinfeed/trainer/model.hpp"

namespace pinfeed::trainer {

struct DeviceSpec {
  BackendKind kind = BackendKind::cpu;
  int count = 1;             ///< workers in this process
  std::vector<int> devices;  ///< CUDA device indices (empty with "all": every visible device)
  bool all = false;
};
/// "cpu", "cpu:N", "cuda", "cuda:all", "cuda:0,1", or "auto" (every device of
/// the first indexed type that has any, else cpu:2). Throws ConfigError.
DeviceSpec parse_devices(std::string_view text);

struct TrainConfig {
  loader::LoaderConfig
      loader;               ///< training data; batch_size is set from global_batch; threads are shared by the workers
  std::string val_dataset;  ///< optional validation data (center crop, no shuffle)
  bool profile = false;     ///< break steps down into EpochSummary::profile
  int val_resize = 0;       ///< validation's shorter side before the center crop; 0: size * 256 / 224
  DeviceSpec devices;       ///< where the workers run
  std::size_t global_batch = 256;  ///< samples per optimizer step over all workers
  unsigned accumulation = 1;       ///< micro-batches per optimizer step (no_sync on all but the last)
  unsigned epochs = 3;
  double lr = 0.1;  ///< per 256 samples (linear scaling rule)
  double momentum = 0.9;
  double weight_decay = 5e-4;
  double warmup_epochs = 1.0;  ///< linear warm-up, then cosine decay
  ModelConfig model;           ///< image_size and classes are taken from the loader and dataset
  DdpConfig ddp;
  CommConfig comm;
  bool device_normalize = true;       ///< loader hands over uint8 NHWC, the device normalizes (4x fewer H2D bytes)
  std::filesystem::path checkpoint;   ///< written at the end of every epoch (and every checkpoint_every steps)
  std::size_t checkpoint_every = 0;   ///< optimizer steps between mid-epoch checkpoints; 0: epoch ends only
  bool resume = false;                ///< continue from `checkpoint`
  bool allow_dataset_change = false;  ///< resume even if the training set is not the checkpoint's (refused otherwise)
  std::uint64_t max_steps = 0;        ///< stop after this many optimizer steps in all (0: every epoch)
  std::chrono::microseconds copy_delay{0};  ///< CPU backend: added to each copy (tests of slot lifetime)
  std::optional<LaunchEnv> launch;  ///< where this process sits; unset: read_launch_env() (mpirun / torchrun variables)
  void validate() const;            ///< ConfigError naming the field
};

/// Where a training step's time goes (TrainConfig::profile), in seconds per
/// optimizer step, mean over the workers. Measured with host callbacks on
/// the streams, in stream order: on a GPU they add a little latency, so
/// they are opt-in.
struct StepProfile {
  bool measured = false;
  double wait = 0;               ///< the host waited for the loader's next batch
  double copy = 0;               ///< host-to-device copy of the batch (copy stream)
  double forward = 0;            ///< normalization, forward and loss (compute stream)
  double backward = 0;           ///< backward, launching the buckets' all-reduces as it goes
  double allreduce = 0;          ///< the gradient all-reduce on the comm stream, first bucket to last
  double allreduce_exposed = 0;  ///< the part of it the compute stream waited for after backward
  double optimizer = 0;          ///< the SGD step
};

struct EpochSummary {
  std::uint64_t epoch = 0;
  std::uint64_t steps = 0;        ///< optimizer steps run in this epoch (this run)
  std::uint64_t samples = 0;      ///< over all workers
  double loss = 0, accuracy = 0;  ///< training, mean over the epoch's samples
  double val_loss = std::numeric_limits<double>::quiet_NaN();
  double val_accuracy = std::numeric_limits<double>::quiet_NaN();
  double seconds = 0;
  double images_per_second = 0;   ///< over all workers
  double data_wait_fraction = 0;  ///< mean over workers: share of the epoch a worker waited for its next batch
  double lr = 0;                  ///< at the epoch's last step
  std::uint64_t pinned_batches = 0, pageable_batches = 0, replaced = 0;
  std::size_t pool_pinned_bytes = 0,
              pool_pageable_bytes = 0;  ///< every pool of the process at the epoch's end (memory::process_pool_stats)
  std::uint64_t pool_transitions = 0;   ///< worker 0's pool: slab moves (pinned, pageable, released) so far
  /// Every pool of the process: slots, slots whose memory is given back to
  /// the kernel now (critical pressure), bytes given back so far; worker 0's
  /// pool: seconds from "critical" to its last slab released (-1: never).
  std::size_t pool_slots = 0, pool_released_slots = 0;
  std::uint64_t pool_given_back_bytes = 0;
  double pool_release_seconds = -1;
  std::string pressure = "normal";  ///< worker 0's pool's pressure level at the epoch's end
  std::vector<float> step_loss;     ///< mean training loss of each step, over all workers
  StepProfile profile;              ///< with TrainConfig::profile
};

struct TrainResult {
  std::vector<EpochSummary> epochs;
  std::vector<float> weights;  ///< the final parameters (identical on every rank)
  int world_size = 1;
  int rank = 0;                  ///< this process's rank (multi-process launches)
  std::string devices;           ///< "cpu:0, cpu:1", "cuda:0 (NVIDIA H200)"
  std::string communicator;      ///< Communicator::name(): "solo", "threads", "mpi", "gloo", "nccl"
  std::uint64_t steps = 0;       ///< optimizer steps done in all (including before a resume)
  std::size_t global_batch = 0;  ///< TrainConfig::global_batch
  std::uint64_t steps_per_epoch = 0;
  double seconds = 0;
  unsigned loader_threads = 0;  ///< decode threads of every loader of this process (each worker has its own)
  int local_workers = 1;        ///< workers in this process
};

/// The one JSON form of each result (nlohmann's to_json, as PoolStats has:
/// `json j = result;`), used by pinfeed-train --json. NaN (no validation
/// set) is written as null. Templates, so this header needs no JSON library.
template <class Json>
void to_json(Json& j, const StepProfile& p) {
  j = Json{{"wait", p.wait},          {"copy", p.copy},           {"forward", p.forward},
           {"backward", p.backward},  {"allreduce", p.allreduce}, {"allreduce_exposed", p.allreduce_exposed},
           {"optimizer", p.optimizer}};
}

template <class Json>
void to_json(Json& j, const EpochSummary& e) {
  const auto or_null = [](double x) { return x != x ? Json(nullptr) : Json(x); };
  j = Json{{"epoch", e.epoch},
           {"steps", e.steps},
           {"samples", e.samples},
           {"loss", e.loss},
           {"accuracy", e.accuracy},
           {"val_loss", or_null(e.val_loss)},
           {"val_accuracy", or_null(e.val_accuracy)},
           {"seconds", e.seconds},
           {"images_per_second", e.images_per_second},
           {"data_wait_fraction", e.data_wait_fraction},
           {"lr", e.lr},
           {"pinned_batches", e.pinned_batches},
           {"pageable_batches", e.pageable_batches},
           {"replaced", e.replaced},
           {"pool_pinned_bytes", e.pool_pinned_bytes},
           {"pool_pageable_bytes", e.pool_pageable_bytes},
           {"pool_transitions", e.pool_transitions},
           {"pool_slots", e.pool_slots},
           {"pool_released_slots", e.pool_released_slots},
           {"pool_given_back_bytes", e.pool_given_back_bytes},
           {"pool_release_seconds", e.pool_release_seconds},
           {"pressure", e.pressure},
           {"step_loss", e.step_loss}};
  if (e.profile.measured) j["profile_seconds_per_step"] = e.profile;
}

/// Without the weights (`parameters` is their count) and the per-process
/// fields (rank, loader_threads, local_workers).
template <class Json>
void to_json(Json& j, const TrainResult& r) {
  j = Json{{"devices", r.devices},
           {"world_size", r.world_size},
           {"communicator", r.communicator},
           {"global_batch", r.global_batch},
           {"steps", r.steps},
           {"steps_per_epoch", r.steps_per_epoch},
           {"seconds", r.seconds},
           {"parameters", r.weights.size()},
           {"epochs", r.epochs}};
}

struct StepProgress {
  std::uint64_t epoch = 0, step = 0, steps = 0;  ///< step within the epoch, of steps
  double images_per_second = 0;                  ///< this epoch so far, over all workers
};

struct TrainCallbacks {
  std::function<void(const StepProgress&)> on_step;   ///< from worker 0 of rank 0
  std::function<void(const EpochSummary&)> on_epoch;  ///< every process
};

/// Trains; throws ConfigError / DataError / CommError / CudaError with the
/// rank and the reason. On failure every worker is stopped (collectives
/// aborted) before this returns.
TrainResult train(const TrainConfig& config, const TrainCallbacks& callbacks = {});

}  // namespace pinfeed::trainer
