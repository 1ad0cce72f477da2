#include "pinfeed/loader/image_decoder.hpp"

#include <fmt/format.h>
#include <libyuv/convert_argb.h>
#include <spng.h>
#include <webp/decode.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/transform.hpp"

namespace pinfeed::loader {

ImageFormat sniff_format(std::span<const std::byte> d) noexcept {
  const auto at = [&](std::size_t i) { return std::to_integer<unsigned>(d[i]); };
  if (d.size() >= 2 && at(0) == 0xff && at(1) == 0xd8) return ImageFormat::jpeg;
  if (d.size() >= 8 && std::memcmp(d.data(), "\x89PNG\r\n\x1a\n", 8) == 0) return ImageFormat::png;
  if (d.size() >= 12 && std::memcmp(d.data(), "RIFF", 4) == 0 && std::memcmp(d.data() + 8, "WEBP", 4) == 0) {
    return ImageFormat::webp;
  }
  return ImageFormat::unknown;
}

std::string_view to_string(ImageFormat f) noexcept { return enum_word(kImageFormatWords, f); }

std::string_view extension(ImageFormat f) noexcept {
  switch (f) {
    case ImageFormat::jpeg: return "jpg";
    case ImageFormat::png: return "png";
    case ImageFormat::webp: return "webp";
    case ImageFormat::unknown: return "bin";
  }
  return "bin";
}

namespace {

/// The largest PNG chunk we accept (an ancillary chunk claiming gigabytes
/// must not be buffered) and the cap on all cached ancillary chunks.
constexpr std::size_t kPngChunkLimit = 64U << 20U;
constexpr std::size_t kPngCacheLimit = 64U << 20U;

/// RAII for a libspng context reading `data`.
class Png {
 public:
  Png(std::span<const std::byte> data, const std::string& name) : name_(name), ctx_(spng_ctx_new(0), &spng_ctx_free) {
    if (!ctx_) throw Error("libspng: cannot create a decoder context");
    check(spng_set_chunk_limits(ctx_.get(), kPngChunkLimit, kPngCacheLimit), "chunk limits");
    check(spng_set_png_buffer(ctx_.get(), data.data(), data.size()), "reading");
    check(spng_get_ihdr(ctx_.get(), &ihdr_), "reading the header");
  }

  void check(int rc, std::string_view what) const {
    if (rc != 0 && rc != SPNG_EOI) throw DataError(name_, fmt::format("corrupt PNG ({}): {}", what, spng_strerror(rc)));
  }
  [[nodiscard]] spng_ctx* get() const noexcept { return ctx_.get(); }
  [[nodiscard]] const spng_ihdr& ihdr() const noexcept { return ihdr_; }

 private:
  const std::string& name_;
  std::unique_ptr<spng_ctx, decltype(&spng_ctx_free)> ctx_;  // freed on every path, a throwing constructor's too
  spng_ihdr ihdr_{};
};

const char* webp_status(VP8StatusCode s) {
  switch (s) {
    case VP8_STATUS_OK: return "ok";
    case VP8_STATUS_OUT_OF_MEMORY: return "out of memory";
    case VP8_STATUS_INVALID_PARAM: return "invalid parameter";
    case VP8_STATUS_BITSTREAM_ERROR: return "bitstream error";
    case VP8_STATUS_UNSUPPORTED_FEATURE: return "unsupported feature";
    case VP8_STATUS_SUSPENDED: return "suspended";
    case VP8_STATUS_USER_ABORT: return "aborted";
    case VP8_STATUS_NOT_ENOUGH_DATA: return "data ends early (truncated file)";
  }
  return "unknown error";
}

void check_pixels(std::uint64_t w, std::uint64_t h, std::uint64_t max_pixels, const std::string& name) {
  if (w == 0 || h == 0) throw DataError(name, "header gives an empty image");
  if (w * h > max_pixels) {
    throw DataError(name, fmt::format("image {}x{} ({} pixels) exceeds the limit of {} pixels", w, h, w * h, max_pixels));
  }
}

/// A sink that keeps nothing (verify()).
class NullSink final : public RowSink {
 public:
  void begin(int, int) override {}
  void row(const std::uint8_t*) override {}
};

}  // namespace

struct ImageDecoder::Impl {
  std::uint64_t max_pixels = 0;
  std::vector<std::uint8_t> rgba_row, bgra_row;  // PNG rows
  DecodedImage whole;                            // interlaced PNG, WebP

  ImageHeader png_header(std::span<const std::byte> data, const std::string& name) const {
    const Png png(data, name);
    const spng_ihdr& ih = png.ihdr();
    check_pixels(ih.width, ih.height, max_pixels, name);
    ImageHeader h;
    h.width = static_cast<int>(ih.width);
    h.height = static_cast<int>(ih.height);
    const bool alpha = ih.color_type == SPNG_COLOR_TYPE_GRAYSCALE_ALPHA || ih.color_type == SPNG_COLOR_TYPE_TRUECOLOR_ALPHA;
    const bool gray = ih.color_type == SPNG_COLOR_TYPE_GRAYSCALE || ih.color_type == SPNG_COLOR_TYPE_GRAYSCALE_ALPHA;
    h.components = (gray ? 1 : 3) + (alpha ? 1 : 0);
    h.color_space = gray ? "gray" : (alpha ? "rgba" : "rgb");
    h.progressive = ih.interlace_method != 0;
    h.scalable = false;
    return h;
  }

