#pragma once
// BufferPool: a fixed set of equal-size host slots for batches, pinned where
// the budget and memory pressure allow, pageable otherwise.
//
// - acquire() blocks while every slot is out: this is the loader's
//   back-pressure. It takes a stop_token and a timeout; cancel() wakes all.
// - A slot comes as a move-only SlotLease; dropping it returns the slot.
//   release_after(fence) keeps the slot busy until the fence is ready (the
//   async copy that reads it has completed).
// - Slots live in slabs (several slots per mapping, one mapping never above
//   kMaxRegistrationBytes) so that pinning takes few registrations. Each slot
//   is exactly round_up_to_page(slot_bytes): no power-of-two rounding.
// - Pressure (on_pressure, usually from a PressureMonitor subscription),
//   decided by Note [Pool policy] (pool_policy.hpp):
//     critical -> idle slabs beyond the floor (min_live_slots) give their
//                 memory back to the kernel: unpinned and unmapped, so RSS
//                 really falls (without swap, pageable memory is as resident
//                 as pinned memory: unpinning alone frees nothing). A busy
//                 slab is drained: its slots are parked as they come back,
//                 and it is released once idle. Acquirers share the live
//                 slots meanwhile.
//     elevated -> nothing is pinned, touched or grown; idle pageable slabs
//                 are hinted cold (MADV_COLD) so that, with swap, the kernel
//                 takes them before the training process's own memory.
//     normal   -> released slabs are touched and pinned again (pageable past
//                 the budget), then idle pageable slabs are pinned.
//   The monitor owns the hold time before "normal" is announced. Every move
//   runs on the pool's maintenance thread with the slab out of service (all
//   of its slots free, none in the free list): the old memory is freed
//   first, then the new memory is mapped, touched and pinned, so no move
//   needs more memory than it frees, and nothing on the acquire or release
//   path maps, pins or frees. Each move is counted and logged; one warning
//   when the pool shrinks, one when it has grown back.
//
// Note [Slot lifetime]: a slot handed out in a lease is never moved, unpinned
// or freed until the lease is dropped and, if release_after() was used, its
// fence is ready. A slab's memory changes only while every one of its slots
// is back and parked, so no lease can see the change.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "pinfeed/memory/fence.hpp"
#include "pinfeed/memory/host_resource.hpp"
#include "pinfeed/memory/pool_policy.hpp"
#include "pinfeed/memory/pressure_monitor.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {

class BufferPool;

/// Move-only ownership of one slot. See Note [Slot lifetime].
class SlotLease {
 public:
  SlotLease() = default;
  SlotLease(SlotLease&& other) noexcept;
  SlotLease& operator=(SlotLease&& other) noexcept;
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;
  ~SlotLease() { release(); }

  [[nodiscard]] explicit operator bool() const noexcept { return pool_ != nullptr; }
  [[nodiscard]] std::size_t index() const noexcept { return slot_; }
  /// The slot's memory: exactly the pool's slot_bytes (page-rounded capacity).
  [[nodiscard]] std::span<std::byte> bytes() const noexcept { return {data_, size_}; }
  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  /// Whether this slot is page-locked; fixed for the life of the lease.
  [[nodiscard]] bool pinned() const noexcept { return pinned_; }

  /// Marks the slot as held by the consumer (a delivered batch) until it is
  /// released: critical pressure keeps at least one live slot more than the
  /// consumer holds (the floor rises with it), so the loader can always
  /// fill the batch the consumer waits for.
  void hand_to_consumer() noexcept;
  /// Returns the slot now. Idempotent.
  void release() noexcept;
  /// Returns the slot once `fence` is ready; the lease is empty afterwards.
  void release_after(std::shared_ptr<Fence> fence) noexcept;
  /// Whether the released memory had been lent out (BufferPool::lend_held):
  /// it was freed instead of returned, and whoever lent it took over what
  /// the lease stood for.
  [[nodiscard]] bool was_lent() const noexcept { return lent_; }

 private:
  friend class BufferPool;
  SlotLease(BufferPool* pool, std::size_t slot, std::byte* data, std::size_t size, bool pinned) noexcept
      : pool_(pool), slot_(slot), data_(data), size_(size), pinned_(pinned) {}
  BufferPool* pool_ = nullptr;
  std::size_t slot_ = 0;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  bool pinned_ = false;
  bool lent_ = false;
};

/// One change of a slab's memory: pinned, pageable or released.
struct PoolTransition {
  std::chrono::system_clock::time_point at;
  std::size_t slab = 0;
  std::size_t slots = 0;
  SlabMemory memory = SlabMemory::pageable;  ///< the slab's memory after this event
  bool ok = true;      ///< false: an attempt that fell short (a refused pin); `memory` is what it got
  std::string reason;  ///< "initial: memlock limit", "pressure critical", "pressure normal failed: ...", ...
};

