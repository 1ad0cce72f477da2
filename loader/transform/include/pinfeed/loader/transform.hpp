#pragma once
// Transforms: which part of an image becomes a sample, and how it is written.
//
// plan_crop() is torchvision's geometry: RandomResizedCrop (scale 0.08-1.0,
// ratio 3/4-4/3, 10 tries then the centre fallback), Resize(shorter side) +
// CenterCrop (the output pixels torchvision's Resize would compute inside
// its CenterCrop window, with its rounding: the long side truncated, the
// offsets rounded half to even), or the whole image (Resize((h, w))). Only
// the pixels the resize reads are decoded. It also picks the DCT scale (1/2,
// 1/4, 1/8 only, JPEG only, and only while the scaled crop still covers the
// output) and the horizontal flip (p = 0.5). Randomness comes from a
// SampleRng of (seed, epoch, sample index) alone.
//
// SampleWriter takes the decoded rows as the decoder produces them and
// resamples them as PIL's resize does (what torchvision's transforms call on
// PIL images): a separable triangle (or cubic) filter widened to the shrink factor
// (antialiased), pixel centres aligned, horizontal pass first; bilinear
// weights in 14-bit fixed point summing exactly to one, so a constant image
// stays exactly constant and the mean over a picture is PIL's. Then it flips
// and writes each band of output rows in the output layout straight into
// the sample's place in the batch: uint8 NHWC (normalize later on the
// device) or float32 NCHW with (x / 255 - mean) / std.
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "pinfeed/enum_words.hpp"
#include "pinfeed/loader/image.hpp"
#include "pinfeed/loader/sample_rng.hpp"

namespace pinfeed::loader {

/// Output side limits (TransformConfig::size), for validate() and every CLI.
inline constexpr int kMinImageSize = 8;
inline constexpr int kMaxImageSize = 4096;
/// The most a resize may shrink along one side: the filter reads about
/// twice that many source pixels per output pixel and the writer keeps as
/// many output-width rows (a sample over it is a DataError naming it).
inline constexpr double kMaxShrink = 512;
/// The largest `resize` (center crop's shorter side) and aspect ratio bound.
inline constexpr int kMaxResize = 8192;
inline constexpr double kMaxAspectRatio = 100.0;

enum class CropMode { random_resized, center, full };
enum class Layout { nhwc_u8, nchw_f32 };
inline constexpr std::array<EnumWord<CropMode>, 3> kCropModeWords{
    {{CropMode::random_resized, "random"}, {CropMode::center, "center"}, {CropMode::full, "full"}}};
inline constexpr std::array<EnumWord<Layout>, 2> kLayoutWords{
    {{Layout::nchw_f32, "nchw-f32"}, {Layout::nhwc_u8, "nhwc-u8"}}};
/// How regions are resized to the output: bilinear, antialiased (exact 2:1
/// box averages while the shrink exceeds 2x, as PIL's and torchvision's
/// antialiased BILINEAR), or nearest (each output pixel takes the source
/// pixel under its centre: PIL's NEAREST, torchvision's NEAREST_EXACT).
/// PIL's filters, antialiased when shrinking (the support grows with the
/// shrink): bilinear (a triangle of support 1), bicubic (Keys' cubic with
/// a = -0.5, support 2, PIL's BICUBIC), nearest.
enum class Interpolation { bilinear, nearest, bicubic };
inline constexpr std::array<EnumWord<Interpolation>, 3> kInterpolationWords{
    {{Interpolation::bilinear, "bilinear"}, {Interpolation::nearest, "nearest"}, {Interpolation::bicubic, "bicubic"}}};
Interpolation parse_interpolation(std::string_view text);  ///< "bilinear", "nearest", "bicubic"; ConfigError otherwise
std::string_view to_string(Interpolation i) noexcept;
CropMode parse_crop_mode(std::string_view text);  ///< "random", "center", "full"; ConfigError otherwise
Layout parse_layout(std::string_view text);       ///< "nhwc-u8", "nchw-f32"; ConfigError otherwise
std::string_view to_string(CropMode m) noexcept;
std::string_view to_string(Layout l) noexcept;

struct TransformConfig {
  CropMode crop = CropMode::random_resized;               ///< how the sample region is chosen
  int size = 224;                                         ///< output width, pixels (and height unless `height` is set)
  int height = 0;                                         ///< output height, pixels; 0: size (square)
  int resize = 256;                                       ///< shorter side before CenterCrop (center mode)
  double scale_min = 0.08, scale_max = 1.0;               ///< RandomResizedCrop area range
  double ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0;    ///< RandomResizedCrop aspect range
  bool flip = true;                                       ///< random horizontal flip (not in center/full mode)
  double flip_p = 0.5;                                    ///< its probability
  Interpolation interpolation = Interpolation::bilinear;  ///< how regions are resized
  Layout layout = Layout::nchw_f32;                       ///< output layout and type
  std::array<float, 3> mean{0.485F, 0.456F, 0.406F};      ///< RGB, in [0, 1] units
  std::array<float, 3> std{0.229F, 0.224F, 0.225F};       ///< RGB, in [0, 1] units
  bool dct_scaling = false;  ///< allow 1/2, 1/4, 1/8 decode: faster on large images, pixels no longer PIL's (opt-in)
  bool roi_decode = true;    ///< decode only the region (measurable trick)
  /// ConfigError naming the field: every range of transform_ranges(), then
  /// validate_relations().
  void validate() const;
  /// The rules the option rows cannot state alone (validate() is the rows'
  /// ranges, then these; LoaderConfig::validate, which checks the rows
  /// itself, calls only these).
  void validate_relations() const;

