#include "pinfeed/loader/image_decoder.hpp"

#include <fmt/format.h>
#include <libyuv/convert_argb.h>
#include <spng.h>
#include <turbojpeg.h>
#include <webp/decode.h>
#include <webp/encode.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "pinfeed/enum_words.hpp"
#include "pinfeed/error.hpp"

namespace pinfeed::loader {

const ImageCodec* find_codec(ImageFormat f) noexcept {
  for (const ImageCodec& c : kImageCodecs) {
    if (c.format == f) return &c;
  }
  return nullptr;
}

ImageFormat format_for_extension(std::string_view ext) noexcept {
  for (const ImageCodec& c : kImageCodecs) {
    for (std::string_view e : c.extensions) {
      if (!e.empty() && e == ext) return c.format;
    }
  }
  return ImageFormat::unknown;
}

std::vector<std::string> codec_word_list() {
  std::vector<std::string> out;
  for (const ImageCodec& c : kImageCodecs) out.emplace_back(c.word);
  return out;
}

std::string codec_words(std::string_view conjunction) { return join_list(codec_word_list(), conjunction); }

std::string codec_names(std::string_view conjunction) {
  std::vector<std::string> names;
  for (const ImageCodec& c : kImageCodecs) names.emplace_back(c.display);
  return join_list(names, conjunction);
}

std::string codec_extensions() {
  std::string out;
  for (const ImageCodec& c : kImageCodecs) {
    for (std::string_view e : c.extensions) {
      if (!e.empty()) out += fmt::format("{}.{}", out.empty() ? "" : ", ", e);
    }
  }
  return out;
}

ImageFormat parse_image_format(std::string_view word, std::string_view what) {
  for (const ImageCodec& c : kImageCodecs) {
    if (c.word == word) return c.format;
  }
  throw ConfigError(fmt::format("{} '{}' is not one of {}", what, word, codec_words()));
}

std::string_view to_string(ImageFormat f) noexcept {
  const ImageCodec* c = find_codec(f);
  return c != nullptr ? c->word : "unknown";
}

std::string_view extension(ImageFormat f) noexcept {
  const ImageCodec* c = find_codec(f);
  return c != nullptr ? c->extensions[0] : "bin";
}

// The encoders: synthetic data and tests.

std::vector<std::byte> encode_png(const std::uint8_t* rgb, int width, int height, bool interlaced) {
  spng_ctx* ctx = spng_ctx_new(SPNG_CTX_ENCODER);
  if (ctx == nullptr) throw Error("libspng: cannot create an encoder");
  spng_set_option(ctx, SPNG_ENCODE_TO_BUFFER, 1);
  spng_ihdr ihdr{};
  ihdr.width = static_cast<std::uint32_t>(width);
  ihdr.height = static_cast<std::uint32_t>(height);
  ihdr.bit_depth = 8;
  ihdr.color_type = SPNG_COLOR_TYPE_TRUECOLOR;
  ihdr.interlace_method = interlaced ? SPNG_INTERLACE_ADAM7 : SPNG_INTERLACE_NONE;
  int rc = spng_set_ihdr(ctx, &ihdr);
  const std::size_t len = static_cast<std::size_t>(width) * static_cast<std::size_t>(height) * 3;
  if (rc == 0) rc = spng_encode_image(ctx, rgb, len, SPNG_FMT_PNG, SPNG_ENCODE_FINALIZE);
  std::size_t size = 0;
  void* buf = rc == 0 ? spng_get_png_buffer(ctx, &size, &rc) : nullptr;
  spng_ctx_free(ctx);
  if (buf == nullptr || rc != 0) {
    std::free(buf);
    throw Error(fmt::format("libspng: encoding a {}x{} PNG failed: {}", width, height, spng_strerror(rc)));
  }
  std::vector<std::byte> out(static_cast<const std::byte*>(buf), static_cast<const std::byte*>(buf) + size);
  std::free(buf);
  return out;
}

std::vector<std::byte> encode_webp(const std::uint8_t* rgb, int width, int height, bool lossless, int quality) {
  std::uint8_t* buf = nullptr;
  const std::size_t size = lossless ? WebPEncodeLosslessRGB(rgb, width, height, width * 3, &buf)
                                    : WebPEncodeRGB(rgb, width, height, width * 3, static_cast<float>(quality), &buf);
  if (size == 0 || buf == nullptr) {
    WebPFree(buf);
    throw Error(fmt::format("libwebp: encoding a {}x{} WebP failed", width, height));
  }
  std::vector<std::byte> out(reinterpret_cast<const std::byte*>(buf), reinterpret_cast<const std::byte*>(buf) + size);
  WebPFree(buf);
  return out;
}

namespace {

std::vector<std::byte> encode_jpeg(const std::uint8_t* rgb, int width, int height, int quality) {
  tjhandle h = tjInitCompress();
  if (h == nullptr) throw Error("TurboJPEG: tjInitCompress failed");
  unsigned char* jpeg = nullptr;
  unsigned long size = 0;
  const int rc =
      tjCompress2(h, rgb, width, width * 3, height, TJPF_RGB, &jpeg, &size, TJSAMP_420, quality, TJFLAG_ACCURATEDCT);
  if (rc != 0) {
    const std::string why = tjGetErrorStr2(h);
    tjFree(jpeg);
    tjDestroy(h);
    throw Error(fmt::format("TurboJPEG: encoding a {}x{} JPEG failed: {}", width, height, why));
  }
  std::vector<std::byte> out(reinterpret_cast<const std::byte*>(jpeg), reinterpret_cast<const std::byte*>(jpeg) + size);
  tjFree(jpeg);
  tjDestroy(h);
  return out;
}

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
    throw DataError(name,
                    fmt::format("image {}x{} ({} pixels) exceeds the limit of {} pixels", w, h, w * h, max_pixels));
  }
}

