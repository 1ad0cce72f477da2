#include "pinfeed/memory/pinned_resource.hpp"

#include <fmt/format.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "mapping.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/memory/cuda_host.hpp"
#include "pinfeed/memory/numa.hpp"
#include "process_limits.hpp"

namespace pinfeed::memory {

PinMethod parse_pin_method(std::string_view text) { return parse_enum(kPinMethodWords, text, "pin method"); }

std::string_view to_string(PinMethod method) noexcept { return enum_word(kPinMethodWords, method); }

namespace {
PinMethod resolve(PinMethod method) {
  if (method != PinMethod::automatic) return method;
  return cuda::runtime_status().available ? PinMethod::cuda_register : PinMethod::mlock;
}
}  // namespace

PinnedResource::PinnedResource(Config config) : config_(config), method_(resolve(config.method)) {
  if (method_ == PinMethod::cuda_register && !cuda::runtime_status().available) {
    throw ConfigError(
        fmt::format("pinned resource: pin method 'cuda' needs a CUDA device ({})", cuda::runtime_status().message));
  }
}

void* PinnedResource::do_allocate(std::size_t bytes, std::size_t /*alignment*/) {
  const std::size_t length = round_up_to_page(bytes);
  if (length > kMaxRegistrationBytes) {
    throw ConfigError(fmt::format("pinned resource: one allocation of {} exceeds the {} limit per registration",
                                  format_bytes(length), format_bytes(kMaxRegistrationBytes)));
  }
  if (method_ == PinMethod::mlock) {
    // Refuse up front what mlock would refuse, before paying for the mapping
    // and the page faults: the limit is per process and includes what is
    // locked already.
    if (const auto limit = detail::memlock_limit(); limit && !detail::has_cap_ipc_lock()) {
      const std::uint64_t locked = detail::locked_now();
      if (locked + length > *limit) {
        throw OutOfMemory("memlock limit",
                          fmt::format("pinned resource: locking {} more would exceed RLIMIT_MEMLOCK {} ({} locked "
                                      "already) and the process lacks CAP_IPC_LOCK",
                                      format_bytes(length), format_bytes(*limit), format_bytes(locked)));
      }
    }
  }
  void* p = detail::map_anonymous(length, name(), config_.huge_pages);
  if (config_.numa_node) {
    if (!Topology::host().bind_area(p, length, *config_.numa_node)) {
      pinfeed::detail::log().warn("pinned resource: cannot bind {} to NUMA node {}; default placement",
                                  format_bytes(length), *config_.numa_node);
    }
  }
  // Fault every page in before locking: mlock would fault them anyway, but
  // doing it here keeps the NUMA placement and makes the cost visible in one place.
  detail::prefault(p, length);
  try {
    if (method_ == PinMethod::cuda_register) {
      cuda::host_register(p, length, config_.cuda_device.value_or(-1));
    } else if (::mlock(p, length) != 0) {
      const int err = errno;
      const auto limit = detail::memlock_limit();
      const bool capped = limit.has_value() && !detail::has_cap_ipc_lock();
      throw OutOfMemory(
          capped ? "memlock limit" : "mlock",
          fmt::format(
              "pinned resource: mlock of {} failed: {}{}", format_bytes(length), std::strerror(err),
              capped ? fmt::format(" (RLIMIT_MEMLOCK is {} and the process lacks CAP_IPC_LOCK)", format_bytes(*limit))
                     : std::string{}));
    }
  } catch (...) {
    detail::unmap(p, length);
    throw;
  }
  locked_bytes_.fetch_add(length);
  return p;
}

std::size_t transparent_huge_page_size() noexcept { return detail::huge_page_size(); }

void PinnedResource::do_deallocate(void* ptr, std::size_t bytes, std::size_t /*alignment*/) noexcept {
  const std::size_t length = round_up_to_page(bytes);
  if (method_ == PinMethod::cuda_register) {
    cuda::host_unregister(ptr, config_.cuda_device.value_or(-1));
  } else if (::munlock(ptr, length) != 0) {
    pinfeed::detail::log().error("munlock({}, {}) failed: {}", ptr, length, std::strerror(errno));
  }
  locked_bytes_.fetch_sub(length);
  detail::unmap(ptr, length);
}

}  // namespace pinfeed::memory
