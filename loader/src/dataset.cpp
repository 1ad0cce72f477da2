#include "pinfeed/loader/dataset.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include "pinfeed/error.hpp"

namespace fs = std::filesystem;

namespace pinfeed::loader {

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

bool is_image_name(const fs::path& p) {
  static const std::set<std::string> kExt{".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp"};
  return kExt.contains(lower(p.extension().string()));
}

/// A read-only descriptor closed on scope exit; opening failures are a
/// DataError naming the file and `what` it is.
class ReadOnlyFile {
 public:
  ReadOnlyFile(const fs::path& path, std::string_view what) : fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (fd_ < 0) throw DataError(path, fmt::format("cannot open {}: {}", what, std::strerror(errno)));
  }
  ~ReadOnlyFile() { ::close(fd_); }
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
  [[nodiscard]] int fd() const noexcept { return fd_; }

 private:
  int fd_;
};

/// Reads a whole file, refusing directories and absurd sizes.
void read_whole_file(const fs::path& path, std::vector<std::byte>& out) {
  const ReadOnlyFile file(path, "file");
  const int fd = file.fd();
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw DataError(path, fmt::format("cannot stat: {}", std::strerror(errno)));
  if (S_ISDIR(st.st_mode)) throw DataError(path, "is a directory, not an image file");
  if (!S_ISREG(st.st_mode)) throw DataError(path, "is not a regular file");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > kMaxSampleBytes) {
    throw DataError(path, fmt::format("is {} bytes, over the {} byte limit for one sample", size, kMaxSampleBytes));
  }
  out.resize(size);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd, out.data() + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw DataError(path, fmt::format("read failed: {}", std::strerror(errno)));
    if (n == 0) throw DataError(path, fmt::format("file shrank while reading ({} of {} bytes)", done, size));
    done += static_cast<std::size_t>(n);
  }
}

std::optional<std::int64_t> parse_label(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  std::int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc{} || ptr != s.data() + s.size() || v < 0) return std::nullopt;
  return v;
}

}  // namespace

// ---------------------------------------------------------------- ImageFolder

ImageFolder::ImageFolder(fs::path root) : root_(std::move(root)) {
  std::error_code ec;
  if (!fs::exists(root_, ec)) throw DataError(root_, "dataset folder does not exist");
  if (!fs::is_directory(root_, ec)) throw DataError(root_, "is not a folder (expected one sub-folder per class)");
  for (fs::directory_iterator it(root_, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_directory()) classes_.push_back(it->path().filename().string());
  }
  if (ec) throw DataError(root_, fmt::format("cannot list: {}", ec.message()));
  if (classes_.empty()) throw DataError(root_, "has no class sub-folders");
  std::sort(classes_.begin(), classes_.end());
  for (std::size_t c = 0; c < classes_.size(); ++c) {
    std::vector<fs::path> files;
    const auto opts = fs::directory_options::follow_directory_symlink;
    for (fs::recursive_directory_iterator it(root_ / classes_[c], opts, ec), end; !ec && it != end; it.increment(ec)) {
      if (!it->is_directory() && is_image_name(it->path())) files.push_back(it->path());
    }
    if (ec) throw DataError(root_ / classes_[c], fmt::format("cannot list: {}", ec.message()));
    std::sort(files.begin(), files.end());
    for (auto& f : files) {
      files_.push_back(std::move(f));
      labels_.push_back(static_cast<std::int64_t>(c));
    }
  }
  if (files_.empty()) throw DataError(root_, "dataset is empty: no image files in any class folder");
}

void ImageFolder::read(std::size_t i, std::vector<std::byte>& out) const { read_whole_file(files_.at(i), out); }

std::string ImageFolder::summary() const {
  return fmt::format("image-folder {}: {} images, {} classes", root_.string(), files_.size(), classes_.size());
}

// ---------------------------------------------------------------- FileList

