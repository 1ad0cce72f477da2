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
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

# Sonames an ELF file in the bundle may take from outside it: the C/C++
# runtimes (the system's), and CUDA's own libraries (the device's driver and
# pip wheels; not there at all in a rehearsal).
SYSTEM = re.compile(r"^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libutil|libstdc\+\+|libgcc_s)\.so")
CUDA = re.compile(r"^(libcuda|libcudart|libcublas|libcublasLt|libnccl|libnvidia-[a-z-]+)\.so")
CUDA_LIBS = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libnccl.so.2", "libcuda.so.1")

DEADLINE = 390           # seconds for the whole run on a GPU: the device call's 420 less a margin
REHEARSAL_DEADLINE = 1800  # a rehearsal runs the CPU twins, slower on CI's 2 cores
MARGIN = 60              # the plan's total must leave this much of the deadline free
SETUP_SECONDS = 10       # unpacking the bundle, nvidia-smi, finding CUDA's libraries
CALL_TIMEOUT = 420       # the device call's timeout_s
# PCIe bandwidth per lane and direction after encoding, GB/s, by generation.
PCIE_LANE_GB_PER_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

# The training configurations, shared by the GPU steps and their CPU twins:
# the rehearsal runs the very same ones, so the GPU run can only fail for
# GPU reasons.
MLP = dict(args=["--epochs", "5", "--batch-size", "32", "--size", "64", "--pool", "8"], bar=0.5)
CNN = dict(args=["--epochs", "6", "--batch-size", "64", "--size", "64", "--model", "cnn:32,64,128", "--lr", "0.4"],
           bar=0.6)
# Compute-bound: a wide two-block CNN at 96 px (~16 GFLOP an image with its
# backward, 4.7 M parameters: seconds of GPU work a run, no host setup to
# speak of), against the loader's ~10k images/s at 16 threads.
COMPUTE_BOUND = dict(channels=(512, 1024), size=96, batch=128)
# ResNet-shaped: four stride-2 stages to 14 x 14 at 224 px (~4.3 GFLOP an
# image with the backward, a ResNet-18's order), 16 decode threads.
RESNET_SHAPED = dict(channels=(64, 128, 256, 512), size=224, batch=128)
THREAD_COUNTS = (1, 2, 4, 8, 16)


def cnn_gflop(channels, size):
    """Forward and backward GFLOP of one image through the CNN's stride-2
    3x3 convolutions (the backward is twice the forward)."""
    flop, cin, side = 0, 3, size
    for cout in channels:
        side = (side + 1) // 2
        flop += 2 * 9 * cin * cout * side * side
        cin = cout
    return 3 * flop / 1e9


class Step:
    """One line of the plan: `seconds` is what it is planned to take; `gpu`
    steps are printed, not run, in a rehearsal; `make(ctx)` returns the
    command, its check and environment (or None when there is nothing to run
    and it said why)."""

    def __init__(self, name, seconds, make, gpu=True):
        self.name, self.seconds, self.make, self.gpu = name, seconds, make, gpu


class NotChecked(Exception):
    """Raised by a check: what the step needs is not there (a sanitizer
    that cannot attach to this runtime's GPU), so nothing was proven either
    way; the step is NOT CHECKED, not failed."""


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


def tail(text, n=400):
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def last_json(output):
    """The JSON object a tool printed last (--json output after log lines;
    whatever follows it, a teardown warning say, is ignored)."""
    start = output.rfind("\n{")
    start = start + 1 if start >= 0 else output.find("{")
    return json.JSONDecoder().raw_decode(output, start)[0]


