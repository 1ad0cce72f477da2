#include <gtest/gtest.h>

#include <cstdlib>

#include <sys/stat.h>

#include <array>
#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <thread>

#include "fixtures.hpp"
#include "image_fixtures.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/dataset_kinds.hpp"
#include "pinfeed/loader/dataset_tools.hpp"
#include "pinfeed/loader/image_decoder.hpp"
#include "pinfeed/loader/synthetic.hpp"
#include "pinfeed/loader/tar_writer.hpp"

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
    w.finish();
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
    w.finish();
  }
  EXPECT_THROW(TarShards({dir_.path() / "badcls.tar"}), DataError);
}

/// One ustar header block for `name` whose size field is `size_field` (12
/// raw bytes), with a correct checksum.
std::array<char, 512> tar_header(const std::string& name, const std::array<unsigned char, 12>& size_field) {
  std::array<char, 512> h{};
  std::memcpy(h.data(), name.data(), name.size());
  std::memcpy(&h[100], "0000644", 7);
  std::memcpy(&h[124], size_field.data(), 12);
  h[156] = '0';
  std::memcpy(&h[257], "ustar", 6);
  h[263] = '0';
  h[264] = '0';
  seal_ustar_header(h);
  return h;
}

void write_blocks(const std::filesystem::path& p, const std::vector<std::array<char, 512>>& blocks) {
  std::ofstream out(p, std::ios::binary);
  for (const auto& b : blocks) out.write(b.data(), 512);
}

/// Runs `f` on another thread; fails the test if it takes over 10 s (the
/// bugs these tests hold down were infinite loops and blocking opens).
/// (A detached thread, so a regression fails here instead of hanging the
/// suite; the process ends it.)
template <class F>
void within_seconds(F f) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> result = done->get_future();
  std::thread([f = std::move(f), done]() mutable {
    try {
      f();
      done->set_value();
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }).detach();
  ASSERT_EQ(result.wait_for(std::chrono::seconds(10)), std::future_status::ready) << "hung";
  result.get();
}

TEST_F(DatasetTest, ABase256SizeNearTwoToThe64IsADataErrorNotAnEndlessIndex) {
  const auto shard = dir_.path() / "overflow.tar";
  // GNU base-256: top bit set, then the value 2^64 - 512, which wrapped
  // `data + size` back to this header, so the index looped forever.
  std::array<unsigned char, 12> size{0x80, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe, 0x00};
  write_blocks(shard, {tar_header("evil.jpg", size), {}, {}});
  within_seconds([&] {
    try {
      TarShards tar({shard});
      ADD_FAILURE() << "expected DataError";
    } catch (const DataError& e) {
      EXPECT_EQ(e.path(), shard);
      EXPECT_NE(e.reason().find("evil.jpg"), std::string::npos) << e.reason();
    }
  });
  // A large size under 2^63 is a member cut short, named.
  std::array<unsigned char, 12> huge{0x80, 0, 0, 0, 0x40, 0, 0, 0, 0, 0, 0, 0};
  write_blocks(shard, {tar_header("evil2.jpg", huge), {}, {}});
  within_seconds([&] { EXPECT_THROW(TarShards({shard}), DataError); });
}

TEST_F(DatasetTest, AShardWithoutItsEndOfArchiveBlocksIsReported) {
  const auto shard = dir_.path() / "shard-0.tar";
  const auto size = std::filesystem::file_size(shard);
  EXPECT_NO_THROW(TarShards({shard}));
  std::filesystem::resize_file(shard, size - 1024);  // cut at a member boundary
  try {
    TarShards tar({shard});
    FAIL() << "a shard cut at a member boundary read as complete";
  } catch (const DataError& e) {
    EXPECT_EQ(e.path(), shard);
    EXPECT_NE(e.reason().find("end-of-archive"), std::string::npos) << e.reason();
  }
  std::ofstream(dir_.path() / "empty.tar").close();
  EXPECT_THROW(TarShards({dir_.path() / "empty.tar"}), DataError);
}

