"""Images/s of a plain `for images, labels in loader:` loop (the loop
variables kept, as users write it) for one or more builds of the Python
module, alternating rounds in one run so the machine's noise hits each
alike. Prints each build's median.
    python3 bench/loop_rate.py DATASET build/release/python /tmp/before/python [--rounds 3]"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import sys, time, pinfeed
l = pinfeed.Loader(sys.argv[1], batch_size=64, size=224, transform="random", shuffle=True, seed=0, threads=2)
for images, labels in l:  # warm-up epoch
    pass
t, n = time.perf_counter(), 0
for _ in range(2):
    for images, labels in l:
        n += len(labels)
print(n / (time.perf_counter() - t))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset")
    p.add_argument("builds", nargs="+", help="PYTHONPATH of each build")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    rates = {b: [] for b in a.builds}
    for _ in range(a.rounds):
        for b in a.builds:
            out = subprocess.run([sys.executable, "-c", CHILD, a.dataset], env=dict(os.environ, PYTHONPATH=b),
                                 capture_output=True, text=True, check=True).stdout
            rates[b].append(float(out.split()[-1]))
    first = statistics.median(rates[a.builds[0]])
    for b in a.builds:
        m = statistics.median(rates[b])
        print(json.dumps({"build": b, "images_per_s": [round(r) for r in rates[b]], "median": round(m),
                          "ratio_to_first": round(m / first, 3)}))


if __name__ == "__main__":
    main()
