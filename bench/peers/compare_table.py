#!/usr/bin/env python3
"""compare.sh's table and bar chart from its CSV (round, loader, images/s):
each loader's per-round rates, their median and pinfeed's float32 rate over
it (the ratios come from medians of the same alternating rounds)."""
import argparse
import csv
import statistics
from collections import OrderedDict

LABELS = {
    "pinfeed-nchw-f32": "pinfeed-bench loader, float32 NCHW",
    "pinfeed-nhwc-u8": "pinfeed-bench loader, uint8 NHWC",
    "pinfeed-python": "pinfeed through Python, float32",
    "dali-cpu": "NVIDIA DALI, CPU pipeline",
    "ffcv": "FFCV (original JPEGs in its .beton)",
    "pytorch": "PyTorch DataLoader + torchvision",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--csv", required=True)
    p.add_argument("--out", required=True, help="prefix: writes PREFIX.md and PREFIX.png")
    p.add_argument("--title", default="")
    a = p.parse_args()

    rates: "OrderedDict[str, list]" = OrderedDict()
    with open(a.csv, newline="") as f:
        for row in csv.DictReader(f):
            rates.setdefault(row["loader"], []).append(float(row["images_per_s"]))
    if not rates:
        raise SystemExit(f"compare_table: {a.csv} holds no rows")
    medians = {k: statistics.median(v) for k, v in rates.items()}
    ours = medians.get("pinfeed-nchw-f32")
    lines = [f"{a.title}" if a.title else "", "",
             "| loader | images/s per round | median | pinfeed f32 / this |", "| --- | --- | --- | --- |"]
    for k, v in rates.items():
        ratio = f"{ours / medians[k]:.2f}x" if ours else "-"
        lines.append(f"| {LABELS.get(k, k)} | {', '.join(f'{x:.0f}' for x in v)} | {medians[k]:.0f} | {ratio} |")
    table = "\n".join(lines).strip() + "\n"
    with open(a.out + ".md", "w") as f:
        f.write(table)
    print(table, end="")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(rates)
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(names) + 1.6))
    colors = ["#1f77b4" if n.startswith("pinfeed") else "#999999" for n in names]
    y = range(len(names))
    ax.barh(y, [medians[n] for n in names], color=colors)
    for i, n in enumerate(names):
        ax.plot(rates[n], [i] * len(rates[n]), "k|", markersize=12)  # each round
        ax.text(max(rates[n]), i, f"   {medians[n]:.0f}", va="center")
    ax.set_yticks(list(y), [LABELS.get(n, n) for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("images/s (bar: median of the rounds; ticks: each round)")
    ax.set_title(a.title, fontsize=10)
    ax.set_xlim(0, max(max(v) for v in rates.values()) * 1.18)
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=100)
    print(f"wrote {a.out}.md and {a.out}.png")


if __name__ == "__main__":
    main()
