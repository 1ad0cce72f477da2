"""examples/ddp_torchrun.py end to end: torchvision's MobileNetV2 under
torchrun with DistributedDataParallel (gloo), 2 processes, a few steps, fed by
pinfeed and by DataLoader + DistributedSampler; then its plot."""
import csv
import os
import shutil
import socket
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "ddp_torchrun.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", ["pinfeed", "torch"])
def test_ddp_example_trains_under_torchrun(dataset, tmp_path, kind):
    pytest.importorskip("torchvision")
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    out_csv = tmp_path / "steps.csv"
    cmd = [sys.executable, torchrun, "--redirects", "9:1", "--tee", "9:1", "--master_port", str(free_port()),
           "--nproc_per_node", "2", EXAMPLE, "--data", str(dataset), "--loader", kind, "--width", "0.25", "--size",
           "32", "--batch", "8", "--epochs", "2", "--max-steps", "2", "--workers", "1", "--csv", str(out_csv)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("epoch ")]
    assert len(lines) == 2, r.stdout  # rank 0 alone reports
    assert f"({kind}, 2 processes, batch 8" in lines[0]
    rows = list(csv.DictReader(open(out_csv)))
    assert len(rows) == 4 and {r["processes"] for r in rows} == {"2"}
    assert all(float(r["loss"]) > 0 for r in rows)
    # The plot of a run's CSV.
    plot = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, %r); import ddp_torchrun as d; "
                           "d.plot(%r, %r)" % (os.path.dirname(EXAMPLE), str(out_csv), str(tmp_path / "p.png"))],
                          capture_output=True, text=True)
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "p.png").stat().st_size > 1000
