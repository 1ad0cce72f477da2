// TarShards: WebDataset-style shards on local disk, indexed once by their
// headers and read by offset (dataset.hpp).
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <unordered_map>

#include "dataset_names.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/file_io.hpp"
#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/tar_writer.hpp"

namespace fs = std::filesystem;

namespace pinfeed::loader {

using detail::check_label;
using detail::is_image_extension;
using detail::lower;
using detail::parse_label;

namespace {

constexpr std::size_t kBlock = 512;

/// A numeric header field: octal text, or GNU base-256 (first byte's top bit
/// set) for large values. Sets *ok = false on anything malformed: stray
/// characters, a negative base-256 value, or a value over 2^63 (no file is
/// that large, and sums with it must not wrap).
std::uint64_t tar_number(const char* field, std::size_t len, bool* ok) {
  constexpr std::uint64_t kMax = std::uint64_t{1} << 63U;
  const auto* u = reinterpret_cast<const unsigned char*>(field);
  if ((u[0] & 0x80U) != 0) {    // GNU base-256 for large sizes
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
  std::string long_name;                                 // from a GNU 'L' or pax 'x' record, for the next member
  std::string long_link;                                 // a link's target, from a GNU 'K' or pax 'x' record
  std::string last = "(none)";                           // the last member's name, for messages
};

/// The header's size field, after its checksum and number fields are checked.
std::uint64_t checked_member_size(const std::array<char, kBlock>& h, std::uint64_t off, const std::string& name,
                                  const fs::path& path) {
  bool ok = true;
  const std::uint64_t size = tar_number(&h[124], 12, &ok);
  const std::uint64_t stored = tar_number(&h[148], 8, &ok);
  if (!ok || ustar_checksum(h) != stored) {
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
void add_member(TarIndexState& st, const std::array<char, kBlock>& h, char type, std::uint64_t data, std::uint64_t size,
                const fs::path& path) {
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
      throw DataError(
          path, fmt::format("{}: a hard link to '{}', which is not an earlier member of the shard", name, target));
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
      throw DataError(path,
                      fmt::format("member '{}' is cut short: {} bytes declared, {} present", name_here, size, left));
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
  return ok && ustar_checksum(block) == stored && declared == size && stored == header_sum;
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
      if (entry.first)
        throw DataError(path, fmt::format("{}: a second image for key '{}' ({})", m.name, key, entry.first->name));
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
        throw DataError(path, fmt::format("key '{}' has a .cls label but no image member pinfeed decodes ({})", key,
                                          codec_extensions()));
      }
      continue;  // another field alone (json, txt): not a sample
    }
    if (!label) throw DataError(path, fmt::format("{}: image without a .cls label", image->name));
    out.push_back(
        IndexedSample{image->name, image->offset, image->size, *label, header_checksum(fd, image->offset, path)});
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
  if (s.size > kMaxSampleBytes)
    throw DataError(describe(i), fmt::format("member of {} bytes is over the limit", s.size));
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
    throw DatasetChanged(shown(s),
                         "changed since it was indexed (a new file, size or modification time): restart to "
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

}  // namespace pinfeed::loader
