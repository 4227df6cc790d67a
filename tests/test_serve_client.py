"""The front end's handle on the engine (dispatcher.serve.client.EngineClient), over a real zmq socket: what a front
end does with the engine's per-step outputs when it is behind."""

import asyncio
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio

from dispatcher.engine.protocol import Delta, EngineDead, Failure, Outputs, encode
from dispatcher.serve import client as C
from scheduler.request import SamplingParams


class _Engine:
    """The engine's side of the front end's sockets: outputs arrive on a real PAIR socket; what the front end sends
    is kept."""

    def __init__(self, ctx: zmq.asyncio.Context, name: str):
        self.from_child = ctx.socket(zmq.PAIR)
        self.from_child.bind(f"inproc://{name}")
        self.engine_side = ctx.socket(zmq.PAIR)
        self.engine_side.connect(f"inproc://{name}")
        self.sent: list[bytes] = []
        self.to_child = SimpleNamespace(send=self.sent.append)

    def alive(self) -> bool:
        return True


def _client(engine: _Engine, metrics=None, stream_interval: int = 1) -> C.EngineClient:
    client = C.EngineClient(SimpleNamespace(worker=SimpleNamespace(max_model_len=4096), num_front_ends=1), None, "m",
                            SamplingParams(max_tokens=8), metrics=metrics, stream_interval=stream_interval)
    client.process, client.ready = engine, True
    return client


def _close(ctx: zmq.asyncio.Context, engine: _Engine, receiver: asyncio.Task) -> None:
    receiver.cancel()
    engine.from_child.close(0)
    engine.engine_side.close(0)
    ctx.term()


async def _outputs_after(num_queued_steps: int, metrics=None) -> list[list[int]]:
    """One request; ``num_queued_steps`` single-token steps reach the socket before the front end reads any (its
    last one finishes the request); the token ids of each output its consumer gets."""
    ctx = zmq.asyncio.Context()
    engine = _Engine(ctx, f"steps{num_queued_steps}")
    client = _client(engine, metrics)
    stream = client.generate("r", None, [1, 2, 3], SamplingParams(max_tokens=num_queued_steps))
    for i in range(num_queued_steps):
        last = i == num_queued_steps - 1
        await engine.engine_side.send(encode(Outputs([Delta("r", [100 + i], "length" if last else None)])))
    task = asyncio.get_running_loop().create_task(client._receive())
    try:
        return [list(out.outputs[0].token_ids) async for out in stream]
    finally:
        _close(ctx, engine, task)


def test_steps_queued_behind_a_busy_front_end_reach_the_client_as_one_output():
    # A front end that fell behind the engine finds several steps waiting: it takes them all before the request's
    # stream runs, so the client gets one chunk with every token (one write, one decode) instead of one per step.
    outs = asyncio.run(_outputs_after(5))
    assert outs == [[100, 101, 102, 103, 104]]


def test_at_most_max_queued_steps_are_taken_at_once(monkeypatch):
    # The front end does not read the socket dry forever: after MAX_QUEUED_STEPS messages the streams run.
    monkeypatch.setattr(C, "MAX_QUEUED_STEPS", 2)
    outs = asyncio.run(_outputs_after(5))
    assert outs == [[100, 101], [102, 103], [104]]


def test_the_backlog_is_counted_and_twogrid_bench_reports_it():
    # The steps a front end found waiting beyond the one it read are counted on /metrics, and `twogrid bench` reports
    # them (the serving path, not the GPU, was the limit); a front end that keeps up counts none.
    from prometheus_client import CollectorRegistry

    from dispatcher.bench.server_metrics import counter_deltas, parse_counters
    from dispatcher.serve.metrics import EngineMetrics

    metrics = EngineMetrics("m", CollectorRegistry())
    before = parse_counters(metrics.render().decode())
    asyncio.run(_outputs_after(5, metrics=metrics))
    assert counter_deltas(before, parse_counters(metrics.render().decode()))["front_end_backlog_steps"] == 4
    kept_up = EngineMetrics("m", CollectorRegistry())
    before = parse_counters(kept_up.render().decode())
    asyncio.run(_outputs_after(1, metrics=kept_up))
    assert counter_deltas(before, parse_counters(kept_up.render().decode()))["front_end_backlog_steps"] == 0


