#include "pinfeed/loader/transform.hpp"

#include "pinfeed/env.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/loader/options.hpp"

#include <fmt/format.h>
#include <libyuv/convert_from_argb.h>
#include <libyuv/planar_functions.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif

#include "pinfeed/error.hpp"

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
/// and Zen+ cores (family 17h, models below 30h: this project's machine)
/// run each 256-bit instruction as two 128-bit halves, and the
/// lane-crossing ones slowly: there a 300x250 -> 224 sample
/// (pinfeed-loader-bench BM_SampleWriter, medians of 7) took 640 us at AVX2
/// and 620 at SSE2 in float32, 358 and 342 in uint8, and the AVX2
/// horizontal pass before issue 41 473 against 375. Those cores get SSE2;
/// every other core its widest level. On a Zen 4 core (family 19h model
/// 11h), where AVX2 is native and AVX-512 runs double-pumped, the same
/// sample took 188, 135 and 115 us in float32 at SSE2, AVX2 and AVX-512. (Timing both at start-up was tried: on a
/// busy 2-core machine it picked either, run to run.) Every level writes
/// the same bytes (TransformTest.EverySimdLevelWritesTheSameBytes).
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

Interpolation parse_interpolation(std::string_view text) { return parse_enum(kInterpolationWords, text, "interpolation"); }

std::string_view to_string(Interpolation i) noexcept { return enum_word(kInterpolationWords, i); }

void TransformConfig::validate() const {
  // Each field's range is its option row's (options.cpp): the loader, the
  // tools and a SampleWriter made directly check the same table. What is
  // left here are the rules the rows cannot state alone.
  check_transform_options(*this);
  validate_relations();
}

void TransformConfig::validate_relations() const {
  if (height != 0 && height < kMinImageSize) {  // the row's range includes 0 (= size)
    throw ConfigError(fmt::format("transform height must be 0 (= size) or {}..{}, got {}", kMinImageSize, kMaxImageSize,
                                  height));
  }
  const int longer = std::max(out_width(), out_height());
  if (crop == CropMode::center && resize < longer) {
    throw ConfigError(fmt::format("transform resize must be at least the crop's longer side for a center crop: {}..{}, "
                                  "got {}",
                                  longer, kMaxResize, resize));
  }
  if (!(scale_min <= scale_max)) {
    throw ConfigError(fmt::format("transform scale range [{}, {}] must satisfy 0 < min <= max <= 1", scale_min, scale_max));
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

/// A crop, then a resize of it (RandomResizedCrop, and the whole image).
ResampleAxis crop_axis(int start, int length, int out) {
  return ResampleAxis{static_cast<double>(length) / out, 0, start, start, start + length};
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

namespace {

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

}  // namespace

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

namespace {

/// One output row: n BGRA pixels (read right to left when `flip`) to three
/// float rows r, g, b of x * scale[c] + bias[c]. On x86 with 16-byte aligned
/// rows, four pixels at a time: each channel is masked out of the 32-bit
/// pixels, converted and stored with non-temporal stores. The slot is written
/// once and never read here, so they skip the read-for-ownership of every
/// cache line. The rest, and other targets, take the same arithmetic in scalar.
#if defined(__x86_64__) && defined(__GNUC__)
/// Eight pixels at a time, the SSE2 loop's arithmetic (convert, multiply,
/// add: two roundings, never fused, as in every path); rows 32-byte aligned.
/// Returns the pixels done.
__attribute__((target("avx2"))) int bgra_row_to_planes_avx2(const std::uint8_t* px, int n, bool flip,
                                                            const std::array<float, 3>& scale,
                                                            const std::array<float, 3>& bias, float* r, float* g,
                                                            float* b) {
  const __m256i mask = _mm256_set1_epi32(0xff), reverse = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const __m256 sr = _mm256_set1_ps(scale[0]), sg = _mm256_set1_ps(scale[1]), sb = _mm256_set1_ps(scale[2]);
  const __m256 br = _mm256_set1_ps(bias[0]), bg = _mm256_set1_ps(bias[1]), bb = _mm256_set1_ps(bias[2]);
  int x = 0;
  for (; x + 8 <= n; x += 8) {
    __m256i v;
    if (flip) {  // outputs x..x+7 are source pixels n-1-x down to n-8-x
      v = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(px + 4 * (n - 8 - x))),
                                      reverse);
    } else {
      v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(px + 4 * x));
    }
    const __m256 fb = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
    const __m256 fg = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), mask));
    const __m256 fr = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 16), mask));
    _mm256_stream_ps(r + x, _mm256_add_ps(_mm256_mul_ps(fr, sr), br));
    _mm256_stream_ps(g + x, _mm256_add_ps(_mm256_mul_ps(fg, sg), bg));
    _mm256_stream_ps(b + x, _mm256_add_ps(_mm256_mul_ps(fb, sb), bb));
  }
  return x;
}
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC diagnostic push
#if !defined(__clang__)  // clang has no such warning group, and no such bug
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593: see resample_row_avx512
#endif
/// Sixteen pixels at a time, the same arithmetic; rows 64-byte aligned.
/// AVX-512F implies FMA to GCC, and GCC writes _mm512_mul_ps and
/// _mm512_add_ps as plain vector arithmetic that it may contract into one
/// fused multiply-add (one rounding, other floats than every other path's):
/// the _round forms are builtins it leaves alone, with the default rounding.
__attribute__((target("avx512f"))) int bgra_row_to_planes_avx512(const std::uint8_t* px, int n, bool flip,
                                                                 const std::array<float, 3>& scale,
                                                                 const std::array<float, 3>& bias, float* r, float* g,
                                                                 float* b) {
  constexpr int kNear = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i mask = _mm512_set1_epi32(0xff);
  const __m512i reverse = _mm512_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 sr = _mm512_set1_ps(scale[0]), sg = _mm512_set1_ps(scale[1]), sb = _mm512_set1_ps(scale[2]);
  const __m512 br = _mm512_set1_ps(bias[0]), bg = _mm512_set1_ps(bias[1]), bb = _mm512_set1_ps(bias[2]);
  int x = 0;
  for (; x + 16 <= n; x += 16) {
    __m512i v;
    if (flip) {  // outputs x..x+15 are source pixels n-1-x down to n-16-x
      v = _mm512_permutexvar_epi32(reverse, _mm512_loadu_si512(px + 4 * (n - 16 - x)));
    } else {
      v = _mm512_loadu_si512(px + 4 * x);
    }
    const __m512 fb = _mm512_cvtepi32_ps(_mm512_and_si512(v, mask));
    const __m512 fg = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8), mask));
    const __m512 fr = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 16), mask));
    _mm512_stream_ps(r + x, _mm512_add_round_ps(_mm512_mul_round_ps(fr, sr, kNear), br, kNear));
    _mm512_stream_ps(g + x, _mm512_add_round_ps(_mm512_mul_round_ps(fg, sg, kNear), bg, kNear));
    _mm512_stream_ps(b + x, _mm512_add_round_ps(_mm512_mul_round_ps(fb, sb, kNear), bb, kNear));
  }
  return x;
}
#pragma GCC diagnostic pop
#endif

