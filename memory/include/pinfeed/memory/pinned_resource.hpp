#pragma once
// PinnedResource: page-locked host memory, and nothing else (policy lives in
// adaptors and the BufferPool).
//
// Each allocation is its own mapping: mmap, optional NUMA binding (hwloc,
// before the first touch so pages land on the node), pre-fault, then lock:
//  - PinMethod::cuda_register: cudaHostRegister only. The driver pins the
//    pages itself and maps them for DMA, so cudaMemcpyAsync from them is truly
//    asynchronous. We do not mlock on top: it adds no guarantee the driver does
//    not give, and it would charge RLIMIT_MEMLOCK, which driver pins are not
//    charged to (both are charged to the memory cgroup).
//  - PinMethod::mlock: mlock(2). Used when no CUDA device is present: the
//    pages stay resident and never swap, which is the property the loader
//    and the CPU backend rely on. Charged to RLIMIT_MEMLOCK unless the
//    process holds CAP_IPC_LOCK.
//  - PinMethod::automatic (default): cuda_register when the CUDA runtime sees
//    a device, mlock otherwise.
// No size rounding beyond the page: the bytes locked are the bytes asked for,
// page-rounded. One allocation (one registration) may not exceed
// kMaxRegistrationBytes; the BufferPool cuts larger pools into slabs.
#include <atomic>
#include <cstdint>
#include <optional>

#include "pinfeed/enum_words.hpp"
#include "pinfeed/memory/host_resource.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {

enum class PinMethod { automatic, mlock, cuda_register };
inline constexpr std::array<EnumWord<PinMethod>, 3> kPinMethodWords{
    {{PinMethod::automatic, "auto"}, {PinMethod::mlock, "mlock"}, {PinMethod::cuda_register, "cuda"}}};

/// "auto", "mlock", "cuda"; ConfigError for anything else.
PinMethod parse_pin_method(std::string_view text);
std::string_view to_string(PinMethod method) noexcept;

/// Largest single pinned mapping (one cudaHostRegister call).
inline constexpr std::size_t kMaxRegistrationBytes = 64_GiB;

/// The kernel's transparent huge page size, or 0 when THP is off ("never")
/// or unknown. PinnedResource uses it when Config::huge_pages is set.
std::size_t transparent_huge_page_size() noexcept;

class PinnedResource final : public HostResource {
 public:
  struct Config {
    PinMethod method = PinMethod::automatic;  ///< how pages are locked
    std::optional<unsigned> numa_node;        ///< bind pages to this NUMA node (OS index)
    /// The GPU the memory feeds: made current before cudaHostRegister and
    /// cudaHostUnregister, on whatever thread runs them (the pool's
    /// maintenance thread too), so no thread creates device 0's context.
    std::optional<int> cuda_device = std::nullopt;
    /// Back mappings of at least one huge page with transparent huge pages
    /// (aligned, MADV_HUGEPAGE). Loader output is written once and cold: with
    /// 4 KiB pages every 4 KiB written is a TLB miss, walked through the
    /// hypervisor's page tables on a VM (see docs/results.md, "huge pages").
    bool huge_pages = true;
  };
  PinnedResource() : PinnedResource(Config{}) {}
  explicit PinnedResource(Config config);

  [[nodiscard]] bool is_pinned() const noexcept override { return true; }
  [[nodiscard]] std::string_view name() const noexcept override { return "pinned"; }
  /// The method actually used (automatic resolved at construction).
  [[nodiscard]] PinMethod method() const noexcept { return method_; }
  /// Bytes currently locked by this resource (page-rounded sizes).
  [[nodiscard]] std::uint64_t locked_bytes() const noexcept { return locked_bytes_.load(); }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* ptr, std::size_t bytes, std::size_t alignment) noexcept override;

  Config config_;
  PinMethod method_;
  std::atomic<std::uint64_t> locked_bytes_{0};  // atomic: allocate/deallocate race
};
static_assert(HostResourceLike<PinnedResource>);

}  // namespace pinfeed::memory
