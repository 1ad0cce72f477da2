// JPEG decode and transforms: ROI + scaled decode against full decode then
// crop/resize; the colour spaces and encodings ImageNet holds.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <malloc.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/image_decoder.hpp"
#include "pinfeed/loader/jpeg_decoder.hpp"
#include "pinfeed/loader/sample_rng.hpp"
#include "pinfeed/loader/synthetic.hpp"
#include "pinfeed/loader/transform.hpp"

namespace pinfeed::loader {
namespace {

std::vector<std::byte> jpeg(int w, int h, JpegKind kind = JpegKind::baseline, int quality = 95) {
  SyntheticImageSpec s;
  s.width = w;
  s.height = h;
  s.kind = kind;
  s.quality = quality;
  return make_synthetic_jpeg(1, 3, 0, s);
}

/// Mean absolute difference per channel value between two BGRA images' RGB.
/// The image's rows packed tightly (width * 4 bytes each), whatever its stride.
std::vector<std::uint8_t> packed(const DecodedImage& img) {
  const auto row_bytes = static_cast<std::size_t>(img.width) * 4;
  std::vector<std::uint8_t> out(row_bytes * static_cast<std::size_t>(img.height));
  for (int y = 0; y < img.height; ++y)
    std::memcpy(out.data() + static_cast<std::size_t>(y) * row_bytes, img.row(y), row_bytes);
  return out;
}

double mean_abs_diff(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b) {
  double sum = 0;
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (i % 4 == 3) continue;
    sum += std::abs(static_cast<int>(a[i]) - static_cast<int>(b[i]));
    ++n;
  }
  return sum / static_cast<double>(n);
}

TEST(JpegDecoderTest, RegionDecodeEqualsFullDecodeThenCrop) {
  const auto data = jpeg(400, 300);
  JpegDecoder d;
  DecodedImage full, region;
  d.decode_full(data, full, "x.jpg");
  ASSERT_EQ(full.width, 400);
  const Region r{123, 77, 150, 101};
  d.decode(data, r, 1, region, "x.jpg");
  ASSERT_EQ(region.width, 150);
  ASSERT_EQ(region.height, 101);
  EXPECT_GT(region.stride_bytes(), 150U * 4) << "a mid-image crop is decoded in place at the iMCU-widened width";
}

/// Region (r, at 1/scale) of `data` decoded alone against the same pixels of
/// the whole image decoded at that scale (`full`): the number of bytes that differ.
std::size_t region_mismatches(JpegDecoder& d, std::span<const std::byte> data, const DecodedImage& full,
                              const Region& r, int scale) {
  DecodedImage region;
  d.decode(data, r, scale, region, "x.jpg");
  const int x0 = r.x / scale, y0 = r.y / scale;
  std::size_t mismatches = 0;
  for (int y = 0; y < region.height; ++y) {
    const std::uint8_t* a = region.row(y);
    const std::uint8_t* b = full.row(y + y0) + static_cast<std::size_t>(x0) * 4;
    for (int x = 0; x < region.width * 4; ++x) mismatches += a[x] != b[x] ? 1 : 0;
  }
  return mismatches;
}

TEST(JpegDecoderTest, RegionDecodeIsTheFullDecodeBitForBit) {
  // Note [Decode margin]: every subsampling, progressive, grey and CMYK,
  // odd sizes, regions touching each edge, one pixel wide, starting on and
  // just past iMCU boundaries, at every DCT scale.
  struct Case {
    int w, h, subsampling;
    JpegKind kind;
  };
  const Case cases[] = {{401, 299, 420, JpegKind::baseline},    {400, 300, 422, JpegKind::baseline},
                        {333, 251, 444, JpegKind::baseline},    {517, 389, 420, JpegKind::progressive},
                        {300, 200, 444, JpegKind::progressive}, {250, 190, 420, JpegKind::grayscale},
                        {210, 170, 420, JpegKind::cmyk},        {97, 61, 420, JpegKind::baseline}};
  SampleRng rng(11, 0, 0);
  JpegDecoder d;
  for (const Case& c : cases) {
    SyntheticImageSpec spec;
    spec.width = c.w;
    spec.height = c.h;
    spec.kind = c.kind;
    spec.subsampling = c.subsampling;
    spec.quality = 90;
    const auto data = make_synthetic_jpeg(5, 2, 1, spec);
    std::vector<Region> regions{{16, 16, 64, 48},     {17, 15, 63, 49},     {15, 17, 33, 31},
                                {0, 0, c.w, c.h},     {0, 0, 40, 30},       {c.w - 41, c.h - 29, 41, 29},
                                {c.w / 2, 0, 1, c.h}, {0, c.h / 2, c.w, 1}, {31, 33, 1, 1}};
    for (int i = 0; i < 24; ++i) {
      const int w = 1 + static_cast<int>(rng.uniform() * (c.w - 1)),
                h = 1 + static_cast<int>(rng.uniform() * (c.h - 1));
      regions.push_back(
          Region{static_cast<int>(rng.uniform() * (c.w - w)), static_cast<int>(rng.uniform() * (c.h - h)), w, h});
    }
    for (const int scale : {1, 2, 4, 8}) {
      DecodedImage full;
      d.decode(data, Region{0, 0, c.w, c.h}, scale, full, "x.jpg");
      for (const Region& r : regions) {
        EXPECT_EQ(region_mismatches(d, data, full, r, scale), 0U)
            << fmt::format("{}x{} {} kind {} scale 1/{}: region {},{} {}x{}", c.w, c.h, c.subsampling,
                           static_cast<int>(c.kind), scale, r.x, r.y, r.width, r.height);
      }
    }
  }
}

TEST(JpegDecoderTest, ScaledDecodeMatchesResizingTheFullImage) {
  const auto data = jpeg(480, 360);
  JpegDecoder d;
  DecodedImage full, quarter;
  d.decode_full(data, full, "x.jpg");
  d.decode(data, Region{0, 0, 480, 360}, 4, quarter, "x.jpg");
  ASSERT_EQ(quarter.width, 120);
  ASSERT_EQ(quarter.height, 90);
  // Reference: a 4x4 box average of the full decode.
  const auto whole = packed(full);
  std::vector<std::uint8_t> ref(120 * 90 * 4);
  for (int y = 0; y < 90; ++y) {
    for (int x = 0; x < 120; ++x) {
      for (int c = 0; c < 4; ++c) {
        int sum = 0;
        for (int dy = 0; dy < 4; ++dy) {
          for (int dx = 0; dx < 4; ++dx)
            sum += whole[static_cast<std::size_t>(((y * 4 + dy) * 480 + x * 4 + dx) * 4 + c)];
        }
        ref[static_cast<std::size_t>((y * 120 + x) * 4 + c)] = static_cast<std::uint8_t>(sum / 16);
      }
    }
  }
  EXPECT_LT(mean_abs_diff(packed(quarter), ref), 4.0);
}

TEST(JpegDecoderTest, GrayscaleCmykAndProgressiveComeOutAsRgb) {
  JpegDecoder d;
  DecodedImage base, img;
  d.decode_full(jpeg(160, 120, JpegKind::baseline), base, "base.jpg");
  const auto base_pixels = packed(base);
  for (const auto kind : {JpegKind::progressive, JpegKind::cmyk, JpegKind::grayscale}) {
    const auto data = jpeg(160, 120, kind);
    const ImageHeader h = d.header(data, "k.jpg");
    EXPECT_EQ(h.width, 160);
    EXPECT_EQ(h.progressive, kind == JpegKind::progressive);
    EXPECT_EQ(h.components, kind == JpegKind::cmyk ? 4 : kind == JpegKind::grayscale ? 1 : 3);
    d.decode(data, Region{10, 10, 100, 80}, 1, img, "k.jpg");
    ASSERT_EQ(img.width, 100);
    const auto pixels = packed(img);
    if (kind == JpegKind::grayscale) {
      for (std::size_t i = 0; i < pixels.size(); i += 4) {
        ASSERT_EQ(pixels[i], pixels[i + 1]);
        ASSERT_EQ(pixels[i + 1], pixels[i + 2]);
      }
      continue;
    }
    // Colour kinds decode to the same picture as the baseline encoding.
    std::vector<std::uint8_t> crop(pixels.size());
    for (int y = 0; y < 80; ++y) {
      std::memcpy(&crop[static_cast<std::size_t>(y * 100 * 4)],
                  &base_pixels[static_cast<std::size_t>(((y + 10) * 160 + 10) * 4)], 400);
    }
    EXPECT_LT(mean_abs_diff(pixels, crop), kind == JpegKind::cmyk ? 6.0 : 2.0);
  }
}

TEST(JpegDecoderTest, StreamedRowsEqualTheDecodedRegion) {
  // The loader streams rows from the decoder into the writer; the region
  // decoded whole and then written must give the same bytes, for every
  // encoding and for crops, DCT scales and flips.
  JpegDecoder d;
  TransformConfig c;
  c.size = 32;
  for (const auto kind : {JpegKind::baseline, JpegKind::progressive, JpegKind::cmyk, JpegKind::grayscale}) {
    const auto data = jpeg(200, 150, kind);
    for (std::uint64_t i = 0; i < 8; ++i) {
      for (const auto layout : {Layout::nchw_f32, Layout::nhwc_u8}) {
        c.layout = layout;
        SampleWriter writer(c);
        std::vector<std::byte> streamed(c.sample_bytes()), whole(c.sample_bytes());
        SampleRng rng(9, 1, i);
        const CropPlan p = plan_crop(d.header(data, "s.jpg"), c, rng);
        const int scale = i % 4 == 3 ? 2 : 1;
        d.decode_planned(
            data,
            [&](const ImageHeader&) {
              writer.prepare(p.flip, streamed);
              return JpegDecoder::Plan{p.region, scale};
            },
            writer.sink(), "s.jpg");
        ASSERT_TRUE(writer.complete());
        DecodedImage img;
        d.decode(data, p.region, scale, img, "s.jpg");
        writer.write(img, Region{}, p.flip, whole);
        EXPECT_EQ(std::memcmp(streamed.data(), whole.data(), whole.size()), 0)
            << "kind " << static_cast<int>(kind) << " sample " << i << " layout " << to_string(layout);
      }
    }
  }
}

TEST(JpegDecoderTest, ASinkThatThrowsLeavesTheDecoderUsable) {
  struct Failing final : RowSink {
    int rows = 0;
    void begin(int /*width*/, int /*height*/) override {}
    void row(const std::uint8_t* /*bgra*/) override {
      if (++rows == 5) throw std::runtime_error("sink full");
    }
  } failing;
  JpegDecoder d;
  const auto data = jpeg(160, 120);
  const auto plan = [](const ImageHeader& h) { return JpegDecoder::Plan{Region{0, 0, h.width, h.height}, 1}; };
  EXPECT_THROW(d.decode_planned(data, plan, failing, "t.jpg"), std::runtime_error);
  DecodedImage img;
  d.decode_full(data, img, "t.jpg");
  EXPECT_EQ(img.height, 120) << "the next decode starts cleanly";
}

TEST(JpegDecoderTest, BadInputIsADataErrorNamingTheFile) {
  JpegDecoder d;
  DecodedImage img;
  const auto good = jpeg(64, 48);
  const auto expect_error = [&](std::vector<std::byte> data, const char* what) {
    try {
      d.decode_full(data, img, "bad.jpg");
      ADD_FAILURE() << what << ": no error";
    } catch (const DataError& e) {
      EXPECT_EQ(e.path(), "bad.jpg") << what;
    }
  };
  expect_error({}, "empty");
  expect_error(std::vector<std::byte>(good.begin(), good.begin() + static_cast<long>(good.size() / 2)), "truncated");
  std::vector<std::byte> png{std::byte{0x89}, std::byte{'P'}, std::byte{'N'}, std::byte{'G'},
                             std::byte{13},   std::byte{10},  std::byte{26},  std::byte{10}};
  expect_error(png, "png");
  SampleRng rng(1, 2, 3);
  std::vector<std::byte> noise(5000);
  for (auto& b : noise) b = static_cast<std::byte>(rng.below(256));
  expect_error(noise, "random bytes");
  // A header claiming 60000 x 60000: refused before any pixel is decoded.
  auto huge = good;
  for (std::size_t i = 0; i + 8 < huge.size(); ++i) {
    if (huge[i] == std::byte{0xff} && huge[i + 1] == std::byte{0xc0}) {  // SOF0: len(2) precision(1) height(2) width(2)
      huge[i + 5] = std::byte{0xea};
      huge[i + 6] = std::byte{0x60};
      huge[i + 7] = std::byte{0xea};
      huge[i + 8] = std::byte{0x60};
      break;
    }
  }
  try {
    (void)d.header(huge, "huge.jpg");
    ADD_FAILURE() << "huge: no error";
  } catch (const DataError& e) {
    EXPECT_NE(e.reason().find("60000x60000"), std::string::npos) << e.reason();
  }
  d.decode_full(good, img, "good.jpg");  // the decoder is still usable afterwards
  EXPECT_EQ(img.width, 64);
}

/// Collects streamed rows (BGRA) into one packed buffer.
class CollectRows final : public RowSink {
 public:
  int width = 0, height = 0;
  std::vector<std::uint8_t> pixels;
  void begin(int w, int h) override {
    width = w;
    height = h;
    pixels.clear();
  }
  void row(const std::uint8_t* bgra) override {
    pixels.insert(pixels.end(), bgra, bgra + static_cast<std::size_t>(width) * 4);
  }
};

/// The RGB pixels of `rgb` in region r, as BGRA with alpha 255.
std::vector<std::uint8_t> rgb_region_as_bgra(const std::vector<std::uint8_t>& rgb, int width, const Region& r) {
  std::vector<std::uint8_t> out;
  for (int y = r.y; y < r.y + r.height; ++y) {
    for (int x = r.x; x < r.x + r.width; ++x) {
      const std::uint8_t* p =
          &rgb[(static_cast<std::size_t>(y) * static_cast<std::size_t>(width) + static_cast<std::size_t>(x)) * 3];
      out.insert(out.end(), {p[2], p[1], p[0], 255});
    }
  }
  return out;
}

TEST(ImageDecoderTest, LosslessPngAndWebPDecodeToTheExactPixelsFullAndByRegion) {
  const int w = 97, h = 61;
  const auto rgb = render_synthetic_rgb(5, 2, 1, w, h);
  ImageDecoder d;
  const Region whole{0, 0, w, h}, part{13, 7, 40, 30};
  for (const auto& [name, data] : {std::pair{std::string("a.png"), encode_png(rgb.data(), w, h)},
                                   std::pair{std::string("a-interlaced.png"), encode_png(rgb.data(), w, h, true)},
                                   std::pair{std::string("a.webp"), encode_webp(rgb.data(), w, h, true)}}) {
    SCOPED_TRACE(name);
    EXPECT_EQ(sniff_format(data), name.ends_with("webp") ? ImageFormat::webp : ImageFormat::png);
    const ImageHeader hd = d.header(data, name);
    EXPECT_EQ(hd.width, w);
    EXPECT_EQ(hd.height, h);
    DecodedImage full;
    d.decode_full(data, full, name);
    EXPECT_EQ(packed(full), rgb_region_as_bgra(rgb, w, whole));
    for (const Region& r : {whole, part}) {
      CollectRows rows;
      d.decode_planned(
          data,
          [&](const ImageHeader&) {
            return JpegDecoder::Plan{r, 4};
          },
          rows, name);  // scale ignored
      EXPECT_EQ(rows.width, r.width);
      EXPECT_EQ(rows.height, r.height);
      EXPECT_EQ(rows.pixels, rgb_region_as_bgra(rgb, w, r));
    }
    EXPECT_NO_THROW((void)d.verify(data, name));
  }
  // A lossy WebP is close to the source.
  const auto lossy = encode_webp(rgb.data(), w, h, false, 95);
  DecodedImage img;
  d.decode_full(lossy, img, "lossy.webp");
  EXPECT_LT(mean_abs_diff(packed(img), rgb_region_as_bgra(rgb, w, whole)), 12.0);
}

// The codec registry: every row's format is sniffed from the bytes its
// encoder writes, decodes through each entry point, and is named the same
// way by every list read from the table. A new row without a sniffer, a
// decoder or an encoder fails here.
TEST(ImageDecoderTest, EveryCodecRowSniffsDecodesAndNamesItsFormat) {
  SyntheticImageSpec spec;
  spec.width = 64;
  spec.height = 48;
  ImageDecoder d;
  std::vector<std::string> words;
  for (const ImageCodec& c : kImageCodecs) {
    SCOPED_TRACE(std::string(c.word));
    words.emplace_back(c.word);
    const auto data = make_synthetic_image(1, 2, 3, spec, std::string(c.word));
    EXPECT_EQ(sniff_format(data), c.format);
    const auto rgb = render_synthetic_rgb(1, 2, 3, 32, 24);
    const auto encoded = encode_image(c.format, rgb.data(), 32, 24, 90);
    EXPECT_EQ(sniff_format(encoded), c.format);
    EXPECT_EQ(d.header(encoded, "e").width, 32);
    EXPECT_EQ(find_codec(c.format), &c);
    EXPECT_EQ(to_string(c.format), c.word);
    EXPECT_EQ(parse_image_format(c.word, "format"), c.format);
    EXPECT_EQ(extension(c.format), c.extensions[0]);
    for (std::string_view e : c.extensions) {
      if (!e.empty()) {
        EXPECT_EQ(format_for_extension(e), c.format) << e;
      }
    }
    const std::string name = fmt::format("a.{}", c.extensions[0]);
    const ImageHeader h = d.header(data, name);
    EXPECT_EQ(h.width, 64);
    EXPECT_EQ(h.height, 48);
    DecodedImage full;
    d.decode_full(data, full, name);
    EXPECT_EQ(full.width, 64);
    CollectRows rows;
    d.decode_planned(
        data,
        [](const ImageHeader&) {
          return JpegDecoder::Plan{Region{8, 4, 20, 10}, 1};
        },
        rows, name);
    EXPECT_EQ(rows.width, 20);
    EXPECT_EQ(rows.height, 10);
    EXPECT_EQ(d.verify(data, name).width, 64);
    // A truncated file of every format is a DataError naming it.
    const std::vector<std::byte> cut(data.begin(), data.begin() + static_cast<std::ptrdiff_t>(data.size() / 2));
    try {
      d.decode_full(cut, full, name);
      ADD_FAILURE() << "a truncated " << c.word << " decoded";
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(codec_word_list(), words);
  // The lists read the rows (join_list's own form: enum_words_test).
  std::vector<std::string> displays, extensions;
  for (const ImageCodec& c : kImageCodecs) {
    displays.emplace_back(c.display);
    for (std::string_view e : c.extensions) {
      if (!e.empty()) extensions.push_back(fmt::format(".{}", e));
    }
  }
  EXPECT_EQ(codec_names(), join_list(displays, "or"));
  EXPECT_EQ(codec_words("and"), join_list(words, "and"));
  EXPECT_EQ(fmt::format("{}", fmt::join(extensions, ", ")), codec_extensions());
  EXPECT_EQ(format_for_extension("gif"), ImageFormat::unknown);
  EXPECT_EQ(extension(ImageFormat::unknown), "bin");
  EXPECT_THROW((void)parse_image_format("gif", "format"), ConfigError);
  EXPECT_THROW((void)encode_image(ImageFormat::unknown, nullptr, 1, 1, 90), ConfigError);
  try {
    ImageDecoder().decode_full(std::vector<std::byte>(16, std::byte{'G'}), *std::make_unique<DecodedImage>(), "x.gif");
    ADD_FAILURE() << "an unknown format decoded";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("not a {} image", codec_names())), std::string::npos) << e.what();
  }
}

TEST(ImageDecoderTest, BadPngAndWebPAreDataErrorsNamingTheFile) {
  const int w = 64, h = 48;
  const auto rgb = render_synthetic_rgb(5, 2, 1, w, h);
  ImageDecoder d(1U << 20U);
  DecodedImage img;
  CollectRows rows;
  const auto whole = [](const ImageHeader& hd) { return JpegDecoder::Plan{Region{0, 0, hd.width, hd.height}, 1}; };
  const auto expect_error = [&](const std::vector<std::byte>& data, const std::string& name, const char* needle) {
    for (int way = 0; way < 3; ++way) {
      try {
        if (way == 0) d.decode_full(data, img, name);
        if (way == 1) d.decode_planned(data, whole, rows, name);
        if (way == 2) (void)d.verify(data, name);
        ADD_FAILURE() << name << " way " << way << ": no error";
      } catch (const DataError& e) {
        EXPECT_EQ(e.path(), name);
        EXPECT_NE(e.reason().find(needle), std::string::npos) << name << ": " << e.reason();
      }
    }
  };
  for (const auto& [name, data] : {std::pair{std::string("t.png"), encode_png(rgb.data(), w, h)},
                                   std::pair{std::string("t.webp"), encode_webp(rgb.data(), w, h, false)}}) {
    expect_error(std::vector<std::byte>(data.begin(), data.begin() + static_cast<long>(data.size() / 2)), name,
                 name.ends_with("png") ? "PNG" : "WebP");
  }
  // A PNG header claiming 20000 x 20000 (over the 1 MP limit): refused
  // before any pixel buffer is sized.
  auto big = encode_png(rgb.data(), w, h);
  const std::uint8_t dims[8] = {0, 0, 0x4e, 0x20, 0, 0, 0x4e, 0x20};
  std::memcpy(big.data() + 16, dims, 8);  // IHDR width, height
  expect_error(big, "big.png", "exceeds the limit");
  expect_error(std::vector<std::byte>(300, std::byte{'x'}), "noise.jpg",
               fmt::format("not a {}", codec_names()).c_str());
  expect_error({}, "empty.png", "empty");
  // The decoder is still usable afterwards.
  d.decode_full(encode_png(rgb.data(), w, h), img, "good.png");
  EXPECT_EQ(img.width, w);
}

TEST(ImageDecoderTest, VerifyingAHugeClaimedJpegKeepsOnlyRows) {
  // 13000 x 13000 claimed by a few KB: decoding it whole costs 676 MB; the
  // check keeps a few rows. Peak RSS growth stays far below the image.
  auto data = jpeg(64, 48);
  for (std::size_t i = 0; i + 8 < data.size(); ++i) {
    if (data[i] == std::byte{0xff} && data[i + 1] == std::byte{0xc0}) {
      data[i + 5] = std::byte{0x32}, data[i + 6] = std::byte{0xc8}, data[i + 7] = std::byte{0x32},
               data[i + 8] = std::byte{0xc8};
      break;
    }
  }
  ImageDecoder d;
  EXPECT_EQ(d.header(data, "claims.jpg").width, 13000);
  const auto rss_peak_kb = [] {
    std::ifstream in("/proc/self/status");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
    }
    return 0L;
  };
  const long before = rss_peak_kb();
  EXPECT_THROW((void)d.verify(data, "claims.jpg"), DataError);  // its data ends early
  EXPECT_LT(rss_peak_kb() - before, 64 * 1024) << "kB of peak RSS added by verifying one image";
}