TEST_F(DatasetTest, AnAbandonedTarWriterLeavesNoShard) {
  const auto shard = dir_.path() / "half.tar";
  {
    TarWriter w(shard);
    w.add("a.jpg", std::vector<std::byte>(100));
    // no finish(): the pack failed half way
  }
  EXPECT_FALSE(std::filesystem::exists(shard));
  EXPECT_FALSE(std::filesystem::exists(shard.string() + ".partial"));
}

TEST_F(DatasetTest, ATarWriterThatCannotCreateItsFileSaysWhy) {
  try {
    TarWriter w(dir_.path() / "no-such-folder" / "x.tar");
    FAIL() << "created";
  } catch (const DataError& e) {
    EXPECT_NE(e.reason().find("No such file or directory"), std::string::npos) << e.reason();
    EXPECT_NE(e.reason().find("x.tar.partial"), std::string::npos) << e.reason();
  }
}

TEST_F(DatasetTest, AFifoNamedLikeAnImageIsRefusedWithoutBlocking) {
  const auto fifo = data_.folder / "class01" / "pipe.jpg";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  within_seconds([&] {
    try {
      ImageFolder folder(data_.folder);
      ADD_FAILURE() << "a FIFO in a class folder was listed";
    } catch (const DataError& e) {
      EXPECT_EQ(e.path(), fifo);
      EXPECT_NE(e.reason().find("FIFO"), std::string::npos) << e.reason();
    }
  });
  // As a file-list entry: the read names it (and never waits for a writer).
  testing::write_file(dir_.path() / "fifo.txt", "folder/class01/pipe.jpg 1\n");
  within_seconds([&] {
    FileList list(dir_.path() / "fifo.txt", dir_.path());
    std::vector<std::byte> out;
    try {
      list.read(0, out);
      ADD_FAILURE() << "read a FIFO";
    } catch (const DataError& e) {
      EXPECT_NE(e.reason().find("FIFO"), std::string::npos) << e.reason();
    }
  });
  // As a shard, and as the file list itself.
  const auto fifo_tar = dir_.path() / "pipe.tar";
  ASSERT_EQ(::mkfifo(fifo_tar.c_str(), 0600), 0);
  within_seconds([&] { EXPECT_THROW(TarShards({fifo_tar}), DataError); });
  within_seconds([&] { EXPECT_THROW(FileList(fifo, dir_.path()), DataError); });
}

TEST_F(DatasetTest, AbsurdLabelsAreRefusedNamingTheFileAndLine) {
  for (const std::string label : {"500000000", "2147483648", "9223372036854775807"}) {
    testing::write_file(dir_.path() / "big.txt",
                        "folder/class00/img000.jpg 0\nfolder/class00/img001.jpg " + label + "\n");
    try {
      FileList list(dir_.path() / "big.txt", dir_.path());
      FAIL() << "label " << label << " accepted: " << list.num_classes() << " classes";
    } catch (const DataError& e) {
      EXPECT_EQ(e.path(), dir_.path() / "big.txt");
      EXPECT_NE(e.reason().find("line 2"), std::string::npos) << e.reason();
      EXPECT_NE(e.reason().find("limit"), std::string::npos) << e.reason();
    }
  }
  // The limit is a default, raised where a dataset really has that many.
  testing::write_file(dir_.path() / "big.txt", "folder/class00/img000.jpg 1500000\n");
  EXPECT_THROW(FileList(dir_.path() / "big.txt", dir_.path()), DataError);
  EXPECT_EQ(FileList(dir_.path() / "big.txt", dir_.path(), 2'000'000).num_classes(), 1'500'001U);
  EXPECT_THROW(FileList(dir_.path() / "big.txt", dir_.path(), 0), ConfigError);
  // In a shard: the member is named.
  {
    TarWriter w(dir_.path() / "biglabel.tar");
    const std::string label = "4000000000";
    w.add("k.jpg", std::vector<std::byte>(10));
    w.add("k.cls", std::as_bytes(std::span(label)));
    w.finish();
  }
  try {
    TarShards tar({dir_.path() / "biglabel.tar"});
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(e.reason().find("k.cls"), std::string::npos) << e.reason();
  }
}

