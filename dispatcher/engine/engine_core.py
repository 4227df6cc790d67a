"""The engine core: scheduler -> dispatcher -> worker -> outputs, one step at a time, in one process.

``twogrid serve`` wraps this loop in an engine process talking to worker processes; offline generation and
the GPU tests use it directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from dispatcher.plan.config import ResolvedConfig
from dispatcher.plan.dispatch import dispatch_step, dispatchers_for_plan
from dispatcher.plan.capture_plan import FULL_VARLEN, build_plan
from dispatcher.engine.trace import TraceWriter, step_record
from dispatcher.runtime.worker import ModelWorker, WorkerConfig
from models.config import ModelConfig
from dispatcher.engine.cost import CostCurve
from scheduler.request import Request, RequestError, SamplingParams
from dispatcher.engine.config import scheduler_config
from scheduler.scheduler import RequestOutput, Scheduler, SchedulerConfig


@dataclass
class EngineArgs:
    model: ModelConfig | str
    """A model shape, a preset name (random weights from ``seed``), a checkpoint directory or a .gguf file."""
    device: str = "cpu"
    dtype: torch.dtype | None = None
    """Default: bfloat16 on CUDA, float32 on the CPU."""
    num_kv_blocks: int = 2048
    block_size: int = 16
    max_model_len: int = 2048
    seed: int = 0
    use_cuda_graphs: bool = True
    step_trace: str | None = None
    eos_token_ids: tuple[int, ...] | None = None
    """Token ids that end a request (unless ignore_eos); default: the model's (config and generation_config)."""


class EngineCore:
    def __init__(self, cfg: ResolvedConfig, args: EngineArgs, capture: bool = True, progress: bool = False):
        self.cfg = cfg
        self.args = args
        self.plan = build_plan(cfg)
        self.dispatchers = dispatchers_for_plan(self.plan)
        dtype = args.dtype or (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
        sched_cfg = scheduler_config(cfg, args.num_kv_blocks, args.block_size, args.max_model_len)
        self.worker = ModelWorker(
            WorkerConfig(args.model, args.device, dtype, args.num_kv_blocks, args.block_size, args.max_model_len,
                         cfg.max_num_seqs, cfg.max_num_batched_tokens, sched_cfg.max_blocks_per_seq, args.seed,
                         args.use_cuda_graphs),
            self.plan, cfg.method, cfg.num_speculative_tokens,
        )
        self.scheduler = Scheduler(sched_cfg)
        reach = args.max_model_len + self.scheduler.extra_tokens
        if reach > self.worker.model.cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len = {args.max_model_len} plus {self.scheduler.extra_tokens} positions for drafts and "
                f"lookahead exceeds the model's max_position_embeddings = "
                f"{self.worker.model.cfg.max_position_embeddings}: lower max_model_len")
        self.capture_report = self.worker.capture(progress=progress) if capture else None
        if capture and cfg.adaptive_verification:
            # Adaptive verification picks each step's size on this runtime's own replay times.
            measured = self.worker.runtime.measure_step_ms(FULL_VARLEN)
            if measured is not None:
                self.scheduler = Scheduler(replace(sched_cfg, step_ms=CostCurve(*measured)))
        self.trace = TraceWriter(args.step_trace)
        self._next_id = 0
        self.eos_token_ids = (self.model_config.eos_token_ids if args.eos_token_ids is None
                              else tuple(args.eos_token_ids))

    @property
    def model_config(self) -> ModelConfig:
        return self.worker.model.cfg

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token {bad[0]!r} is outside the vocabulary 0..{vocab - 1}")
        params.validate(vocab)
        rid = request_id or f"req-{self._next_id}"
        self._next_id += 1
        self.scheduler.add_request(Request(rid, prompt_token_ids, params, self.eos_token_ids))
        return rid

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if len(out.slots) == 0:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler made no progress with requests waiting (KV cache too small?)")
            return []
        descs = dispatch_step(self.dispatchers, self.cfg.method, out)
        t1 = time.perf_counter()
        result = self.worker.execute(out, descs)
        t2 = time.perf_counter()
        self.trace.write(step_record(out.step_id, out, descs.target, (t1 - t0) * 1e3, (t2 - t1) * 1e3,
                                     descs.drafts()))
        return self.scheduler.update(out, result)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Offline: run every prompt to completion; outputs in prompt order."""
        ids = [self.add_request(p, params) for p in prompts]
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.scheduler.has_unfinished():
            for o in self.step():
                outputs[o.request_id].extend(o.new_token_ids)
        return [outputs[rid] for rid in ids]
