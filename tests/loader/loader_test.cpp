// The Loader end to end: real JPEGs through the flow graph into pool slots.
#include <gtest/gtest.h>

#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/info.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <thread>

#include "fixtures.hpp"
#include "image_fixtures.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/loader/image_decoder.hpp"
#include "pinfeed/loader/loader.hpp"
#include "pinfeed/loader/synthetic.hpp"
#include "pinfeed/loader/tar_writer.hpp"

namespace pinfeed::loader {
namespace {

struct Collected {
  std::vector<std::size_t> indices;
  std::vector<std::int64_t> labels;
  std::vector<std::int32_t> slot_labels;
  std::vector<std::vector<std::byte>> data;  // per batch
  std::vector<std::size_t> sizes;
  std::size_t pinned = 0, pageable = 0, replaced = 0;
};

Collected drain(Loader& loader) {
  Collected c;
  for (Batch& b : loader) {
    c.indices.insert(c.indices.end(), b.indices().begin(), b.indices().end());
    c.labels.insert(c.labels.end(), b.labels().begin(), b.labels().end());
    c.slot_labels.insert(c.slot_labels.end(), b.slot_labels().begin(), b.slot_labels().end());
    // The slot's labels sit after the samples, inside the slot.
    const auto* slot_end = b.lease().bytes().data() + b.lease().bytes().size();
    EXPECT_GE(reinterpret_cast<const std::byte*>(b.slot_labels().data()), b.data().data() + b.data().size());
    EXPECT_LE(reinterpret_cast<const std::byte*>(b.slot_labels().data() + b.size()), slot_end);
    c.data.emplace_back(b.data().begin(), b.data().end());
    c.sizes.push_back(b.size());
    (b.pinned() ? c.pinned : c.pageable) += 1;
    c.replaced += b.replaced();
  }
  return c;
}

class LoaderTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spdlog::set_level(spdlog::level::warn); }
  LoaderConfig config(const std::string& dataset) const {
    LoaderConfig c;
    c.dataset = dataset;
    c.list_root = dir_.path();
    c.batch_size = 4;
    c.prefetch = 2;
    c.threads = 2;
    c.seed = 5;
    c.transform.size = 32;
    c.watch_pressure = false;
    return c;
  }
  testing::TempDir dir_;
  testing::SmallDataset data_ = testing::make_small_dataset(dir_.path(), 3, 5);  // 15 images
};

TEST_F(LoaderTest, DeliversTheSamplersOrderInFullBatchesAndOneMarkedPartialBatch) {
  Loader loader(config(data_.folder.string()));
  ASSERT_EQ(loader.batches_per_epoch(), 4U);
  loader.begin_epoch(0);
  const Collected c = drain(loader);
  EXPECT_EQ(c.sizes, (std::vector<std::size_t>{4, 4, 4, 3})) << "15 samples: the last batch says it holds 3";
  EXPECT_EQ(c.indices, DistributedSampler({15, 0, 1, true, false, 5}).indices(0));
  for (std::size_t i = 0; i < c.indices.size(); ++i) EXPECT_EQ(c.labels[i], loader.dataset().label(c.indices[i]));
  ASSERT_EQ(c.slot_labels.size(), c.labels.size());
  for (std::size_t i = 0; i < c.labels.size(); ++i) EXPECT_EQ(c.slot_labels[i], c.labels[i]) << "sample " << i;
  EXPECT_EQ(c.pinned, 4U) << "root may pin: every slot is pinned";
  EXPECT_EQ(c.data[0].size(), 4 * 3 * 32 * 32 * sizeof(float));
  const LoaderStats st = loader.stats();
  EXPECT_EQ(st.samples, 15U);
  EXPECT_GT(st.decode_seconds, 0.0);
  EXPECT_EQ(st.pool.free_slots, 2U) << "every slot came back";
}

