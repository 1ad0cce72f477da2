#!/usr/bin/env python3
"""Two builds of pinfeed-bench, side by side: `pinfeed-bench loader` from
each in alternating rounds on the same data, the medians of the loader's
images/s, of the matching decode (the same crops and scales, nothing else)
and of the pipeline overhead over it, per layout. On a shared, noisy
machine only figures from one such run are compared.

    python3 bench/ab_loader.py BEFORE/pinfeed-bench AFTER/pinfeed-bench --data DIR \\
        [--threads 2] [--rounds 3] [--layouts nchw-f32,nhwc-u8] [--json]

The overhead is pinfeed-bench's "pipeline overhead vs matching decode": one
less the loader's images/s over the matching decode's, same run."""
import argparse
import json
import statistics
import subprocess


def run(binary, data, layout, threads, epochs, ceiling_files, extra):
    out = subprocess.run([binary, "loader", "--data", data, "--threads", str(threads), "--layout", layout,
                          "--epochs", str(epochs), "--repeat", "1", "--ceiling-files", str(ceiling_files), "--json",
                          *extra], check=True, capture_output=True, text=True).stdout
    j = json.loads(out[out.index("{"):])
    loader, matching = j["loader"]["images_per_s"], j["ceiling"]["planned_images_per_s"]
    return {"loader": loader, "matching": matching, "overhead": j["overhead_vs_planned_decode"],
            "per_image_us": j["loader"]["per_image_us"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--data", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ceiling-files", type=int, default=200)
    p.add_argument("--layouts", default="nchw-f32,nhwc-u8")
    p.add_argument("--json", action="store_true")
    p.add_argument("extra", nargs="*", help="more pinfeed-bench loader flags (after --)")
    a = p.parse_args()
    results = {}
    for layout in a.layouts.split(","):
        rounds = {"before": [], "after": []}
        for _ in range(a.rounds):
            for name in ("before", "after"):
                rounds[name].append(run(getattr(a, name), a.data, layout, a.threads, a.epochs, a.ceiling_files,
                                        a.extra))
        med = {name: {k: statistics.median(r[k] for r in rs) for k in ("loader", "matching", "overhead")}
               for name, rs in rounds.items()}
        med["after_over_before"] = med["after"]["loader"] / med["before"]["loader"]
        results[layout] = dict(medians=med, rounds=rounds)
        if not a.json:
            b, f = med["before"], med["after"]
            print(f"{layout}: loader {b['loader']:.0f} -> {f['loader']:.0f} images/s "
                  f"({med['after_over_before']:.3f}x); matching decode {b['matching']:.0f} / {f['matching']:.0f}; "
                  f"overhead {b['overhead'] * 100:+.1f}% -> {f['overhead'] * 100:+.1f}% "
                  f"(medians of {a.rounds} alternating rounds, {a.threads} threads)")
    if a.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
