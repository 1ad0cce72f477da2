"""The one measurement both peer scripts make, so pinfeed and PyTorch are
timed the same way: a short warm-up (workers started, page cache filled,
scratch buffers touched), then whole epochs timed one by one."""
import statistics
import time
from typing import Callable, Iterable, Optional, Tuple


def time_epochs(loader: Iterable, epochs: int,
                before_epoch: Optional[Callable[[int], None]] = None) -> Tuple[int, float, float]:
    """Returns (images, seconds, median images/s over the epochs)."""
    for i, _ in enumerate(loader):  # warm-up
        if i == 2:
            break
    images, seconds, rates = 0, 0.0, []
    for epoch in range(epochs):
        if before_epoch is not None:
            before_epoch(epoch)
        t0 = time.perf_counter()
        n = 0
        for x, _ in loader:
            n += x.shape[0]
        dt = time.perf_counter() - t0
        images += n
        seconds += dt
        rates.append(n / dt)
    return images, seconds, statistics.median(rates)
