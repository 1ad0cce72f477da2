#pragma once
// One data-parallel worker: a host thread with its own loaders, model, DDP
// engine and streams, driving one device as rank `rank` of the job. train()
// (trainer.cpp) makes the devices and communicators and runs one Worker per
// device. Not installed.
#include <array>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "pinfeed/loader/loader.hpp"
#include "pinfeed/memory/fallback_adaptor.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/trainer/checkpoint.hpp"
#include "pinfeed/trainer/schedule.hpp"
#include "pinfeed/trainer/trainer.hpp"

namespace pinfeed::trainer::detail {

/// What every worker of this process shares: the run's configuration, where
/// the workers sit in the world, and the first error and the result.
struct WorkerGroup {
  WorkerGroup(const TrainConfig& c, const TrainCallbacks& cb) : config(c), callbacks(cb) {}
  const TrainConfig& config;
  const TrainCallbacks& callbacks;
  int world = 1;       // ranks in all
  int first_rank = 0;  // rank of this process's worker 0
  int local_workers = 1;
  unsigned local_processes = 1;  // processes of this job on this host (the launcher's local size)
  std::mutex mutex;              // guards error, result and ready_workers
  std::condition_variable ready_cv;
  int ready_workers = 0;  // local workers done allocating (arrive_allocated)
  std::exception_ptr error;
  TrainResult result;

  /// Note [No allocation during collectives]: every device buffer a worker
  /// will use is allocated before its first collective, and the local
  /// workers wait here for each other before any of them starts one: a
  /// cudaMalloc on one GPU's thread can wait for the device while a
  /// collective there waits for this very worker (the deadlock XLA and
  /// PyTorch met). Throws Cancelled when another worker failed first.
  void arrive_allocated();
  void fail(std::exception_ptr e);
};

/// Events reused round-robin: one per copy, without creating and destroying
/// one every step. An event is re-recorded `size` copies later; a slot
/// released after it (Note [Slot lifetime]) is by then long free, and at
/// worst would wait for the newer copy: later, never earlier.
class EventRing {
 public:
  EventRing(DeviceBackend& backend, std::size_t size);
  const std::shared_ptr<Event>& next() { return events_[next_++ % events_.size()]; }

 private:
  std::vector<std::shared_ptr<Event>> events_;
  std::size_t next_ = 0;
};

/// Per-epoch counters of one rank, summed over the ranks as one reduction.
struct EpochCounters {
  float wait_fraction = 0;  // summed: divided by the world afterwards
  float pinned_batches = 0, pageable_batches = 0, replaced = 0;
  [[nodiscard]] std::array<float, 4> values() const {
    return {wait_fraction, pinned_batches, pageable_batches, replaced};
  }
  static EpochCounters from(std::span<const float, 4> v) { return {v[0], v[1], v[2], v[3]}; }
};

/// TrainConfig::profile's scoped timer: marks stamped by host callbacks in
/// stream order, summed by the step's last one. Made disabled, every call is
/// a no-op and enqueues nothing, so the step reads the same either way.
class StepProfiler {
 public:
  enum class Mark { copy_start, copy_end, compute_start, forward_end, backward_end, reduced, comm_first, comm_last };
  StepProfiler(DeviceBackend& backend, bool enabled);
  [[nodiscard]] bool enabled() const noexcept { return enabled_; }
  /// A micro-step's marks start: copy_start on the copy stream.
  void begin(Stream& copy);
  /// Enqueues a host callback on `s` that stamps `m`.
  void mark(Stream& s, Mark m);
  /// copy_end on `copy`, and `compute` waits for it (the step's last
  /// callback reads copy_end after it was written).
  void copied(Stream& copy, Stream& compute);
  /// The step's end, on `compute`: every mark of the micro-step is taken by
  /// then; adds their spans to the sum (the all-reduce's only when `sync`).
  void end(Stream& compute, bool sync);
  /// The sum so far (wait not included), and back to zero.
  StepProfile take();

 private:
  using Marks = std::array<std::chrono::steady_clock::time_point, 8>;
  DeviceBackend& backend_;
  bool enabled_;
  std::shared_ptr<Event> copied_;  // recorded after the copy_end mark
  std::shared_ptr<Marks> marks_;
  std::mutex mutex_;  // guards sum_ (written from stream threads)
  StepProfile sum_;
};

/// StepProfile's timed fields, in order: one reduction over the workers
/// reads and writes them by name.
inline constexpr std::array<double StepProfile::*, 7> kStepProfileFields{
    &StepProfile::wait,     &StepProfile::copy,      &StepProfile::forward,
    &StepProfile::backward, &StepProfile::allreduce, &StepProfile::allreduce_exposed,
    &StepProfile::optimizer};

class Worker {
 public:
  Worker(WorkerGroup& group, int local, DeviceBackend& backend, Communicator& comm);
  /// Drains every stream first: the DDP engine's comm stream may still hold
  /// a copy out of staging_ (queued by host_all_reduce just before an
  /// aborted communicator threw), and staging_ is destroyed before ddp_.
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  /// setup, resume or initialize, allocate, broadcast, the epochs, publish.
  void run();

