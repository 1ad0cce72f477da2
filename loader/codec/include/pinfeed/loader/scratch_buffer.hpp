#pragma once
// ScratchBytes: the loader's large per-thread buffers (decoded regions, 2:1
// reductions, the resized sample). Blocks of 64 KiB and more are mapped
// straight from the kernel and unmapped when freed, never taken from glibc's
// malloc: a freed large block raises glibc's dynamic mmap threshold, after
// which such blocks come from per-thread arenas that keep their high-water
// mark, and RSS grew by ~3.4 MiB per loader thread (docs/results.md, "Threads
// and memory"). Smaller blocks, and every block under a sanitizer (so ASan
// still checks bounds), use operator new.
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace pinfeed::loader {

inline constexpr std::size_t kScratchMapThreshold = 64 * 1024;

template <typename T>
struct MappedAllocator {
  using value_type = T;
  MappedAllocator() noexcept = default;
  template <typename U>
  MappedAllocator(const MappedAllocator<U>& /*other*/) noexcept {}  // NOLINT: allocators convert implicitly

  [[nodiscard]] T* allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (!mapped(bytes)) return static_cast<T*>(::operator new(bytes));
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    const std::size_t bytes = n * sizeof(T);
    if (!mapped(bytes)) {
      ::operator delete(p);
      return;
    }
    ::munmap(p, bytes);
  }
  friend bool operator==(const MappedAllocator& /*a*/, const MappedAllocator& /*b*/) noexcept { return true; }

 private:
  static constexpr bool mapped(std::size_t bytes) noexcept {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    (void)bytes;
    return false;
#else
    return bytes >= kScratchMapThreshold;
#endif
  }
};

using ScratchBytes = std::vector<std::uint8_t, MappedAllocator<std::uint8_t>>;

}  // namespace pinfeed::loader
