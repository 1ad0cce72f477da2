#pragma once
// The one place the process environment is read. Note [one environment
// reader]: every module asks here, never the C library itself, so that
// `grep -rn "env::"` lists every variable pinfeed obeys, and each one that
// is set is logged the first time it is read: the PINFEED_* overrides at
// info ("environment: PINFEED_SIMD=sse2 overrides a default"), the
// launchers' and libraries' variables (MASTER_ADDR, GLOO_SOCKET_IFNAME, ...)
// at debug. An empty variable counts as unset.
#include <optional>
#include <string>

namespace pinfeed::env {

/// NAME's value, or nullopt when it is unset or empty.
std::optional<std::string> get(const char* name);

/// NAME's value as the C library holds it (nullptr when unset, "" when set
/// empty), for read_launch_env's injectable lookup; logged as get() logs.
const char* raw(const char* name);

}  // namespace pinfeed::env
