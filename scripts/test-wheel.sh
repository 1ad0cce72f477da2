#!/usr/bin/env bash
# The Python package as a user gets it: the portable wheel of
# scripts/build-wheel.sh (pip wheel + auditwheel repair), installed into a
# fresh virtualenv; the Python suite runs against the installed package (not
# the build tree) with the system's copies of the libraries the wheel
# carries hidden (those Debian's torch does not load itself), then its
# console scripts and a torchrun launch of its pinfeed-train. Last, an
# operator's host: a venv without torch, every carried library hidden, where
# the tools run and `import pinfeed` does not import torch.
#   scripts/test-wheel.sh [python]   default: Debian's /usr/bin/python3 (its torch)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-/usr/bin/python3}
wheel=$(bash scripts/build-wheel.sh "$python" | tail -n 1)
echo "== wheel: $wheel"

# The system's copies of what the wheel carries, as real files; and those
# Debian's torch loads itself (a process that imports torch needs them).
carried=$("$python" - "$wheel" <<'PY'
import glob, os, re, sys, zipfile
# pinfeed.libs/libspng-fe0e9562.so.0.7.3 is the system's libspng.so.0.7.3.
for n in zipfile.ZipFile(sys.argv[1]).namelist():
    if "pinfeed.libs/" in n and not n.endswith("/"):
        name = re.sub(r"-[0-9a-f]{8}(?=\.)", "", os.path.basename(n), count=1)
        for f in glob.glob(f"/usr/lib/x86_64-linux-gnu/{name}") + glob.glob(f"/usr/lib/x86_64-linux-gnu/*/{name}"):
            if os.path.isfile(f):
                print(os.path.realpath(f))
PY
)
carried=$(sort -u <<<"$carried")
torch_dir=$("$python" -c "import os, torch; print(os.path.dirname(torch.__file__))")
torch_needs=$(for f in "$torch_dir"/_C*.so "$torch_dir"/lib/*.so* /usr/lib/x86_64-linux-gnu/libtorch*.so*; do
  [[ -f $f ]] || continue; ldd "$f" | awk '$3 ~ /^\// {print $3}' || true; done | xargs -r readlink -f | sort -u)
only_ours=$(comm -23 <(echo "$carried") <(echo "$torch_needs"))
echo "== the wheel carries $(wc -l <<<"$carried") system libraries; hidden while its suite runs: $(xargs -n1 basename <<<"$only_ours" | xargs)"

# A fresh venv, with Debian's torch visible (--system-site-packages).
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$python" -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q "$wheel"
"$venv/bin/pip" install -q webdataset==1.0.2  # test tooling: the suite's oracle of WebDataset shards

# Every ELF file of the installed package finds each library it needs in the
# wheel (pinfeed.libs) or in its manylinux tag's policy list (auditwheel's:
# glibc, libstdc++, libgcc_s, libz, ...), never elsewhere on this host: a library auditwheel did not
# graft would load from here and fail on another host.
site=$("$venv/bin/python" -c "import os, pinfeed; print(os.path.dirname(os.path.dirname(pinfeed.__file__)))")
policy=$(ls "$PWD"/build/wheel-tools/lib/python3*/site-packages/auditwheel/policy/manylinux-policy.json)
tag=$(basename "$wheel" .whl | sed 's/.*-\(manylinux_[0-9]*_[0-9]*\)_.*/\1/')
outside=$("$python" - "$site" "$policy" "$tag" <<'PY'
import json, os, re, subprocess, sys
site, policy, tag = sys.argv[1:4]
libs = os.path.realpath(os.path.join(site, "pinfeed.libs")) + "/"
allowed = next(set(p["lib_whitelist"]) for p in json.load(open(policy)) if p["name"] == tag)
for top in ("pinfeed", "pinfeed.libs"):
    for folder, _, names in os.walk(os.path.join(site, top)):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                if f.read(4) != b"\x7fELF":
                    continue
            for line in subprocess.run(["ldd", path], capture_output=True, text=True).stdout.splitlines():
                soname, _, where = line.strip().partition(" => ")
                target = os.path.realpath(where.split(" (")[0]) if where.startswith("/") else ""
                if where and soname not in allowed and not target.startswith(libs):
                    print(f"{path}: {line.strip()}")
PY
)
if [[ -n $outside ]]; then
  echo "== the installed wheel loads libraries from this host, not from itself:" >&2
  echo "$outside" >&2
  exit 1