struct PoolStats {
  std::size_t slots = 0;
  std::size_t slot_bytes = 0;  ///< page-rounded
  std::size_t slabs = 0;
  std::size_t pinned_slots = 0, pageable_slots = 0;
  std::uint64_t pinned_bytes = 0, pageable_bytes = 0;
  /// Slots whose memory is given back to the kernel (critical pressure), and
  /// their bytes; live_slots = slots - released_slots.
  std::size_t released_slots = 0, live_slots = 0;
  std::uint64_t released_bytes = 0;
  std::size_t min_live_slots = 0;  ///< the floor critical pressure never goes below
  std::size_t free_slots = 0, leased_slots = 0, fenced_slots = 0;
  std::size_t draining_slots = 0;  ///< slots of slabs waiting to go idle to be released
  std::uint64_t acquires = 0;
  std::uint64_t acquire_waits = 0;   ///< acquires that found no free slot (counted when they return)
  std::size_t waiting_acquires = 0;  ///< acquires blocked for a slot right now
  double acquire_wait_seconds = 0;   ///< total time spent waiting
  /// Moves after construction, in slabs: into pinned, into pageable memory
  /// (a regrowth past the budget, a refused pin), released to the kernel.
  std::uint64_t to_pageable = 0, to_pinned = 0, releases = 0;
  std::uint64_t given_back_bytes = 0;  ///< bytes released to the kernel, all episodes added up
  std::uint64_t cold_hints = 0;        ///< slabs hinted cold (MADV_COLD) under pressure
  /// The last shrink: seconds from "critical" to the last slab released
  /// (negative: none yet); the last regrowth: from "normal" to every slab live.
  double last_release_seconds = -1, last_regrow_seconds = -1;
  std::uint64_t failed_pins = 0;  ///< pin attempts the pinned resource refused
  /// Note [Lent slots]: slots held by the program that the pool lent out
  /// (their memory is the program's until its last reference dies) and
  /// replaced; lends counts every one so far.
  std::size_t lent_slots = 0;
  std::uint64_t lent_bytes = 0, lends = 0;
  PressureLevel level = PressureLevel::normal;
  /// Rounds of the maintenance thread: a release wakes it only when the
  /// policy (Note [Pool policy]) wants a move, so this stays flat while a
  /// settled pool serves batches.
  std::uint64_t maintenance_rounds = 0;
};

/// The one JSON form of PoolStats (nlohmann's to_json: `json j = stats;`),
/// used by the loader's stats and pinfeed-diag.
template <class Json>
void to_json(Json& j, const PoolStats& s) {
  j = Json{{"slots", s.slots},
           {"slot_bytes", s.slot_bytes},
           {"slabs", s.slabs},
           {"pinned_slots", s.pinned_slots},
           {"pageable_slots", s.pageable_slots},
           {"pinned_bytes", s.pinned_bytes},
           {"pageable_bytes", s.pageable_bytes},
           {"live_slots", s.live_slots},
           {"released_slots", s.released_slots},
           {"released_bytes", s.released_bytes},
           {"min_live_slots", s.min_live_slots},
           {"free_slots", s.free_slots},
           {"leased_slots", s.leased_slots},
           {"fenced_slots", s.fenced_slots},
           {"draining_slots", s.draining_slots},
           {"acquires", s.acquires},
           {"acquire_waits", s.acquire_waits},
           {"waiting_acquires", s.waiting_acquires},
           {"acquire_wait_seconds", s.acquire_wait_seconds},
           {"to_pageable", s.to_pageable},
           {"to_pinned", s.to_pinned},
           {"releases", s.releases},
           {"given_back_bytes", s.given_back_bytes},
           {"cold_hints", s.cold_hints},
           {"last_release_seconds", s.last_release_seconds},
           {"last_regrow_seconds", s.last_regrow_seconds},
           {"failed_pins", s.failed_pins},
           {"lent_slots", s.lent_slots},
           {"lent_bytes", s.lent_bytes},
           {"lends", s.lends},
           {"maintenance_rounds", s.maintenance_rounds},
           {"pressure", std::string(to_string(s.level))}};
}

/// Every live BufferPool of this process added up: what the process holds
/// pinned and pageable for batches (every loader, training and validation,
/// every worker). Compare with VmLck in /proc/self/status. Thread-safe.
struct ProcessPoolStats {
  std::size_t pools = 0, slots = 0, pinned_slots = 0, released_slots = 0;
  std::uint64_t pinned_bytes = 0, pageable_bytes = 0;
  std::uint64_t given_back_bytes = 0;  ///< released to the kernel under critical pressure, all episodes
};
ProcessPoolStats process_pool_stats();

