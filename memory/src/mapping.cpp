#include "mapping.hpp"

#include <fmt/format.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "pinfeed/error.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory::detail {

std::size_t huge_page_size() noexcept {
  static const std::size_t size = [] {
    try {
      std::ifstream enabled("/sys/kernel/mm/transparent_hugepage/enabled");
      std::string modes;
      if (!std::getline(enabled, modes) || modes.find("[never]") != std::string::npos) return std::size_t{0};
      std::ifstream pmd("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
      std::size_t bytes = 0;
      if (!(pmd >> bytes) || bytes < page_size() || (bytes & (bytes - 1)) != 0) return std::size_t{0};
      return bytes;
    } catch (...) {
      return std::size_t{0};
    }
  }();
  return size;
}

void* map_anonymous(std::size_t bytes, std::string_view who, bool huge_pages) {
  const std::size_t length = round_up_to_page(bytes);
  const std::size_t huge = huge_pages ? huge_page_size() : 0;
  const bool align = huge != 0 && length >= huge;
  // To start on a huge-page boundary, map one huge page more and cut the
  // ends off: what stays is exactly [p, p + length).
  const std::size_t mapped = align ? length + huge : length;
  void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw OutOfMemory("mmap", fmt::format("{}: mmap of {} bytes failed: {}", who, length, std::strerror(err)));
  }
  if (!align) return p;
  const auto raw = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t start = (raw + huge - 1) & ~static_cast<std::uintptr_t>(huge - 1);
  const std::size_t head = start - raw, tail = mapped - head - length;
  if (head != 0) ::munmap(p, head);
  if (tail != 0) ::munmap(reinterpret_cast<void*>(start + length), tail);
  void* aligned = reinterpret_cast<void*>(start);
  // Advice only: a kernel that cannot give huge pages gives small ones.
  if (::madvise(aligned, length, MADV_HUGEPAGE) != 0) {
    pinfeed::detail::log().debug("{}: madvise(MADV_HUGEPAGE) on {} bytes failed: {}", who, length,
                                 std::strerror(errno));
  }
  return aligned;
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
