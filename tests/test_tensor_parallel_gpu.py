"""Tensor parallelism on two GPUs (issue 34): ``twogrid serve --tensor-parallel-size 2`` (NCCL, the all-reduces
inside the captured FULL and PIECEWISE graphs) gives bench-dense's and bench-moe-large's greedy tokens at
``--tensor-parallel-size 1``, token for token, or where the all-reduce's order of summation parts the two runs,
TP = 2's token is within TP = 1's top 5 at the first divergence; and TP = 2 runs no step eagerly."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA devices")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: str, tp: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dispatcher", "serve", "--model", model, "--platform", "sm100",
                             "--port", str(port), "--max-num-seqs", "64", "--max-num-batched-tokens", "2048",
                             "--max-model-len", "512", "--gpu-memory-utilization", "0.5",
                             "--tensor-parallel-size", str(tp)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited: {proc.stdout.read()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            time.sleep(1)
    proc.kill()
    pytest.fail("the server did not start")


def _complete(base: str, model: str, prompts: list[list[int]]) -> list[dict]:
    """Every prompt at once (concurrent requests), greedy, 32 tokens, top-5 logprobs."""
    def one(prompt):
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 32, "ignore_eos": True,
                           "temperature": 0, "logprobs": 5}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["choices"][0]["logprobs"]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _eager_steps(base: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("twogrid:eager_steps_total"))


@pytest.mark.parametrize("model", ["bench-dense", "bench-moe-large"])
def test_two_gpus_give_one_gpus_greedy_tokens(model):
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 49000) for _ in range(rng.randint(5, 300))] for _ in range(16)]
    runs, eager = [], []
    for tp in (1, 2):
        proc, base = _serve(model, tp)
        try:
            runs.append(_complete(base, model, prompts))
            eager.append(_eager_steps(base))
        finally:
            proc.terminate()
            assert proc.wait(120) == 0
    same = 0
    for one, two in zip(*runs):
        if one["tokens"] == two["tokens"]:
            same += 1
            continue
        i = next(i for i, (x, y) in enumerate(zip(one["tokens"], two["tokens"])) if x != y)
        assert two["tokens"][i] in one["top_logprobs"][i], (model, i, one, two)
    assert same >= len(prompts) // 2, f"{model}: only {same} of {len(prompts)} outputs are identical"
    assert eager[1] == 0, f"{model}: TP = 2 ran {eager[1]} steps eagerly"