def find_cuda_dirs(python):
    """Folders holding CUDA's shared libraries on this machine: the pip
    wheels of `python` (nvidia.*, torch/lib), the toolkit, the driver."""
    roots = []
    probe = ("import importlib.util, os\n"
             "for n in ('nvidia', 'torch'):\n"
             "    s = importlib.util.find_spec(n)\n"
             "    if s: print('\\n'.join(s.submodule_search_locations or []))\n")
    try:
        roots += subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        pass
    # Not /usr/lib/x86_64-linux-gnu and the like: the dynamic loader's cache
    # has them, and on LD_LIBRARY_PATH they would win over the bundle's RUNPATH.
    roots += ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib", "/usr/local/nvidia/lib64",
              "/usr/local/nvidia/lib"]
    found = {}
    for root in roots:
        if not os.path.isdir(root):
            continue
        for dirpath, _, files in os.walk(root):
            for lib in CUDA_LIBS:
                if lib in files and lib not in found:
                    found[lib] = dirpath
    return found


def ldd_problems(path, rel, output, lib, rehearse):
    """What ldd's output (stdout and stderr) says is wrong with one file:
    a library not found (CUDA's may be absent in a rehearsal), one from
    outside the bundle and the system, or a symbol version the system's
    libraries lack ("version `GLIBC_2.38' not found", on stderr)."""
    problems = []
    for line in output.splitlines():
        if "version `" in line and "not found" in line:
            problems.append(f"{rel}: {line.strip()}")
            continue
        m = re.match(r"\s*(\S+) => (.*?)( \(0x[0-9a-f]+\))?$", line)
        if not m:
            continue
        name, where = m.group(1), m.group(2)
        if where == "not found":
            if not (CUDA.match(name) and rehearse):
                problems.append(f"{rel}: {name} not found")
        elif not (os.path.realpath(where).startswith(lib + os.sep) or SYSTEM.match(name) or CUDA.match(name)):
            problems.append(f"{rel}: {name} from {where}, outside the bundle")
    return problems


def check_libraries(r):
    """Every ELF file of the bundle resolves each library from the bundle,
    the system's C/C++ runtimes or (on a GPU host) CUDA's folders, with the
    symbol versions it needs."""
    problems, checked = [], 0
    lib = os.path.realpath(os.path.join(r.root, "lib"))
    for dirpath, _, files in os.walk(r.root):
        for f in files:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                if fh.read(4) != b"\x7fELF":
                    continue
            checked += 1
            p = subprocess.run(["ldd", path], env=r.env(), capture_output=True, text=True)
            problems += ldd_problems(path, os.path.relpath(path, r.root), p.stdout + "\n" + p.stderr, lib, r.rehearse)
    assert checked > 0, "no ELF files in the bundle"
    assert not problems, "; ".join(problems[:20])
    return {"elf_files": checked}


def python312():
    """A Python 3.12 that runs (pyenv's own, not its shim, which may refuse)."""
    pyenv = os.path.expanduser(os.environ.get("PYENV_ROOT", "~/.pyenv"))
    for cand in sorted(glob.glob(pyenv + "/versions/3.12*/bin/python3.12")) + [shutil.which("python3.12")]:
        if cand and subprocess.run([cand, "-c", "pass"], capture_output=True).returncode == 0:
            return cand
    return None


def find_sanitizer(python):
    """compute-sanitizer: every candidate that exists, first found first:
    PATH, beside nvcc, each CUDA toolkit's bin/ and compute-sanitizer/
    folders, NVIDIA's /opt folders, and the pip wheel of `python`."""
    cands = [shutil.which("compute-sanitizer")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(os.path.join(os.path.dirname(nvcc), "compute-sanitizer"))
        cands.append(os.path.join(os.path.dirname(os.path.dirname(nvcc)), "compute-sanitizer", "compute-sanitizer"))
    cands += sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer"))
    cands += sorted(glob.glob("/usr/local/cuda*/compute-sanitizer/compute-sanitizer"))
    cands += sorted(glob.glob("/opt/nvidia/*/compute-sanitizer")) + sorted(glob.glob("/opt/nvidia/*/*/compute-sanitizer"))
    if python:
        try:
            out = subprocess.run([python, "-c", "import importlib.util as u; s = u.find_spec('nvidia'); "
                                  "print('\\n'.join(s.submodule_search_locations or []) if s else '')"],
                                 capture_output=True, text=True, timeout=60).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            out = []
        for root in out:
            cands += sorted(glob.glob(os.path.join(root, "*", "compute-sanitizer", "compute-sanitizer")))
            cands += sorted(glob.glob(os.path.join(root, "*", "bin", "compute-sanitizer")))
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def pcie_peak(r):
    """The link's expected peak, GB/s one way, from nvidia-smi's maximum
    generation and width; None when it cannot say."""
    if r.rehearse or not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=pcie.link.gen.max,pcie.link.width.max",
                              "--format=csv,noheader,nounits", "-i", "0"], capture_output=True, text=True, timeout=30)
        gen, width = (int(v) for v in out.stdout.split(","))
        return dict(generation=gen, width=width, gb_per_s=round(PCIE_LANE_GB_PER_S[gen] * width, 1))
    except (OSError, ValueError, KeyError, subprocess.TimeoutExpired):
        return None


