// The whole memory module under a changing host: a fixture procfs tree whose
// PSI and pswpout files another thread rewrites while workers use the pool.
// The pool must go elevated -> critical -> normal in order, unpin and re-pin
// only idle slabs, and never hand one slot to two users. Run under TSan by
// the tsan preset.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "fixtures.hpp"
#include "pinfeed/memory/buffer_pool.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/memory/pressure_monitor.hpp"
#include "pinfeed/memory/statistics_adaptor.hpp"

namespace pinfeed::memory {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

using testing::psi;

TEST(PressureScenarioTest, PoolFollowsRewrittenPressureFilesWithoutLosingASlot) {
  testing::TempDir dir;
  testing::copy_fixture("v1-host", dir.path());
  const auto psi_file = dir.path() / "proc/pressure/memory";
  const auto vmstat_file = dir.path() / "proc/vmstat";

  PressureMonitor::Config mc;
  mc.root = dir.path();
  mc.period = 10ms;
  mc.hold = 50ms;
  PressureMonitor monitor(mc);
  std::mutex seen_mutex;
  std::vector<PressureLevel> seen;
  monitor.subscribe([&](PressureLevel, PressureLevel to, const PressureReading&) {
    const std::scoped_lock lock(seen_mutex);
    seen.push_back(to);
  });

  PinnedResource pinned_raw(PinnedResource::Config{PinMethod::mlock, std::nullopt});
  PageableResource pageable_raw;
  StatisticsAdaptor pinned(pinned_raw), pageable(pageable_raw);
  BufferPool::Config pc;
  pc.slots = 8;
  pc.slot_bytes = 256_KiB;
  pc.slab_bytes = 512_KiB;  // 4 slabs of 2 slots
  pc.min_live_slots = 2;
  BufferPool pool(pc, pinned, pageable);
  pool.follow(monitor);
  monitor.start();

  // Workers: acquire, check nobody else holds the slot, stamp it, verify the
  // stamp after a pause (a slot moved or freed under us would fail), release.
  std::vector<std::atomic<int>> holders(pc.slots);
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> batches{0}, duplicated{0}, corrupted{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < 3; ++w) {
    workers.emplace_back([&, w] {
      std::uint64_t n = 0;
      while (!stop.load()) {
        auto lease = pool.acquire(100ms);
        if (!lease) continue;
        if (holders[lease->index()].fetch_add(1) != 0) ++duplicated;
        const auto stamp = static_cast<unsigned char>(static_cast<std::uint64_t>(w) * 50 + (n++ % 50));
        std::memset(lease->data(), stamp, lease->bytes().size());
        std::this_thread::sleep_for(200us);
        const auto* p = reinterpret_cast<const unsigned char*>(lease->data());
        if (p[0] != stamp || p[lease->bytes().size() - 1] != stamp) ++corrupted;
        holders[lease->index()].fetch_sub(1);
        ++batches;
      }
    });
  }

  const auto wait_for_level = [&](PressureLevel want) {
    const auto deadline = Clock::now() + 10s;
    while (monitor.level() != want && Clock::now() < deadline) std::this_thread::sleep_for(2ms);
    return monitor.level() == want;
  };
  const auto wait_for = [&](auto pred) {
    const auto deadline = Clock::now() + 10s;
    while (!pred() && Clock::now() < deadline) std::this_thread::sleep_for(2ms);
    return pred();
  };

  testing::write_file(psi_file, psi(15, 0));  // elevated
  ASSERT_TRUE(wait_for_level(PressureLevel::elevated));
  EXPECT_EQ(pool.stats().pinned_slots, 8U) << "elevated pins nothing new but unpins nothing either";

  testing::write_file(psi_file, psi(15, 0));
  testing::write_file(vmstat_file, "pswpin 0\npswpout 1000000\n");  // a swap storm: critical
  ASSERT_TRUE(wait_for_level(PressureLevel::critical));
  ASSERT_TRUE(wait_for([&] { return pool.stats().live_slots == 2; })) << "released down to the floor";
  EXPECT_EQ(pinned.stats().current_bytes + pageable.stats().current_bytes, 2 * 256_KiB) << "the rest went back";

  testing::write_file(psi_file, psi(0, 0));  // calm again; pswpout stops moving
  ASSERT_TRUE(wait_for_level(PressureLevel::normal));
  ASSERT_TRUE(wait_for([&] { return pool.stats().pinned_slots == 8; })) << "re-pinned once normal";

  stop = true;
  for (auto& t : workers) t.join();
  monitor.stop();
  ASSERT_TRUE(pool.wait_idle(10s)) << "the maintenance thread has settled";

  EXPECT_EQ(duplicated.load(), 0U) << "a slot was handed to two users";
  EXPECT_EQ(corrupted.load(), 0U) << "a slot changed under its user";
  EXPECT_GT(batches.load(), 0U);
  const PoolStats s = pool.stats();
  EXPECT_EQ(s.free_slots, 8U) << "every slot came back";
  EXPECT_EQ(s.releases, 3U) << "3 of 4 slabs released, floor 2 slots";
  EXPECT_EQ(s.to_pinned, 3U);
  EXPECT_EQ(s.to_pageable, 0U) << "nothing was copied into pageable memory on the way";
  EXPECT_EQ(pinned.stats().current_bytes, 8 * 256_KiB);
  EXPECT_EQ(pageable.stats().current_bytes, 0U);
  {
    const std::scoped_lock lock(seen_mutex);
    const std::vector<PressureLevel> expected{PressureLevel::elevated, PressureLevel::critical, PressureLevel::normal};
    EXPECT_EQ(seen, expected);
  }
}

}  // namespace
}  // namespace pinfeed::memory
