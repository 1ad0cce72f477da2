#include "pinfeed/loader/dataset.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cctype>
#include <charconv>
#include <cstring>
#include <iterator>
#include <sstream>
#include <map>
#include <unordered_map>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>
#include <oneapi/tbb/parallel_for.h>
#include <xxhash.h>

#include "pinfeed/error.hpp"
#include "pinfeed/file_io.hpp"
#include "pinfeed/loader/image_decoder.hpp"
#include "pinfeed/loader/streamed.hpp"

namespace fs = std::filesystem;

namespace pinfeed::loader {

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

/// Member extensions (lower case, no dot) TarShards takes as the image: the codec registry's.
bool is_image_extension(const std::string& ext) { return format_for_extension(ext) != ImageFormat::unknown; }

/// torchvision's IMG_EXTENSIONS: a file with one of these is an image of
/// the dataset. The codec registry's are decoded; the others are refused
/// when the dataset is opened, never replaced sample by sample.
enum class NameKind { other, decodable, undecodable };
NameKind image_name_kind(const fs::path& p) {
  static const std::set<std::string> kTorchvision{".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp"};
  const std::string ext = lower(p.extension().string());
  if (!ext.empty() && is_image_extension(ext.substr(1))) return NameKind::decodable;
  return kTorchvision.contains(ext) ? NameKind::undecodable : NameKind::other;
}

/// Reads a whole sample file, refusing anything but regular files and absurd sizes.
void read_whole_file(const fs::path& path, std::vector<std::byte>& out) {
  read_regular_file(path, "one sample (an image file)", kMaxSampleBytes, out);
}

/// The next code point of `s` at `i` as Python's os.fsdecode gives it (UTF-8
/// with surrogateescape: a byte that does not start a valid sequence is
/// U+DC80..U+DCFF), advancing `i`.
char32_t next_code_point(std::string_view s, std::size_t& i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b = byte(i);
  const auto cont = [&](std::size_t k, unsigned lo = 0x80, unsigned hi = 0xBF) {
    return k < s.size() && byte(k) >= lo && byte(k) <= hi;
  };
  if (b < 0x80) {
    ++i;
    return b;
  }
  if (b >= 0xC2 && b <= 0xDF && cont(i + 1)) {
    const char32_t c = (char32_t{b} & 0x1FU) << 6U | (char32_t{byte(i + 1)} & 0x3FU);
    i += 2;
    return c;
  }
  if (b >= 0xE0 && b <= 0xEF && cont(i + 1, b == 0xE0 ? 0xA0 : 0x80, b == 0xED ? 0x9F : 0xBF) && cont(i + 2)) {
    const char32_t c = (char32_t{b} & 0x0FU) << 12U | (char32_t{byte(i + 1)} & 0x3FU) << 6U | (char32_t{byte(i + 2)} & 0x3FU);
    i += 3;
    return c;
  }
  if (b >= 0xF0 && b <= 0xF4 && cont(i + 1, b == 0xF0 ? 0x90 : 0x80, b == 0xF4 ? 0x8F : 0xBF) && cont(i + 2) &&
      cont(i + 3)) {
    const char32_t c = (char32_t{b} & 0x07U) << 18U | (char32_t{byte(i + 1)} & 0x3FU) << 12U |
                       (char32_t{byte(i + 2)} & 0x3FU) << 6U | (char32_t{byte(i + 3)} & 0x3FU);
    i += 4;
    return c;
  }
  ++i;
  return 0xDC00U + b;
}

/// Python's order of the names os.fsdecode makes (code points): byte order,
/// except where a name is not UTF-8 (a Latin-1 "\xa9" sorts after "é" there).
int python_compare(std::string_view a, std::string_view b) {
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const char32_t x = next_code_point(a, i), y = next_code_point(b, j);
    if (x != y) return x < y ? -1 : 1;
  }
  return (i < a.size()) - (j < b.size());
}

/// A file's size, following symlinks as reading it does.
std::uint64_t file_size_or_unknown(const fs::path& p) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) return Dataset::kUnknownSize;
  return static_cast<std::uint64_t>(st.st_size);
}

std::optional<std::int64_t> parse_label(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  std::int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc{} || ptr != s.data() + s.size() || v < 0) return std::nullopt;
  return v;
}

/// The label's class count must stay under the limit: the model's output
/// layer and every buffer sized by it follow from the largest label.
void check_label(std::int64_t label, std::size_t max_classes, const fs::path& file, const std::string& where) {
  if (static_cast<std::uint64_t>(label) >= max_classes) {
    throw DataError(file, fmt::format("{}: label {} means at least {} classes, over the limit of {} (raise max_classes "
                                      "/ --max-classes if the dataset really has that many)",
                                      where, label, static_cast<std::uint64_t>(label) + 1, max_classes));
  }
}

}  // namespace

void check_max_classes(std::size_t max_classes) {
  if (max_classes == 0 || max_classes > kMaxClassesCeiling) {
    throw ConfigError(fmt::format("max_classes must be 1..{}, got {}", kMaxClassesCeiling, max_classes));
  }
}

// ---------------------------------------------------------------- ImageFolder

