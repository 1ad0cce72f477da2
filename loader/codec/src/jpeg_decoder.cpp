#include "pinfeed/loader/jpeg_decoder.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstring>

// jpeglib.h needs FILE and size_t declared first.
#include <jpeglib.h>

#include "pinfeed/error.hpp"

namespace pinfeed::loader {

namespace {

struct ErrorManager {
  jpeg_error_mgr pub;  // first: libjpeg casts j_common_ptr->err to this
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void on_error(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

void on_message(j_common_ptr cinfo, int level) {
  if (level < 0) on_error(cinfo);  // corrupt-data warning: treat as an error
}

const char* color_name(J_COLOR_SPACE cs) {
  switch (cs) {
    case JCS_GRAYSCALE: return "gray";
    case JCS_YCbCr: return "ycbcr";
    case JCS_RGB: return "rgb";
    case JCS_CMYK: return "cmyk";
    case JCS_YCCK: return "ycck";
    default: return "other";
  }
}

/// See run_decode: keeps libjpeg-turbo's output stores ordinary (cached).
constexpr std::size_t kMisalign = 4;

bool is_cmyk(J_COLOR_SPACE cs) { return cs == JCS_CMYK || cs == JCS_YCCK; }

/// Adobe writes CMYK inverted (0 = full ink); Photoshop's are the common
/// case, so invert when the Adobe marker says so, as Pillow does.
void cmyk_row_to_bgra(const std::uint8_t* cmyk, std::uint8_t* bgra, int width, bool inverted) {
  for (int x = 0; x < width; ++x, cmyk += 4, bgra += 4) {
    unsigned c = cmyk[0], m = cmyk[1], y = cmyk[2], k = cmyk[3];
    if (!inverted) c = 255 - c, m = 255 - m, y = 255 - y, k = 255 - k;
    bgra[0] = static_cast<std::uint8_t>(y * k / 255);
    bgra[1] = static_cast<std::uint8_t>(m * k / 255);
    bgra[2] = static_cast<std::uint8_t>(c * k / 255);
    bgra[3] = 255;
  }
}

/// How many output pixels one sample of the most subsampled component spans
/// along an axis (2 at 4:2:0 full size, 1 without subsampling): the context
/// libjpeg-turbo's fancy upsampling reads beyond a pixel (Note [Decode margin]).
int chroma_context(const jpeg_decompress_struct& cinfo, bool horizontal) {
  int most = 1;
  for (int c = 0; c < cinfo.num_components; ++c) {
    const jpeg_component_info& comp = cinfo.comp_info[c];
    const int samp = horizontal ? comp.h_samp_factor : comp.v_samp_factor;
    const int max_samp = horizontal ? cinfo.max_h_samp_factor : cinfo.max_v_samp_factor;
    const int span = (max_samp * cinfo.min_DCT_scaled_size + samp * comp.DCT_scaled_size - 1) /
                     std::max(samp * comp.DCT_scaled_size, 1);
    most = std::max(most, span);
  }
  return most;
}

}  // namespace

struct JpegDecoder::Impl {
  jpeg_decompress_struct cinfo{};
  ErrorManager err{};
  std::uint64_t max_pixels = 0;
  std::vector<std::uint8_t> row;  // one CMYK row before conversion
  ScratchBytes lines[2];          // when streaming to a sink: rows alternate between them
  // decode_planned() keeps the decompressor after jpeg_read_header, so its
  // decode does not parse the header again. Only that path sets it.
  bool header_kept = false;

