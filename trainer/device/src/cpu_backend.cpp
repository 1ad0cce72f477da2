#include "pinfeed/trainer/cpu_backend.hpp"

#include <cblas.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "cpu_stream.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/trainer/device_type.hpp"

namespace pinfeed::trainer {

using cpu_detail::cpu;
using cpu_detail::CpuEvent;
using cpu_detail::CpuStream;
using cpu_detail::post;

namespace {
std::atomic<std::size_t> g_backends{0};  // CpuBackends alive in this process

/// OpenBLAS maps a 128 MiB buffer in each thread that first calls it, and
/// when that mmap fails it retries forever: under a tight RLIMIT_AS a
/// compute thread would spin in sgemm and the process hang at exit. So with
/// a finite limit, room for every backend's buffer (and a margin) is
/// reserved once here: no room is an error now, naming the limit, not a
/// hang later. Note [Address space held for OpenBLAS]: one backend's share
/// stays reserved (PROT_NONE) until its compute thread's first sgemm gives
/// it back, just before OpenBLAS maps its buffer: what the loader, glibc's
/// arenas and the model map meanwhile cannot take that room (CI hung 1 run
/// in 30 at RLIMIT_AS 650 MB once the tools mapped libcurl's libraries too).
// OpenBLAS's buffer: 128 MiB and a few pages (134225920 bytes seen mapped).
// Held, not only checked, so no margin for others is needed: what they
// cannot map fails naming the limit (describe_failure).
constexpr std::size_t kPerThread = std::size_t{130} << 20U;
std::mutex g_reserved_mutex;
std::vector<void*> g_reserved;  // kPerThread each, PROT_NONE

void check_room_for_openblas(std::size_t backends) {
  rlimit as{};
  if (::getrlimit(RLIMIT_AS, &as) != 0 || as.rlim_cur == RLIM_INFINITY) return;
  // The earlier backends' shares are mapped already (held, or OpenBLAS's
  // buffers by now): this one's is what is left to find.
  const std::size_t bytes = kPerThread;
  void* held = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (held != MAP_FAILED) {
    const std::scoped_lock lock(g_reserved_mutex);
    g_reserved.push_back(held);
    return;
  }
  throw OutOfMemory(
      "limit",
      fmt::format(
          "cpu backend: no room for {} MiB of address space (OpenBLAS's 128 MiB buffer for each compute thread, "
          "for {} CPU worker(s)): {}",
          bytes >> 20U, backends, describe_failure(std::bad_alloc())));
}
}  // namespace

CpuBackend::CpuBackend(CpuBackendConfig config) : config_(config), streams_(std::make_shared<StreamSet>()) {
  check_room_for_openblas(g_backends.load() + 1);
  ++g_backends;
  // One rank is one thread here; OpenBLAS's own threads would fight them.
  openblas_set_num_threads(1);
}

void cpu_detail::give_room_to_openblas() {
  thread_local bool given = false;
  if (given) return;
  given = true;
  const std::scoped_lock lock(g_reserved_mutex);
  if (g_reserved.empty()) return;
  ::munmap(g_reserved.back(), kPerThread);
  g_reserved.pop_back();
}

CpuBackend::~CpuBackend() {
  --g_backends;
  const std::scoped_lock lock(g_reserved_mutex);
  if (g_reserved.size() > g_backends.load()) {  // a share no thread took (no sgemm ran)
    ::munmap(g_reserved.back(), kPerThread);
    g_reserved.pop_back();
  }
}

std::string CpuBackend::name() const { return fmt::format("cpu:{}", config_.index); }

namespace {
std::atomic<std::uint64_t> g_allocations{0};  // every CpuBackend's allocate() calls
}  // namespace

std::uint64_t CpuBackend::allocations() noexcept { return g_allocations.load(); }

namespace {
std::atomic<std::uint64_t> g_calls_off_current{0};
thread_local const CpuBackend* t_current = nullptr;  // what make_current() chose on this thread
}  // namespace

void CpuBackend::make_current() { t_current = this; }

std::shared_ptr<void> CpuBackend::scoped_current() {
  static int token = 0;
  const CpuBackend* previous = t_current;
  t_current = this;
  return {&token, [previous](int*) { t_current = previous; }};
}

std::uint64_t CpuBackend::calls_off_current() noexcept { return g_calls_off_current.load(); }

void CpuBackend::note_thread() const noexcept {
  if (t_current == this) return;
  if (g_calls_off_current.fetch_add(1) == 0) {
    pinfeed::detail::log().warn(
        "{}: used from a thread that did not make it current (a GPU would get a context on "
        "device 0 there)",
        name());
  }
}

DeviceBuffer CpuBackend::allocate(std::size_t bytes) {
  note_thread();
  g_allocations.fetch_add(1);
  if (bytes == 0) return DeviceBuffer(this, nullptr, 0);
  const std::size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) throw OutOfMemory("device", fmt::format("{}: cannot allocate {} bytes", name(), bytes));
  std::memset(p, 0, rounded);  // zeroed, and every page touched now rather than in a step
  return DeviceBuffer(this, p, bytes);
}

