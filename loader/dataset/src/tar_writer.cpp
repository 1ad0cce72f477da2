#include "pinfeed/loader/tar_writer.hpp"

#include <fmt/format.h>

#include <array>
#include <cerrno>
#include <cstring>

#include "pinfeed/error.hpp"
#include "pinfeed/log.hpp"

namespace pinfeed::loader {

namespace {
constexpr std::size_t kBlock = 512;
}

std::uint32_t ustar_checksum(std::span<const char, 512> header) noexcept {
  std::uint32_t sum = 0;
  for (std::size_t i = 0; i < header.size(); ++i) {
    sum += (i >= 148 && i < 156) ? std::uint32_t{' '} : std::uint32_t{static_cast<unsigned char>(header[i])};
  }
  return sum;
}

void seal_ustar_header(TarHeaderBlock header) noexcept {
  std::snprintf(&header[148], 8, "%06o", ustar_checksum(header));
  header[155] = ' ';
}

// The shard is written under a temporary name and renamed by finish(): a
// pack that fails half way leaves no shard that looks complete.
TarWriter::TarWriter(std::filesystem::path path)
    : path_(std::move(path)),
      partial_(path_.string() + ".partial"),
      out_(partial_, std::ios::binary | std::ios::trunc) {
  if (!out_) {
    const int err = errno;  // left by filebuf::open's open(2)
    throw DataError(path_, fmt::format("cannot create tar shard (writing {}): {}", partial_.string(),
                                       err != 0 ? std::strerror(err) : "unknown reason"));
  }
}

TarWriter::~TarWriter() {
  if (finished_) return;
  out_.close();
  std::error_code ec;
  std::filesystem::remove(partial_, ec);  // abandoned: never leave half a shard behind
  pinfeed::detail::log().warn("tar shard {} abandoned before finish(): {} bytes discarded", path_.string(), written_);
}

void TarWriter::write(const void* data, std::size_t n) {
  if (finished_ || ending_) throw Error(fmt::format("{}: tar shard written after finish()", path_.string()));
  out_.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  if (!out_) throw DataError(path_, "write failed (disk full?)");
  written_ += n;
}

void TarWriter::header(const std::string& name, std::uint64_t size, char type) {
  std::array<char, kBlock> h{};
  std::memcpy(h.data(), name.data(), std::min<std::size_t>(name.size(), 100));
  std::snprintf(&h[100], 8, "%07o", 0644U);
  std::snprintf(&h[108], 8, "%07o", 0U);
  std::snprintf(&h[116], 8, "%07o", 0U);
  std::snprintf(&h[124], 12, "%011llo", static_cast<unsigned long long>(size));
  std::snprintf(&h[136], 12, "%011o", 0U);
  h[156] = type;
  std::memcpy(&h[257], "ustar", 6);  // magic "ustar\0" then version "00"
  h[263] = '0';
  h[264] = '0';
  seal_ustar_header(h);
  write(h.data(), kBlock);
}

void TarWriter::add(const std::string& name, std::span<const std::byte> data) {
  if (name.size() > 100) {
    header("././@LongLink", name.size() + 1, 'L');
    write(name.c_str(), name.size() + 1);
    const std::array<char, kBlock> zero{};
    write(zero.data(), (kBlock - (name.size() + 1) % kBlock) % kBlock);
  }
  header(name, data.size(), '0');
  write(data.data(), data.size());
  const std::array<char, kBlock> zero{};
  write(zero.data(), (kBlock - data.size() % kBlock) % kBlock);
}

void TarWriter::finish() {
  if (finished_ || ending_) return;
  const std::array<char, 2 * kBlock> zero{};
  write(zero.data(), zero.size());
  ending_ = true;  // no more members; until the rename succeeds the destructor still removes the partial file
  out_.close();
  if (!out_) throw DataError(path_, "closing the shard failed (disk full?)");
  std::error_code ec;
  std::filesystem::rename(partial_, path_, ec);
  if (ec) throw DataError(path_, fmt::format("cannot rename {} to it: {}", partial_.string(), ec.message()));
  finished_ = true;
}

}  // namespace pinfeed::loader
