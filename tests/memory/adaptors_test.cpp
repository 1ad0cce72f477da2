#include <gmock/gmock.h>
#include <gtest/gtest.h>

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

using ::testing::_;
using ::testing::Return;

class MockResource final : public HostResource {
 public:
  MOCK_METHOD(void*, do_allocate, (std::size_t, std::size_t), (override));
  MOCK_METHOD(void, do_deallocate, (void*, std::size_t, std::size_t), (noexcept, override));
  [[nodiscard]] bool is_pinned() const noexcept override { return true; }
  [[nodiscard]] std::string_view name() const noexcept override { return "mock"; }
};

TEST(StatisticsAdaptorTest, ForwardsToUpstreamWithSameArguments) {
  MockResource upstream;
  StatisticsAdaptor stats(upstream);
  alignas(64) static char block[256];
  EXPECT_CALL(upstream, do_allocate(256, 64)).WillOnce(Return(block));
  EXPECT_CALL(upstream, do_deallocate(block, 256, 64));
  void* p = stats.allocate(256, 64);
  EXPECT_EQ(p, block);
  stats.deallocate(p, 256, 64);
  EXPECT_TRUE(stats.is_pinned());
}

TEST(StatisticsAdaptorTest, CountsCurrentPeakAndTotal) {
  PageableResource pageable;
  testing::CheckingResource checked(pageable);
  StatisticsAdaptor stats(checked);
  void* a = stats.allocate(1000);
  void* b = stats.allocate(3000);
  stats.deallocate(a, 1000);
  void* c = stats.allocate(500);
  const AllocationStats s = stats.stats();
  EXPECT_EQ(s.current_bytes, 3500U);
  EXPECT_EQ(s.peak_bytes, 4000U);
  EXPECT_EQ(s.total_bytes, 4500U);
  EXPECT_EQ(s.current_count, 2U);
  EXPECT_EQ(s.peak_count, 2U);
  EXPECT_EQ(s.total_count, 3U);
  stats.deallocate(b, 3000);
  stats.deallocate(c, 500);
  EXPECT_EQ(stats.stats().current_bytes, 0U);
}

TEST(StatisticsAdaptorTest, FailedAllocationsAreNotCounted) {
  PageableResource pageable;
  testing::CheckingResource checked(pageable);
  StatisticsAdaptor stats(checked);
  checked.fail_next(1);
  EXPECT_THROW((void)stats.allocate(100), OutOfMemory);
  EXPECT_EQ(stats.stats().total_count, 0U);
}

TEST(LimitingAdaptorTest, RefusesBeyondTheLimitWithReason) {
  PageableResource pageable;
  testing::CheckingResource checked(pageable);
  LimitingAdaptor limit(checked, 10_KiB);
  void* a = limit.allocate(6_KiB);
  try {
    (void)limit.allocate(5_KiB);
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    EXPECT_EQ(e.reason(), "limit");
  }
  void* b = limit.allocate(4_KiB);  // exactly fills the limit
  EXPECT_EQ(limit.used_bytes(), 10_KiB);
  limit.deallocate(a, 6_KiB);
  limit.deallocate(b, 4_KiB);
  EXPECT_EQ(limit.used_bytes(), 0U);
}

TEST(LimitingAdaptorTest, UndoesTheReservationWhenUpstreamThrows) {
  PageableResource pageable;
  testing::CheckingResource checked(pageable);
  LimitingAdaptor limit(checked, 10_KiB);
  checked.fail_next(1);
  EXPECT_THROW((void)limit.allocate(8_KiB), OutOfMemory);
  EXPECT_EQ(limit.used_bytes(), 0U);
  void* p = limit.allocate(8_KiB);  // the failed attempt left no reservation behind
  limit.deallocate(p, 8_KiB);
}

TEST(LimitingAdaptorTest, ConcurrentCallersNeverOvershoot) {
  PageableResource pageable;
  StatisticsAdaptor stats(pageable);
  LimitingAdaptor limit(stats, 64_KiB);
  std::vector<std::thread> threads;
  std::atomic<int> refused{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        try {
          void* p = limit.allocate(8_KiB);
          limit.deallocate(p, 8_KiB);
        } catch (const OutOfMemory&) {
          ++refused;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(stats.stats().peak_bytes, 64_KiB);
  EXPECT_EQ(limit.used_bytes(), 0U);
}

TEST(FallbackAdaptorTest, ServesFromFallbackWhenPrimaryRunsOut) {
  PageableResource primary_upstream, fallback_upstream;
  testing::CheckingResource primary(primary_upstream), fallback(fallback_upstream);
  FallbackAdaptor adaptor(primary, fallback);
  void* a = adaptor.allocate(4096);
  primary.fail_next(2, "memlock limit");
  void* b = adaptor.allocate(4096);
  void* c = adaptor.allocate(4096);
  EXPECT_EQ(primary.live_blocks(), 1U);
  EXPECT_EQ(fallback.live_blocks(), 2U);
  EXPECT_EQ(adaptor.fallback_count(), 2U);
  EXPECT_EQ(adaptor.fallback_reasons().at("memlock limit"), 2U);
  adaptor.deallocate(a, 4096);
  adaptor.deallocate(b, 4096);  // each block goes back to the resource it came from
  adaptor.deallocate(c, 4096);
  EXPECT_EQ(primary.live_blocks(), 0U);
  EXPECT_EQ(fallback.live_blocks(), 0U);
}

TEST(FallbackAdaptorTest, RefusalPolicySkipsThePrimary) {
  PinnedResource pinned(PinnedResource::Config{PinMethod::mlock, std::nullopt});
  PageableResource pageable;
  bool pressure = false;
  FallbackAdaptor adaptor(pinned, pageable, [&]() -> std::optional<std::string> {
    if (pressure) return "pressure elevated";
    return std::nullopt;
  });
  void* a = adaptor.allocate(8192);
  EXPECT_TRUE(adaptor.served_pinned(a));
  pressure = true;
  void* b = adaptor.allocate(8192);
  EXPECT_FALSE(adaptor.served_pinned(b));
  EXPECT_EQ(adaptor.fallback_reasons().at("pressure elevated"), 1U);
  EXPECT_FALSE(adaptor.is_pinned());  // cannot promise pinned memory as a whole
  adaptor.deallocate(a, 8192);
  adaptor.deallocate(b, 8192);
}

}  // namespace
}  // namespace pinfeed::memory
