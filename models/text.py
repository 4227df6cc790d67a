"""Text: tokenizers and chat templates of a checkpoint, and incremental detokenization with stop strings.

- ``load_tokenizer(model)``: a Hugging Face directory's ``tokenizer.json`` (with ``tokenizer_config.json`` and
  ``chat_template.jinja``), or the tokenizer a GGUF file describes in its metadata, rebuilt with the
  ``tokenizers`` library: byte-level BPE (``tokenizer.ggml.model == "gpt2"``, with the pre-tokenizer split its
  ``tokenizer.ggml.pre`` names) or SentencePiece-style BPE with byte fallback (``"llama"``, merges recovered from
  the scores when the file has none). Presets have no tokenizer (None).
- Chat templates come from checkpoints, so they are untrusted code: they render in jinja2's
  ImmutableSandboxedEnvironment with the helpers Hugging Face templates use (``raise_exception``, ``tojson``
  without HTML escaping, ``strftime_now``, the ``{% generation %}`` tag). Any failure is one TemplateError.
- ``IncrementalDetokenizer``: a request's output text as tokens arrive, never splitting a UTF-8 character
  (``tokenizers``' DecodeStream holds a token back until its bytes complete a character), with stop strings
  matched across token boundaries and held back while the text could still be the start of one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property, lru_cache
from typing import Any, Sequence

from models.config import CheckpointError, model_kind, read_json

log = logging.getLogger("twogrid.text")


class TemplateError(ValueError):
    """A chat template that does not parse, or raised while rendering (the message says which and why)."""


# ---------------------------------------------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------------------------------------------


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass
class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the checkpoint's special tokens and chat template."""

    backend: Any
    """The ``tokenizers.Tokenizer``."""
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)
    """bos_token, eos_token, unk_token, pad_token as strings (what chat templates read)."""
    source: str = ""
    """Where it was loaded from (for errors)."""

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.special_tokens.get("eos_token"))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, also where it is part of a character (its text alone then decodes to
        U+FFFD): a byte-fallback token ``<0xNN>`` is that byte, a byte-level BPE token (GPT-2's alphabet) its
        characters' bytes; else its decoded text's UTF-8. Logprobs' ``bytes`` (OpenAI's: a client joins them to
        rebuild a character split over tokens; vLLM sends the replacement character's)."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.backend.id_to_token(token_id) or ""
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
        byte_of = _byte_of_character()
        if piece and all(ch in byte_of for ch in piece):
            return bytes(byte_of[ch] for ch in piece)
        return text.encode()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer's post-processor adds (BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text in one call of the tokenizers library (parallel over the cores, the GIL released
        while it runs), through its variant that leaves out the character offsets nothing here reads (the same ids;
        a third less time for 64 ShareGPT prompts on the CI machine)."""
        batch = getattr(self.backend, "encode_batch_fast", None) or self.backend.encode_batch
        return [e.ids for e in batch(texts, add_special_tokens=add_special_tokens)]

    @cached_property
    def added_token_split(self) -> "AddedTokenSplit | None":
        """How this tokenizer cuts a text at its added tokens, where the pieces' ids joined are provably the
        text's ids (``AddedTokenSplit``); None where that does not hold for it."""
        return added_token_split(self.backend)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """The conversation rendered as the prompt text (the template's BOS included, as it writes it); ``tools``
        and ``variables`` (a request's ``chat_template_kwargs``) are the template's too. With
        ``continue_final_message`` it ends with the last message's text, for the model to go on with it (what the
        template writes after it, an end of turn, is cut)."""
        template = chat_template or self.chat_template
        if template is None:
            raise TemplateError(f"{self.source}: the model has no chat template (tokenizer_config.json "
                                f"'chat_template', chat_template.jinja, or a GGUF's tokenizer.chat_template); pass "
                                f"chat_template= or use generate() with a plain prompt")
        if continue_final_message and add_generation_prompt:
            raise TemplateError("continue_final_message continues the last message: add_generation_prompt must be "
                                "false with it")
        plain = _plain_messages(messages)
        scope = {**self.special_tokens, **(variables or {}), **({"tools": tools} if tools else {})}
        if not continue_final_message:
            return render_chat_template(template, plain, add_generation_prompt, scope)
        return _continued(template, plain, scope)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of the rendered conversation (special tokens come from the template only, as in
        transformers' ``apply_chat_template(tokenize=True)``)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), False)


MAX_SPLIT_ADDED_TOKENS = 1024
"""A tokenizer with more added tokens than this is not cut here (one regular expression of them all would be slow to
scan; Gemma 3's has 6,414, most of them unused slots): its prompts are tokenized whole."""


@dataclass(frozen=True)
class AddedTokenSplit:
    """A text cut as the tokenizers library cuts it before its model runs: at the tokenizer's added tokens matched on
    the raw text (``normalized`` false: the leftmost match first, the longest of those starting there), then, in
    each piece left, at those matched on the normalized text (``normalized`` true; with no normalizer that text is
    the piece itself), each piece in between normalized, pre-tokenized and tokenized on its own, the
    post-processor's tokens (a BOS) around the whole. A text's ids are then its pieces' ids joined, so a piece
    tokenized before (a chat's earlier messages, a shared system prompt) needs no tokenizing again (the front end's
    ``Tokenizing`` keeps them). Built by ``added_token_split`` only for a tokenizer where that provably holds."""

    passes: tuple[re.Pattern, ...]
    """The added tokens matched on the raw text, then those matched on the normalized text, each longest first
    (a pass with no tokens left out)."""
    token_ids: dict[str, int]
    head: tuple[int, ...]
    """What ``add_special_tokens`` puts before a text's ids (BOS), and after them (``tail``)."""
    tail: tuple[int, ...]

    def pieces(self, text: str) -> list[str | int]:
        """``text`` as the pieces to tokenize (str, never empty) and the added tokens' ids between them (int)."""
        out: list[str | int] = [text] if text else []
        for pattern in self.passes:
            out = [part for piece in out
                   for part in ((piece,) if isinstance(piece, int) else self._cut(pattern, piece))]
        return out

    def _cut(self, pattern: re.Pattern, text: str) -> list[str | int]:
        out: list[str | int] = []
        at = 0
        for match in pattern.finditer(text):
            if match.start() > at:
                out.append(text[at:match.start()])
            out.append(self.token_ids[match.group()])
            at = match.end()
        if at < len(text):
            out.append(text[at:])
        return out

    def join(self, pieces: list[str | int], ids_of: dict, add_special_tokens: bool) -> list[int]:
        """The text's ids from its ``pieces`` and each text piece's ids in ``ids_of``."""
        ids = list(self.head) if add_special_tokens else []
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(ids_of[piece])
        if add_special_tokens:
            ids.extend(self.tail)
        return ids


def added_token_split(backend) -> AddedTokenSplit | None:
    """The split of ``backend`` (a ``tokenizers.Tokenizer``) at its added tokens, or None where joining the pieces'
    ids could differ from tokenizing the whole: an added token that strips the spaces beside it or must stand as a
    word, one matched after normalization (with a normalizer), more than MAX_SPLIT_ADDED_TOKENS of them, a
    post-processor that does more than put tokens around a text, or any probe text (each added token beside letters,
    spaces, newlines, accents, an emoji, itself, and another added token overlapping it) whose ids differ: a
    pre-tokenizer that treats a text's start apart (SentencePiece's prepend "first") fails there."""
    added = backend.get_added_tokens_decoder()
    if len(added) > MAX_SPLIT_ADDED_TOKENS:
        return None
    for token in added.values():
        if token.lstrip or token.rstrip or token.single_word or (token.normalized and backend.normalizer is not None):
            return None
    token_ids = {token.content: token_id for token_id, token in added.items() if token.content}
    passes = []
    for normalized in (False, True):  # (the library's two passes: raw-text matches, then normalized-text ones)
        contents = sorted((t.content for t in added.values() if t.content and t.normalized == normalized),
                          key=len, reverse=True)
        if contents:
            passes.append(re.compile("|".join(map(re.escape, contents))))
    bare, full = backend.encode("a", add_special_tokens=False).ids, backend.encode("a", add_special_tokens=True).ids
    starts = [i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare]
    if len(starts) != 1:
        return None
    split = AddedTokenSplit(tuple(passes), token_ids, tuple(full[:starts[0]]), tuple(full[starts[0] + len(bare):]))
    probes = ["a", " hello  world\n", "x\u00e9 \U0001F600\n\n  y"]
    contents = list(token_ids)
    for i, c in enumerate(contents):
        after = contents[(i + 1) % len(contents)]  # (each beside another too: where two tokens overlap)
        probes += [f"a{c}b", f" {c} ", f"{c}{c}", f"\n{c}\n hi", f"x {c}h\u00e9llo w\u00f6rld \U0001F600 {c}",
                   f"{c}  \n", f"{c}{after}", f"{after[:1]}{c}{after[1:]}", f"{c[:-1]}{after}"]
    pieces = [split.pieces(p) for p in probes]
    texts = list({piece for ps in pieces for piece in ps if isinstance(piece, str)})
    ids_of = dict(zip(texts, (e.ids for e in backend.encode_batch(texts, add_special_tokens=False))))
    for with_special in (False, True):
        whole = backend.encode_batch(probes, add_special_tokens=with_special)
        if any(split.join(ps, ids_of, with_special) != e.ids for ps, e in zip(pieces, whole)):
            return None
    return split


def _continued(template: str, messages: list[dict], scope: dict) -> str:
    """The conversation rendered to the end of its last message's text: rendered with a marker for that text, cut
    at the marker, the text put back (a short text found by transformers' rule, its last place in the render, can
    be a piece of the end-of-turn markup); a template that does not write the marker as it is (it transforms the
    text) falls back to that rule."""
    content = messages[-1].get("content")
    if not isinstance(content, str) or not content.strip():
        raise TemplateError("continue_final_message: the last message has no text to continue")
    marker = f"\x00continue-{uuid.uuid4().hex}\x00"
    marked = render_chat_template(template, [*messages[:-1], {**messages[-1], "content": marker}], False, scope)
    if marked.count(marker) == 1:
        return marked[:marked.index(marker)] + content
    text = render_chat_template(template, messages, False, scope)
    for piece in (content, content.strip()):
        at = text.rfind(piece)
        if at >= 0:
            return text[:at + len(piece)]
    raise TemplateError("continue_final_message: the chat template does not write the last message's text as it is, "
                        "so there is no place to continue it from")


def _plain_messages(messages: list[dict]) -> list[dict]:
    """Check the messages' shape; OpenAI-style content parts of type text become one string."""
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TemplateError(f"messages[{i}] must be a dict with a string 'role', got {m!r}")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise TemplateError(f"messages[{i}].content: only text parts are supported, got {part!r}")
                texts.append(part["text"])
            m = {**m, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise TemplateError(f"messages[{i}].content must be a string or a list of text parts, got {content!r}")
        out.append(m)
    return out


# ---------------------------------------------------------------------------------------------------------------
# chat templates
# ---------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text with it): renders its
        body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class SafeNamespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore-prefixed attributes."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=SafeNamespace)
    return env.from_string(template)


def warm_chat_template(template: str) -> None:
    """Compile ``template`` (importing jinja2) and render it once, so that a serving process's first chat request
    does not: a front end's first chat turns held its event loop 100-140 ms for it on the H100's host (its
    ``LoopWatch``). A template that fails is left for the requests (``twogrid serve`` checked it at start-up)."""
    try:
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    except TemplateError:
        pass


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         variables: dict | None = None) -> str:
    """Render an (untrusted) chat template in the sandbox, ``variables`` beside the messages (which, with
    ``add_generation_prompt``, they cannot replace); every failure is a TemplateError."""
    import jinja2

    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template does not parse: {exc.message} (line {exc.lineno})") from None
    try:
        return compiled.render({**(variables or {}), "messages": messages,
                                "add_generation_prompt": add_generation_prompt})
    except jinja2.TemplateError as exc:  # raise_exception(), undefined names, sandbox violations
        raise TemplateError(f"chat template raised: {exc.message or type(exc).__name__}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
        raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None


# ---------------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------------


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """``bad_words`` as token sequences, as vLLM tokenizes them: each word (its leading spaces stripped) on its own,
    and with one leading space where that makes a different first token of the same length (the word in the middle
    of a text). ValueError for a word that tokenizes to nothing."""
    out: list[tuple[int, ...]] = []
    for word in dict.fromkeys(words):
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words: {word!r} tokenizes to no token")
        out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def check_draft_tokenizer(target: Tokenizer | None, draft_model: str) -> None:
    """A draft model (speculative method draft_model) proposes token ids the target reads: both must have the same
    vocabulary. ValueError saying so when they do not, or when only one of them has a tokenizer."""
    draft = load_tokenizer(draft_model)
    if target is None and draft is None:
        return  # presets: random weights of one shape, token ids only
    if target is None or draft is None:
        which = "the draft model" if draft is None else "the target"
        raise ValueError(f"speculative model {draft_model!r}: {which} has no tokenizer, so the two vocabularies cannot "
                         f"be checked; a draft model must share the target's tokenizer")
    if target.backend.get_vocab(with_added_tokens=True) != draft.backend.get_vocab(with_added_tokens=True):
        raise ValueError(f"speculative model {draft_model!r}: its tokenizer ({draft.vocab_size} tokens) differs from "
                         f"the target's ({target.vocab_size} tokens); a draft model must share the target's tokenizer")


def load_tokenizer(model: str) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory or GGUF file; None for a preset (random weights, token ids only)."""
    kind = model_kind(model)
    if kind == "hf":
        return tokenizer_from_dir(model)
    if kind == "gguf":
        from models.gguf_file import open_gguf

        return tokenizer_from_gguf_metadata(open_gguf(model).metadata, model)
    return None


def load_tokenizer_override(path, arg: str) -> Tokenizer:
    """The tokenizer a user gave apart from the model (``arg``: ``--tokenizer``, ``tokenizer``): a checkpoint
    directory or a .gguf file; CheckpointError naming ``arg`` for anything else (a missing path, a preset, a
    non-string) or for a checkpoint whose tokenizer is unreadable."""
    what = f"{arg} must be a Hugging Face checkpoint directory or a .gguf file"
    if not isinstance(path, str) or not path:
        raise CheckpointError(f"{what}, got {path!r}")
    try:
        kind = model_kind(path)
    except CheckpointError:
        raise CheckpointError(f"{what}: {path!r} is no such directory or file") from None
    if kind == "preset":
        raise CheckpointError(f"{what}: {path!r} is a preset (random weights, no tokenizer)")
    try:
        return load_tokenizer(path)
    except ValueError as exc:
        raise CheckpointError(f"{arg}: {exc}") from None


def _token_text(value) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_from_dir(path: str) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise CheckpointError(f"{path}: no tokenizer.json (a sentencepiece tokenizer.model alone is not supported; "
                              f"save the tokenizer with transformers to get tokenizer.json)")
    try:
        backend = Backend.from_file(tok_path)
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise CheckpointError(f"{tok_path}: unreadable tokenizer ({exc})") from None
    backend.no_padding()  # (a prompt is never padded nor cut: a batch call would pad each to the batch's longest,
    backend.no_truncation()  # and a truncation setting would cut long prompts silently, where the engine says why)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = read_json(cfg_path, "the tokenizer config") if os.path.isfile(cfg_path) else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if not named or len(named) != len(template):
            raise CheckpointError(f"{cfg_path}: chat_template must be a string or a list of {{name, template}} "
                                  f"objects, got {str(template)[:80]!r}")
        template = named.get("default") or next(iter(named.values()), None)
    file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(file):
        try:
            with open(file, encoding="utf-8") as fh:
                template = fh.read()
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{file}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    json_template = os.path.join(path, "chat_template.json")
    if template is None and os.path.isfile(json_template):
        template = read_json(json_template, "the chat template").get("chat_template")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{cfg_path}: chat_template must be a string or a list of {{name, template}} objects, "
                              f"got {str(template)[:80]!r}")
    special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    for key, text in special.items():
        if text is not None and key in ("bos_token", "eos_token") and backend.token_to_id(text) is None:
            raise CheckpointError(f"{cfg_path}: {key} {text!r} is not in {tok_path}'s vocabulary")
    bos = special["bos_token"]
    bos_id = backend.token_to_id(bos) if bos else None
    if cfg.get("add_bos_token") is True and bos_id is not None and backend.encode("a").ids[:1] != [bos_id]:
        # tokenizer_config.json asks for BOS but tokenizer.json's post-processor does not add it (transformers'
        # Llama-style tokenizers rebuild their post-processor from the flag)
        from tokenizers import processors

        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                               special_tokens=[(bos, bos_id)])
    return Tokenizer(backend, template if isinstance(template, str) else None,
                     {k: v for k, v in special.items() if v is not None}, path)


# GGUF byte-level pre-tokenizers, by tokenizer.ggml.pre (llama.cpp's names): the split each vocabulary's merges
# were learned with. Other names are refused (as llama.cpp refuses them).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                   "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
                   "deepseek-r1-qwen": _QWEN2_SPLIT}
GGUF_GPT2_PRE = ("default", "gpt2", "gpt-2", "starcoder", "refact", "smollm")
"""Pre-tokenizer names that split as GPT-2 does (smollm also splits every digit)."""
CONTROL, USER_DEFINED = 3, 4
"""tokenizer.ggml.token_type values: control tokens are special; user-defined ones are matched whole."""


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map, in which byte-level vocabularies are spelled: printable bytes stand for
    themselves, the others for characters from U+0100 on, in byte order."""
    out = {b: chr(b) for b in [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]}
    rest = [b for b in range(256) if b not in out]
    out.update({b: chr(256 + n) for n, b in enumerate(rest)})
    return out


@lru_cache(maxsize=1)
def _byte_of_character() -> dict[str, int]:
    """``_byte_alphabet`` inverted: the byte each character of a byte-level vocabulary spells."""
    return {ch: b for b, ch in _byte_alphabet().items()}


def tokenizer_from_gguf_metadata(md: dict, path: str) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes, built with ``tokenizers``."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors

    kind = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{path}: metadata tokenizer.ggml.tokens is missing")
    _check_gguf_tokens(md, tokens, path)
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        alphabet = _byte_alphabet()
        chars = set(alphabet.values())
        # a token spelled outside the byte alphabet (rare; a converter's plain-text special token) is respelled
        spelled = [t if set(t) <= chars else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        shadowed = next((i for i, t in enumerate(spelled) if vocab[t] != i), None)
        if shadowed is not None:
            raise CheckpointError(f"{path}: tokenizer.ggml.tokens[{shadowed}] {tokens[shadowed]!r}, respelled in the "
                                  f"byte alphabet, is token {vocab[spelled[shadowed]]} "
                                  f"{tokens[vocab[spelled[shadowed]]]!r}; each token must appear once")
        merges = md.get("tokenizer.ggml.merges")
        if not isinstance(merges, list):
            raise CheckpointError(f"{path}: metadata tokenizer.ggml.merges is missing (needed for a gpt2 tokenizer)")
        backend = _gguf_bpe(vocab, _gguf_merges(merges, vocab, path), path, fuse_unk=False)
        pre = md.get("tokenizer.ggml.pre", "default")
        if pre in GGUF_PRE_SPLITS:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(GGUF_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            if pre not in GGUF_GPT2_PRE:
                known = ", ".join(sorted({*GGUF_PRE_SPLITS, *GGUF_GPT2_PRE}))
                raise CheckpointError(
                    f"{path}: metadata tokenizer.ggml.pre {pre!r} names a pre-tokenizer twogrid does not know "
                    f"(known: {known}): its text would be split unlike the model's training; give the model's "
                    f"Hugging Face tokenizer instead (--tokenizer DIR, or LLM(tokenizer=DIR))")
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            backend.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                              byte_level]) if pre == "smollm" else byte_level)
        backend.decoder = decoders.ByteLevel()
        add_bos_default = False
    elif kind == "llama":
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = md.get("tokenizer.ggml.merges")
        merges = (_gguf_merges(merges, vocab, path) if isinstance(merges, list) else
                  merges_from_scores(tokens, md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)))
        unk_id = md.get("tokenizer.ggml.unknown_token_id", 0)
        backend = _gguf_bpe(vocab, merges, path, unk_token=tokens[unk_id], fuse_unk=True,
                            byte_fallback=True)
        prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                         prepend_scheme="first" if prefix else "never")
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        add_bos_default = True
    else:
        raise CheckpointError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (gpt2 or llama)")
    inverse = {i: t for t, i in vocab.items()}
    added = [AddedToken(inverse[i], special=t == CONTROL, normalized=False)
             for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED) and i in inverse]
    backend.add_special_tokens([a for a in added if a.special])
    backend.add_tokens([a for a in added if not a.special])

    def named(key):
        i = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None else None  # (in range: _check_gguf_tokens)

    special = {"bos_token": named("bos"), "eos_token": named("eos"), "unk_token": named("unknown"),
               "pad_token": named("padding")}
    bos = special["bos_token"]
    if md.get("tokenizer.ggml.add_bos_token", add_bos_default) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                               special_tokens=[(bos, vocab[bos])])
    elif kind == "gpt2":
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return Tokenizer(backend, md.get("tokenizer.chat_template"), {k: v for k, v in special.items() if v}, path)


