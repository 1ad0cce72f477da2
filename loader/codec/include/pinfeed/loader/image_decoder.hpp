#pragma once
// ImageDecoder: JPEG, PNG and WebP into the same BGRA rows, one per thread.
//
// The format is taken from the bytes (magic numbers), not the file name: a
// PNG saved as x.jpg decodes as a PNG. JPEG goes through JpegDecoder's
// region path (crop, early stop, DCT scaling). PNG (libspng) is decoded row
// by row, so a non-interlaced PNG never exists whole in memory; WebP
// (libwebp) decodes only the region (libwebp's cropping) and interlaced PNG
// the whole image, into per-thread scratch given back when over 64 MiB. Every format honours the pixel limit before any
// pixel buffer is sized, and every failure is a DataError naming the file.
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pinfeed/loader/jpeg_decoder.hpp"

namespace pinfeed::loader {

enum class ImageFormat { jpeg, png, webp, unknown };

/// The codec registry: one row per format pinfeed decodes. Everything
/// outside the decoder that names formats reads it: the extensions a
/// dataset takes as images, the words of --format, messages ("JPEG, PNG or
/// WebP"), the names pack and make write. A new format is a row here, a row
/// of decode and encode functions in image_decoder.cpp (a static_assert
/// keeps the two in step), and its library in the build's codec list
/// (cmake/PinfeedDependencies.cmake) and scripts/install-deps.sh.
struct ImageCodec {
  ImageFormat format;
  std::string_view word;                       ///< "jpeg": flags, JSON, to_string()
  std::string_view display;                    ///< "JPEG": messages
  std::array<std::string_view, 2> extensions;  ///< lower case, no dot; [0] is the one written; "" unused
};
inline constexpr std::array<ImageCodec, 3> kImageCodecs{{
    {ImageFormat::jpeg, "jpeg", "JPEG", {"jpg", "jpeg"}},
    {ImageFormat::png, "png", "PNG", {"png", ""}},
    {ImageFormat::webp, "webp", "WebP", {"webp", ""}},
}};

/// The row of `f`; nullptr for unknown.
const ImageCodec* find_codec(ImageFormat f) noexcept;
/// The format a file extension (lower case, without the dot) names; unknown if none.
ImageFormat format_for_extension(std::string_view ext) noexcept;
/// The format whose word is `word`; ConfigError "<what> '<word>' is not one of jpeg, png or webp".
ImageFormat parse_image_format(std::string_view word, std::string_view what);
/// "JPEG, PNG or WebP" (`conjunction` "and": "JPEG, PNG and WebP").
std::string codec_names(std::string_view conjunction = "or");
/// "jpeg, png or webp": the words, for messages about a flag.
std::string codec_words(std::string_view conjunction = "or");
/// The words, in the table's order: a CLI's choices.
std::vector<std::string> codec_word_list();
/// ".jpg, .jpeg, .png, .webp": every extension a dataset decodes.
std::string codec_extensions();

/// The registry's encode side, for synthetic data (pinfeed-data make, tests,
/// benchmarks): RGB pixels (width * height * 3) in format `f`, lossy formats
/// at `quality` (JPEG 4:2:0; PNG ignores it). ConfigError for unknown, Error
/// when the library fails.
std::vector<std::byte> encode_image(ImageFormat f, const std::uint8_t* rgb, int width, int height, int quality);
/// RGB pixels as a PNG (libspng; 8-bit RGB, Adam7-interlaced when asked).
std::vector<std::byte> encode_png(const std::uint8_t* rgb, int width, int height, bool interlaced = false);
/// RGB pixels as a WebP (libwebp): lossless, or lossy at `quality`.
std::vector<std::byte> encode_webp(const std::uint8_t* rgb, int width, int height, bool lossless, int quality = 90);

/// From the first bytes: FF D8 (JPEG), the PNG signature, RIFF....WEBP.
ImageFormat sniff_format(std::span<const std::byte> data) noexcept;
std::string_view to_string(ImageFormat f) noexcept;  ///< the codec's word; "unknown"
/// The file extension for a format ("jpg", "png", "webp"); "bin" for unknown.
std::string_view extension(ImageFormat f) noexcept;

class ImageDecoder {
 public:
  explicit ImageDecoder(std::uint64_t max_pixels = kDefaultMaxPixels);
  ~ImageDecoder();
  ImageDecoder(const ImageDecoder&) = delete;
  ImageDecoder& operator=(const ImageDecoder&) = delete;

  /// Reads the header only (size, components). DataError(name, reason).
  ImageHeader header(std::span<const std::byte> data, const std::string& name);

  /// Reads the header, asks `plan(header)` what to decode, and streams that
  /// region's rows to `sink` (begin, then its rows top to bottom). PNG and
  /// WebP are decoded at full scale (plan's scale is ignored). The header's
  /// `progressive` is false and color_space "rgb"/"rgba"/"gray" for them.
  template <typename PlanFn>
  ImageHeader decode_planned(std::span<const std::byte> data, PlanFn&& plan, RowSink& sink, const std::string& name) {
    return decode_planned_ref(data, PlanRef(plan), sink, name);
  }

  /// plan(header) -> JpegDecoder::Plan, by reference (no copy, no allocation).
  class PlanRef {
   public:
    template <typename F>
    explicit PlanRef(F& f) noexcept
        : obj_(const_cast<void*>(static_cast<const void*>(&f))),
          call_([](void* o, const ImageHeader& h) -> JpegDecoder::Plan { return (*static_cast<F*>(o))(h); }) {}
    JpegDecoder::Plan operator()(const ImageHeader& h) const { return call_(obj_, h); }

   private:
    void* obj_;
    JpegDecoder::Plan (*call_)(void*, const ImageHeader&);
  };
  ImageHeader decode_planned_ref(std::span<const std::byte> data, PlanRef plan, RowSink& sink, const std::string& name);

  /// Decodes the whole image at full size into `out` (tightly packed BGRA).
  void decode_full(std::span<const std::byte> data, DecodedImage& out, const std::string& name);

  /// Decodes everything the file holds, checking it, without keeping the
  /// image: JPEG and non-interlaced PNG row by row; WebP at 1/8 size. Peak
  /// memory is a few rows (or 1/64 of the pixels). For `pinfeed-data scan`.
  ImageHeader verify(std::span<const std::byte> data, const std::string& name);

  [[nodiscard]] JpegDecoder& jpeg() noexcept { return jpeg_; }

 private:
  JpegDecoder jpeg_;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pinfeed::loader
