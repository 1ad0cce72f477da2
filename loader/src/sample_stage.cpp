#include "pinfeed/loader/sample_stage.hpp"

#include "pinfeed/error.hpp"

namespace pinfeed::loader {

namespace {
std::uint64_t since(std::chrono::steady_clock::time_point t0) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
}
}  // namespace

void SampleStage::operator()(std::size_t index, std::uint64_t epoch, std::span<std::byte> out, SampleScratch& s,
                             StageTimes& times) const {
  auto t0 = std::chrono::steady_clock::now();
  dataset_->read(index, s.bytes);
  times.read_ns += since(t0);

  t0 = std::chrono::steady_clock::now();
  SampleRng rng(seed_, epoch, index);
  CropPlan plan;
  try {
    static const std::string kUnnamed;  // named below, only when something fails
    s.decoder.decode_planned(
        s.bytes,
        [&](const ImageHeader& h) {
          plan = plan_crop(h, config_, rng);
          if (!config_.roi_decode) return JpegDecoder::Plan{Region{0, 0, h.width, h.height}, 1};
          return JpegDecoder::Plan{plan.region, plan.scale};
        },
        s.image, kUnnamed);
  } catch (const DataError& e) {
    throw DataError(dataset_->describe(index), e.reason());
  }
  times.decode_ns += since(t0);

  t0 = std::chrono::steady_clock::now();
  // With ROI decode the decoded image is the region (to within a scaled
  // pixel); without it, the region is cut out of the full image here.
  const Region crop = config_.roi_decode ? Region{} : plan.region;
  s.writer.write(s.image, crop, plan.flip, out);
  times.transform_ns += since(t0);
}

}  // namespace pinfeed::loader
