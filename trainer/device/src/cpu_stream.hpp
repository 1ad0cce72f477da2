#pragma once
// The CPU backend's streams and events (cpu_backend.cpp: the backend's
// lifecycle, memory and ordering; cpu_kernels.cpp: its math on those streams).
// Private to trainer/device.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stop_token>
#include <thread>
#include <utility>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/trainer/device_backend.hpp"

namespace pinfeed::trainer {

/// A backend's live streams (all CpuStreams), so that freeing memory can ask
/// whether any of them still has work: on a GPU that work could still read
/// the memory.
struct StreamSet {
  std::mutex mutex;  // guards streams
  std::vector<const Stream*> streams;
};

namespace cpu_detail {

/// An event's state: how many times it was recorded, and how far the
/// recordings have completed. Waiters wait for the target they saw.
/// Tasks hold the event by shared_ptr: like a CUDA event, it may be dropped
/// by its owner while recorded work is still queued.
class CpuEvent final : public Event, public std::enable_shared_from_this<CpuEvent> {
 public:
  std::uint64_t arm() {
    const std::scoped_lock lock(mutex_);
    return ++recorded_;
  }
  std::uint64_t target() {
    const std::scoped_lock lock(mutex_);
    return recorded_;
  }
  void complete(std::uint64_t target, const std::exception_ptr& error) {
    {
      const std::scoped_lock lock(mutex_);
      completed_ = std::max(completed_, target);
      if (error && !error_) error_ = error;
    }
    cv_.notify_all();
  }
  [[nodiscard]] bool ready() noexcept override {
    const std::scoped_lock lock(mutex_);
    return completed_ >= recorded_;
  }
  bool wait_for(std::chrono::microseconds timeout) override {
    std::unique_lock lock(mutex_);
    const std::uint64_t want = recorded_;
    if (!cv_.wait_for(lock, timeout, [&] { return completed_ >= want; })) return false;
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  /// Waits for `want` from a stream worker, giving up when the stream stops.
  void wait_from_worker(std::uint64_t want, const std::stop_token& stop) {
    std::unique_lock lock(mutex_);
    while (completed_ < want) {
      if (stop.stop_requested()) throw Cancelled("cpu stream: stopped while waiting for an event");
      cv_.wait_for(lock, std::chrono::milliseconds(10));
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::mutex mutex_;  // guards the three fields below
  std::condition_variable cv_;
  std::uint64_t recorded_ = 0, completed_ = 0;
  std::exception_ptr error_;
};

/// One worker thread running tasks in order. After a task throws, the
/// stream is in error: later tasks are skipped except those marked
/// `always` (event completions and synchronize), which see the error.
class CpuStream final : public Stream {
 public:
  using Task = std::function<void(const std::exception_ptr& stream_error, const std::stop_token&)>;

  CpuStream(std::size_t max_queued, std::shared_ptr<StreamSet> set)
      : registration_(this, std::move(set)),
        max_queued_(max_queued),
        worker_([this](const std::stop_token& st) { run(st); }) {}

  /// Whether work is queued or running.
  [[nodiscard]] bool busy() const {
    const std::scoped_lock lock(mutex_);
    return !queue_.empty() || running_;
  }
  ~CpuStream() override {
    worker_.request_stop();
    { const std::scoped_lock lock(mutex_); }  // the worker is either before its check or waiting: no lost wake-up
    cv_work_.notify_all();
    cv_space_.notify_all();
  }

  void push(Task task, bool always) {
    std::unique_lock lock(mutex_);
    cv_space_.wait(lock, [&] { return queue_.size() < max_queued_; });
    queue_.push_back(Item{std::move(task), always});
    cv_work_.notify_one();
  }

 private:
  struct Item {
    Task task;
    bool always = false;
  };

  void run(const std::stop_token& stop) {
    for (;;) {
      Item item;
      std::exception_ptr error;
      {
        std::unique_lock lock(mutex_);
        running_ = false;
        cv_work_.wait(lock, [&] { return !queue_.empty() || stop.stop_requested(); });
        if (queue_.empty()) return;  // stopping, and nothing left to run
        item = std::move(queue_.front());
        queue_.pop_front();
        error = error_;
        // Event completions and synchronize markers touch no buffer, and a
        // waiter they release may free at once: they do not count as work.
        running_ = !item.always;
      }
      cv_space_.notify_one();
      if (error && !item.always) continue;
      try {
        item.task(error, stop);
      } catch (...) {
        const std::scoped_lock lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  /// In the set from construction until after the worker has joined (the
  /// first member, so destroyed last).
  struct Registration {
    Registration(const Stream* s, std::shared_ptr<StreamSet> set) : stream(s), streams(std::move(set)) {
      const std::scoped_lock lock(streams->mutex);
      streams->streams.push_back(stream);
    }
    ~Registration() {
      const std::scoped_lock lock(streams->mutex);
      std::erase(streams->streams, stream);
    }
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;
    const Stream* stream;
    std::shared_ptr<StreamSet> streams;
  } registration_;
  std::size_t max_queued_;
  mutable std::mutex mutex_;  // guards queue_, running_ and error_
  bool running_ = false;
  std::condition_variable cv_work_, cv_space_;
  std::deque<Item> queue_;
  std::exception_ptr error_;
  std::jthread worker_;  // last: starts after the fields it uses
};

inline CpuStream& cpu(Stream& s) { return dynamic_cast<CpuStream&>(s); }
inline CpuEvent& cpu(Event& e) { return dynamic_cast<CpuEvent&>(e); }

/// Enqueues a plain task (skipped once the stream is in error).
template <class F>
void post(Stream& s, F&& f) {
  cpu(s).push([fn = std::forward<F>(f)](const std::exception_ptr&, const std::stop_token&) { fn(); }, false);
}

/// The calling thread's first sgemm gives one held share of address space
/// back for OpenBLAS's buffer (Note [Address space held for OpenBLAS], cpu_backend.cpp).
void give_room_to_openblas();

}  // namespace cpu_detail

}  // namespace pinfeed::trainer
