"""Structured outputs in the engine: grammars compiled with xgrammar off the step loop and cached, and sent to the
worker, which keeps a matcher per constrained request and fills each step's token bitmask
(``dispatcher.runtime.grammar``).

The design is vLLM v1's (``StructuredOutputManager``: compiles in a thread pool, requests wait for their grammar)
and SGLang's (the matchers beside the model runner, the mask filled while the forward runs):

- **Compile**: a request's constraint (``scheduler.structured.StructuredOutputsParams``) compiles off the step
  loop, once per constraint: ``COMPILE_WORKERS`` threads of this process each hand theirs to a compile process of
  their own (``dispatcher.engine.grammar_process``: forked from a server with xgrammar imported, held to
  ``COMPILE_MEMORY_BYTES``), and compiled grammars stay in a cache of ``CACHE_BYTES`` of their serialized form; a
  constraint already compiling is not compiled twice. The request joins the scheduler only once its grammar is
  ready (vLLM's ``WAITING_FOR_FSM``); a compile that fails, runs out of its memory or takes more than
  ``COMPILE_TIMEOUT_S`` refuses it (400), and at the timeout its process is killed, so a hostile constraint costs at
  most that time and memory. The engine compiles rather than the front end because one cache then serves every
  front end, and rather than the worker because a compile must never hold up a step.
- **Send**: the worker gets each grammar once, serialized (``GrammarDef``), and keeps it while a request it holds
  uses it and ``WORKER_IDLE_GRAMMARS`` (within ``WORKER_IDLE_BYTES``) more after that (least recently used dropped
  first, ``Step.dropped_grammars``): ``for_step`` keeps the engine's account of what the worker holds, from the
  same messages the worker reads. Reading a grammar takes the worker time (19 ms for a 0.36 MB JSON schema, seconds
  for a hostile one), so while other requests run a new grammar is sent ahead (``send_ahead``) with the next step,
  the worker reads it in a thread of its own, and its requests wait in the engine (``EngineCore``) until a step
  result says it is read (``ready``); with nothing else running, it goes with the step that admits its request.
- **Match and mask**: on the worker, which samples the tokens: the engine never waits for a bitmask, so a step that
  a grammar constrains is scheduled and overlapped like any other. Structured requests verify no drafts
  (``Scheduler.structured``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from dispatcher.engine import grammar_process
from dispatcher.engine.grammar_process import CompileFailed, CompileInThread, CompileProcess, CompileTimeout
from dispatcher.messages import GrammarDef, pack, xgrammar_threads
from scheduler.request import RequestError
from scheduler.structured import StructuredOutputsParams

log = logging.getLogger("twogrid.structured")

COMPILE_TIMEOUT_S = 10.0
"""A request whose grammar has not compiled this long after it arrived (queueing for a compile process included) is
refused, and the compile's process killed: a hostile constraint within the static limits (``scheduler.structured``)
costs at most this wait."""
STARTUP_TIMEOUT_S = 60.0
"""How long a compile process may take to start (the fork server imports xgrammar and torch: seconds)."""
COMPILE_WORKERS = 2
"""Grammars compiled at once, each in a process of its own (using ``xgrammar_threads()`` threads)."""
CACHE_BYTES = 512 << 20
"""The compiled grammars kept, by their serialized size (vLLM's default for xgrammar's cache,
VLLM_XGRAMMAR_CACHE_MB = 512)."""
WORKER_IDLE_GRAMMARS = 32
"""Grammars the worker keeps after their last request left (a new request with one of them sends nothing)."""
WORKER_IDLE_BYTES = 256 << 20
"""... and their serialized bytes at most (a hostile schema within the limits compiles to tens of MB)."""


_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
"""xgrammar's error messages start with a time and a source line ('[04:43:24] /project/cpp/grammar_parser.cc:820: ')."""

VOCAB_CHECK_TOKENS = 4096
"""Tokens (spread over the vocabulary) whose text xgrammar's table must match the tokenizer's decoding of."""
VOCAB_CHECK_MISMATCH = 0.01
"""The share of them that may differ (none did on the default model, Gemma 3 or the tests' BPE); a misread
vocabulary (xgrammar's RAW type for a byte-level BPE) differs in most."""


