#pragma once
// Synthetic ImageNet-like JPEGs for tests, the demo and benchmarks: sizes
// around 500x375 with spread, textured content (gratings, multi-octave noise
// and grain, so files are as hard to decode as photographs, ~110 KB at
// quality 90, 4:2:0), and classes that differ in hue, grating orientation and
// frequency, so a small model can learn them. Deterministic in (seed, class,
// index). Encoded with TurboJPEG.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "pinfeed/loader/image_decoder.hpp"  // encode_png, encode_webp, encode_image (declared here before)

namespace pinfeed::loader {

enum class JpegKind { baseline, progressive, grayscale, cmyk };

/// What tells the classes apart.
///   photo    hue, grating orientation and frequency: a colour average
///            separates them, so even average pooling + an MLP learns them.
///   texture  fine local structure only (horizontal or vertical stripes,
///            checks, or blobs, at a class's scale), with hue, brightness,
///            contrast and phase drawn per image from one distribution for
///            every class: a colour average or a 4x-pooled image carries
///            (almost) nothing, a convolution sees it. Every class pattern
///            is its own mirror image, so horizontal flips keep the class.
enum class ImageStyle { photo, texture };
/// Texture classes that differ: 4 patterns x 5 scales.
inline constexpr int kTextureClasses = 20;

struct SyntheticImageSpec {
  int width = 500, height = 375;
  int quality = 90;
  JpegKind kind = JpegKind::baseline;
  int subsampling = 420;  ///< 444, 422 or 420 (ignored for grayscale)
  ImageStyle style = ImageStyle::photo;
};

/// The size of image `index` of `klass`: 500x375 on average, spread by
/// about +-30% in each direction, portrait for about one in five.
SyntheticImageSpec synthetic_size(std::uint64_t seed, int klass, std::uint64_t index);

/// Renders and encodes one image. Throws Error if TurboJPEG fails.
std::vector<std::byte> make_synthetic_jpeg(std::uint64_t seed, int klass, std::uint64_t index,
                                           const SyntheticImageSpec& spec);

/// Synthetic image `index` of `klass` in a format: "jpeg" (the spec's
/// quality and kind), or any other codec registry word through its encoder
/// (encode_image: "png", "webp" lossy at the spec's quality).
std::vector<std::byte> make_synthetic_image(std::uint64_t seed, int klass, std::uint64_t index,
                                            const SyntheticImageSpec& spec, const std::string& format);

/// The RGB pixels make_synthetic_jpeg encodes (width * height * 3).
std::vector<std::uint8_t> render_synthetic_rgb(std::uint64_t seed, int klass, std::uint64_t index, int width,
                                               int height, ImageStyle style = ImageStyle::photo);

}  // namespace pinfeed::loader
