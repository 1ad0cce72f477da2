#include "pinfeed/memory/pressure_monitor.hpp"

#include <fmt/format.h>

#include <thread>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/memory/memory_snapshot.hpp"
#include "pinfeed/memory/pool_policy.hpp"
#include "pinfeed/memory/pressure_events.hpp"

namespace pinfeed::memory {

std::string_view to_string(PressureLevel level) noexcept { return enum_word(kPressureLevelWords, level); }

std::function<std::optional<std::string>(std::uint64_t)> PressureMonitor::regrow_rule(const Config& config) {
  return [root = config.root, keep = config.elevated.available_fraction / config.hysteresis](std::uint64_t bytes) {
    const MemorySnapshot s = MemorySnapshot::read(root);
    return regrow_refusal(s.effective_total(), s.effective_available(), bytes, keep);
  };
}

void PressureMonitor::Config::validate() const {
  if (period.count() < 10 || period.count() > 60'000) {
    throw ConfigError(fmt::format("pressure monitor period must be 10 ms..60 s, got {} ms", period.count()));
  }
  if (!(hysteresis > 0.0 && hysteresis <= 1.0)) {
    throw ConfigError(fmt::format("pressure monitor hysteresis must be in (0, 1], got {}", hysteresis));
  }
  if (hold.count() < 0) throw ConfigError("pressure monitor hold must be >= 0");
  if (near_period.count() < 1 || near_period.count() > 60'000) {
    throw ConfigError(fmt::format("pressure monitor near_period must be 1 ms..60 s, got {} ms", near_period.count()));
  }
  if (headroom_bytes > (1ULL << 40)) throw ConfigError("pressure monitor headroom_bytes must be <= 1 TiB");
  const auto check = [](const char* field, double e, double c, bool inverted) {
    if (e < 0 || c < 0) throw ConfigError(fmt::format("pressure threshold {} must be >= 0", field));
    if (inverted ? c > e : c < e) {
      throw ConfigError(fmt::format("pressure threshold {}: critical ({}) is milder than elevated ({})", field, c, e));
    }
  };
  check("psi_some_avg10", elevated.psi_some_avg10, critical.psi_some_avg10, false);
  check("psi_full_avg10", elevated.psi_full_avg10, critical.psi_full_avg10, false);
  check("swap_out_pages_per_s", elevated.swap_out_pages_per_s, critical.swap_out_pages_per_s, false);
  check("available_fraction", elevated.available_fraction, critical.available_fraction, true);
  if (elevated.available_fraction > 1.0) throw ConfigError("pressure threshold available_fraction must be <= 1");
}

PressureMonitor::PressureMonitor(Config config) : config_(std::move(config)) { config_.validate(); }

std::shared_ptr<PressureMonitor> PressureMonitor::shared(const Config& config) {
  static std::mutex mutex;  // guards monitors
  static std::vector<std::weak_ptr<PressureMonitor>> monitors;
  const std::scoped_lock lock(mutex);
  std::erase_if(monitors, [](const std::weak_ptr<PressureMonitor>& w) { return w.expired(); });
  for (const auto& w : monitors) {
    if (auto m = w.lock(); m && m->config() == config) return m;
  }
  auto m = std::make_shared<PressureMonitor>(config);
  m->start();
  monitors.push_back(m);
  return m;
}

PressureMonitor::~PressureMonitor() { stop(); }

PressureLevel PressureMonitor::classify(const PressureReading& r, double relax, std::string* reason) const {
  // relax < 1 lowers the bar (used to decide whether a level has cleared).
  if (r.cgroup_oom_kills > 0) {
    if (reason) *reason = fmt::format("cgroup OOM kill (+{})", r.cgroup_oom_kills);
    return PressureLevel::critical;
  }
  if (r.cgroup_limit_hits > 0 && config_.elevated.available_fraction > 0 &&
      r.available_fraction <= config_.elevated.available_fraction / relax) {
    if (reason) {
      *reason = fmt::format("cgroup limit hit {} time(s), available {:.1f}% <= {:.1f}%", r.cgroup_limit_hits,
                            r.available_fraction * 100, config_.elevated.available_fraction / relax * 100);
    }
    return PressureLevel::critical;
  }
  const auto hits = [&](const PressureThresholds& t, std::uint64_t headroom, std::string* why) {
    // The headroom in bytes: a fraction of a small cgroup is less than what a
    // neighbour allocates between two readings.
    if (headroom > 0 && r.available_fraction < 1.0 &&
        static_cast<double>(r.available_bytes) < static_cast<double>(headroom) / relax) {
      if (why) {
        *why = fmt::format("available {} < headroom {}", format_bytes(r.available_bytes),
                           format_bytes(static_cast<std::uint64_t>(static_cast<double>(headroom) / relax)));
      }
      return true;
    }
    if (t.psi_some_avg10 > 0 && r.psi_some >= t.psi_some_avg10 * relax) {
      if (why) *why = fmt::format("PSI some {:.1f}% >= {:.1f}%", r.psi_some, t.psi_some_avg10 * relax);
      return true;
    }
    if (t.psi_full_avg10 > 0 && r.psi_full >= t.psi_full_avg10 * relax) {
      if (why) *why = fmt::format("PSI full {:.1f}% >= {:.1f}%", r.psi_full, t.psi_full_avg10 * relax);
      return true;
    }
    if (t.swap_out_pages_per_s > 0 && r.swap_out_rate >= t.swap_out_pages_per_s * relax) {
      if (why) *why = fmt::format("swap-out {:.0f} pages/s >= {:.0f}", r.swap_out_rate, t.swap_out_pages_per_s * relax);
      return true;
    }
    if (t.available_fraction > 0 && r.available_fraction <= t.available_fraction / relax) {
      if (why)
        *why =
            fmt::format("available {:.1f}% <= {:.1f}%", r.available_fraction * 100, t.available_fraction / relax * 100);
      return true;
    }
    return false;
  };
  if (hits(config_.critical, config_.headroom_bytes, reason)) return PressureLevel::critical;
  if (hits(config_.elevated, 2 * config_.headroom_bytes, reason)) return PressureLevel::elevated;
  if (reason) *reason = "all signals below thresholds";
  return PressureLevel::normal;
}

PressureReading PressureMonitor::step() { return step(MemorySnapshot::read(config_.root)); }

PressureReading PressureMonitor::step(const MemorySnapshot& s) {
  PressureReading r;
  r.at = s.taken_at;
  r.psi_some = s.psi ? s.psi->some.avg10 : 0.0;
  r.psi_full = s.psi && s.psi->full ? s.psi->full->avg10 : 0.0;
  if (s.cgroup.pressure) {  // in a container, its own stall figures are the ones that matter
    r.psi_some = std::max(r.psi_some, s.cgroup.pressure->some.avg10);
    if (s.cgroup.pressure->full) r.psi_full = std::max(r.psi_full, s.cgroup.pressure->full->avg10);
  }
  r.available_fraction = s.available_fraction();
  r.available_bytes = s.effective_available();

  std::vector<std::shared_ptr<Subscriber>> to_notify;
  PressureLevel from{};
  {
    const std::scoped_lock lock(mutex_);
    if (previous_) {
      const double dt = std::chrono::duration<double>(s.taken_at - previous_->taken_at).count();
      const auto rate = [dt](std::optional<std::uint64_t> now, std::optional<std::uint64_t> before) {
        if (dt <= 0 || !now || !before || *now < *before) return 0.0;
        return static_cast<double>(*now - *before) / dt;
      };
      r.swap_out_rate = rate(s.pswpout, previous_->pswpout);
      r.swap_in_rate = rate(s.pswpin, previous_->pswpin);
      const auto delta = [](std::optional<std::uint64_t> now, std::optional<std::uint64_t> before) -> std::uint64_t {
        return now && before && *now > *before ? *now - *before : 0;
      };
      // The same cgroup read twice (a process moved between cgroups starts over).
      if (s.cgroup.dir == previous_->cgroup.dir) {
        r.cgroup_limit_hits = delta(s.cgroup.limit_hits(), previous_->cgroup.limit_hits());
        r.cgroup_oom_kills = delta(s.cgroup.oom_kills, previous_->cgroup.oom_kills);
      }
    }
    previous_ = s;

    r.raw = classify(r, 1.0, &r.reason);
    from = level_;
    PressureLevel to = level_;
    if (r.raw > level_) {
      to = r.raw;  // rise at once
      low_since_.reset();
    } else if (r.raw < level_) {
      std::string clear_reason;
      const PressureLevel cleared = classify(r, config_.hysteresis, &clear_reason);
      if (cleared < level_) {
        if (!low_since_) low_since_ = s.taken_at;
        if (s.taken_at - *low_since_ >= config_.hold) {
          to = cleared;
          low_since_.reset();
          r.reason = fmt::format("{} for {} ms", clear_reason, config_.hold.count());
        } else {
          r.reason =
              fmt::format("holding {} until signals stay low for {} ms", to_string(level_), config_.hold.count());
        }
      } else {
        low_since_.reset();
        r.reason = fmt::format("holding {}: {}", to_string(level_), clear_reason);
      }
    } else {
      low_since_.reset();
    }
    r.level = to;
    last_ = r;
    if (to != from) {
      level_ = to;
      ++transitions_;
      for (const auto& [id, sub] : subscribers_) to_notify.push_back(sub);
    }
  }
  if (r.level != from) {
    auto& log = pinfeed::detail::log();
    (r.level > from ? log.warn("memory pressure {} -> {}: {}", to_string(from), to_string(r.level), r.reason)
                    : log.info("memory pressure {} -> {}: {}", to_string(from), to_string(r.level), r.reason));
    const std::scoped_lock notifying(notify_mutex_);
    for (const auto& sub : to_notify) (*sub)(from, r.level, r);
  }
  return r;
}

PressureLevel PressureMonitor::level() const {
  const std::scoped_lock lock(mutex_);
  return level_;
}

std::optional<PressureReading> PressureMonitor::last() const {
  const std::scoped_lock lock(mutex_);
  return last_;
}

std::uint64_t PressureMonitor::transitions() const {
  const std::scoped_lock lock(mutex_);
  return transitions_;
}

PressureMonitor::SubscriptionId PressureMonitor::subscribe(Subscriber subscriber) {
  const std::scoped_lock lock(mutex_);
  const SubscriptionId id = next_id_++;
  subscribers_.emplace(id, std::make_shared<Subscriber>(std::move(subscriber)));
  return id;
}

void PressureMonitor::unsubscribe(SubscriptionId id) {
  const std::scoped_lock lock(notify_mutex_, mutex_);
  subscribers_.erase(id);
}

namespace {
/// The cgroup v1 usage lines where the level changes by the available room
/// (headroom or fraction of the limit, whichever is larger): a threshold
/// event there wakes the monitor the moment a neighbour crosses one.
std::vector<std::uint64_t> usage_lines(const MemorySnapshot& s, const PressureMonitor::Config& c) {
  if (!s.cgroup.limit_bytes || *s.cgroup.limit_bytes >= s.mem_total) return {};
  const std::uint64_t limit = *s.cgroup.limit_bytes;
  std::vector<std::uint64_t> lines;
  for (const auto& [fraction, headroom] : {std::pair{c.elevated.available_fraction, 2 * c.headroom_bytes},
                                           std::pair{c.critical.available_fraction, c.headroom_bytes}}) {
    const auto room = std::max(static_cast<std::uint64_t>(fraction * static_cast<double>(limit)), headroom);
    if (room < limit) lines.push_back(limit - room);
  }
  return lines;
}
}  // namespace

void PressureMonitor::start() {
  const std::scoped_lock lock(thread_mutex_);
  if (thread_.joinable()) return;
  stop_requested_ = false;
  if (config_.kernel_events) {
    try {
      const MemorySnapshot s = MemorySnapshot::read(config_.root);
      events_ = std::make_shared<PressureEvents>(s, usage_lines(s, config_));
      pinfeed::detail::log().debug("pressure monitor: kernel notifications: {}", events_->describe());
    } catch (const std::exception& e) {
      pinfeed::detail::log().warn("pressure monitor: no kernel notifications ({}); polling", e.what());
    }
  }
  thread_ = std::thread([this] { run(); });
}

void PressureMonitor::stop() noexcept {
  {
    const std::scoped_lock lock(thread_mutex_);
    if (!thread_.joinable()) return;
    stop_requested_ = true;
    if (events_) events_->wake();
  }
  thread_cv_.notify_all();
  thread_.join();
}

std::chrono::milliseconds PressureMonitor::next_wait(const PressureReading& r) const {
  const double line = std::max(config_.elevated.available_fraction, 0.0) * 2;
  const bool near =
      r.level != PressureLevel::normal || r.available_fraction <= line ||
      (config_.headroom_bytes > 0 && r.available_fraction < 1.0 && r.available_bytes < 4 * config_.headroom_bytes);
  return near ? std::min(config_.near_period, config_.period) : config_.period;
}

void PressureMonitor::run() {
  std::unique_lock lock(thread_mutex_);
  const std::shared_ptr<PressureEvents> events = events_;
  while (!stop_requested_) {
    lock.unlock();
    auto wait = config_.period;
    try {
      wait = next_wait(step());
    } catch (const std::exception& e) {
      // A snapshot that cannot be read (a vanished cgroup, a fixture being
      // rewritten) is logged; the monitor keeps its level and tries again.
      pinfeed::detail::log().warn("pressure monitor: {}", e.what());
    }
    if (events) {
      // A kernel event, stop(), or the period: read again, but never more
      // often than every 2 ms (a cgroup sitting at memory.high changes
      // memory.events on every charge).
      if (events->wait(wait)) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      lock.lock();
      continue;
    }
    lock.lock();
    thread_cv_.wait_for(lock, wait, [this] { return stop_requested_; });
  }
}

}  // namespace pinfeed::memory
