"""A grammar compile in a process of its own: killed at its deadline, and held to a memory limit, so that a hostile
constraint within the static limits (``scheduler.structured``) costs the engine at most the compile timeout and
``COMPILE_MEMORY_BYTES``, never its memory or a compile slot for good.

xgrammar cannot interrupt a compile, and its compiled grammars grow with some constraints' size squared (a JSON
schema's properties, an EBNF grammar's chained rules): compiled in the engine's threads, one hostile schema under
every limit once ran the engine out of memory, and a slow one held its thread after its request was refused. So
each compile slot owns a process (``CompileProcess``), forked from multiprocessing's fork server with xgrammar
imported there once (``start_fork_server``), which holds the tokenizer's table and compiles one constraint at a
time under ``RLIMIT_AS``; a compile past its deadline has its process killed, and the next compile starts another.
vLLM and SGLang compile in threads of the engine and cannot stop a compile.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import resource
import signal
import threading
import time

log = logging.getLogger("twogrid.structured")

COMPILE_NICENESS = 10
"""Added to a compile process's niceness, which also runs under Linux's SCHED_IDLE: where the cores are few, a slow
compile (up to its timeout) takes only the CPU time the engine, its worker and the front ends leave. On the CI
machine's 2 cores, the default model serving one stream, a 10 s compile at equal priority held the stream's chunks
to a median gap of 0.21-0.30 s (16 ms alone); niced alone, still 0.30 s (the CPU worker's two threads wait on each
other at every barrier while either shares its core); SCHED_IDLE as well: 0.028 s. The price: where serving keeps
every core busy (the CPU backend under load), a compile gets little of them and may reach its timeout (a 400
naming ``compile_timeout_s``) where at equal priority it would have finished, slowing every stream meanwhile."""
COMPILE_MEMORY_BYTES = 2 << 30
"""The address space a compile process may add to what it had mapped at its start (a grammar within the static
limits compiles in tens of MB; the schema that once took the engine down needed 18 GB). Its compile threads' stacks
and malloc arenas count too: about 0.5 GiB with 8 threads, 12 MiB with one; a process starts afresh after a kill,
or after it has grown by RETIRE_FRACTION of this."""

_PRELOAD = ["xgrammar"]


class CompileTimeout(Exception):
    """The compile ran past its deadline; its process was killed."""


class CompileFailed(Exception):
    """The constraint does not compile (xgrammar's message, or the limit it hit)."""


def compile_grammar(compiler, kind: str, value, any_whitespace: bool):
    """xgrammar's CompiledGrammar for a constraint of ``kind`` (``StructuredOutputsParams.kind``) and ``value``."""
    if kind == "json":
        return compiler.compile_json_schema(value, any_whitespace=any_whitespace, strict_mode=True)
    if kind == "json_object":  # (OpenAI's JSON mode: an object; xgrammar's builtin JSON grammar allows an array too)
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in value))
    if kind == "grammar":
        return compiler.compile_grammar(value)
    return compiler.compile_structural_tag(value)


def _address_space_bytes() -> int | None:
    """This process's mapped address space (Linux's VmSize; None elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) << 10
    except (OSError, StopIteration):
        return None


def _limit_address_space(base: int | None, memory_bytes: int) -> None:
    """This process may map ``memory_bytes`` more than ``base`` (no limit where that is unknown), within the hard
    limit."""
    if base is None:
        return
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    soft = base + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


RETIRE_FRACTION = 0.5
"""A compile process whose address space has grown past this share of its limit (memory its compiles left mapped,
which would leave the next one less room) answers, then exits; the next compile starts a fresh one."""


def _serve(conn, tokenizer_info_json: str, threads: int, memory_bytes: int, retire_bytes: int) -> None:
    """The compile process: each job ``(kind, value, any_whitespace)`` acknowledged (``("taken", None, False)``),
    then answered ``("ok", serialized, retiring)`` or ``("error", message, retiring)``, until the engine's end of
    the pipe closes or its address space has grown by ``retire_bytes`` or more (it answers, then exits)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the engine decides when it stops)
    try:  # (before xgrammar starts its threads: they inherit both; a sandbox that forbids either changes nothing)
        os.nice(COMPILE_NICENESS)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        pass
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json), max_threads=threads,
                                   cache_enabled=False)  # (the engine caches the serialized grammars)
    base = _address_space_bytes()
    _limit_address_space(base, memory_bytes)
    conn.send(("ready", None, False))
    while True:
        try:
            kind, value, any_whitespace = conn.recv()
            conn.send(("taken", None, False))
        except (EOFError, OSError):
            return
        try:
            status, payload = "ok", compile_grammar(compiler, kind, value, any_whitespace).serialize_json()
        except Exception as exc:  # xgrammar's errors: the constraint's fault
            status, payload = "error", _message(exc, memory_bytes)
        grown = (_address_space_bytes() or 0) - (base or 0)
        retiring = base is not None and grown >= retire_bytes
        conn.send((status, payload, retiring))
        if retiring:
            return


def _message(exc: Exception, memory_bytes: int | None = None) -> str:
    """What a failed compile says: xgrammar's last line, or the memory limit it ran into."""
    lines = str(exc).strip().splitlines()
    message = lines[-1] if lines else type(exc).__name__
    if memory_bytes is not None and (isinstance(exc, MemoryError) or "bad_alloc" in message):
        return f"compiling it needs more than {memory_bytes / (1 << 30):g} GiB of memory (the limit for one constraint)"
    return message


