#include "worker.hpp"

#include "pinfeed/trainer/device_feed.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <thread>

#include "pinfeed/loader/options.hpp"
#include "pinfeed/log.hpp"

namespace pinfeed::trainer::detail {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

/// Checks the batch's labels against the model's classes (DataError naming
/// the sample's file otherwise): the softmax kernel reads z[label]. The
/// device copies them from the slot (Batch::slot_labels).
void check_labels(const loader::Batch& batch, const loader::Dataset& dataset, int classes) {
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const std::int64_t label = batch.labels()[i];
    if (label < 0 || label >= classes) {
      throw DataError(dataset.describe(batch.indices()[i]),
                      fmt::format("label {} is outside the model's classes 0..{}", label, classes - 1));
    }
  }
}

}  // namespace

void WorkerGroup::arrive_allocated() {
  std::unique_lock lock(mutex);
  ++ready_workers;
  ready_cv.notify_all();
  ready_cv.wait(lock, [&] { return ready_workers >= local_workers || error; });
  if (error) throw Cancelled("another worker failed before training started");
}

void WorkerGroup::fail(std::exception_ptr e) {
  {
    const std::scoped_lock lock(mutex);
    if (!error) error = std::move(e);
  }
  ready_cv.notify_all();
}

EventRing::EventRing(DeviceBackend& backend, std::size_t size) {
  for (std::size_t i = 0; i < size; ++i) events_.push_back(backend.create_event());
}

Worker::~Worker() {
  for (Stream* s : {ddp_ ? &ddp_->comm_stream() : nullptr, compute_.get(), copy_.get()}) {
    if (s == nullptr) continue;
    try {
      backend_.synchronize(*s);
    } catch (const std::exception& e) {  // a failed stream has nothing left to run
      pinfeed::detail::log().debug("worker {}: a stream failed while draining: {}", rank_, e.what());
    }
  }
}

Worker::Worker(WorkerGroup& group, int local, DeviceBackend& backend, Communicator& comm)
    : group_(group),
      cfg_(group.config),
      local_(local),
      rank_(group.first_rank + local),
      backend_(backend),
      comm_(comm),
      norm_{cfg_.loader.transform.mean, cfg_.loader.transform.std} {}

void Worker::run() {
  // First, before the Loader registers its slots: this thread's device.
  backend_.make_current();
  micro_batch_ = cfg_.global_batch / static_cast<std::size_t>(group_.world) / cfg_.accumulation;
  const loader::LoaderConfig lc = training_loader_config();
  make_loaders(lc);
  make_model(lc.transform.size);
  const Start start = resume_or_initialize();
  allocate_buffers();
  group_.arrive_allocated();  // Note [No allocation during collectives]
  // After the barrier: the fingerprint's parallel loop starts oneTBB on this
  // thread, which must not race another worker's Loader setting the
  // process's global_control (TSan saw oneTBB read its control set unlocked).
  check_dataset();
  broadcast_start(start);

  const auto t_train = Clock::now();
  for (std::uint64_t epoch = start.epoch; epoch < cfg_.epochs; ++epoch) {
    if (!run_epoch(epoch, epoch == start.epoch ? start.position : 0)) break;
  }
  publish_result(seconds_since(t_train));
}

// ---- setup --------------------------------------------------------------

loader::LoaderConfig Worker::training_loader_config() const {
  loader::LoaderConfig lc = cfg_.loader;
  lc.rank = static_cast<unsigned>(rank_);
  lc.world_size = static_cast<unsigned>(group_.world);
  lc.batch_size = micro_batch_;
  lc.drop_last_batch = true;  // every step has the global batch
  lc.transform.layout = cfg_.device_normalize ? loader::Layout::nhwc_u8 : loader::Layout::nchw_f32;
  // Every loader of every worker on this host shares its memory and cores:
  // the pinned budget, the pool-fit allowance and (threads 0) the cores are
  // split across all of them.
  lc.local_ranks = (cfg_.loader.local_ranks != 0 ? cfg_.loader.local_ranks : group_.local_processes) *
                   static_cast<unsigned>(group_.local_workers);
  lc.threads = cfg_.loader.threads != 0
                   ? std::max(1U, cfg_.loader.threads / static_cast<unsigned>(group_.local_workers))
                   : loader::default_threads(0, lc.local_ranks);
  lc.cuda_device = backend_.cuda_device();  // slots registered with this GPU current, on every thread
  // The device decides how its source memory is pinned (a CPU worker's
  // copies are memcpy: mlock, no driver registration).
  if (lc.pin_method == memory::PinMethod::automatic) lc.pin_method = backend_.host_pin_method();
  return lc;
}

