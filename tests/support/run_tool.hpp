#pragma once
// Runs one of the real command-line tools in a shell and captures its exit
// code, stdout and stderr, for the end-to-end tool tests.
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "fixtures.hpp"

namespace pinfeed::testing {

struct ToolResult {
  int rc = -1;
  std::string out, err;
};

inline ToolResult run_tool(const std::string& binary, const std::string& args) {
  TempDir tmp;
  const auto out = tmp.path() / "out", err = tmp.path() / "err";
  const int status = std::system((binary + " " + args + " >" + out.string() + " 2>" + err.string()).c_str());
  ToolResult r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream o(out), e(err);
  std::stringstream so, se;
  so << o.rdbuf();
  se << e.rdbuf();
  r.out = so.str();
  r.err = se.str();
  return r;
}

}  // namespace pinfeed::testing
