// The shard cache (remote.hpp): staging whole shards into cache_dir or a
// private folder, what the cache owns and touches (Note [Cache ownership]),
// locks shared by a node's ranks and eviction (Note [Remote staging]). One
// fetch is remote_fetch.cpp's (cache_files.hpp); the transport (libcurl
// handles, retries, the progress watch) remote.cpp's (curl_transfer.hpp).
#include <curl/curl.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cache_files.hpp"
#include "curl_transfer.hpp"
#include "pinfeed/file_io.hpp"
#include "pinfeed/loader/remote.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::loader {

namespace fs = std::filesystem;
using namespace detail;

// Note [Cache ownership]
// cache_dir may be a folder others use too ($HOME, a shared scratch): the
// cache touches only what it made. Its entries are folders named
// pinfeed-<16 hex digits> holding a regular file .pinfeed-cache (the
// marker), owned by this user; each is made whole under a temporary name
// and renamed into place (RENAME_NOREPLACE), so a folder without the marker
// was never ours. Inside one, every file is reached with openat() from the
// folder's descriptor and O_NOFOLLOW: a symbolic link planted where a file
// of ours goes (a <hash> folder linked elsewhere, NAME.meta.tmp linked to a
// victim, a dangling NAME.lock) is refused, naming it, never followed. Files
// we write anew (.part, .meta.tmp) are unlinked and made with O_EXCL, so a
// planted hard link is never written through either. The sweep (.part left
// by a killed fetch) and eviction walk only entry folders with the marker,
// and in them only NAME + NAME.meta pairs: a user's movie.mkv.part or a
// backup/X beside backup/X.meta elsewhere under cache_dir is not ours.

namespace {

constexpr std::string_view kEntryPrefix = "pinfeed-";
constexpr const char* kMarker = ".pinfeed-cache";

/// Whether `name` in `root` is an entry folder of the cache (a real folder,
/// named so, ours, with the marker). Never follows a link.
bool is_entry(const CacheFolder& root, const std::string& name) {
  if (name.size() != kEntryPrefix.size() + 16 || !name.starts_with(kEntryPrefix)) return false;
  if (!std::all_of(name.begin() + static_cast<std::ptrdiff_t>(kEntryPrefix.size()), name.end(),
                   [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); })) {
    return false;
  }
  struct stat st {};
  if (::fstatat(root.fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode) ||
      st.st_uid != ::geteuid()) {
    return false;
  }
  const std::string marker = name + "/" + kMarker;
  return ::fstatat(root.fd.get(), marker.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode);
}

/// This host's name, for names other hosts sharing cache_dir must not take
/// for theirs.
std::string host_name() {
  std::array<char, 256> h{};
  if (::gethostname(h.data(), h.size() - 1) != 0) return "host";
  std::string out(h.data());
  std::replace(out.begin(), out.end(), '-', '_');
  return out.empty() ? "host" : out;
}

/// cache_dir (made if missing; the user's choice, so a link to it is fine).
CacheFolder open_cache_root(const fs::path& root) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) throw DataError(root, fmt::format("cannot make cache_dir: {}", ec.message()));
  return open_folder(root);
}

