// One fetch of a remote shard into a folder of files it owns: libcurl with
// Range resume, or a pipe: command in its own process group, within a byte
// budget, checked to be a whole tar before it is renamed into place.
#include <curl/curl.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "cache_files.hpp"
#include "curl_transfer.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/units.hpp"

extern char** environ;

namespace pinfeed::loader::detail {

namespace fs = std::filesystem;

[[noreturn]] void refuse_planted(const fs::path& p, const char* what) {
  throw DataError(p, fmt::format("is {} where pinfeed's cache keeps its own files: pinfeed did not make it and "
                                 "does not follow or overwrite it; remove it, or choose another cache_dir",
                                 what));
}

/// `name` in `dir`, opened without following a link; only a regular file.
UniqueFd open_in(const CacheFolder& dir, const std::string& name, int flags, mode_t mode) {
  UniqueFd fd(::openat(dir.fd.get(), name.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode));
  if (!fd) {
    const int err = errno;
    if (err == ELOOP) refuse_planted(dir.path / name, "a symbolic link");
    throw DataError(dir.path / name, fmt::format("cannot open: {}", std::strerror(err)));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) refuse_planted(dir.path / name, "not a regular file");
  return fd;
}

/// A new file `name` in `dir` (whatever was there, a planted link included,
/// is unlinked first; O_EXCL never writes through a link made meanwhile).
UniqueFd create_in(const CacheFolder& dir, const std::string& name, mode_t mode) {
  if (::unlinkat(dir.fd.get(), name.c_str(), 0) != 0 && errno != ENOENT) {
    throw DataError(dir.path / name, fmt::format("cannot replace it: {}", std::strerror(errno)));
  }
  return open_in(dir, name, O_RDWR | O_CREAT | O_EXCL, mode);
}

CacheFolder open_folder(const fs::path& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) throw DataError(path, fmt::format("cannot open the folder: {}", std::strerror(errno)));
  return {std::move(fd), path};
}

std::uint64_t file_size_of(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : 0;
}

namespace {

/// pipe:COMMAND: `sh -c COMMAND` in a process group of its own, with its
/// stdout into fd. "" when it exited 0, else why not. The whole group is
/// killed (SIGKILL to -pid: the shell's children too, which hold the file)
/// when the output falls under min_rate bytes/s over read_timeout seconds (a
/// stalled `aws s3 cp` must not hold the shard's lock forever), grows past
/// `limit` bytes (Note [Byte budgets]), or the dataset closes.
std::string run_pipe(const std::string& command, int fd, const RemoteConfig& config, std::uint64_t limit,
                     const std::string& limit_why) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fd, STDOUT_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);  // its own group: -pid reaches every process it starts
  const char* argv[] = {"/bin/sh", "-c", command.c_str(), nullptr};
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/bin/sh", &actions, &attr, const_cast<char* const*>(argv), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) return fmt::format("the command could not be started: {}", std::strerror(rc));
  int status = 0;
  const double window = std::max(0.05, config.read_timeout);
  std::uint64_t window_bytes = 0;
  auto window_start = std::chrono::steady_clock::now();
  std::string killed;
  for (;;) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) {
      ::kill(-pid, SIGKILL);
      return fmt::format("waiting for the command failed: {}", std::strerror(errno));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (!killed.empty()) continue;  // reaped by the next waitpid
    const auto now = std::chrono::steady_clock::now();
    const std::uint64_t size = file_size_of(fd);
    const double elapsed = std::chrono::duration<double>(now - window_start).count();
    if (config.cancel && config.cancel->load()) {
      killed = "cancelled";
    } else if (limit != 0 && size > limit) {
      killed = fmt::format("the command wrote more than {} bytes ({}): killed", limit, limit_why);
    } else if (elapsed >= window) {
      if (static_cast<double>(size - std::min(size, window_bytes)) / elapsed < std::max(config.min_rate, 1e-9)) {
        killed = fmt::format("the command wrote {} bytes in {:.1f} s, under remote_min_rate {} bytes/s: killed",
                             size - std::min(size, window_bytes), elapsed, config.min_rate);
      }
      window_start = now;
      window_bytes = size;
    }
    if (!killed.empty()) ::kill(-pid, SIGKILL);
  }
  ::kill(-pid, SIGKILL);  // whatever the shell left running in the background
  if (killed == "cancelled") throw Cancelled("pipe: cancelled");
  if (!killed.empty()) return killed;
  if (WIFEXITED(status))
    return WEXITSTATUS(status) == 0 ? "" : fmt::format("the command exited with status {}", WEXITSTATUS(status));
  return fmt::format("the command was killed by signal {}", WTERMSIG(status));
}

/// Why fd's bytes are not a whole tar ("" when they are): a tar is whole
/// 512-byte blocks ending in its two zero blocks.
std::string tar_tail_problem(int fd) {
  const std::uint64_t size = file_size_of(fd);
  if (size < 1024 || size % 512 != 0) return fmt::format("not a tar shard: {} bytes, not whole 512-byte blocks", size);
  std::array<char, 1024> tail{};
  if (::pread(fd, tail.data(), tail.size(), static_cast<off_t>(size - tail.size())) !=
      static_cast<ssize_t>(tail.size())) {
    return fmt::format("cannot read it back: {}", std::strerror(errno));
  }
  if (std::any_of(tail.begin(), tail.end(), [](char c) { return c != 0; })) {
    return "not a whole tar shard: it does not end with the end-of-archive blocks (cut short, or not a tar)";
  }
  return {};
}

