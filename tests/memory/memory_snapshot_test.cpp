#include <gtest/gtest.h>
#include <sys/stat.h>

#include "fixtures.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/memory/memory_snapshot.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {
namespace {

MemorySnapshot fixture(const char* name) { return MemorySnapshot::read(testing::data_dir() / "procfs" / name); }

TEST(MemorySnapshotTest, ReadsACgroupV1Host) {
  const auto s = fixture("v1-host");
  EXPECT_EQ(s.mem_total, 24_GiB);
  EXPECT_EQ(s.mem_available, 20_GiB);
  EXPECT_EQ(s.shmem, 1_MiB);
  EXPECT_EQ(s.mlocked, 2_MiB);
  EXPECT_EQ(s.swap_total, 0U);
  EXPECT_EQ(s.pswpin, 0U);
  EXPECT_EQ(s.pswpout, 0U);
  ASSERT_TRUE(s.psi.has_value());
  EXPECT_DOUBLE_EQ(s.psi->some.avg10, 0.0);
  EXPECT_EQ(s.cgroup.version, CgroupVersion::v1);
  EXPECT_EQ(s.cgroup.path, "/process_api/abc");
  EXPECT_FALSE(s.cgroup.limit_bytes.has_value()) << "9223372036854771712 means no limit";
  EXPECT_EQ(s.cgroup.usage_bytes, 315858944U);
  EXPECT_EQ(s.cgroup.inactive_file_bytes, 1_MiB) << "hierarchical total_inactive_file wins";
  EXPECT_EQ(s.cgroup.failcnt, 0U);
  EXPECT_FALSE(s.cgroup.room_bytes().has_value());
  EXPECT_TRUE(s.memlock_limit_known);
  EXPECT_EQ(s.memlock_limit, 8_MiB);
  EXPECT_TRUE(s.cap_ipc_lock);
  EXPECT_EQ(s.effective_available(), 20_GiB);
  EXPECT_EQ(s.effective_total(), 24_GiB);
}

TEST(MemorySnapshotTest, AContainerIsBoundByItsCgroupNotTheHostMeminfo) {
  const auto s = fixture("v2-container");
  EXPECT_EQ(s.mem_total, 256_GiB);  // the host's, as seen from inside
  EXPECT_EQ(s.cgroup.version, CgroupVersion::v2);
  EXPECT_EQ(s.cgroup.limit_bytes, 8_GiB);
  EXPECT_FALSE(s.cgroup.high_bytes.has_value()) << "memory.high 'max' is no limit";
  EXPECT_EQ(s.cgroup.usage_bytes, 6_GiB);
  EXPECT_EQ(s.cgroup.inactive_file_bytes, 2_GiB);
  EXPECT_EQ(s.cgroup.room_bytes(), 4_GiB);  // 8 - (6 - 2)
  ASSERT_TRUE(s.cgroup.pressure.has_value());
  EXPECT_DOUBLE_EQ(s.cgroup.pressure->some.avg10, 3.5);
  EXPECT_DOUBLE_EQ(s.cgroup.pressure->full->avg10, 0.4);
  EXPECT_EQ(s.cgroup.oom_kills, 2U);
  EXPECT_EQ(s.cgroup.max_events, 17U);
  EXPECT_FALSE(s.memlock_limit.has_value()) << "unlimited";
  EXPECT_FALSE(s.cap_ipc_lock) << "Docker's default capability set lacks CAP_IPC_LOCK";
  EXPECT_EQ(s.effective_available(), 4_GiB);
  EXPECT_EQ(s.effective_total(), 8_GiB);
  EXPECT_DOUBLE_EQ(s.available_fraction(), 0.5);
}

TEST(MemorySnapshotTest, AnOldKernelWithoutPsiOrMemAvailableIsReadNotRejected) {
  const auto s = fixture("no-psi");
  EXPECT_FALSE(s.psi.has_value());
  EXPECT_NE(s.psi_note.find("no PSI"), std::string::npos) << s.psi_note;
  EXPECT_EQ(s.mem_available, 10_GiB) << "MemFree + Cached when MemAvailable is missing";
  EXPECT_EQ(s.cgroup.version, CgroupVersion::none);
  EXPECT_EQ(s.memlock_limit, 64_KiB);
}

TEST(MemorySnapshotTest, ReadsSwapActivityAndPressure) {
  const auto s = fixture("swap-active");
  EXPECT_EQ(s.swap_total, 8_GiB);
  EXPECT_EQ(s.swap_used(), 3_GiB);
  EXPECT_EQ(s.pswpin, 1000U);
  EXPECT_EQ(s.pswpout, 50000U);
  ASSERT_TRUE(s.psi.has_value());
  EXPECT_DOUBLE_EQ(s.psi->some.avg10, 22.5);
  EXPECT_DOUBLE_EQ(s.psi->some.avg60, 18.0);
  EXPECT_EQ(s.psi->some.total_us, 55555555U);
  EXPECT_DOUBLE_EQ(s.psi->full->avg10, 6.1);
  EXPECT_EQ(s.mlocked, 1_GiB);
}

TEST(MemorySnapshotTest, TightMemlockAndANestedV2Limit) {
  const auto s = fixture("tight-memlock");
  EXPECT_EQ(s.memlock_limit, 64_KiB);
  EXPECT_FALSE(s.cap_ipc_lock);
  EXPECT_EQ(s.vm_locked, 16_KiB);
  EXPECT_EQ(s.cgroup.version, CgroupVersion::v2);
  EXPECT_EQ(s.cgroup.path, "/user.slice/user-1000.slice/session-1.scope");
  EXPECT_EQ(s.cgroup.limit_bytes, 16_GiB) << "the lowest memory.max up the tree";
  EXPECT_EQ(s.cgroup.room_bytes(), 15_GiB);
}

TEST(MemorySnapshotTest, MissingMeminfoIsADataErrorNamingTheFile) {
  testing::TempDir dir;
  try {
    (void)MemorySnapshot::read(dir.path());
    FAIL() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_EQ(e.path(), dir.path() / "proc" / "meminfo");
  }
}

TEST(MemorySnapshotTest, GarbageMeminfoIsADataError) {
  testing::TempDir dir;
  testing::write_file(dir.path() / "proc" / "meminfo", "hello\n");
  EXPECT_THROW((void)MemorySnapshot::read(dir.path()), DataError);
}

TEST(MemorySnapshotTest, ASnapshotOfDevicesFifosAndHugeFilesIsRefusedNotFollowed) {
  testing::TempDir dir;
  testing::copy_fixture("v1-host", dir.path());
  const auto meminfo = dir.path() / "proc" / "meminfo";
  // /dev/zero as meminfo used to allocate until bad_alloc.
  std::filesystem::remove(meminfo);
  std::filesystem::create_symlink("/dev/zero", meminfo);
  try {
    (void)MemorySnapshot::read(dir.path());
    FAIL() << "read /dev/zero as meminfo";
  } catch (const DataError& e) {
    EXPECT_EQ(e.path(), meminfo);
    EXPECT_NE(e.reason().find("character device"), std::string::npos) << e.reason();
  }
  // A FIFO: refused at once, never waited on.
  std::filesystem::remove(meminfo);
  ASSERT_EQ(::mkfifo(meminfo.c_str(), 0600), 0);
  EXPECT_THROW((void)MemorySnapshot::read(dir.path()), DataError);
  // A regular file of 2 MiB: over the cap for a procfs file.
  std::filesystem::remove(meminfo);
  testing::write_file(meminfo, "MemTotal: 1000 kB\n" + std::string(2U << 20U, ' '));
  EXPECT_THROW((void)MemorySnapshot::read(dir.path()), DataError);
  // kB values that overflow 64 bits when multiplied by 1024.
  testing::write_file(meminfo, "MemTotal:       18446744073709551615 kB\nMemAvailable: 1 kB\n");
  EXPECT_THROW((void)MemorySnapshot::read(dir.path()), DataError);
  testing::write_file(meminfo, "MemTotal:       1048576 kB\nMemAvailable:   18446744073709551615 kB\n");
  EXPECT_EQ(MemorySnapshot::read(dir.path()).mem_available, 0U) << "an overflowing figure is unusable, not wrapped";
}

TEST(MemorySnapshotTest, ACgroupPathThatClimbsOutStaysInsideTheRoot) {
  testing::TempDir dir;
  testing::copy_fixture("v2-container", dir.path());
  // A crafted cgroup path "/../../../outside" would read a memory.max
  // outside the snapshot; it is treated as the mount's own cgroup.
  const auto outside = dir.path() / "outside";
  std::filesystem::create_directories(outside);
  testing::write_file(outside / "memory.max", "1024\n");
  testing::write_file(dir.path() / "proc" / "self" / "cgroup", "0::/../../../outside\n");
  const auto s = MemorySnapshot::read(dir.path());
  ASSERT_TRUE(s.cgroup.limit_bytes.has_value());
  EXPECT_NE(*s.cgroup.limit_bytes, 1024U) << "read a file outside the cgroup mount";
  EXPECT_EQ(s.cgroup.dir, dir.path() / "sys" / "fs" / "cgroup");
}

TEST(MemorySnapshotTest, ReadsThisHost) {
  const auto s = MemorySnapshot::read("/");
  EXPECT_GT(s.mem_total, 0U);
  EXPECT_GT(s.mem_available, 0U);
  EXPECT_LE(s.mem_available, s.mem_total);
  EXPECT_TRUE(s.memlock_limit_known);
  EXPECT_GT(s.available_fraction(), 0.0);
}

TEST(MemorySnapshotTest, FindsProcessesHoldingLockedMemory) {
  const auto users = locked_memory_users(testing::data_dir() / "procfs" / "v1-host");
  ASSERT_EQ(users.size(), 1U) << "only processes with VmLck or VmPin above zero";
  EXPECT_EQ(users[0].pid, 4242);
  EXPECT_EQ(users[0].name, "python3");
  EXPECT_EQ(users[0].vm_locked, 512_MiB);
}

}  // namespace
}  // namespace pinfeed::memory