/// A sink that keeps nothing (verify()).
class NullSink final : public RowSink {
 public:
  void begin(int, int) override {}
  void row(const std::uint8_t*) override {}
};

using Bytes = std::span<const std::byte>;

bool is_jpeg(Bytes d) noexcept { return d.size() >= 2 && d[0] == std::byte{0xff} && d[1] == std::byte{0xd8}; }
bool is_png(Bytes d) noexcept { return d.size() >= 8 && std::memcmp(d.data(), "\x89PNG\r\n\x1a\n", 8) == 0; }
bool is_webp(Bytes d) noexcept {
  return d.size() >= 12 && std::memcmp(d.data(), "RIFF", 4) == 0 && std::memcmp(d.data() + 8, "WEBP", 4) == 0;
}

/// Sizes `out` for the whole image of header `h`, tightly packed BGRA.
void size_whole(const ImageHeader& h, DecodedImage& out) {
  out.width = h.width;
  out.height = h.height;
  out.stride = static_cast<std::size_t>(h.width) * 4;
  out.offset = 0;
  out.pixels.resize(out.stride * static_cast<std::size_t>(h.height));
}

/// verify()'s plan: the whole image at full scale.
constexpr auto whole_plan = [](const ImageHeader& h) { return JpegDecoder::Plan{Region{0, 0, h.width, h.height}, 1}; };

using PlanRef = ImageDecoder::PlanRef;

/// The decoders' state (scratch, the pixel limit) and one function per
/// format and entry point; ImageDecoder::Impl is this.
struct Codecs {
  Codecs(JpegDecoder& j, std::uint64_t limit) : jpeg(j), max_pixels(limit) {}
  JpegDecoder& jpeg;
  std::uint64_t max_pixels = 0;
  std::vector<std::uint8_t> rgba_row, bgra_row;  // PNG rows
  DecodedImage whole;                            // interlaced PNG

  // JPEG: JpegDecoder's region path.
  ImageHeader jpeg_header(Bytes data, const std::string& name) { return jpeg.header(data, name); }
  ImageHeader jpeg_planned(Bytes data, PlanRef plan, RowSink& sink, const std::string& name) {
    return jpeg.decode_planned(data, plan, sink, name);
  }
  void jpeg_whole(Bytes data, DecodedImage& out, const std::string& name) { jpeg.decode_full(data, out, name); }
  ImageHeader jpeg_verify(Bytes data, const std::string& name) {
    NullSink sink;
    return jpeg.decode_planned(data, whole_plan, sink, name);
  }

  // PNG (libspng): row by row, or whole when interlaced.
  ImageHeader png_header(Bytes data, const std::string& name) {
    const Png png(data, name);
    const spng_ihdr& ih = png.ihdr();
    check_pixels(ih.width, ih.height, max_pixels, name);
    ImageHeader h;
    h.width = static_cast<int>(ih.width);
    h.height = static_cast<int>(ih.height);
    const bool alpha =
        ih.color_type == SPNG_COLOR_TYPE_GRAYSCALE_ALPHA || ih.color_type == SPNG_COLOR_TYPE_TRUECOLOR_ALPHA;
    const bool gray = ih.color_type == SPNG_COLOR_TYPE_GRAYSCALE || ih.color_type == SPNG_COLOR_TYPE_GRAYSCALE_ALPHA;
    h.components = (gray ? 1 : 3) + (alpha ? 1 : 0);
    h.color_space = gray ? "gray" : (alpha ? "rgba" : "rgb");
    h.progressive = ih.interlace_method != 0;
    h.scalable = false;
    return h;
  }

