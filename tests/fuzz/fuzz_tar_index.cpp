// libFuzzer target: the tar shard index (headers, sizes, checksums, GNU long
// names, pax records, .cls labels) and reading every indexed member.
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
  static const std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("pinfeed-fuzz-tar-" + std::to_string(::getpid()) + ".tar");
  if (std::FILE* f = std::fopen(path.c_str(), "wb")) {
    std::fwrite(data, 1, size, f);
    std::fclose(f);
  }
  try {
    (void)pinfeed::loader::TarShards::scan(path);
    pinfeed::loader::TarShards shards({path});
    std::vector<std::byte> buf;
    for (std::size_t i = 0; i < shards.size(); ++i) shards.read(i, buf);
  } catch (const pinfeed::Error&) {
  }
  return 0;
}
