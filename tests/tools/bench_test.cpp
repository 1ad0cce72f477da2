// pinfeed-bench end to end: the real binary on a set pinfeed-data makes.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "fixtures.hpp"
#include "run_tool.hpp"

namespace {

using json = nlohmann::json;
using Result = pinfeed::testing::ToolResult;
constexpr auto run = &pinfeed::testing::run_tool;

Result data(const std::string& args) { return run(PINFEED_DATA, args); }

/// pinfeed-bench over a small generated set (16 images of 2 classes).
class BenchToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifndef PINFEED_BENCH
    GTEST_SKIP() << "built with PINFEED_BUILD_BENCH=OFF";
#else
    ASSERT_EQ(data("-q make --out " + (dir_.path() / "set").string() + " --classes 2 --per-class 8").rc, 0);
#endif
  }
  [[nodiscard]] std::string train() const { return (dir_.path() / "set/train").string(); }
  [[nodiscard]] static Result bench(const std::string& args) {
#ifdef PINFEED_BENCH
    return run(PINFEED_BENCH, args);
#else
    return Result{};
#endif
  }
  pinfeed::testing::TempDir dir_;
};

TEST_F(BenchToolTest, LoaderBenchReportsLoaderAndCeilingAsJson) {
  const Result r =
      bench("loader --data " + train() + " --batch 4 --size 32 --threads 2 --ceiling-files 8 --repeat 1 --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["loader"]["images"], 16);
  EXPECT_GT(j["loader"]["images_per_s"].get<double>(), 0);
  EXPECT_GT(j["ceiling"]["single_thread_images_per_s"].get<double>(), 0);
  // The bare loop of the same decode, and the loader's rate over it.
  const double bare = j["ceiling"]["bare_loop_images_per_s"].get<double>();
  EXPECT_GT(bare, 0);
  EXPECT_NEAR(j["ratio_to_bare_loop"].get<double>(), j["loader"]["images_per_s"].get<double>() / bare, 1e-9);
  EXPECT_EQ(j["memory"]["pool_slots"], 4);
  EXPECT_GT(j["memory"]["loading_rss_mib_max"].get<double>(), 0);
  // Reading's share, from the loader's read time and the matching decode rate.
  const double read_us = j["loader"]["per_image_us"]["read"].get<double>();
  const double planned_us = 2.0 / j["ceiling"]["planned_images_per_s"].get<double>() * 1e6;
  EXPECT_GT(read_us, 0);
  EXPECT_NEAR(j["read_share_of_matching_decode"].get<double>(), read_us / planned_us, 1e-9);
  EXPECT_NEAR(j["overhead_from_reading_alone"].get<double>(), read_us / (planned_us + read_us), 1e-9);
  EXPECT_EQ(bench("loader --data /nonexistent").rc, 1);
  EXPECT_EQ(bench("loader --data x --crop diagonal").rc, 2);
}

TEST_F(BenchToolTest, TheCeilingSkipsFilesTheLoaderWouldReplace) {
  // A file whose header claims 65000 x 65000 once made the ceiling die with
  // an unnamed bad_alloc; now it is skipped, as the loader replaces it.
  const auto victim = dir_.path() / "set/train/class_000/000001.jpg";
  std::ifstream in(victim, std::ios::binary);
  std::ostringstream read;
  read << in.rdbuf();
  in.close();
  std::string bytes = read.str();
  const auto sof = bytes.find("\xff\xc0");
  ASSERT_NE(sof, std::string::npos);
  bytes[sof + 5] = '\xfd', bytes[sof + 6] = '\xe8', bytes[sof + 7] = '\xfd', bytes[sof + 8] = '\xe8';
  std::ofstream(victim, std::ios::binary | std::ios::trunc) << bytes;
  const Result r = bench("loader --data " + train() +
                         " --batch 4 --size 32 --threads 2 --ceiling-files 16 --repeat 1 "
                         "--max-replaced-share 0.1 --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["loader"]["images"], 16);
}

TEST_F(BenchToolTest, FloorBenchReportsEachPartAndTheirSum) {
  const Result r = bench("floor --data " + train() +
                         " --crop center --size 32 --threads 2 --batch 4 --prefetch 2 --repeat 1 --evict-mib 8 --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = json::parse(r.out);
  const auto& us = j["per_image_us"];
  for (const char* part :
       {"matching_decode_per_thread", "read_cold", "read_after_an_epoch", "horizontal_resize", "output_write"}) {
    EXPECT_GT(us[part].get<double>(), 0) << part;
  }
  EXPECT_NEAR(us["sum"].get<double>(),
              us["read_after_an_epoch"].get<double>() + us["horizontal_resize"].get<double>() +
                  us["output_write"].get<double>(),
              1e-6)
      << "the sum counts the read a training epoch sees";
  // The idle wait is one epoch at the matching rate: 16 files over 2 threads
  // (a duration in whole nanoseconds: up to 1e-6 ms below the product).
  EXPECT_NEAR(j["config"]["epoch_ms"].get<double>(), us["matching_decode_per_thread"].get<double>() * 16 / 2 / 1000,
              2e-6);
  const double sum = us["sum"].get<double>(), decode = us["matching_decode_per_thread"].get<double>();
  EXPECT_NEAR(j["floor_time_vs_matching_decode"].get<double>(), sum / decode, 1e-9);
  EXPECT_NEAR(us["bare_loop_per_thread"].get<double>(), 2.0 / j["bare_loop_images_per_s"].get<double>() * 1e6, 1e-6);
  EXPECT_NEAR(j["floor_overhead_vs_matching_decode"].get<double>(), sum / (decode + sum), 1e-9)
      << "the same definition as the loader bench's overhead";
  EXPECT_EQ(bench("floor --data /nonexistent").rc, 1);
  EXPECT_EQ(bench("floor --data x --evict-mib 0").rc, 2);
}

TEST_F(BenchToolTest, ThreadsBenchTabulatesEachCountInItsOwnProcess) {
  const std::string prefix = (dir_.path() / "threads").string();
  const Result r = bench("threads --data " + train() +
                         " --counts 1,2 --batch 4 --size 32 --ceiling-files 8 --repeat 1 --out " + prefix + " --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_EQ(j["rows"].size(), 2U);
  for (std::size_t i = 0; i < 2; ++i) {
    const auto& row = j["rows"][i];
    EXPECT_EQ(row["threads"], i + 1);
    EXPECT_GT(row["images_per_s"].get<double>(), 0);
    EXPECT_NEAR(row["pool_mib"].get<double>(), 4 * 4 * 32 * 32 * 3 * 4 / (1024.0 * 1024.0), 0.02)
        << "4 slots of 4 float32 32x32 samples, page-rounded";
    EXPECT_NEAR(row["rss_over_pool_mib"].get<double>(),
                row["loading_rss_mib"].get<double>() - row["pool_mib"].get<double>(), 1e-9);
    EXPECT_GT(row["loading_rss_mib"].get<double>(), row["pool_mib"].get<double>());
  }
  std::ifstream csv(prefix + ".csv");
  std::string line;
  std::vector<std::string> lines;
  while (std::getline(csv, line)) lines.push_back(line);
  ASSERT_EQ(lines.size(), 3U) << "a header and one line per count";
  EXPECT_EQ(lines[1].substr(0, 2), "1,");
  EXPECT_EQ(lines[2].substr(0, 2), "2,");
  if (std::system("command -v gnuplot >/dev/null 2>&1") == 0) {
    EXPECT_EQ(j["png"], prefix + ".png");
    EXPECT_TRUE(std::filesystem::file_size(prefix + ".png") > 0);
  }
  EXPECT_EQ(bench("threads --data /nonexistent").rc, 1);
  EXPECT_EQ(bench("threads --data x --counts 0").rc, 2);
  // An --out that cannot be written is found before the run, not after it.
  const Result nowhere = bench("threads --data " + train() + " --counts 1 --batch 4 --size 32 --repeat 1 --out " +
                               (dir_.path() / "no/such/folder/t").string());
  EXPECT_EQ(nowhere.rc, 2) << "a bad flag";
  EXPECT_NE(nowhere.err.find("no/such/folder does not exist"), std::string::npos) << nowhere.err;
  EXPECT_EQ(nowhere.out.find("images/s"), std::string::npos) << "ran before finding out: " << nowhere.out;
  EXPECT_EQ(bench("threads --data x --counts 1,two").rc, 2);
}

}  // namespace