 private:
  struct Start {  // where training begins, and with which weights
    std::vector<float> weights, momentum, buffers;
    std::uint64_t epoch = 0, position = 0;
  };

  // Setup, before any collective.
  [[nodiscard]] loader::LoaderConfig training_loader_config() const;
  void make_loaders(const loader::LoaderConfig& lc);
  void make_model(int image_size);
  /// The model's running statistics averaged over every rank (equal
  /// already with SyncBN): one set for evaluation and the checkpoint.
  void average_buffers();
  [[nodiscard]] Start resume_or_initialize();
  /// With a checkpoint: the training set's fingerprint (saved with it), and
  /// on --resume the refusal of a changed set. After the allocation barrier.
  void check_dataset();
  void allocate_buffers();
  void allocate_staging(std::size_t floats);
  void broadcast_start(const Start& start);

  // Training.
  /// One epoch from `position`; false when max_steps stopped it early.
  bool run_epoch(std::uint64_t epoch, std::uint64_t position);
  /// One micro-batch: its copy, forward, backward with DDP, and on the
  /// step's last micro-batch the SGD update.
  void micro_step(unsigned micro_in_step, std::uint64_t step, float lr, EpochSummary& s, double& wait_seconds);
  /// The loader's next batch for input buffer `b`, checked and counted.
  loader::Batch next_batch(std::size_t b, std::uint64_t step, EpochSummary& s, double& wait_seconds);
  /// Forward, backward with DDP and (when `sync`) SGD on input buffer `b`.
  void compute(std::size_t b, unsigned micro_in_step, std::uint64_t step, float lr);
  void reduce_epoch(EpochSummary& s, std::uint64_t first_step, std::uint64_t end_step, double wait_seconds);
  void validate_epoch(EpochSummary& s);
  void check_equal_work(std::uint64_t epoch, std::uint64_t steps);
  void save(std::uint64_t epoch, std::uint64_t position);
  void publish_epoch(EpochSummary s);
  void publish_result(double seconds);

  /// Sums `v` over the ranks, through pinned staging (Note [No allocation
  /// during collectives]).
  void host_all_reduce(std::span<float> v);

  WorkerGroup& group_;
  const TrainConfig& cfg_;
  int local_, rank_;
  DeviceBackend& backend_;
  Communicator& comm_;
  // Order matters: the streams are declared last so they are destroyed
  // (drained) first, while every buffer their queued work touches still exists.
  std::unique_ptr<loader::Loader> loader_, val_loader_;
  std::optional<loader::DatasetFingerprint> fingerprint_;  ///< the training set's, with a checkpoint (saved, compared)
  std::optional<loader::DatasetFingerprint> resumed_dataset_;  ///< the resumed checkpoint's
  std::unique_ptr<Model> model_;
  DeviceBuffer scratch_;
  DeviceBuffer in_[2], labels_[2], images_, step_stats_;  // training inputs, double-buffered
  DeviceBuffer val_in_, val_images_, val_labels_, val_stats_;
  std::unique_ptr<DdpEngine> ddp_;
  // Host staging for reductions and statistics, pinned where the host allows
  // (a copy from pageable memory can synchronize against running kernels).
  std::unique_ptr<memory::PinnedResource> staging_pinned_;
  memory::PageableResource staging_pageable_;
  std::unique_ptr<memory::FallbackAdaptor> staging_resource_;
  std::unique_ptr<float, std::function<void(float*)>> staging_;
  std::size_t staging_floats_ = 0;
  std::unique_ptr<Stream> compute_, copy_;
  std::vector<std::shared_ptr<Event>> compute_done_;  // per input buffer: its last reader
  std::unique_ptr<EventRing> copy_events_;

  std::size_t micro_batch_ = 0;      // samples per micro-batch on this rank
  std::uint64_t micro_batches_ = 0;  // micro-batches run so far: picks the input buffer

  std::unique_ptr<StepProfiler> profiler_;  // TrainConfig::profile (disabled: no-ops)
  std::uint64_t steps_per_epoch_ = 0;
  std::uint64_t global_step_ = 0;
  LrSchedule schedule_;
  Normalization norm_;
};

}  // namespace pinfeed::trainer::detail