class BufferPool {
 public:
  struct Config {
    std::size_t slot_bytes = 0;        ///< bytes one slot holds (a batch); > 0
    std::size_t slots = 4;             ///< number of slots; > 0
    std::size_t slab_bytes = 256_MiB;  ///< target size of one slab (>= one slot); capped at kMaxRegistrationBytes
    std::uint64_t pinned_budget_bytes = UINT64_MAX;  ///< never pin more than this (see PinnedBudget)
    /// Floor of live slots under critical pressure: at least the batches the
    /// consumer holds at once plus one being filled (fewer would stall the
    /// loader on a slot the consumer waits for). The pool raises it to the
    /// slots handed to the consumer (SlotLease::hand_to_consumer) plus one,
    /// so it is never below 1; clamped to `slots`.
    std::size_t min_live_slots = 2;
    bool pin = true;  ///< false: every slot pageable from the start
    /// After a refused pin, wait this long before trying again; the wait
    /// doubles with each refusal (up to 64x) and resets when pressure
    /// returns to normal. Limits rarely change, so retries are rare.
    std::chrono::milliseconds retry_pin_after{2000};
    /// Asked (off the lock) before a released slab of `bytes` is mapped
    /// again: nullopt to go ahead, or why not (the pool waits a second and
    /// asks again). The loader checks that the host or cgroup keeps room
    /// above the elevated threshold, so a regrowth never brings the pressure
    /// back. Unset: always.
    std::function<std::optional<std::string>(std::uint64_t bytes)> may_grow;
    /// Note [Lent slots]: one warning once the memory lent to the program
    /// passes this (0: never), and HeldLimit instead of a lend past
    /// held_limit_bytes (0: no limit).
    std::uint64_t held_warning_bytes = 0;
    std::uint64_t held_limit_bytes = 0;
    void validate() const;  ///< ConfigError naming the field
  };

  /// Allocates and pre-faults every slab now (pinned first, within the
  /// budget; pageable where pinning is refused, with the reason logged).
  /// The resources must outlive the pool.
  BufferPool(Config config, HostResource& pinned, HostResource& pageable);
  /// Cancels waiters, joins the maintenance thread, frees every slab. All
  /// leases must have been dropped (checked in debug builds; logged otherwise).
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  /// Blocks until a slot is free, `timeout` passes (nullopt), `stop` is
  /// requested (nullopt) or the pool is cancelled (throws Cancelled).
  std::optional<SlotLease> acquire(std::chrono::milliseconds timeout, std::stop_token stop = {});
  /// Blocks until a slot is free; throws Cancelled if the pool is cancelled.
  SlotLease acquire(std::stop_token stop = {});

  /// Wakes every waiting acquire (they throw Cancelled) and refuses new ones
  /// until reset_cancel().
  void cancel();
  void reset_cancel();

  /// Applies a pressure level (see the policy above). Cheap; the work runs
  /// on the maintenance thread. Thread-safe.
  void on_pressure(PressureLevel level);
  /// Subscribes on_pressure to a monitor; unsubscribes in the destructor.
  void follow(PressureMonitor& monitor);

  /// Blocks until no transition is pending or running, or timeout. For tests
  /// and tools that want a settled state; true when settled.
  bool wait_idle(std::chrono::milliseconds timeout);

  /// Note [Lent slots]: a batch the program keeps (a label, images[0], a
  /// loss whose graph holds the input) is the program's memory, as with
  /// DataLoader. When a slot is needed and the consumer holds it
  /// (hand_to_consumer), the pool lends it out: the lease keeps the memory
  /// (freed when it is released, after its fence), and the slot gets fresh
  /// memory, pinned within the budget (lent pinned bytes count against it),
  /// pageable beyond it, or none under critical pressure when the live
  /// slots stay at the floor without it. Slabs of one slot only. Returns
  /// the bytes lent (and the slot's index in `slot`), or 0 when no held
  /// slot can be lent; throws HeldLimit past held_limit_bytes. Maps off the
  /// lock, on the caller's thread; lent memory is freed on the maintenance
  /// thread (never on the consumer's, under its GIL and a collective's gate).
  std::uint64_t lend_held(std::size_t* slot = nullptr);
  /// Whether an acquire waits for a slot that only the consumer can free:
  /// none free, none fenced.
  [[nodiscard]] bool starved() const;
  /// Slots that can be leased now or once returned: neither released nor
  /// draining. A loader keeps no more batches in flight than this, so none
  /// of its tasks waits on a slot that pressure took away. Lock-free.
  [[nodiscard]] std::size_t serving_slots() const noexcept { return serving_.load(std::memory_order_relaxed); }

