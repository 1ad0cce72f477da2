#!/usr/bin/env bash
# The GPU checks, in the two halves a lent device machine needs (docs/operations.md,
# "On a GPU"): the device has a GPU, CUDA 13, cuBLAS/NCCL pip wheels and
# torch, but no Debian packages and no network, so everything is built here
# and carried there as one bundle.
#
#   bench/gpu_check.sh            make the bundle, then run it on this machine:
#                                 the GPU steps where a GPU is, a rehearsal
#                                 (libraries, imports, the CPU twins) elsewhere
#   bench/gpu_check.sh --bundle   only make the bundle (.gpu/pinfeed-gpu.tar.xz)
#
# bench/gpu_bundle.sh makes the bundle; bench/gpu_run.py runs it (every step
# an assertion, $OUT/log and $OUT/gpu.json; exit non-zero when a step fails,
# or is not checked on a GPU host).
set -euo pipefail
cd "$(dirname "$0")/.."
bash bench/gpu_bundle.sh
[[ ${1:-} == --bundle ]] && exit 0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  exec python3 bench/gpu_run.py --bundle .gpu/pinfeed-gpu.tar.xz --out "${OUT:-build/gpu-run}"
fi
exec python3 bench/gpu_run.py --bundle .gpu/pinfeed-gpu.tar.xz --out "${OUT:-build/gpu-run}" --rehearse
