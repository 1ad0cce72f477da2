#pragma once
// Transforms: which part of an image becomes a sample, and how it is written.
//
// plan_crop() is torchvision's geometry: RandomResizedCrop (scale 0.08-1.0,
// ratio 3/4-4/3, 10 tries then the centre fallback), Resize(shorter side) +
// CenterCrop (expressed as the centre region of the original that the resize
// would keep, so only that region is decoded), or the whole image. It also
// picks the DCT scale (1/2, 1/4, 1/8 only, and only while the scaled region
// still covers the output) and the horizontal flip (p = 0.5). Randomness comes
// from a SampleRng of (seed, epoch, sample index) alone.
//
// SampleWriter takes the decoded region's rows as the decoder produces them
// and resizes them to the output size on the way: exact 2:1 box averages
// while the shrink exceeds 2x (so downscaling is antialiased), then bilinear
// (rows here, columns with libyuv a band at a time), flips, and writes each
// band of output rows in the output layout straight into the sample's place
// in the batch: uint8 NHWC (normalize later on the device) or float32 NCHW
// with (x / 255 - mean) / std.
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "pinfeed/loader/jpeg_decoder.hpp"
#include "pinfeed/loader/sample_rng.hpp"
#include "pinfeed/enum_words.hpp"

namespace pinfeed::loader {

/// Output side limits (TransformConfig::size), for validate() and every CLI.
inline constexpr int kMinImageSize = 8;
inline constexpr int kMaxImageSize = 4096;
/// The largest `resize` (center crop's shorter side) and aspect ratio bound.
inline constexpr int kMaxResize = 8192;
inline constexpr double kMaxAspectRatio = 100.0;

enum class CropMode { random_resized, center, full };
enum class Layout { nhwc_u8, nchw_f32 };
inline constexpr std::array<EnumWord<CropMode>, 3> kCropModeWords{
    {{CropMode::random_resized, "random"}, {CropMode::center, "center"}, {CropMode::full, "full"}}};
inline constexpr std::array<EnumWord<Layout>, 2> kLayoutWords{{{Layout::nchw_f32, "nchw-f32"}, {Layout::nhwc_u8, "nhwc-u8"}}};
/// How regions are resized to the output: bilinear, antialiased (exact 2:1
/// box averages while the shrink exceeds 2x, as PIL's and torchvision's
/// antialiased BILINEAR), or nearest (each output pixel takes the source
/// pixel under its centre: PIL's NEAREST, torchvision's NEAREST_EXACT).
enum class Interpolation { bilinear, nearest };
inline constexpr std::array<EnumWord<Interpolation>, 2> kInterpolationWords{
    {{Interpolation::bilinear, "bilinear"}, {Interpolation::nearest, "nearest"}}};
Interpolation parse_interpolation(std::string_view text);  ///< "bilinear", "nearest"; ConfigError otherwise
std::string_view to_string(Interpolation i) noexcept;
CropMode parse_crop_mode(std::string_view text);  ///< "random", "center", "full"; ConfigError otherwise
Layout parse_layout(std::string_view text);       ///< "nhwc-u8", "nchw-f32"; ConfigError otherwise
std::string_view to_string(CropMode m) noexcept;
std::string_view to_string(Layout l) noexcept;

struct TransformConfig {
  CropMode crop = CropMode::random_resized;  ///< how the sample region is chosen
  int size = 224;                            ///< output width, pixels (and height unless `height` is set)
  int height = 0;                            ///< output height, pixels; 0: size (square)
  int resize = 256;                          ///< shorter side before CenterCrop (center mode)
  double scale_min = 0.08, scale_max = 1.0;  ///< RandomResizedCrop area range
  double ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0;  ///< RandomResizedCrop aspect range
  bool flip = true;                          ///< random horizontal flip (not in center/full mode)
  double flip_p = 0.5;                       ///< its probability
  Interpolation interpolation = Interpolation::bilinear;  ///< how regions are resized
  Layout layout = Layout::nchw_f32;          ///< output layout and type
  std::array<float, 3> mean{0.485F, 0.456F, 0.406F};  ///< RGB, in [0, 1] units
  std::array<float, 3> std{0.229F, 0.224F, 0.225F};   ///< RGB, in [0, 1] units
  bool dct_scaling = true;                   ///< allow 1/2, 1/4, 1/8 decode (measurable trick)
  bool roi_decode = true;                    ///< decode only the region (measurable trick)
  void validate() const;                     ///< ConfigError naming the field

