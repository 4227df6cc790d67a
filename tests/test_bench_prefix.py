"""``twogrid bench``'s prefix-caching workloads against the fake server of test_bench: vLLM's prefix_repetition
dataset (shared prefixes, each with prompts of their own suffix) and multi-turn ShareGPT conversations (each turn
sent with the conversation so far, the model's answers in it); and the prefix cache's counters in a result."""

import json

from prometheus_client import CollectorRegistry, Counter, generate_latest

from test_bench import bench, saved, serve  # noqa: F401  (serve: the fixture)


def test_prefix_repetition_prompts_share_their_prefixes(serve, tmp_path):  # noqa: F811
    fake = serve()
    out_dir = tmp_path / "r"
    rc = bench("--base-url", fake.url, "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "8",
               "--prefix-repetition-suffix-len", "4", "--prefix-repetition-num-prefixes", "2",
               "--prefix-repetition-output-len", "3", "--num-prompts", "7", "--save-result", "--result-dir",
               str(out_dir))
    assert rc == 0
    prompts = [body["prompt"].split() for _, body, _ in fake.requests[1:]]
    assert len(prompts) == 6  # 7 // 2 prompts per prefix, as vLLM's dataset
    assert all(len(p) == 12 for p in prompts)
    assert all(body["max_tokens"] == 3 for _, body, _ in fake.requests[1:])
    prefixes = [tuple(p[:8]) for p in prompts]
    assert sorted(prefixes.count(x) for x in set(prefixes)) == [3, 3]
    assert len({tuple(p[8:]) for p in prompts}) == 6
    (result,) = saved(out_dir)
    assert result["dataset_name"] == "prefix_repetition" and result["output_len"] == 3 and result["completed"] == 6


def test_multi_turn_sends_each_turn_with_the_conversation_so_far(serve, tmp_path):  # noqa: F811
    fake = serve()
    data = tmp_path / "conv.json"
    turns = [{"from": "human", "value": "first question"}, {"from": "gpt", "value": "dataset answer"},
             {"from": "human", "value": "second question"}, {"from": "gpt", "value": "x"},
             {"from": "human", "value": "third question"}]
    data.write_text(json.dumps([{"id": "a", "conversations": turns},
                                {"id": "b", "conversations": [{"from": "human", "value": "only turn"}]}]))
    out_dir = tmp_path / "r"
    rc = bench("--base-url", fake.url, "--endpoint", "chat", "--dataset-path", str(data), "--multi-turn",
               "--max-turns", "4", "--num-prompts", "2", "--sharegpt-output-len", "3", "--max-concurrency", "2",
               "--save-result", "--result-dir", str(out_dir))
    assert rc == 0
    sent = [body["messages"] for _, body, _ in fake.requests[1:]]
    assert len(sent) == 3  # two user turns of "a" (--max-turns 4 counts the answers), one of "b"
    assert [{"role": "user", "content": "only turn"}] in sent
    assert [{"role": "user", "content": "first question"}] in sent
    assert [{"role": "user", "content": "first question"}, {"role": "assistant", "content": " w0 w1 w2"},
            {"role": "user", "content": "second question"}] in sent  # the model's answer, not the dataset's
    (result,) = saved(out_dir)
    assert result["multi_turn"] is True and result["completed"] == 3 and result["failed"] == 0
    first, second = result["median_ttft_ms_by_turn"]  # (conversation a's second turn alone in the second)
    assert first > 0 and second > 0 and len(result["mean_ttft_ms_by_turn"]) == 2
    assert len(result["prompt_tokens_by_turn"]) == 2 and all(n > 0 for n in result["prompt_tokens_by_turn"])


def test_ttft_by_turn_counts_each_turn_over_the_conversations_that_completed_it():
    from dispatcher.bench.client import RequestOutput
    from dispatcher.bench.results import summary_lines, ttft_by_turn

    def out(ttft_s, ok=True):
        return RequestOutput(success=ok, ttft=ttft_s)

    per_item = [[out(0.010), out(0.002), out(0.004)], [out(0.030), out(0.9, ok=False)], [out(0.020)]]
    got = ttft_by_turn(per_item)
    assert got == {"median_ttft_ms_by_turn": [20.0, 2.0, 4.0], "mean_ttft_ms_by_turn": [20.0, 2.0, 4.0]}
    assert ttft_by_turn([[out(0.01)], [out(0.02, ok=False)]])["median_ttft_ms_by_turn"] == [10.0]
    assert ttft_by_turn([[out(0.01), out(0.02, ok=False)]])["median_ttft_ms_by_turn"] == [10.0, None]
    base = {"completed": 1, "failed": 0, "duration": 1.0, "total_input_tokens": 1, "total_output_tokens": 1,
            "request_throughput": 1.0, "output_throughput": 1.0, "max_concurrent_requests": 1,
            "total_token_throughput": 1.0, "input_tokens_source": "usage", "output_tokens_source": "usage"}
    lines = summary_lines({**base, "median_ttft_ms_by_turn": [20.0, None]}, (), ())
    assert any("Median TTFT by turn (ms):" in line and "20.0 / -" in line for line in lines)