void Worker::make_loaders(const loader::LoaderConfig& lc) {
  loader_ = std::make_unique<loader::Loader>(lc);
  if (cfg_.val_dataset.empty()) return;
  // No augmentation, no shuffle, every sample: each option of the table
  // says what evaluation uses (loader::evaluation_config).
  loader::LoaderConfig vc = loader::evaluation_config(lc);
  vc.dataset = cfg_.val_dataset;
  // torchvision's evaluation view: Resize(size * 256 / 224) then
  // CenterCrop(size) (256 for 224; 73 for 64), unless val_resize says
  // otherwise. The loader's own default of 256 would show a 64 px model a
  // 4x zoom of what its random crops showed it in training.
  vc.transform.resize = cfg_.val_resize > 0 ? cfg_.val_resize : (vc.transform.size * 256 + 112) / 224;
  if (vc.transform.resize < vc.transform.size) {
    throw ConfigError(
        fmt::format("val_resize {} is smaller than the image size {}: Resize then CenterCrop needs it "
                    "at least as large",
                    vc.transform.resize, vc.transform.size));
  }
  vc.prefetch = 2;
  vc.watch_pressure = false;
  val_loader_ = std::make_unique<loader::Loader>(vc);
  loader::check_same_classes(loader_->dataset(), val_loader_->dataset());
}

void Worker::make_model(int image_size) {
  ModelConfig mc = cfg_.model;
  mc.image_size = image_size;
  mc.classes = static_cast<int>(std::max<std::size_t>(2, loader_->dataset().num_classes()));
  model_ = pinfeed::trainer::make_model(backend_, mc, static_cast<int>(micro_batch_));
  ddp_ = std::make_unique<DdpEngine>(backend_, comm_, model_->params(), model_->weights(), model_->grads(), cfg_.ddp);
  model_->set_sync(group_.world, [this](Stream& s, float* data, std::size_t count) {
    ddp_->collective(s, data, count, ReduceOp::sum);
  });
  profiler_ = std::make_unique<StepProfiler>(backend_, cfg_.profile);
  if (profiler_->enabled()) {
    using Mark = StepProfiler::Mark;
    model_->set_forward_hook([this](Stream& s) { profiler_->mark(s, Mark::forward_end); });
    ddp_->set_comm_hooks([this](Stream& s) { profiler_->mark(s, Mark::comm_first); },
                         [this](Stream& s) { profiler_->mark(s, Mark::comm_last); });
  }
  compute_ = backend_.create_stream();
  copy_ = backend_.create_copy_stream();
  steps_per_epoch_ = loader_->batches_per_epoch() / cfg_.accumulation;
  if (steps_per_epoch_ == 0) {
    throw ConfigError(
        fmt::format("{} samples per rank make no step of {} x {} samples: lower the batch size or the "
                    "number of workers",
                    loader_->samples_per_epoch(), cfg_.accumulation, micro_batch_));
  }
  schedule_.base_lr = cfg_.lr;
  schedule_.global_batch = cfg_.global_batch;
  schedule_.warmup_steps =
      static_cast<std::uint64_t>(std::llround(cfg_.warmup_epochs * static_cast<double>(steps_per_epoch_)));
  schedule_.total_steps = steps_per_epoch_ * cfg_.epochs;
}

