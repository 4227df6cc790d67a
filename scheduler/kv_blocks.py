"""Paged KV cache bookkeeping: a pool of fixed-size blocks and one block table row per running slot.

Block tables are a (max_num_seqs, max_blocks_per_seq) int32 array, -1 where no block is held; the worker
mirrors it. Allocation and release are vectorized (numpy) so that a 1024-request step stays cheap.
"""

from __future__ import annotations

import numpy as np


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_blocks_per_seq: int):
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        # Free blocks as a stack: the top is free_stack[num_free - 1]. Low ids are handed out first.
        self._free_stack = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self.num_free = num_blocks
        self.block_table = np.full((max_num_seqs, max_blocks_per_seq), -1, dtype=np.int32)
        self.num_held = np.zeros(max_num_seqs, dtype=np.int64)
        """Blocks held per slot (a prefix of its block-table row)."""

    def blocks_for(self, num_tokens: np.ndarray | int):
        """Blocks that hold ``num_tokens`` KV entries."""
        return -(-num_tokens // self.block_size)

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
        ids = self._free_stack[self.num_free - total : self.num_free][::-1].copy()
        self.num_free -= total
        self.block_table[rows, cols] = ids
        self.num_held[slots] += need
        return rows, cols, ids

    def shrink(self, slots: np.ndarray, num_tokens: np.ndarray) -> int:
        """Release blocks beyond what ``num_tokens`` tokens need (rejected drafts' KV); returns blocks freed."""
        keep = self.blocks_for(num_tokens)
        extra = np.maximum(self.num_held[slots] - keep, 0)
        total = int(extra.sum())
        if total:
            rows = np.repeat(slots, extra)
            starts = np.repeat(np.cumsum(extra) - extra, extra)
            cols = np.repeat(keep, extra) + (np.arange(total) - starts)
            self._push(self.block_table[rows, cols])
            self.block_table[rows, cols] = -1
            self.num_held[slots] -= extra
        return total

    def release(self, slot: int) -> None:
        """Free every block of a slot (finished, aborted or preempted request)."""
        held = int(self.num_held[slot])
        if held:
            self._push(self.block_table[slot, :held])
            self.block_table[slot, :held] = -1
            self.num_held[slot] = 0

    def _push(self, ids: np.ndarray) -> None:
        n = len(ids)
        self._free_stack[self.num_free : self.num_free + n] = ids[::-1]
        self.num_free += n
