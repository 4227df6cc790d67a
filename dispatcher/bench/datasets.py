"""The requests a bench run sends: ShareGPT prompts, seeded synthetic ones, vLLM's ``prefix_repetition`` (shared
prefixes, each followed by prompts' own suffixes), each with a fixed output length; or ShareGPT conversations
(``--multi-turn``), whose user turns go in order, each with the conversation so far (the model's own answers in it).

No tokenizer is at hand (the server's is not reachable over the OpenAI API), so prompt lengths here are estimates:
characters / 4 for ShareGPT text, one token per word for synthetic prompts. The result counts input tokens from
the server's ``usage`` when it reports it and says which count it used (``input_tokens_source``).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass

from dispatcher.bench import BenchError
from dispatcher.engine.workload import HUMAN_ROLES, approx_num_tokens, first_human_turn, prefix_groups
from dispatcher.plan.config import load_json_file

# Common English words that are one token each (with their leading space) in GPT-2, Llama and Qwen BPE
# vocabularies, so that a prompt of n words is about n tokens.
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there one all we their been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any like now my over such "
    "our man me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work long "
    "get here between both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three"
).split()

@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    """Estimated prompt tokens (the server's ``usage.prompt_tokens`` replaces it when reported)."""
    output_len: int
    """``max_tokens`` sent with the request."""
    history: tuple[dict[str, str], ...] = ()
    """Chat messages before the prompt (a later turn of a conversation: earlier user turns and the answers)."""


@dataclass(frozen=True)
class Conversation:
    """A ShareGPT conversation's user turns, sent in order (``--multi-turn``): each turn's request holds every
    earlier turn and the model's answer to it, so a server with a prefix cache finds the conversation so far."""

    turns: tuple[str, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        """The first turn's estimated tokens (warm-ups take this shape)."""
        return approx_num_tokens(self.turns[0])


def sharegpt_requests(path: str, num_prompts: int, output_len: int, seed: int) -> list[SampleRequest]:
    """``num_prompts`` first human turns of a ShareGPT JSON file in a seeded shuffle (cycled when the file holds
    fewer), each asking for ``output_len`` tokens. Entries without a human turn are skipped, with a note."""
    data = load_json_file(path, "--dataset-path")
    if not isinstance(data, list):
        raise BenchError(f"--dataset-path: {path!r} holds a JSON {type(data).__name__}, not a list of ShareGPT "
                         f"entries {{id, conversations: [{{from, value}}, ...]}}")
    prompts = [p for p in map(first_human_turn, data) if p is not None]
    if not prompts:
        raise BenchError(f"--dataset-path: {path!r}: none of its {len(data)} entries has a conversation with a "
                         f"non-empty human turn ({{conversations: [{{from: human, value: text}}]}})")
    if len(prompts) < len(data):
        print(f"note: {len(data) - len(prompts)} of {len(data)} entries in {path} have no human turn and were "
              f"skipped", file=sys.stderr)
    random.Random(seed).shuffle(prompts)
    if len(prompts) < num_prompts:
        print(f"note: {path} has {len(prompts)} prompts; --num-prompts {num_prompts} repeats them", file=sys.stderr)
    picked = (prompts[i % len(prompts)] for i in range(num_prompts))
    return [SampleRequest(p, approx_num_tokens(p), output_len) for p in picked]


def sharegpt_conversations(path: str, num_conversations: int, output_len: int, seed: int,
                            max_turns: int | None) -> list[Conversation]:
    """``num_conversations`` ShareGPT conversations in a seeded shuffle (cycled when the file holds fewer): their
    human turns, at most ``max_turns`` messages counting the answers (vLLM's multi-turn ``--max-turns``: user
    turns = ceil(max_turns / 2)); each turn asks for ``output_len`` tokens."""
    data = load_json_file(path, "--dataset-path")
    if not isinstance(data, list):
        raise BenchError(f"--dataset-path: {path!r} holds a JSON {type(data).__name__}, not a list of ShareGPT "
                         f"entries {{id, conversations: [{{from, value}}, ...]}}")
    user_turns = None if max_turns is None else -(-max_turns // 2)
    convs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        texts = [t["value"] for t in turns or () if isinstance(t, dict) and t.get("from") in HUMAN_ROLES
                 and isinstance(t.get("value"), str) and t["value"].strip()] if isinstance(turns, list) else []
        if texts:
            convs.append(tuple(texts[:user_turns]))
    if not convs:
        raise BenchError(f"--dataset-path: {path!r}: none of its {len(data)} entries has a conversation with a "
                         f"non-empty human turn")
    if all(len(c) == 1 for c in convs) and user_turns != 1:
        print(f"note: none of the {len(convs)} conversations in {path} has more than one human turn: --multi-turn "
              f"sends each as a single turn (no conversation history to reuse)", file=sys.stderr)
    random.Random(seed).shuffle(convs)
    return [Conversation(convs[i % len(convs)], output_len) for i in range(num_conversations)]


def prefix_repetition_requests(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, seed: int) -> list[SampleRequest]:
    """vLLM's ``prefix_repetition`` dataset: ``num_prefixes`` random prefixes of ``prefix_len`` words (about a token
    each), ``num_prompts // num_prefixes`` prompts each, every one the prefix and ``suffix_len`` words of its own,
    in a seeded shuffle."""
    for flag, value, low in (("prefix-len", prefix_len, 1), ("suffix-len", suffix_len, 1),
                             ("output-len", output_len, 1)):
        if value < low:
            raise BenchError(f"--prefix-repetition-{flag} must be >= {low}, got {value}")
    groups = prefix_groups(num_prompts, num_prefixes, seed)
    rng = random.Random(seed + 1)
    prefixes = [" ".join(rng.choices(WORDS, k=prefix_len)) for _ in range(num_prefixes)]
    return [SampleRequest(f"{prefixes[g]} {' '.join(rng.choices(WORDS, k=suffix_len))}", prefix_len + suffix_len,
                          output_len) for g in groups]


def random_requests(num_prompts: int, input_len: int, output_len: int, seed: int) -> list[SampleRequest]:
    """``num_prompts`` prompts of ``input_len`` words (about one token each), every word drawn on its own from a
    seeded generator so that prompts share only chance prefixes, each asking for ``output_len`` tokens."""
    rng = random.Random(seed)
    return [SampleRequest(" ".join(rng.choices(WORDS, k=input_len)), input_len, output_len)
            for _ in range(num_prompts)]
