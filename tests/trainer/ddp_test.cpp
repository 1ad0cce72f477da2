// Data-parallel training on the CPU backend, through train() on real JPEGs:
// N workers with B/N each reach the weights of 1 worker with B; bucketing and
// no_sync do not change the result; slots outlive their copies; a CNN
// resumes with its running statistics (checkpoint files: checkpoint_test.cpp).
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

class DdpTest : public ::testing::Test {
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
testing::TempDir* DdpTest::dir_ = nullptr;
testing::SmallDataset* DdpTest::data_ = nullptr;

TEST_F(DdpTest, NWorkersWithBOverNEachReachTheWeightsOfOneWorkerWithB) {
  const TrainResult one = train(config(1));
  ASSERT_EQ(one.epochs.size(), 2U);
  EXPECT_EQ(one.steps, 8U);
  EXPECT_EQ(one.communicator, "solo");
  for (const int n : {2, 4}) {
    const TrainResult many = train(config(n));
    EXPECT_EQ(many.world_size, n);
    EXPECT_LE(testing::relative_difference(many.weights, one.weights), 1e-5) << n << " workers";
    for (std::size_t e = 0; e < 2; ++e) {
      EXPECT_NEAR(one.epochs[e].loss, many.epochs[e].loss, 1e-4) << n << " workers, epoch " << e;
      EXPECT_EQ(one.epochs[e].samples, many.epochs[e].samples);
    }
  }
}

/// The CNN (cnn:4,8 at 16 px) in place of the MLP.
TrainConfig cnn(TrainConfig c, bool sync_bn) {
  c.model.kind = ModelKind::cnn;
  c.model.channels = {4, 8};
  c.model.sync_bn = sync_bn;
  c.lr = 0.4;
  return c;
}

TEST_F(DdpTest, WithSyncBnNCnnWorkersWithBOverNEachReachTheWeightsOfOneWorkerWithB) {
  const TrainResult one = train(cnn(config(1), true));
  for (const int n : {2, 4}) {
    const TrainResult many = train(cnn(config(n), true));
    EXPECT_LE(testing::relative_difference(many.weights, one.weights), 1e-4) << n << " workers";
    EXPECT_NEAR(one.epochs.back().loss, many.epochs.back().loss, 1e-4) << n << " workers";
  }
  // Without SyncBN each worker normalizes by its own 4 samples' statistics:
  // another computation, and other weights. By how much, for the record.
  const TrainResult own = train(cnn(config(4), false));
  const double apart = testing::relative_difference(own.weights, one.weights);
  ::testing::Test::RecordProperty("relative_difference_without_sync_bn", fmt::format("{:.4g}", apart));
  std::printf("4 workers without SyncBN: weights %.4g (relative) from 1 worker's after %zu steps\n", apart,
              static_cast<std::size_t>(own.steps));
  EXPECT_GT(apart, 1e-2);
}

TEST_F(DdpTest, TheProfileAccountsForEachStepOnlyWhenAsked) {
  TrainConfig c = cnn(config(2), true);
  EXPECT_FALSE(train(c).epochs.back().profile.measured);
  c.profile = true;
  const TrainResult r = train(c);
  for (const EpochSummary& e : r.epochs) {
    const StepProfile& p = e.profile;
    ASSERT_TRUE(p.measured);
    EXPECT_GT(p.forward, 0);
    EXPECT_GT(p.backward, 0);
    for (const double part : {p.wait, p.copy, p.allreduce, p.allreduce_exposed, p.optimizer}) EXPECT_GE(part, 0);
    // The compute stream's parts of a step fit in the step's wall time.
    const double step = e.seconds / static_cast<double>(e.steps);
    EXPECT_LE(p.forward + p.backward + p.allreduce_exposed + p.optimizer, 1.2 * step) << "epoch " << e.epoch;
  }
}

TEST_F(DdpTest, TheCnnResumesBitForBitWithItsRunningStatistics) {
  testing::TempDir tmp;
  TrainConfig c = cnn(config(2), false);
  c.epochs = 3;
  c.val_dataset = data_->folder.string();
  const TrainResult straight = train(c);
  c.checkpoint = tmp.path() / "cnn.ckpt";
  c.max_steps = 6;
  (void)train(c);
  const Checkpoint saved = load_checkpoint(c.checkpoint);
  EXPECT_EQ(saved.model.spec(), "cnn:4,8");
  ASSERT_EQ(saved.buffers.size(), 2U * (4 + 8)) << "running mean and variance per channel";
  EXPECT_NE(saved.buffers[0], 0.0F) << "the running mean moved off its initial 0";
  c.max_steps = 0;
  c.resume = true;
  const TrainResult resumed = train(c);
  EXPECT_EQ(resumed.weights, straight.weights);
  EXPECT_EQ(resumed.epochs.back().val_accuracy, straight.epochs.back().val_accuracy)
      << "evaluation uses the checkpointed running statistics";
  c.model.channels = {8, 4};
  EXPECT_THROW(train(c), ConfigError) << "a checkpoint of another CNN is refused";
}

TEST(ModelConfigTest, EverySpecReadsBackAsTheSameModel) {
  for (const char* text : {"mlp:256,128", "mlp:", "cnn:32,64,128", "cnn:8"}) {
    ModelConfig m;
    m.parse_spec(text);
    EXPECT_EQ(m.spec(), text);
    ModelConfig again;
    again.parse_spec(m.spec());
    EXPECT_EQ(again.spec(), m.spec());
  }
  ModelConfig m;
  m.parse_spec("cnn");
  EXPECT_EQ(m.spec(), "cnn:32,64,128") << "the default widths";
  for (const char* bad : {"cnn:0", "cnn:4,", "resnet", "mlp:x", "cnn:-2"})
    EXPECT_THROW(m.parse_spec(bad), ConfigError) << bad;
}

// The model registry: every row names, parses, validates and builds its
// own kind, and what callers ask of it (BatchNorm, pool) is what the model
// it makes does. A new row that forgets one fails here.
TEST(ModelConfigTest, EveryModelTypeSpellsParsesAndBuildsItsKind) {
  CpuBackend backend;
  for (const ModelType* t : model_types()) {
    SCOPED_TRACE(std::string(t->word));
    EXPECT_EQ(&model_type(t->kind), t);
    EXPECT_EQ(&model_type(t->word, "model"), t);
    ModelConfig m;
    m.image_size = 16;
    m.pool = 4;
    m.classes = 3;
    m.parse_spec(std::string(t->word) + ":4,6");
    EXPECT_EQ(m.kind, t->kind);
    EXPECT_EQ(m.*t->widths, (std::vector<int>{4, 6}));
    EXPECT_EQ(m.spec(), std::string(t->word) + ":4,6");
    EXPECT_NO_THROW(m.validate());
    const std::unique_ptr<Model> model = make_model(backend, m, 2);
    EXPECT_EQ(model->config().kind, t->kind);
    EXPECT_GT(model->param_count(), 0U);
    EXPECT_EQ(model->buffer_count() > 0, t->uses_batch_norm) << "BatchNorm keeps running statistics";
    EXPECT_EQ(model->initial_buffers().size(), model->buffer_count());
    m.pool = 5;  // does not divide 16
    if (t->uses_pool) {
      EXPECT_THROW(m.validate(), ConfigError);
    } else {
      EXPECT_NO_THROW(m.validate());
    }
  }
  try {
    (void)model_type("resnet", "--model 'resnet'");
    ADD_FAILURE() << "an unknown model kind was found";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("expected mlp[:W,W...] or cnn[:C,C...]"), std::string::npos) << e.what();
  }
}

