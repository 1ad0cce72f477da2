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
#include "pinfeed/trainer/model.hpp"
#include "pinfeed/trainer/trainer.hpp"

namespace pinfeed::trainer {
namespace {

struct CpuFactory {
  static std::unique_ptr<DeviceBackend> make() { return std::make_unique<CpuBackend>(); }
  /// How this backend's pool page-locks: the kernel's mlock, as no driver
  /// is involved.
  static constexpr memory::PinMethod kPinMethod = memory::PinMethod::mlock;
};
struct CudaFactory {
  static std::unique_ptr<DeviceBackend> make() {
    if (cuda_device_count() == 0) return nullptr;
    return make_cuda_backend(0);
  }
  /// The driver's registration, which makes copies from the pool DMA-able.
  static constexpr memory::PinMethod kPinMethod = memory::PinMethod::cuda_register;
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
  // An empty allocation is no buffer, on every backend (cudaMalloc(0) has
  // no defined pointer), and dropping it frees nothing.
  DeviceBuffer none = this->backend->allocate(0);
  EXPECT_EQ(none.get(), nullptr);
  EXPECT_EQ(none.bytes(), 0U);
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
  // Each backend names its own way (never "automatic", which is a request).
  EXPECT_EQ(this->backend->host_pin_method(), TypeParam::kPinMethod);
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
  this->backend->softmax_cross_entropy(*this->stream, dl.as<float>(), lab.as<std::int32_t>(), n, k, 1.0F,
                                       grad.as<float>(), stats.as<float>());
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
  const auto group = comm_type(BackendKind::cpu).make_group({a.get(), b.get()}, CommConfig{});
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

// ---- the CNN's layers (model.hpp's Cnn) -------------------------------------

/// Host reference: a 3x3 convolution, padding 1, of NCHW x (n x c x h x w)
/// by w (co x c x 3 x 3), out CNHW (co x n x oh x ow).
std::vector<float> direct_conv(const std::vector<float>& x, const std::vector<float>& w, const ConvShape& sh, int co) {
  const int oh = sh.out_h(), ow = sh.out_w();
  std::vector<float> out(static_cast<std::size_t>(co) * sh.columns());
  for (int o = 0; o < co; ++o) {
    for (int i = 0; i < sh.n; ++i) {
      for (int y = 0; y < oh; ++y) {
        for (int xo = 0; xo < ow; ++xo) {
          double sum = 0;
          for (int c = 0; c < sh.c; ++c) {
            for (int k = 0; k < 9; ++k) {
              const int iy = y * sh.stride + k / 3 - 1, ix = xo * sh.stride + k % 3 - 1;
              if (iy < 0 || iy >= sh.h || ix < 0 || ix >= sh.w) continue;
              sum += static_cast<double>(w[static_cast<std::size_t>((o * sh.c + c) * 9 + k)]) *
                     x[static_cast<std::size_t>(((i * sh.c + c) * sh.h + iy) * sh.w + ix)];
            }
          }
          out[static_cast<std::size_t>(((o * sh.n + i) * oh + y) * ow + xo)] = static_cast<float>(sum);
        }
      }
    }
  }
  return out;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

TYPED_TEST(DeviceBackendTest, Im2colAndGemmEqualADirectConvolutionFromEitherLayout) {
  for (const int stride : {1, 2}) {
    const ConvShape sh{2, 3, 7, 6, stride};
    const int co = 4;
    const auto x = random_floats(static_cast<std::size_t>(sh.n * sh.c * sh.h * sh.w), 21);
    const auto w = random_floats(static_cast<std::size_t>(co * sh.c * 9), 22);
    const auto want = direct_conv(x, w, sh, co);
    // The same images as NCHW (the first block's input) and as CNHW (a later block's).
    std::vector<float> cnhw(x.size());
    const std::size_t plane = static_cast<std::size_t>(sh.h * sh.w);
    for (int i = 0; i < sh.n; ++i) {
      for (int c = 0; c < sh.c; ++c) {
        std::copy_n(x.begin() + static_cast<std::ptrdiff_t>((static_cast<std::size_t>(i * sh.c + c)) * plane), plane,
                    cnhw.begin() + static_cast<std::ptrdiff_t>((static_cast<std::size_t>(c * sh.n + i)) * plane));
      }
    }
    for (const bool channel_major : {false, true}) {
      DeviceBuffer dx = this->upload(channel_major ? cnhw : x);
      DeviceBuffer dw = this->upload(w);
      DeviceBuffer col = this->backend->allocate(static_cast<std::size_t>(sh.c) * 9 * sh.columns() * sizeof(float));
      DeviceBuffer z = this->backend->allocate(want.size() * sizeof(float));
      const std::size_t cs = channel_major ? static_cast<std::size_t>(sh.n) * plane : plane;
      const std::size_t ns = channel_major ? plane : static_cast<std::size_t>(sh.c) * plane;
      this->backend->im2col(*this->stream, dx.as<float>(), cs, ns, sh, col.as<float>());
      Gemm g;
      g.m = co;
      g.n = static_cast<int>(sh.columns());
      g.k = sh.c * 9;
      g.a = dw.as<float>();
      g.lda = g.k;
      g.b = col.as<float>();
      g.ldb = g.n;
      g.c = z.as<float>();
      g.ldc = g.n;
      this->backend->gemm(*this->stream, g);
      const auto got = this->download(z, want.size());
      for (std::size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], 1e-4) << "stride " << stride << (channel_major ? " CNHW" : " NCHW") << " at " << i;
      }
    }
  }
}

TYPED_TEST(DeviceBackendTest, Col2imIsTheAdjointOfIm2col) {
  // <im2col(x), c> == <x, col2im(c)> for any x and c: col2im is exactly
  // the gradient of im2col, stride 1 and 2, odd and even sides.
  for (const ConvShape sh : {ConvShape{2, 3, 5, 5, 1}, ConvShape{3, 2, 8, 7, 2}}) {
    const std::size_t xs = static_cast<std::size_t>(sh.c * sh.n * sh.h * sh.w);
    const std::size_t cols = static_cast<std::size_t>(sh.c) * 9 * sh.columns();
    const auto x = random_floats(xs, 31);
    const auto c = random_floats(cols, 32);
    DeviceBuffer dx = this->upload(x), dc = this->upload(c);
    DeviceBuffer col = this->backend->allocate(cols * sizeof(float)),
                 back = this->backend->allocate(xs * sizeof(float));
    const std::size_t plane = static_cast<std::size_t>(sh.h * sh.w);
    this->backend->im2col(*this->stream, dx.as<float>(), static_cast<std::size_t>(sh.n) * plane, plane, sh,
                          col.as<float>());
    this->backend->col2im(*this->stream, dc.as<float>(), sh, back.as<float>());
    const double lhs = dot(this->download(col, cols), c), rhs = dot(x, this->download(back, xs));
    EXPECT_NEAR(lhs, rhs, 1e-4 * (1 + std::abs(lhs))) << "stride " << sh.stride;
  }
}

/// Host BatchNorm over rows (c x m), training mode, in double: y, and the
/// updated running statistics.
struct HostBn {
  std::vector<double> y, mean, var;
};
HostBn host_bn(const std::vector<float>& x, int c, std::size_t m, const std::vector<float>& gamma,
               const std::vector<float>& beta, bool relu) {
  HostBn r;
  r.y.resize(x.size());
  for (int k = 0; k < c; ++k) {
    double mean = 0, var = 0;
    for (std::size_t j = 0; j < m; ++j) mean += x[static_cast<std::size_t>(k) * m + j];
    mean /= static_cast<double>(m);
    for (std::size_t j = 0; j < m; ++j) {
      const double d = x[static_cast<std::size_t>(k) * m + j] - mean;
      var += d * d;
    }
    var /= static_cast<double>(m);
    r.mean.push_back(mean);
    r.var.push_back(var);
    for (std::size_t j = 0; j < m; ++j) {
      const std::size_t i = static_cast<std::size_t>(k) * m + j;
      const double v = gamma[static_cast<std::size_t>(k)] * (x[i] - mean) / std::sqrt(var + 1e-5) +
                       beta[static_cast<std::size_t>(k)];
      r.y[i] = relu ? std::max(v, 0.0) : v;
    }
  }
  return r;
}

/// One worker's BatchNorm over c rows of m: count m, the given buffers.
BatchNormArgs bn_args(int c, std::size_t m, bool relu, const DeviceBuffer& gamma, const DeviceBuffer& beta,
                      const DeviceBuffer& running_mean, const DeviceBuffer& running_var, const DeviceBuffer& invstd) {
  BatchNormArgs a;
  a.c = c;
  a.m = m;
  a.count = static_cast<float>(m);
  a.relu = relu;
  a.gamma = gamma.as<float>();
  a.beta = beta.as<float>();
  a.running_mean = running_mean.as<float>();
  a.running_var = running_var.as<float>();
  a.invstd = invstd.as<float>();
  return a;
}

TYPED_TEST(DeviceBackendTest, BatchNormForwardMatchesItsDefinitionInBothModes) {
  const int c = 3;
  const std::size_t m = 50;
  auto x = random_floats(static_cast<std::size_t>(c) * m, 41);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2 * x[i] + static_cast<float>(i / m);  // a mean per channel
  const std::vector<float> gamma{1.5F, 0.5F, -1}, beta{0.1F, -0.2F, 0.3F};
  const HostBn want = host_bn(x, c, m, gamma, beta, true);
  DeviceBuffer dx = this->upload(x), dg = this->upload(gamma), db = this->upload(beta);
  DeviceBuffer rm = this->upload({0, 0, 0}), rv = this->upload({1, 1, 1});
  DeviceBuffer inv = this->backend->allocate(c * sizeof(float)), sums = this->backend->allocate(2 * c * sizeof(float));
  DeviceBuffer xhat = this->backend->allocate(x.size() * sizeof(float)),
               y = this->backend->allocate(x.size() * sizeof(float));
  const BatchNormArgs a = bn_args(c, m, true, dg, db, rm, rv, inv);
  this->backend->bn_stats(*this->stream, dx.as<float>(), c, m, sums.as<float>());
  this->backend->bn_forward(*this->stream, dx.as<float>(), sums.as<float>(), a, xhat.as<float>(), y.as<float>());
  const auto got = this->download(y, x.size());
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(got[i], want.y[i], 1e-4) << i;
  const auto mean = this->download(rm, c), var = this->download(rv, c);
  for (std::size_t k = 0; k < 3; ++k) {
    EXPECT_NEAR(mean[k], 0.1 * want.mean[k], 1e-5) << "running_mean, momentum 0.1";
    EXPECT_NEAR(var[k], 0.9 + 0.1 * want.var[k] * m / (m - 1), 1e-4) << "running_var takes the unbiased variance";
  }
  // Evaluation: the running statistics, nothing updated.
  this->backend->bn_forward(*this->stream, dx.as<float>(), nullptr, a, nullptr, y.as<float>());
  const auto eval = this->download(y, x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const std::size_t k = i / m;
    const double v = gamma[k] * (x[i] - mean[k]) / std::sqrt(var[k] + 1e-5) + beta[k];
    ASSERT_NEAR(eval[i], std::max(v, 0.0), 1e-4) << i;
  }
  EXPECT_EQ(this->download(rm, c), mean);
}

TYPED_TEST(DeviceBackendTest, BatchNormReducesLongRowsLikeTheHost) {
  // Rows far longer than a block of threads (a 224 px batch has millions
  // per channel): the reductions' partial sums must all be combined.
  const int c = 3;
  const std::size_t m = 100003;
  auto x = random_floats(static_cast<std::size_t>(c) * m, 81);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] += static_cast<float>(i / m);  // a mean per channel
  const auto dyv = random_floats(x.size(), 82);
  std::vector<double> want(4 * static_cast<std::size_t>(c), 0.0);
  for (int k = 0; k < c; ++k) {
    for (std::size_t j = 0; j < m; ++j) {
      const double v = x[static_cast<std::size_t>(k) * m + j];
      want[static_cast<std::size_t>(k)] += v;
      want[static_cast<std::size_t>(c + k)] += v * v;
    }
  }
  DeviceBuffer dx = this->upload(x), sums = this->backend->allocate(2 * c * sizeof(float));
  this->backend->bn_stats(*this->stream, dx.as<float>(), c, m, sums.as<float>());
  const auto got = this->download(sums, 2 * c);
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * std::abs(want[i]) + 1e-2) << i;
  // Backward's sums, with xhat = x here (any values do) and no ReLU.
  DeviceBuffer dy = this->upload(dyv), red = this->backend->allocate(2 * c * sizeof(float));
  DeviceBuffer dg = this->upload({0, 0, 0}), db = this->upload({0, 0, 0});
  BatchNormArgs a;
  a.c = c;
  a.m = m;
  a.relu = false;
  this->backend->bn_backward_reduce(*this->stream, dy.as<float>(), dx.as<float>(), dx.as<float>(), a, red.as<float>(),
                                    dg.as<float>(), db.as<float>());
  const auto r = this->download(red, 2 * c);
  for (int k = 0; k < c; ++k) {
    double sum = 0, dot = 0;
    for (std::size_t j = 0; j < m; ++j) {
      const std::size_t i = static_cast<std::size_t>(k) * m + j;
      sum += dyv[i];
      dot += static_cast<double>(dyv[i]) * x[i];
    }
    EXPECT_NEAR(r[static_cast<std::size_t>(k)], sum, 1e-5 * std::abs(sum) + 1e-2) << "sum dy, channel " << k;
    EXPECT_NEAR(r[static_cast<std::size_t>(c + k)], dot, 1e-5 * std::abs(dot) + 1e-2) << "sum dy*xhat, channel " << k;
  }
}