  [[nodiscard]] PoolStats stats() const;
  [[nodiscard]] std::vector<PoolTransition> transitions() const;
  [[nodiscard]] const Config& config() const noexcept { return config_; }
  [[nodiscard]] std::size_t slot_bytes() const noexcept { return slot_capacity_; }

 private:
  friend class SlotLease;
  // parked: a slot of a slab that is draining, moving or released; it is in
  // no list and cannot be leased.
  enum class SlotState : std::uint8_t { free, leased, fenced, parked };
  struct Slab : PolicySlab {    // slot_count, bytes, memory, draining: what the policy sees
    std::byte* data = nullptr;  // nullptr while released
    std::size_t first_slot = 0;
    HostResource* owner = nullptr;  // resource that allocated data
    bool moving = false;            // the maintenance thread works on it, off the lock
  };
  struct Fenced {
    std::size_t slot;
    std::shared_ptr<Fence> fence;
    std::byte* loose = nullptr;  // lent memory to free when the fence is ready (not the slot)
  };
  using Clock = std::chrono::steady_clock;

  std::optional<SlotLease> acquire_until(std::optional<Clock::time_point> deadline, const std::stop_token& stop);
  /// True when `data` was lent memory (freed, not returned).
  bool release_slot(std::size_t slot, std::byte* data) noexcept;
  void hand_to_consumer(std::size_t slot) noexcept;
  bool release_slot_after(std::size_t slot, std::byte* data, std::shared_ptr<Fence> fence) noexcept;
  struct Loose {  // memory lent to a lease (Note [Lent slots])
    std::size_t bytes = 0;
    HostResource* owner = nullptr;
    bool pinned = false;
  };
  /// Forgets lent memory `data` (its counters) and queues it for the
  /// maintenance thread to free.
  void free_loose_locked(std::map<std::byte*, Loose>::iterator it);
  /// Frees the queued lent memory, off the lock.
  void drain_to_free(std::unique_lock<std::mutex>& lock);
  /// Forgets lent memory `data` (its counters); the caller frees it off the lock.
  Loose take_loose_locked(std::map<std::byte*, Loose>::iterator it);
  /// Picks a held slot of a one-slot slab to lend (none: nullopt).
  [[nodiscard]] std::optional<std::size_t> lendable_locked() const;
  /// The memory a lent slab gets back: pinned within the budget, pageable,
  /// or released (critical pressure, floor kept without it).
  [[nodiscard]] SlabMemory lend_target_locked(const Slab& slab) const;
  /// HeldLimit when lending one more slab of `slab_bytes` would pass held_limit.
  void check_held_limit_locked(std::uint64_t slab_bytes) const;
  SlotLease lease_locked(std::size_t slot);
  bool reclaim_one_fenced(std::unique_lock<std::mutex>& lock, std::chrono::microseconds wait);
  /// A slot comes back: into the free list, or parked when its slab drains.
  /// True when the maintenance thread should look (a drained slab went idle,
  /// or the policy wants a move).
  bool return_slot_locked(std::size_t slot, bool front);
  void unhold_locked(std::size_t slot);
  void allocate_initial();
  /// Maps (and pins, for the pinned resource) `bytes`; nullptr with the
  /// reason in `failure` when the resource refuses. Never under the lock.
  std::byte* map_slab(HostResource& resource, std::size_t bytes, std::string& failure);
  void unmap_slab(std::byte* data, std::size_t bytes, HostResource* owner) noexcept;
  void free_all_slabs() noexcept;
  void maintain(const std::stop_token& stop);
  void run_job(std::unique_lock<std::mutex>& lock, const PoolMove& job);
  /// Memory mapped for a slab's move (off the lock): pinned first when
  /// asked, pageable when pinning fails or pageable is asked.
  struct MappedSlab {
    std::byte* data = nullptr;
    HostResource* owner = nullptr;
    std::string failure;
    bool pin_refused = false;
  };
  MappedSlab map_for_move(SlabMemory to, std::size_t bytes);
  /// Why a released slab may not come back now (config_.may_grow), or nullopt.
  std::optional<std::string> growth_refused(std::size_t bytes) const;
  /// The move's counters, once the slab's memory changed from `from`.
  void count_move_locked(const Slab& slab, SlabMemory from, std::size_t bytes);
  /// Parks the free slots of slab `i` (true: all of them were free).
  bool park_free_slots_locked(std::size_t i);
  /// Puts the parked slots of slab `i` back in service.
  void unpark_slots_locked(std::size_t i);
  /// Slabs drained for a release that the level no longer wants back in
  /// service; hints idle pageable slabs cold once per pressure episode.
  void settle_locked(std::unique_lock<std::mutex>& lock);
  [[nodiscard]] bool settled_locked() const;
  void note_episode_locked();
  // Note [Pool policy] (pool_policy.hpp) decides; these only ask it.
  [[nodiscard]] PolicyInput policy_locked() const;
  /// The next slab to move; idle slabs first; with idle_only, only those.
  [[nodiscard]] std::optional<PoolMove> next_job_locked(bool idle_only = false) const;
  [[nodiscard]] bool slab_idle_locked(const Slab& slab) const;
  /// Whether the policy wants any slab moved, so a plain release does not
  /// wake the maintenance thread.
  [[nodiscard]] bool maintenance_wanted_locked() const;
  void record_locked(std::size_t slab, SlabMemory memory, std::string reason, bool ok = true);
  void update_serving_locked() noexcept;
  void back_off_pinning_locked();

