"""Fixed-size KV blocks handed out from a free list, shared by reference count."""

from __future__ import annotations

from collections import deque
from typing import Callable


class BlockAllocator:
    """Ids ``0 .. num_blocks-1`` of KV blocks with per-block reference counts.

    A block is in use while some sequence holds it (``refcount > 0``).  A block
    a prefix cache keeps (``cached``) stays out of the free list when its last
    user lets go, so a later request can reuse it; ``evict`` (given by the
    prefix cache) returns such an unreferenced block when the free list is
    empty.
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self.free_list: deque[int] = deque(range(num_blocks))
        self.cached: set[int] = set()
        self.evict: Callable[[], int | None] = lambda: None

    def num_free(self) -> int:
        """Blocks available to ``allocate``: free ones plus unreferenced cached ones."""
        return len(self.free_list) + sum(1 for b in self.cached if self.refcount[b] == 0)

    def num_used(self) -> int:
        """Blocks some sequence holds."""
        return sum(1 for r in self.refcount if r > 0)

    def allocate(self) -> int | None:
        """A fresh block with refcount 1, or None when every block is held."""
        block = self.free_list.popleft() if self.free_list else self.evict()
        if block is None:
            return None
        self.refcount[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more holder of ``block``."""
        self.refcount[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; the last release returns an uncached block to the free list."""
        if self.refcount[block] <= 0:
            raise RuntimeError(f"block {block} released more often than it was held")
        self.refcount[block] -= 1
        if self.refcount[block] == 0 and block not in self.cached:
            self.free_list.append(block)
