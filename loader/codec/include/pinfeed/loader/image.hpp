#pragma once
// What every codec produces and every consumer of decoded pixels reads: the
// header, a region in full-resolution pixels, a decoded BGRA image and the
// row sink a streaming decode writes into. The codecs (jpeg_decoder.hpp,
// image_decoder.hpp) fill them; transform.hpp and the loader read them.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "pinfeed/loader/scratch_buffer.hpp"

namespace pinfeed::loader {

/// Largest image accepted, in pixels (Pillow's decompression-bomb limit).
inline constexpr std::uint64_t kDefaultMaxPixels = 178'956'970;

struct ImageHeader {
  int width = 0, height = 0;
  int components = 0;  ///< 1 gray, 3 YCbCr/RGB, 4 CMYK/YCCK
  bool progressive = false;
  std::string color_space;  ///< "gray", "ycbcr", "rgb", "cmyk", "ycck"
  bool scalable = true;     ///< decodes at 1/2, 1/4, 1/8 size (JPEG; PNG and WebP do not)
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

/// `region` clamped to a width x height image; an empty region is the whole image.
inline Region clamp_region(const Region& region, int width, int height) noexcept {
  if (region.width <= 0 || region.height <= 0) return Region{0, 0, width, height};
  Region c;
  c.x = std::clamp(region.x, 0, width - 1);
  c.y = std::clamp(region.y, 0, height - 1);
  c.width = std::min(region.width, width - c.x);
  c.height = std::min(region.height, height - c.y);
  return c;
}

}  // namespace pinfeed::loader
