// One table per enum (enum_words.hpp): every word parses back to its value,
// and a wrong word is refused with the words listed.
#include <gtest/gtest.h>

#include "pinfeed/enum_words.hpp"
#include "pinfeed/memory/memory_snapshot.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/memory/pool_plan.hpp"
#include "pinfeed/memory/pressure_monitor.hpp"

namespace pinfeed {
namespace {

template <class E, std::size_t N>
void round_trips(const std::array<EnumWord<E>, N>& words) {
  for (const auto& w : words) {
    EXPECT_EQ(enum_word(words, w.value), w.word);
    EXPECT_EQ(parse_enum(words, w.word, "x"), w.value) << w.word;
  }
  EXPECT_EQ(enum_choices(words).size(), N);
}

TEST(EnumWordsTest, EveryWordParsesBackAndAWrongOneListsTheWords) {
  round_trips(memory::kPinMethodWords);
  round_trips(memory::kPressureLevelWords);
  round_trips(memory::kVerdictWords);
  round_trips(memory::kCgroupVersionWords);
  EXPECT_EQ(memory::to_string(memory::PinMethod::cuda_register), "cuda");
  EXPECT_EQ(memory::parse_pin_method("mlock"), memory::PinMethod::mlock);
  try {
    (void)memory::parse_pin_method("madvise");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "pin method 'madvise' is not one of auto, mlock, cuda");
  }
}

TEST(EnumWordsTest, JoinListPutsTheConjunctionBeforeTheLastItem) {
  EXPECT_EQ(join_list({}, "or"), "");
  EXPECT_EQ(join_list({"a"}, "or"), "a");
  EXPECT_EQ(join_list({"a", "b"}, "and"), "a and b");
  EXPECT_EQ(join_list({"JPEG", "PNG", "WebP"}, "or"), "JPEG, PNG or WebP");
}

}  // namespace
}  // namespace pinfeed
