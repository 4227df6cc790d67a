"""Requests and their state machine: WAITING -> RUNNING -> FINISHED, with RUNNING -> PREEMPTED -> RUNNING
when KV blocks run out (preemption by recompute) and ABORTED from any live state."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import Iterable

from scheduler.structured import StructuredOutputError, StructuredOutputsParams

MAX_LOGPROBS = 20
"""Top log-probabilities per output token at most (vLLM's default max_logprobs, OpenAI's limit)."""


class RequestError(ValueError):
    """A request the engine refuses; the message names the field, the value and the limit."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_live(self) -> bool:
        return self in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    """max_tokens reached."""
    STOP = "stop"
    """A stop token id or EOS was sampled, or the text reached a stop string."""
    ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of generation. Sampling itself (temperature, top-k, top-p) runs in the worker."""

    max_tokens: int = 16
    """Output tokens at most."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after any of these (kept in the output)."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS token (benchmarks use fixed output lengths)."""
    temperature: float = 0.0
    """0 is greedy."""
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    """1 disables top-p."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings: generation stops when the output text contains one (matched across token boundaries by the
    engine's output processor); the text is cut before it."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    skip_special_tokens: bool = True
    """Leave special tokens (<|im_end|>, ...) out of the output text."""
    logprobs: int | None = None
    """Return each output token's log-probability and those of the top ``logprobs`` tokens at its position
    (0..MAX_LOGPROBS); None returns none."""
    structured_outputs: StructuredOutputsParams | None = None
    """A grammar the output follows (JSON schema, regex, choice, EBNF, structural tag): the engine masks every token
    it forbids before sampling (``dispatcher.engine.structured``)."""

    def __post_init__(self):
        if isinstance(self.stop, str):  # one stop string, as the OpenAI API allows
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def validate(self, vocab_size: int | None = None) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise RequestError(f"stop_token_ids has {t!r}, outside the vocabulary 0..{(vocab_size or 1) - 1}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in 0..{MAX_LOGPROBS} or None, got {self.logprobs!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.structured_outputs is not None:
            try:
                self.structured_outputs.validate()
            except StructuredOutputError as exc:
                raise RequestError(str(exc)) from None


_arrival = itertools.count()


class Request:
    """One generation request. The scheduler owns its counters while it runs; the token lists live here."""

    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "params", "eos_token_ids", "status",
        "finish_reason", "arrival", "num_preemptions", "block_hashes", "num_cached_tokens",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 eos_token_id: int | Iterable[int] | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params or SamplingParams()
        self.eos_token_ids: tuple[int, ...] = (
            () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id))
        """The model's EOS ids (any of them ends the request unless ignore_eos)."""
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.arrival = next(_arrival)
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        """Prefix caching: the hashes of the request's first full blocks (``scheduler.block_hash``), grown as needed."""
        self.num_cached_tokens: int | None = None
        """Prompt tokens whose KV came from the prefix cache when the request first started (None before; what
        ``usage.prompt_tokens_details.cached_tokens`` reports)."""

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """The tokens at positions [start, end) of prompt + output (without building the whole list)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={len(self.prompt_token_ids)}, "
                f"output={len(self.output_token_ids)}, {self.status.value})")
