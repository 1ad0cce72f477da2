"""The launch plane's figures (docs/results.md, issue 26): rank 0's threads
and memory while a client attacks its rendezvous store, and what a rank
waiting on a stopped peer costs under mpirun and under Gloo.

    PYTHONPATH=build/release/python PINFEED_TRAIN_TOOL=build/release/tools/pinfeed-train \\
        python3 bench/launch_plane.py DATA

DATA: an ImageFolder (build/release/tools/pinfeed-data make --out D ...; D/train).
Uses the helpers of tests/python/test_launch_plane.py."""
import os
import resource
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import test_launch_plane as t  # noqa: E402


def store_attack(data):
    port = t.free_port()
    r0 = t.start_rank(data, 0, port, ["--epochs", "2"])
    t.wait_listening(port, r0)
    time.sleep(0.3)
    rss0, th0 = t.status(r0.pid, "VmRSS"), t.status(r0.pid, "Threads")
    t0 = time.time()
    for _ in range(2000):
        socket.create_connection(("127.0.0.1", port)).close()
    cycles = time.time() - t0
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2000)]
    time.sleep(0.5)
    th_idle = t.status(r0.pid, "Threads")
    for s in idle:
        s.close()
    value = b"v" * (16 << 20)
    for i in range(32):
        with socket.create_connection(("127.0.0.1", port)) as s:
            try:
                t.v1_set(s, f"a/{i}", value)
                s.settimeout(2)
                s.sendall(b"\x06")
                s.recv(8)
            except OSError:
                pass
    print(f"store: 2000 connect/close in {cycles:.2f} s; threads {th0} before, {th_idle} with 2000 idle connections "
          f"open, {t.status(r0.pid, 'Threads')} after; RSS {rss0 >> 10} MiB before, peak "
          f"{t.status(r0.pid, 'VmHWM') >> 10} MiB; VmSize {t.status(r0.pid, 'VmSize') >> 10} MiB")
    r1 = t.start_rank(data, 1, port, ["--epochs", "2"])
    print("store: the run's exit codes", r0.wait(120), r1.wait(120))


def stopped_rank(data, launcher):
    port = t.free_port()
    args = ["--data", data, *t.TRAIN, "--epochs", "100000", "--comm-timeout", "10"]
    if launcher == "mpi":
        env = {k: v for k, v in os.environ.items() if k not in t.LAUNCH_VARS}
        env.update(OMPI_MCA_btl_vader_single_copy_mechanism="none", MASTER_PORT=str(port))
        leader = subprocess.Popen(["mpirun", "--allow-run-as-root", "--oversubscribe", "-x", "MASTER_PORT", "-np", "2",
                                   t.train_tool(), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
    else:
        leader = t.start_rank(data, 0, port, args[len(t.TRAIN) + 2:])
        t.start_rank(data, 1, port, args[len(t.TRAIN) + 2:])
    ranks = {}
    while len(ranks) < 2:
        ranks = t.ranks_of(str(port))
        time.sleep(0.1)
    time.sleep(2)
    os.kill(ranks[1], signal.SIGSTOP)
    t0, c0 = time.time(), t.cpu_seconds(ranks[0])
    time.sleep(8)
    c1 = t.cpu_seconds(ranks[0])
    _, err = leader.communicate(timeout=60)
    print(f"{launcher}: rank 0 used {c1 - c0:.3f} CPU s in the first 8 s of waiting; ended {time.time() - t0:.1f} s "
          f"after the stop (timeout 10 s); exit {leader.returncode}")
    print("   ", next((line for line in err.splitlines() if "did not complete" in line), "(no timeout line)"))
    for pid in t.ranks_of(str(port)).values():
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))  # 2000 client sockets
    store_attack(sys.argv[1])
    for launcher in ("mpi", "gloo"):
        stopped_rank(sys.argv[1], launcher)
