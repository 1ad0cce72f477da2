#pragma once
// Loader batches onto a device: the copy from a pool slot and its release,
// done one way for the trainer's workers and for the Python loader's
// device= path.
//
// Note [Consumer streams]
// A DeviceFeed copies each batch on a copy stream of its own and records an
// event after it (and after the normalization that follows it on the same
// stream). The pool slot goes back after the copy's event (Note [Slot
// lifetime]), whatever the consumer does. The consumer, another library's
// stream (torch's current stream) or a host thread, is made to wait for the
// batch's event before it is handed the batch (DeviceBackend::consumer_wait),
// so nobody synchronizes. When the consumer drops the batch, an event is
// recorded at the end of the consumer's work at that moment
// (consumer_record): the batch's device buffers are written again only after
// it, by a copy stream that waits for it. This is what PyTorch's caching
// allocator does with record_stream for memory it did not allocate on the
// stream that uses it.
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "pinfeed/loader/loader.hpp"
#include "pinfeed/trainer/device_backend.hpp"

namespace pinfeed::trainer {

/// Note [Slot lifetime], the one place it is done: enqueues on `s` the copy
/// of `batch`'s samples (into `images`) and of its int32 labels (into
/// `labels`), records `copied` after them and hands the slot back to the pool
/// once `copied` completes. The batch holds no slot afterwards; its host
/// fields (labels(), indices()) stay readable.
void copy_batch(DeviceBackend& backend, Stream& s, loader::Batch& batch, void* images, std::int32_t* labels,
                const std::shared_ptr<Event>& copied);

/// A stream outside pinfeed that may still read a batch's host memory
/// (DeviceBackend::consumer_record names it).
struct ConsumerStream {
  std::shared_ptr<DeviceBackend> backend;
  std::uintptr_t stream = 0;
};

/// The non_blocking rule (Note [Consumer streams]) for a batch handed out as
/// host memory: its slot goes back after an event recorded now on every one
/// of `consumers`, so copies still queued there read it first. With no
/// consumers, the slot goes back now. On a device error the slot goes back
/// now too, and the error is logged.
void release_after_consumers(memory::SlotLease& lease, const std::vector<ConsumerStream>& consumers) noexcept;

struct DeviceFeedOptions {
  /// uint8 NHWC batches become float32 NCHW on the device: (x / 255 - mean) / std.
  bool normalize = true;
  Normalization norm;
  FloatType output = FloatType::f32;  ///< what normalization writes
};

/// What a feed has done so far.
struct DeviceFeedStats {
  std::uint64_t batches = 0;
  std::uint64_t bytes = 0;           ///< host bytes copied (samples and labels)
  std::uint64_t device_buffers = 0;  ///< sets of device buffers made (the ring's size)
  /// The copy stream's time in the copies themselves (from the stream
  /// reaching a batch's copy to its end), summed: bytes / copy_seconds is
  /// the copies' bandwidth.
  double copy_seconds = 0;
  /// The copy stream's time waiting for consumers to be done with the
  /// buffers it is about to reuse.
  double wait_consumer_seconds = 0;
  double wait_copy_seconds = 0;  ///< host time blocked on a copy (a host consumer only)
};

class DeviceBatch;

/// Copies loader batches to a device (Note [Consumer streams]). One host
/// thread submits; DeviceBatches may be dropped on any thread, and may
/// outlive the feed.
class DeviceFeed {
 public:
  DeviceFeed(std::shared_ptr<DeviceBackend> backend, DeviceFeedOptions options);
  ~DeviceFeed();
  DeviceFeed(const DeviceFeed&) = delete;
  DeviceFeed& operator=(const DeviceFeed&) = delete;

  /// Enqueues the batch's copy (and normalization); the slot goes back to
  /// the pool after the copy. Device buffers come from the feed's ring, made
  /// on first need (the ring grows to the number of batches alive at once).
  std::shared_ptr<DeviceBatch> submit(loader::Batch batch);
  [[nodiscard]] DeviceBackend& backend() const noexcept;
  [[nodiscard]] DeviceFeedStats stats() const;

  struct Buffers;
  struct State;

 private:
  std::shared_ptr<State> state_;
  std::unique_ptr<Stream> copy_;
};

/// One batch on the device. Dropping it returns its buffers to the feed's
/// ring, after the consumer's work at that moment (Note [Consumer streams]).
class DeviceBatch {
 public:
  DeviceBatch(std::shared_ptr<DeviceFeed::State> state, std::unique_ptr<DeviceFeed::Buffers> buffers,
              const loader::Batch& batch, bool normalized, FloatType type);
  ~DeviceBatch();
  DeviceBatch(const DeviceBatch&) = delete;
  DeviceBatch& operator=(const DeviceBatch&) = delete;

  /// Samples: float32 {N, C, H, W} when normalized or the loader's nchw-f32,
  /// else uint8 {N, H, W, C}.
  [[nodiscard]] void* images() const noexcept;
  [[nodiscard]] std::int64_t* labels() const noexcept;
  [[nodiscard]] const std::array<std::int64_t, 4>& shape() const noexcept { return shape_; }
  [[nodiscard]] bool floats() const noexcept { return floats_; }
  /// The samples' type when floats(): float32, or what normalization wrote.
  [[nodiscard]] FloatType float_type() const noexcept { return float_type_; }
  [[nodiscard]] std::size_t size() const noexcept { return static_cast<std::size_t>(shape_[0]); }
  /// Makes `consumer` wait for the batch (DeviceBackend::consumer_wait) and
  /// remembers it: the buffers are reused only after its work at the time
  /// the batch is dropped. Call once, before the consumer reads the batch.
  void hand_to(std::uintptr_t consumer);

 private:
  std::shared_ptr<DeviceFeed::State> state_;
  std::unique_ptr<DeviceFeed::Buffers> buffers_;
  std::array<std::int64_t, 4> shape_{};
  bool floats_ = true;
  FloatType float_type_ = FloatType::f32;
  bool handed_ = false;
  std::uintptr_t consumer_ = 0;
};

}  // namespace pinfeed::trainer
