// Checkpoints (checkpoint.cpp), through train() on real JPEGs on the CPU
// backend and through save_checkpoint/load_checkpoint: a resumed run is the
// uninterrupted one bit for bit; a writer killed or signalled mid-save leaves
// the old checkpoint and no temporary; crafted, misplaced and mismatched
// files are named errors.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "fixtures.hpp"
#include "image_fixtures.hpp"
#include "pinfeed/trainer/checkpoint.hpp"
#include "pinfeed/trainer/cpu_backend.hpp"
#include "pinfeed/trainer/cuda_backend.hpp"
#include "pinfeed/trainer/model.hpp"
#include "pinfeed/trainer/trainer.hpp"
#include "train_fixtures.hpp"

namespace pinfeed::trainer {
namespace {

class CheckpointTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    data_ = new testing::SmallDataset(testing::make_small_dataset(dir_->path(), 4, 16));
  }
  static void TearDownTestSuite() {
    delete data_;
    delete dir_;
  }

  static TrainConfig config(int workers) {
    return testing::tiny_train_config(data_->folder.string(), fmt::format("cpu:{}", workers));
  }

  static testing::TempDir* dir_;
  static testing::SmallDataset* data_;
};
testing::TempDir* CheckpointTest::dir_ = nullptr;
testing::SmallDataset* CheckpointTest::data_ = nullptr;

TEST_F(CheckpointTest, ResumingFromACheckpointReproducesTheUninterruptedRun) {
  testing::TempDir tmp;
  TrainConfig c = config(2);
  c.epochs = 3;
  const TrainResult straight = train(c);

  c.checkpoint = tmp.path() / "run.ckpt";
  c.max_steps = 6;  // stops in the middle of epoch 1
  const TrainResult first = train(c);
  EXPECT_EQ(first.steps, 6U);
  const Checkpoint saved = load_checkpoint(c.checkpoint);
  EXPECT_EQ(saved.epoch, 1U);
  EXPECT_EQ(saved.position, 2U * 8U) << "two steps of 8 samples per rank into epoch 1";

  c.max_steps = 0;
  c.resume = true;
  const TrainResult resumed = train(c);
  EXPECT_EQ(resumed.steps, 12U);
  EXPECT_EQ(resumed.weights, straight.weights) << "bit-for-bit on the CPU backend";

  c.global_batch = 32;
  EXPECT_THROW(train(c), ConfigError) << "a checkpoint of another configuration is refused";
}

TEST_F(CheckpointTest, AWriterKilledBeforeTheRenameLeavesTheOldCheckpoint) {
  testing::TempDir tmp;
  const auto path = tmp.path() / "model.ckpt";
  Checkpoint old;
  old.step = 5;
  old.weights = {1, 2, 3};
  old.momentum = {0, 0, 0};
  save_checkpoint(path, old);
  Checkpoint next = old;
  next.step = 6;
  next.weights = {4, 5, 6};
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    save_checkpoint(path, next, SaveHooks{[] { ::kill(::getpid(), SIGKILL); }});
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status));
  const Checkpoint read = load_checkpoint(path);
  EXPECT_EQ(read.step, 5U);
  EXPECT_EQ(read.weights, old.weights);
  // And a damaged file is refused with its name.
  {
    std::FILE* f = std::fopen(path.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    std::fseek(f, 40, SEEK_SET);
    std::fputc('x', f);
    std::fclose(f);
  }
  try {
    (void)load_checkpoint(path);
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("model.ckpt"), std::string::npos);
  }
}

