#pragma once
// CheckingResource: a HostResource for tests that wraps an upstream and
// catches misuse: every block is recorded, a guard word is written just past
// the requested bytes and checked on return, double frees and size or
// alignment mismatches fail the test, leaks are reported at destruction, it
// can be told to refuse the next N allocations with OutOfMemory, and to hold
// every deallocation until released (to catch callers that do not wait).
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "pinfeed/error.hpp"
#include "pinfeed/memory/host_resource.hpp"

namespace pinfeed::testing {

class CheckingResource final : public memory::HostResource {
 public:
  static constexpr std::uint64_t kGuard = 0xfeedfacecafebeefULL;

  explicit CheckingResource(memory::HostResource& upstream) : upstream_(upstream) {}
  ~CheckingResource() override {
    const std::scoped_lock lock(mutex_);
    EXPECT_TRUE(live_.empty()) << live_.size() << " block(s) leaked from CheckingResource(" << upstream_.name() << ")";
  }

  /// The next `n` allocations throw OutOfMemory with `reason`.
  void fail_next(int n, std::string reason = "injected") {
    const std::scoped_lock lock(mutex_);
    fail_next_ = n;
    fail_reason_ = std::move(reason);
  }
  /// Deallocations block from now until release_frees().
  void hold_frees() {
    const std::scoped_lock lock(mutex_);
    hold_frees_ = true;
  }
  void release_frees() {
    {
      const std::scoped_lock lock(mutex_);
      hold_frees_ = false;
    }
    frees_cv_.notify_all();
  }
  [[nodiscard]] std::size_t live_blocks() const {
    const std::scoped_lock lock(mutex_);
    return live_.size();
  }
  [[nodiscard]] std::uint64_t allocations() const { return allocations_.load(); }

  [[nodiscard]] bool is_pinned() const noexcept override { return upstream_.is_pinned(); }
  [[nodiscard]] std::string_view name() const noexcept override { return upstream_.name(); }

 private:
  struct Block {
    std::size_t bytes, alignment;
  };
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    {
      const std::scoped_lock lock(mutex_);
      if (fail_next_ > 0) {
        --fail_next_;
        throw OutOfMemory(fail_reason_, "CheckingResource: simulated out of memory");
      }
    }
    void* p = upstream_.allocate(bytes + sizeof kGuard, alignment);
    std::memcpy(static_cast<char*>(p) + bytes, &kGuard, sizeof kGuard);
    const std::scoped_lock lock(mutex_);
    EXPECT_TRUE(live_.emplace(p, Block{bytes, alignment}).second) << "upstream returned a live pointer twice";
    ++allocations_;
    return p;
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    {
      std::unique_lock lock(mutex_);
      frees_cv_.wait(lock, [this] { return !hold_frees_; });
      const auto it = live_.find(p);
      if (it == live_.end()) {
        ADD_FAILURE() << "deallocate of a pointer not live (double free or foreign): " << p;
        return;
      }
      EXPECT_EQ(it->second.bytes, bytes) << "size mismatch on deallocate";
      EXPECT_EQ(it->second.alignment, alignment) << "alignment mismatch on deallocate";
      std::uint64_t guard = 0;
      std::memcpy(&guard, static_cast<char*>(p) + it->second.bytes, sizeof guard);
      EXPECT_EQ(guard, kGuard) << "guard word overwritten: a write ran past the block";
      live_.erase(it);
    }
    upstream_.deallocate(p, bytes + sizeof kGuard, alignment);
  }

  memory::HostResource& upstream_;
  mutable std::mutex mutex_;  // guards live_, fail_next_, fail_reason_, hold_frees_
  std::condition_variable frees_cv_;
  bool hold_frees_ = false;
  std::unordered_map<void*, Block> live_;
  int fail_next_ = 0;
  std::string fail_reason_;
  std::atomic<std::uint64_t> allocations_{0};
};

}  // namespace pinfeed::testing
