// Budgets from fixture trees, against numbers computed by hand.
#include <gtest/gtest.h>

#include "fixtures.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/memory/pinned_budget.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {
namespace {

MemorySnapshot fixture(const char* name) { return MemorySnapshot::read(testing::data_dir() / "procfs" / name); }

const BudgetTerm* term(const PinnedBudget& b, std::string_view name) {
  for (const auto& t : b.terms) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

TEST(PinnedBudgetTest, OnAnUnconstrainedHostThePoolNeedDecides) {
  const auto b = PinnedBudget::compute(fixture("v1-host"), BudgetPolicy{0.5, PinMethod::mlock, 0}, 1_GiB);
  EXPECT_EQ(b.bytes, 1_GiB);
  EXPECT_EQ(b.limiting, "pool need");
  ASSERT_NE(term(b, "MemAvailable"), nullptr);
  EXPECT_EQ(term(b, "MemAvailable")->bytes, 10_GiB);  // 50% of 20 GiB
  EXPECT_EQ(term(b, "cgroup room"), nullptr) << "no cgroup limit";
  EXPECT_EQ(term(b, "memlock limit"), nullptr) << "CAP_IPC_LOCK lifts the memlock limit";
}

TEST(PinnedBudgetTest, RanksOnOneHostEachGetTheirShareOfTheRoom) {
  // 8 ranks on the v1 host: each may pin 50% of 20 GiB / 8, not 50% of it.
  BudgetPolicy p{0.5, PinMethod::mlock, 0};
  p.local_ranks = 8;
  const auto b = PinnedBudget::compute(fixture("v1-host"), p, 4_GiB);
  EXPECT_EQ(term(b, "MemAvailable")->bytes, 10_GiB / 8);
  EXPECT_EQ(b.bytes, 10_GiB / 8);
  EXPECT_NE(term(b, "MemAvailable")->detail.find("8 local ranks"), std::string::npos)
      << term(b, "MemAvailable")->detail;
  // In a container the cgroup room is shared the same way.
  const auto c = PinnedBudget::compute(fixture("v2-container"), p, 4_GiB);
  EXPECT_EQ(term(c, "cgroup room")->bytes, 2_GiB / 8);
  p.local_ranks = 0;
  EXPECT_THROW((void)PinnedBudget::compute(fixture("v1-host"), p, 1_GiB), ConfigError);
}

TEST(PinnedBudgetTest, InAContainerTheCgroupRoomDecides) {
  const auto b = PinnedBudget::compute(fixture("v2-container"), BudgetPolicy{0.5, PinMethod::mlock, 0}, 4_GiB);
  EXPECT_EQ(term(b, "MemAvailable")->bytes, 100_GiB);  // the host's figure, misleading in here
  EXPECT_EQ(term(b, "cgroup room")->bytes, 2_GiB);     // 50% of (8 - (6 - 2)) GiB
  EXPECT_EQ(b.bytes, 2_GiB);
  EXPECT_EQ(b.limiting, "cgroup room");
  EXPECT_EQ(term(b, "memlock limit"), nullptr) << "memlock is unlimited there";
}

TEST(PinnedBudgetTest, TightMemlockDecidesForMlockButNotForCuda) {
  const auto s = fixture("tight-memlock");
  const auto b = PinnedBudget::compute(s, BudgetPolicy{0.5, PinMethod::mlock, 0}, 64_MiB);
  EXPECT_EQ(b.limiting, "memlock limit");
  EXPECT_EQ(b.bytes, 48_KiB);  // 64 KiB limit - 16 KiB already locked
  const auto c = PinnedBudget::compute(s, BudgetPolicy{0.5, PinMethod::cuda_register, 0}, 64_MiB);
  EXPECT_EQ(c.limiting, "pool need") << "driver pins are not charged to RLIMIT_MEMLOCK";
  EXPECT_EQ(c.bytes, 64_MiB);
  EXPECT_EQ(term(c, "cgroup room")->bytes, 7680_MiB);  // 50% of (16 - 1) GiB
}

TEST(PinnedBudgetTest, ReserveIsKeptBeforeTheFraction) {
  const auto b = PinnedBudget::compute(fixture("swap-active"), BudgetPolicy{0.5, PinMethod::mlock, 1_GiB}, 64_GiB);
  EXPECT_EQ(b.limiting, "MemAvailable");
  EXPECT_EQ(b.bytes, 1_GiB);  // (3 GiB - 1 GiB) * 50%
}

TEST(PinnedBudgetTest, RejectsBadPolicies) {
  const auto s = fixture("v1-host");
  EXPECT_THROW((void)PinnedBudget::compute(s, BudgetPolicy{0.0, PinMethod::mlock, 0}, 1), ConfigError);
  EXPECT_THROW((void)PinnedBudget::compute(s, BudgetPolicy{1.5, PinMethod::mlock, 0}, 1), ConfigError);
  EXPECT_THROW((void)PinnedBudget::compute(s, BudgetPolicy{0.5, PinMethod::automatic, 0}, 1), ConfigError);
}

}  // namespace
}  // namespace pinfeed::memory
