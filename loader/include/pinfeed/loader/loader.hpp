#pragma once
// Loader: a oneTBB flow graph that turns a dataset into batches written
// straight into BufferPool slots (pinned where the host allows).
//
//   batch indices ──┐
//                   ├─ reserving join ─> assemble (read + decode + transform
//   free tokens ────┘                    every sample into its place in a
//   (one per slot)                       slot, in parallel) ─> sequencer
//                                        (batch order) ─> delivery ─> next()
//
// A token is a pool slot: the join only starts a batch when one is free, and
// the token comes back when the user drops the Batch. Nothing queues without
// bound; nothing blocks inside a node waiting for a slot.
//
// Semantics users rely on (PyTorch DataLoader + DistributedSampler):
// sharding, padding, seeds, explicit epochs, resumption from (epoch,
// position), deterministic augmentation from (seed, epoch, sample index), so
// batches are byte-identical with 1 thread or 16.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pinfeed/enum_words.hpp"
#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/remote.hpp"
#include "pinfeed/loader/sampler.hpp"
#include "pinfeed/loader/transform.hpp"
#include "pinfeed/memory/buffer_pool.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/memory/pressure_monitor.hpp"

namespace pinfeed::loader {

/// Pool slots (LoaderConfig::prefetch) limit, for validate() and every CLI.
inline constexpr std::size_t kMaxPrefetch = 256;
/// The largest batch and thread count a loader accepts.
inline constexpr std::size_t kMaxBatchSize = 65536;
inline constexpr unsigned kMaxThreads = 1024;
/// `requested` threads, or (0) this process's share of the cores it may use:
/// oneTBB's default concurrency (which follows the affinity mask and cgroup
/// CPU limits) divided by `local_ranks`, the processes of the launch on this
/// host (8 ranks on a node must not each take every core), at least 1. The
/// one place a default thread count comes from.
unsigned default_threads(unsigned requested = 0, unsigned local_ranks = 1);

/// The largest max_image_pixels (2^40: a terapixel image is never a sample).
inline constexpr std::uint64_t kMaxImagePixelsCeiling = 1ULL << 40;

enum class BadSamplePolicy { replace, fail };
inline constexpr std::array<EnumWord<BadSamplePolicy>, 2> kBadSamplePolicyWords{
    {{BadSamplePolicy::replace, "replace"}, {BadSamplePolicy::fail, "fail"}}};
BadSamplePolicy parse_bad_sample_policy(std::string_view text);  ///< "replace", "fail"
std::string_view to_string(BadSamplePolicy p) noexcept;

struct LoaderConfig {
  std::string dataset;                ///< folder, file list, or tar shard(s) (see open_dataset)
  std::filesystem::path list_root;    ///< root of a file list's relative paths (default: the list's folder)
  std::size_t batch_size = 64;        ///< samples per batch
  unsigned threads = 0;               ///< worker threads; 0: the cores over the ranks on this host (default_threads)
  std::size_t prefetch = 4;           ///< batches in flight = pool slots (>= 2 to overlap)
  unsigned rank = 0, world_size = 1;  ///< this process's shard
  bool shuffle = true;                ///< permute every epoch
  bool drop_last = false;             ///< sampler: trim to equal shards instead of padding
  bool drop_last_batch = false;       ///< drop a final partial batch (otherwise delivered, marked by size())
  std::uint64_t seed = 0;             ///< shuffling and augmentation seed
  TransformConfig transform;          ///< crop, size, flip, layout, normalization
  BadSamplePolicy on_bad_sample = BadSamplePolicy::replace;  ///< replace with a substitute, or fail the epoch
  unsigned max_replacements = 16;                            ///< substitutes tried for one bad sample before failing
  double max_replaced_share =
      0.01;  ///< the epoch fails once more than this share of its samples (at least 1 unless 0) was replaced, [0, 1]
  std::size_t max_classes = kDefaultMaxClasses;  ///< a label at or over it refuses the dataset (it sizes the model)
  std::uint64_t max_image_pixels = kDefaultMaxPixels;  ///< larger images are bad samples
  bool pin = true;                                     ///< pin pool slots (within the budget)
  bool require_pinned = false;                         ///< ConfigError when fewer slots than asked can be pinned
  memory::PinMethod pin_method = memory::PinMethod::automatic;  ///< cuda with a device, else mlock
  int cuda_device =
      -1;  ///< the GPU the batches go to: current when slots are registered, pages on its NUMA node; -1: none
  double pinned_fraction = 0.5;  ///< share of really available memory the pool may pin
  unsigned local_ranks = 0;      ///< processes on this host sharing its memory; 0: from the launcher's variables
  bool watch_pressure = true;    ///< run a PressureMonitor the pool follows
  /// Pool slots kept under critical pressure (the rest give their memory
  /// back): at least the batches the consumer holds at once plus one being
  /// filled, or the loader waits on a slot the consumer never returns.
  std::size_t pressure_floor = 2;
  /// Note [Lent slots] (buffer_pool.hpp): a batch the program keeps is lent
  /// out of the pool; one warning past held_warning bytes (0: the pool's
  /// size), HeldLimit past held_limit (0: none).
  std::uint64_t held_warning = 0;
  std::uint64_t held_limit = 0;
  memory::PressureMonitor::Config pressure;  ///< its root, period, thresholds
  RemoteConfig remote;                       ///< URL shards: cache_dir, cache_limit, timeouts, retries (remote.hpp)
  void validate() const;                     ///< ConfigError naming the field