  ImageHeader webp_header(std::span<const std::byte> data, const std::string& name) const {
    WebPBitstreamFeatures f{};
    const auto* p = reinterpret_cast<const std::uint8_t*>(data.data());
    const VP8StatusCode s = WebPGetFeatures(p, data.size(), &f);
    if (s != VP8_STATUS_OK) throw DataError(name, fmt::format("corrupt WebP header: {}", webp_status(s)));
    if (f.has_animation != 0) throw DataError(name, "animated WebP is not supported (one frame per sample)");
    check_pixels(static_cast<std::uint64_t>(f.width), static_cast<std::uint64_t>(f.height), max_pixels, name);
    ImageHeader h;
    h.width = f.width;
    h.height = f.height;
    h.components = f.has_alpha != 0 ? 4 : 3;
    h.color_space = f.has_alpha != 0 ? "rgba" : "rgb";
    h.scalable = false;
    return h;
  }

  /// Whole image, tightly packed BGRA, into `out`. Alpha is dropped later
  /// (as torchvision's loader does with convert("RGB")).
  void decode_whole(std::span<const std::byte> data, ImageFormat fmt_, DecodedImage& out, const std::string& name) {
    const ImageHeader h = fmt_ == ImageFormat::png ? png_header(data, name) : webp_header(data, name);
    const std::size_t stride = static_cast<std::size_t>(h.width) * 4;
    out.width = h.width;
    out.height = h.height;
    out.stride = stride;
    out.offset = 0;
    out.pixels.resize(stride * static_cast<std::size_t>(h.height));
    if (fmt_ == ImageFormat::webp) {
      const auto* p = reinterpret_cast<const std::uint8_t*>(data.data());
      if (WebPDecodeBGRAInto(p, data.size(), out.pixels.data(), out.pixels.size(), static_cast<int>(stride)) == nullptr) {
        WebPBitstreamFeatures f{};
        const VP8StatusCode s = WebPGetFeatures(p, data.size(), &f);
        throw DataError(name, fmt::format("corrupt WebP: {}", s == VP8_STATUS_OK ? "the image data does not decode"
                                                                                   : webp_status(s)));
      }
      return;
    }
    const Png png(data, name);
    png.check(spng_decode_image(png.get(), out.pixels.data(), out.pixels.size(), SPNG_FMT_RGBA8, SPNG_DECODE_TRNS),
              "image data");
    libyuv::ABGRToARGB(out.pixels.data(), static_cast<int>(stride), out.pixels.data(), static_cast<int>(stride), h.width,
                       h.height);  // RGBA bytes -> BGRA bytes, in place
  }

  /// A WebP region, decoded by libwebp's cropping into scratch of the
  /// region's size (not the image's), then passed on row by row. The crop
  /// starts on even coordinates (lossy WebP's chroma grid) and the extra
  /// column or row is skipped here, so the pixels are exact.
  void webp_region(std::span<const std::byte> data, const Region& r, RowSink& sink, const std::string& name) {
    const int x0 = r.x & ~1, y0 = r.y & ~1;
    const int cw = r.width + (r.x - x0), ch = r.height + (r.y - y0);
    const std::size_t stride = static_cast<std::size_t>(cw) * 4;
    whole.pixels.resize(stride * static_cast<std::size_t>(ch));
    WebPDecoderConfig config;
    if (WebPInitDecoderConfig(&config) == 0) throw Error("libwebp: version mismatch");
    config.options.use_cropping = 1;
    config.options.crop_left = x0;
    config.options.crop_top = y0;
    config.options.crop_width = cw;
    config.options.crop_height = ch;
    config.output.colorspace = MODE_BGRA;
    config.output.is_external_memory = 1;
    config.output.u.RGBA.rgba = whole.pixels.data();
    config.output.u.RGBA.stride = static_cast<int>(stride);
    config.output.u.RGBA.size = whole.pixels.size();
    const VP8StatusCode status =
        WebPDecode(reinterpret_cast<const std::uint8_t*>(data.data()), data.size(), &config);
    WebPFreeDecBuffer(&config.output);  // external memory: frees nothing of ours
    if (status != VP8_STATUS_OK) throw DataError(name, fmt::format("corrupt WebP: {}", webp_status(status)));
    sink.begin(r.width, r.height);
    for (int y = 0; y < r.height; ++y) {
      sink.row(whole.pixels.data() + static_cast<std::size_t>(y + r.y - y0) * stride +
               static_cast<std::size_t>(r.x - x0) * 4);
    }
  }

