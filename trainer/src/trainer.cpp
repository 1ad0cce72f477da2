#include "pinfeed/trainer/trainer.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "pinfeed/log.hpp"
#include "pinfeed/memory/fallback_adaptor.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/trainer/checkpoint.hpp"
#include "pinfeed/trainer/device_type.hpp"
#include "pinfeed/trainer/schedule.hpp"

namespace pinfeed::trainer {

DeviceSpec parse_devices(std::string_view text) {
  if (text == "auto") {  // every device of the first indexed type that has any, else two CPU workers
    for (const DeviceType* t : device_types()) {
      if (t->indexed && t->visible() > 0) return parse_devices(fmt::format("{}:all", t->name));
    }
    return parse_devices(fmt::format("cpu:{}", std::min(2U, std::max(1U, std::thread::hardware_concurrency()))));
  }
  const auto colon = text.find(':');
  const std::string_view name = text.substr(0, colon);
  const std::string_view rest = colon == std::string_view::npos ? std::string_view() : text.substr(colon + 1);
  const auto number = [&](std::string_view s) {
    int v = -1;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size() || v < 0) {
      throw ConfigError(fmt::format("devices '{}': '{}' is not a number", text, s));
    }
    return v;
  };
  const DeviceType* type = nullptr;
  try {
    type = &device_type(name);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("devices '{}': {}; give <type>[:N] (workers), <type>:all or <type>:I,J,... (indices)",
                                  text, e.what()));
  }
  DeviceSpec spec;
  spec.kind = type->kind;
  if (!type->indexed) {  // "cpu:N": N workers
    spec.count = rest.empty() ? 1 : number(rest);
    if (spec.count < 1 || spec.count > type->visible()) {
      throw ConfigError(fmt::format("devices '{}': {} workers must be 1..{}", text, type->name, type->visible()));
    }
    return spec;
  }
  if (rest.empty() || rest == "all") {
    spec.all = true;
    spec.count = 0;
    return spec;
  }
  std::size_t start = 0;
  while (start <= rest.size()) {
    const auto comma = rest.find(',', start);
    const std::string_view item = rest.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    const int d = number(item);
    if (std::find(spec.devices.begin(), spec.devices.end(), d) != spec.devices.end()) {
      throw ConfigError(fmt::format("devices '{}': {}:{} listed twice", text, type->name, d));
    }
    spec.devices.push_back(d);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  spec.count = static_cast<int>(spec.devices.size());
  return spec;
}

void TrainConfig::validate() const {
  if (global_batch < 1) throw ConfigError("global_batch must be >= 1");
  if (accumulation < 1) throw ConfigError("accumulation must be >= 1");
  if (epochs < 1 || epochs > 100000) throw ConfigError(fmt::format("epochs must be 1..100000, got {}", epochs));
  if (!(lr > 0) || !std::isfinite(lr)) throw ConfigError(fmt::format("lr must be > 0, got {}", lr));
  if (!(momentum >= 0 && momentum < 1)) throw ConfigError(fmt::format("momentum must be in [0, 1), got {}", momentum));
  if (!(weight_decay >= 0)) throw ConfigError(fmt::format("weight_decay must be >= 0, got {}", weight_decay));
  if (!(warmup_epochs >= 0)) throw ConfigError(fmt::format("warmup_epochs must be >= 0, got {}", warmup_epochs));
  if (resume && checkpoint.empty()) throw ConfigError("resume needs a checkpoint path");
  ddp.validate();
}

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

/// Events reused round-robin: one per copy, without creating and destroying
/// one every step. An event is re-recorded `size` copies later; a slot
/// released after it (Note [Slot lifetime]) is by then long free, and at
/// worst would wait for the newer copy: later, never earlier.
class EventRing {
 public:
  EventRing(DeviceBackend& backend, std::size_t size) {
    for (std::size_t i = 0; i < size; ++i) events_.push_back(backend.create_event());
  }
  const std::shared_ptr<Event>& next() { return events_[next_++ % events_.size()]; }

 private:
  std::vector<std::shared_ptr<Event>> events_;
  std::size_t next_ = 0;
};

