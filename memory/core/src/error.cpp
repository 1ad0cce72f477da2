#include "pinfeed/error.hpp"

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/std.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <new>
#include <string_view>
#include <system_error>

namespace pinfeed {

DataError::DataError(std::filesystem::path path, const std::string& reason)
    : Error(fmt::format("{}: {}", path.string(), reason)), path_(std::move(path)), reason_(reason) {}

OutOfMemory::OutOfMemory(std::string reason, const std::string& what) : Error(what), reason_(std::move(reason)) {}

namespace {

std::string limit_text(rlim_t v) {
  return v == RLIM_INFINITY ? std::string("unlimited") : fmt::format("{}", static_cast<unsigned long long>(v));
}

/// A field of /proc/self/status ("Threads", "VmSize"), or "?".
std::string status_field(std::string_view name) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.size() > name.size() && line.compare(0, name.size(), name) == 0 && line[name.size()] == ':') {
      const auto start = line.find_first_not_of(" \t", name.size() + 1);
      return start == std::string::npos ? std::string() : line.substr(start);
    }
  }
  return "?";
}

/// The tasks (processes and threads) of this user, which RLIMIT_NPROC counts.
std::size_t user_tasks() {
  std::size_t n = 0;
  const auto uid = ::getuid();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    struct stat st {};
    if (::stat(entry.path().c_str(), &st) != 0 || st.st_uid != uid) continue;
    std::ifstream in(entry.path() / "status");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("Threads:", 0) == 0) {
        n += std::stoul(line.substr(8));
        break;
      }
    }
  }
  return n;
}

std::string address_space_text(const rlimit& as) {
  return fmt::format("the address-space limit (RLIMIT_AS, ulimit -v) is {} bytes and this process maps {}",
                     limit_text(as.rlim_cur), status_field("VmSize"));
}

}  // namespace

std::string describe_failure(const std::exception& e) {
  std::string what = e.what();
  rlimit as{}, nproc{};
  ::getrlimit(RLIMIT_AS, &as);
  ::getrlimit(RLIMIT_NPROC, &nproc);
  if (const auto* se = dynamic_cast<const std::system_error*>(&e);
      se != nullptr && se->code() == std::errc::resource_unavailable_try_again) {
    what += fmt::format("; a thread could not be started. This process runs {} threads; ", status_field("Threads"));
    if (nproc.rlim_cur != RLIM_INFINITY) {
      what += fmt::format("the user's process and thread limit (RLIMIT_NPROC, ulimit -u) is {} and it runs {}; ",
                          limit_text(nproc.rlim_cur), user_tasks());
    }
    if (as.rlim_cur != RLIM_INFINITY) what += address_space_text(as) + " (each thread's stack needs 8 MiB of it); ";
    what += "lower --threads / --loader-threads (num_workers in Python) or raise the limit";
  } else if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    what = "out of memory (std::bad_alloc)";
    if (as.rlim_cur != RLIM_INFINITY)
      what += "; " + address_space_text(as) + ": raise it or lower the batch size and threads";
  }
  return what;
}

void check_thread_room(std::size_t threads, const char* what) {
  rlimit nproc{};
  if (::geteuid() == 0 || ::getrlimit(RLIMIT_NPROC, &nproc) != 0 || nproc.rlim_cur == RLIM_INFINITY) return;
  const std::size_t running = user_tasks();
  const auto limit = static_cast<std::size_t>(nproc.rlim_cur);
  if (running + threads <= limit) return;
  throw ConfigError(fmt::format(
      "{} needs {} more threads, but the user's process and thread limit (RLIMIT_NPROC, ulimit -u) is {} and it runs "
      "{} already: lower --threads / --loader-threads (num_workers in Python) or raise the limit",
      what, threads, limit, running));
}

namespace {
std::atomic<pid_t> g_worker_threads_pid{0};
}  // namespace

void note_worker_threads() noexcept {
  pid_t expected = 0;
  g_worker_threads_pid.compare_exchange_strong(expected, ::getpid());
}

void check_worker_threads_usable(const char* what) {
  const pid_t parent = g_worker_threads_pid.load();
  if (parent == 0 || parent == ::getpid()) return;
  throw ConfigError(fmt::format(
      "{}: this process ({}) is a fork of process {}, in which pinfeed's decode threads (oneTBB's workers) already "
      "ran; oneTBB cannot start them again in a forked child, so this would wait forever. Use multiprocessing's "
      "'spawn' or 'forkserver' start method (torch.multiprocessing.set_start_method('spawn')), or fork before the "
      "parent first iterates a Loader",
      what, ::getpid(), parent));
}

std::uint64_t raise_open_file_limit() noexcept {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return 0;
  const rlim_t want = r.rlim_max == RLIM_INFINITY ? rlim_t{1} << 20U : std::min<rlim_t>(r.rlim_max, rlim_t{1} << 20U);
  if (r.rlim_cur != RLIM_INFINITY && r.rlim_cur < want) {
    rlimit raised = r;
    raised.rlim_cur = want;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) r = raised;
  }
  return r.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<std::uint64_t>(r.rlim_cur);
}

}  // namespace pinfeed
