#pragma once
// LaunchChannel: what a launched rank has of its peers before any
// communicator exists, for a communicator that brings its own transport
// (NCCL): the rank and world the launch gave it, rank 0's bytes shared with
// every rank (NCCL's unique id), and a way to end every process of the
// launch after a fatal error. Each LaunchBootstrap row (communicator.hpp)
// opens its own: MPI_COMM_WORLD (mpi_communicator.cpp; mpi_absent.cpp says
// MPI is missing) and torchrun's rendezvous store (tcp_store.cpp). A new
// bootstrap is a row and a channel; the NCCL code does not change. The MPI
// channel is declared in communicator.hpp and defined beside the MPI
// communicator (comm/), which initializes MPI for both.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "pinfeed/launch_env.hpp"

namespace pinfeed::trainer {

class LaunchChannel {
 public:
  virtual ~LaunchChannel() = default;
  [[nodiscard]] virtual int rank() const noexcept = 0;
  [[nodiscard]] virtual int size() const noexcept = 0;
  /// Every rank gets rank 0's `bytes` (the others pass nothing); `key` names
  /// them where the channel is a store. CommError on failure or timeout.
  virtual std::vector<char> share_from_rank0(const std::string& key, const std::vector<char>& bytes) = 0;
  /// Ends every process of the launch: MPI_Abort; under torchrun, this
  /// process exits and torchrun ends the rest.
  [[noreturn]] virtual void end_launch(const std::string& why) noexcept = 0;
};

/// The channel of a torchrun launch: its rendezvous store (connect_launch_store).
std::unique_ptr<LaunchChannel> open_store_channel(const LaunchEnv& env, std::chrono::milliseconds timeout);

}  // namespace pinfeed::trainer
