#pragma once
// SampleStage: read -> decode -> transform for one sample, written straight
// into its place in a batch. A plain function object: everything it needs
// comes through the constructor, per-thread scratch through the call, so it
// can be tested by calling it, with no graph.
#include <chrono>
#include <cstdint>
#include <span>
#include <stop_token>
#include <vector>

#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/image_decoder.hpp"
#include "pinfeed/loader/transform.hpp"

namespace pinfeed::loader {

/// Per-thread buffers and handles, reused sample after sample.
struct SampleScratch {
  explicit SampleScratch(const TransformConfig& config, std::uint64_t max_pixels = kDefaultMaxPixels)
      : decoder(max_pixels), writer(config) {}
  std::vector<std::byte> bytes;
  ImageDecoder decoder;
  SampleWriter writer;
};

/// Nanoseconds spent per stage, accumulated by the caller.
struct StageTimes {
  std::uint64_t read_ns = 0, decode_ns = 0, transform_ns = 0;
};

class SampleStage {
 public:
  SampleStage(const Dataset& dataset, TransformConfig config, std::uint64_t seed)
      : dataset_(&dataset), config_(config), seed_(seed) {}

  /// Writes dataset sample `index`, as seen in `epoch`, into `out`
  /// (config.sample_bytes() bytes). Throws DataError naming the file.
  void operator()(std::size_t index, std::uint64_t epoch, std::span<std::byte> out, SampleScratch& scratch,
                  StageTimes& times) const;

  /// The crop, scale and flip sample `index` gets in `epoch` (its header
  /// read, nothing decoded): what operator() applies.
  [[nodiscard]] CropPlan plan(std::size_t index, std::uint64_t epoch, SampleScratch& scratch) const;

  [[nodiscard]] const TransformConfig& config() const noexcept { return config_; }

  /// operator()'s reads give up waiting (Cancelled) once `stop` is
  /// requested: Dataset::read_stoppable.
  void stop_reads_on(std::stop_token stop) { stop_ = std::move(stop); }

 private:
  const Dataset* dataset_;
  TransformConfig config_;
  std::uint64_t seed_;
  std::stop_token stop_;
};

}  // namespace pinfeed::loader
