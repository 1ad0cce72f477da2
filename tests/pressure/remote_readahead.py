#!/usr/bin/env python3
"""Streamed remote shards under real memory pressure (issue 43): the
read-ahead gives its memory back like the pool.

A Range-capable HTTP server (a separate process, outside the cgroup) serves
packed shards with their index sidecars. The consumer, the Python loader in a
memory cgroup of the test's own (700 MiB, no swap), streams them with a
64 MiB read-ahead bound that holds the whole set, holds its first batch until
the read-ahead has filled, then reads slowly, so the fetched samples sit in
its memory. A neighbour in the same cgroup then takes
memory until less than the monitor's 64 MiB headroom is left: critical.

It asserts: the loader's read-ahead bound falls to 4 MiB and the fetched
samples past it are given back (stats "dropped"), the read-ahead held after
that stays under the bound, the consumer's anonymous memory falls by at
least half of what it gave back, nobody is OOM-killed, and the epoch still
delivers every sample exactly once (the dropped ones are fetched again).

Exit 0 passed, 1 failed, 77 skipped (no root or no writable memory cgroup).

    PYTHONPATH=build/release/python python3 tests/pressure/remote_readahead.py \\
        --make-data build/release/tools/pinfeed-data
"""
import argparse
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cgroup_squeeze import MiB, Cgroup, skip, wait_or_kill  # noqa: E402

LIMIT = 700 * MiB
READAHEAD = 64 * MiB
CRITICAL_BOUND = 4 * MiB
HEADROOM = 64 * MiB  # the monitor's: critical below it
BATCH = 16


class Server(http.server.ThreadingHTTPServer):
    """A listen backlog for the streaming reader's 32 connections at once
    (socketserver's default of 5 drops SYNs, and each dropped one costs a
    1-3 s retransmit: a slow test, not a fault under test)."""
    request_queue_size = 128


class Ranges(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root = "."

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = os.path.join(self.root, self.path.lstrip("/"))
        if not os.path.isfile(path):
            self.send_error(404)
            return
        size = os.path.getsize(path)
        first, last = 0, size - 1
        rng = self.headers.get("Range")
        if rng:
            a, _, b = rng.split("=")[1].partition("-")
            first, last = int(a), int(b) if b else size - 1
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(last - first + 1))
        self.end_headers()
        with open(path, "rb") as f:
            f.seek(first)
            self.wfile.write(f.read(last - first + 1))


