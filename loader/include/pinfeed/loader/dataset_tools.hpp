#pragma once
// The work behind `pinfeed-data`: make a synthetic dataset, pack an
// ImageFolder into tar shards, scan a dataset for files that will not
// decode. Each runs on every core (oneTBB) and reports progress through a
// callback (done, total), called from one thread at a time.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "pinfeed/loader/dataset.hpp"

namespace pinfeed::loader {

using Progress = std::function<void(std::size_t done, std::size_t total)>;

struct SyntheticDatasetConfig {
  std::filesystem::path out;     ///< created; train/ and (if val_fraction > 0) val/ inside
  int classes = 10;              ///< 1..1000
  int per_class = 100;           ///< images per class, before the split
  double val_fraction = 0.0;     ///< share of each class written to val/, [0, 0.9]
  std::uint64_t seed = 0;
  int quality = 90;              ///< JPEG (and lossy WebP) quality 1..100
  std::string format = "jpeg";   ///< jpeg (.jpg), png (.png) or webp (.webp)
  std::string style = "photo";   ///< photo or texture (synthetic.hpp's ImageStyle)
  unsigned threads = 0;          ///< 0: every core
  void validate() const;         ///< ConfigError naming the field
};

struct SyntheticDatasetSummary {
  std::size_t train_files = 0, val_files = 0;
  std::uint64_t bytes = 0;
};

SyntheticDatasetSummary write_synthetic_dataset(const SyntheticDatasetConfig& config, const Progress& progress = {});

/// Writes `dataset` (usually an ImageFolder) as shards prefix-000000.tar, ...
/// with `per_shard` samples each (key.jpg + key.cls). Returns the brace
/// pattern naming them. Throws DataError on unreadable samples or write errors.
std::string pack_shards(const Dataset& dataset, const std::filesystem::path& prefix, std::size_t per_shard,
                        const Progress& progress = {});

struct BadSample {
  std::size_t index = 0;
  std::string where;   ///< path or shard:member
  std::string reason;
};

/// Reads and fully decodes every sample; returns the ones that fail, in
/// index order.
std::vector<BadSample> scan_dataset(const Dataset& dataset, unsigned threads = 0, const Progress& progress = {});

}  // namespace pinfeed::loader