def test_a_front_end_behind_the_engine_says_so_once_a_window(monkeypatch, caplog):
    # Most steps reaching a front end merged with the ones before (it reads them together: it is behind) is said in
    # a warning naming the flags that help, once a window; a front end that keeps up says nothing.
    monkeypatch.setattr(C, "BEHIND_WINDOW_S", 0.0)
    with caplog.at_level("WARNING", logger="twogrid.serve"):
        asyncio.run(_outputs_after(1))
    assert "behind the engine" not in caplog.text
    with caplog.at_level("WARNING", logger="twogrid.serve"):
        asyncio.run(_outputs_after(5))
    assert "front end 0 is behind the engine: 4 of the 5 engine steps" in caplog.text
    assert "--api-server-count, now 1" in caplog.text
    behind = C._Behind(2, 4, now=0.0)
    monkeypatch.setattr(C, "BEHIND_WINDOW_S", 30.0)
    assert behind.add(3, 10.0) is None and behind.add(1, 29.0) is None  # (within the window: counted, not said)
    assert "2 of the 5 engine steps of the last 31 s" in behind.add(1, 31.0)  # (2 of 5 merged: 40% > 25%)
    assert behind.add(2, 40.0) is None  # (the next window: counted from 31 s)
    assert "1 of the 3 engine steps of the last 31 s" in behind.add(1, 62.0)
    assert behind.add(1, 95.0) is None  # (a window with none merged says nothing)


