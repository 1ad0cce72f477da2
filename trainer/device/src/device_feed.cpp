#include "pinfeed/trainer/device_feed.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <exception>
#include <functional>
#include <utility>

#include "pinfeed/log.hpp"

namespace pinfeed::trainer {

void copy_batch(DeviceBackend& backend, Stream& s, loader::Batch& batch, void* images, std::int32_t* labels,
                const std::shared_ptr<Event>& copied) {
  backend.copy_h2d(s, images, batch.data().data(), batch.data().size());
  backend.copy_h2d(s, labels, batch.slot_labels().data(), batch.size() * sizeof(std::int32_t));
  backend.record(*copied, s);
  batch.lease().release_after(copied);
}

namespace {

/// Ready when every one of its fences is.
class AllFences final : public memory::Fence {
 public:
  explicit AllFences(std::vector<std::shared_ptr<memory::Fence>> f) : fences_(std::move(f)) {}
  [[nodiscard]] bool ready() noexcept override {
    return std::all_of(fences_.begin(), fences_.end(), [](const auto& f) { return f->ready(); });
  }
  bool wait_for(std::chrono::microseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (const auto& f : fences_) {
      const auto left =
          std::chrono::duration_cast<std::chrono::microseconds>(deadline - std::chrono::steady_clock::now());
      if (!f->wait_for(std::max(left, std::chrono::microseconds(0)))) return false;
    }
    return true;
  }

