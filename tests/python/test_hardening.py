"""Hostile but fair use of the Python module: bad arguments, Ctrl-C while a
batch is being made, a second iteration, and pin_memory that cannot pin."""
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib

import pytest

import pinfeed


def small(dataset, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("size", 32)
    kw.setdefault("threads", 2)
    return pinfeed.Loader(str(dataset), **kw)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(threads=-1), ValueError, "threads"),
    (dict(seed=2**70), ValueError, "seed"),
    (dict(size=2**40), ValueError, "size"),
    (dict(std=("a", 1, 1)), TypeError, "std"),
    (dict(std=(0.2, 0.0, 0.2)), ValueError, "std"),
    (dict(mean=(1, 2)), ValueError, "mean"),
    (dict(mean="5"), TypeError, "mean"),
    (dict(prefetch="4"), TypeError, "prefetch"),
    (dict(batch_size=2.5), TypeError, "batch_size"),
    (dict(shuffle="yes"), TypeError, "shuffle"),
    (dict(rank=-1, world_size=2), ValueError, "rank"),
    (dict(max_classes=0), ValueError, "max_classes"),
    (dict(max_replaced_share=2), ValueError, "max_replaced_share"),
    (dict(transform=None), ValueError, "transform"),
])
def test_arguments_out_of_range_name_the_argument(dataset, kwargs, error, name):
    with pytest.raises(error, match=name):
        small(dataset, **kwargs)


def test_a_second_iteration_supersedes_the_first_which_then_says_so(dataset):
    loader = small(dataset, shuffle=False, return_indices=True)
    first = iter(loader)
    _, _, head = next(first)
    second = iter(loader)  # restarts the epoch: the first must not take its batches
    with pytest.raises(RuntimeError, match="superseded"):
        next(first)
    seen = [idx.tolist() for _, _, idx in second]
    assert len(seen) == 5 and seen[0] == head.tolist()  # the whole epoch, from its start
    it = iter(loader)
    next(it)
    it = iter(loader)  # rebinding the name: the common partial-epoch pattern
    assert sum(1 for _ in it) == 5
    for _ in loader:
        break
    assert sum(1 for _ in loader) == 5


def _png_of_zeros(path, side):
    """A side x side grayscale PNG of zeros: a few hundred KB that decode to side^2 pixels."""
    row = b"\x00" * (side + 1)  # filter byte + pixels
    data = zlib.compress(row * side, 9)

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)) +
           chunk(b"IDAT", data) + chunk(b"IEND", b""))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)


def test_ctrl_c_interrupts_a_waiting_next_and_the_loader_stays_usable(tmp_path):
    # Four 10000 x 10000 PNGs on one thread: the first batch takes seconds.
    _png_of_zeros(tmp_path / "set" / "a" / "0.png", 10000)
    for i in range(1, 4):
        os.link(tmp_path / "set" / "a" / "0.png", tmp_path / "set" / "a" / f"{i}.png")
    loader = pinfeed.Loader(str(tmp_path / "set"), batch_size=4, threads=1, size=16, transform="center", prefetch=2)
    it = iter(loader)
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    start = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        next(it)
    interrupted_after = time.monotonic() - start
    timer.join()
    start = time.monotonic()
    batches = [labels.tolist() for _, labels in loader]  # usable again: a whole epoch
    epoch_took = time.monotonic() - start
    assert batches == [[0, 0, 0, 0]]
    print(f"interrupted after {interrupted_after:.2f} s; a whole batch took {epoch_took:.2f} s")
    assert interrupted_after < 0.3 + 0.5
    assert epoch_took > interrupted_after, "the batch was ready before the interrupt: the test proves nothing"


def _without_memlock(code):
    """Runs `code` in a Python whose RLIMIT_MEMLOCK is 64 KiB and that lacks CAP_IPC_LOCK."""
    prefix = ["prlimit", "--memlock=65536:65536"]
    if os.geteuid() == 0:
        prefix += ["setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock"]
    return subprocess.run(prefix + [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))


def test_pin_memory_true_warns_with_the_reason_and_require_raises(dataset):
    common = f"import warnings, pinfeed; warnings.simplefilter('always'); kw = dict(batch_size=8, size=32, threads=1)\n"
    out = _without_memlock(common + f"l = pinfeed.Loader({str(dataset)!r}, pin_memory=True, **kw)\n"
                                    "print('pinned', l.pin_report()['pinned_slots'], 'of', l.pin_report()['slots'])\n")
    assert out.returncode == 0, out.stderr
    assert "pinned 0 of 4" in out.stdout
    assert "RuntimeWarning" in out.stderr and "memlock" in out.stderr, out.stderr
    out = _without_memlock(common + f"pinfeed.Loader({str(dataset)!r}, pin_memory='auto', **kw)\n")
    assert out.returncode == 0 and "RuntimeWarning" not in out.stderr, out.stderr
    out = _without_memlock(common + f"pinfeed.Loader({str(dataset)!r}, pin_memory='require', **kw)\n")
    assert out.returncode != 0
    assert "ConfigError" in out.stderr and "memlock" in out.stderr, out.stderr


def test_ranks_on_one_host_split_its_memory(dataset):
    code = (f"import pinfeed; l = pinfeed.Loader({str(dataset)!r}, batch_size=8, size=32, threads=1)\n"
            "print(l.pin_report()['local_ranks'])")
    for env, expected in (({"LOCAL_WORLD_SIZE": "4", "RANK": "1", "WORLD_SIZE": "4"}, "4"),
                          ({"OMPI_COMM_WORLD_LOCAL_SIZE": "8", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8"}, "8"),
                          ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "7", "SLURM_NODEID": "2",
                            "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2),3"}, "3"),
                          ({"SLURM_STEP_ID": "batch", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "8"}, "1")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, **env))
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == expected, env


