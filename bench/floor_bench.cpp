// pinfeed-bench floor: the loader's unavoidable work besides decoding, each part alone.
#include <fmt/format.h>
#include <libyuv/scale_argb.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <turbojpeg.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <oneapi/tbb/info.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <thread>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/dataset_kinds.hpp"
#include "pinfeed/loader/jpeg_decoder.hpp"
#include "pinfeed/loader/loader.hpp"
#include "pinfeed/loader/sample_rng.hpp"
#include "pinfeed/loader/transform.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/trainer/device_type.hpp"
#include "pinfeed/trainer/trainer.hpp"
#include "pinfeed/units.hpp"
#include "plot.hpp"
#include "tool_main.hpp"

#include "bench_common.hpp"

namespace pinfeed::bench {

namespace {

/// Reads of the first `n_files` files, µs per file: after `evict_mib`
/// written elsewhere (as a loader epoch's decoding and output do between two
/// reads of a file), and after the files sat untouched with the CPU busy for
/// `epoch` (in a training job every file waits an epoch between two reads;
/// on a VM whose host reclaims idle guest memory, this is what a read costs).
struct Reads {
  double cold_us = 0, after_epoch_us = 0;
};
Reads measure_reads(const pl::Dataset& dataset, std::size_t n_files, std::size_t evict_mib, std::size_t repeat,
                    Clock::duration epoch) {
  pinfeed::memory::PageableResource pageable;
  const std::size_t evict_bytes = evict_mib << 20U;
  const Block evict = allocate_block(pageable, evict_bytes);
  std::vector<std::byte> bytes;
  const auto read_pass = [&] {
    const auto t0 = Clock::now();
    for (std::size_t i = 0; i < n_files; ++i) dataset.read(i, bytes);
    return std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(n_files) * 1e6;
  };
  std::vector<double> reads, idle_reads;
  for (std::size_t r = 0; r < repeat; ++r) {
    std::memset(evict.get(), static_cast<int>(r), evict_bytes);
    reads.push_back(read_pass());
  }
  for (std::size_t r = 0; r < repeat; ++r) {
    (void)read_pass();
    const auto until = Clock::now() + epoch;
    volatile std::uint64_t spin = 0;
    while (Clock::now() < until) spin = spin + 1;
    idle_reads.push_back(read_pass());
  }
  return Reads{median(reads), median(idle_reads)};
}

/// Horizontal resize, µs per image: each file's planned region, at its DCT
/// scale, after the writer's 2:1 column averages, to n pixels, n rows in
/// bands of 16 (libyuv, as the writer calls it).
double measure_resize(const pl::Dataset& dataset, const pl::LoaderConfig& config, std::size_t n_files,
                      std::size_t repeat) {
  const pl::TransformConfig& t = config.transform;
  const int n = t.out_width(), n_rows = t.out_height();
  pl::JpegDecoder decoder;
  std::vector<std::byte> bytes;
  std::vector<int> widths;
  for (std::size_t i = 0; i < std::min<std::size_t>(n_files, 200); ++i) {
    dataset.read(i, bytes);
    try {
      pl::SampleRng rng(config.seed, 0, i);
      const pl::CropPlan p = pl::plan_crop(decoder.header(bytes, "floor"), t, rng);
      int w = (p.region.x + p.region.width + p.scale - 1) / p.scale - p.region.x / p.scale;
      while (w > 2 * n) w /= 2;
      widths.push_back(w);
    } catch (const pinfeed::DataError&) {
    }
  }
  if (widths.empty()) throw pinfeed::DataError(config.dataset, "no readable JPEG to plan a resize from");
  const int max_w = *std::max_element(widths.begin(), widths.end());
  std::vector<std::uint8_t> band(static_cast<std::size_t>(max_w) * 4 * 16, 128),
      band_out(static_cast<std::size_t>(n) * 4 * 16);
  std::vector<double> resizes;
  for (std::size_t r = 0; r < repeat; ++r) {
    const auto t0 = Clock::now();
    for (const int w : widths) {
      for (int y = 0; y < n_rows; y += 16) {
        const int rows = std::min(16, n_rows - y);
        if (w != n)
          libyuv::ARGBScale(band.data(), w * 4, w, rows, band_out.data(), n * 4, n, rows, libyuv::kFilterLinear);
      }
    }
    resizes.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(widths.size()) *
                      1e6);
  }
  return median(resizes);
}

/// Output, µs per image: an output-sized BGRA image, no resize, written by the
/// SampleWriter to the next place of a pinned buffer the size of the pool.
double measure_output(const pl::LoaderConfig& config, std::size_t repeat) {
  const pl::TransformConfig& t = config.transform;
  pl::SampleWriter writer(t);
  pl::DecodedImage image;
  image.width = t.out_width();
  image.height = t.out_height();
  image.pixels.assign(static_cast<std::size_t>(image.width) * static_cast<std::size_t>(image.height) * 4, 100);
  pinfeed::memory::PinnedResource pinned;
  const std::size_t places = std::max<std::size_t>(1, config.batch_size * config.prefetch);
  const Block pool = allocate_block(pinned, places * t.sample_bytes());
  std::vector<double> outputs;
  for (std::size_t r = 0; r < repeat; ++r) {
    const auto t0 = Clock::now();
    for (std::size_t k = 0; k < places; ++k) {
      writer.write(image, pl::Region{}, k % 2 == 1,
                   std::span<std::byte>(pool.get() + k * t.sample_bytes(), t.sample_bytes()));
    }
    outputs.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(places) * 1e6);
  }
  return median(outputs);
}

