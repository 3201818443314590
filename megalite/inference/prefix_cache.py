"""A radix tree of cached prompt prefixes at KV-block granularity, with LRU eviction.

Each edge is the token ids of one full block; a node holds the KV block
computed for the prefix that ends there.  A new sequence walks the tree with
its tokens and reuses every matching block (sharing it, so nobody writes to
it again).  Blocks no sequence holds stay cached until the allocator runs out
of free blocks; then the least recently used leaf goes first, so a prefix is
never dropped while a longer cached prefix still depends on it.
"""

from __future__ import annotations

import itertools

from megalite.inference.block_allocator import BlockAllocator


class _Node:
    __slots__ = ("key", "block", "parent", "children", "last_access")

    def __init__(self, key, block, parent):
        self.key, self.block, self.parent = key, block, parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = 0


class PrefixCache:
    """Prefix tree over full blocks of ``block_size`` tokens, registered as ``allocator``'s evictor."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator, self.block_size = allocator, block_size
        self.root = _Node((), None, None)
        self.nodes: dict[int, _Node] = {}
        self._clock = itertools.count(1)
        self.queried_tokens = 0
        self.hit_tokens = 0
        allocator.evict = self.evict

    def _keys(self, tokens: list[int], num_blocks: int):
        bs = self.block_size
        return (tuple(tokens[i * bs:(i + 1) * bs]) for i in range(num_blocks))

    def match(self, tokens: list[int], max_blocks: int) -> list[int]:
        """Blocks of the longest cached prefix of ``tokens`` (at most ``max_blocks``), each shared once."""
        node, blocks, now = self.root, [], next(self._clock)
        for key in self._keys(tokens, max_blocks):
            node = node.children.get(key)
            if node is None:
                break
            node.last_access = now
            self.allocator.share(node.block)
            blocks.append(node.block)
        self.queried_tokens += len(tokens)
        self.hit_tokens += len(blocks) * self.block_size
        return blocks

    def cached_blocks(self, tokens: list[int], max_blocks: int) -> int:
        """How many leading blocks of ``tokens`` (at most ``max_blocks``) :meth:`match` would return.

        Unlike :meth:`match` it shares nothing and counts no lookup, so the scheduler can ask before admitting."""
        node, count = self.root, 0
        for key in self._keys(tokens, max_blocks):
            node = node.children.get(key)
            if node is None:
                break
            count += 1
        return count

    def insert(self, tokens: list[int], blocks: list[int], num_blocks: int) -> None:
        """Cache the first ``num_blocks`` full blocks of a sequence (already-cached prefixes are kept)."""
        node, now = self.root, next(self._clock)
        for key, block in zip(self._keys(tokens, num_blocks), blocks):
            child = node.children.get(key)
            if child is None:
                if block in self.nodes:
                    return
                child = _Node(key, block, node)
                node.children[key] = child
                self.nodes[block] = child
                self.allocator.cached.add(block)
            child.last_access = now
            node = child

    def evict(self) -> int | None:
        """Drop the least recently used unreferenced leaf and return its block, or None."""
        refcount = self.allocator.refcount
        leaves = [n for n in self.nodes.values() if not n.children and refcount[n.block] == 0]
        if not leaves:
            return None
        victim = min(leaves, key=lambda n: n.last_access)
        del victim.parent.children[victim.key]
        del self.nodes[victim.block]
        self.allocator.cached.discard(victim.block)
        return victim.block

    def hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens whose KV came from the cache."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
