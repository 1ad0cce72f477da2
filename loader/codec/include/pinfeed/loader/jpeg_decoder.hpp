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

#include "pinfeed/loader/image.hpp"

namespace pinfeed::loader {

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
  ImageHeader decode_planned(std::span<const std::byte> data, PlanFn&& plan, DecodedImage& out,
                             const std::string& name) {
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
  void decode_kept(std::span<const std::byte> data, const Region& region, int scale, DecodedImage* image, RowSink* sink,
                   const std::string& name);
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