/// Note [Byte budgets]: what a fetch into `fd` may write, and why: the
/// shard's known size, cache_limit, and the free space of the disk less a
/// reserve (the least of 1 GiB and 5% of it), so an endless body never
/// fills the disk.
struct Budget {
  std::uint64_t limit = 0;  ///< always (0: none)
  std::string why;
  std::uint64_t unknown = 0;  ///< also, for a body of no announced length (0: none)
  std::string unknown_why;
};

/// cache_limit bounds what has no length of its own (a chunked body, a
/// command's output): a shard whose size is known may pass it, and stays
/// with a warning while in use, as before.
Budget fetch_budget(int fd, const fs::path& where, const RemoteConfig& config, std::uint64_t expected) {
  Budget b;
  std::uint64_t limit = expected;
  std::string why = expected != 0 ? "the size its index gives" : "";
  if (config.cache_limit != 0 && expected == 0) {
    b.unknown = config.cache_limit;
    b.unknown_why = "cache_limit (the answer gave no length)";
  }
  struct statvfs v {};
  if (::fstatvfs(fd, &v) == 0 && v.f_blocks != 0) {  // some FUSE file systems report no size: no disk bound
    const std::uint64_t avail = static_cast<std::uint64_t>(v.f_bavail) * v.f_frsize;
    const std::uint64_t reserve =
        std::min<std::uint64_t>(1ULL << 30U, static_cast<std::uint64_t>(v.f_blocks) * v.f_frsize / 20);
    const std::uint64_t room = avail > reserve ? avail - reserve : 0;
    if (limit == 0 || room < limit) {
      limit = std::max<std::uint64_t>(room, 1);
      why = fmt::format("the free space of the disk holding {} ({} free, {} kept in reserve)", where.string(),
                        format_bytes(avail), format_bytes(reserve));
    }
  }
  b.limit = limit;
  b.why = why;
  return b;
}

/// One try of a fetch into `fd`: "" when its bytes are complete, else why
/// not (retried). Throws what no retry changes.
struct Attempt {
  std::string last;  ///< why this try did not complete ("": it did)
  long code = 0;     ///< the HTTP status
};

Attempt pipe_attempt(const std::string& url, int fd, const fs::path& part, const Budget& budget,
                     const RemoteConfig& config) {
  // A command has no Range: every try starts over.
  if (::ftruncate(fd, 0) != 0 || ::lseek(fd, 0, SEEK_SET) != 0) {
    throw RemoteError(url, 0, fmt::format("cannot write {}: {}", part.string(), std::strerror(errno)));
  }
  // A command's output has no length: the tighter bound holds.
  const bool unknown_tighter = budget.unknown != 0 && (budget.limit == 0 || budget.unknown < budget.limit);
  const std::uint64_t limit = unknown_tighter ? budget.unknown : budget.limit;
  const std::string& why = unknown_tighter ? budget.unknown_why : budget.why;
  Attempt a{run_pipe(url.substr(5), fd, config, limit, why), 0};
  if (limit != 0 && file_size_of(fd) > limit) {  // a bound: no retry changes it
    throw RemoteError(url, 0,
                      a.last.empty() ? fmt::format("the command wrote more than {} bytes ({})", limit, why) : a.last);
  }
  return a;
}