Worker::Start Worker::resume_or_initialize() {
  Start start;
  if (!cfg_.resume) {
    start.weights = model_->initial_weights(cfg_.loader.seed);  // rank 0's are broadcast
    start.momentum.assign(model_->param_count(), 0.0F);
    start.buffers = model_->initial_buffers();
    return start;
  }
  Checkpoint ck = load_checkpoint(cfg_.checkpoint);
  const ModelConfig& mc = model_->config();
  const auto mismatch = [&](const char* field, auto have, auto want) {
    if (have != want) {
      throw ConfigError(
          fmt::format("{}: checkpoint {} is {}, this run has {}", cfg_.checkpoint.string(), field, have, want));
    }
  };
  mismatch("world_size", ck.world_size, static_cast<std::uint64_t>(group_.world));
  mismatch("global_batch", ck.global_batch, static_cast<std::uint64_t>(cfg_.global_batch));
  mismatch("seed", ck.seed, cfg_.loader.seed);
  mismatch("parameter count", ck.weights.size(), model_->param_count());
  mismatch("model image_size", ck.model.image_size, mc.image_size);
  if (model_type(mc.kind).uses_pool) mismatch("model pool", ck.model.pool, mc.pool);
  mismatch("model classes", ck.model.classes, mc.classes);
  // The same parameter count can be another shape (--hidden 4,8 vs 8,4):
  // every field of the shape must match.
  mismatch("model", ck.model.spec(), mc.spec());
  mismatch("model buffer count", ck.buffers.size(), model_->buffer_count());
  resumed_dataset_ = ck.dataset;
  if (ck.position > loader_->samples_per_epoch()) {
    throw ConfigError(fmt::format("{}: checkpoint position {} is past the epoch's end ({} samples per rank)",
                                  cfg_.checkpoint.string(), ck.position, loader_->samples_per_epoch()));
  }
  start.weights = std::move(ck.weights);
  start.momentum = std::move(ck.momentum);
  start.buffers = std::move(ck.buffers);
  start.epoch = ck.epoch;
  start.position = ck.position;
  global_step_ = ck.step;
  return start;
}

void Worker::check_dataset() {
  if (cfg_.checkpoint.empty()) return;
  fingerprint_ = loader::fingerprint(loader_->dataset());
  if (!cfg_.resume) return;
  // Index i must still be the same sample: a renamed class permutes the
  // labels, an added file shifts every position after it. Every rank sees
  // the same set and the same checkpoint, so every rank refuses together.
  if (!resumed_dataset_) {
    if (rank_ == 0) {
      pinfeed::detail::log().warn(
          "{}: the checkpoint carries no dataset fingerprint (written before 2026-12-03): "
          "whether the training set changed cannot be checked",
          cfg_.checkpoint.string());
    }
    return;
  }
  const std::string change = loader::describe_change(*resumed_dataset_, *fingerprint_);
  if (change.empty()) return;
  if (!cfg_.allow_dataset_change) {
    throw ConfigError(
        fmt::format("{}: the training set is not the one the checkpoint was taken on: {}. Resuming "
                    "would put other samples and labels at the saved position; --allow-dataset-change "
                    "resumes anyway",
                    cfg_.checkpoint.string(), change));
  }
  if (rank_ == 0) {
    pinfeed::detail::log().warn("{}: resuming on a changed training set (--allow-dataset-change): {}",
                                cfg_.checkpoint.string(), change);
  }
}

void Worker::allocate_buffers() {
  // Every buffer, at its largest, before the first collective (Note [No
  // allocation during collectives]): inputs, statistics, validation, and
  // the staging for host reductions (per-step stats, step counts, metrics).
  const std::size_t sample_bytes = loader_->config().transform.sample_bytes();
  const auto side = static_cast<std::size_t>(model_->config().image_size);
  const std::size_t image_floats = micro_batch_ * 3 * side * side;
  for (std::size_t b = 0; b < 2; ++b) {
    in_[b] = backend_.allocate(micro_batch_ * sample_bytes);
    labels_[b] = backend_.allocate(micro_batch_ * sizeof(std::int32_t));
    compute_done_.push_back(backend_.create_event());
  }
  if (cfg_.device_normalize) images_ = backend_.allocate(image_floats * sizeof(float));
  step_stats_ = backend_.allocate(steps_per_epoch_ * 2 * sizeof(float));
  if (val_loader_) {
    val_in_ = backend_.allocate(micro_batch_ * val_loader_->config().transform.sample_bytes());
    val_images_ = backend_.allocate(image_floats * sizeof(float));
    val_labels_ = backend_.allocate(micro_batch_ * sizeof(std::int32_t));
    val_stats_ = backend_.allocate(2 * sizeof(float));
  }
  allocate_staging(std::max<std::size_t>({static_cast<std::size_t>(group_.world), steps_per_epoch_ * 2, 8}));
  // Every slot the loader has can be waiting on a copy event at once, plus
  // the two in flight here.
  copy_events_ = std::make_unique<EventRing>(backend_, loader_->config().prefetch + 2);
}

