"""Tokenizers, chat templates and incremental detokenization against transformers, on the 500 real ShareGPT
prompts (Korean, Chinese, emoji, code): a byte-level BPE tokenizer (tokenizer.json, and the same vocabulary as a
GGUF's metadata) and a SentencePiece-style one with byte fallback (a GGUF) encode and decode as transformers'
tokenizers do; streamed text never splits a character and concatenates to the full decode; stop strings are
matched across token boundaries; chat templates render as transformers renders them and fail in one clear
error when they raise or reach outside the sandbox."""

from __future__ import annotations

import json
import os

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from models.checkpoint import CheckpointError  # noqa: E402
from models.text import IncrementalDetokenizer, TemplateError, load_tokenizer, render_chat_template  # noqa: E402
from models.text import tokenizer_from_dir  # noqa: E402
from textdata import CHATML, SPECIALS  # noqa: E402

def write_tokenizer_gguf(path: str, metadata: dict) -> str:
    """A GGUF holding only tokenizer metadata and one tensor (transformers' tokenizer loader reads such files)."""
    import numpy as np

    from models.gguf_loader import add_metadata

    w = gguf.GGUFWriter(path, "llama")
    add_metadata(w, metadata)
    w.add_tensor("token_embd.weight", np.zeros((len(metadata["tokenizer.ggml.tokens"]), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def bpe_gguf_metadata(bpe: str, pre: str = "qwen2") -> dict:
    """The byte-level BPE vocabulary's GGUF metadata, the way llama.cpp's converter writes it."""
    spec = json.loads(open(os.path.join(bpe, "tokenizer.json"), encoding="utf-8").read())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens], "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"], "tokenizer.ggml.padding_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHATML}


@pytest.fixture(scope="session")
def bpe_gguf(bpe, tmp_path_factory):
    """The same vocabulary as a GGUF's metadata (pre-tokenizer 'qwen2')."""
    return write_tokenizer_gguf(str(tmp_path_factory.mktemp("bpe_gguf") / "tok.gguf"), bpe_gguf_metadata(bpe))


def test_a_gguf_naming_a_pre_tokenizer_not_known_here_is_refused_naming_the_field(bpe, tmp_path):
    """An unknown ``tokenizer.ggml.pre`` would split text unlike the model's training (wrong tokens, no error), so it
    is refused, as llama.cpp refuses it, with the way out: the model's Hugging Face tokenizer."""
    path = write_tokenizer_gguf(str(tmp_path / "tok.gguf"), bpe_gguf_metadata(bpe, pre="made-up-bpe"))
    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.pre 'made-up-bpe'.*qwen2.*--tokenizer DIR"):
        load_tokenizer(path)


@pytest.fixture(scope="session")
def spm_gguf(texts, tmp_path_factory):
    """A SentencePiece-style vocabulary (pieces with scores, 256 byte tokens for byte fallback, no merges: they
    are recovered from the scores) as a GGUF, like llama.cpp's converter writes Llama-2-style tokenizers."""
    from tokenizers.implementations import SentencePieceBPETokenizer

    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(texts[:300], vocab_size=900, limit_alphabet=200, show_progress=False)
    pieces = sorted(trained.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += [p for p, _ in pieces if p not in tokens]
    types += [1] * (len(tokens) - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    path = str(tmp_path_factory.mktemp("spm_gguf") / "spm.gguf")
    return write_tokenizer_gguf(path, {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0})


def hf_gguf_tokenizer(path: str):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.parametrize("source", ["gguf", "spm_gguf"])
def test_transformers_gguf_tokenizer_kept_in_the_cache_loads_back_as_converted(source, texts, bpe_gguf, spm_gguf,
                                                                                tmp_path, monkeypatch):
    """tests/hfgguf.py keeps transformers' tokenizer of a GGUF in the cache for the real-model tests: read back, it
    is the tokenizer transformers built (the same tokenizer.json, special tokens and chat template) and encodes and
    decodes the prompts as it does."""
    from hfgguf import hf_tokenizer_from_gguf

    monkeypatch.setenv("TWOGRID_CACHE", str(tmp_path / "cache"))
    path = {"gguf": bpe_gguf, "spm_gguf": spm_gguf}[source]
    converted = hf_tokenizer_from_gguf(path)
    (folder,) = (tmp_path / "cache" / "hf_from_gguf").iterdir()
    kept = hf_tokenizer_from_gguf(path)
    assert kept.name_or_path == str(folder) and type(kept) is type(converted)
    assert json.loads(kept.backend_tokenizer.to_str()) == json.loads(converted.backend_tokenizer.to_str())
    assert kept.special_tokens_map == converted.special_tokens_map and kept.chat_template == converted.chat_template
    for text in texts:
        ids = converted(text)["input_ids"]
        assert kept(text)["input_ids"] == ids and kept.encode(text) == converted.encode(text), text[:80]
        assert kept.decode(ids) == converted.decode(ids), text[:80]
    if converted.chat_template:
        conv = [{"role": "user", "content": texts[0]}]
        assert (kept.apply_chat_template(conv, add_generation_prompt=True, return_dict=False)
                == converted.apply_chat_template(conv, add_generation_prompt=True, return_dict=False))


@pytest.mark.parametrize("source", ["dir", "gguf", "spm_gguf"])
def test_encode_and_decode_match_transformers_on_sharegpt(source, texts, bpe, bpe_gguf, spm_gguf):
    path = {"dir": bpe, "gguf": bpe_gguf, "spm_gguf": spm_gguf}[source]
    ours = load_tokenizer(path)
    hf = transformers.AutoTokenizer.from_pretrained(path) if source == "dir" else hf_gguf_tokenizer(path)
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text[:80]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text[:80]
        if source != "spm_gguf":  # byte-level BPE is lossless (SentencePiece normalizes leading spaces)
            assert ours.decode(ids) == text
    if source == "spm_gguf":
        assert ours.encode("hi")[0] == 1  # add_bos_token defaults to true for SentencePiece files
    special = "<|im_start|>user\nhi<|im_end|>"
    if source != "spm_gguf":
        ids = ours.encode(special)
        assert ids == hf.encode(special) and ids[0] == ours.token_id("<|im_start|>")
        assert ours.decode(ids) == "user\nhi" and ours.decode(ids, skip_special_tokens=False) == special


def test_gguf_and_directory_forms_of_one_vocabulary_agree(texts, bpe, bpe_gguf):
    a, b = load_tokenizer(bpe), load_tokenizer(bpe_gguf)
    assert a.vocab_size == b.vocab_size and a.eos_token_id == b.eos_token_id
    for text in texts[:100]:
        assert a.encode(text) == b.encode(text)


def test_chat_templates_render_as_transformers_renders_them(bpe, texts):
    ours = tokenizer_from_dir(bpe)
    hf = transformers.AutoTokenizer.from_pretrained(bpe)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": texts[3]},
            {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": "한국어로 답해 주세요 🙂"}]
    for gen in (True, False):
        assert ours.apply_chat_template(conv, gen) == hf.apply_chat_template(conv, tokenize=False,
                                                                            add_generation_prompt=gen)
        assert ours.encode_chat(conv, gen) == hf.apply_chat_template(conv, add_generation_prompt=gen,
                                                                     return_dict=False)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert ours.apply_chat_template(parts).endswith("<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n")
    # Hugging Face templates' helpers: tojson without HTML escaping, the generation tag, loop controls
    tmpl = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{% generation %}"
            "{{ m | tojson }}{% endgeneration %}{% endfor %}")
    assert render_chat_template(tmpl, [{"role": "user", "content": "<b>é</b>"}, {}]) == \
        '{"role": "user", "content": "<b>é</b>"}'


def test_bad_templates_and_tokenizers_give_one_clear_error(bpe, tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateError, match="chat template raised: Only user and assistant roles are supported"):
        render_chat_template("{{ raise_exception('Only user and assistant roles are supported') }}", msgs)
    with pytest.raises(TemplateError, match=r"chat template does not parse: .* \(line 1\)"):
        render_chat_template("{% for m in messages %}{{ m }", msgs)
    with pytest.raises(TemplateError, match="chat template raised"):  # the sandbox: no Python internals
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", msgs)
    with pytest.raises(TemplateError, match="chat template raised"):
        render_chat_template("{% set ns = namespace() %}{% set ns._x = 1 %}", msgs)
    with pytest.raises(TemplateError, match="chat template failed: TypeError"):
        render_chat_template("{{ messages[0]['content'] + 1 }}", msgs)
    with pytest.raises(TemplateError, match=r"messages\[0\] must be a dict with a string 'role'"):
        tokenizer_from_dir(bpe).apply_chat_template([{"content": "no role"}])
    no_template = tokenizer_from_dir(bpe)
    no_template.chat_template = None
    with pytest.raises(TemplateError, match="the model has no chat template"):
        no_template.apply_chat_template(msgs)
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        tokenizer_from_dir(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable tokenizer"):
        tokenizer_from_dir(str(tmp_path))


def test_a_warmed_chat_template_is_compiled_before_the_first_request():
    """A front end warms its chat template at start-up (``warm_chat_template``): the first request's render finds it
    compiled (jinja2 imported and the template parsed then, not on the event loop under the first chat turns); a
    template that fails is left for the requests to report."""
    from models.text import _compile, warm_chat_template

    template = CHATML + "{# warmed #}"
    _compile.cache_clear()
    warm_chat_template(template)
    info = _compile.cache_info()
    assert info.currsize == 1 and info.misses == 1
    render_chat_template(template, [{"role": "user", "content": "a first request"}])
    assert _compile.cache_info().hits == info.hits + 1
    warm_chat_template("{% for m in messages %}{{ m }")  # (does not parse: no error here)
    warm_chat_template("{{ raise_exception('no') }}")


@pytest.mark.parametrize("edit, words", [
    ({"chat_template": 5}, "chat_template must be a string or a list of {name, template} objects, got '5'"),
    ({"chat_template": ["x", 3]}, "chat_template must be a string or a list"),  # (read as no template)
    ({"eos_token": "NOPE"}, "eos_token 'NOPE' is not in .*tokenizer.json's vocabulary"),  # (no EOS for chat)
    ({"bos_token": "<nope>", "add_bos_token": True}, "bos_token '<nope>' is not in"),  # (BOS silently not added)
])
def test_a_tokenizer_config_the_tokenizer_cannot_honour_is_refused(bpe, tmp_path, edit, words):
    import json
    import shutil

    shutil.copytree(bpe, tmp_path / "t")
    cfg_path = tmp_path / "t" / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **edit}))
    with pytest.raises(CheckpointError, match=f"tokenizer_config.json: {words}"):
        tokenizer_from_dir(str(tmp_path / "t"))
    (tmp_path / "t" / "chat_template.jinja").write_bytes(b"{{ \xff }}")
    cfg_path.write_text(json.dumps({}))
    with pytest.raises(CheckpointError, match=r"chat_template.jinja: not UTF-8 text \(byte 3"):
        tokenizer_from_dir(str(tmp_path / "t"))


@pytest.mark.parametrize("source", ["dir", "spm_gguf"])
def test_streamed_chunks_concatenate_to_the_full_text_and_never_split_a_character(source, texts, bpe, spm_gguf):
    tok = load_tokenizer(bpe if source == "dir" else spm_gguf)
    prompt = tok.encode("Answer:")
    split_somewhere = 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt)
        chunks = [detok.add(t) for t in ids] + [detok.finish()]
        full = "".join(chunks)
        assert full == detok.text
        want = tok.decode(prompt + ids)[len(tok.decode(prompt)):]
        assert full == want, text[:80]
        assert not any("\ufffd" in c for c in chunks) or "\ufffd" in want
        split_somewhere += chunks.count("") > 1  # some token ended inside a character and was held back
    assert split_somewhere > 10


