// PIL's resample kernels in 14-bit fixed point, and the loops that apply
// them along a row and across rows, per SIMD level (resample.hpp).
#include "resample.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace pinfeed::loader::detail {

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

}  // namespace

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
      w[static_cast<std::size_t>(t)] = nearest ? 1.0 : filter_weight(filter, (first + t - base + 0.5 - center) / scale);
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

namespace {

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
    const __m128i px =
        pair_sums(in + 4 * static_cast<std::ptrdiff_t>(k.first[ui]),
                  in + 4 * static_cast<std::ptrdiff_t>(k.first[ui + 1]), k.quads.data() + ui / 2 * qs, groups);
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

#pragma GCC diagnostic pop

#endif

// The vertical pass, once per SIMD level: each level's vector traits (Vec:
// the register, its width, the few operations the pass uses) and the one
// loop of rows_pass.inc, compiled for that level (PINFEED_SIMD_TARGET).
#if defined(__SSE2__)
namespace sse2_rows {
#define PINFEED_SIMD_TARGET
struct Vec {
  using R = __m128i;
  static constexpr std::size_t kBytes = 16;
  static R zero() { return _mm_setzero_si128(); }
  static R set1(std::int32_t v) { return _mm_set1_epi32(v); }
  static R load(const std::uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static void store(std::uint8_t* p, R v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v); }
  static R unpacklo8(R a, R b) { return _mm_unpacklo_epi8(a, b); }
  static R unpackhi8(R a, R b) { return _mm_unpackhi_epi8(a, b); }
  static R add32(R a, R b) { return _mm_add_epi32(a, b); }
  static R madd16(R a, R b) { return _mm_madd_epi16(a, b); }
  static R shift_back(R a) { return _mm_srai_epi32(a, kWeightBits); }
  static R packs32(R a, R b) { return _mm_packs_epi32(a, b); }
  static R packus16(R a, R b) { return _mm_packus_epi16(a, b); }
};
#include "rows_pass.inc"
#undef PINFEED_SIMD_TARGET
}  // namespace sse2_rows
#endif

#if defined(PINFEED_AVX2)
namespace avx2_rows {
#define PINFEED_SIMD_TARGET __attribute__((target("avx2")))
struct Vec {
  using R = __m256i;
  static constexpr std::size_t kBytes = 32;
  PINFEED_SIMD_TARGET static R zero() { return _mm256_setzero_si256(); }
  PINFEED_SIMD_TARGET static R set1(std::int32_t v) { return _mm256_set1_epi32(v); }
  PINFEED_SIMD_TARGET static R load(const std::uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  PINFEED_SIMD_TARGET static void store(std::uint8_t* p, R v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  PINFEED_SIMD_TARGET static R unpacklo8(R a, R b) { return _mm256_unpacklo_epi8(a, b); }
  PINFEED_SIMD_TARGET static R unpackhi8(R a, R b) { return _mm256_unpackhi_epi8(a, b); }
  PINFEED_SIMD_TARGET static R add32(R a, R b) { return _mm256_add_epi32(a, b); }
  PINFEED_SIMD_TARGET static R madd16(R a, R b) { return _mm256_madd_epi16(a, b); }
  PINFEED_SIMD_TARGET static R shift_back(R a) { return _mm256_srai_epi32(a, kWeightBits); }
  PINFEED_SIMD_TARGET static R packs32(R a, R b) { return _mm256_packs_epi32(a, b); }
  PINFEED_SIMD_TARGET static R packus16(R a, R b) { return _mm256_packus_epi16(a, b); }
};
#include "rows_pass.inc"
#undef PINFEED_SIMD_TARGET
}  // namespace avx2_rows

// GCC 12's AVX-512 intrinsics pass _mm512_undefined_epi32() as the unused
// merge source, which -Wmaybe-uninitialized reports (GCC bug 105593, fixed
// in GCC 13): silenced for these functions only.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
namespace avx512_rows {
#define PINFEED_SIMD_TARGET __attribute__((target("avx512f,avx512bw")))
struct Vec {
  using R = __m512i;
  static constexpr std::size_t kBytes = 64;
  PINFEED_SIMD_TARGET static R zero() { return _mm512_setzero_si512(); }
  PINFEED_SIMD_TARGET static R set1(std::int32_t v) { return _mm512_set1_epi32(v); }
  PINFEED_SIMD_TARGET static R load(const std::uint8_t* p) { return _mm512_loadu_si512(p); }
  PINFEED_SIMD_TARGET static void store(std::uint8_t* p, R v) { _mm512_storeu_si512(p, v); }
  PINFEED_SIMD_TARGET static R unpacklo8(R a, R b) { return _mm512_unpacklo_epi8(a, b); }
  PINFEED_SIMD_TARGET static R unpackhi8(R a, R b) { return _mm512_unpackhi_epi8(a, b); }
  PINFEED_SIMD_TARGET static R add32(R a, R b) { return _mm512_add_epi32(a, b); }
  PINFEED_SIMD_TARGET static R madd16(R a, R b) { return _mm512_madd_epi16(a, b); }
  PINFEED_SIMD_TARGET static R shift_back(R a) { return _mm512_srai_epi32(a, kWeightBits); }
  PINFEED_SIMD_TARGET static R packs32(R a, R b) { return _mm512_packs_epi32(a, b); }
  PINFEED_SIMD_TARGET static R packus16(R a, R b) { return _mm512_packus_epi16(a, b); }
};
#include "rows_pass.inc"
#undef PINFEED_SIMD_TARGET
}  // namespace avx512_rows
#pragma GCC diagnostic pop
#endif

}  // namespace

/// One row through a kernel: out[i] = sum of in[first + t] * w[t] over the
/// taps, per BGRA channel, rounded. SSE2 (taps padded to an even count):
/// two output pixels at a time, packed and stored together.
void resample_row(const std::uint8_t* in, int size, const SampleWriter::Kernel& k, std::uint8_t* out, SimdLevel simd) {
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
      const __m128i a =
          tap_sums(in + 4 * static_cast<std::ptrdiff_t>(k.first[ui]), k.weights.data() + ui * stride, k.count[ui]);
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
/// byte, rounded: the widest vector loop the CPU has (rows_pass.inc, 64, 32
/// or 16 bytes, two rows at a time), then bytes one by one.
void resample_rows(const std::uint8_t* const* rows, const std::int16_t* w, int count, std::size_t bytes,
                   std::uint8_t* out, SimdLevel simd) {
  std::size_t x = 0;
#if defined(PINFEED_AVX2)
  if (simd >= SimdLevel::avx512) x = avx512_rows::rows_pass<avx512_rows::Vec>(rows, w, count, bytes, out, x);
  if (simd >= SimdLevel::avx2) x = avx2_rows::rows_pass<avx2_rows::Vec>(rows, w, count, bytes, out, x);
#endif
#if defined(__SSE2__)
  if (simd >= SimdLevel::sse2) x = sse2_rows::rows_pass<sse2_rows::Vec>(rows, w, count, bytes, out, x);
#endif
  for (; x < bytes; ++x) {
    int acc = kOne / 2;
    for (int t = 0; t < count; ++t) acc += rows[t][x] * w[t];
    out[x] = static_cast<std::uint8_t>(std::clamp(acc >> kWeightBits, 0, 255));
  }
}

}  // namespace pinfeed::loader::detail
