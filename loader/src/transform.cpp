#include "pinfeed/loader/transform.hpp"

#include <fmt/format.h>
#include <libyuv/convert_from_argb.h>
#include <libyuv/planar_functions.h>
#include <libyuv/scale_argb.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <utility>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "pinfeed/error.hpp"

namespace pinfeed::loader {

CropMode parse_crop_mode(std::string_view text) { return parse_enum(kCropModeWords, text, "crop"); }

Layout parse_layout(std::string_view text) { return parse_enum(kLayoutWords, text, "layout"); }

std::string_view to_string(CropMode m) noexcept { return enum_word(kCropModeWords, m); }

std::string_view to_string(Layout l) noexcept { return enum_word(kLayoutWords, l); }

Interpolation parse_interpolation(std::string_view text) { return parse_enum(kInterpolationWords, text, "interpolation"); }

std::string_view to_string(Interpolation i) noexcept { return enum_word(kInterpolationWords, i); }

void TransformConfig::validate() const {
  if (size < kMinImageSize || size > kMaxImageSize) {
    throw ConfigError(fmt::format("transform size must be {}..{}, got {}", kMinImageSize, kMaxImageSize, size));
  }
  if (height != 0 && (height < kMinImageSize || height > kMaxImageSize)) {
    throw ConfigError(fmt::format("transform height must be 0 (= size) or {}..{}, got {}", kMinImageSize, kMaxImageSize,
                                  height));
  }
  const int longer = std::max(out_width(), out_height());
  if (crop == CropMode::center && (resize < longer || resize > kMaxResize)) {
    throw ConfigError(fmt::format("transform resize must be at least the crop's longer side for a center crop: {}..{}, "
                                  "got {}",
                                  longer, kMaxResize, resize));
  }
  if (!(flip_p >= 0 && flip_p <= 1)) throw ConfigError(fmt::format("transform flip_p must be in [0, 1], got {}", flip_p));
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
  return static_cast<std::size_t>(out_width()) * static_cast<std::size_t>(out_height()) * 3 * element_bytes();
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
  // Resize(shorter = resize) then CenterCrop(h, w) keeps, of the original, a
  // centred w/resize by h/resize fraction of the shorter side.
  const double unit = static_cast<double>(std::min(width, height)) / c.resize;
  const int w = std::clamp(static_cast<int>(std::lround(c.out_width() * unit)), 1, width);
  const int h = std::clamp(static_cast<int>(std::lround(c.out_height() * unit)), 1, height);
  return Region{(width - w) / 2, (height - h) / 2, w, h};
}

}  // namespace

Region clamp_region(const Region& region, int width, int height) noexcept {
  if (region.width <= 0 || region.height <= 0) return Region{0, 0, width, height};
  Region c;
  c.x = std::clamp(region.x, 0, width - 1);
  c.y = std::clamp(region.y, 0, height - 1);
  c.width = std::min(region.width, width - c.x);
  c.height = std::min(region.height, height - c.y);
  return c;
}

CropPlan plan_crop(const ImageHeader& header, const TransformConfig& c, SampleRng& rng) {
  CropPlan p;
  switch (c.crop) {
    case CropMode::random_resized:
      p.region = random_resized_region(header.width, header.height, c, rng);
      p.flip = c.flip && rng.uniform() < c.flip_p;
      break;
    case CropMode::center: p.region = center_region(header.width, header.height, c); break;
    case CropMode::full: p.region = Region{0, 0, header.width, header.height}; break;
  }
  if (c.dct_scaling) {
    // Only the scales libjpeg-turbo accelerates, and only while the scaled
    // region still covers the output (never upsample what DCT scaling dropped).
    for (const int s : {8, 4, 2}) {
      if (p.region.width / s >= c.out_width() && p.region.height / s >= c.out_height()) {
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

/// Averages each pair of BGRA pixels of a row (out_w pixels out; an odd
/// last pixel is dropped), rounding half up. SSE2: 8 pixels in, the even and
/// odd ones picked apart as 32-bit lanes, averaged per byte.
void halve_columns(const std::uint8_t* in, int out_w, std::uint8_t* out) {
  int x = 0;
#if defined(__SSE2__)
  for (; x + 4 <= out_w; x += 4) {
    const __m128 lo = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 8 * x)));
    const __m128 hi = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 8 * x + 16)));
    const __m128i even = _mm_castps_si128(_mm_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)));
    const __m128i odd = _mm_castps_si128(_mm_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 4 * x), _mm_avg_epu8(even, odd));
  }
#endif
  for (; x < out_w; ++x) {
    for (int ch = 0; ch < 4; ++ch) {
      out[4 * x + ch] = static_cast<std::uint8_t>((in[8 * x + ch] + in[8 * x + 4 + ch] + 1) / 2);
    }
  }
}

