"""The front end's prompt tokenization (dispatcher/serve/tokenizing.py): prompts that arrive in one turn of the
event loop are tokenized by one batch call off the loop, each gets exactly what the one-text call gives it, a prompt
the tokenizer refuses fails alone, and a request that went away takes nothing with it."""

import asyncio

import pytest

from dispatcher.serve.tokenizing import Tokenizing


def test_prompts_arriving_together_are_tokenized_in_one_batch_as_one_by_one(bpe, texts):
    from models.text import load_tokenizer

    tok = load_tokenizer(bpe)
    prompts = texts[:40] + texts[-2:]  # (four-byte characters too)

    async def go():
        tokenizing = Tokenizing(tok)
        got = await asyncio.gather(*(tokenizing.encode(p, i % 2 == 0) for i, p in enumerate(prompts)))
        return tokenizing.batches, got

    batches, got = asyncio.run(go())
    assert batches == 2  # (one a value of add_special_tokens)
    assert got == [tok.encode(p, i % 2 == 0) for i, p in enumerate(prompts)]


def test_a_prompt_alone_in_its_turn_is_tokenized_with_the_gil_released(bpe, texts):
    """A long prompt that arrives alone (a chat turn rendered in a thread) goes through the batch call too, which
    releases the GIL: the event loop keeps turning while it tokenizes (the one-text call held the GIL, and the loop
    ran at about half speed)."""
    from models.text import load_tokenizer

    tok = load_tokenizer(bpe)
    calls = []

    class Counting:
        def encode(self, text, add_special_tokens=True):
            calls.append("encode")
            return tok.encode(text, add_special_tokens)

        def encode_batch(self, texts, add_special_tokens=True):
            calls.append("encode_batch")
            return tok.encode_batch(texts, add_special_tokens)

    prompt = " ".join(texts) * 3

    async def go():
        tokenizing = Tokenizing(Counting())
        return await tokenizing.encode(prompt)

    assert asyncio.run(go()) == tok.encode(prompt)
    assert calls == ["encode_batch"]


class Picky:
    """encode refuses texts with 'x'; its batch call fails if any text does."""

    def encode(self, text, add_special_tokens=True):
        if "x" in text:
            raise ValueError(f"cannot tokenize {text!r}")
        return [len(text)]

    def encode_batch(self, texts, add_special_tokens=True):
        return [self.encode(t, add_special_tokens) for t in texts]


def test_a_prompt_the_tokenizer_refuses_fails_alone_and_a_request_gone_takes_nothing_with_it():
    async def go():
        tokenizing = Tokenizing(Picky())
        good = asyncio.ensure_future(tokenizing.encode("abc"))
        bad = asyncio.ensure_future(tokenizing.encode("xyz"))
        gone = asyncio.ensure_future(tokenizing.encode("abcdef"))
        await asyncio.sleep(0)  # (all three waiting for their batch)
        gone.cancel()
        other = await tokenizing.encode("ab")
        with pytest.raises(ValueError, match="cannot tokenize 'xyz'"):
            await bad
        with pytest.raises(asyncio.CancelledError):
            await gone
        return await good, other

    assert asyncio.run(go()) == ([3], [2])


def test_a_checkpoint_s_padding_or_truncation_setting_changes_no_prompt(bpe, tmp_path):
    """Some checkpoints' tokenizer.json carries padding (the batch call would pad each prompt to the batch's longest)
    or truncation (a long prompt cut silently): a served prompt gets the same ids batched or alone, and whole (found
    in review)."""
    import os
    import shutil

    from tokenizers import Tokenizer as Backend

    from models.text import load_tokenizer

    plain = load_tokenizer(bpe)
    d = tmp_path / "padded"
    shutil.copytree(bpe, d)
    backend = Backend.from_file(os.path.join(d, "tokenizer.json"))
    backend.enable_padding(pad_id=0, pad_token=backend.id_to_token(0))
    backend.enable_truncation(max_length=8)
    backend.save(os.path.join(d, "tokenizer.json"))
    tok = load_tokenizer(str(d))
    prompts = ["hi", "a much longer prompt than the first one, with many more tokens in it"]

    async def go():
        tokenizing = Tokenizing(tok)
        return await asyncio.gather(*(tokenizing.encode(p) for p in prompts))

    assert asyncio.run(go()) == [plain.encode(p) for p in prompts] == [tok.encode(p) for p in prompts]
    assert len(tok.encode(prompts[1])) > 8
