"""The server's Prometheus metrics: vLLM's names with a ``twogrid:`` prefix, plus the graph counters no other engine
exports. Free of aiohttp, so the engine process imports it without the HTTP stack.

Who records what:

- the engine calls the step-level hooks: ``on_step`` once per step (graph mode, eager reason, padding,
  speculative decoding's verify events, drafts verified and accepted in all and per position, preemptions, prefix
  cache queries and hits),
  ``set_queue`` with the queue after each step and after aborts that no step follows (running, waiting, free KV
  blocks), ``set_capture``, ``set_graph_counts`` and ``set_startup`` once the worker is ready (``set_graph_counts``
  again as delayed capture goes on), and ``set_spec_tiers`` with the speculative
  tiers at start and whenever ``"auto"`` tiers change (the engine process sends these to the front end, which records
  them);
- the HTTP layer calls the per-request hooks (``on_first_token``, ``on_tokens``, ``on_request_finished``), since it
  sees each request from arrival to its last byte: TTFT, inter-token latency and end-to-end latency are measured
  where the client feels them, and prompt / generation token totals are counted once per request. The engine does
  not call these (that would count requests twice);
- each front end calls ``on_backlog`` when it reads several steps' deltas at once (it fell behind the engine).

With several front-end processes (``--api-server-count``) the metrics are prometheus-client's multiprocess ones
(``$PROMETHEUS_MULTIPROC_DIR``, set by ``twogrid serve`` before anything imports prometheus-client): each process
records its own requests, front end 0 the steps and the queue, and every process's /metrics shows the sum (gauges:
the largest value, which is front end 0's).

Every series carries a ``model_name`` label, as vLLM's do. ``twogrid bench`` reads ``eager_steps_total{reason}``,
``padded_tokens_total``, ``cudagraph_steps_total{kind,mode}``, ``step_device_seconds_total``,
``front_end_backlog_steps_total`` and the ``spec_decode_*`` counters (dispatcher/bench/server_metrics.py; so does
``--cudagraph-metrics``' periodic log line): those names and labels are an interface.
"""

from __future__ import annotations

from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "twogrid:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The Content-Type of ``render()``'s text (Prometheus text format 0.0.4)."""

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that dashboards built for vLLM read these unchanged.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)

FINISH_REASONS = ("stop", "length", "abort", "error")
"""``request_success_total``'s finished_reason values: the engine's three, and ``error`` for a request the engine
failed (worker death, step error)."""


