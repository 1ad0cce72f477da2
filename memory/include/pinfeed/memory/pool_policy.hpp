#pragma once
// Note [Pool policy]: what the BufferPool does with a slab next, written once
// as a pure function of the pressure level, the slabs and the budget. The
// pool asks it whether to wake its maintenance thread (on every release),
// which move to make next, and whether a slab it drains is still wanted;
// the initial allocation follows the same budget rule (whole slabs, front to
// back).
//
//   critical  release slabs (give their pages back to the kernel) while the
//             live slots stay >= min_live_slots: idle slabs first, from the
//             back (the low slots, acquired first, stay longest); a busy one
//             is drained (its slots are parked as they come back) and
//             released once idle. Live slabs within the floor keep their
//             memory as it is: without swap unpinning them frees nothing,
//             and they are in use.
//   elevated  nothing: nothing is pinned, touched or grown
//   normal    released slabs come back (touched, pinned within the budget,
//             pageable past it), from the front; then idle pageable slabs
//             are pinned within the budget
//
// Counts are whole slabs: a slab is one mapping and one registration. A slab
// being drained counts as released already, so the floor is never crossed
// by slabs draining at once.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include <string>
#include "pinfeed/enum_words.hpp"

#include "pinfeed/memory/pressure_level.hpp"

namespace pinfeed::memory {

/// Where a slab's memory is: page-locked, pageable (resident), or given back
/// to the kernel (no pages, no slot of it can be leased).
enum class SlabMemory : std::uint8_t { pinned, pageable, released };
inline constexpr std::array<EnumWord<SlabMemory>, 3> kSlabMemoryWords{
    {{SlabMemory::pinned, "pinned"}, {SlabMemory::pageable, "pageable"}, {SlabMemory::released, "released"}}};
inline std::string_view to_string(SlabMemory m) noexcept { return enum_word(kSlabMemoryWords, m); }

/// What the policy sees of a slab. BufferPool's slabs derive from it.
struct PolicySlab {
  std::size_t slot_count = 0;
  std::uint64_t bytes = 0;
  SlabMemory memory = SlabMemory::pageable;
  bool draining = false;  ///< chosen for release, waiting for its slots to come back
};

struct PolicyInput {
  PressureLevel level = PressureLevel::normal;
  bool pin = true;                 ///< pinning wanted at all (Config::pin)
  std::size_t min_live_slots = 0;  ///< critical never releases below this
  std::uint64_t pinned_budget_bytes = 0;
  bool pin_backed_off = false;   ///< a refusal's back-off is running: start no pinning
  bool grow_backed_off = false;  ///< mapping a released slab failed lately: wait before the next try
};

struct PoolMove {
  std::size_t slab = 0;
  SlabMemory to = SlabMemory::released;
  const char* reason = "";  ///< "pressure critical", "pressure normal"
  bool idle = true;         ///< the slab had no slot out when chosen (false: drain it first)
};

struct PolicyTotals {
  std::size_t live_slots = 0;  ///< slots of slabs neither released nor draining
  std::uint64_t pinned_bytes = 0;
};

template <class Slabs>
[[nodiscard]] PolicyTotals policy_totals(const Slabs& slabs) {
  PolicyTotals t;
  for (const PolicySlab& s : slabs) {
    if (s.memory != SlabMemory::released && !s.draining) t.live_slots += s.slot_count;
    if (s.memory == SlabMemory::pinned) t.pinned_bytes += s.bytes;
  }
  return t;
}

/// Whether a released slab of `bytes` may come back now (nullopt), or why
/// not: growing back must not bring the pressure back, so the host (or the
/// cgroup) must keep more than `keep_fraction` of `total` available after
/// it. `keep_fraction` is the line at which "elevated" clears (the
/// monitor's elevated.available_fraction / hysteresis:
/// PressureMonitor::regrow_rule).
[[nodiscard]] std::optional<std::string> regrow_refusal(std::uint64_t total, std::uint64_t available,
                                                        std::uint64_t bytes, double keep_fraction);

/// Whether slab `slab`, draining, should still be released (false: put its
/// slots back in service): the level is critical and the live slots are at
/// the floor without it.
template <class Slabs>
[[nodiscard]] bool drain_wanted(const PolicyInput& in, const Slabs& slabs, std::size_t slab) {
  return in.level == PressureLevel::critical && slabs[slab].draining &&
         policy_totals(slabs).live_slots >= in.min_live_slots;
}

/// The next move, or none. `idle(i)`: slab i has no slot out. With
/// `idle_only`, busy slabs are not offered.
template <class Slabs, class IsIdle>
[[nodiscard]] std::optional<PoolMove> next_pool_move(const PolicyInput& in, const Slabs& slabs, IsIdle&& idle,
                                                     bool idle_only = false) {
  const PolicyTotals totals = policy_totals(slabs);
  if (in.level == PressureLevel::critical) {
    // A drained slab whose slots are all back goes first.
    for (std::size_t i = slabs.size(); i-- > 0;) {
      if (slabs[i].draining && idle(i)) return PoolMove{i, SlabMemory::released, "pressure critical", true};
    }
    std::optional<PoolMove> busy;
    for (std::size_t i = slabs.size(); i-- > 0;) {
      const PolicySlab& s = slabs[i];
      if (s.memory == SlabMemory::released || s.draining || totals.live_slots < in.min_live_slots + s.slot_count) {
        continue;
      }
      if (idle(i)) return PoolMove{i, SlabMemory::released, "pressure critical", true};
      if (!idle_only && !busy) busy = PoolMove{i, SlabMemory::released, "pressure critical", false};
    }
    return busy;
  }
  if (in.level != PressureLevel::normal || in.grow_backed_off) return std::nullopt;
  const bool may_pin = in.pin && !in.pin_backed_off;
  const auto fits = [&](const PolicySlab& s) { return totals.pinned_bytes + s.bytes <= in.pinned_budget_bytes; };
  for (std::size_t i = 0; i < slabs.size(); ++i) {  // released slabs always come back, pinned if they may
    const PolicySlab& s = slabs[i];
    if (s.memory == SlabMemory::released) {
      return PoolMove{i, may_pin && fits(s) ? SlabMemory::pinned : SlabMemory::pageable, "pressure normal", true};
    }
  }
  if (!may_pin) return std::nullopt;
  for (std::size_t i = 0; i < slabs.size(); ++i) {  // then idle pageable ones are pinned, within the budget
    const PolicySlab& s = slabs[i];
    if (s.memory == SlabMemory::pageable && fits(s) && idle(i))
      return PoolMove{i, SlabMemory::pinned, "pressure normal", true};
  }
  return std::nullopt;
}

}  // namespace pinfeed::memory
