"""Paged KV cache bookkeeping: a pool of fixed-size blocks and one block table row per running slot, with automatic
prefix caching (vLLM's design).

Block tables are a (max_num_seqs, max_blocks_per_seq) int32 array, -1 where no block is held; the worker
mirrors it. Allocation and release are vectorized (numpy) so that a 1024-request step stays cheap.

Prefix caching: a full block whose KV is known to be right is *registered* under its block hash (``block_hash``:
its parent's hash chained with its tokens). A request that starts looks its block hashes up and shares the blocks
found (``start``); every block counts the slots that hold it (``ref_count``). A block no slot holds is free; a
free registered block keeps its content and stays findable, in LRU order (the blocks a request freed last are
evicted last; of one request's blocks the tail goes first, since a chain is only found from its head), and is
evicted only when an allocation finds no plain free block left. Blocks: plain free + evictable (free and
registered) + in use (``ref_count`` > 0) = ``num_blocks``.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

HASH_SHARDS = 16
SHARD_MASK = HASH_SHARDS - 1


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_blocks_per_seq: int):
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        # Plain free blocks as a stack: the top is free_stack[num_plain_free - 1]. Low ids are handed out first.
        self._free_stack = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self.num_plain_free = num_blocks
        """Free blocks that hold no cached prefix."""
        self.block_table = np.full((max_num_seqs, max_blocks_per_seq), -1, dtype=np.int32)
        self.num_held = np.zeros(max_num_seqs, dtype=np.int64)
        """Blocks held per slot (a prefix of its block-table row)."""
        self.ref_count = np.zeros(num_blocks, dtype=np.int32)
        """Slots holding each block."""
        self.num_registered = np.zeros(max_num_seqs, dtype=np.int64)
        """Per slot, its leading blocks already offered to the cache (``register``): registered, or found there."""
        self._registered = np.zeros(num_blocks, dtype=bool)
        self._hash_of: list[bytes | None] = [None] * num_blocks
        """Each registered block's hash (a list, not a dict: nothing to resize as blocks come and go)."""
        self._block_of = [{} for _ in range(HASH_SHARDS)]
        """Registered blocks by hash, in HASH_SHARDS dictionaries by the hash's first byte (``h[0] & SHARD_MASK``):
        one dict of 100,000 blocks paused the engine 5-14 ms whenever churn made it resize; a shard resizes in a
        sixteenth."""
        self._evictable = _EvictionOrder(num_blocks)
        """Free registered blocks, least recently freed first."""

    @property
    def num_free(self) -> int:
        """Blocks no slot holds: an allocation may take them all (evicting cached prefixes last)."""
        return self.num_plain_free + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return len(self._evictable)

    @property
    def num_in_use(self) -> int:
        """Blocks some slot holds."""
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: np.ndarray | int):
        """Blocks that hold ``num_tokens`` KV entries."""
        return -(-num_tokens // self.block_size)

    # -- allocation ------------------------------------------------------------------------------------------
    def grow(self, slots: np.ndarray, num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Make each slot hold blocks for ``num_tokens`` tokens. Returns the new (slot, block index, block id)
        entries, or None (and changes nothing) when the pool is short."""
        need = np.maximum(self.blocks_for(num_tokens) - self.num_held[slots], 0)
        total = int(need.sum())
        if total > self.num_free:
            return None
        if total == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, np.zeros(0, dtype=np.int32)
        rows = np.repeat(slots, need)
        starts = np.repeat(np.cumsum(need) - need, need)
        cols = self.num_held[rows] + (np.arange(total) - starts)
        if int(cols.max()) >= self.max_blocks_per_seq:
            raise ValueError("a request outgrew max_blocks_per_seq (max_model_len); validate requests first")
        ids = self._take(total)
        self.ref_count[ids] = 1
        self.block_table[rows, cols] = ids
        self.num_held[slots] += need
        return rows, cols, ids

    def _take(self, n: int) -> np.ndarray:
        """``n`` free blocks: plain ones first, then the least recently freed cached ones (evicted: unregistered)."""
        plain = min(n, self.num_plain_free)
        ids = self._free_stack[self.num_plain_free - plain : self.num_plain_free][::-1].copy()
        self.num_plain_free -= plain
        if plain == n:
            return ids
        taken = self._evictable.take_first(n - plain)
        shards, hash_of = self._block_of, self._hash_of
        for block in taken:
            h = hash_of[block]
            del shards[h[0] & SHARD_MASK][h]
            hash_of[block] = None
        victims = np.array(taken, dtype=np.int32)
        self._registered[victims] = False
        return np.concatenate([ids, victims])

    def shrink(self, slots: np.ndarray, num_tokens: np.ndarray) -> int:
        """Release blocks beyond what ``num_tokens`` tokens need (rejected drafts' KV); returns blocks released.
        (They are never shared: a slot shares only the leading blocks of its prefix.)"""
        keep = self.blocks_for(num_tokens)
        extra = np.maximum(self.num_held[slots] - keep, 0)
        total = int(extra.sum())
        if total:
            rows = np.repeat(slots, extra)
            starts = np.repeat(np.cumsum(extra) - extra, extra)
            cols = np.repeat(keep, extra) + (np.arange(total) - starts)
            self._unref(self.block_table[rows, cols])
            self.block_table[rows, cols] = -1
            self.num_held[slots] -= extra
            self.num_registered[slots] = np.minimum(self.num_registered[slots], self.num_held[slots])
        return total

    def release(self, slot: int) -> None:
        """Drop every block of a slot (finished, aborted or preempted request): each is freed when no other slot
        holds it, a registered one kept findable as a cached prefix."""
        held = int(self.num_held[slot])
        if held:
            self._unref(self.block_table[slot, :held])
            self.block_table[slot, :held] = -1
            self.num_held[slot] = 0
        self.num_registered[slot] = 0

    def _unref(self, ids: np.ndarray) -> None:
        """One slot lets go of ``ids`` (distinct, in block-table order): those no slot holds any more become free,
        a registered one at the end of the eviction order (the tail of the run first, so that it goes first)."""
        self.ref_count[ids] -= 1
        freed = ids[self.ref_count[ids] == 0]
        cached = self._registered[freed]
        if cached.any():
            self._evictable.extend(freed[cached][::-1].tolist())
            freed = freed[~cached]
        n = len(freed)
        self._free_stack[self.num_plain_free : self.num_plain_free + n] = freed[::-1]
        self.num_plain_free += n

    # -- prefix caching --------------------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The registered blocks of the longest run of ``hashes`` from the first (a chain: a block is only found
        after its parent)."""
        found = []
        for h in hashes:
            block = self._block_of[h[0] & SHARD_MASK].get(h)
            if block is None:
                break
            found.append(block)
        return found

    def start(self, slot: int, blocks: list[int], num_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """An empty slot takes ``blocks`` (a cached prefix, from ``lookup``) as its leading blocks and then fresh
        ones up to ``num_tokens`` tokens (as ``grow``), in one (slot, block index, block id) update; None
        (and nothing changed) when the pool is short. One request's admission: a step at 1,024 streams admits a
        few dozen, and numpy's cost a call was most of each one's (a share and a ``grow`` on one slot)."""
        n = len(blocks)
        need = max(self.blocks_for(num_tokens) - n, 0)
        cached_free = [b for b in blocks if b in self._evictable]  # (free until taken: not for the allocation)
        if need > self.num_free - len(cached_free):
            return None
        if n + need > self.max_blocks_per_seq:
            raise ValueError("a request outgrew max_blocks_per_seq (max_model_len); validate requests first")
        for block in cached_free:
            self._evictable.remove(block)
        ids = np.empty(n + need, dtype=np.int32)
        ids[:n] = blocks
        if n:
            self.ref_count[ids[:n]] += 1
        if need:
            ids[n:] = self._take(need)
            self.ref_count[ids[n:]] = 1
        self.block_table[slot, : n + need] = ids
        self.num_held[slot] = n + need
        self.num_registered[slot] = n
        return np.full(n + need, slot, dtype=np.int64), np.arange(n + need, dtype=np.int64), ids

    def register_one(self, slot: int, hashes: list[bytes], num_blocks: int, owner, log: list) -> None:
        """``register`` for one slot (a request's admission: no array work for one row)."""
        first = int(self.num_registered[slot])
        if num_blocks <= first:
            return
        new = self._offer(self.block_table[slot, first:num_blocks].tolist(), hashes[first:num_blocks],
                          repeat(owner), log)
        if new:
            self._registered[new] = True
        self.num_registered[slot] = num_blocks

    def register(self, slots: np.ndarray, hashes: list[list[bytes]], num_blocks: np.ndarray, owners: list,
                 log: list) -> None:
        """Offer each slot's blocks up to ``num_blocks[i]`` (full, their KV right; ``hashes[i][j]`` is slot i's block
        j's hash) to the cache, ``slots`` distinct. A hash already registered keeps its block (this one stays
        private). Appends (``owners[i]``, block, hash) to ``log`` for each block registered. One call for a step's
        slots: a decode step at 1,024 requests fills ~64 blocks, and numpy's cost a call was most of a block's."""
        first = self.num_registered[slots]
        counts = np.maximum(num_blocks - first, 0)
        total = int(counts.sum())
        if not total:
            return
        starts = first.tolist()
        if total == len(slots) and int(counts.min()) == 1:  # (a decode step: one block a slot, no runs to lay out)
            blocks = self.block_table[slots, first].tolist()
            block_hashes = [hs[f] for hs, f in zip(hashes, starts)]
        else:
            cols = np.repeat(first, counts) + np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
            blocks = self.block_table[np.repeat(slots, counts), cols].tolist()
            runs = counts.tolist()
            block_hashes = [h for hs, f, n in zip(hashes, starts, runs) for h in hs[f:f + n]]
            owners = [owner for owner, n in zip(owners, runs) for _ in range(n)]
        self._registered[self._offer(blocks, block_hashes, owners, log)] = True
        self.num_registered[slots] = first + counts

    def _offer(self, blocks: list[int], hashes: list[bytes], owners, log: list) -> list[int]:
        """Each block under its hash (``owners``: each one's request), where the hash is not registered yet
        (``register``); returns the blocks registered, each also appended to ``log`` as (owner, block, hash)."""
        shards, hash_of, new = self._block_of, self._hash_of, []
        for block, h, owner in zip(blocks, hashes, owners):
            block_of = shards[h[0] & SHARD_MASK]
            if h not in block_of:
                block_of[h] = block
                hash_of[block] = h
                new.append(block)
                log.append((owner, block, h))
        return new

    def unregister(self, entries: list[tuple[int, bytes]]) -> np.ndarray:
        """Forget (block, hash) registrations (a failed step's: their KV was never written) where they still stand;
        a free one becomes a plain free block. Returns the blocks forgotten."""
        gone = []
        for block, h in entries:
            if self._hash_of[block] == h:
                self._hash_of[block] = None
                del self._block_of[h[0] & SHARD_MASK][h]
                self._registered[block] = False
                gone.append(block)
                if block in self._evictable:
                    self._evictable.remove(block)
                    self._free_stack[self.num_plain_free] = block
                    self.num_plain_free += 1
        return np.asarray(gone, dtype=np.int32)

    def slots_holding(self, blocks: np.ndarray) -> np.ndarray:
        """Slots whose rows hold any of ``blocks``."""
        if not len(blocks):
            return np.zeros(0, dtype=np.int64)
        return np.nonzero(np.isin(self.block_table, blocks).any(axis=1))[0]


class _EvictionOrder:
    """Free registered blocks, least recently freed first: a doubly linked list over block ids kept in lists (vLLM's
    free block queue), O(1) to append, remove or take the first, and nothing to resize (an OrderedDict of 100,000
    blocks paused the engine for milliseconds whenever it resized; taking from the front of a plain dict scanned
    past every entry deleted there since its last resize)."""

    def __init__(self, num_blocks: int):
        self.prev = [-1] * num_blocks
        self.next = [-1] * num_blocks
        self.member = bytearray(num_blocks)
        self.head = self.tail = -1
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, block: int) -> bool:
        return bool(self.member[block])

    def __iter__(self):
        block = self.head
        while block != -1:
            yield block
            block = self.next[block]

    def extend(self, blocks: list[int]) -> None:
        """Append ``blocks`` in their order (not members)."""
        prev, next_, member = self.prev, self.next, self.member
        last = self.tail
        for block in blocks:
            prev[block] = last
            if last == -1:
                self.head = block
            else:
                next_[last] = block
            member[block] = 1
            last = block
        if blocks:
            next_[last] = -1
            self.tail = last
            self.size += len(blocks)

    def remove(self, block: int) -> None:
        before, after = self.prev[block], self.next[block]
        if before == -1:
            self.head = after
        else:
            self.next[before] = after
        if after == -1:
            self.tail = before
        else:
            self.prev[after] = before
        self.member[block] = 0
        self.size -= 1

    def take_first(self, n: int) -> list[int]:
        """The first ``n`` blocks, removed (n <= len)."""
        out, next_, member = [], self.next, self.member
        block = self.head
        for _ in range(n):
            out.append(block)
            member[block] = 0
            block = next_[block]
        self.head = block
        if block == -1:
            self.tail = -1
        else:
            self.prev[block] = -1
        self.size -= n
        return out