// Note [One stream, one workspace]: BatchNorm's partial sums and cuBLAS's
// handle belong to a stream. Two threads, each with its own stream, run the
// statistics and a GEMM at once, over and over: each gets what it gets
// alone (a shared workspace would mix the two channels' sums).
TYPED_TEST(DeviceBackendTest, BatchNormAndGemmOnTwoStreamsAtOnceKeepTheirOwnState) {
  const int c = 2;
  const std::size_t m = 200003;
  const int dim = 96;
  struct Lane {
    std::unique_ptr<Stream> stream;
    DeviceBuffer x, sums, a, b, out;
    std::vector<float> want_sums, want_out;
  };
  std::vector<Lane> lanes(2);
  for (std::size_t l = 0; l < lanes.size(); ++l) {
    Lane& lane = lanes[l];
    auto x = random_floats(static_cast<std::size_t>(c) * m, 90 + static_cast<unsigned>(l));
    for (float& v : x) v += 10.0F * static_cast<float>(l + 1);  // a different mean per lane
    lane.x = this->upload(x);
    lane.sums = this->backend->allocate(2 * c * sizeof(float));
    lane.a = this->upload(random_floats(static_cast<std::size_t>(dim) * dim, 95 + static_cast<unsigned>(l)));
    lane.b = this->upload(random_floats(static_cast<std::size_t>(dim) * dim, 97 + static_cast<unsigned>(l)));
    lane.out = this->backend->allocate(static_cast<std::size_t>(dim) * dim * sizeof(float));
    lane.stream = this->backend->create_stream();
  }
  const auto run = [&](Lane& lane) {
    this->backend->bn_stats(*lane.stream, lane.x.template as<float>(), c, m, lane.sums.template as<float>());
    Gemm g;
    g.m = g.n = g.k = dim;
    g.a = lane.a.template as<float>();
    g.b = lane.b.template as<float>();
    g.c = lane.out.template as<float>();
    g.lda = g.ldb = g.ldc = dim;
    this->backend->gemm(*lane.stream, g);
  };
  const auto read = [&](Lane& lane, const DeviceBuffer& b, std::size_t n) {
    std::vector<float> out(n);
    this->backend->copy_d2h(*lane.stream, out.data(), b.get(), n * sizeof(float));
    this->backend->synchronize(*lane.stream);
    return out;
  };
  for (Lane& lane : lanes) {  // alone, one after the other
    run(lane);
    lane.want_sums = read(lane, lane.sums, 2 * c);
    lane.want_out = read(lane, lane.out, static_cast<std::size_t>(dim) * dim);
  }
  ASSERT_GT(std::abs(lanes[1].want_sums[0] - lanes[0].want_sums[0]), 1e5F);  // the lanes' sums differ
  std::vector<std::thread> threads;
  for (Lane& lane : lanes) {
    threads.emplace_back([this, &run, &lane] {
      this->backend->make_current();
      for (int i = 0; i < 50; ++i) run(lane);
    });
  }
  for (auto& t : threads) t.join();
  for (std::size_t l = 0; l < lanes.size(); ++l) {
    const auto sums = read(lanes[l], lanes[l].sums, 2 * c);
    for (std::size_t i = 0; i < sums.size(); ++i) {
      EXPECT_NEAR(sums[i], lanes[l].want_sums[i], 1e-5 * std::abs(lanes[l].want_sums[i])) << "lane " << l << ", " << i;
    }
    // cuBLAS may choose another kernel while two streams are busy: the same
    // product, not necessarily the same bits.
    const auto out = read(lanes[l], lanes[l].out, static_cast<std::size_t>(dim) * dim);
    for (std::size_t i = 0; i < out.size(); ++i) {
      ASSERT_NEAR(out[i], lanes[l].want_out[i], 1e-5 * (1 + std::abs(lanes[l].want_out[i])))
          << "lane " << l << ", " << i;
    }
  }
}