def run_server(root, port_file):
    handler = type("H", (Ranges,), {"root": root})
    server = Server(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.rename(port_file + ".tmp", port_file)
    server.serve_forever()


def rss_anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def run_consumer(url, out):
    import pinfeed
    loader = pinfeed.Loader(url, batch_size=BATCH, size=64, threads=2, prefetch=2, shuffle=True, seed=1,
                            return_indices=True, remote_readahead=READAHEAD)
    progress = open(out + ".progress", "w")

    def report(k):
        st = loader.stats()["remote"]
        progress.write(json.dumps({"t": time.time(), "k": k, "ahead": st["readahead_bytes"],
                                   "limit": st["readahead_limit"], "dropped": st["dropped"],
                                   "requests": st["requests"], "rss": rss_anon()}) + "\n")
        progress.flush()

    seen = []
    for k, (_, _, indices) in enumerate(loader):
        seen += indices.tolist()
        report(k)
        if k == 0:
            # Hold the first batch until the driver says go (it waits for the
            # read-ahead to fill, however slow the machine), reporting the
            # read-ahead every 0.1 s meanwhile.
            deadline = time.time() + 60
            while not os.path.exists(out + ".go") and time.time() < deadline:
                time.sleep(0.1)
                report(k)
        time.sleep(0.3)  # a slow step: the fetched samples sit in memory
    json.dump({"seen": sorted(seen), "n": len(loader.samples)}, open(out, "w"))
    return 0


def run_neighbour(target):
    blocks = []
    while len(blocks) * (8 * MiB) < target:
        b = bytearray(8 * MiB)
        for i in range(0, len(b), 4096):
            b[i] = 1
        blocks.append(b)
        time.sleep(0.02)
    print(f"neighbour: holding {len(blocks) * 8} MiB", flush=True)
    time.sleep(4.0)
    return 0


def progress_lines(path):
    try:
        return [json.loads(line) for line in open(path) if line.endswith("\n")]
    except (OSError, ValueError):
        return []


def drive(args):
    work = tempfile.mkdtemp(prefix="pinfeed-readahead-")
    www = os.path.join(work, "www")
    subprocess.run([args.make_data, "-q", "make", "--out", os.path.join(work, "set"), "--classes", "4",
                    "--per-class", "100", "--val", "0", "--seed", "2"], check=True)
    subprocess.run([args.make_data, "-q", "pack", "--from", os.path.join(work, "set", "train"), "--out",
                    os.path.join(www, "train"), "--per-shard", "50"], check=True)
    set_bytes = sum(os.path.getsize(os.path.join(www, n)) for n in os.listdir(www) if n.endswith(".tar"))
    port_file = os.path.join(work, "port")
    server = subprocess.Popen([sys.executable, __file__, "_server", "--root", www, "--out", port_file])
    failures, consumer, neighbour = [], None, None
    cg = None
    try:
        deadline = time.time() + 20
        while not os.path.exists(port_file) and time.time() < deadline:
            time.sleep(0.05)
        port = int(open(port_file).read())
        url = f"http://127.0.0.1:{port}/train-{{000000..000007}}.tar"
        cg = Cgroup(LIMIT)
        out, log = os.path.join(work, "out.json"), os.path.join(work, "log")
        logf = open(log, "w")
        consumer = subprocess.Popen([sys.executable, __file__, "_consumer", "--url", url, "--out", out],
                                    stdout=logf, stderr=subprocess.STDOUT, preexec_fn=cg.enter())
        # The read-ahead fills while the consumer holds its first batch: wait
        # until it has taken most of the set and stopped growing for 0.5 s
        # (a loaded 2-core CI machine is slow to fetch; a fixed sleep was not
        # enough there), at most 45 s; the premise check below says if not.
        deadline = time.time() + 45
        lines, grew_at, last = [], time.time(), -1
        while time.time() < deadline and consumer.poll() is None:
            lines = progress_lines(out + ".progress")
            if lines:
                ahead = lines[-1]["ahead"]
                if ahead > last:
                    grew_at, last = time.time(), ahead
                elif ahead >= 24 * MiB and time.time() - grew_at > 0.5:
                    break
            time.sleep(0.05)
        lines = progress_lines(out + ".progress")
        if not lines:
            print(open(log, errors="replace").read()[-3000:])
            return [f"the consumer gave no batch (exit {consumer.poll()})"]
        anon = cg.anon_bytes()
        target = LIMIT - anon - HEADROOM // 2
        print(f"cgroup {cg.version} {LIMIT // MiB} MiB; set {set_bytes / MiB:.1f} MiB; consumer anon "
              f"{anon / MiB:.0f} MiB with the read-ahead full; neighbour {target / MiB:.0f} MiB leaves "
              f"{HEADROOM // 2 // MiB} MiB (critical under {HEADROOM // MiB})", flush=True)
        t_squeeze = time.time()
        neighbour = subprocess.Popen([sys.executable, __file__, "_neighbour", "--target", str(target)],
                                     stdout=logf, stderr=subprocess.STDOUT, preexec_fn=cg.enter())
        open(out + ".go", "w").close()
        wait_or_kill(neighbour, 60, failures, "the neighbour did not finish within 60 s")
        wait_or_kill(consumer, 120, failures, "the consumer did not finish its epoch within 120 s")
        logf.close()
        text = open(log, errors="replace").read()
        for name, proc in (("neighbour", neighbour), ("consumer", consumer)):
            if proc.returncode != 0:
                failures.append(f"the {name} exited with {proc.returncode}"
                                f"{' (OOM-killed)' if proc.returncode in (-9, 137) else ''}")
        lines = progress_lines(out + ".progress")
        before = [p for p in lines if p["t"] < t_squeeze]
        squeezed = [p for p in lines if p["limit"] == CRITICAL_BOUND]
        held = max((p["ahead"] for p in before), default=0)
        print(f"read-ahead before the squeeze: {held / MiB:.1f} MiB (bound {READAHEAD // MiB} MiB)", flush=True)
        if held < 16 * MiB:
            failures.append(f"premise: the read-ahead held {held / MiB:.1f} MiB before the squeeze: nothing is tested")
        if not squeezed:
            failures.append("the read-ahead bound never fell to 4 MiB (the loader never saw critical pressure)")
        else:
            first = squeezed[0]
            rss_before = max(p["rss"] for p in before)
            rss_low = min(p["rss"] for p in squeezed)
            given = held - first["ahead"]
            print(f"under critical: bound {first['limit'] / MiB:.0f} MiB, held {first['ahead'] / MiB:.1f} MiB, "
                  f"{first['dropped']} samples given back; consumer anon {rss_before / MiB:.0f} -> "
                  f"{rss_low / MiB:.0f} MiB", flush=True)
            if first["dropped"] == 0:
                failures.append("no fetched sample was given back under critical pressure")
            if max(p["ahead"] for p in squeezed) > CRITICAL_BOUND:
                failures.append(f"the read-ahead held {max(p['ahead'] for p in squeezed)} bytes over the 4 MiB bound")
            if rss_before - rss_low < given / 2:
                failures.append(f"anonymous memory fell by {(rss_before - rss_low) / MiB:.1f} MiB, under half of the "
                                f"{given / MiB:.1f} MiB given back")
        for line in text.splitlines():
            if "read-ahead bound" in line or "neighbour:" in line:
                print(f"  {line}")
        if os.path.exists(out):
            result = json.load(open(out))
            if result["seen"] != list(range(result["n"])):
                failures.append(f"the epoch gave {len(result['seen'])} samples, {len(set(result['seen']))} distinct, "
                                f"not each of {result['n']} once")
        elif not failures:
            failures.append("the consumer wrote no result")
        if failures:
            print("\n".join(text.splitlines()[-30:]))
    finally:
        for p in (consumer, neighbour, server):
            if p and p.poll() is None:
                p.kill()
                p.wait()
        if cg:
            cg.close()
    return failures


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="run", choices=["run", "_server", "_consumer", "_neighbour"])
    p.add_argument("--make-data", metavar="PINFEED_DATA")
    p.add_argument("--root")
    p.add_argument("--url")
    p.add_argument("--out")
    p.add_argument("--target", type=int)
    args = p.parse_args()
    if args.mode == "_server":
        return run_server(args.root, args.out)
    if args.mode == "_consumer":
        return run_consumer(args.url, args.out)
    if args.mode == "_neighbour":
        return run_neighbour(args.target)
    if os.geteuid() != 0:
        skip("needs root to make a memory cgroup")
    if not args.make_data:
        p.error("--make-data PINFEED_DATA is needed")
    failures = drive(args)
    for f in failures:
        print(f"FAIL: {f}")
    if not failures:
        print("PASS: the read-ahead gave its memory back under critical pressure")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
