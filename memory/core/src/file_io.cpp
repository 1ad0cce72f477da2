#include "pinfeed/file_io.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "pinfeed/error.hpp"

namespace pinfeed {

std::string_view file_kind(unsigned mode) noexcept {
  switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFIFO: return "a FIFO";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFSOCK: return "a socket";
    case S_IFLNK: return "a symbolic link";
    default: return "not a regular file";
  }
}

void UniqueFd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

RegularFile::RegularFile(const std::filesystem::path& path, std::string_view what) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
  fd_.reset(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (!fd_) throw DataError(path, fmt::format("cannot open {}: {}", what, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0)
    throw DataError(path, fmt::format("cannot stat {}: {}", what, std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) {
    throw DataError(path, fmt::format("is {}, not a regular file (expected {})", file_kind(st.st_mode), what));
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
  const int flags = ::fcntl(fd_.get(), F_GETFL);
  if (flags >= 0) (void)::fcntl(fd_.get(), F_SETFL, flags & ~O_NONBLOCK);
}

void read_regular_file(const std::filesystem::path& path, std::string_view what, std::uint64_t max_bytes,
                       std::vector<std::byte>& out) {
  const RegularFile file(path, what);
  const std::uint64_t size = file.size();
  if (size > max_bytes) {
    throw DataError(path, fmt::format("is {} bytes, over the {} byte limit for {}", size, max_bytes, what));
  }
  out.resize(size);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(file.fd(), out.data() + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw DataError(path, fmt::format("read failed: {}", std::strerror(errno)));
    if (n == 0) throw DataError(path, fmt::format("file shrank while reading ({} of {} bytes)", done, size));
    done += static_cast<std::size_t>(n);
  }
}

std::optional<std::string> read_text_file(const std::filesystem::path& path, std::size_t max_bytes) {
  std::optional<RegularFile> file;
  try {
    file.emplace(path, "a text file");
  } catch (const DataError&) {
    std::error_code ec;
    const auto st = std::filesystem::status(path, ec);
    if (ec || !std::filesystem::exists(st) || std::filesystem::is_regular_file(st)) return std::nullopt;
    throw;  // exists and is not a regular file: say so
  }
  std::string text;
  char buf[8192];
  for (;;) {
    const ssize_t n = ::read(file->fd(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw DataError(path, fmt::format("read failed: {}", std::strerror(errno)));
    if (n == 0) break;
    if (text.size() + static_cast<std::size_t>(n) > max_bytes) {
      throw DataError(path, fmt::format("is over {} bytes: not the small text file expected here", max_bytes));
    }
    text.append(buf, static_cast<std::size_t>(n));
  }
  return text;
}

}  // namespace pinfeed