fi
echo "== every ELF file of the installed wheel loads its libraries from the wheel or $tag's policy list"

# From a folder outside the checkout, without PYTHONPATH: the installed copy.
# The suite's Module group (tests/python/CMakeLists.txt): the loader, its
# options, formats, samplers, DataLoader side by side, the package and the
# examples, against what pip installed. The release suite runs every group
# against the build tree; the remote and launch groups (servers, torchrun,
# processes: 230 s of CI) test no packaging, and torchrun from the installed
# wheel is below. PINFEED_WHEEL_SUITE=all runs the whole suite here.
work=$(mktemp -d)
skip=(test_two_hosts.py)
if [[ ${PINFEED_WHEEL_SUITE:-module} != all ]]; then
  skip+=(test_remote.py test_remote_hardening.py test_webdataset.py test_launch.py test_launch_plane.py test_hardening.py
         test_habits.py test_gpu_run.py test_device.py test_device_gpu.py)
fi
ignores=()
for f in "${skip[@]}"; do ignores+=(--ignore "$PWD/tests/python/$f"); done
(cd "$work" && env -u PYTHONPATH PINFEED_EXPECT_INSTALLED="$venv" \
  bash "$OLDPWD/scripts/hide-system-libs.sh" $only_ours -- "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider \
    "${ignores[@]}" "$OLDPWD/tests/python")
"$venv/bin/pinfeed-diag" --json --sample-ms 0 >/dev/null
"$venv/bin/pinfeed-train" --help | head -n 1
"$venv/bin/pinfeed-data" -q make --out "$work/data" --classes 2 --per-class 16 --seed 1
# torch 1.13 on Python 3.11 needs non-zero --redirects/--tee (docs/usage.md, Launching).
torchrun --redirects 9:1 --tee 9:1 --master_port 29541 --nproc_per_node 2 --no_python "$venv/bin/pinfeed-train" \
  --data "$work/data/train" --devices cpu:1 --epochs 1 --batch-size 8 --size 16 --pool 2 --threads 1 --json >"$work/run.json"
"$venv/bin/python" -c "import json,sys; j=json.load(open(sys.argv[1])); assert j['world_size']==2 and j['communicator']=='gloo', j" "$work/run.json"

# An operator's host: a venv that never saw torch or Debian's site-packages,
# the wheel alone (pip needs nothing else: torch is the extra pinfeed[torch]),
# and every library the wheel carries hidden. The tools start without torch.
bare=$(dirname "$venv")/bare
"$python" -m venv "$bare"
"$bare/bin/pip" install -q --no-index "$wheel"
# shellcheck disable=SC2086
bash scripts/hide-system-libs.sh $carried -- bash -c '
  set -euo pipefail
  "$1/bin/pinfeed-diag" --sample-ms 0 | sed -n 1,3p
  "$1/bin/pinfeed-data" -q make --out "$2/bare-data" --classes 2 --per-class 4 --seed 1 --format png
  "$1/bin/pinfeed-train" --data "$2/bare-data/train" --devices cpu:1 --epochs 1 --batch-size 4 --size 16 --json >/dev/null
  "$1/bin/python" -c "import sys, pinfeed; assert \"torch\" not in sys.modules; print(\"pinfeed\", pinfeed.__version__, \"without torch\")"
  if "$1/bin/python" -c "import pinfeed; pinfeed.Loader" 2>"$2/err"; then echo "pinfeed.Loader imported without torch" >&2; exit 1; fi
  grep -q "needs PyTorch" "$2/err" || { cat "$2/err" >&2; exit 1; }' _ "$bare" "$work"
start=$(date +%s%N); "$bare/bin/pinfeed-diag" --help >/dev/null; end=$(date +%s%N)
echo "== pinfeed-diag --help from the bare venv's console script: $(( (end - start) / 1000000 )) ms"
rm -rf "$work"
echo "== wheel check passed: $wheel"
