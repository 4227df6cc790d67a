"""The engine's output processor: each step's new token ids -> text deltas, stop strings, final outputs.

Per request it keeps an ``IncrementalDetokenizer`` (models/text.py: whole UTF-8 characters only, stop strings
matched across token boundaries and held back while they may still complete). When a stop string matches, the
request is finished in the scheduler at once (finish reason ``stop``, its KV blocks freed) and the tokens after
the one that completed the match are dropped. A request the scheduler finished on EOS or a stop token id has
that last token left out of its text (it is in its token ids), as vLLM does.

The outputs have vLLM's shape: ``RequestOutput(request_id, prompt, prompt_token_ids, outputs=[CompletionOutput(
index, text, token_ids, finish_reason, stop_reason)], finished, prompt_logprobs)``. A request with n > 1 runs as
n choices in the engine (``scheduler.request.child_request_id``); their outputs come back as the request's, each
choice with its index, and the request has finished when every choice has.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.text import IncrementalDetokenizer, Tokenizer
from scheduler.request import FinishReason, RequestError, SamplingParams, child_request_id
from scheduler.scheduler import RequestOutput as StepOutput


@dataclass
class CompletionOutput:
    index: int
    text: str
    """The output text (a step's delta in streamed outputs); empty without a tokenizer."""
    token_ids: list[int]
    finish_reason: str | None = None
    """'stop' (EOS, a stop token id or a stop string), 'length' (max_tokens), 'abort'; None while running."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the request (None for EOS and length)."""
    logprobs: list[dict[int, float]] | None = None
    """Per token of ``token_ids`` (requests asking for logprobs): {token id: log-probability}, the token's own and
    the top ``SamplingParams.logprobs`` others'."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    """The choices with news (a step's deltas), by ``index``; every choice in a final output."""
    finished: bool
    """Every choice has finished."""
    num_cached_tokens: int | None = None
    """Prompt tokens whose KV came from the prefix cache (vLLM's field); None until the request has started."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With ``prompt_logprobs``, on the first output: per prompt token its log-probability and the top others'
    (None for the first token, as vLLM's)."""
    prompt_logprob_ranks: list[int | None] | None = None
    """Each prompt token's rank among the vocabulary at its position (1: the most likely)."""


@dataclass
class _Request:
    parent: str
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None


@dataclass
class _Parent:
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[str]
    """Its choices' engine request ids, by index (itself alone for n = 1)."""
    unfinished: int
    num_cached_tokens: int | None = None
    """Its prompt's tokens found in the prefix cache, as its first choice to start reported them."""


class OutputProcessor:
    """Turns the scheduler's per-step outputs into RequestOutputs; ``finish`` ends a request in the scheduler
    (``Scheduler.finish_request``). A request with n > 1 is its n choices in the engine (``child_request_id``):
    their outputs come back as the request's, each choice with its index."""

    def __init__(self, tokenizer: Tokenizer | None, finish):
        self.tokenizer = tokenizer
        self.finish = finish
        self.requests: dict[str, _Request] = {}
        """By engine request id (a choice's for n > 1)."""
        self.parents: dict[str, _Parent] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> list[str]:
        """Start following a request; returns its engine request ids (its choices')."""
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the model's tokenizer; this model (a preset) has none")
        ids = [request_id] if params.n == 1 else [child_request_id(request_id, i) for i in range(params.n)]
        for i, rid in enumerate(ids):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                               params.stop, params.include_stop_str_in_output, params.min_tokens)
            self.requests[rid] = _Request(request_id, i, params, detok)
        self.parents[request_id] = _Parent(prompt, list(prompt_token_ids), ids, len(ids))
        return ids

    def engine_ids(self, request_id: str) -> list[str]:
        """The request's choices that still run (their engine request ids)."""
        parent = self.parents.get(request_id)
        return [] if parent is None else [rid for rid in parent.children if rid in self.requests]

    def parent_of(self, engine_id: str) -> str | None:
        req = self.requests.get(engine_id)
        return None if req is None else req.parent

    def process(self, step_outputs: list[StepOutput]) -> list[RequestOutput]:
        """This step's deltas: per request, its choices' new text and token ids, finish reasons on their last."""
        out: dict[str, RequestOutput] = {}
        for so in step_outputs:
            req = self.requests.get(so.request_id)
            if req is None:
                continue
            parent = self.parents[req.parent]
            choice = self._process_one(so.request_id, req, so)
            if so.num_cached_tokens is not None and parent.num_cached_tokens is None:
                parent.num_cached_tokens = so.num_cached_tokens
            ro = out.get(req.parent)
            if ro is None:
                ro = out[req.parent] = RequestOutput(req.parent, parent.prompt, parent.prompt_token_ids, [], False,
                                                     parent.num_cached_tokens)
            ro.outputs.append(choice)
            if so.prompt_logprobs is not None:
                ro.prompt_logprobs, ro.prompt_logprob_ranks = so.prompt_logprobs, so.prompt_logprob_ranks
            if choice.finished:
                parent.unfinished -= 1
                if not parent.unfinished:
                    ro.finished = True
                    del self.parents[req.parent]
        return list(out.values())

    def _process_one(self, rid: str, req: _Request, so: StepOutput) -> CompletionOutput:
        tokens = list(so.new_token_ids)
        reason = so.finish_reason.value if so.finish_reason is not None else None
        stop_reason: str | int | None = None
        if so.finish_reason is FinishReason.STOP and tokens and tokens[-1] in req.params.stop_token_ids:
            stop_reason = tokens[-1]
        text = ""
        if req.detok is not None:
            # EOS / a stop token id ends the text before it (unless the stop string is to be kept)
            drop_last = so.finish_reason is FinishReason.STOP and not req.params.include_stop_str_in_output
            visible = tokens[:-1] if drop_last and tokens else tokens
            text, consumed = req.detok.add_tokens(visible)
            if req.detok.stopped is not None:
                tokens = tokens[:consumed]
                reason, stop_reason = FinishReason.STOP.value, req.detok.stopped
                if so.finish_reason is None:  # the scheduler still runs it: end it now, freeing its KV
                    self.finish(rid, FinishReason.STOP)
            if reason is not None:
                text += req.detok.finish()
        if reason is not None:
            del self.requests[rid]
        logprobs = so.logprobs[:len(tokens)] if so.logprobs is not None else None
        return CompletionOutput(req.index, text, tokens, reason, stop_reason, logprobs)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget an aborted request; its final output (each running choice's text so far, finish reason
        'abort'), None when it no longer runs."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        outs = []
        for rid in parent.children:
            req = self.requests.pop(rid, None)
            if req is not None:
                text = req.detok.finish() if req.detok is not None else ""
                outs.append(CompletionOutput(req.index, text, [], FinishReason.ABORT.value))
        return RequestOutput(request_id, parent.prompt, parent.prompt_token_ids, outs, True, parent.num_cached_tokens)


def merge_outputs(deltas: list[RequestOutput]) -> RequestOutput:
    """One request's streamed deltas as its final output: per choice, text and token ids concatenated."""
    last = deltas[-1]
    by_index: dict[int, list[CompletionOutput]] = {}
    for d in deltas:
        for c in d.outputs:
            by_index.setdefault(c.index, []).append(c)
    merged = []
    for index in sorted(by_index):
        done = by_index[index]
        logprobs = None if done[0].logprobs is None else [lp for c in done for lp in (c.logprobs or [])]
        merged.append(CompletionOutput(index, "".join(c.text for c in done), [t for c in done for t in c.token_ids],
                                       done[-1].finish_reason, done[-1].stop_reason, logprobs))
    first = next((d for d in deltas if d.prompt_logprobs is not None), None)
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, merged, last.finished,
                         last.num_cached_tokens, first.prompt_logprobs if first else None,
                         first.prompt_logprob_ranks if first else None)
