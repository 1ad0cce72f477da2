#pragma once
// The diagnostics report behind `pinfeed-diag --json`, the C ABI's
// pinfeed_diag_json() and Python's pinfeed.diag(): host memory, swap, PSI,
// cgroup limits, memlock, NUMA, GPUs, who holds locked memory, and — when a
// batch is given — the pinned pool plan with its verdict and reasons.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "pinfeed/memory/memory_snapshot.hpp"
#include "pinfeed/memory/pool_plan.hpp"
#include "pinfeed/memory/pressure_monitor.hpp"

namespace pinfeed::memory {

struct DiagnosticsRequest {
  std::string root = "/";              ///< read proc/ and sys/ under this folder
  unsigned gpus = 1;                   ///< consumers the pool feeds
  std::uint64_t batch_bytes = 0;       ///< one batch in host memory; or:
  std::string batch_shape;             ///< "256x3x224x224:u8" (no plan when both are empty)
  unsigned prefetch = 2;               ///< batches in flight per GPU
  unsigned local_ranks = 0;            ///< processes on this host sharing its memory; 0: from the launcher's variables
  double fraction = 0.5;               ///< share of the really available memory pinning may take
  std::uint64_t reserve_bytes = 0;     ///< kept free before the fraction applies
  std::string pin_method = "auto";     ///< auto, mlock, cuda
  std::uint64_t gpu_memory_bytes = 0;  ///< per GPU, for the 2x rule (0: GPU 0's)
  unsigned sample_ms = 250;            ///< window for swap rates (live root only; 0: none)
};

/// The plan request the diagnostics size, or nullopt without a batch.
/// Throws ConfigError naming the bad field.
std::optional<PoolPlanRequest> diagnostics_plan_request(const DiagnosticsRequest& request);
/// The report part of the JSON (no plan).
nlohmann::ordered_json diagnostics_report_json(const std::string& root, const MemorySnapshot& snapshot,
                                               const std::optional<PressureReading>& activity);
nlohmann::ordered_json pool_plan_json(const PoolPlanRequest& request, const PoolPlan& plan);
/// Reads the host (sampling swap rates for `sample_ms`), plans, and returns
/// the whole report as indented JSON. Throws ConfigError / DataError.
std::string diagnostics_json(const DiagnosticsRequest& request);

}  // namespace pinfeed::memory