GGUF_SPECIAL_IDS = ("bos", "eos", "unknown", "padding", "eot", "eom")
"""The tokenizer.ggml.<name>_token_id keys checked against the vocabulary."""


def _check_gguf_tokens(md: dict, tokens: list, path: str) -> None:
    """Refuse a GGUF vocabulary the tokenizer would build wrong: a token that is not a string or appears twice
    (the later id would shadow the earlier), per-token arrays of another length than the tokens, a special token
    id outside the vocabulary (the BOS was silently not added, an unknown id raised IndexError)."""
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not isinstance(token, str):
            raise CheckpointError(f"{path}: tokenizer.ggml.tokens[{i}] is {token!r}, expected a string")
        if token in seen:
            raise CheckpointError(f"{path}: tokenizer.ggml.tokens has {token!r} twice (ids {seen[token]} and {i}); "
                                  f"each token must appear once")
        seen[token] = i
    for key in ("scores", "token_type"):
        values = md.get(f"tokenizer.ggml.{key}")
        if values is not None and (not isinstance(values, list) or len(values) != len(tokens)):
            count = f"{len(values)} entries" if isinstance(values, list) else repr(values)
            raise CheckpointError(f"{path}: tokenizer.ggml.{key} has {count} for {len(tokens)} tokens "
                                  f"(tokenizer.ggml.tokens); expected one per token")
    for name in GGUF_SPECIAL_IDS:
        i = md.get(f"tokenizer.ggml.{name}_token_id")
        if i is not None and (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tokens)):
            raise CheckpointError(f"{path}: tokenizer.ggml.{name}_token_id is {i!r}, outside the vocabulary of "
                                  f"{len(tokens)} tokens (0..{len(tokens) - 1})")


