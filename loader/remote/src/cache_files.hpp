#pragma once
// The files a remote fetch writes, shared by the fetch (remote_fetch.cpp)
// and the shard cache (remote_cache.cpp): a folder held open and the files
// in it reached without following links (Note [Cache ownership]), and one
// fetch into such a folder within its byte budget (Note [Byte budgets]).
// Private to the loader library.
#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <string>

#include "pinfeed/file_io.hpp"
#include "pinfeed/loader/remote.hpp"

namespace pinfeed::loader::detail {

/// A folder held open: what is in it is reached through `fd`, never through
/// a path a planted link could redirect.
struct CacheFolder {
  UniqueFd fd;
  std::filesystem::path path;
};

/// Refuses `p`, which is `what` ("a symbolic link") where the cache keeps
/// its own files: DataError naming it.
[[noreturn]] void refuse_planted(const std::filesystem::path& p, const char* what);
/// `name` in `dir`, opened without following a link; only a regular file.
UniqueFd open_in(const CacheFolder& dir, const std::string& name, int flags, mode_t mode = 0644);
/// A new file `name` in `dir` (whatever was there, a planted link included,
/// is unlinked first; O_EXCL never writes through a link made meanwhile).
UniqueFd create_in(const CacheFolder& dir, const std::string& name, mode_t mode);
CacheFolder open_folder(const std::filesystem::path& path);
std::uint64_t file_size_of(int fd);
/// Fetches `url` into `dir`/`name` (as `name`.part, renamed when whole and a
/// tar; removed on every other way out), retried per `config`; `expected`
/// (0: unknown) is its indexed size. Throws RemoteError, Cancelled.
FetchResult fetch_into(const std::string& url, const CacheFolder& dir, const std::string& name,
                       const RemoteConfig& config, std::uint64_t expected);

}  // namespace pinfeed::loader::detail
