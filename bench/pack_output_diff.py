#!/usr/bin/env python3
"""The change `pinfeed-data pack --max-side N` makes to what training sees:
loads the original dataset and a packed one with the same deterministic
transform (Resize(size * 256 / 224) + CenterCrop(size), uint8, no shuffle,
the same order) through pinfeed's Python module and prints the mean
absolute difference of the outputs in 0..255 levels, over every sample.
Needs build/<preset>/python on PYTHONPATH (bench/pack_figures.sh sets it).
"""
import argparse
import json

import numpy as np
import pinfeed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--original", required=True)
    p.add_argument("--packed", required=True)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()

    def loader(path: str):
        return pinfeed.Loader(path, batch_size=a.batch, transform="center", size=a.size, layout="nhwc-u8",
                              shuffle=False, drop_last=False)

    total, count, samples, worst = 0.0, 0, 0, 0.0
    a_loader, b_loader = loader(a.original), loader(a.packed)
    if len(a_loader.samples) != len(b_loader.samples):
        raise SystemExit(f"pack_output_diff: {len(a_loader.samples)} samples against {len(b_loader.samples)}")
    for (x, y), (xp, yp) in zip(a_loader, b_loader, strict=True):
        if not np.array_equal(y.numpy(), yp.numpy()):
            raise SystemExit("pack_output_diff: the labels differ: the two datasets are not in the same order")
        d = np.abs(x.numpy().astype(np.int16) - xp.numpy().astype(np.int16))
        total += float(d.sum())
        count += d.size
        samples += x.shape[0]
        worst = max(worst, float(d.reshape(x.shape[0], -1).mean(axis=1).max()))
    print(json.dumps({"samples": samples, "mean_abs_diff": total / count, "worst_sample_mean_abs_diff": worst}))


if __name__ == "__main__":
    main()
