// libFuzzer target: PNG and WebP through the loader's per-sample path
// (ImageDecoder: header, crop plan, row-by-row or whole decode, resize, flip,
// normalize) and the scan's verify(). Anything but a DataError or a clean
// result is a bug; ASan/UBSan watch the rest.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/image_decoder.hpp"
#include "pinfeed/loader/sample_rng.hpp"
#include "pinfeed/loader/transform.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace pinfeed::loader;
  static ImageDecoder decoder(1U << 22U);  // 4 MP: keep each run fast and small
  static const TransformConfig config = [] {
    TransformConfig c;
    c.size = 48;
    return c;
  }();
  static SampleWriter writer(config);
  static std::vector<std::byte> out(config.sample_bytes());
  const auto bytes = std::as_bytes(std::span(data, size));
  SampleRng rng(size, size > 0 ? data[0] : 0U, 11);
  try {
    decoder.decode_planned(
        bytes,
        [&](const ImageHeader& h) {
          const CropPlan plan = plan_crop(h, config, rng);
          writer.prepare(plan, out);
          return JpegDecoder::Plan{plan.region, plan.scale};
        },
        writer.sink(), "fuzz.png");
    if (!writer.complete()) __builtin_trap();  // a decode that returns must have delivered every row
  } catch (const pinfeed::DataError&) {
  }
  try {
    (void)decoder.verify(bytes, "fuzz.png");
  } catch (const pinfeed::DataError&) {
  }
  return 0;
}