ImageFolder::ImageFolder(fs::path root, std::size_t max_classes) : root_(std::move(root)) {
  check_max_classes(max_classes);
  std::error_code ec;
  if (!fs::exists(root_, ec)) throw DataError(root_, "dataset folder does not exist");
  if (!fs::is_directory(root_, ec)) throw DataError(root_, "is not a folder (expected one sub-folder per class)");
  for (fs::directory_iterator it(root_, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_directory()) classes_.push_back(it->path().filename().string());
  }
  if (ec) throw DataError(root_, fmt::format("cannot list: {}", ec.message()));
  if (classes_.empty()) throw DataError(root_, "has no class sub-folders");
  if (classes_.size() > max_classes) {
    throw DataError(root_, fmt::format("has {} class folders, over the limit of {} (max_classes / --max-classes)",
                                       classes_.size(), max_classes));
  }
  std::sort(classes_.begin(), classes_.end(),
            [](const std::string& x, const std::string& y) { return python_compare(x, y) < 0; });
  // torchvision's ImageFolder takes every sub-folder as a class, hidden ones
  // too (Jupyter's .ipynb_checkpoints), and refuses the dataset when one has
  // no image: an empty class would silently shift every label after it.
  std::vector<std::string> empty;
  for (std::size_t c = 0; c < classes_.size(); ++c) {
    std::vector<fs::path> files;
    const auto opts = fs::directory_options::follow_directory_symlink;
    for (fs::recursive_directory_iterator it(root_ / classes_[c], opts, ec), end; !ec && it != end; it.increment(ec)) {
      if (it->is_directory(ec)) continue;
      const NameKind kind = image_name_kind(it->path());
      if (kind == NameKind::other) continue;
      if (kind == NameKind::undecodable) {
        throw DataError(it->path(), fmt::format("is a {} image: pinfeed decodes {}; convert it or move it out of the dataset",
                                                lower(it->path().extension().string()).substr(1), codec_names("and")));
      }
      // A FIFO or device named like an image would block or never end when
      // read: refuse the dataset now, naming it, rather than hang later.
      if (!it->is_regular_file(ec)) {
        struct stat st {};
        const bool seen = ::stat(it->path().c_str(), &st) == 0;
        throw DataError(it->path(), seen ? fmt::format("is {}, not a regular image file", file_kind(st.st_mode))
                                         : fmt::format("cannot stat: {}", std::strerror(errno)));
      }
      files.push_back(it->path());
    }
    if (ec) throw DataError(root_ / classes_[c], fmt::format("cannot list: {}", ec.message()));
    if (files.empty()) empty.push_back(classes_[c]);
    // torchvision's order: os.walk's folders sorted as strings, then each
    // folder's files by name (cls/z.jpg before cls/a/1.jpg; cls/a-b/ before
    // cls/a/x/). Sorting whole paths by component would interleave them.
    std::sort(files.begin(), files.end(), [](const fs::path& x, const fs::path& y) {
      const int by_folder = python_compare(x.parent_path().native(), y.parent_path().native());
      return by_folder != 0 ? by_folder < 0 : python_compare(x.filename().native(), y.filename().native()) < 0;
    });
    for (auto& f : files) {
      files_.push_back(std::move(f));
      labels_.push_back(static_cast<std::int64_t>(c));
    }
  }
  if (files_.empty()) throw DataError(root_, "dataset is empty: no image files in any class folder");
  if (!empty.empty()) {
    const std::size_t shown = std::min<std::size_t>(empty.size(), 5);
    std::string names;
    for (std::size_t i = 0; i < shown; ++i) names += fmt::format("{}'{}'", i == 0 ? "" : ", ", empty[i]);
    if (shown < empty.size()) names += fmt::format(" and {} more", empty.size() - shown);
    throw DataError(root_, fmt::format("found no image file ({}) in the class folder{} {}: every "
                                       "sub-folder is a class, hidden ones too, as in torchvision's ImageFolder, which "
                                       "refuses them the same way; remove {} or give {} images",
                                       codec_extensions(), empty.size() == 1 ? "" : "s", names, empty.size() == 1 ? "it" : "them",
                                       empty.size() == 1 ? "it" : "them"));
  }
}

void ImageFolder::read(std::size_t i, std::vector<std::byte>& out) const { read_whole_file(files_.at(i), out); }

std::uint64_t ImageFolder::stored_size(std::size_t i) const { return file_size_or_unknown(files_.at(i)); }

std::string ImageFolder::summary() const {
  return fmt::format("image-folder {}: {} images, {} classes", root_.string(), files_.size(), classes_.size());
}

// ---------------------------------------------------------------- FileList

FileList::FileList(const fs::path& list, fs::path root, std::size_t max_classes) : list_(list), root_(std::move(root)) {
  check_max_classes(max_classes);
  std::vector<std::byte> bytes;
  read_regular_file(list, "a file list", kMaxFileListBytes, bytes);
  std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  // A UTF-8 byte order mark (Windows editors write one) is not part of the
  // first path: kept, it hid the first entry behind an invisible prefix.
  if (text.starts_with("\xEF\xBB\xBF")) text.remove_prefix(3);
  // Sized once: a million entries grown by doubling left half-used blocks
  // behind (the list's RSS stayed after the loader was gone).
  const auto lines = static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')) + 1;
  ends_.reserve(lines);
  labels_.reserve(lines);
  names_.reserve(text.size());
  std::size_t lineno = 0;
  std::int64_t max_label = -1;
  while (!text.empty()) {
    const auto eol = text.find('\n');
    const std::string_view line = text.substr(0, eol);
    text.remove_prefix(eol == std::string_view::npos ? text.size() : eol + 1);
    ++lineno;
    // A NUL cuts a path short for every C API that opens it: refuse the line.
    if (line.find('\0') != std::string_view::npos) {
      std::string shown;
      for (const char c : line.substr(0, 200)) shown += c == '\0' ? std::string("\\0") : std::string(1, c);
      throw DataError(list, fmt::format("line {}: '{}' contains a NUL byte (\\0, at column {}); a path cannot hold one",
                                        lineno, shown, line.find('\0') + 1));
    }
    const auto first = line.find_first_not_of(" \t\r");
    if (first == std::string_view::npos || line[first] == '#') continue;
    const auto last = line.find_last_not_of(" \t\r");
    const std::string_view body = line.substr(first, last - first + 1);
    const auto sep = body.find_last_of(" \t");
    if (sep == std::string_view::npos) {
      throw DataError(list, fmt::format("line {}: '{}' has no label (expected 'relative/path label')", lineno, body));
    }
    const auto label = parse_label(body.substr(sep + 1));
    if (!label) {
      throw DataError(list, fmt::format("line {}: label '{}' is not a non-negative whole number", lineno,
                                        body.substr(sep + 1)));
    }
    check_label(*label, max_classes, list, fmt::format("line {}", lineno));
    names_.append(body.substr(0, body.find_last_not_of(" \t", sep) + 1));
    ends_.push_back(names_.size());
    labels_.push_back(*label);
    max_label = std::max(max_label, *label);
  }
  if (labels_.empty()) throw DataError(list, "dataset is empty: the file list has no entries");
  names_.shrink_to_fit();
  num_classes_ = static_cast<std::size_t>(max_label + 1);
}

