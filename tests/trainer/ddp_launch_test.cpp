// DDP across processes: run by ctest as `mpirun -np 2 ddp_launch_test`
// (MPI all-reduce) and as `torchrun --nproc_per_node 2 ddp_launch_test`
// (Gloo over torchrun's rendezvous store, no MPI). Two processes, one CPU
// worker each; rank 0 then trains the same job with two worker threads in
// one process and compares the weights.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "fixtures.hpp"
#include "image_fixtures.hpp"
#include "pinfeed/trainer/trainer.hpp"
#include "train_fixtures.hpp"

namespace pinfeed::trainer {
namespace {

TEST(DdpLaunchTest, TwoProcessesReachTheWeightsOfTwoThreads) {
  const LaunchEnv env = read_launch_env();
  // ctest launches it and says under what: there, another launch is a failure.
  const char* expected = std::getenv("PINFEED_REQUIRE_LAUNCHER");
  if (expected == nullptr && env.world_size != 2)
    GTEST_SKIP() << "run under mpirun or torchrun with 2 processes (ctest does)";
  ASSERT_EQ(env.world_size, 2) << "expected 2 processes under " << (expected ? expected : "a launcher");
  if (expected != nullptr) {
    ASSERT_EQ(env.launcher, expected);
  }
  const std::string communicator(launch_bootstrap(env).cpu_communicator);  // the rule train() follows
  // Each rank writes the same deterministic dataset into its own folder.
  testing::TempDir dir;
  const auto data = testing::make_small_dataset(dir.path(), 4, 16);
  TrainConfig c = testing::tiny_train_config(data.folder.string(), "cpu:1");
  c.loader.threads = 1;
  c.launch.reset();  // ranks from the launcher
  const TrainResult mpi = train(c);
  EXPECT_EQ(mpi.communicator, communicator);
  EXPECT_EQ(mpi.world_size, 2);
  EXPECT_EQ(mpi.rank, env.rank);
  if (env.rank != 0) return;

  c.devices = parse_devices("cpu:2");
  c.launch = LaunchEnv{};  // this process alone, two threads
  const TrainResult threads = train(c);
  ASSERT_EQ(threads.weights.size(), mpi.weights.size());
  EXPECT_LE(testing::relative_difference(mpi.weights, threads.weights), 1e-5);
  EXPECT_NEAR(mpi.epochs.back().loss, threads.epochs.back().loss, 1e-5);
}

}  // namespace
}  // namespace pinfeed::trainer
