#pragma once
// The loader's options, declared once: name, type, default, range and help
// (the way DALI declares an operator's arguments once in its schema).
// LoaderConfig::validate() checks every value against this table; the tools'
// flags (tools/loader_flags.hpp), the Python keyword arguments (their
// defaults, ranges and docstring) and the C ABI's defaults are all read from
// it, and a test holds that they agree (tests/loader/options_test.cpp,
// tests/python/test_options.py, tests/capi).
//
// The default of an option is the value in a default-constructed
// LoaderConfig; the table never restates it.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pinfeed/loader/loader.hpp"

namespace pinfeed::loader {

enum class OptionType { integer, real, boolean, choice };
/// "integer", "real", "boolean", "choice".
std::string_view to_string(OptionType t) noexcept;

struct LoaderOption {
  std::string_view name;  ///< Python keyword, C field; the CLI flag is --name with '-' for '_'
  OptionType type = OptionType::integer;
  std::string_view help;
  double min = 0, max = 0;                ///< integer and real: the valid range, inclusive...
  bool min_exclusive = false;             ///< ...except the lower bound when this is set (reals: > 0)
  std::vector<std::string_view> choices;  ///< choice: the accepted words
  /// What evaluation uses instead (a validation loader, pinfeed-train's
  /// --val): "center" for the crop, "false" for the flip and the shuffle.
  /// Empty: the option means the same in training and evaluation. Every
  /// augmentation states it here, so a new one cannot leak into validation
  /// (evaluation_config).
  std::string_view evaluation;

  // Access to the field; only the pair matching `type` is set.
  std::uint64_t (*get_int)(const LoaderConfig&) = nullptr;
  void (*set_int)(LoaderConfig&, std::uint64_t) = nullptr;
  double (*get_real)(const LoaderConfig&) = nullptr;
  void (*set_real)(LoaderConfig&, double) = nullptr;
  bool (*get_bool)(const LoaderConfig&) = nullptr;
  void (*set_bool)(LoaderConfig&, bool) = nullptr;
  std::string_view (*get_choice)(const LoaderConfig&) = nullptr;
  void (*set_choice)(LoaderConfig&, std::string_view) = nullptr;  ///< ConfigError on a word not in choices

  /// "--batch-size".
  [[nodiscard]] std::string flag() const;
  /// The value in `c` as text: "64", "0.01", "true", "random".
  [[nodiscard]] std::string text(const LoaderConfig& c) const;
  /// The default (from a default-constructed LoaderConfig), as text.
  [[nodiscard]] std::string default_text() const;
  /// "1..65536", "(0, 1]", "random, center, full", "true or false".
  [[nodiscard]] std::string range_text() const;
  /// ConfigError "loader <name> must be <range>, got <value>" unless the
  /// value in `c` is within range.
  void check(const LoaderConfig& c) const;
  /// Parses `text` ("64", "0.5", "true"/"false"/"1"/"0", a choice) into the
  /// field and checks it: ConfigError naming the option and the range.
  void set_text(LoaderConfig& c, std::string_view text) const;
};

/// Every option, in the order the help lists them.
const std::vector<LoaderOption>& loader_options();
/// The option named `name`; ConfigError naming it otherwise.
const LoaderOption& loader_option(std::string_view name);

/// `c` as evaluation sees it: every option with an `evaluation` value set
/// to it (no random crop, no flip, no shuffle, every sample kept), the rest
/// as in `c`.
LoaderConfig evaluation_config(const LoaderConfig& c);

/// A field of LoaderConfig outside the option table (what to load and which
/// shard, the normalization, the GPU), set by name like the options. Its
/// row is the one place that names it: the setters and getters below and
/// the C ABI's option list read the rows; the Python module gives the seven
/// Python's types and sets any later row from its text.
struct LoaderField {
  std::string_view name;
  std::string_view type;   ///< "text", "integer" or "rgb" ("0.485,0.456,0.406")
  std::string_view range;  ///< as LoaderOption::range_text() words it ("" for text)
  std::string_view help;
  void (*set)(LoaderConfig& c, std::string_view value);  ///< ConfigError naming the field
  std::string (*get)(const LoaderConfig& c);
};
/// The rows: "dataset", "list_root", "rank", "world_size", "mean", "std",
/// "cuda_device" (-1: none).
std::span<const LoaderField> loader_config_fields();
/// The row named `name`, or nullptr when it is an option (or nothing).
const LoaderField* find_loader_field(std::string_view name);
/// Sets any option or field of `c` by name from text, with the table's own
/// parser and range check: the one entry point of the C ABI and of any
/// front end that speaks text. ConfigError naming the name and the reason.
void set_loader_field(LoaderConfig& c, std::string_view name, std::string_view value);
/// An option's or field's value in `c` as text (set_loader_field reads it back).
std::string loader_field(const LoaderConfig& c, std::string_view name);

}  // namespace pinfeed::loader
