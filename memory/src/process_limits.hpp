#pragma once
// The calling process's own locking limits, read with syscalls (the
// MemorySnapshot reads the same facts from files so that fixtures work).
#include <cstdint>
#include <optional>

namespace pinfeed::memory::detail {

/// Soft RLIMIT_MEMLOCK in bytes; nullopt when unlimited.
std::optional<std::uint64_t> memlock_limit() noexcept;
/// VmLck of this process (bytes it has mlocked now), from /proc/self/status; 0 if unreadable.
std::uint64_t locked_now() noexcept;
/// Whether CAP_IPC_LOCK is in the effective set (mlock then ignores the limit).
bool has_cap_ipc_lock() noexcept;

}  // namespace pinfeed::memory::detail
