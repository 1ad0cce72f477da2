"""The launch plane as a hostile but fair operator meets it: a 2-rank
pinfeed-train run on loopback (torchrun's variables, rank 0 serving the
rendezvous store) attacked by a bounded client, wrong rendezvous settings,
and a rank that stops. Real processes, real sockets, the real binary."""
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from pinfeed import _tools

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK",
               "PMI_SIZE", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NODEID",
               "SLURM_STEP_TASKS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")

TRAIN = ["--devices", "cpu:1", "--batch-size", "16", "--size", "16", "--pool", "2", "--loader-threads", "1", "--json"]


def train_tool():
    return os.environ.get("PINFEED_TRAIN_TOOL") or _tools.path("pinfeed-train")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank, world, port, addr="127.0.0.1", **extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR=addr, MASTER_PORT=str(port))
    env.update(extra)
    return env


def start_rank(dataset, rank, port, args=(), world=2, **env):
    return subprocess.Popen([train_tool(), "--data", str(dataset), *TRAIN, *args], env=rank_env(rank, world, port, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def final_loss(stdout):
    import json
    return json.loads(stdout)["epochs"][-1]["loss"]


def status(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def wait_listening(port, proc, limit=30):
    end = time.time() + limit
    while time.time() < end:
        assert proc.poll() is None, proc.communicate()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("rank 0 never listened")


def v1_set(sock, key, value):
    """torch < 2.1's SET: code 0, the key and the value, each u64-length prefixed."""
    k = key.encode()
    sock.sendall(b"\0" + struct.pack("<Q", len(k)) + k + struct.pack("<Q", len(value)))
    sock.sendall(value)


def test_store_attacks_leave_the_run_and_rank_0s_memory_alone(dataset):
    clean_port = free_port()
    clean = [start_rank(dataset, r, clean_port, ["--epochs", "2"]) for r in (0, 1)]
    clean_out = [p.communicate(timeout=120) for p in clean]
    assert [p.returncode for p in clean] == [0, 0], clean_out

    port = free_port()
    rank0 = start_rank(dataset, 0, port, ["--epochs", "2"])
    wait_listening(port, rank0)
    time.sleep(0.3)
    rss0, threads0 = status(rank0.pid, "VmRSS"), status(rank0.pid, "Threads")

    # 2000 connect/close cycles.
    for _ in range(2000):
        socket.create_connection(("127.0.0.1", port)).close()
    # 100 idle connections at once: the store keeps a few per rank.
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    time.sleep(0.5)
    closed = 0
    for s in idle:
        s.settimeout(0.05)
        try:
            closed += s.recv(1) == b""
        except (socket.timeout, ConnectionResetError):
            pass
    for s in idle:
        s.close()
    assert closed >= 100 - 24, closed  # 4 per rank + 16
    # Thirty-two 16 MiB SETs: the store holds 64 MiB at most.
    value = b"v" * (16 << 20)
    refused = 0
    for i in range(32):
        with socket.create_connection(("127.0.0.1", port)) as s:
            try:
                v1_set(s, f"attack/{i}", value)
                s.settimeout(2)
                s.sendall(b"\x06")  # GETNUMKEYS: answered unless dropped
                refused += len(s.recv(8)) == 0
            except (BrokenPipeError, ConnectionResetError, socket.timeout):
                refused += 1
    assert refused >= 28, refused
    # Four WAITs on 4096 keys of 64 KiB: over the 1 MiB of keys a request may name.
    key = b"k" * (64 << 10)
    for _ in range(4):
        with socket.create_connection(("127.0.0.1", port)) as s:
            try:
                s.sendall(b"\x05" + struct.pack("<Q", 4096))
                for _ in range(4096):
                    s.sendall(struct.pack("<Q", len(key)) + key)
                raise AssertionError("a 256 MiB WAIT was read to its end")
            except (BrokenPipeError, ConnectionResetError):
                pass
    time.sleep(0.3)
    assert rank0.poll() is None, rank0.communicate()
    assert status(rank0.pid, "Threads") == threads0
    grown = (status(rank0.pid, "VmHWM") - rss0) >> 10
    assert grown < 200, f"rank 0 grew by {grown} MiB"

    rank1 = start_rank(dataset, 1, port, ["--epochs", "2"])
    out = [p.communicate(timeout=120) for p in (rank0, rank1)]
    assert [p.returncode for p in (rank0, rank1)] == [0, 0], out
    assert final_loss(out[0][0]) == final_loss(clean_out[0][0])
    assert "dropped the client" in out[0][1]


def test_garbage_in_a_runs_gloo_keys_is_an_error_naming_the_key_and_rank(dataset):
    port = free_port()
    rank0 = start_rank(dataset, 0, port, ["--epochs", "1", "--comm-timeout", "10"])
    wait_listening(port, rank0)
    with socket.create_connection(("127.0.0.1", port)) as s:
        for mesh in ("collectives", "barrier"):
            v1_set(s, f"/pinfeed/run/0/gloo/{mesh}/1", b"x" * 68)
        s.sendall(b"\x06")
        s.recv(8)
    # Rank 0 reads the garbage as its peer's record and stops. Rank 1 starts
    # only after that: started at once, it could write its own record before
    # a loaded rank 0 got to read one (CI saw the run then train).
    out0 = rank0.communicate(timeout=60)
    rank1 = start_rank(dataset, 1, port, ["--epochs", "1", "--comm-timeout", "2"])  # finds no store
    out = [out0, rank1.communicate(timeout=60)]
    assert rank0.returncode != 0 and rank1.returncode != 0, out
    # Whichever mesh rank 0 read first, before rank 1 wrote its own record.
    assert re.search(r"the store key '/pinfeed/run/0/gloo/(collectives|barrier)/1'", out[0][1]), out[0][1]
    assert "rank 1's peer addresses" in out[0][1] and "68 bytes" in out[0][1], out[0][1]
    assert "enforce fail" not in out[0][1] + out[1][1]


class _Web(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("case", ["port 0", "port 70000", "unresolvable", "web server", "nobody listens",
                                  "rank 1 never comes"])
def test_wrong_rendezvous_settings_fail_fast_or_say_what_they_wait_for(dataset, case):
    port, rank, env, server = free_port(), 1, {"PINFEED_WAIT_LOG_S": "1"}, None
    if case == "port 0":
        port = 0
    elif case == "port 70000":
        port = 70000
    elif case == "web server":
        server = HTTPServer(("127.0.0.1", port), _Web)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    elif case == "rank 1 never comes":
        rank = 0
    addr = "no-such-host.invalid" if case == "unresolvable" else "127.0.0.1"
    t0 = time.time()
    p = subprocess.run([train_tool(), "--data", str(dataset), *TRAIN, "--epochs", "1", "--comm-timeout", "4"],
                       env=rank_env(rank, 2, port, addr=addr, **env), capture_output=True, text=True, timeout=60)
    took = time.time() - t0
    if server is not None:
        server.shutdown()
    err = p.stderr
    if case in ("port 0", "port 70000", "unresolvable"):
        assert p.returncode == 2, err
        assert took < 5, took
        assert ("MASTER_PORT" in err) if case.startswith("port") else ("no-such-host.invalid" in err), err
    elif case == "web server":
        assert p.returncode == 1, err
        assert took < 10, took
        assert "is not a TCPStore" in err and "rank 1" in err, err
    elif case == "nobody listens":
        assert p.returncode == 1, err
        assert len(re.findall(r"rank 1 cannot reach the store at 127\.0\.0\.1:\d+ yet", err)) >= 2, err
        assert "within 4 s" in err and "MASTER_ADDR:MASTER_PORT" in err, err
    else:
        assert p.returncode == 1, err
        assert re.search(r"rank 0 has waited \d+ s of 4 s for key '/pinfeed/run/0/gloo/collectives/1'", err), err
        assert "rank -1" not in err, err


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ranks_of(parent):
    """{rank: pid} of the pinfeed-train processes below `parent`."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"pinfeed-train" not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        r = env.get(b"OMPI_COMM_WORLD_RANK") or env.get(b"RANK")
        port = env.get(b"MASTER_PORT", b"")
        if r is not None and (parent is None or port == parent.encode()):
            found[int(r)] = int(pid)
    return found


@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_a_stopped_rank_makes_the_other_fail_within_the_timeout_without_spinning(dataset, launcher, request):
    args = ["--data", str(dataset), *TRAIN, "--epochs", "100000", "--comm-timeout", "4"]
    port = free_port()
    if launcher == "mpi":
        mpirun = request.getfixturevalue("mpirun")
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        env.update(OMPI_MCA_btl_vader_single_copy_mechanism="none", MASTER_PORT=str(port))
        procs = [subprocess.Popen([mpirun, "--allow-run-as-root", "--oversubscribe", "-x", "MASTER_PORT", "-np", "2",
                                   train_tool(), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)]
    else:
        procs = [start_rank(dataset, r, port, args[len(TRAIN) + 2:]) for r in (0, 1)]
    try:
        end = time.time() + 30
        ranks = {}
        while len(ranks) < 2 and time.time() < end:
            ranks = ranks_of(str(port))
            time.sleep(0.1)
        assert len(ranks) == 2, ranks
        time.sleep(2)  # training
        os.kill(ranks[1], signal.SIGSTOP)
        stopped_at, cpu0 = time.time(), cpu_seconds(ranks[0])
        leader = procs[0]
        out = leader.communicate(timeout=60)
        waited = time.time() - stopped_at
        assert leader.returncode != 0, out
        assert waited < 4 + 10, waited
        # Waiting is not spinning: well under half a core while rank 1 is stopped.
        try:
            used = cpu_seconds(ranks[0]) - cpu0
        except OSError:
            used = None  # gone: its last figure is not readable, the time limit held
        if used is not None:
            assert used < 0.5 * waited, (used, waited)
        err = out[1]
        assert "did not complete within 4 s: a rank stopped, hung or was lost" in err, err
    finally:
        for pid in ranks_of(str(port)).values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def test_more_tar_shards_than_open_files_still_load(dataset, tmp_path):
    """One-sample shards (40). pinfeed-train under a soft limit of 24 open
    files raises it to the hard one; a Python loader under a hard limit of
    24 keeps a bounded set of shards open and reopens the rest."""
    import pinfeed
    data_tool = os.environ.get("PINFEED_DATA_TOOL") or _tools.path("pinfeed-data")
    subprocess.run([data_tool, "-q", "pack", "--from", str(dataset), "--out", str(tmp_path / "s"), "--per-shard", "1"],
                   check=True)
    shards = sorted(tmp_path.glob("s-*.tar"))
    n = len(pinfeed.Loader(str(dataset), batch_size=8, size=16).samples)
    assert len(shards) == n > 24
    pattern = str(tmp_path / f"s-{{000000..{n - 1:06d}}}.tar")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    out = subprocess.run(["prlimit", "--nofile=24:4096", train_tool(), "--data", pattern, *TRAIN, "--epochs", "1"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    code = ("import pinfeed, resource, sys; "
            "assert resource.getrlimit(resource.RLIMIT_NOFILE) == (24, 24); "
            f"l = pinfeed.Loader({pattern!r}, batch_size=8, size=16, shuffle=True, threads=2); "
            "print(sum(len(y) for _ in range(2) for _, y in l))")
    out = subprocess.run(["prlimit", "--nofile=24:24", sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(2 * n)]


@pytest.mark.parametrize("limit", [400_000_000, 650_000_000, 800_000_000])
def test_an_address_space_limit_is_named_or_met_never_a_hang(dataset, limit):
    """Under a tight RLIMIT_AS, OpenBLAS would retry its buffer's mmap
    forever in a compute thread (and the process hang at exit), and glibc's
    per-thread arenas would eat the space first: the tools cap the arenas,
    the backend checks room, and the run either trains or names the limit."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    out = subprocess.run(["prlimit", f"--as={limit}", train_tool(), "--data", str(dataset), "--devices", "cpu:2",
                          "--batch-size", "16", "--size", "16", "--pool", "2", "--epochs", "1", "--json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode in (0, 1), (out.returncode, out.stderr)
    if limit == 400_000_000 or out.returncode == 1:
        # Named: OpenBLAS's buffer, or whatever else found no room first (a thread's stack).
        assert out.returncode == 1 and "RLIMIT_AS" in out.stderr, out.stderr


@pytest.mark.parametrize("nproc", [4, 8])
def test_a_process_limit_too_low_names_rlimit_nproc_and_never_hangs(dataset, tmp_path, nproc):
    """RLIMIT_NPROC binds only unprivileged users: run as nobody (setpriv),
    with the binary and the data copied where nobody can read them. With 8,
    the std::threads start and oneTBB's workers would not: the work given
    to them would never run, so the loader checks for room first."""
    import shutil
    import tempfile
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as nobody (RLIMIT_NPROC does not bind root)")
    room = tempfile.mkdtemp(prefix="pinfeed-nproc-")
    try:
        os.chmod(room, 0o755)
        data = shutil.copytree(dataset, os.path.join(room, "data"))
        copy = shutil.copy(train_tool(), os.path.join(room, "pinfeed-train"))
        for root, dirs, files in os.walk(room):
            for name in dirs + files:
                os.chmod(os.path.join(root, name), 0o755)
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        # The binary where it is, if nobody may run it there (a wheel's
        # finds its libraries beside it), else the copy (a build tree
        # under a private home).
        runs = [b for b in (train_tool(), copy)
                if subprocess.run(nobody + [b, "--version"], capture_output=True, cwd=room).returncode == 0]
        if not runs:
            pytest.skip("user nobody can run neither pinfeed-train nor a copy of it")
        binary = runs[0]
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "prlimit",
                              f"--nproc={nproc}", binary, "--data", data, *TRAIN, "--epochs", "1"], env=env,
                             capture_output=True, text=True, timeout=60, cwd=room)
        assert out.returncode in (1, 2), (out.returncode, out.stderr)
        assert f"RLIMIT_NPROC, ulimit -u) is {nproc}" in out.stderr, out.stderr
        assert "--loader-threads" in out.stderr, out.stderr
    finally:
        shutil.rmtree(room, ignore_errors=True)
