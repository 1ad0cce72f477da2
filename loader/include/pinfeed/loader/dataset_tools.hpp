#pragma once
// The work behind `pinfeed-data`: make a synthetic dataset, pack an
// ImageFolder into tar shards, scan a dataset for files that will not
// decode. Each runs on every core (oneTBB) and reports progress through a
// callback (done, total), called from one thread at a time.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/image_decoder.hpp"

namespace pinfeed::loader {

using Progress = std::function<void(std::size_t done, std::size_t total)>;

struct SyntheticDatasetConfig {
  std::filesystem::path out;  ///< created; train/ and (if val_fraction > 0) val/ inside
  int classes = 10;           ///< 1..1000
  int per_class = 100;        ///< images per class, before the split
  double val_fraction = 0.0;  ///< share of each class written to val/, [0, 0.9]
  std::uint64_t seed = 0;
  int quality = 90;             ///< JPEG (and lossy WebP) quality 1..100
  std::string format = "jpeg";  ///< jpeg (.jpg), png (.png) or webp (.webp)
  std::string style = "photo";  ///< photo or texture (synthetic.hpp's ImageStyle)
  unsigned threads = 0;         ///< 0: every core
  void validate() const;        ///< ConfigError naming the field
};

struct SyntheticDatasetSummary {
  std::size_t train_files = 0, val_files = 0;
  std::uint64_t bytes = 0;
};

SyntheticDatasetSummary write_synthetic_dataset(const SyntheticDatasetConfig& config, const Progress& progress = {});

struct PackConfig {
  std::size_t per_shard = 1000;  ///< samples per shard, >= 1
  /// 0: every file as it is. Otherwise an image whose longer side exceeds
  /// it is decoded (JPEG at the largest DCT scale that keeps the longer side
  /// >= max_side), shrunk to a longer side of exactly max_side (exact 2:1
  /// box averages, then bilinear) and re-encoded as a baseline 4:2:0 JPEG
  /// (grayscale stays grayscale) at `quality`; metadata (EXIF, ICC) is not
  /// kept. Smaller images keep their bytes (not decoded: `pinfeed-data scan`
  /// checks them). FFCV's max_resolution:
  /// training then decodes fewer pixels. kMinImageSize..kMaxPackSide.
  int max_side = 0;
  int quality = 90;       ///< 1..100, for re-encoded images
  unsigned threads = 0;   ///< re-encoding threads (0: every core); 8 images per thread are held at a time
  void validate() const;  ///< ConfigError naming the field
};
inline constexpr int kMaxPackSide = 16384;

struct PackSummary {
  std::string pattern;  ///< brace pattern naming the shards
  std::size_t samples = 0, resized = 0;
  std::uint64_t bytes_in = 0, bytes_out = 0;  ///< image bytes read and written
};

/// Writes `dataset` (usually an ImageFolder) as shards prefix-000000.tar, ...
/// with `per_shard` samples each (key.jpg + key.cls), in the dataset's
/// order. Throws DataError (naming the sample) on unreadable or undecodable
/// samples or write errors; a shard is complete or absent.
PackSummary pack_shards(const Dataset& dataset, const std::filesystem::path& prefix, const PackConfig& config,
                        const Progress& progress = {});

/// One image shrunk as pack does it: its bytes unchanged (returns false)
/// when its longer side is at most `max_side`, else `out` receives the
/// re-encoded JPEG (returns true). DataError(name, reason) for a bad image.
bool shrink_image(ImageDecoder& decoder, std::span<const std::byte> data, int max_side, int quality,
                  std::vector<std::byte>& out, const std::string& name);

struct BadSample {
  std::size_t index = 0;
  std::string where;  ///< path or shard:member
  std::string reason;
};

/// Reads and fully decodes every sample; returns the ones that fail, in
/// index order.
std::vector<BadSample> scan_dataset(const Dataset& dataset, unsigned threads = 0, const Progress& progress = {});

}  // namespace pinfeed::loader
