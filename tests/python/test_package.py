"""The package as installed: the module, its tools, its metadata. Run by
scripts/test-wheel.sh against a pip-installed wheel (PINFEED_EXPECT_INSTALLED
names the venv) and by ctest against the build tree."""
import os
import subprocess
import sys

import pinfeed
from pinfeed import _tools


def test_the_installed_package_is_the_one_under_test():
    venv = os.environ.get("PINFEED_EXPECT_INSTALLED")
    here = os.path.realpath(pinfeed.__file__)
    if venv:
        assert here.startswith(os.path.realpath(venv) + os.sep), f"testing {here}, not the wheel in {venv}"
        from importlib import metadata
        assert metadata.version("pinfeed") == pinfeed.__version__


def test_every_tool_runs_from_the_package():
    for tool in ("pinfeed-train", "pinfeed-diag", "pinfeed-data", "pinfeed-bench"):
        path = _tools.path(tool)
        if not os.path.exists(path):
            assert "PINFEED_EXPECT_INSTALLED" not in os.environ, f"{tool} is missing from the wheel"
            continue
        out = subprocess.run([path, "--help"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert "Usage" in out.stdout or "usage" in out.stdout.lower()


def test_the_console_scripts_exec_the_tools():
    if "PINFEED_EXPECT_INSTALLED" not in os.environ:
        return  # console scripts exist once pip installed the package
    script = os.path.join(os.environ["PINFEED_EXPECT_INSTALLED"], "bin", "pinfeed-diag")
    out = subprocess.run([script, "--json", "--sample-ms", "0"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"host"' in out.stdout or '"memory"' in out.stdout


def test_a_missing_tool_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(_tools, "_BIN", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["pinfeed-train", "--help"])
    try:
        _tools.train()
    except SystemExit as e:
        assert "pinfeed-train" in str(e.code) and "missing" in str(e.code)
    else:
        raise AssertionError("no error for a missing tool")


def test_the_tools_start_without_importing_torch():
    # The console scripts import pinfeed._tools: the package must not pull
    # torch in (an operator's pinfeed-diag on a host without a training stack).
    code = ("import sys, pinfeed, pinfeed._tools; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert pinfeed.__version__; assert issubclass(pinfeed.ConfigError, ValueError) and pinfeed.Error; "
            "assert 'torch' not in sys.modules, 'the error classes imported torch'; "
            "pinfeed.set_log_level('error'); assert pinfeed.diag(sample_ms=0)['memory']; "
            "assert not hasattr(pinfeed, 'Lodaer') and not hasattr(pinfeed, 'torch'); "
            "assert 'torch' not in sys.modules, 'diag, set_log_level or a typo imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))
    # The loader's names load torch on first use.
    code = "import sys, pinfeed; pinfeed.Loader; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))