void bgra_row_to_planes(const std::uint8_t* px, int n, bool flip, const std::array<float, 3>& scale,
                        const std::array<float, 3>& bias, float* r, float* g, float* b, SimdLevel simd) {
  int x = 0;
  [[maybe_unused]] const auto aligned = [](const float* p, std::uintptr_t to) {
    return reinterpret_cast<std::uintptr_t>(p) % to == 0;
  };
#if defined(__x86_64__) && defined(__GNUC__)
  if (simd >= SimdLevel::avx512 && aligned(r, 64) && aligned(g, 64) && aligned(b, 64)) {
    x = bgra_row_to_planes_avx512(px, n, flip, scale, bias, r, g, b);
  }
  if (simd >= SimdLevel::avx2 && aligned(r + x, 32) && aligned(g + x, 32) && aligned(b + x, 32)) {
    x += bgra_row_to_planes_avx2(px + 4 * (flip ? 0 : x), n - x, flip, scale, bias, r + x, g + x, b + x);
  }
#endif
#if defined(__SSE2__)
  if (simd >= SimdLevel::sse2 && aligned(r + x, 16) && aligned(g + x, 16) && aligned(b + x, 16)) {
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

/// Grows (never shrinks) a scratch buffer to at least `bytes`.
void ensure(ScratchBytes& buffer, std::size_t bytes) {
  if (buffer.size() < bytes) buffer.resize(bytes);
}

std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

/// Output rows written together.
constexpr int kBand = 16;
/// emit_rows calls per timed one (SampleWriter::row).
constexpr std::uint32_t kTimedEvery = 8;

std::size_t un_bytes(int pixels) { return static_cast<std::size_t>(pixels) * 4; }

}  // namespace

SampleWriter::SampleWriter(const TransformConfig& config) : config_(config) {
  config_.validate();
  for (std::size_t ch = 0; ch < 3; ++ch) {
    scale_[ch] = 1.0F / (255.0F * config_.std[ch]);
    bias_[ch] = -config_.mean[ch] / config_.std[ch];
  }
  const auto n = static_cast<std::size_t>(config_.out_width());
  band_.resize(n * 4 * kBand);
  mirrored_.resize(n * 4);
}

std::uint64_t SampleWriter::take_output_ns() noexcept { return std::exchange(output_ns_, 0); }

void SampleWriter::prepare(const CropPlan& plan, std::span<std::byte> out) {
  prepare(plan.flip, out);
  plan_ = plan;
  planned_ = true;
}

void SampleWriter::prepare(bool flip, std::span<std::byte> out) {
  if (out.size() != config_.sample_bytes()) throw ConfigError("sample writer: output span has the wrong size");
  flip_ = flip;
  out_ = out;
  started_ = false;
  planned_ = false;
}

namespace {

constexpr int kWeightBits = 14;
constexpr int kOne = 1 << kWeightBits;

/// One output pixel's `count` weights `w` (summing to `total`) as 14-bit
/// fixed point in `out`, the rounding remainder on the largest, padded with
/// zeros to a multiple of `multiple` inside the row (after the taps where
/// they fit, else before: `first` moves back). Returns the padded count.
int store_taps(const std::vector<double>& w, double total, int count, int size, int multiple, int& first,
               std::int16_t* out) {
  int sum = 0, largest = 0;
  for (int t = 0; t < count; ++t) {
    out[t] = static_cast<std::int16_t>(std::lround(w[static_cast<std::size_t>(t)] / total * kOne));
    sum += out[t];
    if (out[t] > out[largest]) largest = t;
  }
  out[largest] = static_cast<std::int16_t>(out[largest] + (kOne - sum));
  // A window that is the whole row (a source 3 pixels wide, bicubic) stays
  // odd: there is no room inside the row, and the scalar path takes it.
  if (size >= multiple) {
    while (count % multiple != 0 && count < size) {
      if (first + count < size) {
        out[count] = 0;
      } else {
        std::copy_backward(out, out + count, out + count + 1);
        out[0] = 0;
        --first;
      }
      ++count;
    }
  }
  return count;
}

/// PIL's resample kernel for one axis, in the coordinates of the delivered
/// rows: `axis` is in full-resolution source coordinates, the rows are
/// decoded at 1/dct size and start at source pixel `origin` of that scale,
/// `size` of them. Weights: PIL's filter (the triangle, or the cubic with
/// its negative lobes: the sums saturate to 0..255 as PIL clips),
/// normalized, in 14-bit fixed point with the rounding remainder on the
/// largest tap, so each pixel's
/// weights sum to exactly 1 << 14; taps padded to a multiple of `multiple`
/// (zero weights on the side that stays inside the row) for SIMD. Memory:
/// n x stride weights, stride about twice the filter's reach: 2x the shrink bilinear, 4x
/// bicubic (the shrink capped at kMaxShrink).
void make_kernel(const ResampleAxis& axis, int n, int dct, int origin, int size, Interpolation filter, int multiple,
                 SampleWriter::Kernel& k) {
  std::vector<double>& w = k.scratch;  // one output pixel's weights, reused: no allocation per sample
  const bool nearest = filter == Interpolation::nearest;
  // PIL: the filter is stretched by the shrink (`scale`, antialiasing), and
  // reaches filter_support(filter) of those stretched pixels each side.
  const double scale = nearest ? 0.5 : std::max(axis.scale / dct, 1.0);
  const double support = nearest ? 0.5 : filter_support(filter) * scale;
  if (scale > kMaxShrink) {
    throw DataError("", fmt::format("the resize would shrink {} pixels to {}, over {} times: shrink such images first "
                                    "(pinfeed-data pack --max-side N)",
                                    size, n, kMaxShrink));
  }
  k.stride = 2 * (static_cast<int>(std::ceil(support)) + 1) + 4;
  k.first.assign(static_cast<std::size_t>(n), 0);
  k.count.assign(static_cast<std::size_t>(n), 0);
  k.weights.assign(static_cast<std::size_t>(n) * static_cast<std::size_t>(k.stride), 0);
  if (w.size() < static_cast<std::size_t>(k.stride)) w.resize(static_cast<std::size_t>(k.stride));
  for (int i = 0; i < n; ++i) {
    int first = 0, last = 0;
    double center = 0;  // in the frame whose pixel 0 is delivered pixel `base`
    int base = 0;
    if (dct == 1) {
      // PIL's arithmetic exactly: in the crop's frame.
      const Taps t = axis_taps(axis, i, filter);
      first = t.first - origin;
      last = t.last - origin;
      center = (axis.offset + i + 0.5) * axis.scale;
      base = axis.origin - origin;
    } else {
      // DCT-scaled rows: the same centre and support, divided by the scale.
      center = (axis.origin + (axis.offset + i + 0.5) * axis.scale) / dct;
      const int lo = axis.lo / dct, hi = (axis.hi + dct - 1) / dct;
      if (nearest) {
        first = std::clamp(static_cast<int>(center), lo, hi - 1);
        last = first + 1;
      } else {
        first = std::max(static_cast<int>(std::floor(center - support + 0.5)), lo);
        last = std::clamp(static_cast<int>(std::floor(center + support + 0.5)), first + 1, hi);
      }
      first -= origin;
      last -= origin;
      base = -origin;
    }
    first = std::clamp(first, 0, size - 1);
    last = std::clamp(last, first + 1, size);
    int count = last - first;
    double total = 0;
    for (int t = 0; t < count; ++t) {
      w[static_cast<std::size_t>(t)] =
          nearest ? 1.0 : filter_weight(filter, (first + t - base + 0.5 - center) / scale);
      total += w[static_cast<std::size_t>(t)];
    }
    if (total <= 0) {  // a window clamped away from the centre: the nearest pixel
      std::fill(w.begin(), w.begin() + count, 0.0);
      w[static_cast<std::size_t>(std::clamp(static_cast<int>(center) - (first - base), 0, count - 1))] = 1.0;
      total = 1.0;
    }
    count = store_taps(w, total, count, size, multiple, first,
                       k.weights.data() + static_cast<std::ptrdiff_t>(i) * k.stride);
    k.first[static_cast<std::size_t>(i)] = first;
    k.count[static_cast<std::size_t>(i)] = count;
  }
  k.even = std::all_of(k.count.begin(), k.count.end(), [](int c) { return c % 2 == 0; });
  k.quad_stride = 0;
  k.lanes = 0;
}

/// The wide layout of a horizontal kernel's weights (Kernel::quads): per
/// `lanes` output pixels (2 for AVX2, 4 for AVX-512) and per 4 taps, two
/// madd operands: (w0, w1) four times for each pixel (pixel j of the group
/// in 128-bit lane j), then the same of (w2, w3); zeros past each count.
/// The last n % lanes pixels are left to the SSE2 loop.
void make_quads(SampleWriter::Kernel& k, int lanes) {
  const std::size_t n = k.first.size(), stride = static_cast<std::size_t>(k.stride);
  const auto l = static_cast<std::size_t>(lanes);
  const std::size_t groups = (stride + 3) / 4, step = 16 * l;  // int16s per group of 4 taps
  k.lanes = lanes;
  k.quad_stride = static_cast<int>(groups * step);
  k.quads.assign(n / l * groups * step, 0);
  for (std::size_t i = 0; i < n - n % l; ++i) {
    const std::int16_t* w = k.weights.data() + i * stride;
    std::int16_t* q = k.quads.data() + i / l * groups * step + (i % l) * 8;
    const auto count = static_cast<std::size_t>(k.count[i]);
    const auto tap = [&](std::size_t t) { return t < count ? w[t] : std::int16_t{0}; };
    for (std::size_t g = 0; g < (count + 3) / 4; ++g) {
      for (std::size_t p = 0; p < 4; ++p) {
        q[g * step + 2 * p] = tap(4 * g);
        q[g * step + 2 * p + 1] = tap(4 * g + 1);
        q[g * step + 8 * l + 2 * p] = tap(4 * g + 2);
        q[g * step + 8 * l + 2 * p + 1] = tap(4 * g + 3);
      }
    }
  }
}

#if defined(__SSE2__)
/// Taps t..t+3's weights as two madd operands: (w0, w1) and (w2, w3) in
/// every 32-bit lane.
inline void weight_pairs(const std::int16_t* w, __m128i& w01, __m128i& w23) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
  w01 = _mm_shuffle_epi32(v, _MM_SHUFFLE(0, 0, 0, 0));
  w23 = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 1, 1));
}