def test_cache_by_turn_gives_each_turns_prompt_tokens_and_the_share_the_server_found_cached():
    from dispatcher.bench.client import RequestOutput
    from dispatcher.bench.results import cache_by_turn, summary_lines

    def out(prompt_len, cached, ok=True):
        return RequestOutput(success=ok, prompt_len=prompt_len, cached_tokens=cached)

    per_item = [[out(100, 0), out(300, 240), out(500, 0)], [out(100, 0), out(200, 160, ok=False)],
                [out(50, None), out(250, None)]]
    got = cache_by_turn(per_item)
    # (turn 2: the failed request left out; the server that reported nothing counted in the tokens, not the rate)
    assert got == {"prompt_tokens_by_turn": [250, 550, 500], "prefix_cache_hit_rate_by_turn": [0.0, 0.8, 0.0]}
    assert cache_by_turn([[out(10, None)]])["prefix_cache_hit_rate_by_turn"] == [None]
    base = {"completed": 1, "failed": 0, "duration": 1.0, "total_input_tokens": 1, "total_output_tokens": 1,
            "request_throughput": 1.0, "output_throughput": 1.0, "max_concurrent_requests": 1,
            "total_token_throughput": 1.0, "input_tokens_source": "usage", "output_tokens_source": "usage"}
    lines = summary_lines({**base, **got}, (), ())
    assert any("Prefix cache hit rate by turn:" in line and "0% / 80% / 0%" in line for line in lines)
    assert not any("hit rate by turn" in line for line in summary_lines({**base, "prefix_cache_hit_rate_by_turn":
                                                                          [None]}, (), ()))


def test_multi_turn_on_a_file_of_single_turns_says_so(tmp_path, capsys):
    from dispatcher.bench.datasets import sharegpt_conversations

    data = tmp_path / "single.json"
    data.write_text(json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"},
                                                                 {"from": "gpt", "value": "a"}]} for i in range(3)]))
    convs = sharegpt_conversations(str(data), 3, 4, 0, None)
    assert all(len(c.turns) == 1 for c in convs)
    assert "none of the 3 conversations" in capsys.readouterr().err
    data.write_text(json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "q"},
                                                              {"from": "gpt", "value": "a"},
                                                              {"from": "human", "value": "q2"}]}]))
    sharegpt_conversations(str(data), 1, 4, 0, None)
    assert "none of the" not in capsys.readouterr().err


def test_multi_turn_needs_chat_and_sharegpt(tmp_path, capsys):
    assert bench("--base-url", "http://127.0.0.1:9", "--multi-turn") == 2
    assert "--multi-turn sends ShareGPT conversations as chat messages" in capsys.readouterr().err
    assert bench("--base-url", "http://127.0.0.1:9", "--max-turns", "2") == 2
    assert "--max-turns is for --multi-turn" in capsys.readouterr().err
    assert bench("--base-url", "http://127.0.0.1:9", "--dataset-name", "prefix_repetition", "--num-prompts", "3",
                 "--prefix-repetition-num-prefixes", "4") == 2
    assert "--prefix-repetition-num-prefixes must be in 1..--num-prompts (3), got 4" in capsys.readouterr().err


def test_prefix_cache_fields_from_the_counters():
    """The prefix cache's queries and hits over a run (tokens), and the hit rate; null without queries."""
    from dispatcher.bench.server_metrics import counter_deltas, parse_counters

    registry = CollectorRegistry()
    queries = Counter("twogrid:prefix_cache_queries", "x", ["model_name"], registry=registry).labels("m")
    hits = Counter("twogrid:prefix_cache_hits", "x", ["model_name"], registry=registry).labels("m")
    scrape = lambda: parse_counters(generate_latest(registry).decode())  # noqa: E731
    queries.inc(100)
    before = scrape()
    idle = counter_deltas(before, scrape())
    assert (idle["prefix_cache_queries"], idle["prefix_cache_hits"], idle["prefix_cache_hit_rate"]) == (0, 0, None)
    queries.inc(400)
    hits.inc(300)
    run = counter_deltas(before, scrape())
    assert (run["prefix_cache_queries"], run["prefix_cache_hits"], run["prefix_cache_hit_rate"]) == (400, 300, 0.75)
    # and the printed summary says them (the saved JSON only, before)
    from dispatcher.bench.results import summary_lines

    base = {"completed": 1, "failed": 0, "input_tokens_source": "usage", "output_tokens_source": "usage",
            "duration": 1.0, "total_input_tokens": 500, "total_output_tokens": 10, "request_throughput": 1.0,
            "output_throughput": 10.0, "max_concurrent_requests": 1, "total_token_throughput": 510.0}
    text = "\n".join(summary_lines({**base, **run}, [], []))
    assert "Prefix Cache" in text and "Hit tokens:                              300" in text
    assert "Hit rate (%):                            75.00" in text
    assert "Prefix Cache" not in "\n".join(summary_lines({**base, **idle}, [], []))
