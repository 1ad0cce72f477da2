#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "fixtures.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/memory/pressure_events.hpp"
#include "pinfeed/memory/pressure_monitor.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

/// A hand-made snapshot: 16 GiB host, `avail` free, PSI some/full, a pswpout counter, at t0 + ms.
MemorySnapshot snap(double some, double full, std::uint64_t pswpout, std::uint64_t avail, int ms) {
  static const Clock::time_point t0 = Clock::now();
  MemorySnapshot s;
  s.taken_at = t0 + std::chrono::milliseconds(ms);
  s.mem_total = 16_GiB;
  s.mem_available = avail;
  s.psi = Psi{PsiLine{some, some, some, 0}, PsiLine{full, full, full, 0}};
  s.pswpin = 0;
  s.pswpout = pswpout;
  return s;
}

PressureMonitor::Config config(std::chrono::milliseconds hold) {
  PressureMonitor::Config c;
  c.hold = hold;
  return c;  // thresholds: elevated some 10 / full 2 / 256 pages/s / 10%; critical 40 / 10 / 4096 / 5%
}

TEST(PressureMonitorTest, RisesAtOnceOnAnySignal) {
  PressureMonitor m(config(1000ms));
  EXPECT_EQ(m.step(snap(0, 0, 0, 12_GiB, 0)).level, PressureLevel::normal);
  EXPECT_EQ(m.step(snap(15, 0, 0, 12_GiB, 100)).level, PressureLevel::elevated);
  // 1000 pages in 100 ms = 10000 pages/s: critical.
  const auto r = m.step(snap(15, 0, 1000, 12_GiB, 200));
  EXPECT_DOUBLE_EQ(r.swap_out_rate, 10000.0);
  EXPECT_EQ(r.level, PressureLevel::critical);
  EXPECT_NE(r.reason.find("swap-out"), std::string::npos) << r.reason;
  EXPECT_EQ(m.transitions(), 2U);
}

TEST(PressureMonitorTest, LowAvailableMemoryIsCritical) {
  PressureMonitor m(config(0ms));
  EXPECT_EQ(m.step(snap(0, 0, 0, 1_GiB, 0)).level, PressureLevel::elevated);     // 6.25%
  EXPECT_EQ(m.step(snap(0, 0, 0, 512_MiB, 10)).level, PressureLevel::critical);  // 3.1%
}

TEST(PressureMonitorTest, FullStallsCount) {
  PressureMonitor m(config(0ms));
  EXPECT_EQ(m.step(snap(5, 12, 0, 12_GiB, 0)).level, PressureLevel::critical);
}

TEST(PressureMonitorTest, HoldsTheLevelUntilSignalsStayLowForTheHoldTime) {
  PressureMonitor m(config(1000ms));
  m.step(snap(50, 0, 0, 12_GiB, 0));
  ASSERT_EQ(m.level(), PressureLevel::critical);
  EXPECT_EQ(m.step(snap(0, 0, 0, 12_GiB, 100)).level, PressureLevel::critical);
  EXPECT_EQ(m.step(snap(0, 0, 0, 12_GiB, 900)).level, PressureLevel::critical);
  EXPECT_EQ(m.step(snap(0, 0, 0, 12_GiB, 1100)).level, PressureLevel::normal) << "1000 ms low since t=100";
}

TEST(PressureMonitorTest, ABlipResetsTheHoldClock) {
  PressureMonitor m(config(1000ms));
  m.step(snap(15, 0, 0, 12_GiB, 0));
  m.step(snap(0, 0, 0, 12_GiB, 100));
  m.step(snap(12, 0, 0, 12_GiB, 800));  // back above: the clock restarts
  EXPECT_EQ(m.step(snap(0, 0, 0, 12_GiB, 1200)).level, PressureLevel::elevated);
  EXPECT_EQ(m.step(snap(0, 0, 0, 12_GiB, 2300)).level, PressureLevel::normal);
}

