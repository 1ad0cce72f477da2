#include "pinfeed/loader/loader.hpp"

#include <fmt/format.h>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/enumerable_thread_specific.h>
#include <oneapi/tbb/flow_graph.h>
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>
#include <cmath>

#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <stop_token>

#include "epoch_run.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/launch_env.hpp"
#include "pinfeed/loader/dataset_kinds.hpp"
#include "pinfeed/loader/options.hpp"
#include "pinfeed/loader/sample_rng.hpp"
#include "pinfeed/loader/sample_stage.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/memory/cuda_host.hpp"
#include "pinfeed/memory/memory_snapshot.hpp"
#include "pinfeed/memory/pinned_budget.hpp"
#include "pinfeed/memory/pool_plan.hpp"

namespace flow = oneapi::tbb::flow;

namespace pinfeed::loader {

unsigned default_threads(unsigned requested, unsigned local_ranks) {
  if (requested != 0) return requested;
  const auto cores = static_cast<unsigned>(std::max(1, oneapi::tbb::info::default_concurrency()));
  return std::max(1U, cores / std::max(1U, local_ranks));
}

BadSamplePolicy parse_bad_sample_policy(std::string_view text) {
  return parse_enum(kBadSamplePolicyWords, text, "bad-sample policy");
}
std::string_view to_string(BadSamplePolicy p) noexcept { return enum_word(kBadSamplePolicyWords, p); }

void LoaderConfig::validate() const {
  if (dataset.empty()) throw ConfigError("loader dataset: no path given");
  // Every option's range, from the one table (options.hpp); then the rules
  // between fields.
  for (const LoaderOption& o : loader_options()) o.check(*this);
  if (world_size == 0 || rank >= world_size) {
    throw ConfigError(fmt::format("loader rank {} is not in 0..world_size-1 (world_size {})", rank, world_size));
  }
  if (watch_pressure && pressure_floor > std::max<std::size_t>(prefetch, 2)) {
    pinfeed::detail::log().warn(
        "loader: pressure_floor {} is over the pool's {} slots (prefetch): under critical "
        "pressure no slot is given back (at most {} does something)",
        pressure_floor, prefetch, prefetch);
  }
  transform.validate_relations();  // scale and ratio ranges ordered, resize >= size for a center crop, std > 0
  for (std::size_t c = 0; c < 3; ++c) {
    if (!std::isfinite(transform.mean[c]) || !std::isfinite(transform.std[c])) {
      throw ConfigError(fmt::format("loader mean[{}] and std[{}] must be finite", c, c));
    }
  }
  const std::uint64_t slot = slot_bytes();
  if (slot > memory::kMaxRegistrationBytes) {
    throw ConfigError(fmt::format("loader: one batch of {} bytes exceeds the slot maximum of {} bytes", slot,
                                  memory::kMaxRegistrationBytes));
  }
}

// ---------------------------------------------------------------- Batch

Batch::Batch(Batch&& o) noexcept = default;
Batch& Batch::operator=(Batch&& o) noexcept {
  if (this != &o) {
    const std::size_t slot = lease_.index();
    lease_.release();
    if (run_ && !lease_.was_lent()) run_->return_token(slot);  // a lent batch's token went back when it was lent
    run_ = std::move(o.run_);
    lease_ = std::move(o.lease_);
    p_ = std::move(o.p_);
  }
  return *this;
}

Batch::~Batch() {
  const std::size_t slot = lease_.index();
  lease_.release();  // the slot first, then its token: the next batch finds it free
  if (run_ && !lease_.was_lent()) run_->return_token(slot);  // a lent batch's token went back when it was lent
}

std::span<const std::byte> Batch::data() const noexcept {
  return lease_.bytes().subspan(0, p_.labels.size() * p_.sample_bytes);
}
std::span<const std::int32_t> Batch::slot_labels() const noexcept {
  return {reinterpret_cast<const std::int32_t*>(lease_.bytes().data() + p_.label_offset), p_.labels.size()};
}
std::span<std::byte> Batch::mutable_data() noexcept {
  return lease_.bytes().subspan(0, p_.labels.size() * p_.sample_bytes);
}

std::string stats_json(const LoaderStats& s) {
  nlohmann::ordered_json j{{"batches", s.batches},
                           {"samples", s.samples},
                           {"output_bytes", s.output_bytes},
                           {"input_bytes", s.input_bytes},
                           {"seconds", s.seconds},
                           {"images_per_second", s.images_per_second},
                           {"output_bytes_per_second", s.output_bytes_per_second},
                           {"read_seconds", s.read_seconds},
                           {"decode_seconds", s.decode_seconds},
                           {"transform_seconds", s.transform_seconds},
                           {"replaced", s.replaced},
                           {"ready_batches", s.ready_batches},
                           {"in_flight", s.in_flight},
                           {"allowed_in_flight", s.allowed_in_flight},
                           {"pinned_batches", s.pinned_batches},
                           {"pageable_batches", s.pageable_batches}};
  j["pool"] = s.pool;
  if (s.remote) {
    const StreamStats& r = *s.remote;
    j["remote"] = nlohmann::ordered_json{{"requests", r.requests},
                                         {"bytes", r.bytes},
                                         {"retries", r.retries},
                                         {"waits", r.waits},
                                         {"wait_seconds", r.wait_seconds},
                                         {"readahead_bytes", r.readahead_bytes},
                                         {"readahead_peak", r.readahead_peak},
                                         {"readahead_limit", r.readahead_limit},
                                         {"dropped", r.dropped},
                                         {"shards", r.shards},
                                         {"shards_local", r.shards_local}};
  }
  return j.dump();
}

// ---------------------------------------------------------------- Loader

namespace {

/// oneTBB's worker pool is process-wide and a global_control's
/// max_allowed_parallelism applies to all of it (the smallest live value
/// wins), so Loaders must not each set their own: two Loaders of one thread
/// each (two trainer workers) would share a single TBB worker. One control
/// for the process allows the sum of every live Loader's threads (plus the
/// caller's), never less than oneTBB's default.
class ThreadDemand {
 public:
  explicit ThreadDemand(unsigned threads) : threads_(threads) { change(static_cast<long>(threads)); }
  ~ThreadDemand() { change(-static_cast<long>(threads_)); }
  ThreadDemand(const ThreadDemand&) = delete;
  ThreadDemand& operator=(const ThreadDemand&) = delete;

