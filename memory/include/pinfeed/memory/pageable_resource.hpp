#pragma once
// PageableResource: ordinary anonymous memory (mmap), optionally pre-faulted
// so that the first write on the hot path does not pay ~12 us per 4 KiB page.
#include "pinfeed/memory/host_resource.hpp"

namespace pinfeed::memory {

class PageableResource final : public HostResource {
 public:
  struct Config {
    bool prefault = true;  ///< touch every page once at allocation time
  };
  PageableResource() = default;
  explicit PageableResource(Config config) : config_(config) {}

  [[nodiscard]] bool is_pinned() const noexcept override { return false; }
  [[nodiscard]] std::string_view name() const noexcept override { return "pageable"; }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* ptr, std::size_t bytes, std::size_t alignment) noexcept override;
  Config config_{};
};
static_assert(HostResourceLike<PageableResource>);

}  // namespace pinfeed::memory