Attempt http_attempt(const std::string& url, int fd, const fs::path& part, const Budget& budget,
                     const RemoteConfig& config, FetchResult& out) {
  const std::uint64_t have = file_size_of(fd);
  HeaderList headers;
  Easy h = make_handle(url, config, headers);
  Transfer t;
  t.fd = fd;
  t.handle = h.get();
  t.resuming = have > 0;
  t.file_base = have;
  t.byte_limit = budget.limit;
  t.byte_limit_why = budget.why;
  t.unknown_limit = budget.unknown;
  t.unknown_limit_why = budget.unknown_why;
  watch_progress(h.get(), t, config);
  if (::lseek(fd, 0, SEEK_END) < 0) throw RemoteError(url, 0, std::strerror(errno));
  curl_easy_setopt(h.get(), CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(h.get(), CURLOPT_WRITEDATA, &t);
  curl_easy_setopt(h.get(), CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(h.get(), CURLOPT_HEADERDATA, &t);
  if (have > 0) {
    curl_easy_setopt(h.get(), CURLOPT_RESUME_FROM_LARGE, static_cast<curl_off_t>(have));
    // The rest of the same object, or (a changed one) all of the new: never
    // the tail of one version after the head of another. Without an ETag,
    // Last-Modified is the validator (RFC 9110).
    const std::string validator = !out.etag.empty() ? out.etag : out.last_modified;
    if (!validator.empty()) {
      headers.reset(curl_slist_append(headers.release(), ("If-Range: " + validator).c_str()));
      curl_easy_setopt(h.get(), CURLOPT_HTTPHEADER, headers.get());
    }
  }
  const CURLcode rc = curl_easy_perform(h.get());
  const long code = response_code(h.get());
  if (rc == CURLE_ABORTED_BY_CALLBACK && t.stalled.empty())
    throw Cancelled(fmt::format("{}: cancelled", redact_url(url)));
  if (!t.write_error.empty()) throw RemoteError(url, code, fmt::format("{} ({})", t.write_error, part.string()));
  if (have > 0 && !t.restarted && code == 206) out.resumed += have;
  if (!t.etag.empty()) out.etag = t.etag;
  if (!t.last_modified.empty()) out.last_modified = t.last_modified;
  if (rc == CURLE_RANGE_ERROR || (rc == CURLE_OK && code == 200 && have > 0 && !t.restarted) ||
      (rc == CURLE_OK && code == 416)) {
    // No Range support (libcurl stops at a 200 to a Range request), If-Range
    // found another version, or a 416 to a resume: the whole object again.
    if (::ftruncate(fd, 0) != 0) throw RemoteError(url, code, std::strerror(errno));
    return {code == 416 ? "HTTP status 416 on a resumed transfer: starting over"
                        : "the server sent the whole object to a Range request: starting over",
            code};
  }
  if (rc == CURLE_OK && code >= 200 && code < 300) {
    curl_off_t length = -1;
    curl_easy_getinfo(h.get(), CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
    const std::uint64_t start = t.restarted || code == 200 ? 0 : have;
    const std::uint64_t size = file_size_of(fd);
    if (length >= 0 && size != start + static_cast<std::uint64_t>(length)) {
      return {fmt::format("{} bytes arrived of {}", size, start + static_cast<std::uint64_t>(length)), code};
    }
    return {"", code};
  }
  if (rc == CURLE_OK && final_status(code)) throw RemoteError(url, code, status_text(code, t.error_body));
  if (const std::string why = permanent_error(rc, t); !why.empty()) throw RemoteError(url, 0, why);
  return {!t.stalled.empty() ? t.stalled
          : rc != CURLE_OK   ? fmt::format("{} after {} bytes", retry_reason(rc, t), have + t.written)
                             : status_text(code, t.error_body),
          code};
}

}  // namespace

FetchResult fetch_into(const std::string& url, const CacheFolder& dir, const std::string& name,
                       const RemoteConfig& config, std::uint64_t expected) {
  const std::string part_name = name + ".part";
  const fs::path part = dir.path / part_name;
  UniqueFd fd = create_in(dir, part_name, 0644);  // read back: the tar check
  // Every way out but the rename takes the partial file with it.
  struct DropPart {
    const CacheFolder& dir;
    const std::string& name;
    bool keep = false;
    ~DropPart() {
      if (!keep) ::unlinkat(dir.fd.get(), name.c_str(), 0);
    }
  } drop{dir, part_name};
  const Budget budget = fetch_budget(fd.get(), dir.path, config, expected);
  FetchResult out;
  for (unsigned attempt = 0;; ++attempt) {
    ++out.attempts;
    Attempt a = url.starts_with("pipe:") ? pipe_attempt(url, fd.get(), part, budget, config)
                                         : http_attempt(url, fd.get(), part, budget, config, out);
    if (a.last.empty()) {
      a.last = tar_tail_problem(fd.get());
      if (a.last.empty()) break;
      // An error page with a 200, a command that printed something else, a
      // body cut short without a Content-Length: never cached as a shard.
      if (::ftruncate(fd.get(), 0) != 0) throw RemoteError(url, 0, std::strerror(errno));
    }
    if (attempt >= config.retries) {
      throw RemoteError(url, a.code, fmt::format("{} (gave up after {} tries)", a.last, attempt + 1));
    }
    pinfeed::detail::log().warn("remote: {}: {}; try {} of {} in a moment", redact_url(url), a.last, attempt + 2,
                                config.retries + 1);
    sleep_backoff(config, attempt, url);
  }
  if (::fsync(fd.get()) != 0)
    throw RemoteError(url, 0, fmt::format("cannot write {}: {}", part.string(), std::strerror(errno)));
  out.bytes = file_size_of(fd.get());
  fd.reset();
  // Complete, or not there at all (a rename replaces a planted link itself).
  if (::renameat(dir.fd.get(), part_name.c_str(), dir.fd.get(), name.c_str()) != 0) {
    throw RemoteError(url, 0, fmt::format("cannot rename {} to {}: {}", part.string(), name, std::strerror(errno)));
  }
  drop.keep = true;
  return out;
}

}  // namespace pinfeed::loader::detail

namespace pinfeed::loader {

FetchResult fetch_url(const std::string& url, const std::filesystem::path& dest, const RemoteConfig& config) {
  using namespace detail;
  const CacheFolder dir = open_folder(dest.parent_path().empty() ? std::filesystem::path(".") : dest.parent_path());
  return fetch_into(url, dir, dest.filename().string(), config, 0);
}

}  // namespace pinfeed::loader
