"""Block hashes for prefix caching (vLLM's scheme): block i's hash is SHA-256 of block i - 1's hash (a fixed root for
block 0), its ``block_size`` token ids as little-endian int32, and its extra key where a block's KV depends on more
than its own tokens. The one such case here: a drafter whose KV entry at position p holds token p + 1 (an
EAGLE-style head reads (token p + 1, the target's feature at p)), whose blocks carry the token after them as their
extra key, so that a block is only found by a request that continues it with the same token. A hash names the
whole prefix up to the end of its block (and that token), so equal hashes mean equal KV."""

from __future__ import annotations

import array
import hashlib
import struct
import sys

ROOT = b"twogrid prefix cache"
"""The parent hash of a sequence's first block."""
HASH_BYTES = 32
"""A block hash's length (SHA-256)."""


_PACKERS: dict[int, struct.Struct] = {}
"""Packers of the short token runs a step's full blocks hash (a decode step fills a block or two a request)."""
_PACKERS_UP_TO = 128
"""Token counts packed with a cached packer (prompts' longer runs parse their format each time)."""


def extend_block_hashes(hashes: list[bytes], token_ids, num_blocks: int, block_size: int,
                        next_token_key: bool, packed: bytes | None = None) -> list[bytes]:
    """Append to ``hashes`` (the hashes of a sequence's first blocks) those of its blocks up to ``num_blocks``;
    ``token_ids(start, end)`` gives the sequence's tokens in [start, end), which must reach ``num_blocks`` blocks
    (and one token past them with ``next_token_key``). Returns ``hashes``. (Called for every block a step fills, ~160
    a step at 1,024 requests under speculative decoding: the packer is cached, the loop kept to the hash.)
    ``packed``: the sequence's first tokens as native int32 bytes where the caller has them (a prompt's, from the
    engine's check), read in place of packing the tokens where they reach far enough."""
    start = len(hashes)
    if num_blocks <= start:
        return hashes
    extra = 1 if next_token_key else 0
    end = num_blocks * block_size + extra
    if packed is not None and len(packed) >= 4 * end and sys.byteorder == "little":
        data = memoryview(packed)[4 * start * block_size: 4 * end]
    else:
        tokens = token_ids(start * block_size, end)
        n = len(tokens)
        packer = _PACKERS.get(n)
        if packer is None:
            packer = struct.Struct(f"<{n}i")
            if n <= _PACKERS_UP_TO:
                _PACKERS[n] = packer
        data = packer.pack(*tokens)
    width, span = 4 * block_size, 4 * (block_size + extra)
    parent = hashes[-1] if hashes else ROOT
    sha, append = hashlib.sha256, hashes.append
    for offset in range(0, (num_blocks - start) * width, width):
        parent = sha(parent + data[offset:offset + span]).digest()
        append(parent)
    return hashes


def num_lookup_blocks(num_tokens: int, block_size: int) -> int:
    """The blocks of a sequence of ``num_tokens`` tokens that a cache lookup may find: the full blocks before its
    last token (which a step always computes, for its logits); none for an empty one."""
    return max(num_tokens - 1, 0) // block_size


def prompt_block_hashes(packed: bytes, block_size: int, next_token_key: bool) -> bytes:
    """A prompt's lookup blocks' hashes (``num_lookup_blocks``), joined, for a prompt as little-endian int32 bytes
    (``dispatcher.engine.protocol.pack_prompt``): what a front end computes and sends with the request, so that the
    engine's single thread does not (``split_hashes`` takes them apart there)."""
    num_blocks = num_lookup_blocks(len(packed) // 4, block_size)
    if not num_blocks:
        return b""
    return b"".join(extend_block_hashes([], lambda start, end: _int32s(packed)[start:end], num_blocks, block_size,
                                        next_token_key, packed))


def split_hashes(joined: bytes) -> list[bytes]:
    """``prompt_block_hashes``' bytes as the list of hashes a request keeps."""
    return [joined[i:i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]


def _int32s(packed: bytes) -> list[int]:
    """Little-endian int32 bytes as ints (where ``extend_block_hashes`` cannot read the bytes in place: a
    big-endian host)."""
    ids = array.array("i", packed)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tolist()
