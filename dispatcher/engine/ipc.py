"""Child processes and their sockets: ``ChildProcess`` (the front end's engine process, the engine's worker) and
``WorkerProcess``, the worker.

A parent binds two ZeroMQ sockets in a directory only its user can enter (mode 0700, removed on close) and starts
``python -m MODULE DIR``. For the worker (``dispatcher.runtime.process``) it sends a ``WorkerInit`` and waits for
``WorkerReady``; steps go out on one socket, results come back on the other, as ``dispatcher.messages`` (msgpack;
nothing else is decoded, so nothing can be unpickled). ``RemoteWorker`` gives EngineCore the worker interface over
it (blocking sockets); the engine process (``dispatcher.engine.service``) uses asyncio sockets.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import zmq
import zmq.asyncio

from dispatcher.child import PARENT_PID_ENV
from dispatcher.engine.protocol import TO_CORE, TO_FRONT, Drain
from dispatcher.engine.protocol import encode as encode_to_core
from dispatcher.messages import (TO_ENGINE, TO_WORKER, TP_INIT_ENV, TP_RANK_ENV, CaptureProgress, Shutdown, Step,
                                 StepResult, WorkerError, WorkerInit, WorkerReady, decode_to_engine, encode)
from models.config import ModelConfig

log = logging.getLogger("twogrid.engine")


def bind_pair(ctx, ipc_dir: str, push_name: str, pull_name: str) -> tuple:
    """A PUSH and a PULL socket bound as ``ipc_dir/push_name`` and ``ipc_dir/pull_name``, neither with a high-water
    mark (a send never blocks or drops)."""
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.bind(f"ipc://{ipc_dir}/{push_name}")
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(f"ipc://{ipc_dir}/{pull_name}")
    return push, pull


class WorkerDied(RuntimeError):
    """The worker process exited or failed; the message says how."""


class ChildProcess:
    """A child process (``python -m MODULE DIR``) and two sockets bound in a private ipc directory (mode 0700,
    removed on close): ``to_child`` (PUSH) and ``from_child`` (PULL). The child leads a session of its own and
    exits once it finds this process gone (``dispatcher.child.parent_gone``, checked while it waits for a message).
    ``asyncio=True`` makes the sockets awaitable."""

    def __init__(self, module: str, to_child: str, from_child: str, asyncio: bool = False, env: dict | None = None,
                 parent_dir: str | None = None, argv: tuple[str, ...] = ()):
        # mode 0700: only this user can reach the sockets; inside ``parent_dir`` (the engine's worker, in the front
        # end's directory) it goes when that one does, even if this process is killed
        self.dir = tempfile.mkdtemp(prefix="twogrid-ipc-", dir=parent_dir)
        os.chmod(self.dir, 0o700)
        self.ctx = zmq.asyncio.Context() if asyncio else zmq.Context()
        self.to_child, self.from_child = bind_pair(self.ctx, self.dir, to_child, from_child)
        self.proc = subprocess.Popen([sys.executable, "-m", module, *argv, self.dir],
                                     env={**os.environ, PARENT_PID_ENV: str(os.getpid()), **(env or {})},
                                     start_new_session=True)
        self.stopping = False
        """``close`` or ``aclose`` was called: the process is being stopped on purpose."""
        self._closed = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def wait_exit(self, poll_s: float = 0.5) -> None:
        """Return when the process has exited, reaped (no zombie left): at once through a pidfd (Linux 5.3 and
        later; the event loop wakes when the process ends), else by polling every ``poll_s`` seconds."""
        try:
            pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):  # no pidfd here, or the process is gone (reaped) already
            while self.alive():
                await asyncio.sleep(poll_s)
            return
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            if self.alive():
                await exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        self.proc.wait()

    def exit_description(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "running"
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def close(self, goodbye: bytes | None = None, timeout_s: float = 10.0) -> None:
        """Send ``goodbye`` (the child's cue to exit; a child not connected yet gets it once it connects), wait
        ``timeout_s`` in all, SIGKILL its process group if it is still there, close the sockets, remove the
        directory."""
        if self._closed:
            return
        self._closed = self.stopping = True
        if self.alive():
            deadline = time.monotonic() + timeout_s
            while goodbye is not None and self.alive():  # (as ``aclose_with``: a child not connected yet gets it
                try:  # once it connects, not never)
                    self.to_child.send(goodbye, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.02)
                except zmq.ZMQError:
                    break
            try:
                self.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.to_child.close(linger=0)
        self.from_child.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)

    async def aclose_with(self, goodbye: bytes | None, timeout_s: float) -> None:
        """``close`` without blocking the event loop: send ``goodbye``, await the exit for up to ``timeout_s``. A
        child that has not connected yet gets ``goodbye`` once it does (a PUSH socket without a peer refuses it
        rather than queue it): a start-up that fails at once stops its engine at once, not after ``timeout_s``."""
        if self._closed:
            return
        self.stopping = True
        if self.alive():
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            exited = asyncio.ensure_future(self.wait_exit())
            while goodbye is not None and not exited.done():
                try:
                    await self.to_child.send(goodbye, zmq.NOBLOCK)
                    break
                except zmq.Again:  # (not connected yet)
                    if loop.time() >= deadline:
                        break
                    await asyncio.wait({exited}, timeout=0.02)
                except zmq.ZMQError:
                    break
            try:
                await asyncio.wait_for(exited, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                pass
        ChildProcess.close(self, None, 0.0)


def spawn_engine(log_level: str, num_ranks: int) -> ChildProcess:
    """Start the engine process (which starts its worker's ``num_ranks`` processes at once; 0: once its settings
    are in) before its settings are known: ``EngineClient.start`` sends them, ``stop_spawned_engine`` stops an
    engine that never got them."""
    return ChildProcess("dispatcher.engine.service", TO_CORE, TO_FRONT, asyncio=True,
                        env={"TWOGRID_LOG_LEVEL": log_level}, argv=(str(num_ranks),))


async def stop_spawned_engine(process: ChildProcess, timeout_s: float = 10.0) -> None:
    """Stop an engine process that got no init (the front end's start-up failed): it kills its worker, removes
    the worker's ipc directory and exits; this one's ipc directory goes too. SIGKILL after ``timeout_s``."""
    await process.aclose_with(encode_to_core(Drain()), timeout_s)


class WorkerProcess(ChildProcess):
    """One worker process (``dispatcher.runtime.process``): steps go out on ``to_worker``, results come back on
    ``to_engine``. Started without its ``init`` (``set_init`` later), it imports torch while its engine waits for
    the front end's settings."""

    def __init__(self, init: WorkerInit | None, asyncio: bool = False, env: dict | None = None,
                 parent_dir: str | None = None):
        super().__init__("dispatcher.runtime.process", TO_WORKER, TO_ENGINE, asyncio, env, parent_dir)
        self.init = init
        self.to_worker, self.to_engine = self.to_child, self.from_child
        self.ready: WorkerReady | None = None

    def set_init(self, init: WorkerInit) -> None:
        """The settings ``start`` sends, for a process started before they were known."""
        check_num_ranks(init, 1)
        self.init = init

    def start(self, timeout_s: float = 3600.0) -> WorkerReady:
        """Send the init and wait for the worker to load, size its KV cache and capture (blocking; not for asyncio)."""
        self.to_worker.send(encode(self.init))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.to_engine.poll(500):
                msg = decode_to_engine(self.to_engine.recv())
                if isinstance(msg, WorkerError):
                    raise WorkerDied(f"the worker failed to start: {msg.message}")
                if isinstance(msg, WorkerReady):
                    self.ready = msg
                    return msg
                raise WorkerDied(f"the worker sent {type(msg).__name__} before it was ready")
            if not self.alive():
                raise WorkerDied(f"the worker process {self.exit_description()} while starting")
        raise WorkerDied(f"the worker did not start within {timeout_s:.0f} s")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the worker (Shutdown, then SIGKILL after ``timeout_s``), close the sockets, remove the directory."""
        super().close(encode(Shutdown()), timeout_s)

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """``close`` for an event loop, which goes on (streams get their last events) while the worker finishes its
        step and exits."""
        await self.aclose_with(encode(Shutdown()), timeout_s)

    def kill(self) -> None:
        """SIGKILL the worker's process group at once (its engine is going away)."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)


def worker_processes(init: WorkerInit, asyncio: bool = False, env: dict | None = None,
                     parent_dir: str | None = None) -> "WorkerProcess | WorkerGroup":
    """The worker of ``init``: one process, or a tensor-parallel group of ``init.tensor_parallel_size``."""
    process = spawn_workers(init.tensor_parallel_size, asyncio, env, parent_dir)
    process.set_init(init)
    return process


def spawn_workers(num_ranks: int, asyncio: bool = False, env: dict | None = None,
                  parent_dir: str | None = None) -> "WorkerProcess | WorkerGroup":
    """A worker of ``num_ranks`` processes (a tensor-parallel group above 1), started before its ``WorkerInit`` is
    known (``set_init`` gives it; the processes import torch meanwhile)."""
    if num_ranks > 1:
        return WorkerGroup(None, asyncio, env, parent_dir, num_ranks)
    return WorkerProcess(None, asyncio, env, parent_dir)


def check_num_ranks(init: WorkerInit, num_ranks: int) -> None:
    """ValueError unless ``init`` asks for the ``num_ranks`` worker processes that were started."""
    if init.tensor_parallel_size != num_ranks:
        raise ValueError(f"the worker was started with {num_ranks} rank(s), its init asks for tensor_parallel_size "
                         f"{init.tensor_parallel_size}")


class _FanOut:
    """One send to every rank's PUSH socket (awaitable when they are)."""

    def __init__(self, sockets: list):
        self.sockets = sockets

    def send(self, frame: bytes, flags: int = 0):
        sent = [s.send(frame, flags) for s in self.sockets]
        return asyncio.gather(*sent) if sent and asyncio.isfuture(sent[0]) else None


class WorkerGroup:
    """A tensor-parallel worker: one ``WorkerProcess`` per rank, behind WorkerProcess's interface. Every message goes
    to every rank (one PUSH socket each: ZeroMQ's PUB would drop a frame for a rank that connects late or falls
    behind its high-water mark, and a rank that missed a step would wait forever in the next collective); results
    come from rank 0 only. The group is alive while every rank is; the first rank to exit ends it (the others are
    then killed: they would wait in a collective for the one gone). The ranks' torch.distributed rendezvous is a
    file in the group's private directory."""

    def __init__(self, init: WorkerInit | None, asyncio: bool = False, env: dict | None = None,
                 parent_dir: str | None = None, num_ranks: int | None = None):
        """``init``'s ranks, or ``num_ranks`` started before their init is known (``set_init``)."""
        self.dir = tempfile.mkdtemp(prefix="twogrid-tp-", dir=parent_dir)
        os.chmod(self.dir, 0o700)
        method = f"file://{os.path.join(self.dir, 'rendezvous')}"
        self.ranks: list[WorkerProcess] = []
        try:
            for rank in range(init.tensor_parallel_size if init is not None else num_ranks):
                rank_env = {**(env or {}), TP_RANK_ENV: str(rank), TP_INIT_ENV: method}
                self.ranks.append(WorkerProcess(init, asyncio, rank_env, parent_dir=self.dir))
        except BaseException:
            self.kill()
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.init = init
        self.to_worker = _FanOut([r.to_worker for r in self.ranks])
        self.to_engine = self.ranks[0].to_engine
        self.ready: WorkerReady | None = None
        self._closed = False

    def set_init(self, init: WorkerInit) -> None:
        """The settings ``start`` sends to every rank, for ranks started before they were known."""
        check_num_ranks(init, len(self.ranks))
        self.init = init
        for r in self.ranks:
            r.init = init

    @property
    def stopping(self) -> bool:
        return self.ranks[0].stopping

    @property
    def pid(self) -> int:
        return self.ranks[0].pid

    def alive(self) -> bool:
        return all(r.alive() for r in self.ranks)

    def exit_description(self) -> str:
        gone = [f"rank {i} (pid {r.pid}) {r.exit_description()}" for i, r in enumerate(self.ranks) if not r.alive()]
        return "; ".join(gone) if gone else "running"

    async def wait_exit(self, poll_s: float = 0.5) -> None:
        """Return as soon as any rank has exited."""
        waits = [asyncio.ensure_future(r.wait_exit(poll_s)) for r in self.ranks]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def start(self, timeout_s: float = 3600.0) -> WorkerReady:
        """Send the init to every rank and wait until each is ready (blocking; not for asyncio)."""
        self.to_worker.send(encode(self.init))
        deadline = time.monotonic() + timeout_s
        readies: dict[int, WorkerReady] = {}
        while len(readies) < len(self.ranks):
            if time.monotonic() > deadline:
                raise WorkerDied(f"the tensor-parallel worker did not start within {timeout_s:.0f} s")
            for i, r in enumerate(self.ranks):
                if i in readies or not r.to_engine.poll(100):
                    continue
                msg = decode_to_engine(r.to_engine.recv())
                if isinstance(msg, WorkerError):
                    raise WorkerDied(f"the worker failed to start: {msg.message}")
                if not isinstance(msg, WorkerReady):
                    raise WorkerDied(f"rank {i} sent {type(msg).__name__} before it was ready")
                readies[i] = msg
            if not self.alive():
                raise WorkerDied(f"the tensor-parallel worker: {self.exit_description()} while starting"
                                 f"{self.first_error()}")
        self.ready = check_ranks_ready([readies[i] for i in range(len(self.ranks))])
        return self.ready

    def first_error(self) -> str:
        """A start-up error a rank sent before it exited (': message'), or '' (blocking sockets only)."""
        for r in self.ranks:
            while r.to_engine.poll(0):
                msg = decode_to_engine(r.to_engine.recv())
                if isinstance(msg, WorkerError):
                    return f": {msg.message}"
        return ""

    def kill(self) -> None:
        for r in self.ranks:
            r.kill()

    def close(self, timeout_s: float = 10.0) -> None:
        """Shutdown to every rank; a group that lost a rank is killed at once (the others may be waiting in a
        collective); then each rank's sockets and directory, and the group's, removed."""
        if self._closed:
            return
        self._closed = True
        if not self.alive():
            self.kill()
        for r in self.ranks:
            r.stopping = True
            try:
                r.to_worker.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + timeout_s
        for r in self.ranks:
            ChildProcess.close(r, None, max(0.0, deadline - time.monotonic()))
        shutil.rmtree(self.dir, ignore_errors=True)

    async def aclose(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        for r in self.ranks:
            r.stopping = True
        if self.alive():
            for r in self.ranks:
                try:
                    await r.to_worker.send(encode(Shutdown()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            try:
                await asyncio.wait_for(asyncio.gather(*(r.wait_exit() for r in self.ranks)), timeout_s)
            except asyncio.TimeoutError:
                pass
        self._closed = True
        self.kill()
        for r in self.ranks:
            ChildProcess.close(r, None, 0.0)
        shutil.rmtree(self.dir, ignore_errors=True)


def check_ranks_ready(readies: list[WorkerReady]) -> WorkerReady:
    """Rank 0's WorkerReady, once every rank reported the same plan and KV blocks (WorkerDied naming the ranks that
    differ)."""
    first = readies[0]
    for rank, ready in enumerate(readies[1:], 1):
        if (ready.plan_hash, ready.num_kv_blocks) != (first.plan_hash, first.num_kv_blocks):
            raise WorkerDied(f"tensor parallel ranks disagree: rank 0 plan {first.plan_hash} with "
                             f"{first.num_kv_blocks} KV blocks, rank {rank} plan {ready.plan_hash} with "
                             f"{ready.num_kv_blocks}")
    return first


class WorkerInfo:
    """What EngineCore asks of its worker besides steps, from a worker process's WorkerReady."""

    def __init__(self, ready: WorkerReady):
        self.ready = ready
        self.model_config = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                                           for k, v in ready.model_config.items()})
        self.device_name = ready.device_name

    def measure_av_curve(self):
        return self.ready.av_curve

    def measure_decode_costs(self):
        return self.ready.decode_costs


class RemoteWorker(WorkerInfo):
    """EngineCore's worker interface over a worker process (blocking sockets): ``submit`` sends a step, ``collect``
    waits for its result, checking every half second that the process is alive."""

    def __init__(self, process: "WorkerProcess | WorkerGroup"):
        self.process = process
        super().__init__(process.ready or process.start())
        self.tensor_parallel_size = len(process.ranks) if isinstance(process, WorkerGroup) else 1
        self.capture_progress = self.ready.capture_progress
        """Delayed capture's latest progress (None: every graph was captured before the worker was ready)."""

    def submit(self, step: Step) -> int:
        self.process.to_worker.send(encode(step))
        return step.step_id

    def collect(self, step_id: int) -> StepResult:
        while True:
            if self.process.to_engine.poll(500):
                msg = decode_to_engine(self.process.to_engine.recv())
                if isinstance(msg, CaptureProgress):
                    self.capture_progress = msg
                    continue
                if isinstance(msg, WorkerError) and msg.step_id < 0:
                    log.warning("worker: %s", msg.message)  # a frame it refused: not this step's
                    continue
                if isinstance(msg, WorkerError):
                    raise WorkerDied(f"step {msg.step_id} failed in the worker: {msg.message}")
                if not isinstance(msg, StepResult) or msg.step_id != step_id:
                    raise WorkerDied(f"expected the result of step {step_id}, got {msg!r:.200}")
                return msg
            if not self.process.alive():
                raise WorkerDied(f"the worker process {self.process.exit_description()}")

    def close(self) -> None:
        self.process.close()


def tensor_parallel_worker(cfg, args, compilation_config: dict | None, speculative_config: dict | None,
                           tensor_parallel_size: int, structured_outputs: bool = False) -> RemoteWorker:
    """EngineCore's worker for an in-process engine (``LLM``, tests) split over ``tensor_parallel_size`` ranks: a
    started ``WorkerGroup`` with the configuration ``cfg`` was resolved from (``compilation_config`` and
    ``speculative_config`` as given) and the EngineArgs ``args``."""
    from dispatcher.engine.config import scheduler_config
    from models.loader import default_dtype

    sched = scheduler_config(cfg, args.num_kv_blocks, args.block_size, args.max_model_len,
                             steps_in_flight=args.steps_in_flight)
    dtype = args.dtype or default_dtype(args.model, args.device)
    init = WorkerInit(args.model, args.device, str(dtype).removeprefix("torch."), cfg.platform.value,
                      cfg.max_num_seqs, cfg.max_num_batched_tokens, dict(compilation_config or {}),
                      dict(speculative_config or {}), args.block_size, args.max_model_len, sched.max_blocks_per_seq,
                      args.num_kv_blocks, 0.9, args.seed, args.use_cuda_graphs, args.fixed_acceptance,
                      fuse_decode_steps=args.fuse_decode_steps, quantization=args.quantization,
                      kv_cache_dtype=args.kv_cache_dtype, structured_outputs=structured_outputs,
                      tensor_parallel_size=tensor_parallel_size, steps_in_flight=args.steps_in_flight)
    group = WorkerGroup(init)
    try:
        return RemoteWorker(group)
    except BaseException:
        group.close()
        raise
