#!/usr/bin/env python3
"""Runs the GPU checks from the bundle (bench/gpu_bundle.sh) on a machine
with nothing else installed: a GPU, its driver, CUDA's libraries as pip
wheels in python3's environment (cuBLAS, NCCL, the runtime), torch.

    python3 bench/gpu_run.py --bundle .gpu/pinfeed-gpu.tar.xz --out "$OUT"
    python3 bench/gpu_run.py --bundle .gpu/pinfeed-gpu.tar.xz --rehearse

Every step runs under its own timeout and is an assertion; the output goes to
OUT/log and a summary to OUT/gpu.json. The exit status is non-zero when a
step fails, or, on a machine with a GPU, when a step could not be checked.

--rehearse, for a machine without a GPU (CI): unpacks the bundle, checks that
every binary and the Python module resolve their libraries from the bundle
and the system's C/C++ runtimes alone, imports the module with a Python 3.12,
runs the CPU parts of the steps (datasets, the same training on the CPU
backend with the same assertions, the copy benchmark on the CPU backend), and
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

    def run(self, name, cmd, timeout, gpu=True, check=None, env=None, quiet=False):
        """One step: `cmd` under `timeout` (never past the run's deadline);
        `check(stdout)` returns the step's figures or raises with the reason."""
        text = " ".join(shlex.quote(str(c)) for c in cmd)
        if self.only is not None and not any(o in name for o in self.only):
            return None
        if gpu and self.rehearse:
            self.say(f"WOULD RUN: {text}")
            self.steps.append(dict(name=name, status="would run", command=text))
            return None
        left = self.until - time.monotonic()
        if left < 5:
            self.not_checked(name, "the run's deadline came first (--deadline)")
            return None
        timeout = min(timeout, left)
        self.say(f"== {name}: {text}")
        t0 = time.monotonic()
        step = dict(name=name, command=text)
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
        if rc is None:
            step.update(status="fail", reason=f"did not finish within {timeout:.0f} s")
        elif rc != 0:
            step.update(status="fail", reason=f"exit status {rc}: {tail(output)}")
        else:
            try:
                step.update(status="pass", figures=check(output) if check else {})
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


def check_libraries(r):
    """Every ELF file of the bundle resolves each library from the bundle,
    the system's C/C++ runtimes or (on a GPU host) CUDA's folders."""
    problems, checked = [], 0
    lib = os.path.realpath(os.path.join(r.root, "lib"))
    for dirpath, _, files in os.walk(r.root):
        for f in files:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                if fh.read(4) != b"\x7fELF":
                    continue
            checked += 1
            out = subprocess.run(["ldd", path], env=r.env(), capture_output=True, text=True).stdout
            for line in out.splitlines():
                m = re.match(r"\s*(\S+) => (.*?)( \(0x[0-9a-f]+\))?$", line)
                if not m:
                    continue
                name, where = m.group(1), m.group(2)
                if where == "not found":
                    if not (CUDA.match(name) and r.rehearse):
                        problems.append(f"{os.path.relpath(path, r.root)}: {name} not found")
                elif not (os.path.realpath(where).startswith(lib + os.sep) or SYSTEM.match(name) or CUDA.match(name)):
                    problems.append(f"{os.path.relpath(path, r.root)}: {name} from {where}, outside the bundle")
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
    r.say(f"GPUs: {gpus or 'none'}")
    python = sys.executable if not a.rehearse else (python312() or "")
    found = find_cuda_dirs(sys.executable)
    r.cuda_dirs = sorted(set(found.values()))
    r.say(f"CUDA libraries: {found or 'none found'}")
    r.write_summary(mode="rehearse" if a.rehearse else "gpu", gpus=r.gpus, cuda_libraries=r.cuda_dirs,
                    bundle=manifest[:3])
    if a.rehearse and r.gpus:
        r.say("a GPU is here, but --rehearse runs only what needs none")
    if not a.rehearse and not r.gpus:
        r.say("no GPU here: every GPU step will fail (use --rehearse on a machine without one)")
    return manifest, found, python


def library_and_module_steps(r, a, root, found, python):
    """The bundle's libraries resolve; the module imports under Python 3.12."""
    r.run("libraries", ["true"], 10, gpu=False, check=lambda _: check_libraries(r))
    for lib in ("libcublas.so.13", "libnccl.so.2"):  # the runtime is linked statically
        if lib not in found and not a.rehearse:
            r.not_checked(f"find {lib}", "not in this Python's nvidia wheels, torch/lib or /usr/local/cuda")

    # The Python module with a 3.12 interpreter: the device's with its
    # torch; in a rehearsal the extension alone (no torch here for 3.12).
    module = glob.glob(os.path.join(root, "python", "pinfeed", "_pinfeed*.so"))
    if a.rehearse:
        if not python:
            r.not_checked("python module", "no Python 3.12 here (pyenv install 3.12)")
        else:
            code = ("import importlib.util as u, sys; s = u.spec_from_file_location('_pinfeed', sys.argv[1]); "
                    "m = u.module_from_spec(s); s.loader.exec_module(m); print(sys.version.split()[0], m.__name__, "
                    "len(dir(m)), 'names')")
            r.run("python module", [python, "-c", code, module[0]], 60, gpu=False,
                  check=lambda out: {"imported": out.strip()})
    else:
        code = ("import sys, torch, pinfeed; print(sys.version.split()[0], pinfeed.__file__, torch.__version__, "
                "torch.cuda.is_available())")

        def torch_sees_gpu(out):
            assert out.split()[-1] == "True", f"torch sees no GPU: {out.strip()}"
            return {"torch": out.split()[-2]}
        r.run("python module", [python, "-c", code], 90, gpu=False,
              env=r.env(PYTHONPATH=os.path.join(root, "python")), check=torch_sees_gpu)


def gpu_test_steps(r):
    """The GPU test executables (ctest -L gpu); they load in a rehearsal too."""
    # The GPU test executables (ctest -L gpu). They load in a rehearsal too.
    gpu_tests = ("pinned_resource_gpu_test", "device_backend_gpu_test", "ddp_gpu_test")
    for t in gpu_tests:
        r.run(f"{t} loads", [r.test(t), "--gtest_list_tests"], 30, gpu=False, quiet=True,
              check=lambda out: {"tests": sum(1 for line in out.splitlines() if line.startswith("  "))})
        r.run(t, [r.test(t), "--gtest_brief=1"], 90, check=no_skips)


def diag_and_copy_steps(r, a):
    """pinfeed-diag, pinning, and host-to-device copies."""
    # pinfeed-diag's GPU section names the device; the pool pins through
    # cudaHostRegister (the memory bench's resource pins automatically).
    # Both run without a GPU too: in a rehearsal, the same commands.
    def diag_sees_gpu(out):
        j = last_json(out)
        gpus = j["cuda"]["devices"]
        assert gpus or a.rehearse, f"pinfeed-diag reports no GPU: {j['cuda'].get('message')}"
        return {"gpus": len(gpus), "plan": j.get("plan")}
    r.run("pinfeed-diag", [r.bin("pinfeed-diag"), "--gpus", "1", "--batch", "256x3x224x224:u8", "--prefetch", "4",
          "--sample-ms", "100", "--json"], 30, gpu=False, check=diag_sees_gpu)
    r.run("pinning through cudaHostRegister", [r.bin("pinfeed-memory-bench"), "--benchmark_filter=Pinned|Pool",
          "--benchmark_min_time=0.05", "--benchmark_repetitions=1"], 90, gpu=False)

    # Host-to-device copies: pinned must beat pageable clearly (on a GPU;
    # the CPU backend's two copies are both memcpy).
    def copy_figures(out):
        j = last_json(out)
        ratio = j["pageable_over_pinned"]
        figures = {k: j[k] for k in ("pinned_gb_per_s", "pageable_gb_per_s", "pageable_over_pinned")}
        if j["device"].startswith("cuda"):
            assert ratio > 1.25, f"pageable copies take {ratio:.2f}x the pinned time: pinned is not clearly faster"
        return figures
    r.run("copy cpu (the CPU backend's mechanism)", [r.bin("pinfeed-bench"), "copy", "--device", "cpu", "--mib", "64",
          "--repeat", "3", "--json"], 60, gpu=False, check=copy_figures)
    r.run("copy pinned vs pageable", [r.bin("pinfeed-bench"), "copy", "--device", "cuda:0", "--mib", "256",
          "--repeat", "10", "--json"], 60, check=copy_figures)


def training_steps(r, a, data):
    """pinfeed-train on cuda:0 (the CPU twins in a rehearsal)."""
    # Training on cuda:0: the MLP and the CNN; loss falls, every batch
    # pinned, held-out accuracy above the bar. The same runs on the CPU
    # backend in a rehearsal, smaller, with the same assertions.
    r.run("datasets", ["sh", "-c", f"{shlex.quote(r.bin('pinfeed-data'))} -q make --out {data}/mlp --classes 10 "
          f"--per-class 400 --val 0.2 --seed 1 && {shlex.quote(r.bin('pinfeed-data'))} -q make --out {data}/tex "
          f"--classes 4 --per-class 300 --val 0.2 --style texture --seed 2"], 120, gpu=False)
    train = [r.bin("pinfeed-train"), "--json", "-q"]
    mlp = ["--data", f"{data}/mlp/train", "--val", f"{data}/mlp/val", "--epochs", "5", "--batch-size", "32",
           "--size", "64", "--pool", "8"]
    cnn = ["--data", f"{data}/tex/train", "--val", f"{data}/tex/val", "--epochs", "6", "--batch-size", "64",
           "--size", "64", "--model", "cnn:32,64,128", "--lr", "0.4"]
    bars = {"mlp": 0.5, "cnn": 0.6}

    def trained(kind, gpu_run):
        def check(out):
            j = last_json(out)
            first, last = j["epochs"][0], j["epochs"][-1]
            assert last["loss"] < 0.7 * first["loss"], f"loss went {first['loss']:.3f} -> {last['loss']:.3f}"
            if gpu_run:
                assert all(e["pinned_batches"] > 0 and e["pageable_batches"] == 0 for e in j["epochs"]), \
                    "a GPU epoch had pageable batches (or none pinned)"
            assert last["val_accuracy"] >= bars[kind], \
                f"held-out accuracy {last['val_accuracy']:.3f} is under the bar {bars[kind]}"
            return {"loss_first": first["loss"], "loss_last": last["loss"], "val_accuracy": last["val_accuracy"],
                    "images_per_second": last["images_per_second"], "data_wait_fraction": last["data_wait_fraction"],
                    "steps_per_epoch": last["steps"]}
        return check
    if a.rehearse:
        r.run("train mlp (cpu backend)", train + mlp + ["--devices", "cpu:1"], 240, gpu=False,
              check=trained("mlp", False))
        small = ["--data", f"{data}/tex/train", "--val", f"{data}/tex/val", "--epochs", "4", "--batch-size", "32",
                 "--size", "32", "--model", "cnn:8,16", "--lr", "0.2"]
        r.run("train cnn (cpu backend)", train + small + ["--devices", "cpu:1"], 240, gpu=False,
              check=trained("cnn", False))
    r.run("train mlp on cuda:0", train + mlp + ["--devices", "cuda:0"], 90, check=trained("mlp", True))
    r.run("train cnn on cuda:0", train + cnn + ["--devices", "cuda:0"], 90, check=trained("cnn", True))

    # Compute-bound (an MLP of 3 x 32768 on 32 px images, ~13.5 GFLOP an
    # image against the loader's 10k+ images/s at 16 threads; 25 steps an
    # epoch): the loader and the copies keep up, the GPU never waits.
    def compute_bound(out):
        last = last_json(out)["epochs"][-1]
        assert last["steps"] >= 20, f"{last['steps']} steps in the last epoch: too few to judge the wait"
        assert last["data_wait_fraction"] < 0.1, \
            f"data_wait_fraction {last['data_wait_fraction']:.3f} in a compute-bound run: the feed stalls the GPU"
        return {k: last[k] for k in ("images_per_second", "data_wait_fraction", "steps")}
    r.run("compute-bound mlp on cuda:0", train + ["--data", f"{data}/mlp/train", "--epochs", "2", "--batch-size", "128",
          "--size", "32", "--pool", "1", "--hidden", "32768,32768,32768", "--threads", "16", "--devices", "cuda:0"],
          120, check=compute_bound)
    # The loader -> GPU feed at 224 px, 16 decode threads, --profile's step breakdown.
    r.run("feed cnn 224px, 16 threads", train + ["--data", f"{data}/mlp/train", "--epochs", "2", "--batch-size", "128",
          "--size", "224", "--model", "cnn:32,64,128,256", "--threads", "16", "--profile", "--devices", "cuda:0"],
          90, check=lambda out: {k: last_json(out)["epochs"][-1].get(k) for k in
                                 ("images_per_second", "data_wait_fraction", "profile_seconds_per_step")})


def python_steps(r, root, repo, python, data):
    """The Python module with the device's torch."""
    # Python with the device's torch: device= batches against batches
    # moved by hand, then images/s through Python into GPU memory.
    py_env = r.env(PYTHONPATH=os.path.join(root, "python"), PINFEED_DATA_TOOL=r.bin("pinfeed-data"),
                   PINFEED_TRAIN_TOOL=r.bin("pinfeed-train"), PYTHONUNBUFFERED=1)
    r.run("python device tests", [python or "python3", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
          os.path.join(repo, "tests", "python", "test_device_gpu.py")], 90, env=py_env, check=pytest_no_skips)
    r.run("python feed 224px, 16 threads", [python or "python3", os.path.join(repo, "bench", "python_device_bench.py"),
          f"{data}/mlp/train", "--device", "cuda:0", "--batch-size", "256", "--size", "224", "--threads", "16",
          "--rounds", "3", "--json"], 90, env=py_env,
          check=lambda out: {k: v for k, v in last_json(out).items() if k != "rounds"})


def sanitizer_steps(r, a):
    """compute-sanitizer memcheck and racecheck."""
    # compute-sanitizer last (the slowest steps, so they cannot starve the
    # rest): memcheck over the CNN's kernels (im2col/col2im, BatchNorm,
    # pooling, the whole CNN's gradient), racecheck without the whole-CNN
    # test (its ~10k launches under racecheck are the slowest of all).
    nvcc = shutil.which("nvcc")
    sanitizer = shutil.which("compute-sanitizer") or next(iter(
        ([os.path.join(os.path.dirname(nvcc), "compute-sanitizer")] if nvcc else []) +
        glob.glob("/usr/local/cuda*/bin/compute-sanitizer") + glob.glob("/opt/nvidia/*/compute-sanitizer")), None)
    if sanitizer and not os.path.exists(sanitizer):
        sanitizer = None
    twins = {"memcheck": "*Im2col*:*Col2im*:*BatchNorm*:*GlobalAveragePooling*:*Cnn*",
             "racecheck": "*Im2col*:*Col2im*:*BatchNorm*:*GlobalAveragePooling*"}
    r.run("compute-sanitizer's tests", [r.test("device_backend_gpu_test"), "--gtest_list_tests",
          f"--gtest_filter={twins['memcheck']}"], 30, gpu=False, quiet=True, check=lambda out: {"tests": at_least(
              5, sum(1 for line in out.splitlines() if line.startswith("  ")), "tests match the sanitizer's filter")})
    for tool in ("memcheck", "racecheck"):
        cmd = [sanitizer or "compute-sanitizer", "--tool", tool, "--error-exitcode", "3",
               r.test("device_backend_gpu_test"), f"--gtest_filter={twins[tool]}"]
        if sanitizer or a.rehearse:
            r.run(f"compute-sanitizer {tool}", cmd, 150, check=lambda out, t=tool: sanitizer_clean(t, out))
        else:
            r.not_checked(f"compute-sanitizer {tool}", "compute-sanitizer is not installed here")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=".gpu/pinfeed-gpu.tar.xz")
    ap.add_argument("--out", default=os.environ.get("OUT") or "build/gpu-run")
    ap.add_argument("--rehearse", action="store_true", help="no GPU here: run what needs none, print the rest")
    ap.add_argument("--deadline", type=float, default=330,
                    help="seconds for the whole run (each step's timeout is cut to what is left; default 330, "
                         "inside the device call's 420)")
    ap.add_argument("--only", help="comma-separated parts of step names: run only those (a second try)")
    ap.add_argument("--keep", action="store_true", help="keep the unpacked bundle")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    # The device call ends a command past its limit with SIGTERM: Runner.stop
    # exits through `finally`, which writes the summary.
    work = tempfile.mkdtemp(prefix="pinfeed-gpu-")
    started = time.time()
    with tarfile.open(a.bundle) as tar:
        tar.extractall(work)
    root = os.path.join(work, "pinfeed-gpu")
    only = [o.strip() for o in a.only.split(",") if o.strip()] if a.only else None
    r = Runner(root, a.out, a.rehearse, a.deadline, only)
    signal.signal(signal.SIGTERM, r.stop)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    data = os.path.join(work, "data")
    manifest, finished = [], False
    try:
        manifest, found, python = probe_host(r, a, root)
        library_and_module_steps(r, a, root, found, python)
        gpu_test_steps(r)
        diag_and_copy_steps(r, a)
        training_steps(r, a, data)
        python_steps(r, root, repo, python, data)
        sanitizer_steps(r, a)
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


def at_least(n, value, what):
    assert value >= n, f"{value} {what} (expected at least {n})"
    return value


def no_skips(out):
    """A GoogleTest run on a GPU host: every test ran (a skip is a failure)."""
    assert "[  SKIPPED ]" not in out, "skipped on a GPU host: " + "; ".join(
        line for line in out.splitlines() if "SKIPPED" in line or "Skipped" in line)[:800]
    m = re.search(r"\[  PASSED  \] (\d+) test", out)
    assert m, "no PASSED line"
    return {"passed": int(m.group(1))}


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
    assert " skipped" not in out.splitlines()[-1], "skipped on a GPU host: " + tail(out)
    m = re.search(r"(\d+) passed", out)
    assert m, tail(out)
    return {"passed": int(m.group(1))}


if __name__ == "__main__":
    main()
