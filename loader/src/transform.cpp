#include "pinfeed/loader/transform.hpp"

#include <fmt/format.h>
#include <libyuv/convert_from_argb.h>
#include <libyuv/planar_functions.h>
#include <libyuv/scale_argb.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "pinfeed/error.hpp"

namespace pinfeed::loader {

CropMode parse_crop_mode(std::string_view text) {
  if (text == "random") return CropMode::random_resized;
  if (text == "center") return CropMode::center;
  if (text == "full") return CropMode::full;
  throw ConfigError(fmt::format("crop '{}' is not one of random, center, full", text));
}

Layout parse_layout(std::string_view text) {
  if (text == "nhwc-u8") return Layout::nhwc_u8;
  if (text == "nchw-f32") return Layout::nchw_f32;
  throw ConfigError(fmt::format("layout '{}' is not one of nhwc-u8, nchw-f32", text));
}

std::string_view to_string(CropMode m) noexcept {
  switch (m) {
    case CropMode::random_resized: return "random";
    case CropMode::center: return "center";
    case CropMode::full: return "full";
  }
  return "?";
}

std::string_view to_string(Layout l) noexcept { return l == Layout::nhwc_u8 ? "nhwc-u8" : "nchw-f32"; }

void TransformConfig::validate() const {
  if (size < 8 || size > 4096) throw ConfigError(fmt::format("transform size must be 8..4096, got {}", size));
  if (crop == CropMode::center && (resize < size || resize > 8192)) {
    throw ConfigError(fmt::format("transform resize must be size..8192 ({}..8192), got {}", size, resize));
  }
  if (!(scale_min > 0 && scale_min <= scale_max && scale_max <= 1.0)) {
    throw ConfigError(fmt::format("transform scale range [{}, {}] must satisfy 0 < min <= max <= 1", scale_min, scale_max));
  }
  if (!(ratio_min > 0 && ratio_min <= ratio_max)) {
    throw ConfigError(fmt::format("transform ratio range [{}, {}] must satisfy 0 < min <= max", ratio_min, ratio_max));
  }
  for (std::size_t c = 0; c < 3; ++c) {
    if (!(std[c] > 0)) throw ConfigError(fmt::format("transform std[{}] must be > 0, got {}", c, std[c]));
  }
}

std::size_t TransformConfig::sample_bytes() const noexcept {
  return static_cast<std::size_t>(size) * static_cast<std::size_t>(size) * 3 * element_bytes();
}

namespace {

Region random_resized_region(int width, int height, const TransformConfig& c, SampleRng& rng) {
  const double area = static_cast<double>(width) * height;
  const double log_lo = std::log(c.ratio_min), log_hi = std::log(c.ratio_max);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * rng.uniform(c.scale_min, c.scale_max);
    const double aspect = std::exp(rng.uniform(log_lo, log_hi));
    const auto w = static_cast<int>(std::lround(std::sqrt(target * aspect)));
    const auto h = static_cast<int>(std::lround(std::sqrt(target / aspect)));
    if (w > 0 && h > 0 && w <= width && h <= height) {
      const auto y = static_cast<int>(rng.below(static_cast<std::uint64_t>(height - h) + 1));
      const auto x = static_cast<int>(rng.below(static_cast<std::uint64_t>(width - w) + 1));
      return Region{x, y, w, h};
    }
  }
  // torchvision's fallback: the largest centred crop within the ratio range.
  const double in_ratio = static_cast<double>(width) / height;
  int w = width, h = height;
  if (in_ratio < c.ratio_min) {
    h = std::max(1, static_cast<int>(std::lround(w / c.ratio_min)));
  } else if (in_ratio > c.ratio_max) {
    w = std::max(1, static_cast<int>(std::lround(h * c.ratio_max)));
  }
  return Region{(width - w) / 2, (height - h) / 2, w, h};
}

Region center_region(int width, int height, const TransformConfig& c) {
  // Resize(shorter = resize) then CenterCrop(size) keeps, of the original, a
  // centred size/resize fraction of the shorter side.
  const double keep = static_cast<double>(c.size) / c.resize;
  const int shorter = std::min(width, height);
  const int side = std::clamp(static_cast<int>(std::lround(shorter * keep)), 1, shorter);
  return Region{(width - side) / 2, (height - side) / 2, side, side};
}

}  // namespace

