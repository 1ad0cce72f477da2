#pragma once
// Note [Pool policy]: which slab the BufferPool moves next between pinned and
// pageable memory, written once as a pure function of the pressure level,
// the slabs and the budget. The pool asks it whether to wake its
// maintenance thread (on every release), which move to make, whether a
// prepared move is still wanted, and when a back-off ends; the initial
// allocation follows the same budget rule (whole slabs, front to back).
//
//   critical  unpin slabs from the back (the low slots, acquired first, stay
//             pinned longest) while the pinned slots stay >= min_pinned_slots
//   elevated  nothing: keep what is pinned, pin nothing new
//   normal    (pinning on, not backing off after a refusal) pin slabs from
//             the front while the pinned bytes stay within the budget
//
// Counts are whole slabs: a slab moves as one registration. A prepared move
// (memory ready, waiting for its slab to go idle) counts as done, and its
// slab is never chosen again. Idle slabs first; a busy one only when no idle
// one is wanted (it moves once its slots come back).
#include <cstddef>
#include <cstdint>
#include <optional>

#include "pinfeed/memory/pressure_monitor.hpp"

namespace pinfeed::memory {

/// What the policy sees of a slab. BufferPool's slabs derive from it.
struct PolicySlab {
  std::size_t slot_count = 0;
  std::uint64_t bytes = 0;
  bool pinned = false;
};

struct PolicyInput {
  PressureLevel level = PressureLevel::normal;
  bool pin = true;                      ///< pinning wanted at all (Config::pin)
  std::size_t min_pinned_slots = 0;     ///< critical never unpins below this
  std::uint64_t pinned_budget_bytes = 0;
  bool pin_backed_off = false;          ///< a refusal's back-off is running: start no pinning
  std::optional<std::size_t> prepared;  ///< slab of a prepared move, counted as done
  bool prepared_to_pinned = false;
};

struct PoolMove {
  std::size_t slab = 0;
  bool to_pinned = false;
  const char* reason = "";  ///< "pressure critical", "pressure normal"
  bool idle = true;         ///< the slab had no slot out when chosen
};

/// Pinned slots and bytes over `slabs`, the prepared move counted as done.
template <class Slabs>
void pinned_totals(const PolicyInput& in, const Slabs& slabs, std::size_t& slots, std::uint64_t& bytes) {
  slots = 0;
  bytes = 0;
  for (std::size_t i = 0; i < slabs.size(); ++i) {
    const PolicySlab& s = slabs[i];
    const bool pinned = in.prepared == i ? in.prepared_to_pinned : s.pinned;
    if (pinned) {
      slots += s.slot_count;
      bytes += s.bytes;
    }
  }
}

/// Whether moving `slab` (to pinned or to pageable) is wanted at this level,
/// the back-off aside (a prepared pin has already succeeded). Counts leave
/// the slab's own move out: ask it about a move not yet counted as done.
template <class Slabs>
[[nodiscard]] bool pool_move_wanted(const PolicyInput& in, const Slabs& slabs, std::size_t slab, bool to_pinned) {
  std::size_t slots = 0;
  std::uint64_t bytes = 0;
  pinned_totals(in, slabs, slots, bytes);
  const PolicySlab& s = slabs[slab];
  if (to_pinned) {
    return in.level == PressureLevel::normal && in.pin && !s.pinned && bytes + s.bytes <= in.pinned_budget_bytes;
  }
  return in.level == PressureLevel::critical && s.pinned && slots >= in.min_pinned_slots + s.slot_count;
}

/// The next move, or none. `idle(i)`: slab i has no slot out. With
/// `idle_only`, busy slabs are not offered.
template <class Slabs, class IsIdle>
[[nodiscard]] std::optional<PoolMove> next_pool_move(const PolicyInput& in, const Slabs& slabs, IsIdle&& idle,
                                                     bool idle_only = false) {
  std::size_t slots = 0;
  std::uint64_t bytes = 0;
  pinned_totals(in, slabs, slots, bytes);
  std::optional<PoolMove> busy;
  const auto offer = [&](std::size_t i, bool to_pinned, const char* reason) -> std::optional<PoolMove> {
    if (idle(i)) return PoolMove{i, to_pinned, reason, true};
    if (!idle_only && !busy) busy = PoolMove{i, to_pinned, reason, false};
    return std::nullopt;
  };
  if (in.level == PressureLevel::critical) {
    for (std::size_t i = slabs.size(); i-- > 0;) {
      const PolicySlab& s = slabs[i];
      if (in.prepared == i || !s.pinned || slots < in.min_pinned_slots + s.slot_count) continue;
      if (auto m = offer(i, false, "pressure critical")) return m;
    }
    return busy;
  }
  if (in.level == PressureLevel::normal && in.pin && !in.pin_backed_off) {
    for (std::size_t i = 0; i < slabs.size(); ++i) {
      const PolicySlab& s = slabs[i];
      if (in.prepared == i || s.pinned || bytes + s.bytes > in.pinned_budget_bytes) continue;
      if (auto m = offer(i, true, "pressure normal")) return m;
    }
    return busy;
  }
  return std::nullopt;
}

}  // namespace pinfeed::memory
