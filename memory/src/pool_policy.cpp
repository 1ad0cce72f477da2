#include "pinfeed/memory/pool_policy.hpp"

#include <fmt/format.h>

#include "pinfeed/units.hpp"

namespace pinfeed::memory {

std::optional<std::string> regrow_refusal(std::uint64_t total, std::uint64_t available, std::uint64_t bytes,
                                          double keep_fraction) {
  const double after =
      total == 0 || available < bytes ? 0.0 : static_cast<double>(available - bytes) / static_cast<double>(total);
  if (after > keep_fraction) return std::nullopt;
  return fmt::format("{} available of {}: {:.1f}% after {} more, not above {:.1f}%", format_bytes(available),
                     format_bytes(total), after * 100, format_bytes(bytes), keep_fraction * 100);
}

}  // namespace pinfeed::memory
