#pragma once
// Synthetic ImageNet-like JPEGs for tests, the demo and benchmarks: sizes
// around 500x375 with spread, textured content (gratings, multi-octave noise
// and grain, so files are as hard to decode as photographs, ~110 KB at
// quality 90, 4:2:0), and classes that differ in hue, grating orientation and
// frequency, so a small model can learn them. Deterministic in (seed, class,
// index). Encoded with TurboJPEG.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace pinfeed::loader {

enum class JpegKind { baseline, progressive, grayscale, cmyk };

struct SyntheticImageSpec {
  int width = 500, height = 375;
  int quality = 90;
  JpegKind kind = JpegKind::baseline;
  int subsampling = 420;  ///< 444, 422 or 420 (ignored for grayscale)
};

/// The size of image `index` of `klass`: 500x375 on average, spread by
/// about +-30% in each direction, portrait for about one in five.
SyntheticImageSpec synthetic_size(std::uint64_t seed, int klass, std::uint64_t index);

/// Renders and encodes one image. Throws Error if TurboJPEG fails.
std::vector<std::byte> make_synthetic_jpeg(std::uint64_t seed, int klass, std::uint64_t index,
                                           const SyntheticImageSpec& spec);

/// The RGB pixels make_synthetic_jpeg encodes (width * height * 3).
std::vector<std::uint8_t> render_synthetic_rgb(std::uint64_t seed, int klass, std::uint64_t index, int width, int height);

}  // namespace pinfeed::loader
