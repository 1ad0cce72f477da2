// read_launch_env: where this process sits in a launch (OpenMPI, PMI,
// torchrun, an srun step), from variables given by a lookup function.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "pinfeed/error.hpp"
#include "pinfeed/launch_env.hpp"

namespace pinfeed {
namespace {

TEST(LaunchEnvTest, ReadsMpiThenTorchrunVariables) {
  const auto env = [](std::map<std::string, std::string> vars) {
    return read_launch_env([vars = std::move(vars)](const char* name) -> const char* {
      const auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    });
  };
  EXPECT_EQ(env({}).launcher, "single");
  const auto mpi = env({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"RANK", "3"}, {"WORLD_SIZE", "4"}});
  EXPECT_EQ(mpi.launcher, "mpi");
  EXPECT_EQ(mpi.rank, 1);
  EXPECT_EQ(mpi.local_size, 2);
  const auto tr = env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}});
  EXPECT_EQ(tr.launcher, "torchrun");
  EXPECT_EQ(tr.rank, 3);
  EXPECT_EQ(tr.local_rank, 1);
  EXPECT_THROW(env({{"RANK", "4"}, {"WORLD_SIZE", "4"}}), ConfigError);
  EXPECT_THROW(env({{"RANK", "x"}, {"WORLD_SIZE", "4"}}), ConfigError);
  // An srun step: this node's tasks from the step's layout.
  const auto srun = env({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "5"}, {"SLURM_STEP_NUM_TASKS", "7"}, {"SLURM_NODEID", "2"},
                         {"SLURM_LOCALID", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "2(x2),3"}});
  EXPECT_EQ(srun.launcher, "slurm");
  EXPECT_EQ(srun.rank, 5);
  EXPECT_EQ(srun.world_size, 7);
  EXPECT_EQ(srun.local_rank, 1);
  EXPECT_EQ(srun.local_size, 3);
  // The batch script is one process, whatever SLURM_NTASKS says.
  EXPECT_EQ(env({{"SLURM_STEP_ID", "batch"}, {"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "8"}}).launcher, "single");
  EXPECT_EQ(env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}}).launcher, "single");
  EXPECT_THROW(env({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "2"},
                    {"SLURM_STEP_TASKS_PER_NODE", "2(x"}}),
               ConfigError);
}

}  // namespace
}  // namespace pinfeed
