"""More front-end processes (``twogrid serve --api-server-count N``): HTTP, tokenization and detokenization spread
over N processes that listen on one port (on Linux each on its own socket of an SO_REUSEPORT group, so the kernel
deals new connections among them evenly) and one engine.

One Python process streams about 15-20K events a second; at hundreds of concurrent streams under speculative
decoding that is less than the GPU produces, and a saturated front end also admits new requests late. Front end 0
(``twogrid serve`` itself) starts the engine as with one, and front ends 1..N-1 with it (``python -m
dispatcher.serve.frontend IPC_DIR INDEX FD[,FD]``: the listening sockets' descriptors are inherited). Each binds
its own pair of sockets in front end 0's ipc directory, to which the engine connects; requests carry their front
end's index and their outputs come back to it. None is ready before all are (a gate file). The metrics are
prometheus-client's multiprocess ones (a private directory, removed on exit). SIGTERM makes a front end stop
accepting and drain its own requests; SIGINT is front end 0's, which stops the others first, waits for them, then
ends the engine. A front end whose engine or parent (front end 0) is gone fails what it has at once and exits; a
front end that exits unasked ends the server with code 1 (its clients' requests would otherwise run on unseen), so
that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import msgspec

from dispatcher.child import PARENT_PID_ENV, start_serving
from dispatcher.engine.protocol import EngineInit
from dispatcher.serve.protocol import Cors
from scheduler.request import SamplingParams

log = logging.getLogger("twogrid.serve")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client's multiprocess mode: a directory where every process writes its values (read once, when
prometheus-client is imported: this module does not import it)."""

INIT_FILE = "front_end.init"
"""Front ends 1..N-1 read their ``FrontEndInit`` from this file in the ipc directory (mode 0700: it holds the key)."""
READY_S = 120.0
"""How long front end 0 waits for the others to serve."""


class FrontEndInit(msgspec.Struct, array_like=True, frozen=True):
    """What front ends 1..N-1 start from (front end 0's settings)."""

    engine: EngineInit
    tokenizer: str | None
    served_model_name: str
    defaults: SamplingParams
    api_key: str | None
    log_requests: bool
    log_level: str
    shutdown_timeout: float
    engine_pid: int
    """The engine process: a front end whose engine is gone (killed, no last word) fails its requests at once."""
    cors: Cors | None = None
    chat_template: str | None = None
    """``--chat-template``'s text (None: the tokenizer's)."""
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    stream_interval: int = 1


def multiprocess_metrics_dir() -> str:
    """A fresh private directory for prometheus-client's multiprocess values, in $PROMETHEUS_MULTIPROC_DIR (which
    the child processes inherit). Call before anything imports prometheus-client."""
    path = tempfile.mkdtemp(prefix="twogrid-metrics-")
    os.chmod(path, 0o700)
    os.environ[MULTIPROC_ENV] = path
    return path


REUSE_PORT = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
"""Each front end listens on its own socket of one SO_REUSEPORT group, and Linux deals new connections among them
evenly (by a hash of each connection's addresses). On one shared socket, whichever process accepted first took
them, a hundred at a wakeup: 512 connections went 153 / 185 / 53 / 122 to four front ends, and at 1024 streams the
busiest one held a run's last requests back by a second. Elsewhere (no such balancing) they share one socket."""


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening TCP sockets on every address ``host`` resolves to (``localhost``: IPv4 and IPv6 where both are
    configured, as aiohttp's own sites bind), which child processes inherit (``own_socket`` joins their group)."""
    socks, seen = [], set()
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):
        if (family, address) in seen:
            continue
        seen.add((family, address))
        if REUSE_PORT and port:  # nobody listens there yet: another server's group would share our connections
            _bound(family, kind, proto, address, reuse_port=False).close()
        sock = _listening(family, kind, proto, address)
        sock.set_inheritable(True)
        socks.append(sock)
    return socks


def probe_listen(host: str, port: int) -> None:
    """Bind ``host``:``port`` on every address it resolves to, and let go (OSError when another server listens
    there): ``serve`` asks before it starts its engine, so a port in use costs no engine start."""
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):
        _bound(family, kind, proto, address, reuse_port=False).close()


def own_socket(inherited: socket.socket) -> socket.socket:
    """Front end 1..N-1's listening socket: its own, on ``inherited``'s address, in its SO_REUSEPORT group (the
    inherited one closed here, front end 0 keeps it); ``inherited`` itself where there is no such balancing."""
    if not REUSE_PORT:
        return inherited
    with inherited:
        return _listening(inherited.family, inherited.type, inherited.proto, inherited.getsockname())


def _listening(family, kind, proto, address) -> socket.socket:
    sock = _bound(family, kind, proto, address, REUSE_PORT)
    sock.listen(4096)
    return sock