  /// Whole image, tightly packed BGRA, into `out`. Alpha is dropped later
  /// (as torchvision's loader does with convert("RGB")).
  void png_whole(Bytes data, DecodedImage& out, const std::string& name) {
    size_whole(png_header(data, name), out);
    const Png png(data, name);
    png.check(spng_decode_image(png.get(), out.pixels.data(), out.pixels.size(), SPNG_FMT_RGBA8, SPNG_DECODE_TRNS),
              "image data");
    const int stride = static_cast<int>(out.stride);
    libyuv::ABGRToARGB(out.pixels.data(), stride, out.pixels.data(), stride, out.width,
                       out.height);  // RGBA bytes -> BGRA bytes, in place
  }

  /// A non-interlaced PNG, row by row: only rows [y0, y1) and columns
  /// [x0, x1) reach the sink; the rest is decoded (PNG has no random access)
  /// and dropped, and decoding stops after the region's last row. An
  /// interlaced one is decoded whole (the passes need it) into scratch.
  ImageHeader png_planned(Bytes data, PlanRef plan, RowSink& sink, const std::string& name) {
    const ImageHeader h = png_header(data, name);
    const Region r = clamp_region(plan(h).region, h.width, h.height);
    if (h.progressive) {
      struct Trim {
        Codecs& impl;
        ~Trim() { impl.trim(); }
      } trim{*this};
      png_whole(data, whole, name);
      sink.begin(r.width, r.height);
      for (int y = r.y; y < r.y + r.height; ++y) sink.row(whole.row(y) + static_cast<std::size_t>(r.x) * 4);
      return h;
    }
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
    return h;
  }

  ImageHeader png_verify(Bytes data, const std::string& name) {
    NullSink sink;
    return png_planned(data, PlanRef(whole_plan), sink, name);
  }

