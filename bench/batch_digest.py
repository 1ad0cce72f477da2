"""SHA-256 of every batch pinfeed.Loader delivers for a fixed seed (random
and center crop, two epochs each): two builds give the same digest when they
deliver the same bytes (docs/results.md, "Tables, signals and CI time").
    PYTHONPATH=build/release/python python3 bench/batch_digest.py DATASET"""
import hashlib
import sys

import pinfeed

h = hashlib.sha256()
for transform in ("random", "center"):
    loader = pinfeed.Loader(sys.argv[1], batch_size=16, transform=transform, size=64, shuffle=True, seed=7, threads=2)
    for epoch in range(2):
        for images, labels in loader:
            h.update(images.numpy().tobytes())
            h.update(labels.numpy().tobytes())
print(h.hexdigest())