def _gguf_merges(merges: list, vocab: dict, path: str) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges' entries "left right" as pairs (split at the first space after the first character, as
    llama.cpp's llama-vocab.cpp does), each of two tokens of the vocabulary whose concatenation is one too (what
    ``tokenizers`` requires: a merged token outside the vocabulary made it panic); anything else is refused, naming
    the entry."""
    out = []
    for i, m in enumerate(merges):
        cut = m.find(" ", 1) if isinstance(m, str) else -1
        if cut < 0 or cut == len(m) - 1:
            raise CheckpointError(f"{path}: tokenizer.ggml.merges[{i}] is {m!r}, expected two tokens separated by a "
                                  f"space")
        left, right = m[:cut], m[cut + 1:]
        absent = next((t for t in (left, right, left + right) if t not in vocab), None)
        if absent is not None:
            raise CheckpointError(f"{path}: tokenizer.ggml.merges[{i}] {m!r}: {absent!r} is not in the vocabulary "
                                  f"(tokenizer.ggml.tokens)")
        out.append((left, right))
    return out


def _gguf_bpe(vocab: dict, merges: list, path: str, **kw):
    """The ``tokenizers`` BPE model of a GGUF vocabulary, in a ``tokenizers`` Tokenizer; its complaints as one
    CheckpointError."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    try:
        return Backend(BPE(vocab, merges, **kw))
    except Exception as exc:  # tokenizers raises plain Exception subclasses from Rust
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens / merges: the tokenizers library refused the "
                              f"vocabulary ({exc})") from None


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a token into two vocabulary pieces, the
    token's score its priority (higher merges first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


