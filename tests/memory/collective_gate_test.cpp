// CollectiveGate (Note [Registration outside collectives]): a registration
// waits for the collectives in flight and holds new ones back while it runs;
// the pool's pinning and unpinning go through it.
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <thread>

#include "checking_resource.hpp"
#include "pinfeed/memory/buffer_pool.hpp"
#include "pinfeed/memory/collective_gate.hpp"
#include "pinfeed/memory/fence.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {
namespace {

using namespace std::chrono_literals;

TEST(CollectiveGateTest, ARegistrationWaitsForCollectivesInFlightAndHoldsNewOnesBack) {
  CollectiveGate gate;
  auto done = std::make_shared<ManualFence>();
  {
    auto t = gate.enter();
    t.track(done);
  }
  EXPECT_EQ(gate.in_flight(), 1U);

  std::atomic<bool> ran{false};
  std::promise<void> inside;
  std::promise<void> leave;
  auto registration = std::async(std::launch::async, [&] {
    return gate.exclusive([&] {
      ran = true;
      inside.set_value();
      leave.get_future().wait();
    });
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(ran) << "registered while a collective was in flight";
  done->signal();
  inside.get_future().wait();  // now it runs

  // A collective arriving during the registration waits for its end.
  auto collective = std::async(std::launch::async, [&] {
    auto t = gate.enter();
    return ran.load();
  });
  EXPECT_EQ(collective.wait_for(100ms), std::future_status::timeout) << "a collective started during a registration";
  leave.set_value();
  EXPECT_TRUE(registration.get()) << "drained within its patience";
  EXPECT_TRUE(collective.get());
  EXPECT_EQ(gate.in_flight(), 0U) << "a ticket dropped without track() leaves nothing in flight";
  EXPECT_EQ(gate.waited(), 1U);
  EXPECT_EQ(gate.gave_up(), 0U);
}

TEST(CollectiveGateTest, ACollectiveThatNeverEndsDelaysARegistrationOnlyByItsPatience) {
  CollectiveGate gate;
  auto never = std::make_shared<ManualFence>();
  gate.enter().track(never);
  const auto t0 = std::chrono::steady_clock::now();
  bool ran = false;
  EXPECT_FALSE(gate.exclusive(
      [&] {
        ran = true;
        // Given up: a collective that enters now (another GPU's, which the
        // one in flight may wait for) is not held back.
        auto other = std::async(std::launch::async, [&] { gate.enter().track(nullptr); });
        EXPECT_EQ(other.wait_for(2s), std::future_status::ready) << "a collective was held back after the gate gave up";
      },
      50ms));
  EXPECT_TRUE(ran);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 50ms);
  EXPECT_EQ(gate.gave_up(), 1U);
  // And an exception from the registration leaves the gate open.
  EXPECT_THROW(gate.exclusive([] { throw std::runtime_error("register failed"); }, 1ms), std::runtime_error);
  never->signal();
  auto t = gate.enter();  // would block forever if the gate stayed shut
  t.track(nullptr);
  EXPECT_EQ(gate.in_flight(), 0U);
}

TEST(CollectiveGateTest, ThePoolPinsAndUnpinsOnlyWhenNoCollectiveIsInFlight) {
  PinnedResource pinned_raw{PinnedResource::Config{PinMethod::mlock, std::nullopt}};
  PageableResource pageable_raw;
  testing::CheckingResource pinned{pinned_raw}, pageable{pageable_raw};
  BufferPool::Config c;
  c.slots = 3;
  c.slot_bytes = 64_KiB;
  c.slab_bytes = 64_KiB;
  c.min_live_slots = 1;  // critical releases two
  BufferPool pool(c, pinned, pageable);
  ASSERT_EQ(pool.stats().pinned_slots, 3U);

  CollectiveGate& gate = CollectiveGate::process();
  auto collective = std::make_shared<ManualFence>();
  gate.enter().track(collective);
  const std::uint64_t waited_before = gate.waited();
  pool.on_pressure(PressureLevel::critical);
  // A slab's pinned memory is unregistered (and given back) only once the
  // collective has finished.
  std::this_thread::sleep_for(150ms);
  EXPECT_EQ(pinned.live_blocks(), 3U) << "unregistered while a collective was in flight";
  EXPECT_FALSE(pool.wait_idle(1ms));
  collective->signal();
  ASSERT_TRUE(pool.wait_idle(5s));
  EXPECT_EQ(pool.stats().pinned_slots, 1U);
  EXPECT_EQ(pool.stats().released_slots, 2U);
  EXPECT_EQ(pinned.live_blocks(), 1U);
  EXPECT_EQ(gate.gave_up(), 0U);

  // Re-pinning (registering) waits the same way.
  auto again = std::make_shared<ManualFence>();
  gate.enter().track(again);
  pool.on_pressure(PressureLevel::normal);
  std::this_thread::sleep_for(150ms);
  EXPECT_EQ(pool.stats().pinned_slots, 1U) << "registered while a collective was in flight";
  again->signal();
  ASSERT_TRUE(pool.wait_idle(5s));
  EXPECT_EQ(pool.stats().pinned_slots, 3U);
  EXPECT_GE(gate.waited(), waited_before + 2);
}

}  // namespace
}  // namespace pinfeed::memory
