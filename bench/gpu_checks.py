"""The checks and figures of bench/gpu_run.py's steps: what each step's
output must show (tests listed and none skipped, sanitizers clean, training
past its bar, libraries resolved inside the bundle) and the figures read from
it (copy bandwidth against the link's peak, thread scaling, SIMD levels, the
feed, compute-bound and ResNet-shaped training). Split from the runner, which
plans the steps, runs them under their deadlines and writes the summary.

Standard library only, like the runner."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

# Sonames an ELF file in the bundle may take from outside it: the C/C++
# runtimes (the system's), and CUDA's own libraries (the device's driver and
# pip wheels; not there at all in a rehearsal).
SYSTEM = re.compile(r"^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libutil|libstdc\+\+|libgcc_s)\.so")
CUDA = re.compile(r"^(libcuda|libcudart|libcublas|libcublasLt|libnccl|libnvidia-[a-z-]+)\.so")
CUDA_LIBS = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libnccl.so.2", "libcuda.so.1")

# PCIe bandwidth per lane and direction after encoding, GB/s, by generation.
PCIE_LANE_GB_PER_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

# Compute-bound: a wide two-block CNN at 96 px (~16 GFLOP an image with its
# backward, 4.7 M parameters: seconds of GPU work a run, no host setup to
# speak of), against the loader's ~10k images/s at 16 threads.
COMPUTE_BOUND = dict(channels=(512, 1024), size=96, batch=128)
# ResNet-shaped: four stride-2 stages to 14 x 14 at 224 px (~4.3 GFLOP an
# image with the backward, a ResNet-18's order), 16 decode threads.
RESNET_SHAPED = dict(channels=(64, 128, 256, 512), size=224, batch=128)


def cnn_gflop(channels, size):
    """Forward and backward GFLOP of one image through the CNN's stride-2
    3x3 convolutions (the backward is twice the forward)."""
    flop, cin, side = 0, 3, size
    for cout in channels:
        side = (side + 1) // 2
        flop += 2 * 9 * cin * cout * side * side
        cin = cout
    return 3 * flop / 1e9


class NotChecked(Exception):
    """Raised by a check: what the step needs is not there (a sanitizer
    that cannot attach to this runtime's GPU), so nothing was proven either
    way; the step is NOT CHECKED, not failed."""


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
