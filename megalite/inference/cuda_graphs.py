"""CUDA graphs of static-shape forwards: one graph per shape, captured the first time it runs, replayed after.

A decode step of a small model is bound by the host: hundreds of kernel launches, each a few microseconds of
Python and driver time, around very little GPU work.  Replaying a captured graph launches them all at once.
The captured function must read its inputs only from tensors that outlive it (persistent buffers refilled
before each replay) and must not synchronise with the host; its output tensor is the graph's, overwritten by
the next replay of any graph of the cache.

Every graph of a :class:`GraphCache` shares one memory pool: they never run concurrently, and each keeps its
own output alive, so one graph's intermediates may reuse another's freed ones.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


class GraphCache:
    """Captures ``fn`` per ``key`` on first :meth:`run` (after one eager warm-up run) and replays it after."""

    def __init__(self):
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``fn()``'s result for the current contents of its input buffers, by replaying ``key``'s graph."""
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(fn)
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The warm-up runs on a side stream, as capture does, so lazy initialisation (cuBLAS handles and
        # workspaces, SDPA kernel choice) happens outside the graph.  It computes the real step, which the
        # replay then repeats (the same keys written to the same slots).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        return graph, out
