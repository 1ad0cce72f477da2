// pinfeed-bench loader: images/s of the loader and of the matching decode, same files, same run.
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

/// What the rounds measured, summed (and per round where a median is taken).
struct LoaderRuns {
  std::vector<double> rates, full_rates, planned_rates, bare_rates, raw_rates;
  Ceiling ceiling;
  std::size_t images = 0, batches = 0, pinned = 0;
  double seconds = 0, read_s = 0, decode_s = 0, transform_s = 0, loading_rss = 0;
  std::uint64_t replaced = 0;
};

/// Rounds alternate the ceilings and the loader, so both see the same
/// machine; the figures are medians over the rounds.
LoaderRuns measure(pl::Loader& loader, const pl::Dataset& dataset, const pl::LoaderConfig& config, unsigned threads,
                   std::size_t epochs, std::size_t repeat, std::size_t ceiling_files) {
  // Warm-up: one pass over a few batches (page cache, pool, scratch buffers).
  loader.begin_epoch(1000);
  for (int i = 0; i < 3 && loader.next(); ++i) {
  }
  LoaderRuns r;
  for (std::size_t round = 0; round < repeat; ++round) {
    r.ceiling = decode_ceiling(dataset, ceiling_files, config.transform, threads, config.batch_size);
    r.full_rates.push_back(r.ceiling.single_thread_images_per_s * threads);
    r.planned_rates.push_back(r.ceiling.planned_images_per_s);
    r.bare_rates.push_back(r.ceiling.bare_loop_images_per_s);
    r.raw_rates.push_back(r.ceiling.bare_loop_raw_images_per_s);
    std::size_t round_images = 0;
    double round_seconds = 0;
    for (std::size_t e = 0; e < epochs; ++e) {
      const auto t0 = Clock::now();
      loader.begin_epoch(round * epochs + e);
      while (auto b = loader.next()) {
        round_images += b->size();
        ++r.batches;
        r.pinned += b->pinned() ? 1U : 0U;
        r.loading_rss = std::max(r.loading_rss, rss_now_mib());
      }
      round_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
      const pl::LoaderStats st = loader.stats();
      r.read_s += st.read_seconds;
      r.decode_s += st.decode_seconds;
      r.transform_s += st.transform_seconds;
      r.replaced += st.replaced;
    }
    r.images += round_images;
    r.seconds += round_seconds;
    r.rates.push_back(static_cast<double>(round_images) / round_seconds);
  }
  return r;
}

json report(const LoaderRuns& r, const pl::Loader& loader, const pl::Dataset& dataset, const pl::LoaderConfig& config,
            unsigned threads, std::size_t epochs, std::size_t repeat) {
  const pl::LoaderStats st = loader.stats();
  const double rate = median(r.rates), ceiling_rate = median(r.full_rates), planned_rate = median(r.planned_rates);
  const double bare_rate = median(r.bare_rates), raw_rate = median(r.raw_rates);
  const auto per_image_us = [&](double s) { return s / static_cast<double>(r.images) * 1e6; };
  json j;
  j["dataset"] = dataset.summary();
  j["config"] = {{"batch", config.batch_size},
                 {"threads", threads},
                 {"prefetch", config.prefetch},
                 {"crop", pl::to_string(config.transform.crop)},
                 {"size", config.transform.size},
                 {"layout", pl::to_string(config.transform.layout)},
                 {"roi_decode", config.transform.roi_decode},
                 {"dct_scaling", config.transform.dct_scaling},
                 {"epochs", epochs},
                 {"repeat", repeat},
                 // Note [SIMD level by core]
                 {"simd", pl::to_string(pl::simd_level())}};
  j["loader"] = {{"images", r.images},
                 {"rounds_images_per_s", r.rates},
                 {"seconds", r.seconds},
                 {"images_per_s", rate},
                 {"output_mb_per_s", rate * static_cast<double>(config.transform.sample_bytes()) / 1e6},
                 {"per_image_us",
                  {{"read", per_image_us(r.read_s)},
                   {"decode", per_image_us(r.decode_s)},
                   {"transform", per_image_us(r.transform_s)}}},
                 {"replaced", r.replaced},
                 {"pinned_batches", r.pinned},
                 {"batches", r.batches}};
  j["ceiling"] = {{"files", r.ceiling.files},
                  {"megapixels_per_image", r.ceiling.megapixels_per_image},
                  {"single_thread_images_per_s", ceiling_rate / threads},
                  {"threads", threads},
                  {"images_per_s", ceiling_rate},
                  {"planned_images_per_s", planned_rate},
                  {"bare_loop_images_per_s", bare_rate},
                  {"rounds_bare_loop_images_per_s", r.bare_rates},
                  {"bare_loop_raw_ycbcr_images_per_s", raw_rate},
                  {"raw_ycbcr_eligible_share", r.ceiling.raw_eligible_share}};
  j["ratio_to_ceiling"] = rate / ceiling_rate;
  j["ratio_to_bare_loop"] = rate / bare_rate;
  j["overhead_vs_planned_decode"] = 1.0 - rate / planned_rate;
  // Reading runs on the worker threads, so the overhead cannot be below
  // read / (matching decode + read), per image in thread time.
  const double read_us = per_image_us(r.read_s), planned_us = static_cast<double>(threads) / planned_rate * 1e6;
  j["read_share_of_matching_decode"] = read_us / planned_us;
  j["overhead_from_reading_alone"] = read_us / (planned_us + read_us);
  j["memory"] = {{"peak_rss_mib", peak_rss_mib()},
                 {"loading_rss_mib_max", r.loading_rss},
                 {"pool_pinned_bytes", st.pool.pinned_bytes},
                 {"pool_pageable_bytes", st.pool.pageable_bytes},
                 {"pool_slots", st.pool.slots},
                 {"slot_bytes", st.pool.slot_bytes}};
  return j;
}