TEST_F(DatasetTest, ImagesInFormatsWeCannotDecodeRefuseTheFolderWhenOpened) {
  testing::write_file(data_.folder / "class02" / "scan.BMP", "BM....");
  try {
    ImageFolder folder(data_.folder);
    FAIL() << "a .bmp would have been replaced sample by sample";
  } catch (const DataError& e) {
    EXPECT_EQ(e.path(), data_.folder / "class02" / "scan.BMP");
    EXPECT_NE(e.reason().find("bmp"), std::string::npos) << e.reason();
  }
}

TEST_F(DatasetTest, AClassFolderWithoutImagesRefusesTheFolderNamingIt) {
  // Jupyter's checkpoint folder sorts first: taken as class 0, it would move
  // every real class up by one. torchvision refuses it; so do we.
  std::filesystem::create_directories(data_.folder / ".ipynb_checkpoints");
  testing::write_file(data_.folder / "notes" / "README.txt", "not an image");
  try {
    ImageFolder folder(data_.folder);
    FAIL() << "an empty class folder was taken as a class";
  } catch (const DataError& e) {
    EXPECT_EQ(e.path(), data_.folder);
    EXPECT_NE(e.reason().find("class folders '.ipynb_checkpoints', 'notes'"), std::string::npos) << e.reason();
  }
  std::filesystem::remove_all(data_.folder / ".ipynb_checkpoints");
  std::filesystem::remove_all(data_.folder / "notes");
  // A hidden folder with images is a class, as in torchvision: sorted first.
  testing::write_bytes(data_.folder / ".hidden" / "a.jpg", make_synthetic_jpeg(7, 0, 0, SyntheticImageSpec{}));
  const ImageFolder folder(data_.folder);
  EXPECT_EQ(folder.classes().front(), ".hidden");
  EXPECT_EQ(folder.num_classes(), 4U);
}

TEST_F(DatasetTest, NestedFoldersAreOrderedAsTorchvisionWalksThem) {
  // os.walk's folders sorted as strings, each folder's files by name: the
  // class folder's own files first, "a-b/" before "a/x/" ('-' < '/').
  const auto jpeg = make_synthetic_jpeg(7, 0, 0, SyntheticImageSpec{});
  const auto root = dir_.path() / "nested";
  for (const char* rel : {"c/z.jpg", "c/a/1.jpg", "c/a-b/2.jpg", "c/a/x/3.jpg", "c/b.jpg"}) {
    testing::write_bytes(root / rel, jpeg);
  }
  const ImageFolder folder(root);
  std::vector<std::string> order;
  for (std::size_t i = 0; i < folder.size(); ++i) order.push_back(folder.relative(i).string());
  EXPECT_EQ(order, (std::vector<std::string>{"c/b.jpg", "c/z.jpg", "c/a/1.jpg", "c/a-b/2.jpg", "c/a/x/3.jpg"}));
}

