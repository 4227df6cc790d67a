"""``twogrid serve`` as a client written for vLLM drives it, through the official ``openai`` client: a real server
on the CPU (a tiny random Llama with a byte-level BPE and ChatML template, ``tiny_llama``: text in a second) where
each sampling parameter changes the output the way vLLM's does (a banned word never appears, min_tokens holds an
EOS made certain back, n = 3 gives three choices, the presence penalty ends repetition, logit_bias forces a token,
allowed_token_ids restricts the tokens), echo and prompt logprobs in vLLM's shape, OpenAI fields vLLM ignores,
X-Request-Id, and the small endpoints (/tokenize, /detokenize, /version, /ping). About 15 s."""

from __future__ import annotations

import asyncio

import pytest
from serverutil import Server, http_get, http_post

openai = pytest.importorskip("openai")
pytest.importorskip("torch")

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = Server(["--model", tiny_llama, "--served-model-name", MODEL, "--device", "cpu", "--max-model-len", "256",
                  "--max-num-seqs", "8", "--shutdown-timeout", "2"], str(tmp_path_factory.mktemp("e2e") / "server.log"))
    try:
        srv.wait_healthy(120)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from models.text import load_tokenizer

    return load_tokenizer(tiny_llama)


def ask(server, coro_fn):
    async def go():
        client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60)
        try:
            return await coro_fn(client)
        finally:
            await client.close()

    return asyncio.run(go())


def tokens_of(choice) -> list[str]:
    return choice.logprobs.tokens


def test_bad_words_never_appear(server, tok):
    """The output's most frequent one-token word, banned: neither of its tokens (with and without a leading space)
    appears."""
    from models.text import bad_words_token_ids

    args = dict(model=MODEL, prompt="The cat and the dog", max_tokens=40, logprobs=0)

    async def free_run(client):
        return tokens_of((await client.completions.create(**args, extra_body={"ignore_eos": True})).choices[0])

    def variants(word: str) -> set[str]:  # the one-token forms vLLM bans (a longer form bans its last token only)
        return {tok.decode(list(ids)) for ids in bad_words_token_ids(tok, [word]) if len(ids) == 1}

    free = ask(server, free_run)
    words = sorted({t.strip() for t in free if t.strip().isalpha()}, key=lambda w: -sum(t.strip() == w for t in free))
    word = next(w for w in words if variants(w) & set(free))
    banned_texts = variants(word)

    async def banned_run(client):
        out = await client.completions.create(**args, extra_body={"ignore_eos": True, "bad_words": [word]})
        return tokens_of(out.choices[0])

    banned = ask(server, banned_run)
    assert any(t in banned_texts for t in free)
    assert len(banned) == 40 and not any(t in banned_texts for t in banned)


def test_min_tokens_holds_a_certain_eos_back(server, tok):
    eos = tok.eos_token_id

    async def go(client):
        early = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=40, logit_bias={str(eos): 100})
        held = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=40, logit_bias={str(eos): 100},
                                               extra_body={"min_tokens": 20})
        return early, held

    early, held = ask(server, go)
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == 21 and held.choices[0].finish_reason == "stop"  # 20, then EOS


def test_n_gives_as_many_choices_and_counts_the_prompt_once(server, tok):
    async def go(client):
        c = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=3,
                                            temperature=1.0, seed=5)
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=4, n=2, temperature=0.8)
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=4, n=2, temperature=0.8, stream=True)
        finished = {}
        async for chunk in stream:
            for ch in chunk.choices:
                if ch.finish_reason:
                    finished[ch.index] = ch.finish_reason
        return c, chat, finished

    c, chat, finished = ask(server, go)
    assert [ch.index for ch in c.choices] == [0, 1, 2] and len({ch.text for ch in c.choices}) == 3
    assert c.usage.prompt_tokens == len(tok.encode("Once upon a time"))
    assert c.usage.completion_tokens == 18
    assert [ch.index for ch in chat.choices] == [0, 1] and set(finished) == {0, 1}


def test_presence_penalty_ends_repetition(server):
    async def go(client):
        args = dict(model=MODEL, prompt="a b a b a b", max_tokens=48, logprobs=0, extra_body={"ignore_eos": True})
        plain = await client.completions.create(**args)
        penalized = await client.completions.create(**args, presence_penalty=2.0)
        return tokens_of(plain.choices[0]), tokens_of(penalized.choices[0])

    plain, penalized = ask(server, go)
    assert len(set(plain)) < len(plain)  # greedy on random weights loops
    assert len(set(penalized)) > len(set(plain)) + 10


