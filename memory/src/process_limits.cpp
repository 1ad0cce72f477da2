#include "process_limits.hpp"

#include <sys/capability.h>
#include <sys/resource.h>

#include <fstream>
#include <string>

namespace pinfeed::memory::detail {

std::optional<std::uint64_t> memlock_limit() noexcept {
  rlimit lim{};
  if (::getrlimit(RLIMIT_MEMLOCK, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return std::nullopt;
  return static_cast<std::uint64_t>(lim.rlim_cur);
}

std::uint64_t locked_now() noexcept {
  try {
    std::ifstream in("/proc/self/status");
    std::string key;
    while (in >> key) {
      if (key == "VmLck:") {
        std::uint64_t kb = 0;
        in >> kb;
        return kb * 1024;
      }
    }
  } catch (...) {
  }
  return 0;
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
