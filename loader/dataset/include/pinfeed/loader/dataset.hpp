#pragma once
// Datasets: an indexed list of (encoded image, label). Three layouts:
//  - ImageFolder: root/<class>/<file>, classes and files sorted by name, the
//    class index being the position of the folder in sorted order (the same
//    indices torchvision's ImageFolder gives). Files with an image extension
//    (any case) are the samples: .jpg .jpeg .png .webp are decoded; .ppm
//    .bmp .pgm .tif .tiff refuse the dataset when it is opened (named),
//    so no class is silently replaced by others.
//  - FileList: a text file of "relative/path label" lines ('#' comments and
//    blank lines skipped), paths relative to a root folder.
//  - TarShards: WebDataset-style tar files holding key.jpg (.jpeg, .png,
//    .webp) and key.cls members; indexed once by scanning the headers (ustar
//    and GNU long names; every size checked against the file before use; a
//    shard without its end-of-archive blocks is refused), then read by offset
//    with pread.
// Only regular files are opened (a FIFO named x.jpg is refused, never waited
// on). A label at or over `max_classes` refuses the dataset, naming the file
// and line or member: the class count sizes the model.
// All are immutable after construction and safe to read from many threads.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <vector>

#include "pinfeed/file_io.hpp"

namespace pinfeed::memory {
class PressureMonitor;
}

namespace pinfeed::loader {

/// What the streaming reader did (Loader stats' "remote").
struct StreamStats {
  std::uint64_t requests = 0;         ///< Range requests answered
  std::uint64_t bytes = 0;            ///< body bytes they brought
  std::uint64_t retries = 0;          ///< requests made again (a reset, a 5xx, a stall, a dead server)
  std::uint64_t waits = 0;            ///< reads that found their sample not fetched yet
  double wait_seconds = 0;            ///< time those reads waited, summed
  std::uint64_t readahead_bytes = 0;  ///< fetched (or in flight) ahead of the loader now
  std::uint64_t readahead_peak = 0;   ///< the most it has been
  std::uint64_t readahead_limit = 0;  ///< the bound now (lowered under pressure)
  std::uint64_t dropped = 0;          ///< fetched samples given back when pressure lowered the bound
  std::size_t shards = 0;             ///< remote shards
  std::size_t shards_local = 0;       ///< of them read from a local copy now (cache_dir)
};

class Dataset {
 public:
  Dataset() = default;
  Dataset(const Dataset&) = delete;
  Dataset& operator=(const Dataset&) = delete;
  virtual ~Dataset() = default;