def test_logit_bias_forces_and_allowed_token_ids_restrict(server, tok):
    forced, allowed = tok.encode(" cat", False)[0], [tok.encode(w, False)[0] for w in (" a", " b", " c")]

    async def go(client):
        f = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, logprobs=0,
                                            logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
        a = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, logprobs=0, temperature=1.0,
                                            extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
        m = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=1.0, seed=2,
                                            extra_body={"ignore_eos": True, "min_p": 1.0, "repetition_penalty": 1.3})
        return f, a, m

    f, a, m = ask(server, go)
    assert tokens_of(f.choices[0]) == [tok.decode([forced])] * 10  # (logprobs name tokens by their text)
    assert set(tokens_of(a.choices[0])) <= {tok.decode([t]) for t in allowed}
    assert m.usage.completion_tokens == 30


def test_echo_prompt_logprobs_and_ignored_fields(server, tok):
    prompt = "The quick brown fox"

    async def go(client):
        echo = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1,
                                               user="u")
        alone = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, metadata={"team": "x"},
            store=False, service_tier="auto", user="u", extra_body={"prompt_logprobs": 2},
            extra_headers={"X-Request-Id": "trace-42"})
        return echo, alone, raw

    echo, alone, raw = ask(server, go)
    ids = tok.encode(prompt)
    ch = echo.choices[0]
    assert ch.text.startswith(prompt) and len(ch.logprobs.tokens) == len(ids) + 3
    assert ch.logprobs.token_logprobs[0] is None and all(v is not None for v in ch.logprobs.token_logprobs[1:])
    pl = ch.model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for p in range(1, len(ids)):
        entry = pl[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(ch.logprobs.token_logprobs[p]) and entry["rank"] >= 1
    assert alone.choices[0].text == prompt
    assert raw.headers["x-request-id"] == "trace-42"
    chat = raw.parse()
    assert chat.id == "chatcmpl-trace-42" and chat.model_extra["prompt_logprobs"][0] is None


def test_the_small_endpoints(server, tok):
    status, body = http_post(server.base + "/tokenize", b'{"prompt": "hello world", "return_token_strs": true}')
    assert status == 200 and body["tokens"] == tok.encode("hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256 and len(body["token_strs"]) == body["count"]
    status, body = http_post(server.base + "/tokenize", b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert status == 200 and body["tokens"] == tok.encode_chat([{"role": "user", "content": "hi"}])
    status, body = http_post(server.base + "/detokenize", ('{"tokens": %s}' % tok.encode("hello world")).encode())
    assert status == 200 and body == {"prompt": "hello world"}
    status, version = http_get(server.base + "/version")
    assert status == 200 and b'"version"' in version
    assert http_get(server.base + "/ping")[0] == 200
    status, body = http_post(server.base + "/v1/completions", b'{"prompt": "x", "max_tokens": 1, "best_of": 4}')
    assert status == 400 and body["error"]["code"] == 400 and body["error"]["param"] == "best_of"
    status, body = http_post(server.base + "/v1/chat/completions", b'{"messages": [{"role": "user"}]}')
    assert status == 400 and body["error"]["param"] == "messages[0].content"


def test_a_second_signal_exits_at_once(tmp_path):
    """The first SIGINT drains (here for up to 60 s, a long request in flight); a second one exits at once, code 1,
    the engine and worker gone and the ipc directory removed (vLLM's second Ctrl-C)."""
    import os
    import signal
    import threading
    import time

    from serverutil import process_state

    srv = Server(["--model", "tiny-dense", "--device", "cpu", "--max-model-len", "4096", "--max-num-seqs", "2",
                  "--shutdown-timeout", "60"], str(tmp_path / "server.log"))
    try:
        srv.wait_healthy(120)
        engine, worker, ipc = srv.engine_pid(), srv.worker_pid(), srv.ipc_dir()
        body = b'{"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": true}'
        def long_request():
            try:
                http_post(srv.base + "/v1/completions", body, None, 120)
            except OSError:  # (the server exits under it)
                pass

        threading.Thread(target=long_request, daemon=True).start()
        time.sleep(1.0)
        srv.signal(signal.SIGINT)
        time.sleep(1.0)
        assert srv.proc.poll() is None  # draining
        t0 = time.monotonic()
        srv.signal(signal.SIGINT)
        assert srv.wait(10) == 1 and time.monotonic() - t0 < 5
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(process_state(p) not in (None, "Z") for p in (engine, worker)):
            time.sleep(0.1)
        assert all(process_state(p) in (None, "Z") for p in (engine, worker))
        assert not os.path.exists(ipc)
        assert "second signal" in srv.log()
        # (the worker killed with its engine, not left to notice it gone a check later, as a busy one once took 12 s)
        assert "the engine process is gone" not in srv.log()
    finally:
        srv.stop()
