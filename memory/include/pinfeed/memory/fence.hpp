#pragma once
// Fence: "the work that reads this memory has finished". A BufferPool slot
// released with a fence goes back to the free list only once the fence is
// ready (see Note [Slot lifetime] in buffer_pool.hpp). The trainer's copy
// engine implements it with a CUDA event or a CPU-stream completion.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>

namespace pinfeed::memory {

class Fence {
 public:
  Fence() = default;
  Fence(const Fence&) = delete;
  Fence& operator=(const Fence&) = delete;
  virtual ~Fence() = default;
  /// Non-blocking: has the work completed? Thread-safe.
  [[nodiscard]] virtual bool ready() noexcept = 0;
  /// Blocks up to `timeout`; true when completed. Thread-safe. May throw
  /// when the work failed; destructors that wait catch it.
  virtual bool wait_for(std::chrono::microseconds timeout) = 0;
};

/// A fence that someone signals by hand: host-side completions, tests.
class ManualFence final : public Fence {
 public:
  void signal() {
    {
      const std::scoped_lock lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
  }
  [[nodiscard]] bool ready() noexcept override {
    const std::scoped_lock lock(mutex_);
    return done_;
  }
  bool wait_for(std::chrono::microseconds timeout) override {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, timeout, [this] { return done_; });
  }

 private:
  std::mutex mutex_;  // guards done_
  std::condition_variable cv_;
  bool done_ = false;
};

}  // namespace pinfeed::memory