TEST_F(DdpTest, TheModelLearnsTheSyntheticClasses) {
  TrainConfig c = config(2);
  c.epochs = 6;
  const TrainResult r = train(c);
  ASSERT_EQ(r.epochs.size(), 6U);
  EXPECT_LT(r.epochs.back().loss, 0.6 * r.epochs.front().loss);
  EXPECT_GT(r.epochs.back().accuracy, 0.7);
  EXPECT_EQ(r.epochs.back().pinned_batches + r.epochs.back().pageable_batches, 8U) << "4 steps x 2 workers";
  EXPECT_GE(r.epochs.back().data_wait_fraction, 0.0);
  EXPECT_LE(r.epochs.back().data_wait_fraction, 1.0);
}

TEST_F(DdpTest, BucketCapsDoNotChangeTheResult) {
  TrainConfig c = config(2);
  c.epochs = 1;
  const TrainResult base = train(c);
  for (const std::size_t cap : {std::size_t{4}, std::size_t{256}, std::size_t{1} << 30U}) {
    c.ddp.bucket_cap_bytes = cap;
    c.ddp.first_bucket_bytes = cap;
    EXPECT_EQ(train(c).weights, base.weights) << "bucket cap " << cap;
  }
}

TEST_F(DdpTest, NoSyncAccumulationEqualsOneLargeBatch) {
  TrainConfig c = config(2);
  c.epochs = 1;
  const TrainResult large = train(c);
  c.accumulation = 2;
  const TrainResult accumulated = train(c);
  EXPECT_EQ(accumulated.steps, large.steps);
  EXPECT_LE(testing::relative_difference(accumulated.weights, large.weights), 1e-5);
}

