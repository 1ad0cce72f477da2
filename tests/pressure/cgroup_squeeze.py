#!/usr/bin/env python3
"""The loader under real memory pressure: a memory cgroup, no swap, and a
process growing beside it.

The driver makes its own memory cgroup (v2 where the memory controller can be
used, else v1), starts a consumer in it (the Python loader, or pinfeed-train
--devices cpu:2) with a pool of 16 slots, measures the cgroup's anonymous
memory once the pool is up, then starts a second process in the same cgroup
that grows its anonymous memory 32 MiB at a time to a size chosen so that
the consumer plus the grower exceed the limit by half of what the pool can
give back: a pool that does not shrink gets the cgroup's OOM killer (as the
landed main did: the loader was killed with exit 137), one that shrinks
leaves room. The grower holds its memory for 7 s (past the
monitor's 5 s hold, so the pool must grow back only into the room left) and
exits.

It asserts: the consumer is not killed, the grower completes, every epoch
delivers every sample exactly once (indices checked), the consumer's
anonymous RSS falls by (slots - floor) x slot bytes (99% of it: other
allocations move a little meanwhile) within 2 s of
the pool's "memory pressure ... -> critical" log line, and VmLck is back to
all slots pinned within 10 s after the grower exits.

Exit codes: 0 passed, 1 failed, 77 skipped (no writable memory cgroup: the
reason is printed, "SKIP: ..."; ctest shows it as skipped).

    PYTHONPATH=build/release/python python3 tests/pressure/cgroup_squeeze.py loader \
        --make-data build/release/tools/pinfeed-data            # the Python loader
    python3 tests/pressure/cgroup_squeeze.py train --make-data build/release/tools/pinfeed-data \
        --train-tool build/release/tools/pinfeed-train          # pinfeed-train --devices cpu:2
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime

MiB = 1 << 20
SLOTS = 16
FLOOR = 2
BATCH = 64
SIZE = 224
PAGE = os.sysconf("SC_PAGE_SIZE")


def slot_bytes(batch):
    """A pool slot: the float32 NCHW batch, then its int32 labels at a 64-byte boundary, page-rounded."""
    raw = (batch * 3 * SIZE * SIZE * 4 + 63) // 64 * 64 + batch * 4
    return (raw + PAGE - 1) // PAGE * PAGE

LIMIT = 1536 * MiB
STEP = 32 * MiB
# The grower holds its memory longer than the monitor's 5 s hold: "normal"
# comes while it still holds, and the pool may grow back only into the room
# left (the loader's may_grow check), not into an OOM kill.
HOLD = 7.0
# Other memory of the consumer may move a little while the pool shrinks
# (allocator caches, a training step): the fall must reach 99% of what the
# pool gives back. A pool that does not shrink falls by nothing.
TOLERANCE = 0.99


def skip(reason):
    print(f"SKIP: {reason}", flush=True)
    sys.exit(77)


# ---------------------------------------------------------------- cgroups

def mounts():
    with open("/proc/self/mounts") as f:
        for line in f:
            dev, where, kind, opts = line.split()[:4]
            yield where, kind, opts.split(",")


class Cgroup:
    """A memory cgroup of our own, removed on close."""

    def __init__(self, limit, swap=False):
        self.path = None
        self.swap = swap
        errors = []
        for make in (self._v2, self._v1):
            try:
                if make(limit):
                    return
            except OSError as e:
                errors.append(f"{make.__name__[1:]}: {e}")
                self.close()
        skip("no writable memory cgroup (" + ("; ".join(errors) or "neither v1 nor v2 has a memory controller") + ")")

    def _v2(self, limit):
        for where, kind, _ in mounts():
            if kind != "cgroup2":
                continue
            with open(os.path.join(where, "cgroup.controllers")) as f:
                if "memory" not in f.read().split():
                    continue
            # A child of the mount's root (no processes live there in v2).
            with open(os.path.join(where, "cgroup.subtree_control")) as f:
                if "memory" not in f.read().split():
                    with open(os.path.join(where, "cgroup.subtree_control"), "w") as w:
                        w.write("+memory")
            self.version = "v2"
            self.path = os.path.join(where, f"pinfeed-squeeze-{os.getpid()}")
            os.mkdir(self.path)
            self.write("memory.max", str(limit))
            if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                self.write("memory.swap.max", "max" if self.swap else "0")
            return True
        return False

    def _v1(self, limit):
        for where, kind, opts in mounts():
            if kind != "cgroup" or "memory" not in opts:
                continue
            own = ""
            with open("/proc/self/cgroup") as f:
                for line in f:
                    _, controllers, path = line.rstrip("\n").split(":", 2)
                    if "memory" in controllers.split(","):
                        own = path.lstrip("/")
            self.version = "v1"
            self.path = os.path.join(where, own, f"pinfeed-squeeze-{os.getpid()}")
            os.mkdir(self.path)
            self.write("memory.limit_in_bytes", str(limit))
            if not self.swap and os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                self.write("memory.memsw.limit_in_bytes", str(limit))
            self.write("memory.swappiness", "60" if self.swap else "0")
            return True
        return False

    def write(self, name, value):
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def read(self, name):
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def stat(self, key):
        for line in self.read("memory.stat").splitlines():
            k, v = line.split()
            if k == key:
                return int(v)
        return 0

    def swap_bytes(self):
        return self.stat("swap") if self.version == "v2" else self.stat("total_swap")

    def file_bytes(self):
        return self.stat("file") if self.version == "v2" else self.stat("total_cache")

    def anon_bytes(self):
        return self.stat("anon") if self.version == "v2" else self.stat("total_rss")

    def enter(self):
        """For subprocess's preexec_fn: move the child into the cgroup."""
        path = self.path
        return lambda: open(os.path.join(path, "cgroup.procs"), "w").write(str(os.getpid()))

    def close(self):
        if not self.path or not os.path.isdir(self.path):
            return
        for _ in range(50):  # the last tasks leave asynchronously
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


