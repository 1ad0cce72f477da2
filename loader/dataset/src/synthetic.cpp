#include "pinfeed/loader/synthetic.hpp"

#include <fmt/format.h>
#include <turbojpeg.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <numbers>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/image_decoder.hpp"
#include "pinfeed/loader/sample_rng.hpp"

namespace pinfeed::loader {

SyntheticImageSpec synthetic_size(std::uint64_t seed, int klass, std::uint64_t index) {
  SampleRng rng(seed ^ 0x73697a65ULL, static_cast<std::uint64_t>(klass), index);
  SyntheticImageSpec s;
  s.width = static_cast<int>(500 * rng.uniform(0.7, 1.3));
  s.height = static_cast<int>(375 * rng.uniform(0.7, 1.3));
  if (rng.uniform() < 0.2) std::swap(s.width, s.height);
  return s;
}

namespace {

// Smooth value noise on a lattice of `cell` pixels, bilinear.
struct ValueNoise {
  int cell, gw, gh;
  std::vector<float> grid;
  ValueNoise(SampleRng& rng, int width, int height, int cell_px)
      : cell(cell_px),
        gw(width / cell_px + 2),
        gh(height / cell_px + 2),
        grid(static_cast<std::size_t>(gw) * static_cast<std::size_t>(gh)) {
    for (float& v : grid) v = static_cast<float>(rng.uniform(-1.0, 1.0));
  }
  [[nodiscard]] float at(int x, int y) const {
    const int gx = x / cell, gy = y / cell;
    const float fx = static_cast<float>(x % cell) / static_cast<float>(cell);
    const float fy = static_cast<float>(y % cell) / static_cast<float>(cell);
    const auto g = [&](int i, int j) {
      return grid[static_cast<std::size_t>(j) * static_cast<std::size_t>(gw) + static_cast<std::size_t>(i)];
    };
    const float top = g(gx, gy) * (1 - fx) + g(gx + 1, gy) * fx;
    const float bottom = g(gx, gy + 1) * (1 - fx) + g(gx + 1, gy + 1) * fx;
    return top * (1 - fy) + bottom * fy;
  }
};

}  // namespace

namespace {

std::vector<std::uint8_t> render_texture_rgb(std::uint64_t seed, int klass, std::uint64_t index, int width,
                                             int height) {
  // Class identity: the pattern (k % 4) and its scale (k / 4). The period
  // is ~24 source pixels at the first scale: 3-6 pixels after a 64 px
  // RandomResizedCrop, gone under 4x4 average pooling.
  const int pattern = klass % 4;
  const double period = 24.0 * std::pow(1.6, (klass / 4) % (kTextureClasses / 4));
  SampleRng rng(seed ^ 0x74657874ULL, static_cast<std::uint64_t>(klass), index);  // "text"
  const double w = 2 * std::numbers::pi / (period * rng.uniform(0.85, 1.15));
  const double px = rng.uniform(0, 2 * std::numbers::pi), py = rng.uniform(0, 2 * std::numbers::pi);
  const double hue = rng.uniform(0, 2 * std::numbers::pi), level = rng.uniform(90, 165), contrast = rng.uniform(25, 60);
  const std::array<double, 3> tint{std::cos(hue), std::cos(hue - 2.094), std::cos(hue + 2.094)};
  ValueNoise light(rng, width, height, 96), blobs(rng, width, height, std::max(2, static_cast<int>(period / 2)));
  std::vector<std::uint8_t> rgb(static_cast<std::size_t>(width) * static_cast<std::size_t>(height) * 3);
  std::size_t o = 0;
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      double t = 0;
      switch (pattern) {
        case 0: t = std::sin(w * y + py); break;                               // horizontal stripes
        case 1: t = std::sin(w * x + px); break;                               // vertical stripes
        case 2: t = 1.4 * std::sin(w * x + px) * std::sin(w * y + py); break;  // checks
        default: t = 1.6 * blobs.at(x, y); break;                              // blobs, no orientation
      }
      const double shade = level + 30 * light.at(x, y);
      const double grain = static_cast<double>(static_cast<int>(rng.below(17)) - 8);
      for (int c = 0; c < 3; ++c) {
        const double v = shade + 35 * tint[static_cast<std::size_t>(c)] + contrast * t + grain;
        rgb[o++] = static_cast<std::uint8_t>(std::clamp(v, 0.0, 255.0));
      }
    }
  }
  return rgb;
}

}  // namespace

