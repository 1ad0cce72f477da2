// DynamicLibrary (trainer/device/src/dynamic_library.hpp): how cuBLAS and NCCL are
// loaded, shown with libraries every machine has.
#include <gtest/gtest.h>

#include <cstring>

#include "dynamic_library.hpp"

namespace pinfeed::trainer::detail {
namespace {

TEST(DynamicLibraryTest, TheFirstNameThatLoadsIsUsedAndAMissingSymbolIsTheError) {
  DynamicLibrary libc("libc", {"libpinfeed-no-such.so.9", "libc.so.6"});
  EXPECT_EQ(libc.error(), "");
  using Strlen = std::size_t (*)(const char*);
  Strlen f = nullptr;
  libc.bind(f, "strlen");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f("pinfeed"), 7U);
  void (*missing)() = nullptr;
  libc.bind(missing, "pinfeed_no_such_symbol");
  EXPECT_EQ(missing, nullptr);
  EXPECT_EQ(libc.error(), "libc.so.6 lacks pinfeed_no_such_symbol");
}

TEST(DynamicLibraryTest, NoNameLoadsAndTheErrorSaysWhichWereTried) {
  DynamicLibrary none("NCCL", {"libpinfeed-no-such.so.1", "libpinfeed-no-such.so.2"});
  EXPECT_EQ(none.error().rfind("cannot load NCCL (libpinfeed-no-such.so.1, libpinfeed-no-such.so.2): ", 0), 0U)
      << none.error();
  void (*f)() = nullptr;
  none.bind(f, "anything");  // binding on nothing is harmless
  EXPECT_EQ(f, nullptr);
}

}  // namespace
}  // namespace pinfeed::trainer::detail