# ---------------------------------------------------------------------------------------------------------------
# incremental detokenization and stop strings
# ---------------------------------------------------------------------------------------------------------------

PROMPT_CONTEXT_TOKENS = 6
"""Prompt tokens the decoder is seeded with, so that the first output token decodes as it does after them (a
leading space, a character whose bytes began in the prompt)."""


class IncrementalDetokenizer:
    """One request's output text, token by token.

    ``add(token_id)`` returns the text that became final: complete UTF-8 characters only, and nothing that could
    still be the start of a stop string. When a stop string appears, ``stopped`` is set, the text is cut before
    it (or after it, with ``include_stop``) and later tokens are ignored; ``finish()`` releases the held-back
    rest once the request ends otherwise. The concatenation of everything returned is ``text``."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop: bool = False, min_tokens: int = 0):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._ids = context
        """The last tokens: the prompt's, then those added (trimmed to PROMPT_CONTEXT_TOKENS now and then)."""
        self._num_pending = 0
        """The last tokens of ``_ids`` that the stream holds (an incomplete character)."""
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""
        """Everything decoded so far (up to the cut, once stopped)."""
        self.emitted = 0
        """Characters of ``text`` already returned."""
        self.stopped: str | None = None
        """The stop string that ended the text."""
        self.num_tokens = 0
        """Tokens consumed (the rest, after a stop, are not part of the output)."""
        self.min_tokens = min_tokens
        self._min_offset: int | None = 0 if min_tokens == 0 else None
        """Where the text stood after ``min_tokens`` tokens: a stop string must end past it (vLLM's rule); None
        before then."""

    def add(self, token_id: int) -> str:
        if self.stopped is not None:
            return ""
        chunk = self._step(token_id)
        return self._append(chunk) if chunk is not None else ""

    def add_tokens(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """``add`` for each of ``token_ids``: the text that became final, and how many of the tokens were consumed
        (all, unless a stop string completed at one: up to and including it)."""
        if self.stop:  # a stop string can complete at any token: one at a time
            parts = []
            for i, t in enumerate(token_ids):
                parts.append(self.add(t))
                if self.stopped is not None:
                    return "".join(parts), i + 1
            return "".join(parts), len(token_ids)
        chunks = [c for c in map(self._step, token_ids) if c is not None]
        return (self._append("".join(chunks)) if chunks else ""), len(token_ids)

    def _step(self, token_id: int) -> str | None:
        """The stream's text for one more token (None while a character is incomplete)."""
        self.num_tokens += 1
        self._ids.append(token_id)
        chunk = self._stream.step(self.tokenizer.backend, token_id)
        self._num_pending = self._num_pending + 1 if chunk is None else 0
        if chunk is not None and len(self._ids) > 2 * PROMPT_CONTEXT_TOKENS:  # (``finish`` needs the last few)
            del self._ids[:-PROMPT_CONTEXT_TOKENS]
        return chunk

    def _append(self, chunk: str) -> str:
        start = max(0, len(self.text) - self._longest_stop + 1)
        before = len(self.text)
        self.text += chunk
        if self._min_offset is None and self.num_tokens >= self.min_tokens:
            self._min_offset = before if self.num_tokens > self.min_tokens else len(self.text)
        if self.stop and self._min_offset is not None:
            hit = min(((i, s) for s in self.stop if (i := self._find(s, start)) >= 0), default=None)
            if hit is not None:
                i, s = hit
                self.text = self.text[:i + len(s) if self.include_stop else i]
                self.stopped = s
                return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def _find(self, stop: str, start: int) -> int:
        """Where ``stop`` first occurs from ``start`` on, ending past the ``min_tokens`` offset (-1: nowhere)."""
        return self.text.find(stop, max(start, self._min_offset - len(stop) + 1))

    def _held_back(self) -> int:
        """Characters at the end of the text that begin some stop string (they may complete it)."""
        for k in range(min(len(self.text) - self.emitted, self._longest_stop - 1), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _release(self, upto: int) -> str:
        out = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return out

    def finish(self) -> str:
        """The request ended (EOS, length, abort): the held-back text, and an incomplete character's bytes as
        the decoder renders them (U+FFFD), as a full decode of the output would."""
        out = ""
        if self.stopped is None and self._num_pending:
            held = self._ids[-self._num_pending:]
            context = self._ids[:-self._num_pending][-PROMPT_CONTEXT_TOKENS:]
            self._num_pending = 0
            ctx = self.tokenizer.decode(context, self.skip_special_tokens)
            full = self.tokenizer.decode(context + held, self.skip_special_tokens)
            tail = full[len(ctx):] if full.startswith(ctx) else full
            out = self._append(tail) if tail else ""
        return out + self._release(len(self.text))
