// pinfeed-data: make a synthetic ImageNet-like JPEG set, pack an ImageFolder
// into tar shards, scan a dataset for files that will not decode. Parsing and
// printing only; the work is in pinfeed::loader (dataset_tools.hpp).
//
// Exit codes: 0 done (scan: no bad file); 1 an error (named) or, for scan,
// bad files were found; 2 bad flags.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/dataset_kinds.hpp"
#include "pinfeed/loader/dataset_tools.hpp"
#include "pinfeed/loader/image_decoder.hpp"
#include "pinfeed/loader/streamed.hpp"
#include "pinfeed/loader/transform.hpp"
#include "pinfeed/units.hpp"
#include "progress.hpp"
#include "tool_main.hpp"

namespace {

namespace pl = pinfeed::loader;
using json = nlohmann::ordered_json;

/// The tools' progress bar (progress.hpp) as the dataset tools' callback.
pl::Progress progress_bar(const std::string& what) {
  auto bar = std::make_shared<pinfeed::tools::ProgressBar>(what);
  return [bar](std::size_t done, std::size_t total) { bar->update(done, total); };
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// More threads than this is a typo, not a machine (each costs a stack).
constexpr int kMaxThreads = 1024;

/// Each subcommand: its flags (add) and what it does (run).
struct MakeCommand {
  pl::SyntheticDatasetConfig make;
  CLI::App* app = nullptr;

  void add(CLI::App& parent) {
    app = parent.add_subcommand("make", "write a deterministic synthetic ImageNet-like JPEG set (ImageFolder layout)");
    app->add_option("--out", make.out, "output folder (train/ and val/ inside)")->required();
    app->add_option("--classes", make.classes, "number of classes")->check(CLI::Range(1, 1000));
    app->add_option("--per-class", make.per_class, "images per class")->check(CLI::Range(1, 100000));
    app->add_option("--val", make.val_fraction, "share of each class written to val/")->check(CLI::Range(0.0, 0.9));
    app->add_option("--seed", make.seed, "seed: the same seed writes the same bytes");
    app->add_option("--quality", make.quality, "JPEG (and WebP) quality")->check(CLI::Range(1, 100));
    app->add_option("--format", make.format, "image format: " + pl::codec_words())
        ->check(CLI::IsMember(pl::codec_word_list()))
        ->capture_default_str();
    app->add_option("--style", make.style,
                    "what tells the classes apart: photo (hue, grating angle: a colour average does) or texture (fine "
                    "stripes, checks or blobs under random colours: a convolution does, average pooling cannot)")
        ->check(CLI::IsMember({"photo", "texture"}))
        ->capture_default_str();
    app->add_option("--threads", make.threads, "threads (0: every core)")->check(CLI::Range(0, kMaxThreads));
  }

  int run(bool quiet) const {
    // Writing into a folder that already holds files would mix two datasets
    // (another seed, count or format) without a word.
    if (std::error_code ec; std::filesystem::exists(make.out, ec) && (!std::filesystem::is_directory(make.out, ec) ||
                                                                      !std::filesystem::is_empty(make.out, ec))) {
      throw pinfeed::ConfigError(
          fmt::format("--out {}: {} already; pinfeed-data make writes a new dataset into a new "
                      "or empty folder (remove it, or choose another)",
                      make.out.string(), std::filesystem::is_directory(make.out, ec) ? "holds files" : "is a file"));
    }
    const auto t0 = Clock::now();
    const auto s = pl::write_synthetic_dataset(make, quiet ? pl::Progress{} : progress_bar("make"));
    const std::size_t files = s.train_files + s.val_files;
    const std::string kind =
        fmt::format("{}s", pl::find_codec(pl::parse_image_format(make.format, "--format"))->display);
    fmt::print("wrote {} train + {} val {}, {} classes, {} ({:.0f} KB per file on average) to {} in {:.1f} s\n",
               s.train_files, s.val_files, kind, make.classes, pinfeed::format_bytes(s.bytes),
               static_cast<double>(s.bytes) / 1000.0 / static_cast<double>(files), make.out.string(),
               seconds_since(t0));
    return 0;
  }
};

struct PackCommand {
  std::string from, out;
  pl::PackConfig pack;
  CLI::App* app = nullptr;

  void add(CLI::App& parent) {
    app = parent.add_subcommand("pack",
                                "pack an ImageFolder into WebDataset tar shards, each with its index sidecar "
                                "(NAME.tar.index.json, which lets remote shards stream)");
    app->add_option("--from", from, "ImageFolder root")->required()->check(CLI::ExistingDirectory);
    app->add_option("--out", out,
                    "shard prefix: PREFIX-000000.tar, ...; an http(s):// or s3://bucket/prefix URL uploads each "
                    "shard there (PUT; S3 signed with the AWS_* credentials)")
        ->required();
    app->add_option("--per-shard", pack.per_shard, "samples per shard")
        ->check(CLI::Range(std::size_t{1}, std::size_t{10000000}))
        ->capture_default_str();
    app->add_option("--max-side", pack.max_side,
                    "re-encode images whose longer side exceeds N as JPEGs with that side N (training decodes fewer "
                    "pixels; smaller images are kept as they are); 0 keeps every file")
        ->check(CLI::Range(0, 0) | CLI::Range(pl::kMinImageSize, pl::kMaxPackSide))
        ->capture_default_str();
    app->add_option("--quality", pack.quality, "JPEG quality of re-encoded images")
        ->check(CLI::Range(1, 100))
        ->capture_default_str();
    app->add_option("--threads", pack.threads, "re-encoding threads (0: every core)")
        ->check(CLI::Range(0, kMaxThreads));
  }

  int run(bool quiet) const {
    const auto t0 = Clock::now();
    const pl::ImageFolder folder(from);
    const bool remote = pl::is_remote_url(out);
    if (out.starts_with("pipe:"))
      throw pinfeed::ConfigError("--out: pipe: reads shards; write them to a folder or a URL");
    // A URL: the shards are written to a private folder, then uploaded one
    // by one (a shard in the store is complete: S3 and HTTP PUT replace whole).
    struct Staging {
      std::filesystem::path dir;
      Staging() = default;
      Staging(const Staging&) = delete;
      Staging& operator=(const Staging&) = delete;
      ~Staging() {
        std::error_code ec;
        if (!dir.empty()) std::filesystem::remove_all(dir, ec);
      }
    } staging;
    std::filesystem::path prefix = out;
    if (remote) {
      const auto slash = out.rfind('/');
      if (out.ends_with('/') || slash == std::string::npos || slash < out.find("://") + 3 ||
          (out.starts_with("s3://") && out.find('/', 5) == std::string::npos)) {
        throw pinfeed::ConfigError(
            fmt::format("--out '{}': a URL ends in the shards' prefix, as in "
                        "s3://bucket/imagenet/train (train-000000.tar, ...)",
                        pl::redact_url(out)));
      }
      pl::check_upload_target(out);  // missing credentials are said before the packing, not after
      const std::string name = pl::remote_shard_name(out + ".tar");
      std::string dir = (std::filesystem::temp_directory_path() / "pinfeed-pack-XXXXXX").string();
      if (::mkdtemp(dir.data()) == nullptr) throw pinfeed::DataError(dir, std::strerror(errno));
      staging.dir = dir;
      prefix = std::filesystem::path(dir) / name.substr(0, name.size() - 4);
    }
    auto s = pl::pack_shards(folder, prefix, pack, quiet ? pl::Progress{} : progress_bar("pack"));
    if (remote) {
      std::vector<std::filesystem::path> files;
      for (const auto& e : std::filesystem::directory_iterator(prefix.parent_path())) files.push_back(e.path());
      std::sort(files.begin(), files.end());
      const std::string base = out.substr(0, out.rfind('/') + 1);
      for (const auto& f : files) pl::upload_file(f, base + f.filename().string(), pl::RemoteConfig{});
      s.pattern = base + std::filesystem::path(s.pattern).filename().string();
    }
    fmt::print("packed {} samples of {} classes into {} in {:.1f} s\n", s.samples, folder.num_classes(),
               remote ? pl::redact_url(s.pattern) : s.pattern, seconds_since(t0));
    if (pack.max_side > 0) {
      fmt::print("  {} of {} re-encoded with the longer side {} at quality {}: {} -> {} of images\n", s.resized,
                 s.samples, pack.max_side, pack.quality, pinfeed::format_bytes(s.bytes_in),
                 pinfeed::format_bytes(s.bytes_out));
    }
    return 0;
  }
};

struct ScanCommand {
  std::string what;
  bool as_json = false;
  unsigned threads = 0;
  CLI::App* app = nullptr;

  void add(CLI::App& parent) {
    app = parent.add_subcommand("scan", "decode every sample and report the ones that fail");
    app->add_option("dataset", what, "folder, file list, or tar shard pattern")->required();
    app->add_flag("--json", as_json, "print JSON");
    app->add_option("--threads", threads, "threads (0: every core)")->check(CLI::Range(0, kMaxThreads));
  }

  int run(bool quiet) const {
    const auto t0 = Clock::now();
    const auto dataset = pl::open_dataset(what);
    const auto bad = pl::scan_dataset(*dataset, threads, quiet || as_json ? pl::Progress{} : progress_bar("scan"));
    if (as_json) {
      json j{{"dataset", dataset->summary()}, {"samples", dataset->size()}, {"bad", json::array()}};
      for (const auto& b : bad) j["bad"].push_back({{"index", b.index}, {"path", b.where}, {"reason", b.reason}});
      // Names are bytes: one that is not UTF-8 is printed with U+FFFD in
      // place of its bad bytes (the text report prints the bytes).
      fmt::print("{}\n", j.dump(2, ' ', false, json::error_handler_t::replace));
    } else {
      fmt::print("{}\n", dataset->summary());
      for (const auto& b : bad) fmt::print("  bad: {}: {}\n", b.where, b.reason);
      fmt::print("{} of {} samples cannot be used ({:.1f} s)\n", bad.size(), dataset->size(), seconds_since(t0));
    }
    return bad.empty() ? 0 : 1;
  }
};

struct IndexCommand {
  std::string shards;
  std::string out;
  CLI::App* app = nullptr;

  void add(CLI::App& parent) {
    app = parent.add_subcommand("index",
                                "write each local tar shard's index sidecar (NAME.tar.index.json), which "
                                "lets remote shards stream (pack writes them too)");
    app->add_option("shards", shards,
                    "tar shards: a path, a brace pattern (data/train-{000000..000127}.tar) or a comma "
                    "list")
        ->required();
    app->add_option("--out", out,
                    "also upload each sidecar to this URL prefix, which must be the one holding the "
                    "shards in the store (s3://bucket/dir/, https://host/dir/)");
  }

  int run(bool quiet) const {
    if (!out.empty() && (!pl::is_remote_url(out) || out.starts_with("pipe:") || !out.ends_with('/'))) {
      throw pinfeed::ConfigError(
          fmt::format("--out '{}': a URL prefix ending in / (s3://bucket/dir/)", pl::redact_spec(out)));
    }
    if (!out.empty()) pl::check_upload_target(out);
    std::size_t n = 0;
    for (const auto& tar : pl::expand_shard_pattern(shards)) {
      if (pl::is_remote_url(tar.string())) {
        throw pinfeed::ConfigError(
            fmt::format("index: '{}' is a URL: index reads local copies of the shards (the "
                        "same bytes), and --out uploads the sidecars beside the remote ones",
                        pl::redact_url(tar.string())));
      }
      const auto sidecar = pl::write_shard_index(tar);
      if (!out.empty()) pl::upload_file(sidecar, out + sidecar.filename().string(), pl::RemoteConfig{});
      if (!quiet)
        fmt::print("{}\n", out.empty() ? sidecar.string() : pl::redact_url(out + sidecar.filename().string()));
      ++n;
    }
    fmt::print("indexed {} shard{}\n", n, n == 1 ? "" : "s");
    return 0;
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pinfeed-data: make, pack, scan and index image datasets"};
  app.set_version_flag("--version", "pinfeed-data 0.1.0");
  app.require_subcommand(1);
  app.fallthrough();  // -q works after the subcommand too
  bool quiet = false;
  app.add_flag("-q,--quiet", quiet, "no progress output");
  MakeCommand make;
  PackCommand pack;
  ScanCommand scan;
  IndexCommand index;
  make.add(app);
  pack.add(app);
  scan.add(app);
  index.add(app);
  return pinfeed::tools::run_tool("pinfeed-data", app, argc, argv, [&]() -> int {
    spdlog::set_level(spdlog::level::warn);
    if (*make.app) return make.run(quiet);
    if (*pack.app) return pack.run(quiet);
    if (*scan.app) return scan.run(quiet);
    if (*index.app) return index.run(quiet);
    return 0;
  });
}