  [[nodiscard]] int out_width() const noexcept { return size; }
  [[nodiscard]] int out_height() const noexcept { return height != 0 ? height : size; }
  /// Bytes of one output sample.
  [[nodiscard]] std::size_t sample_bytes() const noexcept;
  [[nodiscard]] std::size_t element_bytes() const noexcept { return layout == Layout::nhwc_u8 ? 1 : 4; }
};

struct CropPlan {
  Region region;   ///< in full-resolution pixels of the source image
  int scale = 1;   ///< DCT scale denominator: 1, 2, 4 or 8
  bool flip = false;
};

/// `region` clamped to a width x height image; an empty region is the whole image.
Region clamp_region(const Region& region, int width, int height) noexcept;

/// The crop, scale and flip for one sample. Pure: depends on the header,
/// the config and the rng only.
CropPlan plan_crop(const ImageHeader& header, const TransformConfig& config, SampleRng& rng);

/// Resizes decoded regions and writes them into output samples, streaming:
/// rows are reduced as they arrive from the decoder (exact 2:1 averages
/// while the shrink exceeds 2x, so downscaling is antialiased, then bilinear:
/// vertically here, horizontally by libyuv a band of rows at a time), and
/// each band of output rows is flipped, converted and written to the sample
/// at once. Per-thread memory is a few rows, whatever the image size; the
/// decoded region never exists whole. One per thread.
class SampleWriter : private RowSink {
 public:
  explicit SampleWriter(const TransformConfig& config);
  /// Resizes the `crop` rectangle of `image` (decoded pixel coordinates;
  /// the whole image when empty) to height x width, flips if asked, and writes
  /// `out` (exactly config.sample_bytes() bytes).
  void write(const DecodedImage& image, const Region& crop, bool flip, std::span<std::byte> out);

  /// Streaming: sets up the next sample (flip, where it goes); the rows then
  /// come through sink(), begin() first (JpegDecoder::decode_planned).
  void prepare(bool flip, std::span<std::byte> out);
  [[nodiscard]] RowSink& sink() noexcept { return *this; }
  /// Whether the prepared sample has received all its rows and is written.
  [[nodiscard]] bool complete() const noexcept { return started_ && next_out_ == config_.out_height() && band_rows_ == 0; }
  /// Nanoseconds spent in the horizontal resize and the output writes since
  /// the last call: the rest of the transform runs between decoded rows.
  [[nodiscard]] std::uint64_t take_output_ns() noexcept;

 private:
  void begin(int width, int height) override;
  void row(const std::uint8_t* bgra) override;
  void push_level(std::size_t level, const std::uint8_t* row);
  void push_final(const std::uint8_t* row);
  void flush_band();

  TransformConfig config_;
  std::array<float, 3> scale_{}, bias_{};  // x * scale + bias == (x / 255 - mean) / std
  // The sample in progress.
  bool flip_ = false, started_ = false;
  std::span<std::byte> out_;
  int src_w_ = 0, src_h_ = 0;
  int col_halvings_ = 0, width_ = 0;       // after the 2:1 column averages
  std::size_t row_halvings_ = 0;
  int final_height_ = 0, final_rows_ = 0;  // rows after the 2:1 row averages; received so far
  int next_out_ = 0, band_rows_ = 0;
  std::uint64_t output_ns_ = 0;
  // Scratch, reused: a few rows each.
  ScratchBytes cols_a_, cols_b_;               // a row after each column halving (ping-pong)
  std::vector<ScratchBytes> pending_, averaged_;  // per row-halving level: the row waiting for its pair, the pair's average
  std::vector<char> has_pending_;
  ScratchBytes final_[2];                      // rows after halving, by parity of their index
  const std::uint8_t* recent_[2] = {nullptr, nullptr};  // the last two of them, wherever they lie
  ScratchBytes band_;                          // vertically resized rows (width_ wide), kBand of them
  ScratchBytes band_out_;                      // the same rows at the output width
  ScratchBytes mirrored_;                      // one flipped output row (uint8 output)
  std::vector<int> nearest_x_;                 // nearest: the source column of each output column
  std::vector<int> linear_x_;                  // bilinear: the left source column of each output column
  std::vector<int> linear_f_;                  // bilinear: the right column's weight, 0..256
  std::vector<std::int32_t> linear_w_;         // bilinear: (256 - f) | f << 16, two 16-bit weights for madd
};

}  // namespace pinfeed::loader
