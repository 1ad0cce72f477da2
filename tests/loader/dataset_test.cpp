#include <gtest/gtest.h>

#include <fstream>

#include "fixtures.hpp"
#include "image_fixtures.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/loader/dataset.hpp"

namespace pinfeed::loader {
namespace {

class DatasetTest : public ::testing::Test {
 protected:
  testing::TempDir dir_;
  testing::SmallDataset data_ = testing::make_small_dataset(dir_.path(), 3, 4);
};

TEST_F(DatasetTest, TheThreeLayoutsListTheSameSamplesInTheSameOrder) {
  ImageFolder folder(data_.folder);
  FileList list(data_.list, dir_.path());
  TarShards tar(expand_shard_pattern(data_.shards));
  ASSERT_EQ(folder.size(), 12U);
  ASSERT_EQ(list.size(), 12U);
  ASSERT_EQ(tar.size(), 12U);
  EXPECT_EQ(folder.classes(), (std::vector<std::string>{"class00", "class01", "class02"}));
  std::vector<std::byte> a, b, c;
  for (std::size_t i = 0; i < folder.size(); ++i) {
    EXPECT_EQ(folder.label(i), static_cast<std::int64_t>(i / 4));
    EXPECT_EQ(list.label(i), folder.label(i));
    EXPECT_EQ(tar.label(i), folder.label(i));
    folder.read(i, a);
    list.read(i, b);
    tar.read(i, c);
    EXPECT_EQ(a, b);
    EXPECT_EQ(a, c) << "tar member " << tar.describe(i);
  }
  EXPECT_EQ(folder.num_classes(), 3U);
  EXPECT_EQ(tar.num_classes(), 3U);
}

TEST_F(DatasetTest, OpenDatasetRecognisesEachLayout) {
  EXPECT_NE(dynamic_cast<ImageFolder*>(open_dataset(data_.folder.string()).get()), nullptr);
  EXPECT_NE(dynamic_cast<FileList*>(open_dataset(data_.list.string()).get()), nullptr);
  EXPECT_NE(dynamic_cast<TarShards*>(open_dataset(data_.shards).get()), nullptr);
}

TEST_F(DatasetTest, TarIndexHandlesGnuLongNames) {
  const std::string long_key = "deep/" + std::string(150, 'x') + "/sample";
  {
    TarWriter w(dir_.path() / "long.tar");
    const std::string label = "5";
    std::vector<std::byte> jpeg(1000, std::byte{7});
    w.add(long_key + ".jpg", jpeg);
    w.add(long_key + ".cls", std::as_bytes(std::span(label)));
  }
  const auto members = TarShards::scan(dir_.path() / "long.tar");
  ASSERT_EQ(members.size(), 2U);
  EXPECT_EQ(members[0].name, long_key + ".jpg");
  TarShards tar({dir_.path() / "long.tar"});
  EXPECT_EQ(tar.label(0), 5);
  std::vector<std::byte> out;
  tar.read(0, out);
  EXPECT_EQ(out.size(), 1000U);
}

TEST_F(DatasetTest, ACutShortTarMemberIsNamed) {
  const auto shard = dir_.path() / "shard-0.tar";
  std::filesystem::resize_file(shard, std::filesystem::file_size(shard) / 2);
  try {
    TarShards tar({shard});
    FAIL() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_EQ(e.path(), shard);
    EXPECT_NE(e.reason().find("cut short"), std::string::npos) << e.reason();
  }
}

TEST_F(DatasetTest, ClearErrorsNameTheFile) {
  EXPECT_THROW(ImageFolder(dir_.path() / "missing"), DataError);
  std::filesystem::create_directories(dir_.path() / "empty" / "cls");
  try {
    ImageFolder empty(dir_.path() / "empty");
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(e.reason().find("empty"), std::string::npos) << e.what();
  }
  testing::write_file(dir_.path() / "bad.txt", "folder/class00/img000.jpg seven\n");
  try {
    FileList l(dir_.path() / "bad.txt", dir_.path());
    FAIL();
  } catch (const DataError& e) {
    EXPECT_EQ(e.path(), dir_.path() / "bad.txt");
    EXPECT_NE(e.reason().find("line 1"), std::string::npos);
    EXPECT_NE(e.reason().find("seven"), std::string::npos);
  }
  testing::write_file(dir_.path() / "nolabel.txt", "# only a comment\nfolder/class00/img000.jpg\n");
  EXPECT_THROW(FileList(dir_.path() / "nolabel.txt", dir_.path()), DataError);
  testing::write_file(dir_.path() / "none.txt", "# nothing\n\n");
  EXPECT_THROW(FileList(dir_.path() / "none.txt", dir_.path()), DataError);
  testing::write_file(dir_.path() / "dir.txt", "folder/class00 0\nfolder/nope.jpg 1\n");
  FileList dirs(dir_.path() / "dir.txt", dir_.path());
  std::vector<std::byte> out;
  try {
    dirs.read(0, out);
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(e.reason().find("directory"), std::string::npos) << e.what();
  }
  EXPECT_THROW(dirs.read(1, out), DataError);
  {
    TarWriter w(dir_.path() / "badcls.tar");
    const std::string label = "cat";
    w.add("a.jpg", std::vector<std::byte>(10));
    w.add("a.cls", std::as_bytes(std::span(label)));
  }
  EXPECT_THROW(TarShards({dir_.path() / "badcls.tar"}), DataError);
}

TEST(ShardPatternTest, ExpandsBracesAndLists) {
  EXPECT_EQ(expand_shard_pattern("d/s-{08..11}.tar"),
            (std::vector<std::filesystem::path>{"d/s-08.tar", "d/s-09.tar", "d/s-10.tar", "d/s-11.tar"}));
  EXPECT_EQ(expand_shard_pattern("a.tar,b.tar").size(), 2U);
  EXPECT_THROW((void)expand_shard_pattern("s-{3..1}.tar"), ConfigError);
  EXPECT_THROW((void)expand_shard_pattern("s-{x..1}.tar"), ConfigError);
}

}  // namespace
}  // namespace pinfeed::loader
