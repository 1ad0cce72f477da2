"""What pinfeed offers without torch: the diagnostics report and the log
level (pinfeed.diag, pinfeed.set_log_level), over the C++ module only, so
that they work on an operator's host with no training stack."""

import json
import os

from . import _pinfeed


def set_log_level(level):
    """pinfeed's own log on stderr: "trace", "debug", "info", "warning" (the default), "error", "off"."""
    _pinfeed.set_log_level({"warning": "warn"}.get(level, level))



def diag(root="/", gpus=1, batch=None, prefetch=2, sample_ms=100, loader=None):
    """The memory diagnostics report of `pinfeed-diag --json`, as a dict. With
    batch="256x3x224x224:u8" it includes the pinned pool plan and its verdict.
    With loader= (a Loader with a device) it includes "copy_stream": that
    loader's copy figures so far (bytes, copy seconds and GB/s, the waits for
    the decoders, for the copies and for consumers), as loader.stats()["device"]."""
    if loader is not None:
        from ._api import Loader  # pylint: disable=import-outside-toplevel  (a loader means torch is there)
        if not isinstance(loader, Loader):
            raise TypeError(f"loader must be a pinfeed.Loader, not {type(loader).__name__}")
    report = json.loads(_pinfeed.diag_json(os.fsencode(root), gpus, batch or "", prefetch, sample_ms))
    if loader is not None:
        report["copy_stream"] = loader.stats().get("device", {"device": None, "note": "this loader has no device="})
    return report
