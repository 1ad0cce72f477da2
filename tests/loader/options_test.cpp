// The loader's option table (options.hpp) against its readers: validate(),
// the tools' flags (tools/loader_flags.hpp). Python and the C ABI are held to
// the same table by tests/python/test_options.py.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "loader_flags.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/loader/options.hpp"

namespace pinfeed::loader {
namespace {

/// A value just outside the option's range, or a word not among its choices;
/// empty for a boolean.
std::string just_outside(const LoaderOption& o) {
  switch (o.type) {
    case OptionType::integer:
      if (o.max < 1.8e19) return fmt::format("{}", static_cast<std::uint64_t>(o.max) + 1);
      return "18446744073709551616";  // 2^64
    case OptionType::real: return o.min_exclusive ? fmt::format("{}", o.min) : fmt::format("{}", o.max + 0.5);
    case OptionType::choice: return "no-such-word";
    case OptionType::boolean: return {};
  }
  return {};
}

LoaderConfig valid() {
  LoaderConfig c;
  c.dataset = "unused";
  return c;
}

TEST(LoaderOptionsTest, EveryDefaultIsValidAndEveryOptionRejectsWhatIsOutsideItsRangeByName) {
  ASSERT_GE(loader_options().size(), 25U);
  EXPECT_NO_THROW(valid().validate()) << "a default-constructed config passes its own table";
  for (const LoaderOption& o : loader_options()) {
    EXPECT_EQ(o.default_text(), o.text(LoaderConfig{})) << o.name;
    EXPECT_EQ(&loader_option(o.name), &o);
    const std::string bad = just_outside(o);
    if (bad.empty()) continue;
    LoaderConfig c = valid();
    try {
      o.set_text(c, bad);
      FAIL() << o.name << " accepted " << bad;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(o.name), std::string::npos) << e.what();
    }
    // Round trip: the default's text sets the default back.
    LoaderConfig d = valid();
    o.set_text(d, o.default_text());
    EXPECT_EQ(o.text(d), o.default_text()) << o.name;
  }
  EXPECT_THROW((void)loader_option("no_such_option"), ConfigError);
  // Parsed as 64 bits, checked before it is narrowed into an unsigned field:
  // 2^32 threads must not wrap to 0 ("every core").
  LoaderConfig wrap = valid();
  EXPECT_THROW(loader_option("threads").set_text(wrap, "4294967296"), ConfigError);
  EXPECT_THROW(loader_option("size").set_text(wrap, "4294967360"), ConfigError);
  EXPECT_EQ(wrap.threads, 0U);
}

// By name, as the C ABI sets them: every option and field reads back what
// was set, and a refused value names the option.
TEST(LoaderOptionsTest, EveryOptionAndFieldIsSetAndReadBackByName) {
  LoaderConfig c;
  // What is read back sets exactly the same value again (a real in full:
  // ratio_max's 4/3 must not come back as 1.33333).
  const LoaderConfig defaults;
  for (const LoaderOption& o : loader_options()) {
    LoaderConfig probe;
    probe.transform.ratio_max = 2;  // away from the default, so the set must restore it
    set_loader_field(probe, o.name, loader_field(defaults, o.name));
    EXPECT_EQ(loader_field(probe, o.name), loader_field(defaults, o.name)) << o.name;
  }
  // The fields outside the table: each row's text sets the value it reads,
  // every row names its type and help, and no row shadows an option.
  for (const LoaderField& f : loader_config_fields()) {
    EXPECT_EQ(find_loader_field(f.name), &f);
    EXPECT_TRUE(f.type == "text" || f.type == "integer" || f.type == "rgb") << f.name;
    EXPECT_FALSE(f.help.empty()) << f.name;
    EXPECT_THROW((void)loader_option(f.name), ConfigError) << f.name;
    if (f.name == "dataset" || f.name == "list_root") continue;
    LoaderConfig probe;
    set_loader_field(probe, f.name, f.type == "rgb" ? "0.25,0.5,1" : "2");
    EXPECT_EQ(loader_field(probe, f.name), f.type == "rgb" ? "0.25,0.5,1" : "2") << f.name;
    set_loader_field(probe, f.name, f.get(defaults));
    EXPECT_EQ(loader_field(probe, f.name), loader_field(defaults, f.name)) << f.name;
  }
  EXPECT_EQ(loader_config_fields().size(), 8U);
  EXPECT_EQ(find_loader_field("flip_p"), nullptr);
  LoaderConfig ratio;
  set_loader_field(ratio, "ratio_max", loader_field(defaults, "ratio_max"));
  EXPECT_EQ(ratio.transform.ratio_max, defaults.transform.ratio_max);
  EXPECT_THROW(set_loader_field(ratio, "std", "0.5,0,0.5"), ConfigError);
  set_loader_field(ratio, "cuda_device", "1");
  EXPECT_EQ(ratio.cuda_device, 1);
  EXPECT_THROW(set_loader_field(ratio, "cuda_device", "-2"), ConfigError);
  set_loader_field(c, "dataset", "/data/train");
  set_loader_field(c, "rank", "3");
  set_loader_field(c, "world_size", "8");
  set_loader_field(c, "std", "0.25,0.5,1");
  set_loader_field(c, "flip_p", "0.125");
  set_loader_field(c, "interpolation", "nearest");
  EXPECT_EQ(c.dataset, "/data/train");
  EXPECT_EQ(c.rank, 3U);
  EXPECT_EQ(c.world_size, 8U);
  EXPECT_EQ(loader_field(c, "std"), "0.25,0.5,1");
  EXPECT_EQ(c.transform.flip_p, 0.125);
  EXPECT_EQ(loader_field(c, "interpolation"), "nearest");
  for (const char* bad : {"0.1,0.2", "a,b,c", "1,2,3,4", "", "1,,2"}) {
    EXPECT_THROW(set_loader_field(c, "mean", bad), ConfigError) << bad;
  }
  EXPECT_THROW(set_loader_field(c, "rank", "-1"), ConfigError);
  EXPECT_THROW(set_loader_field(c, "no_such", "1"), ConfigError);
  try {
    set_loader_field(c, "prefetch", "0");
    FAIL() << "prefetch 0 was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("prefetch"), std::string::npos) << e.what();
  }
}

// Whether evaluation (a validation loader) uses an option as training does
// is decided once, in the table: an option that changes what a sample looks
// like or which samples come (an augmentation, the shuffle) says what
// evaluation uses instead. A new option fails here until its row says so,
// or it is listed as meaning the same in evaluation.
TEST(LoaderOptionsTest, EveryOptionSaysWhatEvaluationUses) {
  const std::set<std::string_view> same_in_evaluation = {"batch_size",
                                                         "threads",
                                                         "prefetch",
                                                         "seed",
                                                         "drop_last",
                                                         "size",
                                                         "height",
                                                         "resize",
                                                         "scale_min",
                                                         "scale_max",
                                                         "ratio_min",
                                                         "ratio_max",  // RandomResizedCrop's: unused by the center crop
                                                         "flip_p",     // the flip's: evaluation has none
                                                         "interpolation",
                                                         "layout",
                                                         "dct_scaling",
                                                         "roi_decode",
                                                         "bad_sample",
                                                         "max_replacements",
                                                         "max_replaced_share",
                                                         "max_classes",
                                                         "max_image_pixels",
                                                         "pin",
                                                         "require_pinned",
                                                         "pin_method",
                                                         "pinned_fraction",
                                                         "local_ranks",
                                                         "watch_pressure",
                                                         "pressure_floor",
                                                         "held_warning",
                                                         "held_limit",
                                                         "cache_limit",
                                                         "remote_timeout",
                                                         "remote_min_rate",
                                                         "remote_retries",
                                                         "remote_readahead",
                                                         "remote_streams"};  // how shards arrive, not what they hold
  for (const LoaderOption& o : loader_options()) {
    EXPECT_NE(o.evaluation.empty(), same_in_evaluation.count(o.name) == 0)
        << o.name << ": give its row an evaluation value, or list it here as meaning the same in evaluation";
  }
  LoaderConfig train;
  train.transform.crop = CropMode::random_resized;
  train.transform.flip = true;
  train.shuffle = true;
  train.drop_last_batch = true;
  train.transform.size = 96;
  train.seed = 7;
  const LoaderConfig eval = evaluation_config(train);
  EXPECT_EQ(eval.transform.crop, CropMode::center);
  EXPECT_FALSE(eval.transform.flip);
  EXPECT_FALSE(eval.shuffle);
  EXPECT_FALSE(eval.drop_last_batch);
  EXPECT_EQ(eval.transform.size, 96U);
  EXPECT_EQ(eval.seed, 7U);
}

TEST(LoaderOptionsTest, ValidateChecksTheTableAndTheRulesBetweenFields) {
  LoaderConfig c = valid();
  c.threads = 5000;
  EXPECT_THROW(c.validate(), ConfigError);
  c = valid();
  c.transform.crop = CropMode::center;
  c.transform.size = 300;  // resize 256 < size
  EXPECT_THROW(c.validate(), ConfigError);
  c.transform.resize = 342;
  EXPECT_NO_THROW(c.validate());
  c = valid();
  c.transform.scale_min = 0.9;
  c.transform.scale_max = 0.5;
  EXPECT_THROW(c.validate(), ConfigError);
  c = valid();
  c.rank = 2;
  c.world_size = 2;
  EXPECT_THROW(c.validate(), ConfigError);
}

TEST(LoaderOptionsTest, ToolFlagsCarryTheTablesDefaultsAndRejectWhatItRejects) {
  for (const LoaderOption& o : loader_options()) {
    LoaderConfig config;
    CLI::App app;
    // One option at a time: the helper takes an initializer list.
    tools::add_loader_flags(app, config, {o.name});
    app.parse(std::vector<std::string>{});  // no flag given: the table's default
    EXPECT_EQ(o.text(config), o.default_text()) << o.name;
    const std::string bad = just_outside(o);
    if (bad.empty()) {
      // A boolean flag flips the default.
      const bool before = o.get_bool(config);
      CLI::App flip;
      tools::add_loader_flags(flip, config, {o.name});
      const std::string flag = before ? "--no-" + o.flag().substr(2) : o.flag();
      flip.parse(std::vector<std::string>{flag});
      EXPECT_NE(o.get_bool(config), before) << flag;
      continue;
    }
    CLI::App strict;
    LoaderConfig other;
    tools::add_loader_flags(strict, other, {o.name});
    // CLI11 parses a reversed argv.
    EXPECT_THROW(strict.parse(std::vector<std::string>{bad, o.flag()}), CLI::ValidationError) << o.flag() << " " << bad;
  }
}

TEST(LoaderOptionsTest, AToolTakesEveryOptionButWhatItSetsItself) {
  // "All except": a new row reaches a tool that lists only its exceptions.
  LoaderConfig config;
  CLI::App app;
  tools::add_loader_flags_except(app, config, {"batch_size", "layout"}, {"threads:--loader-threads"});
  for (const LoaderOption& o : loader_options()) {
    const bool expected = o.name != "batch_size" && o.name != "layout";
    const std::string flag =
        o.type == OptionType::boolean && o.get_bool(config) ? "--no-" + o.flag().substr(2) : o.flag();
    EXPECT_EQ(app.get_option_no_throw(flag) != nullptr, expected) << flag;
  }
  EXPECT_NE(app.get_option_no_throw("--loader-threads"), nullptr);
  app.parse(std::vector<std::string>{"7", "--loader-threads", "0.3", "--flip-p"});  // reversed argv
  EXPECT_EQ(config.threads, 7U);
  EXPECT_DOUBLE_EQ(config.transform.flip_p, 0.3);
  CLI::App misspelt;
  EXPECT_THROW(tools::add_loader_flags_except(misspelt, config, {"batch_sise"}), ConfigError);
}

}  // namespace
}  // namespace pinfeed::loader