def _bound(family, kind, proto, address, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:  # (so that "::" and "0.0.0.0" can both be bound, as asyncio does)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class FrontEnds:
    """Front end 0's handle on front ends 1..N-1. They start with the engine (``spawn``), each says it is ready once
    it serves and has heard the engine start (a file), and ``open_gate`` then makes every front end ready at once
    (each one's ``EngineClient.gate``): no front end answers /health with 200 while another would refuse."""

    def __init__(self, args, engine, socks: list[socket.socket], tokenizer: str | None, defaults: SamplingParams,
                 cors: Cors | None = None):
        """``tokenizer``: where front end 0 loaded its tokenizer from (``load_tokenizer`` of it gives the same)."""
        self.args, self.engine, self.socks, self.cors = args, engine, socks, cors
        self.tokenizer, self.defaults = tokenizer, defaults
        self.procs: list[subprocess.Popen] = []
        self.ipc_dir: str | None = None

    def spawn(self, ipc_dir: str) -> None:
        """Start them (front end 0's ipc directory exists: the engine process is starting)."""
        self.ipc_dir = ipc_dir
        self.engine.gate = gate_file(ipc_dir)
        with open(os.path.join(ipc_dir, INIT_FILE), "wb") as fh:
            fh.write(msgspec.msgpack.encode(FrontEndInit(
                engine=self.engine.init, tokenizer=self.tokenizer, served_model_name=self.engine.served_model_name,
                defaults=self.defaults, api_key=self.args.api_key, log_requests=self.args.log_requests,
                log_level=self.args.log_level, shutdown_timeout=self.args.shutdown_timeout,
                engine_pid=self.engine.process.pid, cors=self.cors, chat_template=self.args.chat_template,
                tool_call_parser=self.args.tool_call_parser,
                enable_auto_tool_choice=self.args.enable_auto_tool_choice, stream_interval=self.args.stream_interval)))
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        fds = tuple(sock.fileno() for sock in self.socks)
        for index in range(1, self.args.api_server_count):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "dispatcher.serve.frontend", ipc_dir, str(index), ",".join(map(str, fds))],
                env=env, pass_fds=fds))

    async def open_gate(self) -> None:
        """Wait until each serves (its ready file), then make all ready; RuntimeError if one exits or is late."""
        deadline = time.monotonic() + READY_S
        for index, proc in enumerate(self.procs, 1):
            while not os.path.exists(_ready_file(self.ipc_dir, index)):
                if proc.poll() is not None:
                    raise RuntimeError(f"front end {index} exited with code {proc.returncode} while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"front end {index} did not start within {READY_S:.0f} s")
                await asyncio.sleep(0.02)
        open(gate_file(self.ipc_dir), "w").close()
        log.info("%d front-end processes serve the port", len(self.procs) + 1)

    def exited(self) -> str | None:
        """How a front end that exited unasked ended (None while all run)."""
        for index, proc in enumerate(self.procs, 1):
            if proc.poll() is not None:
                return f"front end {index} exited with code {proc.returncode}"
        return None

    def stop(self) -> None:
        """Ask each to drain and exit (SIGTERM)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    async def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for them to exit; SIGKILL the rest."""
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for proc in self.procs:
            if proc.poll() is None:
                log.warning("front-end process %d did not exit within %.0f s: killed", proc.pid, timeout_s)
                proc.kill()
            proc.wait()


def gate_file(ipc_dir: str) -> str:
    return os.path.join(ipc_dir, "front_end.serving")


def _ready_file(ipc_dir: str, index: int) -> str:
    return os.path.join(ipc_dir, f"front_end.{index}.ready")


async def serve(ipc_dir: str, index: int, fds: list[int]) -> int:
    """Front end ``index``: serve HTTP on the inherited sockets ``fds`` through front end 0's engine until SIGTERM
    (exit 0, its requests drained) or the engine's or front end 0's end (exit 1, its requests failed)."""
    from dispatcher.serve.app import build_app, drain, start_http
    from dispatcher.serve.client import EngineClient
    from dispatcher.serve.metrics import EngineMetrics
    from models.text import load_tokenizer, warm_chat_template

    with open(os.path.join(ipc_dir, INIT_FILE), "rb") as fh:
        init = msgspec.msgpack.decode(fh.read(), type=FrontEndInit)
    logging.getLogger().setLevel(init.log_level.upper())
    tokenizer = load_tokenizer(init.tokenizer) if init.tokenizer else None
    if tokenizer is not None and init.chat_template is not None:
        tokenizer.chat_template = init.chat_template
    if tokenizer is not None and tokenizer.chat_template:
        warm_chat_template(tokenizer.chat_template)  # (front end 0 did it when it checked the template)
    name = init.served_model_name
    engine = EngineClient(init.engine, tokenizer, name, init.defaults, EngineMetrics(name, multiprocess=True),
                          init.log_level, index, init.stream_interval)
    engine.gate = gate_file(ipc_dir)
    engine.attach(ipc_dir, init.engine_pid)
    app = build_app(engine, api_key=init.api_key, log_requests=init.log_requests, cors=init.cors,
                    tool_call_parser=init.tool_call_parser, enable_auto_tool_choice=init.enable_auto_tool_choice)
    runner = await start_http(app, shutdown_timeout=init.shutdown_timeout,
                              socks=[own_socket(socket.socket(fileno=fd)) for fd in fds])
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    said_ready, loop_watch = False, None
    while not stop.is_set() and engine.dead is None:  # (dead: the engine died, or front end 0 is gone)
        if not said_ready and engine.capture is not None:  # serving, and the engine has started
            loop_watch = start_serving()
            open(_ready_file(ipc_dir, index), "w").close()
            said_ready = True
        try:
            await asyncio.wait_for(stop.wait(), 0.02 if not said_ready else 0.25)
        except asyncio.TimeoutError:
            pass
    code = 0 if engine.dead is None else 1
    left = await drain(app, init.shutdown_timeout if code == 0 else 0.0)
    if left:
        log.warning("front end %d: %d requests did not finish within --shutdown-timeout: failing them", index, left)
    if loop_watch is not None:  # (served and drained: what shutting down holds the loop for is not a stall)
        loop_watch.stop()
    await engine.shutdown(0.0)
    await runner.cleanup()
    return code


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches front end 0 too: it stops us (SIGTERM)
    ipc_dir, index, fds = sys.argv[1], int(sys.argv[2]), [int(fd) for fd in sys.argv[3].split(",")]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s front end {index} %(levelname)s %(message)s")
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    from dispatcher.child import profiled

    return profiled(f"front_end_{index}", runner, serve(ipc_dir, index, fds))


if __name__ == "__main__":
    sys.exit(main())