class EngineMetrics:
    """The metrics of one served model, on their own ``CollectorRegistry`` (``render()`` gives the /metrics text)."""

    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None, multiprocess: bool = False,
                 num_speculative_tokens: int = 0):
        """``num_speculative_tokens``: K_max, the draft positions whose ``spec_decode_num_accepted_tokens_per_pos``
        series show from the start (at 0)."""
        self.model_name = model_name
        self.multiprocess = multiprocess
        """Render every front-end process's values (``--api-server-count`` > 1), not this process's alone."""
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r, m = self.registry, ("model_name",)

        def gauge(name: str, doc: str, labels=()):
            return Gauge(PREFIX + name, doc, m + tuple(labels), registry=r, multiprocess_mode="max")

        def counter(name: str, doc: str, labels=()):
            return Counter(PREFIX + name, doc, m + tuple(labels), registry=r)

        def histogram(name: str, doc: str, buckets):
            return Histogram(PREFIX + name, doc, m, buckets=buckets, registry=r)

        # scheduler state (the engine sets these)
        self._running = gauge("num_requests_running", "Requests in the running batch.").labels(model_name)
        self._waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.").labels(model_name)
        self._kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means every block is used.").labels(
            model_name)
        self._kv_free = gauge("kv_cache_free_blocks", "KV blocks free now: the cache's size when nothing runs.").labels(
            model_name)
        self._kv_blocks = gauge("kv_cache_blocks", "KV blocks in the cache.").labels(model_name)
        self._preemptions = counter("num_preemptions", "Preemptions (by recompute) since start.").labels(model_name)
        self._prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in tokens: the tokens of each "
                                       "request when it first starts.").labels(model_name)
        self._prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in tokens: of the queried tokens, those "
                                    "whose KV the cache held.").labels(model_name)
        # tokens and requests (the HTTP layer records these)
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that got their first token."
                                      ).labels(model_name)
        self._generation_tokens = counter("generation_tokens", "Output tokens sent to clients.").labels(model_name)
        self._ttft = histogram("time_to_first_token_seconds", "Time from a request's arrival to its first token.",
                               TTFT_BUCKETS_S).labels(model_name)
        self._preprocess_time = histogram("request_preprocess_time_seconds", "Time from a request's arrival at a "
                                          "front end to its send to the engine (parsing, checks, the chat template, "
                                          "tokenizing, the prefix cache's block hashes): of the TTFT, the front "
                                          "end's part before the engine.",
                                          TTFT_BUCKETS_S).labels(model_name)
        self._queue_time = histogram("request_queue_time_seconds", "Time a request waited in the engine before its "
                                     "first step (its grammar's compile included): of the TTFT, the engine's "
                                     "queue.", TTFT_BUCKETS_S).labels(model_name)
        self._prefill_time = histogram("request_prefill_time_seconds", "Time from a request's first step to its "
                                       "first token in the engine: of the TTFT, its prompt's steps.",
                                       TTFT_BUCKETS_S).labels(model_name)
        self._itl = histogram("inter_token_latency_seconds", "Time between two outputs of one request (one "
                              "observation per output, which may carry several tokens: speculative decoding, or "
                              "a front end behind the engine).", ITL_BUCKETS_S).labels(model_name)
        self._e2e = histogram("e2e_request_latency_seconds", "Time from a request's arrival to its last output.",
                              E2E_BUCKETS_S).labels(model_name)
        self._success = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        for reason in FINISH_REASONS:  # every reason shows from the start, at 0
            self._success.labels(model_name, reason)
        # the dispatcher (the engine records these)
        self._graph_steps = counter("cudagraph_steps", "Steps by batch kind and graph mode (FULL, PIECEWISE, "
                                    "NONE = eager; STATIC_FULL, STATIC_PIECEWISE: the static-buffer backend's "
                                    "eager runs of a graph's shape, without CUDA graphs).", ("kind", "mode"))
        self._eager_steps = counter("eager_steps", "Steps run without a graph, by reason.", ("reason",))
        self._fused_steps = counter("fused_decode_steps", "Uniform-decode steps run as one graph a step (the target's "
                                    "forward, verification and the drafter's forwards: the rest of FULL uniform "
                                    "decodes ran op by op around their forwards' graphs).").labels(model_name)
        self._padded_tokens = counter("padded_tokens", "Tokens added to steps to reach a captured size."
                                      ).labels(model_name)
        # speculative decoding, as vLLM's v1 counts it (vllm/v1/spec_decode/metrics.py)
        self._drafts = counter("spec_decode_num_drafts", "Verify events: a request in a step that verified at least "
                               "one draft.").labels(model_name)
        self._draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.").labels(model_name)
        self._accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted by verification."
                                 ).labels(model_name)
        self._accepted_per_pos_family = counter("spec_decode_num_accepted_tokens_per_pos", "Verify events that "
                                                "accepted the draft at each position (0: the first draft).",
                                                ("position",))
        self._accepted_per_pos = [self._accepted_per_pos_family.labels(model_name, str(j))
                                  for j in range(num_speculative_tokens)]
        self._device_s = counter("step_device_seconds", "Device time of the steps (first to last operation of each, "
                                 "CUDA events): over wall time, how busy the GPU was.").labels(model_name)
        # the serving path (each front end records its own)
        self._backlog = counter("front_end_backlog_steps", "Engine steps whose outputs reached a front end while it "
                                "was still behind on earlier ones, and went out merged with them (several tokens a "
                                "chunk). Growing with load: the front ends, not the GPU, limit throughput.").labels(
            model_name)
        self._tier_k = gauge("spec_decode_tier_k", "Speculative tokens a request drafts in a uniform decode of "
                             "min_batch..max_batch requests (the tiers in force: hand-written, or chosen by \"auto\" "
                             "and re-chosen as the acceptance moves; 0: that tier does not draft).",
                             ("min_batch", "max_batch"))
        self._tier_labels: list[tuple[str, str]] = []
        self._capture_s = gauge("capture_seconds", "Time spent capturing CUDA graphs: at start-up, or under "
                                "delayed capture in the gaps between steps so far.").labels(model_name)
        self._graph_bytes = gauge("cudagraph_memory_bytes", "Device memory held by captured graphs (measured after "
                                  "capture at start-up; 0 under delayed capture).").labels(model_name)
        self._graphs_captured = gauge("cudagraphs_captured", "CUDA graphs captured so far, by runner and kind "
                                      "(delayed capture: rising to cudagraphs_planned while serving; on a CPU, the "
                                      "static-buffer backend's padded sizes set up, no CUDA graph).",
                                      ("runner", "kind"))
        self._graphs_planned = gauge("cudagraphs_planned", "CUDA graphs the capture plan holds, by runner and kind.",
                                     ("runner", "kind"))
        self._startup_s = gauge("startup_phase_seconds", "Seconds of each phase of the worker's start-up (imports, "
                                "settings, weights, grid_fit, kv_sizing, kv_allocation, kernels, capture, measure).",
                                ("phase",))

    # -- engine hooks -------------------------------------------------------------------------------------------
    def on_step(self, kind: str, mode: str, eager_reason: str | None = None, padded_tokens: int = 0,
                accepted_tokens: int = 0, preemptions: int = 0, device_seconds: float = 0.0, num_drafts: int = 0,
                draft_tokens: int = 0, accepted_per_pos: Sequence[int] = (), prefix_cache_queries: int = 0,
                prefix_cache_hits: int = 0, fused: bool = False) -> None:
        """One step ran: its batch kind (dispatch's BATCH_KINDS) and mode (FULL / PIECEWISE / NONE; STATIC_FULL /
        STATIC_PIECEWISE on the CPU's static-buffer backend, which captures no CUDA graphs); why it ran
        eagerly when it did; tokens of padding; draft tokens accepted; requests preempted while scheduling it; its
        device time; verify events, draft tokens verified and, per draft position, the verify events that accepted
        it; the prefix cache's queries and hits (tokens) of the requests it started; whether it ran as one fused
        decode-step graph."""
        self._graph_steps.labels(self.model_name, kind, mode).inc()
        if fused:
            self._fused_steps.inc()
        self._device_s.inc(device_seconds)
        if eager_reason is not None:
            self._eager_steps.labels(self.model_name, eager_reason).inc()
        if padded_tokens:
            self._padded_tokens.inc(padded_tokens)
        if accepted_tokens:
            self._accepted.inc(accepted_tokens)
        if num_drafts:
            self._drafts.inc(num_drafts)
            self._draft_tokens.inc(draft_tokens)
            per_pos = self._accepted_per_pos
            for j, n in enumerate(accepted_per_pos):
                if j == len(per_pos):  # (a K past the one given at start)
                    per_pos.append(self._accepted_per_pos_family.labels(self.model_name, str(j)))
                if n:
                    per_pos[j].inc(n)
        if preemptions:
            self._preemptions.inc(preemptions)
        if prefix_cache_queries:
            self._prefix_queries.inc(prefix_cache_queries)
            self._prefix_hits.inc(prefix_cache_hits)

    def on_backlog(self, num_steps: int) -> None:
        """A front end found ``num_steps`` more engine steps' outputs waiting than the one it was reading."""
        self._backlog.inc(num_steps)

    def set_queue(self, running: int, waiting: int, kv_free_blocks: int, kv_blocks: int) -> None:
        """The scheduler's state now: requests running and waiting, KV blocks free and in all (the usage follows)."""
        self._running.set(running)
        self._waiting.set(waiting)
        self._kv_free.set(kv_free_blocks)
        self._kv_blocks.set(kv_blocks)
        self._kv_usage.set(1.0 - kv_free_blocks / kv_blocks if kv_blocks else 0.0)

    def set_spec_tiers(self, tiers: Sequence[Sequence[int]]) -> None:
        """The speculative tiers in force, (min_batch, max_batch, K) each: one ``spec_decode_tier_k`` series a tier.
        A tier no longer in force loses its series (with several front-end processes, whose values outlive a
        removal, it reads -1 instead)."""
        labels = [(str(lo), str(hi)) for lo, hi, _ in tiers]
        for old in self._tier_labels:
            if old not in labels:
                if self.multiprocess:
                    self._tier_k.labels(self.model_name, *old).set(-1)
                else:
                    self._tier_k.remove(self.model_name, *old)
        for (lo, hi), (_, _, k) in zip(labels, tiers):
            self._tier_k.labels(self.model_name, lo, hi).set(k)
        self._tier_labels = labels

    def set_capture(self, seconds: float, memory_bytes: int) -> None:
        """What capture took: wall seconds and the graphs' device memory."""
        self._capture_s.set(seconds)
        self._graph_bytes.set(memory_bytes)

    def set_graph_counts(self, counts: Sequence[tuple[str, str, int, int]], seconds: float | None = None) -> None:
        """Graphs captured and planned, (runner, kind, captured, planned) each; ``seconds``: the capture time so
        far (delayed capture)."""
        for runner, kind, captured, planned in counts:
            self._graphs_captured.labels(self.model_name, runner, kind).set(captured)
            self._graphs_planned.labels(self.model_name, runner, kind).set(planned)
        if seconds is not None:
            self._capture_s.set(seconds)

    def set_startup(self, phases: dict[str, float]) -> None:
        """The worker's start-up phases, seconds each (``WorkerReady.startup``)."""
        for phase, seconds in phases.items():
            self._startup_s.labels(self.model_name, phase).set(seconds)

    # -- request hooks (the HTTP layer) ----------------------------------------------------------------------------
    def on_first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        self._ttft.observe(ttft_s)
        self._prompt_tokens.inc(prompt_tokens)

    def on_sent_to_engine(self, preprocess_s: float) -> None:
        """A request went to the engine ``preprocess_s`` after its arrival at the front end."""
        self._preprocess_time.observe(preprocess_s)

    def on_engine_times(self, queue_s: float, prefill_s: float) -> None:
        """The engine's part of a request's TTFT (its first delta): queued, then its prompt's steps (the rest of
        the TTFT is the front end's: ``on_sent_to_engine``'s part before, and streaming the token out)."""
        self._queue_time.observe(queue_s)
        self._prefill_time.observe(prefill_s)

    def on_tokens(self, num_tokens: int, itl_s: float | None) -> None:
        """An output of ``num_tokens`` tokens reached the client, ``itl_s`` after the request's previous one (None
        for its first output)."""
        self._generation_tokens.inc(num_tokens)
        if itl_s is not None:
            self._itl.observe(itl_s)

    def on_request_finished(self, finish_reason: str, e2e_s: float) -> None:
        """A request ended: ``finish_reason`` in FINISH_REASONS, ``e2e_s`` from arrival to its last output."""
        self._success.labels(self.model_name, finish_reason).inc()
        self._e2e.observe(e2e_s)

    # -- exposition ---------------------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The registry in Prometheus' text format (every front-end process's, summed, in multiprocess mode)."""
        if self.multiprocess:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)