TYPED_TEST(DeviceBackendTest, BatchNormBackwardMatchesFiniteDifferences) {
  // L = sum(w * y): dL/dy = w. Without ReLU (smooth) for the finite
  // differences of x, gamma and beta; the mask is checked after.
  const int c = 2;
  const std::size_t m = 12;
  const auto x0 = random_floats(static_cast<std::size_t>(c) * m, 51);
  const auto w = random_floats(x0.size(), 52);
  const std::vector<float> gamma0{1.3F, -0.7F}, beta0{0.2F, 0.4F};
  const auto loss = [&](const std::vector<float>& x, const std::vector<float>& g, const std::vector<float>& b) {
    const HostBn r = host_bn(x, c, m, g, b, false);
    double l = 0;
    for (std::size_t i = 0; i < x.size(); ++i) l += w[i] * r.y[i];
    return l;
  };
  for (const bool relu : {false, true}) {
    DeviceBuffer dx = this->upload(x0), dg = this->upload(gamma0), db = this->upload(beta0);
    DeviceBuffer rm = this->upload({0, 0}), rv = this->upload({1, 1});
    DeviceBuffer inv = this->backend->allocate(c * sizeof(float)),
                 sums = this->backend->allocate(2 * c * sizeof(float));
    DeviceBuffer red = this->backend->allocate(2 * c * sizeof(float));
    DeviceBuffer xhat = this->backend->allocate(x0.size() * sizeof(float)),
                 y = this->backend->allocate(x0.size() * sizeof(float));
    DeviceBuffer dy = this->upload(w), grad_x = this->backend->allocate(x0.size() * sizeof(float));
    DeviceBuffer grad_g = this->upload({0, 0}), grad_b = this->upload({0, 0});
    const BatchNormArgs a = bn_args(c, m, relu, dg, db, rm, rv, inv);
    this->backend->bn_stats(*this->stream, dx.as<float>(), c, m, sums.as<float>());
    this->backend->bn_forward(*this->stream, dx.as<float>(), sums.as<float>(), a, xhat.as<float>(), y.as<float>());
    this->backend->bn_backward_reduce(*this->stream, dy.as<float>(), y.as<float>(), xhat.as<float>(), a,
                                      red.as<float>(), grad_g.as<float>(), grad_b.as<float>());
    this->backend->bn_backward_input(*this->stream, dy.as<float>(), xhat.as<float>(), red.as<float>(), a,
                                     grad_x.as<float>());
    const auto gx = this->download(grad_x, x0.size());
    const auto gg = this->download(grad_g, 2), gb = this->download(grad_b, 2);
    if (relu) {
      // The mask: where y is 0 the incoming gradient was dropped.
      const auto yv = this->download(y, x0.size()), masked = this->download(dy, x0.size());
      for (std::size_t i = 0; i < x0.size(); ++i) ASSERT_EQ(masked[i], yv[i] > 0 ? w[i] : 0.0F) << i;
      continue;
    }
    const float h = 1e-3F;
    for (std::size_t i = 0; i < x0.size(); ++i) {
      auto up = x0, down = x0;
      up[i] += h;
      down[i] -= h;
      EXPECT_NEAR(gx[i], (loss(up, gamma0, beta0) - loss(down, gamma0, beta0)) / (2 * h), 2e-3) << "dx " << i;
    }
    for (std::size_t k = 0; k < 2; ++k) {
      auto gu = gamma0, gd = gamma0, bu = beta0, bd = beta0;
      gu[k] += h;
      gd[k] -= h;
      bu[k] += h;
      bd[k] -= h;
      EXPECT_NEAR(gg[k], (loss(x0, gu, beta0) - loss(x0, gd, beta0)) / (2 * h), 2e-3) << "dgamma " << k;
      EXPECT_NEAR(gb[k], (loss(x0, gamma0, bu) - loss(x0, gamma0, bd)) / (2 * h), 2e-3) << "dbeta " << k;
    }
  }
}

