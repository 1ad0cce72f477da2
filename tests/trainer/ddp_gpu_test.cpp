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
  EXPECT_EQ(gpu.communicator, "nccl");
  c.devices = parse_devices(fmt::format("cpu:{}", workers));
  const TrainResult cpu = train(c);
  EXPECT_LE(testing::relative_difference(gpu.weights, cpu.weights), 1e-4);
  EXPECT_GT(gpu.epochs.back().pinned_batches, 0U) << "slots registered with CUDA are pinned";
}

}  // namespace
}  // namespace pinfeed::trainer