TEST_F(DatasetTest, AFingerprintSurvivesAMoveAndNamesWhatChanged) {
  const DatasetFingerprint before = fingerprint(ImageFolder(data_.folder));
  EXPECT_EQ(before.samples, 12U);
  EXPECT_EQ(before.classes, (std::vector<std::string>{"class00", "class01", "class02"}));
  // Another folder, the same files: the same dataset.
  const auto moved = dir_.path() / "moved";
  std::filesystem::copy(data_.folder, moved, std::filesystem::copy_options::recursive);
  EXPECT_EQ(fingerprint(ImageFolder(moved)), before);
  EXPECT_EQ(describe_change(before, fingerprint(ImageFolder(moved))), "");

  std::filesystem::rename(moved / "class01", moved / "class01b");
  EXPECT_EQ(describe_change(before, fingerprint(ImageFolder(moved))), "class 'class01' renamed to 'class01b'");
  std::filesystem::rename(moved / "class01b", moved / "class01");

  const auto jpeg = make_synthetic_jpeg(7, 9, 9, SyntheticImageSpec{});
  for (int i = 0; i < 8; ++i) testing::write_bytes(moved / "class02" / fmt::format("new{}.jpg", i), jpeg);
  EXPECT_EQ(describe_change(before, fingerprint(ImageFolder(moved))), "8 samples added (12 -> 20)");
  for (int i = 0; i < 8; ++i) std::filesystem::remove(moved / "class02" / fmt::format("new{}.jpg", i));

  // The same names, one file's content replaced (another size).
  testing::write_bytes(moved / "class00" / "img001.jpg", jpeg);
  EXPECT_NE(describe_change(before, fingerprint(ImageFolder(moved))).find("the same 12 samples and classes, but"),
            std::string::npos);

  // Numeric labels: lists and shards have fingerprints too, stable per layout.
  const FileList list(data_.list, dir_.path());
  EXPECT_TRUE(fingerprint(list).classes.empty());
  EXPECT_EQ(fingerprint(list).num_classes, 3U);
  EXPECT_EQ(fingerprint(list), fingerprint(FileList(data_.list, dir_.path())));
  // Absolute entries stay themselves: the list moved one folder deeper is
  // the same dataset.
  testing::write_file(dir_.path() / "abs.txt", (data_.folder / "class00" / "img000.jpg").string() + " 0\n");
  testing::write_file(dir_.path() / "deeper" / "abs.txt", (data_.folder / "class00" / "img000.jpg").string() + " 0\n");
  EXPECT_EQ(fingerprint(FileList(dir_.path() / "abs.txt", dir_.path())),
            fingerprint(FileList(dir_.path() / "deeper" / "abs.txt", dir_.path() / "deeper")));
  const TarShards tar(expand_shard_pattern(data_.shards));
  EXPECT_EQ(fingerprint(tar).samples, 12U);
  DatasetFingerprint fewer = fingerprint(tar);
  fewer.num_classes = 2;
  EXPECT_EQ(describe_change(fewer, fingerprint(tar)), "2 classes, now 3");
}

TEST_F(DatasetTest, AFileListsByteOrderMarkIsSkippedAndANulByteIsRefused) {
  const std::string body = "folder/class00/img000.jpg 0\nfolder/class01/img000.jpg 1\n";
  testing::write_file(dir_.path() / "bom.txt", "\xEF\xBB\xBF" + body);
  const FileList with_bom(dir_.path() / "bom.txt", dir_.path());
  ASSERT_EQ(with_bom.size(), 2U);
  EXPECT_EQ(with_bom.label(0), 0);
  EXPECT_EQ(with_bom.describe(0), (dir_.path() / "folder/class00/img000.jpg").string())
      << "the first entry is read, not hidden behind the mark";
  constexpr char kNul[] = "folder/class00/img000.jpg 0\nfolder/cl\0ass01/img000.jpg 1\n";
  testing::write_file(dir_.path() / "nul.txt", std::string_view(kNul, sizeof kNul - 1));
  try {
    FileList bad(dir_.path() / "nul.txt", dir_.path());
    FAIL() << "a path with a NUL byte was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(e.reason().find("line 2: 'folder/cl\\0ass01/img000.jpg 1' contains a NUL byte"), std::string::npos)
        << e.reason();
  }
}