std::vector<std::uint8_t> render_synthetic_rgb(std::uint64_t seed, int klass, std::uint64_t index, int width,
                                               int height, ImageStyle style) {
  if (style == ImageStyle::texture) return render_texture_rgb(seed, klass, index, width, height);
  // Class identity: hue, grating angle and frequency. Instance: phase, noise.
  const double hue = 2 * std::numbers::pi * ((klass * 0.61803398875) - std::floor(klass * 0.61803398875));
  const double angle = std::numbers::pi * ((klass * 0.38196601125) - std::floor(klass * 0.38196601125));
  const double freq = 0.04 + 0.05 * ((klass * 7) % 10) / 10.0;
  SampleRng rng(seed, static_cast<std::uint64_t>(klass), index);
  const double phase = rng.uniform(0, 2 * std::numbers::pi);
  const double fx = freq * std::cos(angle), fy = freq * std::sin(angle);
  const std::array<double, 3> base{127 + 80 * std::cos(hue), 127 + 80 * std::cos(hue - 2.094),
                                   127 + 80 * std::cos(hue + 2.094)};
  ValueNoise coarse(rng, width, height, 48), medium(rng, width, height, 12), fine(rng, width, height, 2);
  std::vector<std::uint8_t> rgb(static_cast<std::size_t>(width) * static_cast<std::size_t>(height) * 3);
  std::size_t o = 0;
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      const double grating = std::sin(fx * x + fy * y + phase);
      const double n = 45 * coarse.at(x, y) + 30 * medium.at(x, y) + 42 * fine.at(x, y);
      // Film-like grain, mostly in luma (what 4:2:0 keeps), a little in chroma.
      const double luma_grain = static_cast<double>(static_cast<int>(rng.below(77)) - 38);
      for (int c = 0; c < 3; ++c) {
        const double grain = luma_grain + static_cast<double>(static_cast<int>(rng.below(13)) - 6);
        const double v = base[static_cast<std::size_t>(c)] * (0.75 + 0.25 * grating) + n * (0.6 + 0.2 * c) + grain;
        rgb[o++] = static_cast<std::uint8_t>(std::clamp(v, 0.0, 255.0));
      }
    }
  }
  return rgb;
}

std::vector<std::byte> make_synthetic_jpeg(std::uint64_t seed, int klass, std::uint64_t index,
                                           const SyntheticImageSpec& spec) {
  std::vector<std::uint8_t> rgb = render_synthetic_rgb(seed, klass, index, spec.width, spec.height, spec.style);
  int pixel_format = TJPF_RGB;
  int samp = spec.subsampling == 444 ? TJSAMP_444 : spec.subsampling == 422 ? TJSAMP_422 : TJSAMP_420;
  int flags = TJFLAG_ACCURATEDCT;
  std::vector<std::uint8_t> pixels;
  switch (spec.kind) {
    case JpegKind::baseline: break;
    case JpegKind::progressive: flags |= TJFLAG_PROGRESSIVE; break;
    case JpegKind::grayscale:
      pixel_format = TJPF_RGB;
      samp = TJSAMP_GRAY;
      break;
    case JpegKind::cmyk: {
      // TurboJPEG takes CMYK in Adobe's inverted form and writes YCCK with
      // an Adobe marker. Inverted: K' = max(r, g, b), C' = 255 r / K', so
      // that r = C' K' / 255 on the way back.
      pixels.resize(rgb.size() / 3 * 4);
      for (std::size_t i = 0, j = 0; i < rgb.size(); i += 3, j += 4) {
        const unsigned k = std::max({rgb[i], rgb[i + 1], rgb[i + 2]});
        const auto inv = [&](std::uint8_t v) { return static_cast<std::uint8_t>(k == 0 ? 0 : 255U * v / k); };
        pixels[j] = inv(rgb[i]);
        pixels[j + 1] = inv(rgb[i + 1]);
        pixels[j + 2] = inv(rgb[i + 2]);
        pixels[j + 3] = static_cast<std::uint8_t>(k);
      }
      pixel_format = TJPF_CMYK;
      break;
    }
  }
  const std::uint8_t* src = pixels.empty() ? rgb.data() : pixels.data();
  const int pitch = spec.width * tjPixelSize[pixel_format];
  tjhandle h = tjInitCompress();
  if (h == nullptr) throw Error("TurboJPEG: tjInitCompress failed");
  unsigned char* jpeg = nullptr;
  unsigned long size = 0;
  const int rc =
      tjCompress2(h, src, spec.width, pitch, spec.height, pixel_format, &jpeg, &size, samp, spec.quality, flags);
  if (rc != 0) {
    const std::string why = tjGetErrorStr2(h);
    tjFree(jpeg);
    tjDestroy(h);
    throw Error(fmt::format("TurboJPEG: encoding {}x{} failed: {}", spec.width, spec.height, why));
  }
  std::vector<std::byte> out(reinterpret_cast<std::byte*>(jpeg), reinterpret_cast<std::byte*>(jpeg) + size);
  tjFree(jpeg);
  tjDestroy(h);
  return out;
}

std::vector<std::byte> make_synthetic_image(std::uint64_t seed, int klass, std::uint64_t index,
                                            const SyntheticImageSpec& spec, const std::string& format) {
  // JPEG keeps its kinds and subsampling; every other row of the codec
  // registry encodes through its own encoder (encode_image).
  const ImageFormat f = parse_image_format(format, "image format");
  if (f == ImageFormat::jpeg) return make_synthetic_jpeg(seed, klass, index, spec);
  const std::vector<std::uint8_t> rgb = render_synthetic_rgb(seed, klass, index, spec.width, spec.height, spec.style);
  return encode_image(f, rgb.data(), spec.width, spec.height, spec.quality);
}

}  // namespace pinfeed::loader
