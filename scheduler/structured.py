"""Structured outputs as a request asks for them (vLLM's ``StructuredOutputsParams``), and the limits that keep a
hostile one from costing the server more than a bounded compile.

One constraint per request: a JSON schema (``json``), any JSON (``json_object``), a regular expression (``regex``),
one of a list of strings (``choice``), an EBNF grammar (``grammar``) or an xgrammar structural tag
(``structural_tag``, JSON text). The engine compiles it with xgrammar (``dispatcher.engine.structured``); here it
is only data, checked by ``validate`` against limits that need no compiler: the text's size, the schema's nesting
and its enumerated values, and every regular expression's repetition counts. What passes them may still fail to
compile (the engine refuses it, naming the field) or take too long (refused after
``dispatcher.engine.structured.COMPILE_TIMEOUT_S``).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

MAX_SPEC_CHARS = 131072
"""Characters of a schema, grammar, structural tag or all choices together (OpenAI's structured outputs allow
about 120,000 characters of names and values in one schema)."""
MAX_REGEX_CHARS = 4096
"""Characters of a regular expression (``regex``, or a schema's ``pattern``)."""
MAX_REGEX_REPEAT = 1000
"""The largest count a regular expression's ``{m,n}`` may name: xgrammar unrolls bounded repetitions, and
``[a-z]{1,100000}`` alone took 0.7 s to compile."""
MAX_GRAMMAR_RULES = 512
"""Rules of an EBNF grammar (``::=``): xgrammar's compiled grammar can grow with their count squared (a chain of
rules each naming the next twice: 400 rules 8.6 MB, 800 36 MB, 1,200 82 MB; 2,000, about 60 KB of text, ran out of
6 GB of address space)."""
MAX_SCHEMA_DEPTH = 64
"""Nesting of a JSON schema's objects and arrays (a schema of 30 nested objects is about 60 deep)."""
MAX_SCHEMA_VALUES = 4096
"""Enumerated values (``enum`` entries, ``const``s) in one schema, or ``choice`` strings: 20,000 enum values took
1.7 s to compile, 4096 about 0.3 s."""
MAX_SCHEMA_PROPERTIES = 256
"""Object properties in one schema, all objects together, counted where the document writes them (a ``$ref`` to a
definition counts the definition once, as xgrammar compiles it once). xgrammar's compiled grammar grows with their
count squared, whatever the shape (flat, nested, in ``anyOf`` branches or array items; ~600 bytes a pair on
SmolLM2's vocabulary): 256 gave 40-56 MB, 1,000 646 MB, 2,000 in ``anyOf`` branches ran this 24 GiB machine out of
memory, and 3,000 in one object got the engine killed at 18.5 GB, its compile (in a thread then) running on past the
compile timeout. A compile now runs in a process of its own under a memory limit, killed at the timeout
(``dispatcher.engine.grammar_process``); this limit keeps legitimate-looking schemas well inside it. OpenAI allows
5,000."""

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


class StructuredOutputError(ValueError):
    """A structured-output request refused before compiling: the message names the field and the limit."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's fields and names); schemas travel as JSON text, which is also their key in the
    engine's compiled-grammar cache."""

    json: str | None = None
    """A JSON schema, as JSON text."""
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    """EBNF (xgrammar's dialect: GBNF-like, ``root ::= ...``)."""
    json_object: bool | None = None
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    structural_tag: str | None = None
    """An xgrammar structural tag, as JSON text (``{"type": "structural_tag", "format": {...}}``)."""
    disable_any_whitespace: bool = False
    """JSON without whitespace between tokens (vLLM's option)."""
    disable_additional_properties: bool = False
    """Accepted for vLLM's clients: objects take only the properties their schema lists unless it says
    ``additionalProperties`` (xgrammar's strict mode, always on here)."""
    where: str = "structured_outputs"
    """The request field it came from (``response_format``, ``tool_choice``, ...): errors name it."""

    def __post_init__(self):
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """The one constraint set (``validate`` checks there is exactly one)."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (everything but ``where``)."""
        return (self.kind, getattr(self, self.kind), self.disable_any_whitespace)

    def validate(self) -> None:
        """StructuredOutputError naming the field when the request is malformed or over a limit."""
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError(
                f"{self.where}: exactly one of {', '.join(_CONSTRAINTS)} is needed, got "
                f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        field = f"{self.where}.{kind}" if self.where == "structured_outputs" else self.where
        value = getattr(self, kind)
        if kind == "json_object":
            return
        if kind == "choice":
            if not value or not all(isinstance(c, str) for c in value):
                raise StructuredOutputError(f"{field} must be a non-empty list of strings")
            if len(value) > MAX_SCHEMA_VALUES:
                raise StructuredOutputError(f"{field} has {len(value)} strings; at most {MAX_SCHEMA_VALUES} are "
                                            f"allowed")
            _check_size(field, sum(len(c) for c in value), MAX_SPEC_CHARS)
            return
        if not isinstance(value, str) or not value.strip():
            raise StructuredOutputError(f"{field} must be a non-empty string")
        _check_text(kind, field, value)


@functools.lru_cache(maxsize=256)
def _check_text(kind: str, field: str, value: str) -> None:
    """A regex, grammar, schema or structural tag within the limits (StructuredOutputError naming ``field``). Kept
    for the texts that passed: a request is validated by its front end and three times in the engine, and an
    application sends the same schema with every request (walking a schema cost ~70 us a request in the engine's
    loop, a burst of 256 arrivals ~17 ms); one that fails is not kept (errors are not cached)."""
    if kind == "regex":
        check_regex(field, value)
        return
    _check_size(field, len(value), MAX_SPEC_CHARS)
    rules = value.count("::=") if kind == "grammar" else 0
    if rules > MAX_GRAMMAR_RULES:
        raise StructuredOutputError(f"{field} has {rules} rules; at most {MAX_GRAMMAR_RULES} are allowed")
    if kind in ("json", "structural_tag"):
        try:
            doc = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise StructuredOutputError(f"{field} is not valid JSON: {exc}") from None
        if kind == "json" and not isinstance(doc, (dict, bool)):
            raise StructuredOutputError(f"{field} must be a JSON schema (an object), got {type(doc).__name__}")
        check_schema(field, doc)


def _check_size(field: str, size: int, limit: int) -> None:
    if size > limit:
        raise StructuredOutputError(f"{field} has {size} characters; at most {limit} are allowed")


def check_regex(field: str, pattern: str) -> None:
    """A regular expression's size and repetition counts within the limits."""
    _check_size(field, len(pattern), MAX_REGEX_CHARS)
    for m in _REPEAT.finditer(pattern):
        top = max(int(m.group(1)), int(m.group(2)) if m.group(2) else 0)
        if top > MAX_REGEX_REPEAT:
            raise StructuredOutputError(f"{field}: the repetition {m.group(0)!r} counts to {top}; at most "
                                        f"{MAX_REGEX_REPEAT} is allowed")


_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose value maps names to schemas (its keys are names, not keywords)."""
_DATA = frozenset({"enum", "const", "default", "examples"})
"""Keywords whose value is data, not a schema."""
SCHEMA, NAMES, DATA = range(3)


def check_schema(field: str, doc) -> None:
    """A JSON schema's (or structural tag's) nesting, enumerated values, properties and patterns within the
    limits, and no keyword that xgrammar would ignore; iterative, so that no nesting reaches Python's recursion
    limit."""
    values = properties = 0
    stack = [(doc, 1, SCHEMA)]
    while stack:
        node, depth, kind = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise StructuredOutputError(f"{field} nests JSON objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels "
                                        f"(a nested object schema takes two: its own and its 'properties'; about "
                                        f"{MAX_SCHEMA_DEPTH // 2} nested objects at most)")
        if isinstance(node, dict) and kind == SCHEMA:
            _check_keywords(field, node)
            enum = node.get("enum")
            values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
            props = node.get("properties")
            properties += len(props) if isinstance(props, dict) else 0
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                check_regex(f"{field} (a pattern)", pattern)
            stack.extend((v, depth + 1, DATA if k in _DATA else NAMES if k in _NAME_MAPS else SCHEMA)
                         for k, v in node.items() if isinstance(v, (dict, list)))
        elif isinstance(node, (dict, list)):
            inner = DATA if kind == DATA else SCHEMA
            stack.extend((v, depth + 1, inner) for v in (node.values() if isinstance(node, dict) else node)
                         if isinstance(v, (dict, list)))
        if values > MAX_SCHEMA_VALUES:
            raise StructuredOutputError(f"{field} enumerates more than {MAX_SCHEMA_VALUES} values (enum, const)")
        if properties > MAX_SCHEMA_PROPERTIES:
            raise StructuredOutputError(f"{field} has more than {MAX_SCHEMA_PROPERTIES} object properties (all its "
                                        f"objects together; the compiled grammar grows with their count squared)")


def _check_keywords(field: str, node: dict) -> None:
    """Keywords xgrammar compiles as if they were absent (allowing any value there): refused, not ignored."""
    if "not" in node:
        raise StructuredOutputError(f"{field}: 'not' is not supported (the grammar compiler would ignore it)")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise StructuredOutputError(f"{field}: 'allOf' of {len(all_of)} schemas is not supported, only of one (the "
                                    f"grammar compiler would ignore it); merge them into one schema")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        raise StructuredOutputError(f"{field}: '$ref' {ref[:80]!r} is not supported, only references within the "
                                    f"schema ('#/...'; the grammar compiler would ignore it)")
