// Transforms: crop planning against torchvision's bounds, antialiased
// downscaling, and the sample writer's float and byte outputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>

#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/jpeg_decoder.hpp"
#include "pinfeed/loader/sample_rng.hpp"
#include "pinfeed/loader/transform.hpp"

namespace pinfeed::loader {
namespace {

TEST(TransformTest, RandomResizedCropFollowsTorchvisionBounds) {
  TransformConfig c;
  ImageHeader h;
  h.width = 500;
  h.height = 375;
  for (std::uint64_t i = 0; i < 2000; ++i) {
    SampleRng rng(11, 0, i);
    const CropPlan p = plan_crop(h, c, rng);
    ASSERT_GE(p.region.x, 0);
    ASSERT_GE(p.region.y, 0);
    ASSERT_LE(p.region.x + p.region.width, 500);
    ASSERT_LE(p.region.y + p.region.height, 375);
    const double area = static_cast<double>(p.region.width) * p.region.height / (500.0 * 375.0);
    ASSERT_GE(area, 0.07);
    ASSERT_TRUE(p.scale == 1 || p.scale == 2 || p.scale == 4 || p.scale == 8);
    if (p.scale > 1) {
      ASSERT_GE(p.region.width / p.scale, 224) << "a DCT scale never drops below the output size";
      ASSERT_GE(p.region.height / p.scale, 224);
    }
  }
  SampleRng a(11, 3, 5), b(11, 3, 5);
  const CropPlan pa = plan_crop(h, c, a), pb = plan_crop(h, c, b);
  EXPECT_EQ(pa.region.x, pb.region.x) << "the plan depends on (seed, epoch, index) only";
  EXPECT_EQ(pa.flip, pb.flip);
}

TEST(TransformTest, CenterCropIsTorchvisionsResizeThenCenterCrop) {
  TransformConfig c;
  c.crop = CropMode::center;
  ImageHeader h;
  h.width = 512;
  h.height = 384;
  SampleRng rng(0, 0, 0);
  const CropPlan p = plan_crop(h, c, rng);
  // Resize(256): 384 -> 256, 512 -> int(256 * 512 / 384) = 341 (truncated);
  // CenterCrop(224): round((341 - 224) / 2) = round(58.5) = 58 (half to
  // even, as Python rounds), round((256 - 224) / 2) = 16.
  EXPECT_DOUBLE_EQ(p.x.scale, 512.0 / 341);
  EXPECT_DOUBLE_EQ(p.y.scale, 384.0 / 256);
  EXPECT_EQ(p.x.offset, 58);
  EXPECT_EQ(p.y.offset, 16);
  // The decoded region is what the taps read: output column 0's centre is
  // at 58.5 * 512/341 = 87.8 with a half-width of 1.5 source pixels.
  EXPECT_EQ(p.region.x, 86);
  EXPECT_EQ(p.region.x + p.region.width, axis_taps(p.x, 223, Interpolation::bilinear).last);
  EXPECT_FALSE(p.flip);
  h.width = 513;  // 342 - 224 = 118: 59, no tie
  EXPECT_EQ(plan_crop(h, c, rng).x.offset, 59);
  h.width = 518;  // int(256 * 518 / 384) = 345: round(60.5) = 60
  EXPECT_EQ(plan_crop(h, c, rng).x.offset, 60);
}

TEST(TransformTest, ARandomCropDecodesExactlyTheCropAndResizesOnlyIt) {
  // RandomResizedCrop crops, then resizes the crop: the filter's taps stop
  // at the crop's edges (PIL resizes the cropped image), so the decoded
  // region is the crop itself, at every scale.
  TransformConfig c;
  ImageHeader h;
  h.width = 500;
  h.height = 375;
  for (std::uint64_t i = 0; i < 64; ++i) {
    SampleRng rng(3, 0, i);
    const CropPlan p = plan_crop(h, c, rng);
    EXPECT_EQ(p.region.x, p.x.lo);
    EXPECT_EQ(p.region.y, p.y.lo);
    EXPECT_EQ(p.region.x + p.region.width, p.x.hi);
    EXPECT_EQ(p.region.y + p.region.height, p.y.hi);
    EXPECT_DOUBLE_EQ(p.x.scale, static_cast<double>(p.x.hi - p.x.lo) / 224);
  }
}

TEST(TransformTest, AbsurdShrinksAndResizesAreDataErrorsNotGigabytes) {
  // The filter reads about twice the shrink per output pixel and the writer
  // keeps that many rows: a 1 x 100,000,000 strip would take gigabytes.
  TransformConfig c;
  c.crop = CropMode::full;
  ImageHeader h;
  h.width = 1;
  h.height = 100'000'000;
  SampleRng rng(0, 0, 0);
  EXPECT_THROW((void)plan_crop(h, c, rng), DataError);
  // Resize(256) of a 1 x 16,777,217 strip: 4.3 billion pixels long.
  c.crop = CropMode::center;
  h.height = 16'777'217;
  try {
    (void)plan_crop(h, c, rng);
    FAIL() << "an int overflow became a plan";
  } catch (const DataError& e) {
    EXPECT_NE(e.reason().find("Resize(256) would make this 1x16777217 image"), std::string::npos) << e.reason();
  }
  // The writer refuses it too, whatever the caller planned.
  c.size = 8;
  DecodedImage img;
  img.width = 600'000;
  img.height = 1;
  img.pixels.assign(static_cast<std::size_t>(img.width) * 4, 7);
  std::vector<std::byte> out(c.sample_bytes());
  EXPECT_THROW(SampleWriter(c).write(img, Region{}, false, out), DataError);
  h.width = 4000;  // 500x, under the limit
  h.height = 4000;
  c.crop = CropMode::full;
  EXPECT_NO_THROW((void)plan_crop(h, c, rng));
}

TEST(TransformTest, DownscalingIsAntialiased) {
  // Noise shrunk 4x (both axes, columns only, rows only): PIL's triangle
  // filter widened to the shrink averages about 8 source pixels per axis, so
  // the output's spread falls to 0.41x the source's per shrunk axis (0.16x
  // for both). Two-tap bilinear sampling, not antialiased, would keep 0.71x
  // (0.5x): aliasing. The mean stays the source's.
  TransformConfig c;
  c.size = 56;
  c.layout = Layout::nhwc_u8;
  for (const auto& [fx, fy] : {std::pair{4, 4}, std::pair{4, 1}, std::pair{1, 4}}) {
    DecodedImage img;
    img.width = 56 * fx;
    img.height = 56 * fy;
    img.pixels.resize(static_cast<std::size_t>(img.width * img.height * 4));
    SampleRng rng(1, 2, 3);
    double in_sum = 0, in_sq = 0;
    for (std::size_t i = 0; i < img.pixels.size(); i += 4) {
      const auto v = static_cast<std::uint8_t>(rng.below(256));
      img.pixels[i] = img.pixels[i + 1] = img.pixels[i + 2] = v;
      img.pixels[i + 3] = 255;
      in_sum += v;
      in_sq += static_cast<double>(v) * v;
    }
    std::vector<std::byte> out(c.sample_bytes());
    SampleWriter(c).write(img, Region{}, false, out);
    double sum = 0, sq = 0;
    for (std::size_t i = 0; i < out.size(); i += 3) {
      const auto v = static_cast<double>(out[i]);
      sum += v;
      sq += v * v;
    }
    const double n_in = static_cast<double>(img.pixels.size() / 4), n = static_cast<double>(out.size() / 3);
    const double in_mean = in_sum / n_in, mean = sum / n;
    const double ratio = std::sqrt(sq / n - mean * mean) / std::sqrt(in_sq / n_in - in_mean * in_mean);
    EXPECT_LT(ratio, fx == fy ? 0.2 : 0.45) << fx << "x" << fy << ": spread of the output / spread of the source";
    EXPECT_NEAR(mean, in_mean, 1.0) << fx << "x" << fy;
  }
}

TEST(TransformTest, AConstantImageStaysExactlyConstantAtEveryScale) {
  // libyuv's column filter weighed two pixels by (127 - f, f)/128: every
  // shrunk image came out 1/128 darker (200 -> 198, 255 -> 253). A resampler
  // may differ from PIL's in detail, never in the mean of a flat picture.
  TransformConfig c;
  c.size = 56;
  c.layout = Layout::nhwc_u8;
  const std::array<std::uint8_t, 3> rgb{200, 100, 50};
  for (const auto& [w, h] : {std::pair{300, 200}, std::pair{97, 61}, std::pair{56, 56}, std::pair{40, 70},
                             std::pair{1000, 57}, std::pair{113, 113}}) {
    DecodedImage img;
    img.width = w;
    img.height = h;
    img.pixels.resize(static_cast<std::size_t>(w * h * 4));
    for (std::size_t i = 0; i < img.pixels.size(); i += 4) {
      img.pixels[i] = rgb[2];  // BGRA
      img.pixels[i + 1] = rgb[1];
      img.pixels[i + 2] = rgb[0];
      img.pixels[i + 3] = 255;
    }
    for (const Interpolation f : {Interpolation::bilinear, Interpolation::bicubic}) {
      c.interpolation = f;
      for (const bool flip : {false, true}) {
        std::vector<std::byte> out(c.sample_bytes());
        SampleWriter(c).write(img, Region{}, flip, out);
        for (std::size_t i = 0; i < out.size(); ++i) {
          ASSERT_EQ(static_cast<int>(out[i]), rgb[i % 3])
              << w << "x" << h << " -> 56x56, byte " << i << ", " << to_string(f);
        }
      }
    }
  }
}

/// PIL's filters in double precision: the triangle (BILINEAR) and Keys'
/// cubic with a = -0.5 (BICUBIC), support 1 and 2 at scale 1.
double pil_filter(Interpolation f, double x) {
  x = std::abs(x);
  if (f == Interpolation::bicubic) {
    constexpr double a = -0.5;
    if (x < 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
    if (x < 2) return (((x - 5) * x + 8) * x - 4) * a;
    return 0;
  }
  return std::max(0.0, 1.0 - x);
}

TEST(TransformTest, ColumnsFollowPilsFilters) {
  // Only the columns scale (W -> 56, rows 56 -> 56): each output pixel is
  // PIL's resample, the source pixels within support * max(scale, 1) of its
  // centre (x + 0.5) * W/56 weighted by the filter of the distance over
  // max(scale, 1), computed here in double precision and clipped to 0..255
  // (the cubic's negative lobes overshoot). The writer's 14-bit weights may
  // round a value the other way, never further, and never all one way.
  // Shrinking (100 -> 56, antialiased) and enlarging (40 -> 56), and a
  // source 3 pixels wide: every bicubic window is the whole row, which must
  // not be padded past its start (ASan reads the 4 bytes before it).
  for (const Interpolation f : {Interpolation::bilinear, Interpolation::bicubic}) {
    for (const int width : {100, 40, 3}) {
      SCOPED_TRACE(std::string(to_string(f)) + " from " + std::to_string(width));
      TransformConfig c;
      c.size = 56;
      c.layout = Layout::nhwc_u8;
      c.interpolation = f;
      DecodedImage img;
      img.width = width;
      img.height = 56;
      img.pixels.resize(static_cast<std::size_t>(img.width * img.height * 4));
      SampleRng rng(4, 5, 6);
      for (auto& p : img.pixels) p = static_cast<std::uint8_t>(rng.below(256));
      std::vector<std::byte> out(c.sample_bytes());
      SampleWriter(c).write(img, Region{}, false, out);
      const double scale = width / 56.0, filterscale = std::max(scale, 1.0);
      const double support = (f == Interpolation::bicubic ? 2.0 : 1.0) * filterscale;
      double signed_sum = 0;
      int off_by_one = 0;
      for (int y = 0; y < 56; ++y) {
        for (int x = 0; x < 56; ++x) {
          const double center = (x + 0.5) * scale;
          const int first = std::max(static_cast<int>(center - support + 0.5), 0);
          const int last = std::min(static_cast<int>(center + support + 0.5), width);
          for (int ch = 0; ch < 3; ++ch) {
            const int bgra = 2 - ch;  // RGB out of BGRA
            double acc = 0, total = 0;
            for (int i = first; i < last; ++i) {
              const double w = pil_filter(f, (i + 0.5 - center) / filterscale);
              acc += w * img.pixels[static_cast<std::size_t>((y * width + i) * 4 + bgra)];
              total += w;
            }
            const double want = std::clamp(acc / total, 0.0, 255.0);
            const int got = static_cast<int>(out[static_cast<std::size_t>((y * 56 + x) * 3 + ch)]);
            ASSERT_LE(std::abs(got - want), 1.0) << "pixel " << x << "," << y << " channel " << ch;
            signed_sum += got - want;
            off_by_one += std::abs(got - std::lround(want)) > 0 ? 1 : 0;
          }
        }
      }
      EXPECT_LT(std::abs(signed_sum / (56 * 56 * 3)), 0.02) << "a bias, not rounding";
      EXPECT_LT(off_by_one, 56 * 56 * 3 / 50) << "rounded the other way more than 2% of the time";
    }
  }
}

TEST(TransformTest, WritesNormalizedPlanarFloatAndInterleavedBytes) {
  TransformConfig c;
  c.size = 16;
  DecodedImage img;
  img.width = 16;
  img.height = 16;
  img.pixels.assign(16 * 16 * 4, 0);
  for (std::size_t i = 0; i < img.pixels.size(); i += 4) {
    img.pixels[i] = 10;       // B
    img.pixels[i + 1] = 128;  // G
    img.pixels[i + 2] = 250;  // R
  }
  img.pixels[2] = 0;  // top-left pixel's R
  std::vector<std::byte> f32(c.sample_bytes());
  SampleWriter(c).write(img, Region{}, false, f32);
  const auto* f = reinterpret_cast<const float*>(f32.data());
  EXPECT_NEAR(f[1], (250 / 255.0 - 0.485) / 0.229, 1e-5);        // R plane
  EXPECT_NEAR(f[256 + 1], (128 / 255.0 - 0.456) / 0.224, 1e-5);  // G plane
  EXPECT_NEAR(f[512 + 1], (10 / 255.0 - 0.406) / 0.225, 1e-5);   // B plane
  EXPECT_NEAR(f[0], (0 - 0.485) / 0.229, 1e-5);
  c.layout = Layout::nhwc_u8;
  std::vector<std::byte> u8(c.sample_bytes());
  SampleWriter(c).write(img, Region{}, true, u8);
  const auto* u = reinterpret_cast<const std::uint8_t*>(u8.data());
  EXPECT_EQ(u[15 * 3], 0) << "flipped: the top-left pixel lands top-right";
  EXPECT_EQ(u[0], 250);
  EXPECT_EQ(u[1], 128);
  EXPECT_EQ(u[2], 10);
}

TEST(TransformTest, FloatOutputIsTheNormalizedByteOutputFlippedOrNot) {
  // The float32 path (SIMD rows, scalar tails) and the uint8 path
  // (libyuv) are written separately; on the same input they must agree
  // exactly, for rows that are 32-byte aligned, only 16-byte aligned, or
  // neither, and widths with and without a tail.
  for (const int n : {16, 24, 12, 13, 10}) {
    TransformConfig c;
    c.size = n;
    DecodedImage img;
    img.width = n;
    img.height = n;
    img.pixels.resize(static_cast<std::size_t>(n * n * 4));
    SampleRng rng(4, 5, static_cast<std::uint64_t>(n));
    for (auto& v : img.pixels) v = static_cast<std::uint8_t>(rng.below(256));
    for (const std::size_t misalign : {0U, 16U}) {
      for (const bool flip : {false, true}) {
        c.layout = Layout::nchw_f32;
        std::vector<std::byte> storage(c.sample_bytes() + 64);
        const auto base = reinterpret_cast<std::uintptr_t>(storage.data());
        const std::size_t start = (64 - base % 64) % 64 + misalign;
        const std::span<std::byte> f32(storage.data() + start, c.sample_bytes());
        SampleWriter(c).write(img, Region{}, flip, f32);
        c.layout = Layout::nhwc_u8;
        std::vector<std::byte> u8(c.sample_bytes());
        SampleWriter(c).write(img, Region{}, flip, u8);
        const auto* f = reinterpret_cast<const float*>(f32.data());
        const auto* u = reinterpret_cast<const std::uint8_t*>(u8.data());
        const auto plane = static_cast<std::size_t>(n * n);
        int mismatches = 0;
        for (std::size_t i = 0; i < plane; ++i) {
          for (std::size_t ch = 0; ch < 3; ++ch) {
            const float want = (static_cast<float>(u[i * 3 + ch]) / 255.0F - c.mean[ch]) / c.std[ch];
            if (std::abs(f[ch * plane + i] - want) > 1e-5F) ++mismatches;
          }
        }
        EXPECT_EQ(mismatches, 0) << "size " << n << " offset " << misalign << (flip ? " flipped" : "");
      }
    }
  }
}

/// A gradient image: R = x, G = y (mod 256), B = 7.
DecodedImage gradient(int width, int height) {
  DecodedImage img;
  img.width = width;
  img.height = height;
  img.pixels.resize(static_cast<std::size_t>(width) * static_cast<std::size_t>(height) * 4);
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      std::uint8_t* px =
          img.pixels.data() +
          (static_cast<std::size_t>(y) * static_cast<std::size_t>(width) + static_cast<std::size_t>(x)) * 4;
      px[0] = 7;
      px[1] = static_cast<std::uint8_t>(y % 256);
      px[2] = static_cast<std::uint8_t>(x % 256);
      px[3] = 255;
    }
  }
  return img;
}

TEST(TransformTest, NonSquareOutputsHaveTheirHeightAndWidth) {
  TransformConfig c;
  c.size = 48;    // width
  c.height = 24;  // height
  c.layout = Layout::nhwc_u8;
  EXPECT_EQ(c.sample_bytes(), 48U * 24U * 3U);
  // A 96 x 48 image to 48 x 24: exactly 2x in both axes, a box average.
  const DecodedImage img = gradient(96, 48);
  std::vector<std::byte> out(c.sample_bytes());
  SampleWriter(c).write(img, Region{}, false, out);
  const auto* u = reinterpret_cast<const std::uint8_t*>(out.data());
  for (int y = 0; y < 24; ++y) {
    for (int x = 0; x < 48; ++x) {
      const std::uint8_t* px = u + (static_cast<std::size_t>(y) * 48 + static_cast<std::size_t>(x)) * 3;
      ASSERT_NEAR(px[0], 2 * x + 0.5, 1.0) << x << "," << y;  // R: centred on columns 2x, 2x+1
      ASSERT_NEAR(px[1], 2 * y + 0.5, 1.0) << x << "," << y;  // G: centred on rows 2y, 2y+1
    }
  }
  // The center crop: Resize(64) makes 400 x 200 into 128 x 64, and the
  // 48 x 24 window starts at (40, 20) of it.
  c.crop = CropMode::center;
  c.resize = 64;
  ImageHeader h;
  h.width = 400;
  h.height = 200;
  SampleRng rng(0, 0, 0);
  const CropPlan p = plan_crop(h, c, rng);
  EXPECT_DOUBLE_EQ(p.x.scale, 400.0 / 128);
  EXPECT_DOUBLE_EQ(p.y.scale, 200.0 / 64);
  EXPECT_EQ(p.x.offset, 40);
  EXPECT_EQ(p.y.offset, 20);
  EXPECT_EQ(p.region.x, 123);  // (40.5 * 3.125 = 126.6) - 3.125, rounded
  c.resize = 40;               // under the crop's longer side
  EXPECT_THROW(c.validate(), ConfigError);
  c.crop = CropMode::random_resized;
  c.height = 1;
  EXPECT_THROW(c.validate(), ConfigError);
}

// Every instruction set the resampler and the float conversion have (AVX2,
// SSE2, plain C++) writes the same bytes: integer sums of the same
// products, and float x * scale + bias with two roundings everywhere.
// Random images, sizes, crops (planned, as the decoder feeds them, and
// whole-region), filters, layouts and flips; outputs 64-byte aligned so
// that the SIMD stores run.
TEST(TransformTest, EverySimdLevelWritesTheSameBytes) {
  struct Restore {
    SimdLevel level = simd_level();
    ~Restore() { set_simd_level(level); }
  } restore;
  const std::vector<SimdLevel> levels = {SimdLevel::scalar, SimdLevel::sse2, SimdLevel::avx2, SimdLevel::avx512};
  std::mt19937 gen(20261206);
  const auto uniform = [&gen](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); };
  const std::array<Interpolation, 3> filters = {Interpolation::bilinear, Interpolation::bicubic,
                                                Interpolation::nearest};
  const std::array<CropMode, 3> crops = {CropMode::random_resized, CropMode::center, CropMode::full};
  std::array<int, 4> compared{};  // samples compared at each level
  for (int trial = 0; trial < 90; ++trial) {
    TransformConfig c;
    c.size = std::array{224, 37, 64, 8, 150}[static_cast<std::size_t>(trial % 5)];
    c.height = trial % 7 == 0 ? c.size / 2 + 8 : 0;
    c.crop = crops[static_cast<std::size_t>(trial % 3)];
    c.resize = std::max(c.out_width(), c.out_height()) + uniform(0, 40);
    c.interpolation = filters[static_cast<std::size_t>((trial / 3) % 3)];
    c.layout = trial % 2 == 0 ? Layout::nchw_f32 : Layout::nhwc_u8;
    DecodedImage img;
    img.width = uniform(8, 640);
    img.height = uniform(8, 480);
    img.pixels.resize(static_cast<std::size_t>(img.width) * static_cast<std::size_t>(img.height) * 4);
    for (std::size_t i = 0; i < img.pixels.size(); ++i) {
      // Edges and noise: every byte value, steps the cubic's lobes overshoot.
      img.pixels[i] =
          static_cast<std::uint8_t>((i / 4) % 7 < 3 ? uniform(0, 255) : static_cast<int>((i / 4) % 2) * 255);
    }
    ImageHeader h;
    h.width = img.width;
    h.height = img.height;
    SampleRng rng(5, 0, static_cast<std::uint64_t>(trial));
    CropPlan plan;
    try {
      plan = plan_crop(h, c, rng);
    } catch (const DataError&) {
      continue;  // a shrink past kMaxShrink
    }
    std::vector<std::vector<std::byte>> outs;
    for (const SimdLevel level : levels) {
      if (set_simd_level(level) != level) continue;  // the CPU has no such level
      std::vector<std::byte> buffer(2 * c.sample_bytes() + 128);
      auto* base = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(buffer.data()) + 63) / 64 * 64);
      const std::span<std::byte> planned(base, c.sample_bytes());
      const std::span<std::byte> whole(base + (c.sample_bytes() + 63) / 64 * 64, c.sample_bytes());
      SampleWriter w(c);
      w.prepare(plan, planned);
      w.sink().begin(plan.region.width, plan.region.height);
      for (int y = 0; y < plan.region.height; ++y) {
        w.sink().row(img.row(plan.region.y + y) + static_cast<std::size_t>(plan.region.x) * 4);
      }
      ASSERT_TRUE(w.complete());
      w.write(img, Region{}, trial % 4 < 2, whole);
      outs.emplace_back(planned.begin(), planned.end());
      outs.back().insert(outs.back().end(), whole.begin(), whole.end());
      ++compared[static_cast<std::size_t>(level)];
    }
    for (std::size_t l = 1; l < outs.size(); ++l) {
      const auto at = std::mismatch(outs[l].begin(), outs[l].end(), outs[0].begin()).first - outs[l].begin();
      ASSERT_TRUE(outs[l] == outs[0]) << "trial " << trial << ": level " << l << " differs from the scalar path ("
                                      << img.width << "x" << img.height << " to " << c.out_width() << "x"
                                      << c.out_height() << ", crop " << to_string(c.crop) << ", filter "
                                      << to_string(c.interpolation) << ", " << to_string(c.layout)
                                      << ", first difference at byte " << at << " of " << outs[l].size() << ")";
    }
  }
  EXPECT_GT(compared[0], 60);
  EXPECT_EQ(compared[1], compared[0]);
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") != 0) {
    EXPECT_EQ(compared[2], compared[0]) << "AVX2 was never compared";
  }
  if (__builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx512bw") != 0) {
    EXPECT_EQ(compared[3], compared[0]) << "AVX-512 was never compared";
  }
