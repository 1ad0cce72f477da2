#include "pinfeed/loader/dataset_tools.hpp"

#include "pinfeed/loader/loader.hpp"

#include <fmt/format.h>
#include <oneapi/tbb/enumerable_thread_specific.h>
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <libyuv/scale_argb.h>
#include <turbojpeg.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <mutex>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/image_decoder.hpp"
#include "pinfeed/loader/streamed.hpp"
#include "pinfeed/loader/synthetic.hpp"
#include "pinfeed/loader/tar_writer.hpp"

namespace fs = std::filesystem;

namespace pinfeed::loader {

namespace {

/// Calls progress at most ~200 times, from one thread at a time.
class ProgressReporter {
 public:
  ProgressReporter(const Progress& p, std::size_t total)
      : progress_(p), total_(total), step_(std::max<std::size_t>(1, total / 200)) {}
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
  oneapi::tbb::global_control control(oneapi::tbb::global_control::max_allowed_parallelism,
                                      static_cast<std::size_t>(t));
  oneapi::tbb::task_arena arena(t);
  arena.execute([&] {
    oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, n),
                              [&](const oneapi::tbb::blocked_range<std::size_t>& r) {
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
  if (per_class < 1 || per_class > 100000)
    throw ConfigError(fmt::format("per-class must be 1..100000, got {}", per_class));
  if (!(val_fraction >= 0 && val_fraction <= 0.9))
    throw ConfigError(fmt::format("val fraction must be 0..0.9, got {}", val_fraction));
  if (quality < 1 || quality > 100) throw ConfigError(fmt::format("quality must be 1..100, got {}", quality));
  (void)parse_image_format(format, "synthetic dataset: format");
  if (style != "photo" && style != "texture") {
    throw ConfigError(fmt::format("style must be photo or texture, got '{}'", style));
  }
  if (style == "texture" && classes > kTextureClasses) {
    throw ConfigError(
        fmt::format("style texture has {} distinct classes (4 patterns x 5 scales), not {}: ask for at "
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
                   fmt::format("{:06}.{}", n, extension(parse_image_format(c.format, "format"))),
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

void PackConfig::validate() const {
  if (per_shard == 0) throw ConfigError("pack: samples per shard must be >= 1");
  if (max_side != 0 && (max_side < kMinImageSize || max_side > kMaxPackSide)) {
    throw ConfigError(fmt::format("pack: max side must be 0 (keep every file) or {}..{}, got {}", kMinImageSize,
                                  kMaxPackSide, max_side));
  }
  if (quality < 1 || quality > 100) throw ConfigError(fmt::format("pack: quality must be 1..100, got {}", quality));
}

namespace {

/// Collects a decoded region's rows into one tightly packed BGRA image.
class CollectRows final : public RowSink {
 public:
  std::vector<std::uint8_t> pixels;
  int width = 0, height = 0;

  void begin(int w, int h) override {
    width = w;
    height = h;
    pixels.resize(static_cast<std::size_t>(w) * static_cast<std::size_t>(h) * 4);
    y_ = 0;
  }
  void row(const std::uint8_t* bgra) override {
    if (y_ >= height) return;
    std::memcpy(pixels.data() + static_cast<std::size_t>(y_) * static_cast<std::size_t>(width) * 4, bgra,
                static_cast<std::size_t>(width) * 4);
    ++y_;
  }

 private:
  int y_ = 0;
};

std::vector<std::byte> encode_bgra_jpeg(const std::uint8_t* bgra, int width, int height, int quality, bool gray,
                                        const std::string& name) {
  tjhandle h = tjInitCompress();
  if (h == nullptr) throw Error("TurboJPEG: tjInitCompress failed");
  unsigned char* jpeg = nullptr;
  unsigned long size = 0;
  const int rc = tjCompress2(h, bgra, width, width * 4, height, TJPF_BGRA, &jpeg, &size,
                             gray ? TJSAMP_GRAY : TJSAMP_420, quality, 0);
  if (rc != 0) {
    const std::string why = tjGetErrorStr2(h);
    tjFree(jpeg);
    tjDestroy(h);
    throw DataError(name, fmt::format("re-encoding at {}x{} failed: TurboJPEG: {}", width, height, why));
  }
  std::vector<std::byte> out(reinterpret_cast<std::byte*>(jpeg), reinterpret_cast<std::byte*>(jpeg) + size);
  tjFree(jpeg);
  tjDestroy(h);
  return out;
}

}  // namespace

bool shrink_image(ImageDecoder& decoder, std::span<const std::byte> data, int max_side, int quality,
                  std::vector<std::byte>& out, const std::string& name) {
  const ImageHeader h = decoder.header(data, name);
  const int longer = std::max(h.width, h.height);
  if (max_side <= 0 || longer <= max_side) return false;
  // The target: the longer side exactly max_side, the other in proportion.
  const double f = static_cast<double>(max_side) / longer;
  const int out_w = h.width >= h.height ? max_side : std::max(1, static_cast<int>(std::lround(h.width * f)));
  const int out_h = h.width >= h.height ? std::max(1, static_cast<int>(std::lround(h.height * f))) : max_side;
  CollectRows image;
  decoder.decode_planned(
      data,
      [&](const ImageHeader& hdr) {
        int scale = 1;  // JPEG only: the largest DCT scale still covering the target
        for (const int s : {8, 4, 2}) {
          if (hdr.width / s >= out_w && hdr.height / s >= out_h) {
            scale = s;
            break;
          }
        }
        return JpegDecoder::Plan{Region{0, 0, hdr.width, hdr.height}, scale};
      },
      image, name);
  std::vector<std::uint8_t> half;
  // Exact 2:1 box averages while the shrink exceeds 2x, then bilinear.
  while (image.width / 2 >= out_w && image.height / 2 >= out_h && (image.width > out_w || image.height > out_h)) {
    const int w = image.width / 2, hh = image.height / 2;
    half.resize(static_cast<std::size_t>(w) * static_cast<std::size_t>(hh) * 4);
    libyuv::ARGBScale(image.pixels.data(), image.width * 4, image.width & ~1, image.height & ~1, half.data(), w * 4, w,
                      hh, libyuv::kFilterBox);
    image.pixels.swap(half);
    image.width = w;
    image.height = hh;
  }
  const std::uint8_t* pixels = image.pixels.data();
  if (image.width != out_w || image.height != out_h) {
    half.resize(static_cast<std::size_t>(out_w) * static_cast<std::size_t>(out_h) * 4);
    const int rc = libyuv::ARGBScale(image.pixels.data(), image.width * 4, image.width, image.height, half.data(),
                                     out_w * 4, out_w, out_h, libyuv::kFilterBilinear);
    if (rc != 0) {
      throw DataError(name, fmt::format("shrinking {}x{} to {}x{} failed (libyuv ARGBScale: {})", image.width,
                                        image.height, out_w, out_h, rc));
    }
    pixels = half.data();
  }
  // A grayscale JPEG stays one channel (BGRA rows of a gray image have B = G = R).
  out = encode_bgra_jpeg(pixels, out_w, out_h, quality, h.color_space == "gray", name);
  return true;
}

PackSummary pack_shards(const Dataset& dataset, const fs::path& prefix, const PackConfig& config,
                        const Progress& progress) {
  config.validate();
  if (!prefix.parent_path().empty()) fs::create_directories(prefix.parent_path());
  const std::size_t n = dataset.size();
  const std::size_t per_shard = config.per_shard;
  const std::size_t shards = (n + per_shard - 1) / per_shard;
  ProgressReporter report(progress, n);
  PackSummary summary;
  summary.samples = n;
  // One shard's samples are read (and, with max_side, shrunk on every
  // core) into memory, then written in order.
  struct Sample {
    std::vector<std::byte> bytes;
    ImageFormat format = ImageFormat::unknown;
    std::size_t read_bytes = 0;
    bool resized = false;
  };
  const std::size_t chunk = 8 * static_cast<std::size_t>(default_threads(config.threads));
  std::vector<Sample> samples(config.max_side > 0 ? std::max<std::size_t>(1, std::min({n, per_shard, chunk})) : 1);
  oneapi::tbb::enumerable_thread_specific<std::unique_ptr<ImageDecoder>> decoders;
  const auto load = [&](std::size_t i, Sample& s) {
    dataset.read(i, s.bytes);
    s.read_bytes = s.bytes.size();
    s.format = sniff_format(s.bytes);
    s.resized = false;
    if (s.format == ImageFormat::unknown) {
      throw DataError(dataset.describe(i), fmt::format("not a {} image: pack refuses it (`pinfeed-data scan` "
                                                       "lists such files)",
                                                       codec_names()));
    }
    if (config.max_side > 0) {
      auto& d = decoders.local();
      if (!d) d = std::make_unique<ImageDecoder>();
      std::vector<std::byte> shrunk;
      if (shrink_image(*d, s.bytes, config.max_side, config.quality, shrunk, dataset.describe(i))) {
        s.bytes.swap(shrunk);
        s.format = ImageFormat::jpeg;
        s.resized = true;
      }
    }
    report.tick();
  };
  const auto add = [&](TarWriter& tar, std::size_t i, const Sample& s) {
    const std::string key = fmt::format("{:09}", i);
    tar.add(fmt::format("{}.{}", key, extension(s.format)), s.bytes);
    const std::string label = std::to_string(dataset.label(i));
    tar.add(key + ".cls", std::as_bytes(std::span(label)));
    summary.bytes_in += s.read_bytes;
    summary.bytes_out += s.bytes.size();
    summary.resized += s.resized ? 1U : 0U;
  };
  for (std::size_t sh = 0; sh < shards; ++sh) {
    const std::size_t first = sh * per_shard, count = std::min(n, first + per_shard) - first;
    if (config.max_side > 0) {
      // A chunk of samples at a time is shrunk on every core, then written
      // in order: memory holds one chunk, whatever the shard size.
      TarWriter tar(fs::path(prefix.string() + fmt::format("-{:06}.tar", sh)));
      for (std::size_t at = 0; at < count; at += samples.size()) {
        const std::size_t m = std::min(samples.size(), count - at);
        run_parallel(config.threads, m, [&](std::size_t k) { load(first + at + k, samples[k]); });
        for (std::size_t k = 0; k < m; ++k) add(tar, first + at + k, samples[k]);
      }
      tar.finish();
      write_shard_index(fs::path(prefix.string() + fmt::format("-{:06}.tar", sh)));  // Note [Streamed shards]
    } else {
      // The files as they are, one at a time (never a shard in memory).
      TarWriter tar(fs::path(prefix.string() + fmt::format("-{:06}.tar", sh)));
      for (std::size_t k = 0; k < count; ++k) {
        load(first + k, samples[0]);
        add(tar, first + k, samples[0]);
      }
      tar.finish();
      write_shard_index(fs::path(prefix.string() + fmt::format("-{:06}.tar", sh)));
    }
  }
  summary.pattern = prefix.string() + (shards == 1 ? "-000000.tar" : fmt::format("-{{000000..{:06}}}.tar", shards - 1));
  return summary;
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
