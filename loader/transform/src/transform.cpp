#include "pinfeed/loader/transform.hpp"

#include "pinfeed/env.hpp"
#include "pinfeed/log.hpp"

#include <fmt/format.h>
#include <libyuv/convert_from_argb.h>
#include <libyuv/planar_functions.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>

#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif

#include "pinfeed/error.hpp"
#include "resample.hpp"

namespace pinfeed::loader {

namespace {

SimdLevel cpu_simd_level() noexcept {
#if defined(__x86_64__) && defined(__GNUC__)
  // libgcc's answer counts the OS's support too (XCR0: the zmm state saved).
  if (__builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx512bw") != 0) return SimdLevel::avx512;
  return __builtin_cpu_supports("avx2") != 0 ? SimdLevel::avx2 : SimdLevel::sse2;
#elif defined(__SSE2__)
  return SimdLevel::sse2;
#else
  return SimdLevel::scalar;
#endif
}

/// Note [SIMD level by core]: AVX2 is not always the faster. AMD's Zen 1
/// and Zen+ cores (family 17h, models below 30h) run each 256-bit
/// instruction as two 128-bit halves, and the lane-crossing ones slowly:
/// there the AVX2 sample writer measured slower than SSE2 (the figures, on
/// both kinds of core, are in docs/results.md, "SIMD level by core"). Those
/// cores get SSE2; every other core its widest level. (Timing both at
/// start-up was tried: on a busy 2-core machine it picked either, run to
/// run.) Every level writes the same bytes
/// (TransformTest.EverySimdLevelWritesTheSameBytes).
bool avx2_runs_as_halves() noexcept {
#if defined(__x86_64__) && defined(__GNUC__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return false;
  const bool amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "AuthenticAMD"
  if (!amd || __get_cpuid(1, &a, &b, &c, &d) == 0) return false;
  const unsigned family = ((a >> 8) & 0xF) + ((a >> 20) & 0xFF);
  const unsigned model = ((a >> 4) & 0xF) | (((a >> 16) & 0xF) << 4);
  return family == 0x17 && model < 0x30;
#else
  return false;
#endif
}

/// PINFEED_SIMD=scalar|sse2|avx2|avx512 (PINFEED_NO_AVX2=1: sse2), capped
/// at the CPU's; unset: the CPU's best, but SSE2 where AVX2 runs as halves
/// (those cores have no AVX-512).
SimdLevel initial_simd_level() noexcept {
  const SimdLevel cpu = cpu_simd_level();
  if (pinfeed::env::get("PINFEED_NO_AVX2")) return std::min(cpu, SimdLevel::sse2);
  const std::optional<std::string> asked = pinfeed::env::get("PINFEED_SIMD");
  for (const auto& w : kSimdLevelWords) {
    if (asked && w.word == *asked) return std::min(cpu, w.value);
  }
  if (asked) {  // an unknown word: the default, said (the environment's line says it overrides one)
    try {
      std::string words;
      for (const auto& w : kSimdLevelWords) words += fmt::format("{}{}", words.empty() ? "" : ", ", w.word);
      pinfeed::detail::log().warn("environment: PINFEED_SIMD='{}' is not one of {}: ignored, the CPU's default is used",
                                  *asked, words);
    } catch (...) {  // static initialization: a log that cannot be written is no reason to stop
    }
  }
  return cpu == SimdLevel::avx2 && avx2_runs_as_halves() ? SimdLevel::sse2 : cpu;
}

std::atomic<SimdLevel> g_simd{initial_simd_level()};

/// Read once per sample (relaxed: a test's change applies from the next one).
SimdLevel level() noexcept { return g_simd.load(std::memory_order_relaxed); }

}  // namespace

SimdLevel simd_level() noexcept { return level(); }

std::string_view to_string(SimdLevel level) noexcept { return enum_word(kSimdLevelWords, level); }

SimdLevel set_simd_level(SimdLevel wanted) noexcept {
  const SimdLevel l = std::min(wanted, cpu_simd_level());
  g_simd.store(l, std::memory_order_relaxed);
  return l;
}

CropMode parse_crop_mode(std::string_view text) { return parse_enum(kCropModeWords, text, "crop"); }

Layout parse_layout(std::string_view text) { return parse_enum(kLayoutWords, text, "layout"); }

std::string_view to_string(CropMode m) noexcept { return enum_word(kCropModeWords, m); }

std::string_view to_string(Layout l) noexcept { return enum_word(kLayoutWords, l); }

Interpolation parse_interpolation(std::string_view text) {
  return parse_enum(kInterpolationWords, text, "interpolation");
}

std::string_view to_string(Interpolation i) noexcept { return enum_word(kInterpolationWords, i); }

namespace {

template <auto Field>
double value_of(const TransformConfig& c) {
  return static_cast<double>(c.*Field);
}

constexpr std::array kRanges{
    TransformRange{"size", true, kMinImageSize, kMaxImageSize, false, &value_of<&TransformConfig::size>},
    TransformRange{"height", true, 0, kMaxImageSize, false, &value_of<&TransformConfig::height>},
    TransformRange{"resize", true, 1, kMaxResize, false, &value_of<&TransformConfig::resize>},
    TransformRange{"scale_min", false, 0, 1, true, &value_of<&TransformConfig::scale_min>},
    TransformRange{"scale_max", false, 0, 1, true, &value_of<&TransformConfig::scale_max>},
    TransformRange{"ratio_min", false, 0, kMaxAspectRatio, true, &value_of<&TransformConfig::ratio_min>},
    TransformRange{"ratio_max", false, 0, kMaxAspectRatio, true, &value_of<&TransformConfig::ratio_max>},
    TransformRange{"flip_p", false, 0, 1, false, &value_of<&TransformConfig::flip_p>},
};

}  // namespace

std::span<const TransformRange> transform_ranges() noexcept { return kRanges; }

const TransformRange& transform_range(std::string_view name) {
  for (const TransformRange& r : kRanges) {
    if (r.name == name) return r;
  }
  throw std::out_of_range(fmt::format("no transform range named '{}'", name));
}

void TransformConfig::validate() const {
  for (const TransformRange& r : kRanges) {
    const double v = r.get(*this);
    if (!((r.min_exclusive ? v > r.min : v >= r.min) && v <= r.max)) {  // NaN fails too
      throw ConfigError(r.integer ? fmt::format("transform {} must be {}..{}, got {}", r.name, r.min, r.max, v)
                                  : fmt::format("transform {} must be in {}{}, {}], got {}", r.name,
                                                r.min_exclusive ? "(" : "[", r.min, r.max, v));
    }
  }
  validate_relations();
}

void TransformConfig::validate_relations() const {
  if (height != 0 && height < kMinImageSize) {  // the row's range includes 0 (= size)
    throw ConfigError(
        fmt::format("transform height must be 0 (= size) or {}..{}, got {}", kMinImageSize, kMaxImageSize, height));
  }
  const int longer = std::max(out_width(), out_height());
  if (crop == CropMode::center && resize < longer) {
    throw ConfigError(
        fmt::format("transform resize must be at least the crop's longer side for a center crop: {}..{}, "
                    "got {}",
                    longer, kMaxResize, resize));
  }
  if (!(scale_min <= scale_max)) {
    throw ConfigError(
        fmt::format("transform scale range [{}, {}] must satisfy 0 < min <= max <= 1", scale_min, scale_max));
  }
  if (!(ratio_min <= ratio_max)) {
    throw ConfigError(fmt::format("transform ratio range [{}, {}] must satisfy 0 < min <= max", ratio_min, ratio_max));
  }
  for (std::size_t c = 0; c < 3; ++c) {  // mean and std are not rows
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

/// Python's round(twice / 2): half to even (torchvision's CenterCrop offsets).
int round_half_even(int twice) {
  if (twice % 2 == 0) return twice / 2;
  const int down = (twice - 1) / 2;
  return down % 2 == 0 ? down : down + 1;
}

/// Resize(resize) + CenterCrop(h, w) as torchvision computes them: the
/// shorter side becomes `resize`, the longer int(resize * longer / shorter)
/// (truncated), and the window starts at round((resized - crop) / 2).
void center_axes(int width, int height, const TransformConfig& c, CropPlan& p) {
  const bool portrait = width <= height;
  const std::int64_t shorter = portrait ? width : height, longer = portrait ? height : width;
  const std::int64_t resized_long = std::int64_t{c.resize} * longer / shorter;
  if (resized_long > std::numeric_limits<int>::max() / 2) {
    throw DataError("", fmt::format("Resize({}) would make this {}x{} image {} pixels long (torchvision's Resize keeps "
                                    "the aspect ratio): refused",
                                    c.resize, width, height, resized_long));
  }
  const auto new_long = static_cast<int>(resized_long);
  const int new_w = portrait ? c.resize : new_long, new_h = portrait ? new_long : c.resize;
  p.x = ResampleAxis{static_cast<double>(width) / new_w, round_half_even(new_w - c.out_width()), 0, 0, width};
  p.y = ResampleAxis{static_cast<double>(height) / new_h, round_half_even(new_h - c.out_height()), 0, 0, height};
}

}  // namespace

namespace detail {

/// A crop, then a resize of it (RandomResizedCrop, and the whole image).
ResampleAxis crop_axis(int start, int length, int out) {
  return ResampleAxis{static_cast<double>(length) / out, 0, start, start, start + length};
}

/// The filter's half-width at scale 1 (PIL's filter->support).
double filter_support(Interpolation f) noexcept { return f == Interpolation::bicubic ? 2.0 : 1.0; }

/// PIL's filter functions of the distance in source pixels at scale 1.
double filter_weight(Interpolation f, double x) noexcept {
  x = std::abs(x);
  if (f == Interpolation::bicubic) {  // PIL's bicubic_filter, a = -0.5
    constexpr double a = -0.5;
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
    if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
    return 0.0;
  }
  return std::max(0.0, 1.0 - x);  // bilinear: the triangle
}

}  // namespace detail

using detail::crop_axis;
using detail::filter_support;

Taps axis_taps(const ResampleAxis& a, int k, Interpolation filter) noexcept {
  // PIL's precompute_coeffs, in the frame of `origin` (the cropped image).
  const double center = (a.offset + k + 0.5) * a.scale;
  const int lo = a.lo - a.origin, hi = a.hi - a.origin;
  if (filter == Interpolation::nearest) {  // PIL's NEAREST: the pixel under the centre
    const int x = std::clamp(static_cast<int>(center), lo, hi - 1);
    return Taps{a.origin + x, a.origin + x + 1};
  }
  const double support = filter_support(filter) * std::max(a.scale, 1.0);
  const int first = std::max(static_cast<int>(center - support + 0.5), lo);
  const int last = std::clamp(static_cast<int>(center + support + 0.5), first + 1, hi);
  return Taps{a.origin + first, a.origin + last};
}

CropPlan plan_crop(const ImageHeader& header, const TransformConfig& c, SampleRng& rng) {
  CropPlan p;
  const int ow = c.out_width(), oh = c.out_height();
  switch (c.crop) {
    case CropMode::random_resized: {
      const Region r = random_resized_region(header.width, header.height, c, rng);
      p.x = crop_axis(r.x, r.width, ow);
      p.y = crop_axis(r.y, r.height, oh);
      p.flip = c.flip && rng.uniform() < c.flip_p;
      break;
    }
    case CropMode::center: center_axes(header.width, header.height, c, p); break;
    case CropMode::full:
      p.x = crop_axis(0, header.width, ow);
      p.y = crop_axis(0, header.height, oh);
      break;
  }
  // The filter reads about twice the shrink in source pixels per output
  // pixel (bicubic: four times), and the writer keeps that many rows: an absurd shrink (a
  // 1 x 100,000,000 strip) would take gigabytes per thread.
  if (p.x.scale > kMaxShrink || p.y.scale > kMaxShrink) {
    throw DataError("", fmt::format("the resize would shrink this {}x{} image {:.0f} times along one side, over the "
                                    "limit of {}: shrink such images first (pinfeed-data pack --max-side N)",
                                    header.width, header.height, std::max(p.x.scale, p.y.scale), kMaxShrink));
  }
  // Decode what the resize reads: from the first output pixel's first tap to
  // the last one's last.
  const Interpolation f = c.interpolation;
  const Taps x0 = axis_taps(p.x, 0, f), x1 = axis_taps(p.x, ow - 1, f);
  const Taps y0 = axis_taps(p.y, 0, f), y1 = axis_taps(p.y, oh - 1, f);
  p.region = Region{x0.first, y0.first, x1.last - x0.first, y1.last - y0.first};
  if (c.dct_scaling && header.scalable) {
    // Only the scales libjpeg-turbo accelerates, and only while the scaled
    // crop still covers the output (never upsample what DCT scaling dropped).
    for (const int s : {8, 4, 2}) {
      if (p.x.scale >= s && p.y.scale >= s) {
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

}  // namespace pinfeed::loader
