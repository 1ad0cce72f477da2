// pinfeed-diag end to end: the real binary on fixture roots and on this host.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "fixtures.hpp"

namespace {

using json = nlohmann::json;

struct Result {
  int rc = -1;
  std::string out, err;
};

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

Result diag(const std::string& args) {
  pinfeed::testing::TempDir tmp;
  const auto out = tmp.path() / "out", err = tmp.path() / "err";
  const std::string cmd = std::string(PINFEED_DIAG) + " " + args + " >" + out.string() + " 2>" + err.string();
  const int status = std::system(cmd.c_str());
  Result r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

/// One JSON object per line (the --watch --json format).
std::vector<json> json_lines(const std::string& text) {
  std::vector<json> out;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) out.push_back(json::parse(line));
  return out;
}

std::string root(const char* fixture) {
  return "--root " + (pinfeed::testing::data_dir() / "procfs" / fixture).string();
}

TEST(DiagTest, PlansAReducedPrefetchInsideAContainer) {
  const Result r = diag(root("v2-container") + " --json --gpus 2 --prefetch 4 --batch-bytes 300MiB --pin-method cuda");
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["cgroup"]["version"], "v2");
  EXPECT_EQ(j["memory"]["effective_total_bytes"], 8ULL << 30);
  EXPECT_EQ(j["cgroup"]["room_bytes"], 4ULL << 30);
  EXPECT_EQ(j["plan"]["verdict"], "pin-reduced");
  EXPECT_EQ(j["plan"]["limiting"], "cgroup room");
  EXPECT_EQ(j["plan"]["budget_bytes"], 2ULL << 30);
  EXPECT_EQ(j["plan"]["slots_fit"], 6);
  EXPECT_EQ(j["plan"]["prefetch_fit"], 3);
  EXPECT_TRUE(j["cuda"].is_null()) << "GPUs are not read from another host's snapshot";
}

TEST(DiagTest, ATightMemlockLimitMeansPageable) {
  const Result r = diag(root("tight-memlock") + " --json --batch 1x1024x1024:u8 --pin-method mlock");
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["plan"]["verdict"], "pageable");
  EXPECT_EQ(j["plan"]["limiting"], "memlock limit");
  EXPECT_EQ(j["plan"]["budget_bytes"], 48 * 1024);
  EXPECT_EQ(j["process"]["cap_ipc_lock"], false);
}