CropPlan plan_crop(const ImageHeader& header, const TransformConfig& c, SampleRng& rng) {
  CropPlan p;
  switch (c.crop) {
    case CropMode::random_resized:
      p.region = random_resized_region(header.width, header.height, c, rng);
      p.flip = c.flip && rng.uniform() < 0.5;
      break;
    case CropMode::center: p.region = center_region(header.width, header.height, c); break;
    case CropMode::full: p.region = Region{0, 0, header.width, header.height}; break;
  }
  if (c.dct_scaling) {
    // Only the scales libjpeg-turbo accelerates, and only while the scaled
    // region still covers the output (never upsample what DCT scaling dropped).
    for (const int s : {8, 4, 2}) {
      if (p.region.width / s >= c.size && p.region.height / s >= c.size) {
        p.scale = s;
        break;
      }
    }
  }
  if (!c.roi_decode) {
    // Measurement mode: decode everything, then crop in memory (see SampleStage).
    p.scale = 1;
  }
  return p;
}

namespace {

/// One output row: n BGRA pixels (read right to left when `flip`) to three
/// float rows r, g, b of x * scale[c] + bias[c]. On x86 with 16-byte aligned
/// rows, four pixels at a time: each channel is masked out of the 32-bit
/// pixels, converted and stored with non-temporal stores. The slot is written
/// once and never read here, so they skip the read-for-ownership of every
/// cache line. The rest, and other targets, take the same arithmetic in scalar.
void bgra_row_to_planes(const std::uint8_t* px, int n, bool flip, const std::array<float, 3>& scale,
                        const std::array<float, 3>& bias, float* r, float* g, float* b) {
  int x = 0;
#if defined(__SSE2__)
  const auto aligned = [](const float* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  if (aligned(r) && aligned(g) && aligned(b)) {
    const __m128i mask = _mm_set1_epi32(0xff);
    const __m128 sr = _mm_set1_ps(scale[0]), sg = _mm_set1_ps(scale[1]), sb = _mm_set1_ps(scale[2]);
    const __m128 br = _mm_set1_ps(bias[0]), bg = _mm_set1_ps(bias[1]), bb = _mm_set1_ps(bias[2]);
    for (; x + 4 <= n; x += 4) {
      __m128i v;
      if (flip) {  // outputs x..x+3 are source pixels n-1-x down to n-4-x
        v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(px + 4 * (n - 4 - x)));
        v = _mm_shuffle_epi32(v, _MM_SHUFFLE(0, 1, 2, 3));
      } else {
        v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(px + 4 * x));
      }
      const __m128 fb = _mm_cvtepi32_ps(_mm_and_si128(v, mask));
      const __m128 fg = _mm_cvtepi32_ps(_mm_and_si128(_mm_srli_epi32(v, 8), mask));
      const __m128 fr = _mm_cvtepi32_ps(_mm_and_si128(_mm_srli_epi32(v, 16), mask));
      _mm_stream_ps(r + x, _mm_add_ps(_mm_mul_ps(fr, sr), br));
      _mm_stream_ps(g + x, _mm_add_ps(_mm_mul_ps(fg, sg), bg));
      _mm_stream_ps(b + x, _mm_add_ps(_mm_mul_ps(fb, sb), bb));
    }
  }
#endif
  for (; x < n; ++x) {
    const std::uint8_t* p = px + 4 * (flip ? n - 1 - x : x);
    r[x] = static_cast<float>(p[2]) * scale[0] + bias[0];
    g[x] = static_cast<float>(p[1]) * scale[1] + bias[1];
    b[x] = static_cast<float>(p[0]) * scale[2] + bias[2];
  }
}

/// Orders the streamed stores before anything that follows (the batch is
/// handed to another thread after this).
void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/// Averages 2:1 along the axes asked (an odd last row or column is
/// dropped): out is out_w x out_h BGRA. Each case takes a SIMD path: libyuv's
/// 2x2 box for both axes, its row interpolation for rows only, and a loop the
/// compiler vectorizes for columns only.
void halve(const std::uint8_t* src, int stride, int out_w, int out_h, bool cols, bool rows, std::uint8_t* out) {
  const int out_stride = out_w * 4;
  if (cols && rows) {
    libyuv::ARGBScale(src, stride, 2 * out_w, 2 * out_h, out, out_stride, out_w, out_h, libyuv::kFilterBox);
  } else if (rows) {
    libyuv::ARGBInterpolate(src, 2 * stride, src + stride, 2 * stride, out, out_stride, out_w, out_h, 128);
  } else {
    // Per-byte average of two BGRA pixels as 32-bit words (rounding down):
    // (a & b) + ((a ^ b) >> 1), with the shift kept inside each byte.
    for (int y = 0; y < out_h; ++y) {
      const auto* in = src + static_cast<std::ptrdiff_t>(y) * stride;
      std::uint8_t* o = out + static_cast<std::ptrdiff_t>(y) * out_stride;
      for (int x = 0; x < out_w; ++x) {
        std::uint32_t a = 0, b = 0;
        std::memcpy(&a, in + 8 * x, 4);
        std::memcpy(&b, in + 8 * x + 4, 4);
        const std::uint32_t avg = (a & b) + (((a ^ b) & 0xfefefefeU) >> 1U);
        std::memcpy(o + 4 * x, &avg, 4);
      }
    }
  }
}

}  // namespace

