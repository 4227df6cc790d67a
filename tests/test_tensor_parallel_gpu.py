"""Tensor parallelism on two GPUs (issue 34): ``twogrid serve --tensor-parallel-size 2`` (NCCL, the all-reduces
inside the captured FULL and PIECEWISE graphs) gives bench-dense's and bench-moe-large's greedy tokens at
``--tensor-parallel-size 1``, token for token, or where the all-reduce's order of summation parts the two runs,
TP = 2's token is within TP = 1's top 5 at the first divergence; and TP = 2 runs no step eagerly."""

from __future__ import annotations

import os
import random
import subprocess
import urllib.request

import pytest
from serverutil import greedy_logprobs, start_gpu_server

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_skip_ok,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA devices")]


def _serve(model: str, tp: int) -> tuple[subprocess.Popen, str]:
    return start_gpu_server(["--model", model, "--platform", "sm100", "--max-num-seqs", "64",
                             "--max-num-batched-tokens", "2048", "--max-model-len", "512",
                             "--gpu-memory-utilization", "0.5", "--tensor-parallel-size", str(tp)], timeout_s=600,
                            env={**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")})


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
            runs.append(greedy_logprobs(base, model, prompts, 32))
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
