#include "process_limits.hpp"

#include <sys/capability.h>
#include <sys/resource.h>

namespace pinfeed::memory::detail {

std::optional<std::uint64_t> memlock_limit() noexcept {
  rlimit lim{};
  if (::getrlimit(RLIMIT_MEMLOCK, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return std::nullopt;
  return static_cast<std::uint64_t>(lim.rlim_cur);
}

bool has_cap_ipc_lock() noexcept {
  cap_t caps = ::cap_get_proc();
  if (caps == nullptr) return false;
  cap_flag_value_t value = CAP_CLEAR;
  const bool ok = ::cap_get_flag(caps, CAP_IPC_LOCK, CAP_EFFECTIVE, &value) == 0;
  ::cap_free(caps);
  return ok && value == CAP_SET;
}

}  // namespace pinfeed::memory::detail
