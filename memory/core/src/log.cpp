#include "pinfeed/log.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

namespace pinfeed::detail {
spdlog::logger& log() {
  static const std::shared_ptr<spdlog::logger> logger = [] {
    if (auto existing = spdlog::get("pinfeed")) return existing;
    return spdlog::stderr_color_mt("pinfeed");
  }();
  return *logger;
}
}  // namespace pinfeed::detail
