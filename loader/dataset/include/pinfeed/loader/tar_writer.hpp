#pragma once
// TarWriter: writes WebDataset-style shards (ustar members, GNU 'L' records
// for names over 100 bytes). Used by `pinfeed-data pack` and the tests.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>

namespace pinfeed::loader {

/// A ustar header block.
using TarHeaderBlock = std::span<char, 512>;
/// The header's checksum as ustar defines it: the sum of its 512 bytes as
/// unsigned, the checksum field (bytes 148..155) counted as spaces.
std::uint32_t ustar_checksum(std::span<const char, 512> header) noexcept;
/// Writes ustar_checksum into the checksum field ("%06o\0 ").
void seal_ustar_header(TarHeaderBlock header) noexcept;

class TarWriter {
 public:
  /// Creates (truncates) `path`.partial; finish() renames it to `path`.
  /// Throws DataError naming it.
  explicit TarWriter(std::filesystem::path path);
  /// Without finish(), the archive is abandoned: the partial file is
  /// removed (and a warning logged), so a failed pack never leaves a shard
  /// that reads as whole. Never throws.
  ~TarWriter();
  TarWriter(const TarWriter&) = delete;
  TarWriter& operator=(const TarWriter&) = delete;

  /// Appends a regular-file member. Throws DataError on a write failure.
  void add(const std::string& name, std::span<const std::byte> data);
  /// Writes the two zero blocks that end an archive, closes the file and
  /// renames it to its final name.
  void finish();
  [[nodiscard]] std::uint64_t bytes_written() const noexcept { return written_; }

 private:
  void header(const std::string& name, std::uint64_t size, char type);
  void write(const void* data, std::size_t n);
  std::filesystem::path path_;
  std::filesystem::path partial_;  // written here until finish()
  std::ofstream out_;
  std::uint64_t written_ = 0;
  bool ending_ = false;    // finish() began: the end blocks are written
  bool finished_ = false;  // renamed to path_
};

}  // namespace pinfeed::loader
