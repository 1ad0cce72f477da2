// The communicators of each device kind (communicator.hpp, CommType): the
// comm half of the device registry, so that device types need no
// communicator.
#include "pinfeed/error.hpp"
#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/nccl_communicator.hpp"

namespace pinfeed::trainer {

namespace {
/// The launch's bootstrap decides (launch_bootstraps()).
std::unique_ptr<Communicator> make_cpu_launched(DeviceBackend& backend, CommConfig config, const LaunchEnv& env) {
  return launch_bootstrap(env).make_cpu(backend, config, env);
}
}  // namespace

const CommType& comm_type(BackendKind kind) {
  static const CommType cpu{BackendKind::cpu, &make_thread_group, &make_cpu_launched};
  static const CommType cuda{BackendKind::cuda, &make_nccl_group, &make_nccl_communicator_launched};
  // No default: a new BackendKind is a -Wswitch error here until it names
  // its communicators, never the CPU ones by omission.
  switch (kind) {
    case BackendKind::cpu: return cpu;
    case BackendKind::cuda: return cuda;
  }
  throw ConfigError("comm_type: unknown backend kind");
}

}  // namespace pinfeed::trainer
