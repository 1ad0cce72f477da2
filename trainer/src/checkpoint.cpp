#include "pinfeed/trainer/checkpoint.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fmt/format.h>
#include <zlib.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "pinfeed/error.hpp"
#include "pinfeed/file_io.hpp"
#include "pinfeed/log.hpp"

namespace pinfeed::trainer {
namespace {

// Format 02: magic, header length, JSON header, weights, momentum, then
// zlib's CRC-32 of all of it in the last 8 bytes. (01 had a hand-written
// FNV-1a there.)
constexpr char kMagic[8] = {'P', 'F', 'C', 'K', 'P', 'T', '0', '2'};
constexpr char kMagicV1[8] = {'P', 'F', 'C', 'K', 'P', 'T', '0', '1'};

std::uint64_t checksum(const std::byte* p, std::size_t n) {
  return crc32_z(crc32_z(0, nullptr, 0), reinterpret_cast<const Bytef*>(p), n);
}

template <class T>
void put(std::vector<std::byte>& out, const T* p, std::size_t count) {
  const auto* b = reinterpret_cast<const std::byte*>(p);
  out.insert(out.end(), b, b + count * sizeof(T));
}

// Note [Temporaries and signals]
// A save writes a full-size temporary beside the checkpoint, then renames it
// over. A SIGINT/SIGTERM meanwhile used to leave the temporary behind.
// install_checkpoint_signal_handlers() blocks both signals in the calling
// thread, before it starts any thread of its own, so every later thread
// inherits the mask and one thread of ours takes them with sigwait: no
// syscall of a worker is interrupted (EINTR) and nothing of ours runs in
// signal context. Threads a library started before (OpenBLAS starts its pool
// when it is loaded) keep the signals unblocked: there a handler passes them
// on to the signal thread with tgkill (without it, the default action killed
// the process mid-save). The flag and the slots' states are sequentially
// consistent: a save publishes its slot, then reads the flag; the signal
// thread raises the flag, then reads the slots; one of them sees the other.
// The signal thread raises `g_terminating`,
// waits (a bounded time) until no save is in flight, and _exits with
// 128 + the signal's number.
// Each save in flight registers its temporary's path in a slot: claimed (1),
// filled, published (2) before the file is created, freed (0) after the
// rename or the temporary's removal. A save looks at `g_terminating` before
// it creates the file, between chunks of the write and before the rename;
// once it is raised the save removes its temporary, frees its slot and parks
// its thread until the exit. A save that stays stuck in the kernel past the
// bound (a hung filesystem) has its temporary removed by the signal thread.
// SIGKILL cannot be handled: the next run's CheckpointLock removes what it
// left.
constexpr std::size_t kSlots = 8;
constexpr std::size_t kPathMax = 4096;
constexpr std::size_t kWriteChunk = std::size_t{64} << 20;  // how often a long write looks at g_terminating
constexpr auto kSaveGrace = std::chrono::seconds(10);       // how long a signal waits for saves in flight
struct TempSlot {
  std::atomic<int> state{0};
  std::array<char, kPathMax> path{};
};
std::array<TempSlot, kSlots> g_temporaries;
std::atomic<bool> g_terminating{false};
static_assert(std::atomic<int>::is_always_lock_free);

/// Registers `tmp` for the signal thread while alive (nothing if every slot
/// is taken or the path is too long: the save still works).
class RegisteredTemp {
 public:
  explicit RegisteredTemp(const std::filesystem::path& tmp) : tmp_(tmp) {
    if (tmp.native().size() >= kPathMax) return;
    for (TempSlot& s : g_temporaries) {
      int expected = 0;
      if (!s.state.compare_exchange_strong(expected, 1)) continue;
      std::memcpy(s.path.data(), tmp.c_str(), tmp.native().size() + 1);
      s.state.store(2);
      slot_ = &s;
      return;
    }
  }
  RegisteredTemp(const RegisteredTemp&) = delete;
  RegisteredTemp& operator=(const RegisteredTemp&) = delete;
  ~RegisteredTemp() { release(); }

