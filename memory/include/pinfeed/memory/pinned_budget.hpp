#pragma once
// PinnedBudget: how many bytes may be pinned, with every term named so a
// tool can explain the answer.
#include <cstdint>
#include <string>
#include <vector>

#include "pinfeed/memory/memory_snapshot.hpp"
#include "pinfeed/memory/pinned_resource.hpp"

namespace pinfeed::memory {

struct BudgetPolicy {
  double fraction = 0.5;                ///< share of the real room pinned memory may take, (0, 1]
  PinMethod method = PinMethod::mlock;  ///< mlock is charged to RLIMIT_MEMLOCK, cuda is not
  std::uint64_t reserve_bytes = 0;      ///< kept free before the fraction is applied
  unsigned local_ranks = 1;             ///< processes on this host sharing its memory (each gets 1/N of the room)
  void validate() const;                ///< ConfigError naming the field
};

struct BudgetTerm {
  std::string name;     ///< "pool need", "MemAvailable", "cgroup room", "memlock limit"
  std::uint64_t bytes;  ///< this term's bound
  std::string detail;   ///< how it was computed, in words
};

struct PinnedBudget {
  std::uint64_t bytes = 0;        ///< the least of the terms
  std::string limiting;           ///< name of the term that decides
  std::vector<BudgetTerm> terms;  ///< every bound considered, in order

  /// Budget for a pool that needs `need_bytes`, under `policy`.
  static PinnedBudget compute(const MemorySnapshot& snapshot, const BudgetPolicy& policy, std::uint64_t need_bytes);
};

}  // namespace pinfeed::memory