FileList::FileList(const fs::path& list, fs::path root) : list_(list) {
  std::ifstream in(list);
  if (!in) throw DataError(list, fmt::format("cannot open file list: {}", std::strerror(errno)));
  std::string line;
  std::size_t lineno = 0;
  std::int64_t max_label = -1;
  while (std::getline(in, line)) {
    ++lineno;
    const auto first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') continue;
    const auto last = line.find_last_not_of(" \t\r");
    const std::string body = line.substr(first, last - first + 1);
    const auto sep = body.find_last_of(" \t");
    if (sep == std::string::npos) {
      throw DataError(list, fmt::format("line {}: '{}' has no label (expected 'relative/path label')", lineno, body));
    }
    const auto label = parse_label(std::string_view(body).substr(sep + 1));
    if (!label) {
      throw DataError(list, fmt::format("line {}: label '{}' is not a non-negative whole number", lineno,
                                        body.substr(sep + 1)));
    }
    std::string rel = body.substr(0, body.find_last_not_of(" \t", sep) + 1);
    files_.push_back(root / rel);
    labels_.push_back(*label);
    max_label = std::max(max_label, *label);
  }
  if (files_.empty()) throw DataError(list, "dataset is empty: the file list has no entries");
  num_classes_ = static_cast<std::size_t>(max_label + 1);
}

void FileList::read(std::size_t i, std::vector<std::byte>& out) const { read_whole_file(files_.at(i), out); }

std::string FileList::summary() const {
  return fmt::format("file-list {}: {} images, {} classes", list_.string(), files_.size(), num_classes_);
}

// ---------------------------------------------------------------- TarShards

namespace {

constexpr std::size_t kBlock = 512;

std::uint64_t tar_number(const char* field, std::size_t len, bool* ok) {
  const auto* u = reinterpret_cast<const unsigned char*>(field);
  if ((u[0] & 0x80U) != 0) {  // GNU base-256 for large sizes
    std::uint64_t v = u[0] & 0x7fU;
    for (std::size_t i = 1; i < len; ++i) v = (v << 8U) | u[i];
    return v;
  }
  std::uint64_t v = 0;
  std::size_t i = 0;
  while (i < len && (field[i] == ' ' || field[i] == '\0')) ++i;
  for (; i < len && field[i] >= '0' && field[i] <= '7'; ++i) v = v * 8 + static_cast<std::uint64_t>(field[i] - '0');
  for (; i < len; ++i) {
    if (field[i] != ' ' && field[i] != '\0') *ok = false;
  }
  return v;
}

std::string field_string(const char* f, std::size_t len) { return std::string(f, strnlen(f, len)); }

void pread_exact(int fd, void* buf, std::size_t n, std::uint64_t off, const fs::path& path, const char* what) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, static_cast<char*>(buf) + done, n - done, static_cast<off_t>(off + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw DataError(path, fmt::format("read of {} failed: {}", what, std::strerror(errno)));
    if (r == 0) throw DataError(path, fmt::format("{} is cut short at byte {}", what, off + done));
    done += static_cast<std::size_t>(r);
  }
}