 private:
  static void change(long delta) {
    static std::mutex mutex;  // guards total and control
    static long total = 0;
    static std::unique_ptr<oneapi::tbb::global_control> control;
    const std::scoped_lock lock(mutex);
    total += delta;
    const auto wanted = static_cast<std::size_t>(total + 1);
    const auto fallback = static_cast<std::size_t>(oneapi::tbb::info::default_concurrency());
    std::unique_ptr<oneapi::tbb::global_control> next;
    if (total > 0 && wanted > fallback) {
      next =
          std::make_unique<oneapi::tbb::global_control>(oneapi::tbb::global_control::max_allowed_parallelism, wanted);
    }
    control = std::move(next);  // the new limit exists before the old one goes
  }
  unsigned threads_;
};

}  // namespace

struct Loader::Engine {
  explicit Engine(unsigned threads)
      // Every worker decodes; the caller's thread waits in next(), so it
      // needs no reserved slot, and the process's pool must allow that many.
      : demand(threads), arena(static_cast<int>(threads), 0) {}
  ThreadDemand demand;
  oneapi::tbb::task_arena arena;
  oneapi::tbb::enumerable_thread_specific<std::unique_ptr<SampleScratch>> scratch;
};

namespace {
/// The pinned resource for a loader feeding `cuda_device`: that device made
/// current for every registration, and the pages placed on its nearest NUMA
/// node (sysfs), so host-to-device copies cross no socket link.
memory::PinnedResource::Config pinned_config(const LoaderConfig& c) {
  memory::PinnedResource::Config pc;
  pc.method = c.pin_method;
  if (c.cuda_device < 0) return pc;
  pc.cuda_device = c.cuda_device;
  try {
    for (const memory::cuda::DeviceInfo& d : memory::cuda::devices()) {
      if (d.index == c.cuda_device && d.numa_node >= 0) pc.numa_node = static_cast<unsigned>(d.numa_node);
    }
  } catch (const Error& e) {
    pinfeed::detail::log().warn("loader: cannot read cuda:{}'s NUMA node ({}); default page placement", c.cuda_device,
                                e.what());
  }
  return pc;
}

/// What the budget lets the pool pin, and in words why not every slot.
PinReport plan_pin_report(const LoaderConfig& c, const memory::PinnedBudget& budget, std::size_t slots,
                          std::size_t slot_bytes, unsigned local_ranks) {
  PinReport r;
  r.slots = slots;
  r.slot_bytes = slot_bytes;
  r.budget_bytes = budget.bytes;
  r.limiting = budget.limiting;
  r.local_ranks = local_ranks;
  if (!c.pin) {
    r.reason = "pinning is off (pin = false)";
    return r;
  }
  const std::uint64_t fit = budget.bytes / round_up_to_page(slot_bytes);
  if (fit < slots) {
    r.reason = fmt::format("{} of {} slots of {} fit the pinned budget of {}, limited by {}{}", fit, slots,
                           format_bytes(round_up_to_page(slot_bytes)), format_bytes(budget.bytes), budget.limiting,
                           local_ranks > 1 ? fmt::format(" (shared by {} local ranks)", local_ranks) : "");
  }
  return r;
}

SamplerConfig sampler_config(const LoaderConfig& c, std::size_t n) {
  c.validate();
  return SamplerConfig{n, c.rank, c.world_size, c.shuffle, c.drop_last, c.seed};
}

/// The pool's slots, pinning and floor from the loader's options.
memory::BufferPool::Config pool_config(const LoaderConfig& c) {
  memory::BufferPool::Config pc;
  pc.slots = c.prefetch;
  pc.slot_bytes = c.slot_bytes();
  // One slot per slab: a running loader always has some slot in use, so
  // pressure can move its memory only slot by slot.
  pc.slab_bytes = pc.slot_bytes;
  pc.pin = c.pin;
  pc.min_live_slots = c.pressure_floor;
  pc.held_warning_bytes = c.held_warning != 0 ? c.held_warning : pc.slots * round_up_to_page(pc.slot_bytes);
  pc.held_limit_bytes = c.held_limit;
  if (c.watch_pressure) pc.may_grow = memory::PressureMonitor::regrow_rule(c.pressure);  // Note [Pool policy]
  return pc;
}

/// A GPU that reads pageable memory through the host's page tables
/// (Grace/ATS) says so: its registration need not lock the slots. Empty
/// otherwise, or for no device.
std::string host_page_tables_note(int cuda_device) {
  if (cuda_device < 0) return {};
  try {
    for (const memory::cuda::DeviceInfo& d : memory::cuda::devices()) {
      if (d.index != cuda_device || !d.host_page_tables) continue;
      return fmt::format(
          "cuda:{} reads pageable memory through the host page tables (Grace/ATS): its "
          "registration need not page-lock the slots; VmLck shows what is locked",
          d.index);
    }
  } catch (const Error&) {
    // already warned about by pinned_config
  }
  return {};
}
}  // namespace

Loader::Loader(LoaderConfig config)
    : config_((check_worker_threads_usable("pinfeed loader"), config.validate(), std::move(config))),
      dataset_(open_dataset(config_.dataset, config_.list_root, config_.max_classes, config_.remote)),
      sampler_(sampler_config(config_, dataset_->size())),
      pinned_(pinned_config(config_)) {
  const unsigned local_ranks =
      config_.local_ranks != 0 ? config_.local_ranks : static_cast<unsigned>(std::max(1, read_launch_env().local_size));
  const unsigned threads = default_threads(config_.threads, local_ranks);
  threads_ = threads;
  // The decode threads, the pool's and the monitor's, and a few for the
  // program around it (a trainer's stream threads).
  check_thread_room(threads + 6, "the loader");

  memory::BufferPool::Config pc = pool_config(config_);
  const auto snapshot = memory::MemorySnapshot::read(config_.watch_pressure ? config_.pressure.root : "/");
  // Pinned or pageable, a pool larger than the host's memory is refused
  // before a byte is mapped (Note [Pool fit] in pool_plan.hpp).
  const memory::PoolFit fit = memory::check_pool_fit(snapshot, pc.slots, pc.slot_bytes, local_ranks);
  if (!fit.fits) throw ConfigError(fmt::format("loader: {}", fit.explain("prefetch", "batch_size", 1)));
  const auto budget = memory::PinnedBudget::compute(
      snapshot, memory::BudgetPolicy{config_.pinned_fraction, pinned_.method(), 0, local_ranks},
      static_cast<std::uint64_t>(pc.slots) * round_up_to_page(pc.slot_bytes));
  pc.pinned_budget_bytes = budget.bytes;
  pin_report_ = plan_pin_report(config_, budget, pc.slots, pc.slot_bytes, local_ranks);
  if (config_.require_pinned && !pin_report_.reason.empty()) {
    throw ConfigError(fmt::format("loader: pinned memory was required but {}", pin_report_.reason));
  }

  engine_ = std::make_unique<Engine>(threads);
  class_good_ = std::make_unique<std::atomic<std::uint32_t>[]>(std::max<std::size_t>(1, dataset_->num_classes()));
  class_total_.assign(std::max<std::size_t>(1, dataset_->num_classes()), 0);
  for (std::size_t i = 0; i < dataset_->size(); ++i) ++class_total_[static_cast<std::size_t>(dataset_->label(i))];
  if (config_.watch_pressure) monitor_ = memory::PressureMonitor::shared(config_.pressure);
  pool_ = std::make_unique<memory::BufferPool>(pc, pinned_, pageable_);
  if (monitor_) pool_->follow(*monitor_);
  if (monitor_) dataset_->follow(monitor_);  // a streamed set's read-ahead shrinks with the pool
  pin_report_.pinned_slots = pool_->stats().pinned_slots;
  if (pinned_.method() == memory::PinMethod::cuda_register) {
    pin_report_.note = host_page_tables_note(config_.cuda_device);
    if (!pin_report_.note.empty()) pinfeed::detail::log().info("loader: {}", pin_report_.note);
  }
  if (config_.pin && pin_report_.pinned_slots < pc.slots && pin_report_.reason.empty()) {
    pin_report_.reason =
        fmt::format("only {} of {} slots could be pinned (see the pool's log)", pin_report_.pinned_slots, pc.slots);
  }
  if (config_.require_pinned && pin_report_.pinned_slots < pc.slots) {
    throw ConfigError(fmt::format("loader: pinned memory was required but {}", pin_report_.reason));
  }
  // The samples of an epoch are logged when it starts: a sampler given in
  // Python (its own indices) decides them, not this rank's share.
  pinfeed::detail::log().info("loader: {}; pool {} x {} ({} pinned, budget {} limited by {}{})", dataset_->summary(),
                              pc.slots, format_bytes(pc.slot_bytes), pin_report_.pinned_slots,
                              format_bytes(budget.bytes), budget.limiting,
                              local_ranks > 1 ? fmt::format(", split across {} local ranks", local_ranks) : "");
}

Loader::~Loader() { stop(); }

CropPlan Loader::crop_plan(std::size_t index, std::uint64_t epoch) const {
  if (index >= dataset_->size()) {
    throw ConfigError(fmt::format("crop_plan: index {} is outside the dataset of {} samples", index, dataset_->size()));
  }
  SampleScratch scratch(config_.transform, config_.max_image_pixels);
  return SampleStage(*dataset_, config_.transform, config_.seed).plan(index, epoch, scratch);
}

std::size_t Loader::batches_per_epoch() const noexcept {
  const std::size_t n = sampler_.num_samples(), b = config_.batch_size;
  return config_.drop_last_batch ? n / b : (n + b - 1) / b;
}

void Loader::begin_epoch(std::uint64_t epoch) { start(epoch, sampler_.indices(epoch), 0); }

void Loader::begin_epoch(std::uint64_t epoch, std::vector<std::size_t> order, std::size_t position) {
  const std::size_t n = dataset_->size();
  for (std::size_t k = 0; k < order.size(); ++k) {
    if (order[k] >= n) {
      throw ConfigError(
          fmt::format("loader: the epoch's order gives index {} at place {}, outside the dataset's {} "
                      "samples (0..{})",
                      order[k], k, n, n - 1));
    }
  }
  if (position > order.size()) {
    throw ConfigError(
        fmt::format("loader: position {} is past the end of the epoch's order ({} samples)", position, order.size()));
  }
  start(epoch, std::move(order), position);
}

void Loader::restore(const LoaderState& s) {
  if (s.seed != config_.seed || s.world_size != config_.world_size || s.rank != config_.rank) {
    throw ConfigError(fmt::format("loader restore: state is for seed {} rank {}/{}, this loader has seed {} rank {}/{}",
                                  s.seed, s.rank, s.world_size, config_.seed, config_.rank, config_.world_size));
  }
  if (s.position > sampler_.num_samples()) {
    throw ConfigError(
        fmt::format("loader restore: position {} is past the epoch's {} samples", s.position, sampler_.num_samples()));
  }
  start(s.epoch, sampler_.indices(s.epoch), s.position);
}

void Loader::start(std::uint64_t epoch, std::vector<std::size_t> order, std::size_t position) {
  stop();
  auto run = std::make_shared<detail::EpochRun>(*dataset_, config_);
  run->pool = pool_.get();
  run->arena = &engine_->arena;
  run->scratch = &engine_->scratch;
  run->class_good = class_good_.get();
  run->class_total = &class_total_;
  for (std::size_t c = 0; c < std::max<std::size_t>(1, dataset_->num_classes()); ++c) class_good_[c].store(0);
  run->epoch = epoch;
  run->order = std::move(order);
  run->start = position;
  dataset_->plan(std::span<const std::size_t>(run->order).subspan(position));  // Note [Streamed shards]
  const std::size_t left = run->order.size() - position, b = config_.batch_size;
  run->num_batches = config_.drop_last_batch ? left / b : (left + b - 1) / b;
  pinfeed::detail::log().info("loader: epoch {}: {} samples on rank {} of {}, from position {} ({} batches)", epoch,
                              run->order.size(), config_.rank, config_.world_size, position, run->num_batches);
  note_worker_threads();
  engine_->arena.execute([&] { run->build_graph(config_.prefetch); });
  run_ = std::move(run);
}

void Loader::stop() noexcept {
  if (!run_) return;
  auto run = std::move(run_);
  run->begin_stop();
  try {
    engine_->arena.execute([&] { run->graph->wait_for_all(); });
  } catch (const std::exception& e) {
    pinfeed::detail::log().error("loader: stopping the epoch: {}", e.what());
  }
  std::deque<detail::BuildPtr> undelivered;
  {
    const std::scoped_lock lock(run->mutex);
    undelivered.swap(run->ready);
  }
  undelivered.clear();  // their slots go back to the pool
}

bool Loader::wait_ready(std::chrono::milliseconds timeout) {
  if (!run_) return true;  // next() throws at once
  return wait_ready_until(std::chrono::steady_clock::now() + timeout);
}

bool Loader::wait_ready_until(std::optional<std::chrono::steady_clock::time_point> deadline) {
  detail::EpochRun& run = *run_;
  std::unique_lock lock(run.mutex);
  const auto ready = [&] { return run.error || !run.ready.empty() || run.delivered >= run.num_batches; };
  // Note [Lent slots]: the batch in order waits for a slot only the
  // consumer can free (it holds every token, or the in-order acquire finds
  // nothing free or fenced): the oldest held batch's slot is lent to it and
  // replaced, instead of waiting for a release that may never come. Seen
  // twice, 2 ms apart, so a batch about to be dropped (a device copy
  // finishing) is not lent for nothing.
  using namespace std::chrono_literals;
  const auto held_for = [](std::optional<std::chrono::steady_clock::time_point>& since, bool now_true,
                           std::chrono::steady_clock::time_point now) {
    if (!now_true) {
      since.reset();
      return std::chrono::steady_clock::duration::zero();
    }
    if (!since) since = now;
    return now - *since;
  };
  while (!ready()) {
    const auto now = std::chrono::steady_clock::now();
    if (deadline && now >= *deadline) return false;
    const std::size_t wanted = run.delivered;  // the seq next() waits for
    lock.unlock();
    // Starved only counts when the acquire waiting is the wanted batch's: a
    // later batch waiting while the wanted one is assembled is ordinary
    // back-pressure (lending then cost a fresh slot per batch at the floor).
    const bool stuck = run.tokens_all_held() || (run.awaiting_slot(wanted) && pool_->starved());
    const auto stuck_for = held_for(run.stuck_since, stuck, now);
    // A later batch's acquire starving for long (both workers blocked, one
    // in acquire, one waiting its turn) is resolved the same way, after 0.5 s.
    const auto starved_for = held_for(run.starved_since, pool_->starved(), now);
    std::size_t slot = 0;
    std::uint64_t lent = 0;
    if ((stuck && stuck_for >= 2ms) || starved_for >= 500ms) {
      try {
        lent = pool_->lend_held(&slot);
      } catch (const OutOfMemory&) {
        run.return_token(slot);  // lent all the same: its Batch will not return it
        throw;
      }
    }
    if (lent > 0) {
      run.stuck_since.reset();
      run.starved_since.reset();
      run.return_token(slot);  // the lent batch's token, if it is this run's: its Batch will not return it (was_lent)
    }
    lock.lock();
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
    if (deadline) until = std::min(until, *deadline);
    run.cv.wait_until(lock, until, ready);
  }
  return true;
}

std::optional<Batch> Loader::next() {
  if (!run_) throw ConfigError("loader: next() before begin_epoch() or restore()");
  detail::EpochRun& run = *run_;
  if (run.parked.load(std::memory_order_relaxed) != 0) run.refill_tokens();  // Note [Tokens follow the pool]
  detail::BuildPtr b;
  wait_ready_until(std::nullopt);
  {
    std::unique_lock lock(run.mutex);
    if (run.error) std::rethrow_exception(run.error);
    if (run.ready.empty()) return std::nullopt;  // the epoch is complete
    b = std::move(run.ready.front());
    run.ready.pop_front();
    if (b->skipped) return std::nullopt;
    ++run.delivered;
  }
  // Batches come in order: with the last one, every sample of the run has
  // been through the stage (a trainer never asks past it).
  if (run.delivered == run.num_batches) run.check_classes();
  Batch batch;
  batch.run_ = run_;
  batch.lease_ = std::move(b->lease);
  batch.lease_.hand_to_consumer();  // the pool's floor under pressure stays above what the consumer holds
  {
    const std::scoped_lock lock(run.token_mutex);
    run.held_slots.insert(batch.lease_.index());
  }
  Batch::Payload& p = batch.p_;
  p.capacity = config_.batch_size;
  p.sample_bytes = config_.transform.sample_bytes();
  p.layout = config_.transform.layout;
  const auto n = b->labels.size();
  const auto h = static_cast<std::size_t>(config_.transform.out_height());
  const auto w = static_cast<std::size_t>(config_.transform.out_width());
  p.shape =
      p.layout == Layout::nhwc_u8 ? std::array<std::size_t, 4>{n, h, w, 3} : std::array<std::size_t, 4>{n, 3, h, w};
  p.labels = std::move(b->labels);
  p.label_offset = config_.label_offset();
  // The labels' int32 copy goes into the slot (max_classes keeps every
  // label below 2^31): a device reads them from pinned memory.
  auto* slot_labels = reinterpret_cast<std::int32_t*>(batch.lease_.bytes().data() + p.label_offset);
  for (std::size_t i = 0; i < p.labels.size(); ++i) slot_labels[i] = static_cast<std::int32_t>(p.labels[i]);
  p.indices = std::move(b->indices);
  p.replaced = b->replaced.load();
  p.epoch = run.epoch;
  p.index = b->job.seq;
  p.position = b->job.position;
  return batch;
}

LoaderState Loader::state() const {
  LoaderState s;
  s.seed = config_.seed;
  s.world_size = config_.world_size;
  s.rank = config_.rank;
  if (!run_) return s;
  s.epoch = run_->epoch;
  const std::scoped_lock lock(run_->mutex);
  s.position = std::min(run_->start + run_->delivered * config_.batch_size, run_->order.size());
  return s;
}

LoaderStats Loader::stats() const {
  LoaderStats st;
  st.pool = pool_->stats();
  st.remote = dataset_->stream_stats();
  if (!run_) return st;
  const detail::EpochRun& r = *run_;
  {
    const std::scoped_lock lock(run_->mutex);
    st.batches = r.delivered;
    st.ready_batches = r.ready.size();
  }
  st.samples = r.samples.load();
  st.output_bytes = st.samples * config_.transform.sample_bytes();
  st.input_bytes = r.input_bytes.load();
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - r.started).count();
  if (st.seconds > 0) {
    st.images_per_second = static_cast<double>(st.samples) / st.seconds;
    st.output_bytes_per_second = static_cast<double>(st.output_bytes) / st.seconds;
  }
  st.read_seconds = static_cast<double>(r.read_ns.load()) * 1e-9;
  st.decode_seconds = static_cast<double>(r.decode_ns.load()) * 1e-9;
  st.transform_seconds = static_cast<double>(r.transform_ns.load()) * 1e-9;
  st.replaced = r.replaced.load();
  st.in_flight = r.in_flight.load();
  {
    const std::scoped_lock lock(run_->token_mutex);
    st.allowed_in_flight = r.tokens_out;
  }
  st.pinned_batches = r.pinned_batches.load();
  st.pageable_batches = r.pageable_batches.load();
  return st;
}

}  // namespace pinfeed::loader
