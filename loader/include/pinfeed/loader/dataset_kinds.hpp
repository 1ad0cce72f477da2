#pragma once
// The kinds of dataset a spec can name, as one table (like the codecs'
// kImageCodecs): each row says what specs it takes and how it opens them.
// open_dataset takes the first row whose test the spec passes; a new kind
// of dataset is a row here and its class, nothing else. What a dataset
// knows about itself (class names, fingerprint, change check, streaming
// statistics, pressure) it says through Dataset's own virtuals.
#include <cstddef>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/remote.hpp"

namespace pinfeed::loader {

/// A spec as every row sees it.
struct DatasetSpec {
  std::string text;                ///< as given
  std::vector<std::string> parts;  ///< split at ',' outside braces (split_shard_spec)
  std::filesystem::path root;      ///< a file list's root ({}: the list's folder)
  std::size_t max_classes = kDefaultMaxClasses;
  RemoteConfig remote;
};

struct DatasetKind {
  std::string_view name;   ///< "image-folder", "file-list", "tar-shards", "remote-shards"
  std::string_view takes;  ///< what specs it takes, for help and docs
  bool (*matches)(const DatasetSpec& spec);
  std::unique_ptr<Dataset> (*open)(const DatasetSpec& spec);
};

/// The rows, in the order open_dataset tries them.
std::span<const DatasetKind> dataset_kinds();

/// Opens a dataset by what `spec` names: URLs among its parts -> remote
/// shards (streamed with index sidecars, else staged; remote.hpp); a
/// directory -> ImageFolder; a .tar file, a brace pattern or a comma list of
/// them -> TarShards; any other file -> FileList with paths relative to the
/// list's folder (or `root` if given).
std::unique_ptr<Dataset> open_dataset(const std::string& spec, const std::filesystem::path& root = {},
                                      std::size_t max_classes = kDefaultMaxClasses, const RemoteConfig& remote = {});

}  // namespace pinfeed::loader