inline __m128i weight_pair(const std::int16_t* w) {
  std::int32_t pair = 0;
  std::memcpy(&pair, w, sizeof pair);
  return _mm_shuffle_epi32(_mm_cvtsi32_si128(pair), 0);
}

/// One output pixel's four channel sums (shifted back to 0..255): four taps
/// at a time (16 bytes loaded, the pixel pairs (0, 1) and (2, 3) interleaved
/// per channel, two madds), then a last pair if the count is 2 mod 4 (8
/// bytes: never past the taps, which stay in the row).
inline __m128i tap_sums(const std::uint8_t* src, const std::int16_t* w, int count) {
  const __m128i zero = _mm_setzero_si128();
  __m128i acc = _mm_set1_epi32(kOne / 2);
  int t = 0;
  for (; t + 4 <= count; t += 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 4 * t));  // pixels t..t+3
    const __m128i x = _mm_shuffle_epi32(v, _MM_SHUFFLE(3, 1, 2, 0));                   // 0 2 1 3
    const __m128i y = _mm_unpacklo_epi8(x, _mm_srli_si128(x, 8));  // b0 b1 g0 g1 r0 r1 a0 a1 b2 b3 ...
    __m128i w01, w23;
    weight_pairs(w + t, w01, w23);
    acc = _mm_add_epi32(acc, _mm_madd_epi16(_mm_unpacklo_epi8(y, zero), w01));
    acc = _mm_add_epi32(acc, _mm_madd_epi16(_mm_unpackhi_epi8(y, zero), w23));
  }
  if (t < count) {
    const __m128i p = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 4 * t));  // pixels t, t+1
    const __m128i y = _mm_unpacklo_epi8(_mm_unpacklo_epi8(p, _mm_srli_si128(p, 4)), zero);
    acc = _mm_add_epi32(acc, _mm_madd_epi16(y, weight_pair(w + t)));
  }
  return _mm_srai_epi32(acc, kWeightBits);
}
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define PINFEED_AVX2 1
/// AVX2, where the CPU has it (simd_level()): the same integer arithmetic
/// as the SSE2 and scalar paths (exact int32 sums of the same products, so
/// the same bytes), more of it per instruction. The build targets baseline
/// x86-64; only these functions are compiled for AVX2, and none for FMA.

