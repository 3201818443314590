"""The allocator setting of a process that streams a checkpoint conversion: freed tensors go back to the system.

glibc's malloc serves a large allocation by a mapping of its own, returned to the system when freed, but after
each such free it raises that size threshold (up to 32 MiB), so later tensors below it come from the heap; in a
conversion's pattern (read a layer, convert, write, free) the heap then fragments and the resident set of a fresh
process grows with the model instead of holding one layer (measured: 64 MiB for an 8-layer, 92 MiB for a 16-layer
model of 15 MiB layers; 18 MiB for both with the threshold fixed).  A training process keeps the default (its
tensors are reused, and mappings cost page faults on each allocation).
"""

from __future__ import annotations

import ctypes

_M_MMAP_THRESHOLD = -3


def return_freed_tensors(threshold: int = 1 << 20) -> bool:
    """Fix glibc's mapping threshold at ``threshold`` bytes for this process (a conversion tool's); False where
    the C library has no ``mallopt`` (not glibc)."""
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