/// What every worker of this process shares.
struct Job {
  Job(const TrainConfig& c, const TrainCallbacks& cb) : config(c), callbacks(cb) {}
  const TrainConfig& config;
  const TrainCallbacks& callbacks;
  int world = 1;        // ranks in all
  int first_rank = 0;   // rank of this process's worker 0
  int local_workers = 1;
  unsigned local_processes = 1;  // processes of this job on this host (the launcher's local size)
  std::mutex mutex;     // guards error, result and ready_workers
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
  void arrive_allocated() {
    std::unique_lock lock(mutex);
    ++ready_workers;
    ready_cv.notify_all();
    ready_cv.wait(lock, [&] { return ready_workers >= local_workers || error; });
    if (error) throw Cancelled("another worker failed before training started");
  }
  void fail(std::exception_ptr e) {
    {
      const std::scoped_lock lock(mutex);
      if (!error) error = std::move(e);
    }
    ready_cv.notify_all();
  }
};

class Worker {
 public:
  Worker(Job& job, int local, DeviceBackend& backend, Communicator& comm)
      : job_(job), cfg_(job.config), local_(local), rank_(job.first_rank + local), backend_(backend), comm_(comm) {}

  void run();

 private:
  void host_all_reduce(std::vector<float>& v);
  void check_equal_work(std::uint64_t epoch, std::uint64_t steps);
  void save(std::uint64_t epoch, std::uint64_t position);
  void validate_epoch(EpochSummary& s);
  void allocate_staging(std::size_t floats);

  Job& job_;
  const TrainConfig& cfg_;
  int local_, rank_;
  DeviceBackend& backend_;
  Communicator& comm_;
  // Order matters: the streams are declared last so they are destroyed
  // (drained) first, while every buffer their queued work touches still exists.
  std::unique_ptr<loader::Loader> loader_, val_loader_;
  std::unique_ptr<Mlp> model_;
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
  std::size_t micro_ = 0;
  std::uint64_t global_step_ = 0;
};

