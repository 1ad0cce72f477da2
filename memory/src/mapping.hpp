#pragma once
// Anonymous mappings shared by the pinned and pageable resources.
#include <cstddef>
#include <string_view>

namespace pinfeed::memory::detail {

/// mmap of round_up_to_page(bytes); throws OutOfMemory("mmap") naming bytes and errno.
void* map_anonymous(std::size_t bytes, std::string_view who);
/// Writes one byte per page so every page is faulted in now, not on the hot path.
void prefault(void* ptr, std::size_t bytes) noexcept;
/// munmap; logs on failure, never throws.
void unmap(void* ptr, std::size_t bytes) noexcept;

}  // namespace pinfeed::memory::detail
