// Note [Pool policy]: the pure function, case by case, and the pool agreeing
// with it in the cases where the pool's four hand-written copies of the rule
// used to disagree (a release waking the maintenance thread for a move the
// job chooser then refused).
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "checking_resource.hpp"
#include "fixtures.hpp"
#include "pinfeed/memory/buffer_pool.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/memory/pool_policy.hpp"
#include "pinfeed/memory/pressure_monitor.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {
namespace {

using namespace std::chrono_literals;

const auto all_idle = [](std::size_t) { return true; };

std::vector<PolicySlab> slabs(std::initializer_list<std::pair<std::size_t, SlabMemory>> shape,
                              std::uint64_t slot_bytes = 64_KiB) {
  std::vector<PolicySlab> out;
  for (const auto& [slots, memory] : shape) out.push_back(PolicySlab{slots, slots * slot_bytes, memory, false});
  return out;
}
constexpr SlabMemory P = SlabMemory::pinned, G = SlabMemory::pageable, R = SlabMemory::released;

TEST(PoolPolicyTest, CriticalReleasesFromTheBackDownToTheFloorInWholeSlabs) {
  PolicyInput in;
  in.level = PressureLevel::critical;
  in.min_live_slots = 2;
  auto s = slabs({{1, P}, {1, P}, {1, G}, {1, P}});
  auto m = next_pool_move(in, s, all_idle);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->slab, 3U);
  EXPECT_EQ(m->to, SlabMemory::released);
  s[3].memory = R;
  m = next_pool_move(in, s, all_idle);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->slab, 2U) << "pageable slabs are released too: without swap they are as resident";
  s[2].memory = R;
  EXPECT_FALSE(next_pool_move(in, s, all_idle)) << "2 live slots: the floor";
  // A slab of 3 with 4 live and a floor of 2: releasing it would go below.
  s = slabs({{3, P}, {1, G}});
  m = next_pool_move(in, s, all_idle);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->slab, 1U);
  s[1].memory = R;
  EXPECT_FALSE(next_pool_move(in, s, all_idle)) << "the floor counts whole slabs";
  // A draining slab counts as released already.
  s = slabs({{1, P}, {1, P}, {1, P}});
  s[2].draining = true;
  EXPECT_FALSE(next_pool_move(in, s, [](std::size_t i) { return i != 2; })) << "3 live, one draining, floor 2";
  m = next_pool_move(in, s, all_idle);
  ASSERT_TRUE(m) << "the drained slab, once idle, is released";
  EXPECT_EQ(m->slab, 2U);
  EXPECT_TRUE(drain_wanted(in, s, 2));
  in.level = PressureLevel::elevated;
  EXPECT_FALSE(drain_wanted(in, s, 2)) << "pressure fell: back into service";
}

TEST(PoolPolicyTest, NormalBringsReleasedSlabsBackThenPinsWithinTheBudget) {
  PolicyInput in;
  in.pinned_budget_bytes = 192_KiB;
  auto s = slabs({{2, P}, {2, G}});  // 128 KiB pinned; the next slab would make 256
  EXPECT_FALSE(next_pool_move(in, s, all_idle)) << "a slab of 128 KiB does not fit the 64 KiB left";
  in.pinned_budget_bytes = 256_KiB;
  auto m = next_pool_move(in, s, all_idle);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->slab, 1U);
  EXPECT_EQ(m->to, SlabMemory::pinned);
  EXPECT_FALSE(next_pool_move(in, s, [](std::size_t) { return false; })) << "pinning waits for an idle slab";
  in.pin_backed_off = true;
  EXPECT_FALSE(next_pool_move(in, s, all_idle)) << "no new pinning during a back-off";
  // A released slab comes back even when it may not be pinned: pageable.
  s = slabs({{2, P}, {2, R}});
  m = next_pool_move(in, s, all_idle);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->to, SlabMemory::pageable);
  in.pin_backed_off = false;
  in.pinned_budget_bytes = 128_KiB;
  m = next_pool_move(in, s, all_idle);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->to, SlabMemory::pageable) << "past the budget";
  in.pinned_budget_bytes = 256_KiB;
  EXPECT_EQ(next_pool_move(in, s, all_idle)->to, SlabMemory::pinned);
  in.grow_backed_off = true;
  EXPECT_FALSE(next_pool_move(in, s, all_idle)) << "mapping failed lately: wait";
  in.grow_backed_off = false;
  in.pin = false;
  EXPECT_EQ(next_pool_move(in, s, all_idle)->to, SlabMemory::pageable);
  in.pin = true;
  in.level = PressureLevel::elevated;
  EXPECT_FALSE(next_pool_move(in, s, all_idle)) << "elevated: nothing is touched or pinned";
}

TEST(PoolPolicyTest, IdleSlabsFirstABusyOneOnlyWhenAllowed) {
  PolicyInput in;
  in.level = PressureLevel::critical;
  const auto s = slabs({{1, P}, {1, P}, {1, P}});
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
  // 1. Critical with a floor of 2 and a slab of 3: a wake test that counted
  //    slots would say "3 live > 2, release something", the chooser "a slab
  //    of 3 would go below 2": every release would wake the thread for nothing.
  {
    BufferPool::Config c;
    c.slots = 4;
    c.slot_bytes = 64_KiB;
    c.slab_bytes = 3 * 64_KiB;  // slabs of 3 and 1
    c.min_live_slots = 2;
    BufferPool pool(c, pinned, pageable);
    pool.on_pressure(PressureLevel::critical);
    ASSERT_TRUE(pool.wait_idle(5s));
    EXPECT_EQ(pool.stats().live_slots, 3U) << "the slab of 1 went, the slab of 3 stays";
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

// Note [Pool policy]'s regrow rule, now in memory (it was a lambda in the
// loader that recomputed the monitor's line): a slab comes back only while
// more than the line at which "elevated" clears stays available after it.
TEST(PoolPolicyTest, ARegrowMustLeaveMoreThanTheLineWhereElevatedClears) {
  constexpr std::uint64_t total = 1024_MiB, available = 256_MiB;
  EXPECT_EQ(regrow_refusal(total, available, 64_MiB, 0.125), std::nullopt);                // 18.75% left
  const std::optional<std::string> no = regrow_refusal(total, available, 160_MiB, 0.125);  // 9.4% left
  ASSERT_TRUE(no.has_value());
  EXPECT_NE(no->find("9.4% after"), std::string::npos) << *no;
  EXPECT_NE(no->find("not above 12.5%"), std::string::npos) << *no;
  EXPECT_TRUE(regrow_refusal(total, 32_MiB, 64_MiB, 0.125).has_value()) << "more than is available";
  EXPECT_TRUE(regrow_refusal(0, 0, 1, 0.125).has_value()) << "no total read";

  // The monitor's rule reads the host under its root at each ask, against
  // elevated.available_fraction / hysteresis (0.10 / 0.8 = 12.5%).
  testing::TempDir dir;
  testing::write_file(dir.path() / "proc" / "meminfo", "MemTotal: 1048576 kB\nMemAvailable: 262144 kB\n");
  PressureMonitor::Config config;
  config.root = dir.path();
  const auto may_grow = PressureMonitor::regrow_rule(config);
  EXPECT_EQ(may_grow(64_MiB), std::nullopt);
  EXPECT_TRUE(may_grow(160_MiB).has_value());
  testing::write_file(dir.path() / "proc" / "meminfo", "MemTotal: 1048576 kB\nMemAvailable: 1048576 kB\n");
  EXPECT_EQ(may_grow(160_MiB), std::nullopt) << "read again at each ask";
}

}  // namespace
}  // namespace pinfeed::memory
