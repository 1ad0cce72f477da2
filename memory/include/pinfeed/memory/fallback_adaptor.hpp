#pragma once
// FallbackAdaptor: try the pinned upstream; when it throws OutOfMemory, or
// when the refusal policy says no (e.g. memory pressure), serve the request
// from the pageable upstream instead. Every fallback is counted and logged
// with its reason; nothing falls back silently.
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "pinfeed/memory/host_resource.hpp"

namespace pinfeed::memory {

class FallbackAdaptor final : public HostResource {
 public:
  /// Returns a reason to skip the pinned upstream for this request, or nullopt.
  using RefusalPolicy = std::function<std::optional<std::string>()>;

  FallbackAdaptor(HostResource& primary, HostResource& fallback, RefusalPolicy refuse = {})
      : primary_(primary), fallback_(fallback), refuse_(std::move(refuse)) {}

  [[nodiscard]] HostResource& upstream() const noexcept { return primary_; }
  [[nodiscard]] HostResource& fallback_upstream() const noexcept { return fallback_; }
  /// false: this adaptor cannot promise pinned memory; ask per pointer.
  [[nodiscard]] bool is_pinned() const noexcept override { return false; }
  [[nodiscard]] std::string_view name() const noexcept override { return "fallback"; }

  /// Whether a live allocation from this adaptor came from the primary
  /// (pinned) upstream. false for unknown pointers.
  [[nodiscard]] bool served_pinned(const void* ptr) const;
  /// Number of requests served by the fallback upstream, in total and by reason.
  [[nodiscard]] std::uint64_t fallback_count() const;
  [[nodiscard]] std::map<std::string, std::uint64_t> fallback_reasons() const;

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* ptr, std::size_t bytes, std::size_t alignment) noexcept override;

  HostResource& primary_;
  HostResource& fallback_;
  RefusalPolicy refuse_;
  mutable std::mutex mutex_;                            // guards the two maps below
  std::unordered_map<const void*, bool> from_primary_;  // live pointer -> served by primary
  std::map<std::string, std::uint64_t> reasons_;        // fallback reason -> count
};
static_assert(HostResourceLike<FallbackAdaptor>);

}  // namespace pinfeed::memory
