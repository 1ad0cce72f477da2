#include "pinfeed/loader/options.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <type_traits>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/dataset.hpp"

namespace pinfeed::loader {
namespace {

// A field of LoaderConfig reached through a chain of member pointers
// (&LoaderConfig::transform, &TransformConfig::size).
template <auto... Path>
auto& field(LoaderConfig& c) {
  return (c.*....*Path);
}
template <auto... Path>
const auto& field(const LoaderConfig& c) {
  return (c.*....*Path);
}
template <auto... Path>
using FieldType = std::remove_cvref_t<decltype(field<Path...>(std::declval<LoaderConfig&>()))>;

LoaderOption base(std::string_view name, OptionType type, std::string_view help, double min = 0, double max = 0,
                  bool min_exclusive = false) {
  LoaderOption o;
  o.name = name;
  o.type = type;
  o.help = help;
  o.min = min;
  o.max = max;
  o.min_exclusive = min_exclusive;
  return o;
}

template <auto... Path>
LoaderOption integer(std::string_view name, double min, double max, std::string_view help) {
  LoaderOption o = base(name, OptionType::integer, help, min, max);
  o.get_int = [](const LoaderConfig& c) { return static_cast<std::uint64_t>(field<Path...>(c)); };
  o.set_int = [](LoaderConfig& c, std::uint64_t v) { field<Path...>(c) = static_cast<FieldType<Path...>>(v); };
  return o;
}

template <auto... Path>
LoaderOption real(std::string_view name, double min, bool min_exclusive, double max, std::string_view help) {
  LoaderOption o = base(name, OptionType::real, help, min, max, min_exclusive);
  o.get_real = [](const LoaderConfig& c) { return static_cast<double>(field<Path...>(c)); };
  o.set_real = [](LoaderConfig& c, double v) { field<Path...>(c) = v; };
  return o;
}

// A transform field's row: its range is the transform's own (transform_ranges).
template <auto... Path>
LoaderOption ranged(std::string_view name, std::string_view help) {
  const TransformRange& r = transform_range(name);
  if constexpr (std::is_integral_v<FieldType<Path...>>) {
    return integer<Path...>(name, r.min, r.max, help);
  } else {
    return real<Path...>(name, r.min, r.min_exclusive, r.max, help);
  }
}

template <auto... Path>
LoaderOption boolean(std::string_view name, std::string_view help) {
  LoaderOption o = base(name, OptionType::boolean, help);
  o.get_bool = [](const LoaderConfig& c) { return static_cast<bool>(field<Path...>(c)); };
  o.set_bool = [](LoaderConfig& c, bool v) { field<Path...>(c) = v; };
  return o;
}

template <auto Parse, auto Print, auto... Path>
LoaderOption choice(std::string_view name, std::vector<std::string_view> choices, std::string_view help) {
  LoaderOption o = base(name, OptionType::choice, help);
  o.choices = std::move(choices);
  o.get_choice = [](const LoaderConfig& c) { return Print(field<Path...>(c)); };
  o.set_choice = [](LoaderConfig& c, std::string_view v) { field<Path...>(c) = Parse(v); };
  return o;
}

/// `o`, which evaluation sets to `value` (LoaderOption::evaluation).
LoaderOption evaluated_as(std::string_view value, LoaderOption o) {
  o.evaluation = value;
  return o;
}

std::string_view print_pin_method(memory::PinMethod m) { return memory::to_string(m); }
std::string_view print_crop(CropMode m) { return to_string(m); }
std::string_view print_layout(Layout l) { return to_string(l); }
std::string_view print_interpolation(Interpolation i) { return to_string(i); }
std::string_view print_policy(BadSamplePolicy p) { return to_string(p); }

/// How remote shards arrive (remote.hpp): cache, waits, retries, streaming.
std::vector<LoaderOption> remote_options() {
  using L = LoaderConfig;
  constexpr double u64_max = 18446744073709551615.0;
  return {
      integer<&L::remote, &RemoteConfig::cache_limit>("cache_limit", 0, u64_max,
                                                      "bytes of remote shards cache_dir may keep; least recently used "
                                                      "go first (0: no bound)"),
      real<&L::remote, &RemoteConfig::read_timeout>("remote_timeout", 0, true, 86400,
                                                    "seconds over which a remote transfer must keep "
                                                    "remote_min_rate (and at most the time to connect, with 10 s), "
                                                    "or it is retried; also bounds a wait for another process's "
                                                    "cache lock, x (remote_retries + 1)"),
      real<&L::remote, &RemoteConfig::min_rate>("remote_min_rate", 0, false, 1e12,
                                                "bytes/s a remote transfer (or a pipe: command's output) must average "
                                                "over any remote_timeout seconds, headers included; slower is a stall, "
                                                "retried (0: only a transfer that brings nothing)"),
      integer<&L::remote, &RemoteConfig::retries>("remote_retries", 0, 100,
                                                  "retries of a failed remote transfer after its first try (backoff "
                                                  "0.5 s doubling, with jitter); a 4xx but 408/416/429 fails at once"),
      integer<&L::remote, &RemoteConfig::readahead>("remote_readahead", 0, u64_max,
                                                    "bytes of streamed remote samples fetched ahead of the loader "
                                                    "(0: 1/16 of available memory, within 4-256 MiB); with "
                                                    "watch_pressure a quarter under elevated pressure, 4 MiB under "
                                                    "critical"),
      integer<&L::remote, &RemoteConfig::streams>("remote_streams", 1, 1024,
                                                  "Range requests in flight at once while streaming remote shards"),
  };
}

std::vector<LoaderOption> make_options() {
  using L = LoaderConfig;
  using T = TransformConfig;
  constexpr double u64_max = 18446744073709551615.0;
  std::vector<LoaderOption> out{
      integer<&L::batch_size>("batch_size", 1, kMaxBatchSize, "samples per batch"),
      integer<&L::threads>("threads", 0, kMaxThreads,
                           "decode threads (0: the cores divided by the ranks on this host)"),
      integer<&L::prefetch>("prefetch", 1, static_cast<double>(kMaxPrefetch), "batches in flight: pool slots"),
      integer<&L::seed>("seed", 0, u64_max, "shuffling and augmentation seed"),
      evaluated_as("false", boolean<&L::shuffle>("shuffle", "shuffle the order every epoch (by seed and epoch)")),
      boolean<&L::drop_last>("drop_last", "trim the dataset to a multiple of the world size instead of padding"),
      evaluated_as("false", boolean<&L::drop_last_batch>("drop_last_batch", "drop each rank's last partial batch")),
      evaluated_as("center", choice<&parse_crop_mode, &print_crop, &L::transform, &T::crop>(
                                 "crop", enum_choices(kCropModeWords),
                                 "random (RandomResizedCrop + flip), center (Resize + CenterCrop), full (the whole "
                                 "image resized)")),
      ranged<&L::transform, &T::size>("size", "output width, and height unless height is set, pixels"),
      ranged<&L::transform, &T::height>("height", "output height, pixels (0: size, square)"),
      ranged<&L::transform, &T::resize>("resize", "center crop: the shorter side before cropping (>= size)"),
      ranged<&L::transform, &T::scale_min>("scale_min", "RandomResizedCrop: smallest area share"),
      ranged<&L::transform, &T::scale_max>("scale_max", "RandomResizedCrop: largest area share"),
      ranged<&L::transform, &T::ratio_min>("ratio_min", "RandomResizedCrop: smallest aspect ratio"),
      ranged<&L::transform, &T::ratio_max>("ratio_max", "RandomResizedCrop: largest aspect ratio"),
      evaluated_as("false", boolean<&L::transform, &T::flip>("flip", "random horizontal flip (random crop only)")),
      ranged<&L::transform, &T::flip_p>("flip_p", "the flip's probability"),
      choice<&parse_interpolation, &print_interpolation, &L::transform, &T::interpolation>(
          "interpolation", enum_choices(kInterpolationWords),
          "bilinear (antialiased: box averages while shrinking over 2x) or nearest (the pixel under each centre)"),
      choice<&parse_layout, &print_layout, &L::transform, &T::layout>(
          "layout", enum_choices(kLayoutWords),
          "nchw-f32 (normalized float32) or nhwc-u8 (to normalize on the device)"),
      boolean<&L::transform, &T::dct_scaling>(
          "dct_scaling",
          "decode JPEGs at 1/2, 1/4, 1/8 where the output allows: faster on images over twice the output size, but the "
          "pixels are no longer torchvision's (about 1-3 levels apart)"),
      boolean<&L::transform, &T::roi_decode>("roi_decode", "decode only the crop's region"),
      choice<&parse_bad_sample_policy, &print_policy, &L::on_bad_sample>(
          "bad_sample", enum_choices(kBadSamplePolicyWords),
          "a sample that cannot be decoded: replace it (counted) or fail"),
      integer<&L::max_replacements>("max_replacements", 0, 1024, "substitutes tried for one bad sample"),
      real<&L::max_replaced_share>("max_replaced_share", 0, false, 1,
                                   "share of an epoch that bad samples may replace before it fails"),
      integer<&L::max_classes>("max_classes", 1, static_cast<double>(kMaxClassesCeiling),
                               "a label at or over it refuses the dataset"),
      integer<&L::max_image_pixels>("max_image_pixels", 1, static_cast<double>(kMaxImagePixelsCeiling),
                                    "larger images are bad samples"),
      boolean<&L::pin>("pin", "page-lock the pool's slots within the budget"),
      boolean<&L::require_pinned>("require_pinned", "fail instead of running with pageable slots"),
      choice<&memory::parse_pin_method, &print_pin_method, &L::pin_method>(
          "pin_method", enum_choices(memory::kPinMethodWords), "auto (cuda with a device, else mlock), mlock or cuda"),
      real<&L::pinned_fraction>("pinned_fraction", 0, true, 1, "share of available memory the pool may pin"),
      integer<&L::local_ranks>("local_ranks", 0, 4096, "processes sharing this host's memory (0: from the launcher)"),
      boolean<&L::watch_pressure>("watch_pressure",
                                  "follow memory pressure: give idle slots back to the kernel under critical "
                                  "pressure, touch and pin them again after"),
      integer<&L::pressure_floor>("pressure_floor", 1, static_cast<double>(kMaxPrefetch),
                                  "slots kept under critical pressure: the batches you hold at once + 1"),
      integer<&L::held_warning>("held_warning", 0, u64_max,
                                "bytes of batches the program keeps (lent out of the pool) before one warning "
                                "(0: the pool's size)"),
      integer<&L::held_limit>("held_limit", 0, u64_max,
                              "bytes of batches the program may keep before next() raises (0: no limit)"),
  };
  for (LoaderOption& o : remote_options()) out.push_back(std::move(o));
  return out;
}

std::string number_text(double v) {
  if (v >= 1.8446744073709552e19) return "2^64-1";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return fmt::format("{}", static_cast<long long>(v));
  return fmt::format("{:g}", v);
}

}  // namespace

const std::vector<LoaderOption>& loader_options() {
  static const std::vector<LoaderOption> options = make_options();
  return options;
}

const LoaderOption& loader_option(std::string_view name) {
  for (const LoaderOption& o : loader_options()) {
    if (o.name == name) return o;
  }
  throw ConfigError(fmt::format("loader has no option '{}'", name));
}

std::string_view to_string(OptionType t) noexcept {
  switch (t) {
    case OptionType::integer: return "integer";
    case OptionType::real: return "real";
    case OptionType::boolean: return "boolean";
    case OptionType::choice: return "choice";
  }
  return "?";
}

LoaderConfig evaluation_config(const LoaderConfig& c) {
  LoaderConfig e = c;
  for (const LoaderOption& o : loader_options()) {
    if (!o.evaluation.empty()) o.set_text(e, o.evaluation);
  }
  return e;
}

namespace {

unsigned parse_unsigned(std::string_view name, std::string_view value) {
  unsigned v = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (value.empty() || ec != std::errc() || end != value.data() + value.size()) {
    throw ConfigError(fmt::format("loader {} must be a whole number, got '{}'", name, value));
  }
  return v;
}

std::array<float, 3> parse_rgb(std::string_view name, std::string_view value) {
  std::array<float, 3> out{};
  std::size_t at = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    const std::size_t comma = i < 2 ? value.find(',', at) : value.size();
    const std::string_view part = value.substr(at, comma == std::string_view::npos ? 0 : comma - at);
    const auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), out[i]);
    if (comma == std::string_view::npos || part.empty() || ec != std::errc() || end != part.data() + part.size() ||
        !std::isfinite(out[i])) {
      throw ConfigError(
          fmt::format("loader {} must be three numbers, R,G,B (\"0.485,0.456,0.406\"), got '{}'", name, value));
    }
    at = comma + 1;
  }
  return out;
}