/// The entry folder `name` of the cache at `root`, made (whole, with its
/// marker) if missing; a folder of that name that is not ours is refused.
CacheFolder open_entry(const CacheFolder& root, const std::string& name) {
  struct stat st {};
  if (::fstatat(root.fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    // Made under a temporary name with its marker, then renamed into place:
    // nobody ever sees an entry without its marker.
    std::string temp = fmt::format(".{}new-{}-{}-XXXXXX", kEntryPrefix, ::getpid(), host_name());
    const std::string full = (root.path / temp).string();
    std::string templ = full;
    if (::mkdtemp(templ.data()) == nullptr) {
      throw DataError(root.path, fmt::format("cannot make a folder in cache_dir: {}", std::strerror(errno)));
    }
    temp = fs::path(templ).filename().string();
    {
      const CacheFolder fresh = open_folder(templ);
      (void)open_in(fresh, kMarker, O_WRONLY | O_CREAT | O_EXCL);
    }
    int rc = ::renameat2(root.fd.get(), temp.c_str(), root.fd.get(), name.c_str(), RENAME_NOREPLACE);
    if (rc != 0 && (errno == EINVAL || errno == ENOSYS)) {
      // NFS, CephFS, Lustre and most FUSE file systems have no
      // RENAME_NOREPLACE: a plain rename cannot replace a folder that holds
      // anything (an entry holds its marker), so it is as safe here.
      rc = ::renameat(root.fd.get(), temp.c_str(), root.fd.get(), name.c_str());
    }
    if (rc != 0) {
      const int err = errno;
      std::error_code e2;
      fs::remove_all(templ, e2);
      if (err != EEXIST && err != ENOTEMPTY) {
        throw DataError(root.path / name, fmt::format("cannot make the cache's folder: {}", std::strerror(err)));
      }  // another rank made it meanwhile
    }
  }
  if (::fstatat(root.fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)) {
    refuse_planted(root.path / name, "a symbolic link");
  }
  if (!is_entry(root, name)) {
    refuse_planted(root.path / name, "a folder without pinfeed's .pinfeed-cache marker (or another user's)");
  }
  UniqueFd fd(::openat(root.fd.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) refuse_planted(root.path / name, "not a folder of pinfeed's");
  // The folder opened is the one checked (not one swapped in since): ours,
  // with its marker.
  if (::fstat(fd.get(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid() ||
      ::fstatat(fd.get(), kMarker, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) {
    refuse_planted(root.path / name, "a folder without pinfeed's .pinfeed-cache marker (or another user's)");
  }
  return {std::move(fd), root.path / name};
}

}  // namespace

// Note [Remote staging]
// A remote shard is fetched whole into <cache>/pinfeed-<hash of its URL's
// folder>/<its file name>, beside <name>.meta (JSON: the URL as shown, a
// hash of the URL as given, size, ETag, Last-Modified) and <name>.lock;
// Note [Cache ownership] says what else the cache touches (nothing).
// The file appears only complete (written as .part, fsync'ed, renamed), and
// the .meta after it, so a crash leaves a .part or a file without .meta, and
// neither is ever read. A cached file is used when its .meta names the same
// URL and size, and the server (HEAD) still gives that size and ETag, or
// without an ETag that Last-Modified, or without either the same first and
// last 64 KiB (two Range requests); else it is fetched again. Waiting for
// another process's lock ends (Note [Bounded waits]): past remote_timeout x
// (remote_retries + 1) seconds in which its shard did not change, the error
// names the holder's pid. Ranks of one node share the cache: the check and fetch
// happen under an exclusive flock on <name>.fetch (the others wait, then find
// it cached), and every user holds a shared flock on <name>.lock while its
// dataset is open, so eviction (least recently used first, by the access
// time staging sets, past cache_limit;
// it must get both locks without waiting) skips shards in use. The
// name is the URL's file name, so fingerprints, resume states and sample
// order are those of the same shards read from a local folder.

namespace {

struct Staged {
  std::vector<UniqueFd> locks;
  fs::path private_dir;  // removed with the dataset
  UniqueFd owner;        // its .owner, locked while it lives: the sweep's sign that it does
  Staged() = default;
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  ~Staged() {
    locks.clear();
    if (!private_dir.empty()) {
      std::error_code ec;
      fs::remove_all(private_dir, ec);
    }
  }
};

/// The cache's entry folder for a URL: its folder's address without query,
/// fragment and user (ranks that sign their own presigned URLs share one
/// copy); a pipe: command's whole text (hashed: its secrets never reach a
/// name).
std::string folder_of(const std::string& raw) {
  const std::string url = raw.starts_with("pipe:") ? raw : redact_url(raw);
  const auto slash = url.rfind('/');
  const std::string prefix = url.starts_with("pipe:") || slash == std::string::npos ? url : url.substr(0, slash);
  return fmt::format("{}{:016x}", kEntryPrefix, XXH3_64bits(prefix.data(), prefix.size()));
}

/// What a .meta's "key" must be for its file to be `url`'s.
std::string cache_key(const std::string& url) {
  const std::string k = url.starts_with("pipe:") ? url : redact_url(url);
  const XXH128_hash_t h = XXH3_128bits(k.data(), k.size());
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

/// `name` in `dir` opened for reading, or nothing when it is not there.
std::optional<UniqueFd> open_existing(const CacheFolder& dir, const std::string& name) {
  struct stat st {};
  if (::fstatat(dir.fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT) return std::nullopt;
  return open_in(dir, name, O_RDONLY);
}

/// A regular file's size in `dir` (nothing: missing); a link is refused.
std::optional<std::uint64_t> size_in(const CacheFolder& dir, const std::string& name) {
  const auto fd = open_existing(dir, name);
  if (!fd) return std::nullopt;
  return file_size_of(fd->get());
}

std::optional<nlohmann::json> read_meta(const CacheFolder& dir, const std::string& name) {
  const auto fd = open_existing(dir, name);
  if (!fd) return std::nullopt;
  std::string text(std::min<std::uint64_t>(file_size_of(fd->get()), 64 * 1024), '\0');
  if (::pread(fd->get(), text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) return std::nullopt;
  try {
    auto j = nlohmann::json::parse(text);
    if (!j.is_object()) return std::nullopt;
    return j;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;  // a torn sidecar: fetched again
  }
}

void write_meta(const CacheFolder& dir, const std::string& name, const nlohmann::json& j) {
  const std::string tmp = name + ".tmp";
  {
    const UniqueFd fd = create_in(dir, tmp, 0600);
    const std::string text = j.dump();
    if (::write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
      throw DataError(dir.path / tmp, fmt::format("cannot write the cache's sidecar: {}", std::strerror(errno)));
    }
  }
  if (::renameat(dir.fd.get(), tmp.c_str(), dir.fd.get(), name.c_str()) != 0) {
    throw DataError(dir.path / name, fmt::format("cannot write the cache's sidecar: {}", std::strerror(errno)));
  }
}

struct ShardOutcome {
  std::uint64_t bytes = 0;
  bool fetched = false;
};

/// Who holds a flock on the file behind `fd`, in words, from /proc/locks
/// ("process 1234"; another host's lock over NFS is not listed there).
std::string lock_holder(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return "another process";
  const std::string where = fmt::format("{:02x}:{:02x}:{}", major(st.st_dev), minor(st.st_dev), st.st_ino);
  std::ifstream in("/proc/locks");
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("->") != std::string::npos) continue;  // a waiter, not the holder
    std::istringstream words(line);
    std::string id, type, advisory, mode, pid, dev;
    words >> id >> type >> advisory >> mode >> pid >> dev;
    if (type == "FLOCK" && dev == where) {
      return pid == std::to_string(::getpid()) ? "this process (another of its datasets)" : "process " + pid;
    }
  }
  return "another process (not on this host, or gone meanwhile)";
}

/// Takes flock `how` on `fd` (`name` in `dir`), waiting while the shard
/// that lock guards changes: past remote_timeout x (remote_retries + 1)
/// seconds without a change (a holder stopped in a debugger, a hung NFS
/// client), gives up naming the holder. Cancelled when the dataset closes.
void lock_bounded(const UniqueFd& fd, int how, const CacheFolder& dir, const std::string& name,
                  const std::string& shard, const std::string& url, const RemoteConfig& config) {
  using Clock = std::chrono::steady_clock;
  const auto progress = [&] {
    std::uint64_t sum = 0;
    for (const std::string& f : {shard + ".part", shard + ".meta", shard}) {
      struct stat st {};
      if (::fstatat(dir.fd.get(), f.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
        sum = sum * 31 + static_cast<std::uint64_t>(st.st_size) * 7 + static_cast<std::uint64_t>(st.st_mtim.tv_nsec) +
              static_cast<std::uint64_t>(st.st_ino);
      }
    }
    return sum;
  };
  // The holder's own tries may go that long without a byte, plus their
  // backoffs (at most 8 s x 1.5 each) between them.
  const double budget = std::max(0.05, config.read_timeout) * (static_cast<double>(config.retries) + 1) +
                        12.0 * static_cast<double>(config.retries);
  const auto start = Clock::now();
  auto changed = start;
  std::uint64_t seen = progress();
  bool told = false;
  for (;;) {
    if (::flock(fd.get(), how | LOCK_NB) == 0) return;
    if (errno != EWOULDBLOCK && errno != EINTR) {
      throw DataError(dir.path / name, fmt::format("cannot lock: {}", std::strerror(errno)));
    }
    if (config.cancel && config.cancel->load()) throw Cancelled(fmt::format("{}: cancelled", redact_url(url)));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const auto now = Clock::now();
    if (const std::uint64_t p = progress(); p != seen) {
      seen = p;
      changed = now;
    }
    if (!told && now - start > std::chrono::seconds(2)) {
      told = true;
      pinfeed::detail::log().info("remote: waiting for {}, which holds {}", lock_holder(fd.get()),
                                  (dir.path / name).string());
    }
    const double idle = std::chrono::duration<double>(now - changed).count();
    if (idle > budget) {
      throw RemoteError(
          url, 0,
          fmt::format("{} holds {} and the shard has not changed for {:.1f} s (remote_timeout x "
                      "(remote_retries + 1), and the retries' backoff): giving up. Is it stopped (a debugger) or hung "
                      "(a network file system)? If it is gone, remove that file",
                      lock_holder(fd.get()), (dir.path / name).string(), idle));
    }
  }
}

/// Note [Remote staging]: NAME.fetch is held exclusively while a shard is
/// checked and fetched (briefly); NAME.lock is held shared by every dataset
/// using the shard, taken before NAME.fetch is let go, so an evictor (who
/// must get both, without waiting) never removes a shard between its check
/// and its use. A fetch never waits for a user: another node's rank
/// training on the shard does not hold NAME.fetch.
ShardOutcome stage_one(const std::string& url, const CacheFolder& root, const fs::path& file, UniqueFd& use,
                       const RemoteConfig& config, std::uint64_t expected) {
  const CacheFolder dir = open_entry(root, file.parent_path().filename().string());
  const std::string name = file.filename().string();
  const UniqueFd fetch = open_in(dir, name + ".fetch", O_RDWR | O_CREAT);
  lock_bounded(fetch, LOCK_EX, dir, name + ".fetch", name, url, config);
  ShardOutcome out;
  const auto meta = read_meta(dir, name + ".meta");
  const auto on_disk = size_in(dir, name);
  const std::string shown = redact_url(url);
  bool valid = on_disk && meta && meta->value("key", "") == cache_key(url) &&
               meta->value("size", std::uint64_t{0}) == *on_disk && (expected == 0 || expected == *on_disk);
  if (valid && !url.starts_with("pipe:")) {
    try {
      const Head head = head_url(url, config);
      const std::string etag = meta->value("etag", ""), modified = meta->value("last_modified", "");
      std::string by;
      if (head.size_known && head.size != *on_disk) {
        valid = false;
        by = "its size";
      } else if (!etag.empty() && !head.etag.empty()) {
        valid = etag == head.etag;
        by = "its ETag";
      } else if (!modified.empty() && !head.last_modified.empty()) {
        valid = modified == head.last_modified;
        by = "its Last-Modified";
      } else {
        const auto local = open_existing(dir, name);
        valid = local && same_ends(url, local->get(), *on_disk, config);
        by = "its size and first and last 64 KiB (the server gives no ETag or Last-Modified)";
      }
      if (valid) {
        pinfeed::detail::log().debug("remote: {}: the cached copy is current, by {}", shown, by);
      } else {
        pinfeed::detail::log().info("remote: {} changed on the server ({}): fetching it again", shown, by);
      }
    } catch (const RemoteError& e) {
      // Gone (404, 410) is gone. Otherwise (unreachable, a presigned GET URL
      // that refuses HEAD with 403) the copy the server confirmed earlier is used.
      if (e.status() == 404 || e.status() == 410) throw;
      pinfeed::detail::log().warn("remote: {}: using the cached copy, unchecked: {}", shown, e.what());
    }
  }
  if (valid) {
    out.bytes = *on_disk;
  } else {
    if (::unlinkat(dir.fd.get(), (name + ".meta").c_str(), 0) != 0 && errno != ENOENT) {
      throw DataError(dir.path / (name + ".meta"), fmt::format("cannot remove: {}", std::strerror(errno)));
    }
    const FetchResult r = fetch_into(url, dir, name, config, expected);
    write_meta(dir, name + ".meta",
               {{"url", shown},
                {"key", cache_key(url)},
                {"size", r.bytes},
                {"etag", r.etag},
                {"last_modified", r.last_modified}});
    out = {r.bytes, true};
  }
  // Last use, for eviction: the access time only. The modification time is
  // part of the identity an open dataset checks its shards against.
  const struct timespec times[2] = {{0, UTIME_NOW}, {0, UTIME_OMIT}};
  ::utimensat(dir.fd.get(), name.c_str(), times, AT_SYMLINK_NOFOLLOW);
  use = open_in(dir, name + ".lock", O_RDWR | O_CREAT);
  lock_bounded(use, LOCK_SH, dir, name + ".lock", name, url, config);  // kept while the dataset is open
  return out;                                                          // NAME.fetch is let go here
}

/// The entry folders of the cache at `root` (Note [Cache ownership]), by
/// name: one is opened at a time (thousands of pipe: shards are thousands
/// of folders, and descriptors are the readers' too).
std::vector<std::string> entries_of(const CacheFolder& root) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = fs::directory_iterator(root.path, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (is_entry(root, name)) out.push_back(std::move(name));
  }
  return out;
}

/// An entry folder that exists, opened and checked (nothing: not one now).
std::optional<CacheFolder> open_existing_entry(const CacheFolder& root, const std::string& name) {
  UniqueFd fd(::openat(root.fd.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  struct stat st {};
  if (!fd || ::fstat(fd.get(), &st) != 0 || st.st_uid != ::geteuid() ||
      ::fstatat(fd.get(), kMarker, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) {
    return std::nullopt;
  }
  return CacheFolder{std::move(fd), root.path / name};
}

/// The names in `dir` (never following a link).
std::vector<std::string> names_in(const CacheFolder& dir) {
  std::vector<std::string> out;
  const int copy = ::fcntl(dir.fd.get(), F_DUPFD_CLOEXEC, 0);
  if (copy < 0) return out;
  DIR* d = ::fdopendir(copy);
  if (d == nullptr) {
    ::close(copy);
    return out;
  }
  ::rewinddir(d);
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  return out;
}

/// Takes `name`'s lock in `dir` exclusively without waiting (an evictor's
/// or a sweep's right to remove); nothing when someone holds it.
std::optional<UniqueFd> try_lock(const CacheFolder& dir, const std::string& name) {
  try {
    UniqueFd fd = open_in(dir, name, O_RDWR | O_CREAT);
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) return std::nullopt;
    return fd;
  } catch (const DataError& e) {
    pinfeed::detail::log().warn("remote cache: passed over: {}", e.what());
    return std::nullopt;
  }
}

/// Past cache_limit, the least recently used shards that nobody holds go:
/// only NAME + NAME.meta pairs in the cache's own entry folders.
void evict(const CacheFolder& root, std::uint64_t limit, std::uint64_t own_bytes) {
  struct Entry {
    std::string folder, name;
    std::uint64_t bytes;
    std::int64_t used_ns;
  };
  std::vector<Entry> entries;
  std::uint64_t total = 0;
  for (const std::string& folder : entries_of(root)) {
    const auto dir = open_existing_entry(root, folder);
    if (!dir) continue;
    for (const std::string& meta : names_in(*dir)) {
      if (!meta.ends_with(".meta")) continue;
      const std::string name = meta.substr(0, meta.size() - 5);
      struct stat st {
      }, ms{};
      if (::fstatat(dir->fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
          ::fstatat(dir->fd.get(), meta.c_str(), &ms, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(ms.st_mode)) {
        continue;
      }
      entries.push_back({folder, name, static_cast<std::uint64_t>(st.st_size),
                         static_cast<std::int64_t>(st.st_atim.tv_sec) * 1'000'000'000 + st.st_atim.tv_nsec});
      total += static_cast<std::uint64_t>(st.st_size);
    }
  }
  if (total <= limit) return;
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.used_ns < b.used_ns; });
  for (const Entry& e : entries) {
    if (total <= limit) break;
    const auto opened = open_existing_entry(root, e.folder);
    if (!opened) continue;
    const CacheFolder& dir = *opened;
    const auto fetch = try_lock(dir, e.name + ".fetch");  // being checked or fetched
    if (!fetch) continue;
    const auto use = try_lock(dir, e.name + ".lock");  // in use by a dataset
    if (!use) continue;
    ::unlinkat(dir.fd.get(), (e.name + ".meta").c_str(), 0);
    ::unlinkat(dir.fd.get(), e.name.c_str(), 0);
    total -= e.bytes;
    pinfeed::detail::log().debug("remote cache: evicted {} ({} bytes)", (dir.path / e.name).string(), e.bytes);
  }
  if (total > limit) {
    pinfeed::detail::log().warn(
        "remote cache {}: {} bytes held, over cache_limit {}: this dataset's shards ({} bytes) "
        "are in use and stay until it closes",
        root.path.string(), total, limit, own_bytes);
  }
}

/// Whether pid names a process that is gone.
bool process_gone(const std::string& pid_text) {
  if (pid_text.empty() || !std::all_of(pid_text.begin(), pid_text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
  return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

/// In the cache's own entry folders, NAME.part files nobody is fetching
/// (NAME.fetch free): a killed fetch's; and entry folders a killed process
/// was making (.pinfeed-new-PID-*).
void sweep_parts(const CacheFolder& root) {
  for (const std::string& folder : entries_of(root)) {
    const auto opened = open_existing_entry(root, folder);
    if (!opened) continue;
    const CacheFolder& dir = *opened;
    for (const std::string& part : names_in(dir)) {
      if (!part.ends_with(".part")) continue;
      struct stat st {};
      if (::fstatat(dir.fd.get(), part.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) continue;
      const auto fetch = try_lock(dir, part.substr(0, part.size() - 5) + ".fetch");
      if (fetch) ::unlinkat(dir.fd.get(), part.c_str(), 0);
    }
  }
  // .pinfeed-new-PID-HOST-XXXXXX: this host's, its process gone, and old
  // (another host sharing the folder has its own name in it).
  const std::string temp = fmt::format(".{}new-", kEntryPrefix);
  std::size_t old_layout = 0;
  for (const std::string& name : names_in(root)) {
    if (name.size() == 16 && std::all_of(name.begin(), name.end(),
                                         [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); })) {
      ++old_layout;  // a cache folder of pinfeed before December 2026
    }
    if (!name.starts_with(temp)) continue;
    const std::string rest = name.substr(temp.size());
    const auto dash = rest.find('-');
    const std::string host = dash == std::string::npos ? "" : rest.substr(dash + 1, rest.rfind('-') - dash - 1);
    struct stat st {};
    if (dash == std::string::npos || host != host_name() || !process_gone(rest.substr(0, dash)) ||
        ::fstatat(root.fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode) ||
        st.st_uid != ::geteuid() || ::time(nullptr) - st.st_mtim.tv_sec < 600) {
      continue;
    }
    std::error_code ec;
    fs::remove_all(root.path / name, ec);  // holds only a marker
  }
  if (old_layout > 0) {
    static std::once_flag told;
    std::call_once(told, [&] {
      pinfeed::detail::log().warn(
          "remote cache {}: {} folder(s) named by a bare 16-digit hash are an older pinfeed's "
          "cache, no longer read or evicted: delete them to get their space back",
          root.path.string(), old_layout);
    });
  }
}

}  // namespace

namespace {

/// Private shard folders (pinfeed-shards-PID-XXXXXX) whose process is gone:
/// a killed rank's, which its own close never removed.
void sweep_private_dirs(const fs::path& base) {
  std::error_code ec;
  for (auto it = fs::directory_iterator(base, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with("pinfeed-shards-")) continue;
    const std::string rest = name.substr(15);
    const auto dash = rest.find('-');
    if (dash == std::string::npos || dash == 0) continue;
    const std::string pid_text = rest.substr(0, dash);
    if (!std::all_of(pid_text.begin(), pid_text.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
    if (pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to know)
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) continue;
    // Its owner's lock decides (another host's or PID namespace's process
    // is not ours to see); a folder without one is an old or half-made one,
    // swept only when it is an hour old.
    const UniqueFd owner(::open((it->path() / ".owner").c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
    if (owner ? ::flock(owner.get(), LOCK_EX | LOCK_NB) != 0 : ::time(nullptr) - st.st_mtim.tv_sec < 3600) continue;
    std::error_code e2;
    fs::remove_all(it->path(), e2);
    if (!e2)
      pinfeed::detail::log().info("remote: removed {}, left by process {} which is gone", it->path().string(), pid);
  }
}

}  // namespace

fs::path cache_path(const std::string& url, const RemoteConfig& config) {
  if (config.cache_dir.empty()) return {};
  return config.cache_dir / folder_of(url) / remote_shard_name(url);
}

StagedShards stage_shards(const std::vector<std::string>& urls, const RemoteConfig& config,
                          const std::vector<std::uint64_t>& sizes) {
  auto keep = std::make_shared<Staged>();
  fs::path root = config.cache_dir;
  if (root.empty()) {
    std::error_code ec;
    const fs::path tmp = fs::temp_directory_path(ec);
    const fs::path base = ec ? fs::path("/tmp") : tmp;
    sweep_private_dirs(base);
    std::string templ = (base / fmt::format("pinfeed-shards-{}-XXXXXX", ::getpid())).string();
    if (::mkdtemp(templ.data()) == nullptr) {
      throw DataError(templ, fmt::format("cannot make a folder for the shards: {}", std::strerror(errno)));
    }
    root = keep->private_dir = templ;
    // Held while the dataset lives: a sweep on another host or in another
    // PID namespace (a shared /tmp) knows the folder is in use by its lock,
    // where a PID it cannot see says nothing.
    keep->owner = UniqueFd(::open((root / ".owner").c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!keep->owner || ::flock(keep->owner.get(), LOCK_EX | LOCK_NB) != 0) {
      throw DataError(root, fmt::format("cannot lock the shards' folder: {}", std::strerror(errno)));
    }
  }
  const CacheFolder root_dir = open_cache_root(root);
  if (keep->private_dir.empty()) sweep_parts(root_dir);
  StagedShards out;
  out.urls = urls;
  out.local.resize(urls.size());
  keep->locks.resize(urls.size());
  std::vector<ShardOutcome> outcomes(urls.size());
  std::map<fs::path, std::pair<std::string, std::string>> owner;  // file -> (key, shown)
  for (std::size_t i = 0; i < urls.size(); ++i) {
    out.local[i] = root / folder_of(urls[i]) / remote_shard_name(urls[i]);
    const auto [it, fresh] = owner.emplace(out.local[i], std::pair{cache_key(urls[i]), redact_url(urls[i])});
    if (!fresh && it->second.first != cache_key(urls[i])) {
      throw ConfigError(
          fmt::format("'{}' and '{}' name the same shard file '{}' (a URL's file name, its query "
                      "left out): give each shard its own name",
                      it->second.second, redact_url(urls[i]), out.local[i].filename().string()));
    }
  }
  // The first failure, or the caller's cancel, stops the other fetches.
  RemoteConfig local = config;
  const auto stop = std::make_shared<std::atomic<bool>>(false);
  local.cancel = stop;
  std::atomic<std::size_t> next{0};
  std::atomic<unsigned> running{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  {
    const unsigned workers = std::max(1U, std::min<unsigned>(config.parallel, static_cast<unsigned>(urls.size())));
    std::vector<std::jthread> pool;
    running = workers;
    for (unsigned w = 0; w < workers; ++w) {
      pool.emplace_back([&] {
        for (std::size_t i = next++; i < urls.size(); i = next++) {
          try {
            outcomes[i] =
                stage_one(urls[i], root_dir, out.local[i], keep->locks[i], local, i < sizes.size() ? sizes[i] : 0);
          } catch (...) {
            const std::scoped_lock lock(failure_mutex);
            // The first failure is the one to tell; the rest it cancelled.
            if (!failure) failure = std::current_exception();
            next = urls.size();
            stop->store(true);
          }
        }
        --running;
      });
    }
    while (running.load() > 0) {
      if (config.cancel && config.cancel->load()) stop->store(true);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  if (failure) std::rethrow_exception(failure);
  std::uint64_t own = 0;
  for (const ShardOutcome& o : outcomes) {
    own += o.bytes;
    (o.fetched ? out.fetched_bytes : out.reused_bytes) += o.bytes;
  }
  if (config.cache_limit > 0 && keep->private_dir.empty()) evict(root_dir, config.cache_limit, own);
  out.keep = keep;
  return out;
}

}  // namespace pinfeed::loader