  // Everything that may longjmp runs inside these functions, whose frames
  // hold only trivially destructible locals (Note: setjmp + C++).
  bool read_header(std::span<const std::byte> data);
  // Exactly one of image / sink. A sink's exception leaves through here and
  // the caller aborts the decompressor.
  bool run_decode(std::span<const std::byte> data, const Region& region, int scale, DecodedImage* image, RowSink* sink);
};

bool JpegDecoder::Impl::read_header(std::span<const std::byte> data) {
  if (setjmp(err.jump) != 0) {
    jpeg_abort_decompress(&cinfo);
    return false;
  }
  jpeg_mem_src(&cinfo, reinterpret_cast<const unsigned char*>(data.data()), static_cast<unsigned long>(data.size()));
  jpeg_read_header(&cinfo, TRUE);
  return true;
}

bool JpegDecoder::Impl::run_decode(std::span<const std::byte> data, const Region& region, int scale,
                                   DecodedImage* image, RowSink* sink) {
  if (setjmp(err.jump) != 0) {
    jpeg_abort_decompress(&cinfo);
    return false;
  }
  if (!header_kept) {
    jpeg_mem_src(&cinfo, reinterpret_cast<const unsigned char*>(data.data()), static_cast<unsigned long>(data.size()));
    jpeg_read_header(&cinfo, TRUE);
  }
  header_kept = false;
  const bool cmyk = is_cmyk(cinfo.jpeg_color_space);
  const bool inverted = cinfo.saw_Adobe_marker != 0;
  cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_EXT_BGRA;
  cinfo.scale_num = 1;
  cinfo.scale_denom = static_cast<unsigned>(scale);
  jpeg_start_decompress(&cinfo);

  // The region in scaled coordinates, clamped to the scaled image.
  const auto ow = static_cast<int>(cinfo.output_width), oh = static_cast<int>(cinfo.output_height);
  const int x0 = std::clamp(region.x / scale, 0, ow - 1);
  const int y0 = std::clamp(region.y / scale, 0, oh - 1);
  const int x1 = std::clamp((region.x + region.width + scale - 1) / scale, x0 + 1, ow);
  const int y1 = std::clamp((region.y + region.height + scale - 1) / scale, y0 + 1, oh);
  const int width = x1 - x0, height = y1 - y0;

  // Note [Decode margin]: libjpeg-turbo upsamples chroma inside the decoded
  // window, so the pixels on a cropped window's edge see the edge of the
  // window where a full decode sees the next chroma sample (up to 34 levels
  // apart at 4:2:0). Decoding one chroma sample more on every side that is
  // not the image's edge makes every pixel of the region the full decode's,
  // bit for bit (JpegDecoderTest.RegionDecodeIsTheFullDecodeBitForBit). The
  // left end is rounded down to an iMCU column anyway, so the margin costs
  // a column only when the region starts or ends within it of a boundary.
  const int mx = chroma_context(cinfo, true), my = chroma_context(cinfo, false);
  const int dx0 = std::max(x0 - mx, 0), dx1 = std::min(x1 + mx, ow);
  const int dy0 = std::max(y0 - my, 0);
  JDIMENSION xoff = static_cast<JDIMENSION>(dx0), cw = static_cast<JDIMENSION>(dx1 - dx0);
  if (cw < cinfo.output_width) jpeg_crop_scanline(&cinfo, &xoff, &cw);  // widens to whole iMCU columns
  const std::size_t skip_left = static_cast<std::size_t>(x0) - xoff;
  if (dy0 > 0) jpeg_skip_scanlines(&cinfo, static_cast<JDIMENSION>(dy0));

  // Rows are decoded in place at libjpeg's (iMCU-widened) width, into the
  // image or into one line for the sink; the region starts skip_left pixels
  // into each row. CMYK goes through one row of 4-channel CMYK and is
  // converted into the same place.
  //
  // Rows start kMisalign bytes past a 16-byte boundary: libjpeg-turbo's SIMD
  // colour conversion writes aligned rows with non-temporal stores, which
  // send every decoded row to DRAM just before we read it back.
  const std::size_t stride = static_cast<std::size_t>(cw) * 4;
  if (image != nullptr) {
    image->width = width;
    image->height = height;
    image->stride = stride;
    image->offset = kMisalign + skip_left * 4;
    image->pixels.resize(kMisalign + stride * static_cast<std::size_t>(height));
  } else {
    lines[0].resize(kMisalign + stride);
    lines[1].resize(kMisalign + stride);
    sink->begin(width, height);
  }
  if (cmyk) row.resize(stride);
  // The margin's rows above the region: decoded (they are the context of
  // the region's first rows) into the first line and dropped.
  for (int y = dy0; y < y0; ++y) {
    JSAMPROW target = cmyk ? row.data() : kMisalign + (image != nullptr ? image->pixels.data() : lines[0].data());
    if (jpeg_read_scanlines(&cinfo, &target, 1) != 1) {
      std::snprintf(err.message, sizeof err.message, "image data ends early at row %d", y);
      jpeg_abort_decompress(&cinfo);
      return false;
    }
  }
  for (int y = 0; y < height; ++y) {
    std::uint8_t* dst = kMisalign + (image != nullptr ? image->pixels.data() + static_cast<std::size_t>(y) * stride
                                                      : lines[y % 2].data());
    JSAMPROW target = cmyk ? row.data() : dst;
    if (jpeg_read_scanlines(&cinfo, &target, 1) != 1) {
      std::snprintf(err.message, sizeof err.message, "image data ends early at row %d", y0 + y);
      jpeg_abort_decompress(&cinfo);
      return false;
    }
    if (cmyk) cmyk_row_to_bgra(row.data() + skip_left * 4, dst + skip_left * 4, width, inverted);
    if (sink != nullptr) sink->row(dst + skip_left * 4);
  }
  // Stop here: the rows below the region are never entropy-decoded.
  jpeg_abort_decompress(&cinfo);
  return true;
}

JpegDecoder::JpegDecoder(std::uint64_t max_pixels) : impl_(std::make_unique<Impl>()) {
  impl_->max_pixels = max_pixels;
  impl_->cinfo.err = jpeg_std_error(&impl_->err.pub);
  impl_->err.pub.error_exit = on_error;
  impl_->err.pub.emit_message = on_message;
  if (setjmp(impl_->err.jump) != 0)
    throw Error(fmt::format("libjpeg: cannot create a decoder: {}", impl_->err.message));
  jpeg_create_decompress(&impl_->cinfo);
}

JpegDecoder::~JpegDecoder() { jpeg_destroy_decompress(&impl_->cinfo); }

ImageHeader JpegDecoder::header(std::span<const std::byte> data, const std::string& name) {
  return read_header(data, name, false);
}

void JpegDecoder::abandon() noexcept {
  if (impl_->header_kept) jpeg_abort_decompress(&impl_->cinfo);
  impl_->header_kept = false;
}

ImageHeader JpegDecoder::read_header(std::span<const std::byte> data, const std::string& name, bool keep) {
  abandon();
  if (data.empty()) throw DataError(name, "empty file (0 bytes)");
  if (data.size() < 4 || data[0] != std::byte{0xff} || data[1] != std::byte{0xd8}) {
    const bool png = data.size() >= 8 && std::memcmp(data.data(), "\x89PNG", 4) == 0;
    throw DataError(name, png ? "not a JPEG (PNG data)" : "not a JPEG (no SOI marker)");
  }
  if (!impl_->read_header(data)) throw DataError(name, fmt::format("corrupt JPEG header: {}", impl_->err.message));
  ImageHeader h;
  h.width = static_cast<int>(impl_->cinfo.image_width);
  h.height = static_cast<int>(impl_->cinfo.image_height);
  h.components = impl_->cinfo.num_components;
  h.progressive = impl_->cinfo.progressive_mode != 0;
  h.color_space = color_name(impl_->cinfo.jpeg_color_space);
  const auto pixels = static_cast<std::uint64_t>(h.width) * static_cast<std::uint64_t>(h.height);
  if (h.width <= 0 || h.height <= 0) {
    jpeg_abort_decompress(&impl_->cinfo);
    throw DataError(name, "JPEG header gives an empty image");
  }
  if (pixels > impl_->max_pixels) {
    jpeg_abort_decompress(&impl_->cinfo);
    throw DataError(name, fmt::format("image {}x{} ({} pixels) exceeds the limit of {} pixels", h.width, h.height,
                                      pixels, impl_->max_pixels));
  }
  if (keep) {
    impl_->header_kept = true;
  } else {
    jpeg_abort_decompress(&impl_->cinfo);
  }
  return h;
}

void JpegDecoder::decode(std::span<const std::byte> data, const Region& region, int scale, DecodedImage& out,
                         const std::string& name) {
  (void)read_header(data, name, true);  // validates markers and the pixel limit first
  decode_kept(data, region, scale, &out, nullptr, name);
}

void JpegDecoder::decode_kept(std::span<const std::byte> data, const Region& region, int scale, DecodedImage* image,
                              RowSink* sink, const std::string& name) {
  if (scale != 1 && scale != 2 && scale != 4 && scale != 8) {
    abandon();
    throw ConfigError(fmt::format("jpeg decode: scale 1/{} is not 1, 1/2, 1/4 or 1/8", scale));
  }
  if (region.width <= 0 || region.height <= 0) {
    abandon();
    throw ConfigError("jpeg decode: empty region");
  }
  bool ok = false;
  try {
    ok = impl_->run_decode(data, region, scale, image, sink);
  } catch (...) {
    jpeg_abort_decompress(&impl_->cinfo);  // the sink threw between two rows
    throw;
  }
  if (!ok) throw DataError(name, fmt::format("corrupt JPEG: {}", impl_->err.message));
}

void JpegDecoder::decode_full(std::span<const std::byte> data, DecodedImage& out, const std::string& name) {
  const ImageHeader h = read_header(data, name, true);
  decode_kept(data, Region{0, 0, h.width, h.height}, 1, &out, nullptr, name);
}

}  // namespace pinfeed::loader