TEST_F(DatasetTest, GnuTarsHardLinksAreReadAsTarExtractsThemSymlinksAndDuplicateLabelsAreRefused) {
  // Made by GNU tar itself: the second name of a file is stored as a hard
  // link (no data of its own); it used to be dropped without a word.
  const auto work = dir_.path() / "links";
  std::filesystem::create_directories(work);
  testing::write_bytes(work / "a.jpg", make_synthetic_jpeg(7, 0, 0, SyntheticImageSpec{}));
  testing::write_file(work / "a.cls", "3");
  testing::write_file(work / "b.cls", "5");
  std::filesystem::create_hard_link(work / "a.jpg", work / "b.jpg");
  const auto tar = [&](const std::string& args) {
    return std::system(fmt::format("cd '{}' && tar {} 2>/dev/null", work.string(), args).c_str());
  };
  ASSERT_EQ(tar("cf hard.tar a.jpg a.cls b.jpg b.cls"), 0);
  const TarShards hard({work / "hard.tar"});
  ASSERT_EQ(hard.size(), 2U) << "both samples, the link's too";
  EXPECT_EQ(hard.label(1), 5);
  std::vector<std::byte> first, second;
  hard.read(0, first);
  hard.read(1, second);
  EXPECT_EQ(first, second) << "the link reads its target's bytes";

  std::filesystem::create_symlink("a.jpg", work / "c.jpg");
  testing::write_file(work / "c.cls", "1");
  ASSERT_EQ(tar("cf sym.tar a.jpg a.cls c.jpg c.cls"), 0);
  try {
    TarShards sym({work / "sym.tar"});
    FAIL() << "a symlink member was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(e.reason().find("c.jpg: a symbolic link"), std::string::npos) << e.reason();
  }

  ASSERT_EQ(tar("cf dup.tar a.jpg a.cls && tar rf dup.tar a.cls"), 0);  // appended: two a.cls members
  try {
    TarShards dup({work / "dup.tar"});
    FAIL() << "a second label for one key was accepted (last one wins)";
  } catch (const DataError& e) {
    EXPECT_NE(e.reason().find("a second label for key 'a'"), std::string::npos) << e.reason();
  }
}

/// Mean of each BGRA channel over the image (decoded in full).
std::array<double, 3> mean_colour(ImageDecoder& decoder, std::span<const std::byte> data) {
  DecodedImage img;
  decoder.decode_full(data, img, "mean");
  std::array<double, 3> sum{};
  for (int y = 0; y < img.height; ++y) {
    for (int x = 0; x < img.width; ++x) {
      for (std::size_t c = 0; c < 3; ++c) sum[c] += img.row(y)[4 * x + static_cast<int>(c)];
    }
  }
  for (auto& v : sum) v /= static_cast<double>(img.width) * img.height;
  return sum;
}

TEST_F(DatasetTest, PackWithMaxSideShrinksOnlyTheLargerImagesAndKeepsOrderAndLabels) {
  // The fixture's images are 96..112 wide, 72..78 tall: with max_side 100,
  // the 104- and 112-wide ones are re-encoded, the 96-wide ones kept.
  ImageFolder folder(data_.folder);
  PackConfig config;
  config.per_shard = 5;
  config.max_side = 100;
  config.threads = 2;
  const PackSummary s = pack_shards(folder, dir_.path() / "packed" / "small", config);
  EXPECT_EQ(s.samples, 12U);
  EXPECT_EQ(s.resized, 6U);  // widths 96 + (i % 3) * 8: images 1 and 2 of each class's 0..3
  TarShards packed(expand_shard_pattern(s.pattern));
  ASSERT_EQ(packed.size(), folder.size());
  ImageDecoder decoder;
  std::vector<std::byte> original, shrunk;
  std::size_t resized = 0;
  for (std::size_t i = 0; i < folder.size(); ++i) {
    EXPECT_EQ(packed.label(i), folder.label(i));
    folder.read(i, original);
    packed.read(i, shrunk);
    const ImageHeader a = decoder.header(original, "original");
    const ImageHeader b = decoder.header(shrunk, packed.describe(i));
    if (std::max(a.width, a.height) <= 100) {
      EXPECT_EQ(original, shrunk) << "an image within the limit keeps its bytes: " << folder.describe(i);
      continue;
    }
    ++resized;
    EXPECT_EQ(b.width, 100) << folder.describe(i);
    EXPECT_NEAR(b.height, a.height * 100.0 / a.width, 1.0) << folder.describe(i);
    const auto ma = mean_colour(decoder, original), mb = mean_colour(decoder, shrunk);
    for (std::size_t c = 0; c < 3; ++c) EXPECT_NEAR(ma[c], mb[c], 2.0) << folder.describe(i) << " channel " << c;
  }
  EXPECT_EQ(resized, s.resized);
  EXPECT_GT(s.bytes_in, s.bytes_out);
}