_fork_server_lock = threading.Lock()


def start_fork_server() -> None:
    """Start multiprocessing's fork server with xgrammar imported (a few seconds, once a process: the first compile
    process's start), so that every later compile process starts in milliseconds."""
    from multiprocessing import forkserver

    with _fork_server_lock:
        multiprocessing.set_forkserver_preload(_PRELOAD)
        forkserver.ensure_running()


class _NotTaken(Exception):
    """A compile process died before it took the job sent to it."""


class CompileProcess:
    """One compile at a time in a process of its own; the thread that calls ``compile`` owns it meanwhile."""

    def __init__(self, tokenizer_info_json: str, threads: int, memory_bytes: int = COMPILE_MEMORY_BYTES,
                 retire_bytes: int | None = None):
        """``retire_bytes``: the growth past which it exits after a compile (default RETIRE_FRACTION of the limit)."""
        retire = int(RETIRE_FRACTION * memory_bytes) if retire_bytes is None else retire_bytes
        self._args = (tokenizer_info_json, threads, memory_bytes, retire)
        self._process = None
        self._conn = None

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None else None

    def start(self, deadline: float) -> None:
        """Start the process; CompileTimeout when it is not ready by ``deadline``, CompileFailed when it cannot start
        (the fork server or the fork failed, or the process died starting)."""
        self.close()
        try:
            start_fork_server()
            ctx = multiprocessing.get_context("forkserver")
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(theirs, *self._args), name="twogrid-grammar", daemon=True)
            process.start()
        except Exception as exc:  # (an OSError from the fork server's socket or the fork, above all)
            log.error("a grammar compile process could not start: %s: %s", type(exc).__name__, exc)
            raise CompileFailed(f"no compile process could start ({type(exc).__name__}: {exc}); a server error, "
                                f"not the constraint's") from None
        theirs.close()
        self._process, self._conn = process, ours
        self._answer(deadline, starting=True)  # ("ready")

    def compile(self, kind: str, value, any_whitespace: bool, deadline: float) -> str:
        """The constraint's grammar, serialized; CompileTimeout at ``deadline`` (``time.monotonic()``), CompileFailed
        when it does not compile, its process dead or out of its memory."""
        if time.monotonic() >= deadline:  # (it waited for a process past its time: nothing to kill)
            raise CompileTimeout()
        for attempt in range(2):  # (a process found dead before it took the job is no verdict on the constraint)
            if self._process is None or not self._process.is_alive():
                self.start(deadline)
            try:
                self._conn.send((kind, value, any_whitespace))
                self._answer(deadline, taking=True)
                break
            except (OSError, AttributeError, _NotTaken):  # (it died while idle, or was closed)
                self.close()
                if attempt:
                    raise CompileFailed("two compile processes in a row died before taking it; a server error, not "
                                        "the constraint's") from None
        status, payload, retiring = self._answer(deadline)
        if retiring:  # (it exits: the next compile starts another)
            self.close()
        if status != "ok":
            raise CompileFailed(payload)
        return payload

    def _answer(self, deadline: float, starting: bool = False, taking: bool = False):
        """The process's next message by ``deadline``: its readiness (``starting``), its taking of a job
        (``taking``: _NotTaken if it is dead by then), or a job's answer."""
        process, conn = self._process, self._conn
        if process is None or conn is None:  # (closed meanwhile: the engine is stopping)
            raise CompileFailed("the compile process was stopped")
        try:
            ready = conn.poll(max(0.0, deadline - time.monotonic()))
            if ready:
                return conn.recv()
        except (EOFError, OSError):
            if taking:
                raise _NotTaken() from None
            process.join(1)
            code = process.exitcode
            self.close()
            if starting:
                raise CompileFailed(f"the compile process died starting ({_exit_reason(code)}); a server error, not "
                                    f"the constraint's") from None
            raise CompileFailed(f"its compile process died ({_exit_reason(code)}); the constraint may need more "
                                f"memory than the limit for one constraint") from None
        self.close()
        raise CompileTimeout()

    def close(self) -> None:
        """Kill the process (a no-op when there is none)."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if process is not None:
            try:
                process.kill()
                process.join(5)
                process.close()
            except (ValueError, OSError, AttributeError):  # (not started, still running after the kill: the
                pass  # daemon flag ends it with this process)
        if conn is not None:
            conn.close()


class CompileInThread:
    """The same calls, compiling in the calling thread, where it cannot be stopped or held to a limit: the offline
    engine's (its user's own constraints), whose script then need not guard its main module as a process's start
    would ask (multiprocessing imports it again in the new process)."""

    def __init__(self, tokenizer_info, threads: int):
        """``tokenizer_info``: xgrammar's TokenizerInfo."""
        import xgrammar as xgr

        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=threads, cache_enabled=False)

    def compile(self, kind: str, value, any_whitespace: bool, deadline: float) -> str:
        try:
            return compile_grammar(self._compiler, kind, value, any_whitespace).serialize_json()
        except Exception as exc:  # xgrammar's errors: the constraint's fault
            raise CompileFailed(_message(exc)) from None


def _exit_reason(code) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