std::string_view FileList::name(std::size_t i) const {
  const std::uint64_t end = ends_.at(i), begin = i == 0 ? 0 : ends_[i - 1];
  return std::string_view(names_).substr(begin, end - begin);
}

fs::path FileList::path(std::size_t i) const { return root_ / name(i); }  // an absolute name stays itself

void FileList::read(std::size_t i, std::vector<std::byte>& out) const { read_whole_file(path(i), out); }

std::uint64_t FileList::stored_size(std::size_t i) const { return file_size_or_unknown(path(i)); }

std::string FileList::relative_name(std::size_t i) const {
  // As the list names it: an absolute path stays itself, so a list moved to
  // another folder keeps its fingerprint.
  const fs::path p = path(i);
  return fs::path(name(i)).is_absolute() ? p.native() : p.lexically_relative(root_).native();
}

std::string FileList::summary() const {
  return fmt::format("file-list {}: {} images, {} classes", list_.string(), labels_.size(), num_classes_);
}

// ---------------------------------------------------------------- TarShards

namespace {

constexpr std::size_t kBlock = 512;

/// A numeric header field: octal text, or GNU base-256 (first byte's top bit
/// set) for large values. Sets *ok = false on anything malformed: stray
/// characters, a negative base-256 value, or a value over 2^63 (no file is
/// that large, and sums with it must not wrap).
std::uint64_t tar_number(const char* field, std::size_t len, bool* ok) {
  constexpr std::uint64_t kMax = std::uint64_t{1} << 63U;
  const auto* u = reinterpret_cast<const unsigned char*>(field);
  if ((u[0] & 0x80U) != 0) {  // GNU base-256 for large sizes
    if ((u[0] & 0x40U) != 0) {  // negative
      *ok = false;
      return 0;
    }
    std::uint64_t v = u[0] & 0x3fU;
    for (std::size_t i = 1; i < len; ++i) {
      if (v > (kMax >> 8U)) {
        *ok = false;
        return 0;
      }
      v = (v << 8U) | u[i];
    }
    if (v > kMax) *ok = false;
    return *ok ? v : 0;
  }
  std::uint64_t v = 0;
  std::size_t i = 0;
  while (i < len && (field[i] == ' ' || field[i] == '\0')) ++i;
  for (; i < len && field[i] >= '0' && field[i] <= '7'; ++i) v = v * 8 + static_cast<std::uint64_t>(field[i] - '0');
  for (; i < len; ++i) {
    if (field[i] != ' ' && field[i] != '\0') *ok = false;
  }
  return v;  // at most 11 octal digits in a 12-byte field: cannot overflow
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

/// Whether a member's name makes it part of a sample (an image or a .cls
/// label, WebDataset's key.ext with the extension after the first dot).
bool is_sample_member_name(const std::string& name) {
  const auto slash = name.rfind('/');
  const auto dot = name.find('.', slash == std::string::npos ? 0 : slash + 1);
  if (dot == std::string::npos) return false;
  const std::string ext = lower(name.substr(dot + 1));
  return ext == "cls" || is_image_extension(ext);
}

/// One shard's index while its headers are read.
struct TarIndexState {
  std::vector<TarShards::Member> members;
  std::unordered_map<std::string, std::size_t> by_name;  // the latest member of each name, for hard links
  std::string long_name;         // from a GNU 'L' or pax 'x' record, for the next member
  std::string long_link;         // a link's target, from a GNU 'K' or pax 'x' record
  std::string last = "(none)";  // the last member's name, for messages
};

/// The header's size field, after its checksum and number fields are checked.
std::uint64_t checked_member_size(const std::array<char, kBlock>& h, std::uint64_t off, const std::string& name,
                                  const fs::path& path) {
  bool ok = true;
  const std::uint64_t size = tar_number(&h[124], 12, &ok);
  const std::uint64_t stored = tar_number(&h[148], 8, &ok);
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < kBlock; ++i) sum += (i >= 148 && i < 156) ? std::uint64_t{' '} : std::uint64_t{static_cast<unsigned char>(h[i])};
  if (!ok || sum != stored) {
    throw DataError(path, fmt::format("bad tar header at byte {} (member '{}'; checksum or size field)", off, name));
  }
  return size;
}

/// A GNU 'L' (name) or 'K' (link target) record, or a pax 'x' record's path
/// and linkpath: they name the next member.
void read_long_record(TarIndexState& st, char type, const std::string& rec) {
  if (type == 'L' || type == 'K') {
    (type == 'L' ? st.long_name : st.long_link) = rec.substr(0, strnlen(rec.data(), rec.size()));
    return;
  }
  std::size_t p = 0;  // pax: "len key=value\n" records; we need only path and linkpath
  while (p < rec.size()) {
    const auto sp = rec.find(' ', p), nl = rec.find('\n', p);
    if (sp == std::string::npos || nl == std::string::npos || nl < sp) break;
    const std::string kv = rec.substr(sp + 1, nl - sp - 1);
    if (kv.rfind("path=", 0) == 0) st.long_name = kv.substr(5);
    if (kv.rfind("linkpath=", 0) == 0) st.long_link = kv.substr(9);
    p = nl + 1;
  }
}

/// A file ('0', '\0', '7'), hard link ('1') or symbolic link ('2') header
/// whose data starts at `data`: the member it adds, or the refusal.
void add_member(TarIndexState& st, const std::array<char, kBlock>& h, char type, std::uint64_t data,
                std::uint64_t size, const fs::path& path) {
  std::string name = st.long_name;
  if (name.empty()) {
    name = field_string(&h[0], 100);
    const std::string prefix = field_string(&h[345], 155);
    if (std::memcmp(&h[257], "ustar", 5) == 0 && !prefix.empty()) name = prefix + "/" + name;
  }
  const std::string target = st.long_link.empty() ? field_string(&h[157], 100) : st.long_link;
  st.last = name;
  st.long_name.clear();
  st.long_link.clear();
  if (type == '1') {
    // A hard link (GNU tar stores a file's second name so): the data is
    // the earlier member's, as tar extracts it.
    const auto it = st.by_name.find(target);
    if (it == st.by_name.end()) {
      throw DataError(path, fmt::format("{}: a hard link to '{}', which is not an earlier member of the shard", name,
                                        target));
    }
    const TarShards::Member& t = st.members[it->second];
    st.by_name[name] = st.members.size();
    st.members.push_back(TarShards::Member{std::move(name), t.offset, t.size});
  } else if (type == '2') {
    if (is_sample_member_name(name)) {
      throw DataError(path, fmt::format("{}: a symbolic link (to '{}'); a shard must hold the sample's own bytes: "
                                        "pack it with tar --dereference (-h)",
                                        name, target));
    }
  } else {
    st.by_name[name] = st.members.size();
    st.members.push_back(TarShards::Member{std::move(name), data, size});
  }
}

std::vector<TarShards::Member> scan_fd(int fd, std::uint64_t file_size, const fs::path& path) {
  TarIndexState st;
  std::array<char, kBlock> h{};
  std::uint64_t off = 0;
  bool ended = false;
  if (file_size == 0) throw DataError(path, "is empty (0 bytes), not a tar archive");
  // Every step below moves `off` forward by at least one block, and every
  // size is compared with what is left of the file before any sum: a crafted
  // header can neither loop the index nor make it allocate.
  while (file_size - off >= kBlock) {
    pread_exact(fd, h.data(), kBlock, off, path, "tar header");
    if (std::all_of(h.begin(), h.end(), [](char c) { return c == 0; })) {
      ended = true;  // end of archive
      break;
    }
    const std::string name_here = st.long_name.empty() ? field_string(&h[0], 100) : st.long_name;
    const std::uint64_t size = checked_member_size(h, off, name_here, path);
    const char type = h[156];
    const std::uint64_t data = off + kBlock;  // <= file_size: a whole block was read at off
    const std::uint64_t left = file_size - data;
    if (size > left) {
      throw DataError(path, fmt::format("member '{}' is cut short: {} bytes declared, {} present", name_here, size, left));
    }
    if (type == 'L' || type == 'K' || type == 'x') {
      if (size > (1U << 20U)) throw DataError(path, fmt::format("long-name record of {} bytes at byte {}", size, off));
      std::string rec(size, '\0');
      pread_exact(fd, rec.data(), size, data, path, "long name");
      read_long_record(st, type, rec);
    } else if (type == '0' || type == '\0' || type == '7' || type == '1' || type == '2') {
      add_member(st, h, type, data, size, path);
    } else {
      st.long_name.clear();  // directories, devices, global pax headers: skipped
      st.long_link.clear();
    }
    // size <= left, so the padded size cannot wrap; the step is >= one block.
    const std::uint64_t padded = size + (kBlock - size % kBlock) % kBlock;
    off = data + std::min(padded, left);
  }
  if (!ended) {
    throw DataError(path, fmt::format("has no end-of-archive blocks: it ends after member '{}' ({} members), so it "
                                      "was cut short or is still being written",
                                      st.last, st.members.size()));
  }
  return std::move(st.members);
}

/// How many shard descriptors a TarShards keeps open: a quarter of the
/// soft RLIMIT_NOFILE (the decoders, sockets and the rest of the program
/// need the others), at least 8.
std::size_t open_file_budget() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return 4096;
  return std::max<std::size_t>(8, static_cast<std::size_t>(r.rlim_cur) / 4);
}

}  // namespace

