"""The serve <-> engine contract: the only things the HTTP front end and the engine process share.

The front end (``twogrid serve``'s own process: HTTP, tokenization, detokenization, stop strings, metrics) sends
each request once (``AddRequest``) and ``Abort`` for clients that left or requests a stop string ended; ``Drain``
asks the engine to finish what it has and exit. The engine process (scheduler and dispatcher; the worker is its
child) answers ``EngineStarted`` once the worker has captured, then one ``Outputs`` per step: every request's new
token ids, the step's record for the metrics, the queue after it. Refusals and failed steps travel in the same
message. ``EngineDead`` is its last word when its worker dies. msgspec Structs as msgpack, no pickle.
"""

from __future__ import annotations

import array
import sys

import msgspec

from dispatcher.messages import CaptureProgress, WorkerInit, WorkerReady
from scheduler.request import SamplingParams

TO_CORE, TO_FRONT = "to_core", "to_front"
"""The sockets' names in the front end's ipc directory (requests in, outputs out)."""


def front_end_sockets(index: int) -> tuple[str, str]:
    """Front end ``index``'s two sockets (``--api-server-count``: each front-end process binds its own pair in the
    first one's ipc directory; the engine connects to every pair)."""
    return (TO_CORE, TO_FRONT) if index == 0 else (f"{TO_CORE}.{index}", f"{TO_FRONT}.{index}")


class EngineInit(msgspec.Struct, array_like=True, frozen=True, tag="init"):
    """What the engine process starts from: the worker's init (the engine resolves the configuration from it
    exactly as the worker does) and the engine's own settings."""

    worker: WorkerInit
    eos_token_ids: list[int]
    step_trace: str | None = None
    num_front_ends: int = 1
    """Front-end processes (``--api-server-count``); the first one also gets every step's record and the queue."""
    enable_prefix_caching: bool = True
    tokenizer: str | None = None
    """The checkpoint whose tokenizer structured outputs compile grammars against (the front end's ``--tokenizer``
    or the model); None: the model's."""
    structured_compile_timeout_s: float = 10.0
    """``--structured-outputs-config``'s ``compile_timeout_s``."""
    admission_wait_steps: int | None = None
    """``--admission-wait-steps`` (None: the default, ``admission_wait_for``)."""


class AddRequest(msgspec.Struct, array_like=True, frozen=True, tag="add"):
    request_id: str
    prompt_token_ids: bytes | list[int]
    """The prompt's token ids: as little-endian int32 bytes (``pack_prompt``: a front end's, which the engine reads
    without decoding a list of ints and checking each), or a list of ints."""
    params: SamplingParams
    front_end: int = 0
    """The front-end process that sent it: its outputs go back there."""
    block_hashes: bytes = b""
    """The prompt's block hashes for the prefix cache's lookup, joined (``scheduler.block_hash.prompt_block_hashes``
    with ``EngineStarted.prefix_block_size``), computed by the front end, several of which share the work that the
    engine's single thread did for every arrival (~50 us a 1,500-token prompt on the CI machine); empty: the engine
    hashes the prompt."""


def pack_prompt(token_ids) -> bytes | list[int]:
    """``AddRequest.prompt_token_ids`` for ``token_ids``: little-endian int32 bytes (the engine unpacks and range-checks
    them in a few numpy calls: ~30 us less of the engine's single thread a 760-token arrival on the CI machine than
    a list's decode and per-token check, for ~11 us more here), or the list as it is where an id does not fit an int32
    (the engine's check then names it)."""
    try:
        packed = array.array("i", token_ids)  # (OverflowError past int32, TypeError for a non-integer: not wrapped)
    except (OverflowError, TypeError):
        return list(token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


class Abort(msgspec.Struct, array_like=True, frozen=True, tag="abort"):
    request_ids: list[str]
    finish_reason: str = "abort"
    """"abort" (the client left) or "stop" (the front end matched a stop string: the request is done)."""


class Drain(msgspec.Struct, array_like=True, frozen=True, tag="drain"):
    """Take no more requests; finish those in flight, then exit (the front end fails what is left first)."""


class Delta(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    """'stop', 'length' or 'abort' on a request's last delta."""
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int | None = None
    """On a request's first delta: its prompt tokens found in the prefix cache."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """On a request's first delta, with ``prompt_logprobs``: per prompt token its log-probability and the top
    others' (None for the first token)."""
    prompt_logprob_ranks: list[int | None] | None = None
    queue_s: float | None = None
    """On a request's first delta: seconds from the engine taking it to its first step (its grammar's compile
    included)."""
    prefill_s: float | None = None
    """On a request's first delta: seconds from its first step to this delta (its prompt's steps)."""


class StepRecord(msgspec.Struct, array_like=True, frozen=True):
    """A step for the metrics: its batch kind and graph mode, why it ran eagerly, padding, drafts accepted,
    requests preempted while scheduling it, its device time; then its speculative decoding as vLLM counts it
    (the scheduler's ``SpecDecodeStep``): verify events, drafts verified, and per draft position the verify events
    that accepted it (empty without drafts: a step without them costs three bytes more)."""

    kind: str
    mode: str
    eager_cause: str | None
    padded_tokens: int
    accepted_tokens: int
    num_preempted: int
    device_s: float
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_per_pos: list[int] = []
    tiers: list[list[int]] | None = None
    """The speculative tiers in force from this step on, [[min_batch, max_batch, K], ...], on the steps after which
    ``"auto"`` tiers changed; None otherwise."""
    prefix_cache_queries: int = 0
    """Tokens of the requests the step started for the first time, with prefix caching on (vLLM's counter)."""
    prefix_cache_hits: int = 0
    """Of those, the tokens found in the prefix cache."""
    fused: bool = False
    """The step ran as one fused decode-step graph."""


class QueueState(msgspec.Struct, array_like=True, frozen=True):
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    """The KV cache's size in blocks."""


class Refusal(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    message: str
    """The engine's RequestError (it names the field and the limit), or why it takes no requests."""


class Failure(msgspec.Struct, array_like=True, frozen=True):
    request_ids: list[str]
    message: str
    """Why their step failed (the worker's error): they end with a server error; the engine goes on."""


class Outputs(msgspec.Struct, array_like=True, frozen=True, tag="outputs"):
    deltas: list[Delta] = []
    steps: list[StepRecord] = []
    queue: QueueState | None = None
    refused: list[Refusal] = []
    failed: list[Failure] = []
    capture: CaptureProgress | None = None
    """Delayed capture's progress, when the worker reported some (to the first front end)."""


class EngineStarted(msgspec.Struct, array_like=True, frozen=True, tag="started"):
    worker: WorkerReady
    async_scheduling: bool
    tiers: list[list[int]] = []
    """The speculative tiers the engine starts with, [[min_batch, max_batch, K], ...] ([] without speculative
    decoding)."""
    prefix_block_size: int = 0
    """The prefix cache's block size, for the front ends' prompt block hashes (0: no prefix caching)."""
    next_token_key: bool = False
    """The prefix cache keys a block by the token after it too (``scheduler.block_hash``)."""


class EngineDead(msgspec.Struct, array_like=True, frozen=True, tag="dead"):
    message: str


ToCore = EngineInit | AddRequest | Abort | Drain
ToFront = Outputs | EngineStarted | EngineDead

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_to_front = msgspec.msgpack.Decoder(ToFront)


def encode(message: ToCore | ToFront) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    """A message for the engine; msgspec.DecodeError / ValidationError on anything else (never pickle)."""
    return _to_core.decode(data)


def decode_to_front(data: bytes) -> ToFront:
    return _to_front.decode(data)