TEST_F(LoaderTest, SeveralLoadersInOneProcessEachGetTheirThreads) {
  // oneTBB's worker pool is process-wide; two trainer workers' loaders must
  // together be allowed all their threads, not the smaller of two limits.
  namespace tbb = oneapi::tbb;
  const auto dc = static_cast<unsigned>(tbb::info::default_concurrency());
  auto cfg = config(data_.folder.string());
  cfg.threads = dc;
  {
    Loader a(cfg), b(cfg);
    EXPECT_GE(tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism), 2 * dc + 1);
    {
      Loader c(cfg);
      EXPECT_GE(tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism), 3 * dc + 1);
    }
    EXPECT_GE(tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism), 2 * dc + 1);
  }
}

TEST_F(LoaderTest, BatchesAreByteIdenticalWithOneThreadOrMany) {
  // One loader at a time: TBB's thread limit is the least any live loader asks for.
  const auto run = [&](unsigned threads, std::size_t prefetch) {
    auto cfg = config(data_.folder.string());
    cfg.threads = threads;
    cfg.prefetch = prefetch;
    Loader loader(cfg);
    loader.begin_epoch(2);
    return drain(loader);
  };
  const Collected ca = run(1, 2), cb = run(4, 3);
  EXPECT_EQ(ca.indices, cb.indices);
  EXPECT_EQ(ca.data, cb.data);
}

TEST_F(LoaderTest, DecodingWholeImagesGivesTheSamplesOfRegionDecoding) {
  // --no-roi (a measurement mode) decodes every image whole and cuts the
  // region out of the rows as they pass; the samples must be those of the
  // region decode, up to libjpeg's edge upsampling at a crop's iMCU border.
  const auto run = [&](bool roi) {
    auto cfg = config(data_.folder.string());
    cfg.transform.layout = Layout::nhwc_u8;
    cfg.transform.roi_decode = roi;
    cfg.transform.dct_scaling = false;  // no-ROI decodes at full size
    Loader loader(cfg);
    loader.begin_epoch(1);
    return drain(loader);
  };
  const Collected roi = run(true), whole = run(false);
  ASSERT_EQ(roi.indices, whole.indices);
  ASSERT_EQ(roi.data.size(), whole.data.size());
  double diff = 0, bytes = 0;
  for (std::size_t b = 0; b < roi.data.size(); ++b) {
    ASSERT_EQ(roi.data[b].size(), whole.data[b].size());
    for (std::size_t i = 0; i < roi.data[b].size(); ++i) {
      diff += std::abs(static_cast<int>(roi.data[b][i]) - static_cast<int>(whole.data[b][i]));
    }
    bytes += static_cast<double>(roi.data[b].size());
  }
  EXPECT_LT(diff / bytes, 0.5) << "mean difference per byte";
}

TEST_F(LoaderTest, FolderListAndShardsGiveTheSameBatches) {
  Loader folder(config(data_.folder.string())), list(config(data_.list.string())), shards(config(data_.shards));
  folder.begin_epoch(1);
  list.begin_epoch(1);
  shards.begin_epoch(1);
  const Collected a = drain(folder), b = drain(list), c = drain(shards);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_EQ(a.labels, c.labels);
  EXPECT_EQ(a.data, b.data);
  EXPECT_EQ(a.data, c.data);
}

TEST_F(LoaderTest, ResumingGivesExactlyTheRestOfTheEpoch) {
  auto cfg = config(data_.folder.string());
  cfg.transform.layout = Layout::nhwc_u8;
  Loader whole(cfg);
  whole.begin_epoch(3);
  const Collected all = drain(whole);

  LoaderState saved;
  {
    Loader first(cfg);
    first.begin_epoch(3);
    auto b0 = first.next();
    auto b1 = first.next();
    ASSERT_TRUE(b0 && b1);
    saved = first.state();
    EXPECT_EQ(saved.position, 8U);
  }  // destroyed mid-epoch: threads joined, slots returned
  Loader second(cfg);
  second.restore(saved);
  const Collected rest = drain(second);
  ASSERT_EQ(rest.data.size(), 2U);
  EXPECT_EQ(rest.data[0], all.data[2]);
  EXPECT_EQ(rest.data[1], all.data[3]);
  EXPECT_EQ(std::vector<std::size_t>(all.indices.begin() + 8, all.indices.end()), rest.indices);

  LoaderState wrong = saved;
  wrong.seed = 99;
  EXPECT_THROW(second.restore(wrong), ConfigError);
}

