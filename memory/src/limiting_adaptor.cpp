#include "pinfeed/memory/limiting_adaptor.hpp"

#include <fmt/format.h>

#include "pinfeed/error.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {

void* LimitingAdaptor::do_allocate(std::size_t bytes, std::size_t alignment) {
  std::uint64_t used = used_bytes_.load();
  do {
    if (bytes > limit_bytes_ || used > limit_bytes_ - bytes) {
      throw OutOfMemory("limit", fmt::format("{}: {} more would exceed the limit of {} ({} in use)", name(),
                                             format_bytes(bytes), format_bytes(limit_bytes_), format_bytes(used)));
    }
  } while (!used_bytes_.compare_exchange_weak(used, used + bytes));
  try {
    return upstream_.allocate(bytes, alignment);
  } catch (...) {
    used_bytes_.fetch_sub(bytes);  // undo the reservation
    throw;
  }
}

void LimitingAdaptor::do_deallocate(void* ptr, std::size_t bytes, std::size_t alignment) noexcept {
  upstream_.deallocate(ptr, bytes, alignment);
  used_bytes_.fetch_sub(bytes);
}

}  // namespace pinfeed::memory
