#pragma once
// Communicator: the collectives data-parallel training needs, run in place on
// a stream of the rank's backend, so they overlap with compute exactly as the
// backend's streams do.
//
//   SoloCommunicator    "solo": one rank in all, collectives are identities.
//   ThreadCommunicator  "threads": CPU ranks as threads of one process
//                       (make_thread_group). Reduces in rank order: results
//                       do not depend on the chunking or on which thread
//                       finished first.
//   MpiCommunicator     "mpi": one CPU rank per process under mpirun or srun.
//   GlooCommunicator    "gloo": one CPU rank per process under torchrun, over
//                       TCP, meeting through the rendezvous store.
//   NcclCommunicator    "nccl": GPUs, one communicator per device, made
//                       together in one process (ncclCommInitAll) or one per
//                       process with the unique id sent over the launch's
//                       bootstrap (nccl_communicator.hpp).
//
// Which one a launched process uses is one table, launch_bootstraps(): the
// launcher decides the bootstrap, the bootstrap the CPU communicator (and
// how NCCL's unique id travels). tests/trainer/communicator_test.cpp holds
// every communicator to the same contract (a typed test).
//
// Every rank must issue the same collectives, in the same order, with the
// same sizes; the thread communicator checks this and fails loudly. A
// collective that does not complete within the configured timeout is
// reported as a CommError naming the ranks that did not arrive, and the
// group is aborted, so no rank hangs forever.
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/launch_env.hpp"
#include "pinfeed/trainer/comm_error.hpp"
#include "pinfeed/trainer/device_backend.hpp"

namespace pinfeed::trainer {

class CpuBackend;

enum class ReduceOp { sum, average };

struct CommConfig {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  ///< a collective not done by then is an error
};

class Communicator {
 public:
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  virtual ~Communicator() = default;

  [[nodiscard]] virtual int rank() const noexcept = 0;
  [[nodiscard]] virtual int size() const noexcept = 0;
  [[nodiscard]] virtual std::string name() const = 0;  ///< "threads", "mpi", "nccl"

  /// In place over `count` floats of device memory, enqueued on `s`.
  virtual void all_reduce(Stream& s, float* data, std::size_t count, ReduceOp op) = 0;
  /// Root's `count` floats to every rank, enqueued on `s`.
  virtual void broadcast(Stream& s, float* data, std::size_t count, int root) = 0;
  /// Blocks the calling host thread until every rank has called it.
  virtual void barrier() = 0;
  /// A rank failed: makes every pending and later collective of the group
  /// fail instead of waiting. Idempotent; never throws.
  virtual void abort(const std::string& why) noexcept = 0;
};

/// A world of one rank ("solo"): every collective is an identity, nothing is
/// enqueued, and no library is needed (one GPU trains without NCCL). After
/// abort(), collectives throw CommError like any other communicator's.
std::unique_ptr<Communicator> make_solo_communicator();

/// `backends.size()` communicators, rank i driving backends[i]: one per CPU
/// rank thread of this process. ConfigError unless every backend is a CPU one.
std::vector<std::unique_ptr<Communicator>> make_thread_group(const std::vector<DeviceBackend*>& backends,
                                                             CommConfig config = {});

// Where this process sits in a launch: one reader for the whole project.
using pinfeed::LaunchEnv;
using pinfeed::read_launch_env;

/// True when pinfeed was built with Gloo.
bool gloo_compiled() noexcept;
/// The CPU communicator of a process launched by torchrun (no MPI): Gloo
/// over TCP, the ranks meeting through torchrun's rendezvous store
/// (MASTER_ADDR:MASTER_PORT). abort() ends the process, so that the other
/// ranks' collectives fail at once. Throws ConfigError when built without
/// Gloo or when the store's variables are missing.
std::unique_ptr<Communicator> make_gloo_communicator(DeviceBackend& backend, const LaunchEnv& env,
                                                     CommConfig config = {});

/// True when pinfeed was built with MPI.
bool mpi_compiled() noexcept;
/// The CPU communicator of a process launched by mpirun: initializes MPI
/// (once; finalized at exit), rank and size from MPI_COMM_WORLD. Throws
/// ConfigError when built without MPI.
std::unique_ptr<Communicator> make_mpi_communicator(DeviceBackend& backend, CommConfig config = {});

/// How the ranks of a multi-process launch find each other.
enum class Bootstrap { mpi, store };
class LaunchChannel;  // launch_channel.hpp

/// The LaunchChannel of an mpirun/srun launch: MPI initialized (once), rank
/// and size from MPI_COMM_WORLD. ConfigError on a build without MPI. Here,
/// not in launch/, because MPI lives in comm/ (mpi_communicator.cpp).
std::unique_ptr<LaunchChannel> open_mpi_channel(const LaunchEnv& env, std::chrono::milliseconds timeout);

/// One row per bootstrap, tried in order: the first that serves a launch
/// is the one its ranks use (every rank reads the same environment, so all
/// choose the same row).
struct LaunchBootstrap {
  Bootstrap kind;
  std::string_view name;              ///< "mpi", "store"
  std::string_view cpu_communicator;  ///< what a CPU rank over it is: Communicator::name()
  std::string_view how;               ///< for messages and --version
  bool (*compiled)() noexcept;        ///< the CPU communicator is in this build
  bool (*serves)(const LaunchEnv& env);
  /// The CPU rank's communicator (throws ConfigError when not compiled).
  std::unique_ptr<Communicator> (*make_cpu)(DeviceBackend& backend, CommConfig config, const LaunchEnv& env);
  /// The launch's channel, for a communicator with its own transport (NCCL
  /// shares its unique id through it): include/pinfeed/trainer/launch_channel.hpp.
  std::unique_ptr<LaunchChannel> (*open_channel)(const LaunchEnv& env, std::chrono::milliseconds timeout);
};
std::span<const LaunchBootstrap> launch_bootstraps() noexcept;
/// The row `env`'s launch uses.
const LaunchBootstrap& launch_bootstrap(const LaunchEnv& env);

/// The communicators of one device kind: the comm half of a DeviceType
/// (device_type.hpp), kept here so that devices do not depend on
/// communicators. CPU: threads in one process, the launch's bootstrap
/// (Gloo or MPI) across processes; CUDA: NCCL (nccl_communicator.hpp).
struct CommType {
  BackendKind kind = BackendKind::cpu;
  /// One communicator per backend of this process, rank i driving backends[i].
  std::vector<std::unique_ptr<Communicator>> (*make_group)(const std::vector<DeviceBackend*>& backends,
                                                           CommConfig config) = nullptr;
  /// This process's rank in a multi-process launch (mpirun, srun, torchrun).
  std::unique_ptr<Communicator> (*make_launched)(DeviceBackend& backend, CommConfig config,
                                                 const LaunchEnv& env) = nullptr;
};

/// The communicators for backends of `kind` (comm_type.cpp).
const CommType& comm_type(BackendKind kind);

}  // namespace pinfeed::trainer