TEST_F(LoaderTest, ShardsAcrossRanksCoverTheDatasetWithEqualBatchCounts) {
  std::map<std::size_t, int> seen;
  std::size_t batches = 0;
  for (unsigned rank = 0; rank < 4; ++rank) {
    auto cfg = config(data_.folder.string());
    cfg.rank = rank;
    cfg.world_size = 4;
    Loader loader(cfg);
    loader.begin_epoch(0);
    const Collected c = drain(loader);
    if (rank == 0) batches = c.sizes.size();
    EXPECT_EQ(c.sizes.size(), batches) << "every rank yields as many batches";
    for (const auto i : c.indices) ++seen[i];
  }
  EXPECT_EQ(seen.size(), 15U);
}

/// A file list mixing good images with every kind of bad file.
std::filesystem::path corrupt_list(const testing::TempDir& dir, const testing::SmallDataset& data) {
  const auto bad = dir.path() / "bad";
  std::filesystem::create_directories(bad / "a_directory.jpg");
  std::ifstream in(data.folder / "class00/img000.jpg", std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto as_bytes = [](const std::vector<char>& v) { return std::as_bytes(std::span(v)); };
  testing::write_bytes(bad / "truncated.jpg",
                       as_bytes(std::vector<char>(bytes.begin(), bytes.begin() + static_cast<long>(bytes.size() / 3))));
  testing::write_bytes(bad / "zero.jpg", {});
  testing::write_bytes(bad / "random.jpg", as_bytes(std::vector<char>(3000, 'q')));
  testing::write_bytes(bad / "png.jpg",
                       as_bytes(std::vector<char>{'\x89', 'P', 'N', 'G', '\r', '\n', '\x1a', '\n', 0, 0}));
  std::vector<char> huge = bytes;
  for (std::size_t i = 0; i + 8 < huge.size(); ++i) {
    if (huge[i] == '\xff' && huge[i + 1] == '\xc0') {
      huge[i + 5] = '\xea', huge[i + 6] = '\x60', huge[i + 7] = '\xea', huge[i + 8] = '\x60';
      break;
    }
  }
  testing::write_bytes(bad / "huge.jpg", as_bytes(huge));
  const auto list = dir.path() / "corrupt.txt";
  std::ofstream out(list);
  int n = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(data.folder)) {
    if (entry.is_regular_file())
      out << std::filesystem::relative(entry.path(), dir.path()).string() << " " << (n++ % 3) << "\n";
  }
  for (const char* name :
       {"truncated.jpg", "zero.jpg", "random.jpg", "png.jpg", "huge.jpg", "a_directory.jpg", "missing.jpg"}) {
    out << "bad/" << name << " 1\n";
  }
  return list;
}

TEST_F(LoaderTest, BadSamplesAreReplacedDeterministicallyAndCounted) {
  auto cfg = config(corrupt_list(dir_, data_).string());
  cfg.shuffle = false;
  cfg.max_replaced_share = 0.5;  // 7 of 22: far over the default budget (see the next test)
  Loader loader(cfg);
  loader.begin_epoch(0);
  const Collected c = drain(loader);
  EXPECT_EQ(c.sizes, (std::vector<std::size_t>{4, 4, 4, 4, 4, 2})) << "22 entries, every batch full but the last";
  EXPECT_EQ(c.replaced, 7U) << "the 7 bad entries were each replaced";
  EXPECT_EQ(loader.stats().replaced, 7U);
  for (const auto i : c.indices) EXPECT_LT(i, 15U) << "substitutes are good samples of this shard";
  Loader again(cfg);
  again.begin_epoch(0);
  EXPECT_EQ(drain(again).indices, c.indices) << "substitutes are deterministic";
}