TEST_F(DatasetTest, ShrinkUsesTheDctScaleAndBoxHalvingsForLargeShrinksAndConvertsPngToJpeg) {
  SyntheticImageSpec spec;
  spec.width = 1200;
  spec.height = 900;
  const auto jpeg = make_synthetic_jpeg(3, 1, 0, spec);
  ImageDecoder decoder;
  std::vector<std::byte> out;
  ASSERT_TRUE(shrink_image(decoder, jpeg, 64, 90, out, "big.jpg"));
  ImageHeader h = decoder.header(out, "out");
  EXPECT_EQ(h.width, 64);
  EXPECT_EQ(h.height, 48);
  const auto ma = mean_colour(decoder, jpeg), mb = mean_colour(decoder, out);
  for (std::size_t c = 0; c < 3; ++c) EXPECT_NEAR(ma[c], mb[c], 2.0) << "channel " << c;
  // A portrait PNG: the height becomes the limit, the output is a JPEG.
  DecodedImage img;
  decoder.decode_full(jpeg, img, "big.jpg");
  std::vector<std::uint8_t> rgb;
  for (int y = 0; y < 300; ++y) {
    for (int x = 0; x < 200; ++x) {
      const std::uint8_t* p = img.row(y) + 4 * x;
      rgb.insert(rgb.end(), {p[2], p[1], p[0]});
    }
  }
  const auto png = encode_png(rgb.data(), 200, 300);
  ASSERT_TRUE(shrink_image(decoder, png, 150, 90, out, "tall.png"));
  EXPECT_EQ(sniff_format(out), ImageFormat::jpeg);
  h = decoder.header(out, "out");
  EXPECT_EQ(h.width, 100);
  EXPECT_EQ(h.height, 150);
  EXPECT_FALSE(shrink_image(decoder, png, 300, 90, out, "tall.png"));
  // Grayscale stays one channel; CMYK comes out as a colour JPEG of the same picture.
  for (const JpegKind kind : {JpegKind::grayscale, JpegKind::cmyk, JpegKind::progressive}) {
    SyntheticImageSpec k;
    k.width = 301;  // odd sizes: the halvings drop a last column or row
    k.height = 203;
    k.kind = kind;
    const auto src = make_synthetic_jpeg(5, 2, 1, k);
    ASSERT_TRUE(shrink_image(decoder, src, 75, 90, out, "kind.jpg"));
    h = decoder.header(out, "out");
    EXPECT_EQ(h.width, 75);
    EXPECT_EQ(h.height, 51);  // 203 * 75 / 301 = 50.6
    EXPECT_EQ(h.components, kind == JpegKind::grayscale ? 1 : 3);
    const auto a = mean_colour(decoder, src), b = mean_colour(decoder, out);
    for (std::size_t c = 0; c < 3; ++c)
      EXPECT_NEAR(a[c], b[c], 3.0) << "kind " << static_cast<int>(kind) << " channel " << c;
  }
}

