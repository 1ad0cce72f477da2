#include "pinfeed/loader/dataset_kinds.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <system_error>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/streamed.hpp"

namespace fs = std::filesystem;

namespace pinfeed::loader {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

bool is_tar_name(const fs::path& p) { return lower(p.extension().string()) == ".tar"; }

/// Shards some of which are URLs: streamed when every shard has an index
/// sidecar (streamed.hpp), else staged (remote.hpp); a shard's error names
/// its URL, not the cache's file.
std::unique_ptr<Dataset> open_remote_shards(const std::vector<fs::path>& expanded, std::size_t max_classes,
                                            const RemoteConfig& remote) {
  std::vector<std::string> urls, sources, all;
  for (const fs::path& p : expanded) {
    if (is_remote_url(p.string())) urls.push_back(p.string());
    all.push_back(p.string());
  }
  // Note [Streamed shards]: with index sidecars, no shard is fetched whole first.
  if (auto streamed = StreamedShards::open(all, max_classes, remote)) return streamed;
  StagedShards staged = stage_shards(urls, remote);
  std::vector<fs::path> local;
  std::size_t next = 0;
  for (const fs::path& p : expanded) {
    const bool url = is_remote_url(p.string());
    local.push_back(url ? staged.local[next++] : p);
    sources.push_back(url ? redact_url(p.string()) : p.string());
  }
  try {
    return std::make_unique<TarShards>(local, std::move(sources), staged.keep, max_classes);
  } catch (const DataError& e) {
    for (std::size_t i = 0; i < local.size(); ++i) {
      if (local[i] == e.path() && local[i] != expanded[i])
        throw DataError(redact_url(expanded[i].string()), e.reason());
    }
    throw;
  }
}

bool names_urls(const DatasetSpec& s) {
  return std::any_of(s.parts.begin(), s.parts.end(), [](const std::string& p) { return is_remote_url(p); });
}

/// Every shard the spec names, an s3:// prefix listed; each one a tar
/// shard or a URL naming a file.
std::unique_ptr<Dataset> open_remote(const DatasetSpec& s) {
  check_max_classes(s.max_classes);
  std::vector<fs::path> expanded;
  for (const fs::path& p : expand_shard_pattern(s.text)) {
    const std::string u = p.string();
    if (u.starts_with("s3://") && u.ends_with('/')) {  // a prefix: its .tar objects, listed
      for (const std::string& listed : list_s3_shards(u, s.remote)) expanded.emplace_back(listed);
    } else {
      expanded.push_back(p);
    }
  }
  for (const fs::path& p : expanded) {
    const std::string u = p.string();
    if (!is_remote_url(u) && !is_tar_name(p)) {
      throw ConfigError(
          fmt::format("dataset '{}': '{}' is not a tar shard (URLs name WebDataset shards)", redact_spec(s.text), u));
    }
    if (is_remote_url(u) && !u.starts_with("pipe:")) (void)remote_shard_name(u);  // a URL naming no file, said now
  }
  return open_remote_shards(expanded, s.max_classes, s.remote);
}

bool is_directory(const DatasetSpec& s) {
  std::error_code ec;
  return fs::is_directory(s.text, ec);
}

std::unique_ptr<Dataset> open_folder(const DatasetSpec& s) {
  return std::make_unique<ImageFolder>(s.text, s.max_classes);
}

bool names_shards(const DatasetSpec& s) {
  return s.text.find('{') != std::string::npos || s.text.find(',') != std::string::npos || is_tar_name(s.text);
}

std::unique_ptr<Dataset> open_shards(const DatasetSpec& s) {
  check_max_classes(s.max_classes);
  return std::make_unique<TarShards>(expand_shard_pattern(s.text), s.max_classes);
}

bool any_spec(const DatasetSpec&) { return true; }

std::unique_ptr<Dataset> open_list(const DatasetSpec& s) {
  check_max_classes(s.max_classes);
  std::error_code ec;
  if (!fs::exists(s.text, ec)) throw DataError(s.text, "dataset path does not exist");
  return std::make_unique<FileList>(s.text, s.root.empty() ? fs::path(s.text).parent_path() : s.root, s.max_classes);
}

constexpr std::array kKinds{
    DatasetKind{"remote-shards", "http(s)://, s3:// or pipe: shards among the parts", &names_urls, &open_remote},
    DatasetKind{"image-folder", "a directory of class folders", &is_directory, &open_folder},
    DatasetKind{"tar-shards", "a .tar file, a brace pattern or a comma list of them", &names_shards, &open_shards},
    DatasetKind{"file-list", "any other file: 'path label' lines", &any_spec, &open_list},
};

}  // namespace

std::span<const DatasetKind> dataset_kinds() { return kKinds; }

std::unique_ptr<Dataset> open_dataset(const std::string& spec, const fs::path& root, std::size_t max_classes,
                                      const RemoteConfig& remote) {
  if (spec.empty()) throw ConfigError("dataset: no path given");
  const DatasetSpec s{spec, split_shard_spec(spec), root, max_classes, remote};
  for (const DatasetKind& kind : kKinds) {
    if (kind.matches(s)) return kind.open(s);
  }
  throw ConfigError(
      fmt::format("dataset '{}': no kind of dataset takes it", redact_spec(spec)));  // file-list takes all
}

}  // namespace pinfeed::loader
