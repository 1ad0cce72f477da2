"""The device feed: device= parsed, the C++ feed's settings, and the
streams a batch is handed to (a mixin of pinfeed.Loader)."""

import torch  # pinfeed._api imported it first, or said why it cannot

from . import _pinfeed

# The tests' CPU stand-in for a CUDA stream (built with the tests only; the
# wheel has none, and isinstance(x, ()) is False).
_TEST_CONSUMER = getattr(_pinfeed, "CpuConsumer", ())


def _parse_device(device, local_rank):
    """A torch.device for device=, or None (CPU tensors over the slots).
    "auto": cuda:LOCAL_RANK when torch sees CUDA, else None."""
    if device is None:
        return None
    if isinstance(device, str) and device == "auto":
        if not torch.cuda.is_available():
            return None
        count = torch.cuda.device_count()
        if local_rank < count:
            return torch.device("cuda", local_rank)
        if count == 1:  # one GPU per rank (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank)
            return torch.device("cuda", 0)
        raise ValueError(f"device='auto': local rank {local_rank} but {count} CUDA devices visible: pass device=")
    try:
        d = device if isinstance(device, torch.device) else torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device must be None, 'auto', 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}") from e
    if d.type == "cuda":
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        return d
    if d.type == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device {device!r}: pinfeed feeds 'cuda' devices (and 'cpu', its test backend)")


class _DeviceMixin:
    """Loader's device feed: its settings and its consumer streams."""

    def _device_feed(self, layout, copy, dtype, memory_format, labels_device, stream, copy_delay_us):
        """(layout, feed): what the C++ loader is asked for with device= (uint8
        slots, and the feed's settings), or the layout as it is and None."""
        if self._device is None:
            if stream is not None and not (hasattr(stream, "cuda_stream") or isinstance(stream, _TEST_CONSUMER)):
                raise TypeError(f"stream must be a torch.cuda.Stream, not {type(stream).__name__}")
            if dtype not in (None, torch.float32) or memory_format not in (None, torch.contiguous_format):
                raise ValueError("dtype= and memory_format= go with device= (convert CPU batches yourself)")
            return layout, None
        if copy:
            raise ValueError("copy=True is for device=None: device batches own their memory already")
        if layout not in ("nchw-f32", "nhwc-u8"):
            raise ValueError(f"layout must be 'nchw-f32' or 'nhwc-u8', got {layout!r}")
        normalize_on_device = layout == "nchw-f32"
        if not normalize_on_device and (dtype is not None or memory_format is not None):
            raise ValueError("dtype= and memory_format= apply to normalized float batches (layout='nchw-f32'), "
                             "not to layout='nhwc-u8'")
        if not isinstance(labels_device, bool):
            raise TypeError(f"labels_device must be True or False, not {labels_device!r}")
        feed = {"type": self._device.type, "index": 0 if self._device.index is None else self._device.index,
                "normalize": normalize_on_device, "copy_delay_us": int(copy_delay_us),
                "dtype": {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, "float32")}
        if stream is not None:
            if self._device.type != "cuda" or not hasattr(stream, "cuda_stream"):
                raise TypeError(f"stream= must be a torch.cuda.Stream on the device, not {stream!r}")
            if stream.device != self._device:
                raise ValueError(f"stream= is on {stream.device}, the batches go to {self._device}")
        return "nhwc-u8", feed

    def _pinned_for_device(self):
        """The GPU the pinned slots are registered with: the device= one, else
        torch's current device once torch has a context, else the local
        rank's (DDP's convention; none on a host without it). Not device 0
        in every rank."""
        if self._device is not None:
            return self._device.index if self._device.type == "cuda" else None
        if torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return self.local_rank

    def _consumer(self):
        """The stream the batch is handed to (Note [Consumer streams]): the
        given stream=, else torch's current stream of the device; 0 on the
        CPU backend (this thread)."""
        if self._device.type != "cuda":
            return 0
        stream = self._stream if self._stream is not None else torch.cuda.current_stream(self._device)
        return int(stream.cuda_stream)

    def _host_consumer(self):
        """device=None: where the batch may still be read after its tensors
        die. Once CUDA is initialized in the process, torch's current stream
        (or stream=) at the time the batch is yielded: a
        tensor.cuda(non_blocking=True) copy queued there reads the slot
        after the tensor is gone, so the slot goes back only after an event
        recorded on that stream when the tensors die."""
        if self._stream is not None:
            if isinstance(self._stream, _TEST_CONSUMER):
                return self._stream
            index = self._stream.device.index
            return [("cuda", torch.cuda.current_device() if index is None else index, int(self._stream.cuda_stream))]
        if self._cuda_seen or (torch.cuda.is_available() and torch.cuda.is_initialized()):
            self._cuda_seen = True
            # The current device's stream, and local_rank's (docs/usage.md's
            # images.cuda(loader.local_rank, non_blocking=True)) when they differ.
            devices = {torch.cuda.current_device()}
            if self.local_rank < torch.cuda.device_count():
                devices.add(self.local_rank)
            return [("cuda", d, int(torch.cuda.current_stream(d).cuda_stream)) for d in sorted(devices)]
        return None

    @property
    def device(self):
        """The device batches are delivered on (None: CPU tensors over the pool's slots)."""
        return self._device
