#include "pinfeed/loader/dataset.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>

#include <oneapi/tbb/parallel_for.h>
#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "dataset_names.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/file_io.hpp"
#include "pinfeed/loader/image_decoder.hpp"

namespace fs = std::filesystem;

namespace pinfeed::loader {

using detail::check_label;
using detail::is_image_extension;
using detail::lower;
using detail::parse_label;

namespace {

/// torchvision's IMG_EXTENSIONS: a file with one of these is an image of
/// the dataset. The codec registry's are decoded; the others are refused
/// when the dataset is opened, never replaced sample by sample.
enum class NameKind { other, decodable, undecodable };
NameKind image_name_kind(const fs::path& p) {
  static const std::set<std::string> kTorchvision{".jpg", ".jpeg", ".png",  ".ppm", ".bmp",
                                                  ".pgm", ".tif",  ".tiff", ".webp"};
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
    const char32_t c =
        (char32_t{b} & 0x0FU) << 12U | (char32_t{byte(i + 1)} & 0x3FU) << 6U | (char32_t{byte(i + 2)} & 0x3FU);
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
        throw DataError(it->path(),
                        fmt::format("is a {} image: pinfeed decodes {}; convert it or move it out of the dataset",
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
                                       codec_extensions(), empty.size() == 1 ? "" : "s", names,
                                       empty.size() == 1 ? "it" : "them", empty.size() == 1 ? "it" : "them"));
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
      throw DataError(
          list, fmt::format("line {}: label '{}' is not a non-negative whole number", lineno, body.substr(sep + 1)));
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

void check_same_classes(const Dataset& train, const Dataset& val) {
  if (!train.class_names().empty() && !val.class_names().empty()) {
    check_same_class_names(train.class_names(), val.class_names());
  }
  // File lists and shards carry their labels: one past the model's classes
  // is refused where it is read, naming its file (Worker's validation pass).
}

void check_same_class_names(const std::vector<std::string>& t, const std::vector<std::string>& v) {
  if (t == v) return;
  const std::size_t n = std::min(t.size(), v.size());
  std::size_t k = 0;
  while (k < n && t[k] == v[k]) ++k;
  const std::string diff = k < n ? fmt::format("class {} is '{}' in validation but '{}' in training", k, v[k], t[k])
                           : k < t.size() ? fmt::format("training's class {} '{}' has no validation folder", k, t[k])
                                          : fmt::format("validation's class {} '{}' has no training folder", k, v[k]);
  throw ConfigError(
      fmt::format("the validation set's classes are not the training set's ({} in validation, {} in "
                  "training): {}; labels are folder positions, so every label from there on would "
                  "be wrong. Give both sets the same class folders",
                  v.size(), t.size(), diff));
}

// ---------------------------------------------------------------- fingerprints

DatasetFingerprint fingerprint(const Dataset& d) {
  DatasetFingerprint f;
  f.samples = d.size();
  f.num_classes = d.num_classes();
  f.classes = d.class_names();
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
      if (!removed.empty())
        what.push_back(fmt::format("class{} {} removed", removed.size() == 1 ? "" : "es", quoted_list(removed)));
      if (!added.empty())
        what.push_back(fmt::format("class{} {} added", added.size() == 1 ? "" : "es", quoted_list(added)));
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
    what.push_back(
        fmt::format("the same {} samples and classes, but their paths, sizes or labels differ (files "
                    "replaced, renamed, edited or relabelled)",
                    now.samples));
  }
  std::string out;
  for (const auto& w : what) out += (out.empty() ? "" : "; ") + w;
  return out;
}

}  // namespace pinfeed::loader
