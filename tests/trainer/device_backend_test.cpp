// DeviceBackend contract: every backend (CpuBackend here; CudaBackend where a
// GPU is present, in device_backend_gpu_test) must pass these. Reference
// results are computed on the host with plain loops.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "fixtures.hpp"
#include "image_fixtures.hpp"
#include "pinfeed/loader/loader.hpp"
#include "pinfeed/trainer/cpu_backend.hpp"
#include "pinfeed/trainer/cuda_backend.hpp"
#include "pinfeed/trainer/device_type.hpp"
#include "pinfeed/trainer/trainer.hpp"

namespace pinfeed::trainer {
namespace {

struct CpuFactory {
  static std::unique_ptr<DeviceBackend> make() { return std::make_unique<CpuBackend>(); }
};
struct CudaFactory {
  static std::unique_ptr<DeviceBackend> make() {
    if (cuda_device_count() == 0) return nullptr;
    return make_cuda_backend(0);
  }
};

#ifdef PINFEED_TEST_CUDA
using Backends = ::testing::Types<CudaFactory>;
#else
using Backends = ::testing::Types<CpuFactory>;
#endif

template <class F>
class DeviceBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend = F::make();
    if (!backend) GTEST_SKIP() << "no CUDA device on this machine";
    stream = backend->create_stream();
  }
  std::vector<float> download(const DeviceBuffer& b, std::size_t count) {
    std::vector<float> out(count);
    backend->copy_d2h(*stream, out.data(), b.get(), count * sizeof(float));
    backend->synchronize(*stream);
    return out;
  }
  DeviceBuffer upload(const std::vector<float>& v) {
    DeviceBuffer b = backend->allocate(v.size() * sizeof(float));
    backend->copy_h2d(*stream, b.get(), v.data(), v.size() * sizeof(float));
    backend->synchronize(*stream);
    return b;
  }
  std::unique_ptr<DeviceBackend> backend;
  std::unique_ptr<Stream> stream;
};
TYPED_TEST_SUITE(DeviceBackendTest, Backends);

