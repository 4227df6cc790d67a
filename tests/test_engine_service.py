"""The serving engine's step loop (``dispatcher.engine.service.EngineService``) against a worker that keeps up, behind
sockets whose awaits resolve at once when a frame is waiting (a stub: pyzmq's poll yields even then, so this is the
worst case the loop must survive). A request that arrives while others run must join them within a step or two,
not wait until they finish."""

from __future__ import annotations

import asyncio
from collections import deque

from dispatcher.engine.engine_core import EngineArgs, EngineCore
from dispatcher.engine.protocol import AddRequest, Drain, Outputs, decode_to_front
from dispatcher.engine.protocol import encode as encode_core
from dispatcher.engine.service import EngineService
from dispatcher.messages import decode_to_worker
from dispatcher.messages import encode as encode_step
from dispatcher.plan.config import resolve
from models.config import preset
from scheduler.request import SamplingParams


class _Done:
    """An awaitable that is already resolved (as a ZeroMQ socket's recv and poll are when a frame is waiting):
    awaiting it does not yield to the event loop."""

    def __init__(self, value):
        self.value = value

    def __await__(self):
        return self.value
        yield  # (a generator: never reached)


class _InstantWorker:
    """The worker process's two sockets, answered in-process: a step sent is run at once, its result waits."""

    def __init__(self, core: EngineCore):
        self.core, self.results = core, deque()
        self.to_worker, self.to_engine = self, self

    def send(self, frame: bytes) -> _Done:
        step = decode_to_worker(frame)
        self.results.append(encode_step(self.core.worker.collect(self.core.worker.submit(step))))
        return _Done(None)

    def poll(self, timeout_ms: float) -> _Done:
        return _Done(bool(self.results))

    def recv(self) -> _Done:
        return _Done(self.results.popleft())

    def alive(self) -> bool:
        return True


class _Inbox:
    def __init__(self):
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()

    async def recv(self) -> bytes:
        return await self.queue.get()  # (no yield when a frame is waiting, as ZeroMQ's)


class _Outbox:
    def __init__(self):
        self.sent: list[Outputs] = []

    def send(self, frame: bytes) -> _Done:
        self.sent.append(decode_to_front(frame))
        return _Done(None)


def test_a_request_arriving_mid_run_joins_the_running_ones_at_once():
    cfg = resolve({}, None, platform="sm100", max_num_seqs=8, max_num_batched_tokens=64)
    core = EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=64, block_size=8, max_model_len=128))
    inbox, outbox = _Inbox(), _Outbox()
    service = EngineService(None, _InstantWorker(core), inbox, [outbox])
    service.core = core
    params = SamplingParams(max_tokens=48, ignore_eos=True)

    def tokens_of(request_id: str) -> list[int]:
        """The index (in messages sent) of each token of ``request_id``."""
        return [i for i, out in enumerate(outbox.sent) for d in out.deltas if d.request_id == request_id
                for _ in d.new_token_ids]

    async def scenario():
        receiver = asyncio.get_running_loop().create_task(service.receive())
        runner = asyncio.get_running_loop().create_task(service.run())
        inbox.queue.put_nowait(encode_core(AddRequest("first", [5, 6, 7, 8], params)))
        while len(tokens_of("first")) < 4:  # the first request is decoding
            await asyncio.sleep(0)
        inbox.queue.put_nowait(encode_core(AddRequest("second", [9, 10, 11], params)))
        sent_when_queued = len(outbox.sent)
        while len(tokens_of("second")) < 48:
            await asyncio.sleep(0)
        inbox.queue.put_nowait(encode_core(Drain()))  # (as the front end stops it: the step task ends)
        await asyncio.wait_for(runner, 30)
        receiver.cancel()
        return sent_when_queued

    sent_when_queued = asyncio.run(asyncio.wait_for(scenario(), 120))
    first, second = tokens_of("first"), tokens_of("second")
    assert len(first) == len(second) == 48
    # The second request's first token comes within three steps of its arrival (one may be in flight), while the
    # first still runs.
    assert second[0] - sent_when_queued <= 3, (sent_when_queued, second[:3])
    assert second[0] < first[-1], (second[0], first[-1])
