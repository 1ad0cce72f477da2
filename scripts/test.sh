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
# Test tooling from PyPI, once, into build/pydeps (on the suite's PYTHONPATH):
# the webdataset package is the oracle of tests/python/test_webdataset.py.
if ! PYTHONPATH=build/pydeps /usr/bin/python3 -c "import webdataset" 2>/dev/null; then
  /usr/bin/python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps --target build/pydeps \
    webdataset==1.0.2 braceexpand==0.1.7
fi
# S3 servers for tests/python/test_remote*.py: moto's standalone server and
# boto3, and LocalBucket (a second implementation, never tuned to: stdlib
# only, Range, HEAD, ListObjectsV2), in their own folder (run as separate
# processes, never on the suite's path: their dependencies must not shadow
# Debian's).
if ! PYTHONPATH=build/s3deps /usr/bin/python3 -c "import moto.server, flask_cors, localbucket" 2>/dev/null; then
  /usr/bin/python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --target build/s3deps \
    "moto[s3]==5.1.18" flask==3.1.3 flask-cors==6.0.5 localbucket==1.2.1
fi
if [[ $preset == tsan ]]; then bash scripts/build-tsan-tbb.sh; fi
cmake --preset "$preset" >/dev/null
if [[ $preset == tsan ]]; then
  # The suites that run threads, and what they link: not the tools (tests/CMakeLists.txt).
  cmake --build --preset "$preset" --target pinfeed_tests
else
  cmake --build --preset "$preset"
fi
ctest --preset "$preset" -j "$(nproc)" "$@"
