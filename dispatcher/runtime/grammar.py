"""Structured outputs on the worker: each constrained request's xgrammar matcher, advanced by the tokens this
worker sampled, and each constrained step's token bitmask, filled while the step's forward runs on the device.

The engine compiles grammars (off its step loop, ``dispatcher.engine.structured``) and sends each once
(``Step.grammars``, xgrammar's serialized form); a request admitted with ``NewRequest.grammar_id`` gets a matcher
here, which first accepts the request's output so far (a preempted request comes back with it). The worker knows
a request's next token before the engine does, so nothing crosses a process boundary between a step's sampling and
the next step's mask: a constrained step launches its forward, then reads the previous step's tokens (a small copy
queued after that step's sampling, ``note_sampled``), advances the matchers, fills the mask (xgrammar's
multi-threaded batch fill) and uploads it before the sampling. SGLang keeps its grammars beside the model runner
the same way; vLLM's engine core fills the mask in the process that runs the model when it has one worker.

A matcher belongs to a slot and a generation: a token sampled for a slot whose request left or was set up again
(preempted, then admitted with its output so far) after the step that sampled it is never accepted.

Reading a grammar (xgrammar's ``deserialize_json``) takes time: 19 ms for a 0.36 MB JSON schema on a 2-core machine,
seconds for a hostile one within the limits. A grammar that no request of its step uses is one the engine sent
ahead (its requests wait in the engine meanwhile): it is read in a thread of its own (xgrammar releases the GIL), and
the step results say which have been read (``StepResult.grammars_ready``), so that no step waits for one.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from dispatcher.messages import GrammarDef, Step, bitmask_words, unpack, xgrammar_threads

log = logging.getLogger("twogrid.worker")

LOG_EVERY_STEPS = 2000
"""Constrained steps between two log lines of the host's grammar time."""


FILL_THREADS_ENV = "TWOGRID_GRAMMAR_FILL_THREADS"
"""Threads of one bitmask fill, when set (by default measured: ``WorkerGrammars.fill``)."""
TRIAL_FILLS = 32
"""Fills timed with each thread count before the faster one is kept."""
TRIAL_MIN_ROWS = 32
"""Fills of fewer live rows are not timed (nor are they where the choice matters)."""


_xgrammar_import: threading.Thread | None = None


def import_xgrammar_in_background() -> None:
    """Start importing xgrammar in a daemon thread, once a process, so that start-up does not wait for it in the
    kernels' warm-up: its import (transformers' with it: 1-3 s on a GPU machine's host) runs beside the worker's
    loading, and where it outlasts it, under delayed capture, beside the first steps. The warm-up of its bitmask
    kernel waits for it (``xgrammar_imported``), and a constrained step's ``import xgrammar`` before then waits for
    the thread's (Python's import lock). An import that fails is left to the one where xgrammar is used, which
    reports it.
    Both threads need the GIL, so beside the loading the import mostly takes turns with it (the weights' phase grew
    from 0.5 s to 1.6 s on an H100's host). Started once the worker serves instead (27d373e, reverted), it overlapped
    GPU work and gave the first token 0.3-0.5 s sooner, but the first steps shared the GIL with it: an eager decode
    of one request took 63-72 ms against 11 ms, where a step must not wait more than a few ms for start-up's work."""
    global _xgrammar_import
    if _xgrammar_import is None:
        _xgrammar_import = threading.Thread(target=_import_quietly, args=("xgrammar",), name="import xgrammar",
                                            daemon=True)
        _xgrammar_import.start()