std::string rgb_text(const std::array<float, 3>& v) { return fmt::format("{},{},{}", v[0], v[1], v[2]); }

void set_std(LoaderConfig& c, std::string_view value) {
  const std::array<float, 3> v = parse_rgb("std", value);
  if (!(v[0] > 0 && v[1] > 0 && v[2] > 0)) {
    throw ConfigError(
        fmt::format("loader std must be three numbers > 0 (each channel is divided by it), got '{}'", value));
  }
  c.transform.std = v;
}

void set_cuda_device(LoaderConfig& c, std::string_view value) {
  int d = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), d);
  if (value.empty() || ec != std::errc() || end != value.data() + value.size() || d < -1) {
    throw ConfigError(fmt::format("loader cuda_device must be -1 (none) or a device number, got '{}'", value));
  }
  c.cuda_device = d;
}

constexpr std::string_view kShard = "this process's shard";
constexpr std::string_view kNormalization = "normalization, RGB, in [0, 1] units";

const std::array<LoaderField, 8> kLoaderFields{{
    {"dataset", "text", "", "folder (ImageFolder), file list, or tar shard pattern; required",
     [](LoaderConfig& c, std::string_view v) { c.dataset = std::string(v); },
     [](const LoaderConfig& c) { return c.dataset; }},
    {"list_root", "text", "", "root of a file list's relative paths (empty: the list's folder)",
     [](LoaderConfig& c, std::string_view v) { c.list_root = std::string(v); },
     [](const LoaderConfig& c) { return c.list_root.string(); }},
    {"rank", "integer", "0..2^32-1", kShard,
     [](LoaderConfig& c, std::string_view v) { c.rank = parse_unsigned("rank", v); },
     [](const LoaderConfig& c) { return std::to_string(c.rank); }},
    {"world_size", "integer", "0..2^32-1", kShard,
     [](LoaderConfig& c, std::string_view v) { c.world_size = parse_unsigned("world_size", v); },
     [](const LoaderConfig& c) { return std::to_string(c.world_size); }},
    {"mean", "rgb", "R,G,B", kNormalization,
     [](LoaderConfig& c, std::string_view v) { c.transform.mean = parse_rgb("mean", v); },
     [](const LoaderConfig& c) { return rgb_text(c.transform.mean); }},
    {"std", "rgb", "R,G,B", kNormalization, set_std, [](const LoaderConfig& c) { return rgb_text(c.transform.std); }},
    {"cuda_device", "integer", "-1..", "the GPU the pool's slots are registered with (-1: none)", set_cuda_device,
     [](const LoaderConfig& c) { return std::to_string(c.cuda_device); }},
    {"cache_dir", "text", "",
     "where remote shards (http://, https://, s3://, pipe:) are kept whole across runs and "
     "shared by the ranks of a node (empty: none kept; streamed samples stay in memory, staged shards go to a "
     "private folder removed at the end)",
     [](LoaderConfig& c, std::string_view v) { c.remote.cache_dir = std::string(v); },
     [](const LoaderConfig& c) { return c.remote.cache_dir.string(); }},
}};

}  // namespace