TEST(PressureMonitorTest, HysteresisKeepsALevelJustBelowItsThreshold) {
  PressureMonitor m(config(0ms));
  m.step(snap(12, 0, 0, 12_GiB, 0));
  ASSERT_EQ(m.level(), PressureLevel::elevated);
  // 9% is below the 10% threshold but above 10 x 0.8 = 8%: not cleared.
  const auto r = m.step(snap(9, 0, 0, 12_GiB, 100));
  EXPECT_EQ(r.raw, PressureLevel::normal);
  EXPECT_EQ(r.level, PressureLevel::elevated);
  EXPECT_EQ(m.step(snap(7, 0, 0, 12_GiB, 200)).level, PressureLevel::normal);
}

TEST(PressureMonitorTest, StepsDownOneOrMoreLevelsToWhatTheSignalsSay) {
  PressureMonitor m(config(0ms));
  m.step(snap(50, 0, 0, 12_GiB, 0));
  EXPECT_EQ(m.step(snap(20, 0, 0, 12_GiB, 10)).level, PressureLevel::elevated);
  m.step(snap(50, 0, 0, 12_GiB, 20));
  EXPECT_EQ(m.step(snap(0, 0, 0, 12_GiB, 30)).level, PressureLevel::normal);
}

TEST(PressureMonitorTest, TheCgroupsOwnPressureCounts) {
  PressureMonitor m(config(0ms));
  auto s = snap(0, 0, 0, 12_GiB, 0);
  s.cgroup.pressure = Psi{PsiLine{45, 0, 0, 0}, PsiLine{0, 0, 0, 0}};
  EXPECT_EQ(m.step(s).level, PressureLevel::critical);
}

/// `snap` inside a cgroup v1 of `limit` bytes using `usage`, whose failcnt is `failcnt`.
MemorySnapshot in_cgroup(MemorySnapshot s, std::uint64_t limit, std::uint64_t usage, std::uint64_t failcnt) {
  s.cgroup.version = CgroupVersion::v1;
  s.cgroup.dir = "/sys/fs/cgroup/memory/job";
  s.cgroup.limit_bytes = limit;
  s.cgroup.usage_bytes = usage;
  s.cgroup.failcnt = failcnt;
  return s;
}

TEST(PressureMonitorTest, TheCgroupHittingItsLimitIsCriticalOnlyWhenLittleIsLeft) {
  PressureMonitor m(config(0ms));
  EXPECT_EQ(m.step(in_cgroup(snap(0, 0, 0, 12_GiB, 0), 2_GiB, 1_GiB, 10)).level, PressureLevel::normal);
  // Page cache filling the cgroup: the limit is hit, but most of it is reclaimable.
  auto cached = in_cgroup(snap(0, 0, 0, 12_GiB, 100), 2_GiB, 2_GiB, 500);
  cached.cgroup.inactive_file_bytes = 1_GiB;
  EXPECT_EQ(m.step(cached).level, PressureLevel::normal) << "50% available: the kernel drops the cache";
  // Anonymous memory at the limit: 8% left and the limit hit again.
  const auto r = m.step(in_cgroup(snap(0, 0, 0, 12_GiB, 200), 2_GiB, 1884_MiB, 520));
  EXPECT_EQ(r.cgroup_limit_hits, 20U);
  EXPECT_EQ(r.level, PressureLevel::critical);
  EXPECT_NE(r.reason.find("cgroup limit hit 20 time(s)"), std::string::npos) << r.reason;
  // The same 8% with no new hit: only elevated (available <= 10%).
  EXPECT_EQ(m.step(in_cgroup(snap(0, 0, 0, 12_GiB, 300), 2_GiB, 1884_MiB, 520)).raw, PressureLevel::elevated);
}

TEST(PressureMonitorTest, AnOomKillInTheCgroupIsCriticalAtOnce) {
  PressureMonitor m(config(0ms));
  auto a = in_cgroup(snap(0, 0, 0, 12_GiB, 0), 8_GiB, 1_GiB, 0);
  a.cgroup.oom_kills = 0;
  EXPECT_EQ(m.step(a).level, PressureLevel::normal);
  auto b = in_cgroup(snap(0, 0, 0, 12_GiB, 100), 8_GiB, 1_GiB, 0);
  b.cgroup.oom_kills = 1;
  const auto r = m.step(b);
  EXPECT_EQ(r.level, PressureLevel::critical);
  EXPECT_NE(r.reason.find("OOM kill"), std::string::npos) << r.reason;
}