def _import_quietly(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception:  # (raised again where the module is used, and reported there: ModelWorker.warm_up_grammar)
        pass


def xgrammar_imported() -> bool:
    """Whether xgrammar's background import has ended (or none was started)."""
    return _xgrammar_import is None or not _xgrammar_import.is_alive()


def fill_thread_counts() -> tuple[int, ...]:
    """The thread counts a bitmask fill may use: ``$TWOGRID_GRAMMAR_FILL_THREADS``'s, else one thread and
    xgrammar's pool (``xgrammar_threads``), between which the worker measures (on a busy host the pool can be the
    slower: 1.83 ms for 248 rows on the H200's serving host, where one thread filled 256 in 0.5-0.7 ms on an idle
    2-core machine)."""
    value = os.environ.get(FILL_THREADS_ENV, "")
    if not value:
        return tuple(sorted({1, xgrammar_threads()}))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"${FILL_THREADS_ENV}: {value!r} is not a thread count (an integer >= 1)")
    return (int(value),)


@dataclass
class _Sampled:
    """One step's sampled tokens on their way to the host: the slots, each slot's matcher generation then, the
    tokens' host copy and the event after it (None on the CPU)."""

    slots: np.ndarray
    generations: np.ndarray
    host: torch.Tensor
    event: object