std::span<const LoaderField> loader_config_fields() { return kLoaderFields; }

const LoaderField* find_loader_field(std::string_view name) {
  for (const LoaderField& f : kLoaderFields) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

void set_loader_field(LoaderConfig& c, std::string_view name, std::string_view value) {
  if (const LoaderField* f = find_loader_field(name)) {
    f->set(c, value);
  } else {
    loader_option(name).set_text(c, value);
  }
}

std::string loader_field(const LoaderConfig& c, std::string_view name) {
  if (const LoaderField* f = find_loader_field(name)) return f->get(c);
  const LoaderOption& o = loader_option(name);
  // Reals in full (shortest exact form), not text()'s 6 digits: what is
  // read back sets the same value again (4/3 must not become 1.33333).
  return o.type == OptionType::real ? fmt::format("{}", o.get_real(c)) : o.text(c);
}

std::string LoaderOption::flag() const {
  std::string f = "--" + std::string(name);
  std::replace(f.begin(), f.end(), '_', '-');
  return f;
}

std::string LoaderOption::text(const LoaderConfig& c) const {
  switch (type) {
    case OptionType::integer: return fmt::format("{}", get_int(c));
    case OptionType::real: return fmt::format("{:g}", get_real(c));
    case OptionType::boolean: return get_bool(c) ? "true" : "false";
    case OptionType::choice: return std::string(get_choice(c));
  }
  return {};
}

std::string LoaderOption::default_text() const { return text(LoaderConfig{}); }

std::string LoaderOption::range_text() const {
  switch (type) {
    case OptionType::integer: return fmt::format("{}..{}", number_text(min), number_text(max));
    case OptionType::real:
      return fmt::format("{}{}, {}]", min_exclusive ? "(" : "[", number_text(min), number_text(max));
    case OptionType::boolean: return "true or false";
    case OptionType::choice: {
      std::string out;
      for (const auto c : choices) out += fmt::format("{}{}", out.empty() ? "" : ", ", c);
      return "one of " + out;
    }
  }
  return {};
}

void LoaderOption::check(const LoaderConfig& c) const {
  double v = 0;
  if (type == OptionType::integer) {
    v = static_cast<double>(get_int(c));
  } else if (type == OptionType::real) {
    v = get_real(c);
  } else {
    return;  // booleans and choices hold only valid values
  }
  const bool low_ok = min_exclusive ? v > min : v >= min;
  if (!(low_ok && v <= max)) {  // NaN fails too
    throw ConfigError(fmt::format("loader {} must be {}, got {}", name, range_text(), text(c)));
  }
}

void LoaderOption::set_text(LoaderConfig& c, std::string_view value) const {
  const auto bad = [&] {
    return ConfigError(fmt::format("loader {} must be {}, got '{}'", name, range_text(), value));
  };
  switch (type) {
    case OptionType::integer: {
      std::uint64_t v = 0;
      const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
      if (value.empty() || ec != std::errc() || end != value.data() + value.size()) throw bad();
      // Checked before it is narrowed into the field: 2^32 must not become 0.
      if (static_cast<double>(v) < min || static_cast<double>(v) > max) throw bad();
      set_int(c, v);
      break;
    }
    case OptionType::real: {
      double v = 0;
      const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
      if (value.empty() || ec != std::errc() || end != value.data() + value.size() || !std::isfinite(v)) throw bad();
      set_real(c, v);
      break;
    }
    case OptionType::boolean:
      if (value == "true" || value == "1") {
        set_bool(c, true);
      } else if (value == "false" || value == "0") {
        set_bool(c, false);
      } else {
        throw bad();
      }
      break;
    case OptionType::choice:
      if (std::find(choices.begin(), choices.end(), value) == choices.end()) throw bad();
      set_choice(c, value);
      break;
  }
  check(c);
}

}  // namespace pinfeed::loader
