#pragma once
// Small JPEG datasets for loader tests, written by the test itself: the same
// images as an ImageFolder, a file list and tar shards.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "fixtures.hpp"
#include "pinfeed/loader/synthetic.hpp"
#include "pinfeed/loader/tar_writer.hpp"

namespace pinfeed::testing {

struct SmallDataset {
  std::filesystem::path folder;  ///< ImageFolder root
  std::filesystem::path list;    ///< file list over the same files
  std::string shards;            ///< brace pattern of the tar shards
  std::size_t size = 0;
};

inline void write_bytes(const std::filesystem::path& p, std::span<const std::byte> data) {
  std::filesystem::create_directories(p.parent_path());
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

/// `classes` x `per_class` images of about width x height (sizes vary a
/// little so crops differ), in dir/folder, dir/list.txt, dir/shard-{0..}.tar.
inline SmallDataset make_small_dataset(const std::filesystem::path& dir, int classes, int per_class, int width = 96,
                                       int height = 72, std::size_t per_shard = 7) {
  SmallDataset d;
  d.folder = dir / "folder";
  d.list = dir / "list.txt";
  std::ofstream list(d.list);
  list << "# relative/path label\n";
  std::vector<std::pair<std::string, std::vector<std::byte>>> members;
  int labels_seen = 0;
  for (int c = 0; c < classes; ++c, ++labels_seen) {
    for (int i = 0; i < per_class; ++i) {
      loader::SyntheticImageSpec spec;
      spec.width = width + (i % 3) * 8;
      spec.height = height + (i % 2) * 6;
      const auto jpeg = loader::make_synthetic_jpeg(7, c, static_cast<std::uint64_t>(i), spec);
      const std::string rel = fmt::format("class{:02}/img{:03}.jpg", c, i);
      write_bytes(d.folder / rel, jpeg);
      list << "folder/" << rel << " " << c << "\n";
      members.emplace_back(fmt::format("class{:02}/img{:03}", c, i), jpeg);
    }
  }
  d.size = members.size();
  std::size_t shard = 0;
  for (std::size_t m = 0; m < members.size(); m += per_shard, ++shard) {
    loader::TarWriter tar(dir / fmt::format("shard-{}.tar", shard));
    for (std::size_t k = m; k < std::min(m + per_shard, members.size()); ++k) {
      const auto& [key, jpeg] = members[k];
      tar.add(key + ".jpg", jpeg);
      const std::string cls = key.substr(5, 2);
      const std::string label = std::to_string(std::stoi(cls));
      tar.add(key + ".cls", std::as_bytes(std::span(label)));
    }
    tar.finish();
  }
  d.shards = (dir / fmt::format("shard-{{0..{}}}.tar", shard - 1)).string();
  return d;
}

}  // namespace pinfeed::testing