TYPED_TEST(DeviceBackendTest, GlobalAveragePoolingAndItsAdjoint) {
  const int c = 3, n = 2;
  const std::size_t hw = 5;
  const auto x = random_floats(static_cast<std::size_t>(c * n) * hw, 61);
  const auto d = random_floats(static_cast<std::size_t>(n * c), 62);
  DeviceBuffer dx = this->upload(x), dd = this->upload(d);
  DeviceBuffer out = this->backend->allocate(d.size() * sizeof(float)),
               back = this->backend->allocate(x.size() * sizeof(float));
  this->backend->channel_mean(*this->stream, dx.as<float>(), c, n, hw, out.as<float>());
  this->backend->channel_mean_backward(*this->stream, dd.as<float>(), c, n, hw, back.as<float>());
  const auto got = this->download(out, d.size());
  for (int i = 0; i < n; ++i) {
    for (int k = 0; k < c; ++k) {
      double mean = 0;
      for (std::size_t p = 0; p < hw; ++p) mean += x[(static_cast<std::size_t>(k * n + i)) * hw + p];
      EXPECT_NEAR(got[static_cast<std::size_t>(i * c + k)], mean / static_cast<double>(hw), 1e-6)
          << "sample " << i << " channel " << k;
    }
  }
  EXPECT_NEAR(dot(got, d), dot(x, this->download(back, x.size())), 1e-5);
}

