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

  r = data("-q pack --from " + (root / "train").string() + " --out " + (dir.path() / "shards/train").string() +
           " --per-shard 10");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("train-{000000..000002}.tar"), std::string::npos) << r.out;
  r = data("scan --json '" + (dir.path() / "shards/train-{000000..000002}.tar").string() + "'");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["samples"], 24);

  // --max-side: every image (500x375 on average) re-encoded smaller, all
  // of them still decodable, in the same number.
  r = data("-q pack --from " + (root / "train").string() + " --out " + (dir.path() / "small/train").string() +
           " --max-side 64 --quality 80 --threads 2");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("24 of 24 re-encoded with the longer side 64 at quality 80"), std::string::npos) << r.out;
  r = data("scan --json '" + (dir.path() / "small/train-000000.tar").string() + "'");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["samples"], 24);
  EXPECT_LT(std::filesystem::file_size(dir.path() / "small/train-000000.tar"),
            std::filesystem::file_size(dir.path() / "shards/train-000000.tar") * 24 / 10 / 4)
      << "a tenth of the pixels, far fewer bytes";
}

TEST(DataToolTest, TextureStyleWritesTheSameFilesEveryTimeAndRefusesUnknownStyles) {
  pinfeed::testing::TempDir dir;
  for (const char* name : {"a", "b"}) {
    const Result r =
        data("-q make --out " + (dir.path() / name).string() + " --classes 4 --per-class 2 --seed 9 --style texture");
    ASSERT_EQ(r.rc, 0) << r.err;
  }
  const auto bytes = [&](const char* name) {
    std::ifstream f(dir.path() / name / "train/class_003/000001.jpg", std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  EXPECT_GT(bytes("a").size(), 1000U);
  EXPECT_EQ(bytes("a"), bytes("b")) << "deterministic in the seed";
  const Result photo = data("-q make --out " + (dir.path() / "p").string() + " --classes 4 --per-class 2 --seed 9");
  ASSERT_EQ(photo.rc, 0) << photo.err;
  EXPECT_NE(bytes("p"), bytes("a")) << "photo (the default) and texture are other images";
  const Result bad = data("-q make --out " + (dir.path() / "c").string() + " --style plaid");
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.err.find("--style"), std::string::npos) << bad.err;
  const Result many = data("-q make --out " + (dir.path() / "d").string() + " --style texture --classes 21");
  EXPECT_EQ(many.rc, 2);
  EXPECT_NE(many.err.find("at most 20"), std::string::npos) << many.err;
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

TEST(DataToolTest, ScanJsonNamesABadFileWhoseNameIsNotUtf8) {
  pinfeed::testing::TempDir dir;
  const auto root = dir.path() / "set";
  ASSERT_EQ(data("-q make --out " + root.string() + " --classes 2 --per-class 2").rc, 0);
  pinfeed::testing::write_file(root / "train/class_000/caf\xe9.jpg", "not a jpeg at all");
  const Result r = data("scan --json " + (root / "train").string());
  EXPECT_EQ(r.rc, 1) << r.err;
  const json j = json::parse(r.out);  // valid JSON: the bad byte is U+FFFD
  ASSERT_EQ(j["bad"].size(), 1U) << r.out;
  EXPECT_NE(j["bad"][0]["path"].get<std::string>().find("caf\xef\xbf\xbd.jpg"), std::string::npos) << r.out;
}

TEST(DataToolTest, MakeRefusesAFolderThatHoldsFiles) {
  pinfeed::testing::TempDir dir;
  const auto root = dir.path() / "set";
  ASSERT_EQ(data("-q make --out " + root.string() + " --classes 2 --per-class 2 --seed 1").rc, 0);
  const Result again = data("-q make --out " + root.string() + " --classes 3 --per-class 2 --seed 2");
  EXPECT_EQ(again.rc, 2) << "a bad flag";
  EXPECT_NE(again.err.find("holds files already"), std::string::npos) << again.err;
  EXPECT_FALSE(std::filesystem::exists(root / "train/class_002")) << "nothing written into the old set";
  std::filesystem::create_directories(dir.path() / "empty");
  EXPECT_EQ(data("-q make --out " + (dir.path() / "empty").string() + " --classes 1 --per-class 1").rc, 0);
}

TEST(DataToolTest, BadFlagsExitTwo) {
  for (const char* args : {"", "make", "make --out /tmp/x --classes 0", "make --out /tmp/x --quality 101",
                           "pack --from /nonexistent --out x", "pack --from . --out x --max-side 4",
                           "pack --from . --out x --max-side 100 --quality 0", "pack --from . --out x --max-side -1",
                           "make --out /tmp/x --threads 100000", "scan . --threads 5000",
                           "pack --from . --out x --threads 1025", "frobnicate"}) {
    const Result r = data(args);
    EXPECT_EQ(r.rc, 2) << args;
    EXPECT_FALSE(r.err.empty() && r.out.empty()) << args;
  }
  EXPECT_EQ(data("scan /nonexistent-dataset").rc, 1) << "a missing dataset is a named error";
}

}  // namespace