TarShards::Identity TarShards::identity_of(int fd, const fs::path& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw DataError(path, fmt::format("fstat: {}", std::strerror(errno)));
  return Identity{static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino),
                  static_cast<std::uint64_t>(st.st_size),
                  static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

std::vector<TarShards::Member> TarShards::scan(const fs::path& tar) {
  const RegularFile file(tar, "a tar shard");
  return scan_fd(file.fd(), file.size(), tar);
}

TarShards::TarShards(std::vector<fs::path> shards, std::vector<std::string> sources, std::shared_ptr<const void> keep,
                     std::size_t max_classes)
    : TarShards(std::move(shards), max_classes) {
  sources_ = std::move(sources);
  keep_ = std::move(keep);
}

std::vector<TarShards::IndexedSample> TarShards::index(const fs::path& tar, std::size_t max_classes) {
  check_max_classes(max_classes);
  const RegularFile file(tar, "a tar shard");
  return index_fd(file.fd(), file.size(), tar, max_classes);
}

bool TarShards::header_matches(const char* h, std::uint64_t size, std::uint64_t header_sum) noexcept {
  std::array<char, kBlock> block{};
  std::memcpy(block.data(), h, kBlock);
  bool ok = true;
  const std::uint64_t declared = tar_number(&block[124], 12, &ok);
  const std::uint64_t stored = tar_number(&block[148], 8, &ok);
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < kBlock; ++i) {
    sum += (i >= 148 && i < 156) ? std::uint64_t{' '} : std::uint64_t{static_cast<unsigned char>(block[i])};
  }
  return ok && sum == stored && declared == size && stored == header_sum;
}

bool TarShards::header_matches(const char* h, std::uint64_t size, std::uint64_t header_sum,
                               std::string_view name) noexcept {
  if (!header_matches(h, size, header_sum)) return false;
  // A name that is not ASCII is in a pax record before the header, which
  // holds a stand-in (Python's tarfile writes '?' for each character).
  if (std::any_of(name.begin(), name.end(), [](char c) { return static_cast<unsigned char>(c) >= 0x80; })) return true;
  const std::string_view field(h, ::strnlen(h, 100));
  const std::string_view prefix(h + 345, ::strnlen(h + 345, 155));
  const bool ustar = std::memcmp(h + 257, "ustar", 5) == 0;
  if (ustar && !prefix.empty()) {
    if (name.size() == prefix.size() + 1 + field.size() && name.starts_with(prefix) && name[prefix.size()] == '/' &&
        name.ends_with(field)) {
      return true;
    }
  }
  if (field == name) return true;
  // A long name: the header holds a cut copy (GNU) or a stand-in (pax).
  return name.size() >= 100 && (name.starts_with(field) || field.find("PaxHeader") != std::string_view::npos);
}

