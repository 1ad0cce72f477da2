#pragma once
// What the dataset room's sources share about names and labels: lower-case
// extensions, which member names are images, and the label rules. Private
// to loader/dataset.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/image_decoder.hpp"

namespace pinfeed::loader::detail {

inline std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

/// Member extensions (lower case, no dot) TarShards takes as the image: the codec registry's.
inline bool is_image_extension(const std::string& ext) { return format_for_extension(ext) != ImageFormat::unknown; }

inline std::optional<std::int64_t> parse_label(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  std::int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc{} || ptr != s.data() + s.size() || v < 0) return std::nullopt;
  return v;
}

/// The label's class count must stay under the limit: the model's output
/// layer and every buffer sized by it follow from the largest label.
inline void check_label(std::int64_t label, std::size_t max_classes, const std::filesystem::path& file,
                        const std::string& where) {
  if (static_cast<std::uint64_t>(label) >= max_classes) {
    throw DataError(file, fmt::format("{}: label {} means at least {} classes, over the limit of {} (raise max_classes "
                                      "/ --max-classes if the dataset really has that many)",
                                      where, label, static_cast<std::uint64_t>(label) + 1, max_classes));
  }
}

}  // namespace pinfeed::loader::detail
