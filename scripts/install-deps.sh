#!/usr/bin/env bash
# Installs the Debian packages pinfeed builds and tests with. Idempotent: it
# asks dpkg first and only calls apt when something is missing, so a second
# run costs well under a second. Needs root (or sudo) on a Debian 12 machine.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  ccache                # CI: the release build's objects serve the wheel's and the GPU bundle's (.ci/run)
  libtbb-dev            # oneTBB: flow graph, task arena
  libturbojpeg0-dev libjpeg62-turbo-dev  # libjpeg-turbo: TurboJPEG and the libjpeg API (crop, skip)
  libspng-dev libwebp-dev  # PNG (libspng: limits on size and chunks) and WebP images
  zlib1g-dev  # checkpoints' crc32
  libxxhash-dev         # datasets' fingerprints (XXH3, header-only)
  libyuv-dev            # scaling (box filter when downscaling)
  libhwloc-dev          # NUMA topology, memory binding
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev libspdlog-dev
  libcurl4-openssl-dev  # remote shards: HTTP(S) with Range resume, S3 (AWS SigV4 is built in)
  nginx-light           # remote shards' tests: a real HTTP server on loopback (started by the tests)
  libcap-dev            # drop CAP_IPC_LOCK in the memlock-denial test
  clang-14 libclang-rt-14-dev  # libFuzzer targets (fuzz preset)
  clang-format-14       # the house style (.clang-format; a ctest holds it)
  libopenblas-dev       # trainer: the CPU backend's matrix products (cblas_sgemm)
  libopenmpi-dev openmpi-bin  # trainer: multi-process launch (mpirun), MPI all-reduce on CPU
  libgloo-dev           # trainer: CPU all-reduce across processes under torchrun (no MPI)
  gnuplot-nox           # pinfeed-train --compare: the loss-curve plot (PNG)
  python3-dev pybind11-dev libdlpack-dev  # the Python module (zero-copy tensors through DLPack)
  python3-torch python3-pytest            # its tests, and the PyTorch side of bench/peers
  python3-pip                             # test tooling from PyPI (webdataset, scripts/test.sh)
  python3-torchvision python3-matplotlib  # examples/ddp_torchrun.py (MobileNetV2, ResNet-18; its plot), ImageFolder checks
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