TEST_F(LoaderTest, ReplacingMoreThanTheBudgetFailsTheEpochWithCounts) {
  auto cfg = config(corrupt_list(dir_, data_).string());
  cfg.shuffle = false;  // default max_replaced_share: 1% of 22 samples, so no replacement at all
  Loader loader(cfg);
  loader.begin_epoch(0);
  try {
    while (loader.next()) {
    }
    FAIL() << "7 bad files of 22 were replaced silently";
  } catch (const DataError& e) {
    EXPECT_NE(e.path().string().find("bad/"), std::string::npos) << e.what();
    EXPECT_NE(e.reason().find("budget"), std::string::npos) << e.reason();
    EXPECT_NE(e.reason().find("class 1"), std::string::npos) << e.reason();
  }
  cfg.max_replaced_share = 0.2;  // 4 of 22 allowed: the fifth bad sample fails it
  Loader some(cfg);
  some.begin_epoch(0);
  EXPECT_THROW(while (some.next()){}, DataError);
  // One corrupt file in a small set is within the default budget (at least one).
  std::ofstream one(dir_.path() / "one-bad.txt");
  for (const auto& e : std::filesystem::recursive_directory_iterator(data_.folder)) {
    if (e.is_regular_file()) one << std::filesystem::relative(e.path(), dir_.path()).string() << " 0\n";
  }
  one << "bad/zero.jpg 0\n";
  one.close();
  Loader small(config((dir_.path() / "one-bad.txt").string()));
  small.begin_epoch(0);
  EXPECT_EQ(drain(small).replaced, 1U);
}

TEST_F(LoaderTest, AClassWithNoDecodableSampleFailsTheEpoch) {
  // Class 3 exists only as corrupt files: replacing them all would train
  // on a dataset without it.
  std::ofstream list(dir_.path() / "lost.txt");
  for (int i = 0; i < 3; ++i) {  // first: the dropped last partial batch must not hold them
    testing::write_file(dir_.path() / fmt::format("lost/{}.jpg", i), "not an image");
    list << "lost/" << i << ".jpg 3\n";
  }
  for (const auto& e : std::filesystem::recursive_directory_iterator(data_.folder)) {
    if (e.is_regular_file()) list << std::filesystem::relative(e.path(), dir_.path()).string() << " 0\n";
  }
  list.close();
  auto cfg = config((dir_.path() / "lost.txt").string());
  cfg.max_replaced_share = 1.0;  // the budget alone would let it through
  cfg.drop_last_batch = true;    // as the trainer runs it: it never asks past the last batch
  cfg.shuffle = false;
  Loader loader(cfg);
  loader.begin_epoch(0);
  try {
    for (std::size_t i = 0; i < loader.batches_per_epoch(); ++i) ASSERT_TRUE(loader.next().has_value());
    FAIL() << "a class with no decodable sample passed";
  } catch (const DataError& e) {
    EXPECT_NE(e.reason().find("class 3"), std::string::npos) << e.reason();
    EXPECT_NE(e.path().string().find("lost/"), std::string::npos) << e.what();
  }
}

TEST_F(LoaderTest, PngAndWebPClassesAreDecodedNotReplaced) {
  // A folder with a JPEG class, a PNG class and a WebP class (one WebP file
  // named .jpg: the bytes decide), as torchvision's ImageFolder reads it.
  const auto root = dir_.path() / "mixed";
  for (std::uint64_t i = 0; i < 4; ++i) {
    SyntheticImageSpec spec;
    spec.width = 80 + 4 * static_cast<int>(i);
    spec.height = 60;
    testing::write_bytes(root / "a_jpeg" / fmt::format("{}.jpg", i), make_synthetic_image(3, 0, i, spec, "jpeg"));
    testing::write_bytes(root / "b_png" / fmt::format("{}.png", i), make_synthetic_image(3, 1, i, spec, "png"));
    testing::write_bytes(root / "c_webp" / fmt::format("{}.{}", i, i == 0 ? "jpg" : "webp"),
                         make_synthetic_image(3, 2, i, spec, "webp"));
  }
  auto cfg = config(root.string());
  cfg.max_replaced_share = 0;
  Loader loader(cfg);
  loader.begin_epoch(0);
  const Collected c = drain(loader);
  EXPECT_EQ(c.replaced, 0U);
  std::map<std::int64_t, int> per_class;
  for (const auto l : c.labels) ++per_class[l];
  EXPECT_EQ(per_class, (std::map<std::int64_t, int>{{0, 4}, {1, 4}, {2, 4}}));
  // The same through tar shards (pinfeed-data pack keeps each format's extension).
  {
    TarWriter tar(dir_.path() / "mixed.tar");
    ImageFolder folder(root);
    std::vector<std::byte> bytes;
    for (std::size_t i = 0; i < folder.size(); ++i) {
      folder.read(i, bytes);
      const auto key = fmt::format("{:04}", i);
      tar.add(key + "." + std::string(extension(sniff_format(bytes))), bytes);
      const std::string label = std::to_string(folder.label(i));
      tar.add(key + ".cls", std::as_bytes(std::span(label)));
    }
    tar.finish();
  }
  auto tcfg = config((dir_.path() / "mixed.tar").string());
  tcfg.max_replaced_share = 0;
  Loader shards(tcfg);
  shards.begin_epoch(0);
  const Collected t = drain(shards);
  EXPECT_EQ(t.replaced, 0U);
  EXPECT_EQ(t.labels.size(), 12U);
}