TEST(DiagTest, TextReportExplainsTheVerdictAndTheRuleOfThumb) {
  const Result r = diag(root("v1-host") + " --gpus 8 --batch 256x3x224x224:u8 --gpu-mem 80GiB");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("verdict: pin\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("NOT met"), std::string::npos) << "24 GiB of RAM for 640 GiB of GPU memory";
  EXPECT_NE(r.out.find("python3"), std::string::npos) << "the process holding locked memory is listed";
}

TEST(DiagTest, SaysWhenTheKernelHasNoPsi) {
  const Result r = diag(root("no-psi"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("no PSI on this kernel"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("no memory cgroup found"), std::string::npos) << r.out;
}

TEST(DiagTest, WatchPrintsOneJsonLinePerSample) {
  const Result r = diag(root("swap-active") + " --watch 0.02 --count 3 --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto lines = json_lines(r.out);
  for (const json& j : lines) {
    // PSI some 22.5% alone is elevated; 3 GiB available of 64 GiB (4.7%) is critical.
    EXPECT_EQ(j["level"], "critical");
    EXPECT_NE(j["reason"].get<std::string>().find("available 4.7%"), std::string::npos) << j["reason"];
  }
  EXPECT_EQ(lines.size(), 3U);
}

TEST(DiagTest, WatchWithAPoolShowsItsSlotsOnThisHost) {
  const Result r = diag("--watch 0.02 --count 2 --json --with-pool --gpus 2 --prefetch 2 --batch-bytes 1MiB");
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto lines = json_lines(r.out);
  for (const json& j : lines) {
    EXPECT_EQ(j["pool"]["pinned_slots"].get<int>() + j["pool"]["pageable_slots"].get<int>(), 4);
  }
  EXPECT_EQ(lines.size(), 2U);
}

TEST(DiagTest, APoolThatDoesNotFitInMemoryExitsThreeWithWhatWouldFit) {
  const std::string root = "--root " + (pinfeed::testing::data_dir() / "procfs" / "v1-host").string();
  // 4 x 30 GiB on a host with 20 GiB available: once "pageable".
  Result r = diag(root + " --batch-bytes 30GiB --prefetch 4 --json");
  EXPECT_EQ(r.rc, 3) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["plan"]["verdict"], "does-not-fit");
  EXPECT_FALSE(j["plan"]["fit"]["fits"].get<bool>());
  r = diag(root + " --batch-bytes 8GiB --prefetch 4");
  EXPECT_EQ(r.rc, 3) << r.err;
  EXPECT_NE(r.out.find("verdict: does-not-fit"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("lower --prefetch to 2"), std::string::npos) << r.out;
  // Eight ranks on the host share it: 1 GiB x 2 no longer fits for each.
  EXPECT_EQ(diag(root + " --batch-bytes 1GiB --prefetch 2").rc, 0);
  r = diag(root + " --batch-bytes 1GiB --prefetch 2 --local-ranks 16");
  EXPECT_EQ(r.rc, 3) << r.out;
  EXPECT_NE(r.out.find("16 ranks on this host"), std::string::npos) << r.out;
  // From the launcher's variables (torchrun) when not given.
  ::setenv("LOCAL_WORLD_SIZE", "16", 1);
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "16", 1);
  r = diag("--json " + root + " --batch-bytes 1GiB --prefetch 2");
  ::unsetenv("LOCAL_WORLD_SIZE");
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  EXPECT_EQ(r.rc, 3);
  EXPECT_NE(r.out.find("\"local_ranks\": 16"), std::string::npos) << r.out;
}

TEST(DiagTest, WithPoolPinsAsManySlotsAsThePlanSays) {
  // tight-memlock: 64 KiB of RLIMIT_MEMLOCK; 16 KiB slots: the plan fits a
  // few, and the pool must pin exactly those (not 0, as one 256 MiB slab did).
  const std::string args = "--root " + (pinfeed::testing::data_dir() / "procfs" / "tight-memlock").string() +
                           " --batch-bytes 16KiB --prefetch 4 --pin-method mlock";
  Result r = diag(args + " --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  const int fit = json::parse(r.out)["plan"]["slots_fit"];
  ASSERT_GT(fit, 0);
  ASSERT_LT(fit, 4);
  r = diag(args + " --watch 0.02 --count 1 --json --with-pool");
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto lines = json_lines(r.out);
  ASSERT_EQ(lines.size(), 1U);
  EXPECT_EQ(lines[0]["pool"]["pinned_slots"].get<int>(), fit);
}

TEST(DiagTest, ASnapshotWithADeviceForMeminfoExitsOneNamingIt) {
  pinfeed::testing::TempDir dir;
  pinfeed::testing::copy_fixture("v1-host", dir.path());
  std::filesystem::remove(dir.path() / "proc/meminfo");
  std::filesystem::create_symlink("/dev/zero", dir.path() / "proc/meminfo");
  const Result r = diag("--root " + dir.path().string() + " --sample-ms 0");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("meminfo"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("character device"), std::string::npos) << r.err;
}

TEST(DiagTest, ReportsThisHostAsJson) {
  const Result r = diag("--json --sample-ms 50");
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_GT(j["memory"]["total_bytes"].get<std::uint64_t>(), 0U);
  EXPECT_FALSE(j["numa"]["nodes"].empty());
  EXPECT_FALSE(j["cuda"]["message"].get<std::string>().empty());
  EXPECT_FALSE(j.contains("plan"));
}

TEST(DiagTest, BadFlagsExitTwoWithAMessage) {
  for (const char* args : {"--gpus 0", "--batch 3x0x2", "--batch 3x2:q7", "--bogus", "--fraction 2", "--count 3",
                           "--root /nonexistent-dir", "--pin-method magic", "--batch 2x2 --batch-bytes 4",
                           "--watch 0.1 --count 1 --with-pool", "--local-ranks 0", "--local-ranks x"}) {
    const Result r = diag(args);
    EXPECT_EQ(r.rc, 2) << args;
    EXPECT_FALSE(r.err.empty()) << args << ": no message";
  }
}

TEST(DiagTest, AnUnreadableRootExitsOneNamingTheFile) {
  pinfeed::testing::TempDir empty;
  const Result r = diag("--root " + empty.path().string());
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("meminfo"), std::string::npos) << r.err;
}

}  // namespace
