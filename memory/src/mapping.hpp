#pragma once
// Anonymous mappings shared by the pinned and pageable resources.
#include <cstddef>
#include <string_view>

namespace pinfeed::memory::detail {

/// Transparent huge page size (/sys/kernel/mm/transparent_hugepage), or 0
/// when the kernel has THP off ("never") or does not say. Read once.
std::size_t huge_page_size() noexcept;

/// mmap of round_up_to_page(bytes); throws OutOfMemory("mmap") naming bytes
/// and errno. With `huge_pages` and THP available, a mapping of at least one
/// huge page starts on a huge-page boundary and is madvise(MADV_HUGEPAGE)d.
/// unmap(p, bytes) releases it either way.
void* map_anonymous(std::size_t bytes, std::string_view who, bool huge_pages = false);
/// Writes one byte per page so every page is faulted in now, not on the hot path.
void prefault(void* ptr, std::size_t bytes) noexcept;
/// munmap; logs on failure, never throws.
void unmap(void* ptr, std::size_t bytes) noexcept;

}  // namespace pinfeed::memory::detail