def probe_host(r, a, root):
    """The bundle, the GPUs and CUDA's libraries here; the summary's first lines."""
    with open(os.path.join(root, "MANIFEST")) as f:
        manifest = f.read().splitlines()
    r.say("bundle: " + "; ".join(manifest[:3]))
    smi = None
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            r.say("nvidia-smi did not answer within 30 s")
    gpus = [line for line in (smi.stdout.splitlines() if smi and smi.returncode == 0 else []) if line.strip()]
    r.gpus = len(gpus)
    r.say(f"GPUs: {gpus or 'none'}; {os.cpu_count()} CPUs")
    python = sys.executable if not a.rehearse else (python312() or "")
    found = find_cuda_dirs(sys.executable)
    r.cuda_dirs = sorted(set(found.values()))
    r.say(f"CUDA libraries: {found or 'none found'}")
    r.say(f"kernel: {os.uname().release}")
    r.write_summary(mode="rehearse" if a.rehearse else "gpu", gpus=gpus, cpus=os.cpu_count(), kernel=os.uname().release,
                    cuda_libraries=r.cuda_dirs, bundle=manifest[:3])
    if a.rehearse and r.gpus:
        r.say("a GPU is here, but --rehearse runs only what needs none")
    if not a.rehearse and not r.gpus:
        r.say("no GPU here: every GPU step will fail (use --rehearse on a machine without one)")
    return found, python


# ---- the steps' checks ------------------------------------------------------

def at_least(n, value, what):
    assert value >= n, f"{value} {what} (expected at least {n})"
    return value


def listed_tests(out):
    return sum(1 for line in out.splitlines() if line.startswith("  "))


def no_skips(out):
    """A GoogleTest run on a GPU host: at least one test ran, and every one
    passed (a skip is a failure)."""
    assert "[  SKIPPED ]" not in out, "skipped on a GPU host: " + "; ".join(
        line for line in out.splitlines() if "SKIPPED" in line or "Skipped" in line)[:800]
    m = re.search(r"\[  PASSED  \] (\d+) tests?", out)
    assert m, "no PASSED line: " + tail(out)
    return {"passed": at_least(1, int(m.group(1)), "tests passed")}


def sanitizer_clean(tool, out):
    """memcheck ends with "ERROR SUMMARY: 0 errors", racecheck with
    "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"."""
    if tool == "racecheck":
        m = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", out)
        assert m, "no RACECHECK SUMMARY line: " + tail(out)
        assert m.group(2) == "0", f"racecheck: {m.group(0)}"
        figures = {"hazards": int(m.group(1)), "warnings": int(m.group(3))}
    else:
        m = re.search(r"ERROR SUMMARY: (\d+) errors?", out)
        assert m, "no ERROR SUMMARY line: " + tail(out)
        assert m.group(1) == "0", f"memcheck: {m.group(0)}"
        figures = {"errors": 0}
    return {**figures, **no_skips(out)}


def pytest_no_skips(out):
    last = out.strip().splitlines()[-1] if out.strip() else ""
    assert " skipped" not in last, "skipped on a GPU host: " + tail(out)
    m = re.search(r"(\d+) passed", last)
    assert m, tail(out)
    return {"passed": at_least(1, int(m.group(1)), "tests passed")}


