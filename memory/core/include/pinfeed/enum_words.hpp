#pragma once
// One table per enum: its values and their words. The same table parses
// (ConfigError listing the words), prints, gives a CLI its choices and the
// loader's option table its choices, so no list of words is written twice.
//
//   inline constexpr std::array<EnumWord<CropMode>, 3> kCropModeWords{{
//       {CropMode::random_resized, "random"}, {CropMode::center, "center"}, ...}};
//   parse_enum(kCropModeWords, "center", "crop") -> CropMode::center
//   enum_word(kCropModeWords, CropMode::center)  -> "center"
#include <fmt/format.h>

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "pinfeed/error.hpp"

namespace pinfeed {

template <class E>
struct EnumWord {
  E value;
  std::string_view word;
};

template <class E, std::size_t N>
constexpr std::string_view enum_word(const std::array<EnumWord<E>, N>& words, E value) noexcept {
  for (const auto& w : words) {
    if (w.value == value) return w.word;
  }
  return "?";
}

/// The words, in the table's order.
template <class E, std::size_t N>
std::vector<std::string_view> enum_choices(const std::array<EnumWord<E>, N>& words) {
  std::vector<std::string_view> out;
  for (const auto& w : words) out.push_back(w.word);
  return out;
}

/// The value whose word is `text`; ConfigError "<what> '<text>' is not one
/// of a, b, c" otherwise.
template <class E, std::size_t N>
E parse_enum(const std::array<EnumWord<E>, N>& words, std::string_view text, std::string_view what) {
  std::string known;
  for (const auto& w : words) {
    if (w.word == text) return w.value;
    known += fmt::format("{}{}", known.empty() ? "" : ", ", w.word);
  }
  throw ConfigError(fmt::format("{} '{}' is not one of {}", what, text, known));
}

/// "a, b or c" ("a", "a or b"), with `conjunction` before the last item.
inline std::string join_list(const std::vector<std::string>& items, std::string_view conjunction) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += i + 1 == items.size() ? fmt::format(" {} ", conjunction) : std::string(", ");
    out += items[i];
  }
  return out;
}

}  // namespace pinfeed
