"""Prefix caching through ``twogrid serve`` (a random preset on the CPU, about 15 s): a request that shares another's
prefix reports the tokens it found in the cache as OpenAI does (``usage.prompt_tokens_details.cached_tokens``, in
plain and streamed responses), ``/metrics`` counts the cache's queries and hits in tokens under vLLM's names, and
``--no-enable-prefix-caching`` reaches the engine. The offline API reports ``num_cached_tokens``."""

from __future__ import annotations

import argparse
import json
import urllib.request

import pytest
from serverutil import Server, http_post, metrics

pytest.importorskip("torch")


def stream_usage(base: str, body: dict) -> dict:
    """The usage of a streamed completion (its last chunk before [DONE])."""
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(
        {**body, "stream": True, "stream_options": {"include_usage": True}}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    usage = None
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


def test_cached_tokens_in_usage_and_the_metrics(tmp_path):
    srv = Server(["--model", "tiny-dense", "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "8",
                  "--max-num-batched-tokens", "128", "--num-kv-blocks", "128"], str(tmp_path / "server.log"))
    shared = [(31 * i) % 400 + 3 for i in range(40)]
    try:
        srv.wait_healthy()
        before = metrics(srv.base)
        first = {"prompt": shared + [5], "max_tokens": 4, "ignore_eos": True}
        status, body = http_post(srv.base + "/v1/completions", json.dumps(first).encode())
        assert status == 200, body
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        status, body = http_post(srv.base + "/v1/completions", json.dumps(
            {"prompt": shared + [6, 7], "max_tokens": 4, "ignore_eos": True}).encode())
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == 42
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}  # two full blocks of 16
        usage = stream_usage(srv.base, {"prompt": shared + [8], "max_tokens": 3, "ignore_eos": True})
        assert usage["completion_tokens"] == 3 and usage["prompt_tokens_details"] == {"cached_tokens": 32}
        after = metrics(srv.base)
    finally:
        srv.stop()
    assert after["twogrid:prefix_cache_queries_total"] - before["twogrid:prefix_cache_queries_total"] == 41 + 42 + 41
    assert after["twogrid:prefix_cache_hits_total"] - before["twogrid:prefix_cache_hits_total"] == 64


def test_no_enable_prefix_caching_reaches_the_engine():
    from dispatcher.cli import build_parser
    from dispatcher.serve.launch import _setup

    for flag, on in (([], True), (["--no-enable-prefix-caching"], False), (["--enable-prefix-caching"], True)):
        args = build_parser().parse_args(["serve", "--model", "tiny-dense", "--device", "cpu", *flag])
        _, engine_args, *_ = _setup(args)
        assert engine_args.enable_prefix_caching is on
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in help_text


def test_offline_outputs_count_cached_tokens():
    from dispatcher.llm import LLM
    from scheduler.request import SamplingParams

    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompt = [(13 * i) % 300 + 3 for i in range(40)]
    for caching, cached in ((True, 32), (False, 0)):
        llm = LLM("tiny-dense", device="cpu", max_model_len=128, num_kv_blocks=64, enforce_eager=True,
                  enable_prefix_caching=caching)
        llm.generate([prompt + [1]], params)
        (out,) = llm.generate([prompt + [2]], params)
        assert out.num_cached_tokens == cached
        assert llm.engine.scheduler.stats.prefix_cache_hits == cached


def test_flag_parses_as_vllms(capsys):
    from dispatcher.cli import add_prefix_caching_arg

    p = argparse.ArgumentParser()
    add_prefix_caching_arg(p)
    assert p.parse_args([]).enable_prefix_caching is True
    assert p.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
