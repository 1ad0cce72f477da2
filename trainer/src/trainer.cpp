#include "pinfeed/trainer/trainer.hpp"

// train(): the devices and communicators of this process, one Worker
// (worker.cpp) per device on its own thread, the first error rethrown.
#include <fmt/format.h>

#include <cmath>
#include <optional>
#include <thread>

#include "pinfeed/trainer/checkpoint.hpp"
#include "pinfeed/trainer/device_type.hpp"
#include "worker.hpp"

namespace pinfeed::trainer {

void TrainConfig::validate() const {
  if (global_batch < 1) throw ConfigError("global_batch must be >= 1");
  if (accumulation < 1) throw ConfigError("accumulation must be >= 1");
  if (epochs < 1 || epochs > 100000) throw ConfigError(fmt::format("epochs must be 1..100000, got {}", epochs));
  if (!(lr > 0) || !std::isfinite(lr)) throw ConfigError(fmt::format("lr must be > 0, got {}", lr));
  if (!(momentum >= 0 && momentum < 1)) throw ConfigError(fmt::format("momentum must be in [0, 1), got {}", momentum));
  if (!(weight_decay >= 0)) throw ConfigError(fmt::format("weight_decay must be >= 0, got {}", weight_decay));
  if (!(warmup_epochs >= 0)) throw ConfigError(fmt::format("warmup_epochs must be >= 0, got {}", warmup_epochs));
  if (resume && checkpoint.empty()) throw ConfigError("resume needs a checkpoint path");
  if (loader.transform.out_height() != loader.transform.out_width()) {
    throw ConfigError(fmt::format("height {} differs from size {}: the reference model takes square inputs (height 0)",
                                  loader.transform.height, loader.transform.size));
  }
  ddp.validate();
}

namespace {

/// The backends this process drives: the devices named (or all of them,
/// or this process's share under a launcher), or N CPU workers.
std::vector<std::unique_ptr<DeviceBackend>> make_backends(const TrainConfig& config, const LaunchEnv& env,
                                                          DeviceSpec& spec) {
  const DeviceType& type = device_type(spec.kind);
  const bool multi_process = env.world_size > 1;
  std::vector<std::unique_ptr<DeviceBackend>> backends;
  BackendOptions options;
  options.copy_delay = config.copy_delay;
  if (!type.indexed) {
    // Worker i of this process, named by its global rank.
    for (int i = 0; i < spec.count; ++i)
      backends.push_back(type.make_backend((multi_process ? env.rank : 0) + i, options));
    return backends;
  }
  const int visible = type.visible();
  if (visible == 0) {
    // The type's own factory knows why (built without it, no driver, no device).
    std::string why = fmt::format("no {} device is visible", type.name);
    try {
      (void)type.make_backend(spec.devices.empty() ? 0 : spec.devices.front(), options);
    } catch (const Error& e) {
      why = e.what();
    }
    throw ConfigError(fmt::format("devices: {} was asked for, but {}", type.name, why));
  }
  if (spec.all) {
    if (multi_process) {
      spec.devices = {env.local_rank % visible};
    } else {
      for (int d = 0; d < visible; ++d) spec.devices.push_back(d);
    }
    spec.count = static_cast<int>(spec.devices.size());
  }
  for (const int d : spec.devices) {
    if (d >= visible)
      throw ConfigError(fmt::format("devices: {}:{} does not exist ({} visible)", type.name, d, visible));
    backends.push_back(type.make_backend(d, options));
  }
  return backends;
}

/// Where this process's workers sit in the world; ConfigError when the
/// batch does not divide over them.
void place_workers(const TrainConfig& config, const LaunchEnv& env, int workers, detail::WorkerGroup& group) {
  const bool multi_process = env.world_size > 1;
  if (multi_process && workers != 1) {
    throw ConfigError(fmt::format("devices: under {} each process runs one worker; got {} (use cpu:1 or cuda:all)",
                                  env.launcher, workers));
  }
  group.local_processes = static_cast<unsigned>(std::max(1, env.local_size));
  group.local_workers = workers;
  group.world = multi_process ? env.world_size : workers;
  group.first_rank = multi_process ? env.rank : 0;
  const auto world = static_cast<std::size_t>(group.world);
  if (config.global_batch % world != 0) {
    throw ConfigError(
        fmt::format("batch size {} is not divisible by the {} workers", config.global_batch, group.world));
  }
  if ((config.global_batch / world) % config.accumulation != 0) {
    throw ConfigError(fmt::format("per-worker batch {} is not divisible by accumulation {}",
                                  config.global_batch / world, config.accumulation));
  }
}

/// One communicator per backend: solo for one worker, the launcher's for
/// one rank per process, else the group of the kind's CommType (comm_type()).
std::vector<std::unique_ptr<Communicator>> make_communicators(
    const TrainConfig& config, const LaunchEnv& env, const DeviceType& type,
    const std::vector<std::unique_ptr<DeviceBackend>>& backends) {
  std::vector<std::unique_ptr<Communicator>> comms;
  if (env.world_size > 1) {
    comms.push_back(comm_type(type.kind).make_launched(*backends[0], config.comm, env));
    if (comms[0]->size() != env.world_size || comms[0]->rank() != env.rank) {
      throw ConfigError(fmt::format("{} ({}) says rank {} of {}, but the {} communicator sees rank {} of {}",
                                    env.launcher, env.source, env.rank, env.world_size, comms[0]->name(),
                                    comms[0]->rank(), comms[0]->size()));
    }
  } else if (backends.size() == 1) {
    comms.push_back(make_solo_communicator());  // one worker: nothing to exchange, no NCCL needed
  } else {
    std::vector<DeviceBackend*> raw;
    for (const auto& b : backends) raw.push_back(b.get());
    comms = comm_type(type.kind).make_group(raw, config.comm);
  }
  return comms;
}

/// Runs worker i on its own thread. A failing worker records the first
/// error and aborts every communicator of the process (ncclCommAbort sets
/// only the flags of the one it is given; the others' ranks would wait in
/// their collectives until the timeout).
void run_workers(detail::WorkerGroup& group, const std::vector<std::unique_ptr<DeviceBackend>>& backends,
                 const std::vector<std::unique_ptr<Communicator>>& comms) {
  std::vector<std::jthread> threads;
  for (std::size_t i = 0; i < backends.size(); ++i) {
    threads.emplace_back([&, i] {
      // The worker outlives the catch: its streams may be blocked in a
      // collective that only the abort below releases.
      detail::Worker worker(group, static_cast<int>(i), *backends[i], *comms[i]);
      try {
        worker.run();
      } catch (...) {
        std::string what = "unknown error";
        try {
          throw;
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        group.fail(std::current_exception());
        // A CommError's text already begins with its rank.
        const std::string rank = fmt::format("rank {}: ", group.first_rank + static_cast<int>(i));
        for (const auto& c : comms) c->abort(what.rfind(rank, 0) == 0 ? what : rank + what);
      }
    });
  }
}

}  // namespace

TrainResult train(const TrainConfig& config, const TrainCallbacks& callbacks) {
  config.validate();
  const LaunchEnv env = config.launch ? *config.launch : read_launch_env();
  // Found before the first epoch, not after it: a checkpoint that cannot be
  // written (missing or read-only folder, a directory in its place). Rank 0
  // writes it, so rank 0 checks.
  // Rank 0 also holds the checkpoint's lock for the whole run: a second run
  // writing the same file is refused, and temporaries of killed writers go.
  std::optional<CheckpointLock> lock;
  if (!config.checkpoint.empty() && env.rank == 0) {
    check_checkpoint_writable(config.checkpoint);
    lock.emplace(config.checkpoint);
  }
  DeviceSpec spec = config.devices;
  const std::vector<std::unique_ptr<DeviceBackend>> backends = make_backends(config, env, spec);
  detail::WorkerGroup group(config, callbacks);
  place_workers(config, env, spec.count, group);
  const std::vector<std::unique_ptr<Communicator>> comms =
      make_communicators(config, env, device_type(spec.kind), backends);
  run_workers(group, backends, comms);
  if (group.error) std::rethrow_exception(group.error);
  group.result.world_size = group.world;
  group.result.rank = group.first_rank;
  group.result.communicator = comms[0]->name();
  group.result.global_batch = config.global_batch;
  for (std::size_t i = 0; i < backends.size(); ++i) {
    group.result.devices += (i ? ", " : "") + backends[i]->name();
  }
  return std::move(group.result);
}

}  // namespace pinfeed::trainer
