"""Packed-document attention at cp=1: the dense path (one fused SDPA call) beside the tiled (blockwise) path.

Forward + backward of one attention call, ``[b, 4 heads, s, 64]`` with 2 key/value heads, fp32, documents of
random lengths around ``doc`` tokens (``doc = s``: one document), on one CPU thread; the best CPU time of a
few repetitions of each.  The ratio tiled / dense is what ``megalite.context_parallel.dense.DENSE_MAX_LENGTH``
was chosen from: the dense path runs where it is above 1.  Then one document with a sliding window (the
Mistral-style rows, which run dense up to the same length).

    python benchmarks/document_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from megalite.context_parallel.blockwise import BlockwiseAttention, Tokens
from megalite.context_parallel.dense import DENSE_MAX_LENGTH, dense_attention

WINDOW_SHAPES = [(4, 256, 31), (4, 256, 127), (4, 512, 127), (4, 512, 255), (4, 1024, 127), (4, 1024, 511),
                 (2, 1792, 127), (2, 1792, 895)]
"""``(b, s, window)``: one document, a window of ``window`` tokens before each query."""
SHAPES = [(4, 317, 80), (4, 512, 120), (4, 1024, 150), (4, 1024, 1024), (2, 1536, 150), (2, 1792, 150),
          (2, 1792, 1792), (2, 2048, 200), (2, 2048, 2048), (1, 4096, 300), (1, 4096, 4096), (1, 8192, 300)]


def documents(b: int, s: int, doc: int, gen: torch.Generator) -> torch.Tensor:
    """``[b, s]`` non-decreasing document ids, lengths uniform in ``[doc/2, 3doc/2]``."""
    ids = torch.zeros(b, s, dtype=torch.long)
    for row in range(b):
        start, index = 0, 0
        while start < s:
            length = int(torch.randint(max(1, doc // 2), doc * 3 // 2 + 1, (1,), generator=gen))
            ids[row, start:start + length] = index
            start, index = start + length, index + 1
    return ids


def cpu_seconds(attend, q, k, v, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        start = time.process_time()
        attend(*leaves).sum().backward()
        best = min(best, time.process_time() - start)
    return best


def compare(b: int, s: int, ids: torch.Tensor | None, window: int | None, reps: int, gen: torch.Generator):
    """CPU seconds ``(tiled, dense)`` of one attention call over ``[b, 4 heads, s, 64]`` (2 key/value heads)."""
    q = torch.randn(b, 4, s, 64, generator=gen)
    k, v = (torch.randn(b, 2, s, 64, generator=gen) for _ in range(2))
    scale = 1 / math.sqrt(64)
    tokens = Tokens(torch.arange(s), ids)
    tiled = cpu_seconds(lambda *t: BlockwiseAttention.apply(*t, tokens, tokens, scale, window), q, k, v, reps)
    dense = cpu_seconds(lambda *t: dense_attention(*t, ids, scale, window), q, k, v, reps)
    return tiled, dense


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the rows up to 1024 tokens only, two repetitions")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"{'b':>2} {'s':>5} {'doc':>5} {'tiled':>9} {'dense':>9} {'tiled/dense':>12}  path taken")
    for b, s, doc in SHAPES:
        if args.quick and s > 1024:
            continue
        ids = documents(b, s, doc, gen)
        tiled, dense = compare(b, s, ids, None, 2 if args.quick or s > 1024 else 4, gen)
        print(f"{b:>2} {s:>5} {doc:>5} {tiled * 1e3:7.1f}ms {dense * 1e3:7.1f}ms {tiled / dense:12.2f}  "
              f"{'dense' if s <= DENSE_MAX_LENGTH else 'tiled'}", flush=True)
    print(f"{'b':>2} {'s':>5} {'window':>6} {'tiled':>9} {'dense':>9} {'tiled/dense':>12}")
    for b, s, window in WINDOW_SHAPES:
        if args.quick and s > 1024:
            continue
        tiled, dense = compare(b, s, None, window, 2 if args.quick else 3, gen)
        print(f"{b:>2} {s:>5} {window:>6} {tiled * 1e3:7.1f}ms {dense * 1e3:7.1f}ms {tiled / dense:12.2f}", flush=True)


if __name__ == "__main__":
    main()
