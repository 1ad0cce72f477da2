#include "pinfeed/trainer/schedule.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace pinfeed::trainer {

double LrSchedule::peak() const noexcept { return base_lr * static_cast<double>(global_batch) / 256.0; }

double LrSchedule::at(std::uint64_t step) const noexcept {
  const double top = peak();
  if (step < warmup_steps) return top * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  const std::uint64_t decay = total_steps > warmup_steps ? total_steps - warmup_steps : 1;
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(decay));
  return top * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace pinfeed::trainer
