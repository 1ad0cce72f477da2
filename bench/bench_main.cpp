// pinfeed-bench: loader throughput against the machine's own decode ceiling.
//
//   pinfeed-bench loader --data DIR [--batch 64] [--crop random] [--json] ...
//
// In one run it measures (1) the decode ceiling: a single-thread, full-size
// TurboJPEG decode of the same files (read into memory first, so it is the
// decoder alone), times the thread count; and (2) the pinfeed loader over the
// dataset with the given transforms, per-stage times, peak RSS and the pool's
// pinned/pageable bytes. `floor` times the loader's work besides decoding,
// each part alone; `threads` runs the loader bench per thread count (table,
// CSV, plot); `copy` times host-to-device copies from pinned and pageable
// memory. Benchmarks, not tests: numbers go to docs/results.md.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <libyuv/scale_argb.h>
#include <turbojpeg.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <oneapi/tbb/info.h>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/dataset.hpp"
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

namespace {

namespace pl = pinfeed::loader;
using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

/// Resident set size now, MiB (/proc/self/statm), sampled once per batch.
double rss_now_mib() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  return n == 2 ? static_cast<double>(resident) * static_cast<double>(pinfeed::page_size()) / (1024.0 * 1024.0) : 0;
}

/// A mapping from a HostResource, returned to it when the Block goes.
using Block = std::unique_ptr<std::byte, std::function<void(std::byte*)>>;
Block allocate_block(pinfeed::memory::HostResource& resource, std::size_t bytes) {
  return Block(static_cast<std::byte*>(resource.allocate(bytes)),
               [&resource, bytes](std::byte* p) { resource.deallocate(p, bytes); });
}

struct Ceiling {
  std::size_t files = 0;
  double single_thread_images_per_s = 0;
  double megapixels_per_image = 0;
  double planned_images_per_s = 0;  ///< all threads, decoding only what the loader decodes
};

/// The loader's own decode work alone (same crop plans, ROI and DCT scale)
/// on `threads` threads at once, files from memory: the "matching" ceiling
/// that the loader's reading, transforms and batching add to.
double planned_decode_rate(const std::vector<std::span<const std::byte>>& files, const pl::TransformConfig& t,
                           unsigned threads) {
  const auto work = [&](unsigned k) {
    pl::JpegDecoder decoder;
    pl::DecodedImage image;
    for (std::size_t i = k; i < files.size(); i += threads) {
      pl::SampleRng rng(0, 0, i);
      try {
        decoder.decode_planned(
            files[i],
            [&](const pl::ImageHeader& h) {
              const pl::CropPlan p = pl::plan_crop(h, t, rng);
              return t.roi_decode ? pl::JpegDecoder::Plan{p.region, p.scale}
                                  : pl::JpegDecoder::Plan{pl::Region{0, 0, h.width, h.height}, 1};
            },
            image, "ceiling");
      } catch (const pinfeed::DataError&) {
      }
    }
  };
  const auto run_all = [&] {
    std::vector<std::thread> pool;
    for (unsigned k = 0; k < threads; ++k) pool.emplace_back(work, k);
    for (auto& th : pool) th.join();
  };
  run_all();  // warm caches
  const auto t0 = Clock::now();
  for (int rep = 0; rep < 2; ++rep) run_all();
  return 2.0 * static_cast<double>(files.size()) / std::chrono::duration<double>(Clock::now() - t0).count();
}

