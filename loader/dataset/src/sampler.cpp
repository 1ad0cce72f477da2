#include "pinfeed/loader/sampler.hpp"

#include <fmt/format.h>

#include <numeric>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/sample_rng.hpp"

namespace pinfeed::loader {

namespace {
std::size_t samples_per_rank(const SamplerConfig& c) {
  const std::size_t n = c.dataset_size, r = c.world_size;
  if (c.drop_last && n % r != 0) return n / r;  // == ceil((N - R) / R) for N >= R
  return (n + r - 1) / r;
}
}  // namespace

void SamplerConfig::validate() const {
  if (dataset_size == 0) throw ConfigError("sampler: the dataset is empty (0 samples)");
  if (world_size == 0) throw ConfigError("sampler: world_size must be > 0");
  if (rank >= world_size)
    throw ConfigError(fmt::format("sampler: rank {} is not below world_size {}", rank, world_size));
  if (samples_per_rank(*this) == 0) {
    throw ConfigError(
        fmt::format("sampler: drop_last with {} samples over {} ranks leaves each rank nothing; "
                    "use drop_last=false (pads) or fewer ranks",
                    dataset_size, world_size));
  }
}

DistributedSampler::DistributedSampler(SamplerConfig config) : config_(config) {
  config_.validate();
  num_samples_ = samples_per_rank(config_);
}

std::vector<std::size_t> DistributedSampler::indices(std::uint64_t epoch) const {
  const std::size_t n = config_.dataset_size;
  std::vector<std::size_t> all(n);
  std::iota(all.begin(), all.end(), std::size_t{0});
  if (config_.shuffle) {
    // Fisher-Yates driven by one stream for (seed + epoch).
    SampleRng rng(config_.seed + epoch, 0, 0);
    for (std::size_t i = n - 1; i > 0; --i) std::swap(all[i], all[rng.below(i + 1)]);
  }
  const std::size_t total = total_size();
  if (total > n) {
    // Pad by wrapping around from the start, as many times as needed.
    all.reserve(total);
    for (std::size_t i = 0; all.size() < total; ++i) all.push_back(all[i % n]);
  } else {
    all.resize(total);
  }
  std::vector<std::size_t> mine;
  mine.reserve(num_samples_);
  for (std::size_t i = config_.rank; i < total; i += config_.world_size) mine.push_back(all[i]);
  return mine;
}

}  // namespace pinfeed::loader
