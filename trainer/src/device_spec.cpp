// --devices: which device type, and how many of it (trainer.hpp's
// DeviceSpec), from the device types' registry.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <thread>

#include "pinfeed/error.hpp"
#include "pinfeed/trainer/device_type.hpp"
#include "pinfeed/trainer/trainer.hpp"

namespace pinfeed::trainer {

DeviceSpec parse_devices(std::string_view text) {
  if (text == "auto") {  // every device of the first indexed type that has any, else two CPU workers
    for (const DeviceType* t : device_types()) {
      if (t->indexed && t->visible() > 0) return parse_devices(fmt::format("{}:all", t->name));
    }
    return parse_devices(fmt::format("cpu:{}", std::min(2U, loader::default_threads())));
  }
  const auto colon = text.find(':');
  const std::string_view name = text.substr(0, colon);
  const std::string_view rest = colon == std::string_view::npos ? std::string_view() : text.substr(colon + 1);
  const auto number = [&](std::string_view s) {
    int v = -1;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size() || v < 0) {
      throw ConfigError(fmt::format("devices '{}': '{}' is not a number", text, s));
    }
    return v;
  };
  const DeviceType* type = nullptr;
  try {
    type = &device_type(name);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("devices '{}': {}; give <type>[:N] (workers), <type>:all or <type>:I,J,... (indices)",
                                  text, e.what()));
  }
  DeviceSpec spec;
  spec.kind = type->kind;
  if (!type->indexed) {  // "cpu:N": N workers
    spec.count = rest.empty() ? 1 : number(rest);
    if (spec.count < 1 || spec.count > type->visible()) {
      throw ConfigError(fmt::format("devices '{}': {} workers must be 1..{}", text, type->name, type->visible()));
    }
    return spec;
  }
  if (rest.empty() || rest == "all") {
    spec.all = true;
    spec.count = 0;
    return spec;
  }
  std::size_t start = 0;
  while (start <= rest.size()) {
    const auto comma = rest.find(',', start);
    const std::string_view item =
        rest.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    const int d = number(item);
    if (std::find(spec.devices.begin(), spec.devices.end(), d) != spec.devices.end()) {
      throw ConfigError(fmt::format("devices '{}': {}:{} listed twice", text, type->name, d));
    }
    spec.devices.push_back(d);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  spec.count = static_cast<int>(spec.devices.size());
  return spec;
}

}  // namespace pinfeed::trainer
