#pragma once
// Shards in object storage: http://, https://, s3://bucket/key and
// WebDataset's pipe:COMMAND, wherever a shard path is accepted. The transport
// is libcurl (HTTP(S) with Range resume; S3 through its built-in AWS
// Signature V4), never a client of our own.
//
// A set whose every shard has an index sidecar streams (streamed.hpp). Here
// is the rest: staging, which fetches each remote shard whole into a cache
// folder (cache_dir, or a private temporary one removed when the dataset
// closes) to be read as a local shard, the cache itself (also filled by the
// streaming reader), uploads and listings. Either way sample order, torch
// order, fingerprints and resume are those of the same shards on disk. Note
// [Remote staging] (remote_cache.cpp) says what a file in the cache promises and
// how ranks share it.
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "pinfeed/error.hpp"

namespace pinfeed::loader {

/// A transfer that failed for good: after the retry budget, or at once for
/// an answer no retry changes (any 4xx but 408, 416 and 429). Names the URL and the
/// HTTP status (0: none, a transport error). Fatal: never replaced by a
/// substitute sample, since the whole shard is missing.
class RemoteError : public Error {
 public:
  RemoteError(std::string url, long status, const std::string& reason);
  [[nodiscard]] const std::string& url() const noexcept { return url_; }
  [[nodiscard]] long status() const noexcept { return status_; }

 private:
  std::string url_;
  long status_ = 0;
};

struct RemoteConfig {
  std::filesystem::path cache_dir;  ///< shards kept across runs (empty: a private folder removed at close)
  std::uint64_t cache_limit = 0;    ///< bytes the cache may hold; least recently used shards go first (0: no bound)
  double connect_timeout = 10.0;    ///< seconds to connect
  double read_timeout = 30.0;       ///< seconds over which a transfer must keep min_rate, else it is retried
  /// Bytes per second a transfer (or a pipe: command's output) must average
  /// over any read_timeout seconds, headers included; slower is a stall,
  /// retried (Note [Bounded waits], remote.cpp).
  double min_rate = 4096;
  unsigned retries = 5;   ///< tries after the first, with exponential backoff and jitter
  double backoff = 0.5;   ///< seconds before the first retry (doubling, at most 8 s)
  unsigned parallel = 8;  ///< shards fetched at once
  /// Streaming (Note [Streamed shards], streamed.cpp): bytes of samples
  /// fetched ahead of the loader, counted against the host's memory (0:
  /// auto, the least of 256 MiB and 1/16 of the memory really available).
  /// Shrinks under memory pressure.
  std::uint64_t readahead = 0;
  unsigned streams = 32;  ///< Range requests in flight at once while streaming
  /// Set: transfers (at their next progress call, about once a second),
  /// retries' backoff, lock waits and pipe: commands stop and throw Cancelled (a dataset closing while its shards
  /// are cached, a program interrupted while the dataset opens).
  std::shared_ptr<const std::atomic<bool>> cancel;
};

/// Shard patterns as webdataset's braceexpand reads them: every group,
/// ranges and lists, nested ("data/s-{000..012}.tar" -> 13 paths,
/// "s-{0..1}-{a,b}.tar" -> 4); sources separated by ',' outside braces
/// ("a.tar,b.tar" -> 2); "\," "\{" "\}" are literal (a comma in a
/// pipe: command or an S3 key). Throws ConfigError on a malformed pattern.
std::vector<std::filesystem::path> expand_shard_pattern(const std::string& pattern);
/// A spec's sources, unexpanded: split at ',' outside braces ("\\," kept).
std::vector<std::string> split_shard_spec(const std::string& spec);

/// "http://", "https://", "s3://" or "pipe:".
[[nodiscard]] bool is_remote_url(std::string_view spec) noexcept;

/// `url` as messages, logs, repr, JSON and the cache's sidecars show it: the
/// one redaction rule. Without its query and fragment (a presigned URL's
/// signature and token) and without user:password@; a pipe: command as its
/// program and the argument naming the shard, every other word "…"
/// ("pipe:curl … https://h/a.tar").
[[nodiscard]] std::string redact_url(const std::string& url);

/// A dataset spec as shown: each of its comma-separated parts that is a URL
/// through redact_url (brace patterns stay), local paths as they are.
[[nodiscard]] std::string redact_spec(const std::string& spec);

/// Where an s3:// URL is fetched from: AWS_ENDPOINT_URL (path style:
/// endpoint/bucket/key) or https://bucket.s3.REGION.amazonaws.com/key.
/// Other URLs are returned as they are.
[[nodiscard]] std::string http_url(const std::string& url);

/// The name a remote shard keeps in fingerprints and messages: its URL's
/// last path component ("train-000001.tar"); for pipe:, the command's
/// argument that ends in .tar.
[[nodiscard]] std::string remote_shard_name(const std::string& url);

struct FetchResult {
  std::uint64_t bytes = 0;    ///< the file's size
  std::string etag;           ///< the server's, when it gave one
  std::string last_modified;  ///< the server's Last-Modified, when it gave one
  unsigned attempts = 0;      ///< transfers made (1: no retry)
  std::uint64_t resumed = 0;  ///< bytes not fetched again thanks to Range requests
};

/// Fetches `url` into `dest` (written as dest + ".part", renamed when
/// complete and as long as the server said). Retries per `config`; throws
/// RemoteError naming the URL and the status.
FetchResult fetch_url(const std::string& url, const std::filesystem::path& dest, const RemoteConfig& config);

/// Uploads `file` to `url` (http(s) PUT, or s3:// signed), with the same
/// retries. Throws RemoteError.
void upload_file(const std::filesystem::path& file, const std::string& url, const RemoteConfig& config);

/// Remote shards staged into a cache folder: local[i] is urls[i]'s file,
/// named by remote_shard_name in a folder per URL prefix. While it lives,
/// each file holds a shared lock, so no other process evicts it.
struct StagedShards {
  std::vector<std::string> urls;
  std::vector<std::filesystem::path> local;
  std::uint64_t fetched_bytes = 0, reused_bytes = 0;
  std::shared_ptr<const void> keep;  ///< the locks, and a private folder's removal
};

/// The .tar objects under an s3://bucket/prefix/ (ListObjectsV2, every
/// page), sorted by key. Throws RemoteError (none there: 404).
[[nodiscard]] std::vector<std::string> list_s3_shards(const std::string& url, const RemoteConfig& config);

/// Refuses, before any work, an upload target that cannot be written:
/// pipe:, or s3:// without credentials (RemoteError naming the URL).
void check_upload_target(const std::string& url);

/// Where cache_dir keeps `url`'s shard (empty without a cache_dir).
[[nodiscard]] std::filesystem::path cache_path(const std::string& url, const RemoteConfig& config);

/// Stages every URL (parallel fetches; a valid cached copy is reused after
/// the server confirms it). sizes[i], when given and not 0, is urls[i]'s
/// indexed size: a copy of another size is not used and a download past it
/// stops. Throws RemoteError; Cancelled when config.cancel is set.
[[nodiscard]] StagedShards stage_shards(const std::vector<std::string>& urls, const RemoteConfig& config,
                                        const std::vector<std::uint64_t>& sizes = {});

}  // namespace pinfeed::loader