/// The report as a table (every figure read back from the JSON: one source).
void print_report(const json& j) {
  const json& c = j["config"];
  const json& l = j["loader"];
  const json& ce = j["ceiling"];
  const json& m = j["memory"];
  const auto threads = c["threads"].get<unsigned>();
  fmt::print("pinfeed-bench loader: {}\n", j["dataset"].get<std::string>());
  fmt::print("  config: batch {} threads {} prefetch {} crop {} size {} layout {}{}{} simd {}\n",
             c["batch"].get<std::size_t>(), threads, c["prefetch"].get<std::size_t>(), c["crop"].get<std::string>(),
             c["size"].get<int>(), c["layout"].get<std::string>(), c["roi_decode"].get<bool>() ? "" : " no-roi",
             c["dct_scaling"].get<bool>() ? " dct-scale" : "", c["simd"].get<std::string>());
  fmt::print("  (medians of {} rounds; each round: the ceilings, then {} epoch(s) of the loader)\n",
             c["repeat"].get<std::size_t>(), c["epochs"].get<std::size_t>());
  fmt::print("  {:<34} {:>10.1f} images/s  {:>8.1f} MB/s out  ({} images in {:.2f} s)\n", "pinfeed loader",
             l["images_per_s"].get<double>(), l["output_mb_per_s"].get<double>(), l["images"].get<std::size_t>(),
             l["seconds"].get<double>());
  fmt::print("  {:<34} {:>10.1f} images/s  ({:.1f}/s x {} threads, {} files, {:.2f} MP each)\n",
             "decode ceiling (full TurboJPEG)", ce["images_per_s"].get<double>(),
             ce["single_thread_images_per_s"].get<double>(), threads, ce["files"].get<std::size_t>(),
             ce["megapixels_per_image"].get<double>());
  fmt::print("  {:<34} {:>10.1f} images/s  ({} threads decoding the loader's own crops and scales, nothing else)\n",
             "matching decode (same plans)", ce["planned_images_per_s"].get<double>(), threads);
  fmt::print(
      "  {:<34} {:>10.1f} images/s  (same decode + libyuv bilinear scale + flip/normalize loops into one batch)\n",
      "bare loop (same plans)", ce["bare_loop_images_per_s"].get<double>());
  fmt::print("  {:<34} {:>10.2f}x\n", "loader / bare loop", j["ratio_to_bare_loop"].get<double>());
  fmt::print(
      "  {:<34} {:>10.1f} images/s  (raw YCbCr planes: box-filtered, colour converted at the output size; "
      "{:.0f}% of the files)\n",
      "bare loop, raw YCbCr", ce["bare_loop_raw_ycbcr_images_per_s"].get<double>(),
      ce["raw_ycbcr_eligible_share"].get<double>() * 100);
  fmt::print("  {:<34} {:>10.2f}x   pipeline overhead vs matching decode {:+.1f}%\n", "loader / full-decode ceiling",
             j["ratio_to_ceiling"].get<double>(), j["overhead_vs_planned_decode"].get<double>() * 100);
  const json& us = l["per_image_us"];
  fmt::print("  per image, summed over threads: read {:.0f} us, decode {:.0f} us, transform {:.0f} us\n",
             us["read"].get<double>(), us["decode"].get<double>(), us["transform"].get<double>());
  fmt::print("  reading alone: {:.0f}% of the matching decode's time per image, an overhead of {:+.1f}% by itself\n",
             j["read_share_of_matching_decode"].get<double>() * 100,
             j["overhead_from_reading_alone"].get<double>() * 100);
  fmt::print(
      "  RSS while loading {:.0f} MiB (process peak {:.0f} MiB, ceilings included); pool {} slots x {}: {} pinned, "
      "{} pageable; {} of {} batches pinned; {} replaced\n",
      m["loading_rss_mib_max"].get<double>(), m["peak_rss_mib"].get<double>(), m["pool_slots"].get<std::size_t>(),
      pinfeed::format_bytes(m["slot_bytes"].get<std::uint64_t>()),
      pinfeed::format_bytes(m["pool_pinned_bytes"].get<std::uint64_t>()),
      pinfeed::format_bytes(m["pool_pageable_bytes"].get<std::uint64_t>()), l["pinned_batches"].get<std::size_t>(),
      l["batches"].get<std::size_t>(), l["replaced"].get<std::uint64_t>());
}

}  // namespace

int run_loader_bench(pl::LoaderConfig config, std::size_t epochs, std::size_t repeat, std::size_t ceiling_files,
                     bool as_json) {
  const unsigned threads = pl::default_threads(config.threads);
  const auto dataset = pl::open_dataset(config.dataset, config.list_root);
  pl::Loader loader(config);
  const LoaderRuns runs = measure(loader, *dataset, config, threads, epochs, repeat, ceiling_files);
  const json j = report(runs, loader, *dataset, config, threads, epochs, repeat);
  return emit_report(j, as_json, print_report);
}

}  // namespace pinfeed::bench
