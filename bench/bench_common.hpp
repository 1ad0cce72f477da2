#pragma once
// What the pinfeed-bench commands share, and the commands themselves (one
// file each: loader_bench.cpp, floor_bench.cpp, threads_bench.cpp,
// copy_bench.cpp; the command line in bench_main.cpp).
#include <chrono>
#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/loader.hpp"
#include "pinfeed/loader/transform.hpp"
#include "pinfeed/memory/host_resource.hpp"
#include "pinfeed/memory/pageable_resource.hpp"

namespace pinfeed::bench {

namespace pl = pinfeed::loader;
using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

/// Peak resident set size of this process so far, MiB.
double peak_rss_mib();
/// Resident set size now, MiB (/proc/self/statm), sampled once per batch.
double rss_now_mib();
double median(std::vector<double> v);

/// A mapping from a HostResource, returned to it when the Block goes.
using Block = std::unique_ptr<std::byte, std::function<void(std::byte*)>>;
Block allocate_block(pinfeed::memory::HostResource& resource, std::size_t bytes);

struct Ceiling {
  std::size_t files = 0;
  double single_thread_images_per_s = 0;
  double megapixels_per_image = 0;
  double planned_images_per_s = 0;        ///< all threads, decoding only what the loader decodes
  double bare_loop_images_per_s = 0;      ///< all threads, the bare loop (bare_loop_rate)
  double bare_loop_raw_images_per_s = 0;  ///< all threads, the raw-YCbCr bare loop (eligible files only)
  double raw_eligible_share = 0;          ///< files the raw loop can decode (baseline YCbCr 4:2:0/4:2:2/4:4:4)
};
/// The loader's own decode work alone (same crop plans, ROI and DCT scale)
/// on `threads` threads at once, files from memory.
double planned_decode_rate(const std::vector<std::span<const std::byte>>& files, const pl::TransformConfig& t,
                           unsigned threads);
/// The bare loop of pinfeed's decode path on `threads` threads, files from
/// memory, no pipeline: the same planned ROI decode at the same DCT scale
/// into a reused image, libyuv's bilinear ARGBScale of it to the output
/// size, then flip + normalize to float32 NCHW (or RGB for uint8 NHWC) with
/// plain loops into the next place of one reused, pre-faulted batch of
/// `batch` samples (each thread its own places). What a hand-written loop
/// of the same decode does; the loader's target (float32 >=
/// 0.95x of it). It does less than the loader where the decoded region is
/// over twice the output (no 2:1 box averages: bilinear alone aliases) and
/// ignores --interpolation nearest and --no-roi.
double bare_loop_rate(const std::vector<std::span<const std::byte>>& files, const pl::TransformConfig& t,
                      unsigned threads, std::size_t batch);
/// Runs `work(k)` on threads k = 0..threads-1 once to warm the caches, then
/// `reset()`, then twice more, timed; returns those two passes' seconds.
double timed_passes(unsigned threads, const std::function<void(unsigned)>& work, const std::function<void()>& reset);

/// The bare loops' batch: allocated and touched once, reused; thread k
/// writes only its own places k, k + threads, ... (at least one each), as a
/// loader's threads fill the places of a batch.
class BareBatch {
 public:
  BareBatch(const pl::TransformConfig& t, unsigned threads, std::size_t batch);
  /// Thread k's next place (`mine` counts its samples so far).
  std::byte* next_place(unsigned k, std::size_t& mine) const;
  /// The output step: BGRA rows (out_width x out_height) flipped when asked
  /// and written as float32 NCHW (normalized) or uint8 RGB NHWC to `place`;
  /// `mirrored` holds one row.
  void write(const std::uint8_t* bgra, bool flip, std::uint8_t* mirrored, std::byte* place) const;

 private:
  int n_, rows_;
  pl::Layout layout_;
  unsigned threads_;
  std::size_t sample_, per_thread_;
  float scale_[3], bias_[3];
  pinfeed::memory::PageableResource memory_;
  Block out_;
};
/// The bare loop decoding raw YCbCr planes instead (libjpeg raw_data_out,
/// raw_loop.cpp): the same plans and DCT scale, whole rows (libjpeg cannot
/// crop columns or skip rows in raw mode) down to the region's last row
/// only; each plane's region box-filtered to the output size (libyuv
/// ScalePlane), colour converted at the output size (libyuv J4xxToARGB, full
/// range), then the same output step. Baseline YCbCr 4:2:0, 4:2:2 and 4:4:4
/// files only (the share in `eligible_share`); images/s of those.
double bare_loop_raw_rate(const std::vector<std::span<const std::byte>>& files, const pl::TransformConfig& t,
                          unsigned threads, std::size_t batch, double* eligible_share);
/// Full decode of up to `limit` files, one thread, TurboJPEG's defaults;
/// the planned (matching) decode and the bare loop on `threads` threads.
Ceiling decode_ceiling(const pl::Dataset& data, std::size_t limit, const pl::TransformConfig& transform,
                       unsigned threads, std::size_t batch);

/// Prints `j` as JSON, or as the command's table (`print`, which reads it);
/// returns the exit code, 0.
int emit_report(const json& j, bool as_json, void (*print)(const json&));

// The commands: each prints a table or JSON and returns the exit code.
int run_loader_bench(pl::LoaderConfig config, std::size_t epochs, std::size_t repeat, std::size_t ceiling_files,
                     bool as_json);
int run_floor_bench(const pl::LoaderConfig& config, std::size_t repeat, std::size_t evict_mib, bool as_json);
int run_threads_bench(const pl::LoaderConfig& config, const std::vector<unsigned>& counts, std::size_t epochs,
                      std::size_t repeat, std::size_t ceiling_files, const std::string& out_prefix, bool as_json);
int run_copy_bench(const std::string& device, std::size_t mib, std::size_t repeat, bool as_json);
int run_remote_bench(const pl::LoaderConfig& config, const std::string& local, const std::filesystem::path& cache_dir,
                     std::size_t repeat, bool as_json);

}  // namespace pinfeed::bench
