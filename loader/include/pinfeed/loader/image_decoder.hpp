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
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "pinfeed/loader/jpeg_decoder.hpp"
#include "pinfeed/enum_words.hpp"

namespace pinfeed::loader {

enum class ImageFormat { jpeg, png, webp, unknown };
inline constexpr std::array<EnumWord<ImageFormat>, 4> kImageFormatWords{{{ImageFormat::jpeg, "jpeg"},
                                                                        {ImageFormat::png, "png"},
                                                                        {ImageFormat::webp, "webp"},
                                                                        {ImageFormat::unknown, "unknown"}}};
/// From the first bytes: FF D8 (JPEG), the PNG signature, RIFF....WEBP.
ImageFormat sniff_format(std::span<const std::byte> data) noexcept;
std::string_view to_string(ImageFormat f) noexcept;  ///< "jpeg", "png", "webp", "unknown"
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
    const ImageFormat f = sniff_format(data);
    if (f == ImageFormat::jpeg) return jpeg_.decode_planned(data, std::forward<PlanFn>(plan), sink, name);
    if (f == ImageFormat::unknown) refuse_unknown(data, name);
    const ImageHeader h = header(data, name);
    const JpegDecoder::Plan p = plan(h);
    decode_other(data, p.region, sink, name);
    return h;
  }

  /// Decodes the whole image at full size into `out` (tightly packed BGRA).
  void decode_full(std::span<const std::byte> data, DecodedImage& out, const std::string& name);

  /// Decodes everything the file holds, checking it, without keeping the
  /// image: JPEG and non-interlaced PNG row by row; WebP at 1/8 size. Peak
  /// memory is a few rows (or 1/64 of the pixels). For `pinfeed-data scan`.
  ImageHeader verify(std::span<const std::byte> data, const std::string& name);

  [[nodiscard]] JpegDecoder& jpeg() noexcept { return jpeg_; }

 private:
  [[noreturn]] static void refuse_unknown(std::span<const std::byte> data, const std::string& name);
  void decode_other(std::span<const std::byte> data, const Region& region, RowSink& sink, const std::string& name);
  JpegDecoder jpeg_;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pinfeed::loader