  /// Scratch over this size is given back after each image: one large
  /// image must not stay resident per thread for the loader's lifetime.
  void trim() noexcept {
    constexpr std::size_t kKeep = 64U << 20U;
    if (whole.pixels.capacity() > kKeep) ScratchBytes().swap(whole.pixels);
  }

  /// A non-interlaced PNG, row by row: only rows [y0, y1) and columns
  /// [x0, x1) reach the sink; the rest is decoded (PNG has no random access)
  /// and dropped, and decoding stops after the region's last row.
  void png_rows(std::span<const std::byte> data, const Region& r, RowSink& sink, const std::string& name) {
    const Png png(data, name);
    const std::size_t width = png.ihdr().width;
    png.check(spng_decode_image(png.get(), nullptr, 0, SPNG_FMT_RGBA8, SPNG_DECODE_TRNS | SPNG_DECODE_PROGRESSIVE),
              "image data");
    rgba_row.resize(width * 4);
    bgra_row.resize(static_cast<std::size_t>(r.width) * 4);
    sink.begin(r.width, r.height);
    for (int y = 0; y < r.y + r.height; ++y) {
      const int rc = spng_decode_row(png.get(), rgba_row.data(), rgba_row.size());
      if (rc != 0 && !(rc == SPNG_EOI && y == r.y + r.height - 1)) {
        throw DataError(name, fmt::format("corrupt PNG (row {}): {}", y, spng_strerror(rc)));
      }
      if (y < r.y) continue;
      libyuv::ABGRToARGB(rgba_row.data() + static_cast<std::size_t>(r.x) * 4, 0, bgra_row.data(), 0, r.width, 1);
      sink.row(bgra_row.data());
    }
  }
};

ImageDecoder::ImageDecoder(std::uint64_t max_pixels) : jpeg_(max_pixels), impl_(std::make_unique<Impl>()) {
  impl_->max_pixels = max_pixels;
}

ImageDecoder::~ImageDecoder() = default;

void ImageDecoder::refuse_unknown(std::span<const std::byte> data, const std::string& name) {
  if (data.empty()) throw DataError(name, "empty file (0 bytes)");
  throw DataError(name, "not a JPEG, PNG or WebP image (its first bytes match none of them)");
}

ImageHeader ImageDecoder::header(std::span<const std::byte> data, const std::string& name) {
  switch (sniff_format(data)) {
    case ImageFormat::png: return impl_->png_header(data, name);
    case ImageFormat::webp: return impl_->webp_header(data, name);
    case ImageFormat::jpeg: return jpeg_.header(data, name);
    case ImageFormat::unknown: break;
  }
  refuse_unknown(data, name);
}

void ImageDecoder::decode_other(std::span<const std::byte> data, const Region& region, RowSink& sink,
                                const std::string& name) {
  const ImageFormat f = sniff_format(data);
  const ImageHeader h = header(data, name);
  const Region r = clamp_region(region, h.width, h.height);
  if (f == ImageFormat::png && !h.progressive) {
    impl_->png_rows(data, r, sink, name);
    return;
  }
  struct Trim {
    Impl& impl;
    ~Trim() { impl.trim(); }
  } trim{*impl_};
  if (f == ImageFormat::webp) {
    impl_->webp_region(data, r, sink, name);
    return;
  }
  impl_->decode_whole(data, f, impl_->whole, name);  // interlaced PNG: the passes need the whole image
  sink.begin(r.width, r.height);
  for (int y = r.y; y < r.y + r.height; ++y) sink.row(impl_->whole.row(y) + static_cast<std::size_t>(r.x) * 4);
}

void ImageDecoder::decode_full(std::span<const std::byte> data, DecodedImage& out, const std::string& name) {
  const ImageFormat f = sniff_format(data);
  if (f == ImageFormat::png || f == ImageFormat::webp) {
    impl_->decode_whole(data, f, out, name);
    return;
  }
  if (f == ImageFormat::unknown) refuse_unknown(data, name);
  jpeg_.decode_full(data, out, name);
}

ImageHeader ImageDecoder::verify(std::span<const std::byte> data, const std::string& name) {
  NullSink sink;
  const auto whole = [](const ImageHeader& h) { return JpegDecoder::Plan{Region{0, 0, h.width, h.height}, 1}; };
  const ImageFormat f = sniff_format(data);
  if (f == ImageFormat::webp) {
    const ImageHeader h = impl_->webp_header(data, name);
    WebPDecoderConfig config;
    if (WebPInitDecoderConfig(&config) == 0) throw Error("libwebp: version mismatch");
    config.options.use_scaling = 1;
    config.options.scaled_width = std::max(1, h.width / 8);
    config.options.scaled_height = std::max(1, h.height / 8);
    config.output.colorspace = MODE_BGRA;
    const VP8StatusCode s = WebPDecode(reinterpret_cast<const std::uint8_t*>(data.data()), data.size(), &config);
    WebPFreeDecBuffer(&config.output);
    if (s != VP8_STATUS_OK) throw DataError(name, fmt::format("corrupt WebP: {}", webp_status(s)));
    return h;
  }
  return decode_planned(data, whole, sink, name);
}

}  // namespace pinfeed::loader
