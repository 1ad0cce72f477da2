"""images/s of pinfeed.Loader: one warm-up epoch, then two timed (random
crop 224, 2 threads, batch 64). bench/alternate_rounds.sh runs it against
two builds in turn.
    PYTHONPATH=build/release/python python3 bench/loader_rate.py DATASET"""
import sys
import time

import pinfeed

loader = pinfeed.Loader(sys.argv[1], batch_size=64, threads=2, size=224, transform="random", shuffle=True, seed=3)
for _ in loader:  # warm-up: page cache, the pool
    pass
start, n = time.perf_counter(), 0
for epoch in range(2):
    for images, labels in loader:
        n += images.shape[0]
print(f"{n / (time.perf_counter() - start):.1f}")