def vocabulary_misread(decoded_vocab: list[bytes], tokenizer, special_ids) -> str | None:
    """Where xgrammar's table of the tokens' texts (``TokenizerInfo.decoded_vocab``) disagrees with the tokenizer's
    own decoding on more than ``VOCAB_CHECK_MISMATCH`` of ``VOCAB_CHECK_TOKENS`` tokens, why (with an example);
    None when they agree. Grammars over a misread vocabulary allow the wrong tokens. Each token is decoded after a
    plain one (a SentencePiece decoder drops a first token's leading space); special tokens and pieces of a
    character (byte-fallback tokens) are not compared."""
    anchor = tokenizer.encode("x", False)[-1]
    prefix = tokenizer.decode([anchor], skip_special_tokens=False)
    special = set(special_ids)
    compared, differ, example = 0, 0, None
    for i in range(0, min(len(decoded_vocab), tokenizer.vocab_size), max(1, len(decoded_vocab) // VOCAB_CHECK_TOKENS)):
        text = tokenizer.decode([anchor, i], skip_special_tokens=False)
        piece = text[len(prefix):]
        if i in special or not text.startswith(prefix) or not piece or "\ufffd" in text:
            continue
        compared += 1
        if piece.encode() != decoded_vocab[i]:
            differ += 1
            if example is None or (" " in piece and " " not in example[1]):  # (a word shows it best)
                example = (i, piece, decoded_vocab[i])
    if example is None or differ <= VOCAB_CHECK_MISMATCH * compared:
        return None
    i, ours, theirs = example
    return (f"xgrammar reads this tokenizer's vocabulary otherwise than the tokenizer decodes it ({differ} of "
            f"{compared} tokens checked differ; token {i} is {ours!r}, xgrammar's table says "
            f"{theirs.decode('utf-8', 'backslashreplace')!r}), so its grammars would allow the wrong tokens: "
            f"structured outputs are off for this model")


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


@dataclass(frozen=True)
class Compiled:
    """A constraint's compiled grammar, as the engine keeps it and the worker gets it."""

    grammar_id: int
    """Its id on the wire (``NewRequest.grammar_id``)."""
    serialized: str
    """``grammar.serialize_json()`` (what ``GrammarDef`` carries)."""


class StructuredOutputs:
    """The engine's grammars. ``tokenizer``: models.text.Tokenizer (None: a preset without one, which refuses every
    structured request); ``vocab_size``: the model's; ``in_processes``: compile in processes that are killed at the
    timeout and held to a memory limit (the server, which takes constraints from anyone), else in threads of this
    process (the offline engine)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, timeout_s: float = COMPILE_TIMEOUT_S,
                 in_processes: bool = False):
        self.tokenizer = tokenizer
        self.in_processes = in_processes
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.timeout_s = timeout_s
        self.tokenizer_info_json = ""
        """xgrammar's TokenizerInfo, serialized (what the worker's first ``GrammarDef`` carries)."""
        self.misread: str | None = None
        """Why structured outputs are off for this tokenizer (``vocabulary_misread``), once started."""
        self._info_sent = False
        self._init_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._processes: queue.SimpleQueue[CompileProcess | CompileInThread] = queue.SimpleQueue()
        """The compilers not in use (``COMPILE_WORKERS``; a pool thread takes one for a compile)."""
        self._all_processes: list[CompileProcess] = []
        self._ready = threading.Event()
        self._compilers_started = False
        self._closed = False
        self._ready_at: float | None = None
        """When the compilers were ready (None: compile processes still starting)."""
        self._compiling: dict[tuple, Future] = {}
        self._waiters: dict[tuple, int] = {}
        """Requests waiting for each compile in ``_compiling`` (a compile none waits for any more is cancelled
        before it starts)."""
        self._lock = threading.RLock()  # (a future cancelled under it runs ``_done``, which takes it too)
        self._cache_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Compiled] = OrderedDict()
        """Compiled constraints by key, least recently used first, their serialized sizes within CACHE_BYTES."""
        self._cache_bytes = 0
        self._next_id = 0
        self.requests: dict[str, Compiled] = {}
        """Each live structured request's grammar."""
        self._slot_grammar: dict[int, int] = {}
        """The worker's constrained slots and their grammar ids (``for_step``'s account)."""
        self._worker_refs: dict[int, int] = {}
        """Grammar ids the worker holds and how many of its slots use each."""
        self._worker_idle: OrderedDict[int, None] = OrderedDict()
        """Grammar ids the worker holds that no slot uses, least recently used first."""
        self._sizes: dict[int, int] = {}
        """The serialized bytes of each grammar the worker holds."""
        self._ahead: dict[int, Compiled] = {}
        """Grammars to send ahead with the next step (``send_ahead``)."""
        self._reading: set[int] = set()
        """Grammars sent ahead that the worker has not said it read (each holds a reference until then)."""
        self._resend: set[int] = set()
        """Grammar ids sent with a step that failed: the worker may not have read them, so the next use sends them
        again (they stay in the account above, so that they are dropped as any other)."""

    # -- the backend ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Import xgrammar and build the tokenizer's vocabulary table (a second or two: the engine calls this while
        its worker loads; the compile processes start later, ``start_compilers``); a no-op without a tokenizer or
        when done."""
        if self.tokenizer is None:
            return
        with self._init_lock:
            if self._pool is not None:
                return
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            try:
                self.misread = vocabulary_misread(info.decoded_vocab, self.tokenizer, info.special_token_ids)
            except Exception:  # (a check that fails to run says nothing: serve, and say it could not check)
                log.exception("structured outputs: the check of xgrammar's vocabulary table failed to run")
            if self.misread is not None:
                log.error("%s", self.misread)
            self.tokenizer_info_json = info.serialize_json()
            if self.in_processes:
                self._all_processes = [CompileProcess(self.tokenizer_info_json, xgrammar_threads(),
                                                      grammar_process.COMPILE_MEMORY_BYTES)
                                       for _ in range(COMPILE_WORKERS)]
            else:
                here = CompileInThread(info, xgrammar_threads())  # (thread-safe: one for all)
                for _ in range(COMPILE_WORKERS):
                    self._processes.put(here)
                self._ready_at = time.monotonic()
            self._pool = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="twogrid-grammar")

    def start_compilers(self) -> None:
        """Start the compile processes in the background (the fork server imports xgrammar, torch and transformers:
        seconds of CPU, which the serving engine spends once it is ready rather than beside its worker's load); a
        constraint that arrives meanwhile waits for them before its compile timeout starts (``_deadline``). A no-op
        without them or when started."""
        with self._init_lock:
            if not self._all_processes or self._compilers_started:
                return
            self._compilers_started = True
        threading.Thread(target=self._start_processes, name="twogrid-grammar-start", daemon=True).start()

    def _start_processes(self) -> None:
        try:
            for process in self._all_processes:
                if self._closed:
                    return
                try:
                    process.start(time.monotonic() + STARTUP_TIMEOUT_S)
                except CompileTimeout:  # (its first compile starts it again)
                    log.warning("a grammar compile process did not start within %.0f s", STARTUP_TIMEOUT_S)
                except CompileFailed as exc:  # (likewise; logged by the process's start)
                    log.warning("a grammar compile process did not start: %s", exc)
        finally:  # (whatever happened, the slots are there: a compile starts its process again, or says why not)
            self._ready_at = time.monotonic()
            self._ready.set()
            for process in self._all_processes:
                self._processes.put(process)

    def _deadline(self, submitted: float) -> float:
        """When a compile submitted at ``submitted`` is refused: the compile timeout after it, or after the compile
        processes were ready where they were not yet (waiting for them at most STARTUP_TIMEOUT_S)."""
        if self._ready_at is None:
            self._ready.wait(STARTUP_TIMEOUT_S)
        return max(submitted, self._ready_at or submitted) + self.timeout_s

    def _wait_s(self) -> float:
        """How long a request waits for its compile's future (whose own deadline refuses it on time)."""
        return self.timeout_s + (0.0 if self._ready_at is not None else STARTUP_TIMEOUT_S)

    def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for process in self._all_processes:
            process.close()

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
        if self.misread is not None:
            raise RequestError(f"{params.where}: {self.misread}")
        compiled = self._from_cache(params.key)
        if compiled is not None:  # (at once: no wait for a pool thread that others' compiles may hold)
            done: Future = Future()
            done.set_result(compiled)
            return done
        with self._lock:
            fut = self._compiling.get(params.key)
            created = fut is None
            if created:
                fut = self._compiling[params.key] = self._pool.submit(self._compile, params, time.monotonic())
            self._waiters[params.key] = self._waiters.get(params.key, 0) + 1
        if created:  # (outside the lock: a compile done already runs its callback here, and that takes the lock)
            fut.add_done_callback(lambda _, key=params.key: self._done(key))
        return fut

    def _done(self, key: tuple) -> None:
        with self._lock:
            self._compiling.pop(key, None)
            self._waiters.pop(key, None)

    def _stop_waiting(self, params: StructuredOutputsParams, fut: Future) -> None:
        """A request stopped waiting for ``fut`` (refused at the timeout): when no other request waits for it, a
        compile that has not started yet is cancelled, so that refused requests do not hold the pool's threads
        (one that runs goes on, and its grammar reaches the cache)."""
        with self._lock:
            left = self._waiters.get(params.key, 0) - 1
            if left > 0:
                self._waiters[params.key] = left
                return
            self._waiters.pop(params.key, None)
            if self._compiling.get(params.key) is fut:
                fut.cancel()

    def _from_cache(self, key: tuple) -> Compiled | None:
        with self._cache_lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def _compile(self, params: StructuredOutputsParams, submitted: float) -> Compiled:
        compiled = self._from_cache(params.key)
        if compiled is not None:
            return compiled
        self.start_compilers()  # (the serving engine's start did; the offline one, and tests, start them here)
        deadline = self._deadline(submitted)
        try:  # (a compile process, once one is free: all may be busy, or still starting)
            process = self._processes.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise CompileTimeout() from None
        try:
            serialized = process.compile(params.kind, getattr(params, params.kind), not params.disable_any_whitespace,
                                         deadline)
        finally:
            self._processes.put(process)
        with self._cache_lock:
            compiled = Compiled(self._next_id, serialized)
            self._next_id += 1
            self._cache[params.key] = compiled
            self._cache_bytes += len(serialized)
            while self._cache_bytes > CACHE_BYTES and len(self._cache) > 1:
                self._cache_bytes -= len(self._cache.popitem(last=False)[1].serialized)
        return compiled

    def result(self, params: StructuredOutputsParams, fut: Future):
        """A finished compile's grammar; RequestError naming the field when it failed."""
        try:
            return fut.result()
        except CompileTimeout:
            raise self._timeout(params) from None
        except CompileFailed as exc:  # xgrammar's message, or the limit the compile hit (or why no process ran)
            raise RequestError(f"{self._field(params)} does not compile: {_SOURCE_PREFIX.sub('', str(exc))}") from None
        except Exception as exc:  # (anything else: the request still gets its answer, a 400 saying what)
            log.exception("a %s grammar's compile failed", params.kind)
            raise RequestError(f"{self._field(params)} could not be compiled: {type(exc).__name__}: {exc}") from None

    @staticmethod
    def _field(params: StructuredOutputsParams) -> str:
        return params.where if params.where != "structured_outputs" else f"structured_outputs.{params.kind}"

    def compile(self, params: StructuredOutputsParams):
        """Compile now (the offline engine), waiting up to the timeout."""
        fut = self.compile_future(params)
        try:
            fut.result(timeout=self._wait_s())
        except FutureTimeout:
            self._stop_waiting(params, fut)
            raise self._timeout(params) from None
        except Exception:
            pass
        return self.result(params, fut)

    async def compile_async(self, params: StructuredOutputsParams):
        """Compile without blocking the event loop (the serving engine), waiting up to the timeout."""
        fut = self.compile_future(params)
        waiting = asyncio.wrap_future(fut)
        waiting.add_done_callback(_retrieve)  # (its error is read from ``fut``; asyncio must not report it)
        done, _ = await asyncio.wait([waiting], timeout=self._wait_s())
        if not done:
            self._stop_waiting(params, fut)
            raise self._timeout(params)
        return self.result(params, fut)

    def _timeout(self, params: StructuredOutputsParams) -> RequestError:
        log.warning("a %s grammar did not compile within %g s: refused", params.kind, self.timeout_s)
        return RequestError(f"{params.where}: the grammar did not compile within {self.timeout_s:g} s (the server's "
                            f"limit for one constraint, compile_timeout_s of --structured-outputs-config); simplify it")

    # -- requests, and what the worker holds ---------------------------------------------------------------------
    def add(self, request_id: str, compiled: Compiled) -> None:
        self.requests[request_id] = compiled

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def worker_has(self, compiled: Compiled) -> bool:
        """Whether the worker holds ``compiled`` read (or will, from the step before its request's: nothing is
        read ahead then)."""
        gid = compiled.grammar_id
        held = gid in self._worker_refs or gid in self._worker_idle
        return held and gid not in self._resend and gid not in self._reading

    def awaiting(self, grammar_id: int) -> bool:
        """Whether ``grammar_id`` is sent ahead and not known to be read yet (its requests wait in the engine)."""
        return grammar_id in self._ahead or grammar_id in self._reading

    def send_ahead(self, compiled: Compiled) -> None:
        """Send ``compiled`` with the next step, before any request uses it (``ready`` says when it is read)."""
        if compiled.grammar_id not in self._reading:
            self._ahead[compiled.grammar_id] = compiled

    def ready(self, grammar_id: int) -> None:
        """The worker read a grammar sent ahead (``StepResult.grammars_ready``), or its requests go without waiting
        for that (nothing else runs, or the step that carried it failed): one sent from now on goes with the step
        that admits its request."""
        if self._ahead.pop(grammar_id, None) is None and grammar_id in self._reading:
            self._reading.discard(grammar_id)
            self._release_ref(grammar_id)

    def _take_ref(self, grammar_id: int) -> None:
        self._worker_idle.pop(grammar_id, None)
        self._worker_refs[grammar_id] = self._worker_refs.get(grammar_id, 0) + 1

    def _release_ref(self, grammar_id: int) -> None:
        self._worker_refs[grammar_id] -= 1
        if not self._worker_refs[grammar_id]:
            del self._worker_refs[grammar_id]
            self._worker_idle[grammar_id] = None

    def _define(self, compiled: Compiled) -> GrammarDef:
        """``compiled``'s definition for the worker (the tokenizer's table with the very first)."""
        self._sizes[compiled.grammar_id] = len(compiled.serialized)
        self._resend.discard(compiled.grammar_id)
        info = "" if self._info_sent else self.tokenizer_info_json
        self._info_sent = True  # (the worker keeps the first)
        return GrammarDef(compiled.grammar_id, compiled.serialized, info)

    def step_failed(self, message) -> None:
        """A step the worker failed (``Step`` ``message``): the grammars it defined (and the tokenizer's table) are
        sent again with their next use, as the worker may have failed before it read them. The account of slots
        and idle grammars stays: the failed requests' slots come back freed, and the worker drops what it got."""
        self._resend.update(d.grammar_id for d in message.grammars)
        if any(d.tokenizer_info for d in message.grammars):
            self._info_sent = False

    def for_step(self, out) -> tuple[list[int], list[GrammarDef], bytes]:
        """A step's structured-output fields (``SchedulerOutput`` ``out``): each new request's grammar id (-1: none),
        the grammars the worker gets first with this step, and the ids it drops. Freed slots release their
        grammars first, as the worker forgets them first."""
        if not self._slot_grammar and not self.requests:
            return [-1] * len(out.new_requests), [], b""
        for slot in list(out.freed_slots):
            gid = self._slot_grammar.pop(slot, None)
            if gid is not None:
                self._release_ref(gid)
        first = len(out.slots) - len(out.new_requests)
        ids, defs = [], []
        used = {c.grammar_id for c in map(self.requests.get, (r.request_id for r in out.new_requests)) if c}
        for gid in used & self._ahead.keys():  # (a request of this step uses it: it goes in line, read in the step)
            del self._ahead[gid]
        for gid, compiled in self._ahead.items():
            defs.append(self._define(compiled))
            self._take_ref(gid)  # (held while it is read)
            self._reading.add(gid)
        self._ahead.clear()
        for req, slot in zip(out.new_requests, out.slots[first:].tolist()):
            compiled = self.requests.get(req.request_id)
            if compiled is None:
                ids.append(-1)
                continue
            gid = compiled.grammar_id
            if (gid not in self._worker_refs and gid not in self._worker_idle) or gid in self._resend:
                defs.append(self._define(compiled))
            self._take_ref(gid)
            self._slot_grammar[slot] = gid
            ids.append(gid)
        for gid in used & self._reading:  # (the worker takes it read, waiting for it if it must: no notice comes)
            self.ready(gid)
        drops = []
        while self._worker_idle and (len(self._worker_idle) > WORKER_IDLE_GRAMMARS
                                     or sum(self._sizes.get(g, 0) for g in self._worker_idle) > WORKER_IDLE_BYTES):
            gid = self._worker_idle.popitem(last=False)[0]
            self._sizes.pop(gid, None)
            drops.append(gid)
        return ids, defs, pack(drops) if drops else b""