def trained(bar, gpu_run):
    """pinfeed-train's JSON: the loss fell, the held-out accuracy is over
    the bar; on a GPU every batch came from pinned slots."""
    def check(out):
        j = last_json(out)
        first, last = j["epochs"][0], j["epochs"][-1]
        assert last["loss"] < 0.7 * first["loss"], f"loss went {first['loss']:.3f} -> {last['loss']:.3f}"
        if gpu_run:
            assert all(e["pinned_batches"] > 0 and e["pageable_batches"] == 0 for e in j["epochs"]), \
                "a GPU epoch had pageable batches (or none pinned)"
        assert last["val_accuracy"] >= bar, f"held-out accuracy {last['val_accuracy']:.3f} is under the bar {bar}"
        return {"loss_first": first["loss"], "loss_last": last["loss"], "val_accuracy": last["val_accuracy"],
                "bar": bar, "images_per_second": last["images_per_second"],
                "data_wait_fraction": last["data_wait_fraction"], "steps_per_epoch": last["steps"]}
    return check


def copy_figures(peak):
    """pinfeed-bench copy's JSON: pinned must be clearly faster than
    pageable on a GPU (the CPU backend's two copies are both memcpy); the
    pinned rate is also set against the link's expected peak."""
    def check(out):
        j = last_json(out)
        ratio = j["pageable_over_pinned"]
        figures = {k: j[k] for k in ("pinned_gb_per_s", "pageable_gb_per_s", "pageable_over_pinned")}
        if peak:
            figures.update(link=f"PCIe gen{peak['generation']} x{peak['width']}", link_peak_gb_per_s=peak["gb_per_s"],
                           pinned_over_peak=round(j["pinned_gb_per_s"] / peak["gb_per_s"], 3))
        if j["device"].startswith("cuda"):
            # Not calibrated on a device yet (docs/results.md, "First GPU
            # run"): pageable copies go through a staging buffer, which on
            # PCIe hosts has cost 1.5-3x; 1.25 only says "clearly".
            assert ratio > 1.25, f"pageable copies take {ratio:.2f}x the pinned time: pinned is not clearly faster"
        return figures
    return check


def thread_scaling(counts):
    """pinfeed-bench threads' JSON: images/s for every count asked, and
    each count's images/s per thread against one thread's (1.0: linear)."""
    def check(out):
        j = last_json(out)
        rows = {int(row["threads"]): row["images_per_s"] for row in j["rows"]}
        assert sorted(rows) == sorted(counts), f"rows for {sorted(rows)} threads, asked for {list(counts)}"
        assert all(v > 0 for v in rows.values()), rows
        one = rows[1]
        return {"images_per_second": {n: round(v) for n, v in rows.items()},
                "per_thread_vs_one": {n: round(v / n / one, 3) for n, v in rows.items()}}
    return check


def json_objects(output):
    """Every JSON object a command printed at the start of a line, in order."""
    dec, found, at = json.JSONDecoder(), [], 0
    output = "\n" + output
    while True:
        at = output.find("\n{", at)
        if at < 0:
            return found
        obj, end = dec.raw_decode(output, at + 1)
        found.append(obj)
        at = end


SIMD_LEVELS = ("sse2", "avx2", "avx512")


def simd_figures(out):
    """pinfeed-bench loader at SSE2, AVX2 and AVX-512 (the same bytes: Note
    [SIMD level by core]): which is fastest on this core. A level the CPU
    lacks runs at the CPU's best, and the run says which (config.simd)."""
    runs = [j for j in json_objects(out) if "loader" in j]
    assert len(runs) == len(SIMD_LEVELS), f"{len(runs)} loader results, expected {len(SIMD_LEVELS)} {SIMD_LEVELS}"
    levels = [r["config"]["simd"] for r in runs]
    assert levels[0] == "sse2", f"the first run was at {levels[0]}, asked for sse2"
    rate = [r["loader"]["images_per_s"] for r in runs]
    figures = {"levels": levels}
    for asked, got, r in zip(SIMD_LEVELS, levels, rate):
        figures[f"images_per_second_{asked}"] = round(r)
        if got != asked:
            figures[f"{asked}_ran_at"] = got
    figures["avx2_over_sse2"] = round(rate[1] / rate[0], 3)
    figures["avx512_over_avx2"] = round(rate[2] / rate[1], 3)
    return figures


