"""Requests and their state machine: WAITING -> RUNNING -> FINISHED, with RUNNING -> PREEMPTED -> RUNNING
when KV blocks run out (preemption by recompute) and ABORTED from any live state."""

from __future__ import annotations

import array
import enum
import itertools
from dataclasses import dataclass, replace
from typing import Iterable

from scheduler.structured import StructuredOutputError, StructuredOutputsParams

MAX_LOGPROBS = 20
"""Top log-probabilities per output token at most (vLLM's default max_logprobs, OpenAI's limit)."""
MAX_N = 256
"""Choices per request at most (``n``: each one a request of its own in the engine)."""
MAX_TOP_K = 2**31 - 1
"""``top_k`` at most (any value from the vocabulary's size up keeps every token, as 0 does; the bound keeps it an
integer the worker's tables hold)."""
MAX_TEMPERATURE = 2.0
"""vLLM's and OpenAI's upper bound."""
MAX_ALLOWED_TOKEN_IDS = 1024
"""``allowed_token_ids`` per request at most (vLLM's GPU model runner's limit); the worker's table width."""
MAX_LOGIT_BIAS = 1024
"""``logit_bias`` entries per request at most (vLLM's GPU model runner's limit; OpenAI documents 300)."""
MAX_MIN_TOKENS_STOP_IDS = 128
"""Stop token ids plus EOS ids that ``min_tokens`` holds back, at most (vLLM's GPU model runner's limit)."""
MAX_BAD_WORDS = 128
"""Bad words per request at most, after tokenization (vLLM's VLLM_MAX_NUM_BAD_WORDS); each word may count twice,
with and without a leading space."""
MAX_BAD_WORD_TOKENS = 16
"""Tokens per bad word at most (the worker's table width)."""
MAX_LOGIT_BIAS_VALUE = 100.0
"""``logit_bias`` values are in [-100, 100] (OpenAI's range)."""


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
    temperature: float | None = None
    """0 is greedy. Not given (None): greedy, or vLLM's 1.0 where ``n`` > 1 (a greedy request cannot have n
    choices), so that ``SamplingParams(n=2)`` samples two as in vLLM."""
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
    n: int = 1
    """Choices: the engine runs n child requests on the one prompt (each with its own seed), vLLM's parallel
    sampling. Needs temperature > 0, as vLLM's (the default where n > 1)."""
    min_p: float = 0.0
    """Tokens less likely than min_p times the most likely one are left out (0: off)."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens of the prompt and the output so far, < 1 encourages them (1: off)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output holds already ([-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it ([-2, 2])."""
    min_tokens: int = 0
    """EOS and the stop token ids cannot be drawn (and stop strings do not match) before this many output tokens."""
    logit_bias: dict[int, float] | None = None
    """Added to these tokens' logits before sampling (values in [-100, 100])."""
    allowed_token_ids: tuple[int, ...] | None = None
    """The only tokens the request may draw (None: any)."""
    bad_words: tuple[str, ...] = ()
    """Words that may not be generated: the last token of a word is banned where the output ends with the rest."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """``bad_words`` tokenized (``models.text.bad_words_token_ids``: each word with and without a leading space, as
    vLLM does); what the engine uses. Set by the front end, which has the tokenizer."""
    prompt_logprobs: int | None = None
    """Return each prompt token's log-probability, its rank and the top ``prompt_logprobs`` tokens at its position
    (0..MAX_LOGPROBS); None returns none."""
    structured_outputs: StructuredOutputsParams | None = None
    """A grammar the output follows (JSON schema, regex, choice, EBNF, structural tag): the engine masks every token
    it forbids before sampling (``dispatcher.engine.structured``)."""

    def __post_init__(self):
        if self.temperature is None:
            object.__setattr__(self, "temperature", 1.0 if _is_int(self.n) and self.n > 1 else 0.0)
        if isinstance(self.stop, str):  # one stop string, as the OpenAI API allows
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        for name in ("stop_token_ids", "allowed_token_ids", "bad_words"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        if isinstance(self.bad_words_token_ids, list):
            object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))

    @property
    def processes_logits(self) -> bool:
        """Some parameter changes the logits before sampling (the worker's slower path)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0 or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids))

    def validate(self, vocab_size: int | None = None, eos_token_ids: Iterable[int] = ()) -> None:
        """RequestError naming the field and its limit. ``eos_token_ids``: the model's, which ``min_tokens`` holds
        back with the stop token ids."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (_is_number(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise RequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise RequestError(f"top_k must be an integer in 0..{MAX_TOP_K} (0: no top-k), got {self.top_k!r}")
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
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._validate_extras(vocab_size, eos_token_ids)
        if self.structured_outputs is not None:
            try:
                self.structured_outputs.validate()
            except StructuredOutputError as exc:
                raise RequestError(str(exc)) from None
            self._check_grammar_conflicts()

    def _check_grammar_conflicts(self) -> None:
        """``min_tokens`` and ``allowed_token_ids`` beside a grammar: where they forbid every token the grammar
        allows (its end before min_tokens, its next token outside the allowed ones), no token is left to sample, and
        the request would go on unconstrained, its output breaking the constraint; so the pair is refused."""
        where = self.structured_outputs.where
        if self.min_tokens:
            raise RequestError(f"min_tokens cannot be combined with structured outputs ({where}): the grammar "
                               f"decides where the output ends, and one ending sooner would leave no token to sample")
        if self.allowed_token_ids is not None:
            raise RequestError(f"allowed_token_ids cannot be combined with structured outputs ({where}): the "
                               f"grammar decides which tokens may come next; constrain them in it instead")

    def _validate_extras(self, vocab_size: int | None, eos_token_ids: Iterable[int]) -> None:
        """n, min_p, the penalties, min_tokens, logit_bias, allowed_token_ids, bad words, prompt_logprobs: vLLM's
        ranges, and the worker's table limits."""
        if self.seed is not None and not (_is_int(self.seed) and -2**63 <= self.seed < 2**63):
            raise RequestError(f"seed must be an integer in [-2^63, 2^63 - 1], got {self.seed!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be an integer in 1..{MAX_N}, got {self.n!r}")
        if self.n > 1 and self.temperature == 0:
            raise RequestError(f"n must be 1 when using greedy sampling (temperature 0), got {self.n}: every choice "
                               f"would be the same (vLLM refuses it too)")
        if not (_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (_is_number(getattr(self, name)) and -2.0 <= getattr(self, name) <= 2.0):
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not (_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty < float("inf")):
            raise RequestError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be an integer in 0..max_tokens ({self.max_tokens}), got "
                               f"{self.min_tokens!r}")
        if self.min_tokens:
            held = set(self.stop_token_ids) | set(eos_token_ids)
            if len(held) > MAX_MIN_TOKENS_STOP_IDS:
                raise RequestError(f"min_tokens holds back {len(held)} stop token ids (stop_token_ids and the "
                                   f"model's EOS); at most {MAX_MIN_TOKENS_STOP_IDS}")
        self._validate_token_lists(vocab_size)
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise RequestError(f"prompt_logprobs must be an integer in 0..{MAX_LOGPROBS} or None, got "
                               f"{self.prompt_logprobs!r}")

    def _validate_token_lists(self, vocab_size: int | None) -> None:
        top = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"

        def check_ids(name: str, ids) -> None:
            for t in ids:
                if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                    raise RequestError(f"{name} has token id {t!r}, outside the vocabulary {top}")

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise RequestError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
            check_ids("logit_bias", self.logit_bias)
            for t, v in self.logit_bias.items():
                if not (_is_number(v) and -MAX_LOGIT_BIAS_VALUE <= v <= MAX_LOGIT_BIAS_VALUE):
                    raise RequestError(f"logit_bias[{t}] must be in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                                       f"{MAX_LOGIT_BIAS_VALUE:g}], got {v!r}")
        if self.allowed_token_ids is not None:
            count = len(self.allowed_token_ids) if isinstance(self.allowed_token_ids, tuple) else 0
            if not 1 <= count <= MAX_ALLOWED_TOKEN_IDS:
                raise RequestError(f"allowed_token_ids must list 1..{MAX_ALLOWED_TOKEN_IDS} token ids, got {count}")
            check_ids("allowed_token_ids", self.allowed_token_ids)
        if not isinstance(self.bad_words, tuple) or not all(isinstance(w, str) and w for w in self.bad_words):
            raise RequestError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        if self.bad_words and not self.bad_words_token_ids:
            raise RequestError("bad_words need the model's tokenizer; this model (a preset) has none")
        if len(self.bad_words_token_ids) > MAX_BAD_WORDS:
            raise RequestError(f"bad_words make {len(self.bad_words_token_ids)} token sequences (each word with and "
                               f"without a leading space); at most {MAX_BAD_WORDS}")
        for word in self.bad_words_token_ids:
            if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS:
                raise RequestError(f"bad_words: a word of {len(word)} tokens; each must be 1..{MAX_BAD_WORD_TOKENS} "
                                   f"tokens")
            check_ids("bad_words", word)


def child_request_id(request_id: str, index: int) -> str:
    """The id of choice ``index`` of a request with n > 1 (vLLM's naming)."""
    return f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: n = 1, its own seed (seed + index; None: the engine draws one), the prompt's
    log-probabilities on the first choice only (they are the same for every one)."""
    seed = None if params.seed is None else (params.seed + index + 2**63) % 2**64 - 2**63  # (int64, wrapped)
    return replace(params, n=1, seed=seed,
                   prompt_logprobs=params.prompt_logprobs if index == 0 else None)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


_arrival = itertools.count()


class Request:
    """One generation request. The scheduler owns its counters while it runs; the token lists live here."""

    __slots__ = (
        "request_id", "_prompt_ids", "num_prompt_tokens", "output_token_ids", "params", "eos_token_ids", "status",
        "finish_reason", "arrival", "num_preemptions", "block_hashes", "num_cached_tokens", "prompt_int32",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int] | None, params: SamplingParams | None = None,
                 eos_token_id: int | Iterable[int] | None = None, prompt_int32: bytes | None = None):
        """``prompt_token_ids`` (copied), or None with ``prompt_int32``: the prompt as native int32 bytes only, its
        list made where a use asks for it (the engine's check packs a front end's prompt: a 1,500-token list costs
        ~20 us of the engine's one thread an arrival, which the step that admits the request does not need)."""
        self.request_id = request_id
        self._prompt_ids = list(prompt_token_ids) if prompt_token_ids is not None else None
        self.prompt_int32: bytes | None = prompt_int32
        """The prompt as native int32 where the engine kept it when it checked the prompt: the step that admits the
        request sends it as it is (a step at 1,024 streams admits a few dozen)."""
        if self._prompt_ids is None and prompt_int32 is None:
            raise ValueError("a request needs its prompt: token ids or their int32 bytes")
        self.num_prompt_tokens = len(self._prompt_ids) if self._prompt_ids is not None else len(prompt_int32) // 4
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
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids (made from ``prompt_int32`` at the first use that asks for the list)."""
        if self._prompt_ids is None:
            self._prompt_ids = self._prompt_slice(0, self.num_prompt_tokens)
        return self._prompt_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """The tokens at positions [start, end) of prompt + output (without building the whole list)."""
        n = self.num_prompt_tokens
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        head = self._prompt_slice(start, min(end, n))
        return head if end <= n else head + self.output_token_ids[: end - n]

    def _prompt_slice(self, start: int, end: int) -> list[int]:
        """The prompt's tokens in [start, end): from its list where made, else from its int32 bytes."""
        if self._prompt_ids is not None:
            return self._prompt_ids[start:end]
        part = array.array("i")
        part.frombytes(memoryview(self.prompt_int32)[4 * start: 4 * end])
        return part.tolist()

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
                f"output={len(self.output_token_ids)}, {self.status.value})")
