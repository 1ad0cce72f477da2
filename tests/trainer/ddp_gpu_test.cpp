// GPU training (label gpu; bench/gpu_check.sh runs it where a GPU exists):
// the CUDA backend with NCCL over every visible GPU must train the model to
// the CPU backend's weights, within float tolerance (cuBLAS and OpenBLAS sum
// in different orders).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "fixtures.hpp"
#include "image_fixtures.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/cuda_backend.hpp"
#include "pinfeed/trainer/model.hpp"
#include "pinfeed/trainer/nccl_communicator.hpp"
#include "pinfeed/trainer/trainer.hpp"
#include "train_fixtures.hpp"

namespace pinfeed::trainer {
namespace {

TEST(DdpGpuTest, CudaWorkersWithNcclMatchTheCpuBackend) {
  const int gpus = cuda_device_count();
  if (gpus == 0) GTEST_SKIP() << "no CUDA device on this machine";
  if (gpus >= 2 && !nccl_available()) GTEST_SKIP() << "NCCL (libnccl.so.2) cannot be loaded";
  testing::TempDir dir;
  const auto data = testing::make_small_dataset(dir.path(), 4, 16);
  const int workers = gpus >= 2 ? 2 : 1;
  TrainConfig c = testing::tiny_train_config(data.folder.string(), workers == 2 ? "cuda:0,1" : "cuda:0");
  const TrainResult gpu = train(c);
  EXPECT_EQ(gpu.communicator, workers == 2 ? "nccl" : "solo") << "one GPU needs no NCCL";
  c.devices = parse_devices(fmt::format("cpu:{}", workers));
  const TrainResult cpu = train(c);
  EXPECT_LE(testing::relative_difference(gpu.weights, cpu.weights), 1e-4);
  EXPECT_GT(gpu.epochs.back().pinned_batches, 0U) << "slots registered with CUDA are pinned";
}

TEST(DdpGpuTest, TheCnnWithSyncBnOnGpusMatchesOneCpuWorker) {
  // The CUDA kernels of the CNN (im2col, col2im, BatchNorm, pooling) end to
  // end, and SyncBN's statistics over NCCL with 2 GPUs: the weights of one
  // CPU worker with the whole batch, within float tolerance.
  const int gpus = cuda_device_count();
  if (gpus == 0) GTEST_SKIP() << "no CUDA device on this machine";
  if (gpus >= 2 && !nccl_available()) GTEST_SKIP() << "NCCL (libnccl.so.2) cannot be loaded";
  testing::TempDir dir;
  const auto data = testing::make_small_dataset(dir.path(), 4, 16);
  TrainConfig c = testing::tiny_train_config(data.folder.string(), gpus >= 2 ? "cuda:0,1" : "cuda:0");
  c.model.kind = ModelKind::cnn;
  c.model.channels = {4, 8};
  c.model.sync_bn = true;
  c.lr = 0.4;
  const TrainResult gpu = train(c);
  c.devices = parse_devices("cpu:1");
  const TrainResult cpu = train(c);
  EXPECT_LE(testing::relative_difference(gpu.weights, cpu.weights), 1e-3) << gpu.world_size << " GPU(s)";
  EXPECT_NEAR(gpu.epochs.back().loss, cpu.epochs.back().loss, 1e-3);
}

// One GPU exercises NCCL nowhere else (one worker trains with the solo
// communicator): a one-rank NCCL communicator is legal, and every call of
// ours on it must work, then abort must fail later calls, and destroying an
// aborted one must not hang. On a GPU host NCCL must load: no skip.
TEST(NcclGpuTest, AOneRankCommunicatorReducesBroadcastsWaitsAndAborts) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  ASSERT_TRUE(nccl_available()) << "NCCL (libnccl.so.2) cannot be loaded: put its folder on LD_LIBRARY_PATH";
  auto backend = make_cuda_backend(0);
  auto comms = make_nccl_group({backend.get()});
  ASSERT_EQ(comms.size(), 1U);
  Communicator& comm = *comms[0];
  EXPECT_EQ(comm.name(), "nccl");
  EXPECT_EQ(comm.size(), 1);
  auto stream = backend->create_stream();
  const std::vector<float> host = {1.5F, -2.0F, 3.25F, 0.0F, 7.0F};
  DeviceBuffer buf = backend->allocate(host.size() * sizeof(float));
  backend->copy_h2d(*stream, buf.get(), host.data(), host.size() * sizeof(float));
  comm.all_reduce(*stream, buf.as<float>(), host.size(), ReduceOp::sum);
  comm.all_reduce(*stream, buf.as<float>(), host.size(), ReduceOp::average);
  comm.broadcast(*stream, buf.as<float>(), host.size(), 0);
  std::vector<float> back(host.size());
  backend->copy_d2h(*stream, back.data(), buf.get(), back.size() * sizeof(float));
  backend->synchronize(*stream);
  EXPECT_EQ(back, host) << "a world of one: sum, average and broadcast are the identity";
  comm.barrier();
  EXPECT_THROW(comm.broadcast(*stream, buf.as<float>(), host.size(), 1), ConfigError);
  comm.abort("the test aborts");
  EXPECT_THROW(comm.all_reduce(*stream, buf.as<float>(), host.size(), ReduceOp::sum), CommError);
  EXPECT_THROW(comm.barrier(), CommError);
  comms.clear();  // destroying an aborted communicator returns
}

}  // namespace
}  // namespace pinfeed::trainer
