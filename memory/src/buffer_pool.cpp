#include "pinfeed/memory/buffer_pool.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cassert>

#include "pinfeed/log.hpp"
#include "pinfeed/memory/collective_gate.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/memory/pinned_resource.hpp"

namespace pinfeed::memory {

// ---------------------------------------------------------------- SlotLease

SlotLease::SlotLease(SlotLease&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      slot_(other.slot_),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      pinned_(other.pinned_) {}

SlotLease& SlotLease::operator=(SlotLease&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = std::exchange(other.pool_, nullptr);
    slot_ = other.slot_;
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    pinned_ = other.pinned_;
  }
  return *this;
}

void SlotLease::release() noexcept {
  if (pool_ == nullptr) return;
  std::exchange(pool_, nullptr)->release_slot(slot_);
  data_ = nullptr;
  size_ = 0;
}

void SlotLease::release_after(std::shared_ptr<Fence> fence) noexcept {
  if (pool_ == nullptr) return;
  if (!fence) {
    release();
    return;
  }
  std::exchange(pool_, nullptr)->release_slot_after(slot_, std::move(fence));
  data_ = nullptr;
  size_ = 0;
}

// ---------------------------------------------------------------- BufferPool

void BufferPool::Config::validate() const {
  if (slot_bytes == 0) throw ConfigError("buffer pool slot_bytes must be > 0");
  if (round_up_to_page(slot_bytes) > kMaxRegistrationBytes) {
    throw ConfigError(fmt::format("buffer pool slot_bytes {} exceeds the {} maximum of one registration",
                                  format_bytes(slot_bytes), format_bytes(kMaxRegistrationBytes)));
  }
  if (slots == 0 || slots > 65536) throw ConfigError(fmt::format("buffer pool slots must be 1..65536, got {}", slots));
  if (slab_bytes == 0) throw ConfigError("buffer pool slab_bytes must be > 0");
  if (min_pinned_slots > slots) {
    throw ConfigError(fmt::format("buffer pool min_pinned_slots {} exceeds slots {}", min_pinned_slots, slots));
  }
  if (retry_pin_after.count() < 0) throw ConfigError("buffer pool retry_pin_after must be >= 0");
  const std::size_t cap = round_up_to_page(slot_bytes);
  if (cap > SIZE_MAX / slots) throw ConfigError("buffer pool slots x slot_bytes overflows");
}

namespace {
/// Every live pool of the process, for process_pool_stats(). Lock order:
/// the registry's mutex, then a pool's (stats()); never the other way.
struct PoolRegistry {
  std::mutex mutex;  // guards pools
  std::vector<const BufferPool*> pools;
};
PoolRegistry& pool_registry() {
  static PoolRegistry r;
  return r;
}
}  // namespace

ProcessPoolStats process_pool_stats() {
  PoolRegistry& r = pool_registry();
  const std::scoped_lock lock(r.mutex);
  ProcessPoolStats total;
  for (const BufferPool* p : r.pools) {
    const PoolStats st = p->stats();
    ++total.pools;
    total.slots += st.slots;
    total.pinned_slots += st.pinned_slots;
    total.pinned_bytes += st.pinned_bytes;
    total.pageable_bytes += st.pageable_bytes;
  }
  return total;
}

BufferPool::BufferPool(Config config, HostResource& pinned, HostResource& pageable)
    : config_(std::move(config)), pinned_resource_(pinned), pageable_resource_(pageable) {
  config_.validate();
  slot_capacity_ = round_up_to_page(config_.slot_bytes);
  const std::size_t slab_limit = std::min(std::max(config_.slab_bytes, slot_capacity_), kMaxRegistrationBytes);
  const std::size_t per_slab = std::max<std::size_t>(1, slab_limit / slot_capacity_);
  for (std::size_t first = 0; first < config_.slots; first += per_slab) {
    Slab slab;
    slab.first_slot = first;
    slab.slot_count = std::min(per_slab, config_.slots - first);
    slab.bytes = slab.slot_count * slot_capacity_;
    slabs_.push_back(slab);
  }
  state_.assign(config_.slots, SlotState::free);
  slab_of_.resize(config_.slots);
  for (std::size_t i = 0; i < slabs_.size(); ++i) {
    for (std::size_t k = 0; k < slabs_[i].slot_count; ++k) slab_of_[slabs_[i].first_slot + k] = i;
  }
  allocate_initial();
  for (std::size_t i = 0; i < config_.slots; ++i) free_.push_back(i);
  maintainer_ = std::jthread([this](const std::stop_token& stop) { maintain(stop); });
  PoolRegistry& r = pool_registry();
  const std::scoped_lock lock(r.mutex);
  r.pools.push_back(this);
}

void BufferPool::allocate_initial() {
  // Pinning is the slow part (1-2 GB/s): it happens here, once, before the
  // first batch, never on the acquire path. The lock is uncontended (the
  // maintenance thread starts after this) and held so that the *_locked
  // helpers are called as their names say. The budget rule is the policy's:
  // whole slabs, front to back (Note [Pool policy]).
  const std::scoped_lock lock(mutex_);
  std::string refused = config_.pin ? "" : "pinning disabled";
  std::uint64_t pinned_bytes = 0;
  try {
    for (std::size_t i = 0; i < slabs_.size(); ++i) {
      Slab& slab = slabs_[i];
      if (refused.empty() && pinned_bytes + slab.bytes > config_.pinned_budget_bytes) {
        refused = "budget";
      }
      if (refused.empty()) {
        try {
          slab.data = static_cast<std::byte*>(pinned_resource_.allocate(slab.bytes, page_size()));
          slab.pinned = pinned_resource_.is_pinned();
          slab.owner = &pinned_resource_;
          pinned_bytes += slab.bytes;
          record_locked(i, true, "initial");
          continue;
        } catch (const OutOfMemory& e) {
          refused = e.reason();
          ++failed_pins_;
          back_off_pinning_locked();
          pinfeed::detail::log().warn("buffer pool: pinning slab {} ({}) refused: {}; slabs from here on are pageable",
                                      i, format_bytes(slab.bytes), e.what());
        }
      }
      slab.data = static_cast<std::byte*>(pageable_resource_.allocate(slab.bytes, page_size()));
      slab.pinned = pageable_resource_.is_pinned();
      slab.owner = &pageable_resource_;
      record_locked(i, false, fmt::format("initial: {}", refused));
    }
  } catch (...) {
    free_all_slabs();
    throw;
  }
}

void BufferPool::free_all_slabs() noexcept {
  for (Slab& slab : slabs_) {
    if (slab.data != nullptr) slab.owner->deallocate(slab.data, slab.bytes, page_size());
    slab.data = nullptr;
  }
}

BufferPool::~BufferPool() {
  {
    PoolRegistry& r = pool_registry();
    const std::scoped_lock lock(r.mutex);
    std::erase(r.pools, this);
  }
  if (monitor_ != nullptr) monitor_->unsubscribe(subscription_);
  maintainer_.request_stop();
  {
    const std::scoped_lock lock(mutex_);
    cancelled_ = true;
    ++work_generation_;
  }
  slot_cv_.notify_all();
  work_cv_.notify_all();
  maintainer_.join();

  std::unique_lock lock(mutex_);
  // Copies still reading fenced slots must finish before the memory goes.
  while (!fenced_.empty()) {
    Fenced f = std::move(fenced_.front());
    fenced_.pop_front();
    lock.unlock();
    // A destructor never throws: a fence whose wait fails (a sticky device
    // error, the runtime unloading) means nothing will read the slot again.
    try {
      if (!f.fence->wait_for(std::chrono::seconds(30))) {
        pinfeed::detail::log().error("buffer pool: slot {} still fenced after 30 s at destruction", f.slot);
      }
    } catch (const std::exception& e) {
      pinfeed::detail::log().error("buffer pool: slot {}'s fence failed at destruction ({}): treated as complete", f.slot,
                                   e.what());
    }
    lock.lock();
    state_[f.slot] = SlotState::free;
  }
  if (prepared_) {
    retired_.push_back(Retired{prepared_->data, slabs_[prepared_->job.slab].bytes, prepared_->owner});
    prepared_.reset();
  }
  free_retired(lock);
  const auto leased = static_cast<std::size_t>(std::count(state_.begin(), state_.end(), SlotState::leased));
  if (leased > 0) {
    pinfeed::detail::log().critical("buffer pool destroyed with {} slot(s) still leased", leased);
    assert(leased == 0 && "BufferPool destroyed while leases are alive");
  }
  free_all_slabs();
}

void BufferPool::record_locked(std::size_t slab, bool to_pinned, std::string reason, bool ok) {
  transitions_.push_back(PoolTransition{std::chrono::system_clock::now(), slab, slabs_[slab].slot_count, to_pinned, ok,
                                        std::move(reason)});
}

void BufferPool::back_off_pinning_locked() {
  const unsigned shift = std::min(pin_refusals_in_a_row_, 6U);
  no_pin_before_ = Clock::now() + config_.retry_pin_after * (1U << shift);
  ++policy_version_;
  ++pin_refusals_in_a_row_;
}

SlotLease BufferPool::lease_locked(std::size_t slot) {
  state_[slot] = SlotState::leased;
  const Slab& slab = slabs_[slab_of_[slot]];
  std::byte* data = slab.data + (slot - slab.first_slot) * slot_capacity_;
  return SlotLease(this, slot, data, config_.slot_bytes, slab.pinned);
}

bool BufferPool::reclaim_one_fenced(std::unique_lock<std::mutex>& lock, std::chrono::microseconds wait) {
  // The fence is queried with the lock released: it may call the driver.
  if (fenced_.empty()) return false;
  Fenced f = std::move(fenced_.front());
  fenced_.pop_front();
  lock.unlock();
  bool ready = false;
  try {
    ready = wait.count() > 0 ? f.fence->wait_for(wait) : f.fence->ready();
  } catch (const std::exception& e) {
    pinfeed::detail::log().error("buffer pool: fence of slot {} failed ({}); the slot stays busy", f.slot, e.what());
  }
  lock.lock();
  // While the fence was out of fenced_, an acquirer may have found neither
  // a free nor a fenced slot and gone to sleep on slot_cv_: wake it, with
  // the slot back in either list, or it sleeps until its deadline (forever
  // without one) while the slot sits free.
  if (!ready) {
    fenced_.push_front(std::move(f));
    slot_cv_.notify_all();
    return false;
  }
  state_[f.slot] = SlotState::free;
  free_.push_front(f.slot);
  try_swap_locked();
  ++work_generation_;
  slot_cv_.notify_all();
  work_cv_.notify_one();
  return true;
}

std::optional<SlotLease> BufferPool::acquire_until(std::optional<Clock::time_point> deadline,
                                                   const std::stop_token& stop) {
  std::unique_lock lock(mutex_);
  ++acquires_;
  bool waited = false;
  const auto t0 = Clock::now();
  const auto account = [&] {
    if (!waited) return;
    ++acquire_waits_;
    acquire_wait_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
  };
  while (true) {
    if (cancelled_) {
      account();
      throw Cancelled("buffer pool: acquire cancelled");
    }
    if (stop.stop_requested()) {
      account();
      return std::nullopt;
    }
    if (!free_.empty()) {
      const std::size_t slot = free_.front();
      free_.pop_front();
      account();
      return lease_locked(slot);
    }
    waited = true;
    const auto now = Clock::now();
    if (deadline && now >= *deadline) {
      account();
      return std::nullopt;
    }
    if (!fenced_.empty()) {
      // Every slot is out and some wait on a copy: wait on the oldest copy
      // (copies on one stream complete in order), a little at a time so a
      // plain release, a cancel or a stop is still seen promptly.
      auto slice = std::chrono::microseconds(2000);
      if (deadline) slice = std::min(slice, std::chrono::duration_cast<std::chrono::microseconds>(*deadline - now) + std::chrono::microseconds(1));
      reclaim_one_fenced(lock, slice);
      continue;
    }
    const auto pred = [this] { return cancelled_ || !free_.empty() || !fenced_.empty(); };
    if (deadline) {
      slot_cv_.wait_until(lock, stop, *deadline, pred);
    } else {
      slot_cv_.wait(lock, stop, pred);
    }
  }
}

std::optional<SlotLease> BufferPool::acquire(std::chrono::milliseconds timeout, std::stop_token stop) {
  return acquire_until(Clock::now() + timeout, stop);
}

SlotLease BufferPool::acquire(std::stop_token stop) {
  auto lease = acquire_until(std::nullopt, stop);
  if (!lease) throw Cancelled("buffer pool: acquire stopped");
  return std::move(*lease);
}

void BufferPool::release_slot(std::size_t slot) noexcept {
  bool wake_maintainer = false;
  {
    const std::scoped_lock lock(mutex_);
    assert(state_[slot] == SlotState::leased);
    state_[slot] = SlotState::free;
    free_.push_back(slot);
    const bool swapped = prepared_ && prepared_->job.slab == slab_of_[slot] && try_swap_locked();
    wake_maintainer = swapped || maintenance_wanted_locked();
    if (wake_maintainer) ++work_generation_;
  }
  slot_cv_.notify_one();
  if (wake_maintainer) work_cv_.notify_one();
}

PolicyInput BufferPool::policy_locked(bool without_prepared) const {
  PolicyInput in;
  in.level = level_;
  in.pin = config_.pin;
  in.min_pinned_slots = config_.min_pinned_slots;
  in.pinned_budget_bytes = config_.pinned_budget_bytes;
  in.pin_backed_off = no_pin_before_ != Clock::time_point{} && Clock::now() < no_pin_before_;
  if (prepared_ && !without_prepared) {
    in.prepared = prepared_->job.slab;
    in.prepared_to_pinned = prepared_->job.to_pinned;
  }
  return in;
}

bool BufferPool::maintenance_wanted_locked() const {
  // Asked on every release: the answer is kept until the policy's inputs
  // change (level, pinning, a prepared move, a back-off) or a back-off it
  // depended on ends, so a settled pool answers with two compares.
  if (wanted_version_ == policy_version_ &&
      (wanted_until_ == Clock::time_point::max() || Clock::now() < wanted_until_)) {
    return wanted_;
  }
  const PolicyInput in = policy_locked();
  wanted_ = next_pool_move(in, slabs_, [](std::size_t) { return true; }).has_value();
  wanted_version_ = policy_version_;
  wanted_until_ = in.pin_backed_off ? no_pin_before_ : Clock::time_point::max();
  return wanted_;
}

void BufferPool::release_slot_after(std::size_t slot, std::shared_ptr<Fence> fence) noexcept {
  {
    const std::scoped_lock lock(mutex_);
    assert(state_[slot] == SlotState::leased);
    state_[slot] = SlotState::fenced;
    fenced_.push_back(Fenced{slot, std::move(fence)});
    ++work_generation_;
  }
  slot_cv_.notify_all();
  work_cv_.notify_one();
}

void BufferPool::cancel() {
  {
    const std::scoped_lock lock(mutex_);
    cancelled_ = true;
  }
  slot_cv_.notify_all();
}

void BufferPool::reset_cancel() {
  const std::scoped_lock lock(mutex_);
  cancelled_ = false;
}

void BufferPool::on_pressure(PressureLevel level) {
  {
    const std::scoped_lock lock(mutex_);
    if (level_ == level) return;
    pinfeed::detail::log().info("buffer pool: pressure {} -> {}", to_string(level_), to_string(level));
    level_ = level;
    ++policy_version_;
    if (level == PressureLevel::normal) {  // a fresh "normal" may retry at once
      no_pin_before_ = {};
      pin_refusals_in_a_row_ = 0;
    }
    ++work_generation_;
  }
  work_cv_.notify_one();
}

void BufferPool::follow(PressureMonitor& monitor) {
  if (monitor_ != nullptr) throw ConfigError("buffer pool already follows a pressure monitor");
  monitor_ = &monitor;
  subscription_ = monitor.subscribe([this](PressureLevel, PressureLevel to, const PressureReading&) { on_pressure(to); });
  on_pressure(monitor.level());
}

bool BufferPool::slab_idle_locked(const Slab& slab) const {
  for (std::size_t k = 0; k < slab.slot_count; ++k) {
    if (state_[slab.first_slot + k] != SlotState::free) return false;
  }
  return true;
}

std::optional<PoolMove> BufferPool::next_job_locked(bool idle_only) const {
  return next_pool_move(policy_locked(), slabs_, [this](std::size_t i) { return slab_idle_locked(slabs_[i]); }, idle_only);
}

bool BufferPool::still_wanted_locked(const PoolMove& job) const {
  // Asked about the prepared move itself (or one being prepared): its own
  // move is not counted as done, and a pin that succeeded ignores back-off.
  return pool_move_wanted(policy_locked(/*without_prepared=*/true), slabs_, job.slab, job.to_pinned);
}

bool BufferPool::try_swap_locked() {
  if (!prepared_ || !slab_idle_locked(slabs_[prepared_->job.slab])) return false;
  // Note [Slot lifetime]: every slot of the slab is free and we hold the
  // lock, so no lease sees the memory change under it.
  Prepared p = std::move(*prepared_);
  prepared_.reset();
  ++policy_version_;  // the slab's pinning changes below
  Slab& slab = slabs_[p.job.slab];
  retired_.push_back(Retired{slab.data, slab.bytes, slab.owner});
  slab.data = p.data;
  slab.owner = p.owner;
  slab.pinned = p.owner->is_pinned();
  (p.job.to_pinned ? to_pinned_ : to_pageable_) += 1;
  if (p.job.to_pinned) pin_refusals_in_a_row_ = 0;
  record_locked(p.job.slab, slab.pinned, p.job.reason);
  ++work_generation_;  // the maintenance thread frees the old memory
  return true;
}

void BufferPool::free_retired(std::unique_lock<std::mutex>& lock) {
  if (retired_.empty()) return;
  std::vector<Retired> batch;
  batch.swap(retired_);
  // wait_idle() must not see an empty retired_ while this memory is still
  // held: callers compare resource statistics right after it returns.
  freeing_ = true;
  lock.unlock();
  for (const Retired& r : batch) {
    if (r.owner == &pinned_resource_) {
      // Unregistering: never while a device collective is in flight (Note
      // [Registration outside collectives] in collective_gate.hpp).
      CollectiveGate::process().exclusive([&] { r.owner->deallocate(r.data, r.bytes, page_size()); });
    } else {
      r.owner->deallocate(r.data, r.bytes, page_size());
    }
  }
  lock.lock();
  freeing_ = false;
}

void BufferPool::run_job(std::unique_lock<std::mutex>& lock, const PoolMove& job) {
  moving_ = true;
  HostResource& target = job.to_pinned ? pinned_resource_ : pageable_resource_;
  const std::size_t bytes = slabs_[job.slab].bytes;
  lock.unlock();

  // The slow part (mmap, faulting, pinning at 1-2 GB/s) runs with no lock
  // held and no slot taken: the slab stays in use meanwhile.
  std::byte* fresh = nullptr;
  std::string failure;
  try {
    if (job.to_pinned) {
      // Registering: outside device collectives (Note [Registration outside
      // collectives] in collective_gate.hpp).
      CollectiveGate::process().exclusive([&] { fresh = static_cast<std::byte*>(target.allocate(bytes, page_size())); });
    } else {
      fresh = static_cast<std::byte*>(target.allocate(bytes, page_size()));
    }
  } catch (const OutOfMemory& e) {
    failure = e.reason();
    pinfeed::detail::log().warn("buffer pool: preparing {} memory for slab {} failed: {}",
                                job.to_pinned ? "pinned" : "pageable", job.slab, e.what());
  }

  lock.lock();
  moving_ = false;
  if (fresh == nullptr) {
    if (job.to_pinned) {
      ++failed_pins_;
      back_off_pinning_locked();  // a refusing resource is not hammered; a new "normal" resets it
    }
    record_locked(job.slab, slabs_[job.slab].pinned, fmt::format("{} failed: {}", job.reason, failure), false);
    return;
  }
  if (!still_wanted_locked(job)) {  // the level changed while we prepared
    retired_.push_back(Retired{fresh, bytes, &target});
    return;
  }
  prepared_ = Prepared{job, fresh, &target};
  ++policy_version_;
  if (try_swap_locked()) {
    lock.unlock();
    slot_cv_.notify_all();
    lock.lock();
  }
  pinfeed::detail::log().info("buffer pool: slab {} ({}) {} {} memory ({})", job.slab, format_bytes(bytes),
                              prepared_ ? "will move, once idle, to" : "moved to", job.to_pinned ? "pinned" : "pageable",
                              job.reason);
}

void BufferPool::maintain(const std::stop_token& stop) {
  std::unique_lock lock(mutex_);
  while (!stop.stop_requested()) {
    ++maintenance_rounds_;
    free_retired(lock);
    if (prepared_ && !still_wanted_locked(prepared_->job)) {
      retired_.push_back(Retired{prepared_->data, slabs_[prepared_->job.slab].bytes, prepared_->owner});
      prepared_.reset();
      ++policy_version_;
      continue;
    }
    if (!prepared_) {
      if (const auto job = next_job_locked()) {
        run_job(lock, *job);
        continue;
      }
    }
    if (!fenced_.empty()) reclaim_one_fenced(lock, std::chrono::microseconds(0));
    idle_cv_.notify_all();
    const std::uint64_t seen = work_generation_;
    const auto pred = [&] { return work_generation_ != seen; };
    // Fences are polled; a pin back-off ends at a known time; everything
    // else (pressure changes, releases that matter, swaps) bumps the generation.
    std::optional<Clock::time_point> wake;
    if (!fenced_.empty()) wake = Clock::now() + std::chrono::milliseconds(5);
    if (no_pin_before_ > Clock::now()) {  // a back-off runs: wake when it ends, if the policy would pin then
      PolicyInput later = policy_locked();
      later.pin_backed_off = false;
      if (next_pool_move(later, slabs_, [](std::size_t) { return true; })) {
        wake = wake ? std::min(*wake, no_pin_before_) : no_pin_before_;
      }
    }
    if (wake) {
      work_cv_.wait_until(lock, stop, *wake, pred);
    } else {
      work_cv_.wait(lock, stop, pred);
    }
  }
  free_retired(lock);
}

bool BufferPool::wait_idle(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  return idle_cv_.wait_for(lock, timeout, [this] {
    return !moving_ && !freeing_ && retired_.empty() && (!prepared_ || !slab_idle_locked(slabs_[prepared_->job.slab])) &&
           !next_job_locked(/*idle_only=*/true);
  });
}

PoolStats BufferPool::stats() const {
  const std::scoped_lock lock(mutex_);
  PoolStats st;
  st.slots = config_.slots;
  st.slot_bytes = slot_capacity_;
  st.slabs = slabs_.size();
  for (const Slab& s : slabs_) {
    (s.pinned ? st.pinned_slots : st.pageable_slots) += s.slot_count;
    (s.pinned ? st.pinned_bytes : st.pageable_bytes) += s.bytes;
  }
  for (const SlotState s : state_) {
    switch (s) {
      case SlotState::free: ++st.free_slots; break;
      case SlotState::leased: ++st.leased_slots; break;
      case SlotState::fenced: ++st.fenced_slots; break;
    }
  }
  st.acquires = acquires_;
  st.acquire_waits = acquire_waits_;
  st.acquire_wait_seconds = acquire_wait_seconds_;
  st.to_pageable = to_pageable_;
  st.to_pinned = to_pinned_;
  st.failed_pins = failed_pins_;
  st.level = level_;
  st.pending_slots = prepared_ ? slabs_[prepared_->job.slab].slot_count : 0;
  st.maintenance_rounds = maintenance_rounds_;
  return st;
}

std::vector<PoolTransition> BufferPool::transitions() const {
  const std::scoped_lock lock(mutex_);
  return transitions_;
}

}  // namespace pinfeed::memory
