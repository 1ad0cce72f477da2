#include "pinfeed/loader/dataset_tools.hpp"

#include "pinfeed/loader/loader.hpp"

#include <fmt/format.h>
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/enumerable_thread_specific.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <atomic>
#include <fstream>
#include <mutex>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/image_decoder.hpp"
#include "pinfeed/loader/synthetic.hpp"
#include "pinfeed/loader/tar_writer.hpp"

namespace fs = std::filesystem;

namespace pinfeed::loader {

namespace {

/// Calls progress at most ~200 times, from one thread at a time.
class ProgressReporter {
 public:
  ProgressReporter(const Progress& p, std::size_t total) : progress_(p), total_(total), step_(std::max<std::size_t>(1, total / 200)) {}
  void tick() {
    const std::size_t n = ++done_;
    if (!progress_ || (n % step_ != 0 && n != total_)) return;
    const std::scoped_lock lock(mutex_);
    progress_(n, total_);
  }

 private:
  const Progress& progress_;
  std::size_t total_, step_;
  std::atomic<std::size_t> done_{0};
  std::mutex mutex_;
};

template <typename F>
void run_parallel(unsigned threads, std::size_t n, F&& body) {
  const auto t = static_cast<int>(default_threads(threads));
  oneapi::tbb::global_control control(oneapi::tbb::global_control::max_allowed_parallelism, static_cast<std::size_t>(t));
  oneapi::tbb::task_arena arena(t);
  arena.execute([&] {
    oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, n), [&](const oneapi::tbb::blocked_range<std::size_t>& r) {
      for (std::size_t i = r.begin(); i != r.end(); ++i) body(i);
    });
  });
}

void write_file(const fs::path& path, std::span<const std::byte> data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  if (!out) throw DataError(path, "write failed (disk full?)");
}

}  // namespace

void SyntheticDatasetConfig::validate() const {
  if (out.empty()) throw ConfigError("synthetic dataset: no output folder");
  if (classes < 1 || classes > 1000) throw ConfigError(fmt::format("classes must be 1..1000, got {}", classes));
  if (per_class < 1 || per_class > 100000) throw ConfigError(fmt::format("per-class must be 1..100000, got {}", per_class));
  if (!(val_fraction >= 0 && val_fraction <= 0.9)) throw ConfigError(fmt::format("val fraction must be 0..0.9, got {}", val_fraction));
  if (quality < 1 || quality > 100) throw ConfigError(fmt::format("quality must be 1..100, got {}", quality));
  if (format != "jpeg" && format != "png" && format != "webp") {
    throw ConfigError(fmt::format("format must be jpeg, png or webp, got '{}'", format));
  }
  if (style != "photo" && style != "texture") {
    throw ConfigError(fmt::format("style must be photo or texture, got '{}'", style));
  }
  if (style == "texture" && classes > kTextureClasses) {
    throw ConfigError(fmt::format("style texture has {} distinct classes (4 patterns x 5 scales), not {}: ask for at "
                                  "most {}",
                                  kTextureClasses, classes, kTextureClasses));
  }
}

SyntheticDatasetSummary write_synthetic_dataset(const SyntheticDatasetConfig& c, const Progress& progress) {
  c.validate();
  const int val_per_class = static_cast<int>(c.per_class * c.val_fraction);
  for (int k = 0; k < c.classes; ++k) {
    fs::create_directories(c.out / "train" / fmt::format("class_{:03}", k));
    if (val_per_class > 0) fs::create_directories(c.out / "val" / fmt::format("class_{:03}", k));
  }
  const auto total = static_cast<std::size_t>(c.classes) * static_cast<std::size_t>(c.per_class);
  std::atomic<std::uint64_t> bytes{0};
  ProgressReporter report(progress, total);
  run_parallel(c.threads, total, [&](std::size_t i) {
    const int klass = static_cast<int>(i / static_cast<std::size_t>(c.per_class));
    const int n = static_cast<int>(i % static_cast<std::size_t>(c.per_class));
    SyntheticImageSpec spec = synthetic_size(c.seed, klass, static_cast<std::uint64_t>(n));
    spec.quality = c.quality;
    spec.style = c.style == "texture" ? ImageStyle::texture : ImageStyle::photo;
    const auto image = make_synthetic_image(c.seed, klass, static_cast<std::uint64_t>(n), spec, c.format);
    const bool val = n >= c.per_class - val_per_class;
    write_file(c.out / (val ? "val" : "train") / fmt::format("class_{:03}", klass) /
                   fmt::format("{:06}.{}", n, c.format == "jpeg" ? "jpg" : c.format),
               image);
    bytes += image.size();
    report.tick();
  });
  SyntheticDatasetSummary s;
  s.val_files = static_cast<std::size_t>(val_per_class) * static_cast<std::size_t>(c.classes);
  s.train_files = total - s.val_files;
  s.bytes = bytes.load();
  return s;
}

std::string pack_shards(const Dataset& dataset, const fs::path& prefix, std::size_t per_shard, const Progress& progress) {
  if (per_shard == 0) throw ConfigError("pack: samples per shard must be > 0");
  if (!prefix.parent_path().empty()) fs::create_directories(prefix.parent_path());
  const std::size_t n = dataset.size();
  const std::size_t shards = (n + per_shard - 1) / per_shard;
  ProgressReporter report(progress, n);
  std::vector<std::byte> buf;
  for (std::size_t s = 0; s < shards; ++s) {
    TarWriter tar(fs::path(prefix.string() + fmt::format("-{:06}.tar", s)));
    for (std::size_t i = s * per_shard; i < std::min(n, (s + 1) * per_shard); ++i) {
      dataset.read(i, buf);
      const std::string key = fmt::format("{:09}", i);
      const ImageFormat format = sniff_format(buf);
      if (format == ImageFormat::unknown) {
        throw DataError(dataset.describe(i), "not a JPEG, PNG or WebP image: pack refuses it (`pinfeed-data scan` lists "
                                             "such files)");
      }
      tar.add(fmt::format("{}.{}", key, extension(format)), buf);
      const std::string label = std::to_string(dataset.label(i));
      tar.add(key + ".cls", std::as_bytes(std::span(label)));
      report.tick();
    }
    tar.finish();
  }
  return prefix.string() + (shards == 1 ? "-000000.tar" : fmt::format("-{{000000..{:06}}}.tar", shards - 1));
}

std::vector<BadSample> scan_dataset(const Dataset& dataset, unsigned threads, const Progress& progress) {
  std::mutex mutex;
  std::vector<BadSample> bad;
  ProgressReporter report(progress, dataset.size());
  // verify() decodes every pixel but keeps only a few rows: a small file
  // whose header claims 13000x13000 costs rows, not 667 MB per thread.
  struct Scratch {
    ImageDecoder decoder;
    std::vector<std::byte> bytes;
  };
  oneapi::tbb::enumerable_thread_specific<std::unique_ptr<Scratch>> local;
  run_parallel(threads, dataset.size(), [&](std::size_t i) {
    auto& s = local.local();
    if (!s) s = std::make_unique<Scratch>();
    try {
      dataset.read(i, s->bytes);
      (void)s->decoder.verify(s->bytes, dataset.describe(i));
    } catch (const DataError& e) {
      const std::scoped_lock lock(mutex);
      bad.push_back(BadSample{i, dataset.describe(i), e.reason()});
    }
    report.tick();
  });
  std::sort(bad.begin(), bad.end(), [](const BadSample& a, const BadSample& b) { return a.index < b.index; });
  return bad;
}

}  // namespace pinfeed::loader
