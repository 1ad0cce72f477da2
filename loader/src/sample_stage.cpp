#include "pinfeed/loader/sample_stage.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "pinfeed/error.hpp"

namespace pinfeed::loader {

namespace {

/// Passes a region of the decoded rows on (all of them when empty): the
/// crop, when the whole image is decoded (no ROI decoding).
class CropRows final : public RowSink {
 public:
  explicit CropRows(RowSink& next) : next_(&next) {}
  Region region;

  void begin(int width, int height) override {
    y_ = 0;
    box_ = clamp_region(region, width, height);
    next_->begin(box_.width, box_.height);
  }
  void row(const std::uint8_t* bgra) override {
    if (y_ >= box_.y && y_ < box_.y + box_.height) next_->row(bgra + static_cast<std::size_t>(box_.x) * 4);
    ++y_;
  }

 private:
  RowSink* next_;
  Region box_;
  int y_ = 0;
};

std::uint64_t since(std::chrono::steady_clock::time_point t0) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
}
}  // namespace

CropPlan SampleStage::plan(std::size_t index, std::uint64_t epoch, SampleScratch& s) const {
  dataset_->read(index, s.bytes);
  SampleRng rng(seed_, epoch, index);
  try {
    return plan_crop(s.decoder.header(s.bytes, ""), config_, rng);
  } catch (const DataError& e) {
    throw DataError(dataset_->describe(index), e.reason());
  }
}

void SampleStage::operator()(std::size_t index, std::uint64_t epoch, std::span<std::byte> out, SampleScratch& s,
                             StageTimes& times) const {
  auto t0 = std::chrono::steady_clock::now();
  dataset_->read_stoppable(index, s.bytes, stop_);
  times.read_ns += since(t0);

  t0 = std::chrono::steady_clock::now();
  SampleRng rng(seed_, epoch, index);
  CropPlan plan;
  // Decode and transform run interleaved: each decoded row goes straight to
  // the writer, which resizes and writes a band of output rows at a time.
  // Without ROI decoding the whole image is decoded and the region is cut
  // out of the rows as they pass (measurement mode).
  CropRows crop(s.writer.sink());
  RowSink& sink = config_.roi_decode ? s.writer.sink() : crop;
  try {
    static const std::string kUnnamed;  // named below, only when something fails
    s.decoder.decode_planned(
        s.bytes,
        [&](const ImageHeader& h) {
          plan = plan_crop(h, config_, rng);
          s.writer.prepare(plan, out);
          if (!config_.roi_decode) {
            crop.region = plan.region;
            return JpegDecoder::Plan{Region{0, 0, h.width, h.height}, 1};
          }
          return JpegDecoder::Plan{plan.region, plan.scale};
        },
        sink, kUnnamed);
  } catch (const DataError& e) {
    throw DataError(dataset_->describe(index), e.reason());
  }
  if (!s.writer.complete()) throw Error(fmt::format("{}: the decoder stopped before the sample was written", dataset_->describe(index)));
  const std::uint64_t total = since(t0), output = s.writer.take_output_ns();
  times.transform_ns += output;
  times.decode_ns += total - std::min(total, output);
}

}  // namespace pinfeed::loader