#endif
}

TEST(TransformTest, TheFlipProbabilityIsHonoured) {
  TransformConfig c;
  ImageHeader h;
  h.width = 320;
  h.height = 240;
  for (const double p : {0.0, 0.2, 0.5, 1.0}) {
    c.flip_p = p;
    int flips = 0;
    for (std::uint64_t i = 0; i < 4000; ++i) {
      SampleRng rng(5, 0, i);
      flips += plan_crop(h, c, rng).flip ? 1 : 0;
    }
    EXPECT_NEAR(flips / 4000.0, p, 0.03) << "flip_p " << p;
  }
  c.flip_p = 1.5;
  EXPECT_THROW(c.validate(), ConfigError);
}

TEST(TransformTest, NearestTakesThePixelUnderEachCentre) {
  TransformConfig c;
  c.size = 10;
  c.layout = Layout::nhwc_u8;
  c.interpolation = Interpolation::nearest;
  // 40 x 30 to 10 x 10: column floor((x + 0.5) * 4), row floor((y + 0.5) * 3),
  // exact source values (no averaging at all).
  const DecodedImage img = gradient(40, 30);
  std::vector<std::byte> out(c.sample_bytes());
  SampleWriter(c).write(img, Region{}, false, out);
  const auto* u = reinterpret_cast<const std::uint8_t*>(out.data());
  for (int y = 0; y < 10; ++y) {
    for (int x = 0; x < 10; ++x) {
      const std::uint8_t* px = u + (static_cast<std::size_t>(y) * 10 + static_cast<std::size_t>(x)) * 3;
      ASSERT_EQ(px[0], static_cast<int>((x + 0.5) * 4)) << x << "," << y;
      ASSERT_EQ(px[1], static_cast<int>((y + 0.5) * 3)) << x << "," << y;
      ASSERT_EQ(px[2], 7);
    }
  }
  // Bilinear of the same image averages: it is not the nearest result.
  c.interpolation = Interpolation::bilinear;
  std::vector<std::byte> smooth(c.sample_bytes());
  SampleWriter(c).write(img, Region{}, false, smooth);
  EXPECT_NE(std::memcmp(out.data(), smooth.data(), out.size()), 0);
  EXPECT_THROW((void)parse_interpolation("lanczos"), ConfigError);
}

}  // namespace
}  // namespace pinfeed::loader
