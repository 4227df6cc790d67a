"""Block hashes for prefix caching (vLLM's scheme): block i's hash is SHA-256 of block i - 1's hash (a fixed root for
block 0), its ``block_size`` token ids as little-endian int32, and its extra key where a block's KV depends on more
than its own tokens. The one such case here: a drafter whose KV entry at position p holds token p + 1 (an
EAGLE-style head reads (token p + 1, the target's feature at p)), whose blocks carry the token after them as their
extra key, so that a block is only found by a request that continues it with the same token. A hash names the
whole prefix up to the end of its block (and that token), so equal hashes mean equal KV."""

from __future__ import annotations

import hashlib
import struct

ROOT = b"twogrid prefix cache"
"""The parent hash of a sequence's first block."""


def extend_block_hashes(hashes: list[bytes], token_ids, num_blocks: int, block_size: int,
                        next_token_key: bool) -> list[bytes]:
    """Append to ``hashes`` (the hashes of a sequence's first blocks) those of its blocks up to ``num_blocks``;
    ``token_ids(start, end)`` gives the sequence's tokens in [start, end), which must reach ``num_blocks`` blocks
    (and one token past them with ``next_token_key``). Returns ``hashes``."""
    start = len(hashes)
    if num_blocks <= start:
        return hashes
    extra = 1 if next_token_key else 0
    tokens = token_ids(start * block_size, num_blocks * block_size + extra)
    data = struct.pack(f"<{len(tokens)}i", *tokens)
    width = 4 * block_size
    parent = hashes[-1] if hashes else ROOT
    for i in range(num_blocks - start):
        parent = hashlib.sha256(parent + data[i * width : (i + 1) * width + 4 * extra]).digest()
        hashes.append(parent)
    return hashes