void print_report(const json& j) {
  const json& c = j["config"];
  const json& us = j["per_image_us"];
  const auto at = [&](const char* k) { return us[k].get<double>(); };
  fmt::print("pinfeed-bench floor: {}\n", j["dataset"].get<std::string>());
  fmt::print("  config: crop {} size {} layout {}, {} files, medians of {} rounds\n", c["crop"].get<std::string>(),
             c["size"].get<int>(), c["layout"].get<std::string>(), c["files"].get<std::size_t>(),
             c["repeat"].get<std::size_t>());
  fmt::print("  {:<44} {:>8.1f} us per image per thread\n", "matching decode", at("matching_decode_per_thread"));
  fmt::print("  {:<44} {:>8.1f} us   (not in the sum)\n", "read, page cache out of the CPU caches", at("read_cold"));
  fmt::print("  {:<44} {:>8.1f} us   (files untouched for {:.0f} ms, CPU busy)\n",
             "read, one epoch after the last read", at("read_after_an_epoch"), c["epoch_ms"].get<double>());
  fmt::print("  {:<44} {:>8.1f} us\n", "horizontal resize (libyuv linear, bands of 16)", at("horizontal_resize"));
  fmt::print("  {:<44} {:>8.1f} us\n", "output write to a cold pinned pool", at("output_write"));
  fmt::print("  {:<44} {:>8.1f} us = {:.1f}% of the matching decode's time\n", "sum", at("sum"),
             j["floor_time_vs_matching_decode"].get<double>() * 100);
  fmt::print(
      "  {:<44} {:>8.1f} us = {:.0f} images/s on {} threads (decode + libyuv bilinear scale + "
      "flip/normalize loops into one batch)\n",
      "bare loop of the same decode", at("bare_loop_per_thread"), j["bare_loop_images_per_s"].get<double>(),
      c["threads"].get<unsigned>());
  fmt::print("  {:<44} {:>8.0f} images/s on {} threads ({:.0f}% of the files: baseline YCbCr 4:2:0/4:2:2/4:4:4)\n",
             "bare loop decoding raw YCbCr planes", j["bare_loop_raw_ycbcr_images_per_s"].get<double>(),
             c["threads"].get<unsigned>(), j["raw_ycbcr_eligible_share"].get<double>() * 100);
  fmt::print(
      "  least pipeline overhead vs matching decode      {:+.1f}%   (as pinfeed-bench loader computes it: "
      "1 - rate / matching rate)\n",
      j["floor_overhead_vs_matching_decode"].get<double>() * 100);
}

}  // namespace

/// What the loader must do per image besides decoding, each part measured
/// alone: reading the file, the horizontal resize of the output rows and
/// writing the output into a cold pool-sized pinned buffer. Their sum
/// against the matching decode is the least overhead the loader can have.
int run_floor_bench(const pl::LoaderConfig& config, std::size_t repeat, std::size_t evict_mib, bool as_json) {
  const unsigned threads = pl::default_threads(config.threads);
  const auto dataset = pl::open_dataset(config.dataset, config.list_root);
  const pl::TransformConfig& t = config.transform;
  const std::size_t n_files = std::min<std::size_t>(dataset->size(), 2000);

  std::vector<double> planned, bare, raw;  // the matching decode and the bare loops: images/s, all threads
  double raw_share = 0;
  for (std::size_t r = 0; r < repeat; ++r) {
    const Ceiling c = decode_ceiling(*dataset, 200, t, threads, config.batch_size);
    planned.push_back(c.planned_images_per_s);
    bare.push_back(c.bare_loop_images_per_s);
    raw.push_back(c.bare_loop_raw_images_per_s);
    raw_share = c.raw_eligible_share;
  }
  const double decode_us = static_cast<double>(threads) / median(planned) * 1e6;
  const double bare_us = static_cast<double>(threads) / median(bare) * 1e6;
  // An epoch over these files at the matching decode's rate.
  const auto epoch = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::micro>(
      static_cast<double>(n_files) * decode_us / static_cast<double>(threads)));
  const Reads reads = measure_reads(*dataset, n_files, evict_mib, repeat, epoch);
  const double resize_us = measure_resize(*dataset, config, n_files, repeat);
  const double output_us = measure_output(config, repeat);

  const double floor_us = reads.after_epoch_us + resize_us + output_us;
  json j;
  j["dataset"] = dataset->summary();
  j["config"] = {{"crop", pl::to_string(t.crop)},
                 {"size", t.size},
                 {"layout", pl::to_string(t.layout)},
                 {"threads", threads},
                 {"files", n_files},
                 {"repeat", repeat},
                 {"epoch_ms", std::chrono::duration<double, std::milli>(epoch).count()}};
  j["per_image_us"] = {{"matching_decode_per_thread", decode_us},
                       {"read_cold", reads.cold_us},
                       {"read_after_an_epoch", reads.after_epoch_us},
                       {"horizontal_resize", resize_us},
                       {"output_write", output_us},
                       {"sum", floor_us},
                       {"bare_loop_per_thread", bare_us}};
  j["bare_loop_images_per_s"] = median(bare);
  j["bare_loop_raw_ycbcr_images_per_s"] = median(raw);
  j["raw_ycbcr_eligible_share"] = raw_share;
  // The loader bench's overhead is 1 - loader rate / matching rate, i.e. the
  // share of the pipeline's time that is not decoding; at the floor that is
  // floor / (decode + floor).
  j["floor_time_vs_matching_decode"] = floor_us / decode_us;
  j["floor_overhead_vs_matching_decode"] = floor_us / (decode_us + floor_us);
  return emit_report(j, as_json, print_report);
}

}  // namespace pinfeed::bench
