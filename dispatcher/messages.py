"""The engine <-> worker contract: the only things the two share (SPEC section 7).

The engine sends each request once (``NewRequest``, with the step that admits it), then per step only what changed
(``Step``): the scheduled slots, their query lengths and drafts, new KV blocks, slots freed since the last step,
and the dispatcher's descriptors. The worker keeps every request's state on its device (tokens, computed count,
drafts, sampling parameters) and answers each step with a ``StepResult``: sampled tokens and accepted-draft counts.
It never sees a scheduler object. Columns of numbers travel as little-endian numpy bytes (int32 unless named);
messages are msgspec Structs encoded as msgpack arrays (no field names on the wire, no pickle).
"""

from __future__ import annotations

import os

import msgspec
import numpy as np

from dispatcher.plan.config import ResolvedConfig, resolve
from dispatcher.plan.dispatch import BatchDescriptor
from dispatcher.plan.gridfit import StepCost
from scheduler.request import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS,
                               MAX_MIN_TOKENS_STOP_IDS)

SAMPLING_LIMITS = (MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS, MAX_MIN_TOKENS_STOP_IDS, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS)
"""What a ``SamplingSpec``'s lists hold at most (the engine refuses longer ones, ``SamplingParams.validate``): the
widths of the worker's per-slot tables."""

TP_RANK_ENV, TP_INIT_ENV = "TWOGRID_TP_RANK", "TWOGRID_TP_INIT_METHOD"
"""A tensor-parallel worker's rank, and the group's torch.distributed rendezvous (``init_method``: ``file://`` in the
engine's private ipc directory on one host, ``tcp://LEADER:PORT`` across hosts)."""
TO_WORKER, TO_ENGINE = "to_worker", "to_engine"
"""The two sockets' names in the engine's ipc directory: steps go to the worker on one, results come back on the
other."""
I32 = np.dtype("<i4")
F32 = np.dtype("<f4")


