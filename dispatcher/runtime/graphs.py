"""The graph runtime: capture every graph of a runner's plan and replay them (SPEC section 6).

- Static buffers live in one place (``StaticBuffers``), sized for the widest graph; a graph of S tokens reads
  and writes their first S rows. Replay copies the step's real rows in from the device (the worker builds them
  there), pads the rest (slot -1, position -1), lays out the per-request attention metadata (query starts,
  sequence lengths, block-table rows) for S tokens and R requests after them (``StaticBuffers.inputs``), replays,
  and returns a view of the real rows of the output.
- FULL graphs hold the whole forward, attention included, over the metadata buffers: uniform decode (n
  requests at q tokens each, S = n * q, R = n) and varlen (adaptive verification, or every batch in mode FULL:
  S tokens, R = min(S, max_num_reqs + 1), one slot more than a step can fill so that padded rows always have a
  padded request to belong to). A graph's (S, R, query-length bound) is fixed, so are its attention launches.
- PIECEWISE graphs are the pieces between attention calls: piece 0 is the embedding and layer 0 up to its
  attention (its KV write included: padded rows have slot -1), piece i finishes layer i - 1 and prepares layer
  i, the last piece finishes the last layer. Attention runs eagerly between them on the real rows only. Pieces
  exchange tensors through the static buffers, so no piece output outlives its replay.
- Capture: one memory pool per device shared by every runner and kind, largest size first, Python GC frozen,
  a progress bar; per kind, graph count, seconds and measured memory are logged. Memory is estimated first
  (per kind, the largest size and the median size captured into a throwaway pool, extrapolated; see
  ``estimate_memory``) and measured after.
- CPU: no CUDA graphs; the same closures run eagerly on the same padded static buffers, so dispatch, padding
  and output slicing are exercised identically in tests.
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from dispatcher.plan.dispatch import MODE_FULL, MODE_PIECEWISE, BatchDescriptor, GraphKey
from dispatcher.plan.capture_plan import FULL, FULL_DECODE, FULL_VARLEN, PIECEWISE, GraphSet
from models.attention_metadata import AttentionMetadata, RequestLayout, pack_requests
from models.fused import advance_inputs, programmatic_launch, use_triton

log = logging.getLogger("twogrid.runtime")

EAGER_WARM_UP_TOKENS = (1, 17, 33, 65, 193, 257, 1025)
"""Token counts of the warm-up's eager forwards: past each size at which a kernel's launch choice changes (the MoE
router's padded token count at 16 / 32 / 64, its tile height at 16 / 48 rows an expert for 8-of-32 routing,
programmatic launches at 256 tokens, the fused MoE's limit of 1024), and the step budget."""

CAP_FIELD = {
    PIECEWISE: "max_prefill_cudagraph_capture_tokens",
    FULL: "max_prefill_cudagraph_capture_tokens (mode FULL) or max_full_mixed_cudagraph_capture_tokens",
    FULL_DECODE: "max_decode_cudagraph_capture_requests (or max_decode_cudagraph_capture_tokens)",
    FULL_VARLEN: "max_decode_cudagraph_capture_requests (the adaptive-verification cap is it times 1 + K)",
}
_POOLS: dict[int, tuple[object, object]] = {}
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


INPUT_ROWS = ("input_ids", "positions", "slot_mapping", "token_req", "token_pos")
"""A step's per-token inputs, in their order in ``StaticBuffers.inputs``."""
_PAD_ROWS = np.array([[0], [0], [-1], [0], [-1]], dtype=np.int64)
"""Padding for each of INPUT_ROWS: slot -1 (no KV write), position -1 (attends to nothing)."""


class CaptureOOMError(RuntimeError):
    """Out of GPU memory while capturing: names the graph and the cap to lower."""


def shared_pool(device: torch.device):
    """The one graph memory pool of a device, shared by every runner and kind for the life of the process.
    A one-op keeper graph holds the pool, so that it survives runtimes whose graphs are all released."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _POOLS:
        pool = torch.cuda.graph_pool_handle()
        scratch = torch.zeros(1, device=device)
        keeper = torch.cuda.CUDAGraph()
        with torch.cuda.graph(keeper, pool=pool):
            scratch.add_(1)
        _POOLS[index] = (pool, keeper)
    return _POOLS[index][0]


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one capture stream of a device, for every runtime, the estimate included. Libraries keep per-stream
    state (cuBLAS a workspace of tens of MiB per stream); a new stream per capture would pay it again each time,
    inside the graph pool."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[index]


def free_device_bytes(device: torch.device) -> int:
    """Free device memory once the caching allocator has returned its idle blocks (graph pools stay held)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


@dataclass
class StaticBuffers:
    """Every tensor a graph reads or writes, sized for the widest graph."""

    inputs: torch.Tensor
    """(5 * max_num_tokens + 3 * request_capacity + 1,) int64. A step padded to S rows and R requests packs its
    INPUT_ROWS at the start, five consecutive runs of S (``rows(S)``), then its per-request attention metadata
    (``requests(S, R)``: query starts (R + 1), sequence lengths (R), block-table rows (R)), so that everything
    arrives in one host-to-device copy and a graph reads it where it lands; nothing is copied on the device."""
    request_capacity: int
    """The most requests a step's metadata can hold (a graph's request slots, padded ones included)."""
    block_table: torch.Tensor
    """(max_num_reqs, max_blocks_per_seq): row = the scheduler's slot, updated by deltas."""
    residual: torch.Tensor
    q: torch.Tensor
    attn_out: torch.Tensor
    hidden_out: torch.Tensor
    aux: torch.Tensor | None
    """(max_num_tokens, width): a drafter's second input (target features, or its own), None for a target."""
    aux_out: torch.Tensor | None = None
    """(max_num_tokens, len(aux_layers) * hidden): a target's residual stream at the layer boundaries an EAGLE-3
    head reads (``CausalLM.aux_layers``), written inside every graph; None when no head reads them."""
    proposals: tuple[torch.Tensor, torch.Tensor] | None = None
    """A runtime that proposes (``GraphRuntime(proposes=True)``): per row, its greedy token (int64) and that
    token's probability (float32), written inside the graph after the forward."""

    @classmethod
    def allocate(cls, cfg, max_num_tokens: int, max_num_reqs: int, max_blocks_per_seq: int, dtype, device,
                 aux_size: int = 0, request_capacity: int | None = None, proposes: bool = False, aux_out_size: int = 0,
                 block_table: torch.Tensor | None = None):
        t = max_num_tokens
        capacity = request_capacity or max_num_reqs + 1
        z = lambda *shape, dt=dtype: torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
        return cls(
            inputs=z(input_length(t, capacity), dt=torch.int64), request_capacity=capacity,
            block_table=block_table if block_table is not None else
            torch.full((max_num_reqs, max_blocks_per_seq), -1, dtype=torch.int32, device=device),
            residual=z(t, cfg.hidden_size), q=z(t, cfg.num_heads, cfg.head_dim),
            attn_out=z(t, cfg.num_heads, cfg.head_dim),
            hidden_out=z(t, cfg.hidden_size), aux=z(t, aux_size) if aux_size else None,
            aux_out=z(t, aux_out_size) if aux_out_size else None,
            proposals=(z(t, dt=torch.int64), z(t, dt=torch.float32)) if proposes else None,
        )

    def rows(self, num_tokens: int) -> torch.Tensor:
        """(5, num_tokens) view: the INPUT_ROWS of a step padded to num_tokens."""
        return self.inputs[:len(INPUT_ROWS) * num_tokens].view(len(INPUT_ROWS), num_tokens)

    def requests(self, num_tokens: int, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of a step's per-request metadata (query starts, sequence lengths, block-table rows), packed after
        the INPUT_ROWS of num_tokens rows."""
        start = len(INPUT_ROWS) * num_tokens
        flat = self.inputs[start:start + 3 * num_reqs + 1]
        return flat[:num_reqs + 1], flat[num_reqs + 1:2 * num_reqs + 1], flat[2 * num_reqs + 1:]

    def meta(self, num_tokens: int, num_reqs: int, max_query_len: int,
             max_seq_len: int | None = None) -> AttentionMetadata:
        _, _, slots, token_req, token_pos = self.rows(num_tokens)
        return AttentionMetadata(slots, token_req, token_pos, self.block_table, *self.requests(num_tokens, num_reqs),
                                 max_query_len, max_seq_len)

    def nbytes(self) -> int:
        tensors = [t for t in vars(self).values() if isinstance(t, torch.Tensor)] + list(self.proposals or ())
        return sum(t.numel() * t.element_size() for t in tensors)


def input_length(num_tokens: int, num_reqs: int) -> int:
    """Entries of ``StaticBuffers.inputs`` a step of num_tokens rows and num_reqs requests fills."""
    return len(INPUT_ROWS) * num_tokens + 3 * num_reqs + 1


class Replayable:
    """A captured CUDA graph, or (CPU, or capture disabled) the closure itself run eagerly."""

    __slots__ = ("fn", "graph")

    def __init__(self, fn: Callable[[], None]):
        self.fn, self.graph = fn, None

    @classmethod
    def captured(cls, fn: Callable[[], None], pool, stream) -> "Replayable":
        """A new graph of ``fn``, captured."""
        graph = cls(fn)
        graph.capture(pool, stream)
        return graph

    def capture(self, pool, stream, between_steps: bool = False) -> None:
        """Capture ``fn`` (after one eager run outside the graph: it compiles kernels, creates handles). The graph
        is replayed only once whole: ``graph`` is set last. ``between_steps`` (delayed capture, while serving):
        no device synchronization or cache emptying first (steps may still run; the recording waits for nothing)
        and the capture mode is thread-local, so that the worker's other thread, waiting for a step's result, is
        free to synchronize on its event meanwhile."""
        self.fn()
        graph = torch.cuda.CUDAGraph()
        if between_steps:
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    self.fn()
                except BaseException:
                    with suppress(RuntimeError):  # (the capture is invalid: end it, and report the first error)
                        graph.capture_end()
                    raise
                graph.capture_end()
        else:
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.fn()
        self.graph = graph

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


@dataclass
class KindReport:
    runner: str
    kind: str
    q: int | None
    graphs: int
    seconds: float
    measured_gib: float
    estimated_gib: float | None = None
    estimate_samples_gib: tuple[float, ...] = ()
    """(growth from the largest graph, per-graph growth of the median size, the allocator pool's part of that
    per-graph growth) in the throwaway pool; the rest of a graph's growth is the driver's (its executable)."""
    pool_gib: float | None = None
    """Of measured_gib, what the caching allocator holds for the graph pool; the rest is the driver's (graph
    executables)."""
    size_growth_gib: tuple[float, ...] = ()
    """With ``capture(trace_memory=True)``: device memory each size took, largest first (a diagnostic)."""


@dataclass
class CaptureReport:
    kinds: list[KindReport] = field(default_factory=list)
    buffers_gib: float = 0.0
    estimate_seconds: float = 0.0

    @property
    def measured_gib(self) -> float:
        return sum(k.measured_gib for k in self.kinds)

    @property
    def estimated_gib(self) -> float:
        return sum(k.estimated_gib or 0.0 for k in self.kinds)

    @property
    def seconds(self) -> float:
        return sum(k.seconds for k in self.kinds)


def _graph_tokens(g: GraphSet, size: int) -> int:
    return size * g.q if g.kind == FULL_DECODE else size


Layout = tuple[int, int | None, int | None]
"""A graph's (tokens, request slots, query-length bound); PIECEWISE: (tokens, None, None), its eager attention
takes each step's own requests."""


def _graph_layout(g: GraphSet, size: int, max_num_reqs: int) -> Layout:
    tokens = _graph_tokens(g, size)
    if g.kind == FULL_DECODE:
        return tokens, size, g.q
    if g.kind == PIECEWISE:
        return tokens, None, None
    return tokens, min(tokens, max_num_reqs + 1), tokens


class GraphRuntime:
    """Runs one model (a runner) for any BatchDescriptor of its plan."""

    def __init__(self, model, kv_caches: list[torch.Tensor], graph_sets: Iterable[GraphSet], *, max_num_tokens: int,
                 max_num_reqs: int, max_blocks_per_seq: int, runner: str = "target", use_cuda_graphs: bool = True,
                 proposes: bool = False, aux_size: int | None = None, block_table: torch.Tensor | None = None):
        """``proposes``: every forward also takes each row's greedy token and its probability from the model's
        logits, inside the graph (``proposals``): an EAGLE drafter's one-token steps, whose every row proposes.
        ``aux_size``: the width of a drafter's second input (default: its hidden size). ``block_table``: another
        runtime's (max_num_reqs, max_blocks_per_seq) table, shared (a drafter's KV sits in the same blocks as its
        target's); default: its own."""
        self.model = model
        self.kv_caches = kv_caches
        self.runner = runner
        self.device = kv_caches[0].device
        self.cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        self.graph_sets = [g for g in graph_sets if g.sizes]
        widest = max((_graph_tokens(g, g.largest) for g in self.graph_sets), default=0)
        self.max_num_tokens = max(max_num_tokens, widest)
        self.max_num_reqs = max_num_reqs
        self.layouts = {GraphKey(g.kind, g.q, size): _graph_layout(g, size, max_num_reqs)
                        for g in self.graph_sets for size in g.sizes}
        capacity = max([max_num_reqs + 1] + [reqs for _, reqs, _ in self.layouts.values() if reqs])
        self.bufs = StaticBuffers.allocate(model.cfg, self.max_num_tokens, max_num_reqs, max_blocks_per_seq,
                                           model.dtype, self.device,
                                           aux_size=(aux_size or model.cfg.hidden_size) if model.needs_aux else 0,
                                           request_capacity=capacity, proposes=proposes,
                                           aux_out_size=len(model.aux_layers) * model.cfg.hidden_size,
                                           block_table=block_table)
        self.graphs: dict[GraphKey, list[Replayable]] = {}
        self.captured: set[GraphKey] = set()
        """Graphs captured whole (every piece of a PIECEWISE size): what delayed capture lets a step replay."""
        self.report = CaptureReport(buffers_gib=self.bufs.nbytes() / 2**30)
        self._kind_estimates: dict[tuple[str, int | None], float] = {}
        self._estimate_samples: dict[tuple[str, int | None], tuple[float, ...]] = {}
        self._primed = False
        self._pad_rows = torch.from_numpy(_PAD_ROWS).to(self.device).expand(-1, self.max_num_tokens)
        self._counts = torch.arange(max(capacity, self.max_num_tokens) + 1, device=self.device)
        """0, 1, ..., the widest step's tokens: padded requests' query starts and zeros are views of it."""
        self._build_closures()

    # -- closures over the static buffers --------------------------------------------------------------------
    def _full(self, num_tokens: int, num_reqs: int, max_query_len: int, max_seq_len: int | None = None,
              graph: bool = False) -> Callable[[], None]:
        """The whole forward over the static buffers' first num_tokens rows and num_reqs requests. A graph's
        closure (``graph``) takes the graph's bounds (``max_seq_len`` None: the block table's width); eager, the
        step's own. A proposing runtime's graph then also proposes and advances its inputs to the next step."""
        b, model = self.bufs, self.model
        advance = graph and b.proposals is not None

        def run() -> None:
            aux = b.aux[:num_tokens] if b.aux is not None else None
            input_ids, positions = b.rows(num_tokens)[:2]
            meta = b.meta(num_tokens, num_reqs, max_query_len, max_seq_len)
            aux_out = b.aux_out[:num_tokens] if b.aux_out is not None else None
            hidden = model(input_ids, positions, self.kv_caches, meta, aux, aux_out)
            b.hidden_out[:num_tokens].copy_(hidden)
            self._propose(num_tokens)
            if advance:
                self._advance_inputs(num_tokens, num_reqs)

        return run

    def _advance_inputs(self, num_tokens: int, num_reqs: int) -> None:
        """Inside a proposing runtime's FULL graph, after its proposals: its inputs become the next one-token step
        of the same requests (``execute_next``): each row's token is its proposal and its feature this step's
        output; real rows move one position on (their KV slot looked up again), real requests one token longer;
        padded rows and requests (position -1, slot -1, sequence length 0) stay padded. With Triton one kernel."""
        b = self.bufs
        if use_triton(b.inputs):
            advance_inputs(b.inputs, b.proposals[0], num_tokens, num_reqs, b.block_table, self.block_size)
        else:
            rows = b.rows(num_tokens)
            rows[0].copy_(b.proposals[0][:num_tokens])
            live = rows[1] >= 0
            positions = torch.where(live, rows[1] + 1, rows[1])
            rows[2].copy_(torch.where(live & (rows[2] >= 0), self.kv_slots(rows[3], positions.clamp(min=0)), -1))
            rows[1::3].copy_(positions.expand(2, num_tokens))  # positions and token positions (INPUT_ROWS 1 and 4)
            seq_lens = b.requests(num_tokens, num_reqs)[1]
            seq_lens.copy_(torch.where(seq_lens > 0, seq_lens + 1, seq_lens))
        if b.aux is not None:
            b.aux[:num_tokens].copy_(b.hidden_out[:num_tokens])

    def _propose(self, num_tokens: int) -> None:
        """A proposing runtime's greedy tokens and their probabilities for the first num_tokens rows."""
        if self.bufs.proposals is not None:
            ids, probs = self.bufs.proposals
            self.model.propose(self.bufs.hidden_out[:num_tokens], out=(ids[:num_tokens], probs[:num_tokens]))

    def features(self, num_tokens: int) -> torch.Tensor:
        """The last execute's residual-stream features (``StaticBuffers.aux_out``) of its num_tokens real rows."""
        return self.bufs.aux_out[:num_tokens]

    def proposals(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last execute's proposals (greedy tokens, their probabilities) for its num_tokens real rows (views of
        static buffers, valid until the next execute)."""
        ids, probs = self.bufs.proposals
        return ids[:num_tokens], probs[:num_tokens]

    def _piece(self, index: int, num_tokens: int) -> Callable[[], None]:
        b, model, n = self.bufs, self.model, num_tokens
        last = model.num_layers
        norm = model.next_norms()[index - 1] if index else None  # (the norm that ends the previous layer)

        def run() -> None:
            input_ids, positions, slots = b.rows(n)[:3]
            if index == 0:
                x, residual = model.begin(input_ids, b.aux[:n] if b.aux is not None else None)
            else:
                x, residual = model.layers[index - 1].post_attention(b.attn_out[:n], b.residual[:n], norm)
            model.keep_aux(b.aux_out[:n] if b.aux_out is not None else None, index, residual)
            if index < last:
                # the KV write happens here, inside the graph (padded rows: slot -1, nothing stored)
                q = model.layers[index].pre_attention(x, positions, model.rotary, self.kv_caches[index], slots)
                b.q[:n].copy_(q)
                b.residual[:n].copy_(residual)
            else:
                b.hidden_out[:n].copy_(x)
                self._propose(n)

        return run

    def _attention_runner(self, num_tokens: int, num_real: int | None, layout: RequestLayout) -> Callable[[int], None]:
        """Eager attention for the first ``num_real`` rows (None: all) of each layer of a step padded to
        ``num_tokens`` rows, whose per-request metadata (``layout``) covers exactly those rows, between PIECEWISE
        pieces (each piece has already written its K and V): prepared once a step (row views, metadata, launch
        arguments; the step's own longest query and sequence pick tiles and splits), so a layer costs its launches
        only; the output lands in ``attn_out``."""
        b, n = self.bufs, num_tokens if num_real is None else num_real
        meta = b.meta(num_tokens, layout.num_reqs, max(layout.max_query_len, 1), layout.max_seq_len or None).narrow(n)
        return self.model.prepare_attention(b.q[:n], self.kv_caches, meta, b.attn_out[:n])

    def _build_closures(self) -> None:
        for g in self.graph_sets:
            for size in g.sizes:
                key = GraphKey(g.kind, g.q, size)
                tokens, reqs, bound = self.layouts[key]
                if g.kind == PIECEWISE:
                    self.graphs[key] = [Replayable(self._piece(i, tokens)) for i in range(self.model.num_layers + 1)]
                else:
                    self.graphs[key] = [Replayable(self._full(tokens, reqs, bound, graph=True))]

    # -- capture ---------------------------------------------------------------------------------------------
    def _capture_order(self) -> list[GraphSet]:
        """Kinds widest first, so that narrower graphs reuse the pool the widest ones grew."""
        return sorted(self.graph_sets, key=lambda s: -_graph_tokens(s, s.largest))

    def _reset_metadata(self, key: GraphKey) -> RequestLayout:
        """Safe inputs for warm-up and capture of a graph: every row padded (no KV write; attention writes zeros),
        in the graph's layout (PIECEWISE: one padded request holding every row)."""
        tokens, reqs, bound = self.layouts[key]
        return self._load_host(np.zeros((4, 0), dtype=np.int64), tokens, reqs or 1, bound or tokens)

    def capture_order(self) -> list[GraphKey]:
        """Every graph, in capture order: kinds widest first (``_capture_order``), each largest size first."""
        return [GraphKey(g.kind, g.q, size) for g in self._capture_order() for size in sorted(g.sizes, reverse=True)]

    def capture_key(self, key: GraphKey, between_steps: bool = False) -> None:
        """Capture one size's graph into the shared pool and mark it captured (``captured``): delayed capture's
        unit. On the CPU (no CUDA graphs) only the mark."""
        if self.cuda_graphs:
            pool, stream = shared_pool(self.device), capture_stream(self.device)
            self._prime_capture_stream(stream)
            g = next(g for g in self.graph_sets if (g.kind, g.q) == (key.kind, key.q))
            self._capture_one(g, key.size, pool, stream, between_steps=between_steps)
        self.captured.add(key)

    def _capture_one(self, g: GraphSet, size: int, pool, stream, pieces: list[Replayable] | None = None,
                     between_steps: bool = False) -> None:
        """Capture one size's graph (the pieces of a PIECEWISE size, attention run between them); by default the
        runtime's own, or ``pieces`` (a throwaway copy for the estimate). Out of memory raises CaptureOOMError."""
        tokens = _graph_tokens(g, size)
        if pieces is None:
            pieces = self.graphs[GraphKey(g.kind, g.q, size)]
        layout = self._reset_metadata(GraphKey(g.kind, g.q, size))
        attention = self._attention_runner(tokens, None, layout) if g.kind == PIECEWISE else None
        try:
            for i, piece in enumerate(pieces):
                piece.capture(pool, stream, between_steps)
                if g.kind == PIECEWISE and i < self.model.num_layers:
                    attention(i)
        except torch.cuda.OutOfMemoryError:
            q = f" at q = {g.q}" if g.q is not None else ""
            raise CaptureOOMError(
                f"out of GPU memory capturing the {self.runner} {g.kind} graph for {size} {g.unit}{q} ({tokens} "
                f"tokens): lower {CAP_FIELD[g.kind]} (largest {g.kind} size now {g.largest}), or leave more memory "
                f"(a smaller KV cache or max_num_seqs)"
            ) from None

    def prime_capture_stream(self) -> None:
        """``_prime_capture_stream`` on the device's capture stream (delayed capture does it before serving)."""
        self._prime_capture_stream(capture_stream(self.device))

    def _prime_capture_stream(self, stream: torch.cuda.Stream) -> None:
        """Run the smallest graph of each kind once, eagerly, on the capture stream, so that libraries create their
        per-stream state (cuBLAS's workspace) here, in the ordinary allocator, not inside the first capture where
        it would count as graph memory (and inflate the estimate's first sample). Once per runtime."""
        if self._primed:
            return
        self._primed = True
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for g in self.graph_sets:
                self._reset_metadata(GraphKey(g.kind, g.q, min(g.sizes)))
                try:
                    for piece in self.graphs[GraphKey(g.kind, g.q, min(g.sizes))]:
                        piece.fn()
                except torch.cuda.OutOfMemoryError:
                    raise CaptureOOMError(
                        f"out of GPU memory preparing the {self.runner} graphs (the smallest {g.kind} graph, "
                        f"{min(g.sizes)} {g.unit}, run once on the capture stream): no graph fits; leave more memory "
                        f"(a smaller KV cache or max_num_seqs)") from None
        current.wait_stream(stream)

    def estimate_memory(self) -> float:
        """GiB the plan's graphs will take (``estimate_kind_memory`` per kind, kinds in capture order, one
        throwaway pool for all)."""
        if not self.cuda_graphs:
            return 0.0
        start = time.perf_counter()
        pool, keep = torch.cuda.graph_pool_handle(), []
        self._prime_capture_stream(capture_stream(self.device))
        est = 0.0
        with frozen_gc():
            for g in self._capture_order():
                samples: list[float] = []
                copies = [self._copy_capture(g, size) for size in sorted(g.sizes, reverse=True)]
                kind_gib = estimate_kind_memory(self.device, copies, pool, keep, samples) / 2**30
                self._kind_estimates[(g.kind, g.q)] = kind_gib
                self._estimate_samples[(g.kind, g.q)] = tuple(x / 2**30 for x in samples)
                est += kind_gib
        del keep, pool
        gc.collect()
        free_device_bytes(self.device)
        self.report.estimate_seconds = time.perf_counter() - start
        return est

    def _copy_capture(self, g: GraphSet, size: int) -> Callable[[object, object], list]:
        """A function (pool, stream) that captures a fresh copy of one size's graph (for the estimate)."""
        def capture(pool, stream) -> list:
            pieces = [Replayable(p.fn) for p in self.graphs[GraphKey(g.kind, g.q, size)]]
            self._capture_one(g, size, pool, stream, pieces)
            return pieces

        return capture

    @torch.inference_mode()
    def capture(self, progress: bool = True, estimate: bool = True, trace_memory: bool = False,
                pool=None) -> CaptureReport:
        """Capture every graph, largest first per kind; on the CPU this only readies the closures. ``pool``: a
        graph memory pool of the caller's (default: the device's shared pool)."""
        if not self.cuda_graphs:
            self.report.kinds = [KindReport(self.runner, g.kind, g.q, len(g.sizes), 0.0, 0.0) for g in self.graph_sets]
            self.captured = set(self.layouts)
            return self.report
        if estimate:
            self.estimate_memory()
        pool, stream = pool or shared_pool(self.device), capture_stream(self.device)
        self._prime_capture_stream(stream)
        total = sum(len(g.sizes) for g in self.graph_sets)
        bar = progress_bar(total, f"capturing {self.runner} graphs", progress)
        with frozen_gc():
            for g in self._capture_order():
                free0 = free_device_bytes(self.device)
                reserved0 = torch.cuda.memory_reserved(self.device)
                start = time.perf_counter()
                growth = []
                for size in sorted(g.sizes, reverse=True):
                    before = free_device_bytes(self.device) if trace_memory else 0
                    self._capture_one(g, size, pool, stream)
                    self.captured.add(GraphKey(g.kind, g.q, size))
                    if trace_memory:
                        growth.append((before - free_device_bytes(self.device)) / 2**30)
                    bar.update(1)
                used = (free0 - free_device_bytes(self.device)) / 2**30
                pool_gib = (torch.cuda.memory_reserved(self.device) - reserved0) / 2**30
                kr = KindReport(self.runner, g.kind, g.q, len(g.sizes), time.perf_counter() - start, used,
                                self._kind_estimates.get((g.kind, g.q)), self._estimate_samples.get((g.kind, g.q), ()),
                                pool_gib, tuple(growth))
                self.report.kinds.append(kr)
                log.info("captured %d %s %s graphs%s in %.1f s, %.3f GiB (estimated %s)", kr.graphs, self.runner,
                         g.kind, f" at q={g.q}" if g.q else "", kr.seconds, kr.measured_gib,
                         f"{kr.estimated_gib:.3f} GiB" if kr.estimated_gib is not None else "-")
        bar.close()
        return self.report

    def eager_warm_up_tokens(self) -> list[int]:
        """Token counts of the warm-up's eager forwards (``EAGER_WARM_UP_TOKENS`` and the widest step), within this
        runtime's widest forward: a proposing runtime (one row a request) never runs more rows than requests."""
        widest = self.max_num_reqs if self.bufs.proposals is not None else self.max_num_tokens
        return sorted({min(n, widest) for n in EAGER_WARM_UP_TOKENS + (widest,)})

    @property
    def context_width(self) -> int:
        """The block table's width in tokens: the longest sequence a request can hold."""
        return self.bufs.block_table.shape[1] * self.block_size

    def eager_attention_shapes(self, within_tokens: int | None = None) -> list[tuple[int, int, bool]]:
        """The eager attention launches that compile every variant a step can need (``eager_launch_shapes``:
        query-length bound, split count, programmatic launch); with ``within_tokens``, those of steps of at most that
        many tokens over sequences of at most that many (delayed capture's first steps: no context is long enough
        yet for the wider splits' merges). Empty off CUDA (no Triton there: it may not be installed)."""
        if self.device.type != "cuda":
            return []
        from models.triton_attention import eager_launch_shapes, sm_count

        cfg = self.model.cfg
        max_tokens, max_context = self.max_num_tokens, self.context_width
        if within_tokens is not None:
            max_tokens, max_context = min(max_tokens, within_tokens), min(max_context, within_tokens)
        return eager_launch_shapes(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, max_tokens, max_context,
                                   sm_count(self.device))

    @torch.inference_mode()
    def warm_up_eager(self, forwards: list[int] | None = None,
                      attention: list[tuple[int, int, bool]] | None = None) -> int:
        """Launch, over padded rows, what eager steps can launch, so that Triton compiles it now rather than stall
        a served step (~0.5 s a kernel variant): eager attention's variants (between PIECEWISE pieces, or in an
        eager step: ``attention``, default every one, ``eager_attention_shapes``), and whole eager forwards at token
        counts on each side of every size threshold of the other kernels' launch choices (``forwards``, default
        ``eager_warm_up_tokens``). Later starts load the kernels from Triton's disk cache. The number of launches
        (0 on the CPU)."""
        if self.device.type != "cuda":
            return 0
        from models.triton_attention import prepare_paged_attention

        b, max_context = self.bufs, self.context_width
        shapes = self.eager_attention_shapes() if attention is None else attention
        for max_query_len, splits, pdl in shapes:
            layout = self._load_host(np.zeros((4, 0), dtype=np.int64), max_query_len, 1, max_query_len)
            meta = b.meta(max_query_len, layout.num_reqs, max_query_len, max_context)
            with programmatic_launch(pdl):
                prepare_paged_attention(b.q[:max_query_len], self.kv_caches[0], meta, self.model.scale,
                                        b.attn_out[:max_query_len], num_kv_splits=splits)(self.kv_caches[0])
        forwards = self.eager_warm_up_tokens() if forwards is None else forwards
        for num_tokens in forwards:
            layout = self._load_host(np.zeros((4, 0), dtype=np.int64), num_tokens, 1, num_tokens)
            self._full(num_tokens, layout.num_reqs, num_tokens)()
        torch.cuda.synchronize(self.device)
        return len(shapes) + len(forwards)

    @torch.inference_mode()
    def measure_step_ms(self, kind: str, repeats: int = 5) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
        """The median replay time (ms) of every captured size of a token-keyed kind (adaptive verification's
        cost curve), or None without such graphs. Every row is padding while it runs, so attention costs
        nothing here: the curve is the step's cost without context."""
        sets = [g for g in self.graph_sets if g.kind == kind and g.unit == "tokens" and len(g.sizes) >= 2]
        if not sets:
            return None
        sizes = tuple(sets[0].sizes)
        return sizes, tuple(self._replay_ms(GraphKey(kind, sets[0].q, size), repeats) for size in sizes)

    @torch.inference_mode()
    def measure_decode_ms(self, repeats: int = 5) -> dict[int, list[tuple[int, float]]]:
        """The median replay time (ms) of every captured FULL decode graph, by q: {q: [(requests, ms), ...]} (the
        ``"auto"`` tiers' step costs; {} without such graphs). As ``measure_step_ms``, every row is padding: the
        cost without attention over context."""
        out: dict[int, list[tuple[int, float]]] = {}
        for g in self.graph_sets:
            if g.kind == FULL_DECODE and g.sizes:
                out[g.q] = [(size, self._replay_ms(GraphKey(FULL_DECODE, g.q, size), repeats)) for size in g.sizes]
        return out

    def _replay_ms(self, key: GraphKey, repeats: int) -> float:
        """The median of ``repeats`` timed replays of one graph over padded inputs (after one to warm;
        ``padded_replay``)."""
        return replay_ms(self.padded_replay(key), self.device, repeats)

    def padded_replay(self, key: GraphKey) -> Replayable:
        """One graph's replay over padded inputs, its metadata reset now: a PIECEWISE size's pieces with eager
        attention between them, over one padded request (every row padding, so attention costs its launches only:
        the step's cost without context). Safe between steps: it writes no KV of a request."""
        layout = self._reset_metadata(key)
        if key.kind != PIECEWISE:
            return self.graphs[key][0]
        pieces, attention = self.graphs[key], self._attention_runner(key.size, None, layout)

        def step() -> None:
            for i, piece in enumerate(pieces):
                piece.replay()
                if i < len(pieces) - 1:
                    attention(i)

        return Replayable(step)

    @torch.inference_mode()
    def measure_sizes_ms(self, repeats: int = 5) -> dict[tuple[str, int | None], list[tuple[int, float]]]:
        """The median replay time (ms) of every graph of the plan (``_replay_ms``), {(kind, q): [(size, ms), ...]}:
        the step-cost curves fitted grids come from (``fit_cudagraph_capture_sizes``)."""
        return {(g.kind, g.q): [(size, self._replay_ms(GraphKey(g.kind, g.q, size), repeats)) for size in g.sizes]
                for g in self.graph_sets}

    # -- replay ----------------------------------------------------------------------------------------------
    def inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, token_rows: torch.Tensor,
               query_start: torch.Tensor, seq_lens: torch.Tensor, req_rows: torch.Tensor, max_query_len: int,
               max_seq_len: int, kv_slots: torch.Tensor | None = None) -> "StepInputs":
        """A forward's inputs from device tensors: per token its id, position and block-table row (its KV slot is
        looked up here, unless given: ``kv_slots``); per request its query start, sequence length (context with
        this step's tokens) and block-table row; host-side bounds on the query and sequence lengths."""
        if kv_slots is None:
            kv_slots = self.kv_slots(token_rows, positions)
        return StepInputs((input_ids, positions, kv_slots, token_rows), query_start, seq_lens, req_rows,
                          max_query_len, max_seq_len)

    def iota(self, n: int) -> torch.Tensor:
        """0, 1, ..., n - 1 on the device, a view of a constant buffer (no launch) as far as it reaches."""
        return self._counts[:n] if n < len(self._counts) else torch.arange(n, device=self.device)

    @property
    def block_size(self) -> int:
        """Tokens a KV-cache block holds."""
        return self.kv_caches[0].shape[2]

    def kv_slots(self, token_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The KV-cache slot of each (block-table row, position), any shape."""
        bs = self.block_size
        return torch.add(positions % bs, self.bufs.block_table[token_rows, positions // bs], alpha=bs)  # (int64)

    def load_inputs(self, inputs: "StepInputs", num_tokens: int, num_reqs: int | None = None,
                    max_query_len: int | None = None) -> RequestLayout:
        """Copy a step's inputs into the static buffers, on the device. Rows num_real..num_tokens become padding
        (slot -1, position -1). With ``num_reqs`` (a FULL graph's request slots and query-length bound) the
        per-request metadata covers all num_tokens rows: padded rows in padded requests (sequence length 0), in
        runs of at most ``max_query_len`` rows, the last taking the rest (as ``models.attention.pack_requests``
        lays them out); without, exactly the real requests over the real rows (eager attention). One launch: the
        buffer's every section concatenated into it, the padding from views of constant buffers."""
        n, r = inputs.num_tokens, inputs.num_reqs
        reqs = r if num_reqs is None else num_reqs
        if r + (num_tokens > n and num_reqs is not None) > reqs:
            raise ValueError(f"num_reqs: the step's {r} requests and {num_tokens - n} padded rows (which need a "
                             f"padded request) do not fit the graph's {reqs} request slots")
        t, pad = inputs.tokens, self._pad_rows[:, : num_tokens - n]
        zeros = self._counts[:1].expand(reqs - r)
        starts = self._padded_starts(n, reqs - r, max_query_len, num_tokens) if reqs > r else []
        torch.cat([t[0], pad[0], t[1], pad[1], t[2], pad[2], t[3], pad[3], t[1], pad[4],  # INPUT_ROWS
                   inputs.query_start, *starts, inputs.seq_lens, zeros, inputs.req_rows, zeros],
                  out=self.bufs.inputs[: input_length(num_tokens, reqs)])
        return RequestLayout(reqs, r, inputs.max_query_len, inputs.max_seq_len)

    def _padded_starts(self, n: int, k: int, max_query_len: int, num_tokens: int) -> list[torch.Tensor]:
        """The query starts of ``k`` padded requests after ``n`` real rows of ``num_tokens``: min(n + j *
        max_query_len, num_tokens) for j = 1..k - 1, then num_tokens, as views of ``_counts`` (no launch)."""
        below = min(k - 1, max(0, (num_tokens - n - 1) // max_query_len))  # (the starts before num_tokens)
        c = self._counts
        return [c[n + max_query_len : n + max_query_len * below + 1 : max_query_len],
                c[num_tokens : num_tokens + 1].expand(k - below)]

    def _load_host(self, host: np.ndarray, num_tokens: int, num_reqs: int | None = None,
                   max_query_len: int | None = None) -> RequestLayout:
        """``load_inputs`` from host rows (4, num_real) int64 (input ids, positions, KV slots, block-table rows; a
        request's rows contiguous), laid out on the host (``pack_requests``) and copied synchronously: capture's
        safe inputs."""
        num_real = host.shape[1]
        rows = len(INPUT_ROWS)
        flat = np.empty(self.bufs.inputs.shape[0], dtype=np.int64)
        staged = flat[:rows * num_tokens].reshape(rows, num_tokens)
        staged[:4, :num_real] = host
        staged[4, :num_real] = host[1]
        staged[:, num_real:] = _PAD_ROWS
        covered = num_tokens if num_reqs is not None else num_real
        layout = pack_requests(host[3], host[1], flat[rows * num_tokens:], covered, num_reqs, max_query_len)
        length = input_length(num_tokens, layout.num_reqs)
        self.bufs.inputs[:length].copy_(torch.from_numpy(flat[:length]))
        return layout

    def update_block_table(self, rows: np.ndarray, cols: np.ndarray, ids: np.ndarray) -> None:
        if len(rows):
            idx = (torch.from_numpy(np.asarray(rows, np.int64)).to(self.device),
                   torch.from_numpy(np.asarray(cols, np.int64)).to(self.device))
            self.bufs.block_table.index_put_(idx, torch.from_numpy(np.asarray(ids, np.int32)).to(self.device))

    def execute(self, desc: BatchDescriptor, inputs: "StepInputs", aux: torch.Tensor | None = None) -> torch.Tensor:
        """Run a step: its inputs (and a drafter's (num_real, hidden) features) -> final hidden states of the real
        rows (a view of a static buffer, valid until the next execute)."""
        num_real = inputs.num_tokens
        if desc.mode == MODE_FULL:
            self.load_inputs(inputs, *self.layouts[desc.graph])
        else:
            num = desc.num_tokens if desc.mode == MODE_PIECEWISE else num_real
            layout = self.load_inputs(inputs, num)
        if aux is not None:
            self.bufs.aux[:num_real].copy_(aux)
        if desc.mode == MODE_FULL:
            self.graphs[desc.graph][0].replay()
        elif desc.mode == MODE_PIECEWISE:
            pieces = self.graphs[desc.graph]
            attention = self._attention_runner(num, num_real, layout)
            last = len(pieces) - 1
            for i, piece in enumerate(pieces):
                piece.replay()
                if i < last:
                    attention(i)
        else:
            self._full(num_real, layout.num_reqs, layout.max_query_len, layout.max_seq_len)()
        return self.bufs.hidden_out[:num_real]

    def execute_next(self, desc: BatchDescriptor, num_real: int) -> torch.Tensor:
        """The next one-token step of the requests the last ``execute`` ran through ``desc``'s FULL graph, in a
        proposing runtime (an EAGLE drafter's steps 2..K-1): that graph left its inputs advanced
        (``_advance_inputs``: each row's proposal as its token, its output as its feature, one position on), so
        this is the replay alone, with no copy from the host's side."""
        self.graphs[desc.graph][0].replay()
        return self.bufs.hidden_out[:num_real]


@dataclass
class StepInputs:
    """One forward's real rows, on the device."""

    tokens: torch.Tensor | tuple[torch.Tensor, ...]
    """(4, num_tokens) int64, or its four rows: input ids, positions, KV slots, block-table rows (a request's tokens
    contiguous)."""
    query_start: torch.Tensor
    """(num_reqs + 1,) int64: where each request's query starts among the tokens."""
    seq_lens: torch.Tensor
    """(num_reqs,) int64: each request's context including this step's tokens."""
    req_rows: torch.Tensor
    """(num_reqs,) int64: each request's block-table row."""
    max_query_len: int
    """The longest query (host-side, exact)."""
    max_seq_len: int
    """A host-side bound on the longest sequence (eager attention chooses its splits by it)."""

    @property
    def num_tokens(self) -> int:
        return self.tokens[0].shape[0]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def from_host(cls, host: np.ndarray, device) -> "StepInputs":
        """From host rows (4, n): input ids, positions, KV slots, block-table rows, a request's rows contiguous
        (tests and benchmarks)."""
        buf = np.empty(3 * (host.shape[1] + 1) + 1, dtype=np.int64)
        layout = pack_requests(host[3], host[1], buf, host.shape[1])
        r = layout.num_reqs
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)  # noqa: E731
        return cls(to(host), to(buf[: r + 1]), to(buf[r + 1 : 2 * r + 1]), to(buf[2 * r + 1 : 3 * r + 1]),
                   max(layout.max_query_len, 1), layout.max_seq_len)


@contextmanager
def frozen_gc():
    """Python's garbage collector off (and the heap frozen) while graphs are captured."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def gc_off():
    """No collection while a graph is captured between steps (as ``frozen_gc`` at start-up, without its full
    collection: the worker froze its start-up heap): a collection that frees device or pinned memory mid-capture
    can invalidate the capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


ESTIMATE_REPEATS = 16
"""The median-size graph is captured this many times, so that the per-graph growth is measured finer than the
driver's 2 MiB allocation granularity."""


def estimate_kind_memory(device: torch.device, captures: list, pool, keep: list,
                         samples: list | None = None) -> float:
    """Bytes a kind of graphs will take, from copies captured into a throwaway ``pool`` (the copies are appended to
    ``keep``, which the caller drops once every kind is estimated): the largest's growth (it sizes the pool:
    smaller graphs reuse its blocks), plus (count - 1) times the per-graph growth of the median size captured
    ESTIMATE_REPEATS times (what a graph adds once the pool exists: mostly the driver's graph executable, which
    grows with the kernel count, not with the size; the median stands for the many small sizes of a grid better
    than the second largest). ``captures``: per size, widest first, a function (pool, stream) that captures a
    fresh copy of that size's graph and returns it. ``samples`` receives (the largest's growth, the per-graph
    growth, the allocator pool's part of it) in bytes."""
    stream = capture_stream(device)

    def capture(make) -> int:
        free0 = free_device_bytes(device)
        keep.append(make(pool, stream))
        return free0 - free_device_bytes(device)

    first = capture(captures[0])
    per_graph = per_graph_pool = 0.0
    if len(captures) > 1:
        rest = captures[1:]
        repeats = min(ESTIMATE_REPEATS, len(rest))
        free0, reserved0 = free_device_bytes(device), torch.cuda.memory_reserved(device)
        for _ in range(repeats):
            capture(rest[len(rest) // 2])
        per_graph = max(0, free0 - free_device_bytes(device)) / repeats
        per_graph_pool = max(0, torch.cuda.memory_reserved(device) - reserved0) / repeats
    if samples is not None:
        samples[:] = [first, per_graph, per_graph_pool]
    return first + (len(captures) - 1) * per_graph


def replay_ms(graph: Replayable, device: torch.device, repeats: int) -> float:
    """The median of ``repeats`` timed replays of a graph over whatever inputs its buffers hold (after one to
    warm)."""
    graph.replay()
    runs = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            graph.replay()
            runs.append((time.perf_counter() - t0) * 1e3)
    return sorted(runs)[len(runs) // 2]


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="graph")