  /// A pool slot holds the batch's samples, then (at a 64-byte boundary) its
  /// labels as int32: a device copy reads both from the same pinned slot,
  /// never from a pageable vector that the driver would have to stage.
  [[nodiscard]] std::size_t label_offset() const noexcept {
    return (batch_size * transform.sample_bytes() + 63) / 64 * 64;
  }
  [[nodiscard]] std::size_t slot_bytes() const noexcept { return label_offset() + batch_size * sizeof(std::int32_t); }
};

/// How the pool was pinned at construction, and why not more.
struct PinReport {
  std::size_t slots = 0, pinned_slots = 0;
  std::uint64_t slot_bytes = 0;
  std::uint64_t budget_bytes = 0;  ///< pinned budget of this process
  std::string limiting;            ///< the budget term that decides ("MemAvailable", "memlock limit", ...)
  unsigned local_ranks = 1;        ///< processes sharing the host's memory
  std::string reason;              ///< in words, when pinned_slots < slots (or pinning is off)
  /// What "pinned" means on this host, when it means less than page-locked:
  /// a GPU that reads host page tables (Grace) need not lock registered pages.
  std::string note;
};

/// Where an epoch stands: enough to resume exactly where it stopped.
struct LoaderState {
  std::uint64_t seed = 0;
  std::uint64_t epoch = 0;
  std::size_t position = 0;  ///< samples of this rank's epoch already delivered
  unsigned world_size = 1;
  unsigned rank = 0;
};

struct LoaderStats {
  std::uint64_t batches = 0, samples = 0;  ///< delivered this epoch
  std::uint64_t output_bytes = 0, input_bytes = 0;
  double seconds = 0;  ///< since begin_epoch
  double images_per_second = 0, output_bytes_per_second = 0;
  double read_seconds = 0, decode_seconds = 0, transform_seconds = 0;  ///< summed over threads
  std::uint64_t replaced = 0;                                          ///< bad samples replaced this epoch
  std::size_t ready_batches = 0;                                       ///< assembled, waiting for next()
  std::size_t in_flight = 0;                                           ///< being assembled
  /// Batches the run lets be in flight or ready at once: prefetch, lowered
  /// to the pool's serving slots while it is shrunk (Note [Tokens follow the pool]).
  std::size_t allowed_in_flight = 0;
  std::uint64_t pinned_batches = 0, pageable_batches = 0;
  memory::PoolStats pool;
  std::optional<StreamStats> remote;  ///< a streamed remote dataset's transfers
};

/// The stats as a JSON object (for the C ABI, Python and tools).
std::string stats_json(const LoaderStats& stats);

class Loader;
namespace detail {
struct EpochRun;
}

/// One batch, in a pool slot. Move-only; dropping it returns the slot.
/// Batches must be dropped before their Loader.
class Batch {
 public:
  Batch(Batch&&) noexcept;
  Batch& operator=(Batch&&) noexcept;
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;
  ~Batch();

