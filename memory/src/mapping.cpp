#include "mapping.hpp"

#include <fmt/format.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "pinfeed/log.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory::detail {

void* map_anonymous(std::size_t bytes, std::string_view who) {
  const std::size_t length = round_up_to_page(bytes);
  void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw OutOfMemory("mmap", fmt::format("{}: mmap of {} bytes failed: {}", who, length, std::strerror(err)));
  }
  return p;
}

void prefault(void* ptr, std::size_t bytes) noexcept {
  // A volatile write per page: the kernel zero-fills it now. MAP_POPULATE
  // would do the same but before a NUMA binding could be applied.
  auto* bytes_ptr = static_cast<volatile unsigned char*>(ptr);
  const std::size_t page = page_size();
  for (std::size_t off = 0; off < bytes; off += page) bytes_ptr[off] = 0;
}

void unmap(void* ptr, std::size_t bytes) noexcept {
  if (::munmap(ptr, round_up_to_page(bytes)) != 0) {
    pinfeed::detail::log().error("munmap({}, {}) failed: {}", ptr, bytes, std::strerror(errno));
  }
}

}  // namespace pinfeed::memory::detail
