#include "pinfeed/units.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <array>

namespace pinfeed {

std::size_t page_size() noexcept {
  static const std::size_t size = [] {
    const long v = ::sysconf(_SC_PAGESIZE);
    return v > 0 ? static_cast<std::size_t>(v) : std::size_t{4096};
  }();
  return size;
}

std::size_t round_up_to_page(std::size_t bytes) noexcept {
  const std::size_t page = page_size();
  return (bytes + page - 1) / page * page;
}

std::string format_bytes(std::uint64_t bytes) {
  static constexpr std::array<const char*, 7> kUnits{"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return fmt::format("{} B", bytes);
  double v = static_cast<double>(bytes);
  std::size_t unit = 0;
  while (v >= 1024.0 && unit + 1 < kUnits.size()) {
    v /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.2f} {}", v, kUnits[unit]);
}

}  // namespace pinfeed