TYPED_TEST(DeviceBackendTest, TheCnnsGradientMatchesFiniteDifferencesOfItsLoss) {
  // The whole model through train_step: im2col, GEMMs, BatchNorm with batch
  // statistics, ReLU, pooling, fc and the loss. Every parameter's gradient
  // against central differences of the batch's mean loss.
  ModelConfig mc;
  mc.kind = ModelKind::cnn;
  mc.channels = {3, 4};
  mc.image_size = 8;
  mc.classes = 3;
  const int n = 4;
  Cnn model(*this->backend, mc, n);
  const std::vector<float> w0 = model.initial_weights(7);
  const auto images = random_floats(static_cast<std::size_t>(n) * 3 * 64, 71);
  const std::vector<std::int32_t> labels{0, 2, 1, 2};
  DeviceBuffer dimg = this->upload(images);
  DeviceBuffer dlab = this->backend->allocate(labels.size() * sizeof(std::int32_t));
  this->backend->copy_h2d(*this->stream, dlab.get(), labels.data(), labels.size() * sizeof(std::int32_t));
  DeviceBuffer stats = this->backend->allocate(2 * sizeof(float));
  const std::vector<float> buffers = model.initial_buffers();
  ASSERT_EQ(buffers.size(), model.buffer_count());
  const auto run = [&](const std::vector<float>& w) {
    this->backend->copy_h2d(*this->stream, model.weights(), w.data(), w.size() * sizeof(float));
    this->backend->copy_h2d(*this->stream, model.buffers(), buffers.data(), buffers.size() * sizeof(float));
    this->backend->fill(*this->stream, stats.as<float>(), 2, 0.0F);
    model.zero_grad(*this->stream);
    std::vector<std::size_t> order;
    model.train_step(*this->stream, dimg.as<float>(), dlab.as<std::int32_t>(), n, 1.0F, stats.as<float>(),
                     [&](std::size_t p) { order.push_back(p); });
    std::vector<std::size_t> reverse(model.params().size());
    std::iota(reverse.rbegin(), reverse.rend(), std::size_t{0});
    EXPECT_EQ(order, reverse) << "every gradient reported once, in reverse parameter order";
    return static_cast<double>(this->download(stats, 1)[0]) / n;
  };
  run(w0);
  std::vector<float> g(model.param_count());
  this->backend->copy_d2h(*this->stream, g.data(), model.grads(), g.size() * sizeof(float));
  this->backend->synchronize(*this->stream);
  // Small enough that no ReLU input crosses zero in this case (1e-2 and
  // 1e-3 cross kinks), large enough for float32's resolution of the loss.
  const float h = 2e-4F;
  int checked = 0;
  for (std::size_t i = 0; i < w0.size(); ++i) {
    auto up = w0, down = w0;
    up[i] += h;
    down[i] -= h;
    const double numeric = (run(up) - run(down)) / (2 * h);
    EXPECT_NEAR(g[i], numeric, 2e-3 + 0.05 * std::abs(numeric)) << "parameter " << i;
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(model.param_count()));
}

}  // namespace
}  // namespace pinfeed::trainer