std::vector<TarShards::Member> scan_fd(int fd, const fs::path& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw DataError(path, fmt::format("cannot stat: {}", std::strerror(errno)));
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  std::vector<TarShards::Member> members;
  std::array<char, kBlock> h{};
  std::uint64_t off = 0;
  std::string long_name;  // from a GNU 'L' or pax 'x' record, for the next member
  while (off + kBlock <= file_size) {
    pread_exact(fd, h.data(), kBlock, off, path, "tar header");
    if (std::all_of(h.begin(), h.end(), [](char c) { return c == 0; })) break;  // end of archive
    bool ok = true;
    const std::uint64_t size = tar_number(&h[124], 12, &ok);
    const std::uint64_t stored = tar_number(&h[148], 8, &ok);
    std::uint64_t sum = 0;
    for (std::size_t i = 0; i < kBlock; ++i) sum += (i >= 148 && i < 156) ? std::uint64_t{' '} : std::uint64_t{static_cast<unsigned char>(h[i])};
    if (!ok || sum != stored) throw DataError(path, fmt::format("bad tar header at byte {} (checksum or size field)", off));
    const char type = h[156];
    const std::uint64_t data = off + kBlock;
    if (data + size > file_size) {
      throw DataError(path, fmt::format("member '{}' is cut short: {} bytes declared, {} present",
                                        long_name.empty() ? field_string(&h[0], 100) : long_name, size,
                                        file_size - std::min(file_size, data)));
    }
    if (type == 'L' || type == 'x') {
      if (size > (1U << 20U)) throw DataError(path, fmt::format("long-name record of {} bytes at byte {}", size, off));
      std::string rec(size, '\0');
      pread_exact(fd, rec.data(), size, data, path, "long name");
      if (type == 'L') {
        long_name = rec.substr(0, strnlen(rec.data(), rec.size()));
      } else {  // pax: "len key=value\n" records; we need only path
        std::size_t p = 0;
        while (p < rec.size()) {
          const auto sp = rec.find(' ', p), nl = rec.find('\n', p);
          if (sp == std::string::npos || nl == std::string::npos) break;
          const std::string kv = rec.substr(sp + 1, nl - sp - 1);
          if (kv.rfind("path=", 0) == 0) long_name = kv.substr(5);
          p = nl + 1;
        }
      }
    } else if (type == '0' || type == '\0' || type == '7') {
      std::string name = long_name;
      if (name.empty()) {
        name = field_string(&h[0], 100);
        const std::string prefix = field_string(&h[345], 155);
        if (std::memcmp(&h[257], "ustar", 5) == 0 && !prefix.empty()) name = prefix + "/" + name;
      }
      members.push_back(TarShards::Member{std::move(name), data, size});
      long_name.clear();
    } else {
      long_name.clear();  // directories, links, global pax headers: skipped
    }
    off = data + (size + kBlock - 1) / kBlock * kBlock;
  }
  return members;
}

}  // namespace

std::vector<TarShards::Member> TarShards::scan(const fs::path& tar) {
  const ReadOnlyFile file(tar, "shard");
  return scan_fd(file.fd(), tar);
}

TarShards::TarShards(std::vector<fs::path> shards) : shards_(std::move(shards)) {
  if (shards_.empty()) throw ConfigError("tar shards: no shard given");
  std::int64_t max_label = -1;
  try {
    for (std::size_t s = 0; s < shards_.size(); ++s) {
      const fs::path& path = shards_[s];
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) throw DataError(path, fmt::format("cannot open shard: {}", std::strerror(errno)));
      fds_.push_back(fd);
      // key -> (image member, label); WebDataset keys are the name up to the
      // first dot of the base name.
      std::map<std::string, std::pair<std::optional<Member>, std::optional<std::int64_t>>> by_key;
      std::vector<std::string> order;
      for (Member& m : scan_fd(fd, path)) {
        const auto slash = m.name.rfind('/');
        const auto dot = m.name.find('.', slash == std::string::npos ? 0 : slash + 1);
        if (dot == std::string::npos) continue;
        const std::string key = m.name.substr(0, dot), ext = lower(m.name.substr(dot + 1));
        auto& entry = by_key[key];
        if (!entry.first && !entry.second) order.push_back(key);
        if (ext == "jpg" || ext == "jpeg") {
          entry.first = m;
        } else if (ext == "cls") {
          if (m.size > 64) throw DataError(path, fmt::format("{}: label member of {} bytes", m.name, m.size));
          std::string text(m.size, '\0');
          pread_exact(fd, text.data(), m.size, m.offset, path, m.name.c_str());
          const auto label = parse_label(text);
          if (!label) throw DataError(path, fmt::format("{}: label '{}' is not a non-negative whole number", m.name, text));
          entry.second = *label;
        }
      }
      for (const std::string& key : order) {
        const auto& [image, label] = by_key[key];
        if (!image) continue;  // a label or other member without an image
        if (!label) throw DataError(path, fmt::format("{}: image without a .cls label", image->name));
        samples_.push_back(Sample{static_cast<std::uint32_t>(s), image->offset, image->size, *label, image->name});
        max_label = std::max(max_label, *label);
      }
    }
  } catch (...) {
    for (const int fd : fds_) ::close(fd);
    throw;
  }
  if (samples_.empty()) {
    for (const int fd : fds_) ::close(fd);
    throw DataError(shards_.front(), "dataset is empty: no key.jpg + key.cls pairs in the shards");
  }
  num_classes_ = static_cast<std::size_t>(max_label + 1);
}

