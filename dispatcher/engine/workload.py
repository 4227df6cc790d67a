"""Workloads for ``simulate`` and ``bench``: ShareGPT prompts, a seeded synthetic length distribution, or vLLM's
``prefix_repetition`` (a few shared prefixes, each followed by its own suffixes)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from dispatcher.plan.config import ConfigError, fill_mode_flags, load_json_file

CHARS_PER_TOKEN = 4
"""Prompt tokens are estimated as characters / 4 when no tokenizer is given (typical for BPE on English)."""


PREFIX_REPETITION_DEFAULTS = {"prefix_len": 256, "suffix_len": 256, "num_prefixes": 10, "output_len": 128}
"""vLLM's defaults for the prefix_repetition dataset (``--prefix-repetition-*``)."""


def fill_prefix_repetition_flags(args, error=ConfigError) -> None:
    """``args``' ``--prefix-repetition-*`` flags (None: left out) filled in with their defaults, or ``error`` naming
    one given beside another dataset (nothing would read it)."""
    fill_mode_flags(args, {f"prefix_repetition_{k}": v for k, v in PREFIX_REPETITION_DEFAULTS.items()},
                    args.dataset_name == "prefix_repetition",
                    "--dataset-name prefix_repetition" + (f", not {args.dataset_name}" if args.dataset_name else ""),
                    error)


@dataclass(frozen=True)
class PromptSpec:
    text: str | None
    num_tokens: int
    prefix: int = -1
    """The shared prefix the prompt starts with (an index; -1: none)."""
    prefix_len: int = 0
    """That prefix's tokens (the first of ``num_tokens``)."""


def approx_num_tokens(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


HUMAN_ROLES = ("human", "user")


def first_human_turn(entry) -> str | None:
    """The first human (or user) turn of a ShareGPT entry {id, conversations: [{from, value}, ...]}, else None."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for turn in turns:
        if isinstance(turn, dict) and turn.get("from") in HUMAN_ROLES:
            value = turn.get("value")
            return value if isinstance(value, str) and value.strip() else None
    return None


def load_sharegpt(path: str) -> list[str]:
    """First human turn of each conversation in a ShareGPT JSON file (a list of {"conversations": [...]})."""
    data = load_json_file(path, "--dataset")
    if not isinstance(data, list):
        raise ConfigError(f"--dataset: {path!r} must hold a JSON list of conversations")
    prompts = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ConfigError(f"--dataset: {path!r} item {i} must be an object with 'conversations', got "
                              f"{type(item).__name__}")
        turns = item.get("conversations")
        if not isinstance(turns, list):
            raise ConfigError(f"--dataset: {path!r} item {i}: 'conversations' must be a list of turns, got "
                              f"{type(turns).__name__}")
        text = first_human_turn(item)  # (the first human turn, not the first turn: that may be the assistant's)
        if text is not None:
            prompts.append(text)
    if not prompts:
        raise ConfigError(f"--dataset: {path!r} holds no conversation with a non-empty human turn ({{conversations: "
                          f"[{{from: human, value: text}}]}})")
    return prompts


def prefix_groups(num_prompts: int, num_prefixes: int, seed: int) -> list[int]:
    """vLLM's prefix_repetition layout: ``num_prompts // num_prefixes`` prompts per prefix (the remainder left
    out), in a seeded shuffle; the prefix index of each. ConfigError when a prefix would get no prompt."""
    if num_prefixes < 1 or num_prompts < num_prefixes:
        raise ConfigError(f"--prefix-repetition-num-prefixes must be in 1..--num-prompts ({num_prompts}), got "
                          f"{num_prefixes}")
    groups = [p for p in range(num_prefixes) for _ in range(num_prompts // num_prefixes)]
    random.Random(seed).shuffle(groups)
    return groups


def prefix_repetition_prompts(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                              seed: int) -> list[PromptSpec]:
    """``prefix_groups``' prompts: ``prefix_len`` tokens of their prefix, then ``suffix_len`` of their own."""
    for flag, value, low in (("prefix-len", prefix_len, 0), ("suffix-len", suffix_len, 1)):
        if value < low:
            raise ConfigError(f"--prefix-repetition-{flag} must be >= {low}, got {value}")
    return [PromptSpec(None, prefix_len + suffix_len, p, prefix_len)
            for p in prefix_groups(num_prompts, num_prefixes, seed)]


SYNTHETIC_MEAN_MAX = 1024
"""``--input-len`` at most: the lognormal lengths are clipped at 4,096 tokens, which at a mean of 1,024 cuts under 2%
of the prompts, and at larger means bends the mean itself (5,000 gave 3,100)."""


def make_prompts(num_prompts: int, seed: int, dataset: str | None = None, input_len_mean: int = 230,
                 input_len_max: int = 4096) -> list[PromptSpec]:
    """``num_prompts`` prompts: ShareGPT prompts in a seeded shuffle (cycled if too few), else lognormal lengths
    (sigma 0.8) with the given mean (1..SYNTHETIC_MEAN_MAX), clipped to 1..input_len_max tokens."""
    if not dataset and not 1 <= input_len_mean <= SYNTHETIC_MEAN_MAX:
        raise ConfigError(f"--input-len must be in 1..{SYNTHETIC_MEAN_MAX} (the synthetic prompts' mean length; "
                          f"they are drawn up to {input_len_max} tokens), got {input_len_mean}; longer prompts "
                          f"come from a --dataset")
    rng = random.Random(seed)
    if dataset:
        texts = load_sharegpt(dataset)
        rng.shuffle(texts)
        return [PromptSpec(t, min(approx_num_tokens(t), input_len_max))
                for t in (texts[i % len(texts)] for i in range(num_prompts))]
    sigma = 0.8
    mu = math.log(max(input_len_mean, 1)) - sigma * sigma / 2
    return [PromptSpec(None, int(min(max(1, round(rng.lognormvariate(mu, sigma))), input_len_max)))
            for _ in range(num_prompts)]
