"""Capturing a step as a CUDA graph, and getting back to a clean eager process when a
capture fails.

``torch.cuda.graph.__exit__`` ends the capture, then leaves the capture stream, with no
try/finally. When ``capture_end`` raises (the capture was invalidated by an operation not
allowed while capturing), the capture stream stays current, the caching allocator keeps
routing that stream's allocations to the graph's pool, and the next ``empty_cache()``
asserts. ``CudaGraphCapture`` therefore drives ``CUDAGraph`` itself: on its own side
stream, inside a ``torch.cuda.stream`` block that always exits, and ``abandon`` ends the
pool routing a failed ``capture_end`` left behind.

A capturer's contract (``StepGraphs`` takes any object with these three methods; CPU
runs use ``Uncaptured``, tests inject failing ones):

- ``capture(fn) -> replay``: ``fn`` is the step's forward writing into static buffers;
  ``replay()`` repeats it. Every graph of one capturer shares one memory pool, so capture
  the largest step first (later, smaller captures reuse its memory).
- ``abandon()``: after a failed capture. Drops every graph and its pool, and leaves the
  process as it was before the first capture (eager work on the default stream). Raises
  RuntimeError if the device itself no longer answers: nothing can be served then.
- ``captured``: how many graphs it holds.
"""

from __future__ import annotations

from typing import Callable

import torch


class Uncaptured:
    """No graphs: a replay runs the forward itself (CPU, and the tests of the padded path)."""

    captured = 0

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        return fn

    def abandon(self) -> None:
        pass


class CudaGraphCapture:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._pool = None
        self._capturing: tuple | None = None   # the pool a capture routes allocations to, until it ends

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        dev = self.device
        torch.cuda.synchronize(dev)
        with torch.cuda.stream(self.stream):
            for _ in range(2):          # kernels choose their algorithms (and allocate) before capture
                fn()
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self._pool)
            self._capturing = graph.pool()
            try:
                fn()
            except BaseException:
                try:
                    graph.capture_end()
                except RuntimeError:
                    pass                # invalidated: the pool routing is still on, for ``abandon`` to end
                raise                   # the forward's own error, which says what broke the capture
            graph.capture_end()         # may raise too: ``abandon`` then ends the routing
            self._capturing = None
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs.append(graph)
        return graph.replay

    def abandon(self) -> None:
        dev = self.device
        if self._capturing is not None:
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            try:
                torch._C._cuda_endAllocateToPool(index, self._capturing)
            except RuntimeError:
                pass                    # capture_end got that far: nothing routes to the pool
            else:
                # capture_end stopped before marking the capture ended, so the graph's
                # reset will not give back its hold on the pool: give it back here.
                torch._C._cuda_releasePool(index, self._capturing)
            self._capturing = None
        for g in self._graphs:
            g.reset()
        self._graphs.clear()
        self._pool = None
        try:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
        except RuntimeError as e:
            raise RuntimeError(f"the device is unusable after a failed CUDA graph capture: {e}") from e


def for_device(device: torch.device):
    """The capturer a runner on ``device`` uses (tests replace it to make captures fail)."""
    return CudaGraphCapture(device) if device.type == "cuda" else Uncaptured()
