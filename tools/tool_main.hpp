#pragma once
// The shape every pinfeed command line shares: parse with CLI11, run, and
// turn errors into messages and exit codes: 0 done, 1 a runtime error (the
// message names the file or the reason), 2 bad flags or an absurd request
// (ConfigError names the field). Used by tools/ and bench/.
#include <malloc.h>
#include <sys/resource.h>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "pinfeed/error.hpp"

namespace pinfeed::tools {

template <typename Body>
int run_tool(const char* name, CLI::App& app, int argc, char** argv, Body&& body) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help, version, or the parse error
    return rc == 0 ? 0 : 2;
  }
  // Descriptors: a dataset of many tar shards, sockets to many ranks.
  raise_open_file_limit();
  // Under a finite RLIMIT_AS, glibc's per-thread malloc arenas (64 MiB of
  // address space each) would use it up before the buffers that need it.
  if (rlimit as{}; ::getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) ::mallopt(M_ARENA_MAX, 2);
  try {
    return body();
  } catch (const ConfigError& e) {
    fmt::print(stderr, "{}: {}\n", name, e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: {}\n", name, describe_failure(e));
    return 1;
  }
}

}  // namespace pinfeed::tools