  // WebP (libwebp): the region through libwebp's cropping.
  ImageHeader webp_header(Bytes data, const std::string& name) {
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

  void webp_whole(Bytes data, DecodedImage& out, const std::string& name) {
    size_whole(webp_header(data, name), out);
    const auto* p = reinterpret_cast<const std::uint8_t*>(data.data());
    if (WebPDecodeBGRAInto(p, data.size(), out.pixels.data(), out.pixels.size(), static_cast<int>(out.stride)) ==
        nullptr) {
      WebPBitstreamFeatures f{};
      const VP8StatusCode s = WebPGetFeatures(p, data.size(), &f);
      throw DataError(name, fmt::format("corrupt WebP: {}",
                                        s == VP8_STATUS_OK ? "the image data does not decode" : webp_status(s)));
    }
  }

  /// A WebP region, decoded by libwebp's cropping into scratch of the
  /// region's size (not the image's), then passed on row by row. The crop
  /// starts on even coordinates (lossy WebP's chroma grid) and the extra
  /// column or row is skipped here, so the pixels are exact.
  ImageHeader webp_planned(Bytes data, PlanRef plan, RowSink& sink, const std::string& name) {
    const ImageHeader h = webp_header(data, name);
    const Region r = clamp_region(plan(h).region, h.width, h.height);
    struct Trim {
      Codecs& impl;
      ~Trim() { impl.trim(); }
    } trim{*this};
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
    const VP8StatusCode status = WebPDecode(reinterpret_cast<const std::uint8_t*>(data.data()), data.size(), &config);
    WebPFreeDecBuffer(&config.output);  // external memory: frees nothing of ours
    if (status != VP8_STATUS_OK) throw DataError(name, fmt::format("corrupt WebP: {}", webp_status(status)));
    sink.begin(r.width, r.height);
    for (int y = 0; y < r.height; ++y) {
      sink.row(whole.pixels.data() + static_cast<std::size_t>(y + r.y - y0) * stride +
               static_cast<std::size_t>(r.x - x0) * 4);
    }
    return h;
  }

  /// Everything decoded at 1/8 size (libwebp's scaling): checked, not kept.
  ImageHeader webp_verify(Bytes data, const std::string& name) {
    const ImageHeader h = webp_header(data, name);
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

  /// Scratch over this size is given back after each image: one large
  /// image must not stay resident per thread for the loader's lifetime.
  void trim() noexcept {
    constexpr std::size_t kKeep = 64U << 20U;
    if (whole.pixels.capacity() > kKeep) ScratchBytes().swap(whole.pixels);
  }
};

/// The codec registry's decode side: one row per kImageCodecs row, in its
/// order, saying what the format does for each of ImageDecoder's entry points.
struct CodecOps {
  ImageFormat format;
  bool (*sniff)(Bytes) noexcept;
  ImageHeader (Codecs::*header)(Bytes, const std::string&);
  ImageHeader (Codecs::*planned)(Bytes, PlanRef, RowSink&, const std::string&);
  void (Codecs::*whole)(Bytes, DecodedImage&, const std::string&);
  ImageHeader (Codecs::*verify)(Bytes, const std::string&);
  std::vector<std::byte> (*encode)(const std::uint8_t* rgb, int width, int height, int quality);
};
std::vector<std::byte> encode_png_rgb(const std::uint8_t* rgb, int w, int h, int /*quality*/) {
  return encode_png(rgb, w, h);
}
std::vector<std::byte> encode_webp_lossy(const std::uint8_t* rgb, int w, int h, int quality) {
  return encode_webp(rgb, w, h, false, quality);
}
constexpr std::array<CodecOps, kImageCodecs.size()> kCodecOps{{
    {ImageFormat::jpeg, is_jpeg, &Codecs::jpeg_header, &Codecs::jpeg_planned, &Codecs::jpeg_whole, &Codecs::jpeg_verify,
     encode_jpeg},
    {ImageFormat::png, is_png, &Codecs::png_header, &Codecs::png_planned, &Codecs::png_whole, &Codecs::png_verify,
     encode_png_rgb},
    {ImageFormat::webp, is_webp, &Codecs::webp_header, &Codecs::webp_planned, &Codecs::webp_whole, &Codecs::webp_verify,
     encode_webp_lossy},
}};
constexpr bool in_registry_order() {
  for (std::size_t i = 0; i < kImageCodecs.size(); ++i) {
    if (kCodecOps[i].format != kImageCodecs[i].format) return false;
  }
  return true;
}
static_assert(in_registry_order(), "kCodecOps has one row per kImageCodecs row, in its order");
constexpr bool every_row_complete() {
  for (const CodecOps& o : kCodecOps) {
    if (o.sniff == nullptr || o.header == nullptr || o.planned == nullptr || o.whole == nullptr ||
        o.verify == nullptr || o.encode == nullptr) {
      return false;
    }
  }
  return true;
}
static_assert(every_row_complete(), "every kCodecOps row sniffs, reads, decodes, verifies and encodes");

const CodecOps* ops_for(Bytes data) noexcept {
  for (const CodecOps& o : kCodecOps) {
    if (o.sniff(data)) return &o;
  }
  return nullptr;
}

}  // namespace

struct ImageDecoder::Impl : Codecs {
  using Codecs::Codecs;
};

ImageFormat sniff_format(std::span<const std::byte> data) noexcept {
  const CodecOps* o = ops_for(data);
  return o != nullptr ? o->format : ImageFormat::unknown;
}

std::vector<std::byte> encode_image(ImageFormat f, const std::uint8_t* rgb, int width, int height, int quality) {
  for (const CodecOps& o : kCodecOps) {
    if (o.format == f) return o.encode(rgb, width, height, quality);
  }
  throw ConfigError(fmt::format("image format '{}' has no encoder", to_string(f)));
}

ImageDecoder::ImageDecoder(std::uint64_t max_pixels)
    : jpeg_(max_pixels), impl_(std::make_unique<Impl>(jpeg_, max_pixels)) {}

ImageDecoder::~ImageDecoder() = default;

namespace {

/// The row whose sniffer takes `data`; a DataError naming the file otherwise.
const CodecOps& known(std::span<const std::byte> data, const std::string& name) {
  const CodecOps* o = ops_for(data);
  if (o != nullptr) return *o;
  if (data.empty()) throw DataError(name, "empty file (0 bytes)");
  throw DataError(name, fmt::format("not a {} image (its first bytes match none of them)", codec_names()));
}

}  // namespace

ImageHeader ImageDecoder::header(std::span<const std::byte> data, const std::string& name) {
  return ((*impl_).*known(data, name).header)(data, name);
}

ImageHeader ImageDecoder::decode_planned_ref(std::span<const std::byte> data, PlanRef plan, RowSink& sink,
                                             const std::string& name) {
  return ((*impl_).*known(data, name).planned)(data, plan, sink, name);
}

void ImageDecoder::decode_full(std::span<const std::byte> data, DecodedImage& out, const std::string& name) {
  ((*impl_).*known(data, name).whole)(data, out, name);
}

ImageHeader ImageDecoder::verify(std::span<const std::byte> data, const std::string& name) {
  return ((*impl_).*known(data, name).verify)(data, name);
}

}  // namespace pinfeed::loader