std::vector<TarShards::IndexedSample> TarShards::index_fd(int fd, std::uint64_t file_size, const fs::path& path,
                                                          std::size_t max_classes) {
  std::vector<IndexedSample> out;
  // key -> (image member, label); Note [WebDataset keys]: a key is the
  // name up to the first dot of its last path component (webdataset's
  // reader: "dir/photo.2019.jpg" is key "dir/photo", field "2019.jpg").
  std::map<std::string, std::pair<std::optional<Member>, std::optional<std::int64_t>>> by_key;
  std::map<std::string, std::string> dotted;  // key -> a member whose field only ends like an image's or a label's
  std::vector<std::string> order;
  for (Member& m : scan_fd(fd, file_size, path)) {
    const auto slash = m.name.rfind('/');
    const auto dot = m.name.find('.', slash == std::string::npos ? 0 : slash + 1);
    if (dot == std::string::npos) continue;
    const std::string key = m.name.substr(0, dot), ext = lower(m.name.substr(dot + 1));
    auto& entry = by_key[key];
    if (!entry.first && !entry.second && !dotted.contains(key)) order.push_back(key);
    if (const auto last = ext.rfind('.'); last != std::string::npos) {
      const std::string tail = ext.substr(last + 1);
      if (tail == "cls" || is_image_extension(tail)) dotted.emplace(key, m.name);
    }
    if (is_image_extension(ext)) {
      if (entry.first) throw DataError(path, fmt::format("{}: a second image for key '{}' ({})", m.name, key, entry.first->name));
      entry.first = m;
    } else if (ext == "cls") {
      // "Last one wins" would label the sample by whichever copy tar kept last.
      if (entry.second) throw DataError(path, fmt::format("{}: a second label for key '{}'", m.name, key));
      if (m.size > 64) throw DataError(path, fmt::format("{}: label member of {} bytes", m.name, m.size));
      std::string text(m.size, '\0');
      pread_exact(fd, text.data(), m.size, m.offset, path, m.name.c_str());
      const auto label = parse_label(text);
      if (!label) throw DataError(path, fmt::format("{}: label '{}' is not a non-negative whole number", m.name, text));
      check_label(*label, max_classes, path, m.name);
      entry.second = *label;
    }
  }
  for (const std::string& key : order) {
    const auto& [image, label] = by_key[key];
    if (!image) {
      // Note [WebDataset keys]: never drop a sample without a word.
      if (const auto d = dotted.find(key); d != dotted.end()) {
        throw DataError(path, fmt::format("{}: its key is '{}' (WebDataset's key is the name up to the first dot "
                                          "of its last path component), so its field is '{}', not an image or "
                                          "a label: this sample would be lost. Write keys without dots "
                                          "(webdataset's own reader does not find it as an image either)",
                                          d->second, key, d->second.substr(key.size() + 1)));
      }
      if (label) {
        throw DataError(path, fmt::format("key '{}' has a .cls label but no image member pinfeed decodes ({})",
                                          key, codec_extensions()));
      }
      continue;  // another field alone (json, txt): not a sample
    }
    if (!label) throw DataError(path, fmt::format("{}: image without a .cls label", image->name));
    out.push_back(IndexedSample{image->name, image->offset, image->size, *label, header_checksum(fd, image->offset, path)});
  }
  return out;
}

TarShards::TarShards(std::vector<fs::path> shards, std::size_t max_classes) : shards_(std::move(shards)) {
  check_max_classes(max_classes);
  if (shards_.empty()) throw ConfigError("tar shards: no shard given");
  std::int64_t max_label = -1;
  max_open_ = open_file_budget();
  fds_.resize(shards_.size());
  where_.resize(shards_.size(), recent_.end());
  for (std::size_t s = 0; s < shards_.size(); ++s) {
    const fs::path& path = shards_[s];
    RegularFile file(path, "a tar shard");
    identity_.push_back(identity_of(file.fd(), path));
    for (IndexedSample& x : index_fd(file.fd(), file.size(), path, max_classes)) {
      max_label = std::max(max_label, x.label);
      Sample sample;
      static_cast<IndexedSample&>(sample) = std::move(x);
      sample.shard = static_cast<std::uint32_t>(s);
      samples_.push_back(std::move(sample));
    }
    // Kept open while the cache has room (most datasets: every shard).
    if (s < max_open_) {
      fds_[s] = std::make_shared<const UniqueFd>(file.take());
      recent_.push_front(static_cast<std::uint32_t>(s));
      where_[s] = recent_.begin();
    }
  }
  if (samples_.empty()) {
    throw DataError(shards_.front(), "dataset is empty: no key.jpg + key.cls pairs in the shards");
  }
  num_classes_ = static_cast<std::size_t>(max_label + 1);
}

TarShards::~TarShards() = default;

fs::path TarShards::shown(std::uint32_t s) const { return sources_.empty() ? shards_[s] : fs::path(sources_[s]); }

std::string TarShards::relative_name(std::size_t i) const {
  const Sample& s = samples_.at(i);
  return fmt::format("{}:{}", shards_[s.shard].filename().string(), s.key);
}

std::string TarShards::describe(std::size_t i) const {
  const Sample& s = samples_.at(i);
  return fmt::format("{}:{}", sources_.empty() ? shards_[s.shard].string() : sources_[s.shard], s.key);
}

void TarShards::read(std::size_t i, std::vector<std::byte>& out) const {
  const Sample& s = samples_.at(i);
  if (s.size > kMaxSampleBytes) throw DataError(describe(i), fmt::format("member of {} bytes is over the limit", s.size));
  out.resize(s.size);
  const auto fd = shard_fd(s.shard);
  check_unchanged(s, fd->get());
  pread_exact(fd->get(), out.data(), s.size, s.offset, shown(s.shard), s.key.c_str());
}

std::uint64_t TarShards::header_checksum(int fd, std::uint64_t data_offset, const fs::path& path) {
  if (data_offset < kBlock) return 0;
  std::array<char, kBlock> h{};
  pread_exact(fd, h.data(), kBlock, data_offset - kBlock, path, "tar header");
  bool ok = true;
  return tar_number(&h[148], 8, &ok);
}

