"""The engine's output processor: each step's new token ids -> text deltas, stop strings, final outputs.

Per request it keeps an ``IncrementalDetokenizer`` (models/text.py: whole UTF-8 characters only, stop strings
matched across token boundaries and held back while they may still complete). When a stop string matches, the
request is finished in the scheduler at once (finish reason ``stop``, its KV blocks freed) and the tokens after
the one that completed the match are dropped. A request the scheduler finished on EOS or a stop token id has
that last token left out of its text (it is in its token ids), as vLLM does.

The outputs have vLLM's shape: ``RequestOutput(request_id, prompt, prompt_token_ids, outputs=[CompletionOutput(
index, text, token_ids, finish_reason, stop_reason)], finished)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.text import IncrementalDetokenizer, Tokenizer
from scheduler.request import FinishReason, RequestError, SamplingParams
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
    finished: bool
    num_cached_tokens: int | None = None
    """Prompt tokens whose KV came from the prefix cache (vLLM's field); None until the request has started."""


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    num_cached_tokens: int | None = None


class OutputProcessor:
    """Turns the scheduler's per-step outputs into RequestOutputs; ``finish`` ends a request in the scheduler
    (``Scheduler.finish_request``)."""

    def __init__(self, tokenizer: Tokenizer | None, finish):
        self.tokenizer = tokenizer
        self.finish = finish
        self.requests: dict[str, _Request] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the model's tokenizer; this model (a preset) has none")
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                                           params.include_stop_str_in_output)
        self.requests[request_id] = _Request(prompt, list(prompt_token_ids), params, detok)

    def process(self, step_outputs: list[StepOutput]) -> list[RequestOutput]:
        """This step's deltas: new text and token ids per request, finish reasons on the last one."""
        out = []
        for so in step_outputs:
            req = self.requests.get(so.request_id)
            if req is None:
                continue
            out.append(self._process_one(so.request_id, req, so))
        return out

    def _process_one(self, rid: str, req: _Request, so: StepOutput) -> RequestOutput:
        if so.num_cached_tokens is not None:
            req.num_cached_tokens = so.num_cached_tokens
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
        return RequestOutput(rid, req.prompt, req.prompt_token_ids,
                             [CompletionOutput(0, text, tokens, reason, stop_reason, logprobs)], reason is not None,
                             req.num_cached_tokens)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget an aborted request; its final output (text so far, finish reason 'abort')."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        text = req.detok.finish() if req.detok is not None else ""
        return RequestOutput(request_id, req.prompt, req.prompt_token_ids,
                             [CompletionOutput(0, text, [], FinishReason.ABORT.value)], True, req.num_cached_tokens)


def merge_outputs(deltas: list[RequestOutput]) -> RequestOutput:
    """One request's streamed deltas as its final output (text and token ids concatenated)."""
    last = deltas[-1]
    done = [d.outputs[0] for d in deltas]
    logprobs = None if done[0].logprobs is None else [lp for c in done for lp in (c.logprobs or [])]
    merged = CompletionOutput(0, "".join(c.text for c in done), [t for c in done for t in c.token_ids],
                              last.outputs[0].finish_reason, last.outputs[0].stop_reason, logprobs)
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, [merged], last.finished,
                         last.num_cached_tokens)
