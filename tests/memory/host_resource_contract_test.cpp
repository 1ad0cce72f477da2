// The contract every HostResource and adaptor must keep. A new resource is
// added by one ResourceHolder specialization and one line in the type list.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "checking_resource.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/memory/fallback_adaptor.hpp"
#include "pinfeed/memory/limiting_adaptor.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/memory/statistics_adaptor.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {
namespace {

template <typename T>
struct ResourceHolder;

template <>
struct ResourceHolder<PageableResource> {
  PageableResource resource;
};
template <>
struct ResourceHolder<PinnedResource> {
  PinnedResource resource{PinnedResource::Config{PinMethod::mlock, std::nullopt}};
};
template <>
struct ResourceHolder<StatisticsAdaptor> {
  PageableResource upstream;
  StatisticsAdaptor resource{upstream};
};
template <>
struct ResourceHolder<LimitingAdaptor> {
  PageableResource upstream;
  LimitingAdaptor resource{upstream, 1_GiB};
};
template <>
struct ResourceHolder<FallbackAdaptor> {
  PinnedResource pinned{PinnedResource::Config{PinMethod::mlock, std::nullopt}};
  PageableResource pageable;
  FallbackAdaptor resource{pinned, pageable};
};
template <>
struct ResourceHolder<testing::CheckingResource> {
  PageableResource upstream;
  testing::CheckingResource resource{upstream};
};

template <typename T>
class HostResourceContractTest : public ::testing::Test {
 protected:
  ResourceHolder<T> holder_;
  HostResource& resource() { return holder_.resource; }
};

using Resources = ::testing::Types<PageableResource, PinnedResource, StatisticsAdaptor, LimitingAdaptor,
                                   FallbackAdaptor, testing::CheckingResource>;
TYPED_TEST_SUITE(HostResourceContractTest, Resources);

TYPED_TEST(HostResourceContractTest, ZeroBytesAllocatesNothing) {
  EXPECT_EQ(this->resource().allocate(0), nullptr);
  this->resource().deallocate(nullptr, 0);  // must be a no-op
}

TYPED_TEST(HostResourceContractTest, HonoursEveryAlignmentUpToThePage) {
  for (std::size_t align = 1; align <= page_size(); align *= 2) {
    void* p = this->resource().allocate(100, align);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % align, 0U) << "alignment " << align;
    std::memset(p, 0xab, 100);
    this->resource().deallocate(p, 100, align);
  }
}

TYPED_TEST(HostResourceContractTest, RejectsBadAlignment) {
  EXPECT_THROW((void)this->resource().allocate(64, 3), ConfigError);
  EXPECT_THROW((void)this->resource().allocate(64, 2 * page_size()), ConfigError);
  EXPECT_THROW((void)this->resource().allocate(64, 0), ConfigError);
}

TYPED_TEST(HostResourceContractTest, LiveBlocksAreDistinctAndKeepTheirContents) {
  constexpr std::size_t kBlocks = 24, kBytes = 5000;
  std::vector<unsigned char*> blocks;
  for (std::size_t i = 0; i < kBlocks; ++i) {
    auto* p = static_cast<unsigned char*>(this->resource().allocate(kBytes));
    ASSERT_NE(p, nullptr);
    std::memset(p, static_cast<int>(i + 1), kBytes);
    blocks.push_back(p);
  }
  for (std::size_t i = 0; i < kBlocks; ++i) {
    EXPECT_TRUE(std::all_of(blocks[i], blocks[i] + kBytes, [&](unsigned char c) { return c == i + 1; }))
        << "block " << i << " was overwritten: blocks overlap";
  }
  for (auto* p : blocks) this->resource().deallocate(p, kBytes);
}

TYPED_TEST(HostResourceContractTest, ConcurrentAllocateAndFree) {
  constexpr int kThreads = 4, kRounds = 150;
  std::vector<std::thread> threads;
  std::atomic<int> corrupt{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        const std::size_t bytes = 64 + static_cast<std::size_t>((t * 977 + r * 131) % 20000);
        auto* p = static_cast<unsigned char*>(this->resource().allocate(bytes));
        std::memset(p, t + 1, bytes);
        if (p[bytes - 1] != t + 1 || p[0] != t + 1) ++corrupt;
        this->resource().deallocate(p, bytes);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(corrupt.load(), 0);
}

}  // namespace
}  // namespace pinfeed::memory