void Worker::allocate_staging(std::size_t floats) {
  // Registered with the GPU the copies go to (pageable if the driver
  // refuses); a CPU backend's copies are memcpy: nothing to pin.
  memory::HostResource* r = &staging_pageable_;
  if (backend_.host_pin_method() == memory::PinMethod::cuda_register) {
    memory::PinnedResource::Config pc;
    pc.method = memory::PinMethod::cuda_register;
    pc.huge_pages = false;
    pc.cuda_device = backend_.cuda_device();
    staging_pinned_ = std::make_unique<memory::PinnedResource>(pc);
    staging_resource_ = std::make_unique<memory::FallbackAdaptor>(*staging_pinned_, staging_pageable_);
    r = staging_resource_.get();
  }
  const std::size_t bytes = floats * sizeof(float);
  staging_ = std::unique_ptr<float, std::function<void(float*)>>(static_cast<float*>(r->allocate(bytes)),
                                                                 [r, bytes](float* p) { r->deallocate(p, bytes); });
  staging_floats_ = floats;
  scratch_ = backend_.allocate(bytes);
}

void Worker::broadcast_start(const Start& start) {
  backend_.copy_h2d(*compute_, model_->weights(), start.weights.data(), start.weights.size() * sizeof(float));
  backend_.copy_h2d(*compute_, model_->momentum(), start.momentum.data(), start.momentum.size() * sizeof(float));
  if (!start.buffers.empty()) {
    backend_.copy_h2d(*compute_, model_->buffers(), start.buffers.data(), start.buffers.size() * sizeof(float));
  }
  ddp_->broadcast_parameters(*compute_);
  backend_.synchronize(*compute_);  // `start` goes out of scope after this
}

// ---- training -------------------------------------------------------------

bool Worker::run_epoch(std::uint64_t epoch, std::uint64_t position) {
  std::uint64_t first_step = 0;
  if (position > 0) {
    const loader::LoaderConfig& lc = loader_->config();
    loader_->restore(loader::LoaderState{cfg_.loader.seed, epoch, position, lc.world_size, lc.rank});
    first_step = position / (micro_batch_ * cfg_.accumulation);
  } else {
    loader_->begin_epoch(epoch);
  }
  check_equal_work(epoch, steps_per_epoch_ - first_step);
  backend_.fill(*compute_, step_stats_.as<float>(), steps_per_epoch_ * 2, 0.0F);
  (void)profiler_->take();  // the epoch's sum starts at zero
  EpochSummary summary;
  summary.epoch = epoch;
  double wait_seconds = 0;
  const auto t_epoch = Clock::now();
  std::uint64_t step = first_step;
  bool stopped = false;
  for (; step < steps_per_epoch_; ++step) {
    if (cfg_.max_steps != 0 && global_step_ >= cfg_.max_steps) {
      stopped = true;
      break;
    }
    const auto lr = static_cast<float>(schedule_.at(global_step_));
    for (unsigned micro = 0; micro < cfg_.accumulation; ++micro) micro_step(micro, step, lr, summary, wait_seconds);
    ++global_step_;
    summary.lr = lr;
    if (rank_ == 0 && group_.callbacks.on_step) {
      const double el = seconds_since(t_epoch);
      const std::uint64_t done = step + 1 - first_step;
      group_.callbacks.on_step(StepProgress{epoch, done, steps_per_epoch_ - first_step,
                                            el > 0 ? static_cast<double>(done * cfg_.global_batch) / el : 0});
    }
    if (cfg_.checkpoint_every != 0 && global_step_ % cfg_.checkpoint_every == 0 && step + 1 < steps_per_epoch_) {
      save(epoch, (step + 1) * micro_batch_ * cfg_.accumulation);
    }
  }
  backend_.synchronize(*compute_);
  summary.seconds = seconds_since(t_epoch);
  reduce_epoch(summary, first_step, step, wait_seconds);
  validate_epoch(summary);
  if (stopped) {
    save(epoch, step * micro_batch_ * cfg_.accumulation);
  } else {
    save(epoch + 1, 0);
  }
  publish_epoch(std::move(summary));
  return !stopped;
}

