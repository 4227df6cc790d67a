"""A front end's prompt tokenization: the prompts that arrive in one turn of the event loop are tokenized together,
in a worker thread, by the tokenizer's batch call (``tokenizers``' ``encode_batch``: parallel over the cores, the
GIL released). A burst of arrivals then costs about one call's wall time instead of one call per prompt, and the
event loop keeps streaming the running requests' tokens meanwhile: the one-text call holds the GIL, so tokenizing a
long prompt in a thread used to stall the loop all the same. A prompt alone in its turn goes through the batch call
too (a chat turn whose long conversation was rendered in a thread comes alone): the same ids at the same cost, the
GIL released (with the one-text call the loop ran at about half speed while a 60,000-character prompt tokenized).

Where the tokenizer cuts a text at its added tokens and tokenizes the pieces between them each on its own
(``models.text.AddedTokenSplit``, checked for each tokenizer), a prompt is tokenized piece by piece and the pieces'
ids are kept (least recently used dropped first, ``MAX_KEPT_BYTES`` in all): a chat's earlier messages, a shared
system prompt or a prompt sent again cost a dictionary lookup, not a tokenization. A multi-turn conversation's turn
then tokenizes only its new messages, and a prompt whose pieces are all kept is answered without the batch call.
"""

from __future__ import annotations

import asyncio
from array import array
from collections import ChainMap, OrderedDict

MAX_KEPT_BYTES = 64 << 20
"""The pieces kept in all, counted as their ids (4 bytes a token), their text (a byte a character, most prompts'
text being ASCII) and ``KEPT_ENTRY_BYTES`` each."""
KEPT_ENTRY_BYTES = 256
"""What one kept piece costs besides its ids and text (the dictionary's entry, the string and array objects)."""
MAX_KEPT_PIECE_TOKENS = 1 << 18
"""A longer piece is tokenized each time (one piece would otherwise push out the many that repeat)."""
SPLIT_ON_LOOP_CHARS = 8192
"""A longer prompt is cut into pieces in the worker thread: the cut scans the text for every added token, which
for a crafted prompt of megabytes and a tokenizer of hundreds of them takes seconds."""


class Tokenizing:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.split = getattr(tokenizer, "added_token_split", None)
        """How the tokenizer cuts a text into pieces tokenized on their own (None: prompts are tokenized whole)."""
        self._kept: OrderedDict[str, array] = OrderedDict()
        self.kept_bytes = 0
        self._waiting: dict[bool, list[tuple[str, list | None, asyncio.Future]]] = {}
        self._running: set[asyncio.Task] = set()
        """The batches' tasks, held until done (the loop keeps only weak references to tasks)."""
        self.batches = 0
        """Batch calls made (tests, metrics)."""

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, from the batch of everything asked for in this turn of the loop (or at once, from
        the pieces kept). What the tokenizer raises for ``text`` (alone: a batch that fails is retried piece by
        piece) is raised here."""
        pieces = None
        if self.split is not None and len(text) <= SPLIT_ON_LOOP_CHARS:
            pieces = self.split.pieces(text)
            if all(isinstance(p, int) or p in self._kept for p in pieces):
                return self._join(pieces, add_special_tokens)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._waiting:
            loop.call_soon(self._flush)
        self._waiting.setdefault(add_special_tokens, []).append((text, pieces, future))
        return await future

    def _join(self, pieces: list, add_special_tokens: bool) -> list[int]:
        for piece in pieces:
            if not isinstance(piece, int):
                self._kept.move_to_end(piece)
        return self.split.join(pieces, self._kept, add_special_tokens)

    def _keep(self, piece: str, ids: list[int]) -> None:
        if len(ids) > MAX_KEPT_PIECE_TOKENS or piece in self._kept:
            return
        self._kept[piece] = array("i", ids)
        self.kept_bytes += _cost(piece, self._kept[piece])
        while self.kept_bytes > MAX_KEPT_BYTES:
            self.kept_bytes -= _cost(*self._kept.popitem(last=False))

    def _flush(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for add_special_tokens, items in waiting.items():
            self.batches += 1
            task = asyncio.get_running_loop().create_task(self._run(add_special_tokens, items))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, add_special_tokens: bool, items: list[tuple[str, list | None, asyncio.Future]]) -> None:
        try:
            if self.split is None:
                results = await asyncio.to_thread(self._encode_all, [text for text, _, _ in items],
                                                  add_special_tokens)
            else:
                results = await self._by_pieces([(text, pieces) for text, pieces, _ in items], add_special_tokens)
        except BaseException as exc:  # (the worker thread's error, or this task cancelled at shutdown)
            results = [exc] * len(items)
        for (_, _, future), result in zip(items, results):
            if future.done():  # (its request went away meanwhile)
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _by_pieces(self, texts: list[tuple[str, list | None]], add_special_tokens: bool) -> list:
        """Each text's ids (or the exception one of its pieces raised), the pieces not kept tokenized in one batch
        call in the worker thread (those kept are read before it: another batch may drop them meanwhile); a long
        text cut into pieces in the worker thread first."""
        if any(pieces is None for _, pieces in texts):
            texts = await asyncio.to_thread(lambda: [(t, p if p is not None else self.split.pieces(t))
                                                     for t, p in texts])
        pieces = [p for _, p in texts]
        have: dict[str, array] = {}
        new: dict[str, None] = {}
        for piece in (p for ps in pieces for p in ps if not isinstance(p, int)):
            if piece in have or piece in new:
                continue
            ids = self._kept.get(piece)
            if ids is None:
                new[piece] = None
            else:
                have[piece] = ids
                self._kept.move_to_end(piece)
        got = dict(zip(new, await asyncio.to_thread(self._encode_all, list(new), False)))
        for piece, ids in got.items():
            if not isinstance(ids, BaseException):
                self._keep(piece, ids)
        ids_of = ChainMap(got, have)
        return [next((got[p] for p in ps if isinstance(got.get(p), BaseException)), None)
                or self.split.join(ps, ids_of, add_special_tokens) for ps in pieces]

    def _encode_all(self, texts: list[str], add_special_tokens: bool) -> list:
        """Each text's ids (or the exception it alone raised), in the worker thread."""
        batch = getattr(self.tokenizer, "encode_batch", None)
        if batch is not None:
            try:
                return batch(texts, add_special_tokens)
            except BaseException as exc:  # one bad text fails the call: find it, prompt by prompt
                _reraise_interrupts(exc)
        out: list = []
        for text in texts:
            try:
                out.append(self.tokenizer.encode(text, add_special_tokens))
            except BaseException as exc:  # (the tokenizers library's panics derive from BaseException)
                _reraise_interrupts(exc)
                out.append(exc)
        return out


def _cost(piece: str, ids: array) -> int:
    return 4 * len(ids) + len(piece) + KEPT_ENTRY_BYTES


def _reraise_interrupts(exc: BaseException) -> None:
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        raise exc
