// GPU-only tests of the memory module, labelled "gpu" for bench/gpu_check.sh.
// On a machine without a device they skip with the reason, never pass empty.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "pinfeed/memory/buffer_pool.hpp"
#include "pinfeed/memory/cuda_host.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
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
  // The driver's own view, not our counter: first, middle and last byte.
  auto* b = static_cast<std::byte*>(p);
  EXPECT_TRUE(cuda::host_registered(b));
  EXPECT_TRUE(cuda::host_registered(b + bytes / 2));
  EXPECT_TRUE(cuda::host_registered(b + bytes - 1));
  std::memset(p, 7, bytes);
  pinned.deallocate(p, bytes);
  EXPECT_EQ(pinned.locked_bytes(), 0U);
  std::vector<std::byte> pageable(4096);
  EXPECT_FALSE(cuda::host_registered(pageable.data()));
}

// The pool's slots, as the loader gets them: every slot the pool calls
// pinned is page-locked for the driver, from its first to its last byte.
TEST(PinnedResourceGpuTest, PoolSlotsAreRegisteredWithTheDriver) {
  if (!cuda::runtime_status().available) GTEST_SKIP() << "no CUDA device: " << cuda::runtime_status().message;
  PinnedResource pinned(PinnedResource::Config{PinMethod::cuda_register, std::nullopt});
  PageableResource pageable;
  BufferPool::Config c;
  c.slots = 4;
  c.slot_bytes = 3_MiB + 17;
  c.slab_bytes = 8_MiB;
  BufferPool pool(c, pinned, pageable);
  std::vector<SlotLease> leases;
  for (std::size_t i = 0; i < c.slots; ++i) leases.push_back(pool.acquire());
  for (const SlotLease& l : leases) {
    ASSERT_TRUE(l.pinned()) << "slot " << l.index();
    EXPECT_TRUE(cuda::host_registered(l.data())) << "slot " << l.index();
    EXPECT_TRUE(cuda::host_registered(l.data() + l.bytes().size() - 1)) << "slot " << l.index();
  }
  EXPECT_EQ(pool.stats().pinned_slots, c.slots);
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
