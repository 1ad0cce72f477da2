// What the pinfeed-bench commands share: RSS, medians, blocks, the decode ceiling.
#include <fmt/format.h>
#include <libyuv/convert_from_argb.h>
#include <libyuv/planar_functions.h>
#include <libyuv/scale_argb.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <turbojpeg.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <oneapi/tbb/info.h>
#include <algorithm>
#include <atomic>
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
Block allocate_block(pinfeed::memory::HostResource& resource, std::size_t bytes) {
  return Block(static_cast<std::byte*>(resource.allocate(bytes)),
               [&resource, bytes](std::byte* p) { resource.deallocate(p, bytes); });
}

/// The loader's own decode work alone (same crop plans, ROI and DCT scale)
/// on `threads` threads at once, files from memory: the "matching" ceiling
/// that the loader's reading, transforms and batching add to.
double planned_decode_rate(const std::vector<std::span<const std::byte>>& files, const pl::TransformConfig& t,
                           unsigned threads) {
  std::atomic<std::size_t> decoded{0};
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
        decoded.fetch_add(1, std::memory_order_relaxed);
      } catch (const pinfeed::DataError&) {
      }
    }
  };
  const double seconds = timed_passes(threads, work, [&] { decoded = 0; });
  // Only the files that decoded count (a PNG or a bad file throws at once).
  return static_cast<double>(decoded.load()) / seconds;
}

namespace {

/// One output row of the bare loop: BGRA to three float planes, normalized,
/// as a plain loop the compiler vectorizes (this file is built with -O3; a
/// flipped row is mirrored by libyuv first): what a hand-written loader does.
void bare_planes(const std::uint8_t* px, int n, const float* scale, const float* bias, float* __restrict r,
                 float* __restrict g, float* __restrict b) {
  for (int x = 0; x < n; ++x) {
    r[x] = static_cast<float>(px[4 * x + 2]) * scale[0] + bias[0];
    g[x] = static_cast<float>(px[4 * x + 1]) * scale[1] + bias[1];
    b[x] = static_cast<float>(px[4 * x]) * scale[2] + bias[2];
  }
}

}  // namespace

double timed_passes(unsigned threads, const std::function<void(unsigned)>& work, const std::function<void()>& reset) {
  const auto run_all = [&] {
    std::vector<std::thread> pool;
    for (unsigned k = 0; k < threads; ++k) pool.emplace_back(work, k);
    for (auto& th : pool) th.join();
  };
  run_all();  // warm caches
  reset();
  const auto t0 = Clock::now();
  for (int rep = 0; rep < 2; ++rep) run_all();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

BareBatch::BareBatch(const pl::TransformConfig& t, unsigned threads, std::size_t batch)
    : n_(t.out_width()),
      rows_(t.out_height()),
      layout_(t.layout),
      threads_(threads),
      sample_(t.sample_bytes()),
      per_thread_(std::max<std::size_t>(1, batch / threads)),
      out_(allocate_block(memory_, per_thread_ * threads * sample_)) {
  std::memset(out_.get(), 0, per_thread_ * threads * sample_);
  for (std::size_t c = 0; c < 3; ++c) {
    scale_[c] = 1.0F / (255.0F * t.std[c]);
    bias_[c] = -t.mean[c] / t.std[c];
  }
}

std::byte* BareBatch::next_place(unsigned k, std::size_t& mine) const {
  return out_.get() + (k + threads_ * (mine++ % per_thread_)) * sample_;
}

void BareBatch::write(const std::uint8_t* bgra, bool flip, std::uint8_t* mirrored, std::byte* place) const {
  const int n = n_, rows = rows_;
  const auto un = static_cast<std::size_t>(n);
  for (int y = 0; y < rows; ++y) {
    const auto at = static_cast<std::size_t>(y) * un;
    const std::uint8_t* r = bgra + at * 4;
    if (flip) {
      libyuv::ARGBMirror(r, 0, mirrored, 0, n, 1);
      r = mirrored;
    }
    if (layout_ == pl::Layout::nchw_f32) {
      auto* dst = reinterpret_cast<float*>(place);
      const auto plane = un * static_cast<std::size_t>(rows);
      bare_planes(r, n, scale_, bias_, dst + at, dst + plane + at, dst + 2 * plane + at);
    } else {
      libyuv::ARGBToRAW(r, 0, reinterpret_cast<std::uint8_t*>(place) + at * 3, 0, n, 1);
    }
  }
}

double bare_loop_rate(const std::vector<std::span<const std::byte>>& files, const pl::TransformConfig& t,
                      unsigned threads, std::size_t batch) {
  const int n = t.out_width(), rows = t.out_height();
  const BareBatch out(t, threads, batch);
  std::atomic<std::size_t> decoded{0};
  const auto work = [&](unsigned k) {
    pl::JpegDecoder decoder;
    pl::DecodedImage image;
    std::vector<std::uint8_t> scaled(static_cast<std::size_t>(n) * static_cast<std::size_t>(rows) * 4);
    std::vector<std::uint8_t> mirrored(static_cast<std::size_t>(n) * 4);
    std::size_t mine = 0;  // samples this thread has written
    for (std::size_t i = k; i < files.size(); i += threads) {
      pl::SampleRng rng(0, 0, i);
      bool flip = false;
      try {
        decoder.decode_planned(
            files[i],
            [&](const pl::ImageHeader& h) {
              const pl::CropPlan p = pl::plan_crop(h, t, rng);
              flip = p.flip;
              return pl::JpegDecoder::Plan{p.region, p.scale};
            },
            image, "bare loop");
      } catch (const pinfeed::DataError&) {
        continue;
      }
      libyuv::ARGBScale(image.row(0), static_cast<int>(image.stride_bytes()), image.width, image.height, scaled.data(),
                        n * 4, n, rows, libyuv::kFilterBilinear);
      out.write(scaled.data(), flip, mirrored.data(), out.next_place(k, mine));
      decoded.fetch_add(1, std::memory_order_relaxed);
    }
  };
  const double seconds = timed_passes(threads, work, [&] { decoded = 0; });
  return static_cast<double>(decoded.load()) / seconds;
}

/// Full decode of up to `limit` files, one thread, TurboJPEG's defaults.
Ceiling decode_ceiling(const pl::Dataset& data, std::size_t limit, const pl::TransformConfig& transform,
                       unsigned threads, std::size_t batch) {
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
    if (one.size() != sizes[k])
      throw pinfeed::Error(fmt::format("{} changed size while benchmarking", data.describe(picked[k])));
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
  if (files.empty())
    throw pinfeed::DataError(data.describe(0), "no file of the dataset could be read for the decode ceiling");
  const auto count = static_cast<double>(files.size());
  Ceiling c{files.size(), count / s, pixels / count / 1e6, planned_decode_rate(files, transform, threads),
            bare_loop_rate(files, transform, threads, batch)};
  c.bare_loop_raw_images_per_s = bare_loop_raw_rate(files, transform, threads, batch, &c.raw_eligible_share);
  return c;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int emit_report(const json& j, bool as_json, void (*print)(const json&)) {
  if (as_json) {
    fmt::print("{}\n", j.dump(2));
  } else {
    print(j);
  }
  return 0;
}

}  // namespace pinfeed::bench
