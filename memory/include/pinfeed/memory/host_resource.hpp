#pragma once
// HostResource: the interface every producer of host memory implements.
//
// Non-virtual interface: allocate()/deallocate() do the shared work (zero-byte
// requests, alignment checks) and call the private virtuals. Implementations
// and adaptors are thread-safe unless they say otherwise.
#include <concepts>
#include <cstddef>
#include <string_view>

namespace pinfeed::memory {

class HostResource {
 public:
  HostResource() = default;
  HostResource(const HostResource&) = delete;
  HostResource& operator=(const HostResource&) = delete;
  virtual ~HostResource() = default;

  /// Returns `bytes` bytes aligned to `alignment` (a power of two, at most the
  /// page size). A zero-byte request returns nullptr and allocates nothing.
  /// Throws OutOfMemory (with a reason) when the memory cannot be provided,
  /// ConfigError on a bad alignment.
  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment = alignof(std::max_align_t));

  /// Returns memory from allocate() with the same bytes and alignment.
  /// nullptr or zero bytes is a no-op. Never throws.
  void deallocate(void* ptr, std::size_t bytes, std::size_t alignment = alignof(std::max_align_t)) noexcept;

  /// Whether memory from this resource is page-locked (usable for true
  /// asynchronous DMA). Adaptors answer for what they hand out.
  [[nodiscard]] virtual bool is_pinned() const noexcept = 0;

  /// A short name for logs and reports ("pinned", "pageable", "limit(pinned)").
  [[nodiscard]] virtual std::string_view name() const noexcept = 0;

 private:
  virtual void* do_allocate(std::size_t bytes, std::size_t alignment) = 0;
  virtual void do_deallocate(void* ptr, std::size_t bytes, std::size_t alignment) noexcept = 0;
};

/// Compile-time check that a type keeps the HostResource shape; each class
/// carries a static_assert with it next to its definition.
template <typename T>
concept HostResourceLike = std::derived_from<T, HostResource> && requires(T& r, const T& cr, void* p, std::size_t n) {
  { r.allocate(n, n) } -> std::same_as<void*>;
  { r.deallocate(p, n, n) }
  noexcept;
  { cr.is_pinned() }
  noexcept->std::same_as<bool>;
  { cr.name() }
  noexcept->std::same_as<std::string_view>;
};

}  // namespace pinfeed::memory