loader::Batch Worker::next_batch(std::size_t b, std::uint64_t step, EpochSummary& s, double& wait_seconds) {
  const auto t0 = Clock::now();
  std::optional<loader::Batch> batch = loader_->next();
  const double waited = seconds_since(t0);
  // Counted as waiting for data only when the device had run dry.
  if (compute_done_[(b + 1) % 2]->ready()) wait_seconds += waited;
  if (!batch) {
    throw Error(fmt::format("rank {}: the loader ended after {} of {} steps in epoch {}", rank_, step, steps_per_epoch_,
                            s.epoch));
  }
  if (batch->size() != micro_batch_) {
    throw Error(
        fmt::format("rank {}: a batch of {} samples where {} were expected", rank_, batch->size(), micro_batch_));
  }
  check_labels(*batch, loader_->dataset(), model_->config().classes);
  (batch->pinned() ? s.pinned_batches : s.pageable_batches) += 1;
  s.replaced += batch->replaced();
  return std::move(*batch);
}

void Worker::micro_step(unsigned micro_in_step, std::uint64_t step, float lr, EpochSummary& s, double& wait_seconds) {
  const std::size_t b = micro_batches_ % 2;
  // Buffer b was last read by the compute two micro-batches ago (which
  // waited for its copy): sleep until the device says so, no polling.
  compute_done_[b]->wait();
  {
    loader::Batch batch = next_batch(b, step, s, wait_seconds);
    // The copy: slot samples and labels (both pinned), then the slot goes
    // back once the copy's event completes (Note [Slot lifetime]) as the
    // batch leaves this scope.
    backend_.stream_wait(*copy_, *compute_done_[b]);
    const std::shared_ptr<Event>& copied = copy_events_->next();
    profiler_->begin(*copy_);
    copy_batch(backend_, *copy_, batch, in_[b].get(), labels_[b].as<std::int32_t>(), copied);
    // The compute, after the copy.
    backend_.stream_wait(*compute_, *copied);
  }
  profiler_->copied(*copy_, *compute_);
  compute(b, micro_in_step, step, lr);
  backend_.record(*compute_done_[b], *compute_);
  ++micro_batches_;
}

void Worker::compute(std::size_t b, unsigned micro_in_step, std::uint64_t step, float lr) {
  using Mark = StepProfiler::Mark;
  profiler_->mark(*compute_, Mark::compute_start);
  const float* x = in_[b].as<float>();
  if (cfg_.device_normalize) {
    const int side = model_->config().image_size;
    backend_.normalize_u8(*compute_, in_[b].as<std::uint8_t>(), images_.as<float>(), static_cast<int>(micro_batch_),
                          side, side, norm_);
    x = images_.as<float>();
  }
  if (micro_in_step == 0) model_->zero_grad(*compute_);
  const bool sync = micro_in_step + 1 == cfg_.accumulation;  // no_sync on all but the last
  ddp_->begin_backward(sync);
  model_->train_step(*compute_, x, labels_[b].as<std::int32_t>(), static_cast<int>(micro_batch_),
                     1.0F / static_cast<float>(cfg_.accumulation), step_stats_.as<float>() + 2 * step,
                     [&](std::size_t p) { ddp_->grad_ready(p, *compute_); });
  profiler_->mark(*compute_, Mark::backward_end);
  ddp_->finish_backward(*compute_);
  profiler_->mark(*compute_, Mark::reduced);
  if (sync)
    model_->sgd(*compute_, SgdStep{lr, static_cast<float>(cfg_.momentum), static_cast<float>(cfg_.weight_decay)});
  profiler_->end(*compute_, sync);
}