TarShards::~TarShards() {
  for (const int fd : fds_) ::close(fd);
}

std::string TarShards::describe(std::size_t i) const {
  const Sample& s = samples_.at(i);
  return fmt::format("{}:{}", shards_[s.shard].string(), s.key);
}

void TarShards::read(std::size_t i, std::vector<std::byte>& out) const {
  const Sample& s = samples_.at(i);
  if (s.size > kMaxSampleBytes) throw DataError(describe(i), fmt::format("member of {} bytes is over the limit", s.size));
  out.resize(s.size);
  pread_exact(fds_[s.shard], out.data(), s.size, s.offset, shards_[s.shard], s.key.c_str());
}

std::string TarShards::summary() const {
  return fmt::format("tar shards ({} files, first {}): {} images, {} classes", shards_.size(), shards_.front().string(),
                     samples_.size(), num_classes_);
}

// ---------------------------------------------------------------- opening

std::vector<fs::path> expand_shard_pattern(const std::string& pattern) {
  std::vector<fs::path> out;
  std::size_t start = 0;
  while (start <= pattern.size()) {
    const auto comma = std::min(pattern.find(',', start), pattern.size());
    const std::string part = pattern.substr(start, comma - start);
    start = comma + 1;
    if (part.empty()) continue;
    const auto open = part.find('{');
    if (open == std::string::npos) {
      out.emplace_back(part);
      continue;
    }
    const auto close = part.find('}', open);
    const auto dots = part.find("..", open);
    if (close == std::string::npos || dots == std::string::npos || dots > close) {
      throw ConfigError(fmt::format("shard pattern '{}': expected {{first..last}}", part));
    }
    const std::string a = part.substr(open + 1, dots - open - 1), b = part.substr(dots + 2, close - dots - 2);
    std::uint64_t lo = 0, hi = 0;
    const auto r1 = std::from_chars(a.data(), a.data() + a.size(), lo);
    const auto r2 = std::from_chars(b.data(), b.data() + b.size(), hi);
    if (a.empty() || b.empty() || r1.ec != std::errc{} || r2.ec != std::errc{} || lo > hi || hi - lo > 1'000'000) {
      throw ConfigError(fmt::format("shard pattern '{}': bad range {{{}..{}}}", part, a, b));
    }
    const std::size_t width = a.size();  // zero padding taken from the first number
    for (std::uint64_t v = lo; v <= hi; ++v) {
      out.emplace_back(part.substr(0, open) + fmt::format("{:0{}}", v, width) + part.substr(close + 1));
    }
    if (comma >= pattern.size()) break;
  }
  if (out.empty()) throw ConfigError(fmt::format("shard pattern '{}' names no file", pattern));
  return out;
}

std::unique_ptr<Dataset> open_dataset(const std::string& spec, const fs::path& root) {
  std::error_code ec;
  if (spec.empty()) throw ConfigError("dataset: no path given");
  if (fs::is_directory(spec, ec)) return std::make_unique<ImageFolder>(spec);
  const bool tar = spec.find('{') != std::string::npos || spec.find(',') != std::string::npos ||
                   lower(fs::path(spec).extension().string()) == ".tar";
  if (tar) return std::make_unique<TarShards>(expand_shard_pattern(spec));
  if (!fs::exists(spec, ec)) throw DataError(spec, "dataset path does not exist");
  return std::make_unique<FileList>(spec, root.empty() ? fs::path(spec).parent_path() : root);
}

}  // namespace pinfeed::loader
