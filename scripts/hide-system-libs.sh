#!/usr/bin/env bash
# Runs a command with the system's copies of some shared libraries made
# unloadable (each file bound over by /dev/null in a private mount
# namespace), so that it proves it does not need them: the repaired wheel's
# check that it loads its own copies (scripts/test-wheel.sh).
#   scripts/hide-system-libs.sh libspng libturbojpeg ... -- command args...
# A name matches <libdir>/<name>.so* (libcap: libcap.so.2.66, not
# libcap-ng.so.0); an absolute path is that file.
set -euo pipefail
names=()
while [[ $# -gt 0 && $1 != -- ]]; do names+=("$1"); shift; done
[[ ${1:-} == -- ]] || { echo "usage: $0 LIBNAME... -- COMMAND..." >&2; exit 2; }
shift
files=()
for name in "${names[@]}"; do
  if [[ $name == /* ]]; then
    [[ -f $name ]] && files+=("$(readlink -f "$name")")
    continue
  fi
  found=0
  for dir in /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu /usr/lib /usr/local/lib; do
    for f in "$dir/$name".so*; do
      if [[ -f $f && ! -L $f ]]; then files+=("$(readlink -f "$f")"); found=1; fi
    done
  done
  [[ $found == 1 ]] || { echo "$0: $name is not installed: nothing to hide" >&2; exit 2; }
done
[[ ${#files[@]} -gt 0 ]] || { echo "$0: none of ${names[*]} is installed: nothing to hide" >&2; exit 2; }
mapfile -t files < <(printf '%s\n' "${files[@]}" | sort -u)
echo "hiding ${#files[@]} system libraries: ${files[*]##*/}" >&2
# Root (CI) needs only a mount namespace; another user maps itself to root
# in a user namespace of its own to be allowed one.
ns=(--mount)
[[ $EUID -eq 0 ]] || ns+=(--map-root-user)
exec unshare "${ns[@]}" -- bash -c '
  set -e
  for f in "${@:2:$1}"; do
    mount --bind /dev/null "$f"
    [[ ! -s $f ]] || { echo "hide-system-libs: $f is still readable" >&2; exit 2; }
  done
  shift $(( $1 + 1 )); exec "$@"' _ "${#files[@]}" "${files[@]}" "$@"
