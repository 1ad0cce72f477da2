#pragma once
// Learning rate: the linear scaling rule (Goyal et al.: lr = base_lr x global
// batch / 256), a linear warm-up from base/warmup to the peak, then cosine
// decay to zero at the last step.
#include <cstdint>

namespace pinfeed::trainer {

struct LrSchedule {
  double base_lr = 0.1;  ///< per 256 samples
  std::uint64_t global_batch = 256;
  std::uint64_t warmup_steps = 0;
  std::uint64_t total_steps = 1;

  [[nodiscard]] double peak() const noexcept;
  /// The rate for optimizer step `step` (0-based).
  [[nodiscard]] double at(std::uint64_t step) const noexcept;
};

}  // namespace pinfeed::trainer
