#!/usr/bin/env python3
"""A plain training loop under real memory pressure (issue 38): a memory
cgroup of the test's own (650 MiB, no swap), the Python loader in it running
`for images, labels in loader:` that keeps its loop variables (no `del`), and
a neighbour in the same cgroup.

  stall   the neighbour takes 400 MiB (32 MiB steps) and holds it 20 s: the
          pool shrinks to its floor; the longest gap between batches must
          stay under 5 s (the landed main stalled 17-30 s).
  steady  the neighbour keeps the cgroup at 5-10% free for 30 s (pressure
          that never lifts): batches keep coming (longest gap under 5 s).
  burst   the neighbour allocates 400 MiB in 32 MiB chunks back to back, no
          sleep, at memory speed: nobody is OOM-killed, --runs times in a row
          (the landed main was killed 3 of 3).

Each run prints its figures (gaps, images/s before and while squeezed, the
loader's first "-> critical" and the release time). Exit 0 passed, 1 failed,
77 skipped (no root or no writable memory cgroup).

    PYTHONPATH=build/release/python python3 tests/pressure/loop_pressure.py stall \\
        --make-data build/release/tools/pinfeed-data
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cgroup_squeeze import MiB, Cgroup, skip, wait_or_kill  # noqa: E402

LIMIT = 650 * MiB
NEIGHBOUR = 400 * MiB
STEP = 32 * MiB
SLOTS, FLOOR, BATCH, SIZE = 12, 2, 64, 128
MAX_GAP = 5.0


def touch(n):
    b = bytearray(n)
    for i in range(0, n, 4096):
        b[i] = 1
    return b


def run_neighbour(mode, cgroup_dir, version):
    blocks = []
    if mode in ("stall", "burst"):
        while len(blocks) * STEP < NEIGHBOUR:
            blocks.append(touch(STEP))
            if mode == "stall":
                time.sleep(0.1)
        print(f"neighbour: holding {len(blocks) * STEP // MiB} MiB", flush=True)
        time.sleep(20.0 if mode == "stall" else 3.0)
        return 0
    # steady: keep the cgroup's free share between 5 and 10% for 30 s, free
    # counted as the loader's monitor counts it (limit - usage + inactive
    # file): page cache charged here (a cold cache) is not mistaken for
    # pressure, nor is the room it leaves mistaken for none.
    usage_file = os.path.join(cgroup_dir, "memory.usage_in_bytes" if version == "v1" else "memory.current")
    inactive_key = "total_inactive_file" if version == "v1" else "inactive_file"
    chunk = 4 * MiB
    end = time.time() + 30
    first = None
    while time.time() < end:
        with open(usage_file) as f:
            usage = int(f.read())
        with open(os.path.join(cgroup_dir, "memory.stat")) as f:
            inactive = next((int(v) for k, v in (line.split() for line in f) if k == inactive_key), 0)
        free = (LIMIT - usage + min(inactive, usage)) / LIMIT
        if free > 0.09:
            blocks.append(touch(chunk))
        elif free < 0.06 and blocks:
            blocks.pop()
        elif first is None:
            first = time.time()
            print(f"neighbour: cgroup at {free * 100:.1f}% free holding {len(blocks) * chunk // MiB} MiB", flush=True)
        time.sleep(0.02)
    print(f"neighbour: held {len(blocks) * chunk // MiB} MiB at the end", flush=True)
    return 0


def run_consumer(data, out, stop_file):
    import pinfeed
    pinfeed.set_log_level("debug")  # the pool's slab moves, stamped: what a failure report shows
    progress = os.open(out + ".progress", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    loader = pinfeed.Loader(data, batch_size=BATCH, size=SIZE, prefetch=SLOTS, threads=2, pressure_floor=FLOOR,
                            seed=0, return_indices=True, shuffle=True)
    times, epochs = [], []
    while not os.path.exists(stop_file):
        seen = []
        for images, labels, indices in loader:  # the loop variables are kept: no del
            float(images[0, 0, 0, 0])
            seen.extend(indices.tolist())
            times.append(time.time())
            os.pwrite(progress, b"%-20.3f\n" % times[-1], 0)  # the watcher's view of the loop
        epochs.append(sorted(seen))
        if len(epochs) == 1:
            with open(out + ".ready", "w") as f:
                json.dump(loader.stats()["pool"], f)
    with open(out, "w") as f:
        json.dump({"times": times, "epochs": epochs, "n": len(loader.samples), "pool": loader.stats()["pool"]}, f)
    return 0


def watch(pid, progress, neighbour, cg):
    """Waits for the neighbour. The first time the consumer's loop goes 3 s
    without a batch, takes what the kernel says each of its threads is doing
    (wchan, kernel stack) and the cgroup's memory.stat: a stall's report
    says where it was, not only that it was."""
    report = []
    while neighbour.poll() is None:
        time.sleep(0.2)
        try:
            with open(progress) as f:
                last = float(f.read().strip() or 0)
        except (OSError, ValueError):
            continue
        if report or not last or time.time() - last < 3.0:
            continue
        report.append(f"stall: no batch for {time.time() - last:.1f} s; the consumer's threads:")
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            base = f"/proc/{pid}/task/{tid}"
            try:
                comm = open(f"{base}/comm").read().strip()
                state = open(f"{base}/stat").read().rsplit(")", 1)[1].split()[0]
                wchan = open(f"{base}/wchan").read().strip()
                stack = " <- ".join(line.split()[-1] for line in open(f"{base}/stack").read().splitlines()[:8])
            except OSError as e:
                comm, state, wchan, stack = "?", "?", "?", str(e)
            report.append(f"  {tid} {comm} {state} wchan={wchan} {stack}")
        keys = ("total_rss", "total_cache", "total_inactive_file", "total_active_file", "total_pgmajfault", "anon",
                "file", "inactive_file", "active_file", "pgmajfault")
        stat = {k: v for k, v in (line.split() for line in cg.read("memory.stat").splitlines()) if k in keys}
        report.append(f"  cgroup memory.stat: {stat}")
    return report


def one_run(args, mode):
    cg = Cgroup(LIMIT)
    work = tempfile.mkdtemp(prefix="pinfeed-loop-")
    out, stop, log = (os.path.join(work, n) for n in ("out.json", "stop", "log"))
    failures, consumer, neighbour = [], None, None
    try:
        logf = open(log, "w")
        consumer = subprocess.Popen([sys.executable, __file__, "_consumer", "--data", args.data, "--out", out,
                                     "--stop", stop], stdout=logf, stderr=subprocess.STDOUT, preexec_fn=cg.enter())
        deadline = time.time() + 120
        while not os.path.exists(out + ".ready") and consumer.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        if consumer.poll() is not None or not os.path.exists(out + ".ready"):
            print(open(log, errors="replace").read()[-3000:])
            return [f"the consumer did not start (exit {consumer.poll()})"]
        time.sleep(0.5)
        pool = json.load(open(out + ".ready"))
        anon = cg.anon_bytes()
        give_back = (pool["slots"] - FLOOR) * pool["slot_bytes"]
        print(f"[{mode}] cgroup {cg.version} {LIMIT // MiB} MiB; consumer anon {anon / MiB:.0f} MiB with a pool of "
              f"{pool['slots']} x {pool['slot_bytes'] / MiB:.1f} MiB; neighbour {NEIGHBOUR // MiB} MiB: "
              f"{(anon + NEIGHBOUR - LIMIT) / MiB:+.0f} MiB over the limit unless the pool gives back "
              f"(it can give {give_back / MiB:.0f} MiB)", flush=True)
        if anon + NEIGHBOUR <= LIMIT * 0.95 and mode != "steady":
            failures.append(f"premise: consumer {anon / MiB:.0f} MiB + neighbour fits the limit: nothing is tested")
        t_start = time.time()
        neighbour = subprocess.Popen([sys.executable, __file__, "_neighbour", "--mode", mode, "--cgroup", cg.path,
                                      "--version", cg.version], stdout=logf, stderr=subprocess.STDOUT,
                                     preexec_fn=cg.enter())
        stuck = watch(consumer.pid, out + ".progress", neighbour, cg)
        t_end = time.time()
        time.sleep(1.0)
        open(stop, "w").close()
        wait_or_kill(consumer, 120, failures, "the consumer did not finish its epoch within 120 s of the neighbour's exit")
        logf.close()
        text = open(log, errors="replace").read()
        if neighbour.returncode != 0:
            failures.append(f"the neighbour exited with {neighbour.returncode}"
                            f"{' (OOM-killed)' if neighbour.returncode in (-9, 137) else ''}")
        if consumer.returncode != 0:
            failures.append(f"the consumer exited with {consumer.returncode}"
                            f"{' (OOM-killed)' if consumer.returncode in (-9, 137) else ''}")
        if os.path.exists(out):
            result = json.load(open(out))
            times = [t for t in result["times"]]
            inside = [t for t in times if t_start <= t <= t_end]
            edges = [t_start] + inside + [t_end]
            gap = max(b - a for a, b in zip(edges, edges[1:]))
            before = [t for t in times if t < t_start]
            rate_before = (len(before) - 1) * BATCH / (before[-1] - before[0]) if len(before) > 2 else float("nan")
            rate_in = len(inside) * BATCH / (t_end - t_start)
            print(f"[{mode}] longest gap between batches while the neighbour ran: {gap:.2f} s; images/s before "
                  f"{rate_before:.0f}, during {rate_in:.0f}; pool at the end: {result['pool']['live_slots']}/"
                  f"{result['pool']['slots']} live, releases {result['pool']['releases']}, last release "
                  f"{result['pool']['last_release_seconds'] * 1000:.0f} ms, lent {result['pool'].get('lends', 0)}",
                  flush=True)
            if mode in ("stall", "steady") and gap >= MAX_GAP:
                failures.append(f"a gap of {gap:.1f} s between batches (>= {MAX_GAP} s)")
            for k, seen in enumerate(result["epochs"]):
                if seen != list(range(result["n"])):
                    failures.append(f"epoch {k}: {len(seen)} samples, {len(set(seen))} distinct, not 0..n-1 once")
                    break
        elif not failures:
            failures.append("the consumer wrote no result")
        for line in text.splitlines():
            if "-> critical" in line or "gave" in line or "neighbour:" in line or "held by" in line:
                print(f"  {line}")
        if mode == "steady" and not any(m in text for m in ("-> critical", "-> elevated")):
            failures.append("premise: the loader's monitor never saw pressure: nothing is tested")
        if failures:
            print("\n".join(text.splitlines()[-30:]))
            print("\n".join(stuck) if stuck else "(the batches never stopped for 3 s while the neighbour ran)")
    finally:
        for p in (consumer, neighbour):
            if p and p.poll() is None:
                p.kill()
                p.wait()
        cg.close()
    return failures


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["stall", "steady", "burst", "_consumer", "_neighbour"])
    p.add_argument("--data")
    p.add_argument("--make-data", metavar="PINFEED_DATA")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--out")
    p.add_argument("--stop")
    p.add_argument("--cgroup")
    p.add_argument("--version")
    p.add_argument("--mode", dest="neighbour_mode")
    args = p.parse_args()
    if args.mode == "_neighbour":
        return run_neighbour(args.neighbour_mode, args.cgroup, args.version)
    if args.mode == "_consumer":
        return run_consumer(args.data, args.out, args.stop)
    if os.geteuid() != 0:
        skip("needs root to make a memory cgroup")
    if args.make_data:
        tmp = tempfile.mkdtemp(prefix="pinfeed-loop-data-")
        subprocess.run([args.make_data, "-q", "make", "--out", tmp, "--classes", "4", "--per-class", "64", "--val",
                        "0", "--seed", "1"], check=True)
        args.data = os.path.join(tmp, "train")
    failures = []
    for run in range(args.runs):
        got = one_run(args, args.mode)
        failures += [f"run {run + 1}: {f}" for f in got]
    for f in failures:
        print(f"FAIL: {f}")
    if not failures:
        print(f"PASS: {args.mode} ({args.runs} run(s))")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
