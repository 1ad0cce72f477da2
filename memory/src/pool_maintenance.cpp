// BufferPool's side that follows memory: pressure events, the maintenance
// thread's moves between pinned, pageable and released slabs (decided by
// Note [Pool policy], pool_policy.hpp), and the statistics. The slots' side
// (leases, acquire, release, lending) is buffer_pool.cpp.
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

void BufferPool::on_pressure(PressureLevel level) {
  {
    const std::scoped_lock lock(mutex_);
    if (level_ == level) return;
    pinfeed::detail::log().debug("buffer pool: pressure {} -> {}", to_string(level_), to_string(level));
    level_ = level;
    ++policy_version_;
    const auto now = Clock::now();
    if (level == PressureLevel::normal) {  // a fresh "normal" may retry at once
      no_pin_before_ = {};
      no_grow_before_ = {};
      pin_refusals_in_a_row_ = 0;
      normal_since_ = now;
    } else {
      normal_since_.reset();
      cold_pending_ = true;
    }
    if (level == PressureLevel::critical) {
      critical_since_ = now;
      shrink_reported_ = false;
    }
    ++work_generation_;
  }
  work_cv_.notify_one();
}

void BufferPool::follow(PressureMonitor& monitor) {
  if (monitor_ != nullptr) throw ConfigError("buffer pool already follows a pressure monitor");
  monitor_ = &monitor;
  subscription_ =
      monitor.subscribe([this](PressureLevel, PressureLevel to, const PressureReading&) { on_pressure(to); });
  on_pressure(monitor.level());
}

bool BufferPool::slab_idle_locked(const Slab& slab) const {
  for (std::size_t k = 0; k < slab.slot_count; ++k) {
    const SlotState s = state_[slab.first_slot + k];
    if (s == SlotState::leased || s == SlotState::fenced) return false;
  }
  return true;
}

std::optional<PoolMove> BufferPool::next_job_locked(bool idle_only) const {
  // A slab being lent (moving, off the lock) is never idle: nothing may move it meanwhile.
  return next_pool_move(
      policy_locked(), slabs_, [this](std::size_t i) { return !slabs_[i].moving && slab_idle_locked(slabs_[i]); },
      idle_only);
}

bool BufferPool::park_free_slots_locked(std::size_t i) {
  const Slab& slab = slabs_[i];
  bool all = true;
  for (std::size_t k = 0; k < slab.slot_count; ++k) {
    const std::size_t slot = slab.first_slot + k;
    if (state_[slot] == SlotState::free) {
      state_[slot] = SlotState::parked;
      std::erase(free_, slot);
    } else if (state_[slot] != SlotState::parked) {
      all = false;
    }
  }
  return all;
}

void BufferPool::unpark_slots_locked(std::size_t i) {
  const Slab& slab = slabs_[i];
  if (slab.moving || slab.data == nullptr) return;  // its slot comes back when the lend or move ends
  for (std::size_t k = 0; k < slab.slot_count; ++k) {
    const std::size_t slot = slab.first_slot + k;
    if (state_[slot] != SlotState::parked) continue;
    state_[slot] = SlotState::free;
    free_.push_back(slot);
  }
  slot_cv_.notify_all();
}

std::byte* BufferPool::map_slab(HostResource& resource, std::size_t bytes, std::string& failure) {
  std::byte* data = nullptr;
  try {
    if (&resource == &pinned_resource_) {
      // Registering: outside device collectives (Note [Registration outside
      // collectives] in collective_gate.hpp).
      CollectiveGate::process().exclusive(
          [&] { data = static_cast<std::byte*>(resource.allocate(bytes, page_size())); });
    } else {
      data = static_cast<std::byte*>(resource.allocate(bytes, page_size()));
    }
  } catch (const OutOfMemory& e) {
    failure = e.reason();
    pinfeed::detail::log().warn("buffer pool: mapping {} of {} memory failed: {}", format_bytes(bytes), resource.name(),
                                e.what());
  }
  return data;
}

void BufferPool::unmap_slab(std::byte* data, std::size_t bytes, HostResource* owner) noexcept {
  if (owner == &pinned_resource_) {
    // Unregistering: never while a device collective is in flight.
    CollectiveGate::process().exclusive([&] { owner->deallocate(data, bytes, page_size()); });
  } else {
    owner->deallocate(data, bytes, page_size());
  }
}

