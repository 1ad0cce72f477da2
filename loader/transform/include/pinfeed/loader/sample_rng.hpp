#pragma once
// SampleRng: every random choice the loader makes comes from (seed, epoch,
// sample index) alone, so results do not depend on thread scheduling or on
// how many threads run. SplitMix64 over a hash of the three: fully specified,
// so the same inputs give the same stream on every platform and library
// (unlike std::uniform_*_distribution).
#include <cstdint>

namespace pinfeed::loader {

class SampleRng {
 public:
  SampleRng(std::uint64_t seed, std::uint64_t epoch, std::uint64_t index) noexcept
      : state_(mix(mix(mix(seed ^ 0x9e3779b97f4a7c15ULL) ^ epoch) ^ (index * 0xbf58476d1ce4e5b9ULL))) {}

  /// Next 64 random bits.
  std::uint64_t next() noexcept {
    state_ += 0x9e3779b97f4a7c15ULL;
    return mix(state_);
  }
  /// Uniform in [0, 1), 53 bits.
  double uniform() noexcept { return static_cast<double>(next() >> 11U) * 0x1.0p-53; }
  /// Uniform in [lo, hi).
  double uniform(double lo, double hi) noexcept { return lo + (hi - lo) * uniform(); }
  /// Uniform integer in [0, n), n > 0 (Lemire's multiply-shift, unbiased).
  std::uint64_t below(std::uint64_t n) noexcept {
    std::uint64_t x = next();
    __uint128_t m = static_cast<__uint128_t>(x) * n;
    auto low = static_cast<std::uint64_t>(m);
    if (low < n) {
      const std::uint64_t threshold = (0 - n) % n;
      while (low < threshold) {
        x = next();
        m = static_cast<__uint128_t>(x) * n;
        low = static_cast<std::uint64_t>(m);
      }
    }
    return static_cast<std::uint64_t>(m >> 64U);
  }

 private:
  static std::uint64_t mix(std::uint64_t z) noexcept {
    z = (z ^ (z >> 30U)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27U)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31U);
  }
  std::uint64_t state_;
};

}  // namespace pinfeed::loader
