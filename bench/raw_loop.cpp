// The bare loop decoding raw YCbCr planes (libjpeg's raw_data_out): a
// measurement of the decode path the loader does not take, to tell whether
// it should.
#include <cstddef>
#include <cstdio>

// jpeglib.h needs FILE and size_t declared first.
#include <jpeglib.h>
#include <libyuv/convert_argb.h>
#include <libyuv/planar_functions.h>
#include <libyuv/scale.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "pinfeed/loader/jpeg_decoder.hpp"
#include "pinfeed/loader/sample_rng.hpp"
#include "pinfeed/loader/transform.hpp"

#include "bench_common.hpp"

namespace pinfeed::bench {

namespace {

struct RawError {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
};

[[noreturn]] void raw_error_exit(j_common_ptr c) {
  std::longjmp(reinterpret_cast<RawError*>(c->err)->jump, 1);  // NOLINT: libjpeg's error protocol
}
void raw_quiet(j_common_ptr /*c*/, int /*level*/) {}

/// A thread's decoder state: the decompressor and the planes of the rows
/// decoded so far (whole iMCU rows, full width).
struct RawDecoder {
  jpeg_decompress_struct cinfo{};
  RawError err{};
  std::array<std::vector<std::uint8_t>, 3> planes;
  std::array<int, 3> stride{}, rows{}, sub_x{}, sub_y{};  ///< sub: luma pixels per plane pixel
  std::array<std::vector<JSAMPROW>, 3> pointers;
  std::array<JSAMPARRAY, 3> arrays{};
  RawDecoder() {
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = raw_error_exit;
    err.pub.emit_message = raw_quiet;
    jpeg_create_decompress(&cinfo);
  }
  ~RawDecoder() { jpeg_destroy_decompress(&cinfo); }
  RawDecoder(const RawDecoder&) = delete;
  RawDecoder& operator=(const RawDecoder&) = delete;
};

/// 0: not eligible (gray, CMYK, progressive or other sampling), else 420,
/// 422 or 444.
int sampling(const jpeg_decompress_struct& c) {
  if (c.num_components != 3 || c.jpeg_color_space != JCS_YCbCr || c.progressive_mode) return 0;
  const auto& y = c.comp_info[0];
  for (int k = 1; k < 3; ++k) {
    if (c.comp_info[k].h_samp_factor != 1 || c.comp_info[k].v_samp_factor != 1) return 0;
  }
  if (y.h_samp_factor == 2 && y.v_samp_factor == 2) return 420;
  if (y.h_samp_factor == 2 && y.v_samp_factor == 1) return 422;
  if (y.h_samp_factor == 1 && y.v_samp_factor == 1) return 444;
  return 0;
}

/// Reads the header: the sampling (0: not eligible, -1: bad data) and size.
/// Only trivially destructible locals below setjmp (Note: setjmp + C++).
int read_raw_header(RawDecoder& d, std::span<const std::byte> file, int& width, int& height) {
  jpeg_decompress_struct& c = d.cinfo;
  if (setjmp(d.err.jump) != 0) {
    jpeg_abort_decompress(&c);
    return -1;
  }
  jpeg_mem_src(&c, reinterpret_cast<const unsigned char*>(file.data()), static_cast<unsigned long>(file.size()));
  jpeg_read_header(&c, TRUE);
  width = static_cast<int>(c.image_width);
  height = static_cast<int>(c.image_height);
  // The loader's pixel limit: a header claiming 65000x65000 is skipped here.
  if (static_cast<std::uint64_t>(width) * static_cast<std::uint64_t>(height) > pl::kDefaultMaxPixels) {
    jpeg_abort_decompress(&c);
    return -1;
  }
  const int s = sampling(c);
  if (s == 0) jpeg_abort_decompress(&c);
  return s;
}

/// Decodes raw planes at 1/scale, whole iMCU rows, down to scaled row
/// `last` (inclusive), then stops: the rows below are never decoded.
bool decode_raw_rows(RawDecoder& d, int scale, const int region_last) {
  jpeg_decompress_struct& c = d.cinfo;
  if (setjmp(d.err.jump) != 0) {
    jpeg_abort_decompress(&c);
    return false;
  }
  c.raw_data_out = TRUE;
  c.scale_num = 1;
  c.scale_denom = static_cast<unsigned>(scale);
  jpeg_start_decompress(&c);
  const int block = c.min_DCT_scaled_size;  // 8 / scale
  const int imcu_rows = c.max_v_samp_factor * block;
  const int last = std::min(region_last, static_cast<int>(c.output_height) - 1);
  const int needed = (last / imcu_rows + 1) * imcu_rows;
  // Each component's own scaled block size: at 1/4 or 1/8 libjpeg scales
  // chroma up in its IDCT (DCT_scaled_size 2 or 4 where luma's is 1 or 2),
  // so its planes can be as large as luma's; `sub` holds the ratios.
  for (std::size_t k = 0; k < 3; ++k) {
    const auto& comp = c.comp_info[k];
    const int per = comp.v_samp_factor * comp.DCT_scaled_size;  // rows per iMCU row
    d.stride[k] = static_cast<int>(comp.width_in_blocks) * comp.DCT_scaled_size;
    d.rows[k] = needed / imcu_rows * per;
    d.sub_x[k] = c.max_h_samp_factor * block / (comp.h_samp_factor * comp.DCT_scaled_size);
    d.sub_y[k] = imcu_rows / per;
    d.planes[k].resize(static_cast<std::size_t>(d.stride[k]) * static_cast<std::size_t>(d.rows[k]) + 64);
    d.pointers[k].resize(static_cast<std::size_t>(per));
  }
  for (int y = 0; y < needed; y += imcu_rows) {
    for (std::size_t k = 0; k < 3; ++k) {
      const int per = c.comp_info[k].v_samp_factor * c.comp_info[k].DCT_scaled_size;
      const int y0 = y / imcu_rows * per;
      for (int r = 0; r < per; ++r) {
        d.pointers[k][static_cast<std::size_t>(r)] =
            d.planes[k].data() + static_cast<std::size_t>(y0 + r) * static_cast<std::size_t>(d.stride[k]);
      }
      d.arrays[k] = d.pointers[k].data();
    }
    if (jpeg_read_raw_data(&c, d.arrays.data(), static_cast<JDIMENSION>(imcu_rows)) == 0) break;
  }
  jpeg_abort_decompress(&c);
  return true;
}

}  // namespace

double bare_loop_raw_rate(const std::vector<std::span<const std::byte>>& files, const pl::TransformConfig& t,
                          unsigned threads, std::size_t batch, double* eligible_share) {
  const int n = t.out_width(), rows = t.out_height();
  const BareBatch out(t, threads, batch);
  std::atomic<std::size_t> decoded{0}, eligible{0};
  const auto work = [&](unsigned k) {
    RawDecoder d;
    const auto un = static_cast<std::size_t>(n), urows = static_cast<std::size_t>(rows);
    std::vector<std::uint8_t> y_out(un * urows), u_out(un * urows), v_out(un * urows), argb(un * urows * 4),
        mirrored(un * 4);
    std::size_t mine = 0;
    for (std::size_t i = k; i < files.size(); i += threads) {
      pl::SampleRng rng(0, 0, i);
      pl::ImageHeader header;
      const int s = read_raw_header(d, files[i], header.width, header.height);
      if (s <= 0) continue;
      eligible.fetch_add(1, std::memory_order_relaxed);
      const pl::CropPlan plan = pl::plan_crop(header, t, rng);
      if (!decode_raw_rows(d, plan.scale, (plan.region.y + plan.region.height + plan.scale - 1) / plan.scale)) continue;
      // The region in scaled luma coordinates, and per chroma plane.
      const int sc = plan.scale;
      const int x0 = plan.region.x / sc, y0 = plan.region.y / sc;
      const int w = std::max(1, plan.region.width / sc), h = std::max(1, plan.region.height / sc);
      // The decoded chroma planes' subsampling (at 1/4 and 1/8 often none:
      // see decode_raw_rows); both chroma planes share it.
      const int cx = d.sub_x[1], cy = d.sub_y[1];
      if (cx != d.sub_x[2] || cy != d.sub_y[2] || cx > 2 || cy > 2 || cx < cy) continue;
      const int kind = cx == 1 ? 444 : (cy == 2 ? 420 : 422);
      const int cw = cx == 1 ? n : (n + 1) / 2, ch = cy == 1 ? rows : (rows + 1) / 2;
      libyuv::ScalePlane(d.planes[0].data() + static_cast<std::size_t>(y0) * static_cast<std::size_t>(d.stride[0]) +
                             static_cast<std::size_t>(x0),
                         d.stride[0], w, h, y_out.data(), n, n, rows, libyuv::kFilterBox);
      for (int p = 1; p < 3; ++p) {
        const auto up = static_cast<std::size_t>(p);
        std::uint8_t* dst = p == 1 ? u_out.data() : v_out.data();
        libyuv::ScalePlane(d.planes[up].data() +
                               static_cast<std::size_t>(y0 / cy) * static_cast<std::size_t>(d.stride[up]) +
                               static_cast<std::size_t>(x0 / cx),
                           d.stride[up], std::max(1, w / cx), std::max(1, h / cy), dst, cw, cw, ch, libyuv::kFilterBox);
      }
      // libyuv's J (full-range JFIF) conversion at the output size; its
      // "ARGB" is B, G, R, A in memory, as the loader's BGRA rows.
      if (kind == 420) {
        libyuv::J420ToARGB(y_out.data(), n, u_out.data(), cw, v_out.data(), cw, argb.data(), n * 4, n, rows);
      } else if (kind == 422) {
        libyuv::J422ToARGB(y_out.data(), n, u_out.data(), cw, v_out.data(), cw, argb.data(), n * 4, n, rows);
      } else {
        libyuv::J444ToARGB(y_out.data(), n, u_out.data(), cw, v_out.data(), cw, argb.data(), n * 4, n, rows);
      }
      out.write(argb.data(), plan.flip, mirrored.data(), out.next_place(k, mine));
      decoded.fetch_add(1, std::memory_order_relaxed);
    }
  };
  const double seconds = timed_passes(threads, work, [&] {
    decoded = 0;
    eligible = 0;
  });
  if (eligible_share != nullptr)
    *eligible_share =
        files.empty() ? 0 : static_cast<double>(eligible.load()) / 2.0 / static_cast<double>(files.size());
  return static_cast<double>(decoded.load()) / seconds;
}

}  // namespace pinfeed::bench
