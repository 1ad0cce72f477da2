#include "pinfeed/trainer/cpu_backend.hpp"

#include <cblas.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <fmt/format.h>

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

#include "batch_norm_stats.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/trainer/device_type.hpp"

namespace pinfeed::trainer {

/// A backend's live streams (all CpuStreams), so that freeing memory can ask
/// whether any of them still has work: on a GPU that work could still read
/// the memory.
struct StreamSet {
  std::mutex mutex;  // guards streams
  std::vector<const Stream*> streams;
};

namespace {

/// An event's state: how many times it was recorded, and how far the
/// recordings have completed. Waiters wait for the target they saw.
/// Tasks hold the event by shared_ptr: like a CUDA event, it may be dropped
/// by its owner while recorded work is still queued.
class CpuEvent final : public Event, public std::enable_shared_from_this<CpuEvent> {
 public:
  std::uint64_t arm() {
    const std::scoped_lock lock(mutex_);
    return ++recorded_;
  }
  std::uint64_t target() {
    const std::scoped_lock lock(mutex_);
    return recorded_;
  }
  void complete(std::uint64_t target, const std::exception_ptr& error) {
    {
      const std::scoped_lock lock(mutex_);
      completed_ = std::max(completed_, target);
      if (error && !error_) error_ = error;
    }
    cv_.notify_all();
  }
  [[nodiscard]] bool ready() noexcept override {
    const std::scoped_lock lock(mutex_);
    return completed_ >= recorded_;
  }
  bool wait_for(std::chrono::microseconds timeout) override {
    std::unique_lock lock(mutex_);
    const std::uint64_t want = recorded_;
    if (!cv_.wait_for(lock, timeout, [&] { return completed_ >= want; })) return false;
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  /// Waits for `want` from a stream worker, giving up when the stream stops.
  void wait_from_worker(std::uint64_t want, const std::stop_token& stop) {
    std::unique_lock lock(mutex_);
    while (completed_ < want) {
      if (stop.stop_requested()) throw Cancelled("cpu stream: stopped while waiting for an event");
      cv_.wait_for(lock, std::chrono::milliseconds(10));
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::mutex mutex_;  // guards the three fields below
  std::condition_variable cv_;
  std::uint64_t recorded_ = 0, completed_ = 0;
  std::exception_ptr error_;
};

/// One worker thread running tasks in order. After a task throws, the
/// stream is in error: later tasks are skipped except those marked
/// `always` (event completions and synchronize), which see the error.
class CpuStream final : public Stream {
 public:
  using Task = std::function<void(const std::exception_ptr& stream_error, const std::stop_token&)>;

  CpuStream(std::size_t max_queued, std::shared_ptr<StreamSet> set)
      : registration_(this, std::move(set)), max_queued_(max_queued),
        worker_([this](const std::stop_token& st) { run(st); }) {}

  /// Whether work is queued or running.
  [[nodiscard]] bool busy() const {
    const std::scoped_lock lock(mutex_);
    return !queue_.empty() || running_;
  }
  ~CpuStream() override {
    worker_.request_stop();
    { const std::scoped_lock lock(mutex_); }  // the worker is either before its check or waiting: no lost wake-up
    cv_work_.notify_all();
    cv_space_.notify_all();
  }

  void push(Task task, bool always) {
    std::unique_lock lock(mutex_);
    cv_space_.wait(lock, [&] { return queue_.size() < max_queued_; });
    queue_.push_back(Item{std::move(task), always});
    cv_work_.notify_one();
  }

 private:
  struct Item {
    Task task;
    bool always = false;
  };

  void run(const std::stop_token& stop) {
    for (;;) {
      Item item;
      std::exception_ptr error;
      {
        std::unique_lock lock(mutex_);
        running_ = false;
        cv_work_.wait(lock, [&] { return !queue_.empty() || stop.stop_requested(); });
        if (queue_.empty()) return;  // stopping, and nothing left to run
        item = std::move(queue_.front());
        queue_.pop_front();
        error = error_;
        // Event completions and synchronize markers touch no buffer, and a
        // waiter they release may free at once: they do not count as work.
        running_ = !item.always;
      }
      cv_space_.notify_one();
      if (error && !item.always) continue;
      try {
        item.task(error, stop);
      } catch (...) {
        const std::scoped_lock lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  /// In the set from construction until after the worker has joined (the
  /// first member, so destroyed last).
  struct Registration {
    Registration(const Stream* s, std::shared_ptr<StreamSet> set) : stream(s), streams(std::move(set)) {
      const std::scoped_lock lock(streams->mutex);
      streams->streams.push_back(stream);
    }
    ~Registration() {
      const std::scoped_lock lock(streams->mutex);
      std::erase(streams->streams, stream);
    }
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;
    const Stream* stream;
    std::shared_ptr<StreamSet> streams;
  } registration_;
  std::size_t max_queued_;
  mutable std::mutex mutex_;  // guards queue_, running_ and error_
  bool running_ = false;
  std::condition_variable cv_work_, cv_space_;
  std::deque<Item> queue_;
  std::exception_ptr error_;
  std::jthread worker_;  // last: starts after the fields it uses
};

CpuStream& cpu(Stream& s) { return dynamic_cast<CpuStream&>(s); }
CpuEvent& cpu(Event& e) { return dynamic_cast<CpuEvent&>(e); }

/// Enqueues a plain task (skipped once the stream is in error).
template <class F>
void post(Stream& s, F&& f) {
  cpu(s).push([fn = std::forward<F>(f)](const std::exception_ptr&, const std::stop_token&) { fn(); }, false);
}

}  // namespace

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
  throw OutOfMemory("limit", fmt::format(
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

namespace {
/// The calling thread's first sgemm: one held share goes back for
/// OpenBLAS's buffer (Note [Address space held for OpenBLAS]).
void give_room_to_openblas() {
  thread_local bool given = false;
  if (given) return;
  given = true;
  const std::scoped_lock lock(g_reserved_mutex);
  if (g_reserved.empty()) return;
  ::munmap(g_reserved.back(), kPerThread);
  g_reserved.pop_back();
}
}  // namespace

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
    pinfeed::detail::log().warn("{}: used from a thread that did not make it current (a GPU would get a context on "
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
  cpu(s).push([ev, target](const std::exception_ptr&, const std::stop_token& stop) { ev->wait_from_worker(target, stop); },
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

void CpuBackend::gemm(Stream& s, const Gemm& g) {
  note_thread();
  post(s, [g] {
    give_room_to_openblas();
    cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans, g.trans_b ? CblasTrans : CblasNoTrans, g.m, g.n,
                g.k, g.alpha, g.a, g.lda, g.b, g.ldb, g.beta, g.c, g.ldc);
  });
}

void CpuBackend::normalize_u8(Stream& s, const std::uint8_t* nhwc, float* nchw, int n, int h, int w,
                              const Normalization& norm) {
  normalize_u8_as(s, nhwc, nchw, FloatType::f32, n, h, w, norm);
}

void CpuBackend::avg_pool(Stream& s, const float* nchw, float* out, int n, int c, int h, int w, int factor) {
  note_thread();
  post(s, [=] {
    const int oh = h / factor, ow = w / factor;
    const float inv = 1.0F / static_cast<float>(factor * factor);
    std::size_t o = 0;
    for (int plane = 0; plane < n * c; ++plane) {
      const float* in = nchw + static_cast<std::size_t>(plane) * static_cast<std::size_t>(h) * static_cast<std::size_t>(w);
      for (int y = 0; y < oh; ++y) {
        for (int x = 0; x < ow; ++x) {
          float sum = 0;
          for (int dy = 0; dy < factor; ++dy) {
            const float* row = in + static_cast<std::size_t>(y * factor + dy) * static_cast<std::size_t>(w) +
                               static_cast<std::size_t>(x * factor);
            for (int dx = 0; dx < factor; ++dx) sum += row[dx];
          }
          out[o++] = sum * inv;
        }
      }
    }
  });
}

void CpuBackend::bias_activation(Stream& s, float* z, const float* bias, float* a, int n, int d, bool relu) {
  note_thread();
  post(s, [=] {
    for (int i = 0; i < n; ++i) {
      float* zr = z + static_cast<std::size_t>(i) * static_cast<std::size_t>(d);
      float* ar = a + static_cast<std::size_t>(i) * static_cast<std::size_t>(d);
      for (int j = 0; j < d; ++j) {
        zr[j] += bias[j];
        ar[j] = relu ? std::max(zr[j], 0.0F) : zr[j];
      }
    }
  });
}

void CpuBackend::relu_backward(Stream& s, float* grad, const float* z, std::size_t count) {
  note_thread();
  post(s, [=] {
    for (std::size_t i = 0; i < count; ++i) grad[i] = z[i] > 0 ? grad[i] : 0.0F;
  });
}

void CpuBackend::bias_grad(Stream& s, const float* dz, float* db, int n, int d) {
  note_thread();
  post(s, [=] {
    for (int i = 0; i < n; ++i) {
      const float* row = dz + static_cast<std::size_t>(i) * static_cast<std::size_t>(d);
      for (int j = 0; j < d; ++j) db[j] += row[j];
    }
  });
}

void CpuBackend::softmax_cross_entropy(Stream& s, const float* logits, const std::int32_t* labels, int n, int k,
                                       float scale, float* dlogits, float* stats) {
  note_thread();
  post(s, [=] {
    double loss = 0;
    int correct = 0;
    for (int i = 0; i < n; ++i) {
      const float* z = logits + static_cast<std::size_t>(i) * static_cast<std::size_t>(k);
      const int label = labels[i];
      int best = 0;
      for (int j = 1; j < k; ++j) best = z[j] > z[best] ? j : best;
      const float zmax = z[best];
      double sum = 0;
      for (int j = 0; j < k; ++j) sum += std::exp(static_cast<double>(z[j] - zmax));
      loss += std::log(sum) - static_cast<double>(z[label] - zmax);
      correct += best == label ? 1 : 0;
      if (dlogits != nullptr) {
        float* g = dlogits + static_cast<std::size_t>(i) * static_cast<std::size_t>(k);
        const float f = scale / static_cast<float>(n);
        for (int j = 0; j < k; ++j) {
          const auto p = static_cast<float>(std::exp(static_cast<double>(z[j] - zmax)) / sum);
          g[j] = f * (p - (j == label ? 1.0F : 0.0F));
        }
      }
    }
    stats[0] += static_cast<float>(loss);
    stats[1] += static_cast<float>(correct);
  });
}

void CpuBackend::sgd(Stream& s, float* w, float* grad, float* momentum, std::size_t count, const SgdStep& step) {
  note_thread();
  post(s, [=] {
    for (std::size_t i = 0; i < count; ++i) {
      const float g = grad[i] + step.weight_decay * w[i];
      momentum[i] = step.momentum * momentum[i] + g;
      w[i] -= step.lr * momentum[i];
    }
  });
}

void CpuBackend::scale(Stream& s, float* x, std::size_t count, float factor) {
  note_thread();
  post(s, [=] {
    for (std::size_t i = 0; i < count; ++i) x[i] *= factor;
  });
}

void CpuBackend::fill(Stream& s, float* x, std::size_t count, float value) {
  note_thread();
  post(s, [=] { std::fill(x, x + count, value); });
}

namespace {

std::uint32_t float_bits(float f) noexcept {
  std::uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

/// float32 -> bfloat16, round to nearest even; NaN stays a (quiet) NaN.
std::uint16_t to_bf16(float f) noexcept {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFU) > 0x7F800000U) return static_cast<std::uint16_t>((u >> 16U) | 0x40U);
  u += 0x7FFFU + ((u >> 16U) & 1U);
  return static_cast<std::uint16_t>(u >> 16U);
}

/// float32 -> IEEE float16, round to nearest even, with subnormals,
/// overflow to infinity and NaN.
std::uint16_t to_f16(float f) noexcept {
  std::uint32_t x = float_bits(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16U) & 0x8000U);
  x &= 0x7FFFFFFFU;
  if (x >= 0x7F800000U) return static_cast<std::uint16_t>(sign | (x > 0x7F800000U ? 0x7E00U : 0x7C00U));
  if (x >= 0x477FF000U) return static_cast<std::uint16_t>(sign | 0x7C00U);  // rounds to >= 65520: infinity
  if (x < 0x38800000U) {  // below 2^-14: a subnormal half (or zero), in units of 2^-24
    float magnitude = 0;
    std::memcpy(&magnitude, &x, sizeof magnitude);
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(std::nearbyint(magnitude * 16777216.0F)));
  }
  std::uint32_t h = x - 0x38000000U;  // exponent bias 127 -> 15
  h += 0x0FFFU + ((h >> 13U) & 1U);
  return static_cast<std::uint16_t>(sign | (h >> 13U));
}

}  // namespace

void CpuBackend::normalize_u8_as(Stream& s, const std::uint8_t* nhwc, void* nchw, FloatType type, int n, int h, int w,
                                 const Normalization& norm) {
  note_thread();
  post(s, [=] {
    const auto plane = static_cast<std::size_t>(h) * static_cast<std::size_t>(w);
    for (int c = 0; c < 3; ++c) {
      // The loader's float path computes x * (1 / (255 std)) - mean / std; so does this.
      const float sc = 1.0F / (255.0F * norm.std[static_cast<std::size_t>(c)]);
      const float bi = -norm.mean[static_cast<std::size_t>(c)] / norm.std[static_cast<std::size_t>(c)];
      for (int i = 0; i < n; ++i) {
        const std::uint8_t* in = nhwc + static_cast<std::size_t>(i) * plane * 3 + static_cast<std::size_t>(c);
        const std::size_t first = (static_cast<std::size_t>(i) * 3 + static_cast<std::size_t>(c)) * plane;
        const auto value = [&](std::size_t p) { return static_cast<float>(in[3 * p]) * sc + bi; };
        if (type == FloatType::f32) {
          float* out = static_cast<float*>(nchw) + first;
          for (std::size_t p = 0; p < plane; ++p) out[p] = value(p);
        } else {
          std::uint16_t* out = static_cast<std::uint16_t*>(nchw) + first;
          for (std::size_t p = 0; p < plane; ++p) out[p] = type == FloatType::f16 ? to_f16(value(p)) : to_bf16(value(p));
        }
      }
    }
  });
}

// ---- the CNN's layers ------------------------------------------------------

void CpuBackend::im2col(Stream& s, const float* x, std::size_t c_stride, std::size_t n_stride, const ConvShape& shape,
                        float* col) {
  note_thread();
  post(s, [=] {
    const int oh = shape.out_h(), ow = shape.out_w();
    const std::size_t cols = shape.columns();
    for (int ci = 0; ci < shape.c; ++ci) {
      for (int k = 0; k < 9; ++k) {
        const int ky = k / 3, kx = k % 3;
        float* row = col + (static_cast<std::size_t>(ci) * 9 + static_cast<std::size_t>(k)) * cols;
        for (int i = 0; i < shape.n; ++i) {
          const float* plane = x + static_cast<std::size_t>(ci) * c_stride + static_cast<std::size_t>(i) * n_stride;
          for (int y = 0; y < oh; ++y) {
            const int iy = y * shape.stride + ky - 1;
            float* out = row + (static_cast<std::size_t>(i) * static_cast<std::size_t>(oh) + static_cast<std::size_t>(y)) *
                                   static_cast<std::size_t>(ow);
            for (int xo = 0; xo < ow; ++xo) {
              const int ix = xo * shape.stride + kx - 1;
              const bool inside = iy >= 0 && iy < shape.h && ix >= 0 && ix < shape.w;
              out[xo] = inside ? plane[static_cast<std::size_t>(iy) * static_cast<std::size_t>(shape.w) +
                                       static_cast<std::size_t>(ix)]
                               : 0.0F;
            }
          }
        }
      }
    }
  });
}

void CpuBackend::col2im(Stream& s, const float* col, const ConvShape& shape, float* dx) {
  note_thread();
  post(s, [=] {
    const int oh = shape.out_h(), ow = shape.out_w(), st = shape.stride;
    const std::size_t cols = shape.columns();
    std::size_t o = 0;
    for (int ci = 0; ci < shape.c; ++ci) {
      for (int i = 0; i < shape.n; ++i) {
        for (int iy = 0; iy < shape.h; ++iy) {
          for (int ix = 0; ix < shape.w; ++ix) {
            float sum = 0;
            for (int k = 0; k < 9; ++k) {
              const int ty = iy + 1 - k / 3, tx = ix + 1 - k % 3;  // y * stride, x * stride
              if (ty < 0 || tx < 0 || ty % st != 0 || tx % st != 0 || ty / st >= oh || tx / st >= ow) continue;
              sum += col[(static_cast<std::size_t>(ci) * 9 + static_cast<std::size_t>(k)) * cols +
                         (static_cast<std::size_t>(i) * static_cast<std::size_t>(oh) + static_cast<std::size_t>(ty / st)) *
                             static_cast<std::size_t>(ow) +
                         static_cast<std::size_t>(tx / st)];
            }
            dx[o++] = sum;
          }
        }
      }
    }
  });
}

void CpuBackend::bn_stats(Stream& s, const float* x, int c, std::size_t m, float* sums) {
  note_thread();
  post(s, [=] {
    for (int r = 0; r < c; ++r) {
      const float* row = x + static_cast<std::size_t>(r) * m;
      double sum = 0, sq = 0;
      for (std::size_t j = 0; j < m; ++j) {
        sum += row[j];
        sq += static_cast<double>(row[j]) * row[j];
      }
      sums[r] = static_cast<float>(sum);
      sums[c + r] = static_cast<float>(sq);
    }
  });
}

void CpuBackend::bn_forward(Stream& s, const float* x, const float* sums, const BatchNormArgs& a, float* xhat, float* y) {
  note_thread();
  post(s, [=] {
    for (int r = 0; r < a.c; ++r) {
      const auto [mean, var] = batch_norm_moments(sums, a, r);
      const auto inv = static_cast<float>(1.0 / std::sqrt(var + a.eps));
      a.invstd[r] = inv;
      const auto mu = static_cast<float>(mean);
      const float g = a.gamma[r], b = a.beta[r];
      const std::size_t first = static_cast<std::size_t>(r) * a.m;
      for (std::size_t j = first; j < first + a.m; ++j) {
        const float h = (x[j] - mu) * inv;
        if (xhat != nullptr) xhat[j] = h;
        const float v = g * h + b;
        y[j] = a.relu ? std::max(v, 0.0F) : v;
      }
    }
  });
}

void CpuBackend::bn_backward_reduce(Stream& s, float* dy, const float* y, const float* xhat, const BatchNormArgs& a,
                                    float* red, float* dgamma, float* dbeta) {
  note_thread();
  post(s, [=] {
    for (int r = 0; r < a.c; ++r) {
      const std::size_t first = static_cast<std::size_t>(r) * a.m;
      double sum = 0, dot = 0;
      for (std::size_t j = first; j < first + a.m; ++j) {
        if (a.relu && !(y[j] > 0)) dy[j] = 0;
        sum += dy[j];
        dot += static_cast<double>(dy[j]) * xhat[j];
      }
      red[r] = static_cast<float>(sum);
      red[a.c + r] = static_cast<float>(dot);
      dbeta[r] += red[r];
      dgamma[r] += red[a.c + r];
    }
  });
}

void CpuBackend::bn_backward_input(Stream& s, const float* dy, const float* xhat, const float* red,
                                   const BatchNormArgs& a, float* dx) {
  note_thread();
  post(s, [=] {
    for (int r = 0; r < a.c; ++r) {
      const float k = a.gamma[r] * a.invstd[r];
      const float mean_dy = red[r] / a.count, mean_dot = red[a.c + r] / a.count;
      const std::size_t first = static_cast<std::size_t>(r) * a.m;
      for (std::size_t j = first; j < first + a.m; ++j) dx[j] = k * (dy[j] - mean_dy - xhat[j] * mean_dot);
    }
  });
}

void CpuBackend::channel_mean(Stream& s, const float* x, int c, int n, std::size_t hw, float* out) {
  note_thread();
  post(s, [=] {
    for (int r = 0; r < c; ++r) {
      for (int i = 0; i < n; ++i) {
        const float* p = x + (static_cast<std::size_t>(r) * static_cast<std::size_t>(n) + static_cast<std::size_t>(i)) * hw;
        double sum = 0;
        for (std::size_t j = 0; j < hw; ++j) sum += p[j];
        out[static_cast<std::size_t>(i) * static_cast<std::size_t>(c) + static_cast<std::size_t>(r)] =
            static_cast<float>(sum / static_cast<double>(hw));
      }
    }
  });
}

void CpuBackend::channel_mean_backward(Stream& s, const float* dout, int c, int n, std::size_t hw, float* dx) {
  note_thread();
  post(s, [=] {
    const float inv = 1.0F / static_cast<float>(hw);
    for (int r = 0; r < c; ++r) {
      for (int i = 0; i < n; ++i) {
        const float g = dout[static_cast<std::size_t>(i) * static_cast<std::size_t>(c) + static_cast<std::size_t>(r)] * inv;
        float* p = dx + (static_cast<std::size_t>(r) * static_cast<std::size_t>(n) + static_cast<std::size_t>(i)) * hw;
        std::fill(p, p + hw, g);
      }
    }
  });
}

void CpuBackend::widen_labels(Stream& s, const std::int32_t* in, std::int64_t* out, std::size_t n) {
  note_thread();
  post(s, [=] { std::copy(in, in + n, out); });
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
