"""A front end's prompt tokenization: the prompts that arrive in one turn of the event loop are tokenized together,
in a worker thread, by the tokenizer's batch call (``tokenizers``' ``encode_batch``: parallel over the cores, the
GIL released). A burst of arrivals then costs about one call's wall time instead of one call per prompt, and the
event loop keeps streaming the running requests' tokens meanwhile: the one-text call holds the GIL, so tokenizing a
long prompt in a thread used to stall the loop all the same. A prompt alone in its turn goes through the batch call
too (a chat turn whose long conversation was rendered in a thread comes alone): the same ids at the same cost, the
GIL released (with the one-text call the loop ran at about half speed while a 60,000-character prompt tokenized)."""

from __future__ import annotations

import asyncio


class Tokenizing:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._waiting: dict[bool, list[tuple[str, asyncio.Future]]] = {}
        self._running: set[asyncio.Task] = set()
        """The batches' tasks, held until done (the loop keeps only weak references to tasks)."""
        self.batches = 0
        """Batch calls made (tests, metrics)."""

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, from the batch of everything asked for in this turn of the loop. What the
        tokenizer raises for ``text`` (alone: a batch that fails is retried prompt by prompt) is raised here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._waiting:
            loop.call_soon(self._flush)
        self._waiting.setdefault(add_special_tokens, []).append((text, future))
        return await future

    def _flush(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for add_special_tokens, items in waiting.items():
            self.batches += 1
            task = asyncio.get_running_loop().create_task(self._run(add_special_tokens, items))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, add_special_tokens: bool, items: list[tuple[str, asyncio.Future]]) -> None:
        texts = [text for text, _ in items]
        try:
            results = await asyncio.to_thread(self._encode_all, texts, add_special_tokens)
        except BaseException as exc:  # (the worker thread's error, or this task cancelled at shutdown)
            results = [exc] * len(items)
        for (_, future), result in zip(items, results):
            if future.done():  # (its request went away meanwhile)
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

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


def _reraise_interrupts(exc: BaseException) -> None:
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        raise exc
