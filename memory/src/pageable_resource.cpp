#include "pinfeed/memory/pageable_resource.hpp"

#include "mapping.hpp"

namespace pinfeed::memory {

void* PageableResource::do_allocate(std::size_t bytes, std::size_t /*alignment*/) {
  void* p = detail::map_anonymous(bytes, name());  // page-aligned: satisfies any allowed alignment
  if (config_.prefault) detail::prefault(p, bytes);
  return p;
}

void PageableResource::do_deallocate(void* ptr, std::size_t bytes, std::size_t /*alignment*/) noexcept {
  detail::unmap(ptr, bytes);
}

}  // namespace pinfeed::memory
