"""Fixtures of the Python suite. It runs against the build tree (ctest sets
PYTHONPATH, PINFEED_DATA_TOOL and PINFEED_CAPI) or against an installed
package (pip install; .ci/run's wheel check), where the tools are the
package's own and the C ABI tests skip."""
import faulthandler
import os
import subprocess
import sys

import pytest

import pinfeed
from pinfeed import _tools


def data_tool():
    """pinfeed-data: the build tree's, else the installed package's."""
    return os.environ.get("PINFEED_DATA_TOOL") or _tools.path("pinfeed-data")


@pytest.fixture(scope="session")
def capi():
    """The path of libpinfeed.so (the C ABI is not part of the wheel)."""
    path = os.environ.get("PINFEED_CAPI")
    if not path:
        pytest.skip("PINFEED_CAPI is not set: the C ABI comes with the CMake build, not the wheel")
    return path


def train_tool():
    """pinfeed-train: the build tree's, else the installed package's."""
    return os.environ.get("PINFEED_TRAIN_TOOL") or _tools.path("pinfeed-train")


@pytest.fixture(scope="session")
def mpirun():
    """mpirun's path, when it is installed and pinfeed-train was built with
    MPI (a wheel is not: OpenMPI's plugins live at Debian's paths)."""
    import shutil
    path = shutil.which("mpirun")
    if path is None:
        pytest.skip("mpirun is not installed")
    version = subprocess.run([train_tool(), "--version"], capture_output=True, text=True, check=True).stdout
    if "mpi" not in version.split("communicators:", 1)[-1]:
        pytest.skip(f"this pinfeed-train was built without MPI ({version.strip()})")
    return path


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """4 classes x 12 JPEGs (+ a val split), written by pinfeed-data."""
    root = tmp_path_factory.mktemp("data")
    subprocess.run([data_tool(), "-q", "make", "--out", str(root), "--classes", "4",
                    "--per-class", "12", "--val", "0.17", "--seed", "3"], check=True)
    return root / "train"


# A test that hangs ends the run with every thread's stack instead of
# holding CI until its own limit (the slowest test takes ~15 s here).
TEST_LIMIT_S = float(os.environ.get("PINFEED_TEST_LIMIT_S", "150"))


_real_stderr = None


def pytest_configure(config):
    # The terminal's stderr, kept before a test's capture takes fd 2 (the
    # dump would go into the capture file, and the process ends unread).
    global _real_stderr
    _real_stderr = os.fdopen(os.dup(sys.__stderr__.fileno()), "w")


@pytest.fixture(autouse=True)
def _hang_guard():
    faulthandler.dump_traceback_later(TEST_LIMIT_S, exit=True, file=_real_stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


def pytest_report_header(config):
    return f"pinfeed {pinfeed.__version__} from {os.path.dirname(pinfeed.__file__)}"
