#include "pinfeed/error.hpp"

#include <fmt/format.h>
#include <fmt/std.h>

namespace pinfeed {

DataError::DataError(std::filesystem::path path, const std::string& reason)
    : Error(fmt::format("{}: {}", path.string(), reason)), path_(std::move(path)), reason_(reason) {}

OutOfMemory::OutOfMemory(std::string reason, const std::string& what)
    : Error(what), reason_(std::move(reason)) {}

namespace detail {
void throw_expects(const char* condition, const std::string& message, std::source_location where) {
  throw ConfigError(fmt::format("{} (expected {} at {}:{})", message, condition, where.file_name(), where.line()));
}
}  // namespace detail

}  // namespace pinfeed