void BufferPool::run_job(std::unique_lock<std::mutex>& lock, const PoolMove& job) {
  // Note [Slot lifetime]: every slot of the slab is back; parked, none can
  // be leased while its memory changes off the lock.
  Slab& slab = slabs_[job.slab];
  const bool idle = park_free_slots_locked(job.slab);
  assert(idle);
  (void)idle;
  slab.moving = true;
  slab.draining = false;
  moving_ = true;
  if (job.to == SlabMemory::released) serving_.fetch_sub(std::min(serving_.load(), slab.slot_count));
  std::byte* const old = slab.data;
  HostResource* const old_owner = slab.owner;
  const SlabMemory from = slab.memory;
  const std::size_t bytes = slab.bytes;
  lock.unlock();

  // Free first, then map: no move needs more memory than it frees. Unmapping
  // (after munlock / cudaHostUnregister) is what makes RSS fall.
  if (old != nullptr) unmap_slab(old, bytes, old_owner);
  if (from == SlabMemory::released) {
    if (const std::optional<std::string> no_room = growth_refused(bytes)) {
      lock.lock();
      slab.moving = false;
      moving_ = false;
      no_grow_before_ = Clock::now() + std::chrono::seconds(1);
      ++policy_version_;
      pinfeed::detail::log().debug("buffer pool: slab {} stays released for now: {}", job.slab, *no_room);
      return;
    }
  }
  const MappedSlab fresh = map_for_move(job.to, bytes);

  lock.lock();
  const auto now = Clock::now();
  slab.moving = false;
  moving_ = false;
  slab.data = fresh.data;
  slab.owner = fresh.data != nullptr ? fresh.owner : nullptr;
  slab.memory = fresh.data == nullptr      ? SlabMemory::released
                : fresh.owner->is_pinned() ? SlabMemory::pinned
                                           : SlabMemory::pageable;
  ++policy_version_;
  if (fresh.pin_refused) {
    ++failed_pins_;
    back_off_pinning_locked();  // a refusing resource is not hammered; a new "normal" resets it
  } else if (slab.memory == SlabMemory::pinned) {
    pin_refusals_in_a_row_ = 0;
  }
  if (job.to != SlabMemory::released && fresh.data == nullptr) {
    no_grow_before_ = now + std::chrono::seconds(1);  // mapping itself failed: try again in a while
  }
  count_move_locked(slab, from, bytes);
  const bool ok = slab.memory == job.to;
  record_locked(job.slab, slab.memory, ok ? job.reason : fmt::format("{} failed: {}", job.reason, fresh.failure), ok);
  if (slab.memory != SlabMemory::released) unpark_slots_locked(job.slab);
  update_serving_locked();
  pinfeed::detail::log().debug("buffer pool: slab {} ({}) {} -> {} ({}{})", job.slab, format_bytes(bytes),
                               to_string(from), to_string(slab.memory), job.reason,
                               ok ? "" : fmt::format(", wanted {}: {}", to_string(job.to), fresh.failure));
}

std::optional<std::string> BufferPool::growth_refused(std::size_t bytes) const {
  if (!config_.may_grow) return std::nullopt;
  try {
    return config_.may_grow(bytes);
  } catch (const std::exception& e) {
    return std::string(e.what());
  }
}

BufferPool::MappedSlab BufferPool::map_for_move(SlabMemory to, std::size_t bytes) {
  MappedSlab m;
  if (to == SlabMemory::pinned) {
    m.data = map_slab(pinned_resource_, bytes, m.failure);
    m.owner = &pinned_resource_;
    m.pin_refused = m.data == nullptr;
  }
  if (to != SlabMemory::released && m.data == nullptr) {
    std::string pageable_failure;
    m.data = map_slab(pageable_resource_, bytes, pageable_failure);
    m.owner = &pageable_resource_;
    if (m.data == nullptr) m.failure += (m.failure.empty() ? "" : "; ") + pageable_failure;
  }
  return m;
}