def test_stop_strings_across_token_boundaries(bpe):
    tok = load_tokenizer(bpe)
    text = "The quick brown fox jumps over the lazy dog. END of story, and more text."
    ids = tok.encode(text)
    pieces = [tok.decode(ids[:i + 1]) for i in range(len(ids))]
    # a stop string that begins inside one token and ends inside the next
    k = next(i for i in range(1, len(ids)) if len(pieces[i]) - len(pieces[i - 1]) >= 3 and pieces[i - 1][-1] != " ")
    stop = pieces[k - 1][-2:] + pieces[k][len(pieces[k - 1]):][:2]
    cut = pieces[k].index(stop)
    for include in (False, True):
        detok = IncrementalDetokenizer(tok, [], stop=[stop, "zzz-never"], include_stop=include)
        out = [detok.add(t) for t in ids]
        assert detok.stopped == stop and detok.num_tokens == k + 1
        assert "".join(out) + detok.finish() == pieces[k][:cut + (len(stop) if include else 0)]
        # the first part of the stop string was held back, never streamed and then taken back
        assert "".join(out[:k]) == pieces[k - 1][:cut]
    # a prefix that never completes is released at the end
    detok = IncrementalDetokenizer(tok, [], stop=["dog. END!"])
    out = "".join(detok.add(t) for t in ids)
    assert detok.stopped is None and out + detok.finish() == text


@pytest.mark.parametrize("model", ["default", "gemma3"])
def test_token_bytes_rebuild_a_text_split_inside_its_characters(model):
    """Logprobs' ``bytes``: a character split over tokens (byte-level BPE's pieces of an emoji, Gemma's byte-fallback
    tokens) decodes to U+FFFD token by token, yet the tokens' bytes joined are the text's UTF-8, as a client that
    rebuilds text from OpenAI's ``bytes`` needs."""
    from models.default_model import default_model_path, gemma3_gguf_path

    tok = load_tokenizer(default_model_path() if model == "default" else gemma3_gguf_path())
    text = "🙂 ok ȸ é 漢字 \u0378x"
    ids = tok.encode(text, False)
    assert any("\ufffd" in tok.decode([i], skip_special_tokens=False) for i in ids)  # (the case it is for)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