/// Full decode of up to `limit` files, one thread, TurboJPEG's defaults.
Ceiling decode_ceiling(const pl::Dataset& data, std::size_t limit, const pl::TransformConfig& transform, unsigned threads) {
  const std::size_t n = std::min(limit, data.size());
  // Spread over the dataset (every k-th file) so all classes are represented.
  // The files go into one mapping that is unmapped afterwards: tens of MB
  // of small vectors would stay in the heap and count in the loader's RSS.
  const std::size_t stride = std::max<std::size_t>(1, data.size() / n);
  // Files the loader would replace (unreadable, not regular) are skipped
  // here too, named once, instead of aborting the benchmark.
  std::vector<std::byte> one;
  std::vector<std::size_t> picked, sizes;
  std::size_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    try {
      data.read(i * stride, one);
    } catch (const pinfeed::DataError& e) {
      fmt::print(stderr, "pinfeed-bench: ceiling skips {}: {}\n", e.path().string(), e.reason());
      continue;
    }
    picked.push_back(i * stride);
    sizes.push_back(one.size());
    total += one.size();
  }
  pinfeed::memory::PageableResource memory;
  const std::size_t block_bytes = std::max<std::size_t>(total, 1);
  const Block block = allocate_block(memory, block_bytes);
  std::vector<std::span<const std::byte>> files(picked.size());
  for (std::size_t k = 0, at = 0; k < picked.size(); ++k) {
    data.read(picked[k], one);
    if (one.size() != sizes[k]) throw pinfeed::Error(fmt::format("{} changed size while benchmarking", data.describe(picked[k])));
    std::memcpy(block.get() + at, one.data(), one.size());
    files[k] = std::span<const std::byte>(block.get() + at, one.size());
    at += one.size();
  }
  tjhandle h = tjInitDecompress();
  if (h == nullptr) throw pinfeed::Error("TurboJPEG: tjInitDecompress failed");
  std::vector<unsigned char> out;
  double pixels = 0;
  const auto decode_all = [&] {
    for (const auto& f : files) {
      int w = 0, hgt = 0, ss = 0, cs = 0;
      const auto* src = reinterpret_cast<const unsigned char*>(f.data());
      if (tjDecompressHeader3(h, src, f.size(), &w, &hgt, &ss, &cs) != 0) continue;
      // The loader's pixel limit: a header claiming 65000x65000 is a bad
      // sample there, not a 12 GB allocation here.
      if (static_cast<std::uint64_t>(w) * static_cast<std::uint64_t>(hgt) > pl::kDefaultMaxPixels) continue;
      out.resize(static_cast<std::size_t>(w) * static_cast<std::size_t>(hgt) * 3);
      tjDecompress2(h, src, f.size(), out.data(), w, 0, hgt, TJPF_RGB, 0);
      pixels += static_cast<double>(w) * hgt;
    }
  };
  decode_all();  // warm caches
  pixels = 0;
  const auto t0 = Clock::now();
  decode_all();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  tjDestroy(h);
  if (files.empty()) throw pinfeed::DataError(data.describe(0), "no file of the dataset could be read for the decode ceiling");
  const auto count = static_cast<double>(files.size());
  return Ceiling{files.size(), count / s, pixels / count / 1e6, planned_decode_rate(files, transform, threads)};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int run_loader_bench(pl::LoaderConfig config, std::size_t epochs, std::size_t repeat, std::size_t ceiling_files,
                     bool as_json) {
  const unsigned threads = config.threads != 0 ? config.threads : static_cast<unsigned>(oneapi::tbb::info::default_concurrency());
  const auto dataset = pl::open_dataset(config.dataset, config.list_root);

  pl::Loader loader(config);
  // Warm-up: one pass over a few batches (page cache, pool, scratch buffers).
  loader.begin_epoch(1000);
  for (int i = 0; i < 3 && loader.next(); ++i) {
  }
  // Rounds alternate the ceiling and the loader, so both see the same
  // machine; the figures are medians over the rounds.
  std::vector<double> rates, full_rates, planned_rates;
  Ceiling ceiling;
  std::size_t images = 0, batches = 0, pinned = 0;
  double seconds = 0, read_s = 0, decode_s = 0, transform_s = 0, loading_rss = 0;
  std::uint64_t replaced = 0;
  for (std::size_t round = 0; round < repeat; ++round) {
    ceiling = decode_ceiling(*dataset, ceiling_files, config.transform, threads);
    full_rates.push_back(ceiling.single_thread_images_per_s * threads);
    planned_rates.push_back(ceiling.planned_images_per_s);
    std::size_t round_images = 0;
    double round_seconds = 0;
    for (std::size_t e = 0; e < epochs; ++e) {
      const auto t0 = Clock::now();
      loader.begin_epoch(round * epochs + e);
      while (auto b = loader.next()) {
        round_images += b->size();
        ++batches;
        pinned += b->pinned() ? 1U : 0U;
        loading_rss = std::max(loading_rss, rss_now_mib());
      }
      round_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
      const pl::LoaderStats st = loader.stats();
      read_s += st.read_seconds;
      decode_s += st.decode_seconds;
      transform_s += st.transform_seconds;
      replaced += st.replaced;
    }
    images += round_images;
    seconds += round_seconds;
    rates.push_back(static_cast<double>(round_images) / round_seconds);
  }
  const pl::LoaderStats st = loader.stats();
  const double rate = median(rates);
  const double ceiling_rate = median(full_rates);
  const double planned_rate = median(planned_rates);
  ceiling.single_thread_images_per_s = ceiling_rate / threads;
  const double out_mb_s = rate * static_cast<double>(config.transform.sample_bytes()) / 1e6;
  const auto per_image_us = [&](double s) { return s / static_cast<double>(images) * 1e6; };

  json j;
  j["dataset"] = dataset->summary();
  j["config"] = {{"batch", config.batch_size},       {"threads", threads},
                 {"prefetch", config.prefetch},      {"crop", pl::to_string(config.transform.crop)},
                 {"size", config.transform.size},    {"layout", pl::to_string(config.transform.layout)},
                 {"roi_decode", config.transform.roi_decode}, {"dct_scaling", config.transform.dct_scaling},
                 {"epochs", epochs},
                 {"repeat", repeat}};
  j["loader"] = {{"images", images},
                 {"rounds_images_per_s", rates},
                 {"seconds", seconds},
                 {"images_per_s", rate},
                 {"output_mb_per_s", out_mb_s},
                 {"per_image_us", {{"read", per_image_us(read_s)}, {"decode", per_image_us(decode_s)}, {"transform", per_image_us(transform_s)}}},
                 {"replaced", replaced},
                 {"pinned_batches", pinned},
                 {"batches", batches}};
  j["ceiling"] = {{"files", ceiling.files},
                  {"megapixels_per_image", ceiling.megapixels_per_image},
                  {"single_thread_images_per_s", ceiling.single_thread_images_per_s},
                  {"threads", threads},
                  {"images_per_s", ceiling_rate},
                  {"planned_images_per_s", planned_rate}};
  j["ratio_to_ceiling"] = rate / ceiling_rate;
  j["overhead_vs_planned_decode"] = 1.0 - rate / planned_rate;
  // Reading runs on the worker threads, so the overhead cannot be below
  // read / (matching decode + read), per image in thread time.
  const double read_us = per_image_us(read_s), planned_us = static_cast<double>(threads) / planned_rate * 1e6;
  j["read_share_of_matching_decode"] = read_us / planned_us;
  j["overhead_from_reading_alone"] = read_us / (planned_us + read_us);
  j["memory"] = {{"peak_rss_mib", peak_rss_mib()},
                 {"loading_rss_mib_max", loading_rss},
                 {"pool_pinned_bytes", st.pool.pinned_bytes},
                 {"pool_pageable_bytes", st.pool.pageable_bytes},
                 {"pool_slots", st.pool.slots},
                 {"slot_bytes", st.pool.slot_bytes}};
  if (as_json) {
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("pinfeed-bench loader: {}\n", dataset->summary());
  fmt::print("  config: batch {} threads {} prefetch {} crop {} size {} layout {}{}{}\n", config.batch_size, threads,
             config.prefetch, pl::to_string(config.transform.crop), config.transform.size,
             pl::to_string(config.transform.layout), config.transform.roi_decode ? "" : " no-roi",
             config.transform.dct_scaling ? "" : " no-dct-scale");
  fmt::print("  (medians of {} rounds; each round: the ceilings, then {} epoch(s) of the loader)\n", repeat, epochs);
  fmt::print("  {:<34} {:>10.1f} images/s  {:>8.1f} MB/s out  ({} images in {:.2f} s)\n", "pinfeed loader", rate, out_mb_s,
             images, seconds);
  fmt::print("  {:<34} {:>10.1f} images/s  ({:.1f}/s x {} threads, {} files, {:.2f} MP each)\n",
             "decode ceiling (full TurboJPEG)", ceiling_rate, ceiling.single_thread_images_per_s, threads, ceiling.files,
             ceiling.megapixels_per_image);
  fmt::print("  {:<34} {:>10.1f} images/s  ({} threads decoding the loader's own crops and scales, nothing else)\n",
             "matching decode (same plans)", planned_rate, threads);
  fmt::print("  {:<34} {:>10.2f}x   pipeline overhead vs matching decode {:+.1f}%\n", "loader / full-decode ceiling",
             rate / ceiling_rate, (1.0 - rate / planned_rate) * 100);
  fmt::print("  per image, summed over threads: read {:.0f} us, decode {:.0f} us, transform {:.0f} us\n",
             per_image_us(read_s), per_image_us(decode_s), per_image_us(transform_s));
  fmt::print("  reading alone: {:.0f}% of the matching decode's time per image, an overhead of {:+.1f}% by itself\n",
             read_us / planned_us * 100, read_us / (planned_us + read_us) * 100);
  fmt::print("  RSS while loading {:.0f} MiB (process peak {:.0f} MiB, ceilings included); pool {} slots x {}: {} pinned, "
             "{} pageable; {} of {} batches pinned; {} replaced\n",
             loading_rss, peak_rss_mib(), st.pool.slots, pinfeed::format_bytes(st.pool.slot_bytes), pinfeed::format_bytes(st.pool.pinned_bytes),
             pinfeed::format_bytes(st.pool.pageable_bytes), pinned, batches, replaced);
  return 0;
}

/// What the loader must do per image besides decoding, each part measured
/// alone: reading the file from a page cache pushed out of the CPU caches,
/// the horizontal resize of the output rows (libyuv, as the writer calls it),
/// and writing the output into a cold pool-sized pinned buffer. Their sum
/// against the matching decode is the least overhead the loader can have.
int run_floor_bench(const pl::LoaderConfig& config, std::size_t repeat, std::size_t evict_mib, bool as_json) {
  const unsigned threads = config.threads != 0 ? config.threads : static_cast<unsigned>(oneapi::tbb::info::default_concurrency());
  const auto dataset = pl::open_dataset(config.dataset, config.list_root);
  const pl::TransformConfig& t = config.transform;
  const std::size_t n_files = std::min<std::size_t>(dataset->size(), 2000);
  const int n = t.size;

  // Matching decode: per image, per thread.
  std::vector<double> planned;
  for (std::size_t r = 0; r < repeat; ++r) planned.push_back(decode_ceiling(*dataset, 200, t, threads).planned_images_per_s);
  const double decode_us = static_cast<double>(threads) / median(planned) * 1e6;

  // Read: one pass over the files after evict_mib written elsewhere, as a
  // loader epoch's decoding and output do between two reads of a file.
  pinfeed::memory::PageableResource pageable;
  const std::size_t evict_bytes = evict_mib << 20U;
  const Block evict = allocate_block(pageable, evict_bytes);
  std::vector<std::byte> bytes;
  const auto read_pass = [&] {
    const auto t0 = Clock::now();
    for (std::size_t i = 0; i < n_files; ++i) dataset->read(i, bytes);
    return std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(n_files) * 1e6;
  };
  std::vector<double> reads;
  for (std::size_t r = 0; r < repeat; ++r) {
    std::memset(evict.get(), static_cast<int>(r), evict_bytes);
    reads.push_back(read_pass());
  }
  // Read again after the files sat untouched, with the CPU busy, for as long
  // as a loader epoch over them takes at the matching decode's rate: in a
  // training job every file waits an epoch between two reads. On a VM whose
  // host reclaims idle guest memory, this is what a read really costs.
  const auto epoch = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::micro>(
      static_cast<double>(n_files) * decode_us / static_cast<double>(threads)));
  std::vector<double> idle_reads;
  for (std::size_t r = 0; r < repeat; ++r) {
    (void)read_pass();
    const auto until = Clock::now() + epoch;
    volatile std::uint64_t spin = 0;
    while (Clock::now() < until) spin = spin + 1;
    idle_reads.push_back(read_pass());
  }

  // Horizontal resize: each file's planned region, at its DCT scale, after
  // the writer's 2:1 column averages, to n pixels, n rows in bands of 16.
  pl::JpegDecoder decoder;
  std::vector<int> widths;
  for (std::size_t i = 0; i < std::min<std::size_t>(n_files, 200); ++i) {
    dataset->read(i, bytes);
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
  std::vector<std::uint8_t> band(static_cast<std::size_t>(max_w) * 4 * 16, 128), band_out(static_cast<std::size_t>(n) * 4 * 16);
  std::vector<double> resizes;
  for (std::size_t r = 0; r < repeat; ++r) {
    const auto t0 = Clock::now();
    for (const int w : widths) {
      for (int y = 0; y < n; y += 16) {
        const int rows = std::min(16, n - y);
        if (w != n) {
          libyuv::ARGBScale(band.data(), w * 4, w, rows, band_out.data(), n * 4, n, rows, libyuv::kFilterLinear);
        }
      }
    }
    resizes.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(widths.size()) * 1e6);
  }

  // Output: an n x n BGRA image, no resize, written by the SampleWriter to
  // the next place of a pinned buffer the size of the loader's pool.
  pl::SampleWriter writer(t);
  pl::DecodedImage image;
  image.width = image.height = n;
  image.pixels.assign(static_cast<std::size_t>(n) * static_cast<std::size_t>(n) * 4, 100);
  pinfeed::memory::PinnedResource pinned;
  const std::size_t places = std::max<std::size_t>(1, config.batch_size * config.prefetch);
  const std::size_t pool_bytes = places * t.sample_bytes();
  const Block pool = allocate_block(pinned, pool_bytes);
  std::vector<double> outputs;
  for (std::size_t r = 0; r < repeat; ++r) {
    const auto t0 = Clock::now();
    for (std::size_t k = 0; k < places; ++k) {
      writer.write(image, pl::Region{}, k % 2 == 1, std::span<std::byte>(pool.get() + k * t.sample_bytes(), t.sample_bytes()));
    }
    outputs.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(places) * 1e6);
  }

  const double read_us = median(reads), idle_read_us = median(idle_reads), resize_us = median(resizes),
               output_us = median(outputs);
  const double floor_us = idle_read_us + resize_us + output_us;
  json j;
  j["dataset"] = dataset->summary();
  j["config"] = {{"crop", pl::to_string(t.crop)}, {"size", n}, {"layout", pl::to_string(t.layout)}, {"threads", threads},
                 {"files", n_files}, {"repeat", repeat},
                 {"epoch_ms", std::chrono::duration<double, std::milli>(epoch).count()}};
  j["per_image_us"] = {{"matching_decode_per_thread", decode_us}, {"read_cold", read_us},
                       {"read_after_an_epoch", idle_read_us}, {"horizontal_resize", resize_us}, {"output_write", output_us}, {"sum", floor_us}};
  // The loader bench's overhead is 1 - loader rate / matching rate, i.e. the
  // share of the pipeline's time that is not decoding; at the floor that is
  // floor / (decode + floor).
  j["floor_time_vs_matching_decode"] = floor_us / decode_us;
  j["floor_overhead_vs_matching_decode"] = floor_us / (decode_us + floor_us);
  if (as_json) {
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("pinfeed-bench floor: {}\n", dataset->summary());
  fmt::print("  config: crop {} size {} layout {}, {} files, medians of {} rounds\n", pl::to_string(t.crop), n,
             pl::to_string(t.layout), n_files, repeat);
  fmt::print("  {:<44} {:>8.1f} us per image per thread\n", "matching decode", decode_us);
  fmt::print("  {:<44} {:>8.1f} us   (not in the sum)\n", "read, page cache out of the CPU caches", read_us);
  fmt::print("  {:<44} {:>8.1f} us   (files untouched for {:.0f} ms, CPU busy)\n", "read, one epoch after the last read",
             idle_read_us, std::chrono::duration<double, std::milli>(epoch).count());
  fmt::print("  {:<44} {:>8.1f} us\n", "horizontal resize (libyuv linear, bands of 16)", resize_us);
  fmt::print("  {:<44} {:>8.1f} us\n", "output write to a cold pinned pool", output_us);
  fmt::print("  {:<44} {:>8.1f} us = {:.1f}% of the matching decode's time\n", "sum", floor_us, floor_us / decode_us * 100);
  fmt::print("  least pipeline overhead vs matching decode      {:+.1f}%   (as pinfeed-bench loader computes it: "
             "1 - rate / matching rate)\n",
             floor_us / (decode_us + floor_us) * 100);
  return 0;
}