/// Grows (never shrinks) a scratch buffer to at least `bytes`.
void ensure(ScratchBytes& buffer, std::size_t bytes) {
  if (buffer.size() < bytes) buffer.resize(bytes);
}

std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

/// Output rows resized horizontally and written together.
constexpr int kBand = 16;

}  // namespace

SampleWriter::SampleWriter(const TransformConfig& config) : config_(config) {
  config_.validate();
  for (std::size_t ch = 0; ch < 3; ++ch) {
    scale_[ch] = 1.0F / (255.0F * config_.std[ch]);
    bias_[ch] = -config_.mean[ch] / config_.std[ch];
  }
  const auto n = static_cast<std::size_t>(config_.out_width());
  band_out_.resize(n * 4 * kBand);
  mirrored_.resize(n * 4);
}

std::uint64_t SampleWriter::take_output_ns() noexcept { return std::exchange(output_ns_, 0); }

void SampleWriter::prepare(bool flip, std::span<std::byte> out) {
  if (out.size() != config_.sample_bytes()) throw ConfigError("sample writer: output span has the wrong size");
  flip_ = flip;
  out_ = out;
  started_ = false;
}

void SampleWriter::begin(int width, int height) {
  if (out_.empty()) throw Error("sample writer: rows arrived before prepare()");
  if (width <= 0 || height <= 0) throw Error(fmt::format("sample writer: empty region {}x{}", width, height));
  const int nw = config_.out_width(), nh = config_.out_height();
  const bool nearest = config_.interpolation == Interpolation::nearest;
  src_w_ = width;
  src_h_ = height;
  // Exact 2:1 averages while the shrink exceeds 2x (a box filter: two-tap
  // bilinear sampling would skip pixels and alias), then bilinear. Nearest
  // samples the source as it is.
  col_halvings_ = 0;
  width_ = width;
  while (!nearest && width_ > 2 * nw) {
    width_ /= 2;
    ++col_halvings_;
  }
  row_halvings_ = 0;
  final_height_ = height;
  while (!nearest && final_height_ > 2 * nh) {
    final_height_ /= 2;
    ++row_halvings_;
  }
  if (nearest) {
    nearest_x_.resize(static_cast<std::size_t>(nw));
    for (int x = 0; x < nw; ++x) {
      nearest_x_[static_cast<std::size_t>(x)] =
          std::min(width_ - 1, static_cast<int>((x + 0.5) * width_ / nw));
    }
  } else if (width_ != nw) {
    // Column x samples the source at (x + 0.5) * step - 0.5 (pixel centres
    // aligned, as the rows are), clamped: columns x0 and x0 + 1, blended
    // with weights that sum to 256.
    linear_x_.resize(static_cast<std::size_t>(nw));
    linear_f_.resize(static_cast<std::size_t>(nw));
    const double step = static_cast<double>(width_) / nw;
    for (int x = 0; x < nw; ++x) {
      const double c = std::clamp((x + 0.5) * step - 0.5, 0.0, static_cast<double>(width_ - 1));
      int x0 = static_cast<int>(c);
      int f = static_cast<int>(std::lround((c - x0) * 256.0));
      if (f >= 256) {
        ++x0;
        f = 0;
      }
      if (x0 >= width_ - 1) {  // the last column: as the right one of the last pair, so x0 + 1 stays inside
        x0 = std::max(0, width_ - 2);
        f = width_ > 1 ? 256 : 0;
      }
      linear_x_[static_cast<std::size_t>(x)] = x0;
      linear_f_[static_cast<std::size_t>(x)] = f;
    }
    linear_w_.resize(static_cast<std::size_t>(nw));
    for (std::size_t x = 0; x < linear_w_.size(); ++x) {
      linear_w_[x] = (256 - linear_f_[x]) | (linear_f_[x] << 16);
    }
  }
  const auto row_bytes = static_cast<std::size_t>(width_) * 4;
  if (col_halvings_ > 0) {
    ensure(cols_a_, static_cast<std::size_t>(width / 2) * 4);
    ensure(cols_b_, static_cast<std::size_t>(width / 2) * 4);
  }
  if (pending_.size() < row_halvings_) {
    pending_.resize(row_halvings_);
    averaged_.resize(row_halvings_);
  }
  has_pending_.assign(row_halvings_, 0);
  for (std::size_t l = 0; l < row_halvings_; ++l) {
    ensure(pending_[l], row_bytes);
    ensure(averaged_[l], row_bytes);
  }
  ensure(final_[0], row_bytes);
  ensure(final_[1], row_bytes);
  ensure(band_, row_bytes * kBand);
  final_rows_ = 0;
  next_out_ = 0;
  band_rows_ = 0;
  started_ = true;
}