def feed_figures(out):
    """python_device_bench's JSON: device= into GPU memory, the old way,
    and the same decode into host memory alone."""
    j = last_json(out)
    assert j["device"].startswith("cuda"), f"the feed ran on {j['device']}"
    rates = {k: j[k] for k in ("images_per_second_device", "images_per_second_by_hand", "images_per_second_host")}
    assert all(v > 0 for v in rates.values()), rates
    return {k: v for k, v in j.items() if k != "rounds"}


def compute_bound(out):
    last = last_json(out)["epochs"][-1]
    assert last["steps"] >= 20, f"{last['steps']} steps in the last epoch: too few to judge the wait"
    assert last["data_wait_fraction"] < 0.1, \
        f"data_wait_fraction {last['data_wait_fraction']:.3f} in a compute-bound run: the feed stalls the GPU"
    gflop = cnn_gflop(COMPUTE_BOUND["channels"], COMPUTE_BOUND["size"])
    return {**{k: last[k] for k in ("images_per_second", "data_wait_fraction", "steps")},
            "gflop_per_image": round(gflop, 2), "tflops": round(last["images_per_second"] * gflop / 1e3, 2)}


def resnet_figures(out):
    last = last_json(out)["epochs"][-1]
    assert last.get("profile_seconds_per_step"), "no step profile (--profile)"
    assert last["steps"] >= 20, f"{last['steps']} steps in the last epoch: too few to judge the wait"
    gflop = cnn_gflop(RESNET_SHAPED["channels"], RESNET_SHAPED["size"])
    return {**{k: last.get(k) for k in ("images_per_second", "data_wait_fraction", "profile_seconds_per_step")},
            "gflop_per_image": round(gflop, 2), "tflops": round(last["images_per_second"] * gflop / 1e3, 2)}


# ---- the plan ---------------------------------------------------------------

# The steps every run makes, --only or not.
ALWAYS = ("libraries", "datasets")
# The sanitizers' GoogleTest filters: our kernels' tests (im2col, col2im,
# BatchNorm, pooling), without the whole CNN's gradient (~11k launches) and
# the two-stream test (100 launches over 400k values): minutes under either
# tool, for kernels the tests above already run.
SANITIZER_TESTS = {"memcheck": "*Im2col*:*Col2im*:*BatchNorm*:*GlobalAveragePooling*-*TwoStreams*",
                   "racecheck": "*Im2col*:*Col2im*:*BatchNorm*:*GlobalAveragePooling*-*TwoStreams*"}
# memcheck: every kernel's memory accesses, no API-error reports (cuBLAS
# makes and handles errors inside itself; an API error of ours throws
# CudaError and fails the test anyway). racecheck: only our kernels (their
# mangled names hold "pinfeed"); cuBLAS's hazards are not ours to fix.
SANITIZER_FLAGS = {"memcheck": ["--report-api-errors", "no"], "racecheck": ["--kernel-name", "kns=pinfeed"]}
# compute-sanitizer on a runtime that does not let it attach (gVisor: "Device
# not supported", then error 999 at the first allocation): nothing proven.
SANITIZER_REFUSED = re.compile(r"Device not supported|CUDA_ERROR_UNKNOWN|error 999|"
                               r"Target application terminated before first instrumented API call")


def sanitizer_refused(out):
    m = SANITIZER_REFUSED.search(out)
    return f"compute-sanitizer cannot attach on this runtime ({m.group(0)}; uname -r: {os.uname().release})" \
        if m and "SUMMARY" not in out else None


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
