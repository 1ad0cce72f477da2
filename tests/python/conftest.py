import os
import subprocess

import pytest


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """4 classes x 10 JPEGs (+ a val split), written by pinfeed-data."""
    root = tmp_path_factory.mktemp("data")
    subprocess.run([os.environ["PINFEED_DATA_TOOL"], "-q", "make", "--out", str(root), "--classes", "4",
                    "--per-class", "12", "--val", "0.17", "--seed", "3"], check=True)
    return root / "train"