void Worker::host_all_reduce(std::vector<float>& v) {
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

void Worker::check_equal_work(std::uint64_t epoch, std::uint64_t steps) {
  std::vector<float> counts(static_cast<std::size_t>(job_.world), 0.0F);
  counts[static_cast<std::size_t>(rank_)] = static_cast<float>(steps);
  host_all_reduce(counts);
  for (std::size_t r = 0; r < counts.size(); ++r) {
    if (counts[r] != counts[0]) {
      throw Error(fmt::format("epoch {}: rank {} has {} steps but rank {} has {}: every rank must run the same number "
                              "of steps (same dataset, batch size and drop_last on every rank)",
                              epoch, r, counts[r], 0, counts[0]));
    }
  }
}

void Worker::save(std::uint64_t epoch, std::uint64_t position) {
  backend_.synchronize(*compute_);
  if (rank_ != 0 || cfg_.checkpoint.empty()) return;
  Checkpoint c;
  c.step = global_step_;
  c.epoch = epoch;
  c.position = position;
  c.seed = cfg_.loader.seed;
  c.world_size = static_cast<std::uint64_t>(job_.world);
  c.global_batch = cfg_.global_batch;
  c.model = model_->config();
  c.weights.resize(model_->param_count());
  c.momentum.resize(model_->param_count());
  backend_.copy_d2h(*compute_, c.weights.data(), model_->weights(), c.weights.size() * sizeof(float));
  backend_.copy_d2h(*compute_, c.momentum.data(), model_->momentum(), c.momentum.size() * sizeof(float));
  backend_.synchronize(*compute_);
  save_checkpoint(cfg_.checkpoint, c);
  pinfeed::detail::log().info("checkpoint: step {}, epoch {} position {} -> {}", c.step, epoch, position, cfg_.checkpoint.string());
}

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

void Worker::validate_epoch(EpochSummary& s) {
  if (!val_loader_) return;
  val_loader_->begin_epoch(0);
  const auto size = static_cast<std::size_t>(model_->config().image_size);
  DeviceBuffer& in = val_in_;
  DeviceBuffer& images = val_images_;
  DeviceBuffer& labels = val_labels_;
  DeviceBuffer& stats = val_stats_;
  backend_.fill(*compute_, stats.as<float>(), 2, 0.0F);
  float count = 0;
  while (auto batch = val_loader_->next()) {
    const auto n = static_cast<int>(batch->size());
    // The softmax kernel reads z[label]: a validation label past the
    // model's classes would read outside its row.
    check_labels(*batch, val_loader_->dataset(), model_->config().classes);
    backend_.copy_h2d(*compute_, in.get(), batch->data().data(), batch->data().size());
    backend_.copy_h2d(*compute_, labels.get(), batch->slot_labels().data(), batch->size() * sizeof(std::int32_t));
    const float* x = in.as<float>();
    if (cfg_.device_normalize) {
      Normalization norm{cfg_.loader.transform.mean, cfg_.loader.transform.std};
      backend_.normalize_u8(*compute_, in.as<std::uint8_t>(), images.as<float>(), n, static_cast<int>(size),
                            static_cast<int>(size), norm);
      x = images.as<float>();
    }
    model_->evaluate(*compute_, x, labels.as<std::int32_t>(), n, stats.as<float>());
    backend_.synchronize(*compute_);  // the slot is reused next
    count += static_cast<float>(n);
  }
  backend_.copy_d2h(*compute_, staging_.get(), stats.get(), 2 * sizeof(float));
  backend_.synchronize(*compute_);
  std::vector<float> v{staging_.get()[0], staging_.get()[1], count};
  host_all_reduce(v);
  s.val_loss = v[2] > 0 ? v[0] / v[2] : std::numeric_limits<double>::quiet_NaN();
  s.val_accuracy = v[2] > 0 ? v[1] / v[2] : std::numeric_limits<double>::quiet_NaN();
}

void Worker::run() {
  // First, before the Loader registers its slots: this thread's device.
  backend_.make_current();
  const auto world = static_cast<std::size_t>(job_.world);
  const std::size_t per_rank = cfg_.global_batch / world;
  micro_ = per_rank / cfg_.accumulation;

  loader::LoaderConfig lc = cfg_.loader;
  lc.rank = static_cast<unsigned>(rank_);
  lc.world_size = static_cast<unsigned>(job_.world);
  lc.batch_size = micro_;
  lc.drop_last_batch = true;  // every step has the global batch
  lc.transform.layout = cfg_.device_normalize ? loader::Layout::nhwc_u8 : loader::Layout::nchw_f32;
  const unsigned cores = std::max(1U, std::thread::hardware_concurrency());
  const unsigned threads = cfg_.loader.threads == 0 ? cores : cfg_.loader.threads;
  lc.threads = std::max(1U, threads / static_cast<unsigned>(job_.local_workers));
  // Every loader of every worker on this host shares its memory: the pinned
  // budget and the pool-fit allowance are split across all of them.
  lc.local_ranks = (cfg_.loader.local_ranks != 0 ? cfg_.loader.local_ranks : job_.local_processes) *
                   static_cast<unsigned>(job_.local_workers);
  lc.cuda_device = backend_.cuda_device();  // slots registered with this GPU current, on every thread
  // The device decides how its source memory is pinned (a CPU worker's
  // copies are memcpy: mlock, no driver registration).
  if (lc.pin_method == memory::PinMethod::automatic) lc.pin_method = backend_.host_pin_method();
  loader_ = std::make_unique<loader::Loader>(lc);
  if (!cfg_.val_dataset.empty()) {
    loader::LoaderConfig vc = lc;
    vc.dataset = cfg_.val_dataset;
    vc.shuffle = false;
    vc.drop_last_batch = false;
    vc.transform.crop = loader::CropMode::center;
    vc.transform.flip = false;
    vc.prefetch = 2;
    vc.watch_pressure = false;
    val_loader_ = std::make_unique<loader::Loader>(vc);
  }

  ModelConfig mc = cfg_.model;
  mc.image_size = lc.transform.size;
  mc.classes = static_cast<int>(std::max<std::size_t>(2, loader_->dataset().num_classes()));
  model_ = std::make_unique<Mlp>(backend_, mc, static_cast<int>(micro_));
  ddp_ = std::make_unique<DdpEngine>(backend_, comm_, model_->params(), model_->weights(), model_->grads(), cfg_.ddp);
  compute_ = backend_.create_stream();
  copy_ = backend_.create_stream();

  // Initial weights (rank 0's, broadcast) or the checkpoint's.
  Checkpoint ck;
  std::vector<float> w, m(model_->param_count(), 0.0F);
  if (cfg_.resume) {
    ck = load_checkpoint(cfg_.checkpoint);
    const auto mismatch = [&](const char* field, auto have, auto want) {
      if (have != want) {
        throw ConfigError(fmt::format("{}: checkpoint {} is {}, this run has {}", cfg_.checkpoint.string(), field, have, want));
      }
    };
    mismatch("world_size", ck.world_size, static_cast<std::uint64_t>(job_.world));
    mismatch("global_batch", ck.global_batch, static_cast<std::uint64_t>(cfg_.global_batch));
    mismatch("seed", ck.seed, cfg_.loader.seed);
    mismatch("parameter count", ck.weights.size(), model_->param_count());
    mismatch("model image_size", ck.model.image_size, mc.image_size);
    mismatch("model pool", ck.model.pool, mc.pool);
    mismatch("model classes", ck.model.classes, mc.classes);
    // The same parameter count can be another shape (--hidden 4,8 vs 8,4):
    // every field of the shape must match.
    mismatch("model hidden widths", fmt::format("{}", fmt::join(ck.model.hidden, ",")),
             fmt::format("{}", fmt::join(mc.hidden, ",")));
    w = std::move(ck.weights);
    m = std::move(ck.momentum);
    global_step_ = ck.step;
  } else {
    w = model_->initial_weights(cfg_.loader.seed);
  }
  const std::uint64_t steps_per_epoch = loader_->batches_per_epoch() / cfg_.accumulation;
  if (steps_per_epoch == 0) {
    throw ConfigError(fmt::format("{} samples per rank make no step of {} x {} samples: lower the batch size or the "
                                  "number of workers",
                                  loader_->samples_per_epoch(), cfg_.accumulation, micro_));
  }
  // Every buffer, at its largest, before the first collective (Note [No
  // allocation during collectives]): inputs, statistics, validation, and
  // the staging for host reductions (per-step stats, step counts, metrics).
  const std::size_t sample_bytes = lc.transform.sample_bytes();
  {
    const auto side = static_cast<std::size_t>(mc.image_size);
    for (std::size_t b = 0; b < 2; ++b) {
      in_[b] = backend_.allocate(micro_ * sample_bytes);
      labels_[b] = backend_.allocate(micro_ * sizeof(std::int32_t));
    }
    if (cfg_.device_normalize) images_ = backend_.allocate(micro_ * 3 * side * side * sizeof(float));
    step_stats_ = backend_.allocate(steps_per_epoch * 2 * sizeof(float));
    if (val_loader_) {
      val_in_ = backend_.allocate(micro_ * val_loader_->config().transform.sample_bytes());
      val_images_ = backend_.allocate(micro_ * 3 * side * side * sizeof(float));
      val_labels_ = backend_.allocate(micro_ * sizeof(std::int32_t));
      val_stats_ = backend_.allocate(2 * sizeof(float));
    }
    allocate_staging(std::max<std::size_t>({static_cast<std::size_t>(job_.world), steps_per_epoch * 2, 8}));
  }
  job_.arrive_allocated();

  backend_.copy_h2d(*compute_, model_->weights(), w.data(), w.size() * sizeof(float));
  backend_.copy_h2d(*compute_, model_->momentum(), m.data(), m.size() * sizeof(float));
  ddp_->broadcast_parameters(*compute_);
  backend_.synchronize(*compute_);

  LrSchedule schedule;
  schedule.base_lr = cfg_.lr;
  schedule.global_batch = cfg_.global_batch;
  schedule.warmup_steps = static_cast<std::uint64_t>(std::llround(cfg_.warmup_epochs * static_cast<double>(steps_per_epoch)));
  schedule.total_steps = steps_per_epoch * cfg_.epochs;

  const auto size = static_cast<std::size_t>(mc.image_size);
  DeviceBuffer(&in)[2] = in_;
  DeviceBuffer(&labels)[2] = labels_;
  DeviceBuffer& images = images_;
  DeviceBuffer& step_stats = step_stats_;
  std::shared_ptr<Event> compute_done[2] = {backend_.create_event(), backend_.create_event()};
  // Every slot the loader has can be waiting on a copy event at once, plus
  // the two in flight here.
  EventRing copy_events(backend_, lc.prefetch + 2);
  const Normalization norm{cfg_.loader.transform.mean, cfg_.loader.transform.std};
  const bool report = rank_ == 0;

  const std::uint64_t start_epoch = cfg_.resume ? ck.epoch : 0;
  const std::uint64_t start_position = cfg_.resume ? ck.position : 0;
  std::uint64_t micro_index = 0;
  bool stop = false;
  const auto t_train = Clock::now();
  for (std::uint64_t epoch = start_epoch; epoch < cfg_.epochs && !stop; ++epoch) {
    std::uint64_t first_step = 0;
    if (epoch == start_epoch && start_position > 0) {
      loader_->restore(loader::LoaderState{cfg_.loader.seed, epoch, start_position, lc.world_size, lc.rank});
      first_step = start_position / (micro_ * cfg_.accumulation);
    } else {
      loader_->begin_epoch(epoch);
    }
    check_equal_work(epoch, steps_per_epoch - first_step);
    backend_.fill(*compute_, step_stats.as<float>(), steps_per_epoch * 2, 0.0F);
    EpochSummary summary;
    summary.epoch = epoch;
    double wait_seconds = 0;
    const auto t_epoch = Clock::now();
    std::uint64_t step = first_step;
    for (; step < steps_per_epoch; ++step) {
      if (cfg_.max_steps != 0 && global_step_ >= cfg_.max_steps) {
        stop = true;
        break;
      }
      const float lr = static_cast<float>(schedule.at(global_step_));
      for (unsigned micro = 0; micro < cfg_.accumulation; ++micro, ++micro_index) {
        const std::size_t b = micro_index % 2;
        // Buffer b was last read by the compute two micro-steps ago (which
        // waited for its copy): sleep until the device says so, no polling.
        compute_done[b]->wait();
        const auto t0 = Clock::now();
        std::optional<loader::Batch> batch = loader_->next();
        const double waited = seconds_since(t0);
        // Counted as waiting for data only when the device had run dry.
        if (compute_done[(micro_index + 1) % 2]->ready()) wait_seconds += waited;
        if (!batch) {
          throw Error(fmt::format("rank {}: the loader ended after {} of {} steps in epoch {}", rank_, step,
                                  steps_per_epoch, epoch));
        }
        if (batch->size() != micro_) {
          throw Error(fmt::format("rank {}: a batch of {} samples where {} were expected", rank_, batch->size(), micro_));
        }
        check_labels(*batch, loader_->dataset(), mc.classes);
        (batch->pinned() ? summary.pinned_batches : summary.pageable_batches) += 1;
        summary.replaced += batch->replaced();

        backend_.stream_wait(*copy_, *compute_done[b]);
        backend_.copy_h2d(*copy_, in[b].get(), batch->data().data(), batch->data().size());
        backend_.copy_h2d(*copy_, labels[b].get(), batch->slot_labels().data(), micro_ * sizeof(std::int32_t));
        const std::shared_ptr<Event>& copied = copy_events.next();
        backend_.record(*copied, *copy_);
        batch->lease().release_after(copied);  // Note [Slot lifetime]
        batch.reset();

        backend_.stream_wait(*compute_, *copied);
        const float* x = in[b].as<float>();
        if (cfg_.device_normalize) {
          backend_.normalize_u8(*compute_, in[b].as<std::uint8_t>(), images.as<float>(), static_cast<int>(micro_),
                                static_cast<int>(size), static_cast<int>(size), norm);
          x = images.as<float>();
        }
        if (micro == 0) model_->zero_grad(*compute_);
        const bool sync = micro + 1 == cfg_.accumulation;
        ddp_->begin_backward(sync);
        model_->train_step(*compute_, x, labels[b].as<std::int32_t>(), static_cast<int>(micro_),
                           1.0F / static_cast<float>(cfg_.accumulation), step_stats.as<float>() + 2 * step,
                           [&](std::size_t p) { ddp_->grad_ready(p, *compute_); });
        ddp_->finish_backward(*compute_);
        if (sync) {
          model_->sgd(*compute_, SgdStep{lr, static_cast<float>(cfg_.momentum), static_cast<float>(cfg_.weight_decay)});
        }
        backend_.record(*compute_done[b], *compute_);
      }
      ++global_step_;
      summary.lr = lr;
      if (report && job_.callbacks.on_step) {
        const double el = seconds_since(t_epoch);
        job_.callbacks.on_step(StepProgress{epoch, step + 1 - first_step, steps_per_epoch - first_step,
                                            el > 0 ? static_cast<double>((step + 1 - first_step) * cfg_.global_batch) / el : 0});
      }
      if (cfg_.checkpoint_every != 0 && global_step_ % cfg_.checkpoint_every == 0 && step + 1 < steps_per_epoch) {
        save(epoch, (step + 1) * micro_ * cfg_.accumulation);
      }
    }
    backend_.synchronize(*compute_);
    summary.seconds = seconds_since(t_epoch);
    summary.steps = step - first_step;
    summary.samples = summary.steps * cfg_.global_batch;

    // Global per-step loss and accuracy: sum the stats of every rank.
    std::vector<float> st(static_cast<std::size_t>(steps_per_epoch) * 2);
    backend_.copy_d2h(*compute_, staging_.get(), step_stats.get(), st.size() * sizeof(float));
    backend_.synchronize(*compute_);
    std::copy(staging_.get(), staging_.get() + st.size(), st.begin());
    host_all_reduce(st);
    double loss = 0, correct = 0;
    for (std::uint64_t k = first_step; k < step; ++k) {
      summary.step_loss.push_back(st[2 * k] / static_cast<float>(cfg_.global_batch));
      loss += st[2 * k];
      correct += st[2 * k + 1];
    }
    if (summary.samples > 0) {
      summary.loss = loss / static_cast<double>(summary.samples);
      summary.accuracy = correct / static_cast<double>(summary.samples);
    }
    std::vector<float> extra{static_cast<float>(summary.seconds > 0 ? wait_seconds / summary.seconds : 0),
                             static_cast<float>(summary.pinned_batches), static_cast<float>(summary.pageable_batches),
                             static_cast<float>(summary.replaced)};
    host_all_reduce(extra);
    summary.data_wait_fraction = extra[0] / static_cast<float>(job_.world);
    summary.pinned_batches = static_cast<std::uint64_t>(extra[1]);
    summary.pageable_batches = static_cast<std::uint64_t>(extra[2]);
    summary.replaced = static_cast<std::uint64_t>(extra[3]);
    summary.images_per_second = summary.seconds > 0 ? static_cast<double>(summary.samples) / summary.seconds : 0;
    const memory::PoolStats pool = loader_->pool().stats();
    // Every pool of the process (all workers' training and validation
    // loaders), not this worker's alone: what VmLck shows.
    const memory::ProcessPoolStats all = memory::process_pool_stats();
    summary.pool_pinned_bytes = all.pinned_bytes;
    summary.pool_pageable_bytes = all.pageable_bytes;
    summary.pool_transitions = pool.to_pageable + pool.to_pinned;
    summary.pressure = std::string(memory::to_string(pool.level));
    validate_epoch(summary);
    if (!stop || step == steps_per_epoch) {
      save(epoch + 1, 0);
    } else {
      save(epoch, step * micro_ * cfg_.accumulation);
    }
    if (local_ == 0) {
      if (job_.callbacks.on_epoch) job_.callbacks.on_epoch(summary);
      const std::scoped_lock lock(job_.mutex);
      job_.result.epochs.push_back(std::move(summary));
      job_.result.steps_per_epoch = steps_per_epoch;
    }
  }
  backend_.synchronize(*compute_);
  if (local_ == 0) {
    std::vector<float> weights(model_->param_count());
    backend_.copy_d2h(*compute_, weights.data(), model_->weights(), weights.size() * sizeof(float));
    backend_.synchronize(*compute_);
    const std::scoped_lock lock(job_.mutex);
    job_.result.weights = std::move(weights);
    job_.result.steps = global_step_;
    job_.result.seconds = seconds_since(t_train);
  }
}

}  // namespace

