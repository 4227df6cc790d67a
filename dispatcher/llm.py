"""The offline API, in vLLM's shape::

    from dispatcher import LLM, SamplingParams

    llm = LLM()                                   # the default model, SmolLM2-135M-Instruct (a GGUF)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32))
    print(out[0].outputs[0].text)

``model`` takes a Hugging Face checkpoint directory, a .gguf file or a preset name (random weights, no
tokenizer: token-id prompts only, for benchmarks); None is the default model. Engine options are EngineCore's
and the configuration's (``max_num_seqs``, ``compilation_config``, ``speculative_config``,
``enable_prefix_caching`` (default True, as vLLM's), ``admission_wait_steps`` (``--admission-wait-steps``: a
request added while a batch decodes waits up to that many steps; default under speculative decoding up to 4 steps
and 25 ms by the steps' pace, else 0; prompts given together arrive at once), ...).
Each output's ``num_cached_tokens`` counts its prompt tokens found in the prefix cache.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Iterator, Sequence

import torch

from dispatcher.configure import (MAX_BLOCK_SIZE, check_tensor_parallel_size, detect_platform, generation_defaults,
                                  resolve_device)
from dispatcher.engine.config import max_model_len_limit
from dispatcher.engine.engine_core import EngineArgs, EngineCore, EngineStats
from dispatcher.engine.output import CompletionOutput, OutputProcessor, RequestOutput, merge_outputs
from dispatcher.plan.config import ConfigError, Platform, resolve
from models.attention import kv_cache_dtype as kv_cache_dtype_of
from models.checkpoint import CheckpointError
from models.loader import default_dtype, model_kind, read_model_config
from models.text import (Tokenizer, bad_words_token_ids, check_draft_tokenizer, load_tokenizer,
                         load_tokenizer_override)
from scheduler.request import RequestError, SamplingParams

DEFAULT_KV_CACHE_GIB_CPU = 1.0
"""KV cache size on the CPU when neither num_kv_blocks nor kv_cache_memory_gib is given."""
DEFAULT_KV_CACHE_FRACTION_CUDA = 0.5
"""On a GPU: this fraction of the free memory at start-up (before the model loads)."""


class LLM:
    """Load a model and its tokenizer once; ``generate`` and ``chat`` run batches of prompts to completion."""

    def __init__(self, model: str | None = None, *, device: str | None = None, dtype: torch.dtype | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 num_kv_blocks: int | None = None, kv_cache_memory_gib: float | None = None, block_size: int = 16,
                 compilation_config: dict | None = None, speculative_config: dict | None = None,
                 platform: str = "auto", seed: int = 0, enforce_eager: bool = False, step_trace: str | None = None,
                 enable_prefix_caching: bool = True, quantization: str | None = None,
                 kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1, admission_wait_steps: int | None = None,
                 tokenizer: str | None = None):
        """``tensor_parallel_size`` (vLLM's): the model split across this many ranks, one worker process each
        (``models.parallel``; GPUs 0..N-1 on CUDA, gloo ranks on the CPU); ``close()`` stops them. ``tokenizer``
        (vLLM's): a checkpoint directory or GGUF whose tokenizer to use instead of the model's."""
        dtype = _check_options(dtype, block_size, enable_prefix_caching, seed)
        if num_kv_blocks is not None and kv_cache_memory_gib is not None:
            raise ConfigError("num_kv_blocks and kv_cache_memory_gib both size the KV cache: give one")
        if model is None:
            from models.default_model import default_model_path

            model = default_model_path()
        model_kind(model)  # a clear error for a path that is neither a checkpoint nor a preset
        self.model = model
        device = resolve_device(device, "device")
        if platform == "auto":
            platform = detect_platform() if device.startswith("cuda") else Platform.DEFAULT
        self.config = resolve(compilation_config, speculative_config, platform=platform, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens)
        model_cfg = read_model_config(model, quantization)
        self.tokenizer: Tokenizer | None
        if tokenizer is None:
            self.tokenizer = load_tokenizer(model)
        else:
            try:
                self.tokenizer = load_tokenizer_override(tokenizer, "tokenizer")
            except CheckpointError as exc:  # (its message names the argument)
                raise ConfigError(str(exc)) from None
        if self.tokenizer is not None and self.tokenizer.vocab_size > model_cfg.vocab_size:
            raise ConfigError(f"model {model!r}: the tokenizer has {self.tokenizer.vocab_size} tokens, more than the "
                              f"model's vocab_size {model_cfg.vocab_size}")
        if self.config.draft_model is not None and self.config.method == "draft_model":
            try:
                check_draft_tokenizer(self.tokenizer, self.config.draft_model)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        limit, extra = max_model_len_limit(self.config, model_cfg.max_position_embeddings, block_size)
        if max_model_len is None:
            max_model_len = limit
        elif isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
            raise ConfigError(f"max_model_len must be an integer >= 1 (None: the model's {limit}), got "
                              f"{max_model_len!r}")
        elif max_model_len > limit:
            raise ConfigError(f"max_model_len = {max_model_len} exceeds the model's max_position_embeddings "
                              f"({model_cfg.max_position_embeddings}) less {extra} positions for drafts and lookahead")
        dtype = dtype or default_dtype(model, device)
        if num_kv_blocks is None:
            num_kv_blocks = _kv_blocks(model_cfg, device, kv_cache_dtype_of(kv_cache_dtype, dtype), block_size,
                                       max_model_len + extra, max_num_seqs, kv_cache_memory_gib)
        eos = list(model_cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        args = EngineArgs(
            model, device=device, dtype=dtype, num_kv_blocks=num_kv_blocks, block_size=block_size,
            max_model_len=max_model_len, seed=seed, use_cuda_graphs=not enforce_eager, step_trace=step_trace,
            eos_token_ids=tuple(dict.fromkeys(eos)), enable_prefix_caching=enable_prefix_caching,
            quantization=quantization, kv_cache_dtype=kv_cache_dtype, admission_wait_steps=admission_wait_steps,
            tokenizer=tokenizer)
        self._worker = None
        if tensor_parallel_size != 1:
            from dispatcher.engine.ipc import tensor_parallel_worker

            check_tensor_parallel_size(tensor_parallel_size, model_cfg, device, "tensor_parallel_size", self.config)
            self._worker = tensor_parallel_worker(self.config, args, compilation_config, speculative_config,
                                                  tensor_parallel_size, self.tokenizer is not None)
        try:
            self.engine = EngineCore(self.config, args, capture=not enforce_eager, worker=self._worker)
        except BaseException:
            self.close()
            raise
        self.processor = OutputProcessor(self.tokenizer, self.engine.finish_request)
        self.default_params = generation_defaults(model)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel ranks' processes (nothing to do for one in-process worker)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    @property
    def stats(self) -> EngineStats:
        """The engine's counters since it was built: steps, device time, eager steps, padding, and speculative
        decoding as vLLM counts it (``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``,
        ``accepted_per_pos``; ``mean_acceptance_length``, ``acceptance_rate_per_pos``)."""
        return self.engine.stats

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (temperature, top_k, top_p, max_new_tokens), else
        SamplingParams()."""
        return self.default_params

    # -- requests ---------------------------------------------------------------------------------------------
    def _prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise RequestError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"model {self.model!r} has no tokenizer (a preset): give prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise RequestError(f"a prompt must be a string, a list of token ids or a dict; got {type(prompt).__name__}")

    def _add(self, prompt, params: SamplingParams) -> str:
        text, ids = self._prompt(prompt)
        if params.bad_words and self.tokenizer is not None:
            params = replace(params, bad_words_token_ids=self._bad_words(params.bad_words))
        rid = str(next(self._ids))
        requests = self.engine.make_requests(ids, params, rid)
        self.processor.add_request(rid, text, ids, params)
        self.engine.queue_all(requests)
        return rid

    def _bad_words(self, words) -> tuple[tuple[int, ...], ...]:
        try:
            return bad_words_token_ids(self.tokenizer, words)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    def _abort(self, rid: str) -> None:
        for engine_id in self.processor.engine_ids(rid):
            self.engine.abort(engine_id)
        self.processor.abort(rid)

    def _run(self, rids: list[str]) -> Iterator[RequestOutput]:
        """Step until every request in ``rids`` has finished, yielding each step's deltas."""
        try:
            while self.engine.has_unfinished():
                yield from self.processor.process(self.engine.step())
        finally:  # an abandoned stream: free what is left of its requests
            for rid in rids:
                self._abort(rid)

    def _batch(self, prompts: list, sampling_params) -> list[RequestOutput]:
        params = _params_list(sampling_params or self.default_params, len(prompts))
        rids = []
        try:
            for p, sp in zip(prompts, params):
                rids.append(self._add(p, sp))
        except Exception:
            for rid in rids:
                self._abort(rid)
            raise
        deltas: dict[str, list[RequestOutput]] = {rid: [] for rid in rids}
        for d in self._run(rids):
            deltas[d.request_id].append(d)
        return [merge_outputs(deltas[rid]) for rid in rids]

    # -- public -----------------------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Complete each prompt (a string, a list of token ids, {'prompt': ...} / {'prompt_token_ids': ...}, or a
        list of these); outputs in prompt order."""
        return self._batch(_as_list(prompts), sampling_params)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Answer a conversation (a list of {'role', 'content'} dicts) or a list of conversations, rendered with
        the model's chat template (or ``chat_template``); ``continue_final_message``: the model goes on with the
        last message's text (``add_generation_prompt`` False with it), as vLLM's."""
        if self.tokenizer is None:
            raise RequestError(f"model {self.model!r} has no tokenizer or chat template (a preset)")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.encode_chat(
            c, add_generation_prompt, chat_template=chat_template, continue_final_message=continue_final_message,
            variables=chat_template_kwargs)} for c in convs]
        outs = self._batch(prompts, sampling_params)
        for o, p in zip(outs, prompts):
            o.prompt = self.tokenizer.decode(p["prompt_token_ids"], skip_special_tokens=False)
        return outs

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[CompletionOutput]:
        """One prompt, streamed: a CompletionOutput per step and choice with the new text and token ids (the last
        one of a choice carries its finish reason; ``index`` tells the choices of n > 1 apart). The deltas
        concatenate to what ``generate`` returns."""
        rid = self._add(prompt, sampling_params or self.default_params)
        for d in self._run([rid]):
            if d.request_id == rid:
                yield from d.outputs