/// Two output pixels at once, one per 128-bit lane, four taps per step:
/// 16 bytes of each pixel's source (`a`, `b`) in the two lanes, one
/// in-lane shuffle into channel pairs (b0 b1 g0 g1 r0 r1 a0 a1 | b2 b3 ...),
/// each half widened to 16 bits and madded against the pair's ready quads
/// (Kernel::quads). No lane crossing until the end, where the two pixels'
/// sums are shifted back to 0..255 and packed: returns a's BGRA then b's in
/// the low 8 bytes. Reads 4 * groups pixels from each: the caller checked
/// they are in the row.
__attribute__((target("avx2"))) inline __m128i pair_sums(const std::uint8_t* a, const std::uint8_t* b,
                                                         const std::int16_t* q, int groups) {
  const __m256i pairs = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,  //
                                         0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  const __m256i zero = _mm256_setzero_si256();
  __m256i acc = _mm256_set1_epi32(kOne / 2);
  for (int g = 0; g < groups; ++g) {
    const __m256i both =
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16 * g))),
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * g)), 1);
    const __m256i v = _mm256_shuffle_epi8(both, pairs);
    const __m256i w01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * g));
    const __m256i w23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * g + 16));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_unpacklo_epi8(v, zero), w01));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_unpackhi_epi8(v, zero), w23));
  }
  acc = _mm256_srai_epi32(acc, kWeightBits);
  const __m128i sums = _mm_packs_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  return _mm_packus_epi16(sums, sums);
}