TEST(ScratchBufferTest, LargeBlocksBypassMallocSmallOnesDoNot) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "under sanitizers every scratch block goes through operator new, so ASan checks its bounds";
#else
  const auto malloc_bytes = [] {
    const struct mallinfo2 m = mallinfo2();
    return m.uordblks + m.hblkhd;  // in use from arenas + malloc's own mmapped blocks
  };
  const std::size_t big = 4 << 20;
  const std::size_t before = malloc_bytes();
  std::vector<std::uint8_t> control(big, 1);
  EXPECT_GE(malloc_bytes() - before, big) << "the measure must see an ordinary vector";
  const std::size_t with_control = malloc_bytes();
  ScratchBytes scratch(big, 1);
  EXPECT_LT(malloc_bytes() - with_control, kScratchMapThreshold) << "a large scratch block must not come from malloc";
  scratch.resize(2 * big, 2);  // growth maps a new block and unmaps the old
  EXPECT_EQ(scratch[big - 1], 1);
  EXPECT_EQ(scratch[2 * big - 1], 2);
  EXPECT_LT(malloc_bytes() - with_control, kScratchMapThreshold);
  ScratchBytes small(kScratchMapThreshold / 2, 3);  // over the tcache sizes, under the threshold
  EXPECT_GE(malloc_bytes() - with_control, kScratchMapThreshold / 2) << "small blocks stay with operator new";
#endif
}

}  // namespace
}  // namespace pinfeed::loader