std::vector<float> random_floats(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

TYPED_TEST(DeviceBackendTest, RoundTripAndZeroedAllocation) {
  const auto v = random_floats(1000, 1);
  DeviceBuffer b = this->upload(v);
  EXPECT_EQ(this->download(b, v.size()), v);
  DeviceBuffer z = this->backend->allocate(64 * sizeof(float));
  EXPECT_EQ(this->download(z, 64), std::vector<float>(64, 0.0F));
}

TYPED_TEST(DeviceBackendTest, StreamWaitOrdersWorkAcrossStreams) {
  // Stream A fills a buffer; stream B, told to wait for A's event, copies it.
  auto a = this->backend->create_stream();
  DeviceBuffer src = this->backend->allocate(1 << 22);
  DeviceBuffer dst = this->backend->allocate(1 << 22);
  const std::size_t n = (1 << 22) / sizeof(float);
  for (int round = 0; round < 5; ++round) {
    const auto value = static_cast<float>(round + 1);
    this->backend->fill(*a, src.as<float>(), n, value);
    auto ev = this->backend->create_event();
    this->backend->record(*ev, *a);
    this->backend->stream_wait(*this->stream, *ev);
    this->backend->copy_d2d(*this->stream, dst.get(), src.get(), n * sizeof(float));
    const auto out = this->download(dst, n);
    EXPECT_EQ(out.front(), value);
    EXPECT_EQ(out.back(), value);
    EXPECT_TRUE(ev->ready());
  }
}

TYPED_TEST(DeviceBackendTest, ARecycledEventWaitsForItsLatestRecording) {
  // The trainer reuses events from a ring: re-recording resets one, and
  // wait() (a blocking sync on CUDA) returns once the latest work is done.
  DeviceBuffer d = this->backend->allocate(1 << 22);
  const std::size_t n = (1 << 22) / sizeof(float);
  auto ev = this->backend->create_event();
  for (int round = 0; round < 3; ++round) {
    const auto value = static_cast<float>(round + 7);
    this->backend->fill(*this->stream, d.as<float>(), n, value);
    this->backend->record(*ev, *this->stream);
    ev->wait();
    EXPECT_TRUE(ev->ready());
    std::vector<float> back(n);
    auto s2 = this->backend->create_stream();
    this->backend->copy_d2h(*s2, back.data(), d.get(), n * sizeof(float));
    this->backend->synchronize(*s2);
    EXPECT_EQ(back.back(), value) << "round " << round;
  }
  EXPECT_GE(static_cast<int>(this->backend->host_pin_method()), 0);
}

TYPED_TEST(DeviceBackendTest, GemmMatchesHostLoopsForEveryTranspose) {
  const int m = 7, n = 5, k = 9;
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      const auto a = random_floats(static_cast<std::size_t>(m * k), 2);
      const auto b = random_floats(static_cast<std::size_t>(k * n), 3);
      const auto c0 = random_floats(static_cast<std::size_t>(m * n), 4);
      DeviceBuffer da = this->upload(a), db = this->upload(b), dc = this->upload(c0);
      Gemm g;
      g.trans_a = ta;
      g.trans_b = tb;
      g.m = m;
      g.n = n;
      g.k = k;
      g.alpha = 0.5F;
      g.beta = 2.0F;
      g.a = da.as<float>();
      g.lda = ta ? m : k;
      g.b = db.as<float>();
      g.ldb = tb ? k : n;
      g.c = dc.as<float>();
      g.ldc = n;
      this->backend->gemm(*this->stream, g);
      const auto c = this->download(dc, c0.size());
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          double sum = 0;
          for (int p = 0; p < k; ++p) {
            const float av = ta ? a[static_cast<std::size_t>(p * m + i)] : a[static_cast<std::size_t>(i * k + p)];
            const float bv = tb ? b[static_cast<std::size_t>(j * k + p)] : b[static_cast<std::size_t>(p * n + j)];
            sum += static_cast<double>(av) * bv;
          }
          const double want = 0.5 * sum + 2.0 * c0[static_cast<std::size_t>(i * n + j)];
          EXPECT_NEAR(c[static_cast<std::size_t>(i * n + j)], want, 1e-5) << "ta=" << ta << " tb=" << tb;
        }
      }
    }
  }
}

TYPED_TEST(DeviceBackendTest, SoftmaxCrossEntropyGradientMatchesFiniteDifferences) {
  const int n = 3, k = 4;
  const auto logits = random_floats(static_cast<std::size_t>(n * k), 5);
  const std::vector<std::int32_t> labels{2, 0, 3};
  DeviceBuffer dl = this->upload(logits);
  DeviceBuffer lab = this->backend->allocate(labels.size() * sizeof(std::int32_t));
  this->backend->copy_h2d(*this->stream, lab.get(), labels.data(), labels.size() * sizeof(std::int32_t));
  DeviceBuffer grad = this->backend->allocate(logits.size() * sizeof(float));
  DeviceBuffer stats = this->backend->allocate(2 * sizeof(float));
  this->backend->softmax_cross_entropy(*this->stream, dl.as<float>(), lab.as<std::int32_t>(), n, k, 1.0F, grad.as<float>(),
                                       stats.as<float>());
  const auto g = this->download(grad, logits.size());
  const auto st = this->download(stats, 2);
  const auto mean_loss = [&](const std::vector<float>& z) {
    double total = 0;
    for (int i = 0; i < n; ++i) {
      double s = 0;
      for (int j = 0; j < k; ++j) s += std::exp(static_cast<double>(z[static_cast<std::size_t>(i * k + j)]));
      total += std::log(s) - z[static_cast<std::size_t>(i * k + labels[static_cast<std::size_t>(i)])];
    }
    return total / n;
  };
  EXPECT_NEAR(st[0] / n, mean_loss(logits), 1e-5);
  for (std::size_t i = 0; i < logits.size(); ++i) {
    auto up = logits, down = logits;
    up[i] += 1e-3F;
    down[i] -= 1e-3F;
    const double numeric = (mean_loss(up) - mean_loss(down)) / 2e-3;
    EXPECT_NEAR(g[i], numeric, 1e-3) << "logit " << i;
  }
}