def wait_or_kill(proc, timeout, failures, message):
    """Waits for `proc`; past `timeout` it is killed and `message` is a failure."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        failures.append(message)


# ---------------------------------------------------------------- children

def run_grower(target, step, hold):
    """Grows anonymous memory step by step (every page touched), holds it, exits."""
    blocks = []
    while len(blocks) * step < target:
        b = bytearray(step)
        for i in range(0, step, 4096):  # touch: a bytearray is zeroed by calloc, maybe untouched
            b[i] = 1
        blocks.append(b)
        time.sleep(0.2)
    print(f"grower: holding {len(blocks) * step // MiB} MiB", flush=True)
    time.sleep(hold)
    return 0


def run_loader(data, out, stop_file):
    import pinfeed
    loader = pinfeed.Loader(data, batch_size=BATCH, size=SIZE, prefetch=SLOTS, threads=2, pin_memory=True,
                            return_indices=True, pressure_floor=FLOOR, seed=0)
    n = len(loader.dataset) if hasattr(loader, "dataset") else None
    epochs = []
    batch_times = []
    epoch = 0
    while True:
        seen = []
        for images, labels, indices in loader:
            seen.extend(int(i) for i in indices)
            del images, labels
            batch_times.append(time.time())
        epochs.append(seen)
        pool = loader.stats()["pool"]
        print(f"loader: epoch {epoch} {len(seen)} samples, pool live {pool['live_slots']}/{pool['slots']}, "
              f"pinned {pool['pinned_slots']}, pressure {pool['pressure']}", flush=True)
        if epoch == 0:
            with open(out + ".ready", "w") as f:
                json.dump({"slot_bytes": pool["slot_bytes"], "slots": pool["slots"]}, f)
        epoch += 1
        if os.path.exists(stop_file):
            break
    with open(out, "w") as f:
        json.dump({"epochs": epochs, "n": n, "pool": loader.stats()["pool"], "batch_times": batch_times}, f)
    return 0


# ---------------------------------------------------------------- driver

def status(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    fields = dict(re.findall(r"^(\w+):\s+(\d+) kB", text, re.M))
    return {k: int(v) * 1024 for k, v in fields.items()}


def major_faults(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[9])  # majflt, the 12th field
    except (OSError, IndexError, ValueError):
        return 0


LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\]")


def log_times(path, pattern):
    """Wall-clock times of the log lines matching `pattern` (spdlog's default stamp)."""
    times = []
    with open(path, errors="replace") as f:
        for line in f:
            m = LOG_TIME.match(line)
            if m and re.search(pattern, line):
                times.append(datetime.strptime(m.group(1)[:26], "%Y-%m-%d %H:%M:%S.%f").timestamp())
    return times


def drive(args):
    if os.geteuid() != 0:
        skip("needs root to make a memory cgroup")
    with open("/proc/meminfo") as f:
        host_swap = int(re.search(r"SwapTotal:\s+(\d+)", f.read()).group(1)) * 1024
    if args.with_swap and host_swap == 0:
        skip("--with-swap needs swap on the host (bench/pressure_swap.sh makes a swap file)")
    # Without --with-swap the cgroup may not swap (v2 memory.swap.max 0, v1
    # memory + swap limit = limit where the kernel accounts swap, swappiness 0).
    cg = Cgroup(LIMIT, swap=args.with_swap)
    failures = []
    work = tempfile.mkdtemp(prefix="pinfeed-squeeze-")
    out, stop_file, log = os.path.join(work, "result.json"), os.path.join(work, "stop"), os.path.join(work, "log")
    consumer = grower = None
    samples = []  # (wall time, RssAnon, VmLck, major faults, cgroup file, VmSwap, cgroup swap)
    try:
        env = dict(os.environ)
        if args.mode == "loader":
            cmd = [sys.executable, __file__, "_loader", "--data", args.data, "--out", out, "--stop", stop_file]
            pools, slot = 1, slot_bytes(BATCH)
        else:
            # Two CPU workers, each with its own loader and pool of 16 slots
            # of half the global batch (float32 on the host, so the slots are
            # the loader's size); it trains until stopped (SIGTERM).
            cmd = [args.train_tool, "--data", args.data, "--devices", "cpu:2", "--epochs", "100000",
                   "--batch-size", str(BATCH), "--size", str(SIZE), "--prefetch", str(SLOTS), "--pressure-floor",
                   str(FLOOR), "--host-normalize", "--loader-threads", "2"]
            pools, slot = 2, slot_bytes(BATCH // 2)
        print(f"cgroup {cg.version} {cg.path}, limit {LIMIT // MiB} MiB; consumer: {' '.join(cmd)}", flush=True)
        logf = open(log, "w")
        consumer = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, preexec_fn=cg.enter())

        def sample():
            st = status(consumer.pid)
            if st:
                samples.append((time.time(), st.get("RssAnon", 0), st.get("VmLck", 0), major_faults(consumer.pid),
                                cg.file_bytes(), st.get("VmSwap", 0), cg.swap_bytes()))

        ready = out + ".ready" if args.mode == "loader" else None
        deadline = time.time() + 180
        while time.time() < deadline and consumer.poll() is None:
            if (ready and os.path.exists(ready)) or (not ready and "epoch 1/" in open(log, errors="replace").read()):
                break
            time.sleep(0.2)
        if consumer.poll() is not None:
            print(open(log, errors="replace").read()[-4000:])
            raise AssertionError(f"the consumer ended before its first epoch (exit {consumer.returncode})")
        time.sleep(1.0)
        pool_bytes = pools * SLOTS * slot
        anon = cg.anon_bytes()
        give_back = pools * (SLOTS - FLOOR) * slot
        target = LIMIT - anon + give_back // 2
        print(f"cgroup anon {anon // MiB} MiB with {pools} pool(s) of {SLOTS} x {slot / MiB:.1f} MiB up; "
              f"the pool can give back {give_back // MiB} MiB; the grower takes {target // MiB} MiB: "
              f"{(anon + target - LIMIT) // MiB} MiB over the limit unless the pool shrinks", flush=True)
        grower = subprocess.Popen([sys.executable, __file__, "_grower", "--target", str(target)],
                                  stdout=logf, stderr=subprocess.STDOUT, preexec_fn=cg.enter())
        while grower.poll() is None and consumer.poll() is None:
            sample()
            time.sleep(0.05)
        grower.wait()
        grower_end = time.time()
        print(f"grower exited at {datetime.fromtimestamp(grower_end).strftime('%H:%M:%S.%f')[:-3]}", flush=True)
        # 5 s of hold before "normal", then the regrowth: watch for up to 20 s.
        while consumer.poll() is None and time.time() < grower_end + 20:
            sample()
            if samples[-1][2] >= pool_bytes and time.time() > grower_end + 1:
                break
            time.sleep(0.05)
        alive = consumer.poll() is None
        open(stop_file, "w").close()
        if args.mode == "train" and alive:
            consumer.send_signal(signal.SIGTERM)
        wait_or_kill(consumer, 120, failures, "the consumer did not stop within 120 s of being asked")
        logf.close()

        # --- what happened
        text = open(log, errors="replace").read()
        if not alive or (consumer.returncode != 0 and args.mode == "loader"):
            failures.append(f"the consumer exited with {consumer.returncode}"
                            f"{' (killed: the OOM killer)' if consumer.returncode in (-9, 137) else ''}")
        if grower.returncode != 0:
            failures.append(f"the grower exited with {grower.returncode} (killed: the pool left it no room)")
        critical = log_times(log, r"memory pressure \w+ -> critical")
        if not critical:
            failures.append("the loader never saw critical pressure")
        else:
            t0 = critical[0]
            before = [s for s in samples if s[0] <= t0]
            base = before[-1][1] if before else samples[0][1]
            within = [s for s in samples if t0 <= s[0] <= t0 + 2.0]
            low = min((s[1] for s in within), default=base)
            drop = base - low
            print(f"critical at +{t0 - samples[0][0]:.2f} s ({critical[0] and 'log'}): RssAnon {base / MiB:.0f} MiB "
                  f"-> {low / MiB:.0f} MiB within 2 s (fell {drop / MiB:.0f} MiB; needed {give_back / MiB:.0f})",
                  flush=True)
            if drop < give_back * TOLERANCE:
                failures.append(f"RssAnon fell {drop / MiB:.0f} MiB within 2 s of critical, "
                                f"less than 99% of (slots - floor) x slot bytes = {give_back / MiB:.0f} MiB")
        repinned = [s[0] for s in samples if s[0] >= grower_end and s[2] >= pool_bytes]
        if not repinned:
            last = samples[-1][2] if samples else 0
            failures.append(f"VmLck {last / MiB:.0f} MiB, not back to the whole pool ({pool_bytes / MiB:.0f} MiB) "
                            f"within 20 s of the grower's exit")
        else:
            print(f"all {pools * SLOTS} slots pinned again {repinned[0] - grower_end:.2f} s after the grower exited", flush=True)
            if repinned[0] - grower_end > 10:
                failures.append(f"re-pinned {repinned[0] - grower_end:.1f} s after the grower exited (> 10 s)")
        if args.mode == "loader":
            if os.path.exists(out):
                result = json.load(open(out))
                failures += check_loader_epochs(result)
                report_phases(result["batch_times"], log, samples)
            else:
                failures.append("the loader wrote no result")
        else:
            failures += check_train_epochs(text, grower_end)
        shrink = re.findall(r"gave \d+ slot\(s\) \([^)]*\) back to the kernel in \d+ ms[^\n]*", text)
        grow = re.findall(r"pressure gone: [^\n]*", text)
        for line in text.splitlines():
            if "memory pressure" in line or "grower:" in line:
                print(line, flush=True)
        for line in shrink[:1] + grow[:1]:
            print(f"pool: {line}", flush=True)
        if not shrink:
            failures.append("no 'gave ... back to the kernel' warning from the pool")
    finally:
        for p in (consumer, grower):
            if p and p.poll() is None:
                p.kill()
                p.wait()
        cg.close()
    if args.with_swap and samples:
        print(f"swap: the consumer's VmSwap peaked at {max(s[5] for s in samples) / MiB:.0f} MiB, the cgroup's swap "
              f"at {max(s[6] for s in samples) / MiB:.0f} MiB", flush=True)
        for f in failures:
            print(f"note: {f}")
        dead = [f for f in failures if "exited with" in f]
        print("consumer and grower alive" if not dead else "; ".join(dead))
        return 1 if any("consumer" in f for f in dead) else 0
    if failures:
        print("---- consumer log (last 60 lines)")
        print("\n".join(open(log, errors="replace").read().splitlines()[-60:]))
        for f in failures:
            print(f"FAIL: {f}")
        return 1
    print(f"PASS: {args.mode} survived the squeeze")
    return 0


def report_phases(batch_times, log, samples):
    """Images/s before the squeeze, while the pool is shrunk, and after it grew back (measured, not asserted)."""
    crit = log_times(log, r"memory pressure \w+ -> critical")
    gone = log_times(log, r"buffer pool: pressure gone")
    took = re.findall(r"buffer pool: pressure gone: .* back in (\d+) ms", open(log, errors="replace").read())
    if not (crit and gone and took):
        return
    normal = [gone[0] - int(took[0]) / 1000]  # the pool's own count from "normal" to every slot back
    def rate(lo, hi):
        n = sum(1 for t in batch_times if lo < t <= hi)
        return n * BATCH / (hi - lo) if hi > lo and n > 1 else float("nan")
    start = batch_times[min(8, len(batch_times) - 1)]  # past the first epoch's start-up
    def cache(lo, hi):
        inside = sorted(s[4] for s in samples if lo <= s[0] <= hi)
        return inside[len(inside) // 2] / MiB if inside else float("nan")
    def faults(lo, hi):
        inside = [s[3] for s in samples if lo <= s[0] <= hi]
        return (inside[-1] - inside[0]) / (hi - lo) if len(inside) > 1 and hi > lo else float("nan")
    print(f"images/s: before {rate(start, crit[0]):.0f}, shrunk to the floor {rate(crit[0], normal[0]):.0f} "
          f"({normal[0] - crit[0]:.1f} s), after regrowth {rate(gone[0], batch_times[-1]):.0f}; "
          f"regrowth took {gone[0] - normal[0]:.2f} s after 'normal'; the consumer's major page faults/s: "
          f"before {faults(samples[0][0], crit[0]):.0f}, shrunk {faults(crit[0], normal[0]):.0f}; the cgroup's page "
          f"cache: before {cache(samples[0][0], crit[0]):.0f} MiB, shrunk {cache(crit[0], normal[0]):.0f} MiB", flush=True)


def check_loader_epochs(result):
    failures = []
    epochs = result["epochs"]
    n = max(len(e) for e in epochs)
    for k, seen in enumerate(epochs):
        if sorted(seen) != list(range(n)):
            failures.append(f"epoch {k}: {len(seen)} samples, {len(set(seen))} distinct; expected 0..{n - 1} once each")
    print(f"{len(epochs)} epochs, each of the {n} samples exactly once", flush=True)
    return failures


EPOCH_LINE = re.compile(r"^epoch (\d+)/\d+ .* batches (\d+) pinned / (\d+) pageable .* (\d+)/(\d+) slots live")


def check_train_epochs(text, grower_end):
    """Every finished epoch of pinfeed-train delivered as many batches as the first; some ran shrunk."""
    failures = []
    epochs = [tuple(int(g) for g in m.groups()) for m in map(EPOCH_LINE.match, text.splitlines()) if m]
    if len(epochs) < 3:
        return [f"pinfeed-train finished {len(epochs)} epoch(s); expected training to go on through the squeeze"]
    per_epoch = epochs[0][1] + epochs[0][2]
    for e, pinned, pageable, live, slots in epochs:
        if pinned + pageable != per_epoch:
            failures.append(f"epoch {e}: {pinned + pageable} batches, the first had {per_epoch}")
    shrunk = [e for e in epochs if e[3] < e[4]]
    print(f"pinfeed-train: {len(epochs)} epochs of {per_epoch} batches; {len(shrunk)} ended with the pool shrunk",
          flush=True)
    return failures


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["loader", "train", "_loader", "_grower"])
    p.add_argument("--data", help="an ImageFolder; or --make-data")
    p.add_argument("--make-data", metavar="PINFEED_DATA", help="make 4 x 64 synthetic JPEGs with this pinfeed-data")
    p.add_argument("--train-tool")
    p.add_argument("--out")
    p.add_argument("--stop")
    p.add_argument("--target", type=int)
    p.add_argument("--with-swap", action="store_true",
                   help="a benchmark, not a test: let the cgroup swap and report what happens (images/s per phase, "
                        "what was swapped); the checks are printed, the exit is 0 unless the consumer died")
    args = p.parse_args()
    if args.mode == "_grower":
        return run_grower(args.target, STEP, HOLD)
    if args.mode == "_loader":
        return run_loader(args.data, args.out, args.stop)
    if args.make_data:
        tmp = tempfile.mkdtemp(prefix="pinfeed-squeeze-data-")
        subprocess.run([args.make_data, "make", "--out", tmp, "--classes", "4", "--per-class", "64", "--val", "0",
                        "--seed", "1"], check=True, stdout=subprocess.DEVNULL)
        args.data = os.path.join(tmp, "train")
    if not args.data:
        p.error("--data or --make-data is required")
    if args.mode == "train" and not args.train_tool:
        p.error("train needs --train-tool")
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
