#include "pinfeed/memory/pool_plan.hpp"

#include <fmt/format.h>

#include <charconv>
#include <limits>

#include "pinfeed/error.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {

std::string_view to_string(Verdict v) noexcept { return enum_word(kVerdictWords, v); }

std::uint64_t batch_bytes_from_shape(std::string_view shape) {
  const auto bad = [&](std::string_view why) {
    return ConfigError(fmt::format("batch shape '{}': {} (expected e.g. 256x3x224x224:u8)", shape, why));
  };
  const auto colon = shape.find(':');
  const std::string_view dims = shape.substr(0, colon);
  const std::string_view type = colon == std::string_view::npos ? std::string_view{"u8"} : shape.substr(colon + 1);
  std::uint64_t elem = 0;
  if (type == "u8" || type == "i8")
    elem = 1;
  else if (type == "f16" || type == "bf16" || type == "u16" || type == "i16")
    elem = 2;
  else if (type == "f32" || type == "i32")
    elem = 4;
  else if (type == "f64" || type == "i64")
    elem = 8;
  else
    throw bad(fmt::format("unknown element type '{}'", type));
  if (dims.empty()) throw bad("no dimensions");
  std::uint64_t total = elem;
  std::size_t pos = 0;
  while (pos <= dims.size()) {
    const std::size_t x = std::min(dims.find('x', pos), dims.size());
    const std::string_view part = dims.substr(pos, x - pos);
    std::uint64_t d = 0;
    const auto [ptr, ec] = std::from_chars(part.data(), part.data() + part.size(), d);
    if (part.empty() || ec != std::errc{} || ptr != part.data() + part.size()) {
      throw bad(fmt::format("'{}' is not a whole number", part));
    }
    if (d == 0) throw bad("a dimension is zero");
    if (total > std::numeric_limits<std::uint64_t>::max() / d) throw bad("size overflows 64 bits");
    total *= d;
    pos = x + 1;
  }
  return total;
}

PoolFit check_pool_fit(const MemorySnapshot& s, std::uint64_t slots, std::uint64_t slot_bytes, unsigned local_ranks) {
  if (local_ranks == 0) throw ConfigError("local ranks must be >= 1");
  PoolFit f;
  const std::uint64_t slot = round_up_to_page(slot_bytes);
  f.local_ranks = local_ranks;
  f.pool_bytes = slot != 0 && slots > std::numeric_limits<std::uint64_t>::max() / slot
                     ? std::numeric_limits<std::uint64_t>::max()
                     : slots * slot;
  f.available_bytes = s.effective_available();
  const auto room = s.cgroup.room_bytes();
  f.limiting = room && *room < s.mem_available ? "cgroup room" : "MemAvailable";
  f.allowed_bytes = static_cast<std::uint64_t>(static_cast<double>(f.available_bytes) * kPoolMaxShareOfAvailable /
                                               static_cast<double>(local_ranks));
  f.slots_fit = slot == 0 ? slots : f.allowed_bytes / slot;
  f.largest_slot_bytes = slots == 0 ? f.allowed_bytes : f.allowed_bytes / slots / page_size() * page_size();
  f.fits = f.pool_bytes <= f.allowed_bytes;
  return f;
}

std::string PoolFit::explain(std::string_view prefetch_name, std::string_view batch_name, unsigned consumers) const {
  const std::string share = local_ranks > 1 ? fmt::format(", split across {} local ranks", local_ranks) : std::string();
  std::string what = fmt::format("the pool needs {} but only {} may be used: {:.0f}% of the {} really available ({}{})",
                                 format_bytes(pool_bytes), format_bytes(allowed_bytes), kPoolMaxShareOfAvailable * 100,
                                 format_bytes(available_bytes), limiting, share);
  const std::uint64_t prefetch_fit = slots_fit / std::max(1U, consumers);
  if (prefetch_fit > 0) {
    what += fmt::format("; {} slot(s) of this size fit: lower {} to {}, or lower {} so that one slot is at most {}",
                        slots_fit, prefetch_name, prefetch_fit, batch_name, format_bytes(largest_slot_bytes));
  } else if (slots_fit > 0) {
    what += fmt::format(
        "; {} slot(s) of this size fit, fewer than one per consumer: lower {} so that one slot is at "
        "most {}",
        slots_fit, batch_name, format_bytes(largest_slot_bytes));
  } else {
    what += fmt::format("; not one slot of this size fits: lower {} so that one slot is at most {}", batch_name,
                        format_bytes(largest_slot_bytes));
  }
  return what;
}