/// The horizontal pass over one row with AVX2, two output pixels per step;
/// returns how many output pixels it did (all but the last few whose 4-tap
/// groups would read past the row, and an odd last one, left to the SSE2
/// loop).
__attribute__((target("avx2"))) int resample_row_avx2(const std::uint8_t* in, int size, const SampleWriter::Kernel& k,
                                                      std::uint8_t* out) {
  const int n = static_cast<int>(k.first.size());
  const auto qs = static_cast<std::size_t>(k.quad_stride);
  int i = 0;
  for (; i + 2 <= n; i += 2) {
    const auto ui = static_cast<std::size_t>(i);
    const int groups = (std::max(k.count[ui], k.count[ui + 1]) + 3) / 4;
    if (k.first[ui] + 4 * groups > size || k.first[ui + 1] + 4 * groups > size) break;
    const __m128i px = pair_sums(in + 4 * static_cast<std::ptrdiff_t>(k.first[ui]),
                                 in + 4 * static_cast<std::ptrdiff_t>(k.first[ui + 1]), k.quads.data() + ui / 2 * qs,
                                 groups);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + 4 * static_cast<std::ptrdiff_t>(i)), px);
  }
  return i;
}

// GCC 12's AVX-512 intrinsics pass _mm512_undefined_epi32() as the unused
// merge source, which -Wmaybe-uninitialized reports (GCC bug 105593, fixed
// in GCC 13): silenced for these functions only.
#pragma GCC diagnostic push
#if !defined(__clang__)  // clang has no such warning group, and no such bug
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
/// AVX-512 (F and BW): four output pixels at once, one per 128-bit lane,
/// as pair_sums does two; writes their 16 bytes.
__attribute__((target("avx512f,avx512bw"))) inline void quad_pixel_sums(const std::uint8_t* const* src,
                                                                        const std::int16_t* q, int groups,
                                                                        std::uint8_t* out) {
  const __m512i pairs = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15));
  const __m512i zero = _mm512_setzero_si512();
  __m512i acc = _mm512_set1_epi32(kOne / 2);
  for (int g = 0; g < groups; ++g) {
    __m512i all = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[0] + 16 * g)));
    all = _mm512_inserti32x4(all, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[1] + 16 * g)), 1);
    all = _mm512_inserti32x4(all, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[2] + 16 * g)), 2);
    all = _mm512_inserti32x4(all, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[3] + 16 * g)), 3);
    const __m512i v = _mm512_shuffle_epi8(all, pairs);
    const __m512i w01 = _mm512_loadu_si512(q + 64 * g);
    const __m512i w23 = _mm512_loadu_si512(q + 64 * g + 32);
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_unpacklo_epi8(v, zero), w01));
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_unpackhi_epi8(v, zero), w23));
  }
  acc = _mm512_srai_epi32(acc, kWeightBits);
  // Pixel j's four sums are 32-bit lanes 4j..4j+3: saturate to bytes in order.
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtusepi32_epi8(_mm512_max_epi32(acc, zero)));
}

