"""Tool calling: the model's tool-call format, parsed out of its text (whole, or as it streams), and the grammar
that forces a call when ``tool_choice`` asks for one.

A parser (``--tool-call-parser``, vLLM's names) knows one format:

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call, text before
  the first block being the message's content (Hermes 2 Pro, Qwen2.5, Qwen3).
- ``llama3_json``: the output is JSON objects ``{"name": ..., "parameters": {...}}`` (``"arguments"`` also read),
  separated by ``;``, after an optional ``<|python_tag|>`` (Llama 3.1 / 3.2 / 3.3); any other output is content.

``tool_choice: "auto"`` (with ``--enable-auto-tool-choice``) leaves the model free and parses what it wrote.
``"required"`` constrains the output with a structured-output grammar in the parser's format (an xgrammar
structural tag: a call's opening text, the function's parameters as a JSON schema, its closing text; one call or,
with ``parallel_tool_calls``, several): the same parser then reads the calls, so a forced call takes the path an
automatic one does, in the format the model's chat template taught it. A named function's call opens in the prompt
(``NamedCall``: the parser's opening text for it written after the generation prompt, as if the model had), so the
model writes its arguments alone, under the parameters' schema: vLLM's named choice generates the arguments alone
too, without the opening, while the model writing it token by token under a grammar took ~25 decode steps more on
the default model. Without ``--tool-call-parser`` forced calls use llama3_json's plain JSON format.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
"""``--tool-call-parser`` values."""
DEFAULT_FORCED_PARSER = "llama3_json"
"""The format of forced calls on a server without ``--tool-call-parser``."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""
    id: str = ""

    @staticmethod
    def of(name: str, arguments) -> "ToolCall":
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ToolCall(name, text, f"chatcmpl-tool-{uuid.uuid4().hex}")


class ToolParser(abc.ABC):
    """One tool-call format: its forced-call grammar, and its parsing of a whole output or a stream."""

    name: str
    separator: str
    """Between two forced calls."""

    @abc.abstractmethod
    def call_begin(self, name: str) -> str:
        """The text that opens a call of ``name`` (already escaped), up to its arguments."""

    call_end: str

    def structural_tag(self, tools: list[dict], parallel: bool) -> str:
        """The structural tag (JSON text) that forces a call of any of ``tools`` (once or, with ``parallel``,
        several times) in this format."""
        tags = [{"type": "tag", "begin": self.opening(t["function"]["name"]),
                 "content": {"type": "json_schema", "json_schema": parameters_schema(t)}, "end": self.call_end}
                for t in tools]
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": self.separator, "at_least_one": True,
               "stop_after_first": not parallel}
        return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)

    def opening(self, name: str) -> str:
        """The text that opens a call of ``name`` (the name escaped as a JSON string's content)."""
        return self.call_begin(json.dumps(name, ensure_ascii=False)[1:-1])

    def parse(self, text: str, cut_off: bool = False) -> tuple[str | None, list[ToolCall]]:
        """A whole output: (content or None, calls). Text that does not parse as calls is all content (vLLM's
        parsers do the same); ``cut_off``: the output ended at ``max_tokens`` (``ToolStream.finish``)."""
        stream = self.stream()
        content, calls = stream.feed(text)
        tail, more = stream.finish(cut_off)
        content, calls = content + tail, calls + more
        return (None if calls and not content.strip() else content), calls

    @abc.abstractmethod
    def stream(self) -> "ToolStream":
        """A parser of one output as it streams."""


def parameters_schema(tool: dict) -> dict:
    """A tool's arguments as a JSON schema (any object when it gives none)."""
    return tool["function"].get("parameters") or {"type": "object"}


class NamedCall:
    """A named ``tool_choice``: the output is the arguments of one call of ``name`` (the call's opening being in
    the prompt); a parser's ``parse`` and ``stream``. An output cut off (at ``max_tokens``) is still the call, its
    arguments as far as written, as OpenAI's API sends a call cut off (the finish reason says ``length``)."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, cut_off: bool = False) -> tuple[str | None, list[ToolCall]]:
        return None, [ToolCall.of(self.name, text.strip())]

    def stream(self) -> "ToolStream":
        return _NamedCallStream(self)


class ToolStream(abc.ABC):
    """A streamed output: ``feed(delta)`` and ``finish()`` return (content text that is final, calls completed).
    Content is held back while it may be the start of a call."""

    @abc.abstractmethod
    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """The content made final and the calls completed by ``delta``."""

    @abc.abstractmethod
    def finish(self, cut_off: bool = False) -> tuple[str, list[ToolCall]]:
        """The rest, once the output ended; ``cut_off``: at ``max_tokens``, so that a call it ended inside is the
        call so far (``_cut_off_call``), not content."""


def _call_from_json(text: str, arguments_keys=("arguments", "parameters")) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return _call_from_obj(obj, arguments_keys)


def _call_from_obj(obj, arguments_keys=("arguments", "parameters"), need_arguments: bool = False) -> ToolCall | None:
    """A call from a parsed object with a string ``name`` (and, with ``need_arguments``, one of the arguments keys:
    Llama 3's JSON calls are plain objects, and content such as ``{"name": "Alice"}`` is not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if need_arguments and not any(k in obj for k in arguments_keys):
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    return ToolCall.of(obj["name"], args)


_CUT_OFF_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(.*)',
                           re.DOTALL)


