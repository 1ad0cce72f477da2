// GPU training (label gpu; bench/gpu_check.sh runs it where a GPU exists):
// the CUDA backend with NCCL over every visible GPU must train the model to
// the CPU backend's weights, within float tolerance (cuBLAS and OpenBLAS sum
// in different orders).
#include <gtest/gtest.h>

#include <cmath>

#include "fixtures.hpp"
#include "image_fixtures.hpp"
#include "train_fixtures.hpp"
#include "pinfeed/trainer/cuda_backend.hpp"
#include "pinfeed/trainer/model.hpp"
#include "pinfeed/trainer/trainer.hpp"

namespace pinfeed::trainer {
namespace {

TEST(DdpGpuTest, CudaWorkersWithNcclMatchTheCpuBackend) {
  const int gpus = cuda_device_count();
  if (gpus == 0) GTEST_SKIP() << "no CUDA device on this machine";
  if (!nccl_available()) GTEST_SKIP() << "NCCL (libnccl.so.2) cannot be loaded";
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

}  // namespace
}  // namespace pinfeed::trainer
