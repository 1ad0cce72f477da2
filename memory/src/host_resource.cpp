#include "pinfeed/memory/host_resource.hpp"

#include <fmt/format.h>

#include <bit>

#include "pinfeed/error.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {

void* HostResource::allocate(std::size_t bytes, std::size_t alignment) {
  if (alignment == 0 || !std::has_single_bit(alignment) || alignment > page_size()) {
    throw ConfigError(
        fmt::format("{}: alignment {} is not a power of two up to the page size {}", name(), alignment, page_size()));
  }
  if (bytes == 0) return nullptr;
  return do_allocate(bytes, alignment);
}

void HostResource::deallocate(void* ptr, std::size_t bytes, std::size_t alignment) noexcept {
  if (ptr == nullptr || bytes == 0) return;
  do_deallocate(ptr, bytes, alignment);
}

}  // namespace pinfeed::memory
