"""``twogrid serve --tensor-parallel-size 2`` on the CPU (two gloo ranks): it streams the greedy tokens of one
worker, and a rank SIGKILLed under running streams takes the server to unhealthy within 2 s, fails every stream
with an error and leaves no process and no ipc directory behind; a size that cannot split the model is refused
before any process starts."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(__file__))
from serverutil import (REPO, Server, http_get, process_state, request_body, run_streams,  # noqa: E402
                        token_prompts)

MODEL = "tiny-dense"
ARGS = ["--model", MODEL, "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "8", "--num-kv-blocks",
        "96", "--tensor-parallel-size", "2"]
DETECT_LIMIT_S = 2.0


def _children(pid: int) -> list[int]:
    """``pid``'s worker processes (an engine with a tokenizer also has its grammar compilers' fork server)."""
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as fh:
        kids = [int(p) for p in fh.read().split()]
    return [k for k in kids if b"dispatcher.runtime.process" in open(f"/proc/{k}/cmdline", "rb").read()]


def test_two_ranks_serve_and_a_killed_rank_ends_the_server_cleanly(tmp_path):
    from dispatcher import LLM
    from scheduler.request import SamplingParams

    prompts = token_prompts(4, 512, 4, 16, seed=8)
    want = [o.outputs[0].token_ids for o in LLM(MODEL, device="cpu", max_model_len=256, num_kv_blocks=96).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]
    server = Server(ARGS, str(tmp_path / "server.log")).wait_healthy()
    try:
        streams, _ = run_streams(server.base, [dict(request_body(p, 8, seed=1), temperature=0.0) for p in prompts])
        assert [s.tokens for s in streams] == want
        engine = server.engine_pid()
        ranks = _children(engine)
        ipc = server.ipc_dir()
        assert len(ranks) == 2
        long = [request_body(p, 240, seed=9 + i) for i, p in enumerate(prompts)]
        import concurrent.futures

        pool = concurrent.futures.ThreadPoolExecutor(1)
        running = pool.submit(run_streams, server.base, long)
        deadline = time.monotonic() + 60
        while not any(float(line.split()[-1]) > 16 for line in http_get(server.base + "/metrics")[1].decode()
                      .splitlines() if line.startswith("twogrid:generation_tokens_total")):
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.05)
        killed_at = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        while http_get(server.base + "/health", timeout_s=2)[0] == 200:
            assert time.monotonic() - killed_at < 10, "the dead rank was not noticed"
            time.sleep(0.01)
        detect_s = time.monotonic() - killed_at
        streams, _ = running.result(timeout=30)
        told_s = max(s.ended_at for s in streams) - killed_at
        code = server.wait(30)
    finally:
        server.stop()
    assert detect_s <= DETECT_LIMIT_S and told_s <= DETECT_LIMIT_S, (detect_s, told_s)
    for s in streams:
        assert s.error is not None and "rank 1" in s.error and "SIGKILL" in s.error, s
    assert code == 1
    assert all(process_state(pid) is None for pid in ranks + [engine])
    assert not os.path.exists(ipc)


RANK0_FAILS_ONCE = """
import os
if os.environ.get("TWOGRID_TP_RANK") == "0":
    import dispatcher.runtime.worker as w
    real, calls = w.ModelWorker.submit, [0]
    def submit(self, step):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected: rank 0 only")
        return real(self, step)
    w.ModelWorker.submit = submit
"""


def test_a_step_that_fails_on_rank_0_alone_ends_the_group(tmp_path):
    """A step error on rank 0 only (an out-of-memory on GPU 0, say) leaves rank 1 waiting in that step's
    collectives: the next step would pair with it there and answer wrong tokens without an error. So the server
    stops with an error, as when a rank dies, and no later request gets tokens other than one worker's."""
    from dispatcher import LLM
    from scheduler.request import SamplingParams

    (tmp_path / "sitecustomize.py").write_text(RANK0_FAILS_ONCE)
    rounds = [token_prompts(1, 512, 16, 17, seed=s)[0] for s in (1, 2, 3)]
    want = [o.outputs[0].token_ids for o in LLM(MODEL, device="cpu", max_model_len=256, num_kv_blocks=96).generate(
        [{"prompt_token_ids": p} for p in rounds], SamplingParams(max_tokens=1, temperature=0.0))]
    server = Server(ARGS, str(tmp_path / "server.log"),
                    env={"PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}).wait_healthy()
    got = []
    try:
        for p in rounds:  # (one request at a time: each one 16-token prefill step)
            (s,), _ = run_streams(server.base, [dict(request_body(p, 1, seed=1), temperature=0.0)])
            got.append((s.tokens, s.error))
        code = server.wait(30)
    finally:
        server.stop()
    assert got[0][1] is not None and "rank 0 of the tensor-parallel group" in got[0][1], got[0]
    for (tokens, error), w in zip(got[1:], want[1:]):
        assert error is not None or tokens == w, (tokens, w)
    assert code == 1


def test_a_size_that_does_not_split_the_model_is_refused_before_serving():
    out = subprocess.run([sys.executable, "-m", "dispatcher", "serve", "--model", MODEL, "--device", "cpu",
                          "--tensor-parallel-size", "3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--tensor-parallel-size" in out.stderr and "num_attention_heads = 4" in out.stderr, out.stderr[-2000:]
