// Note [Pool policy]: the pure function, case by case, and the pool agreeing
// with it in the cases where the pool's four hand-written copies of the rule
// used to disagree (a release waking the maintenance thread for a move the
// job chooser then refused).
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "checking_resource.hpp"
#include "pinfeed/memory/buffer_pool.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/memory/pool_policy.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {
namespace {

using namespace std::chrono_literals;

const auto all_idle = [](std::size_t) { return true; };

std::vector<PolicySlab> slabs(std::initializer_list<std::pair<std::size_t, bool>> shape, std::uint64_t slot_bytes = 64_KiB) {
  std::vector<PolicySlab> out;
  for (const auto& [slots, pinned] : shape) out.push_back(PolicySlab{slots, slots * slot_bytes, pinned});
  return out;
}

TEST(PoolPolicyTest, CriticalUnpinsFromTheBackDownToTheFloorInWholeSlabs) {
  PolicyInput in;
  in.level = PressureLevel::critical;
  in.min_pinned_slots = 2;
  auto s = slabs({{1, true}, {1, true}, {1, true}, {1, true}});
  auto m = next_pool_move(in, s, all_idle);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->slab, 3U);
  EXPECT_FALSE(m->to_pinned);
  // A slab of 3 with 3 pinned and a floor of 2: moving it would go below.
  s = slabs({{3, true}, {1, false}});
  EXPECT_FALSE(next_pool_move(in, s, all_idle)) << "the floor counts whole slabs";
  EXPECT_FALSE(pool_move_wanted(in, s, 0, false));
  // A prepared unpin counts as done: the next one stops at the floor.
  s = slabs({{1, true}, {1, true}, {1, true}});
  in.prepared = 2;
  in.prepared_to_pinned = false;
  m = next_pool_move(in, s, all_idle);
  EXPECT_FALSE(m) << "3 pinned, one leaving, floor 2";
}

TEST(PoolPolicyTest, NormalPinsFromTheFrontWithinTheBudgetInWholeSlabs) {
  PolicyInput in;
  in.pinned_budget_bytes = 192_KiB;
  auto s = slabs({{2, true}, {2, false}});  // 128 KiB pinned; the next slab would make 256
  EXPECT_FALSE(next_pool_move(in, s, all_idle)) << "a slab of 128 KiB does not fit the 64 KiB left";
  in.pinned_budget_bytes = 256_KiB;
  auto m = next_pool_move(in, s, all_idle);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->slab, 1U);
  EXPECT_TRUE(m->to_pinned);
  in.pin_backed_off = true;
  EXPECT_FALSE(next_pool_move(in, s, all_idle)) << "no new pinning during a back-off";
  EXPECT_TRUE(pool_move_wanted(in, s, 1, true)) << "a prepared pin that succeeded stays wanted";
  in.pin_backed_off = false;
  in.pin = false;
  EXPECT_FALSE(next_pool_move(in, s, all_idle));
  in.pin = true;
  in.level = PressureLevel::elevated;
  EXPECT_FALSE(next_pool_move(in, s, all_idle)) << "elevated: pin nothing new";
}

TEST(PoolPolicyTest, IdleSlabsFirstABusyOneOnlyWhenAllowed) {
  PolicyInput in;
  in.level = PressureLevel::critical;
  const auto s = slabs({{1, true}, {1, true}, {1, true}});
  const auto busy_last = [](std::size_t i) { return i != 2; };
  auto m = next_pool_move(in, s, busy_last);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->slab, 1U) << "the busy back slab is passed over for an idle one";
  const auto all_busy = [](std::size_t) { return false; };
  m = next_pool_move(in, s, all_busy);
  ASSERT_TRUE(m);
  EXPECT_FALSE(m->idle);
  EXPECT_FALSE(next_pool_move(in, s, all_busy, /*idle_only=*/true));
}

/// Acquire and release `n` times; return how many maintenance rounds ran.
std::uint64_t rounds_during_releases(BufferPool& pool, int n) {
  std::this_thread::sleep_for(50ms);  // the maintenance thread's first round, after construction
  const std::uint64_t before = pool.stats().maintenance_rounds;
  for (int i = 0; i < n; ++i) (void)pool.acquire();
  std::this_thread::sleep_for(50ms);
  return pool.stats().maintenance_rounds - before;
}

TEST(PoolPolicyTest, ASettledPoolIsNotWokenByReleasesInTheCasesThatUsedToDisagree) {
  PinnedResource pinned_raw{PinnedResource::Config{PinMethod::mlock, std::nullopt}};
  PageableResource pageable_raw;
  testing::CheckingResource pinned{pinned_raw}, pageable{pageable_raw};
  // 1. Critical with a floor of 2 and a slab of 3: the old wake test said
  //    "3 pinned > 2, move something", the chooser "a slab of 3 would go
  //    below 2": every release woke the thread for nothing.
  {
    BufferPool::Config c;
    c.slots = 4;
    c.slot_bytes = 64_KiB;
    c.slab_bytes = 3 * 64_KiB;  // slabs of 3 and 1
    c.min_pinned_slots = 2;
    BufferPool pool(c, pinned, pageable);
    pool.on_pressure(PressureLevel::critical);
    ASSERT_TRUE(pool.wait_idle(5s));
    EXPECT_EQ(pool.stats().pinned_slots, 3U) << "the slab of 1 went, the slab of 3 stays";
    EXPECT_EQ(rounds_during_releases(pool, 100), 0U);
  }
  // 2. A budget of 192 KiB with slabs of 128 KiB: the old wake test counted
  //    slots ("one more 64 KiB slot fits"), the chooser whole slabs.
  {
    BufferPool::Config c;
    c.slots = 4;
    c.slot_bytes = 64_KiB;
    c.slab_bytes = 128_KiB;
    c.pinned_budget_bytes = 192_KiB;
    BufferPool pool(c, pinned, pageable);
    ASSERT_TRUE(pool.wait_idle(5s));
    EXPECT_EQ(pool.stats().pinned_slots, 2U);
    EXPECT_EQ(rounds_during_releases(pool, 100), 0U);
  }
}

}  // namespace
}  // namespace pinfeed::memory
