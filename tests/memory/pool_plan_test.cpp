#include <gtest/gtest.h>

#include "fixtures.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/memory/pool_plan.hpp"
#include "pinfeed/units.hpp"

#include <cstdint>
#include <limits>

namespace pinfeed::memory {
namespace {

MemorySnapshot fixture(const char* name) { return MemorySnapshot::read(testing::data_dir() / "procfs" / name); }

PoolPlanRequest request(unsigned gpus, std::uint64_t batch, unsigned prefetch, PinMethod method) {
  PoolPlanRequest r;
  r.gpus = gpus;
  r.batch_bytes = batch;
  r.prefetch = prefetch;
  r.policy = BudgetPolicy{0.5, method, 0};
  return r;
}

TEST(PoolPlanTest, SizesArePrintedInTheirUnitUpToExbibytes) {
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(std::numeric_limits<std::uint64_t>::max()), "16.00 EiB");  // was "16384.00 PiB"
}

TEST(PoolPlanTest, ParsesBatchShapes) {
  EXPECT_EQ(batch_bytes_from_shape("256x3x224x224:u8"), 256ULL * 3 * 224 * 224);
  EXPECT_EQ(batch_bytes_from_shape("256x3x224x224:f32"), 256ULL * 3 * 224 * 224 * 4);
  EXPECT_EQ(batch_bytes_from_shape("8x1000:bf16"), 16000U);
  EXPECT_EQ(batch_bytes_from_shape("100"), 100U) << "u8 by default";
  EXPECT_THROW((void)batch_bytes_from_shape("256x0x3"), ConfigError);
  EXPECT_THROW((void)batch_bytes_from_shape("256xx3"), ConfigError);
  EXPECT_THROW((void)batch_bytes_from_shape("256x3:q4"), ConfigError);
  EXPECT_THROW((void)batch_bytes_from_shape("-3x4"), ConfigError);
  EXPECT_THROW((void)batch_bytes_from_shape("99999999999x99999999999x99999999999:f64"), ConfigError);
  EXPECT_THROW((void)batch_bytes_from_shape(""), ConfigError);
}

TEST(PoolPlanTest, APoolLargerThanTheHostDoesNotFitPinnedOrNot) {
  // 30 GiB batches x prefetch 4 on a host with 20 GiB available: 120 GiB
  // would have been "pageable" and mapped slab after slab until mmap failed.
  const auto p = plan_pool(fixture("v1-host"), request(1, 30_GiB, 4, PinMethod::cuda_register));
  EXPECT_EQ(p.verdict, Verdict::does_not_fit);
  EXPECT_FALSE(p.fit.fits);
  EXPECT_EQ(p.fit.slots_fit, 0U);
  EXPECT_EQ(p.fit.allowed_bytes, static_cast<std::uint64_t>(20.0 * (1ULL << 30U) * kPoolMaxShareOfAvailable));
  ASSERT_GE(p.reasons.size(), 2U);
  EXPECT_NE(p.reasons[1].find("not one slot of this size fits"), std::string::npos) << p.reasons[1];
  // 8 GiB batches: two fit, and the plan says which prefetch would do.
  const auto q = plan_pool(fixture("v1-host"), request(1, 8_GiB, 4, PinMethod::cuda_register));
  EXPECT_EQ(q.verdict, Verdict::does_not_fit);
  EXPECT_EQ(q.fit.slots_fit, 2U);
  EXPECT_EQ(q.prefetch_fit, 2U);
  EXPECT_NE(q.reasons[1].find("lower --prefetch to 2"), std::string::npos) << q.reasons[1];
  // In a container the cgroup room decides (8 GiB limit, 4 GiB room).
  const auto c = plan_pool(fixture("v2-container"), request(1, 2_GiB, 2, PinMethod::cuda_register));
  EXPECT_EQ(c.verdict, Verdict::does_not_fit);
  EXPECT_EQ(c.fit.limiting, "cgroup room");
  // Ranks on one host each get their share.
  auto r = request(1, 1_GiB, 2, PinMethod::cuda_register);
  EXPECT_NE(plan_pool(fixture("v1-host"), r).verdict, Verdict::does_not_fit);
  r.local_ranks = 16;
  const auto shared = plan_pool(fixture("v1-host"), r);
  EXPECT_EQ(shared.verdict, Verdict::does_not_fit);
  EXPECT_NE(shared.reasons[1].find("16 local ranks"), std::string::npos) << shared.reasons[1];
}

TEST(PoolPlanTest, PinsWhenThePoolFits) {
  // 8 GPUs x prefetch 2 x 38.5 MB batches on a 24 GiB host with 20 GiB available.
  const auto p =
      plan_pool(fixture("v1-host"), request(8, batch_bytes_from_shape("256x3x224x224:u8"), 2, PinMethod::mlock));
  EXPECT_EQ(p.slot_bytes, round_up_to_page(38535168));
  EXPECT_EQ(p.slots_needed, 16U);
  EXPECT_EQ(p.need_bytes, 16 * p.slot_bytes);
  EXPECT_EQ(p.verdict, Verdict::pin);
  EXPECT_EQ(p.slots_fit, 16U);
}

TEST(PoolPlanTest, ReducesPrefetchWhenOnlySomeSlotsFit) {
  // Container room 4 GiB, 50% -> 2 GiB budget; slots of 300 MiB: 6 fit of 8 needed.
  const auto p = plan_pool(fixture("v2-container"), request(2, 300_MiB, 4, PinMethod::cuda_register));
  EXPECT_EQ(p.budget.bytes, 2_GiB);
  EXPECT_EQ(p.budget.limiting, "cgroup room");
  EXPECT_EQ(p.slots_fit, 6U);
  EXPECT_EQ(p.prefetch_fit, 3U);
  EXPECT_EQ(p.verdict, Verdict::pin_reduced);
  EXPECT_NE(p.reasons[0].find("prefetch 3"), std::string::npos) << p.reasons[0];
}

TEST(PoolPlanTest, FallsBackToPageableUnderATightMemlockLimit) {
  const auto p = plan_pool(fixture("tight-memlock"), request(1, 1_MiB, 2, PinMethod::mlock));
  EXPECT_EQ(p.verdict, Verdict::pageable);
  EXPECT_EQ(p.budget.limiting, "memlock limit");
  ASSERT_GE(p.reasons.size(), 2U);
  EXPECT_NE(p.reasons[1].find("memlock"), std::string::npos);
}

TEST(PoolPlanTest, WarnsAboutPressureAndSwapAndChecksTheRuleOfThumb) {
  auto r = request(4, 100_MiB, 2, PinMethod::cuda_register);
  r.gpu_memory_bytes = 80_GiB;  // 4 x 80 GiB = 320 GiB of GPU memory vs 64 GiB of RAM
  const auto p = plan_pool(fixture("swap-active"), r);
  EXPECT_TRUE(p.rule_known);
  EXPECT_FALSE(p.rule_met);
  EXPECT_EQ(p.gpu_memory_total, 320_GiB);
  bool pressure = false, swap = false;
  for (const auto& reason : p.reasons) {
    pressure = pressure || reason.find("PSI some avg10 22.5%") != std::string::npos;
    swap = swap || reason.find("3.00 GiB of swap in use") != std::string::npos;
  }
  EXPECT_TRUE(pressure);
  EXPECT_TRUE(swap);
  auto small = request(1, 1_MiB, 2, PinMethod::cuda_register);
  small.gpu_memory_bytes = 8_GiB;
  EXPECT_TRUE(plan_pool(fixture("v1-host"), small).rule_met);  // 24 GiB >= 2 x 8 GiB
}

TEST(PoolPlanTest, RejectsAbsurdRequests) {
  const auto s = fixture("v1-host");
  EXPECT_THROW((void)plan_pool(s, request(0, 1_MiB, 2, PinMethod::mlock)), ConfigError);
  EXPECT_THROW((void)plan_pool(s, request(1, 0, 2, PinMethod::mlock)), ConfigError);
  EXPECT_THROW((void)plan_pool(s, request(1, 1_MiB, 0, PinMethod::mlock)), ConfigError);
  EXPECT_THROW((void)plan_pool(s, request(1, 65_GiB, 2, PinMethod::mlock)), ConfigError);
}

}  // namespace
}  // namespace pinfeed::memory