TrainResult train(const TrainConfig& config, const TrainCallbacks& callbacks) {
  config.validate();
  const LaunchEnv env = config.launch ? *config.launch : read_launch_env();
  // Found before the first epoch, not after it: a checkpoint that cannot be
  // written (missing or read-only folder, a directory in its place). Rank 0
  // writes it, so rank 0 checks.
  if (!config.checkpoint.empty() && env.rank == 0) check_checkpoint_writable(config.checkpoint);
  const bool multi_process = env.world_size > 1;
  Job job(config, callbacks);
  job.local_processes = static_cast<unsigned>(std::max(1, env.local_size));
  DeviceSpec spec = config.devices;

  const DeviceType& type = device_type(spec.kind);
  std::vector<std::unique_ptr<DeviceBackend>> backends;
  BackendOptions options;
  options.copy_delay = config.copy_delay;
  if (type.indexed) {
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
      if (d >= visible) throw ConfigError(fmt::format("devices: {}:{} does not exist ({} visible)", type.name, d, visible));
      backends.push_back(type.make_backend(d, options));
    }
  } else {
    // Worker i of this process, named by its global rank.
    for (int i = 0; i < spec.count; ++i) backends.push_back(type.make_backend((multi_process ? env.rank : 0) + i, options));
  }
  if (multi_process && spec.count != 1) {
    throw ConfigError(fmt::format("devices: under {} each process runs one worker; got {} (use cpu:1 or cuda:all)",
                                  env.launcher, spec.count));
  }
  job.local_workers = spec.count;
  job.world = multi_process ? env.world_size : spec.count;
  job.first_rank = multi_process ? env.rank : 0;
  if (config.global_batch % static_cast<std::size_t>(job.world) != 0) {
    throw ConfigError(fmt::format("batch size {} is not divisible by the {} workers", config.global_batch, job.world));
  }
  if ((config.global_batch / static_cast<std::size_t>(job.world)) % config.accumulation != 0) {
    throw ConfigError(fmt::format("per-worker batch {} is not divisible by accumulation {}",
                                  config.global_batch / static_cast<std::size_t>(job.world), config.accumulation));
  }

  std::vector<std::unique_ptr<Communicator>> comms;
  if (!multi_process && spec.count == 1) {
    comms.push_back(make_solo_communicator());  // one worker: nothing to exchange, no NCCL needed
  } else if (multi_process) {
    comms.push_back(type.make_launched(*backends[0], config.comm));
    if (comms[0]->size() != env.world_size) {
      throw ConfigError(fmt::format("{} says {} processes but MPI sees {}: launch multi-process runs with mpirun",
                                    env.launcher, env.world_size, comms[0]->size()));
    }
  } else {
    std::vector<DeviceBackend*> raw;
    for (auto& b : backends) raw.push_back(b.get());
    comms = type.make_group(raw, config.comm);
  }

  {
    std::vector<std::jthread> threads;
    for (int i = 0; i < spec.count; ++i) {
      threads.emplace_back([&, i] {
        // The worker outlives the catch: its streams may be blocked in a
        // collective that only the abort below releases.
        Worker worker(job, i, *backends[static_cast<std::size_t>(i)], *comms[static_cast<std::size_t>(i)]);
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
          job.fail(std::current_exception());
          // Every communicator of the process: ncclCommAbort sets only the
          // flags of the one it is given, and the others' ranks would wait
          // in their collectives until the timeout.
          for (auto& c : comms) c->abort(fmt::format("rank {}: {}", job.first_rank + i, what));
        }
      });
    }
  }
  if (job.error) std::rethrow_exception(job.error);
  job.result.world_size = job.world;
  job.result.rank = job.first_rank;
  job.result.communicator = comms[0]->name();
  for (std::size_t i = 0; i < backends.size(); ++i) {
    job.result.devices += (i ? ", " : "") + backends[i]->name();
  }
  return std::move(job.result);
}

}  // namespace pinfeed::trainer
