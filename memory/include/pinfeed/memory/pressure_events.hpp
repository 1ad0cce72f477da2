#pragma once
// PressureEvents: the kernel's own notifications that memory pressure may
// have changed, so the PressureMonitor reads the host at once instead of at
// its next poll. A neighbour growing at memory speed fills a 64 MiB headroom
// in ~0.2 s; a 250 ms poll sees it too late (3 of 3 runs OOM-killed,
// docs/results.md).
//
//   cgroup v1  usage thresholds (cgroup.event_control + memory.usage_in_bytes
//              + an eventfd per line): the kernel signals when the usage
//              crosses a line, checked every ~0.5 MiB charged; and
//              memory.pressure_level "medium" (reclaim has begun).
//   cgroup v2  a PSI trigger on the cgroup's memory.pressure ("some 100 ms
//              in 1 s") and memory.events (changes when the limit or
//              memory.high is hit, or an OOM kill), both through poll().
//   host       a PSI trigger on /proc/pressure/memory.
//
// Whatever cannot be armed (no permission, an old kernel, a fixture root) is
// left out and said in describe(); the monitor then polls, faster while the
// host is near a threshold. Linux only; elsewhere nothing is armed.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "pinfeed/memory/memory_snapshot.hpp"

namespace pinfeed::memory {

class PressureEvents {
 public:
  /// Arms what `snapshot`'s host offers; `usage_lines`: cgroup v1 usage
  /// thresholds in bytes. Never throws.
  PressureEvents(const MemorySnapshot& snapshot, const std::vector<std::uint64_t>& usage_lines);
  ~PressureEvents();
  PressureEvents(const PressureEvents&) = delete;
  PressureEvents& operator=(const PressureEvents&) = delete;

  /// Waits up to `timeout` for a kernel event or wake(). True when a kernel
  /// event fired (it is consumed).
  bool wait(std::chrono::milliseconds timeout);
  /// Ends a wait() at once (from another thread).
  void wake() noexcept;

  /// What is armed, in words ("cgroup v1 usage thresholds at 522 MiB and
  /// 586 MiB; cgroup v1 pressure_level medium; PSI trigger on
  /// /proc/pressure/memory"), or why nothing is.
  [[nodiscard]] const std::string& describe() const noexcept { return description_; }
  [[nodiscard]] bool armed() const noexcept { return !sources_.empty(); }
  [[nodiscard]] std::uint64_t fired() const noexcept { return fired_; }

 private:
  enum class Kind { eventfd, psi, kernfs };
  struct Source {
    int fd = -1;
    Kind kind = Kind::eventfd;
  };
  void arm_v1(const CgroupMemory& cg, const std::vector<std::uint64_t>& usage_lines, std::vector<std::string>& armed,
              std::vector<std::string>& missed);
  void arm_psi(const std::filesystem::path& file, std::vector<std::string>& armed, std::vector<std::string>& missed);
  void arm_kernfs(const std::filesystem::path& file, std::vector<std::string>& armed, std::vector<std::string>& missed);

  int wake_fd_ = -1;
  std::vector<Source> sources_;
  std::vector<int> keep_open_;  // v1: the usage / pressure_level files an eventfd is registered against
  std::string description_;
  std::uint64_t fired_ = 0;
};

}  // namespace pinfeed::memory
