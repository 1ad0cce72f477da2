#!/usr/bin/env python3
"""Index sidecars in bounded memory, under a real memory cgroup (issue 51).

A server outside the cgroup hands a loader inside it (1 GiB, no swap) eight
hostile sidecars at once, in two rounds:

- "huge": sidecars of well-formed entries that never end (a 250 MiB one
  OOM-killed a loader in a 4 GiB cgroup when eight were fetched at once,
  each parsed into a document tree);
- "arrays": 60 MiB sidecars of "[]," (1.75 GiB each as a document tree).

Each open must fail with an error naming why (the 64 MiB limit for a
sidecar; an entry with 0 fields), the loader must not be killed, and the
cgroup's peak memory must stay under its limit. The peaks are printed.

    PYTHONPATH=build/release/python python3 tests/pressure/remote_sidecars.py

Exit 0 passed, 1 failed, 77 skipped (no root or no writable memory cgroup).
"""
import argparse
import http.server
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cgroup_squeeze import MiB, Cgroup, skip  # noqa: E402

LIMIT = 1024 * MiB
SHARDS = 8
HEAD = b'{"format":"pinfeed-shard-index","version":1,"size":1099511627776,"samples":['


class Hostile(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        kind = self.path.strip("/").split("/")[0]
        if not self.path.endswith(".index.json"):
            self.send_error(404)
            return
        self.send_response(206 if self.headers.get("Range") else 200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(b):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))

        try:
            chunk(HEAD)
            if kind == "arrays":
                block = b"[]," * (1 << 20)
                for _ in range(20):  # 60 MiB
                    chunk(block)
                chunk(b"[]]}")
            else:
                n, sent = 0, 0
                while sent < 250 * MiB:
                    part = b"".join(b'["k%d.jpg",%d,100,0,1],' % (k, 512 + 1024 * k) for k in range(n, n + 20000))
                    n += 20000
                    chunk(part)
                    sent += len(part)
                chunk(b'["last.jpg",512,100,0,1]]}')
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the client stopped reading: what a bound does
        self.close_connection = True


class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 64
    daemon_threads = True


def run_server(port_file):
    server = Server(("127.0.0.1", 0), Hostile)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.rename(port_file + ".tmp", port_file)
    server.serve_forever()


def run_consumer(url, out):
    import pinfeed  # noqa: E402 (inside the cgroup)
    pinfeed.Loader  # torch, before the open is measured
    error = None
    try:
        pinfeed.Loader(url, batch_size=4, threads=1, remote_retries=0)
    except pinfeed.Error as e:
        error = str(e)
    with open(out, "w") as f:
        json.dump({"error": error}, f)


def peak_bytes(cg):
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        try:
            return int(cg.read(name))
        except (OSError, ValueError):
            continue
    return None


def drive():
    work = tempfile.mkdtemp(prefix="pinfeed-sidecars-")
    port_file = os.path.join(work, "port")
    server = subprocess.Popen([sys.executable, __file__, "_server", "--out", port_file])
    failures = []
    try:
        deadline = time.time() + 20
        while not os.path.exists(port_file) and time.time() < deadline:
            time.sleep(0.05)
        port = int(open(port_file).read())
        for kind, says in (("huge", "over 64 MiB, the limit for a shard's index sidecar"), ("arrays", "0 fields")):
            cg = Cgroup(LIMIT)
            try:
                url = f"http://127.0.0.1:{port}/{kind}/train-{{000000..{SHARDS - 1:06d}}}.tar"
                out = os.path.join(work, f"{kind}.json")
                start = time.monotonic()
                consumer = subprocess.Popen([sys.executable, __file__, "_consumer", "--url", url, "--out", out],
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                            preexec_fn=cg.enter())
                try:
                    log, _ = consumer.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    consumer.kill()
                    log, _ = consumer.communicate()
                    failures.append(f"{kind}: the open did not end within 120 s")
                peak = peak_bytes(cg)
                shown = "?" if peak is None else f"{peak / MiB:.0f} MiB"
                print(f"{kind}: exit {consumer.returncode} in {time.monotonic() - start:.1f} s, cgroup peak {shown} "
                      f"of {LIMIT // MiB} MiB")
                if consumer.returncode != 0:
                    failures.append(f"{kind}: the loader exited {consumer.returncode} (-9: OOM-killed): "
                                    f"{log[-1500:]}")
                    continue
                error = json.load(open(out))["error"]
                print(f"{kind}: {error}")
                if not error or says not in error:
                    failures.append(f"{kind}: expected an error saying {says!r}, got {error!r}")
                if peak is not None and peak >= LIMIT:
                    failures.append(f"{kind}: the cgroup's peak reached its limit")
            finally:
                cg.close()
    finally:
        server.kill()
        server.wait()
    return failures


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="run", choices=["run", "_server", "_consumer"])
    p.add_argument("--url")
    p.add_argument("--out")
    args = p.parse_args()
    if args.mode == "_server":
        return run_server(args.out)
    if args.mode == "_consumer":
        return run_consumer(args.url, args.out)
    if os.geteuid() != 0:
        skip("needs root to make a memory cgroup")
    failures = drive()
    for f in failures:
        print(f"FAIL: {f}")
    if not failures:
        print("PASS: eight hostile sidecars at once stay within a 1 GiB cgroup, each refused naming why")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