class WorkerGrammars:
    """The worker's matchers, by slot (``num_slots`` of them). ``vocab_size``: the model's (a bitmask row's width)."""

    def __init__(self, vocab_size: int, device: torch.device, num_slots: int):
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.device = device
        self.compiled: dict[int, object] = {}
        """The engine's grammars by id (``GrammarDef``)."""
        self._reading: dict[int, Future] = {}
        """Grammars sent ahead, being read in ``_reader``'s thread, by id."""
        self._reader: ThreadPoolExecutor | None = None
        self.matchers: list = [None] * num_slots
        """Each slot's matcher (None: unconstrained)."""
        self.generation = np.full(num_slots, -1, np.int64)
        """Each slot's matcher's generation (-1: none): a token noted under another generation is not its."""
        self.terminated = np.zeros(num_slots, bool)
        """Each slot's matcher took a stop token (kept here: asking xgrammar costs a call a request a step)."""
        self._stops: frozenset[int] = frozenset()
        """The tokenizer's stop tokens (a matcher terminates by taking one)."""
        self._generation = 0
        self._sampled: deque[_Sampled] = deque()
        self._xgr = None
        self._info = None
        self._batches: dict[int, object] = {}
        """xgrammar's batch matcher by thread count (``fill_thread_counts``)."""
        self._fill_s: dict[int, list[float]] = {}
        """While no count is chosen: each timed fill's seconds a row, by thread count."""
        self.fill_threads: int | None = None
        """The thread count chosen (None while the counts are timed)."""
        self._timing = np.zeros(5)
        """Since the last log line: steps, rows, seconds waiting for the step before, advancing, filling."""
        self.before_fill = None
        """The worker process's wait for the results of the steps before to be sent (``_InFlight.wait_sent``):
        the fill holds the GIL, which the result thread needs; None in-process."""

    # -- what a step changes ---------------------------------------------------------------------------------
    def admit(self, step: Step) -> None:
        """A step's changes before it runs: grammars defined and dropped, freed slots' matchers gone, each admitted
        constrained request's matcher set up."""
        used = {r.grammar_id for r in step.new_requests}
        for d in step.grammars:
            if d.grammar_id in used:
                self.define(d)
            else:
                self.define_ahead(d)
        if step.dropped_grammars:
            for gid in unpack(step.dropped_grammars).tolist():
                self.compiled.pop(gid, None)
                reading = self._reading.pop(gid, None)
                if reading is not None:
                    reading.cancel()
        if step.freed_slots:
            for slot in unpack(step.freed_slots).tolist():
                self.forget(slot)
        for r in step.new_requests:
            self.forget(r.slot)
            if r.grammar_id >= 0:
                self.start(r.slot, r.grammar_id, unpack(r.token_ids)[r.num_prompt_tokens:].tolist())

    def define(self, d: GrammarDef) -> None:
        """Read a grammar now (a request of this step uses it)."""
        xgr = self._with_info(d)
        self._reading.pop(d.grammar_id, None)
        self.compiled[d.grammar_id] = xgr.CompiledGrammar.deserialize_json(d.compiled, self._info)

    def define_ahead(self, d: GrammarDef) -> None:
        """Read a grammar in the reader's thread (no request of this step uses it: the engine sent it ahead)."""
        xgr = self._with_info(d)
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="twogrid-grammar-read")
        self.compiled.pop(d.grammar_id, None)
        self._reading[d.grammar_id] = self._reader.submit(xgr.CompiledGrammar.deserialize_json, d.compiled,
                                                          self._info)

    def _with_info(self, d: GrammarDef):
        xgr = self.backend()
        if d.tokenizer_info:
            self._info = xgr.TokenizerInfo.deserialize_json(d.tokenizer_info)
            self._stops = frozenset(self._info.stop_token_ids)
        if self._info is None:
            raise RuntimeError(f"grammar {d.grammar_id} came before the tokenizer's information")
        return xgr

    @property
    def reading(self) -> bool:
        return bool(self._reading)

    def ready(self) -> list[int]:
        """The grammars sent ahead that have been read since the last call (for ``StepResult.grammars_ready``)."""
        done = [gid for gid, fut in self._reading.items() if fut.done()]
        for gid in done:
            self._take_read(gid)
        return done

    def _take_read(self, grammar_id: int) -> None:
        """A grammar sent ahead, into ``compiled`` (waiting for its reading if it is not done)."""
        fut = self._reading.pop(grammar_id)
        try:
            self.compiled[grammar_id] = fut.result()
        except Exception as exc:  # (the request that uses it fails its step: "never defined")
            log.error("grammar %d could not be read: %s", grammar_id, exc)

    def start(self, slot: int, grammar_id: int, output_ids: list[int]) -> None:
        """A matcher for the request at ``slot``, past its output so far."""
        if grammar_id in self._reading:  # (a request the engine admitted before it heard the grammar was read)
            self._take_read(grammar_id)
        compiled = self.compiled.get(grammar_id)
        if compiled is None:
            raise RuntimeError(f"slot {slot}: grammar {grammar_id} was never defined (or was dropped)")
        matcher = self._xgr.GrammarMatcher(compiled)
        for t in output_ids:
            if matcher.is_terminated() or not matcher.accept_token(t):
                break
        self._generation += 1
        self.matchers[slot] = matcher
        self.generation[slot] = self._generation
        self.terminated[slot] = matcher.is_terminated()

    def forget(self, slot: int) -> None:
        self.matchers[slot] = None
        self.generation[slot] = -1

    # -- tokens and masks ------------------------------------------------------------------------------------
    def note_sampled(self, slots: np.ndarray, tokens: torch.Tensor) -> None:
        """A step's sampled tokens (``tokens[i]`` for ``slots[i]``, on the device, queued already): copied to the
        host behind the step, and accepted by their matchers when the next mask is filled."""
        gens = self.generation[slots]
        if not (gens >= 0).any():
            return
        cuda = tokens.device.type == "cuda"
        host = torch.empty(len(gens), dtype=torch.int32, pin_memory=cuda)
        host.copy_(tokens.to(torch.int32), non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self._sampled.append(_Sampled(np.asarray(slots, np.int64), gens, host, event))

    def _catch_up(self) -> float:
        """Every noted step's tokens accepted, oldest first (each waits for its copy: the step that sampled them
        done); the seconds spent waiting for those copies."""
        waited = 0.0
        while self._sampled:
            s = self._sampled.popleft()
            if s.event is not None:
                t0 = time.perf_counter()
                s.event.synchronize()
                waited += time.perf_counter() - t0
            taking = np.nonzero((s.generations >= 0) & (self.generation[s.slots] == s.generations)
                                & ~self.terminated[s.slots])[0]
            if not len(taking):
                continue
            slots, tokens = s.slots[taking].tolist(), s.host.numpy()[taking].tolist()
            ok = self._xgr.BatchGrammarMatcher.batch_accept_token([self.matchers[i] for i in slots], tokens)
            for slot, t, accepted in zip(slots, tokens, ok):
                if not accepted:  # (the mask forbade it: a defect; the request goes on unconstrained)
                    log.error("slot %d: token %d is outside its grammar; the request runs on unconstrained", slot, t)
                    self.forget(slot)
                elif t in self._stops:
                    self.terminated[slot] = True
        return waited

    def fill(self, slots: np.ndarray, out: torch.Tensor) -> None:
        """``out`` (at least len(slots) rows, words) int32 on the host: row i the allowed next tokens of
        ``slots[i]``, after the tokens sampled so far; every bit set in the rows of slots without a live matcher
        and in the rows past them (a fused step's padding)."""
        t0 = time.perf_counter()
        if self.before_fill is not None:
            self.before_fill()
        waited = time.perf_counter() - t0
        waited += self._catch_up()
        t1 = time.perf_counter()
        out.numpy().fill(-1)  # (numpy's: torch's would wake its OpenMP threads, whose spinning slows xgrammar's)
        rows = np.nonzero((self.generation[slots] >= 0) & ~self.terminated[slots])[0]
        if len(rows):
            self._fill([self.matchers[i] for i in slots[rows].tolist()], out, rows.tolist())
        self._note(len(slots), waited, t1 - t0 - waited, time.perf_counter() - t1)

    def _fill(self, live: list, out: torch.Tensor, rows: list[int]) -> None:
        """xgrammar's batch fill with the chosen thread count; until one is chosen, fills of TRIAL_MIN_ROWS rows or
        more take turns between the counts and are timed (the mask is the same whichever fills it), and after
        TRIAL_FILLS of each the faster a row is kept."""
        timed = self.fill_threads is None and len(live) >= TRIAL_MIN_ROWS
        if not timed:
            threads = self.fill_threads or max(self._batches)
        else:
            threads = min(self._fill_s, key=lambda c: len(self._fill_s[c]))
        t0 = time.perf_counter()
        self._batches[threads].batch_fill_next_token_bitmask(live, out, rows)
        if timed:
            self._fill_s[threads].append((time.perf_counter() - t0) / len(live))
            if all(len(v) >= TRIAL_FILLS for v in self._fill_s.values()):
                self._choose()

    def _choose(self) -> None:
        per_row = {c: float(np.median(v)) for c, v in self._fill_s.items()}
        self.fill_threads = min(per_row, key=per_row.get)
        self._batches = {self.fill_threads: self._batches[self.fill_threads]}
        log.info("structured outputs: the bitmask fills with %d thread(s) (measured, microseconds a row: %s)",
                 self.fill_threads, ", ".join(f"{c} thread(s) {1e6 * t:.2f}" for c, t in sorted(per_row.items())))

    def _note(self, rows: int, wait_s: float, advance_s: float, fill_s: float) -> None:
        self._timing += (1, rows, wait_s, advance_s, fill_s)
        steps, total, waited, advanced, filled = self._timing
        if steps >= LOG_EVERY_STEPS:
            log.info("structured outputs: %d constrained steps, %.0f rows a step, a step's host time while its "
                     "forward runs: waiting for the step before %.2f ms (its result sent, its tokens copied), "
                     "matchers advanced %.2f ms, bitmask filled %.2f ms", steps, total / steps,
                     1e3 * waited / steps, 1e3 * advanced / steps, 1e3 * filled / steps)
            self._timing[:] = 0

    def backend(self, xgr=None):
        """xgrammar, imported at the first grammar (``xgr``: a stand-in with its API, for tests)."""
        if self._xgr is None:
            if xgr is None:
                import xgrammar as xgr
            counts = fill_thread_counts()
            self._batches = {c: xgr.BatchGrammarMatcher(c) for c in counts}
            self._fill_s = {c: [] for c in counts}
            self.fill_threads = counts[0] if len(counts) == 1 else None
            self._xgr = xgr
        return self._xgr


def unpack_bitmask(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """The allowed tokens of packed bitmask rows (int32 (rows, words)), as bool (rows, vocab_size) (tests, checks)."""
    words = np.ascontiguousarray(bits, np.int32).reshape(len(bits), -1)
    table = (words[:, :, None].view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    return table.reshape(len(words), -1)[:, :vocab_size].astype(bool)