TEST_F(DdpTest, NoSlotIsReusedBeforeItsCopyCompletes) {
  // A slow copy reads each slot long after the loader handed it over; a slot
  // reused early would be overwritten by a later batch mid-copy, and the
  // weights would differ from the run with instant copies.
  TrainConfig c = config(1);
  c.epochs = 1;
  c.loader.prefetch = 2;
  const TrainResult fast = train(c);
  c.copy_delay = std::chrono::milliseconds(30);
  const TrainResult slow = train(c);
  EXPECT_EQ(slow.weights, fast.weights);
}

TEST_F(DdpTest, PageableSlotsTrainExactlyLikePinnedOnes) {
  // After a pressure fallback slots are pageable; the copy path is the same
  // call and must give the same result.
  TrainConfig c = config(2);
  c.epochs = 1;
  const TrainResult pinned = train(c);
  c.loader.pin = false;
  const TrainResult pageable = train(c);
  EXPECT_EQ(pageable.weights, pinned.weights);
  EXPECT_EQ(pageable.epochs[0].pageable_batches, 8U);
  EXPECT_EQ(pageable.epochs[0].pinned_batches, 0U);
  EXPECT_EQ(pinned.epochs[0].pinned_batches, 8U);
}

TEST_F(DdpTest, PressureMidTrainingShrinksThePoolAndGrowsItBackWithoutChangingTheResult) {
  // Each worker's loader watches a procfs copy whose PSI the test rewrites
  // while training runs: critical, then calm again.
  using namespace std::chrono_literals;
  testing::TempDir root;
  testing::copy_fixture("v1-host", root.path());
  const auto psi_file = root.path() / "proc/pressure/memory";
  using testing::psi;
  testing::write_file(psi_file, psi(0, 0));
  TrainConfig c = config(2);
  c.epochs = 20;
  c.copy_delay = 5ms;  // at least 20 x 4 x 5 ms = 400 ms of training
  c.loader.watch_pressure = false;
  const TrainResult calm = train(c);

  c.loader.watch_pressure = true;
  c.loader.pressure.root = root.path();
  c.loader.pressure.period = 10ms;
  c.loader.pressure.hold = 50ms;
  // The storm starts with the first step, not at a fixed time after
  // train() is called: setup takes longer under a sanitizer on a busy machine.
  std::promise<void> first_step;
  std::once_flag once;
  TrainCallbacks cb;
  cb.on_step = [&](const StepProgress&) { std::call_once(once, [&] { first_step.set_value(); }); };
  std::jthread weather([&, started = first_step.get_future()]() mutable {
    started.wait();
    std::this_thread::sleep_for(30ms);
    testing::write_file(psi_file, psi(60, 30));  // critical
    std::this_thread::sleep_for(150ms);
    testing::write_file(psi_file, psi(0, 0));  // calm
  });
  const auto release_weather = [&] { std::call_once(once, [&] { first_step.set_value(); }); };
  TrainResult stormy;
  try {
    stormy = train(c, cb);
  } catch (...) {
    release_weather();
    throw;
  }
  release_weather();
  weather.join();
  std::uint64_t pinned = 0, pageable = 0;
  for (const auto& e : stormy.epochs) {
    pinned += e.pinned_batches;
    pageable += e.pageable_batches;
  }
  EXPECT_EQ(pinned + pageable, 20U * 8U) << "every batch delivered";
  EXPECT_GT(pinned, 0U);
  EXPECT_GT(stormy.epochs.back().pool_transitions, 0U) << "3 slots, floor 2: one was given back";
  EXPECT_GT(stormy.epochs.back().pool_given_back_bytes, 0U);
  EXPECT_EQ(stormy.weights, calm.weights) << "nothing lost, nothing repeated";
}