TEST_F(LoaderTest, APoolLargerThanTheHostsMemoryIsRefusedBeforeMapping) {
  // swap-active: MemAvailable 3 GiB. 4 slots of 64 x 3 x 1024 x 1024 float32 (768 MiB each) = 3 GiB.
  auto cfg = config(data_.folder.string());
  cfg.watch_pressure = true;
  cfg.pressure.root = testing::data_dir() / "procfs" / "swap-active";
  cfg.batch_size = 64;
  cfg.transform.size = 1024;
  cfg.prefetch = 4;
  cfg.local_ranks = 1;
  try {
    Loader loader(cfg);
    FAIL() << "a 3 GiB pool was accepted with 3 GiB available";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("3 slot(s) of this size fit"), std::string::npos) << what;
    EXPECT_NE(what.find("prefetch"), std::string::npos) << what;
  }
  // Eight ranks on the host: each may use an eighth; not one slot fits.
  cfg.local_ranks = 8;
  try {
    Loader loader(cfg);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("not one slot"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("8 local ranks"), std::string::npos) << e.what();
  }
}

TEST_F(LoaderTest, LocalRanksComeFromTheLauncherAndRequirePinnedSaysWhy) {
  auto cfg = config(data_.folder.string());
  cfg.watch_pressure = true;
  cfg.pressure.root = testing::data_dir() / "procfs" / "tight-memlock";  // RLIMIT_MEMLOCK 64 KiB, no CAP_IPC_LOCK
  cfg.pin_method = memory::PinMethod::mlock;
  ::setenv("LOCAL_WORLD_SIZE", "4", 1);
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  cfg.local_ranks = 0;
  const Loader from_env(cfg);
  ::unsetenv("LOCAL_WORLD_SIZE");
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  EXPECT_EQ(from_env.pin_report().local_ranks, 4U);
  // Two slots of 40 KiB (4 x 3 x 28 x 28 floats, then the int32 labels),
  // 48 KiB of memlock left: one is pinned, and the reason says why.
  cfg.local_ranks = 1;
  cfg.transform.size = 28;
  EXPECT_EQ(cfg.slot_bytes(), 4U * 3 * 28 * 28 * 4 + 4 * sizeof(std::int32_t));
  const Loader lax(cfg);
  EXPECT_EQ(lax.pin_report().slots, 2U);
  EXPECT_EQ(lax.pin_report().pinned_slots, 1U);
  EXPECT_NE(lax.pin_report().reason.find("memlock"), std::string::npos) << lax.pin_report().reason;
  cfg.require_pinned = true;
  try {
    Loader loader(cfg);
    FAIL() << "require_pinned with a tight memlock limit";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("memlock"), std::string::npos) << e.what();
  }
}

TEST_F(LoaderTest, TheFailPolicyStopsWithAnErrorNamingTheFile) {
  auto cfg = config(corrupt_list(dir_, data_).string());
  cfg.shuffle = false;
  cfg.on_bad_sample = BadSamplePolicy::fail;
  Loader loader(cfg);
  loader.begin_epoch(0);
  try {
    while (loader.next()) {
    }
    FAIL() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_NE(e.path().string().find("bad/"), std::string::npos) << e.what();
  }
  loader.begin_epoch(1);  // the loader is usable again
  EXPECT_THROW(while (loader.next()){}, DataError);
}