/// The horizontal pass over one row with AVX-512, four output pixels per
/// step (Kernel::lanes 4); returns how many it did, as resample_row_avx2.
__attribute__((target("avx512f,avx512bw"))) int resample_row_avx512(const std::uint8_t* in, int size,
                                                                    const SampleWriter::Kernel& k, std::uint8_t* out) {
  const int n = static_cast<int>(k.first.size());
  const auto qs = static_cast<std::size_t>(k.quad_stride);
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    const auto ui = static_cast<std::size_t>(i);
    const int widest = std::max(std::max(k.count[ui], k.count[ui + 1]), std::max(k.count[ui + 2], k.count[ui + 3]));
    const int groups = (widest + 3) / 4;
    std::array<const std::uint8_t*, 4> src{};
    bool inside = true;
    for (std::size_t j = 0; j < 4; ++j) {
      inside = inside && k.first[ui + j] + 4 * groups <= size;
      src[j] = in + 4 * static_cast<std::ptrdiff_t>(k.first[ui + j]);
    }
    if (!inside) break;
    quad_pixel_sums(src.data(), k.quads.data() + ui / 4 * qs, groups, out + 4 * static_cast<std::ptrdiff_t>(i));
  }
  return i;
}

/// The vertical pass, 64 bytes at a time; returns how many bytes it did.
/// The unpacks and packs work within 128-bit lanes, as in AVX2 and SSE2:
/// the bytes come back in order.
__attribute__((target("avx512f,avx512bw"))) std::size_t resample_rows_avx512(const std::uint8_t* const* rows,
                                                                             const std::int16_t* w, int count,
                                                                             std::size_t bytes, std::uint8_t* out) {
  const __m512i zero = _mm512_setzero_si512();
  std::size_t x = 0;
  for (; x + 64 <= bytes; x += 64) {
    __m512i a0 = _mm512_set1_epi32(kOne / 2), a1 = a0, a2 = a0, a3 = a0;
    for (int t = 0; t < count; t += 2) {
      const bool pair = t + 1 < count;
      const __m512i a = _mm512_loadu_si512(rows[t] + x);
      const __m512i b = pair ? _mm512_loadu_si512(rows[t + 1] + x) : zero;
      const auto wb = pair ? static_cast<std::uint16_t>(w[t + 1]) : std::uint16_t{0};
      const __m512i ww = _mm512_set1_epi32(static_cast<std::int32_t>(static_cast<std::uint16_t>(w[t]) |
                                                                     (static_cast<std::uint32_t>(wb) << 16)));
      const __m512i lo = _mm512_unpacklo_epi8(a, b), hi = _mm512_unpackhi_epi8(a, b);
      a0 = _mm512_add_epi32(a0, _mm512_madd_epi16(_mm512_unpacklo_epi8(lo, zero), ww));
      a1 = _mm512_add_epi32(a1, _mm512_madd_epi16(_mm512_unpackhi_epi8(lo, zero), ww));
      a2 = _mm512_add_epi32(a2, _mm512_madd_epi16(_mm512_unpacklo_epi8(hi, zero), ww));
      a3 = _mm512_add_epi32(a3, _mm512_madd_epi16(_mm512_unpackhi_epi8(hi, zero), ww));
    }
    const __m512i lo16 = _mm512_packs_epi32(_mm512_srai_epi32(a0, kWeightBits), _mm512_srai_epi32(a1, kWeightBits));
    const __m512i hi16 = _mm512_packs_epi32(_mm512_srai_epi32(a2, kWeightBits), _mm512_srai_epi32(a3, kWeightBits));
    _mm512_storeu_si512(out + x, _mm512_packus_epi16(lo16, hi16));
  }
  return x;
}
#pragma GCC diagnostic pop

/// The vertical pass, 32 bytes at a time from byte `x`; returns where it
/// stopped.
__attribute__((target("avx2"))) std::size_t resample_rows_avx2(const std::uint8_t* const* rows, const std::int16_t* w,
                                                               int count, std::size_t bytes, std::uint8_t* out,
                                                               std::size_t x) {
  const __m256i zero = _mm256_setzero_si256();
  for (; x + 32 <= bytes; x += 32) {
    __m256i a0 = _mm256_set1_epi32(kOne / 2), a1 = a0, a2 = a0, a3 = a0;
    for (int t = 0; t < count; t += 2) {
      const bool pair = t + 1 < count;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[t] + x));
      const __m256i b = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[t + 1] + x)) : zero;
      const auto wb = pair ? static_cast<std::uint16_t>(w[t + 1]) : std::uint16_t{0};
      const __m256i ww = _mm256_set1_epi32(static_cast<std::int32_t>(static_cast<std::uint16_t>(w[t]) |
                                                                     (static_cast<std::uint32_t>(wb) << 16)));
      const __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), ww));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), ww));
      a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), ww));
      a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), ww));
    }
    const __m256i lo16 = _mm256_packs_epi32(_mm256_srai_epi32(a0, kWeightBits), _mm256_srai_epi32(a1, kWeightBits));
    const __m256i hi16 = _mm256_packs_epi32(_mm256_srai_epi32(a2, kWeightBits), _mm256_srai_epi32(a3, kWeightBits));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + x), _mm256_packus_epi16(lo16, hi16));
  }
  return x;
}
#endif

