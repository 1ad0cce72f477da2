// Transforms: crop planning against torchvision's bounds, antialiased
// downscaling, and the sample writer's float and byte outputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>

#include <cmath>
#include <cstring>
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

TEST(TransformTest, CenterCropKeepsTheResizeFraction) {
  TransformConfig c;
  c.crop = CropMode::center;
  ImageHeader h;
  h.width = 512;
  h.height = 384;
  SampleRng rng(0, 0, 0);
  const CropPlan p = plan_crop(h, c, rng);
  EXPECT_EQ(p.region.width, 336);  // 384 * 224 / 256
  EXPECT_EQ(p.region.x, (512 - 336) / 2);
  EXPECT_FALSE(p.flip);
}

TEST(TransformTest, DownscalingIsAntialiased) {
  // Noise shrunk exactly 4x (both axes, columns only, rows only) must come out
  // as the mean of each source block (a box filter). Two-tap bilinear sampling
  // would read 2 of the pixels and land far from the block means.
  TransformConfig c;
  c.size = 56;
  c.layout = Layout::nhwc_u8;
  for (const auto& [fx, fy] : {std::pair{4, 4}, std::pair{4, 1}, std::pair{1, 4}}) {
    DecodedImage img;
    img.width = 56 * fx;
    img.height = 56 * fy;
    img.pixels.resize(static_cast<std::size_t>(img.width * img.height * 4));
    SampleRng rng(1, 2, 3);
    for (std::size_t i = 0; i < img.pixels.size(); i += 4) {
      const auto v = static_cast<std::uint8_t>(rng.below(256));
      img.pixels[i] = img.pixels[i + 1] = img.pixels[i + 2] = v;
      img.pixels[i + 3] = 255;
    }
    std::vector<std::byte> out(c.sample_bytes());
    SampleWriter(c).write(img, Region{}, false, out);
    double diff = 0;
    for (int y = 0; y < 56; ++y) {
      for (int x = 0; x < 56; ++x) {
        int sum = 0;
        for (int dy = 0; dy < fy; ++dy) {
          for (int dx = 0; dx < fx; ++dx) {
            sum += img.pixels[static_cast<std::size_t>(((y * fy + dy) * img.width + x * fx + dx) * 4)];
          }
        }
        diff += std::abs(static_cast<double>(sum) / (fx * fy) - static_cast<double>(out[static_cast<std::size_t>((y * 56 + x) * 3)]));
      }
    }
    EXPECT_LT(diff / (56 * 56), 3.0) << "mean distance from the " << fx << "x" << fy << " block means";
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
    for (const bool flip : {false, true}) {
      std::vector<std::byte> out(c.sample_bytes());
      SampleWriter(c).write(img, Region{}, flip, out);
      for (std::size_t i = 0; i < out.size(); ++i) {
        ASSERT_EQ(static_cast<int>(out[i]), rgb[i % 3]) << w << "x" << h << " -> 56x56, byte " << i;
      }
    }
  }
}

TEST(TransformTest, ColumnsAreBlendedWithWeightsThatSumTo256) {
  // Only the columns scale (100 -> 56, rows 56 -> 56): each output pixel is
  // the two source columns around (x + 0.5) * 100/56 - 0.5, weighted in
  // 256ths and rounded, whichever code path (SIMD or not) computes it.
  TransformConfig c;
  c.size = 56;
  c.layout = Layout::nhwc_u8;
  DecodedImage img;
  img.width = 100;
  img.height = 56;
  img.pixels.resize(static_cast<std::size_t>(img.width * img.height * 4));
  SampleRng rng(4, 5, 6);
  for (auto& p : img.pixels) p = static_cast<std::uint8_t>(rng.below(256));
  std::vector<std::byte> out(c.sample_bytes());
  SampleWriter(c).write(img, Region{}, false, out);
  for (int y = 0; y < 56; ++y) {
    for (int x = 0; x < 56; ++x) {
      const double pos = std::clamp((x + 0.5) * 100.0 / 56 - 0.5, 0.0, 99.0);
      const int x0 = static_cast<int>(pos);
      const int f = static_cast<int>(std::lround((pos - x0) * 256.0));
      const int x1 = std::min(x0 + 1, 99);
      for (int ch = 0; ch < 3; ++ch) {
        const int bgra = 2 - ch;  // RGB out of BGRA
        const auto at = [&](int col) {
          return static_cast<int>(img.pixels[static_cast<std::size_t>((y * 100 + col) * 4 + bgra)]);
        };
        const int want = (at(x0) * (256 - f) + at(x1) * f + 128) >> 8;
        ASSERT_EQ(static_cast<int>(out[static_cast<std::size_t>((y * 56 + x) * 3 + ch)]), want)
            << "pixel " << x << "," << y << " channel " << ch;
      }
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
  EXPECT_NEAR(f[1], (250 / 255.0 - 0.485) / 0.229, 1e-5);          // R plane
  EXPECT_NEAR(f[256 + 1], (128 / 255.0 - 0.456) / 0.224, 1e-5);    // G plane
  EXPECT_NEAR(f[512 + 1], (10 / 255.0 - 0.406) / 0.225, 1e-5);     // B plane
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
      std::uint8_t* px = img.pixels.data() + (static_cast<std::size_t>(y) * static_cast<std::size_t>(width) + static_cast<std::size_t>(x)) * 4;
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
      ASSERT_NEAR(px[0], 2 * x + 0.5, 2.0) << x << "," << y;  // R: columns 2x, 2x+1 (libyuv's linear phase)
      ASSERT_NEAR(px[1], 2 * y + 0.5, 1.0) << x << "," << y;  // G: mean of rows 2y, 2y+1
    }
  }
  // The center crop keeps height/resize and width/resize of the shorter side.
  c.crop = CropMode::center;
  c.resize = 64;
  ImageHeader h;
  h.width = 400;
  h.height = 200;
  SampleRng rng(0, 0, 0);
  const CropPlan p = plan_crop(h, c, rng);
  EXPECT_EQ(p.region.width, 150);  // 48 * 200 / 64
  EXPECT_EQ(p.region.height, 75);  // 24 * 200 / 64
  EXPECT_EQ(p.region.x, (400 - 150) / 2);
  c.resize = 40;  // under the crop's longer side
  EXPECT_THROW(c.validate(), ConfigError);
  c.crop = CropMode::random_resized;
  c.height = 1;
  EXPECT_THROW(c.validate(), ConfigError);
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
  EXPECT_THROW((void)parse_interpolation("bicubic"), ConfigError);
}

}  // namespace
}  // namespace pinfeed::loader