TEST_F(LoaderTest, PressureMidEpochShrinksThePoolWithoutLosingASample) {
  auto cfg = config(data_.folder.string());
  cfg.prefetch = 8;
  cfg.pressure_floor = 2;
  cfg.batch_size = 1;
  Loader loader(cfg);
  loader.begin_epoch(0);
  std::vector<std::size_t> indices;
  std::size_t n = 0, while_shrunk = 0, settled = 0;
  std::uint64_t waits_at_floor = 0, waits_then = 0;
  while (auto b = loader.next()) {
    indices.insert(indices.end(), b->indices().begin(), b->indices().end());
    const LoaderStats ls = loader.stats();
    const memory::PoolStats& st = ls.pool;
    if (st.released_slots == 6) {
      ++while_shrunk;
      // Note [Tokens follow the pool]: once the run lets no more batches be
      // out than the floor has slots, no decode task waits in acquire() for
      // a slot. Tasks that blocked while the slabs drained are counted when
      // they return, so the count is taken once none is blocked.
      if (settled == 0 && ls.allowed_in_flight <= st.live_slots && st.waiting_acquires == 0) {
        settled = while_shrunk;
        waits_at_floor = st.acquire_waits;
      }
      if (settled != 0) waits_then = st.acquire_waits;
    }
    if (++n == 2) loader.pool().on_pressure(memory::PressureLevel::critical);
    if (n == 13) loader.pool().on_pressure(memory::PressureLevel::normal);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // let the maintenance thread move idle slabs
  }
  EXPECT_EQ(indices, DistributedSampler({15, 0, 1, true, false, 5}).indices(0)) << "nothing lost or repeated";
  EXPECT_GT(while_shrunk, 0U) << "batches kept flowing from the floor's slots";
  ASSERT_NE(settled, 0U) << "the run never settled to the floor's slots";
  EXPECT_GT(while_shrunk, settled + 1) << "batches kept flowing after it settled";
  EXPECT_EQ(waits_then, waits_at_floor) << "a batch task blocked on a released slot holds a decode thread";
  ASSERT_TRUE(loader.pool().wait_idle(std::chrono::seconds(5)));
  const memory::PoolStats st = loader.pool().stats();
  EXPECT_EQ(st.releases, 6U) << "8 slots, floor 2";
  EXPECT_EQ(st.live_slots, 8U) << "grown back";
}

TEST_F(LoaderTest, MovingABatchOverAnotherReturnsTheOverwrittenSlot) {
  Loader loader(config(data_.folder.string()));
  loader.begin_epoch(0);
  std::optional<Batch> a = loader.next(), b = loader.next();
  ASSERT_TRUE(a && b);
  const std::size_t second = b->index();
  const std::vector<std::int64_t> labels(b->labels().begin(), b->labels().end());
  *a = std::move(*b);  // a's slot and token go back; a now holds b's batch
  EXPECT_EQ(a->index(), second);
  EXPECT_EQ(std::vector<std::int64_t>(a->labels().begin(), a->labels().end()), labels);
  EXPECT_EQ(b->size(), 0U) << "moved-from";
  std::size_t rest = 0;
  while (auto c = loader.next()) rest += 1;  // the epoch can finish: no slot was lost
  EXPECT_EQ(rest, 2U);
  a.reset();
  b.reset();
  EXPECT_TRUE(loader.pool().wait_idle(std::chrono::seconds(5)));
  EXPECT_EQ(loader.pool().stats().free_slots, 2U);
}

TEST_F(LoaderTest, RejectsBadConfigAndMissingData) {
  auto cfg = config(data_.folder.string());
  cfg.batch_size = 0;
  EXPECT_THROW(Loader{cfg}, ConfigError);
  cfg = config((dir_.path() / "nowhere").string());
  EXPECT_THROW(Loader{cfg}, DataError);
  cfg = config(data_.folder.string());
  cfg.transform.size = 2;
  EXPECT_THROW(Loader{cfg}, ConfigError);
  Loader loader(config(data_.folder.string()));
  EXPECT_THROW((void)loader.next(), ConfigError) << "next() before begin_epoch()";
}

}  // namespace
}  // namespace pinfeed::loader