  [[nodiscard]] virtual std::size_t size() const noexcept = 0;
  [[nodiscard]] virtual std::int64_t label(std::size_t i) const = 0;
  /// Where sample i lives, for messages: a path, or "shard.tar:member".
  [[nodiscard]] virtual std::string describe(std::size_t i) const = 0;
  /// Reads sample i's encoded bytes into `out` (resized; its capacity is
  /// reused). Throws DataError naming the file and the reason. Thread-safe.
  virtual void read(std::size_t i, std::vector<std::byte>& out) const = 0;
  /// Number of classes (max label + 1, or the folder count for ImageFolder).
  [[nodiscard]] virtual std::size_t num_classes() const noexcept = 0;
  /// A short description of the layout ("image-folder /data/train, 1000 classes").
  [[nodiscard]] virtual std::string summary() const = 0;
  /// Sample i's name in the dataset's fingerprint: where it lives relative
  /// to the dataset's root ("class/file.jpg", "shard-0.tar:key"), so that a
  /// dataset moved to another folder keeps its fingerprint.
  [[nodiscard]] virtual std::string relative_name(std::size_t i) const = 0;
  /// Sample i's stored size in bytes: a stat for a file (kUnknownSize when
  /// it cannot be stat'ed; reading it will say why), the member's size in a shard.
  [[nodiscard]] virtual std::uint64_t stored_size(std::size_t i) const = 0;
  static constexpr std::uint64_t kUnknownSize = ~std::uint64_t{0};
  /// The order the next reads will come in (an epoch's, from its position):
  /// a streamed dataset fetches ahead along it. Thread-safe.
  virtual void plan(std::span<const std::size_t> order) const { (void)order; }
  /// read(), as an epoch's decoding threads do it: once `stop` is requested
  /// (the loader stopping its epoch: an early break, a new epoch, its end),
  /// a read that would wait for bytes not yet here (a streamed sample)
  /// throws Cancelled instead of waiting for a server. Without it, a loader
  /// closed while a server stalls waits out the transfer's timeout and
  /// retries. Other reads (crop_params, scans) are not affected.
  virtual void read_stoppable(std::size_t i, std::vector<std::byte>& out, const std::stop_token& stop) const {
    (void)stop;
    read(i, out);
  }
  /// A streamed dataset's transfers (none for local data).
  [[nodiscard]] virtual std::optional<StreamStats> stream_stats() const { return std::nullopt; }
  /// The class names labels index (ImageFolder's folders); empty where
  /// labels are numbers (file lists, shards).
  [[nodiscard]] virtual const std::vector<std::string>& class_names() const noexcept {
    static const std::vector<std::string> kNone;
    return kNone;
  }
  /// Follow `monitor`'s memory pressure while the loader runs (a streamed
  /// dataset bounds its read-ahead by it); local data ignores it.
  virtual void follow(std::shared_ptr<memory::PressureMonitor> monitor) { (void)monitor; }
};

/// What a checkpoint or a state_dict remembers of its dataset, to refuse
/// resuming on another one: index i must still be the same sample.
struct DatasetFingerprint {
  std::uint64_t samples = 0;
  std::uint64_t num_classes = 0;
  std::vector<std::string> classes;  ///< ImageFolder's class names; empty for numeric labels
  std::uint64_t hash = 0;            ///< XXH3-64 over every sample's (relative name, size, label), in dataset order
  bool operator==(const DatasetFingerprint&) const = default;
};

/// The dataset's fingerprint: a stat per file (on all cores), no read.
DatasetFingerprint fingerprint(const Dataset& d);

/// "" when `now` is `was`; else what changed, for a refusal: classes
/// added, removed or renamed, N samples added or removed, or the same counts
/// with other paths, sizes or labels. Class names are compared as UTF-8
/// with invalid bytes replaced (as a checkpoint's JSON header stores them);
/// the hash sees their bytes.
std::string describe_change(const DatasetFingerprint& was, const DatasetFingerprint& now);

/// Largest sample file accepted (a corrupt size field must not allocate terabytes).
inline constexpr std::uint64_t kMaxSampleBytes = 256ULL << 20U;
/// Default bound on the class count (labels 0..max_classes-1).
inline constexpr std::size_t kDefaultMaxClasses = 1'000'000;
/// The most max_classes may be raised to.
inline constexpr std::size_t kMaxClassesCeiling = 100'000'000;
/// Largest file list read (ImageNet's is ~40 MB).
inline constexpr std::uint64_t kMaxFileListBytes = 4ULL << 30U;
/// ConfigError unless 1 <= max_classes <= kMaxClassesCeiling.
void check_max_classes(std::size_t max_classes);

class ImageFolder final : public Dataset {
 public:
  /// Throws DataError: missing or unreadable root, no class folders, no
  /// images, more than max_classes folders, an image that is not a regular
  /// file or not in a decodable format.
  explicit ImageFolder(std::filesystem::path root, std::size_t max_classes = kDefaultMaxClasses);
  [[nodiscard]] std::size_t size() const noexcept override { return files_.size(); }
  [[nodiscard]] std::int64_t label(std::size_t i) const override { return labels_.at(i); }
  [[nodiscard]] std::string describe(std::size_t i) const override { return files_.at(i).string(); }
  void read(std::size_t i, std::vector<std::byte>& out) const override;
  [[nodiscard]] std::size_t num_classes() const noexcept override { return classes_.size(); }
  [[nodiscard]] std::string summary() const override;
  [[nodiscard]] std::string relative_name(std::size_t i) const override { return relative(i).native(); }
  [[nodiscard]] std::uint64_t stored_size(std::size_t i) const override;
  [[nodiscard]] const std::vector<std::string>& classes() const noexcept { return classes_; }
  [[nodiscard]] const std::vector<std::string>& class_names() const noexcept override { return classes_; }
  /// Path of sample i relative to the root ("class/file.jpg").
  [[nodiscard]] std::filesystem::path relative(std::size_t i) const { return files_.at(i).lexically_relative(root_); }

