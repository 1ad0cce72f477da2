#include "pinfeed/memory/pinned_budget.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "pinfeed/error.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {

void BudgetPolicy::validate() const {
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    throw ConfigError(fmt::format("budget fraction must be in (0, 1], got {}", fraction));
  }
  if (method == PinMethod::automatic) {
    throw ConfigError("budget pin method must be resolved (mlock or cuda), not auto");
  }
  if (local_ranks == 0 || local_ranks > 4096) {
    throw ConfigError(fmt::format("budget local_ranks must be 1..4096, got {}", local_ranks));
  }
}

namespace {
/// This rank's share of a shared room: (room - reserve) * fraction / ranks.
std::uint64_t scaled(std::uint64_t bytes, std::uint64_t reserve, double fraction, unsigned ranks) {
  const std::uint64_t room = bytes > reserve ? bytes - reserve : 0;
  return static_cast<std::uint64_t>(std::floor(static_cast<double>(room) * fraction / ranks));
}
}  // namespace

PinnedBudget PinnedBudget::compute(const MemorySnapshot& s, const BudgetPolicy& policy, std::uint64_t need_bytes) {
  policy.validate();
  PinnedBudget b;
  const int pct = static_cast<int>(std::lround(policy.fraction * 100));
  std::string reserve =
      policy.reserve_bytes > 0 ? fmt::format(" after keeping {} free", format_bytes(policy.reserve_bytes)) : "";
  // Ranks on one host share its RAM and cgroup: each sizes its pinned
  // memory as one of N, never as if alone. RLIMIT_MEMLOCK is per process.
  if (policy.local_ranks > 1) reserve += fmt::format(", split across {} local ranks", policy.local_ranks);

  b.terms.push_back({"pool need", need_bytes, "the slots the pool asks for, page-rounded"});
  b.terms.push_back({"MemAvailable", scaled(s.mem_available, policy.reserve_bytes, policy.fraction, policy.local_ranks),
                     fmt::format("{}% of MemAvailable {}{}", pct, format_bytes(s.mem_available), reserve)});
  if (const auto room = s.cgroup.room_bytes()) {
    b.terms.push_back(
        {"cgroup room", scaled(*room, policy.reserve_bytes, policy.fraction, policy.local_ranks),
         fmt::format("{}% of cgroup {} room {} (limit {} - usage {} + inactive file {}){}", pct,
                     to_string(s.cgroup.version), format_bytes(*room), format_bytes(*s.cgroup.limit_bytes),
                     format_bytes(s.cgroup.usage_bytes), format_bytes(s.cgroup.inactive_file_bytes), reserve)});
  }
  if (policy.method == PinMethod::mlock && !s.cap_ipc_lock && s.memlock_limit) {
    const std::uint64_t left = *s.memlock_limit > s.vm_locked ? *s.memlock_limit - s.vm_locked : 0;
    b.terms.push_back({"memlock limit", left,
                       fmt::format("RLIMIT_MEMLOCK {} minus {} already locked; mlock without CAP_IPC_LOCK",
                                   format_bytes(*s.memlock_limit), format_bytes(s.vm_locked))});
  }
  const auto smallest = std::min_element(b.terms.begin(), b.terms.end(),
                                         [](const BudgetTerm& x, const BudgetTerm& y) { return x.bytes < y.bytes; });
  b.bytes = smallest->bytes;
  b.limiting = smallest->name;
  return b;
}

}  // namespace pinfeed::memory
