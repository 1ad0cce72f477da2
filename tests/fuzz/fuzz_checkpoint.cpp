// libFuzzer target: the checkpoint reader on arbitrary bytes (magic,
// checksum, JSON header, parameter count against the data). Anything but a
// DataError or a checkpoint whose sizes agree with the input is a bug.
#include <cstddef>
#include <cstdint>
#include <span>

#include "pinfeed/error.hpp"
#include "pinfeed/trainer/checkpoint.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto c = pinfeed::trainer::parse_checkpoint(std::as_bytes(std::span(data, size)), "fuzz.ckpt");
    if (c.weights.size() != c.momentum.size() || c.weights.size() * 8 > size) __builtin_trap();
  } catch (const pinfeed::DataError&) {
  }
  return 0;
}