namespace {
std::atomic<std::uint64_t> g_frees_with_work_pending{0};
}  // namespace

std::uint64_t CpuBackend::frees_with_work_pending() noexcept { return g_frees_with_work_pending.load(); }

void CpuBackend::free(void* ptr, std::size_t bytes) noexcept {
  // A CPU stream's queue runs on even after its buffers go; a GPU's does
  // too, and reads freed memory. Counted (and logged) so tests catch a
  // teardown that frees before draining, which the CPU would otherwise hide.
  {
    const std::scoped_lock lock(streams_->mutex);
    const auto busy = [](const Stream* s) { return static_cast<const CpuStream*>(s)->busy(); };
    if (std::any_of(streams_->streams.begin(), streams_->streams.end(), busy)) {
      g_frees_with_work_pending.fetch_add(1);
      pinfeed::detail::log().error("{}: {} bytes freed while a stream still has work queued", name(), bytes);
    }
  }
  std::free(ptr);
}

std::unique_ptr<Stream> CpuBackend::create_stream() {
  note_thread();
  return std::make_unique<CpuStream>(config_.max_queued, streams_);
}

std::shared_ptr<Event> CpuBackend::create_event() {
  note_thread();
  return std::make_shared<CpuEvent>();
}

void CpuBackend::enqueue(Stream& s, std::function<void()> task) {
  note_thread();
  post(s, std::move(task));
}

void CpuBackend::copy_h2d(Stream& s, void* dst, const void* src, std::size_t bytes) {
  note_thread();
  const auto delay = config_.copy_delay;
  post(s, [=] {
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    std::memcpy(dst, src, bytes);
  });
}

void CpuBackend::copy_d2h(Stream& s, void* dst, const void* src, std::size_t bytes) {
  note_thread();
  post(s, [=] { std::memcpy(dst, src, bytes); });
}

void CpuBackend::copy_d2d(Stream& s, void* dst, const void* src, std::size_t bytes) {
  note_thread();
  post(s, [=] { std::memmove(dst, src, bytes); });
}

void CpuBackend::record(Event& e, Stream& s) {
  note_thread();
  auto ev = cpu(e).shared_from_this();
  const std::uint64_t target = ev->arm();
  cpu(s).push([ev, target](const std::exception_ptr& err, const std::stop_token&) { ev->complete(target, err); }, true);
}

void CpuBackend::stream_wait(Stream& s, Event& e) {
  note_thread();
  auto ev = cpu(e).shared_from_this();
  const std::uint64_t target = ev->target();
  cpu(s).push(
      [ev, target](const std::exception_ptr&, const std::stop_token& stop) { ev->wait_from_worker(target, stop); },
      false);
}

void CpuBackend::synchronize(Stream& s) {
  note_thread();
  auto done = std::make_shared<std::promise<void>>();
  auto fut = done->get_future();
  cpu(s).push(
      [done](const std::exception_ptr& err, const std::stop_token&) {
        if (err) {
          done->set_exception(err);
        } else {
          done->set_value();
        }
      },
      true);
  fut.get();
}

void CpuBackend::host_callback(Stream& s, std::function<void()> f) { enqueue(s, std::move(f)); }

void CpuBackend::consumer_wait(std::uintptr_t consumer, Event& e) {
  if (consumer != 0) {
    stream_wait(*reinterpret_cast<Stream*>(consumer), e);
  } else {
    e.wait();
  }
}

void CpuBackend::consumer_record(std::uintptr_t consumer, Event& e) {
  if (consumer != 0) {
    record(e, *reinterpret_cast<Stream*>(consumer));
  } else {
    // The host thread that dropped the batch is done with it: an empty
    // stream's recording, complete at once.
    auto ev = cpu(e).shared_from_this();
    ev->complete(ev->arm(), nullptr);
  }
}

namespace {
int cpu_workers_possible() noexcept { return 256; }
std::unique_ptr<DeviceBackend> make_cpu_backend(int index, const BackendOptions& options) {
  CpuBackendConfig c;
  c.index = index;
  c.copy_delay = options.copy_delay;
  return std::make_unique<CpuBackend>(c);
}
}  // namespace

const DeviceType& cpu_device_type() {
  static const DeviceType type{BackendKind::cpu, "cpu", false, &cpu_workers_possible, &make_cpu_backend};
  return type;
}

}  // namespace pinfeed::trainer
