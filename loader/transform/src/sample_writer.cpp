// SampleWriter: decoded rows in, the sample out, in its place in the batch
// (transform.hpp): the band of resampled rows, the vertical pass, and the
// conversion to the output layout.
#include "pinfeed/loader/transform.hpp"

#include <fmt/format.h>
#include <libyuv/convert_from_argb.h>
#include <libyuv/planar_functions.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "pinfeed/error.hpp"
#include "resample.hpp"

namespace pinfeed::loader {

using detail::crop_axis;
using detail::make_kernel;
using detail::make_quads;
using detail::resample_row;
using detail::resample_rows;

namespace {

// One output row: n BGRA pixels (read right to left when `flip`) to three
// float rows r, g, b of x * scale[c] + bias[c], once per SIMD level: each
// level's traits (Vec) and the one loop of planes_pass.inc, compiled for that
// level. Each channel is masked out of the 32-bit pixels, converted,
// multiplied and added (two roundings, never fused, as in every path) and
// stored with non-temporal stores: the slot is written once and never read
// here, so they skip the read-for-ownership of every cache line. The rest,
// and other targets, take the same arithmetic in scalar.
#if defined(__SSE2__)
namespace sse2_planes {
#define PINFEED_SIMD_TARGET
struct Vec {
  using R = __m128i;
  using F = __m128;
  static constexpr int kPixels = 4;
  static constexpr std::uintptr_t kAlign = 16;
  static R mask() { return _mm_set1_epi32(0xff); }
  static F set1(float v) { return _mm_set1_ps(v); }
  static R load(const std::uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static R reverse(R v) { return _mm_shuffle_epi32(v, _MM_SHUFFLE(0, 1, 2, 3)); }
  template <int Shift>
  static F channel(R v, R mask) {
    return _mm_cvtepi32_ps(_mm_and_si128(_mm_srli_epi32(v, Shift), mask));
  }
  static F scale_bias(F f, F scale, F bias) { return _mm_add_ps(_mm_mul_ps(f, scale), bias); }
  static void stream(float* p, F v) { _mm_stream_ps(p, v); }
};
#include "planes_pass.inc"
#undef PINFEED_SIMD_TARGET
}  // namespace sse2_planes
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define PINFEED_HAVE_WIDE_PLANES 1
namespace avx2_planes {
#define PINFEED_SIMD_TARGET __attribute__((target("avx2")))
struct Vec {
  using R = __m256i;
  using F = __m256;
  static constexpr int kPixels = 8;
  static constexpr std::uintptr_t kAlign = 32;
  PINFEED_SIMD_TARGET static R mask() { return _mm256_set1_epi32(0xff); }
  PINFEED_SIMD_TARGET static F set1(float v) { return _mm256_set1_ps(v); }
  PINFEED_SIMD_TARGET static R load(const std::uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  PINFEED_SIMD_TARGET static R reverse(R v) {
    return _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0));
  }
  template <int Shift>
  PINFEED_SIMD_TARGET static F channel(R v, R mask) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, Shift), mask));
  }
  PINFEED_SIMD_TARGET static F scale_bias(F f, F scale, F bias) { return _mm256_add_ps(_mm256_mul_ps(f, scale), bias); }
  PINFEED_SIMD_TARGET static void stream(float* p, F v) { _mm256_stream_ps(p, v); }
};
#include "planes_pass.inc"
#undef PINFEED_SIMD_TARGET
}  // namespace avx2_planes

#pragma GCC diagnostic push
#if !defined(__clang__)                                 // clang has no such warning group, and no such bug
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593: see resample_row_avx512
#endif
namespace avx512_planes {
#define PINFEED_SIMD_TARGET __attribute__((target("avx512f")))
/// AVX-512F implies FMA to GCC, and GCC writes _mm512_mul_ps and
/// _mm512_add_ps as plain vector arithmetic that it may contract into one
/// fused multiply-add (one rounding, other floats than every other path's):
/// the _round forms are builtins it leaves alone, with the default rounding.
struct Vec {
  using R = __m512i;
  using F = __m512;
  static constexpr int kPixels = 16;
  static constexpr std::uintptr_t kAlign = 64;
  static constexpr int kNear = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  PINFEED_SIMD_TARGET static R mask() { return _mm512_set1_epi32(0xff); }
  PINFEED_SIMD_TARGET static F set1(float v) { return _mm512_set1_ps(v); }
  PINFEED_SIMD_TARGET static R load(const std::uint8_t* p) { return _mm512_loadu_si512(p); }
  PINFEED_SIMD_TARGET static R reverse(R v) {
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), v);
  }
  template <int Shift>
  PINFEED_SIMD_TARGET static F channel(R v, R mask) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, Shift), mask));
  }
  PINFEED_SIMD_TARGET static F scale_bias(F f, F scale, F bias) {
    return _mm512_add_round_ps(_mm512_mul_round_ps(f, scale, kNear), bias, kNear);
  }
  PINFEED_SIMD_TARGET static void stream(float* p, F v) { _mm512_stream_ps(p, v); }
};
#include "planes_pass.inc"
#undef PINFEED_SIMD_TARGET
}  // namespace avx512_planes
#pragma GCC diagnostic pop
#endif

void bgra_row_to_planes(const std::uint8_t* px, int n, bool flip, const std::array<float, 3>& scale,
                        const std::array<float, 3>& bias, float* r, float* g, float* b, SimdLevel simd) {
  int x = 0;
  [[maybe_unused]] const auto aligned = [&](std::uintptr_t to) {
    return (reinterpret_cast<std::uintptr_t>(r + x) | reinterpret_cast<std::uintptr_t>(g + x) |
            reinterpret_cast<std::uintptr_t>(b + x)) %
               to ==
           0;
  };
#if defined(PINFEED_HAVE_WIDE_PLANES)
  using V512 = avx512_planes::Vec;
  using V256 = avx2_planes::Vec;
  if (simd >= SimdLevel::avx512 && aligned(V512::kAlign)) {
    x = avx512_planes::planes_pass<V512>(px, n, flip, scale, bias, r, g, b, x);
  }
  if (simd >= SimdLevel::avx2 && aligned(V256::kAlign)) {
    x = avx2_planes::planes_pass<V256>(px, n, flip, scale, bias, r, g, b, x);
  }
#endif
#if defined(__SSE2__)
  if (simd >= SimdLevel::sse2 && aligned(sse2_planes::Vec::kAlign)) {
    x = sse2_planes::planes_pass<sse2_planes::Vec>(px, n, flip, scale, bias, r, g, b, x);
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
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

/// Output rows written together.
constexpr int kBand = 16;
/// emit_rows calls per timed one (SampleWriter::row).
constexpr std::uint32_t kTimedEvery = 8;

std::size_t un_bytes(int pixels) { return static_cast<std::size_t>(pixels) * 4; }

}  // namespace

SampleWriter::SampleWriter(const TransformConfig& config) : config_(config) {
  // A writer never sizes its rows from a config out of range, whoever made it.
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
  simd_ = simd_level();
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
