"""Batches prepared ahead of the train step, off the training thread.

`Prefetch` runs one background thread that, for each step in order, reads and augments the
step's batch (`make(step)`, the dataset's `train_batch`: the same call, hence the same batch, as
without prefetching) and puts it on the devices with its sharding (`put(batch)`: an
asynchronous transfer), keeping at most `depth` batches ready ahead of the one being trained.
The training thread takes them in order with `get(step)`, which blocks only while the thread
has not finished that step's batch; the seconds it blocked are the step's wait for input
(`waited`). An exception of the thread (a dataset that fails to read) is raised by the `get`
of the step it failed at. `close()` stops the thread (at the end, or when the run stops early:
batches prepared and never taken are dropped, so nothing is trained twice or skipped).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

DEPTH = 2  # batches on the devices ahead of the step being trained


class Prefetch:
    """`depth` 0 (or `DEPTH` set to 0) prepares each batch in `get`, on the training thread: the
    feeding without prefetch, for measuring what prefetching gains (docs/measured.md)."""

    def __init__(self, make: Callable[[int], dict], put: Callable[[dict], Any], steps: range,
                 depth: int | None = None):
        depth = DEPTH if depth is None else int(depth)
        if depth < 0:
            raise ValueError(f"prefetch depth {depth} must be >= 0")
        self.steps, self.waited, self._make, self._put = steps, 0.0, make, put
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = None
        if depth:
            self._thread = threading.Thread(target=self._work, args=(make, put), name="cdpjax-prefetch", daemon=True)
            self._thread.start()

    def _work(self, make, put) -> None:
        for step in self.steps:
            try:
                item = (step, put(make(step)), None)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread, at its step
                item = (step, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or item[2] is not None:
                return

    def get(self, step: int):
        """The batch of `step` (on the devices), steps taken in order; raises what preparing it raised."""
        t0 = time.perf_counter()
        if self._thread is None:
            try:
                return self._put(self._make(step))
            finally:
                self.waited += time.perf_counter() - t0
        got, batch, error = self._queue.get()
        self.waited += time.perf_counter() - t0
        if got != step:
            raise RuntimeError(f"prefetch: batch of step {got} where step {step} was expected")
        if error is not None:
            raise error
        return batch

    def close(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        while True:  # unblock a thread waiting to put
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5.0)


__all__ = ["DEPTH", "Prefetch"]
