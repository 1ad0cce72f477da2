#pragma once
// The three pressure levels, on their own: the pure pool policy
// (pool_policy.hpp) decides on a level without knowing the monitor that
// reads it (pressure_monitor.hpp).
#include <array>
#include <string_view>

#include "pinfeed/enum_words.hpp"

namespace pinfeed::memory {

enum class PressureLevel { normal = 0, elevated = 1, critical = 2 };
inline constexpr std::array<EnumWord<PressureLevel>, 3> kPressureLevelWords{
    {{PressureLevel::normal, "normal"}, {PressureLevel::elevated, "elevated"}, {PressureLevel::critical, "critical"}}};
std::string_view to_string(PressureLevel level) noexcept;

}  // namespace pinfeed::memory
