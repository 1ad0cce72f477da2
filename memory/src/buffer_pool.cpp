#include "pinfeed/memory/buffer_pool.hpp"

#include <fmt/format.h>

#include <sys/mman.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstring>

#include "pinfeed/error.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/memory/collective_gate.hpp"
#include "pinfeed/memory/pinned_resource.hpp"

namespace pinfeed::memory {

// ---------------------------------------------------------------- SlotLease

SlotLease::SlotLease(SlotLease&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      slot_(other.slot_),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      pinned_(other.pinned_),
      lent_(other.lent_) {}

SlotLease& SlotLease::operator=(SlotLease&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = std::exchange(other.pool_, nullptr);
    slot_ = other.slot_;
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    pinned_ = other.pinned_;
    lent_ = other.lent_;
  }
  return *this;
}

void SlotLease::hand_to_consumer() noexcept {
  if (pool_ != nullptr) pool_->hand_to_consumer(slot_);
}

void SlotLease::release() noexcept {
  if (pool_ == nullptr) return;
  lent_ = std::exchange(pool_, nullptr)->release_slot(slot_, data_);
  data_ = nullptr;
  size_ = 0;
}

void SlotLease::release_after(std::shared_ptr<Fence> fence) noexcept {
  if (pool_ == nullptr) return;
  if (!fence) {
    release();
    return;
  }
  lent_ = std::exchange(pool_, nullptr)->release_slot_after(slot_, data_, std::move(fence));
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
    total.released_slots += st.released_slots;
    total.given_back_bytes += st.given_back_bytes;
    total.pinned_bytes += st.pinned_bytes;
    total.pageable_bytes += st.pageable_bytes;
  }
  return total;
}

BufferPool::BufferPool(Config config, HostResource& pinned, HostResource& pageable)
    : config_(std::move(config)), pinned_resource_(pinned), pageable_resource_(pageable) {
  config_.validate();
  slot_capacity_ = round_up_to_page(config_.slot_bytes);
  min_live_slots_ = std::min(config_.min_live_slots, config_.slots);
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
  held_.assign(config_.slots, false);
  slab_of_.resize(config_.slots);
  for (std::size_t i = 0; i < slabs_.size(); ++i) {
    for (std::size_t k = 0; k < slabs_[i].slot_count; ++k) slab_of_[slabs_[i].first_slot + k] = i;
  }
  allocate_initial();
  for (std::size_t i = 0; i < config_.slots; ++i) free_.push_back(i);
  serving_ = config_.slots;
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
          slab.memory = pinned_resource_.is_pinned() ? SlabMemory::pinned : SlabMemory::pageable;
          slab.owner = &pinned_resource_;
          pinned_bytes += slab.bytes;
          record_locked(i, slab.memory, "initial");
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
      slab.memory = pageable_resource_.is_pinned() ? SlabMemory::pinned : SlabMemory::pageable;
      slab.owner = &pageable_resource_;
      record_locked(i, slab.memory, fmt::format("initial: {}", refused));
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
      pinfeed::detail::log().error("buffer pool: slot {}'s fence failed at destruction ({}): treated as complete",
                                   f.slot, e.what());
    }
    lock.lock();
    if (f.loose != nullptr) {
      if (auto it = loose_.find(f.loose); it != loose_.end()) {
        const Loose l = take_loose_locked(it);
        lock.unlock();
        unmap_slab(f.loose, l.bytes, l.owner);
        lock.lock();
      }
      continue;
    }
    state_[f.slot] = SlotState::free;
  }
  drain_to_free(lock);
  if (!loose_.empty()) {
    pinfeed::detail::log().critical("buffer pool destroyed with {} lent slot(s) still held", loose_.size());
    assert(loose_.empty() && "BufferPool destroyed while lent slots are alive");
  }
  const auto leased = static_cast<std::size_t>(std::count(state_.begin(), state_.end(), SlotState::leased));
  if (leased > 0) {
    pinfeed::detail::log().critical("buffer pool destroyed with {} slot(s) still leased", leased);
    assert(leased == 0 && "BufferPool destroyed while leases are alive");
  }
  lock.unlock();
  for (const Slab& slab : slabs_) {
    if (slab.data != nullptr) unmap_slab(slab.data, slab.bytes, slab.owner);
  }
  for (Slab& slab : slabs_) slab.data = nullptr;
}

