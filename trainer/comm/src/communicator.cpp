// What every communicator shares: the launch bootstraps (how a rank
// launched by mpirun, srun or torchrun finds its peers), one table for the
// CPU communicators and NCCL alike.
#include <fmt/format.h>

#include <array>
#include <cstdlib>
#include <utility>

#include "pinfeed/env.hpp"
#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/launch_channel.hpp"

namespace pinfeed::trainer {

namespace {

bool store_named() { return pinfeed::env::get("MASTER_ADDR") && pinfeed::env::get("MASTER_PORT"); }

/// mpirun and srun launches, except on a build without MPI (the wheel) when
/// MASTER_ADDR and MASTER_PORT name a store to use instead (srun with them
/// exported). Without either, MPI's row explains that MPI is missing.
bool mpi_serves(const LaunchEnv& env) { return env.mpi_launch() && (mpi_compiled() || !store_named()); }
bool store_serves(const LaunchEnv& /*env*/) { return true; }

std::unique_ptr<Communicator> make_mpi_launched(DeviceBackend& backend, CommConfig config, const LaunchEnv& /*env*/) {
  return make_mpi_communicator(backend, config);
}
std::unique_ptr<Communicator> make_gloo_launched(DeviceBackend& backend, CommConfig config, const LaunchEnv& env) {
  return make_gloo_communicator(backend, env, config);
}

constexpr std::array<LaunchBootstrap, 2> kBootstraps{{
    {Bootstrap::mpi, "mpi", "mpi", "MPI_COMM_WORLD (mpirun, or srun of a build with MPI)", &mpi_compiled, &mpi_serves,
     &make_mpi_launched, &open_mpi_channel},
    {Bootstrap::store, "store", "gloo", "the rendezvous store at MASTER_ADDR:MASTER_PORT (torchrun)", &gloo_compiled,
     &store_serves, &make_gloo_launched, &open_store_channel},
}};

}  // namespace

std::span<const LaunchBootstrap> launch_bootstraps() noexcept { return kBootstraps; }

const LaunchBootstrap& launch_bootstrap(const LaunchEnv& env) {
  for (const LaunchBootstrap& b : kBootstraps) {
    if (b.serves(env)) return b;
  }
  return kBootstraps.back();  // the store's row serves every launch: not reached
}

}  // namespace pinfeed::trainer
