// libFuzzer target: the per-sample path (header, crop plan, ROI/scaled decode,
// resize, flip, normalize) on arbitrary bytes. Anything but a DataError or a
// clean result is a bug; ASan/UBSan watch the rest.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/jpeg_decoder.hpp"
#include "pinfeed/loader/sample_rng.hpp"
#include "pinfeed/loader/transform.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace pinfeed::loader;
  static JpegDecoder decoder(1U << 22U);  // 4 MP: keep each run fast and small
  static const TransformConfig config = [] {
    TransformConfig c;
    c.size = 48;
    return c;
  }();
  static SampleWriter writer(config);
  static std::vector<std::byte> out(config.sample_bytes());
  DecodedImage image;
  const auto bytes = std::as_bytes(std::span(data, size));
  SampleRng rng(size, size > 0 ? data[0] : 0U, 7);
  try {
    // The loader's path: rows streamed from the decoder into the writer.
    CropPlan plan;
    decoder.decode_planned(
        bytes,
        [&](const ImageHeader& h) {
          plan = plan_crop(h, config, rng);
          writer.prepare(plan, out);
          return JpegDecoder::Plan{plan.region, plan.scale};
        },
        writer.sink(), "fuzz.jpg");
    if (!writer.complete()) __builtin_trap();  // a decode that returns must have delivered every row
    // And the whole-region path, on the same plan.
    decoder.decode(bytes, plan.region, plan.scale, image, "fuzz.jpg");
    writer.write(image, Region{}, plan.flip, out);
  } catch (const pinfeed::DataError&) {
  }
  return 0;
}
