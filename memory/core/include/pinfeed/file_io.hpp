#pragma once
// Opening and reading files that someone else made, safely: only regular
// files are opened (a FIFO or a device named like an image would block
// open() or read() forever, or never end), and the check itself never
// blocks. Every failure is a DataError naming the file and the reason.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pinfeed {

/// What kind of file `mode` (st_mode) is, in words: "a FIFO", "a directory".
std::string_view file_kind(unsigned mode) noexcept;

/// A file descriptor, closed when its owner goes: the one way pinfeed owns
/// one (RegularFile, tar shards, checkpoints). Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }
  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] explicit operator bool() const noexcept { return fd_ >= 0; }
  /// Gives the descriptor up: the caller closes it.
  [[nodiscard]] int release() noexcept {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

/// A read-only descriptor of a regular file, closed on scope exit.
///
/// Opens with O_NONBLOCK (so a FIFO does not wait for a writer), checks with
/// fstat that it is a regular file, then clears O_NONBLOCK. Throws
/// DataError(path, "cannot open <what>: ...") when it cannot be opened and
/// DataError(path, "is a FIFO, not a regular file") and the like otherwise.
class RegularFile {
 public:
  RegularFile(const std::filesystem::path& path, std::string_view what);
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;
  RegularFile(RegularFile&& other) noexcept = default;
  RegularFile& operator=(RegularFile&&) = delete;

  [[nodiscard]] int fd() const noexcept { return fd_.get(); }
  /// Size from fstat at open time.
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  /// The descriptor, for an owner that outlives this object.
  [[nodiscard]] UniqueFd take() noexcept { return std::move(fd_); }

 private:
  UniqueFd fd_;
  std::uint64_t size_ = 0;
};

/// Reads the whole of a regular file into `out` (resized; its capacity is
/// reused), refusing more than `max_bytes`: DataError(path, "is N bytes,
/// over the M byte limit for <what>"), and every other failure named.
void read_regular_file(const std::filesystem::path& path, std::string_view what, std::uint64_t max_bytes,
                       std::vector<std::byte>& out);

/// The whole text of a regular file, read until end of file (procfs files
/// report size 0), refusing more than `max_bytes`: DataError "is over N
/// bytes". std::nullopt when the file does not exist or cannot be opened
/// (permissions); DataError when it exists but is not a regular file.
std::optional<std::string> read_text_file(const std::filesystem::path& path, std::size_t max_bytes);

}  // namespace pinfeed
