"""bench/gpu_run.py, the one GPU call's runner, without a GPU: its plan fits
the call, a step the deadline cuts is not checked (never failed), a step
far over its plan fails, and each check refuses what proves less than the
step's name (no test run, ldd's symbol-version errors, a sanitizer beside
nvcc that is not there). The rehearsal in .ci/run runs the steps
themselves on the CPU backend."""
import importlib.util
import os
import re
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "bench", "gpu_run.py")


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_run():
    return load("gpu_run", SCRIPT)


@pytest.fixture(scope="module")
def checks(gpu_run):
    """bench/gpu_checks.py, as gpu_run imported it (one module: a check's
    NotChecked is the class the runner catches): what the steps check and
    the figures they read."""
    return sys.modules["gpu_checks"]


def plan(*args):
    return subprocess.run([sys.executable, SCRIPT, "--plan", *args], capture_output=True, text=True, timeout=60)


def test_the_plan_fits_the_device_call_with_a_minute_to_spare():
    p = plan()
    assert p.returncode == 0, p.stderr
    total = int(re.search(r"^total (\d+) s of a 390 s deadline", p.stdout, re.M).group(1))
    assert total <= 330
    assert "timeout_s=420" in p.stdout and "carry=['.gpu']" in p.stdout
    names = [line.split("  ")[0] for line in p.stdout.splitlines()[1:] if re.search(r"\d+ s", line)
             and not line.startswith(("total", "device call"))]
    # The most valuable figures first, the slowest and least sure last.
    assert names[0] == "libraries"
    order = [next(i for i, n in enumerate(names) if n.startswith(k)) for k in
             ("libraries", "python module", "device_backend_gpu_test", "copy pinned", "train cnn", "loader threads",
              "compute-sanitizer memcheck")]
    assert order == sorted(order), names
    assert "32768" not in open(SCRIPT).read()


def test_a_plan_that_leaves_no_margin_is_refused():
    p = plan("--deadline", "300")
    assert p.returncode == 1
    assert "does not fit" in p.stderr


def runner(gpu_run, tmp_path, deadline):
    r = gpu_run.Runner(str(tmp_path), str(tmp_path), False, deadline, None)
    r.slack = 0  # a step's own limit is twice its plan, no extra seconds: a quick test
    return r


def test_a_step_the_deadline_cuts_is_not_checked(gpu_run, tmp_path):
    r = runner(gpu_run, tmp_path, 6)
    t0 = time.monotonic()
    step = r.run("slow", ["sleep", "30"], 20, gpu=False)
    assert time.monotonic() - t0 < 15
    assert step["status"] == "not checked", step
    assert "deadline" in step["reason"]
    # And once the deadline has passed, a step is not even started.
    r.until = time.monotonic()
    assert r.run("late", ["true"], 1, gpu=False) is None
    assert r.steps[-1] == dict(name="late", status="not checked", reason="the run's deadline came first (--deadline)")


def test_a_step_far_over_its_plan_fails(gpu_run, tmp_path):
    r = runner(gpu_run, tmp_path, 300)
    step = r.run("stuck", ["sleep", "30"], 0.5, gpu=False)
    assert step["status"] == "fail", step
    assert "did not finish within 1.0 s" in step["reason"], step


def test_a_check_that_raises_fails_the_step_with_its_reason(checks, gpu_run, tmp_path):
    r = runner(gpu_run, tmp_path, 300)
    step = r.run("zero tests", ["echo", "[  PASSED  ] 0 tests."], 5, gpu=False, check=checks.no_skips)
    assert step["status"] == "fail" and "0 tests passed" in step["reason"], step
    step = r.run("a skip", ["printf", "[  PASSED  ] 3 tests.\\n[  SKIPPED ] 1 test\\n"], 5, gpu=False,
                 check=checks.no_skips)
    assert step["status"] == "fail" and "skipped" in step["reason"], step
    step = r.run("ran", ["echo", "[  PASSED  ] 3 tests."], 5, gpu=False, check=checks.no_skips)
    assert step["status"] == "pass" and step["figures"] == {"passed": 3}
    with pytest.raises(AssertionError):
        checks.pytest_no_skips("\n0 passed, 2 skipped in 0.1s")


