"""pinfeed: a drop-in, pinned-memory-safe image loader for PyTorch training.

    import pinfeed
    loader = pinfeed.Loader("data/train", batch_size=256, shuffle=True, transform="random", threads=8,
                            device="cuda")
    for epoch in range(epochs):
        loader.set_epoch(epoch)              # like DistributedSampler.set_epoch (optional)
        for images, labels in loader:        # on the GPU: float32 NCHW (or uint8 NHWC), int64
            ...

With device=, each batch is copied from its pool slot on the loader's own
CUDA stream, normalized there and made ready on torch's current stream (an
event wait, no synchronize); the slot goes back after the copy's event.
Without it, tensors are zero-copy views of the loader's pool slot
(page-locked when the host can afford it). The slot goes back to the pool
when the last tensor made from the batch is freed (once CUDA is initialized,
after an event recorded then on torch's current stream, so that a queued
tensor.cuda(non_blocking=True) has read it first), so keep at most
`prefetch - 1` batches alive at a time (the usual loop does), or pass
copy=True to get tensors that own their memory. Under torchrun, mpirun or srun (or with torch.distributed initialized)
the rank and world size come from the launch: see pinfeed.launch_env().
"""

# The package itself imports nothing heavy: the command-line tools (console
# scripts in pinfeed._tools) run on hosts without torch and start in
# milliseconds. Loader, DistributedSampler and launch_env live in
# pinfeed._api, which imports torch; diag and set_log_level in pinfeed._base,
# which does not. Each is loaded on first use (PEP 562).
__version__ = "0.1.0"
__all__ = ["Loader", "DistributedSampler", "FakeData", "diag", "launch_env", "set_log_level", "Error", "ConfigError", "DataError",
           "HeldLimitError"]


def _submodule(name):
    import importlib  # pylint: disable=import-outside-toplevel
    return importlib.import_module(f".{name}", __name__)


# Where each public name lives: the C++ module's errors and the torch-free
# helpers load without torch; the loader's names load pinfeed._api (torch).
_HOME = {"Error": "_pinfeed", "ConfigError": "_pinfeed", "DataError": "_pinfeed", "HeldLimitError": "_pinfeed",
         "diag": "_base",
         "set_log_level": "_base", "Loader": "_api", "DistributedSampler": "_api", "FakeData": "_api", "launch_env": "_api"}


def __getattr__(name):
    # Submodules by importlib: `from . import x` would ask this hook first.
    if name in ("_api", "_base", "_compat", "_data", "_device", "_launch", "_options", "_order", "_pinfeed", "_state",
                "_tools"):
        return _submodule(name)
    if name not in _HOME:  # a typo or a probe must not import torch
        raise AttributeError(f"module 'pinfeed' has no attribute {name!r}")
    return getattr(_submodule(_HOME[name]), name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