void BufferPool::record_locked(std::size_t slab, SlabMemory memory, std::string reason, bool ok) {
  transitions_.push_back(
      PoolTransition{std::chrono::system_clock::now(), slab, slabs_[slab].slot_count, memory, ok, std::move(reason)});
}

void BufferPool::update_serving_locked() noexcept {
  serving_.store(policy_totals(slabs_).live_slots, std::memory_order_relaxed);
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
  assert(slab.data != nullptr && !slab.moving && !slab.draining);
  std::byte* data = slab.data + (slot - slab.first_slot) * slot_capacity_;
  return SlotLease(this, slot, data, config_.slot_bytes, slab.memory == SlabMemory::pinned);
}

void BufferPool::hand_to_consumer(std::size_t slot) noexcept {
  const std::scoped_lock lock(mutex_);
  assert(state_[slot] == SlotState::leased);
  if (held_[slot]) return;
  held_[slot] = true;
  ++consumer_held_;
  if (level_ == PressureLevel::critical) ++policy_version_;  // the floor moves only matter there
}

bool BufferPool::return_slot_locked(std::size_t slot, bool front) {
  const Slab& slab = slabs_[slab_of_[slot]];
  if (slab.draining) {  // Note [Pool policy]: released on return under critical pressure
    state_[slot] = SlotState::parked;
    return slab_idle_locked(slab);
  }
  state_[slot] = SlotState::free;
  if (front) {
    free_.push_front(slot);
  } else {
    free_.push_back(slot);
  }
  return maintenance_wanted_locked();
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
  if (f.loose != nullptr) {  // lent memory: freed by the maintenance thread, the slot is someone else's
    if (auto it = loose_.find(f.loose); it != loose_.end()) free_loose_locked(it);
    slot_cv_.notify_all();
    return true;
  }
  return_slot_locked(f.slot, /*front=*/true);
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
  // waiting_acquires_ counts this call from its first wait until it returns
  // or throws (a failed fence sync too), under the lock.
  struct Waiting {
    std::unique_lock<std::mutex>& lock;
    const bool& waited;
    std::size_t& count;
    ~Waiting() {
      if (!waited) return;
      if (!lock.owns_lock()) lock.lock();
      --count;
    }
  } const waiting{lock, waited, waiting_acquires_};
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
    if (!waited) ++waiting_acquires_;
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
      if (deadline)
        slice = std::min(slice, std::chrono::duration_cast<std::chrono::microseconds>(*deadline - now) +
                                    std::chrono::microseconds(1));
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

void BufferPool::unhold_locked(std::size_t slot) {
  if (!held_[slot]) return;
  held_[slot] = false;
  --consumer_held_;
  if (level_ == PressureLevel::critical) ++policy_version_;
}

bool BufferPool::release_slot(std::size_t slot, std::byte* data) noexcept {
  bool wake_maintainer = false;
  {
    std::unique_lock lock(mutex_);
    if (auto it = loose_.find(data); it != loose_.end()) {  // Note [Lent slots]
      free_loose_locked(it);
      return true;
    }
    assert(state_[slot] == SlotState::leased);
    unhold_locked(slot);
    wake_maintainer = return_slot_locked(slot, /*front=*/false);
    if (wake_maintainer) ++work_generation_;
  }
  slot_cv_.notify_one();
  if (wake_maintainer) work_cv_.notify_one();
  return false;
}

void BufferPool::free_loose_locked(std::map<std::byte*, Loose>::iterator it) {
  std::byte* const data = it->first;
  to_free_.emplace_back(data, take_loose_locked(it));  // take_loose_locked wakes the maintenance thread
}

void BufferPool::drain_to_free(std::unique_lock<std::mutex>& lock) {
  while (!to_free_.empty()) {
    const auto [data, l] = to_free_.back();
    to_free_.pop_back();
    ++freeing_;  // popped but not yet unmapped: the pool is not settled
    lock.unlock();
    unmap_slab(data, l.bytes, l.owner);
    lock.lock();
    --freeing_;
  }
}

BufferPool::Loose BufferPool::take_loose_locked(std::map<std::byte*, Loose>::iterator it) {
  const Loose l = it->second;
  loose_.erase(it);
  loose_bytes_ -= l.bytes;
  if (l.pinned) loose_pinned_bytes_ -= l.bytes;
  ++policy_version_;  // the pinned budget has room again
  ++work_generation_;
  work_cv_.notify_one();
  return l;
}

std::optional<std::size_t> BufferPool::lendable_locked() const {
  for (std::size_t slot = 0; slot < state_.size(); ++slot) {
    const Slab& slab = slabs_[slab_of_[slot]];
    if (held_[slot] && state_[slot] == SlotState::leased && slab.slot_count == 1 && !slab.moving) return slot;
  }
  return std::nullopt;
}

SlabMemory BufferPool::lend_target_locked(const Slab& slab) const {
  const PolicyInput in = policy_locked();
  if (in.level == PressureLevel::critical || slab.draining) {
    // The floor without this slab: the live slots the policy counts, less it.
    const std::size_t live = policy_totals(slabs_).live_slots - (slab.draining ? 0 : slab.slot_count);
    if (live >= in.min_live_slots) return SlabMemory::released;
  }
  const bool may_pin = in.pin && !in.pin_backed_off && in.level == PressureLevel::normal;
  const std::uint64_t pinned =
      policy_totals(slabs_).pinned_bytes - (slab.memory == SlabMemory::pinned ? slab.bytes : 0);
  return may_pin && pinned + slab.bytes <= in.pinned_budget_bytes ? SlabMemory::pinned : SlabMemory::pageable;
}

void BufferPool::check_held_limit_locked(std::uint64_t slab_bytes) const {
  if (config_.held_limit_bytes == 0 || loose_bytes_ + slab_bytes <= config_.held_limit_bytes) return;
  const std::uint64_t held = loose_bytes_ + consumer_held_ * slab_bytes;
  throw HeldLimit(fmt::format(
      "{} batch(es) held by the program: {}, {} held_limit ({}). Drop "
      "references to earlier batches (labels are the program's own; images[0] or a loss "
      "whose graph holds the input keeps the whole batch), or raise held_limit",
      loose_.size() + consumer_held_, format_bytes(held),
      held > config_.held_limit_bytes ? "past" : "and one more would pass", format_bytes(config_.held_limit_bytes)));
}

std::uint64_t BufferPool::lend_held(std::size_t* lent_slot) {
  std::unique_lock lock(mutex_);
  const std::optional<std::size_t> found = lendable_locked();
  if (!found) return 0;
  const std::size_t slot = *found;
  const std::size_t index = slab_of_[slot];
  Slab& slab = slabs_[index];
  check_held_limit_locked(slab.bytes);
  // The memory becomes the lease's (freed at its release); the slot is
  // parked, out of every list, while the slab gets new memory off the lock.
  loose_[slab.data] = Loose{slab.bytes, slab.owner, slab.memory == SlabMemory::pinned};
  loose_bytes_ += slab.bytes;
  if (slab.memory == SlabMemory::pinned) loose_pinned_bytes_ += slab.bytes;
  const SlabMemory target = lend_target_locked(slab);  // the lent pinned bytes count against the budget now
  ++lends_;
  held_[slot] = false;
  --consumer_held_;
  state_[slot] = SlotState::parked;
  const SlabMemory from = slab.memory;
  const std::uint64_t bytes = slab.bytes;
  slab.data = nullptr;
  slab.owner = nullptr;
  slab.moving = true;
  ++policy_version_;
  if (config_.held_warning_bytes > 0 && loose_bytes_ > config_.held_warning_bytes && !held_warned_) {
    held_warned_ = true;
    pinfeed::detail::log().warn(
        "buffer pool: {} batch(es) held by the program: {} lent out of the pool (over held_warning {}). Each kept "
        "images[0], or a loss whose graph holds its input, keeps a whole batch, as with DataLoader; drop them, or set "
        "held_limit to make this an error",
        loose_.size(), format_bytes(loose_bytes_), format_bytes(config_.held_warning_bytes));
  }
  MappedSlab fresh;
  if (target != SlabMemory::released) {
    lock.unlock();
    try {
      fresh = map_for_move(target, bytes);
    } catch (const std::exception& e) {  // a device error registering: the slab stays released, not lost
      fresh = MappedSlab{};
      fresh.failure = e.what();
      pinfeed::detail::log().warn("buffer pool: slab {} lent out; its new memory failed: {}", index, e.what());
    }
    lock.lock();
  }
  slab.moving = false;
  slab.data = fresh.data;
  slab.owner = fresh.data != nullptr ? fresh.owner : nullptr;
  slab.memory = fresh.data == nullptr      ? SlabMemory::released
                : fresh.owner->is_pinned() ? SlabMemory::pinned
                                           : SlabMemory::pageable;
  if (slab.memory == SlabMemory::released) slab.draining = false;
  if (fresh.pin_refused) {
    ++failed_pins_;
    back_off_pinning_locked();
  }
  if (slab.memory != from && slab.memory == SlabMemory::pinned) ++to_pinned_;
  if (slab.memory != from && slab.memory == SlabMemory::pageable) ++to_pageable_;
  record_locked(index, slab.memory, "lent to the program (a batch it holds)");
  ++policy_version_;
  ++work_generation_;
  if (slab.memory != SlabMemory::released) (void)return_slot_locked(slot, /*front=*/true);
  update_serving_locked();
  // The slab was meant to get memory and did not (RLIMIT_AS, the cgroup):
  // the batch waiting for this slot would wait forever, the maintainer
  // retrying the mapping once a second. Raised instead, naming what failed;
  // the slab stays released and is mapped again once there is room.
  const bool refused = target != SlabMemory::released && fresh.data == nullptr;
  const std::string lent = format_bytes(loose_bytes_);
  const std::size_t lent_count = loose_.size();
  lock.unlock();
  slot_cv_.notify_all();
  work_cv_.notify_one();
  if (lent_slot != nullptr) *lent_slot = slot;
  if (refused) {
    throw OutOfMemory("mmap", fmt::format("buffer pool: a batch the program holds was lent out of the pool and its "
                                          "slot could not get new memory ({} bytes: {}); {} batch(es), {}, are held "
                                          "by the program. Drop references to earlier batches, or raise the "
                                          "limit (ulimit -v, the memory cgroup)",
                                          bytes, fresh.failure.empty() ? "refused" : fresh.failure, lent_count, lent));
  }
  return bytes;
}

bool BufferPool::starved() const {
  const std::scoped_lock lock(mutex_);
  return waiting_acquires_ > 0 && free_.empty() && fenced_.empty();
}

PolicyInput BufferPool::policy_locked() const {
  PolicyInput in;
  in.level = level_;
  in.pin = config_.pin;
  in.min_live_slots = std::min(config_.slots, std::max(min_live_slots_, consumer_held_ + 1));
  // Lent pinned memory is still pinned: it counts against the budget.
  in.pinned_budget_bytes = config_.pinned_budget_bytes - std::min(config_.pinned_budget_bytes, loose_pinned_bytes_);
  const auto now = Clock::now();
  in.pin_backed_off = no_pin_before_ != Clock::time_point{} && now < no_pin_before_;
  in.grow_backed_off = no_grow_before_ != Clock::time_point{} && now < no_grow_before_;
  return in;
}

bool BufferPool::maintenance_wanted_locked() const {
  // Asked on every release: the answer is kept until the policy's inputs
  // change (level, a slab's memory, a drain, a back-off) or a back-off it
  // depended on ends, so a settled pool answers with two compares.
  if (wanted_version_ == policy_version_ &&
      (wanted_until_ == Clock::time_point::max() || Clock::now() < wanted_until_)) {
    return wanted_;
  }
  const PolicyInput in = policy_locked();
  wanted_ = next_pool_move(in, slabs_, [](std::size_t) { return true; }).has_value();
  wanted_version_ = policy_version_;
  wanted_until_ = Clock::time_point::max();
  if (in.pin_backed_off) wanted_until_ = no_pin_before_;
  if (in.grow_backed_off) wanted_until_ = std::min(wanted_until_, no_grow_before_);
  return wanted_;
}

bool BufferPool::release_slot_after(std::size_t slot, std::byte* data, std::shared_ptr<Fence> fence) noexcept {
  {
    const std::scoped_lock lock(mutex_);
    if (loose_.contains(data)) {  // Note [Lent slots]: freed once the copy that reads it is done
      fenced_.push_back(Fenced{slot, std::move(fence), data});
      ++work_generation_;
      work_cv_.notify_one();
      return true;
    }
    assert(state_[slot] == SlotState::leased);
    unhold_locked(slot);  // a fenced slot comes back by itself
    state_[slot] = SlotState::fenced;
    fenced_.push_back(Fenced{slot, std::move(fence)});
    ++work_generation_;
  }
  slot_cv_.notify_all();
  work_cv_.notify_one();
  return false;
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

}  // namespace pinfeed::memory