def test_a_tool_that_cannot_run_here_is_not_checked_and_only_keeps_the_data(checks, gpu_run, tmp_path):
    r = runner(gpu_run, tmp_path, 300)
    refused = "========= Device not supported\n========= Error: 999\n"
    step = r.run("compute-sanitizer memcheck", ["sh", "-c", f"printf '{refused}'; exit 3"], 5, gpu=False,
                 refused=checks.sanitizer_refused)
    assert step["status"] == "not checked" and "cannot attach" in step["reason"], step
    # A real finding is a failure, not "cannot attach".
    found = "========= Invalid __global__ write of size 4\n========= ERROR SUMMARY: 1 error\n"
    step = r.run("compute-sanitizer memcheck", ["sh", "-c", f"printf '{found}'; exit 3"], 5, gpu=False,
                 refused=checks.sanitizer_refused)
    assert step["status"] == "fail", step
    r.only = ["sanitizer"]
    assert r.wanted("compute-sanitizer racecheck") and r.wanted("datasets") and r.wanted("libraries")
    assert not r.wanted("train cnn on cuda:0")


def test_ldd_symbol_version_errors_on_stderr_are_problems(checks):
    lib = "/bundle/lib"
    stderr = "bin/pinfeed-train: /lib/x86_64-linux-gnu/libc.so.6: version `GLIBC_2.99' not found (required by x)"
    stdout = ("\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x7f)\n"
              "\tlibtbb.so.12 => /bundle/lib/libtbb.so.12 (0x7f)\n"
              "\tlibfoo.so.1 => /usr/lib/libfoo.so.1 (0x7f)\n"
              "\tlibcublas.so.13 => not found\n")
    problems = checks.ldd_problems("x", "bin/x", stdout + "\n" + stderr, lib, rehearse=True)
    assert any("GLIBC_2.99" in p for p in problems), problems
    assert any("libfoo.so.1 from /usr/lib" in p for p in problems), problems
    assert not any("libcublas" in p or "libtbb" in p for p in problems), problems
    # On a GPU host CUDA's libraries must be found.
    assert any("libcublas.so.13 not found" in p for p in checks.ldd_problems("x", "bin/x", stdout, lib, False))


def test_the_sanitizer_lookup_tries_every_candidate(checks, tmp_path, monkeypatch):
    # nvcc with no compute-sanitizer beside it; the pip wheel's is the one there.
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "nvcc").write_text("#!/bin/sh\n")
    (bin_dir / "nvcc").chmod(0o755)
    wheel = tmp_path / "site" / "nvidia"
    tool = wheel / "cuda_sanitizer_api" / "compute-sanitizer" / "compute-sanitizer"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\necho {wheel}\n")
    python.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    if any(os.path.exists(p) for p in ("/usr/local/cuda/bin/compute-sanitizer",
                                       "/usr/local/cuda/compute-sanitizer/compute-sanitizer")):
        pytest.skip("this machine has a compute-sanitizer of its own, found before the wheel's")
    assert checks.find_sanitizer(str(python)) == str(tool)
    tool.unlink()
    assert checks.find_sanitizer(str(python)) is None


def test_the_sanitizers_check_only_our_kernels_and_our_api_errors(checks):
    assert checks.SANITIZER_FLAGS["memcheck"] == ["--report-api-errors", "no"]
    assert checks.SANITIZER_FLAGS["racecheck"] == ["--kernel-name", "kns=pinfeed"]
    with pytest.raises(AssertionError):
        checks.sanitizer_clean("racecheck", "RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n"
                                             "[  PASSED  ] 4 tests.")
    assert checks.sanitizer_clean("memcheck", "ERROR SUMMARY: 0 errors\n[  PASSED  ] 4 tests.")["passed"] == 4


def test_the_compute_bound_step_is_seconds_of_gpu_work_not_host_setup(checks):
    cb = checks.COMPUTE_BOUND
    gflop = checks.cnn_gflop(cb["channels"], cb["size"])
    assert 10 < gflop < 25  # ~16 GFLOP an image: ~2-4k images/s on an H100, under the loader's rate
    params = 9 * (3 * cb["channels"][0] + cb["channels"][0] * cb["channels"][1])
    assert params < 10e6  # megabytes of weights, not the 9 GB of a 3 x 32768 MLP
    # A ResNet-18 is 1.8 GFLOP forward: the resnet-shaped step is of its order.
    assert 3 < checks.cnn_gflop(checks.RESNET_SHAPED["channels"], 224) < 8


def test_the_simd_step_reads_both_runs_of_its_command(checks):
    run = '{{"config": {{"simd": "{}"}}, "loader": {{"images_per_s": {}}}}}'
    out = run.format("sse2", 1000) + "\nlog line\n" + run.format("avx2", 1100) + "\n" + run.format("avx2", 1100)
    figures = checks.simd_figures(out)  # a CPU without AVX-512: the third run says avx2
    assert figures["avx2_over_sse2"] == 1.1 and figures["levels"] == ["sse2", "avx2", "avx2"]
    assert figures["avx512_ran_at"] == "avx2" and "avx2_ran_at" not in figures
    with pytest.raises(AssertionError):
        checks.simd_figures(run.format("sse2", 1000) + "\n" + run.format("avx2", 1100))  # the third run missing