void BufferPool::count_move_locked(const Slab& slab, SlabMemory from, std::size_t bytes) {
  if (slab.memory == from) return;
  switch (slab.memory) {
    case SlabMemory::pinned: ++to_pinned_; break;
    case SlabMemory::pageable: ++to_pageable_; break;
    case SlabMemory::released:
      ++releases_;
      given_back_bytes_ += bytes;
      episode_released_slots_ += slab.slot_count;
      episode_released_bytes_ += bytes;
      break;
  }
}

void BufferPool::settle_locked(std::unique_lock<std::mutex>& lock) {
  // Drains that are no longer wanted: the level fell, or the consumer came
  // to hold more batches and the floor rose with it.
  const PolicyInput in = policy_locked();
  for (std::size_t i = slabs_.size(); i-- > 0;) {
    if (slabs_[i].draining && !drain_wanted(in, slabs_, i)) {
      slabs_[i].draining = false;
      unpark_slots_locked(i);
      ++policy_version_;
      update_serving_locked();
    }
  }
  if (!cold_pending_ || level_ == PressureLevel::normal) return;
  cold_pending_ = false;
  // With swap, idle pageable slabs should go out before the trainer's own
  // memory: MADV_COLD moves them to the inactive list (no data is lost; a
  // later touch brings them back). Only this thread frees slab memory, so
  // the ranges stay mapped while the lock is released for the syscalls.
  std::vector<std::pair<std::byte*, std::size_t>> cold;
  for (const Slab& slab : slabs_) {
    if (slab.memory == SlabMemory::pageable && slab.data != nullptr && slab_idle_locked(slab)) {
      cold.emplace_back(slab.data, slab.bytes);
    }
  }
  if (cold.empty()) return;
  lock.unlock();
  std::uint64_t hinted = 0;
#ifdef MADV_COLD
  for (const auto& [data, bytes] : cold) {
    if (::madvise(data, bytes, MADV_COLD) == 0) {
      ++hinted;
    } else {
      pinfeed::detail::log().debug("buffer pool: madvise(MADV_COLD) on {} failed: {}", format_bytes(bytes),
                                   std::strerror(errno));
    }
  }
#endif
  lock.lock();
  cold_hints_ += hinted;
}

void BufferPool::note_episode_locked() {
  // Called when the maintenance thread has nothing left to do at this level.
  const auto now = Clock::now();
  const auto seconds = [&](Clock::time_point since) { return std::chrono::duration<double>(now - since).count(); };
  std::size_t live = 0, pinned = 0, draining = 0;
  for (const Slab& s : slabs_) {
    if (s.memory != SlabMemory::released) live += s.slot_count;
    if (s.memory == SlabMemory::pinned) pinned += s.slot_count;
    if (s.draining) draining += s.slot_count;
  }
  // Said once per count: a second critical spell in the same episode
  // (critical, elevated, critical) that released nothing more says nothing.
  if (level_ == PressureLevel::critical && critical_since_ && !shrink_reported_ && draining == 0 &&
      episode_released_slots_ > reported_released_slots_) {
    shrink_reported_ = true;
    reported_released_slots_ = episode_released_slots_;
    last_release_seconds_ = seconds(*critical_since_);
    pinfeed::detail::log().warn(
        "buffer pool: critical memory pressure: gave {} slot(s) ({}) back to the kernel in {:.0f} ms; {} of {} slots "
        "live (floor {})",
        episode_released_slots_, format_bytes(episode_released_bytes_), last_release_seconds_ * 1000, live,
        config_.slots, min_live_slots_);
  }
  if (level_ == PressureLevel::normal && normal_since_ && live == config_.slots && episode_released_slots_ > 0) {
    last_regrow_seconds_ = seconds(*normal_since_);
    pinfeed::detail::log().warn("buffer pool: pressure gone: {} slot(s) ({}) back in {:.0f} ms; {} of {} slots pinned",
                                episode_released_slots_, format_bytes(episode_released_bytes_),
                                last_regrow_seconds_ * 1000, pinned, config_.slots);
    episode_released_slots_ = 0;
    reported_released_slots_ = 0;
    episode_released_bytes_ = 0;
    critical_since_.reset();
  }
}