void TarShards::check_unchanged(const Sample& s, int fd) const {
  // A shard rewritten in place keeps its descriptor (and maybe its size): the
  // old offsets would read other members under the old labels. The file's
  // size and time, then the member's own header (the 512 bytes before its
  // data): its checksum, size and name must still be the indexed ones.
  const fs::path path = shown(s.shard);
  const Identity now = identity_of(fd, path);
  const Identity& then = identity_[s.shard];
  if (now.size != then.size || now.mtime_ns != then.mtime_ns) {
    throw DatasetChanged(path, fmt::format("changed since it was indexed ({} -> {} bytes, modified again): member "
                                           "offsets no longer hold the indexed samples; restart to index it again",
                                           then.size, now.size));
  }
  std::array<char, kBlock> h{};
  if (s.offset < kBlock) throw DatasetChanged(path, fmt::format("{}: no header before its data", s.key));
  pread_exact(fd, h.data(), kBlock, s.offset - kBlock, path, "tar header");
  // The header holding the data (the member's own, or a hard link's target)
  // as indexed: its checksum covers its name, size and time.
  bool same = true;
  try {
    same = checked_member_size(h, s.offset - kBlock, s.key, path) == s.size;
  } catch (const DataError&) {
    same = false;
  }
  bool ok = true;
  if (same) same = tar_number(&h[148], 8, &ok) == s.header_sum && ok;
  if (!same) {
    throw DatasetChanged(path, fmt::format("member {} at byte {} is not the indexed one any more (the shard was "
                                           "rewritten in place): restart to index it again",
                                           s.key, s.offset - kBlock));
  }
}

std::shared_ptr<const UniqueFd> TarShards::shard_fd(std::uint32_t s) const {
  {
    const std::scoped_lock lock(fd_mutex_);
    if (fds_[s]) {
      recent_.splice(recent_.begin(), recent_, where_[s]);
      return fds_[s];
    }
  }
  // Opened outside the lock (a slow disk must not stall the other readers).
  const fs::path& path = shards_[s];
  RegularFile file(path, "a tar shard");
  const Identity now = identity_of(file.fd(), path);
  const Identity& then = identity_[s];
  if (now.device != then.device || now.inode != then.inode || now.size != then.size || now.mtime_ns != then.mtime_ns) {
    throw DatasetChanged(shown(s), "changed since it was indexed (a new file, size or modification time): restart to "
                                   "index it again");
  }
  auto fd = std::make_shared<const UniqueFd>(file.take());
  const std::scoped_lock lock(fd_mutex_);
  if (fds_[s]) return fds_[s];  // another reader opened it meanwhile
  while (recent_.size() >= max_open_) {
    const std::uint32_t oldest = recent_.back();
    recent_.pop_back();
    where_[oldest] = recent_.end();
    fds_[oldest].reset();  // closed when its last reader is done
  }
  fds_[s] = fd;
  recent_.push_front(s);
  where_[s] = recent_.begin();
  return fd;
}

std::string TarShards::summary() const {
  return fmt::format("tar shards ({} files, first {}): {} images, {} classes", shards_.size(),
                     sources_.empty() ? shards_.front().string() : sources_.front(), samples_.size(), num_classes_);
}

// ---------------------------------------------------------------- opening

namespace {

constexpr std::size_t kMaxExpanded = 1'000'000;

/// Where the '}' closing the '{' at `open` is (npos: none), skipping escapes.
std::size_t matching_brace(const std::string& s, std::size_t open) {
  int depth = 0;
  for (std::size_t i = open; i < s.size(); ++i) {
    if (s[i] == '\\') {
      ++i;
    } else if (s[i] == '{') {
      ++depth;
    } else if (s[i] == '}' && --depth == 0) {
      return i;
    }
  }
  return std::string::npos;
}

/// `s` split at the commas outside braces (escaped ones kept, escaped); a
/// group's body at its own level's commas alike.
std::vector<std::string> split_top(const std::string& s) {
  std::vector<std::string> out(1);
  int depth = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '\\' && i + 1 < s.size()) {
      out.back() += s.substr(i, 2);
      ++i;
      continue;
    }
    if (c == '{') ++depth;
    if (c == '}' && depth > 0) --depth;
    if (depth == 0 && c == ',') {
      out.emplace_back();
      continue;
    }
    out.back() += c;
  }
  return out;
}

/// {first..last} or {first..last..step}: numbers (zero-padded to the longer
/// bound when either starts with 0, as braceexpand does) or single letters,
/// up or down. Nothing when `body` is not a range.
std::optional<std::vector<std::string>> range_of(const std::string& body, const std::string& shown) {
  const auto dots = body.find("..");
  if (dots == std::string::npos) return std::nullopt;
  const std::string a = body.substr(0, dots);
  std::string b = body.substr(dots + 2), step_text;
  if (const auto more = b.find(".."); more != std::string::npos) {
    step_text = b.substr(more + 2);
    b.resize(more);
  }
  std::int64_t step = 1;
  if (!step_text.empty()) {
    const auto r = std::from_chars(step_text.data(), step_text.data() + step_text.size(), step);
    if (r.ec != std::errc{} || r.ptr != step_text.data() + step_text.size() || step == 0 ||
        step < -static_cast<std::int64_t>(kMaxExpanded) || step > static_cast<std::int64_t>(kMaxExpanded)) {
      return std::nullopt;  // not a range: literal
    }
    step = step < 0 ? -step : step;
  }
  std::vector<std::string> out;
  const auto letter = [](const std::string& t) { return t.size() == 1 && std::isalpha(static_cast<unsigned char>(t[0])) != 0; };
  if (letter(a) && letter(b)) {
    const std::int64_t lo = a[0], hi = b[0], dir = lo <= hi ? 1 : -1;
    for (std::int64_t c = lo; dir > 0 ? c <= hi : c >= hi; c += dir * step) out.emplace_back(1, static_cast<char>(c));
    return out;
  }
  std::int64_t lo = 0, hi = 0;  // negative bounds too, as braceexpand takes them
  const auto r1 = std::from_chars(a.data(), a.data() + a.size(), lo);
  const auto r2 = std::from_chars(b.data(), b.data() + b.size(), hi);
  if (a.empty() || b.empty() || r1.ec != std::errc{} || r2.ec != std::errc{} || r1.ptr != a.data() + a.size() ||
      r2.ptr != b.data() + b.size() || lo < -(std::int64_t{1} << 62) || hi < -(std::int64_t{1} << 62) ||
      lo > (std::int64_t{1} << 62) || hi > (std::int64_t{1} << 62)) {
    return std::nullopt;  // not a range ({x..1}, {1.5..2}): literal, as braceexpand keeps it
  }
  const auto n = static_cast<std::uint64_t>(lo > hi ? lo - hi : hi - lo) / static_cast<std::uint64_t>(step);
  if (n >= kMaxExpanded) {
    throw ConfigError(fmt::format("shard pattern '{}': {{{}}} names over {} shards", shown, body, kMaxExpanded));
  }
  const auto zero_led = [](const std::string& t) {
    const std::size_t d = t.starts_with('-') ? 1 : 0;
    return t.size() > d + 1 && t[d] == '0';
  };
  const std::size_t width = zero_led(a) || zero_led(b) ? std::max(a.size(), b.size()) : 0;
  for (std::uint64_t k = 0; k <= n; ++k) {
    const std::int64_t v = lo <= hi ? lo + static_cast<std::int64_t>(k) * step : lo - static_cast<std::int64_t>(k) * step;
    out.push_back(v < 0 ? fmt::format("-{:0{}}", -v, width > 0 ? width - 1 : 0) : fmt::format("{:0{}}", v, width));
  }
  return out;
}

