#!/usr/bin/env python3
"""Runs the GPU checks from the bundle (bench/gpu_bundle.sh) on a machine
with nothing else installed: a GPU, its driver, CUDA's libraries as pip
wheels in python3's environment (cuBLAS, NCCL, the runtime), torch.

    python3 bench/gpu_run.py --plan
    python3 bench/gpu_run.py --bundle .gpu/pinfeed-gpu.tar.xz --out "$OUT"
    python3 bench/gpu_run.py --bundle .gpu/pinfeed-gpu.tar.xz --rehearse

The run is a plan: steps in the order of what their figures are worth (the
libraries, the module, the GPU tests, copy bandwidth, training, the feed,
the sanitizers last), each with its planned seconds. --plan prints it, the
total and the device call to make; the total must leave a minute of the
deadline free, or --plan exits non-zero. A step may take twice its plan
(then it fails: it is far slower than planned) but never past the run's
deadline; a step the deadline cuts, or never reaches, is NOT CHECKED, never
failed. Every step is an assertion about what its name claims. The output
goes to OUT/log and a summary to OUT/gpu.json (rewritten after every step).
The exit status is non-zero when a step fails, or, on a machine with a GPU,
when a step could not be checked.

--rehearse, for a machine without a GPU (CI): unpacks the bundle, checks that
every binary and the Python module resolve their libraries from the bundle
and the system's C/C++ runtimes alone, imports the module with a Python 3.12,
runs the CPU parts of the steps (datasets, the GPU's exact training
configurations on the CPU backend with the same assertions and bars, the
copy benchmark on the CPU backend, loader scaling at 1 and 2 threads), and
prints each GPU step as WOULD RUN: <command>. bench/gpu_check.sh makes the
bundle and runs this in the mode the machine allows.

Standard library only: it runs with the device's python3 and with any
Python 3 here."""
import argparse
import glob
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

# The checks and figures each step applies to its output (bench/gpu_checks.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_checks import (  # noqa: E402
    ALWAYS, COMPUTE_BOUND, NotChecked, RESNET_SHAPED, SANITIZER_FLAGS,
    SANITIZER_TESTS, SIMD_LEVELS, check_libraries, compute_bound, copy_figures,
    feed_figures, find_sanitizer, last_json, no_skips, pcie_peak, probe_host,
    pytest_no_skips, resnet_figures, sanitizer_clean, sanitizer_refused, simd_figures, tail,
    thread_scaling, trained,
)


DEADLINE = 390           # seconds for the whole run on a GPU: the device call's 420 less a margin
REHEARSAL_DEADLINE = 1800  # a rehearsal runs the CPU twins, slower on CI's 2 cores
MARGIN = 60              # the plan's total must leave this much of the deadline free
SETUP_SECONDS = 10       # unpacking the bundle, nvidia-smi, finding CUDA's libraries
CALL_TIMEOUT = 420       # the device call's timeout_s

# The training configurations, shared by the GPU steps and their CPU twins:
# the rehearsal runs the very same ones, so the GPU run can only fail for
# GPU reasons.
MLP = dict(args=["--epochs", "5", "--batch-size", "32", "--size", "64", "--pool", "8"], bar=0.5)
CNN = dict(args=["--epochs", "6", "--batch-size", "64", "--size", "64", "--model", "cnn:32,64,128", "--lr", "0.4"],
           bar=0.6)
THREAD_COUNTS = (1, 2, 4, 8, 16)


class Step:
    """One line of the plan: `seconds` is what it is planned to take; `gpu`
    steps are printed, not run, in a rehearsal; `make(ctx)` returns the
    command, its check and environment (or None when there is nothing to run
    and it said why)."""

    def __init__(self, name, seconds, make, gpu=True):
        self.name, self.seconds, self.make, self.gpu = name, seconds, make, gpu


