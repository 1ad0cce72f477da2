#pragma once
// Readable byte sizes (4_MiB) and page arithmetic.
#include <cstddef>
#include <cstdint>
#include <string>

namespace pinfeed {

inline namespace literals {
constexpr std::size_t operator""_KiB(unsigned long long v) { return static_cast<std::size_t>(v) << 10U; }
constexpr std::size_t operator""_MiB(unsigned long long v) { return static_cast<std::size_t>(v) << 20U; }
constexpr std::size_t operator""_GiB(unsigned long long v) { return static_cast<std::size_t>(v) << 30U; }
}  // namespace literals

/// The system page size in bytes (sysconf, read once).
std::size_t page_size() noexcept;

/// bytes rounded up to a whole number of pages.
std::size_t round_up_to_page(std::size_t bytes) noexcept;

/// Human form of a byte count: "1.50 GiB", "512 KiB", "17 B".
std::string format_bytes(std::uint64_t bytes);

}  // namespace pinfeed
