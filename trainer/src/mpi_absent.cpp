#include "pinfeed/trainer/communicator.hpp"

namespace pinfeed::trainer {

bool mpi_compiled() noexcept { return false; }

std::unique_ptr<Communicator> make_mpi_communicator(DeviceBackend& /*backend*/, CommConfig /*config*/) {
  throw ConfigError("this pinfeed was built without MPI (install libopenmpi-dev and rebuild)");
}

}  // namespace pinfeed::trainer