TEST_F(DdpTest, ThePinnedFigureCountsEveryPoolOfTheProcessAsVmLckDoes) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ASan and TSan intercept mlock and make it a no-op; the release build runs this test";
#endif
  // Two workers, each with a training and a validation loader: four pools.
  // Epoch 0's report: the other worker cannot be tearing its pools down
  // then (epoch 1 starts with a collective that waits for this one).
  TrainConfig c = config(2);
  c.epochs = 2;
  c.val_dataset = data_->folder.string();
  c.loader.pin_method = memory::PinMethod::mlock;
  std::uint64_t reported = 0, locked = 0;
  const auto vm_lck = [] {
    std::ifstream in("/proc/self/status");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("VmLck:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
    }
    return 0ULL;
  };
  TrainCallbacks cb;
  cb.on_epoch = [&](const EpochSummary& s) {
    if (s.epoch != 0) return;
    reported = s.pool_pinned_bytes;
    locked = vm_lck();
  };
  (void)train(c, cb);
  ASSERT_GT(locked, 0U) << "nothing was pinned (memlock limit?)";
  EXPECT_EQ(reported, locked) << "the report must count every pool the process holds";
}

TEST_F(DdpTest, AValidationLabelPastTheModelsClassesIsNamedNotReadPastTheRow) {
  testing::TempDir tmp;
  const auto list = tmp.path() / "val.txt";
  std::ofstream(list) << (data_->folder / "class00/img000.jpg").string() << " 0\n"
                      << (data_->folder / "class01/img001.jpg").string() << " 7\n";
  TrainConfig c = config(1);
  c.epochs = 1;
  c.val_dataset = list.string();
  try {
    (void)train(c);
    FAIL() << "a validation label of 7 with 4 training classes was used";
  } catch (const DataError& e) {
    EXPECT_NE(e.path().string().find("img001.jpg"), std::string::npos) << e.what();
    EXPECT_NE(e.reason().find("label 7"), std::string::npos) << e.what();
  }
}

TEST_F(DdpTest, NothingIsAllocatedOnceTheCollectivesHaveBegun) {
  // Note [No allocation during collectives]: on a GPU, a cudaMalloc while
  // another worker's collective waits for this one can deadlock. Every
  // buffer (inputs, statistics, validation, reduction staging) is made
  // before the first broadcast; from the first step on, nothing.
  TrainConfig c = config(2);
  c.epochs = 3;
  c.val_dataset = data_->folder.string();
  std::uint64_t at_first_step = 0;
  std::once_flag once;
  TrainCallbacks cb;
  cb.on_step = [&](const StepProgress&) { std::call_once(once, [&] { at_first_step = CpuBackend::allocations(); }); };
  (void)train(c, cb);
  const std::uint64_t at_end = CpuBackend::allocations();
  ASSERT_GT(at_first_step, 0U);
  EXPECT_EQ(at_end, at_first_step) << "allocations after the first step: " << at_end - at_first_step;
}

