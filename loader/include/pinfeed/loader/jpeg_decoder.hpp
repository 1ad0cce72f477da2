#pragma once
// JpegDecoder: libjpeg-turbo, one per thread (not thread-safe; cheap to keep).
//
// Decodes only what the output needs: a region (cropped to whole iMCU columns
// with jpeg_crop_scanline, rows above it skipped with jpeg_skip_scanlines,
// and decoding stopped after its last row), optionally DCT-scaled by 1/2, 1/4
// or 1/8 (the scales libjpeg-turbo accelerates; others measured slower than
// none). Output is BGRA (libyuv's "ARGB" byte order), whatever the input:
// grayscale, YCbCr, RGB, CMYK and YCCK (Adobe-inverted CMYK converted), and
// progressive files. Corrupt-data warnings (a truncated file, bad Huffman
// data) are errors: a half-grey image is not a training sample.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "pinfeed/loader/scratch_buffer.hpp"

namespace pinfeed::loader {

/// Largest image accepted, in pixels (Pillow's decompression-bomb limit).
inline constexpr std::uint64_t kDefaultMaxPixels = 178'956'970;

struct ImageHeader {
  int width = 0, height = 0;
  int components = 0;        ///< 1 gray, 3 YCbCr/RGB, 4 CMYK/YCCK
  bool progressive = false;
  std::string color_space;   ///< "gray", "ycbcr", "rgb", "cmyk", "ycck"
  bool scalable = true;      ///< decodes at 1/2, 1/4, 1/8 size (JPEG; PNG and WebP do not)
};

/// A rectangle in full-resolution pixel coordinates.
struct Region {
  int x = 0, y = 0, width = 0, height = 0;
};

/// Decoded pixels, BGRA. Row y starts at pixels.data() + offset + y * stride:
/// the decoder writes libjpeg's whole-iMCU-column rows in place and points
/// `offset` at the region's first pixel, so no row is copied after decoding.
/// stride == 0 means tightly packed rows (width * 4). Buffers are reused.
struct DecodedImage {
  int width = 0, height = 0;
  std::size_t stride = 0, offset = 0;
  ScratchBytes pixels;

  [[nodiscard]] std::size_t stride_bytes() const noexcept {
    return stride != 0 ? stride : static_cast<std::size_t>(width) * 4;
  }
  [[nodiscard]] const std::uint8_t* row(int y) const noexcept {
    return pixels.data() + offset + static_cast<std::size_t>(y) * stride_bytes();
  }
  [[nodiscard]] std::uint8_t* row(int y) noexcept {
    return pixels.data() + offset + static_cast<std::size_t>(y) * stride_bytes();
  }
};

/// Receives a decoded region row by row, top to bottom: begin() once with
/// the region's size, then `height` rows of `width` BGRA pixels. A row stays
/// valid until two more rows have come (the decoder alternates two lines).
/// May throw; the decode is then abandoned.
class RowSink {
 public:
  RowSink() = default;
  RowSink(const RowSink&) = delete;
  RowSink& operator=(const RowSink&) = delete;
  virtual ~RowSink() = default;
  virtual void begin(int width, int height) = 0;
  virtual void row(const std::uint8_t* bgra) = 0;

 protected:
  RowSink(RowSink&&) = default;
  RowSink& operator=(RowSink&&) = default;
};

class JpegDecoder {
 public:
  explicit JpegDecoder(std::uint64_t max_pixels = kDefaultMaxPixels);
  ~JpegDecoder();
  JpegDecoder(const JpegDecoder&) = delete;
  JpegDecoder& operator=(const JpegDecoder&) = delete;

  /// Reads the header only. Throws DataError(name, reason) on anything that
  /// is not a readable JPEG within the pixel limit.
  ImageHeader header(std::span<const std::byte> data, const std::string& name);

  /// Decodes `region` (clamped to the image) at 1/scale (scale 1, 2, 4 or 8)
  /// into `out`: out.width = ceil((x + w) / scale) - floor(x / scale), same
  /// for height. Throws DataError(name, reason); ConfigError on a bad scale.
  void decode(std::span<const std::byte> data, const Region& region, int scale, DecodedImage& out,
              const std::string& name);

  /// What to decode, chosen once the header is known.
  struct Plan {
    Region region;
    int scale = 1;
  };

  /// Reads the header once, asks `plan(header)` what to decode, decodes it.
  /// The header is parsed a single time.
  template <typename PlanFn>
  ImageHeader decode_planned(std::span<const std::byte> data, PlanFn&& plan, DecodedImage& out, const std::string& name) {
    return planned(data, std::forward<PlanFn>(plan), &out, nullptr, name);
  }

  /// The same, streaming: each row goes to `sink` as libjpeg produces it, so
  /// the region never exists whole in memory (the per-sample path).
  template <typename PlanFn>
  ImageHeader decode_planned(std::span<const std::byte> data, PlanFn&& plan, RowSink& sink, const std::string& name) {
    return planned(data, std::forward<PlanFn>(plan), nullptr, &sink, name);
  }

  /// Decodes the whole image at full size (the "full decode" reference).
  void decode_full(std::span<const std::byte> data, DecodedImage& out, const std::string& name);

 private:
  ImageHeader read_header(std::span<const std::byte> data, const std::string& name, bool keep);
  /// Into `image`, or row by row into `sink` (exactly one of them).
  void decode_kept(std::span<const std::byte> data, const Region& region, int scale, DecodedImage* image,
                   RowSink* sink, const std::string& name);
  void abandon() noexcept;
  template <typename PlanFn>
  ImageHeader planned(std::span<const std::byte> data, PlanFn&& plan, DecodedImage* image, RowSink* sink,
                      const std::string& name) {
    const ImageHeader h = read_header(data, name, /*keep=*/true);
    Plan p;
    try {
      p = plan(h);
    } catch (...) {
      abandon();
      throw;
    }
    decode_kept(data, p.region, p.scale, image, sink, name);
    return h;
  }
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pinfeed::loader
