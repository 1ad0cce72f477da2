#include "pinfeed/env.hpp"

#include <cstdlib>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <string_view>

#include "pinfeed/log.hpp"

namespace pinfeed::env {

namespace {

/// Logs NAME=value the first time NAME is read in this process. The set
/// and its lock are function statics: a variable may be read while another
/// translation unit's statics are initialized (the resampler's SIMD level).
void note_once(const char* name, const char* value) {
  static std::mutex lock;
  static std::set<std::string, std::less<>> seen;
  {
    const std::lock_guard<std::mutex> hold(lock);
    if (!seen.emplace(name).second) return;
  }
  const std::string_view n(name);
  if (n.starts_with("PINFEED_")) {
    detail::log().info("environment: {}={} overrides a default", name, value);
  } else if (n.find("SECRET") != n.npos || n.find("TOKEN") != n.npos || n.find("PASSWORD") != n.npos ||
             n.find("KEY_ID") != n.npos) {
    detail::log().debug("environment: {} is set (not shown: a credential)", name);  // AWS_SECRET_ACCESS_KEY, ...
  } else {
    // A URL's user:password@, query and fragment (AWS_ENDPOINT_URL with a
    // token) are not shown: remote.hpp's redact_url rule, for the layer below it.
    std::string shown(value);
    if (const auto scheme = shown.find("://"); scheme != std::string::npos) {
      const std::size_t host = scheme + 3;
      if (const auto q = shown.find_first_of("?#", host); q != std::string::npos) shown.resize(q);
      const auto path = shown.find('/', host);
      if (const auto at = shown.rfind('@', path == std::string::npos ? shown.size() : path);
          at != std::string::npos && at >= host) {
        shown.erase(host, at + 1 - host);
      }
    }
    detail::log().debug("environment: {}={}", name, shown);
  }
}

}  // namespace

const char* raw(const char* name) {
  const char* value = std::getenv(name);  // the one call (Note [one environment reader])
  if (value != nullptr && *value != '\0') note_once(name, value);
  return value;
}

std::optional<std::string> get(const char* name) {
  const char* value = raw(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

}  // namespace pinfeed::env
