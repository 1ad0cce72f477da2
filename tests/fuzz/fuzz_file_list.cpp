// libFuzzer target: the file-list parser ("relative/path label" lines,
// comments, blanks, bad labels) and reading its entries.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/dataset.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("pinfeed-fuzz-list-" + std::to_string(::getpid()));
  static const bool made = std::filesystem::create_directories(dir) || true;
  (void)made;
  const auto list = dir / "list.txt";
  if (std::FILE* f = std::fopen(list.c_str(), "wb")) {
    std::fwrite(data, 1, size, f);
    std::fclose(f);
  }
  try {
    pinfeed::loader::FileList files(list, dir);
    std::vector<std::byte> buf;
    for (std::size_t i = 0; i < files.size() && i < 8; ++i) {
      try {
        files.read(i, buf);
      } catch (const pinfeed::DataError&) {
      }
    }
  } catch (const pinfeed::Error&) {
  }
  return 0;
}
