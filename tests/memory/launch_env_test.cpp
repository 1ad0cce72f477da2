// read_launch_env: where this process sits in a launch (OpenMPI, PMI,
// torchrun, an srun step), from variables given by a lookup function.
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>

#include "pinfeed/error.hpp"
#include "pinfeed/launch_env.hpp"

namespace pinfeed {
namespace {

using Vars = std::map<std::string, std::string>;

LaunchEnv env(Vars vars, std::optional<ProcessGroupView> group = std::nullopt) {
  return read_launch_env(
      [vars = std::move(vars)](const char* name) -> const char* {
        const auto it = vars.find(name);
        return it == vars.end() ? nullptr : it->second.c_str();
      },
      group);
}

std::string conflict(Vars vars, std::optional<ProcessGroupView> group = std::nullopt) {
  try {
    (void)env(std::move(vars), std::move(group));
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(LaunchEnvTest, ReadsTorchrunMpiPmiAndSlurmVariables) {
  EXPECT_EQ(env({}).launcher, "single");
  const auto mpi = env({{"OMPI_COMM_WORLD_RANK", "1"},
                        {"OMPI_COMM_WORLD_SIZE", "4"},
                        {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(mpi.launcher, "mpi");
  EXPECT_TRUE(mpi.mpi_launch());
  EXPECT_EQ(mpi.rank, 1);
  EXPECT_EQ(mpi.world_size, 4);
  EXPECT_EQ(mpi.local_rank, 1);
  EXPECT_EQ(mpi.local_size, 2);
  const auto pmi = env({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}, {"MPI_LOCALRANKID", "0"}, {"MPI_LOCALNRANKS", "1"}});
  EXPECT_EQ(pmi.launcher, "pmi");
  EXPECT_EQ(pmi.rank, 2);
  EXPECT_EQ(pmi.local_size, 1);
  const auto tr = env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}});
  EXPECT_EQ(tr.launcher, "torchrun");
  EXPECT_FALSE(tr.mpi_launch());
  EXPECT_EQ(tr.rank, 3);
  EXPECT_EQ(tr.local_rank, 1);
  EXPECT_THROW(env({{"RANK", "4"}, {"WORLD_SIZE", "4"}}), ConfigError);
  EXPECT_THROW(env({{"RANK", "x"}, {"WORLD_SIZE", "4"}}), ConfigError);
  // An srun step: this node's tasks from the step's layout.
  const auto srun = env({{"SLURM_STEP_ID", "0"},
                         {"SLURM_PROCID", "5"},
                         {"SLURM_STEP_NUM_TASKS", "7"},
                         {"SLURM_NODEID", "2"},
                         {"SLURM_LOCALID", "1"},
                         {"SLURM_STEP_TASKS_PER_NODE", "2(x2),3"}});
  EXPECT_EQ(srun.launcher, "slurm");
  EXPECT_EQ(srun.rank, 5);
  EXPECT_EQ(srun.world_size, 7);
  EXPECT_EQ(srun.local_rank, 1);
  EXPECT_EQ(srun.local_size, 3);
  // The batch script is one process, whatever SLURM_NTASKS says.
  EXPECT_EQ(env({{"SLURM_STEP_ID", "batch"}, {"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "8"}}).launcher, "single");
  EXPECT_EQ(env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}}).launcher, "single");
  EXPECT_THROW(env({{"SLURM_STEP_ID", "0"},
                    {"SLURM_PROCID", "0"},
                    {"SLURM_STEP_NUM_TASKS", "2"},
                    {"SLURM_STEP_TASKS_PER_NODE", "2(x"}}),
               ConfigError);
  try {  // the whole value is named, not what was left of it
    (void)env({{"SLURM_STEP_ID", "0"},
               {"SLURM_PROCID", "0"},
               {"SLURM_STEP_NUM_TASKS", "2"},
               {"SLURM_STEP_TASKS_PER_NODE", "abc"}});
    ADD_FAILURE() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("SLURM_STEP_TASKS_PER_NODE='abc'"), std::string::npos) << e.what();
  }
}

TEST(LaunchEnvTest, HalfALaunchIsAnErrorNamingTheMissingVariable) {
  // RANK without WORLD_SIZE was read as "rank 0 of 1": every process then
  // trains on the whole dataset.
  const std::string rank_only = conflict({{"RANK", "3"}});
  EXPECT_NE(rank_only.find("RANK=3 is set but WORLD_SIZE is not"), std::string::npos) << rank_only;
  const std::string size_only = conflict({{"WORLD_SIZE", "4"}});
  EXPECT_NE(size_only.find("WORLD_SIZE=4 is set but RANK is not"), std::string::npos) << size_only;
  EXPECT_NE(conflict({{"OMPI_COMM_WORLD_RANK", "1"}}).find("OMPI_COMM_WORLD_SIZE is not"), std::string::npos);
}

TEST(LaunchEnvTest, SourcesThatDisagreeAreAnErrorNamingBoth) {
  // Agreeing sources are fine: srun starting an MPI program sets both.
  const auto both = env({{"OMPI_COMM_WORLD_RANK", "1"},
                         {"OMPI_COMM_WORLD_SIZE", "2"},
                         {"SLURM_STEP_ID", "0"},
                         {"SLURM_PROCID", "1"},
                         {"SLURM_STEP_NUM_TASKS", "2"}});
  EXPECT_EQ(both.launcher, "mpi");
  // A stale RANK/WORLD_SIZE exported by hand under mpirun.
  const std::string stale =
      conflict({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}});
  EXPECT_NE(stale.find("RANK/WORLD_SIZE"), std::string::npos) << stale;
  EXPECT_NE(stale.find("OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE"), std::string::npos) << stale;
  EXPECT_NE(stale.find("rank 3 of 4"), std::string::npos) << stale;
  EXPECT_NE(stale.find("rank 1 of 4"), std::string::npos) << stale;
  EXPECT_NE(
      conflict({{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"}}),
      "no error");
  // An MPI launch whose world is larger than the srun step's tasks is one
  // the other way round: the step is 2 tasks, MPI claims 1 of 2 elsewhere.
  EXPECT_NE(conflict({{"SLURM_STEP_ID", "0"},
                      {"SLURM_PROCID", "0"},
                      {"SLURM_STEP_NUM_TASKS", "4"},
                      {"OMPI_COMM_WORLD_RANK", "1"},
                      {"OMPI_COMM_WORLD_SIZE", "2"}}),
            "no error");
}

TEST(LaunchEnvTest, TorchrunInsideSrunOrMpirunIgnoresTheOuterLaunch) {
  // srun --ntasks-per-node 1 torchrun --nnodes 2 --nproc_per_node 4: the
  // step is 2 tasks (one agent per node), torchrun's world is 8.
  const Vars srun_torchrun{{"RANK", "5"},
                           {"WORLD_SIZE", "8"},
                           {"LOCAL_RANK", "1"},
                           {"LOCAL_WORLD_SIZE", "4"},
                           {"TORCHELASTIC_RUN_ID", "job"},
                           {"SLURM_STEP_ID", "0"},
                           {"SLURM_PROCID", "1"},
                           {"SLURM_STEP_NUM_TASKS", "2"}};
  const auto e = env(srun_torchrun);
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.local_size, 4);
  // mpirun -np 2 torchrun --nproc_per_node 2.
  EXPECT_EQ(env({{"RANK", "3"},
                 {"WORLD_SIZE", "4"},
                 {"TORCHELASTIC_RUN_ID", "x"},
                 {"OMPI_COMM_WORLD_RANK", "1"},
                 {"OMPI_COMM_WORLD_SIZE", "2"}})
                .rank,
            3);
  // The same variables without torchrun's own marker are set by hand: a conflict.
  Vars by_hand = srun_torchrun;
  by_hand.erase("TORCHELASTIC_RUN_ID");
  EXPECT_NE(conflict(by_hand), "no error");
  // mpirun's daemons started by srun (one per node): the step is 2 tasks, MPI's world 8.
  EXPECT_EQ(env({{"OMPI_COMM_WORLD_RANK", "6"},
                 {"OMPI_COMM_WORLD_SIZE", "8"},
                 {"SLURM_STEP_ID", "0"},
                 {"SLURM_PROCID", "1"},
                 {"SLURM_STEP_NUM_TASKS", "2"}})
                .rank,
            6);
}

TEST(LaunchEnvTest, AnInitializedProcessGroupOutranksTheVariables) {
  ProcessGroupView group;
  group.rank = 1;
  group.world_size = 2;
  // Alone: rank and size from the group, no local information.
  const auto alone = env({}, group);
  EXPECT_EQ(alone.launcher, "torch.distributed");
  EXPECT_EQ(alone.rank, 1);
  EXPECT_EQ(alone.world_size, 2);
  EXPECT_EQ(alone.local_size, 1);
  // With torchrun's agreeing variables: their local rank and size.
  const auto tr = env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}}, group);
  EXPECT_EQ(tr.launcher, "torch.distributed");
  EXPECT_EQ(tr.local_rank, 1);
  EXPECT_EQ(tr.local_size, 2);
  // A group of another shape than the launch is an error naming both.
  const std::string why = conflict({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"}}, group);
  EXPECT_NE(why.find("torch.distributed is initialized as rank 1 of 2"), std::string::npos) << why;
  EXPECT_NE(why.find("OMPI_COMM_WORLD_RANK"), std::string::npos) << why;
  group.rank = 2;
  EXPECT_THROW(env({}, group), ConfigError);
}

TEST(LaunchEnvTest, LocalRankAndSizeComeFromAnAgreeingSourceThatHasThem) {
  // srun --mpi=pmi2: PMI_RANK/PMI_SIZE without MPI_LOCALRANKID; Slurm knows the node.
  const auto pmi2 = env({{"PMI_RANK", "3"},
                         {"PMI_SIZE", "4"},
                         {"SLURM_STEP_ID", "0"},
                         {"SLURM_PROCID", "3"},
                         {"SLURM_STEP_NUM_TASKS", "4"},
                         {"SLURM_NODEID", "1"},
                         {"SLURM_LOCALID", "1"},
                         {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}});
  EXPECT_EQ(pmi2.launcher, "pmi");
  EXPECT_EQ(pmi2.rank, 3);
  EXPECT_EQ(pmi2.local_rank, 1);
  EXPECT_EQ(pmi2.local_size, 2);
  // Without Slurm: one node of PMI_SIZE ranks.
  const auto alone = env({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}});
  EXPECT_EQ(alone.local_rank, 3);
  EXPECT_EQ(alone.local_size, 4);
}

TEST(LaunchEnvTest, RankExportedByHandUnderMpirunStaysAnMpiLaunch) {
  // A job script's `export RANK=$OMPI_COMM_WORLD_RANK WORLD_SIZE=...`: no
  // TORCHELASTIC_RUN_ID, so MPI (which agrees) decides and MPI bootstraps.
  const auto e = env({{"RANK", "1"},
                      {"WORLD_SIZE", "2"},
                      {"OMPI_COMM_WORLD_RANK", "1"},
                      {"OMPI_COMM_WORLD_SIZE", "2"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(e.launcher, "mpi");
  EXPECT_TRUE(e.mpi_launch());
  EXPECT_EQ(e.local_size, 2);
  // torchrun's own workers stay torchrun's even when MPI's numbers agree.
  const auto tr = env({{"RANK", "1"},
                       {"WORLD_SIZE", "2"},
                       {"TORCHELASTIC_RUN_ID", "r"},
                       {"OMPI_COMM_WORLD_RANK", "1"},
                       {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_EQ(tr.launcher, "torchrun");
  EXPECT_FALSE(tr.mpi_launch());
}

TEST(LaunchEnvTest, TorchrunWorkersIgnoreAnOuterLaunchOfTheSameSize) {
  // srun -N2 --ntasks-per-node 2 torchrun --nproc_per_node 1 --nnodes 4:
  // four agents, four workers, but torchrun numbers them its own way.
  const auto e = env({{"RANK", "2"},
                      {"WORLD_SIZE", "4"},
                      {"LOCAL_RANK", "0"},
                      {"LOCAL_WORLD_SIZE", "1"},
                      {"TORCHELASTIC_RUN_ID", "job"},
                      {"SLURM_STEP_ID", "0"},
                      {"SLURM_PROCID", "1"},
                      {"SLURM_STEP_NUM_TASKS", "4"}});
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.local_size, 1);
}

TEST(LaunchEnvTest, TorchrunWorkersRefuseAnOuterLaunchOfMoreProcesses) {
  // mpirun -np 4 torchrun --standalone --nproc-per-node 1: four torchrun
  // jobs of one process each, every one reading the whole dataset.
  const std::string why = conflict({{"RANK", "0"},
                                    {"WORLD_SIZE", "1"},
                                    {"TORCHELASTIC_RUN_ID", "job"},
                                    {"OMPI_COMM_WORLD_RANK", "2"},
                                    {"OMPI_COMM_WORLD_SIZE", "4"}});
  EXPECT_NE(why.find("torchrun (RANK/WORLD_SIZE) says rank 0 of 1"), std::string::npos) << why;
  EXPECT_NE(why.find("OMPI_COMM_WORLD_RANK"), std::string::npos) << why;
}

TEST(LaunchEnvTest, AProcessGroupLargerThanAnOuterSlurmStepIsTheLaunch) {
  // One process per node from srun (2 nodes), each starting 4 that form a
  // group of 8: consecutive ranks on a node, 4 per node.
  ProcessGroupView group;
  group.rank = 5;
  group.world_size = 8;
  const Vars step{{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "1"}, {"SLURM_STEP_NUM_TASKS", "2"}};
  const auto e = env(step, group);
  EXPECT_EQ(e.launcher, "torch.distributed");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_size, 4);
  // The starting script's LOCAL_RANK/LOCAL_WORLD_SIZE win over the guess.
  Vars with_local = step;
  with_local["LOCAL_RANK"] = "0";
  with_local["LOCAL_WORLD_SIZE"] = "2";
  const auto named = env(with_local, group);
  EXPECT_EQ(named.local_rank, 0);
  EXPECT_EQ(named.local_size, 2);
  // A group that does not split evenly over the step's processes: ask.
  group.world_size = 7;
  group.rank = 3;
  const std::string why = conflict(step, group);
  EXPECT_NE(why.find("LOCAL_WORLD_SIZE"), std::string::npos) << why;
  group.world_size = 8;
  // A smaller group than the launch is still a conflict.
  group.rank = 0;
  group.world_size = 2;
  EXPECT_NE(conflict({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "1"}, {"SLURM_STEP_NUM_TASKS", "4"}}, group),
            "no error");
}

}  // namespace
}  // namespace pinfeed
