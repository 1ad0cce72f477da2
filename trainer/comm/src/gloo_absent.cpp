// Built without Gloo (libgloo-dev missing or PINFEED_GLOO=OFF).
#include <fmt/format.h>

#include "pinfeed/trainer/communicator.hpp"

namespace pinfeed::trainer {

bool gloo_compiled() noexcept { return false; }

std::unique_ptr<Communicator> make_gloo_communicator(DeviceBackend& /*backend*/, const LaunchEnv& env,
                                                     CommConfig /*config*/) {
  throw ConfigError(
      fmt::format("{} launched {} processes, but this pinfeed was built without Gloo, which CPU ranks "
                  "need outside mpirun (install libgloo-dev and rebuild, or launch with mpirun)",
                  env.launcher, env.world_size));
}

}  // namespace pinfeed::trainer
