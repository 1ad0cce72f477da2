#!/usr/bin/env bash
# Builds the real-photo benchmark set from wallpapers that Debian ships:
#   bench/real_photos.sh [OUT_DIR] [PER_CLASS]     (default build/real-photos, 30)
# Downloads (does not install) plasma-workspace-wallpapers and mate-backgrounds,
# unpacks them under OUT_DIR/debs, takes the largest JPEG of every KDE
# wallpaper and every MATE nature photo (one class each) and cuts
# PER_CLASS ImageNet-like 500x375 crops from each, saved at the quality
# closest to ImageNet's ~110 KB (74 KB on average: the wallpapers are
# smoother), by bench/real_photos.py with a fixed seed: OUT_DIR/train is an
# ImageFolder. Debian 12's packages; another release ships other wallpapers.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/real-photos}
per_class=${2:-30}
if [[ -d $out/train ]]; then
  echo "real_photos.sh: $out/train exists (remove it to rebuild)"
  exit 0
fi
sudo=""; [[ $(id -u) -ne 0 ]] && sudo=sudo
dpkg-query -W -f='${Status}' python3-pil 2>/dev/null | grep -q "install ok installed" ||
  { $sudo apt-get update -qq; DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends python3-pil >/dev/null; }
mkdir -p "$out/debs"
out=$(realpath "$out")
(cd "$out/debs" && apt-get download -q plasma-workspace-wallpapers mate-backgrounds >/dev/null 2>&1 ||
  { $sudo apt-get update -qq && apt-get download -q plasma-workspace-wallpapers mate-backgrounds; })
for deb in "$out"/debs/*.deb; do dpkg-deb -x "$deb" "$out/debs/root"; done
sources=()
for dir in "$out"/debs/root/usr/share/wallpapers/*/contents/images; do
  largest=$(ls -S "$dir"/*.jpg 2>/dev/null | head -1 || true)  # the largest file: its highest resolution
  [[ -n $largest ]] && sources+=("$largest")
done
sources+=("$out"/debs/root/usr/share/backgrounds/mate/nature/*.jpg)
[[ ${#sources[@]} -gt 0 ]] || { echo "real_photos.sh: no JPEG found in the unpacked packages" >&2; exit 1; }
# Written under a temporary name: a run that fails half way leaves no train/.
rm -rf "$out/.partial"
/usr/bin/python3 bench/real_photos.py --sources "${sources[@]}" --out "$out/.partial" --per-class "$per_class"
mv "$out/.partial/train" "$out/train"
rmdir "$out/.partial"
echo "real_photos.sh: $out/train"