/// Every group of `s` expanded, left to right (webdataset's braceexpand:
/// lists {a,b}, ranges {a..b}, nested and several in one name).
void expand_groups(const std::string& s, const std::string& shown, std::vector<std::string>& out, std::size_t from = 0) {
  std::size_t open = std::string::npos;
  for (std::size_t i = from; i < s.size(); ++i) {
    if (s[i] == '\\') {
      ++i;
    } else if (s[i] == '{') {
      open = i;
      break;
    }
  }
  const std::size_t close = open == std::string::npos ? open : matching_brace(s, open);
  if (close == std::string::npos) {  // no group (an unmatched brace is literal, as braceexpand keeps it)
    if (out.size() >= kMaxExpanded) throw ConfigError(fmt::format("shard pattern '{}' names over {} shards", shown, kMaxExpanded));
    out.push_back(s);
    return;
  }
  const std::string head = s.substr(0, open), body = s.substr(open + 1, close - open - 1), tail = s.substr(close + 1);
  std::vector<std::string> choices = split_top(body);
  if (choices.size() == 1) {
    auto range = range_of(body, shown);
    if (!range) {  // neither a list nor a range ("${VAR}", awk's '{print}'): literal, as braceexpand keeps it
      expand_groups(s, shown, out, open + 1);
      return;
    }
    choices = std::move(*range);
  }
  for (const std::string& c : choices) expand_groups(head + c + tail, shown, out, head.size());
}

std::string unescape(const std::string& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size() && (s[i + 1] == ',' || s[i + 1] == '{' || s[i + 1] == '}' || s[i + 1] == '\\')) ++i;
    out += s[i];
  }
  return out;
}

}  // namespace

std::vector<std::string> split_shard_spec(const std::string& spec) {
  std::vector<std::string> out;
  for (std::string& part : split_top(spec)) {
    if (!part.empty()) out.push_back(std::move(part));
  }
  return out;
}

std::vector<fs::path> expand_shard_pattern(const std::string& pattern) {
  std::vector<fs::path> out;
  for (const std::string& part : split_shard_spec(pattern)) {
    const std::string shown = is_remote_url(part) ? redact_url(part) : part;
    std::vector<std::string> names;
    expand_groups(part, shown, names);
    for (const std::string& n : names) out.emplace_back(unescape(n));
  }
  if (out.empty()) throw ConfigError(fmt::format("shard pattern '{}' names no file", redact_spec(pattern)));
  return out;
}

void check_same_classes(const Dataset& train, const Dataset& val) {
  const auto* tf = dynamic_cast<const ImageFolder*>(&train);
  const auto* vf = dynamic_cast<const ImageFolder*>(&val);
  if (tf != nullptr && vf != nullptr) check_same_class_names(tf->classes(), vf->classes());
  // File lists and shards carry their labels: one past the model's classes
  // is refused where it is read, naming its file (Worker's validation pass).
}

void check_same_class_names(const std::vector<std::string>& t, const std::vector<std::string>& v) {
  if (t == v) return;
  const std::size_t n = std::min(t.size(), v.size());
  std::size_t k = 0;
  while (k < n && t[k] == v[k]) ++k;
  const std::string diff =
      k < n ? fmt::format("class {} is '{}' in validation but '{}' in training", k, v[k], t[k])
      : k < t.size() ? fmt::format("training's class {} '{}' has no validation folder", k, t[k])
                     : fmt::format("validation's class {} '{}' has no training folder", k, v[k]);
  throw ConfigError(fmt::format("the validation set's classes are not the training set's ({} in validation, {} in "
                                "training): {}; labels are folder positions, so every label from there on would "
                                "be wrong. Give both sets the same class folders",
                                v.size(), t.size(), diff));
}

// ---------------------------------------------------------------- fingerprints

DatasetFingerprint fingerprint(const Dataset& d) {
  DatasetFingerprint f;
  f.samples = d.size();
  f.num_classes = d.num_classes();
  if (const auto* folder = dynamic_cast<const ImageFolder*>(&d)) f.classes = folder->classes();
  // One hash per sample, in parallel (a stat each: a network filesystem's
  // latency is hidden across cores), then one hash over them in order.
  std::vector<std::uint64_t> each(d.size());
  check_worker_threads_usable("dataset fingerprint");
  note_worker_threads();
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, d.size(), 256), [&](const tbb::blocked_range<std::size_t>& r) {
    for (std::size_t i = r.begin(); i != r.end(); ++i) {
      const std::string name = d.relative_name(i);
      const std::array<std::uint64_t, 3> fields{XXH3_64bits(name.data(), name.size()), d.stored_size(i),
                                                static_cast<std::uint64_t>(d.label(i))};
      each[i] = XXH3_64bits(fields.data(), sizeof fields);
    }
  });
  f.hash = XXH3_64bits(each.data(), each.size() * sizeof(std::uint64_t));
  return f;
}

