#include "pinfeed/error.hpp"

#include <fmt/format.h>
#include <fmt/std.h>

namespace pinfeed {

DataError::DataError(std::filesystem::path path, const std::string& reason)
    : Error(fmt::format("{}: {}", path.string(), reason)), path_(std::move(path)), reason_(reason) {}

OutOfMemory::OutOfMemory(std::string reason, const std::string& what)
    : Error(what), reason_(std::move(reason)) {}

}  // namespace pinfeed
