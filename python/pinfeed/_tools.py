"""The command-line tools of an installed pinfeed (pip install): each console
script (pinfeed-train, pinfeed-diag, pinfeed-data, pinfeed-bench) runs the
binary of the same name in pinfeed/bin, with the same arguments, in place of
this Python process (exec: signals, exit codes and torchrun's process
management reach the tool itself)."""

import os
import sys

_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin")


def path(tool):
    """The installed binary of `tool` ("pinfeed-train", ...)."""
    return os.path.join(_BIN, tool)


def _run(tool):
    binary = path(tool)
    if not os.access(binary, os.X_OK):
        sys.exit(f"{tool}: {binary} is missing; this pinfeed was not installed by pip (use build/release/tools/{tool})")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(binary, [tool] + sys.argv[1:])


def train():
    _run("pinfeed-train")


def diag():
    _run("pinfeed-diag")


def data():
    _run("pinfeed-data")


def bench():
    _run("pinfeed-bench")