  const Config config_;
  HostResource& pinned_resource_;
  HostResource& pageable_resource_;
  std::size_t slot_capacity_ = 0;   // slot_bytes page-rounded; immutable after construction
  std::size_t min_live_slots_ = 0;  // config_.min_live_slots clamped to slots

  mutable std::mutex mutex_;             // guards everything below
  std::condition_variable_any slot_cv_;  // a slot became free, or cancel
  std::condition_variable_any work_cv_;  // maintenance may have work (work_generation_ moved)
  std::condition_variable idle_cv_;      // maintenance finished a round
  std::vector<Slab> slabs_;
  std::vector<SlotState> state_;
  std::vector<std::size_t> slab_of_;
  std::vector<bool> held_;         // slot handed to the consumer (SlotLease::hand_to_consumer)
  std::size_t consumer_held_ = 0;  // count of held_
  std::deque<std::size_t> free_;
  std::deque<Fenced> fenced_;
  bool cancelled_ = false;
  PressureLevel level_ = PressureLevel::normal;
  bool moving_ = false;                // a slab's memory is being changed off the lock
  bool cold_pending_ = false;          // hint idle pageable slabs cold on the next round
  std::uint64_t work_generation_ = 0;  // bumped on pressure changes and slot returns
  Clock::time_point no_pin_before_{};
  Clock::time_point no_grow_before_{};  // regrowth failed to map: wait before the next try
  unsigned pin_refusals_in_a_row_ = 0;
  std::vector<PoolTransition> transitions_;
  std::uint64_t acquires_ = 0, acquire_waits_ = 0, to_pageable_ = 0, to_pinned_ = 0, failed_pins_ = 0;
  std::uint64_t releases_ = 0, given_back_bytes_ = 0, cold_hints_ = 0;
  // The current pressure episode, for the shrink and regrowth warnings and
  // their timings: when critical / normal began, and what it released.
  std::optional<Clock::time_point> critical_since_, normal_since_;
  std::size_t episode_released_slots_ = 0, reported_released_slots_ = 0;
  std::uint64_t episode_released_bytes_ = 0;
  bool shrink_reported_ = false;
  double last_release_seconds_ = -1, last_regrow_seconds_ = -1;
  std::uint64_t maintenance_rounds_ = 0;
  std::size_t waiting_acquires_ = 0;
  std::uint64_t policy_version_ = 0;  // bumped whenever an input of Note [Pool policy] changes
  // maintenance_wanted_locked()'s last answer, valid for policy_version_ and
  // until a back-off it depended on ends.
  mutable bool wanted_ = false;
  mutable std::uint64_t wanted_version_ = ~std::uint64_t{0};
  mutable Clock::time_point wanted_until_{};
  double acquire_wait_seconds_ = 0;
  std::atomic<std::size_t> serving_{0};                // serving_slots(), written under the lock
  std::map<std::byte*, Loose> loose_;                  // Note [Lent slots]: lent memory by address
  std::vector<std::pair<std::byte*, Loose>> to_free_;  // released lent memory, freed by the maintenance thread
  std::size_t freeing_ = 0;  // entries taken off to_free_ whose unmap has not finished (wait_idle waits for them)
  std::uint64_t loose_bytes_ = 0, loose_pinned_bytes_ = 0, lends_ = 0;
  bool held_warned_ = false;

  PressureMonitor* monitor_ = nullptr;
  PressureMonitor::SubscriptionId subscription_ = 0;
  std::jthread maintainer_;  // last: started after everything above exists
};

}  // namespace pinfeed::memory