void BufferPool::maintain(const std::stop_token& stop) {
  std::unique_lock lock(mutex_);
  while (!stop.stop_requested()) {
    ++maintenance_rounds_;
    drain_to_free(lock);
    settle_locked(lock);
    if (const auto job = next_job_locked()) {
      if (job->idle) {
        run_job(lock, *job);
      } else {  // a busy slab under critical pressure: park its slots as they come back
        slabs_[job->slab].draining = true;
        park_free_slots_locked(job->slab);
        ++policy_version_;
        update_serving_locked();
      }
      continue;
    }
    note_episode_locked();
    if (!fenced_.empty()) reclaim_one_fenced(lock, std::chrono::microseconds(0));
    if (!to_free_.empty()) continue;  // a fence just let lent memory go: free it now
    idle_cv_.notify_all();
    const std::uint64_t seen = work_generation_;
    const auto pred = [&] { return work_generation_ != seen; };
    // Fences are polled; back-offs end at known times; everything else
    // (pressure changes, releases that matter) bumps the generation.
    std::optional<Clock::time_point> wake;
    if (!fenced_.empty()) wake = Clock::now() + std::chrono::milliseconds(5);
    for (const Clock::time_point until : {no_pin_before_, no_grow_before_}) {
      if (until <= Clock::now()) continue;
      // A back-off runs: wake when it ends, if the policy would move then.
      PolicyInput later = policy_locked();
      later.pin_backed_off = later.grow_backed_off = false;
      if (next_pool_move(later, slabs_, [](std::size_t) { return true; })) wake = wake ? std::min(*wake, until) : until;
    }
    if (wake) {
      work_cv_.wait_until(lock, stop, *wake, pred);
    } else {
      work_cv_.wait(lock, stop, pred);
    }
  }
}

bool BufferPool::settled_locked() const {
  if (moving_ || freeing_ != 0 || !to_free_.empty() || next_job_locked(/*idle_only=*/true)) return false;
  if (cold_pending_ && level_ != PressureLevel::normal) return false;
  if (level_ != PressureLevel::critical) {
    for (const Slab& s : slabs_) {
      if (s.draining) return false;
    }
  }
  return true;
}

bool BufferPool::wait_idle(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  return idle_cv_.wait_for(lock, timeout, [this] { return settled_locked(); });
}

PoolStats BufferPool::stats() const {
  const std::scoped_lock lock(mutex_);
  PoolStats st;
  st.slots = config_.slots;
  st.slot_bytes = slot_capacity_;
  st.slabs = slabs_.size();
  st.min_live_slots = min_live_slots_;
  for (const Slab& s : slabs_) {
    switch (s.memory) {
      case SlabMemory::pinned:
        st.pinned_slots += s.slot_count;
        st.pinned_bytes += s.bytes;
        break;
      case SlabMemory::pageable:
        st.pageable_slots += s.slot_count;
        st.pageable_bytes += s.bytes;
        break;
      case SlabMemory::released:
        st.released_slots += s.slot_count;
        st.released_bytes += s.bytes;
        break;
    }
    if (s.draining) st.draining_slots += s.slot_count;
  }
  st.live_slots = st.slots - st.released_slots;
  for (const SlotState s : state_) {
    switch (s) {
      case SlotState::free: ++st.free_slots; break;
      case SlotState::leased: ++st.leased_slots; break;
      case SlotState::fenced: ++st.fenced_slots; break;
      case SlotState::parked: break;
    }
  }
  st.acquires = acquires_;
  st.acquire_waits = acquire_waits_;
  st.acquire_wait_seconds = acquire_wait_seconds_;
  st.to_pageable = to_pageable_;
  st.to_pinned = to_pinned_;
  st.releases = releases_;
  st.given_back_bytes = given_back_bytes_;
  st.cold_hints = cold_hints_;
  st.last_release_seconds = last_release_seconds_;
  st.last_regrow_seconds = last_regrow_seconds_;
  st.failed_pins = failed_pins_;
  st.lent_slots = loose_.size();
  st.lent_bytes = loose_bytes_;
  st.lends = lends_;
  st.level = level_;
  st.maintenance_rounds = maintenance_rounds_;
  st.waiting_acquires = waiting_acquires_;
  return st;
}

std::vector<PoolTransition> BufferPool::transitions() const {
  const std::scoped_lock lock(mutex_);
  return transitions_;
}

}  // namespace pinfeed::memory
