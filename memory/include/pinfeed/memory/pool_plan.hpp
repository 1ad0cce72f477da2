#pragma once
// Planning a pinned pool for a job before running it: how big it must be,
// whether the host can afford it, and what to do if not. pinfeed-diag prints
// this; the logic lives here so it is tested without the tool.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pinfeed/memory/pinned_budget.hpp"

namespace pinfeed::memory {

/// Bytes of a batch given as "256x3x224x224:u8" (dims, then u8|f16|bf16|f32|f64).
/// Throws ConfigError on malformed text, zero dims or overflow.
std::uint64_t batch_bytes_from_shape(std::string_view shape);

struct PoolPlanRequest {
  unsigned gpus = 1;                    ///< consumers (GPUs, or CPU workers)
  std::uint64_t batch_bytes = 0;        ///< one batch as it sits in host memory
  unsigned prefetch = 2;                ///< batches in flight per GPU
  std::uint64_t gpu_memory_bytes = 0;   ///< memory per GPU for the 2x rule; 0: unknown
  BudgetPolicy policy;
  void validate() const;                ///< ConfigError naming the field
};

enum class Verdict { pin, pin_reduced, pageable };
std::string_view to_string(Verdict v) noexcept;

struct PoolPlan {
  std::uint64_t slot_bytes = 0;     ///< batch_bytes page-rounded
  unsigned slots_needed = 0;        ///< gpus * prefetch
  std::uint64_t need_bytes = 0;     ///< slot_bytes * slots_needed
  PinnedBudget budget;
  unsigned slots_fit = 0;           ///< whole slots the budget holds (capped at slots_needed)
  unsigned prefetch_fit = 0;        ///< slots_fit / gpus
  Verdict verdict = Verdict::pageable;
  std::vector<std::string> reasons;  ///< plain-language explanation, most important first
  // Field rule of thumb: host RAM about twice the GPU memory in use.
  std::uint64_t gpu_memory_total = 0;  ///< gpus * gpu_memory_bytes; 0 when unknown
  bool rule_known = false;
  bool rule_met = false;
};

PoolPlan plan_pool(const MemorySnapshot& snapshot, const PoolPlanRequest& request);

}  // namespace pinfeed::memory