StepProfiler::StepProfiler(DeviceBackend& backend, bool enabled)
    : backend_(backend), enabled_(enabled), copied_(enabled ? backend.create_event() : nullptr) {}

void StepProfiler::begin(Stream& copy) {
  if (!enabled_) return;
  marks_ = std::make_shared<Marks>();
  mark(copy, Mark::copy_start);
}

void StepProfiler::mark(Stream& s, Mark m) {
  if (!enabled_) return;
  backend_.host_callback(s, [marks = marks_, m] { (*marks)[static_cast<std::size_t>(m)] = Clock::now(); });
}

void StepProfiler::copied(Stream& copy, Stream& compute) {
  if (!enabled_) return;
  // copy_batch recorded the slot's event before this mark: the compute
  // stream also waits for the mark, so the step's last callback reads
  // copy_end after it was written.
  mark(copy, Mark::copy_end);
  backend_.record(*copied_, copy);
  backend_.stream_wait(compute, *copied_);
}

void StepProfiler::end(Stream& compute, bool sync) {
  if (!enabled_) return;
  // Every mark of this micro-step is taken by now: the compute stream
  // waited for the copy and for the comm stream.
  backend_.host_callback(compute, [this, m = marks_, sync] {
    const auto at = [&](Mark k) { return (*m)[static_cast<std::size_t>(k)]; };
    const auto d = [&](Mark from, Mark to) {
      return at(to) > at(from) ? std::chrono::duration<double>(at(to) - at(from)).count() : 0.0;
    };
    const auto done = Clock::now();
    const std::scoped_lock lock(mutex_);
    sum_.copy += d(Mark::copy_start, Mark::copy_end);
    sum_.forward += d(Mark::compute_start, Mark::forward_end);
    sum_.backward += d(Mark::forward_end, Mark::backward_end);
    if (sync) sum_.allreduce += d(Mark::comm_first, Mark::comm_last);
    sum_.allreduce_exposed += d(Mark::backward_end, Mark::reduced);
    sum_.optimizer += done > at(Mark::reduced) ? std::chrono::duration<double>(done - at(Mark::reduced)).count() : 0.0;
  });
}

StepProfile StepProfiler::take() {
  const std::scoped_lock lock(mutex_);
  return std::exchange(sum_, StepProfile{});
}

