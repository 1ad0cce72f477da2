#pragma once
// Planning a pinned pool for a job before running it: how big it must be,
// whether the host can afford it, and what to do if not. pinfeed-diag prints
// this; the logic lives here so it is tested without the tool.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pinfeed/enum_words.hpp"
#include "pinfeed/memory/pinned_budget.hpp"

namespace pinfeed::memory {

/// Bytes of a batch given as "256x3x224x224:u8" (dims, then u8|f16|bf16|f32|f64).
/// Throws ConfigError on malformed text, zero dims or overflow.
std::uint64_t batch_bytes_from_shape(std::string_view shape);

// Note [Pool fit]: a pool is checked against the host before anything is
// mapped, pinned or not: its slots x page-rounded slot bytes must be within
// kPoolMaxShareOfAvailable of the really available memory (the least of
// MemAvailable and the cgroup room), divided by the ranks on this host.
// Over it, the Loader refuses with a ConfigError that says how many slots
// fit and what slot size would, and pinfeed-diag's verdict is does-not-fit.
// Without it a 120 GiB pool on a 24 GiB host maps slab after slab until
// mmap fails (or the OOM killer comes).

/// Share of the really available memory that a whole pool may take: the
/// rest is the host's, for the model, the page cache and everything else.
inline constexpr double kPoolMaxShareOfAvailable = 0.9;

/// Whether a pool of `slots` x `slot_bytes` (page-rounded) fits this rank's
/// share of the really available memory, whatever it is pinned with.
struct PoolFit {
  bool fits = true;
  std::uint64_t pool_bytes = 0;       ///< slots x page-rounded slot bytes
  std::uint64_t allowed_bytes = 0;    ///< kPoolMaxShareOfAvailable x available / local ranks
  std::uint64_t available_bytes = 0;  ///< the snapshot's effective_available()
  unsigned local_ranks = 1;
  std::uint64_t slots_fit = 0;           ///< whole slots of this size that fit
  std::uint64_t largest_slot_bytes = 0;  ///< the largest slot that fits `slots` times
  std::string limiting;                  ///< "MemAvailable" or "cgroup room"
  /// When it does not fit: what was asked, what there is, and what would
  /// fit, with the prefetch per consumer (slots_fit / consumers).
  [[nodiscard]] std::string explain(std::string_view prefetch_name, std::string_view batch_name,
                                    unsigned consumers) const;
};
PoolFit check_pool_fit(const MemorySnapshot& snapshot, std::uint64_t slots, std::uint64_t slot_bytes,
                       unsigned local_ranks);

struct PoolPlanRequest {
  unsigned gpus = 1;                   ///< consumers (GPUs, or CPU workers)
  std::uint64_t batch_bytes = 0;       ///< one batch as it sits in host memory
  unsigned prefetch = 2;               ///< batches in flight per GPU
  unsigned local_ranks = 1;            ///< processes on this host sharing its memory
  std::uint64_t gpu_memory_bytes = 0;  ///< memory per GPU for the 2x rule; 0: unknown
  BudgetPolicy policy;
  void validate() const;  ///< ConfigError naming the field
};

/// does_not_fit: the pool would not fit in memory at all, pinned or not.
enum class Verdict { pin, pin_reduced, pageable, does_not_fit };
inline constexpr std::array<EnumWord<Verdict>, 4> kVerdictWords{{{Verdict::pin, "pin"},
                                                                 {Verdict::pin_reduced, "pin-reduced"},
                                                                 {Verdict::pageable, "pageable"},
                                                                 {Verdict::does_not_fit, "does-not-fit"}}};
std::string_view to_string(Verdict v) noexcept;

struct PoolPlan {
  std::uint64_t slot_bytes = 0;  ///< batch_bytes page-rounded
  unsigned slots_needed = 0;     ///< gpus * prefetch
  std::uint64_t need_bytes = 0;  ///< slot_bytes * slots_needed
  PinnedBudget budget;
  unsigned slots_fit = 0;     ///< whole slots the budget holds (capped at slots_needed)
  unsigned prefetch_fit = 0;  ///< slots_fit / gpus
  PoolFit fit;                ///< the pool against the really available memory
  Verdict verdict = Verdict::pageable;
  std::vector<std::string> reasons;  ///< plain-language explanation, most important first
  // Field rule of thumb: host RAM about twice the GPU memory in use.
  std::uint64_t gpu_memory_total = 0;  ///< gpus * gpu_memory_bytes; 0 when unknown
  bool rule_known = false;
  bool rule_met = false;
};

PoolPlan plan_pool(const MemorySnapshot& snapshot, const PoolPlanRequest& request);

}  // namespace pinfeed::memory
