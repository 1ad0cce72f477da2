#include "pinfeed/memory/statistics_adaptor.hpp"

namespace pinfeed::memory {

namespace {
void raise_peak(std::atomic<std::uint64_t>& peak, std::uint64_t value) noexcept {
  std::uint64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}
}  // namespace

void* StatisticsAdaptor::do_allocate(std::size_t bytes, std::size_t alignment) {
  void* p = upstream_.allocate(bytes, alignment);  // count only what succeeded
  raise_peak(peak_bytes_, current_bytes_.fetch_add(bytes) + bytes);
  raise_peak(peak_count_, current_count_.fetch_add(1) + 1);
  total_bytes_.fetch_add(bytes);
  total_count_.fetch_add(1);
  return p;
}

void StatisticsAdaptor::do_deallocate(void* ptr, std::size_t bytes, std::size_t alignment) noexcept {
  upstream_.deallocate(ptr, bytes, alignment);
  current_bytes_.fetch_sub(bytes);
  current_count_.fetch_sub(1);
}

AllocationStats StatisticsAdaptor::stats() const noexcept {
  return AllocationStats{current_bytes_.load(), peak_bytes_.load(), total_bytes_.load(),
                         current_count_.load(), peak_count_.load(), total_count_.load()};
}

}  // namespace pinfeed::memory