void Worker::reduce_epoch(EpochSummary& s, std::uint64_t first_step, std::uint64_t end_step, double wait_seconds) {
  s.steps = end_step - first_step;
  if (cfg_.profile && s.steps > 0) {
    StepProfile mine = profiler_->take();
    mine.wait = wait_seconds;
    std::array<float, kStepProfileFields.size()> v{};
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(mine.*kStepProfileFields[i]);
    host_all_reduce(v);
    const double per = 1.0 / (static_cast<double>(s.steps) * group_.world);  // per step, mean over workers
    s.profile.measured = true;
    for (std::size_t i = 0; i < v.size(); ++i) s.profile.*kStepProfileFields[i] = v[i] * per;
  }
  s.samples = s.steps * cfg_.global_batch;
  s.images_per_second = s.seconds > 0 ? static_cast<double>(s.samples) / s.seconds : 0;

  // Global per-step loss and accuracy: the stats of every rank, summed.
  std::vector<float> st(static_cast<std::size_t>(steps_per_epoch_) * 2);
  backend_.copy_d2h(*compute_, staging_.get(), step_stats_.get(), st.size() * sizeof(float));
  backend_.synchronize(*compute_);
  std::copy(staging_.get(), staging_.get() + st.size(), st.begin());
  host_all_reduce(st);
  double loss = 0, correct = 0;
  for (std::uint64_t k = first_step; k < end_step; ++k) {
    const float step_loss = st[2 * k] / static_cast<float>(cfg_.global_batch);
    if (!std::isfinite(step_loss)) {
      // Every rank sees the same all-reduced loss and stops here together,
      // before the epoch's checkpoint is written with the diverged weights.
      throw Error(
          fmt::format("training diverged: the loss is {} at step {} (epoch {}, step {} of {}): lower the "
                      "learning rate (--lr {:g}), or lengthen the warm-up",
                      step_loss, static_cast<std::uint64_t>(s.epoch) * steps_per_epoch_ + k + 1, s.epoch, k + 1,
                      steps_per_epoch_, cfg_.lr));
    }
    s.step_loss.push_back(step_loss);
    loss += st[2 * k];
    correct += st[2 * k + 1];
  }
  if (s.samples > 0) {
    s.loss = loss / static_cast<double>(s.samples);
    s.accuracy = correct / static_cast<double>(s.samples);
  }

  EpochCounters mine{static_cast<float>(s.seconds > 0 ? wait_seconds / s.seconds : 0),
                     static_cast<float>(s.pinned_batches), static_cast<float>(s.pageable_batches),
                     static_cast<float>(s.replaced)};
  std::array<float, 4> v = mine.values();
  host_all_reduce(v);
  const EpochCounters all = EpochCounters::from(v);
  s.data_wait_fraction = all.wait_fraction / static_cast<float>(group_.world);
  s.pinned_batches = static_cast<std::uint64_t>(all.pinned_batches);
  s.pageable_batches = static_cast<std::uint64_t>(all.pageable_batches);
  s.replaced = static_cast<std::uint64_t>(all.replaced);

  const memory::PoolStats pool = loader_->pool().stats();
  // Every pool of the process (all workers' training and validation
  // loaders), not this worker's alone: what VmLck shows.
  const memory::ProcessPoolStats process = memory::process_pool_stats();
  s.pool_pinned_bytes = process.pinned_bytes;
  s.pool_pageable_bytes = process.pageable_bytes;
  s.pool_transitions = pool.to_pageable + pool.to_pinned + pool.releases;
  s.pool_slots = process.slots;
  s.pool_released_slots = process.released_slots;
  s.pool_given_back_bytes = process.given_back_bytes;
  s.pool_release_seconds = pool.last_release_seconds;
  s.pressure = std::string(memory::to_string(pool.level));
}

void Worker::validate_epoch(EpochSummary& s) {
  if (!val_loader_) return;
  average_buffers();
  val_loader_->begin_epoch(0);
  const int side = model_->config().image_size;
  backend_.fill(*compute_, val_stats_.as<float>(), 2, 0.0F);
  float count = 0;
  while (auto batch = val_loader_->next()) {
    const auto n = static_cast<int>(batch->size());
    // The softmax kernel reads z[label]: a validation label past the
    // model's classes would read outside its row.
    check_labels(*batch, val_loader_->dataset(), model_->config().classes);
    backend_.copy_h2d(*compute_, val_in_.get(), batch->data().data(), batch->data().size());
    backend_.copy_h2d(*compute_, val_labels_.get(), batch->slot_labels().data(), batch->size() * sizeof(std::int32_t));
    const float* x = val_in_.as<float>();
    if (cfg_.device_normalize) {
      backend_.normalize_u8(*compute_, val_in_.as<std::uint8_t>(), val_images_.as<float>(), n, side, side, norm_);
      x = val_images_.as<float>();
    }
    model_->evaluate(*compute_, x, val_labels_.as<std::int32_t>(), n, val_stats_.as<float>());
    backend_.synchronize(*compute_);  // the slot is reused next
    count += static_cast<float>(n);
  }
  backend_.copy_d2h(*compute_, staging_.get(), val_stats_.get(), 2 * sizeof(float));
  backend_.synchronize(*compute_);
  std::array<float, 3> v{staging_.get()[0], staging_.get()[1], count};
  host_all_reduce(v);
  s.val_loss = v[2] > 0 ? v[0] / v[2] : std::numeric_limits<double>::quiet_NaN();
  s.val_accuracy = v[2] > 0 ? v[1] / v[2] : std::numeric_limits<double>::quiet_NaN();
}

