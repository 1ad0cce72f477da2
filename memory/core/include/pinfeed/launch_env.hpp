#pragma once
// Where this process sits in a multi-process launch, read once from the
// launcher's variables. One reader for C++ (the trainer, the loader's memory
// budget and threads, pinfeed-diag) and Python (which adds torch.distributed):
// ranks on one host share its memory and cores, so each must size itself as
// one of `local_size`.
#include <functional>
#include <optional>
#include <string>

namespace pinfeed {

struct LaunchEnv {
  int rank = 0, world_size = 1;        ///< processes
  int local_rank = 0, local_size = 1;  ///< processes on this machine (device selection, memory and core shares)
  /// "single", "torch.distributed", "torchrun" (RANK, WORLD_SIZE, ...), "mpi"
  /// (OMPI_COMM_WORLD_*), "pmi" (PMI_*, MPICH and Intel MPI), "slurm" (an srun step).
  std::string launcher = "single";
  /// The variables it came from, for messages ("RANK/WORLD_SIZE").
  std::string source;
  /// True when launched by mpirun, mpiexec or srun, so MPI_Init can find its
  /// peers (the MPI communicator); false for torchrun (its rendezvous store).
  [[nodiscard]] bool mpi_launch() const noexcept {
    return launcher == "mpi" || launcher == "pmi" || launcher == "slurm";
  }
};

/// A process group that is already up (Python's torch.distributed): it
/// outranks every variable.
struct ProcessGroupView {
  int rank = 0, world_size = 1;
  std::string name = "torch.distributed";
};

/// Reads, in this order: an initialized process group (`group`), torchrun's
/// RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE, OpenMPI's
/// OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}, PMI's
/// PMI_RANK/PMI_SIZE/MPI_LOCALRANKID/MPI_LOCALNRANKS, then an srun step's
/// SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID, with this node's tasks
/// from SLURM_STEP_TASKS_PER_NODE ("4(x2),3") at SLURM_NODEID. The batch
/// script itself (SLURM_STEP_ID batch) is one process, not a launch.
///
/// The first source found decides. Every other source present must agree
/// with it on rank and world size, or ConfigError names both, except:
///  - torchrun's workers (TORCHELASTIC_RUN_ID, which only torchrun's agent
///    sets): torchrun decides and every other source is the launch that
///    started the agents (srun or mpirun, once per node or not); ignored,
///    unless it has more processes than torchrun's (then ConfigError).
///  - mpirun's daemons started by srun: the step's smaller world is ignored.
///  - RANK/WORLD_SIZE without TORCHELASTIC_RUN_ID were set by hand or by a
///    script; when MPI, PMI or Slurm agrees with them, that launcher decides
///    (an mpirun launch stays an MPI launch).
/// Local rank and size come from the deciding source, or, when it has none
/// (srun --mpi=pmi2 sets no MPI_LOCALRANKID), from an agreeing source that
/// has them; failing both, rank of world on one node. An initialized
/// process group outranks the variables: those that agree with it give the
/// local rank and size; an MPI or Slurm launch of fewer processes than the
/// group is an outer launch (one process per node that started the group's):
/// the local rank and size are LOCAL_RANK/LOCAL_WORLD_SIZE when set, else
/// the group split evenly over the outer processes with consecutive ranks
/// on a node (ConfigError when it does not divide).
///
/// `getenv` is injectable for tests. Throws ConfigError on malformed values.
LaunchEnv read_launch_env(const std::function<const char*(const char*)>& getenv,
                          const std::optional<ProcessGroupView>& group = std::nullopt);
LaunchEnv read_launch_env();

}  // namespace pinfeed