SampleWriter::SampleWriter(const TransformConfig& config) : config_(config) {
  config_.validate();
  for (std::size_t ch = 0; ch < 3; ++ch) {
    scale_[ch] = 1.0F / (255.0F * config_.std[ch]);
    bias_[ch] = -config_.mean[ch] / config_.std[ch];
  }
  resized_.resize(static_cast<std::size_t>(config_.size) * static_cast<std::size_t>(config_.size) * 4);
  if (config_.layout == Layout::nhwc_u8) mirrored_.resize(resized_.size());
}

void SampleWriter::write(const DecodedImage& image, const Region& crop, bool flip, std::span<std::byte> out) {
  const int n = config_.size;
  const auto plane = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  if (out.size() != config_.sample_bytes()) throw ConfigError("sample writer: output span has the wrong size");
  Region c = crop;
  if (c.width <= 0 || c.height <= 0) c = Region{0, 0, image.width, image.height};
  c.x = std::clamp(c.x, 0, image.width - 1);
  c.y = std::clamp(c.y, 0, image.height - 1);
  c.width = std::min(c.width, image.width - c.x);
  c.height = std::min(c.height, image.height - c.y);
  const std::uint8_t* src = image.row(c.y) + static_cast<std::size_t>(c.x) * 4;
  const auto in_stride = static_cast<int>(image.stride_bytes());
  if (c.width != n || c.height != n || in_stride != n * 4) {
    // libyuv scales ARGB bilinearly (its box mode falls back to bilinear for
    // ARGB): 2x2 taps, which read every source pixel only while the shrink
    // is under 2x. Larger shrinks first halve the axis with exact 2:1
    // averaging (a box filter), as often as needed, so downscaling stays
    // antialiased. After DCT scaling the shrink is nearly always under 2x.
    int w = c.width, h = c.height, stride = in_stride;
    while (w > 2 * n || h > 2 * n) {
      const int hw = w > 2 * n ? w / 2 : w, hh = h > 2 * n ? h / 2 : h;
      halved_.resize(static_cast<std::size_t>(hw) * static_cast<std::size_t>(hh) * 4);
      halve(src, stride, hw, hh, hw != w, hh != h, halved_.data());
      halved_.swap(halved_spare_);
      src = halved_spare_.data();
      w = hw;
      h = hh;
      stride = hw * 4;
    }
    const int rc = libyuv::ARGBScale(src, stride, w, h, resized_.data(), n * 4, n, n, libyuv::kFilterBilinear);
    if (rc != 0) throw Error(fmt::format("libyuv ARGBScale {}x{} -> {}x{} failed ({})", w, h, n, n, rc));
    src = resized_.data();
  }
  if (config_.layout == Layout::nhwc_u8) {
    // BGRA in, RGB out; the flip mirrors the resized BGRA first (libyuv,
    // SIMD). libyuv's "RAW" is R, G, B in memory order.
    if (flip) {
      libyuv::ARGBMirror(src, n * 4, mirrored_.data(), n * 4, n, n);
      src = mirrored_.data();
    }
    libyuv::ARGBToRAW(src, n * 4, reinterpret_cast<std::uint8_t*>(out.data()), n * 3, n, n);
    return;
  }
  // float32 NCHW: one pass over the resized BGRA, a row at a time, reading
  // it backwards when flipped and writing the row of each of the three
  // planes, streamed to the batch slot (see bgra_row_to_planes).
  float* dst = reinterpret_cast<float*>(out.data());
  const auto width = static_cast<std::size_t>(n);
  for (std::size_t y = 0; y < width; ++y) {
    const std::size_t row = y * width;
    bgra_row_to_planes(src + row * 4, n, flip, scale_, bias_, dst + row, dst + plane + row, dst + 2 * plane + row);
  }
  stream_fence();
}

}  // namespace pinfeed::loader
