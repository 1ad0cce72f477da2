// The one environment reader (pinfeed/env.hpp): values, empty as unset,
// the raw view read_launch_env needs, and each variable logged once.
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <stdlib.h>

#include <memory>
#include <sstream>
#include <string>

#include "pinfeed/env.hpp"
#include "pinfeed/launch_env.hpp"
#include "pinfeed/log.hpp"

namespace pinfeed {
namespace {

/// The logger's lines while it lives, at debug and above.
class CapturedLog {
 public:
  CapturedLog() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)) {
    level_ = detail::log().level();
    detail::log().set_level(spdlog::level::debug);
    detail::log().sinks().push_back(sink_);
  }
  ~CapturedLog() {
    detail::log().sinks().pop_back();
    detail::log().set_level(level_);
  }
  CapturedLog(const CapturedLog&) = delete;
  CapturedLog& operator=(const CapturedLog&) = delete;
  std::string text() const { return out_.str(); }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
  spdlog::level::level_enum level_ = spdlog::level::info;
};

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(EnvTest, ValuesAndEmptyAsUnset) {
  ::setenv("PINFEED_ENV_TEST_VALUE", "seven", 1);
  ::setenv("PINFEED_ENV_TEST_EMPTY", "", 1);
  ::unsetenv("PINFEED_ENV_TEST_UNSET");
  EXPECT_EQ(env::get("PINFEED_ENV_TEST_VALUE"), "seven");
  EXPECT_EQ(env::get("PINFEED_ENV_TEST_EMPTY"), std::nullopt);
  EXPECT_EQ(env::get("PINFEED_ENV_TEST_UNSET"), std::nullopt);
  // raw tells set-empty from unset, as the C library does.
  ASSERT_NE(env::raw("PINFEED_ENV_TEST_EMPTY"), nullptr);
  EXPECT_STREQ(env::raw("PINFEED_ENV_TEST_EMPTY"), "");
  EXPECT_EQ(env::raw("PINFEED_ENV_TEST_UNSET"), nullptr);
}

TEST(EnvTest, EachOverrideIsLoggedOnceAtInfoOthersAtDebug) {
  ::setenv("PINFEED_ENV_TEST_ONCE", "3", 1);
  ::setenv("ENV_TEST_LAUNCHER_VARIABLE", "host-a", 1);
  const CapturedLog log;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(env::get("PINFEED_ENV_TEST_ONCE"), "3");
    EXPECT_EQ(env::get("ENV_TEST_LAUNCHER_VARIABLE"), "host-a");
  }
  const std::string text = log.text();
  EXPECT_EQ(count(text, "PINFEED_ENV_TEST_ONCE=3 overrides a default"), 1U) << text;
  EXPECT_EQ(count(text, "ENV_TEST_LAUNCHER_VARIABLE=host-a"), 1U) << text;
  EXPECT_NE(text.find("[info]"), std::string::npos) << text;
  EXPECT_NE(text.find("[debug]"), std::string::npos) << text;
}

TEST(EnvTest, CredentialsAreNamedButNeverLogged) {
  ::setenv("ENV_TEST_SECRET_ACCESS_KEY", "wJalrXUtnFEMI", 1);
  ::setenv("ENV_TEST_SESSION_TOKEN", "FwoGZXIvYXdz", 1);
  const CapturedLog log;
  EXPECT_EQ(env::get("ENV_TEST_SECRET_ACCESS_KEY"), "wJalrXUtnFEMI");
  EXPECT_EQ(env::get("ENV_TEST_SESSION_TOKEN"), "FwoGZXIvYXdz");
  const std::string text = log.text();
  EXPECT_EQ(text.find("wJalrXUtnFEMI"), std::string::npos) << text;
  EXPECT_EQ(text.find("FwoGZXIvYXdz"), std::string::npos) << text;
  EXPECT_NE(text.find("ENV_TEST_SECRET_ACCESS_KEY is set (not shown: a credential)"), std::string::npos) << text;
}

TEST(EnvTest, TheLaunchersVariablesAreReadThroughIt) {
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("LOCAL_RANK", "1", 1);
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);
  const CapturedLog log;
  const LaunchEnv e = read_launch_env();
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_NE(log.text().find("environment: WORLD_SIZE=4"), std::string::npos) << log.text();
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}) ::unsetenv(name);
}

}  // namespace
}  // namespace pinfeed
