#pragma once
// StatisticsAdaptor: counts what passes through to its upstream. Lock-free.
#include <atomic>
#include <cstdint>

#include "pinfeed/memory/host_resource.hpp"

namespace pinfeed::memory {

struct AllocationStats {
  std::uint64_t current_bytes = 0;
  std::uint64_t peak_bytes = 0;
  std::uint64_t total_bytes = 0;  ///< sum over all allocations ever made
  std::uint64_t current_count = 0;
  std::uint64_t peak_count = 0;
  std::uint64_t total_count = 0;
};

class StatisticsAdaptor final : public HostResource {
 public:
  explicit StatisticsAdaptor(HostResource& upstream) : upstream_(upstream) {}

  [[nodiscard]] HostResource& upstream() const noexcept { return upstream_; }
  [[nodiscard]] bool is_pinned() const noexcept override { return upstream_.is_pinned(); }
  [[nodiscard]] std::string_view name() const noexcept override { return upstream_.name(); }
  /// A consistent-enough reading: each field is exact, fields are read one by one.
  [[nodiscard]] AllocationStats stats() const noexcept;

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* ptr, std::size_t bytes, std::size_t alignment) noexcept override;

  HostResource& upstream_;
  // All counters are atomics; peaks are raised with compare-exchange.
  std::atomic<std::uint64_t> current_bytes_{0}, peak_bytes_{0}, total_bytes_{0};
  std::atomic<std::uint64_t> current_count_{0}, peak_count_{0}, total_count_{0};
};
static_assert(HostResourceLike<StatisticsAdaptor>);

}  // namespace pinfeed::memory
