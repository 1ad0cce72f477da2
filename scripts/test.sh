#!/usr/bin/env bash
# Set up, build and run every test.
#   scripts/test.sh                 release build, all suites
#   scripts/test.sh asan|tsan|debug another preset (CMakePresets.json)
#   scripts/test.sh release -L gpu  extra arguments go to ctest
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
shift || true

bash scripts/install-deps.sh
if [[ $preset == tsan ]]; then bash scripts/build-tsan-tbb.sh; fi
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset"
ctest --preset "$preset" -j "$(nproc)" "$@"
