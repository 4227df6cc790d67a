"""Structured outputs in the engine: grammars compiled with xgrammar off the step loop and cached, one matcher per
constrained request, advanced with its tokens, and each step's token bitmask.

The design is vLLM v1's (``StructuredOutputManager`` in the engine core, ``apply_grammar_bitmask`` in the GPU model
runner) and SGLang's (the grammar on the scheduler's side, the mask applied in the sampler):

- **Compile**: a request's constraint (``scheduler.structured.StructuredOutputsParams``) compiles in a thread pool
  of this process (xgrammar releases the GIL while it computes token masks, so a step never waits for a compile),
  once per constraint: xgrammar's compiler keeps compiled grammars in an LRU cache of ``CACHE_BYTES``, and a
  constraint already compiling is not compiled twice. The request joins the scheduler only once its grammar is
  ready (vLLM's ``WAITING_FOR_FSM``); a compile that fails or takes more than ``COMPILE_TIMEOUT_S`` refuses it
  (400), and the compile thread's work is not lost (the cache keeps it). The engine process rather than the front
  end compiles because the matchers live here (a compiled grammar does not travel between processes cheaply) and
  one cache serves every front end.
- **Match**: a ``GrammarMatcher`` per request, advanced by ``advance`` with the tokens each step appended (the
  scheduler's update path). Structured requests verify no drafts (``Scheduler.structured``): the drafts stay on the
  worker, so the engine cannot check them against the grammar.
- **Mask**: ``bitmask`` fills one packed int32 row per constrained sampling row of a step (bit ``t % 32`` of word
  ``t // 32`` set: token ``t`` allowed) with xgrammar's multi-threaded batch fill; the rows travel in the step
  message and the worker applies them to the logits on the device before sampling
  (``ModelWorker._apply_grammar_bitmask``). A finished or terminated grammar's row allows every token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from dispatcher.messages import bitmask_words
from scheduler.request import RequestError
from scheduler.structured import StructuredOutputsParams

log = logging.getLogger("twogrid.structured")

COMPILE_TIMEOUT_S = 10.0
"""A request whose grammar has not compiled this long after it arrived (queueing for a compile thread included) is
refused: a hostile constraint within the static limits (``scheduler.structured``) costs at most this wait."""
COMPILE_WORKERS = 2
"""Grammars compiled at once (each compile uses ``_threads()`` threads of its own)."""
LOG_EVERY_STEPS = 2000
"""Constrained steps between two lines of bitmask and matcher timings."""
CACHE_BYTES = 512 << 20
"""xgrammar's compiled-grammar cache (vLLM's default, VLLM_XGRAMMAR_CACHE_MB = 512)."""


_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
"""xgrammar's error messages start with a time and a source line ('[04:43:24] /project/cpp/grammar_parser.cc:820: ')."""


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _threads() -> int:
    """Threads of one compile or one bitmask fill: half the cores, at most 8 (vLLM's choice)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class StructuredOutputs:
    """The engine's grammars and matchers. ``tokenizer``: models.text.Tokenizer (None: a preset without one, which
    refuses every structured request); ``vocab_size``: the model's (the bitmask's width)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, max_num_seqs: int,
                 timeout_s: float = COMPILE_TIMEOUT_S):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.timeout_s = timeout_s
        self.words = bitmask_words(vocab_size)
        """int32 words per bitmask row."""
        self._xgr = None
        self._compiler = None
        self._batch = None
        self._init_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._compiling: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self.matchers: dict[str, object] = {}
        """Each live structured request's xgrammar GrammarMatcher."""
        self._bitmask = None
        self._timing = [0, 0.0, 0.0, 0]
        """Since the last log line: constrained steps, seconds advancing matchers, seconds filling, rows."""

    # -- the backend ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Import xgrammar and build the tokenizer's vocabulary table (a second or two: the engine calls this while
        its worker starts); a no-op without a tokenizer or when done."""
        if self.tokenizer is None:
            return
        with self._init_lock:
            if self._compiler is not None:
                return
            import torch
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            self._batch = xgr.BatchGrammarMatcher(_threads())
            self._bitmask = torch.full((self.max_num_seqs, self.words), -1, dtype=torch.int32)
            self._pool = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="twogrid-grammar")
            self._xgr = xgr
            self._compiler = xgr.GrammarCompiler(info, max_threads=_threads(), cache_enabled=True,
                                                 cache_limit_bytes=CACHE_BYTES)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- compiling -----------------------------------------------------------------------------------------------
    def compile_future(self, params: StructuredOutputsParams) -> Future:
        """The constraint's compiled grammar, compiling in the pool (one future per constraint being compiled)."""
        if self.tokenizer is None:
            raise RequestError(f"{params.where}: structured outputs need the model's tokenizer; this model has none "
                               f"(a preset with random weights, or a checkpoint without tokenizer.json): give "
                               f"--tokenizer")
        try:
            self.start()
        except ImportError as exc:
            raise RequestError(f"{params.where}: structured outputs need xgrammar, which cannot be imported here "
                               f"({exc}): pip install xgrammar") from None
        with self._lock:
            fut = self._compiling.get(params.key)
            created = fut is None
            if created:
                fut = self._compiling[params.key] = self._pool.submit(self._compile, params)
        if created:  # (outside the lock: a compile done already runs its callback here, and that takes the lock)
            fut.add_done_callback(lambda _, key=params.key: self._done(key))
        return fut

    def _done(self, key: tuple) -> None:
        with self._lock:
            self._compiling.pop(key, None)

    def _compile(self, params: StructuredOutputsParams):
        c, kind = self._compiler, params.kind
        value = getattr(params, kind)
        if kind == "json":
            return c.compile_json_schema(value, any_whitespace=not params.disable_any_whitespace, strict_mode=True)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(value)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in value))
        if kind == "grammar":
            return c.compile_grammar(value)
        return c.compile_structural_tag(value)

    def result(self, params: StructuredOutputsParams, fut: Future):
        """A finished compile's grammar; RequestError naming the field when it failed."""
        try:
            return fut.result()
        except Exception as exc:  # xgrammar's errors (RuntimeError, ValueError, its own types): the request's fault
            field = params.where if params.where != "structured_outputs" else f"structured_outputs.{params.kind}"
            lines = str(exc).strip().splitlines()
            message = _SOURCE_PREFIX.sub("", lines[-1]) if lines else type(exc).__name__
            raise RequestError(f"{field} does not compile: {message}") from None

    def compile(self, params: StructuredOutputsParams):
        """Compile now (the offline engine), waiting up to the timeout."""
        fut = self.compile_future(params)
        try:
            fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise self._timeout(params) from None
        except Exception:
            pass
        return self.result(params, fut)

    async def compile_async(self, params: StructuredOutputsParams):
        """Compile without blocking the event loop (the serving engine), waiting up to the timeout."""
        fut = self.compile_future(params)
        waiting = asyncio.wrap_future(fut)
        waiting.add_done_callback(_retrieve)  # (its error is read from ``fut``; asyncio must not report it)
        done, _ = await asyncio.wait([waiting], timeout=self.timeout_s)
        if not done:
            raise self._timeout(params)
        return self.result(params, fut)

    def _timeout(self, params: StructuredOutputsParams) -> RequestError:
        log.warning("a %s grammar did not compile within %.0f s: refused", params.kind, self.timeout_s)
        return RequestError(f"{params.where}: the grammar did not compile within {self.timeout_s:.0f} s (the limit "
                            f"for one constraint); simplify it")

    # -- matchers ------------------------------------------------------------------------------------------------
    def add(self, request_id: str, grammar) -> None:
        self.matchers[request_id] = self._xgr.GrammarMatcher(grammar)

    def remove(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def advance(self, outputs) -> None:
        """Each structured request's new tokens into its matcher (the step's outputs, after the scheduler's update),
        all of them in one xgrammar call (a structured request gains one token a step: it verifies no drafts). A
        finished request's matcher goes. A token its grammar refuses cannot be sampled under the mask; if one is
        (a defect), the request is logged and runs on unconstrained rather than failing the step."""
        t0 = time.perf_counter()
        live = [(o, m) for o in outputs if (m := self.matchers.get(o.request_id)) is not None and o.new_token_ids]
        taking = [(o, m) for o, m in live if not m.is_terminated()]  # (after EOS under ignore_eos: free)
        if taking:
            ok = self._xgr.BatchGrammarMatcher.batch_accept_token([m for _, m in taking],
                                                                  [o.new_token_ids[0] for o, _ in taking])
            for (o, m), accepted in zip(taking, ok):
                if not accepted:
                    log.error("request %s: token %d is outside its grammar; it runs on unconstrained", o.request_id,
                              o.new_token_ids[0])
                    self.matchers.pop(o.request_id)
                elif len(o.new_token_ids) > 1:  # (not from a structured request's step; kept exact anyway)
                    for t in o.new_token_ids[1:]:
                        if m.is_terminated() or not m.accept_token(t):
                            break
        for o in outputs:
            if o.finished:
                self.matchers.pop(o.request_id, None)
        self._timing[1] += time.perf_counter() - t0

    def bitmask(self, request_ids: list[str]) -> bytes:
        """int32 (len(request_ids), words): each request's allowed next tokens, packed (all allowed for one whose
        grammar ended or that left)."""
        t0 = time.perf_counter()
        n = len(request_ids)
        mask = self._bitmask[:n]
        live, rows = [], []
        for i, rid in enumerate(request_ids):
            m = self.matchers.get(rid)
            if m is not None and not m.is_terminated():
                live.append(m)
                rows.append(i)
        if len(rows) < n:
            mask.fill_(-1)
        if live:
            self._batch.batch_fill_next_token_bitmask(live, mask, rows)
        data = mask.numpy().tobytes()
        self._note_step(n, time.perf_counter() - t0)
        return data

    def _note_step(self, rows: int, fill_s: float) -> None:
        """Every LOG_EVERY_STEPS constrained steps, one line: rows a step and the host's milliseconds for the
        bitmask (fill and copy) and for advancing the matchers (what asynchronous scheduling must hide)."""
        steps, _, filled, rows_total = self._timing
        self._timing = [steps + 1, self._timing[1], filled + fill_s, rows_total + rows]
        if self._timing[0] >= LOG_EVERY_STEPS:
            steps, advanced, filled, rows_total = self._timing
            log.info("structured outputs: %d constrained steps, %.0f rows a step, bitmask %.2f ms a step, matchers "
                     "advanced %.2f ms a step", steps, rows_total / steps, 1e3 * filled / steps,
                     1e3 * advanced / steps)
            self._timing = [0, 0.0, 0.0, 0]


def unpack_bitmask(data: bytes, vocab_size: int) -> np.ndarray:
    """The allowed tokens of packed bitmask rows, as bool (rows, vocab_size) (tests and checks)."""
    words = np.frombuffer(data, np.int32).reshape(-1, bitmask_words(vocab_size))
    bits = (words[:, :, None].view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(len(words), -1)[:, :vocab_size].astype(bool)