def pack(values, dtype=I32) -> bytes:
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def unpack(data: bytes, dtype=I32, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """A read-only view of a packed column (no copy)."""
    arr = np.frombuffer(data, dtype=dtype)
    return arr.reshape(shape) if shape is not None else arr


class SamplingSpec(msgspec.Struct, array_like=True, frozen=True):
    temperature: float
    """0 is greedy."""
    top_k: int
    """0: off."""
    top_p: float
    """1: off."""
    seed: int
    """Every random draw of the request is a function of (seed, position): reproducible whatever the batch."""
    num_logprobs: int = -1
    """Return each new token's log-probability and the top ``num_logprobs`` others (-1: none)."""
    min_p: float = 0.0
    """0: off."""
    repetition_penalty: float = 1.0
    """1: off."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    """Output tokens before ``min_tokens_stop_ids`` may be drawn."""
    min_tokens_stop_ids: bytes = b""
    """int32: the EOS and stop token ids that ``min_tokens`` holds back."""
    allowed_token_ids: bytes = b""
    """int32: the only tokens the request may draw (empty: any)."""
    logit_bias_ids: bytes = b""
    """int32: tokens whose logit ``logit_bias`` (float32, one per id) is added to."""
    logit_bias: bytes = b""
    bad_words: bytes = b""
    """int32: the bad words' token ids, one word after the other (``bad_word_lens`` tokens each)."""
    bad_word_lens: bytes = b""
    num_prompt_logprobs: int = -1
    """Return each prompt token's log-probability, rank and the top ``num_prompt_logprobs`` others (-1: none)."""


class NewRequest(msgspec.Struct, array_like=True, frozen=True):
    slot: int
    """The request's row in the block table and in the worker's state, until it leaves."""
    token_ids: bytes
    """int32: the prompt, then the output so far (a preempted request computes both again)."""
    num_prompt_tokens: int
    sampling: SamplingSpec
    num_computed: int = 0
    """Tokens whose KV the request already has: its cached prefix, in the blocks the step's ``block_updates`` give
    it (the step computes from there)."""
    grammar_id: int = -1
    """Structured outputs: the compiled grammar that constrains the request (``Step.grammars`` defined it, with this
    step or before); -1: none."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words a grammar bitmask row takes: one bit a token, ceil(vocab_size / 32)."""
    return -(-vocab_size // 32)


def xgrammar_threads() -> int:
    """Threads of one grammar compile (the engine) or one bitmask fill (the worker): half the cores, at most 8
    (vLLM's choice)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class GrammarDef(msgspec.Struct, array_like=True, frozen=True):
    """Structured outputs: a grammar the engine compiled, for the worker to keep until ``Step.dropped_grammars``
    names it (the worker advances each constrained request's matcher and fills the bitmask itself)."""

    grammar_id: int
    compiled: str
    """xgrammar's ``CompiledGrammar.serialize_json()``."""
    tokenizer_info: str = ""
    """xgrammar's ``TokenizerInfo.serialize_json()``, with the first grammar only (the worker keeps it)."""


class Step(msgspec.Struct, array_like=True, frozen=True, tag="step"):
    step_id: int
    new_requests: list[NewRequest]
    """Requests this step admits (set up before the step runs)."""
    freed_slots: bytes
    """Slots whose requests left since the previous step (finished, aborted, preempted): forgotten first."""
    slots: bytes
    """The scheduled requests' slots, in batch order (a request's query tokens are contiguous)."""
    num_scheduled: bytes
    """Query length per request: its known tokens, then the drafts it verifies."""
    num_drafts: bytes
    """Drafts each request verifies (the last tokens of its query)."""
    samples: bytes
    """uint8 per request: the query reaches the request's last token, so the step samples for it."""
    num_new_drafts: int
    """Drafts to propose for each sampling request, for its next step."""
    max_seq_len: int
    """A bound on every scheduled request's context with this step's tokens (the engine's count, which assumes the
    drafts of a step still running all accepted): eager attention chooses its splits by it."""
    block_updates: bytes
    """int32 (3, m): new block-table entries (slot, block index, block id)."""
    target: BatchDescriptor
    draft: BatchDescriptor | None = None
    """EAGLE step 0 (the target's shape) or a block drafter's forward."""
    draft_next: BatchDescriptor | None = None
    """EAGLE's one-token draft steps."""
    prompt_logprob_rows: bytes = b""
    """int32 per request (empty: none): how many of its query's first tokens are prompt tokens whose next prompt
    token's log-probability to return (``prompt_logprobs``)."""
    grammar_rows: bytes = b""
    """int32: the rows (batch order) of the sampling requests a grammar constrains (structured outputs: they verify
    no drafts); empty in an unconstrained step. The worker fills their bitmask from its matchers."""
    grammars: list[GrammarDef] = []
    """Grammars defined before the step's new requests are set up; one that none of them uses is sent ahead (its
    requests wait in the engine until ``StepResult.grammars_ready`` names it), and read off the step's path."""
    dropped_grammars: bytes = b""
    """int32: ids of grammars the worker forgets (no request it holds uses them)."""

    @property
    def num_reqs(self) -> int:
        return len(self.slots) // I32.itemsize

    @property
    def constrained(self) -> bool:
        """A grammar constrains some request's next token: the sampler must apply the step's bitmask."""
        return bool(self.grammar_rows)


class StepResult(msgspec.Struct, array_like=True, frozen=True, tag="result"):
    step_id: int
    sampled: bytes
    """int32 (n, 1 + K): row i's first num_accepted[i] + 1 entries are its new tokens (sampling rows only)."""
    num_accepted: bytes
    """int32 (n,): drafts accepted per request."""
    width: int
    """1 + K: the row length of ``sampled``."""
    draft_confidences: bytes = b""
    """float32 (n, num_new_drafts): the drafter's probability of each draft (adaptive verification's input); empty
    without a drafter."""
    device_ms: float = 0.0
    """The step's time on the device, from its first to its last operation (CUDA events; wall time on the CPU),
    less ``bitmask_wait_ms``."""
    logprobs: bytes = b""
    """float32 (n, 1 + K, 1 + N): per verified position, the log-probability of the token produced there, then
    of the N most likely tokens (N = the step's largest num_logprobs); empty unless a request asked."""
    logprob_ids: bytes = b""
    """int32 (n, 1 + K, N): the ids of those N tokens."""
    num_top_logprobs: int = 0
    jit_compiles: int = 0
    """Triton kernel variants compiled while the step was launched (each one stalls the step)."""
    jit_ms: float = 0.0
    """The host time those compiles took."""
    fused: bool = False
    """The step ran as one fused decode-step graph (``dispatcher.runtime.decode_step``)."""
    prompt_logprobs: bytes = b""
    """float32 (p, 1 + N): per row of ``Step.prompt_logprob_rows`` (in request order), the log-probability of the
    prompt token after it, then of the N most likely tokens there (N = ``num_prompt_top_logprobs``)."""
    prompt_logprob_ids: bytes = b""
    """int32 (p, N): those N tokens' ids."""
    prompt_logprob_ranks: bytes = b""
    """int32 (p,): the prompt token's rank there (1: the most likely)."""
    num_prompt_top_logprobs: int = 0
    not_captured: list[str] = []
    """Delayed capture: the step's graphs that were not captured yet, so that it ran without them: ``"step"`` (its
    fused decode-step graph: it ran op by op), ``"target"``, ``"draft"``, ``"draft_next"`` (that forward ran
    eagerly). Empty once every graph is captured."""
    grammars_ready: bytes = b""
    """int32 ids of the grammars sent ahead (``Step.grammars`` with no request of their step) that the worker has
    read since its last result: the engine admits the requests waiting for them."""
    bitmask_wait_ms: float = 0.0
    """A constrained step's wait inside it for its bitmask (the device idle from its forward's end to the end of
    the host's fill: the fill ended later); 0 where the forward outlasted the fill."""
    stand_in: int = 0
    """Delayed capture: the target's graph was not captured yet and the step replayed, padded up, its kind's captured
    graph of this size (requests for a FULL decode graph, else tokens) instead (``dispatch.padded_up``); 0: none."""


class GraphCount(msgspec.Struct, array_like=True, frozen=True):
    """Graphs of one runner and kind: captured so far, and in the plan."""

    runner: str
    kind: str
    captured: int
    total: int


class CaptureProgress(msgspec.Struct, array_like=True, frozen=True, tag="capture"):
    """Delayed capture's progress (``delayed_cudagraph_capture``): the worker sends it after each idle gap in which
    it captured graphs, and once when the last one is captured (``done``)."""

    graphs: list[GraphCount]
    seconds: float
    """Time spent capturing so far (the worker's host time, in the gaps between steps)."""
    done: bool
    error: str = ""
    """Why capture stopped before the end (out of memory): the graphs left uncaptured run eagerly."""

    @property
    def num_captured(self) -> int:
        return sum(g.captured for g in self.graphs)

    @property
    def num_total(self) -> int:
        return sum(g.total for g in self.graphs)


class Shutdown(msgspec.Struct, array_like=True, frozen=True, tag="shutdown"):
    pass


class WorkerInit(msgspec.Struct, array_like=True, frozen=True, tag="init"):
    """What a worker process starts from: the engine's configuration as the user gave it (the worker resolves it
    the same way) and its own settings."""

    model: str
    """A preset name, a Hugging Face directory or a .gguf file."""
    device: str
    dtype: str
    """"bfloat16", "float16" or "float32"."""
    platform: str
    max_num_seqs: int
    max_num_batched_tokens: int
    compilation_config: dict
    speculative_config: dict
    block_size: int
    max_model_len: int
    max_blocks_per_seq: int
    """The scheduler's block-table width."""
    num_kv_blocks: int
    """0: size the KV cache from free memory (``gpu_memory_utilization``)."""
    gpu_memory_utilization: float
    seed: int
    use_cuda_graphs: bool
    fixed_acceptance: float | None = None
    measure_av_curve: bool = False
    """Adaptive verification without a saved cost curve: time the graphs after capture and report it."""
    measure_decode_costs: bool = False
    """``"auto"`` speculative tiers: time every runner's FULL decode graphs after capture and report them."""
    fuse_decode_steps: bool = True
    """Capture whole uniform-decode steps (``dispatcher.runtime.decode_step``)."""
    quantization: str | None = None
    """``"fp8"``: weights quantized to FP8 at load (``--quantization``)."""
    kv_cache_dtype: str = "auto"
    """``"auto"`` or ``"fp8"`` (``--kv-cache-dtype``)."""
    structured_outputs: bool = False
    """The engine serves text (it has a tokenizer), so steps may carry grammar bitmasks: load xgrammar's kernels at
    start rather than at the first constrained step."""
    tensor_parallel_size: int = 1
    """Ranks the model is split across (``--tensor-parallel-size``): one worker process each, every one getting this
    same init and every step; its rank and the group's rendezvous come from its environment (TP_RANK_ENV,
    TP_INIT_ENV). Rank 0 answers the steps."""
    steps_in_flight: int = 2
    """Steps the engine submits at once (``--steps-in-flight``): ``WorkerConfig.steps_in_flight``."""


def resolve_init(init: WorkerInit, grid_cost: dict | None = None) -> ResolvedConfig:
    """The configuration a ``WorkerInit`` carries, resolved (the worker and the engine process both do this, so
    they agree on every size list); ``grid_cost``: the measured step cost fitted grids come from
    (``WorkerReady.grid_cost``)."""
    cost = StepCost.from_json(grid_cost, grid_cost.get("source", "the worker's grid cost")) if grid_cost else None
    return resolve(init.compilation_config, init.speculative_config, platform=init.platform,
                   max_num_seqs=init.max_num_seqs, max_num_batched_tokens=init.max_num_batched_tokens,
                   step_cost=cost)


class WorkerReady(msgspec.Struct, array_like=True, frozen=True, tag="ready"):
    """The worker's answer once its model is loaded and its graphs captured."""

    model_config: dict
    """models.config.ModelConfig's fields."""
    num_kv_blocks: int
    capture: list[dict]
    """Per runner and graph kind: graphs, seconds, measured and estimated GiB."""
    capture_seconds: float
    """The graphs' capture (0 without CUDA graphs)."""
    device_name: str
    av_curve: tuple[tuple[int, ...], tuple[float, ...]] | None = None
    decode_costs: dict[str, dict[int, list[tuple[int, float]]]] | None = None
    """``"auto"`` tiers: every runner's FULL decode replay times ({runner: {q: [(requests, ms), ...]}})."""
    cuda_graphs: bool = True
    """False: the static-buffer backend (the CPU): the graphs' closures run eagerly on the padded buffers, nothing
    is captured."""
    ready_seconds: float = 0.0
    """From the start of the model's loading to this message (loading, KV cache sizing, capture, warm-up)."""
    startup: dict[str, float] = {}
    """Seconds of each start-up phase in the worker (``dispatcher.runtime.process.STARTUP_PHASES``)."""
    capture_progress: CaptureProgress | None = None
    """Delayed capture: the graphs captured when the worker became ready (None: all were, before)."""
    grid_cost: dict | None = None
    """``fit_cudagraph_capture_sizes``: the measured step cost the grids were fitted to (``gridfit.StepCost``'s
    JSON), from which the engine resolves the same plan."""
    plan_hash: str = ""
    """The capture plan's hash (``models.parallel.check_same_plan``): the ranks of a tensor-parallel group must all
    report the same one."""
    rank: int = 0
    """The tensor-parallel rank that answered."""


class WorkerError(msgspec.Struct, array_like=True, frozen=True, tag="error"):
    """A step (or the start-up) failed in the worker: the requests of that step fail, the worker goes on."""

    step_id: int
    """-1: start-up."""
    message: str


ToWorker = Step | Shutdown
ToEngine = StepResult | WorkerReady | WorkerError | CaptureProgress

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_init = msgspec.msgpack.Decoder(WorkerInit)


def encode(message: ToWorker | StepResult | WorkerInit | WorkerReady | WorkerError | CaptureProgress) -> bytes:
    return _encoder.encode(message)


def decode_to_worker(data: bytes) -> Step | Shutdown:
    """A message for the worker; msgspec.ValidationError / DecodeError on anything else (never pickle)."""
    return _to_worker.decode(data)


def decode_to_engine(data: bytes) -> StepResult | WorkerReady | WorkerError | CaptureProgress:
    return _to_engine.decode(data)


def decode_init(data: bytes) -> WorkerInit:
    return _init.decode(data)


def decode_or_refuse(decode, frame: bytes, log, where: str):
    """``decode(frame)``, or None with a warning naming ``where`` for a frame that is not a message: it is dropped
    (only our processes and this user's reach the sockets, whose directory is private; a dropped frame costs a
    wait, where an exception would cost every request in flight)."""
    try:
        return decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("refused a malformed frame of %d bytes on %s: %s", len(frame), where, exc)
        return None