def _as_list(prompts) -> list:
    if prompts is None or isinstance(prompts, (int, float, bytes)):
        raise RequestError(f"prompts must be a string, a list of token ids, a {{'prompt': ...}} / "
                           f"{{'prompt_token_ids': ...}} dict, or a list of these; got {type(prompts).__name__}")
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    return list(prompts)


def _params_list(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise RequestError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _kv_blocks(cfg, device: str, kv_dtype: torch.dtype, block_size: int, max_tokens_per_seq: int, max_num_seqs: int,
               gib: float | None) -> int:
    """KV blocks that fit the memory budget (in the cache's dtype), at most what max_num_seqs full-length requests
    need, and at least what one does."""
    from dispatcher.runtime.process import kv_bytes_per_block

    per_block = kv_bytes_per_block(cfg, block_size, kv_dtype)
    if gib is None:
        if device.startswith("cuda"):
            gib = torch.cuda.mem_get_info(torch.device(device))[0] * DEFAULT_KV_CACHE_FRACTION_CUDA / 2**30
        else:
            gib = DEFAULT_KV_CACHE_GIB_CPU
    per_seq = -(-max_tokens_per_seq // block_size)
    blocks = min(int(gib * 2**30 // per_block), per_seq * max_num_seqs)
    if blocks < per_seq:
        raise ConfigError(f"kv_cache_memory_gib = {gib:.3f} holds {blocks} KV blocks of {block_size} tokens, fewer "
                          f"than one request of max_model_len needs ({per_seq}); raise it or lower max_model_len")
    return blocks


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
"""``dtype`` as a name: the model dtypes the kernels and graphs are built for."""


def _check_options(dtype, block_size, enable_prefix_caching, seed) -> torch.dtype | None:
    """ConfigError naming the argument for a value of the wrong type or range (what torch or numpy would have
    raised later without naming it, or a truthy string taken as True); ``dtype`` as a torch dtype (None: the
    model's default)."""
    if isinstance(dtype, str):
        if dtype != "auto" and dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, 'auto' or a torch dtype, got {dtype!r}")
        dtype = DTYPES.get(dtype)  # ("auto": None, the model's default)
    if dtype is not None and dtype not in DTYPES.values():
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ConfigError(f"block_size must be an integer in 1..{MAX_BLOCK_SIZE}, got {block_size!r}")
    if not isinstance(enable_prefix_caching, bool):
        raise ConfigError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    return dtype
