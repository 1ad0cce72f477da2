#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/memory/cuda_host.hpp"
#include "pinfeed/memory/memory_snapshot.hpp"
#include "pinfeed/memory/numa.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {
namespace {

/// VmLck of this process, bytes: what the kernel says is locked.
std::uint64_t vm_locked_bytes() { return MemorySnapshot::read("/").vm_locked; }

PinnedResource::Config mlock_config() { return {PinMethod::mlock, std::nullopt}; }

TEST(PinnedResourceTest, LocksExactlyTheBytesAskedForPageRounded) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ASan and TSan intercept mlock and make it a no-op; the release build runs this test";
#endif
  PinnedResource pinned(mlock_config());
  const std::uint64_t before = vm_locked_bytes();
  const std::size_t sizes[] = {1, page_size() + 1, 10_MiB + 123, 3_MiB};
  std::uint64_t expected = 0;
  std::vector<void*> blocks;
  for (const std::size_t s : sizes) {
    blocks.push_back(pinned.allocate(s));
    expected += round_up_to_page(s);
  }
  EXPECT_EQ(pinned.locked_bytes(), expected);
  EXPECT_EQ(vm_locked_bytes() - before, expected) << "the kernel's VmLck must grow by exactly the page-rounded sizes";
  for (std::size_t i = 0; i < blocks.size(); ++i) pinned.deallocate(blocks[i], sizes[i]);
  EXPECT_EQ(pinned.locked_bytes(), 0U);
  EXPECT_EQ(vm_locked_bytes(), before);
}

TEST(PinnedResourceTest, MemoryIsPrefaultedAndWritable) {
  PinnedResource pinned(mlock_config());
  const std::size_t bytes = 4_MiB;
  auto* p = static_cast<unsigned char*>(pinned.allocate(bytes));
  for (std::size_t i = 0; i < bytes; i += 4096) EXPECT_EQ(p[i], 0) << "fresh pinned memory reads as zero";
  std::memset(p, 0x5a, bytes);
  EXPECT_EQ(p[bytes - 1], 0x5a);
  pinned.deallocate(p, bytes);
}

TEST(PinnedResourceTest, LargeMappingsStartOnAHugePageBoundary) {
  const std::size_t huge = transparent_huge_page_size();
  if (huge == 0) GTEST_SKIP() << "transparent huge pages are off on this kernel";
  PinnedResource pinned(mlock_config());
  const std::size_t bytes = 3 * huge + 12345;  // not a multiple: the tail stays small pages
  std::vector<void*> blocks;
  for (int i = 0; i < 3; ++i) blocks.push_back(pinned.allocate(bytes));
  for (void* b : blocks) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b) % huge, 0U) << "the mapping must start on a huge page";
    auto* p = static_cast<unsigned char*>(b);
    EXPECT_EQ(p[0], 0);
    EXPECT_EQ(p[bytes - 1], 0) << "the whole length, tail included, is mapped";
    std::memset(p, 0x33, bytes);
  }
  EXPECT_EQ(pinned.locked_bytes(), 3 * round_up_to_page(bytes));
  for (void* b : blocks) pinned.deallocate(b, bytes);
  EXPECT_EQ(pinned.locked_bytes(), 0U);

  PinnedResource small_pages({PinMethod::mlock, std::nullopt, /*huge_pages=*/false});
  void* b = small_pages.allocate(bytes);
  static_cast<unsigned char*>(b)[bytes - 1] = 1;
  small_pages.deallocate(b, bytes);
}

TEST(PinnedResourceTest, AutomaticMethodFollowsTheCudaRuntime) {
  PinnedResource pinned;
  const auto& status = cuda::runtime_status();
  EXPECT_EQ(pinned.method(), status.available ? PinMethod::cuda_register : PinMethod::mlock) << status.message;
}

TEST(PinnedResourceTest, CudaMethodWithoutDeviceIsAConfigError) {
  if (cuda::runtime_status().available) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_THROW(PinnedResource(PinnedResource::Config{PinMethod::cuda_register, std::nullopt}), ConfigError);
}

TEST(PinnedResourceTest, RefusesOneRegistrationOverTheMaximum) {
  PinnedResource pinned(mlock_config());
  EXPECT_THROW((void)pinned.allocate(kMaxRegistrationBytes + 1), ConfigError);
}

TEST(PinnedResourceTest, BindsToTheFirstNumaNode) {
  const Topology& topo = Topology::host();
  ASSERT_FALSE(topo.nodes().empty());
  PinnedResource pinned(PinnedResource::Config{PinMethod::mlock, topo.nodes().front().os_index});
  void* p = pinned.allocate(2_MiB);
  std::memset(p, 1, 2_MiB);
  pinned.deallocate(p, 2_MiB);
}

TEST(PinnedResourceTest, ParsesPinMethods) {
  EXPECT_EQ(parse_pin_method("auto"), PinMethod::automatic);
  EXPECT_EQ(parse_pin_method("mlock"), PinMethod::mlock);
  EXPECT_EQ(parse_pin_method("cuda"), PinMethod::cuda_register);
  EXPECT_THROW((void)parse_pin_method("pin"), ConfigError);
}

}  // namespace
}  // namespace pinfeed::memory