FORK_CHILD = r"""
import multiprocessing as mp, os, sys
import pinfeed

def use_inherited(loader, q):
    try:
        next(iter(loader))
        q.put("no error")
    except RuntimeError as e:
        q.put("RuntimeError: " + str(e))

def make_own(root, q):
    try:
        loader = pinfeed.Loader(root, batch_size=8, size=32, threads=2)
        q.put(sum(len(labels) for _, labels in loader))
    except Exception as e:
        q.put(type(e).__name__ + ": " + str(e))

if __name__ == "__main__":
    root, iterate = sys.argv[1], sys.argv[2] == "1"
    loader = pinfeed.Loader(root, batch_size=8, size=32, threads=2)
    if iterate:
        for _ in loader:
            pass
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    for target, args in ((use_inherited, (loader, q)), (make_own, (root, q))):
        p = ctx.Process(target=target, args=args)
        p.start()
        print(q.get(timeout=60), flush=True)
        p.join(timeout=60)
        print("exit", p.exitcode, flush=True)
    # The parent's loader still works.
    print("parent", sum(len(labels) for _, labels in loader), flush=True)
"""


@pytest.mark.parametrize("iterate", [False, True], ids=["fresh", "iterated"])
def test_a_loader_used_in_a_forked_child_says_so_and_one_made_there_works(dataset, tmp_path, iterate):
    """Inherited loaders raise in the child. A new one works in the child of
    a parent whose decode threads never ran; once they ran, oneTBB cannot
    start them again in a fork, and making one says so (spawn instead)."""
    script = tmp_path / "fork_child.py"
    script.write_text(FORK_CHILD)
    out = subprocess.run([sys.executable, str(script), str(dataset), "1" if iterate else "0"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("RuntimeError: pinfeed.Loader: this loader was created in process"), lines
    assert "create the Loader in the child process" in lines[0]
    assert lines[1] == "exit 0"
    n = len(pinfeed.Loader(str(dataset), batch_size=8, size=32, threads=2).samples)
    if iterate:
        assert lines[2].startswith("ConfigError: pinfeed loader: this process"), lines
        assert "'spawn'" in lines[2] and "oneTBB" in lines[2], lines
    else:
        assert lines[2] == str(n), lines
    assert lines[3] == "exit 0"
    assert lines[4] == f"parent {n}"


def test_iter_on_another_thread_while_next_waits_supersedes_it_cleanly(dataset):
    """Thread A waits in next(); thread B calls iter(). A's batch is whole,
    A's next ask says "superseded", B gets the whole epoch. Every time."""
    for _ in range(10):
        loader = small(dataset, batch_size=8, shuffle=True, threads=1)
        first = iter(loader)
        got, errors = [], []
        started = threading.Event()

        def take():
            started.set()
            try:
                while True:
                    images, labels = next(first)
                    got.append(len(labels))
            except StopIteration:
                errors.append("stop")
            except RuntimeError as e:
                errors.append(str(e))

        a = threading.Thread(target=take)
        a.start()
        started.wait()
        second = iter(loader)  # while A is (most likely) inside next()
        b_counts = [len(labels) for _, labels in second]
        a.join(timeout=60)
        assert not a.is_alive()
        assert all(n == 8 for n in got[:-1]) and all(0 < n <= 8 for n in got), got
        assert sum(b_counts) == len(loader.samples), b_counts
        assert errors and ("superseded" in errors[0] or errors[0] == "stop"), errors


def test_held_batches_past_an_address_space_limit_raise_never_hang(dataset):
    """Under RLIMIT_AS (the real kernel limit), a loop that keeps every batch
    runs out of room for the slots lent in their place: next() raises,
    naming it, where it waited forever logging 'mapping failed' (issue 51)."""
    code = f"""
import resource, pinfeed
loader = pinfeed.Loader({str(dataset)!r}, batch_size=8, size=224, threads=1, prefetch=2, watch_pressure=False)
held = [next(iter(loader))]
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.RLIM_INFINITY))
try:
    for epoch in range(100):
        loader.set_epoch(epoch)
        for batch in loader:
            held.append(batch)
    print("no error", flush=True)
except (pinfeed.Error, MemoryError, RuntimeError) as e:
    print("raised:", e, flush=True)
"""
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert "raised:" in r.stdout, (r.stdout, r.stderr[-3000:])
    assert "memory" in r.stdout.lower() or "RLIMIT_AS" in r.stdout, r.stdout
    assert time.monotonic() - start < 60


def test_a_bad_simd_word_and_a_floor_over_the_pool_are_said(dataset):
    """PINFEED_SIMD=garbage was ignored while the log said it overrode a
    default; pressure_floor=100 over a 4-slot pool was taken without a word."""
    r = subprocess.run([sys.executable, "-c", f"import pinfeed; pinfeed.Loader({str(dataset)!r}, pressure_floor=100)"],
                       capture_output=True, text=True, env=dict(os.environ, PINFEED_SIMD="garbage"), timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PINFEED_SIMD='garbage' is not one of" in r.stderr, r.stderr[-2000:]
    assert "pressure_floor 100 is over the pool's 4 slots" in r.stderr, r.stderr[-2000:]
