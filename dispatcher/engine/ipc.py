"""The engine's side of the process boundary: a worker process, its private ipc directory and its two sockets.

The engine binds two ZeroMQ sockets in a directory only its user can enter (mode 0700, removed on close), starts
``python -m dispatcher.runtime.process DIR``, sends it a ``WorkerInit`` and waits for ``WorkerReady``. Steps go
out on one socket, results come back on the other, as ``dispatcher.messages`` (msgpack; nothing else is decoded,
so nothing can be unpickled). ``RemoteWorker`` gives EngineCore the worker interface over it; the serving engine
uses the same process with asyncio sockets.
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

from dispatcher.messages import (ENGINE_PID_ENV, TO_ENGINE, TO_WORKER, Shutdown, Step, StepResult, WorkerError,
                                 WorkerInit, WorkerReady, decode_to_engine, encode)
from models.config import ModelConfig

log = logging.getLogger("twogrid.engine")

class WorkerDied(RuntimeError):
    """The worker process exited or failed; the message says how."""


class WorkerProcess:
    """One worker process and its sockets. ``asyncio=True`` makes the sockets awaitable (the serving engine)."""

    def __init__(self, init: WorkerInit, asyncio: bool = False, env: dict | None = None):
        self.init = init
        self.dir = tempfile.mkdtemp(prefix="twogrid-ipc-")  # mode 0700: only this user can reach the sockets
        os.chmod(self.dir, 0o700)
        self.ctx = zmq.asyncio.Context() if asyncio else zmq.Context()
        self.to_worker = self.ctx.socket(zmq.PUSH)
        self.to_worker.bind(f"ipc://{self.dir}/{TO_WORKER}")
        self.to_engine = self.ctx.socket(zmq.PULL)
        self.to_engine.bind(f"ipc://{self.dir}/{TO_ENGINE}")
        self.proc = subprocess.Popen([sys.executable, "-m", "dispatcher.runtime.process", self.dir],
                                     env={**os.environ, ENGINE_PID_ENV: str(os.getpid()), **(env or {})},
                                     start_new_session=True)
        self.ready: WorkerReady | None = None
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
        if self._closed:
            return
        self._closed = self.stopping = True
        if self.alive():
            try:
                self.to_worker.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.to_worker.close(linger=0)
        self.to_engine.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """``close`` for the serving engine's event loop, which goes on (streams get their last events) while the
        worker finishes its step and exits."""
        if self._closed:
            return
        self.stopping = True
        if self.alive():
            try:
                await self.to_worker.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                await asyncio.wait_for(self.wait_exit(), timeout_s)
            except asyncio.TimeoutError:
                pass
        self.close(0.0)


class RemoteWorker:
    """EngineCore's worker interface over a worker process (blocking sockets): ``submit`` sends a step, ``collect``
    waits for its result, checking every half second that the process is alive."""

    def __init__(self, process: WorkerProcess):
        self.process = process
        ready = process.ready or process.start()
        self.ready = ready
        self.model_config = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                                           for k, v in ready.model_config.items()})
        self.device_name = ready.device_name

    def measure_av_curve(self):
        return self.ready.av_curve

    def submit(self, step: Step) -> int:
        self.process.to_worker.send(encode(step))
        return step.step_id

    def collect(self, step_id: int) -> StepResult:
        while True:
            if self.process.to_engine.poll(500):
                msg = decode_to_engine(self.process.to_engine.recv())
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
