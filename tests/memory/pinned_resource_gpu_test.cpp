// GPU-only tests of the memory module, labelled "gpu" for bench/gpu_check.sh.
// On a machine without a device they skip with the reason, never pass empty.
#include <gtest/gtest.h>

#include <cstring>

#include "pinfeed/memory/cuda_host.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {
namespace {

TEST(PinnedResourceGpuTest, RegistersWithTheCudaDriver) {
  if (!cuda::runtime_status().available) GTEST_SKIP() << "no CUDA device: " << cuda::runtime_status().message;
  PinnedResource pinned(PinnedResource::Config{PinMethod::cuda_register, std::nullopt});
  const std::size_t bytes = 64_MiB + 5;
  void* p = pinned.allocate(bytes);
  EXPECT_EQ(pinned.locked_bytes(), round_up_to_page(bytes));
  std::memset(p, 7, bytes);
  pinned.deallocate(p, bytes);
  EXPECT_EQ(pinned.locked_bytes(), 0U);
}

TEST(PinnedResourceGpuTest, AutomaticMethodRegistersWhenADeviceIsPresent) {
  if (!cuda::runtime_status().available) GTEST_SKIP() << "no CUDA device: " << cuda::runtime_status().message;
  EXPECT_EQ(PinnedResource().method(), PinMethod::cuda_register);
  const auto devices = cuda::devices();
  ASSERT_FALSE(devices.empty());
  EXPECT_GT(devices[0].total_bytes, 0U);
  EXPECT_FALSE(devices[0].pci_bus_id.empty());
}

}  // namespace
}  // namespace pinfeed::memory
