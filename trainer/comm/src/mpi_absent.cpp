#include <fmt/format.h>

#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/launch_channel.hpp"

namespace pinfeed::trainer {

bool mpi_compiled() noexcept { return false; }

std::unique_ptr<Communicator> make_mpi_communicator(DeviceBackend& /*backend*/, CommConfig /*config*/) {
  throw ConfigError("this pinfeed was built without MPI (install libopenmpi-dev and rebuild)");
}

std::unique_ptr<LaunchChannel> open_mpi_channel(const LaunchEnv& env, std::chrono::milliseconds /*timeout*/) {
  throw ConfigError(
      fmt::format("{} launched {} processes, but this pinfeed was built without MPI (launch with "
                  "torchrun, or rebuild with libopenmpi-dev)",
                  env.launcher, env.world_size));
}

}  // namespace pinfeed::trainer