TYPED_TEST(DeviceBackendTest, PoolBiasReluAndSgdMatchTheirDefinitions) {
  // avg_pool 2x2 over a 1 x 1 x 4 x 4 image.
  std::vector<float> img(16);
  std::iota(img.begin(), img.end(), 0.0F);
  DeviceBuffer di = this->upload(img);
  DeviceBuffer pooled = this->backend->allocate(4 * sizeof(float));
  this->backend->avg_pool(*this->stream, di.as<float>(), pooled.as<float>(), 1, 1, 4, 4, 2);
  EXPECT_EQ(this->download(pooled, 4), (std::vector<float>{2.5F, 4.5F, 10.5F, 12.5F}));

  DeviceBuffer z = this->upload({-1, 2, 3, -4});
  DeviceBuffer bias = this->upload({0.5F, 1.0F});
  DeviceBuffer a = this->backend->allocate(4 * sizeof(float));
  this->backend->bias_activation(*this->stream, z.as<float>(), bias.as<float>(), a.as<float>(), 2, 2, true);
  EXPECT_EQ(this->download(z, 4), (std::vector<float>{-0.5F, 3, 3.5F, -3}));
  EXPECT_EQ(this->download(a, 4), (std::vector<float>{0, 3, 3.5F, 0}));
  DeviceBuffer g = this->upload({1, 1, 1, 1});
  this->backend->relu_backward(*this->stream, g.as<float>(), z.as<float>(), 4);
  EXPECT_EQ(this->download(g, 4), (std::vector<float>{0, 1, 1, 0}));
  DeviceBuffer db = this->upload({10, 20});
  this->backend->bias_grad(*this->stream, z.as<float>(), db.as<float>(), 2, 2);
  EXPECT_EQ(this->download(db, 2), (std::vector<float>{13, 20}));

  DeviceBuffer w = this->upload({1, -2}), gr = this->upload({0.5F, 0.25F}), mom = this->upload({0.1F, 0});
  this->backend->sgd(*this->stream, w.as<float>(), gr.as<float>(), mom.as<float>(), 2, SgdStep{0.1F, 0.9F, 0.01F});
  // g' = g + wd w; m = 0.9 m + g'; w -= lr m
  const float m0 = 0.9F * 0.1F + (0.5F + 0.01F * 1), m1 = 0.9F * 0 + (0.25F + 0.01F * -2);
  const auto wn = this->download(w, 2);
  EXPECT_FLOAT_EQ(wn[0], 1 - 0.1F * m0);
  EXPECT_FLOAT_EQ(wn[1], -2 - 0.1F * m1);
  EXPECT_FLOAT_EQ(this->download(mom, 2)[0], m0);
}

TYPED_TEST(DeviceBackendTest, DeviceNormalizationEqualsTheLoadersFloatOutput) {
  // The same batch from the loader twice: uint8 NHWC normalized on the
  // device, and float32 NCHW normalized by the loader.
  testing::TempDir dir;
  const auto data = testing::make_small_dataset(dir.path(), 2, 4);
  loader::LoaderConfig c;
  c.dataset = data.folder.string();
  c.batch_size = 8;
  c.threads = 2;
  c.seed = 3;
  c.transform.size = 32;
  c.watch_pressure = false;
  c.pin_method = memory::PinMethod::mlock;
  c.transform.layout = loader::Layout::nhwc_u8;
  loader::Loader u8(c);
  c.transform.layout = loader::Layout::nchw_f32;
  loader::Loader f32(c);
  u8.begin_epoch(0);
  f32.begin_epoch(0);
  auto bu = u8.next();
  auto bf = f32.next();
  ASSERT_TRUE(bu && bf);
  DeviceBuffer in = this->backend->allocate(bu->data().size());
  DeviceBuffer out = this->backend->allocate(bf->data().size());
  this->backend->copy_h2d(*this->stream, in.get(), bu->data().data(), bu->data().size());
  Normalization norm{c.transform.mean, c.transform.std};
  this->backend->normalize_u8(*this->stream, in.as<std::uint8_t>(), out.as<float>(), 8, 32, 32, norm);
  const auto got = this->download(out, bf->data().size() / sizeof(float));
  const auto* want = reinterpret_cast<const float*>(bf->data().data());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, static_cast<double>(std::abs(got[i] - want[i])));
  EXPECT_LT(worst, 1e-5) << "device normalization must equal the host-normalized batch";
}

