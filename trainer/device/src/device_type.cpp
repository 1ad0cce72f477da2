#include "pinfeed/trainer/device_type.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "pinfeed/error.hpp"

namespace pinfeed::trainer {
std::vector<const DeviceType*> device_types() { return {&cpu_device_type(), &cuda_device_type()}; }

const DeviceType& device_type(BackendKind kind) {
  for (const DeviceType* t : device_types()) {
    if (t->kind == kind) return *t;
  }
  throw ConfigError("no device type for this backend kind");
}

const DeviceType& device_type(std::string_view name) {
  std::string known;
  for (const DeviceType* t : device_types()) {
    if (t->name == name) return *t;
    known += fmt::format("{}{}", known.empty() ? "" : ", ", t->name);
  }
  throw ConfigError(fmt::format("no device type '{}' (known: {})", name, known));
}

}  // namespace pinfeed::trainer