 private:
  std::vector<std::shared_ptr<memory::Fence>> fences_;
};

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

void release_after_consumers(memory::SlotLease& lease, const std::vector<ConsumerStream>& consumers) noexcept {
  if (consumers.empty()) {
    lease.release();
    return;
  }
  try {
    std::vector<std::shared_ptr<memory::Fence>> fences;
    for (const ConsumerStream& c : consumers) {
      const auto current = c.backend->scoped_current();
      auto done = c.backend->create_event();
      c.backend->consumer_record(c.stream, *done);
      fences.push_back(std::move(done));
    }
    lease.release_after(fences.size() == 1 ? std::move(fences.front())
                                           : std::make_shared<AllFences>(std::move(fences)));
  } catch (const std::exception& e) {
    pinfeed::detail::log().error("a batch's slot could not be fenced on its consumer's stream; returned now: {}",
                                 e.what());
    lease.release();
  }
}

/// One batch's device memory, reused through the feed's ring.
struct DeviceFeed::Buffers {
  DeviceBuffer raw;            ///< the slot's samples as copied
  DeviceBuffer output_buffer;  ///< float NCHW (of `output`'s type), when normalizing
  DeviceBuffer labels32, labels64;
  std::size_t capacity = 0, sample_bytes = 0;
  bool normalizes = false;
  FloatType output = FloatType::f32;
  std::shared_ptr<Event> copied, ready, released;
  bool release_recorded = false;  ///< `released` marks the last consumer's use
};

struct DeviceFeed::State {
  std::shared_ptr<DeviceBackend> backend;  // first: the buffers below are freed through it
  DeviceFeedOptions options;
  std::mutex mutex;
  std::vector<std::unique_ptr<Buffers>> free;
  DeviceFeedStats stats;
  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    // The last batch may go on any thread: free on this device, then give
    // the thread its own back.
    if (!backend) return;
    const auto current = backend->scoped_current();
    free.clear();
  }
};

DeviceFeed::DeviceFeed(std::shared_ptr<DeviceBackend> backend, DeviceFeedOptions options)
    : state_(std::make_shared<State>()) {
  state_->backend = std::move(backend);
  state_->options = options;
  const auto current = state_->backend->scoped_current();
  copy_ = state_->backend->create_copy_stream();
}

DeviceFeed::~DeviceFeed() {
  // Work still queued reads slots and writes buffers: let it finish first.
  try {
    const auto current = state_->backend->scoped_current();
    state_->backend->synchronize(*copy_);
  } catch (const std::exception& e) {
    pinfeed::detail::log().error("device feed on {}: {}", state_->backend->name(), e.what());
  }
}

DeviceBackend& DeviceFeed::backend() const noexcept { return *state_->backend; }

DeviceFeedStats DeviceFeed::stats() const {
  const std::scoped_lock lock(state_->mutex);
  return state_->stats;
}

std::shared_ptr<DeviceBatch> DeviceFeed::submit(loader::Batch batch) {
  DeviceBackend& b = *state_->backend;
  const auto current = b.scoped_current();
  const bool normalize = state_->options.normalize && batch.layout() == loader::Layout::nhwc_u8;
  const std::size_t capacity = batch.capacity(), sample_bytes = batch.sample_bytes();
  std::unique_ptr<Buffers> buf;
  {
    const std::scoped_lock lock(state_->mutex);
    auto& free = state_->free;
    const auto fits = std::find_if(free.begin(), free.end(), [&](const std::unique_ptr<Buffers>& f) {
      return f->capacity >= capacity && f->sample_bytes == sample_bytes && f->normalizes == normalize &&
             f->output == state_->options.output;
    });
    if (fits != free.end()) {
      buf = std::move(*fits);
      free.erase(fits);
    }
  }
  if (!buf) {
    buf = std::make_unique<Buffers>();
    buf->capacity = capacity;
    buf->sample_bytes = sample_bytes;
    buf->normalizes = normalize;
    buf->output = state_->options.output;
    buf->raw = b.allocate(capacity * sample_bytes);
    if (normalize) buf->output_buffer = b.allocate(capacity * sample_bytes * float_bytes(state_->options.output));
    buf->labels32 = b.allocate(capacity * sizeof(std::int32_t));
    buf->labels64 = b.allocate(capacity * sizeof(std::int64_t));
    buf->copied = b.create_event();
    buf->ready = b.create_event();
    buf->released = b.create_event();
    const std::scoped_lock lock(state_->mutex);
    ++state_->stats.device_buffers;
  }
  // The last consumer of these buffers may still be reading them. The
  // stream's own clock: how long it waits for that, how long the copy takes.
  using Clock = std::chrono::steady_clock;
  auto times = std::make_shared<std::array<Clock::time_point, 3>>();
  b.host_callback(*copy_, [times] { (*times)[0] = Clock::now(); });
  if (buf->release_recorded) b.stream_wait(*copy_, *buf->released);
  b.host_callback(*copy_, [times] { (*times)[1] = Clock::now(); });
  // A pool that has not yet seen the last copy's event complete still holds
  // it: re-recording it would keep that slot out until this copy is done.
  if (buf->copied.use_count() > 1) buf->copied = b.create_event();
  const std::size_t n = batch.size();
  copy_batch(b, *copy_, batch, buf->raw.get(), buf->labels32.as<std::int32_t>(), buf->copied);
  b.host_callback(*copy_, [times, state = std::weak_ptr<State>(state_)] {
    (*times)[2] = Clock::now();
    if (const auto s = state.lock()) {
      const std::scoped_lock lock(s->mutex);
      s->stats.wait_consumer_seconds += seconds_between((*times)[0], (*times)[1]);
      s->stats.copy_seconds += seconds_between((*times)[1], (*times)[2]);
    }
  });
  if (normalize) {
    const auto shape = batch.shape();  // N, H, W, C
    b.normalize_u8_as(*copy_, buf->raw.as<std::uint8_t>(), buf->output_buffer.get(), state_->options.output,
                      static_cast<int>(n), static_cast<int>(shape[1]), static_cast<int>(shape[2]),
                      state_->options.norm);
  }
  b.widen_labels(*copy_, buf->labels32.as<std::int32_t>(), buf->labels64.as<std::int64_t>(), n);
  b.record(*buf->ready, *copy_);
  {
    const std::scoped_lock lock(state_->mutex);
    ++state_->stats.batches;
    state_->stats.bytes += n * (sample_bytes + sizeof(std::int32_t));
  }
  return std::make_shared<DeviceBatch>(state_, std::move(buf), batch, normalize, state_->options.output);
}

DeviceBatch::DeviceBatch(std::shared_ptr<DeviceFeed::State> state, std::unique_ptr<DeviceFeed::Buffers> buffers,
                         const loader::Batch& batch, bool normalized, FloatType type)
    : state_(std::move(state)), buffers_(std::move(buffers)), float_type_(normalized ? type : FloatType::f32) {
  const auto s = batch.shape();
  const auto n = static_cast<std::int64_t>(batch.size());
  if (batch.layout() == loader::Layout::nhwc_u8) {
    floats_ = normalized;
    shape_ = normalized ? std::array<std::int64_t, 4>{n, static_cast<std::int64_t>(s[3]),
                                                      static_cast<std::int64_t>(s[1]), static_cast<std::int64_t>(s[2])}
                        : std::array<std::int64_t, 4>{n, static_cast<std::int64_t>(s[1]),
                                                      static_cast<std::int64_t>(s[2]), static_cast<std::int64_t>(s[3])};
  } else {
    floats_ = true;
    shape_ = {n, static_cast<std::int64_t>(s[1]), static_cast<std::int64_t>(s[2]), static_cast<std::int64_t>(s[3])};
  }
}

void* DeviceBatch::images() const noexcept {
  return buffers_->normalizes ? buffers_->output_buffer.get() : buffers_->raw.get();
}
std::int64_t* DeviceBatch::labels() const noexcept { return buffers_->labels64.as<std::int64_t>(); }

void DeviceBatch::hand_to(std::uintptr_t consumer) {
  DeviceBackend& b = *state_->backend;
  const auto current = b.scoped_current();
  const auto t0 = std::chrono::steady_clock::now();
  b.consumer_wait(consumer, *buffers_->ready);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  handed_ = true;
  consumer_ = consumer;
  const std::scoped_lock lock(state_->mutex);
  state_->stats.wait_copy_seconds += waited;
}

DeviceBatch::~DeviceBatch() {
  if (!buffers_) return;
  try {
    if (handed_) {
      DeviceBackend& b = *state_->backend;
      const auto current = b.scoped_current();
      b.consumer_record(consumer_, *buffers_->released);
    }
    // Never handed over: only the copy stream used the buffers, and its
    // next copy into them comes after in stream order.
    buffers_->release_recorded = handed_;
    const std::scoped_lock lock(state_->mutex);
    state_->free.push_back(std::move(buffers_));
  } catch (const std::exception& e) {
    // The device failed; these buffers are not reused.
    pinfeed::detail::log().error("device feed on {}: a batch's buffers could not be handed back: {}",
                                 state_->backend->name(), e.what());
  }
}

}  // namespace pinfeed::trainer