  [[nodiscard]] int out_width() const noexcept { return size; }
  [[nodiscard]] int out_height() const noexcept { return height != 0 ? height : size; }
  /// Bytes of one output sample.
  [[nodiscard]] std::size_t sample_bytes() const noexcept;
  [[nodiscard]] std::size_t element_bytes() const noexcept { return layout == Layout::nhwc_u8 ? 1 : 4; }
};

/// A numeric field's valid range, owned by the transform: validate() checks
/// these, and the loader's option table (options.cpp) takes its rows' ranges
/// from them, so the two cannot disagree.
struct TransformRange {
  std::string_view name;  ///< the option's name ("scale_min")
  bool integer = false;
  double min = 0, max = 0;     ///< inclusive...
  bool min_exclusive = false;  ///< ...except the lower bound when this is set
  double (*get)(const TransformConfig&) = nullptr;
};
/// size, height, resize, scale_min/max, ratio_min/max, flip_p.
std::span<const TransformRange> transform_ranges() noexcept;
/// The row named `name`; std::out_of_range when there is none.
const TransformRange& transform_range(std::string_view name);

/// One axis of a resize, as PIL's resample sees it: output pixel k has its
/// centre at origin + (offset + k + 0.5) * scale in source pixels, and reads
/// the source pixels under the filter stretched to max(scale, 1) there
/// (half-width 1 x that for bilinear, 2 x bicubic, one pixel for nearest), clamped to [lo, hi). RandomResizedCrop
/// crops, then resizes: its taps stop at the crop. Resize + CenterCrop resizes the whole image: taps reach past the
/// crop window into the rest of the image, and `offset` is the window's first column (row) in the resized image.
struct ResampleAxis {
  double scale = 1;
  int offset = 0;
  int origin = 0;
  int lo = 0, hi = 0;
};

/// [first, last) source pixels of output pixel k (source coordinates).
struct Taps {
  int first = 0, last = 0;
};
Taps axis_taps(const ResampleAxis& axis, int k, Interpolation filter) noexcept;

struct CropPlan {
  Region region;  ///< what to decode, in full-resolution pixels: every source pixel the resize reads
  int scale = 1;  ///< DCT scale denominator: 1, 2, 4 or 8
  bool flip = false;
  ResampleAxis x, y;  ///< the resize, in full-resolution source coordinates
};

/// The crop, scale and flip for one sample. Pure: depends on the header,
/// the config and the rng only.
CropPlan plan_crop(const ImageHeader& header, const TransformConfig& config, SampleRng& rng);

/// Resizes decoded regions and writes them into output samples, streaming:
/// each row is resampled horizontally as it arrives from the decoder into a
/// ring of rows, each output row is resampled vertically from the ring once
/// its last source row arrived, and each band of output rows is flipped,
/// converted and written to the sample at once. Per-thread memory is a few
/// rows, whatever the image size; the
/// decoded region never exists whole. One per thread.
/// The instruction set the resampler and the float conversion use: the
/// CPU's best, except SSE2 on cores that run AVX2 as two halves (AMD Zen 1
/// and Zen+: Note [SIMD level by core]); avx512 is AVX-512 F and BW.
/// PINFEED_SIMD=scalar|sse2|avx2|avx512 chooses (PINFEED_NO_AVX2=1: sse2).
/// Every level writes the same bytes (tests compare them).
enum class SimdLevel { scalar, sse2, avx2, avx512 };
inline constexpr std::array<EnumWord<SimdLevel>, 4> kSimdLevelWords{{{SimdLevel::scalar, "scalar"},
                                                                     {SimdLevel::sse2, "sse2"},
                                                                     {SimdLevel::avx2, "avx2"},
                                                                     {SimdLevel::avx512, "avx512"}}};
SimdLevel simd_level() noexcept;
std::string_view to_string(SimdLevel level) noexcept;
/// Every later sample uses `level`, capped at what the CPU has; returns the
/// level now in use. For tests and benchmarks.
SimdLevel set_simd_level(SimdLevel level) noexcept;

class SampleWriter : private RowSink {
 public:
  explicit SampleWriter(const TransformConfig& config);
  /// Resizes the `crop` rectangle of `image` (decoded pixel coordinates;
  /// the whole image when empty) to height x width, flips if asked, and writes
  /// `out` (exactly config.sample_bytes() bytes).
  void write(const DecodedImage& image, const Region& crop, bool flip, std::span<std::byte> out);

