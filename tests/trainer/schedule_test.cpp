// LrSchedule: the linear scaling rule, warm-up, cosine decay.
#include <gtest/gtest.h>

#include "pinfeed/trainer/schedule.hpp"

namespace pinfeed::trainer {
namespace {

TEST(LrScheduleTest, LinearScalingWarmupThenCosine) {
  const LrSchedule s{0.1, 512, 10, 110};
  EXPECT_DOUBLE_EQ(s.peak(), 0.2) << "0.1 per 256 samples at a global batch of 512";
  EXPECT_DOUBLE_EQ(s.at(0), 0.02);
  EXPECT_DOUBLE_EQ(s.at(9), 0.2);
  EXPECT_DOUBLE_EQ(s.at(10), 0.2);
  EXPECT_NEAR(s.at(60), 0.1, 1e-12) << "half way through the decay";
  EXPECT_NEAR(s.at(110), 0.0, 1e-12);
  const LrSchedule no_warmup{0.1, 256, 0, 4};
  EXPECT_DOUBLE_EQ(no_warmup.at(0), 0.1);
}

}  // namespace
}  // namespace pinfeed::trainer
