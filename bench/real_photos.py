#!/usr/bin/env python3
"""A real-photo ImageFolder built from wallpapers that Debian ships, for the
benchmarks (bench/real_photos.sh downloads the packages and calls this).

Each source picture (the largest JPEG of each wallpaper) is one class; each
sample is a crop of it at a random place, 30-100% of the source's area, 4:3
landscape or, one in five, 3:4 portrait, resized (PIL, Lanczos) to 500x375
or 375x500 and saved as a baseline 4:2:0 JPEG at the quality whose size is
closest to --target-kb (ImageNet's training JPEGs: ~110 KB, ~400x350 on
average, most 500x375 or 375x500). Deterministic for a --seed.
"""
import argparse
import io
import random
from pathlib import Path

from PIL import Image


def encode(image: Image.Image, target: int) -> bytes:
    """The JPEG whose size is closest to `target` bytes, quality 70..98."""
    best = b""
    lo, hi = 70, 98
    while lo <= hi:
        q = (lo + hi) // 2
        buf = io.BytesIO()
        image.save(buf, "JPEG", quality=q, subsampling=2)  # 2: 4:2:0
        data = buf.getvalue()
        if not best or abs(len(data) - target) < abs(len(best) - target):
            best = data
        if len(data) < target:
            lo = q + 1
        else:
            hi = q - 1
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sources", required=True, nargs="+", help="source JPEGs, one class each")
    p.add_argument("--out", required=True, help="ImageFolder root to write (train/ inside)")
    p.add_argument("--per-class", type=int, default=30)
    p.add_argument("--target-kb", type=float, default=110)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()

    rng = random.Random(a.seed)
    total, count = 0, 0
    for src in sorted(a.sources):
        name = Path(src).parents[2].name if Path(src).parent.name == "images" else Path(src).stem
        with Image.open(src) as im:
            source = im.convert("RGB")
        sw, sh = source.size
        folder = Path(a.out) / "train" / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(a.per_class):
            portrait = rng.random() < 0.2
            ow, oh = (375, 500) if portrait else (500, 375)
            area = rng.uniform(0.3, 1.0) * sw * sh
            w = min(sw, int(round((area * ow / oh) ** 0.5)))
            h = min(sh, int(round(w * oh / ow)))
            w = min(sw, int(round(h * ow / oh)))
            x, y = rng.randint(0, sw - w), rng.randint(0, sh - h)
            crop = source.crop((x, y, x + w, y + h)).resize((ow, oh), Image.LANCZOS)
            data = encode(crop, int(a.target_kb * 1000))
            (folder / f"{i:04}.jpg").write_bytes(data)
            total += len(data)
            count += 1
    print(f"wrote {count} photos of {len(a.sources)} classes to {a.out}/train, {total / count / 1000:.0f} KB on average")


if __name__ == "__main__":
    main()