void SampleWriter::row(const std::uint8_t* bgra) {
  // The row after all halvings goes to final_[its index % 2] (or, with no
  // halving at all, is used where it lies: a row stays valid for two more),
  // so the bilinear step reads its two rows without copying either.
  const std::uint8_t* r = bgra;
  int w = src_w_;
  for (int s = 0; s < col_halvings_; ++s) {
    const bool last = s + 1 == col_halvings_ && row_halvings_ == 0;
    std::uint8_t* dst = last ? final_[final_rows_ % 2].data() : (s % 2 == 0 ? cols_a_ : cols_b_).data();
    halve_columns(r, w / 2, dst);
    r = dst;
    w /= 2;
  }
  push_level(0, r);
}

void SampleWriter::push_level(std::size_t level, const std::uint8_t* r) {
  if (level == row_halvings_) {
    push_final(r);
    return;
  }
  // Rows pair up at each level; an odd last row never finds its pair and is
  // dropped, as an odd last column is.
  const auto bytes = static_cast<std::size_t>(width_) * 4;
  if (has_pending_[level] == 0) {
    std::memcpy(pending_[level].data(), r, bytes);
    has_pending_[level] = 1;
    return;
  }
  has_pending_[level] = 0;
  std::uint8_t* dst = level + 1 == row_halvings_ ? final_[final_rows_ % 2].data() : averaged_[level].data();
  libyuv::ARGBInterpolate(pending_[level].data(), 0, r, 0, dst, 0, width_, 1, 128);
  push_level(level + 1, dst);
}

void SampleWriter::push_final(const std::uint8_t* r) {
  const int k = final_rows_++;
  recent_[k % 2] = r;
  const auto bytes = static_cast<std::size_t>(width_) * 4;
  const int n = config_.out_height();
  const double step = static_cast<double>(final_height_) / n;
  // Output row j samples the final rows at (j + 0.5) * step - 0.5 (pixel
  // centres aligned), clamped to the image: rows r0 and r0 + 1, blended.
  while (next_out_ < n) {
    const double c = std::clamp((next_out_ + 0.5) * step - 0.5, 0.0, static_cast<double>(final_height_ - 1));
    const int r0 = static_cast<int>(c);
    const int r1 = std::min(r0 + 1, final_height_ - 1);
    if (r1 > k) break;  // its lower row has not arrived yet
    auto frac = static_cast<int>(std::lround((c - r0) * 256.0));
    if (config_.interpolation == Interpolation::nearest) {
      // The row under the output row's centre: floor((j + 0.5) * step).
      const int pick = std::min(static_cast<int>((next_out_ + 0.5) * step), final_height_ - 1);
      frac = pick > r0 ? 256 : 0;
    }
    const std::uint8_t* top = recent_[r0 % 2];
    if (frac >= 256) {
      top = recent_[r1 % 2];
      frac = 0;
    }
    std::uint8_t* dst = band_.data() + static_cast<std::size_t>(band_rows_) * bytes;
    if (frac == 0 || r0 == r1) {
      std::memcpy(dst, top, bytes);
    } else {
      libyuv::ARGBInterpolate(top, 0, recent_[r1 % 2], 0, dst, 0, width_, 1, frac);
    }
    ++band_rows_;
    ++next_out_;
    if (band_rows_ == kBand || next_out_ == n) flush_band();
  }
}

namespace {
std::size_t un_bytes(int pixels) { return static_cast<std::size_t>(pixels) * 4; }
}  // namespace