  /// Valid samples (batch_size, or fewer in a final partial batch).
  [[nodiscard]] std::size_t size() const noexcept { return p_.labels.size(); }
  [[nodiscard]] std::size_t capacity() const noexcept { return p_.capacity; }
  /// Samples' bytes: size() * sample_bytes, in `layout`.
  [[nodiscard]] std::span<const std::byte> data() const noexcept;
  [[nodiscard]] std::span<std::byte> mutable_data() noexcept;
  [[nodiscard]] std::size_t sample_bytes() const noexcept { return p_.sample_bytes; }
  /// {N, H, W, C} for nhwc-u8, {N, C, H, W} for nchw-f32.
  [[nodiscard]] std::array<std::size_t, 4> shape() const noexcept { return p_.shape; }
  [[nodiscard]] Layout layout() const noexcept { return p_.layout; }
  [[nodiscard]] std::string_view dtype() const noexcept { return p_.layout == Layout::nhwc_u8 ? "uint8" : "float32"; }
  [[nodiscard]] std::span<const std::int64_t> labels() const noexcept { return p_.labels; }
  /// The same labels as int32, in the slot after the samples (pinned when
  /// the slot is): what a device copy reads. Valid while the lease is held.
  [[nodiscard]] std::span<const std::int32_t> slot_labels() const noexcept;
  /// Dataset index of each sample (a substitute's index where one was replaced).
  [[nodiscard]] std::span<const std::size_t> indices() const noexcept { return p_.indices; }
  [[nodiscard]] std::size_t replaced() const noexcept { return p_.replaced; }
  [[nodiscard]] bool pinned() const noexcept { return lease_.pinned(); }
  [[nodiscard]] std::uint64_t epoch() const noexcept { return p_.epoch; }
  [[nodiscard]] std::size_t index() const noexcept { return p_.index; }  ///< batch number in this run of the epoch
  [[nodiscard]] std::size_t position() const noexcept { return p_.position; }  ///< epoch position of the first sample
  /// The slot, for the trainer: release_after(fence) once a copy reads it.
  [[nodiscard]] memory::SlotLease& lease() noexcept { return lease_; }

 private:
  friend class Loader;
  friend struct detail::EpochRun;
  Batch() = default;
  struct Payload {  // everything but the run and the slot; plain values, moved as one
    std::size_t capacity = 0, sample_bytes = 0, label_offset = 0;
    std::array<std::size_t, 4> shape{};
    Layout layout = Layout::nchw_f32;
    std::vector<std::int64_t> labels;
    std::vector<std::size_t> indices;
    std::size_t replaced = 0;
    std::uint64_t epoch = 0;
    std::size_t index = 0, position = 0;
  };
  std::shared_ptr<detail::EpochRun> run_;
  memory::SlotLease lease_;
  Payload p_;
};

class Loader {
 public:
  /// Opens the dataset, sizes and allocates the pool (pinning within the
  /// budget), starts the pressure monitor. Throws ConfigError / DataError.
  explicit Loader(LoaderConfig config);
  /// Stops a running epoch: tasks finished, slots returned, threads joined.
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  /// Starts epoch `epoch` from its beginning (stopping any epoch running).
  void begin_epoch(std::uint64_t epoch);
  /// Continues from a saved state: its epoch, at its position.
  void restore(const LoaderState& state);
  /// Starts epoch `epoch` over `order` (this rank's dataset indices, in
  /// order) from `position`, instead of the sampler's order: a Python
  /// sampler's own indices, torch's order, an elastic restart's remainder.
  /// Augmentation still draws from (seed, epoch, index). ConfigError naming
  /// the first index outside the dataset, or a position past the order.
  /// state() then gives the position in this order; restore() replays the
  /// sampler's order, so resume such an epoch by passing the same order and
  /// that position here again (what the Python Loader does), and count its
  /// batches from the order: batches_per_epoch() and samples_per_epoch()
  /// are the sampler's.
  void begin_epoch(std::uint64_t epoch, std::vector<std::size_t> order, std::size_t position = 0);
  /// The next batch of the epoch, in order; nullopt at the end. Throws the
  /// epoch's error (DataError naming the file under the fail policy).
  std::optional<Batch> next();
  /// Waits up to `timeout` until next() would not block (a batch is ready,
  /// the epoch is over, or it failed); true then. For callers that must stay
  /// responsive while waiting (Python's signal handlers run between slices).
  bool wait_ready(std::chrono::milliseconds timeout);