/// One row through a kernel: out[i] = sum of in[first + t] * w[t] over the
/// taps, per BGRA channel, rounded. SSE2 (taps padded to an even count):
/// two output pixels at a time, packed and stored together.
void resample_row(const std::uint8_t* in, int size, const SampleWriter::Kernel& k, std::uint8_t* out,
                  SimdLevel simd) {
  const int n = static_cast<int>(k.first.size());
  const auto stride = static_cast<std::size_t>(k.stride);
  int i = 0;
#if defined(PINFEED_AVX2)
  if (simd >= SimdLevel::avx512 && k.lanes == 4) i = resample_row_avx512(in, size, k, out);
  if (simd >= SimdLevel::avx2 && k.lanes == 2) i = resample_row_avx2(in, size, k, out);
#endif
#if defined(__SSE2__)
  if (simd >= SimdLevel::sse2 && k.even) {
    for (; i + 2 <= n; i += 2) {
      const auto ui = static_cast<std::size_t>(i);
      const __m128i a = tap_sums(in + 4 * static_cast<std::ptrdiff_t>(k.first[ui]), k.weights.data() + ui * stride,
                                 k.count[ui]);
      const __m128i b = tap_sums(in + 4 * static_cast<std::ptrdiff_t>(k.first[ui + 1]),
                                 k.weights.data() + (ui + 1) * stride, k.count[ui + 1]);
      const __m128i px = _mm_packs_epi32(a, b);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + 4 * static_cast<std::ptrdiff_t>(i)), _mm_packus_epi16(px, px));
    }
  }
#endif
  for (; i < n; ++i) {
    const auto ui = static_cast<std::size_t>(i);
    const std::uint8_t* src = in + 4 * static_cast<std::ptrdiff_t>(k.first[ui]);
    const std::int16_t* w = k.weights.data() + static_cast<std::ptrdiff_t>(i) * k.stride;
    for (int ch = 0; ch < 4; ++ch) {
      int acc = kOne / 2;
      for (int t = 0; t < k.count[ui]; ++t) acc += src[4 * t + ch] * w[t];
      out[4 * i + ch] = static_cast<std::uint8_t>(std::clamp(acc >> kWeightBits, 0, 255));
    }
  }
  (void)stride;
  (void)size;
}

/// One output row from `count` ring rows: out = sum of rows[t] * w[t], per
/// byte, rounded. SSE2: 16 bytes, two rows at a time.
void resample_rows(const std::uint8_t* const* rows, const std::int16_t* w, int count, std::size_t bytes,
                   std::uint8_t* out, SimdLevel simd) {
  std::size_t x = 0;
#if defined(PINFEED_AVX2)
  if (simd >= SimdLevel::avx512) x = resample_rows_avx512(rows, w, count, bytes, out);
  if (simd >= SimdLevel::avx2) x = resample_rows_avx2(rows, w, count, bytes, out, x);
#endif
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  for (; simd >= SimdLevel::sse2 && x + 16 <= bytes; x += 16) {
    __m128i a0 = _mm_set1_epi32(kOne / 2), a1 = a0, a2 = a0, a3 = a0;
    for (int t = 0; t < count; t += 2) {
      const bool pair = t + 1 < count;
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[t] + x));
      const __m128i b = pair ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[t + 1] + x)) : zero;
      const auto wb = pair ? static_cast<std::uint16_t>(w[t + 1]) : std::uint16_t{0};
      const __m128i ww = _mm_set1_epi32(static_cast<std::int32_t>(static_cast<std::uint16_t>(w[t]) |
                                                                  (static_cast<std::uint32_t>(wb) << 16)));
      const __m128i lo = _mm_unpacklo_epi8(a, b), hi = _mm_unpackhi_epi8(a, b);
      a0 = _mm_add_epi32(a0, _mm_madd_epi16(_mm_unpacklo_epi8(lo, zero), ww));
      a1 = _mm_add_epi32(a1, _mm_madd_epi16(_mm_unpackhi_epi8(lo, zero), ww));
      a2 = _mm_add_epi32(a2, _mm_madd_epi16(_mm_unpacklo_epi8(hi, zero), ww));
      a3 = _mm_add_epi32(a3, _mm_madd_epi16(_mm_unpackhi_epi8(hi, zero), ww));
    }
    const __m128i lo16 = _mm_packs_epi32(_mm_srai_epi32(a0, kWeightBits), _mm_srai_epi32(a1, kWeightBits));
    const __m128i hi16 = _mm_packs_epi32(_mm_srai_epi32(a2, kWeightBits), _mm_srai_epi32(a3, kWeightBits));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + x), _mm_packus_epi16(lo16, hi16));
  }