TEST(PressureMonitorTest, MemoryHighAndTheSwapLimitBoundTheRoom) {
  CgroupMemory cg;
  cg.limit_bytes = 4_GiB;
  cg.usage_bytes = 1_GiB;
  EXPECT_EQ(cg.room_bytes(), 3_GiB);
  cg.high_bytes = 2_GiB;
  EXPECT_EQ(cg.room_bytes(), 1_GiB) << "memory.high throttles before memory.max";
  cg.memsw_limit_bytes = 1536_MiB;
  cg.memsw_usage_bytes = 1280_MiB;
  EXPECT_EQ(cg.room_bytes(), 256_MiB) << "v1: memory + swap";
  cg.max_events = 3;
  cg.high_events = 4;
  EXPECT_EQ(cg.limit_hits(), 7U);
}

TEST(PressureMonitorTest, SubscribersSeeEveryChangeInOrder) {
  PressureMonitor m(config(0ms));
  std::vector<std::pair<PressureLevel, PressureLevel>> seen;
  const auto id =
      m.subscribe([&](PressureLevel from, PressureLevel to, const PressureReading&) { seen.emplace_back(from, to); });
  m.step(snap(15, 0, 0, 12_GiB, 0));
  m.step(snap(15, 0, 0, 12_GiB, 10));  // no change, no call
  m.step(snap(50, 0, 0, 12_GiB, 20));
  m.step(snap(0, 0, 0, 12_GiB, 30));
  m.unsubscribe(id);
  m.step(snap(50, 0, 0, 12_GiB, 40));
  const std::vector<std::pair<PressureLevel, PressureLevel>> expected{
      {PressureLevel::normal, PressureLevel::elevated},
      {PressureLevel::elevated, PressureLevel::critical},
      {PressureLevel::critical, PressureLevel::normal}};
  EXPECT_EQ(seen, expected);
}

TEST(PressureMonitorTest, ItsThreadSamplesTheRoot) {
  testing::TempDir dir;
  testing::copy_fixture("v1-host", dir.path());
  PressureMonitor::Config c;
  c.root = dir.path();
  c.period = 10ms;
  c.hold = 0ms;
  PressureMonitor m(c);
  m.start();
  testing::write_file(
      dir.path() / "proc/pressure/memory",
      "some avg10=55.00 avg60=1.00 avg300=0.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n");
  const auto deadline = Clock::now() + 10s;
  while (m.level() != PressureLevel::critical && Clock::now() < deadline) std::this_thread::sleep_for(5ms);
  m.stop();
  EXPECT_EQ(m.level(), PressureLevel::critical);
  ASSERT_TRUE(m.last().has_value());
  EXPECT_DOUBLE_EQ(m.last()->psi_some, 55.0);
}

// A small cgroup: 5% of 650 MiB is 32 MiB, what a neighbour takes in 0.1 s;
// the 64 MiB headroom is critical first (issue 38).
TEST(PressureMonitorTest, TheHeadroomCountsBelowTheFractions) {
  PressureMonitor m(config(0ms));
  MemorySnapshot s = snap(0, 0, 0, 12_GiB, 0);
  s.cgroup.version = CgroupVersion::v1;
  s.cgroup.limit_bytes = 650_MiB;
  s.cgroup.usage_bytes = 650_MiB - 100_MiB;             // 15% free: normal by fraction
  EXPECT_EQ(m.step(s).level, PressureLevel::elevated);  // < 2 x 64 MiB
  s.cgroup.usage_bytes = 650_MiB - 60_MiB;              // 9.2% free: elevated by fraction
  s.taken_at += 10ms;
  const PressureReading r = m.step(s);
  EXPECT_EQ(r.level, PressureLevel::critical);
  EXPECT_NE(r.reason.find("headroom"), std::string::npos) << r.reason;
}

