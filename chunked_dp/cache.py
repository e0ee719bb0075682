"""The rCache: ``n_block`` device blocks holding gathered chunks, and its replacement policies.

Belady's rule (evict the chunk whose next use is farthest away) is optimal when the future is
known.  Training is periodic, so the chunk order recorded in the warm-up step is the future of
every later step.  The warm-up step itself uses LRU.  :func:`count_replacements` replays an
access order under any policy, for tests and for the chunk-size search.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict


def count_replacements(order: list[int], n_block: int, policy: str = "belady") -> tuple[int, int]:
    """(misses, replacements) of ``order`` with ``n_block`` blocks; a replacement is a miss that
    had to evict a chunk."""
    cache = RCachePolicy(n_block, policy, order if policy == "belady" else None)
    misses = replacements = 0
    for chunk in order:
        hit, victim = cache.access(chunk)
        misses += not hit
        replacements += victim is not None
    return misses, replacements


class RCachePolicy:
    """Which chunk occupies which block; ``access`` returns (hit, evicted chunk or None)."""

    def __init__(self, n_block: int, policy: str = "belady", future: list[int] | None = None):
        if n_block < 1:
            raise ValueError("the rCache needs at least one block")
        self.n_block = n_block
        self.policy = policy
        self.resident: OrderedDict[int, int] = OrderedDict()  # chunk -> block (insertion/recency order)
        self.pinned: set[int] = set()
        self.position = 0
        self.now = 0
        self.set_future(future)

    def set_future(self, future: list[int] | None) -> None:
        """The access order to plan against (Belady); None means LRU until one is recorded."""
        self.uses: dict[int, list[int]] = {}
        if future is not None:
            for i, c in enumerate(future):
                self.uses.setdefault(c, []).append(i)
        self.future_known = future is not None

    def new_step(self) -> None:
        self.position = 0

    def _next_use(self, chunk: int) -> float:
        positions = self.uses.get(chunk, [])
        k = bisect.bisect_right(positions, self.now)
        return positions[k] if k < len(positions) else float("inf")

    def _victim(self) -> int:
        candidates = [c for c in self.resident if c not in self.pinned]
        if not candidates:
            raise RuntimeError("rCache: every block holds a chunk in use; it needs more blocks")
        if self.policy == "belady" and self.future_known:
            return max(candidates, key=lambda c: (self._next_use(c), -candidates.index(c)))
        return candidates[0]  # LRU (recency-ordered) and FIFO (insertion-ordered) both take the oldest

    def access(self, chunk: int) -> tuple[bool, int | None]:
        """Use ``chunk`` now; returns whether it was resident and which chunk was evicted for it."""
        self.now = self.position  # index of this access in the step's order
        self.position += 1
        hit = chunk in self.resident
        victim = None
        if hit:
            if self.policy == "lru" or (self.policy == "belady" and not self.future_known):
                self.resident.move_to_end(chunk)
        else:
            victim = self._place(chunk)
        return hit, victim

    def _place(self, chunk: int) -> int | None:
        """Put ``chunk`` in a free block, or in the victim's; returns the victim (or None)."""
        victim = None
        if len(self.resident) >= self.n_block:
            victim = self._victim()
            block = self.resident.pop(victim)
        else:
            used = set(self.resident.values())
            block = next(b for b in range(self.n_block) if b not in used)
        self.resident[chunk] = block
        return victim

    def reserve(self, chunk: int) -> tuple[bool, int | None]:
        """Give ``chunk`` a block ahead of its use (prefetch) without advancing the step's position.

        Returns (placed, evicted chunk or None); not placed when every block is pinned.  A placed
        chunk is pinned until its access, so it is not evicted before it is used."""
        if chunk in self.resident:
            return True, None
        if len(self.resident) >= self.n_block and all(c in self.pinned for c in self.resident):
            return False, None
        victim = self._place(chunk)
        self.pinned.add(chunk)
        return True, victim

    def block_of(self, chunk: int) -> int:
        return self.resident[chunk]

    def drop_all(self) -> None:
        self.resident.clear()
        self.pinned.clear()