void SampleWriter::flush_band() {
  const std::uint64_t t0 = now_ns();
  const int n = config_.out_width();
  const int rows = band_rows_;
  const std::uint8_t* src = band_.data();
  if (config_.interpolation == Interpolation::nearest && width_ != n) {
    // Each output column copies the source pixel under its centre.
    const auto* in = reinterpret_cast<const std::uint32_t*>(band_.data());
    auto* out = reinterpret_cast<std::uint32_t*>(band_out_.data());
    for (int r = 0; r < rows; ++r) {
      const std::uint32_t* from = in + static_cast<std::ptrdiff_t>(r) * width_;
      std::uint32_t* to = out + static_cast<std::ptrdiff_t>(r) * n;
      for (int x = 0; x < n; ++x) to[x] = from[nearest_x_[static_cast<std::size_t>(x)]];
    }
    src = band_out_.data();
  } else if (width_ != n) {
    // Horizontal bilinear, by hand: libyuv's ARGBScale (kFilterLinear and
    // kFilterBilinear alike) blends columns with 7-bit weights that sum to
    // 127/128, so every shrunk image came out 1/128 darker (255 -> 253,
    // 200 -> 198). Weights here sum to 256 and round half up: a constant
    // image stays exactly constant.
    for (int r = 0; r < rows; ++r) {
      const std::uint8_t* from = band_.data() + static_cast<std::size_t>(r) * static_cast<std::size_t>(width_) * 4;
      std::uint8_t* to = band_out_.data() + static_cast<std::size_t>(r) * un_bytes(n);
      int x = 0;
#if defined(__SSE2__)
      if (width_ > 1) {  // every x0 + 1 is inside the row: an 8-byte load reads pixels x0 and x0 + 1
        const __m128i zero = _mm_setzero_si128(), half = _mm_set1_epi32(128);
        for (; x + 2 <= n; x += 2) {
          const auto ux = static_cast<std::size_t>(x);
          const __m128i p0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(from + 4 * static_cast<std::size_t>(linear_x_[ux])));
          const __m128i p1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(from + 4 * static_cast<std::size_t>(linear_x_[ux + 1])));
          // a0 b0 a1 b1 a2 b2 a3 b3 per output pixel, as 16-bit lanes: madd
          // with (256 - f, f) pairs gives each channel's weighted sum.
          const __m128i q = _mm_unpacklo_epi64(_mm_unpacklo_epi8(p0, _mm_srli_si128(p0, 4)),
                                               _mm_unpacklo_epi8(p1, _mm_srli_si128(p1, 4)));
          __m128i s0 = _mm_madd_epi16(_mm_unpacklo_epi8(q, zero), _mm_set1_epi32(linear_w_[ux]));
          __m128i s1 = _mm_madd_epi16(_mm_unpackhi_epi8(q, zero), _mm_set1_epi32(linear_w_[ux + 1]));
          s0 = _mm_srli_epi32(_mm_add_epi32(s0, half), 8);
          s1 = _mm_srli_epi32(_mm_add_epi32(s1, half), 8);
          const __m128i px = _mm_packs_epi32(s0, s1);
          _mm_storel_epi64(reinterpret_cast<__m128i*>(to + 4 * ux), _mm_packus_epi16(px, px));
        }
      }
#endif
      for (; x < n; ++x) {
        const auto ux = static_cast<std::size_t>(x);
        const std::uint8_t* a = from + static_cast<std::size_t>(linear_x_[ux]) * 4;
        const int f = linear_f_[ux];
        const std::uint8_t* b = f == 0 ? a : a + 4;
        for (std::size_t ch = 0; ch < 4; ++ch) {
          to[ux * 4 + ch] = static_cast<std::uint8_t>((a[ch] * (256 - f) + b[ch] * f + 128) >> 8);
        }
      }
    }
    src = band_out_.data();
  }
  const auto un = static_cast<std::size_t>(n);
  const std::size_t first = static_cast<std::size_t>(next_out_ - rows);
  if (config_.layout == Layout::nhwc_u8) {
    // BGRA in, RGB out (libyuv's "RAW" is R, G, B in memory order); a
    // flipped row is mirrored first.
    auto* dst = reinterpret_cast<std::uint8_t*>(out_.data());
    for (std::size_t i = 0; i < static_cast<std::size_t>(rows); ++i) {
      const std::uint8_t* r = src + i * un * 4;
      if (flip_) {
        libyuv::ARGBMirror(r, 0, mirrored_.data(), 0, n, 1);
        r = mirrored_.data();
      }
      libyuv::ARGBToRAW(r, 0, dst + (first + i) * un * 3, 0, n, 1);
    }
  } else {
    // float32 NCHW: each row read backwards when flipped, its three channel
    // rows streamed to the slot (see bgra_row_to_planes).
    auto* dst = reinterpret_cast<float*>(out_.data());
    const std::size_t plane = un * static_cast<std::size_t>(config_.out_height());
    for (std::size_t i = 0; i < static_cast<std::size_t>(rows); ++i) {
      const std::size_t at = (first + i) * un;
      bgra_row_to_planes(src + i * un * 4, n, flip_, scale_, bias_, dst + at, dst + plane + at, dst + 2 * plane + at);
    }
    if (next_out_ == config_.out_height()) stream_fence();
  }
  band_rows_ = 0;
  output_ns_ += now_ns() - t0;
}

void SampleWriter::write(const DecodedImage& image, const Region& crop, bool flip, std::span<std::byte> out) {
  prepare(flip, out);
  const Region c = clamp_region(crop, image.width, image.height);
  begin(c.width, c.height);
  for (int y = 0; y < c.height; ++y) row(image.row(c.y + y) + static_cast<std::size_t>(c.x) * 4);
  if (!complete()) throw Error("sample writer: the region's rows did not complete the sample");
}

}  // namespace pinfeed::loader