#ifndef PINFEED_TEST_CUDA
// CPU-specific semantics: asynchrony and sticky errors.
TEST(CpuBackendTest, CopiesRunAsynchronouslyAndEventsTrackThem) {
  CpuBackendConfig cfg;
  cfg.copy_delay = std::chrono::milliseconds(100);
  CpuBackend b(cfg);
  auto s = b.create_stream();
  std::vector<float> host(16, 1.0F);
  DeviceBuffer d = b.allocate(host.size() * sizeof(float));
  auto ev = b.create_event();
  EXPECT_TRUE(ev->ready()) << "an event never recorded is complete";
  b.copy_h2d(*s, d.get(), host.data(), host.size() * sizeof(float));
  b.record(*ev, *s);
  EXPECT_FALSE(ev->ready()) << "the enqueueing thread returns before the copy runs";
  EXPECT_FALSE(ev->wait_for(std::chrono::milliseconds(1)));
  EXPECT_TRUE(ev->wait_for(std::chrono::seconds(10)));
  EXPECT_EQ(d.as<float>()[15], 1.0F);
}

TEST(CpuBackendTest, AnErrorIsStickyAndReachesEventsAndSynchronize) {
  CpuBackend b;
  auto s = b.create_stream();
  DeviceBuffer d = b.allocate(4 * sizeof(float));
  b.enqueue(*s, [] { throw Error("injected failure"); });
  b.fill(*s, d.as<float>(), 4, 7.0F);  // skipped: the stream is in error
  auto ev = b.create_event();
  b.record(*ev, *s);
  EXPECT_THROW(ev->wait_for(std::chrono::seconds(10)), Error);
  try {
    b.synchronize(*s);
    FAIL() << "synchronize must rethrow";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "injected failure");
  }
  EXPECT_EQ(d.as<float>()[0], 0.0F) << "work after the error must not run";
}

TEST(CpuBackendTest, DestroyingAStreamWithQueuedWorkFinishesIt) {
  CpuBackend b;
  DeviceBuffer d = b.allocate(1 << 20);
  {
    auto s = b.create_stream();
    for (int i = 0; i < 100; ++i) b.fill(*s, d.as<float>(), (1 << 20) / sizeof(float), static_cast<float>(i));
  }
  EXPECT_EQ(d.as<float>()[0], 99.0F);
}
#endif

TEST(DeviceTypeTest, CallersMakeBackendsAndCommunicatorsThroughTheTypeTheyWereGiven) {
  const DeviceType& cpu = device_type("cpu");
  EXPECT_EQ(&device_type(BackendKind::cpu), &cpu);
  EXPECT_FALSE(cpu.indexed) << "cpu:N counts workers";
  EXPECT_TRUE(device_type("cuda").indexed) << "cuda:I,J names devices";
  EXPECT_EQ(device_types().front(), &cpu);
  auto a = cpu.make_backend(3, BackendOptions{});
  auto b = cpu.make_backend(4, BackendOptions{});
  EXPECT_EQ(a->name(), "cpu:3");
  EXPECT_EQ(a->host_pin_method(), memory::PinMethod::mlock) << "a CPU copy is memcpy: nothing to register";
  const auto group = cpu.make_group({a.get(), b.get()}, CommConfig{});
  ASSERT_EQ(group.size(), 2U);
  EXPECT_EQ(group[1]->rank(), 1);
  EXPECT_EQ(group[1]->name(), "threads");
  try {
    (void)device_type("tpu");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("known: cpu, cuda"), std::string::npos) << e.what();
  }
  // "auto": every GPU when there is one, else CPU workers.
  const DeviceSpec spec = parse_devices("auto");
  EXPECT_EQ(spec.kind, device_type("cuda").visible() > 0 ? BackendKind::cuda : BackendKind::cpu);
}

}  // namespace
}  // namespace pinfeed::trainer