  /// The process is exiting on a signal: remove the temporary, free the
  /// slot, and never return (the signal thread ends the process).
  void abandon_if_terminating() {
    if (!g_terminating.load()) return;
    (void)::unlink(tmp_.c_str());
    release();
    for (;;) ::pause();  // SIGINT/SIGTERM are blocked here: sleeps until the exit
  }

 private:
  void release() {
    // 2 -> 0; a slot the signal thread took (3) is never reused: its path
    // may be read by that thread's unlink.
    int published = 2;
    if (slot_ != nullptr) (void)slot_->state.compare_exchange_strong(published, 0);
    slot_ = nullptr;
  }
  const std::filesystem::path& tmp_;
  TempSlot* slot_ = nullptr;
};

void write_all(int fd, const std::byte* p, std::size_t n, const std::filesystem::path& path,
               RegisteredTemp& registered) {
  while (n > 0) {
    registered.abandon_if_terminating();
    const ssize_t w = ::write(fd, p, std::min(n, kWriteChunk));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw DataError(path, fmt::format("write failed: {}", std::strerror(errno)));
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

std::atomic<pid_t> g_signal_thread{0};  // the thread that takes SIGINT/SIGTERM with sigwait

/// On a thread that does not block the signals: to the signal thread, which
/// does (tgkill is async-signal-safe; errno is left as it was).
extern "C" void forward_to_signal_thread(int sig) {
  const int saved = errno;
  if (const pid_t tid = g_signal_thread.load(); tid != 0) (void)::syscall(SYS_tgkill, ::getpid(), tid, sig);
  errno = saved;
}

[[noreturn]] void end_on_signal(int sig) {
  g_terminating.store(true);
  const auto deadline = std::chrono::steady_clock::now() + kSaveGrace;
  const auto in_flight = [] {
    return std::any_of(g_temporaries.begin(), g_temporaries.end(),
                       [](const TempSlot& s) { return s.state.load() != 0; });
  };
  while (in_flight() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (TempSlot& s : g_temporaries) {  // saves still stuck past the grace
    int published = 2;
    if (s.state.compare_exchange_strong(published, 3)) (void)::unlink(s.path.data());
  }
  ::_exit(128 + sig);
}

/// The signal thread: publishes its id, then waits for SIGINT/SIGTERM.
extern "C" void* signal_thread_main(void* arg) {
  const auto* set = static_cast<const sigset_t*>(arg);
  g_signal_thread.store(static_cast<pid_t>(::syscall(SYS_gettid)));
  int sig = 0;
  while (::sigwait(set, &sig) != 0) {
  }
  end_on_signal(sig);
}

std::string temporary_prefix(const std::filesystem::path& target) {
  return fmt::format(".{}.tmp.", target.filename().string());
}

}  // namespace

std::filesystem::path resolve_checkpoint_path(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  fs::path p = path;
  for (int hops = 0; hops < 40; ++hops) {
    std::error_code ec;
    if (!fs::is_symlink(fs::symlink_status(p, ec))) return p;
    const fs::path to = fs::read_symlink(p, ec);
    if (ec) throw DataError(path, fmt::format("cannot read the symlink {}: {}", p.string(), ec.message()));
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
  throw DataError(path, "too many levels of symbolic links (a loop?)");
}

void install_checkpoint_signal_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    sigset_t set;
    sigemptyset(&set);
    for (const int sig : {SIGINT, SIGTERM}) {
      struct sigaction old {};
      if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;  // nohup, a background job
      sigaddset(&set, sig);
    }
    if (sigisemptyset(&set) != 0) return;
    sigset_t before;
    if (const int e = ::pthread_sigmask(SIG_BLOCK, &set, &before); e != 0) {
      throw Error(fmt::format("cannot block SIGINT/SIGTERM: {}", std::strerror(e)));
    }
    // Note [Temporaries and signals]
    // A thread of its own, with a small stack: under a tight RLIMIT_AS
    // (the launch-plane test's 650 MB) the default 8 MiB reservation was
    // enough to leave OpenBLAS's later 128 MiB buffer without room.
    static sigset_t waited;
    waited = set;
    pthread_attr_t attr;
    (void)::pthread_attr_init(&attr);
    (void)::pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t thread{};
    // 256 KiB, unless the libraries' static TLS needs more (glibc puts it on
    // the stack and refuses a stack it does not fit in): then the default.
    (void)::pthread_attr_setstacksize(&attr,
                                      std::max(static_cast<std::size_t>(PTHREAD_STACK_MIN), std::size_t{256} << 10U));
    int e = ::pthread_create(&thread, &attr, signal_thread_main, &waited);
    if (e == EINVAL) {
      (void)::pthread_attr_destroy(&attr);
      (void)::pthread_attr_init(&attr);
      (void)::pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
      e = ::pthread_create(&thread, &attr, signal_thread_main, &waited);
    }
    (void)::pthread_attr_destroy(&attr);
    if (e != 0) {
      (void)::pthread_sigmask(SIG_SETMASK, &before, nullptr);  // the caller keeps its signals
      throw Error(fmt::format("cannot start the signal thread: {}", std::strerror(e)));
    }
    while (g_signal_thread.load() == 0) std::this_thread::yield();
    // Threads that existed before this call (OpenBLAS starts its pool when
    // it is loaded) do not block the signals: there a handler passes the
    // signal on to the signal thread.
    for (const int sig : {SIGINT, SIGTERM}) {
      if (sigismember(&set, sig) != 1) continue;
      struct sigaction sa {};
      sa.sa_handler = forward_to_signal_thread;
      sa.sa_flags = SA_RESTART;
      sigemptyset(&sa.sa_mask);
      (void)::sigaction(sig, &sa, nullptr);
    }
  });
}

bool termination_requested() { return g_terminating.load(); }

CheckpointLock::CheckpointLock(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  const fs::path target = resolve_checkpoint_path(path);
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  const fs::path lock = dir / fmt::format(".{}.lock", target.filename().string());
  fd_.reset(::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (!fd_) throw DataError(lock, fmt::format("cannot create the checkpoint's lock file: {}", std::strerror(errno)));
  if (::flock(fd_.get(), LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    if (e != EWOULDBLOCK) throw DataError(lock, fmt::format("cannot lock: {}", std::strerror(e)));
    std::array<char, 256> holder{};
    const ssize_t n = ::pread(fd_.get(), holder.data(), holder.size() - 1, 0);
    std::string who = n > 0 ? std::string(holder.data(), static_cast<std::size_t>(n)) : std::string("unknown");
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    throw DataError(path, fmt::format("another run is writing this checkpoint (it holds {}: {}); two runs writing one "
                                      "checkpoint would replace each other's. Give this run another --checkpoint, or "
                                      "stop the other",
                                      lock.string(), who));
  }
  char host[256] = {};
  (void)::gethostname(host, sizeof host - 1);
  const std::string me = fmt::format("pid {} on {}\n", ::getpid(), host);
  if (::ftruncate(fd_.get(), 0) == 0) (void)!::pwrite(fd_.get(), me.data(), me.size(), 0);
  // Held: no live writer of this checkpoint is left, so every temporary of
  // it is a killed writer's (SIGKILL, a power cut).
  const std::string prefix = temporary_prefix(target);
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    // ".<name>.tmp.<pid>" exactly: a checkpoint named "<name>.tmp.7" has its own.
    const std::string_view pid = std::string_view(name).substr(std::min(prefix.size(), name.size()));
    if (!name.starts_with(prefix) || pid.empty() || pid.find_first_not_of("0123456789") != std::string_view::npos) {
      continue;
    }
    if (fs::remove(it->path(), ec)) ++removed_;
  }
  if (removed_ > 0) {
    pinfeed::detail::log().info("{}: removed {} temporar{} left by killed writers", path.string(), removed_,
                                removed_ == 1 ? "y" : "ies");
  }
}

void save_checkpoint(const std::filesystem::path& path, const Checkpoint& c, const SaveHooks& hooks) {
  if (c.weights.size() != c.momentum.size()) throw ConfigError("checkpoint: weights and momentum differ in size");
  nlohmann::json h;
  h["format"] = 1;
  h["step"] = c.step;
  h["epoch"] = c.epoch;
  h["position"] = c.position;
  h["seed"] = c.seed;
  h["world_size"] = c.world_size;
  h["global_batch"] = c.global_batch;
  h["model"] = {{"image_size", c.model.image_size},
                {"pool", c.model.pool},
                {"hidden", c.model.hidden},
                {"classes", c.model.classes},
                {"spec", c.model.spec()}};
  h["params"] = c.weights.size();
  h["buffers"] = c.buffers.size();
  if (c.dataset) {
    const loader::DatasetFingerprint& f = *c.dataset;
    h["dataset"] = {{"samples", f.samples}, {"num_classes", f.num_classes}, {"hash", fmt::format("{:016x}", f.hash)}};
    if (!f.classes.empty()) h["dataset"]["classes"] = f.classes;
  }
  // Class names that are not UTF-8 (legal on Linux) are stored with U+FFFD
  // for the bad bytes: describe_change compares them that way too.
  const std::string header = h.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::vector<std::byte> out;
  out.reserve(32 + header.size() + (2 * c.weights.size() + c.buffers.size()) * sizeof(float));
  put(out, kMagic, sizeof kMagic);
  const std::uint64_t len = header.size();
  put(out, &len, 1);
  put(out, header.data(), header.size());
  put(out, c.weights.data(), c.weights.size());
  put(out, c.momentum.data(), c.momentum.size());
  put(out, c.buffers.data(), c.buffers.size());
  const std::uint64_t sum = checksum(out.data(), out.size());
  put(out, &sum, 1);

  // Through a symlink to its target, as cp writes: the rename replaces the
  // target, and the link stays.
  const std::filesystem::path target = resolve_checkpoint_path(path);
  const std::filesystem::path dir = target.parent_path().empty() ? std::filesystem::path(".") : target.parent_path();
  const std::filesystem::path tmp = dir / fmt::format("{}{}", temporary_prefix(target), ::getpid());
  RegisteredTemp registered(tmp);  // Note [Temporaries and signals]
  try {
    registered.abandon_if_terminating();
    const UniqueFd f(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!f) throw DataError(tmp, fmt::format("cannot create: {}", std::strerror(errno)));
    write_all(f.get(), out.data(), out.size(), tmp, registered);
    if (::fsync(f.get()) != 0) throw DataError(tmp, fmt::format("fsync failed: {}", std::strerror(errno)));
  } catch (...) {
    ::unlink(tmp.c_str());  // a failed write (disk full) leaves no temporary behind
    throw;
  }
  if (hooks.before_rename) hooks.before_rename();
  registered.abandon_if_terminating();
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    throw DataError(path, fmt::format("cannot rename {} over it: {}", tmp.string(), std::strerror(e)));
  }
  const UniqueFd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d) (void)::fsync(d.get());  // the rename itself durable; best effort
}

Checkpoint load_checkpoint(const std::filesystem::path& path) {
  std::vector<std::byte> in;  // sized from the file, never from a header field
  read_regular_file(path, "a checkpoint", kMaxCheckpointBytes, in);
  return parse_checkpoint(in, path);
}

Checkpoint parse_checkpoint(std::span<const std::byte> in, const std::filesystem::path& path) {
  if (in.size() >= sizeof kMagicV1 && std::memcmp(in.data(), kMagicV1, sizeof kMagicV1) == 0) {
    throw DataError(path,
                    "checkpoint format 01, written by a pinfeed before 2026-12-01: resume it with that "
                    "version, or start the run again");
  }
  if (in.size() < sizeof kMagic + 16 || std::memcmp(in.data(), kMagic, sizeof kMagic) != 0) {
    throw DataError(path, "not a pinfeed checkpoint (bad magic or too short)");
  }
  std::uint64_t stored = 0;
  std::memcpy(&stored, in.data() + in.size() - 8, 8);
  if (checksum(in.data(), in.size() - 8) != stored) throw DataError(path, "checksum mismatch (truncated or corrupt)");
  std::uint64_t len = 0;
  std::memcpy(&len, in.data() + 8, 8);
  if (len > in.size() - 24) throw DataError(path, "header length past the end of the file");
  Checkpoint c;
  try {
    const auto h = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(in.data() + 16), len));
    if (h.at("format").get<int>() != 1) throw DataError(path, "unknown checkpoint format");
    c.step = h.at("step");
    c.epoch = h.at("epoch");
    c.position = h.at("position");
    c.seed = h.at("seed");
    c.world_size = h.at("world_size");
    c.global_batch = h.at("global_batch");
    c.model.image_size = h.at("model").at("image_size");
    c.model.pool = h.at("model").at("pool");
    c.model.hidden = h.at("model").at("hidden").get<std::vector<int>>();
    c.model.classes = h.at("model").at("classes");
    // Written before the CNN: an MLP, and no buffers.
    if (h.at("model").contains("spec")) {
      try {
        c.model.parse_spec(h.at("model").at("spec").get<std::string>());
      } catch (const ConfigError& e) {
        throw DataError(path, fmt::format("bad model in the header: {}", e.what()));
      }
    }
    const std::uint64_t n = h.at("params").get<std::uint64_t>();
    const std::uint64_t nb = h.value("buffers", std::uint64_t{0});
    // Compared without multiplying a header field: a crafted count must not
    // wrap into a small allocation size, nor size one past the file.
    const std::uint64_t data_bytes = in.size() - 24 - len;
    const std::uint64_t floats = data_bytes / sizeof(float);
    if (data_bytes % sizeof(float) != 0 || n > floats / 2 || nb > floats || 2 * n + nb != floats) {
      throw DataError(path, fmt::format("parameter data does not match the header ({} parameters and {} buffer values "
                                        "declared, {} bytes of data)",
                                        n, nb, data_bytes));
    }
    c.weights.resize(n);
    c.momentum.resize(n);
    c.buffers.resize(nb);
    // memcpy (the floats need not be aligned in the file), but never with an
    // empty vector's data(), which may be null even for 0 bytes.
    const std::byte* at = in.data() + 16 + len;
    const auto take = [&](std::vector<float>& v) {
      if (!v.empty()) std::memcpy(v.data(), at, v.size() * sizeof(float));
      at += v.size() * sizeof(float);
    };
    take(c.weights);
    take(c.momentum);
    take(c.buffers);
    if (h.contains("dataset")) {
      const auto& d = h.at("dataset");
      loader::DatasetFingerprint f;
      f.samples = d.at("samples");
      f.num_classes = d.at("num_classes");
      if (d.contains("classes")) f.classes = d.at("classes").get<std::vector<std::string>>();
      const auto hash = d.at("hash").get<std::string>();
      const auto [end, ec] = std::from_chars(hash.data(), hash.data() + hash.size(), f.hash, 16);
      if (ec != std::errc{} || end != hash.data() + hash.size() || hash.empty()) {
        throw DataError(path, fmt::format("bad dataset hash '{}' in the header", hash));
      }
      c.dataset = std::move(f);
    }
  } catch (const nlohmann::json::exception& e) {
    throw DataError(path, fmt::format("bad checkpoint header: {}", e.what()));
  }
  return c;
}

void check_checkpoint_writable(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (!ec && fs::exists(st) && !fs::is_regular_file(st)) {
    throw DataError(path, "exists and is not a regular file: a checkpoint cannot be written there");
  }
  const fs::path target = resolve_checkpoint_path(path);
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  if (!fs::is_directory(dir, ec)) throw DataError(dir, "checkpoint folder does not exist");
  char host[256] = {};
  (void)::gethostname(host, sizeof host - 1);
  const fs::path probe = dir / fmt::format(".{}.probe.{}.{}", path.filename().string(), host, ::getpid());
  UniqueFd fd(::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd) throw DataError(dir, fmt::format("checkpoint folder does not take a new file: {}", std::strerror(errno)));
  fd.reset();
  ::unlink(probe.c_str());
}

}  // namespace pinfeed::trainer