TEST(PressureEventsTest, AFixtureRootArmsNothingAndWakeEndsAWait) {
  MemorySnapshot s = snap(0, 0, 0, 12_GiB, 0);
  s.root = "/somewhere/else";
  PressureEvents events(s, {1_GiB});
  EXPECT_FALSE(events.armed());
  EXPECT_NE(events.describe().find("fixture"), std::string::npos) << events.describe();
  const auto t0 = Clock::now();
  EXPECT_FALSE(events.wait(30ms));
  EXPECT_GE(Clock::now() - t0, 25ms);
  std::thread waker([&] {
    std::this_thread::sleep_for(20ms);
    events.wake();
  });
  EXPECT_FALSE(events.wait(10s)) << "wake() is not a kernel event";
  EXPECT_LT(Clock::now() - t0, 5s);
  waker.join();
}

// The real kernel: a v1 memory cgroup of the test's own, a usage threshold
// at 32 MiB, and a child process in it that touches 64 MiB. The threshold's
// eventfd fires while the child allocates, long before any poll would.
TEST(PressureEventsTest, ACgroupV1UsageThresholdFiresInARealCgroup) {
  const std::filesystem::path mount = "/sys/fs/cgroup/memory";
  if (::geteuid() != 0 || !std::filesystem::exists(mount / "cgroup.event_control")) {
    GTEST_SKIP() << "needs root and a cgroup v1 memory hierarchy at " << mount;
  }
  std::string own;
  {
    std::ifstream f("/proc/self/cgroup");
    for (std::string line; std::getline(f, line);) {
      if (line.find(":memory:") != std::string::npos) own = line.substr(line.find(":memory:") + 8);
    }
  }
  const std::filesystem::path dir =
      mount / std::filesystem::path(own).relative_path() / ("pinfeed-events-" + std::to_string(::getpid()));
  std::error_code ec;
  if (!std::filesystem::create_directory(dir, ec)) GTEST_SKIP() << "cannot make " << dir << ": " << ec.message();
  std::ofstream(dir / "memory.limit_in_bytes") << (256_MiB);
  MemorySnapshot s;
  s.root = "/";
  s.cgroup.version = CgroupVersion::v1;
  s.cgroup.dir = dir;
  s.cgroup.limit_bytes = 256_MiB;
  {
    PressureEvents events(s, {32_MiB});
    ASSERT_NE(events.describe().find("usage thresholds at 32"), std::string::npos) << events.describe();
    int go[2];
    ASSERT_EQ(::pipe(go), 0);
    const pid_t child = ::fork();
    if (child == 0) {
      char c = 0;
      if (::read(go[0], &c, 1) != 1) ::_exit(2);
      std::ofstream(dir / "cgroup.procs") << ::getpid();
      auto* p = static_cast<char*>(std::malloc(64_MiB));
      for (std::size_t i = 0; p != nullptr && i < 64_MiB; i += 4096) p[i] = 1;
      ::sleep(1);
      ::_exit(0);
    }
    EXPECT_FALSE(events.wait(50ms)) << "nothing charged yet";
    ASSERT_EQ(::write(go[1], "x", 1), 1);
    const auto t0 = Clock::now();
    const bool fired = events.wait(5s);
    const auto took = Clock::now() - t0;
    int status = 0;
    ::waitpid(child, &status, 0);
    ::close(go[0]);
    ::close(go[1]);
    EXPECT_TRUE(fired) << "the usage threshold never fired";
    EXPECT_LT(took, 900ms) << "fired only after the child was done";
    EXPECT_EQ(events.fired(), 1U);
  }
  for (int i = 0; i < 50 && !std::filesystem::remove(dir, ec); ++i) std::this_thread::sleep_for(20ms);
}

TEST(PressureMonitorTest, RejectsBadConfig) {
  auto c = config(0ms);
  c.period = 1ms;
  EXPECT_THROW(PressureMonitor{c}, ConfigError);
  c = config(0ms);
  c.critical.psi_some_avg10 = 5;  // milder than elevated's 10
  EXPECT_THROW(PressureMonitor{c}, ConfigError);
  c = config(0ms);
  c.critical.available_fraction = 0.5;  // "critical" at more free memory than "elevated"
  EXPECT_THROW(PressureMonitor{c}, ConfigError);
  c = config(0ms);
  c.hysteresis = 0;
  EXPECT_THROW(PressureMonitor{c}, ConfigError);
}

}  // namespace
}  // namespace pinfeed::memory
