#include "pinfeed/trainer/comm_error.hpp"

#include <fmt/format.h>

#include <utility>

namespace pinfeed::trainer {

CommError::CommError(int rank, std::string op, std::size_t bytes, const std::string& reason)
    : Error(fmt::format("rank {}: {} of {} bytes failed: {}", rank, op, bytes, reason)),
      rank_(rank),
      op_(std::move(op)),
      bytes_(bytes) {}

std::string timeout_reason(std::chrono::milliseconds timeout) {
  const auto n = timeout.count();
  return fmt::format("did not complete within {}: a rank stopped, hung or was lost",
                     n % 1000 == 0 ? fmt::format("{} s", n / 1000) : fmt::format("{} ms", n));
}

}  // namespace pinfeed::trainer