 private:
  std::filesystem::path root_;
  std::vector<std::string> classes_;
  std::vector<std::filesystem::path> files_;
  std::vector<std::int64_t> labels_;
};

class FileList final : public Dataset {
 public:
  /// Throws DataError naming the list file and line: unreadable, a line
  /// without a label, a label that is not a non-negative number or is at or
  /// over max_classes, no entries, a list that is not a regular file.
  FileList(const std::filesystem::path& list, std::filesystem::path root, std::size_t max_classes = kDefaultMaxClasses);
  [[nodiscard]] std::size_t size() const noexcept override { return labels_.size(); }
  [[nodiscard]] std::int64_t label(std::size_t i) const override { return labels_.at(i); }
  [[nodiscard]] std::string describe(std::size_t i) const override { return path(i).string(); }
  void read(std::size_t i, std::vector<std::byte>& out) const override;
  [[nodiscard]] std::size_t num_classes() const noexcept override { return num_classes_; }
  [[nodiscard]] std::string summary() const override;
  [[nodiscard]] std::string relative_name(std::size_t i) const override;
  [[nodiscard]] std::uint64_t stored_size(std::size_t i) const override;

 private:
  /// Entry i's name as the list gives it, and the file it names.
  [[nodiscard]] std::string_view name(std::size_t i) const;
  [[nodiscard]] std::filesystem::path path(std::size_t i) const;

  std::filesystem::path list_, root_;
  // Every entry's name in one buffer (a path object per entry cost ~110
  // bytes of heap each plus its name, in blocks a freed list left behind).
  std::string names_;
  std::vector<std::uint64_t> ends_;  ///< entry i is names_[ends_[i-1], ends_[i])
  std::vector<std::int64_t> labels_;
  std::size_t num_classes_ = 0;
};

class TarShards final : public Dataset {
 public:
  /// Opens and indexes every shard. Throws DataError naming the shard: missing,
  /// a member cut short, a bad header checksum, a .cls that is not a number,
  /// an image without a label, a label at or over max_classes, a shard that
  /// is not a regular file or has no end-of-archive blocks, no samples.
  explicit TarShards(std::vector<std::filesystem::path> shards, std::size_t max_classes = kDefaultMaxClasses);
  /// Remote shards staged into local files (remote.hpp): messages name
  /// sources[i] instead of shards[i]; `keep` lives as long as the dataset.
  TarShards(std::vector<std::filesystem::path> shards, std::vector<std::string> sources,
            std::shared_ptr<const void> keep, std::size_t max_classes = kDefaultMaxClasses);
  ~TarShards() override;
  [[nodiscard]] std::size_t size() const noexcept override { return samples_.size(); }
  [[nodiscard]] std::int64_t label(std::size_t i) const override { return samples_.at(i).label; }
  [[nodiscard]] std::string describe(std::size_t i) const override;
  void read(std::size_t i, std::vector<std::byte>& out) const override;
  [[nodiscard]] std::size_t num_classes() const noexcept override { return num_classes_; }
  [[nodiscard]] std::string summary() const override;
  [[nodiscard]] std::string relative_name(std::size_t i) const override;
  [[nodiscard]] std::uint64_t stored_size(std::size_t i) const override { return samples_.at(i).size; }

  struct Member {
    std::string name;
    std::uint64_t offset = 0;  ///< of the data, in the shard file
    std::uint64_t size = 0;
  };
  /// Every regular-file member of a tar file (for tests and tools). Throws DataError.
  static std::vector<Member> scan(const std::filesystem::path& tar);

