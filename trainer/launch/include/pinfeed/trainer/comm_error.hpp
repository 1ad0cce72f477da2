#pragma once
// The error of a collective or of the rendezvous it needs, and the words of a
// timeout: shared by the communicators and the launch plane (the store), so
// that the store does not depend on the communicators.
#include <chrono>
#include <cstddef>
#include <string>

#include "pinfeed/error.hpp"

namespace pinfeed::trainer {

/// A collective failed: which rank, which operation, how many bytes.
class CommError : public Error {
 public:
  CommError(int rank, std::string op, std::size_t bytes, const std::string& reason);
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] const std::string& op() const noexcept { return op_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

 private:
  int rank_;
  std::string op_;
  std::size_t bytes_;
};

/// Every communicator's words for a collective past its timeout: "did not
/// complete within 4 s: a rank stopped, hung or was lost" (ms when the
/// timeout is not whole seconds).
std::string timeout_reason(std::chrono::milliseconds timeout);

}  // namespace pinfeed::trainer