  /// Streaming: sets up the next sample: the plan's resize (its axes in
  /// source coordinates; the rows that come are its region, at 1/plan.scale
  /// size), flip, and where it goes. The rows then come through sink(),
  /// begin() first (JpegDecoder::decode_planned).
  void prepare(const CropPlan& plan, std::span<std::byte> out);
  /// The same, resizing whatever region comes to the output (its taps
  /// stopping at its edges, as a crop followed by a resize).
  void prepare(bool flip, std::span<std::byte> out);
  [[nodiscard]] RowSink& sink() noexcept { return *this; }
  /// Whether the prepared sample has received all its rows and is written.
  [[nodiscard]] bool complete() const noexcept {
    return started_ && next_out_ == config_.out_height() && band_rows_ == 0;
  }
  /// Nanoseconds spent in the vertical resample and the output writes
  /// since the last call: the rest of the sample's time (the horizontal
  /// pass runs between decoded rows) is counted as the decoder's.
  [[nodiscard]] std::uint64_t take_output_ns() noexcept;

  /// One axis's taps in the decoded rows' coordinates, weights in 14-bit
  /// fixed point summing to 1 << 14 (for tests and the benchmarks).
  struct Kernel {
    std::vector<int> first;             ///< per output pixel: its first source pixel
    std::vector<int> count;             ///< and how many (nearest: 1)
    std::vector<std::int16_t> weights;  ///< per output pixel, `stride` of them (zero past count)
    int stride = 0;
    bool even = false;  ///< every count is even (the SIMD path)
    /// The AVX2 and AVX-512 layout of `weights` (horizontal kernels): per
    /// `lanes` output pixels (2 or 4), `quad_stride` int16s; per 4 taps
    /// (w0, w1) four times for each pixel, then (w2, w3) the same: two madd
    /// operands, one 128-bit lane per pixel.
    std::vector<std::int16_t> quads;
    int quad_stride = 0;
    int lanes = 0;
    std::vector<double> scratch;  ///< one output pixel's weights while they are made
  };

 private:
  void begin(int width, int height) override;
  void row(const std::uint8_t* bgra) override;
  void emit_rows();
  void flush_band();

  TransformConfig config_;
  std::array<float, 3> scale_{}, bias_{};  // x * scale + bias == (x / 255 - mean) / std
  // The sample in progress.
  bool flip_ = false, started_ = false, planned_ = false;
  CropPlan plan_;
  std::span<std::byte> out_;
  int src_w_ = 0, src_h_ = 0;
  int rows_in_ = 0;  // decoded rows received
  int next_out_ = 0, band_rows_ = 0;
  std::uint64_t output_ns_ = 0;
  std::uint32_t emits_ = 0;             // emit_rows calls: one in kTimedEvery is timed
  SimdLevel simd_ = SimdLevel::scalar;  // the sample's instruction set (simd_level() at begin)
  Kernel kx_, ky_;
  int ring_rows_ = 0;  // capacity of the ring (the largest vertical tap count)
  // Scratch, reused: a few rows each.
  ScratchBytes ring_;      // horizontally resampled rows (output width), by source row % ring_rows_
  ScratchBytes band_;      // finished output rows, kBand of them
  ScratchBytes mirrored_;  // one flipped output row (uint8 output)
};

}  // namespace pinfeed::loader
