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
