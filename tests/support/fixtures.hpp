#pragma once
// Helpers for tests that need files: a temporary folder removed at the end,
// writing a file with its parents, and the path of tests/data.
#include <fmt/format.h>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <string_view>

namespace pinfeed::testing {

inline std::filesystem::path data_dir() { return PINFEED_TEST_DATA_DIR; }

class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            ("pinfeed-test-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// Writes `text` to `path`, creating folders. Writes to a temporary
/// name and renames, so a concurrent reader sees the old or the new file.
inline void write_file(const std::filesystem::path& path, std::string_view text) {
  std::filesystem::create_directories(path.parent_path());
  const auto tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
  }
  std::filesystem::rename(tmp, path);
}

/// A /proc/pressure/memory file with these avg10 percentages.
inline std::string psi(double some, double full) {
  return fmt::format(
      "some avg10={:.2f} avg60=0.00 avg300=0.00 total=1\nfull avg10={:.2f} avg60=0.00 avg300=0.00 total=1\n", some,
      full);
}

/// Copies a fixture procfs tree from tests/data/procfs/<name> into `dest`.
inline void copy_fixture(std::string_view name, const std::filesystem::path& dest) {
  std::filesystem::copy(data_dir() / "procfs" / std::string(name), dest,
                        std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);
}

}  // namespace pinfeed::testing