TEST_F(DdpTest, EveryThreadThatDrivesABackendMadeItCurrentFirst) {
  // On a GPU, a thread whose first CUDA call precedes cudaSetDevice makes a
  // context on device 0 (issue 11): the CPU backend counts such calls.
  {
    CpuBackend backend;
    const std::uint64_t before = CpuBackend::calls_off_current();
    std::thread([&] { (void)backend.allocate(64); }).join();
    EXPECT_EQ(CpuBackend::calls_off_current(), before + 1) << "the mechanism must see a thread that skipped it";
    std::thread([&] {
      backend.make_current();
      (void)backend.allocate(64);
    }).join();
    EXPECT_EQ(CpuBackend::calls_off_current(), before + 1);
  }
  // Training, validation, collectives, checkpoints: every thread of it.
  testing::TempDir tmp;
  TrainConfig c = config(2);
  c.val_dataset = data_->folder.string();
  c.checkpoint = tmp.path() / "m.ckpt";
  const std::uint64_t before = CpuBackend::calls_off_current();
  (void)train(c);
  EXPECT_EQ(CpuBackend::calls_off_current(), before);
}

TEST_F(DdpTest, FreeingWhileAStreamHasWorkIsCountedAndAFailedRunNeverDoesIt) {
  using namespace std::chrono_literals;
  // The mechanism: a buffer freed while a stream still copies.
  {
    CpuBackend backend(CpuBackendConfig{0, 50ms});
    auto stream = backend.create_stream();
    std::vector<float> host(16, 1.0F);
    DeviceBuffer target = backend.allocate(host.size() * sizeof(float));
    DeviceBuffer other = backend.allocate(64);
    const std::uint64_t before = CpuBackend::frees_with_work_pending();
    backend.copy_h2d(*stream, target.get(), host.data(), host.size() * sizeof(float));
    other = DeviceBuffer();  // freed with the copy still queued
    EXPECT_EQ(CpuBackend::frees_with_work_pending(), before + 1);
    backend.synchronize(*stream);
  }
  // A worker failing mid-epoch (a corrupt file under the fail policy) with
  // copies and compute in flight: its teardown drains before it frees.
  testing::TempDir tmp;
  const auto list = tmp.path() / "list.txt";
  {
    std::ofstream out(list);
    for (const auto& e : std::filesystem::recursive_directory_iterator(data_->folder)) {
      if (e.is_regular_file())
        out << e.path().string() << " " << e.path().parent_path().filename().string().substr(5) << "\n";
    }
    testing::write_file(tmp.path() / "broken.jpg", "not an image");
    out << (tmp.path() / "broken.jpg").string() << " 0\n";
  }
  TrainConfig c = config(2);
  c.loader.dataset = list.string();
  c.loader.on_bad_sample = loader::BadSamplePolicy::fail;
  c.loader.shuffle = true;
  c.copy_delay = 2ms;
  const std::uint64_t before = CpuBackend::frees_with_work_pending();
  EXPECT_THROW((void)train(c), DataError);
  EXPECT_EQ(CpuBackend::frees_with_work_pending(), before) << "a buffer was freed while its stream still had work";
}

TEST_F(DdpTest, BadConfigurationsAreClearErrors) {
  TrainConfig c = config(3);
  try {
    (void)train(c);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("not divisible by the 3 workers"), std::string::npos) << e.what();
  }
  c = config(4);
  c.global_batch = 256;  // 64 per worker, 16 samples per worker
  try {
    (void)train(c);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("make no step"), std::string::npos) << e.what();
  }
  c = config(1);
  c.devices = parse_devices("cuda:0");
  if (cuda_device_count() == 0) {
    EXPECT_THROW(train(c), ConfigError);
  }
  EXPECT_THROW(parse_devices("tpu:1"), ConfigError);
  EXPECT_THROW(parse_devices("cpu:0"), ConfigError);
  EXPECT_THROW(parse_devices("cuda:0,0"), ConfigError);
  EXPECT_EQ(parse_devices("cuda:1,3").devices, (std::vector<int>{1, 3}));
}

}  // namespace
}  // namespace pinfeed::trainer
