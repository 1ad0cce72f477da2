#pragma once
// The library's logger: one spdlog logger named "pinfeed", created on first
// use, writing to stderr. Tools and tests set its level.
#include <spdlog/spdlog.h>

namespace pinfeed::detail {
spdlog::logger& log();
}  // namespace pinfeed::detail
