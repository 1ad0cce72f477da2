#pragma once
// Remote shards read as streams: a shard's samples are fetched with
// HTTP Range requests in the order the epoch will read them, a bounded number
// of bytes ahead of the loader, so the first batch comes after a few round
// trips, not after the whole set. Note [Streamed shards] (streamed.cpp).
//
// The order, the labels and the sample count come from each shard's index
// sidecar, NAME.tar.index.json, written by `pinfeed-data pack` (and by
// `pinfeed-data index` for shards made elsewhere): the same index TarShards
// builds from the headers, so sample order, torch order, fingerprints and
// resume are exactly the local shards'. A remote shard without a sidecar is
// staged whole instead (remote.hpp).
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/remote.hpp"

namespace pinfeed::memory {
class PressureMonitor;
}

namespace pinfeed::loader {

/// "s3://b/train-000001.tar" -> "s3://b/train-000001.tar.index.json".
[[nodiscard]] std::string shard_index_url(const std::string& shard);

/// The index sidecar of a local shard, as JSON text (TarShards::index with
/// every check; DataError naming the shard).
[[nodiscard]] std::string shard_index_json(const std::filesystem::path& tar,
                                           std::size_t max_classes = kDefaultMaxClasses);

/// Writes `tar`'s sidecar next to it (atomically); returns its path.
std::filesystem::path write_shard_index(const std::filesystem::path& tar, std::size_t max_classes = kDefaultMaxClasses);

/// A sidecar read back: the shard's size and its samples. DataError naming
/// `source` when it is not one, or names a member outside the shard.
struct ShardIndex {
  std::uint64_t size = 0;
  std::vector<TarShards::IndexedSample> samples;
};
[[nodiscard]] ShardIndex parse_shard_index(const std::string& text, const std::string& source, std::size_t max_classes);

class StreamedShards final : public Dataset {
 public:
  /// Shards as given (URLs and local paths, in order). nullptr when some
  /// http(s)/s3 shard has no sidecar (404) or cannot stream (pipe:, a URL
  /// with a query): the caller stages whole shards instead. Throws
  /// RemoteError for any other failure to read a sidecar.
  static std::unique_ptr<StreamedShards> open(const std::vector<std::string>& shards, std::size_t max_classes,
                                              const RemoteConfig& config);
  ~StreamedShards() override;

  [[nodiscard]] std::size_t size() const noexcept override;
  [[nodiscard]] std::int64_t label(std::size_t i) const override;
  [[nodiscard]] std::string describe(std::size_t i) const override;
  void read(std::size_t i, std::vector<std::byte>& out) const override;
  [[nodiscard]] std::size_t num_classes() const noexcept override;
  [[nodiscard]] std::string summary() const override;
  [[nodiscard]] std::string relative_name(std::size_t i) const override;
  [[nodiscard]] std::uint64_t stored_size(std::size_t i) const override;
  void plan(std::span<const std::size_t> order) const override;
  void read_stoppable(std::size_t i, std::vector<std::byte>& out, const std::stop_token& stop) const override;
  [[nodiscard]] std::optional<StreamStats> stream_stats() const override;

  /// Follows `monitor`: the read-ahead bound is a quarter under elevated
  /// pressure and 4 MiB under critical, and fetched samples past the new
  /// bound are given back at once.
  void follow(std::shared_ptr<memory::PressureMonitor> monitor) override;

  struct Impl;

 private:
  StreamedShards() = default;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pinfeed::loader
