"""Does a DDP rank hang at exit, and does pinfeed play a part? (issue 29,
item 8: a rank seen stuck for 20 minutes in ~ProcessGroupGloo after its
last write, in a script that never called destroy_process_group.)

Runs 2-rank gloo DDP jobs (processes of this machine, env:// rendezvous) a
few steps each, then exits in one of several ways, N times each, and
reports how long each exit took and how many did not end within --limit s:

    loader-alive-no-destroy   a pinfeed.Loader and a live mid-epoch iterator
                              at interpreter exit, no destroy_process_group
    no-loader-no-destroy      the same without pinfeed (torch alone)
    loader-alive-destroy      loader alive, destroy_process_group() at the end
    del-loader-then-destroy   docs/usage.md's order: del it, del loader, destroy

    PYTHONPATH=build/release/python /usr/bin/python3 bench/teardown_loop.py DATA [--runs 10] [--limit 60]
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

RANK_CODE = r"""
import os, sys, time
import torch, torch.distributed as dist
way, data = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3 * 16 * 16, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if way.startswith("no-loader"):
    batches = [(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))) for _ in range(3)]
    it = iter(batches)
else:
    import pinfeed
    loader = pinfeed.Loader(data, batch_size=8, size=16, threads=2, shuffle=True)
    it = iter(loader)
for _ in range(3):
    x, y = next(it)
    loss = torch.nn.functional.cross_entropy(model(x.flatten(1)), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("last write", flush=True)
if way == "del-loader-then-destroy":
    del it, loader
if way.endswith("-destroy") and not way.endswith("no-destroy"):
    dist.destroy_process_group()
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_job(way, data, limit):
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_CODE, way, data], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    # From the last write to the process's end: read the line, then wait.
    written, ends, hung = [], [], 0
    for p in procs:
        line = p.stdout.readline()
        written.append(time.perf_counter())
        if "last write" not in line:
            p.wait()
            raise SystemExit(f"{way}: a rank failed before its last write: {p.stderr.read()[-2000:]}")
    for p, t in zip(procs, written):
        try:
            p.wait(timeout=max(1.0, limit - (time.perf_counter() - t)))
            ends.append(time.perf_counter() - t)
        except subprocess.TimeoutExpired:
            hung += 1
            p.kill()
            p.wait()
        if p.returncode not in (0, None) and hung == 0:
            raise SystemExit(f"{way}: a rank exited {p.returncode}: {p.stderr.read()[-2000:]}")
    return max(ends) if ends else None, hung


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--limit", type=float, default=60.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    ways = ["loader-alive-no-destroy", "no-loader-no-destroy", "loader-alive-destroy", "del-loader-then-destroy"]
    results = {w: {"exit_s": [], "hung": 0} for w in ways}
    for _ in range(args.runs):
        for way in ways:  # alternating
            seconds, hung = one_job(way, args.data, args.limit)
            if seconds is not None:
                results[way]["exit_s"].append(round(seconds, 3))
            results[way]["hung"] += hung
    if args.json:
        print(json.dumps(results))
        return
    for way, r in results.items():
        s = sorted(r["exit_s"])
        med = s[len(s) // 2] if s else float("nan")
        print(f"{way:<26} exits after the last write: median {med:.3f} s, max {max(s) if s else float('nan'):.3f} s; "
              f"ranks hung past {args.limit:.0f} s: {r['hung']} of {2 * args.runs}")


if __name__ == "__main__":
    main()