namespace {

/// As nlohmann's dump stores it: invalid UTF-8 bytes become U+FFFD.
std::string utf8_replaced(const std::string& s) {
  return nlohmann::json::parse(nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace))
      .get<std::string>();
}

std::string quoted_list(const std::vector<std::string>& names) {
  const std::size_t shown = std::min<std::size_t>(names.size(), 5);
  std::string out;
  for (std::size_t i = 0; i < shown; ++i) out += fmt::format("{}'{}'", i == 0 ? "" : ", ", names[i]);
  if (shown < names.size()) out += fmt::format(" and {} more", names.size() - shown);
  return out;
}

}  // namespace

std::string describe_change(const DatasetFingerprint& was, const DatasetFingerprint& now) {
  std::vector<std::string> what;
  if (!was.classes.empty() || !now.classes.empty()) {
    std::set<std::string> before, after;
    for (const auto& c : was.classes) before.insert(utf8_replaced(c));
    for (const auto& c : now.classes) after.insert(utf8_replaced(c));
    std::vector<std::string> removed, added;
    std::set_difference(before.begin(), before.end(), after.begin(), after.end(), std::back_inserter(removed));
    std::set_difference(after.begin(), after.end(), before.begin(), before.end(), std::back_inserter(added));
    if (!removed.empty() && removed.size() == added.size()) {
      what.push_back(fmt::format("class{} {} renamed to {}", removed.size() == 1 ? "" : "es", quoted_list(removed),
                                 quoted_list(added)));
    } else {
      if (!removed.empty()) what.push_back(fmt::format("class{} {} removed", removed.size() == 1 ? "" : "es", quoted_list(removed)));
      if (!added.empty()) what.push_back(fmt::format("class{} {} added", added.size() == 1 ? "" : "es", quoted_list(added)));
    }
  } else if (was.num_classes != now.num_classes) {
    what.push_back(fmt::format("{} classes, now {}", was.num_classes, now.num_classes));
  }
  if (now.samples != was.samples) {
    const std::uint64_t n = now.samples > was.samples ? now.samples - was.samples : was.samples - now.samples;
    what.push_back(fmt::format("{} sample{} {} ({} -> {})", n, n == 1 ? "" : "s",
                               now.samples > was.samples ? "added" : "removed", was.samples, now.samples));
  }
  if (what.empty() && was.hash != now.hash) {
    what.push_back(fmt::format("the same {} samples and classes, but their paths, sizes or labels differ (files "
                               "replaced, renamed, edited or relabelled)",
                               now.samples));
  }
  std::string out;
  for (const auto& w : what) out += (out.empty() ? "" : "; ") + w;
  return out;
}

namespace {

/// Shards some of which are URLs: streamed when every shard has an index
/// sidecar (streamed.hpp), else staged (remote.hpp); a shard's error names
/// its URL, not the cache's file.
std::unique_ptr<Dataset> open_remote_shards(const std::vector<fs::path>& expanded, std::size_t max_classes,
                                            const RemoteConfig& remote) {
  std::vector<std::string> urls, sources, all;
  for (const fs::path& p : expanded) {
    if (is_remote_url(p.string())) urls.push_back(p.string());
    all.push_back(p.string());
  }
  // Note [Streamed shards]: with index sidecars, no shard is fetched whole first.
  if (auto streamed = StreamedShards::open(all, max_classes, remote)) return streamed;
  StagedShards staged = stage_shards(urls, remote);
  std::vector<fs::path> local;
  std::size_t next = 0;
  for (const fs::path& p : expanded) {
    const bool url = is_remote_url(p.string());
    local.push_back(url ? staged.local[next++] : p);
    sources.push_back(url ? redact_url(p.string()) : p.string());
  }
  try {
    return std::make_unique<TarShards>(local, std::move(sources), staged.keep, max_classes);
  } catch (const DataError& e) {
    for (std::size_t i = 0; i < local.size(); ++i) {
      if (local[i] == e.path() && local[i] != expanded[i]) throw DataError(redact_url(expanded[i].string()), e.reason());
    }
    throw;
  }
}

}  // namespace

std::unique_ptr<Dataset> open_dataset(const std::string& spec, const fs::path& root, std::size_t max_classes,
                                      const RemoteConfig& remote) {
  std::error_code ec;
  if (spec.empty()) throw ConfigError("dataset: no path given");
  const std::vector<std::string> parts = split_shard_spec(spec);
  if (std::any_of(parts.begin(), parts.end(), [](const std::string& p) { return is_remote_url(p); })) {
    check_max_classes(max_classes);
    std::vector<fs::path> expanded;
    for (const fs::path& p : expand_shard_pattern(spec)) {
      const std::string s = p.string();
      if (s.starts_with("s3://") && s.ends_with('/')) {  // a prefix: its .tar objects, listed
        for (const std::string& u : list_s3_shards(s, remote)) expanded.emplace_back(u);
      } else {
        expanded.push_back(p);
      }
    }
    for (const fs::path& p : expanded) {
      const std::string s = p.string();
      if (!is_remote_url(s) && lower(p.extension().string()) != ".tar") {
        throw ConfigError(fmt::format("dataset '{}': '{}' is not a tar shard (URLs name WebDataset shards)",
                                      redact_spec(spec), s));
      }
      if (is_remote_url(s) && !s.starts_with("pipe:")) (void)remote_shard_name(s);  // a URL naming no file, said now
    }
    return open_remote_shards(expanded, max_classes, remote);
  }
  if (fs::is_directory(spec, ec)) return std::make_unique<ImageFolder>(spec, max_classes);
  check_max_classes(max_classes);
  const bool tar = spec.find('{') != std::string::npos || spec.find(',') != std::string::npos ||
                   lower(fs::path(spec).extension().string()) == ".tar";
  if (tar) return std::make_unique<TarShards>(expand_shard_pattern(spec), max_classes);
  if (!fs::exists(spec, ec)) throw DataError(spec, "dataset path does not exist");
  return std::make_unique<FileList>(spec, root.empty() ? fs::path(spec).parent_path() : root, max_classes);
}

}  // namespace pinfeed::loader
