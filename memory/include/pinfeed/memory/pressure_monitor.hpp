#pragma once
// PressureMonitor: turns memory snapshots into a level (normal / elevated /
// critical) and tells subscribers when it changes.
//
// Signals: PSI memory some/full avg10 (the system's, or the cgroup's v2
// memory.pressure when it is higher), swap-out rate (pages/s from pswpout
// deltas), the available fraction (effective available / effective total:
// the cgroup's room under memory.max, memory.high and v1's memory + swap
// limit counts), and the cgroup's own events between two readings: an OOM
// kill in the cgroup is critical at once; the limit hit (v1 memory.failcnt,
// v2 memory.events max/high) is critical when the available fraction is also
// at or below the elevated threshold (a cgroup full of page cache hits its
// limit all the time, harmlessly: the kernel drops the cache).
// The level rises at once when any signal crosses a threshold. It falls only
// after every signal has been below the lower level's thresholds, relaxed by
// the hysteresis factor, for the whole hold time, so a level does not flap.
//
// It runs on its own thread (start/stop) or is driven step by step (step()),
// which is how tests and `pinfeed-diag --watch` use it.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "pinfeed/enum_words.hpp"
#include "pinfeed/memory/memory_snapshot.hpp"
#include "pinfeed/memory/pressure_level.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {

/// A level is entered when ANY signal reaches its threshold.
struct PressureThresholds {
  double psi_some_avg10 = 0;        ///< percent of time some task stalled on memory
  double psi_full_avg10 = 0;        ///< percent of time all tasks stalled on memory
  double swap_out_pages_per_s = 0;  ///< pswpout rate
  double available_fraction = 0;    ///< entered when the available fraction is AT OR BELOW this
  bool operator==(const PressureThresholds&) const = default;
};

struct PressureReading {
  PressureLevel level = PressureLevel::normal;  ///< level after this reading (with hysteresis)
  PressureLevel raw = PressureLevel::normal;    ///< what this reading alone says
  double psi_some = 0, psi_full = 0;            ///< avg10, percent
  double swap_in_rate = 0, swap_out_rate = 0;   ///< pages/s since the previous reading
  double available_fraction = 1;
  std::uint64_t available_bytes = 0;
  std::uint64_t cgroup_limit_hits = 0;  ///< since the previous reading (failcnt, memory.events max + high)
  std::uint64_t cgroup_oom_kills = 0;   ///< since the previous reading
  std::string reason;                   ///< which signal decided, e.g. "swap-out 5120 pages/s >= 4096"
  std::chrono::steady_clock::time_point at{};
};

class PressureMonitor {
 public:
  struct Config {
    std::filesystem::path root = "/";  ///< procfs/sysfs root to read
    /// 250 ms: fast enough to react inside a second to a swap storm (each
    /// reading is ~6 small procfs reads, tens of µs: ~0.01% of a core), slow
    /// enough that the pswpout delta over one period is not noise. PSI avg10
    /// itself moves on a 2 s clock, so sampling faster gains nothing.
    std::chrono::milliseconds period{250};
    PressureThresholds elevated{10.0, 2.0, 256.0, 0.10};
    PressureThresholds critical{40.0, 10.0, 4096.0, 0.05};
    double hysteresis = 0.8;  ///< to step down, signals must be below threshold*h (available above threshold/h)
    std::chrono::milliseconds hold{5000};  ///< how long signals must stay low before stepping down
    /// Room (cgroup room, or MemAvailable) kept free: critical when less is
    /// available, elevated below twice it, whatever the fractions say. A
    /// neighbour allocating at memory speed (~0.3 GB/s of first touches here)
    /// needs ~0.2 s to fill 64 MiB: the pool is already giving back by then.
    std::uint64_t headroom_bytes = 64_MiB;
    /// Wake on the kernel's notifications (PressureEvents: cgroup v1 usage
    /// thresholds at the two lines above, PSI triggers, memory.events)
    /// instead of waiting for the next period; only when root is "/".
    bool kernel_events = true;
    /// The period while the host is near a threshold (a level above normal,
    /// or available within twice the elevated line): a missed or absent
    /// notification costs at most this (never more than period).
    std::chrono::milliseconds near_period{20};
    void validate() const;  ///< ConfigError naming the field
    bool operator==(const Config&) const = default;
  };
  using Subscriber = std::function<void(PressureLevel from, PressureLevel to, const PressureReading& reading)>;
  /// The pool's regrow rule (BufferPool::Config::may_grow) for these
  /// thresholds: reads the host (config.root) at each ask and answers with
  /// regrow_refusal (pool_policy.hpp) against the line at which "elevated"
  /// clears, elevated.available_fraction / hysteresis.
  static std::function<std::optional<std::string>(std::uint64_t bytes)> regrow_rule(const Config& config);
  using SubscriptionId = std::uint64_t;

  explicit PressureMonitor(Config config);
  ~PressureMonitor();  ///< stops the thread
  PressureMonitor(const PressureMonitor&) = delete;
  PressureMonitor& operator=(const PressureMonitor&) = delete;

  /// The process's running monitor for `config`, started; made on first
  /// use and stopped when the last holder lets go. Every pool of a process
  /// (each trainer worker's loaders) follows the same readings, so they
  /// shrink and grow back together and one thread samples for all.
  static std::shared_ptr<PressureMonitor> shared(const Config& config);

  /// Starts sampling on an own thread every period. Idempotent.
  void start();
  /// Stops and joins the thread. Idempotent; never throws.
  void stop() noexcept;

  /// Reads a snapshot from the root now and evaluates it. Thread-safe.
  PressureReading step();
  /// Evaluates a given snapshot (its taken_at is the clock). Thread-safe;
  /// subscribers run on the calling thread, outside the monitor's lock.
  PressureReading step(const MemorySnapshot& snapshot);

  [[nodiscard]] PressureLevel level() const;
  [[nodiscard]] std::optional<PressureReading> last() const;
  /// Level changes seen so far (up and down).
  [[nodiscard]] std::uint64_t transitions() const;

  /// Subscribers run on the thread that steps the monitor. Once
  /// unsubscribe() returns, the subscriber is not running and will not run
  /// again; do not call unsubscribe from inside a subscriber.
  SubscriptionId subscribe(Subscriber subscriber);
  void unsubscribe(SubscriptionId id);

  [[nodiscard]] const Config& config() const noexcept { return config_; }

 private:
  [[nodiscard]] PressureLevel classify(const PressureReading& r, double relax, std::string* reason) const;
  /// How long the thread sleeps after reading `r` (period, or near_period near a line).
  [[nodiscard]] std::chrono::milliseconds next_wait(const PressureReading& r) const;
  void run();

  const Config config_;

  mutable std::mutex mutex_;  // guards everything below except the thread
  PressureLevel level_ = PressureLevel::normal;
  std::optional<PressureReading> last_;
  std::optional<MemorySnapshot> previous_;
  std::optional<std::chrono::steady_clock::time_point> low_since_;
  std::uint64_t transitions_ = 0;
  std::map<SubscriptionId, std::shared_ptr<Subscriber>> subscribers_;
  SubscriptionId next_id_ = 1;

  std::mutex notify_mutex_;  // held while subscribers run; taken by unsubscribe

  mutable std::mutex thread_mutex_;  // guards stop_requested_, thread_, events_
  std::condition_variable thread_cv_;
  bool stop_requested_ = false;
  std::shared_ptr<class PressureEvents> events_;  // armed by the thread's start; woken by stop()
  std::thread thread_;
};

}  // namespace pinfeed::memory
