"""The learned resume-point source: where earlier requests of the same key parted from each other. No torch.

A client that sends a key with its requests (prompt_cache_key; else the cache salt groups them) says which
requests belong together: the sessions of one agent, the turns of one conversation. Two of them that share a
prefix and then part (two sessions of an agent in other working directories, whose instructions differ at one
line) show where the next one is likely to part too. This generalises the fork checkpoint (scheduler.py: where a
prompt leaves a cached chain without a checkpoint), which needs the earlier request's pages to be still cached:
a junction learned here is remembered by its block hash, so it is kept for the next request of the key that
passes it even after the pool dropped the pages of the requests it was learned from.

  - When a request of key k is added, its prompt's block hashes are compared with those of the last KEEP prompts
    of k. Where it parts from one of them after sharing j > 0 full blocks (not a continuation: the earlier prompt
    is not a prefix of it), the boundary j * block_size is a junction of k, remembered by the hash of block j - 1
    (its chain names the whole prefix), and is a learned point of this request.
  - Every junction of k whose block the request's prompt holds is a learned point of it (the next session reads
    the checkpoint the first request to pass it left).
Aging: a junction not passed by any of the last MAX_AGE requests of its key is forgotten, a key keeps its
JUNCTIONS most recently passed junctions, and the table keeps the KEYS most recently used keys and the first
MAX_BLOCKS blocks of each remembered prompt, so a key's junctions follow what its traffic does now and the table's
memory is bounded.
"""
from __future__ import annotations

from collections import OrderedDict

from ..memory.hashing import BlockHash

KEEP = 4  # the prompts of a key whose block hashes a new request is compared with
JUNCTIONS = 8  # the junctions one key keeps (most recently passed)
MAX_AGE = 64  # a junction not passed by one of this many requests of its key is forgotten
KEYS = 64  # the keys the table keeps (most recently used)
# the blocks of a prompt it remembers (128K tokens of 64): with KEYS and KEEP, the table holds at most 2M block
# hashes' references, a few tens of MB at worst; a junction past them is not learned
MAX_BLOCKS = 2048


class _Key:
    def __init__(self):
        self.prompts: list[list[BlockHash]] = []  # the last KEEP prompts' block hashes, oldest first
        self.junctions: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()  # hash -> (position, last seen)
        self.count = 0  # requests of this key so far


class LearnedJunctions:
    """Junctions by key; `points(key, hashes, block_size)` records a request and returns its learned points."""

    def __init__(self):
        self._keys: OrderedDict[str, _Key] = OrderedDict()

    def points(self, key: str, hashes: list[BlockHash], block_size: int) -> list[int]:
        """The learned points (block boundaries) of a request of `key` whose prompt's full blocks hash to `hashes`,
        most recently confirmed first; the request is remembered for the next ones."""
        k = self._keys.pop(key, None) or _Key()
        self._keys[key] = k
        while len(self._keys) > KEYS:
            self._keys.popitem(last=False)
        k.count += 1
        for prev in reversed(k.prompts):  # the newest first: what the traffic does now
            j = next((i for i, (a, b) in enumerate(zip(prev, hashes)) if a != b), min(len(prev), len(hashes)))
            if 0 < j < len(prev) and j < len(hashes):  # shared j blocks, then parted (neither continues the other)
                # (a prev cut at MAX_BLOCKS that hashes continues past is no parting: j == len(prev) then)
                k.junctions[hashes[j - 1]] = (j * block_size, k.count)
        out = []
        for h in list(k.junctions):
            pos, seen = k.junctions[h]
            j = pos // block_size
            if j <= len(hashes) and hashes[j - 1] == h:
                k.junctions[h] = (pos, k.count)
                k.junctions.move_to_end(h)
                out.append(pos)
            elif k.count - seen > MAX_AGE:
                del k.junctions[h]
        while len(k.junctions) > JUNCTIONS:
            k.junctions.popitem(last=False)
        k.prompts = (k.prompts + [list(hashes[:MAX_BLOCKS])])[-KEEP:]
        return out[::-1]

    def __len__(self) -> int:
        return sum(len(k.junctions) for k in self._keys.values())