/// Runs the loader bench with `threads` worker threads in a child process
/// (fork, before this process has started any thread of its own), so each
/// count's RSS is its own and not the high-water mark of the ones before.
json loader_bench_in_child(pl::LoaderConfig config, unsigned threads, std::size_t epochs, std::size_t repeat,
                           std::size_t ceiling_files) {
  config.threads = threads;
  int fds[2];
  if (::pipe(fds) != 0) throw pinfeed::Error(fmt::format("pipe: {}", std::strerror(errno)));
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) throw pinfeed::Error(fmt::format("fork: {}", std::strerror(errno)));
  if (pid == 0) {
    ::close(fds[0]);
    ::dup2(fds[1], STDOUT_FILENO);
    ::close(fds[1]);
    int rc = 1;
    try {
      rc = run_loader_bench(config, epochs, repeat, ceiling_files, /*as_json=*/true);
    } catch (const std::exception& e) {
      fmt::print(stderr, "pinfeed-bench: {} threads: {}\n", threads, e.what());
    }
    std::fflush(stdout);
    ::_exit(rc);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw pinfeed::Error(fmt::format("the loader bench with {} threads failed (see above)", threads));
  }
  return json::parse(out);
}

/// Images/s and RSS over the pool for each thread count: a table, a CSV and
/// a plot (PREFIX.csv, PREFIX.png), the bound being pool + 64 MiB.
int run_threads_bench(const pl::LoaderConfig& config, const std::vector<unsigned>& counts, std::size_t epochs,
                      std::size_t repeat, std::size_t ceiling_files, const std::string& out, bool as_json) {
  const auto dataset = pl::open_dataset(config.dataset, config.list_root);  // a bad --data fails here, once
  json rows = json::array();
  std::string csv = "threads,images_per_s,matching_decode_images_per_s,overhead,rss_mib,pool_mib,over_pool_mib\n";
  for (const unsigned t : counts) {
    const json r = loader_bench_in_child(config, t, epochs, repeat, ceiling_files);
    const auto& m = r["memory"];
    const double pool_mib =
        (m["pool_pinned_bytes"].get<double>() + m["pool_pageable_bytes"].get<double>()) / (1024.0 * 1024.0);
    const double rss = m["loading_rss_mib_max"].get<double>();
    json row = {{"threads", t},
                {"images_per_s", r["loader"]["images_per_s"]},
                {"matching_decode_images_per_s", r["ceiling"]["planned_images_per_s"]},
                {"overhead_vs_planned_decode", r["overhead_vs_planned_decode"]},
                {"loading_rss_mib", rss},
                {"pool_mib", pool_mib},
                {"rss_over_pool_mib", rss - pool_mib}};
    csv += fmt::format("{},{:.1f},{:.1f},{:.4f},{:.1f},{:.1f},{:.1f}\n", t, row["images_per_s"].get<double>(),
                       row["matching_decode_images_per_s"].get<double>(), row["overhead_vs_planned_decode"].get<double>(),
                       rss, pool_mib, rss - pool_mib);
    rows.push_back(std::move(row));
  }
  const std::string commands =
      "set key below\nset xlabel 'loader threads'\nset logscale x 2\n"
      "set ylabel 'images/s'\nset y2label 'RSS while loading, over the pool (MiB)'\nset ytics nomirror\nset y2tics\n"
      "set yrange [0:*]\nset y2range [0:80]\n"
      "set title 'pinfeed-bench threads: throughput and memory against the thread count'\n"
      "plot '{csv}' using 1:2 skip 1 with linespoints lw 2 title 'loader images/s', "
      "'{csv}' using 1:3 skip 1 with linespoints dt 2 title 'matching decode images/s', "
      "'{csv}' using 1:7 skip 1 axes x1y2 with linespoints lw 2 title 'RSS over the pool', "
      "64 axes x1y2 with lines dt 3 lc rgb 'red' title 'bound: pool + 64 MiB'\n";
  const std::string png = pinfeed::tools::write_plot(out, csv, commands, "pinfeed-bench");
  if (as_json) {
    fmt::print("{}\n", json{{"dataset", dataset->summary()}, {"rows", rows}, {"csv", out + ".csv"}, {"png", png}}.dump(2));
    return 0;
  }
  fmt::print("pinfeed-bench threads: {}\n", dataset->summary());
  fmt::print("  (each count in its own process: pinfeed-bench loader --repeat {} --epochs {}, medians)\n", repeat, epochs);
  fmt::print("  {:>7} {:>12} {:>16} {:>9} {:>10} {:>10} {:>10}\n", "threads", "images/s", "matching decode", "overhead",
             "RSS MiB", "pool MiB", "over pool");
  for (const auto& row : rows) {
    fmt::print("  {:>7} {:>12.1f} {:>16.1f} {:>+8.1f}% {:>10.1f} {:>10.1f} {:>10.1f}\n", row["threads"].get<unsigned>(),
               row["images_per_s"].get<double>(), row["matching_decode_images_per_s"].get<double>(),
               row["overhead_vs_planned_decode"].get<double>() * 100, row["loading_rss_mib"].get<double>(),
               row["pool_mib"].get<double>(), row["rss_over_pool_mib"].get<double>());
  }
  fmt::print("  data: {}.csv{}\n", out, png.empty() ? "" : fmt::format(", plot: {}", png));
  return 0;
}