def _cut_off_call(text: str) -> ToolCall | None:
    """A call whose output ended at ``max_tokens`` inside it, once its name is whole: the call with its arguments as
    far as written, as OpenAI's API sends a call cut off; None before that (the text stays content)."""
    m = _CUT_OFF_CALL.match(text)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    return ToolCall.of(name, m.group(2).rstrip())


def _held_prefix(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that begin ``marker`` (they may complete it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class _NamedCallStream(ToolStream):
    """The call, whole, when the output ends (as the other parsers send each call)."""

    def __init__(self, named: NamedCall):
        self.named, self.text = named, []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.text.append(delta)
        return "", []

    def finish(self, cut_off: bool = False) -> tuple[str, list[ToolCall]]:
        return "", self.named.parse("".join(self.text))[1]


class HermesParser(ToolParser):
    name = "hermes"
    separator = "\n"
    call_end = "}\n</tool_call>"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def call_begin(self, name: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": '

    def stream(self) -> "ToolStream":
        return _HermesStream()


class _HermesStream(ToolStream):
    def __init__(self):
        self.buf = ""
        self.in_call = False
        self.seen_call = False
        self.num_calls = 0
        self.spaces = ""
        """Whitespace after a call, held until content follows it (dropped if a call or the end does)."""

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        content, calls = [], []
        while True:
            if self.in_call:
                end = self.buf.find(HermesParser.CLOSE)
                if end < 0:
                    break
                call = _call_from_json(self.buf[:end])
                if call is None:  # not a call after all: its text is content
                    content.append(HermesParser.OPEN + self.buf[:end + len(HermesParser.CLOSE)])
                else:
                    calls.append(call)
                    self.num_calls += 1
                self.buf, self.in_call = self.buf[end + len(HermesParser.CLOSE):], False
                continue
            start = self.buf.find(HermesParser.OPEN)
            if start < 0:
                keep = _held_prefix(self.buf, HermesParser.OPEN)
                text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                content.append(self._content(text))
                break
            content.append(self._content(self.buf[:start]))
            self.buf, self.in_call, self.seen_call = self.buf[start + len(HermesParser.OPEN):], True, True
            self.spaces = ""
        return "".join(content), calls

    def _content(self, text: str) -> str:
        """Text outside calls; after a call, whitespace between calls (or after the last) is not content, and
        whitespace before content is, however the text arrives in pieces."""
        if not self.seen_call:
            return text
        text, self.spaces = self.spaces + text, ""
        if text.strip():
            return text
        self.spaces = text
        return ""

    def finish(self, cut_off: bool = False) -> tuple[str, list[ToolCall]]:
        if self.in_call:  # an unclosed last call (the output ended, e.g. at max_tokens, or EOS before the tag)
            call = _call_from_json(self.buf) or (_cut_off_call(self.buf) if cut_off else None)
            if call is None and cut_off and self.num_calls:  # (a further call cut off before its name: not content)
                return "", []
            text = "" if call is not None else HermesParser.OPEN + self.buf
            return text, [call] if call is not None else []
        if cut_off and self.num_calls and self.buf.strip() and HermesParser.OPEN.startswith(self.buf.strip()):
            return "", []  # (a further call's opening tag cut off: markup, not content)
        return self._content(self.buf), []


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    separator = "; "
    call_end = "}"
    PYTHON_TAG = "<|python_tag|>"

    def call_begin(self, name: str) -> str:
        return f'{{"name": "{name}", "parameters": '

    def stream(self) -> "ToolStream":
        return _Llama3Stream()


class _Llama3Stream(ToolStream):
    """Calls when the output starts with ``{`` (or the python tag), else all content; objects are emitted as soon
    as each one parses."""

    def __init__(self):
        self.buf = ""
        self.mode: str | None = None
        """None until the first non-space character decides: "calls" or "content"."""
        self.decoder = json.JSONDecoder()
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        if self.mode is None:
            head = self.buf.lstrip()
            tag = Llama3JsonParser.PYTHON_TAG
            if not head or (tag.startswith(head) and len(head) < len(tag)):
                return "", []
            if head.startswith(tag):
                head = head[len(tag):].lstrip()
                if not head:
                    return "", []
            self.mode = "calls" if head.startswith("{") else "content"
            if self.mode == "calls":
                self.buf = head
        if self.mode == "content":
            text, self.buf = self.buf, ""
            return text, []
        calls = []
        while True:
            rest = self.buf.lstrip().lstrip(";").lstrip()
            if not rest:
                self.buf = ""
                break
            try:
                obj, end = self.decoder.raw_decode(rest)
            except ValueError:
                self.buf = rest
                break
            call = _call_from_obj(obj, need_arguments=True)
            if call is None:  # JSON, but not a call: everything from here on is content
                self.mode = "content"
                text, self.buf = rest, ""
                return text, calls
            calls.append(call)
            self.num_calls += 1
            self.buf = rest[end:]
        return "", calls

    def finish(self, cut_off: bool = False) -> tuple[str, list[ToolCall]]:
        text, self.buf = self.buf, ""
        if self.mode == "calls" and not text.strip():
            return "", []
        call = _cut_off_call(text) if self.mode == "calls" and cut_off else None
        if call is None and self.mode == "calls" and cut_off and self.num_calls:
            return "", []  # (a further call cut off before its name is whole: not content beside the calls)
        return ("", [call]) if call is not None else (text, [])


PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser())}
