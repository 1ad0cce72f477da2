#pragma once
// DistributedSampler with PyTorch's semantics (torch.utils.data.distributed):
//  - shuffle: a permutation of [0, N) seeded by seed + epoch (our own RNG:
//    orders are deterministic but not PyTorch's bit for bit);
//  - drop_last = false: pad by repeating indices from the start of the
//    (shuffled) list up to ceil(N / R) * R, so every rank gets as many;
//  - drop_last = true: trim to floor(N / R) * R (PyTorch's
//    ceil((N - R) / R) * R when N % R != 0);
//  - rank r takes every R-th index starting at r.
// The epoch is always passed explicitly: there is no set_epoch to forget.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace pinfeed::loader {

struct SamplerConfig {
  std::size_t dataset_size = 0;  ///< N, > 0
  unsigned rank = 0;             ///< this process's rank, < world_size
  unsigned world_size = 1;       ///< R, > 0
  bool shuffle = true;           ///< permute each epoch
  bool drop_last = false;        ///< trim instead of padding
  std::uint64_t seed = 0;        ///< base seed; the epoch is added to it
  void validate() const;         ///< ConfigError naming the field; also when a rank would get no sample
};

class DistributedSampler {
 public:
  explicit DistributedSampler(SamplerConfig config);

  /// Samples each rank yields per epoch.
  [[nodiscard]] std::size_t num_samples() const noexcept { return num_samples_; }
  /// num_samples() * world_size: the padded or trimmed epoch length.
  [[nodiscard]] std::size_t total_size() const noexcept { return num_samples_ * config_.world_size; }
  /// This rank's dataset indices for `epoch`, in order.
  [[nodiscard]] std::vector<std::size_t> indices(std::uint64_t epoch) const;
  [[nodiscard]] const SamplerConfig& config() const noexcept { return config_; }

 private:
  SamplerConfig config_;
  std::size_t num_samples_ = 0;
};

}  // namespace pinfeed::loader