async def _outputs_then(messages: list, max_tokens: int) -> list:
    """One request; ``messages`` (the engine's) reach the socket before the front end reads any; what the client
    gets: each output's token ids and finish reason, then the error that ended the stream, if one did."""
    ctx = zmq.asyncio.Context()
    engine = _Engine(ctx, f"then{len(messages)}-{max_tokens}")
    client = _client(engine)
    stream = client.generate("r", None, [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    for message in messages:
        await engine.engine_side.send(encode(message))
    task = asyncio.get_running_loop().create_task(client._receive())
    got = []
    try:
        async for out in stream:
            got.append((list(out.outputs[0].token_ids), out.outputs[0].finish_reason))
    except Exception as exc:
        got.append(f"{type(exc).__name__}: {exc}")
    finally:
        task.cancel()
        engine.from_child.close(0)
        engine.engine_side.close(0)
        ctx.term()
    assert "r" not in client.processor.requests  # nothing left behind in the output processor
    return got


@pytest.mark.parametrize("limit", [1, 64])
def test_a_request_that_finished_just_before_the_engine_died_gets_its_output(monkeypatch, limit):
    # Its last delta and the engine's death were read together (a front end behind): the client still gets the
    # completed output, not an error.
    monkeypatch.setattr(C, "MAX_QUEUED_STEPS", limit)
    got = asyncio.run(_outputs_then([Outputs([Delta("r", [100, 101], "length")]), EngineDead("the worker died")], 2))
    assert got == [([100, 101], "length")]


@pytest.mark.parametrize("limit", [1, 64])
def test_tokens_before_a_failed_step_reach_the_client_before_its_error(monkeypatch, limit):
    monkeypatch.setattr(C, "MAX_QUEUED_STEPS", limit)
    got = asyncio.run(_outputs_then([Outputs([Delta("r", [100])]), Outputs([Delta("r", [101])]),
                                     Outputs(failed=[Failure(["r"], "step failed: boom")])], 8))
    assert [t for ids, _ in got[:-1] for t in ids] == [100, 101]
    assert got[-1] == "EngineError: step failed: boom"


async def _outputs_one_step_at_a_time(num_steps: int, stream_interval: int, tokens_per_step: int = 1,
                                      stop_at: int | None = None) -> list[list[int]]:
    """One request; its steps reach the socket one at a time, the front end keeping up (each step read and taken
    before the next is sent); the last finishes it (or the ``stop_at``-th, with a stop reason). The token ids of
    each output its consumer gets."""
    ctx = zmq.asyncio.Context()
    engine = _Engine(ctx, f"interval{stream_interval}-{num_steps}-{tokens_per_step}")
    client = _client(engine, stream_interval=stream_interval)
    stream = client.generate("r", None, [1, 2, 3], SamplingParams(max_tokens=num_steps * tokens_per_step))
    outs: list[list[int]] = []

    async def consume():
        async for out in stream:
            outs.append(list(out.outputs[0].token_ids))

    loop = asyncio.get_running_loop()
    receiver, consumer = loop.create_task(client._receive()), loop.create_task(consume())
    try:
        last = num_steps - 1 if stop_at is None else stop_at
        for i in range(last + 1):
            ids = [100 + tokens_per_step * i + j for j in range(tokens_per_step)]
            reason = ("length" if stop_at is None else "stop") if i == last else None
            await engine.engine_side.send(encode(Outputs([Delta("r", ids, reason)])))
            for _ in range(20):  # (the front end reads it and, if it is due, the consumer takes it)
                await asyncio.sleep(0)
        await asyncio.wait_for(consumer, 5)
        return outs
    finally:
        _close(ctx, engine, receiver)


def test_a_stream_interval_holds_tokens_back_after_the_first_until_enough_wait():
    """--stream-interval N (vLLM's): a request's first tokens go out at once (its time to first token), then one
    output per N new tokens, and whatever waits when it ends; with 1, every step's tokens go out as they come.
    Nothing is lost or reordered."""
    every = asyncio.run(_outputs_one_step_at_a_time(10, 1))
    assert every == [[100 + i] for i in range(10)]
    held = asyncio.run(_outputs_one_step_at_a_time(10, 4))
    assert held == [[100], [101, 102, 103, 104], [105, 106, 107, 108], [109]]
    # speculative steps bring several tokens at once: an output once at least N wait
    multi = asyncio.run(_outputs_one_step_at_a_time(5, 4, tokens_per_step=3))
    assert [len(o) for o in multi] == [3, 6, 6]
    assert [t for o in multi for t in o] == list(range(100, 115))
    # a request that ends early (a stop) sends what waited at once
    stopped = asyncio.run(_outputs_one_step_at_a_time(10, 4, stop_at=2))
    assert stopped == [[100], [101, 102]]


def test_reading_the_engines_steps_leaves_no_reference_cycles():
    """The front end's read of each engine step (``_queued``: one message waited for, the rest taken while any is
    waiting) frees everything it allocates by reference counting. Taking the rest with zmq.asyncio's non-blocking
    receive raised ``zmq.Again`` through a future when none was left: ~27 objects in a cycle a step, so every
    front end ran a young collection of ~50,000 objects (20-46 ms, the front end paused) every few seconds while
    serving (H100, 256 streams). Three messages waiting are all taken, in order, and nothing more."""
    import gc

    async def scenario() -> tuple[list, int]:
        ctx = zmq.asyncio.Context()
        engine = _Engine(ctx, "cycles")
        got = []
        gc.collect()
        gc.disable()
        try:
            for i in range(100):
                for j in range(3):
                    await engine.engine_side.send(b"%d.%d" % (i, j))
                await engine.from_child.poll(1000)
                got.append(await C._queued(engine.from_child, 8))
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            cycles = len(gc.garbage)
            gc.garbage.clear()
        finally:
            gc.set_debug(0)
            gc.enable()
            engine.from_child.close(0)
            engine.engine_side.close(0)
            ctx.term()
        return got, cycles

    got, cycles = asyncio.run(scenario())
    assert got == [[b"%d.%d" % (i, j) for j in range(3)] for i in range(100)]
    assert cycles == 0


def test_a_request_whose_message_cannot_be_encoded_leaves_nothing_behind():
    """A request id with a lone surrogate (a header byte that is not UTF-8, decoded with surrogate escapes) cannot be
    sent to the engine: generate raises, and the request is not left registered, so that shutdown's Abort of the
    running requests (which encodes their ids) still goes out and the next request is served."""
    async def go():
        ctx = zmq.asyncio.Context()
        engine = _Engine(ctx, "unencodable")
        client = _client(engine)
        with pytest.raises(UnicodeEncodeError):
            client.generate("cmpl-caf\udce9", None, [1, 2, 3], SamplingParams(max_tokens=2))
        assert not client._streams and not client.processor.requests and engine.sent == []
        stream = client.generate("ok", None, [1, 2, 3], SamplingParams(max_tokens=1))
        await engine.engine_side.send(encode(Outputs([Delta("ok", [100], "length")])))
        task = asyncio.get_running_loop().create_task(client._receive())
        try:
            assert [list(out.outputs[0].token_ids) async for out in stream] == [[100]]
        finally:
            _close(ctx, engine, task)

    asyncio.run(go())
