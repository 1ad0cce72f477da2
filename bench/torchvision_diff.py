#!/usr/bin/env python3
"""How far pinfeed's pixels are from torchvision's on the same files:
Resize(size * 256 / 224) + CenterCrop(size) through torchvision (PIL decode,
PIL bilinear resize, as a training script's validation transform) against
pinfeed's centre crop (uint8 NHWC, no shuffle, the same order): the mean
absolute difference and the mean signed difference (pinfeed - torchvision;
a bias darkens or brightens every image) in 0..255 levels over every
sample, and the worst image of each. Debian's
python3-torchvision; build/<preset>/python on PYTHONPATH:
  PYTHONPATH=build/release/python /usr/bin/python3 bench/torchvision_diff.py --data DIR
"""
import argparse
import json

import numpy as np
import pinfeed
import torchvision
from torchvision import transforms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True, help="ImageFolder root")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--limit", type=int, default=0, help="compare only the first N samples (0: all)")
    p.add_argument("--dct-scaling", action="store_true",
                   help="pinfeed's opt-in fast path (decode at 1/2-1/8 where the crop allows): how far it moves the pixels")
    a = p.parse_args()

    tf = transforms.Compose([transforms.Resize(a.size * 256 // 224), transforms.CenterCrop(a.size)])
    ref = torchvision.datasets.ImageFolder(a.data, transform=tf)
    ours = pinfeed.Loader(a.data, batch_size=64, transform="center", size=a.size, resize=a.size * 256 // 224,
                          layout="nhwc-u8", shuffle=False, dct_scaling=a.dct_scaling)
    if len(ours.samples) != len(ref):
        raise SystemExit(f"torchvision_diff: {len(ours.samples)} samples against torchvision's {len(ref)}")
    total, signed, count, i = 0.0, 0.0, 0, 0
    worst_abs, worst_signed = (0.0, None), (0.0, None)
    for x, _ in ours:
        for img in x.numpy():
            if a.limit and i >= a.limit:
                break
            d = img.astype(np.int16) - np.asarray(ref[i][0], dtype=np.int16)
            total += float(np.abs(d).sum())
            signed += float(d.sum())
            count += img.size
            mean_abs, mean_signed = float(np.abs(d).mean()), float(d.mean())
            if mean_abs > worst_abs[0]:
                worst_abs = (mean_abs, ref.samples[i][0])
            if abs(mean_signed) > abs(worst_signed[0]):
                worst_signed = (mean_signed, ref.samples[i][0])
            i += 1
    print(json.dumps({"samples": i, "mean_abs_diff_vs_torchvision": total / count,
                      "mean_signed_diff_vs_torchvision": signed / count,
                      "worst_image_abs": {"diff": worst_abs[0], "path": worst_abs[1]},
                      "worst_image_signed": {"diff": worst_signed[0], "path": worst_signed[1]},
                      "dct_scaling": a.dct_scaling, "torchvision": torchvision.__version__}))


if __name__ == "__main__":
    main()
