#pragma once
// pinfeed's exception hierarchy. Every error the library throws derives from
// pinfeed::Error; callers that react to running out of memory catch
// OutOfMemory, which carries a short machine-readable reason.
#include <cstdint>
#include <exception>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace pinfeed {

/// Base of every pinfeed exception.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A configuration or flag is invalid: names the field and the bad value.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A file could not be read or parsed. Always carries the path and a reason.
class DataError : public Error {
 public:
  DataError(std::filesystem::path path, const std::string& reason);
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  [[nodiscard]] const std::string& reason() const noexcept { return reason_; }

 private:
  std::filesystem::path path_;
  std::string reason_;
};

/// A file changed under the loader after it was indexed (a tar shard
/// rewritten in place): never replaced by a substitute, since every later
/// sample of the file would be wrong too.
class DatasetChanged : public DataError {
 public:
  using DataError::DataError;
};

/// A CUDA runtime call failed (memory/cuda_host.hpp, the trainer's CUDA backend).
class CudaError : public Error {
 public:
  using Error::Error;
};

/// Memory could not be provided. reason() is a short tag callers and tools
/// can show or match on: "memlock limit", "budget", "mmap", "cuda register",
/// "limit" (LimitingAdaptor), "injected" (tests).
class OutOfMemory : public Error {
 public:
  OutOfMemory(std::string reason, const std::string& what);
  [[nodiscard]] const std::string& reason() const noexcept { return reason_; }

 private:
  std::string reason_;
};

/// A blocking wait was cancelled (pool shut down or a stop was requested).
class Cancelled : public Error {
 public:
  using Error::Error;
};

/// The program holds more batches than the limit it set (held_limit): the
/// pool would have to lend out another slot. Python runs gc.collect() once
/// before raising it.
class HeldLimit : public Error {
 public:
  using Error::Error;
};

/// The message of `e`, and when it is the process running into one of its
/// limits, which limit and what to lower: a thread that could not start
/// (std::system_error EAGAIN: RLIMIT_NPROC, or RLIMIT_AS with no room for
/// its stack) or memory that could not be had (std::bad_alloc: RLIMIT_AS).
/// What tools print and the Python module raises instead of a bare
/// "Resource temporarily unavailable".
std::string describe_failure(const std::exception& e);

/// ConfigError when RLIMIT_NPROC (the user's processes and threads) leaves
/// no room for `threads` more: a thread oneTBB cannot start is not an error
/// it reports, work given to it just never runs. `what` names the user of
/// the threads. Nothing for root (the limit does not bind it).
void check_thread_room(std::size_t threads, const char* what);

/// Records that this process has started oneTBB's worker threads (call
/// before handing work to TBB). oneTBB cannot start them again in a forked
/// child: its workers are gone there, but TBB believes they sleep, so work
/// given to it would wait forever.
void note_worker_threads() noexcept;
/// ConfigError when this process is a fork of one in which
/// note_worker_threads() was called: `what` cannot run here, and the
/// message says what to do instead (spawn, or fork before the first use).
void check_worker_threads_usable(const char* what);

/// Raises the soft RLIMIT_NOFILE to the hard one (at most 1 Mi), as servers
/// do: the default soft limit (1024) is a leftover of select(2). Returns the
/// soft limit now in force.
std::uint64_t raise_open_file_limit() noexcept;

}  // namespace pinfeed
