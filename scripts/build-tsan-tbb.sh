#!/usr/bin/env bash
# Builds oneTBB with ThreadSanitizer for the `tsan` preset, from Debian's own
# source package (the same 2021.8 as libtbb-dev), into build/third_party.
#
# Why: Debian's libtbb is not instrumented, so TSan cannot see the
# happens-before TBB's scheduler creates between a task's spawn and its run,
# and reports every flow-graph hand-off as a race. With an instrumented
# libtbb the loader's suites run under TSan like everything else.
# Idempotent: does nothing when the install is already there (~35 s otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=$PWD/build/third_party/onetbb-tsan
if [[ -f $prefix/lib/cmake/TBB/TBBConfig.cmake ]]; then
  echo "build-tsan-tbb: $prefix is there"
  exit 0
fi
work=$PWD/build/third_party/onetbb-src
mkdir -p "$work/apt/lists/partial" "$work/apt/parts"
# A private deb-src list: the machine's apt configuration is left alone.
cat >"$work/apt/parts/debian-src.sources" <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
apt_opts=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$work/apt/parts" -o "Dir::State::Lists=$work/apt/lists")
version=$(dpkg-query -W -f='${Version}' libtbb-dev)
(cd "$work" && apt-get "${apt_opts[@]}" update -qq && apt-get "${apt_opts[@]}" source --download-only -qq "onetbb=$version")
tar -C "$work" -xf "$work"/onetbb_*.orig.tar.xz
src=$(find "$work" -maxdepth 1 -type d -name 'oneTBB-*' | head -n 1)
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTBB_TEST=OFF -DTBB_EXAMPLES=OFF \
  -DTBB_STRICT=OFF -DTBBMALLOC_BUILD=OFF -DTBB_SANITIZE=thread -DCMAKE_INSTALL_PREFIX="$prefix" >/dev/null
cmake --build "$work/build"
cmake --install "$work/build" >/dev/null
echo "build-tsan-tbb: installed oneTBB $version with ThreadSanitizer into $prefix"