  /// One sample of a shard's index: its image member, label, and the
  /// checksum field of the header before its data (what a reader checks to
  /// know the bytes at `offset` are still this member).
  struct IndexedSample {
    std::string key;  ///< the image member's name
    std::uint64_t offset = 0, size = 0;
    std::int64_t label = 0;
    std::uint64_t header_sum = 0;
  };
  /// A shard's samples in the order the dataset numbers them, with every
  /// check the constructor makes (labels under max_classes, keys, links).
  /// Throws DataError naming the shard.
  static std::vector<IndexedSample> index(const std::filesystem::path& tar,
                                          std::size_t max_classes = kDefaultMaxClasses);
  /// Whether the 512-byte tar header `h` still describes a member of `size`
  /// bytes whose checksum field is `header_sum` (a reader's check that the
  /// bytes it read are the indexed member's).
  static bool header_matches(const char* h, std::uint64_t size, std::uint64_t header_sum) noexcept;
  /// The same, and its name is `name` (a name too long for the header's
  /// fields, kept in a GNU or pax record before it, must start with what
  /// the header holds): an index entry pointing at another member's header
  /// is not taken for its own.
  static bool header_matches(const char* h, std::uint64_t size, std::uint64_t header_sum,
                             std::string_view name) noexcept;

 private:
  struct Sample : IndexedSample {
    std::uint32_t shard = 0;
  };
  static std::vector<IndexedSample> index_fd(int fd, std::uint64_t file_size, const std::filesystem::path& path,
                                             std::size_t max_classes);
  /// The checksum field of the tar header before `data_offset` (0 at the start).
  static std::uint64_t header_checksum(int fd, std::uint64_t data_offset, const std::filesystem::path& path);
  /// What a shard was when indexed: a reopened one must still be it.
  struct Identity {
    std::uint64_t device = 0, inode = 0, size = 0;
    std::int64_t mtime_ns = 0;
  };
  static Identity identity_of(int fd, const std::filesystem::path& path);
  /// DatasetChanged unless shard `s.shard` (open as `fd`) is as indexed:
  /// size, modification time, and the member's own header.
  void check_unchanged(const Sample& s, int fd) const;
  /// A descriptor of shard `s`, opened again if the cache closed it.
  [[nodiscard]] std::shared_ptr<const UniqueFd> shard_fd(std::uint32_t s) const;

  std::vector<std::filesystem::path> shards_;
  std::vector<std::string> sources_;  ///< URLs of staged remote shards, as shown (empty: local)
  /// What messages name for shard s: its URL when it was staged, else its path.
  [[nodiscard]] std::filesystem::path shown(std::uint32_t s) const;
  std::shared_ptr<const void> keep_;
  std::vector<Identity> identity_;
  // Open descriptors, at most max_open_ (a quarter of RLIMIT_NOFILE's soft
  // limit, at least 8): a dataset of more shards than the process may open
  // still loads, least recently read shards closed first. A reader holds
  // its shared_ptr while it reads, so closing never races a pread.
  mutable std::mutex fd_mutex_;
  mutable std::vector<std::shared_ptr<const UniqueFd>> fds_;
  mutable std::list<std::uint32_t> recent_;  // front: most recently read
  mutable std::vector<std::list<std::uint32_t>::iterator> where_;
  std::size_t max_open_ = 0;
  std::vector<Sample> samples_;
  std::size_t num_classes_ = 0;
};

/// Refuses (ConfigError) a validation set whose classes are not the
/// training set's: for two ImageFolders the class names must be the same
/// (a renamed, missing or extra folder moves the labels after it, and the
/// validation accuracy silently drops to chance), naming the first
/// difference. Numeric labels (file lists, shards) are checked where read.
void check_same_classes(const Dataset& train, const Dataset& val);
/// The same check on class names (the Python loader's classes=).
void check_same_class_names(const std::vector<std::string>& train, const std::vector<std::string>& val);

}  // namespace pinfeed::loader
