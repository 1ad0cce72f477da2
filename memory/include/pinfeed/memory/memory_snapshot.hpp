#pragma once
// MemorySnapshot: one reading of host memory, from a procfs/sysfs root.
//
// The root defaults to "/"; tests and `pinfeed-diag --root` point it at a
// folder laid out like / (proc/meminfo, proc/vmstat, proc/pressure/memory,
// proc/self/{cgroup,limits,status}, sys/fs/cgroup/...). Files that old
// kernels or other setups lack (PSI, swap counters, cgroup files) become
// empty optionals with a note; only a missing proc/meminfo is an error.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "pinfeed/enum_words.hpp"

namespace pinfeed::memory {

/// One line of a PSI file: percentages of wall time stalled, and total µs.
struct PsiLine {
  double avg10 = 0, avg60 = 0, avg300 = 0;
  std::uint64_t total_us = 0;
};
struct Psi {
  PsiLine some;
  std::optional<PsiLine> full;  ///< absent in some kernels' cpu files; present for memory
};

enum class CgroupVersion { none, v1, v2 };
inline constexpr std::array<EnumWord<CgroupVersion>, 3> kCgroupVersionWords{
    {{CgroupVersion::none, "none"}, {CgroupVersion::v1, "v1"}, {CgroupVersion::v2, "v2"}}};
std::string_view to_string(CgroupVersion v) noexcept;

struct CgroupMemory {
  CgroupVersion version = CgroupVersion::none;
  std::string path;                          ///< the process's cgroup, from proc/self/cgroup
  std::filesystem::path dir;                 ///< where the files were read
  std::optional<std::uint64_t> limit_bytes;  ///< effective hard limit (lowest up the tree); nullopt: none
  std::optional<std::uint64_t> high_bytes;   ///< v2 memory.high; nullopt: none
  std::uint64_t usage_bytes = 0;             ///< v1 usage_in_bytes, v2 memory.current
  std::uint64_t inactive_file_bytes = 0;     ///< reclaimable page cache inside the usage
  std::optional<Psi> pressure;               ///< v2 memory.pressure
  std::optional<std::uint64_t> oom_kills;    ///< v2 memory.events oom_kill; v1 memory.oom_control oom_kill
  std::optional<std::uint64_t> max_events;   ///< v2 memory.events max (times the limit was hit)
  std::optional<std::uint64_t> high_events;  ///< v2 memory.events high (times reclaim was forced over memory.high)
  std::optional<std::uint64_t> failcnt;      ///< v1 memory.failcnt
  std::optional<std::uint64_t> memsw_limit_bytes;  ///< v1 memory.memsw.limit_in_bytes (memory + swap); nullopt: none
  std::uint64_t memsw_usage_bytes = 0;             ///< v1 memory.memsw.usage_in_bytes

  /// Times the cgroup ran into its limit: v1 failcnt, v2 memory.events max +
  /// high; nullopt when the cgroup does not count them.
  [[nodiscard]] std::optional<std::uint64_t> limit_hits() const noexcept;
  /// The least of the limits (memory.max, memory.high, memory + swap) minus
  /// usage net of inactive file cache; nullopt when unlimited.
  [[nodiscard]] std::optional<std::uint64_t> room_bytes() const noexcept;
};

struct MemorySnapshot {
  std::chrono::steady_clock::time_point taken_at{};
  std::filesystem::path root;

  // proc/meminfo, bytes
  std::uint64_t mem_total = 0, mem_available = 0, shmem = 0, mlocked = 0;
  std::uint64_t swap_total = 0, swap_free = 0;
  // proc/vmstat, pages since boot
  std::optional<std::uint64_t> pswpin, pswpout;
  // proc/pressure/memory; nullopt with psi_note saying why
  std::optional<Psi> psi;
  std::string psi_note;

  CgroupMemory cgroup;

  // the process: proc/self/limits and proc/self/status
  std::optional<std::uint64_t> memlock_limit;  ///< soft RLIMIT_MEMLOCK; nullopt: unlimited or unknown
  bool memlock_limit_known = false;
  bool cap_ipc_lock = false;    ///< CAP_IPC_LOCK in CapEff
  std::uint64_t vm_locked = 0;  ///< VmLck: bytes this process has mlocked
  std::uint64_t vm_pinned = 0;  ///< VmPin: bytes pinned by drivers (not always reported)

  /// Reads everything under root. Throws DataError when proc/meminfo is
  /// missing or unparsable; everything else is optional.
  static MemorySnapshot read(const std::filesystem::path& root = "/");

  /// What is really available: the least of MemAvailable and the cgroup room.
  [[nodiscard]] std::uint64_t effective_available() const noexcept;
  /// What the process can ever have: the least of MemTotal and the cgroup limit.
  [[nodiscard]] std::uint64_t effective_total() const noexcept;
  /// effective_available / effective_total, in [0, 1].
  [[nodiscard]] double available_fraction() const noexcept;
  [[nodiscard]] std::uint64_t swap_used() const noexcept { return swap_total - std::min(swap_free, swap_total); }
};

/// A process holding locked or driver-pinned memory (proc/<pid>/status).
struct LockedMemoryUser {
  int pid = 0;
  std::string name;
  std::uint64_t vm_locked = 0;  ///< VmLck
  std::uint64_t vm_pinned = 0;  ///< VmPin
};
/// Every process under root/proc with VmLck or VmPin above zero, largest
/// first. Best effort: processes that vanish or cannot be read are skipped.
std::vector<LockedMemoryUser> locked_memory_users(const std::filesystem::path& root = "/");

}  // namespace pinfeed::memory