class RequestTimer:
    """One request's latencies as its outputs reach the client, recorded into ``EngineMetrics``: TTFT and the
    prompt tokens at its first output, an inter-token latency at each later one, e2e latency and finish reason
    when it ends. Times from ``time.perf_counter``."""

    __slots__ = ("metrics", "arrival", "last", "prompt_tokens", "generation_tokens", "done")

    def __init__(self, metrics: EngineMetrics, prompt_tokens: int, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self.last: float | None = None
        """When the previous output was sent (None before the first)."""
        self.prompt_tokens = prompt_tokens
        self.generation_tokens = 0
        self.done = False

    def output(self, num_tokens: int, now: float) -> None:
        """An output carrying ``num_tokens`` new tokens was sent (outputs without tokens are not timed)."""
        if num_tokens <= 0:
            return
        if self.last is None:
            self.metrics.on_first_token(now - self.arrival, self.prompt_tokens)
            self.metrics.on_tokens(num_tokens, None)
        else:
            self.metrics.on_tokens(num_tokens, now - self.last)
        self.last = now
        self.generation_tokens += num_tokens

    def discard(self) -> None:
        """The request was refused before it ran: record nothing for it."""
        self.done = True

    def finish(self, finish_reason: str, now: float) -> None:
        """The request ended at ``now`` (its last output sent, or it was aborted or failed); once, later calls do
        nothing."""
        if not self.done:
            self.done = True
            self.metrics.on_request_finished(finish_reason, now - self.arrival)
