// pinfeed-data and pinfeed-bench end to end: the real binaries on data they make.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
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

TEST(DataToolTest, MakeScanPackScanAgain) {
  pinfeed::testing::TempDir dir;
  const auto root = dir.path() / "set";
  Result r = data("-q make --out " + root.string() + " --classes 3 --per-class 10 --val 0.2 --seed 4");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("24 train + 6 val"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::exists(root / "train/class_002/000007.jpg"));
  EXPECT_TRUE(std::filesystem::exists(root / "val/class_002/000009.jpg"));

  r = data("scan --json " + (root / "train").string());
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["samples"], 24);
  EXPECT_TRUE(json::parse(r.out)["bad"].empty());

  r = data("-q pack --from " + (root / "train").string() + " --out " + (dir.path() / "shards/train").string() + " --per-shard 10");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("train-{000000..000002}.tar"), std::string::npos) << r.out;
  r = data("scan --json '" + (dir.path() / "shards/train-{000000..000002}.tar").string() + "'");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["samples"], 24);
}

TEST(DataToolTest, ScanNamesEveryBadFileAndExitsOne) {
  pinfeed::testing::TempDir dir;
  const auto root = dir.path() / "set";
  ASSERT_EQ(data("-q make --out " + root.string() + " --classes 2 --per-class 4").rc, 0);
  const auto victim = root / "train/class_001/000002.jpg";
  std::filesystem::resize_file(victim, std::filesystem::file_size(victim) / 2);
  pinfeed::testing::write_file(root / "train/class_000/fake.jpg", "not a jpeg at all");
  const Result r = data("scan --json " + (root / "train").string());
  EXPECT_EQ(r.rc, 1);
  const json j = json::parse(r.out);
  ASSERT_EQ(j["bad"].size(), 2U);
  std::string all = j["bad"].dump();
  EXPECT_NE(all.find("000002.jpg"), std::string::npos);
  EXPECT_NE(all.find("fake.jpg"), std::string::npos);
  EXPECT_NE(all.find("not a JPEG"), std::string::npos);
}

TEST(DataToolTest, PngAndWebPSetsMakeScanAndPackWithTheirOwnExtensions) {
  pinfeed::testing::TempDir dir;
  for (const std::string format : {"png", "webp"}) {
    const auto root = dir.path() / format;
    Result r = data("-q make --out " + root.string() + " --classes 2 --per-class 3 --format " + format);
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_TRUE(std::filesystem::exists(root / ("train/class_001/000002." + format)));
    r = data("scan --json " + (root / "train").string());
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_EQ(json::parse(r.out)["samples"], 6);
    r = data("-q pack --from " + (root / "train").string() + " --out " + (root / "shard").string() + " --per-shard 10");
    ASSERT_EQ(r.rc, 0) << r.err;
    r = data("scan --json " + (root / "shard-000000.tar").string());
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_EQ(json::parse(r.out)["samples"], 6) << "the ." << format << " members are the samples";
  }
}

TEST(DataToolTest, HostileShardsAndFifosAreNamedErrorsNotHangs) {
  pinfeed::testing::TempDir dir;
  // A shard whose one header carries a base-256 size of 2^64 - 512.
  std::string header(512, '\0');
  header.replace(0, 5, "x.jpg");
  header.replace(100, 7, "0000644");
  const unsigned char size[12] = {0x80, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe, 0};
  header.replace(124, 12, reinterpret_cast<const char*>(size), 12);
  header[156] = '0';
  header.replace(257, 6, std::string("ustar\0", 6));
  header.replace(263, 2, "00");
  header.replace(148, 8, "        ");
  unsigned sum = 0;
  for (const char c : header) sum += static_cast<unsigned char>(c);
  char sum_text[8];
  std::snprintf(sum_text, sizeof sum_text, "%06o", sum);
  header.replace(148, 7, std::string(sum_text, 6) + '\0');
  header[155] = ' ';
  std::ofstream(dir.path() / "evil.tar", std::ios::binary) << header << std::string(1024, '\0');
  Result r = run("timeout 20 " PINFEED_DATA, "scan " + (dir.path() / "evil.tar").string());
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_NE(r.err.find("evil.tar"), std::string::npos) << r.err;
  // A FIFO named like an image in a class folder: refused at once.
  ASSERT_EQ(data("-q make --out " + (dir.path() / "set").string() + " --classes 2 --per-class 2").rc, 0);
  const auto fifo = dir.path() / "set/train/class_000/pipe.jpg";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  r = run("timeout 20 " PINFEED_DATA, "scan " + (dir.path() / "set/train").string());
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_NE(r.err.find("pipe.jpg"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("FIFO"), std::string::npos) << r.err;
}

TEST(DataToolTest, BadFlagsExitTwo) {
  for (const char* args : {"", "make", "make --out /tmp/x --classes 0", "make --out /tmp/x --quality 101", "pack --from /nonexistent --out x",
                           "frobnicate"}) {
    const Result r = data(args);
    EXPECT_EQ(r.rc, 2) << args;
    EXPECT_FALSE(r.err.empty() && r.out.empty()) << args;
  }
  EXPECT_EQ(data("scan /nonexistent-dataset").rc, 1) << "a missing dataset is a named error";
}

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
  const Result r = bench("loader --data " + train() + " --batch 4 --size 32 --threads 2 --ceiling-files 8 --repeat 1 --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["loader"]["images"], 16);
  EXPECT_GT(j["loader"]["images_per_s"].get<double>(), 0);
  EXPECT_GT(j["ceiling"]["single_thread_images_per_s"].get<double>(), 0);
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
  const Result r = bench("loader --data " + train() + " --batch 4 --size 32 --threads 2 --ceiling-files 16 --repeat 1 "
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
  // The idle wait is one epoch at the matching rate: 16 files over 2 threads.
  EXPECT_NEAR(j["config"]["epoch_ms"].get<double>(), us["matching_decode_per_thread"].get<double>() * 16 / 2 / 1000, 1e-6);
  const double sum = us["sum"].get<double>(), decode = us["matching_decode_per_thread"].get<double>();
  EXPECT_NEAR(j["floor_time_vs_matching_decode"].get<double>(), sum / decode, 1e-9);
  EXPECT_NEAR(j["floor_overhead_vs_matching_decode"].get<double>(), sum / (decode + sum), 1e-9)
      << "the same definition as the loader bench's overhead";
  EXPECT_EQ(bench("floor --data /nonexistent").rc, 1);
  EXPECT_EQ(bench("floor --data x --evict-mib 0").rc, 2);
}

TEST_F(BenchToolTest, ThreadsBenchTabulatesEachCountInItsOwnProcess) {
  const std::string prefix = (dir_.path() / "threads").string();
  const Result r = bench("threads --data " + train() + " --counts 1,2 --batch 4 --size 32 --ceiling-files 8 --repeat 1 --out " +
                         prefix + " --json");
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
  EXPECT_EQ(bench("threads --data x --counts 1,two").rc, 2);
}

}  // namespace
