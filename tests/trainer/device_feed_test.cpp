// DeviceFeed (device_feed.hpp): loader batches copied to a device on a copy
// stream, the slot returned after the copy's event (Note [Slot lifetime]),
// the batch handed to a consumer stream that waits for it, and its device
// buffers reused only after that consumer's work (Note [Consumer streams]).
// On the CPU backend with delayed copies and a slow consumer stream, so that
// any of these returned early would let the next batch overwrite memory that
// is still to be read.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "image_fixtures.hpp"
#include "pinfeed/loader/loader.hpp"
#include "pinfeed/trainer/cpu_backend.hpp"
#include "pinfeed/trainer/device_feed.hpp"

namespace pinfeed::trainer {
namespace {

using namespace std::chrono_literals;

loader::LoaderConfig config(const std::filesystem::path& folder, loader::Layout layout) {
  loader::LoaderConfig c;
  c.dataset = folder.string();
  c.batch_size = 4;
  c.threads = 2;
  c.prefetch = 2;  // every slot the pool hands back is decoded into at once
  c.seed = 5;
  c.shuffle = true;
  c.transform.size = 24;
  c.transform.layout = layout;
  c.watch_pressure = false;
  c.pin_method = memory::PinMethod::mlock;
  return c;
}

/// Every batch of epoch 0 as the host path makes it (float32 NCHW), copied out.
std::vector<std::vector<float>> host_batches(const loader::LoaderConfig& c) {
  loader::Loader l(c);
  l.begin_epoch(0);
  std::vector<std::vector<float>> out;
  while (auto b = l.next()) {
    const auto* f = reinterpret_cast<const float*>(b->data().data());
    out.emplace_back(f, f + b->data().size() / sizeof(float));
  }
  return out;
}

struct FeedTest : ::testing::Test {
  testing::TempDir dir;
  testing::SmallDataset data = testing::make_small_dataset(dir.path(), 2, 10);
  std::vector<std::vector<float>> want = host_batches(config(data.folder, loader::Layout::nchw_f32));
};

TEST_F(FeedTest, BatchesOnTheDeviceEqualTheHostBatches) {
  CpuBackendConfig bc;
  bc.copy_delay = 10ms;  // the copy reads the slot 10 ms after it is enqueued
  auto backend = std::make_shared<CpuBackend>(bc);
  backend->make_current();
  const auto c = config(data.folder, loader::Layout::nhwc_u8);
  loader::Loader l(c);
  DeviceFeed feed(backend, DeviceFeedOptions{true, Normalization{c.transform.mean, c.transform.std}});
  l.begin_epoch(0);
  std::size_t i = 0;
  while (auto b = l.next()) {
    const std::vector<std::int64_t> labels(b->labels().begin(), b->labels().end());
    auto d = feed.submit(std::move(*b));
    d->hand_to(0);  // this thread is the consumer: blocks until the batch is there
    ASSERT_LT(i, want.size());
    ASSERT_TRUE(d->floats());
    EXPECT_EQ(d->shape()[1], 3);
    const auto* got = static_cast<const float*>(d->images());
    ASSERT_EQ(want[i].size(), d->size() * 3 * 24 * 24);
    EXPECT_EQ(std::memcmp(got, want[i].data(), want[i].size() * sizeof(float)), 0) << "batch " << i;
    EXPECT_TRUE(std::equal(labels.begin(), labels.end(), d->labels()));
    ++i;
  }
  EXPECT_EQ(i, want.size());
  const auto s = feed.stats();
  EXPECT_EQ(s.batches, want.size());
  EXPECT_LE(s.device_buffers, 2U) << "one batch alive at a time: the ring needs one or two";
}

TEST_F(FeedTest, BuffersAreWrittenAgainOnlyAfterTheConsumersWork) {
  // The consumer is a stream that reads each batch 20 ms after it is handed
  // over, after the batch was dropped: the feed must not copy the next
  // batches into those buffers before that read.
  auto backend = std::make_shared<CpuBackend>(CpuBackendConfig{});
  backend->make_current();
  const auto c = config(data.folder, loader::Layout::nhwc_u8);
  loader::Loader l(c);
  DeviceFeed feed(backend, DeviceFeedOptions{true, Normalization{c.transform.mean, c.transform.std}});
  auto consumer = backend->create_stream();
  const auto handle = reinterpret_cast<std::uintptr_t>(consumer.get());
  std::vector<std::vector<float>> read(want.size());
  l.begin_epoch(0);
  std::size_t i = 0;
  while (auto b = l.next()) {
    auto d = feed.submit(std::move(*b));
    d->hand_to(handle);
    const auto* src = static_cast<const float*>(d->images());
    std::vector<float>* dst = &read.at(i);
    const std::size_t n = d->size() * 3 * 24 * 24;
    backend->enqueue(*consumer, [src, dst, n] {
      std::this_thread::sleep_for(20ms);
      dst->assign(src, src + n);
    });
    d.reset();  // dropped while the consumer's read is still queued
    ++i;
  }
  backend->synchronize(*consumer);
  ASSERT_EQ(i, want.size());
  for (std::size_t k = 0; k < want.size(); ++k) EXPECT_EQ(read[k], want[k]) << "batch " << k;
  EXPECT_LE(feed.stats().device_buffers, 3U);
}

TEST_F(FeedTest, AHostBatchsSlotGoesBackAfterItsConsumersQueuedRead) {
  // device=None's rule: the batch is handed out as host memory, a consumer
  // stream queues a read of it (20 ms later), the batch is dropped at once.
  // Fenced on that stream, its slot is decoded into again only after the read.
  auto backend = std::make_shared<CpuBackend>(CpuBackendConfig{});
  backend->make_current();
  auto c = config(data.folder, loader::Layout::nchw_f32);
  loader::Loader l(c);
  auto consumer = backend->create_stream();
  const std::vector<ConsumerStream> consumers{{backend, reinterpret_cast<std::uintptr_t>(consumer.get())}};
  std::vector<std::vector<float>> read(want.size());
  l.begin_epoch(0);
  std::size_t i = 0;
  while (auto b = l.next()) {
    const auto* src = reinterpret_cast<const float*>(b->data().data());
    const std::size_t n = b->data().size() / sizeof(float);
    std::vector<float>* dst = &read.at(i++);
    backend->enqueue(*consumer, [src, dst, n] {
      std::this_thread::sleep_for(20ms);
      dst->assign(src, src + n);
    });
    release_after_consumers(b->lease(), consumers);
  }
  backend->synchronize(*consumer);
  ASSERT_EQ(i, want.size());
  for (std::size_t k = 0; k < want.size(); ++k) EXPECT_EQ(read[k], want[k]) << "batch " << k;
}

TEST_F(FeedTest, TheCopyStreamsTimesAreCounted) {
  CpuBackendConfig bc;
  bc.copy_delay = 5ms;
  auto backend = std::make_shared<CpuBackend>(bc);
  backend->make_current();
  const auto c = config(data.folder, loader::Layout::nhwc_u8);
  loader::Loader l(c);
  DeviceFeed feed(backend, DeviceFeedOptions{true, Normalization{c.transform.mean, c.transform.std}});
  l.begin_epoch(0);
  std::size_t batches = 0;
  while (auto b = l.next()) {
    feed.submit(std::move(*b))->hand_to(0);
    ++batches;
  }
  const auto s = feed.stats();
  // Two copies per batch (samples, labels), 5 ms each at least.
  EXPECT_GE(s.copy_seconds, static_cast<double>(batches) * 2 * 0.005 * 0.9);
  EXPECT_GT(s.bytes, 0U);
  EXPECT_GE(s.wait_consumer_seconds, 0.0);
}

TEST_F(FeedTest, BatchesMayOutliveTheirFeed) {
  auto backend = std::make_shared<CpuBackend>(CpuBackendConfig{});
  backend->make_current();
  const auto c = config(data.folder, loader::Layout::nhwc_u8);
  loader::Loader l(c);
  std::shared_ptr<DeviceBatch> kept;
  {
    DeviceFeed feed(backend, DeviceFeedOptions{false, {}});
    l.begin_epoch(0);
    auto b = l.next();
    ASSERT_TRUE(b);
    kept = feed.submit(std::move(*b));
    kept->hand_to(0);
  }
  EXPECT_FALSE(kept->floats());  // not normalized: the slot's uint8 NHWC
  EXPECT_EQ(kept->shape()[3], 3);
  kept.reset();  // the feed's state goes with its last batch
  EXPECT_EQ(CpuBackend::frees_with_work_pending(), 0U);
}

}  // namespace
}  // namespace pinfeed::trainer
