#pragma once
// LimitingAdaptor: refuses allocations that would take its upstream past a
// byte limit. The bytes are reserved atomically before the upstream is asked
// and given back if the upstream throws, so concurrent callers can never
// overshoot the limit together.
#include <atomic>
#include <cstdint>

#include "pinfeed/memory/host_resource.hpp"

namespace pinfeed::memory {

class LimitingAdaptor final : public HostResource {
 public:
  LimitingAdaptor(HostResource& upstream, std::uint64_t limit_bytes) : upstream_(upstream), limit_bytes_(limit_bytes) {}

  [[nodiscard]] HostResource& upstream() const noexcept { return upstream_; }
  [[nodiscard]] bool is_pinned() const noexcept override { return upstream_.is_pinned(); }
  [[nodiscard]] std::string_view name() const noexcept override { return upstream_.name(); }
  [[nodiscard]] std::uint64_t limit_bytes() const noexcept { return limit_bytes_; }
  [[nodiscard]] std::uint64_t used_bytes() const noexcept { return used_bytes_.load(); }

 private:
  /// Throws OutOfMemory("limit") when bytes do not fit.
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* ptr, std::size_t bytes, std::size_t alignment) noexcept override;

  HostResource& upstream_;
  const std::uint64_t limit_bytes_;
  std::atomic<std::uint64_t> used_bytes_{0};  // reserved with compare-exchange
};
static_assert(HostResourceLike<LimitingAdaptor>);

}  // namespace pinfeed::memory