TEST_F(CheckpointTest, SigtermDuringASaveRemovesTheTemporaryAndExitsWith143) {
  testing::TempDir tmp;
  const auto path = tmp.path() / "model.ckpt";
  Checkpoint c;
  c.weights = {1, 2, 3};
  c.momentum = {0, 0, 0};
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    install_checkpoint_signal_handlers();
    // The temporary is complete when the signal comes (the real handler, a
    // real signal); the save goes on until the signal thread has it.
    save_checkpoint(path, c, SaveHooks{[] {
                      ::kill(::getpid(), SIGTERM);
                      while (!termination_requested()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
                    }});
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  for (const auto& e : std::filesystem::directory_iterator(tmp.path())) ADD_FAILURE() << "left behind: " << e.path();
}

TEST_F(CheckpointTest, OneRunHoldsACheckpointAndRemovesKilledWritersTemporaries) {
  testing::TempDir tmp;
  const auto path = tmp.path() / "run.ckpt";
  testing::write_file(tmp.path() / ".run.ckpt.tmp.4242", "a killed writer's");
  testing::write_file(tmp.path() / ".run.ckpt.tmp.7.tmp.1", "another checkpoint's (run.ckpt.tmp.7)");
  {
    const CheckpointLock held(path);
    EXPECT_EQ(held.removed_temporaries(), 1U);
    EXPECT_FALSE(std::filesystem::exists(tmp.path() / ".run.ckpt.tmp.4242"));
    EXPECT_TRUE(std::filesystem::exists(tmp.path() / ".run.ckpt.tmp.7.tmp.1"));
    try {
      const CheckpointLock second(path);
      FAIL() << "two runs hold one checkpoint";
    } catch (const DataError& e) {
      EXPECT_NE(e.reason().find("another run is writing this checkpoint"), std::string::npos) << e.reason();
      EXPECT_NE(e.reason().find(fmt::format("pid {}", ::getpid())), std::string::npos) << e.reason();
    }
    // Through a symlink to the same file: the same lock.
    std::filesystem::create_symlink("run.ckpt", tmp.path() / "link.ckpt");
    EXPECT_THROW(CheckpointLock{tmp.path() / "link.ckpt"}, DataError);
  }
  const CheckpointLock again(path);  // released with its holder
}

TEST_F(CheckpointTest, ACheckpointPathThatIsASymlinkIsWrittenThroughIt) {
  testing::TempDir tmp;
  std::filesystem::create_directories(tmp.path() / "store");
  const auto link = tmp.path() / "latest.ckpt";
  std::filesystem::create_symlink("store/run-7.ckpt", link);
  Checkpoint c;
  c.step = 3;
  c.weights = {1, 2};
  c.momentum = {0, 0};
  loader::DatasetFingerprint f;
  f.samples = 2;
  f.num_classes = 2;
  f.classes = {"caf\xe9", "ok"};  // not UTF-8: stored with U+FFFD, compared that way
  f.hash = 0xfedcba9876543210ULL;
  c.dataset = f;
  check_checkpoint_writable(link);
  save_checkpoint(link, c);
  save_checkpoint(link, c);  // the second replaces the target, not the link
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_EQ(load_checkpoint(tmp.path() / "store/run-7.ckpt").step, 3U);
  const Checkpoint read = load_checkpoint(link);
  ASSERT_TRUE(read.dataset.has_value());
  EXPECT_EQ(read.dataset->hash, f.hash);
  EXPECT_EQ(read.dataset->samples, 2U);
  EXPECT_EQ(loader::describe_change(*read.dataset, f), "");
  f.classes[1] = "ok2";
  EXPECT_EQ(loader::describe_change(*read.dataset, f), "class 'ok' renamed to 'ok2'");
}

std::string read_all(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST_F(CheckpointTest, ACheckpointOfAnotherShapeIsRefusedAndNotRewritten) {
  testing::TempDir tmp;
  TrainConfig c = config(1);
  c.epochs = 1;
  // 192 inputs (3 x 8 x 8), 4 classes: hidden 1,38 and 2,5 both have 425
  // parameters, so a parameter count check alone lets one resume as the other.
  c.model.hidden = {1, 38};
  c.checkpoint = tmp.path() / "run.ckpt";
  c.max_steps = 1;
  (void)train(c);
  const auto bytes = [&] { return read_all(c.checkpoint); };
  const auto before = bytes();
  c.model.hidden = {2, 5};
  c.resume = true;
  c.max_steps = 0;
  try {
    (void)train(c);
    FAIL() << "resumed a checkpoint of another model shape";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("model is mlp:1,38, this run has mlp:2,5"), std::string::npos) << what;
  }
  EXPECT_EQ(bytes(), before) << "a refused checkpoint was rewritten";
}

TEST_F(CheckpointTest, CraftedAndMisplacedCheckpointsAreNamedErrors) {
  testing::TempDir tmp;
  const auto path = tmp.path() / "c.ckpt";
  Checkpoint ok;
  ok.weights = {1, 2, 3};
  ok.momentum = {0, 0, 0};
  save_checkpoint(path, ok);
  // A parameter count that makes 2 * n * 4 wrap to the real data size.
  {
    const std::string text = read_all(path);
    const auto at = text.find("\"params\":3");
    ASSERT_NE(at, std::string::npos);
    // 2^62 + 3: 2 * n * 4 == 24 (mod 2^64), the size of the real data. Same length
    // header is impossible, so rewrite the header and its length and checksum.
    nlohmann::json h = nlohmann::json::parse(text.substr(16, text.size() - 16 - 24 - 8));
    h["params"] = (std::uint64_t{1} << 62U) + 3;
    const std::string header = h.dump();
    std::string out = text.substr(0, 8);
    const std::uint64_t len = header.size();
    out.append(reinterpret_cast<const char*>(&len), 8);
    out += header;
    out += text.substr(text.size() - 8 - 24, 24);
    const std::uint64_t sum = crc32_z(crc32_z(0, nullptr, 0), reinterpret_cast<const Bytef*>(out.data()), out.size());
    out.append(reinterpret_cast<const char*>(&sum), 8);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << out;
  }
  try {
    (void)load_checkpoint(path);
    FAIL() << "a crafted parameter count was accepted";
  } catch (const DataError& e) {
    EXPECT_EQ(e.path(), path);
    EXPECT_NE(e.reason().find("parameter"), std::string::npos) << e.reason();
  }
  // A checkpoint of the previous format says so instead of "corrupt".
  {
    save_checkpoint(path, ok);
    std::string text = read_all(path);
    text[7] = '1';
    std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
    try {
      (void)load_checkpoint(path);
      FAIL();
    } catch (const DataError& e) {
      EXPECT_NE(e.reason().find("format 01"), std::string::npos) << e.reason();
    }
  }
  // Not a regular file: refused without blocking.
  const auto fifo = tmp.path() / "fifo.ckpt";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THROW((void)load_checkpoint(fifo), DataError);
  EXPECT_THROW(check_checkpoint_writable(fifo), DataError);
  // A folder that does not exist is found before training, naming it.
  TrainConfig c = config(1);
  c.checkpoint = tmp.path() / "missing" / "run.ckpt";
  try {
    (void)train(c);
    FAIL();
  } catch (const DataError& e) {
    EXPECT_EQ(e.path(), tmp.path() / "missing");
  }
  // A write that fails leaves no temporary behind (a directory in the way of the rename).
  std::filesystem::create_directories(tmp.path() / "dir.ckpt" / "x");
  EXPECT_THROW(save_checkpoint(tmp.path() / "dir.ckpt", ok), DataError);
  for (const auto& e : std::filesystem::directory_iterator(tmp.path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace pinfeed::trainer
