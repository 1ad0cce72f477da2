// Shard specs as webdataset's braceexpand reads them (remote.hpp): comma
// lists, nested {a,b} lists and {0..9} ranges, "\," literal.
#include <fmt/format.h>

#include <charconv>
#include <optional>
#include <string>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/remote.hpp"

namespace fs = std::filesystem;

namespace pinfeed::loader {

namespace {

constexpr std::size_t kMaxExpanded = 1'000'000;

/// Where the '}' closing the '{' at `open` is (npos: none), skipping escapes.
std::size_t matching_brace(const std::string& s, std::size_t open) {
  int depth = 0;
  for (std::size_t i = open; i < s.size(); ++i) {
    if (s[i] == '\\') {
      ++i;
    } else if (s[i] == '{') {
      ++depth;
    } else if (s[i] == '}' && --depth == 0) {
      return i;
    }
  }
  return std::string::npos;
}

/// `s` split at the commas outside braces (escaped ones kept, escaped); a
/// group's body at its own level's commas alike.
std::vector<std::string> split_top(const std::string& s) {
  std::vector<std::string> out(1);
  int depth = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '\\' && i + 1 < s.size()) {
      out.back() += s.substr(i, 2);
      ++i;
      continue;
    }
    if (c == '{') ++depth;
    if (c == '}' && depth > 0) --depth;
    if (depth == 0 && c == ',') {
      out.emplace_back();
      continue;
    }
    out.back() += c;
  }
  return out;
}

/// {first..last} or {first..last..step}: numbers (zero-padded to the longer
/// bound when either starts with 0, as braceexpand does) or single letters,
/// up or down. Nothing when `body` is not a range.
std::optional<std::vector<std::string>> range_of(const std::string& body, const std::string& shown) {
  const auto dots = body.find("..");
  if (dots == std::string::npos) return std::nullopt;
  const std::string a = body.substr(0, dots);
  std::string b = body.substr(dots + 2), step_text;
  if (const auto more = b.find(".."); more != std::string::npos) {
    step_text = b.substr(more + 2);
    b.resize(more);
  }
  std::int64_t step = 1;
  if (!step_text.empty()) {
    const auto r = std::from_chars(step_text.data(), step_text.data() + step_text.size(), step);
    if (r.ec != std::errc{} || r.ptr != step_text.data() + step_text.size() || step == 0 ||
        step < -static_cast<std::int64_t>(kMaxExpanded) || step > static_cast<std::int64_t>(kMaxExpanded)) {
      return std::nullopt;  // not a range: literal
    }
    step = step < 0 ? -step : step;
  }
  std::vector<std::string> out;
  const auto letter = [](const std::string& t) {
    return t.size() == 1 && std::isalpha(static_cast<unsigned char>(t[0])) != 0;
  };
  if (letter(a) && letter(b)) {
    const std::int64_t lo = a[0], hi = b[0], dir = lo <= hi ? 1 : -1;
    for (std::int64_t c = lo; dir > 0 ? c <= hi : c >= hi; c += dir * step) out.emplace_back(1, static_cast<char>(c));
    return out;
  }
  std::int64_t lo = 0, hi = 0;  // negative bounds too, as braceexpand takes them
  const auto r1 = std::from_chars(a.data(), a.data() + a.size(), lo);
  const auto r2 = std::from_chars(b.data(), b.data() + b.size(), hi);
  if (a.empty() || b.empty() || r1.ec != std::errc{} || r2.ec != std::errc{} || r1.ptr != a.data() + a.size() ||
      r2.ptr != b.data() + b.size() || lo < -(std::int64_t{1} << 62) || hi < -(std::int64_t{1} << 62) ||
      lo > (std::int64_t{1} << 62) || hi > (std::int64_t{1} << 62)) {
    return std::nullopt;  // not a range ({x..1}, {1.5..2}): literal, as braceexpand keeps it
  }
  const auto n = static_cast<std::uint64_t>(lo > hi ? lo - hi : hi - lo) / static_cast<std::uint64_t>(step);
  if (n >= kMaxExpanded) {
    throw ConfigError(fmt::format("shard pattern '{}': {{{}}} names over {} shards", shown, body, kMaxExpanded));
  }
  const auto zero_led = [](const std::string& t) {
    const std::size_t d = t.starts_with('-') ? 1 : 0;
    return t.size() > d + 1 && t[d] == '0';
  };
  const std::size_t width = zero_led(a) || zero_led(b) ? std::max(a.size(), b.size()) : 0;
  for (std::uint64_t k = 0; k <= n; ++k) {
    const std::int64_t v =
        lo <= hi ? lo + static_cast<std::int64_t>(k) * step : lo - static_cast<std::int64_t>(k) * step;
    out.push_back(v < 0 ? fmt::format("-{:0{}}", -v, width > 0 ? width - 1 : 0) : fmt::format("{:0{}}", v, width));
  }
  return out;
}

/// Every group of `s` expanded, left to right (webdataset's braceexpand:
/// lists {a,b}, ranges {a..b}, nested and several in one name).
void expand_groups(const std::string& s, const std::string& shown, std::vector<std::string>& out,
                   std::size_t from = 0) {
  std::size_t open = std::string::npos;
  for (std::size_t i = from; i < s.size(); ++i) {
    if (s[i] == '\\') {
      ++i;
    } else if (s[i] == '{') {
      open = i;
      break;
    }
  }
  const std::size_t close = open == std::string::npos ? open : matching_brace(s, open);
  if (close == std::string::npos) {  // no group (an unmatched brace is literal, as braceexpand keeps it)
    if (out.size() >= kMaxExpanded)
      throw ConfigError(fmt::format("shard pattern '{}' names over {} shards", shown, kMaxExpanded));
    out.push_back(s);
    return;
  }
  const std::string head = s.substr(0, open), body = s.substr(open + 1, close - open - 1), tail = s.substr(close + 1);
  std::vector<std::string> choices = split_top(body);
  if (choices.size() == 1) {
    auto range = range_of(body, shown);
    if (!range) {  // neither a list nor a range ("${VAR}", awk's '{print}'): literal, as braceexpand keeps it
      expand_groups(s, shown, out, open + 1);
      return;
    }
    choices = std::move(*range);
  }
  for (const std::string& c : choices) expand_groups(head + c + tail, shown, out, head.size());
}

std::string unescape(const std::string& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size() && (s[i + 1] == ',' || s[i + 1] == '{' || s[i + 1] == '}' || s[i + 1] == '\\'))
      ++i;
    out += s[i];
  }
  return out;
}

}  // namespace

std::vector<std::string> split_shard_spec(const std::string& spec) {
  std::vector<std::string> out;
  for (std::string& part : split_top(spec)) {
    if (!part.empty()) out.push_back(std::move(part));
  }
  return out;
}

std::vector<fs::path> expand_shard_pattern(const std::string& pattern) {
  std::vector<fs::path> out;
  for (const std::string& part : split_shard_spec(pattern)) {
    const std::string shown = is_remote_url(part) ? redact_url(part) : part;
    std::vector<std::string> names;
    expand_groups(part, shown, names);
    for (const std::string& n : names) out.emplace_back(unescape(n));
  }
  if (out.empty()) throw ConfigError(fmt::format("shard pattern '{}' names no file", redact_spec(pattern)));
  return out;
}

}  // namespace pinfeed::loader