void Worker::check_equal_work(std::uint64_t epoch, std::uint64_t steps) {
  std::vector<float> counts(static_cast<std::size_t>(group_.world), 0.0F);
  counts[static_cast<std::size_t>(rank_)] = static_cast<float>(steps);
  host_all_reduce(counts);
  for (std::size_t r = 0; r < counts.size(); ++r) {
    if (counts[r] != counts[0]) {
      throw Error(
          fmt::format("epoch {}: rank {} has {} steps but rank {} has {}: every rank must run the same number "
                      "of steps (same dataset, batch size and drop_last on every rank)",
                      epoch, r, counts[r], 0, counts[0]));
    }
  }
}

void Worker::host_all_reduce(std::span<float> v) {
  // On the comm stream, after whatever DDP put there, through the staging
  // buffer and scratch_, both sized before the first collective (Note [No
  // allocation during collectives]).
  Stream& s = ddp_->comm_stream();
  const std::size_t bytes = v.size() * sizeof(float);
  if (v.size() > staging_floats_ || bytes > scratch_.bytes()) {
    throw Error(fmt::format("rank {}: a reduction of {} values exceeds the {} sized before training", rank_, v.size(),
                            staging_floats_));
  }
  std::copy(v.begin(), v.end(), staging_.get());
  backend_.copy_h2d(s, scratch_.get(), staging_.get(), bytes);
  comm_.all_reduce(s, scratch_.as<float>(), v.size(), ReduceOp::sum);
  backend_.copy_d2h(s, staging_.get(), scratch_.get(), bytes);
  backend_.synchronize(s);
  std::copy(staging_.get(), staging_.get() + v.size(), v.begin());
}

void Worker::average_buffers() {
  if (group_.world <= 1 || model_->buffer_count() == 0) return;
  ddp_->collective(*compute_, model_->buffers(), model_->buffer_count(), ReduceOp::average);
}

void Worker::save(std::uint64_t epoch, std::uint64_t position) {
  if (!cfg_.checkpoint.empty()) average_buffers();  // every rank: a collective
  backend_.synchronize(*compute_);
  if (rank_ != 0 || cfg_.checkpoint.empty()) return;
  Checkpoint c;
  c.step = global_step_;
  c.epoch = epoch;
  c.position = position;
  c.seed = cfg_.loader.seed;
  c.world_size = static_cast<std::uint64_t>(group_.world);
  c.global_batch = cfg_.global_batch;
  c.model = model_->config();
  c.dataset = fingerprint_;
  c.weights.resize(model_->param_count());
  c.momentum.resize(model_->param_count());
  backend_.copy_d2h(*compute_, c.weights.data(), model_->weights(), c.weights.size() * sizeof(float));
  backend_.copy_d2h(*compute_, c.momentum.data(), model_->momentum(), c.momentum.size() * sizeof(float));
  c.buffers.resize(model_->buffer_count());
  if (!c.buffers.empty()) {
    backend_.copy_d2h(*compute_, c.buffers.data(), model_->buffers(), c.buffers.size() * sizeof(float));
  }
  backend_.synchronize(*compute_);
  save_checkpoint(cfg_.checkpoint, c);
  pinfeed::detail::log().info("checkpoint: step {}, epoch {} position {} -> {}", c.step, epoch, position,
                              cfg_.checkpoint.string());
}

// ---- results --------------------------------------------------------------

void Worker::publish_epoch(EpochSummary s) {
  if (local_ != 0) return;  // the reductions made every worker's summary the same
  if (group_.callbacks.on_epoch) group_.callbacks.on_epoch(s);
  const std::scoped_lock lock(group_.mutex);
  group_.result.epochs.push_back(std::move(s));
  group_.result.steps_per_epoch = steps_per_epoch_;
}

void Worker::publish_result(double seconds) {
  backend_.synchronize(*compute_);
  if (local_ != 0) return;
  std::vector<float> weights(model_->param_count());
  backend_.copy_d2h(*compute_, weights.data(), model_->weights(), weights.size() * sizeof(float));
  backend_.synchronize(*compute_);
  const std::scoped_lock lock(group_.mutex);
  group_.result.weights = std::move(weights);
  group_.result.steps = global_step_;
  group_.result.loader_threads = loader_->threads() * static_cast<unsigned>(group_.local_workers);
  group_.result.local_workers = group_.local_workers;
  group_.result.seconds = seconds;
}

}  // namespace pinfeed::trainer::detail
