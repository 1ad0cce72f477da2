#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/sampler.hpp"

namespace pinfeed::loader {
namespace {

std::vector<std::vector<std::size_t>> all_ranks(std::size_t n, unsigned r, bool drop_last, bool shuffle,
                                                std::uint64_t epoch) {
  std::vector<std::vector<std::size_t>> out;
  for (unsigned rank = 0; rank < r; ++rank) {
    out.push_back(DistributedSampler({n, rank, r, shuffle, drop_last, 42}).indices(epoch));
  }
  return out;
}

TEST(SamplerTest, EveryIndexExactlyOnceAcrossRanksPlusPyTorchPadding) {
  for (std::size_t n : {1U, 2U, 3U, 7U, 10U, 64U, 100U, 1001U}) {
    for (unsigned r : {1U, 2U, 3U, 4U, 8U, 13U}) {
      const auto ranks = all_ranks(n, r, false, true, 5);
      const std::size_t per = (n + r - 1) / r;  // ceil(N / R)
      std::map<std::size_t, int> count;
      for (const auto& v : ranks) {
        ASSERT_EQ(v.size(), per) << "n=" << n << " r=" << r;
        for (auto i : v) ++count[i];
      }
      ASSERT_EQ(count.size(), n) << "every index appears (n=" << n << " r=" << r << ")";
      std::size_t extra = 0;
      for (const auto& [i, c] : count) {
        ASSERT_GE(c, 1);
        extra += static_cast<std::size_t>(c - 1);
      }
      EXPECT_EQ(extra, per * r - n) << "padding is exactly ceil(N/R)*R - N";
    }
  }
}

TEST(SamplerTest, DropLastTrimsToEqualShardsWithoutRepeats) {
  for (std::size_t n : {4U, 7U, 10U, 100U, 1001U}) {
    for (unsigned r : {1U, 2U, 3U, 4U}) {
      const auto ranks = all_ranks(n, r, true, true, 1);
      std::set<std::size_t> seen;
      for (const auto& v : ranks) {
        ASSERT_EQ(v.size(), n / r);
        for (auto i : v) EXPECT_TRUE(seen.insert(i).second) << "no index twice with drop_last";
      }
      EXPECT_EQ(seen.size(), n / r * r);
    }
  }
}

TEST(SamplerTest, UnshuffledOrderMatchesPyTorchExactly) {
  // PyTorch, shuffle=False, N=10, R=4: indices 0..9 padded with 0, 1 -> rank r takes r::4.
  const auto ranks = all_ranks(10, 4, false, false, 0);
  EXPECT_EQ(ranks[0], (std::vector<std::size_t>{0, 4, 8}));
  EXPECT_EQ(ranks[1], (std::vector<std::size_t>{1, 5, 9}));
  EXPECT_EQ(ranks[2], (std::vector<std::size_t>{2, 6, 0}));
  EXPECT_EQ(ranks[3], (std::vector<std::size_t>{3, 7, 1}));
  // N=2 < R=5: padding repeats the list as many times as needed.
  const auto small = all_ranks(2, 5, false, false, 0);
  EXPECT_EQ(small[4], (std::vector<std::size_t>{0}));
  EXPECT_EQ(small[3], (std::vector<std::size_t>{1}));
}

TEST(SamplerTest, EpochsReshuffleAndSeedsAreReproducible) {
  const DistributedSampler s({1000, 0, 1, true, false, 9});
  EXPECT_EQ(s.indices(3), s.indices(3));
  EXPECT_NE(s.indices(3), s.indices(4));
  EXPECT_EQ(DistributedSampler({1000, 0, 1, true, false, 9}).indices(3), s.indices(3));
  EXPECT_NE(DistributedSampler({1000, 0, 1, true, false, 10}).indices(3), s.indices(3));
  auto sorted = s.indices(3);
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 0; i < sorted.size(); ++i) ASSERT_EQ(sorted[i], i);
}

TEST(SamplerTest, RejectsEmptyDatasetsAndImpossibleShards) {
  EXPECT_THROW(DistributedSampler({0, 0, 1, true, false, 0}), ConfigError);
  EXPECT_THROW(DistributedSampler({10, 2, 2, true, false, 0}), ConfigError);
  EXPECT_THROW(DistributedSampler({10, 0, 0, true, false, 0}), ConfigError);
  EXPECT_THROW(DistributedSampler({3, 0, 4, true, true, 0}), ConfigError) << "drop_last with N < R leaves nothing";
  EXPECT_NO_THROW(DistributedSampler({3, 0, 4, true, false, 0})) << "padding serves N < R";
}

}  // namespace
}  // namespace pinfeed::loader