class Runner:
    def __init__(self, root, out, rehearse, deadline, only):
        self.root, self.out, self.rehearse = root, out, rehearse
        self.log = open(os.path.join(out, "log"), "a", buffering=1)
        self.steps = []
        self.cuda_dirs = []
        self.gpus = 0
        self.until = time.monotonic() + deadline  # the whole run's budget (the device call's limit, less a margin)
        self.only = only  # names (substrings) of the steps to run; None: all
        self.summary = {}
        self.child = None  # the step's process, while one runs
        self.slack = 10  # a step's own limit: twice its plan, and at least this many seconds over it
        # The plan is for the device's 16 cores; a rehearsal's CPU steps run
        # on CI's 2 (making the datasets: ~25 s here, ~4 s there).
        self.stretch = 8 if rehearse else 1

    def stop(self, *_):
        """SIGTERM (the device call's limit): the running step's process
        group goes too (it has a session of its own, which the device would
        leave running), then out through main's `finally`."""
        if self.child is not None:
            try:
                os.killpg(self.child.pid, signal.SIGKILL)
            except OSError:
                pass
        sys.exit(124)

    def say(self, text):
        print(text, flush=True)
        self.log.write(text + "\n")

    def env(self, **extra):
        """The environment of a command: CUDA's folders ahead of the library
        path it had (the bundle's own libraries come through RUNPATH; the
        system's default folders are never put there, or they would win over
        RUNPATH)."""
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        inherited = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
        env["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(self.cuda_dirs + inherited))
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def write_summary(self, **fields):
        """gpu.json, rewritten after every step: a run killed at the call's
        limit still leaves what it found."""
        self.summary.update(fields, steps=self.steps)
        with open(os.path.join(self.out, "gpu.json.tmp"), "w") as f:
            json.dump(self.summary, f, indent=1)
        os.replace(os.path.join(self.out, "gpu.json.tmp"), os.path.join(self.out, "gpu.json"))

    def wanted(self, name):
        """--only's steps; the library check and the datasets always (a
        second try unpacks afresh, and the other steps read the data)."""
        return self.only is None or name in ALWAYS or any(o in name for o in self.only)

    def run(self, name, cmd, planned, gpu=True, check=None, env=None, quiet=False, refused=None):
        """One step: `cmd` for at most twice its `planned` seconds, never
        past the run's deadline; `check(stdout)` returns the step's figures
        or raises with the reason (NotChecked: nothing proven either way).
        `refused(output)`, on a non-zero exit, names why the tool could not
        run here at all (NOT CHECKED), or returns None (a failure). Over its
        own time it fails; cut by the deadline it is not checked."""
        text = " ".join(shlex.quote(str(c)) for c in cmd)
        if not self.wanted(name):
            return None
        if gpu and self.rehearse:
            self.say(f"WOULD RUN: {text}")
            self.steps.append(dict(name=name, status="would run", command=text, planned=planned))
            return None
        left = self.until - time.monotonic()
        if left < 5:
            self.not_checked(name, "the run's deadline came first (--deadline)")
            return None
        own = max(2 * planned, planned + self.slack) * self.stretch
        timeout = min(own, left)
        self.say(f"== {name} (planned {planned} s): {text}")
        t0 = time.monotonic()
        step = dict(name=name, command=text, planned=planned)
        output, rc = "", None
        try:
            # A session of its own: a timeout kills the whole group (sh -c's
            # children, compute-sanitizer's target), not only the child.
            p = subprocess.Popen([str(c) for c in cmd], env=env or self.env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
            self.child = p  # killed with its group if this script is stopped (stop())
            try:
                output, _ = p.communicate(timeout=timeout)
                rc = p.returncode
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                output, _ = p.communicate()
        except OSError as e:
            output, rc = f"cannot start: {e}", -1
        self.child = None
        step["seconds"] = round(time.monotonic() - t0, 2)
        self.log.write(output)
        if not quiet and (len(output) < 3000 or rc != 0):  # the whole of it is in the log
            sys.stdout.write(output[-3000:])
        if rc is None and timeout < own:
            step.update(status="not checked", reason=f"the run's deadline cut it after {step['seconds']} s "
                                                     f"(planned {planned} s)")
        elif rc is None:
            step.update(status="fail", reason=f"did not finish within {own} s (its planned {planned} s: twice that, "
                                              f"or {self.slack} s more{', x8 in a rehearsal' if self.rehearse else ''})")
        elif rc != 0 and refused and refused(output):
            step.update(status="not checked", reason=refused(output))
        elif rc != 0:
            step.update(status="fail", reason=f"exit status {rc}: {tail(output)}")
        else:
            try:
                step.update(status="pass", figures=check(output) if check else {})
            except NotChecked as e:
                step.update(status="not checked", reason=str(e))
            except Exception as e:  # any check's failure is the step's, never the run's
                step.update(status="fail", reason=f"{type(e).__name__}: {e}")
        said = step.get("reason") or json.dumps(step.get("figures") or {})[:600]
        self.say(f"-- {name}: {step['status'].upper()} ({step['seconds']} s): {said}")
        self.steps.append(step)
        self.write_summary()
        return step

    def not_checked(self, name, why):
        self.say(f"-- {name}: NOT CHECKED: {why}")
        self.steps.append(dict(name=name, status="not checked", reason=why))

    def bin(self, name):
        return os.path.join(self.root, "bin", name)

    def test(self, name):
        return os.path.join(self.root, "tests", name)


def plan(ctx):
    """The steps, in the order of what their figures are worth."""
    r, data, train = ctx["r"], ctx["data"], ctx["train"]

    def cmd(command, check=None, env=None, quiet=False, gpu=None, refused=None):
        return dict(cmd=command, check=check, env=env, quiet=quiet, gpu=gpu, refused=refused)

    def module(_):
        if r.rehearse:  # the extension alone with a 3.12 (no torch for it here)
            if not ctx["python"]:
                r.not_checked("python module: extension, a pinned batch", "no Python 3.12 here (pyenv install 3.12)")
                return None
            code = ("import importlib.util as u, sys; s = u.spec_from_file_location('_pinfeed', sys.argv[1]); "
                    "m = u.module_from_spec(s); s.loader.exec_module(m); assert hasattr(m, 'Loader'), dir(m); "
                    "print(sys.version.split()[0], m.__name__, len(dir(m)), 'names')")
            module_so = glob.glob(os.path.join(r.root, "python", "pinfeed", "_pinfeed*.so"))
            return cmd([ctx["python"], "-c", code, module_so[0]], gpu=False,
                       check=lambda out: {"imported": out.strip().splitlines()[-1]})
        return cmd([ctx["python"], "-c", PYTHON_BATCH, f"{data}/mlp/train"], env=ctx["py_env"], check=python_batch)

    def gtest(name, filt=None):
        args = [r.test(name), "--gtest_brief=1"] + ([f"--gtest_filter={filt}"] if filt else [])
        return lambda _: cmd(args, check=no_skips)

    def sanitizer(tool):
        def make(_):
            if not ctx["sanitizer"] and not r.rehearse:
                r.not_checked(f"compute-sanitizer {tool}", "no compute-sanitizer here (PATH, beside nvcc, "
                              "/usr/local/cuda*/{bin,compute-sanitizer}, /opt/nvidia, the nvidia pip wheels)")
                return None
            return cmd([ctx["sanitizer"] or "compute-sanitizer", "--tool", tool, "--error-exitcode", "3",
                        *SANITIZER_FLAGS[tool], r.test("device_backend_gpu_test"), "--gtest_brief=1",
                        f"--gtest_filter={SANITIZER_TESTS[tool]}"], check=lambda out: sanitizer_clean(tool, out),
                       refused=sanitizer_refused)
        return make

    peak = pcie_peak(r)
    cb, rn = COMPUTE_BOUND, RESNET_SHAPED
    counts = THREAD_COUNTS if not r.rehearse else (1, 2)
    return [
        Step("libraries", 5, lambda _: cmd(["true"], check=lambda _: check_libraries(r)), gpu=False),
        Step("datasets", 10, lambda _: cmd(["sh", "-c", f"{shlex.quote(r.bin('pinfeed-data'))} -q make --out "
                                           f"{data}/mlp --classes 10 --per-class 400 --val 0.2 --seed 1 && "
                                           f"{shlex.quote(r.bin('pinfeed-data'))} -q make --out {data}/tex "
                                           f"--classes 4 --per-class 300 --val 0.2 --style texture --seed 2"]),
             gpu=False),
        Step("python module: extension, a pinned batch", 20, module),
        Step("pinning: pool slots page-locked for the driver", 10, gtest("pinned_resource_gpu_test")),
        Step("device_backend_gpu_test", 20, gtest("device_backend_gpu_test")),
        Step("ddp_gpu_test", 15, gtest("ddp_gpu_test")),
        Step("pinfeed-diag sees the GPU", 5, lambda _: cmd(
            [r.bin("pinfeed-diag"), "--gpus", "1", "--batch", "256x3x224x224:u8", "--prefetch", "4", "--sample-ms",
             "100", "--json"], check=diag_sees_gpu)),
        Step("copy pinned vs pageable", 10, lambda _: cmd(
            [r.bin("pinfeed-bench"), "copy", "--device", "cuda:0", "--mib", "256", "--repeat", "10", "--json"],
            check=copy_figures(peak))),
        Step("train mlp on cuda:0", 15, lambda _: cmd(
            train + ["--data", f"{data}/mlp/train", "--val", f"{data}/mlp/val", *MLP["args"], "--devices", "cuda:0"],
            check=trained(MLP["bar"], True))),
        Step("train cnn on cuda:0", 25, lambda _: cmd(
            train + ["--data", f"{data}/tex/train", "--val", f"{data}/tex/val", *CNN["args"], "--devices", "cuda:0"],
            check=trained(CNN["bar"], True))),
        Step("compute-bound cnn on cuda:0", 25, lambda _: cmd(
            train + ["--data", f"{data}/mlp/train", "--epochs", "2", "--batch-size", str(cb["batch"]), "--size",
                     str(cb["size"]), "--model", "cnn:" + ",".join(map(str, cb["channels"])), "--threads", "16",
                     "--devices", "cuda:0"], check=compute_bound)),
        Step("loader threads " + ",".join(map(str, THREAD_COUNTS)), 25, lambda _: cmd(
            [r.bin("pinfeed-bench"), "threads", "--data", f"{data}/mlp/train", "--size", "224", "--batch-size", "64",
             "--counts", ",".join(map(str, counts)), "--epochs", "1", "--repeat", "1", "--ceiling-files", "64",
             "--out", f"{data}/threads", "--json"], check=thread_scaling(counts)), gpu=False),
        Step("loader sse2 vs avx2 vs avx512, 16 threads", 15, lambda _: cmd(
            ["sh", "-c", " && ".join(
                f"PINFEED_SIMD={lvl} {shlex.quote(r.bin('pinfeed-bench'))} loader --data {data}/mlp/train "
                f"--threads {16 if not r.rehearse else 2} --epochs 1 --repeat 1 --ceiling-files 16 --json"
                for lvl in SIMD_LEVELS)], check=simd_figures), gpu=False),
        Step("loader to cuda vs to host, 16 threads", 25, lambda _: cmd(
            [ctx["python"] or "python3", os.path.join(ctx["repo"], "bench", "python_device_bench.py"),
             f"{data}/mlp/train", "--device", "cuda:0", "--batch-size", "256", "--size", "224", "--threads", "16",
             "--rounds", "3", "--json"], env=ctx["py_env"],
            check=feed_figures)),
        Step("resnet-shaped step: data wait, 16 threads", 20, lambda _: cmd(
            train + ["--data", f"{data}/mlp/train", "--epochs", "2", "--batch-size", str(rn["batch"]), "--size",
                     str(rn["size"]), "--model", "cnn:" + ",".join(map(str, rn["channels"])), "--threads", "16",
                     "--profile", "--devices", "cuda:0"], check=resnet_figures)),
        Step("python device tests", 15, lambda _: cmd(
            [ctx["python"] or "python3", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
             os.path.join(ctx["repo"], "tests", "python", "test_device_gpu.py")], env=ctx["py_env"],
            check=pytest_no_skips)),
        Step("compute-sanitizer memcheck", 30, sanitizer("memcheck")),
        Step("compute-sanitizer racecheck", 30, sanitizer("racecheck")),
    ]


# Loads one batch through the module with the device's torch: the compiled
# extension is the one imported, the batch has its shape, and its memory is
# page-locked for the driver (torch's is_pinned asks cudaPointerGetAttributes).
PYTHON_BATCH = """
import json, sys, torch, pinfeed, pinfeed._pinfeed as ext
loader = pinfeed.Loader(sys.argv[1], batch_size=32, size=64, threads=4, pin_memory="require")
images, labels = next(iter(loader))
print(json.dumps(dict(python=sys.version.split()[0], torch=torch.__version__, extension=ext.__file__,
                      cuda=torch.cuda.is_available(), shape=list(images.shape), labels=len(labels),
                      pinned=bool(images.is_pinned()))))
"""


def python_batch(out):
    j = last_json(out)
    assert j["cuda"], "torch sees no GPU"
    assert j["extension"].endswith(".so"), f"the extension was not loaded: {j['extension']}"
    assert j["shape"] == [32, 3, 64, 64] and j["labels"] == 32, f"batch of shape {j['shape']}"
    assert j["pinned"], "the batch is not page-locked memory for the driver (torch's is_pinned)"
    return {k: j[k] for k in ("python", "torch", "shape", "pinned")}


def diag_sees_gpu(out):
    j = last_json(out)
    gpus = j["cuda"]["devices"]
    assert gpus, f"pinfeed-diag reports no GPU: {j['cuda'].get('message')}"
    return {"gpus": len(gpus), "plan": j.get("plan")}


def cpu_twins(ctx):
    """A rehearsal's CPU parts: the GPU's training configurations on the
    CPU backend (the same bars), pinfeed-diag, the copy benchmark."""
    r, data, train = ctx["r"], ctx["data"], ctx["train"]
    r.run("pinfeed-diag (no GPU)", [r.bin("pinfeed-diag"), "--gpus", "1", "--batch", "256x3x224x224:u8",
          "--prefetch", "4", "--sample-ms", "100", "--json"], 30, gpu=False,
          check=lambda out: {"plan": last_json(out).get("plan")})
    r.run("copy cpu (the CPU backend's mechanism)", [r.bin("pinfeed-bench"), "copy", "--device", "cpu", "--mib", "64",
          "--repeat", "3", "--json"], 60, gpu=False, check=copy_figures(None))
    r.run("train mlp (cpu backend, the GPU's configuration)", train + ["--data", f"{data}/mlp/train", "--val",
          f"{data}/mlp/val", *MLP["args"], "--devices", "cpu:1"], 240, gpu=False, check=trained(MLP["bar"], False))
    r.run("train cnn (cpu backend, the GPU's configuration)", train + ["--data", f"{data}/tex/train", "--val",
          f"{data}/tex/val", *CNN["args"], "--devices", "cpu:1"], 300, gpu=False, check=trained(CNN["bar"], False))


def print_plan(steps, deadline):
    total = SETUP_SECONDS + sum(s.seconds for s in steps)
    print(f"{'setup (unpack, nvidia-smi, CUDA libraries)':<48} {SETUP_SECONDS:>4} s")
    for s in steps:
        print(f"{s.name:<48} {s.seconds:>4} s{'' if s.gpu else '   (no GPU needed)'}")
    print(f"total {total} s of a {deadline:.0f} s deadline (margin {deadline - total:.0f} s; each step may take "
          f"twice its plan, never past the deadline)")
    print(f"device call: run(command='python3 bench/gpu_run.py --bundle .gpu/pinfeed-gpu.tar.xz --out \"$OUT\"', "
          f"carry=['.gpu'], timeout_s={CALL_TIMEOUT})")
    ok = total <= deadline - MARGIN and deadline <= CALL_TIMEOUT - 20
    if not ok:
        print(f"the plan does not fit: {total} s needs a {total + MARGIN} s deadline inside the call's {CALL_TIMEOUT} s",
              file=sys.stderr)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=".gpu/pinfeed-gpu.tar.xz")
    ap.add_argument("--out", default=os.environ.get("OUT") or "build/gpu-run")
    ap.add_argument("--rehearse", action="store_true", help="no GPU here: run what needs none, print the rest")
    ap.add_argument("--plan", action="store_true", help="print the steps' planned seconds, the total and the device "
                                                        "call; exit non-zero when the plan does not fit the deadline")
    ap.add_argument("--deadline", type=float, default=None,
                    help=f"seconds for the whole run (default {DEADLINE}, inside the device call's {CALL_TIMEOUT}; "
                         f"{REHEARSAL_DEADLINE} for a rehearsal)")
    ap.add_argument("--only", help="comma-separated parts of step names: run only those (a second try)")
    ap.add_argument("--keep", action="store_true", help="keep the unpacked bundle")
    a = ap.parse_args()
    deadline = a.deadline or (REHEARSAL_DEADLINE if a.rehearse else DEADLINE)
    if a.plan:
        dry = Runner.__new__(Runner)
        dry.rehearse, dry.root = True, "BUNDLE"
        steps = plan(dict(r=dry, data="DATA", train=[], python="python3", py_env=None, repo=".", sanitizer=None))
        sys.exit(0 if print_plan(steps, deadline) else 1)
    os.makedirs(a.out, exist_ok=True)
    # The device call ends a command past its limit with SIGTERM: Runner.stop
    # exits through `finally`, which writes the summary.
    work = tempfile.mkdtemp(prefix="pinfeed-gpu-")
    started = time.time()
    with tarfile.open(a.bundle) as tar:
        tar.extractall(work)
    root = os.path.join(work, "pinfeed-gpu")
    only = [o.strip() for o in a.only.split(",") if o.strip()] if a.only else None
    r = Runner(root, a.out, a.rehearse, deadline - (time.time() - started), only)
    signal.signal(signal.SIGTERM, r.stop)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    data = os.path.join(work, "data")
    finished = False
    try:
        found, python = probe_host(r, a, root)
        for lib in ("libcublas.so.13", "libnccl.so.2"):  # the runtime is linked statically
            if lib not in found and not a.rehearse:
                r.not_checked(f"find {lib}", "not in this Python's nvidia wheels, torch/lib or /usr/local/cuda")
        ctx = dict(r=r, data=data, repo=repo, python=python, train=[r.bin("pinfeed-train"), "--json", "-q"],
                   sanitizer=find_sanitizer(python or sys.executable),
                   py_env=r.env(PYTHONPATH=os.path.join(root, "python"), PINFEED_DATA_TOOL=r.bin("pinfeed-data"),
                                PINFEED_TRAIN_TOOL=r.bin("pinfeed-train"), PYTHONUNBUFFERED=1))
        r.say(f"compute-sanitizer: {ctx['sanitizer'] or 'not found'}")
        steps = plan(ctx)
        r.write_summary(plan={s.name: s.seconds for s in steps})
        for s in steps:
            if not r.wanted(s.name):
                continue
            made = s.make(ctx)
            if made is not None:
                gpu = s.gpu if made["gpu"] is None else made["gpu"]
                r.run(s.name, made["cmd"], s.seconds, gpu=gpu, check=made["check"], env=made["env"],
                      quiet=made["quiet"], refused=made["refused"])
            if s.name == "datasets" and a.rehearse:
                cpu_twins(ctx)
        finished = True
    finally:
        failed = [s["name"] for s in r.steps if s["status"] == "fail"]
        unchecked = [s["name"] for s in r.steps if s["status"] == "not checked"]
        ok = finished and not failed and (a.rehearse or not unchecked)
        r.write_summary(ok=ok, finished=finished, seconds=round(time.time() - started, 1), failed=failed,
                        not_checked=unchecked)
        r.say(f"gpu_run: {'OK' if ok else 'FAILED'} in {r.summary['seconds']} s; failed: {failed or 'none'}; "
              f"not checked: {unchecked or 'none'}{'' if finished else '; the run stopped early'}; "
              f"summary in {os.path.join(a.out, 'gpu.json')}")
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
