#!/usr/bin/env bash
# cmake --install into a temporary prefix, then build examples/cpp out of
# tree against it with find_package(pinfeed), and run the result on a
# dataset made by the installed pinfeed-data.
#   run.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
test -f "$work/prefix/include/pinfeed/pinfeed.h"
test -f "$work/prefix/include/pinfeed/loader/loader.hpp"
test -x "$work/prefix/bin/pinfeed-train"
ls "$work/prefix"/lib*/libpinfeed.so* >/dev/null
cmake -S "$src/examples/cpp" -B "$work/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/consumer" >/dev/null
"$work/prefix/bin/pinfeed-data" -q make --out "$work/data" --classes 3 --per-class 12 --seed 2
"$work/consumer/train_loop" "$work/data/train" 2 | tee "$work/out"
grep -q "^epoch 2: loss" "$work/out"
echo "install test: installed, consumed with find_package(pinfeed), trained"