/// Host-to-device copies through the trainer's backend, from a pinned buffer
/// and from a pageable one of the same size: what a pool slot costs once
/// pressure has moved it to pageable memory.
int run_copy_bench(const std::string& device, std::size_t mib, std::size_t repeat, bool as_json) {
  namespace pt = pinfeed::trainer;
  const pt::DeviceSpec spec = pt::parse_devices(device);
  if (spec.count != 1 && !spec.all) throw pinfeed::ConfigError("copy: give one device (cpu or cuda:N)");
  const pt::DeviceType& type = pt::device_type(spec.kind);
  std::unique_ptr<pt::DeviceBackend> backend =
      type.make_backend(type.indexed && !spec.devices.empty() ? spec.devices.front() : 0, pt::BackendOptions{});
  backend->make_current();  // this thread drives the device
  const std::size_t bytes = mib << 20U;
  pinfeed::memory::PinnedResource pinned;
  pinfeed::memory::PageableResource pageable;
  void* hp = pinned.allocate(bytes, 4096);
  void* hq = pageable.allocate(bytes, 4096);
  std::memset(hp, 1, bytes);
  std::memset(hq, 1, bytes);
  auto dev = backend->allocate(bytes);
  auto stream = backend->create_stream();
  const auto time_copy = [&](void* src) {
    const auto t0 = std::chrono::steady_clock::now();
    backend->copy_h2d(*stream, dev.get(), src, bytes);
    backend->synchronize(*stream);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<double> tp, tq;
  for (std::size_t r = 0; r < repeat + 1; ++r) {  // the first round warms up
    const double a = time_copy(hp), b = time_copy(hq);
    if (r == 0) continue;
    tp.push_back(a);
    tq.push_back(b);
  }
  const double mp = median(tp), mq = median(tq);
  const double gp = static_cast<double>(bytes) / mp / 1e9, gq = static_cast<double>(bytes) / mq / 1e9;
  pinned.deallocate(hp, bytes, 4096);
  pageable.deallocate(hq, bytes, 4096);
  if (as_json) {
    fmt::print("{}\n", json{{"device", backend->name()}, {"bytes", bytes}, {"repeat", repeat},
                            {"pinned_seconds", mp}, {"pageable_seconds", mq}, {"pinned_gb_per_s", gp},
                            {"pageable_gb_per_s", gq}, {"pageable_over_pinned", mq / mp}}.dump(2));
    return 0;
  }
  fmt::print("pinfeed-bench copy: {} MiB host -> {} (medians of {})\n", mib, backend->name(), repeat);
  fmt::print("  from pinned memory     {:8.3f} ms  {:6.2f} GB/s\n", mp * 1e3, gp);
  fmt::print("  from pageable memory   {:8.3f} ms  {:6.2f} GB/s   ({:.2f}x the pinned time)\n", mq * 1e3, gq, mq / mp);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pinfeed-bench: loader throughput against the decode ceiling; host-to-device copy costs"};
  app.require_subcommand(1);
  pl::LoaderConfig config;
  config.watch_pressure = true;
  std::size_t epochs = 1, repeat = 3, ceiling_files = 200;
  bool as_json = false, no_roi = false, no_dct = false;
  std::string crop = "random", layout = "nchw-f32";
  auto* ld = app.add_subcommand("loader", "images/s of the loader and of a bare full decode, same files, same run");
  // What the loader is asked to do, the same flags for every loader subcommand.
  const auto add_loader_options = [&](CLI::App* sub) {
    sub->add_option("--data", config.dataset, "folder, file list or tar shard pattern")->required();
    sub->add_option("--batch", config.batch_size, "batch size")->check(CLI::Range(1, 65536));
    sub->add_option("--prefetch", config.prefetch, "batches in flight (pool slots)")
        ->check(CLI::Range(std::size_t{1}, pl::kMaxPrefetch));
    sub->add_option("--crop", crop, "random (RandomResizedCrop), center (Resize+CenterCrop), full")
        ->check(CLI::IsMember({"random", "center", "full"}));
    sub->add_option("--size", config.transform.size, "output size")->check(CLI::Range(pl::kMinImageSize, pl::kMaxImageSize));
    sub->add_option("--layout", layout, "nchw-f32 (normalized) or nhwc-u8")->check(CLI::IsMember({"nchw-f32", "nhwc-u8"}));
    sub->add_option("--max-replaced-share", config.max_replaced_share,
                    "share of an epoch that bad samples may replace before it fails")
        ->check(CLI::Range(0.0, 1.0))
        ->capture_default_str();
  };
  add_loader_options(ld);
  ld->add_option("--threads", config.threads, "worker threads (0: every core)");
  ld->add_option("--epochs", epochs, "loader epochs per round")->check(CLI::Range(1, 1000));
  ld->add_option("--repeat", repeat, "rounds (ceiling + loader); figures are medians")->check(CLI::Range(1, 100));
  ld->add_option("--ceiling-files", ceiling_files, "files decoded for the ceiling")->check(CLI::Range(1, 100000));
  ld->add_flag("--no-roi", no_roi, "decode whole images, crop in memory (to measure ROI decoding)");
  ld->add_flag("--no-dct-scale", no_dct, "never decode at 1/2, 1/4, 1/8 (to measure DCT scaling)");
  ld->add_flag("--json", as_json, "print JSON");
  std::size_t floor_repeat = 5, evict_mib = 512;
  auto* fl = app.add_subcommand("floor", "the loader's unavoidable work besides decoding, each part alone");
  add_loader_options(fl);  // --batch x --prefetch: the pool the output is written to
  fl->add_option("--threads", config.threads, "threads of the matching decode (0: every core)");
  fl->add_option("--repeat", floor_repeat, "rounds; figures are medians")->check(CLI::Range(1, 100));
  fl->add_option("--evict-mib", evict_mib, "written before each read pass, to push the files out of the CPU caches")
      ->check(CLI::Range(1, 65536));
  fl->add_flag("--json", as_json, "print JSON");
  std::vector<unsigned> thread_counts{1, 2, 4, 8};
  std::string threads_out = "pinfeed-threads";
  auto* th = app.add_subcommand("threads", "images/s and RSS over the pool for each thread count: table, CSV, plot");
  add_loader_options(th);
  th->add_option("--counts", thread_counts, "thread counts, comma separated")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024));
  th->add_option("--epochs", epochs, "loader epochs per round")->check(CLI::Range(1, 1000));
  th->add_option("--repeat", repeat, "rounds per count; figures are medians")->check(CLI::Range(1, 100));
  th->add_option("--ceiling-files", ceiling_files, "files decoded for the matching decode")->check(CLI::Range(1, 100000));
  th->add_option("--out", threads_out, "prefix of the CSV and the PNG");
  th->add_flag("--json", as_json, "print JSON");
  std::string copy_device = "cpu";
  std::size_t copy_mib = 64, copy_repeat = 5;
  auto* cp = app.add_subcommand("copy", "host-to-device copy time from pinned and from pageable memory");
  cp->add_option("--device", copy_device, "cpu or cuda:N");
  cp->add_option("--mib", copy_mib, "bytes per copy, MiB")->check(CLI::Range(1, 16384));
  cp->add_option("--repeat", copy_repeat, "copies of each kind; medians")->check(CLI::Range(1, 1000));
  cp->add_flag("--json", as_json, "print JSON");

  return pinfeed::tools::run_tool("pinfeed-bench", app, argc, argv, [&] {
    spdlog::set_level(spdlog::level::warn);
    if (cp->parsed()) return run_copy_bench(copy_device, copy_mib, copy_repeat, as_json);
    config.transform.crop = pl::parse_crop_mode(crop);
    config.transform.layout = pl::parse_layout(layout);
    config.transform.roi_decode = !no_roi;
    config.transform.dct_scaling = !no_dct;
    if (fl->parsed()) return run_floor_bench(config, floor_repeat, evict_mib, as_json);
    if (th->parsed()) {
      if (thread_counts.empty()) throw pinfeed::ConfigError("threads: --counts needs at least one thread count");
      return run_threads_bench(config, thread_counts, epochs, repeat, ceiling_files, threads_out, as_json);
    }
    return run_loader_bench(config, epochs, repeat, ceiling_files, as_json);
  });
}