void PoolPlanRequest::validate() const {
  if (gpus == 0 || gpus > 1024) throw ConfigError(fmt::format("gpus must be 1..1024, got {}", gpus));
  if (batch_bytes == 0) throw ConfigError("batch bytes must be > 0");
  if (batch_bytes > kMaxRegistrationBytes) {
    throw ConfigError(fmt::format("batch bytes {} exceed one slot's maximum of {}", format_bytes(batch_bytes),
                                  format_bytes(kMaxRegistrationBytes)));
  }
  if (prefetch == 0 || prefetch > 64) throw ConfigError(fmt::format("prefetch must be 1..64, got {}", prefetch));
  if (local_ranks == 0 || local_ranks > 4096)
    throw ConfigError(fmt::format("local ranks must be 1..4096, got {}", local_ranks));
  policy.validate();
}

PoolPlan plan_pool(const MemorySnapshot& s, const PoolPlanRequest& req) {
  req.validate();
  PoolPlan p;
  p.slot_bytes = round_up_to_page(req.batch_bytes);
  p.slots_needed = req.gpus * req.prefetch;
  p.need_bytes = p.slot_bytes * p.slots_needed;
  BudgetPolicy policy = req.policy;
  policy.local_ranks = req.local_ranks;
  p.budget = PinnedBudget::compute(s, policy, p.need_bytes);
  p.fit = check_pool_fit(s, p.slots_needed, p.slot_bytes, req.local_ranks);
  p.slots_fit = static_cast<unsigned>(std::min<std::uint64_t>(p.budget.bytes / p.slot_bytes, p.slots_needed));
  p.prefetch_fit = p.slots_fit / req.gpus;

  const std::string need = fmt::format("{} slots of {} ({} GPU(s) x prefetch {}) = {}", p.slots_needed,
                                       format_bytes(p.slot_bytes), req.gpus, req.prefetch, format_bytes(p.need_bytes));
  if (!p.fit.fits) {
    // Pinned or pageable, this pool is more memory than the host has.
    p.verdict = Verdict::does_not_fit;
    p.prefetch_fit = static_cast<unsigned>(std::min<std::uint64_t>(p.fit.slots_fit / req.gpus, req.prefetch));
    p.reasons.push_back(fmt::format("the pool does not fit in memory, pinned or not: {}", need));
    p.reasons.push_back(p.fit.explain("--prefetch", "--batch", req.gpus));
  } else if (p.slots_fit == p.slots_needed) {
    p.verdict = Verdict::pin;
    p.reasons.push_back(fmt::format("the pool fits: {} within a pinned budget of {}", need,
                                    format_bytes(std::max(p.budget.bytes, p.need_bytes))));
  } else if (p.prefetch_fit >= 1) {
    p.verdict = Verdict::pin_reduced;
    p.reasons.push_back(fmt::format(
        "only {} of {} slots fit the pinned budget of {} (limited by {}): pin with prefetch {} "
        "per GPU instead of {}",
        p.slots_fit, p.slots_needed, format_bytes(p.budget.bytes), p.budget.limiting, p.prefetch_fit, req.prefetch));
  } else {
    p.verdict = Verdict::pageable;
    p.reasons.push_back(
        fmt::format("not even one slot per GPU fits the pinned budget of {} (limited by {}): use pageable "
                    "memory; copies will be synchronous and slower",
                    format_bytes(p.budget.bytes), p.budget.limiting));
  }
  if (p.budget.limiting == "memlock limit") {
    p.reasons.push_back(
        "raise the memlock limit (ulimit -l, or LimitMEMLOCK= in systemd, or --ulimit memlock in "
        "containers), grant CAP_IPC_LOCK, or pin through the CUDA driver, which is not charged to it");
  } else if (p.budget.limiting == "cgroup room") {
    p.reasons.push_back("the container's memory limit, not the host's RAM, is what bounds pinning here");
  }
  if (s.psi && s.psi->some.avg10 >= 10.0) {
    p.reasons.push_back(
        fmt::format("memory pressure is already high (PSI some avg10 {:.1f}%): pinning more will make "
                    "it worse",
                    s.psi->some.avg10));
  }
  if (s.swap_total > 0 && s.swap_used() > 0) {
    p.reasons.push_back(fmt::format("{} of swap in use: pinned pages cannot be swapped, pressure lands on the rest",
                                    format_bytes(s.swap_used())));
  }

  if (req.gpu_memory_bytes > 0) {
    p.rule_known = true;
    p.gpu_memory_total = req.gpu_memory_bytes * req.gpus;
    p.rule_met = s.effective_total() >= 2 * p.gpu_memory_total;
    p.reasons.push_back(
        fmt::format("rule of thumb: host RAM should be about twice the GPU memory in use ({} x 2 = {}); "
                    "this host has {}: {}",
                    format_bytes(p.gpu_memory_total), format_bytes(2 * p.gpu_memory_total),
                    format_bytes(s.effective_total()), p.rule_met ? "met" : "NOT met"));
  }
  return p;
}

}  // namespace pinfeed::memory
