#pragma once
// Where this process sits in a multi-process launch, read once from the
// launcher's variables. One reader for C++ (the trainer, the loader's memory
// budget, pinfeed-diag) and Python: ranks on one host share its memory and
// cores, so each must size itself as one of `local_size`.
#include <functional>
#include <string>

namespace pinfeed {

struct LaunchEnv {
  int rank = 0, world_size = 1;        ///< processes
  int local_rank = 0, local_size = 1;  ///< processes on this machine (device selection, memory and core shares)
  std::string launcher = "single";     ///< "single", "mpi" (OMPI_/PMI_), "torchrun" (RANK, WORLD_SIZE, ...), "slurm"
};

/// Reads, in this order, OpenMPI's OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,
/// LOCAL_SIZE}, PMI's PMI_RANK/PMI_SIZE/MPI_LOCALRANKID/MPI_LOCALNRANKS,
/// torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE, then an srun step's
/// SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID, with this node's tasks
/// from SLURM_STEP_TASKS_PER_NODE ("4(x2),3") at SLURM_NODEID. The batch
/// script itself (SLURM_STEP_ID batch) is one process, not a launch.
/// `getenv` is injectable for tests. Throws ConfigError on malformed values.
LaunchEnv read_launch_env(const std::function<const char*(const char*)>& getenv);
LaunchEnv read_launch_env();

}  // namespace pinfeed