#endif
  for (; x < bytes; ++x) {
    int acc = kOne / 2;
    for (int t = 0; t < count; ++t) acc += rows[t][x] * w[t];
    out[x] = static_cast<std::uint8_t>(std::clamp(acc >> kWeightBits, 0, 255));
  }
}

}  // namespace

void SampleWriter::begin(int width, int height) {
  if (out_.empty()) throw Error("sample writer: rows arrived before prepare()");
  if (width <= 0 || height <= 0) throw Error(fmt::format("sample writer: empty region {}x{}", width, height));
  const int nw = config_.out_width(), nh = config_.out_height();
  const Interpolation filter = config_.interpolation;
  src_w_ = width;
  src_h_ = height;
  if (planned_) {
    const int dct = plan_.scale;
    make_kernel(plan_.x, nw, dct, plan_.region.x / dct, width, filter, 2, kx_);
    make_kernel(plan_.y, nh, dct, plan_.region.y / dct, height, filter, 1, ky_);
  } else {
    make_kernel(crop_axis(0, width, nw), nw, 1, 0, width, filter, 2, kx_);
    make_kernel(crop_axis(0, height, nh), nh, 1, 0, height, filter, 1, ky_);
  }
  simd_ = level();
  if (simd_ >= SimdLevel::avx2) make_quads(kx_, simd_ >= SimdLevel::avx512 ? 4 : 2);
  ring_rows_ = *std::max_element(ky_.count.begin(), ky_.count.end());
  ensure(ring_, static_cast<std::size_t>(ring_rows_) * un_bytes(nw));
  rows_in_ = 0;
  next_out_ = 0;
  band_rows_ = 0;
  started_ = true;
}

void SampleWriter::row(const std::uint8_t* bgra) {
  const int y = rows_in_++;
  const int nh = config_.out_height();
  // Only the rows some output row reads go through the horizontal pass.
  const int first_needed = ky_.first.front();
  const int last_needed = ky_.first[static_cast<std::size_t>(nh - 1)] + ky_.count[static_cast<std::size_t>(nh - 1)];
  if (y >= first_needed && y < last_needed) {
    const std::size_t bytes = un_bytes(config_.out_width());
    resample_row(bgra, src_w_, kx_, ring_.data() + static_cast<std::size_t>(y % ring_rows_) * bytes, simd_);
    // Output rows whose last source row this was: the vertical pass and the
    // writes, timed (the horizontal pass runs between decoded rows and is
    // counted with the decoder, as its row averages were before). One call
    // in kTimedEvery is timed and counted that many times: two clock reads
    // per output row were ~1% of a sample.
    const auto j = static_cast<std::size_t>(next_out_);
    if (next_out_ < nh && ky_.first[j] + ky_.count[j] <= rows_in_) {
      if (emits_++ % kTimedEvery == 0) {
        const std::uint64_t t0 = now_ns();
        emit_rows();
        output_ns_ += (now_ns() - t0) * kTimedEvery;
      } else {
        emit_rows();
      }
    }
  }
}

void SampleWriter::emit_rows() {
  const int nh = config_.out_height();
  const std::size_t bytes = un_bytes(config_.out_width());
  std::array<const std::uint8_t*, 64> rows{};
  std::vector<const std::uint8_t*> many;
  while (next_out_ < nh) {
    const auto j = static_cast<std::size_t>(next_out_);
    const int first = ky_.first[j], count = ky_.count[j];
    if (first + count > rows_in_) break;  // its last row has not arrived yet
    const std::uint8_t** r = rows.data();
    if (static_cast<std::size_t>(count) > rows.size()) {
      many.resize(static_cast<std::size_t>(count));
      r = many.data();
    }
    for (int t = 0; t < count; ++t) r[t] = ring_.data() + static_cast<std::size_t>((first + t) % ring_rows_) * bytes;
    resample_rows(r, ky_.weights.data() + static_cast<std::ptrdiff_t>(j) * ky_.stride, count, bytes,
                  band_.data() + static_cast<std::size_t>(band_rows_) * bytes, simd_);
    ++band_rows_;
    ++next_out_;
    if (band_rows_ == kBand || next_out_ == nh) flush_band();
  }
}

void SampleWriter::flush_band() {
  const int n = config_.out_width();
  const int rows = band_rows_;
  const std::uint8_t* src = band_.data();
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
      bgra_row_to_planes(src + i * un * 4, n, flip_, scale_, bias_, dst + at, dst + plane + at, dst + 2 * plane + at,
                         simd_);
    }
    if (next_out_ == config_.out_height()) stream_fence();
  }
  band_rows_ = 0;
}

void SampleWriter::write(const DecodedImage& image, const Region& crop, bool flip, std::span<std::byte> out) {
  prepare(flip, out);
  const Region c = clamp_region(crop, image.width, image.height);
  begin(c.width, c.height);
  for (int y = 0; y < c.height; ++y) row(image.row(c.y + y) + static_cast<std::size_t>(c.x) * 4);
  if (!complete()) throw Error("sample writer: the region's rows did not complete the sample");
}

}  // namespace pinfeed::loader