  [[nodiscard]] LoaderState state() const;
  [[nodiscard]] LoaderStats stats() const;
  /// Batches the current epoch yields in all (from position 0).
  [[nodiscard]] std::size_t batches_per_epoch() const noexcept;
  [[nodiscard]] std::size_t samples_per_epoch() const noexcept { return sampler_.num_samples(); }
  [[nodiscard]] const Dataset& dataset() const noexcept { return *dataset_; }
  /// The crop, scale and flip dataset sample `index` gets in `epoch`: what
  /// its batch holds is that region resized (reads the sample's header).
  [[nodiscard]] CropPlan crop_plan(std::size_t index, std::uint64_t epoch) const;
  [[nodiscard]] memory::BufferPool& pool() noexcept { return *pool_; }
  [[nodiscard]] const LoaderConfig& config() const noexcept { return config_; }
  [[nodiscard]] const PinReport& pin_report() const noexcept { return pin_report_; }
  /// The decode threads it runs (config().threads, or default_threads()).
  [[nodiscard]] unsigned threads() const noexcept { return threads_; }

  /// Range-for over the rest of the current epoch.
  class Iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    Iterator() = default;
    explicit Iterator(Loader* loader) : loader_(loader) { ++*this; }
    Batch& operator*() { return *current_; }
    Iterator& operator++() {
      current_.reset();
      current_ = loader_->next();
      return *this;
    }
    void operator++(int) { ++*this; }
    bool operator==(std::default_sentinel_t) const { return !current_.has_value(); }

   private:
    Loader* loader_ = nullptr;
    std::optional<Batch> current_;
  };
  Iterator begin() { return Iterator(this); }
  std::default_sentinel_t end() { return {}; }

 private:
  void start(std::uint64_t epoch, std::vector<std::size_t> order, std::size_t position);
  void stop() noexcept;
  /// Waits (no deadline: for ever) until next() would not block, lending
  /// held slots out when the batch in order needs one (Note [Lent slots]).
  bool wait_ready_until(std::optional<std::chrono::steady_clock::time_point> deadline);

  LoaderConfig config_;
  std::unique_ptr<Dataset> dataset_;
  DistributedSampler sampler_;
  memory::PinnedResource pinned_;
  memory::PageableResource pageable_;
  std::shared_ptr<memory::PressureMonitor> monitor_;  // the process's, for this config (PressureMonitor::shared)
  std::unique_ptr<memory::BufferPool> pool_;
  struct Engine;  // TBB arena and per-thread scratch
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<detail::EpochRun> run_;
  PinReport pin_report_;
  unsigned threads_ = 1;
  // Per class: samples decoded this run (reset by start()). With the bad
  // samples' classes, it tells a class with nothing decodable.
  std::unique_ptr<std::atomic<std::uint32_t>[]> class_good_;
  std::vector<std::size_t> class_total_;  // per class: samples in the dataset
};

}  // namespace pinfeed::loader