TEST_F(DatasetTest, PackRefusesAbsurdSettingsAndNamesABadSample) {
  ImageFolder folder(data_.folder);
  PackConfig bad;
  bad.max_side = 4;
  EXPECT_THROW(pack_shards(folder, dir_.path() / "x", bad), ConfigError);
  bad.max_side = 100;
  bad.quality = 101;
  EXPECT_THROW(pack_shards(folder, dir_.path() / "x", bad), ConfigError);
  bad.quality = 90;
  bad.per_shard = 0;
  EXPECT_THROW(pack_shards(folder, dir_.path() / "x", bad), ConfigError);
  // A truncated JPEG among the files: a DataError naming it, and no shard.
  testing::TempDir other;
  const auto broken = other.path() / "data" / "class00" / "broken.jpg";
  std::vector<std::byte> bytes;
  folder.read(5, bytes);
  bytes.resize(bytes.size() / 3);
  testing::write_bytes(broken, bytes);
  ImageFolder with_bad(other.path() / "data");
  PackConfig config;
  config.max_side = 50;
  try {
    pack_shards(with_bad, other.path() / "out" / "p", config);
    FAIL() << "a truncated JPEG was packed";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("broken.jpg"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(other.path() / "out" / "p-000000.tar"));
}

TEST(ShardPatternTest, ExpandsBracesAndLists) {
  EXPECT_EQ(expand_shard_pattern("d/s-{08..11}.tar"),
            (std::vector<std::filesystem::path>{"d/s-08.tar", "d/s-09.tar", "d/s-10.tar", "d/s-11.tar"}));
  EXPECT_EQ(expand_shard_pattern("a.tar,b.tar").size(), 2U);
  // What is neither a list nor a range stays literal, as braceexpand keeps
  // it: a pipe: command's ${VAR} or awk program, an unmatched brace.
  using P = std::vector<std::filesystem::path>;
  EXPECT_EQ(expand_shard_pattern("s-{x..1}.tar"), (P{"s-{x..1}.tar"}));
  EXPECT_EQ(expand_shard_pattern("s-{1..2.tar"), (P{"s-{1..2.tar"}));
  EXPECT_EQ(expand_shard_pattern("pipe:curl -s ${BASE}/s-{0..1}.tar"),
            (P{"pipe:curl -s ${BASE}/s-0.tar", "pipe:curl -s ${BASE}/s-1.tar"}));
  EXPECT_EQ(expand_shard_pattern("s-{-1..1}.tar"), (P{"s--1.tar", "s-0.tar", "s-1.tar"}));
}

// webdataset's braceexpand is the oracle (tests/python/test_webdataset.py
// compares the two on the same patterns); these are its rules.
TEST(ShardPatternTest, EveryGroupListsAndRangesExpandAsWebdatasetDoes) {
  using P = std::vector<std::filesystem::path>;
  EXPECT_EQ(expand_shard_pattern("s-{0..1}-{0..1}.tar"), (P{"s-0-0.tar", "s-0-1.tar", "s-1-0.tar", "s-1-1.tar"}));
  EXPECT_EQ(expand_shard_pattern("other/{a,b}.tar"), (P{"other/a.tar", "other/b.tar"}));
  EXPECT_EQ(expand_shard_pattern("{x,y{1..2}}.tar"), (P{"x.tar", "y1.tar", "y2.tar"}));   // nested
  EXPECT_EQ(expand_shard_pattern("s-{3..1}.tar"), (P{"s-3.tar", "s-2.tar", "s-1.tar"}));  // down
  EXPECT_EQ(expand_shard_pattern("s-{0..10..5}.tar"), (P{"s-0.tar", "s-5.tar", "s-10.tar"}));
  EXPECT_EQ(expand_shard_pattern("s-{8..010}.tar"), (P{"s-008.tar", "s-009.tar", "s-010.tar"}));
  EXPECT_EQ(expand_shard_pattern("s-{a..c}.tar"), (P{"s-a.tar", "s-b.tar", "s-c.tar"}));
  // A literal comma or brace: escaped with a backslash.
  EXPECT_EQ(expand_shard_pattern("pipe:cut -d\\, -f1 x.tar,b.tar"), (P{"pipe:cut -d, -f1 x.tar", "b.tar"}));
  EXPECT_EQ(expand_shard_pattern("s3://b/k\\,1.tar"), (P{"s3://b/k,1.tar"}));
  EXPECT_EQ(expand_shard_pattern("d/\\{x\\}.tar"), (P{"d/{x}.tar"}));
  EXPECT_THROW((void)expand_shard_pattern("s-{0..999999}-{0..9}.tar"), ConfigError);  // over a million names
}

}  // namespace
}  // namespace pinfeed::loader
