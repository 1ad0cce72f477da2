#pragma once
// The loader's command-line flags, made from its option table (options.hpp):
// the flag's name, help, default and accepted values come from the table,
// and a value is checked by the table's own rule, so no tool restates one.
//   numbers and choices  --batch-size 64, --crop center
//   booleans             --no-<name> when the default is true, --<name> when false
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/options.hpp"

namespace pinfeed::tools {

/// One flag per option named in `names`, writing into `config`. The default
/// shown is the value `config` holds when the flags are added (a tool may
/// have chosen its own, like pinfeed-train's 64-pixel images). "name:--alias"
/// adds an older spelling of the flag ("batch_size:--batch").
template <typename Names = std::initializer_list<std::string_view>>
inline void add_loader_flags(CLI::App& app, loader::LoaderConfig& config, const Names& names) {
  for (const std::string_view entry : names) {
    const auto colon = entry.find(':');
    const loader::LoaderOption& o = loader::loader_option(entry.substr(0, colon));
    const std::string alias = colon == std::string_view::npos ? "" : "," + std::string(entry.substr(colon + 1));
    if (o.type == loader::OptionType::boolean) {
      const bool current = o.get_bool(config);
      std::string flag = o.flag();
      if (current) flag.insert(2, "no-");
      flag += alias;
      app.add_flag_callback(
          flag, [&config, &o, current] { o.set_bool(config, !current); },
          fmt::format("{}{}", current ? "turn off: " : "", o.help));
      continue;
    }
    auto* opt = app.add_option_function<std::string>(
        o.flag() + alias, [&config, &o](const std::string& v) { o.set_text(config, v); }, std::string(o.help));
    opt->default_str(o.text(config));
    const bool is_choice = o.type == loader::OptionType::choice;
    opt->type_name(is_choice ? "{" + o.range_text().substr(7) + "}"
                             : std::string(o.type == loader::OptionType::real ? "FLOAT" : "UINT"));
    opt->check(CLI::Validator(
        [&o](std::string& v) -> std::string {
          loader::LoaderConfig probe;
          try {
            o.set_text(probe, v);
          } catch (const ConfigError& e) {
            return e.what();
          }
          return {};
        },
        is_choice ? std::string() : o.range_text()));
  }
}

/// One flag per option of the table except those in `except` (what the tool
/// sets itself): a new option reaches the tool without an edit here.
/// `aliases`: "name:--alias" entries, as add_loader_flags takes them.
inline void add_loader_flags_except(CLI::App& app, loader::LoaderConfig& config,
                                    std::initializer_list<std::string_view> except,
                                    std::initializer_list<std::string_view> aliases = {}) {
  std::vector<std::string> names;
  for (const loader::LoaderOption& o : loader::loader_options()) {
    if (std::find(except.begin(), except.end(), o.name) != except.end()) continue;
    std::string entry(o.name);
    for (const std::string_view a : aliases) {
      if (a.substr(0, a.find(':')) == o.name) entry = std::string(a);
    }
    names.push_back(std::move(entry));
  }
  for (const std::string_view e : except) (void)loader::loader_option(e);  // a misspelt name is an error
  add_loader_flags(app, config, std::vector<std::string_view>(names.begin(), names.end()));
}

}  // namespace pinfeed::tools
